"""The native backend: one sequence (a ``KVCache``) over a shared ``NativeModel``.

The model (``native_model.py``) holds the weights and everything chosen for them; a backend holds
its sequence's cache and runs passes on it, so ``fork`` is a second backend over the same model.
A pass goes through one of three runners of one signature, all computing every row as a one-token
step would (``runners.py``): the float rows, the integer rows, or fixed-shape chunks
(``fixed_rows.py``, GPUs and half precision); ``NativeModel.run_rows`` picks it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forerun.backends.base import ArgmaxOutput, BackendBase, Capabilities, ForwardOutput, check_forward
from forerun.backends.fixed_rows import fixed_chunks, fixed_takes
from forerun.backends.gguf_weights import attach_integer, integer_sub_head, joined_head, requantize_4bit
from forerun.backends.kv_cache import KVCache
from forerun.backends.linear import PackedLinear
from forerun.backends.native_model import NativeModel
from forerun.backends.runners import check_trees
from forerun.timing import median_s


class NativeBackend(BackendBase):
    """One sequence over a ``NativeModel``: ``NativeBackend(hf_model, **options)`` builds the model
    (options: ``NativeModel``'s), ``NativeBackend(model)`` puts a new sequence over a built one."""

    def __init__(self, model, **options):
        self.model = model if isinstance(model, NativeModel) else NativeModel(model, **options)
        if options and model is self.model:
            raise TypeError("options are the model's: they go with a transformers model, not a built NativeModel")
        self.cache = KVCache(self.model)

    # -- what the engine reads ----------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """Exact argmax passes (chains, trees, with layer outputs), token trees, batched passes,
        layer skipping; greedy trees run the LM head lazily on the CPU only (``lazy_tree_head``).
        ``kv_any_pass`` on the integer path, batch-invariant: its products are row by row and its
        attention reads each row's keys as a one-token step does, in passes of every size, so a
        prompt chunk's keys and values are those steps and verify passes left."""
        m = self.model
        return Capabilities(exact_argmax=True, argmax_features=True, argmax_tree=True,
                            lazy_tree_head=m.greedy.lazy_tree_head, token_trees=True, batched=True,
                            layer_skip=True, kv_segments=True, hidden_states=True, draft_batch=m.fixed is None,
                            kv_any_pass=m.quant is not None and m.batch_invariant)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_context(self) -> int:
        return self.model.max_context

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def embed(self) -> torch.Tensor:
        return self.model.embed

    @property
    def config(self):
        """The transformers config the model was built from."""
        return self.model.config

    @property
    def length(self) -> int:
        return self.cache.length

    def fork(self) -> NativeBackend:
        self.model.greedy.exact_head()  # decided once, so that every sequence takes greedy tokens the same way
        return NativeBackend(self.model)

    def report(self) -> dict:
        return self.model.report()

    # -- the cache ------------------------------------------------------------------------------
    def reserve(self, n: int) -> None:
        self.cache.reserve(n)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def reset(self) -> None:
        self.cache.truncate(0)

    def keep_rows(self, pos: int, rows: Sequence[int]) -> None:
        self.cache.keep_rows(pos, rows)

    def kv_segment(self, start: int, end: int):
        return self.cache.segment(start, end)

    def load_kv_segment(self, pos: int, segment) -> None:
        self.cache.load_segment(pos, segment)

    # -- a draft model's heads ----------------------------------------------------------------
    def sub_head(self, rows: torch.Tensor) -> PackedLinear:
        """An LM head over the vocabulary rows ``rows`` only (logits come back in that order)."""
        return self.model.sub_head(rows)

    def integer_sub_head(self, rows: torch.Tensor):
        """``sub_head`` on the integer kernels from the GGUF file's own blocks (None off that path)."""
        return integer_sub_head(self.model, rows)

    def joined_head(self, first, rows: torch.Tensor):
        """``first`` (an ``integer_sub_head``) and the rows ``rows`` after it in one integer head
        (``gguf_weights.joined_head``; None off that path)."""
        return joined_head(self.model, first, rows)

    def requantize_4bit(self) -> bool:
        """The model's layer weights re-coded to Q4_0 (``gguf_weights.requantize_4bit``): a draft's."""
        return requantize_4bit(self.model)

    def attach_integer(self, codes_of) -> bool:
        """The model onto the integer kernels with these blocks (``gguf_weights.attach_integer``);
        this sequence's cache starts anew (float16 from then on)."""
        done = attach_integer(self.model, codes_of)
        if done:
            self.cache = KVCache(self.model)
        return done

    # -- passes -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        pos: int,
        *,
        skip_layers: Sequence[int] = (),
        return_hidden: bool = False,
        last_only: bool = False,
        head: PackedLinear | None = None,
        layers: Sequence[int] = (),
        logits: bool = True,
        tree: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """``head`` replaces the LM head (e.g. a drafter's reduced vocabulary, see ``sub_head``).
        ``layers``: return these layers' outputs (residual stream) at every position;
        ``logits=False`` skips the LM head (feature extraction). ``tree``: parents [T - 1] of rows
        1.. (see ``forerun.tree``): rows sit at pos + depth and see only their ancestors."""
        check_forward(self, tokens, pos)
        finish = "logits" if logits else "hidden" if return_hidden else "none"
        out = self.model.run_rows([self.cache], [tokens], [pos], () if tree is None else (tree,), skip_layers, layers,
                                  finish, last_only, head)
        return ForwardOutput(logits=out.logits, hidden=out.hidden if return_hidden else None, layers=out.layers)

    @torch.inference_mode()
    def forward_batch(self, seqs: Sequence[NativeBackend], feeds: Sequence[torch.Tensor],
                      positions: Sequence[int], layers: Sequence[int] = (),
                      greedy: Sequence[bool] = (), trees: Sequence[torch.Tensor | None] = (),
                      head: PackedLinear | None = None, last_only: bool = False) -> list:
        """One pass over several sequences: ``feeds[i]`` runs at ``positions[i]`` on ``seqs[i]``'s
        cache (backends over this model); where ``trees[i]`` is given, its rows 1.. are a token tree
        with those parents (as ``forward(tree=)``). Returns each sequence's logits [T_i, vocab]
        (float32) and, with ``layers``, those layers' outputs; a sequence marked in ``greedy`` gets
        the exact argmax of every row instead of logits (``ArgmaxOutput``), where it is found without
        logits (the integer path or the screened exact head). ``head`` replaces the LM head and
        ``last_only`` keeps each sequence's last row only (a draft model's step; not on fixed-shape
        passes)."""
        m = self.model
        if any(s.model is not m for s in seqs):
            raise ValueError("a batched pass over sequences of different models")
        for seq, feed, pos in zip(seqs, feeds, positions):
            check_forward(seq, feed, pos)
        if m.fixed is not None:
            if head is not None or last_only:
                raise ValueError("fixed-shape passes run the whole LM head on every row")
            return self._fixed_batch(seqs, feeds, positions, layers, trees)
        sizes = [f.numel() for f in feeds]
        out = m.run_rows([s.cache for s in seqs], feeds, positions, trees, (), layers, "hidden", last_only)
        hn = out.hidden.split([1] * len(sizes) if last_only else sizes)
        per_seq = out.layers.split(sizes) if out.layers is not None else [None] * len(sizes)
        argmax = m.greedy.without_logits() if any(greedy) else None
        flags = [argmax is not None and i < len(greedy) and bool(greedy[i]) for i in range(len(sizes))]

        def run(fn, chosen):  # one pass of fn over the chosen sequences' rows, split back per sequence
            rows = [x for x, f in zip(hn, flags) if f == chosen]
            return iter(fn(torch.cat(rows)).split([len(x) for x in rows]) if rows else [])

        lg, am = run(lambda x: m.lm_logits(x, head, batched=len(sizes) > 1), False), run(argmax, True)
        return [ArgmaxOutput(next(am), f) if g else ForwardOutput(logits=next(lg), layers=f)
                for g, f in zip(flags, per_seq)]

    def _fixed_batch(self, seqs, feeds, positions, layers, trees) -> list:
        """``forward_batch`` on fixed-shape passes: every verify pass (a chain, a token tree of any
        size) in shared fixed-shape chunks, so a row's result cannot depend on the batch; a feed
        as long as a prompt runs on its own sequence alone, as ``forward`` runs it alone."""
        m = self.model
        trees = [trees[i] if i < len(trees) else None for i in range(len(feeds))]
        check_trees(feeds, trees)  # before the chunked sequences run
        chunked = [i for i, (f, t) in enumerate(zip(feeds, trees)) if fixed_takes(f.numel(), t)]
        outs: list = [None] * len(feeds)
        if chunked:
            got = fixed_chunks(m, [seqs[i].cache for i in chunked], [feeds[i] for i in chunked],
                               [positions[i] for i in chunked], [trees[i] for i in chunked], (), layers, "logits")
            sizes = [feeds[i].numel() for i in chunked]
            feats = got.layers.split(sizes) if got.layers is not None else [None] * len(sizes)
            for i, lg, ft in zip(chunked, got.logits.split(sizes), feats):
                outs[i] = ForwardOutput(logits=lg, layers=ft)
        for i in range(len(feeds)):
            if outs[i] is None:
                passed = seqs[i].forward(feeds[i], positions[i], layers=layers)
                outs[i] = ForwardOutput(logits=passed.logits, layers=passed.layers)
        return outs

    # -- greedy targets -----------------------------------------------------------------------
    @torch.inference_mode()
    def argmax_forward(self, tokens: torch.Tensor, pos: int, layers: Sequence[int] = (),
                       tree: torch.Tensor | None = None) -> ArgmaxOutput:
        """Greedy targets of a verify pass: the argmax [T] at every row (of a chain or a ``tree``),
        decided from each row's own hidden state alone, and the outputs of ``layers``."""
        tree_kw = {} if tree is None else {"tree": tree}
        if self.model.fixed is not None and fixed_takes(tokens.numel(), tree):  # each row's logits from its fixed-shape chunk
            passed = self.forward(tokens, pos, layers=layers, **tree_kw)
            return ArgmaxOutput(passed.logits.argmax(-1), passed.layers if layers else None)
        passed = self.forward(tokens, pos, layers=layers, logits=False, return_hidden=True, **tree_kw)
        return ArgmaxOutput(self.model.greedy.argmax_hidden(passed.hidden), passed.layers if layers else None)

    def argmax_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy tokens [n] of final normed hidden states h [n, hidden] (``GreedyTargets.argmax_hidden``)."""
        return self.model.greedy.argmax_hidden(h)

    def warm_up(self, tokens: list[int], rows: int) -> None:
        """Let the LM head pick its kernel for every pass width up to ``rows`` now, not inside a
        timed generation."""
        head = self.model.lm_head
        if getattr(head, "autotune", False):
            for n in range(1, min(rows, head.AUTOTUNE_ROWS) + 1):
                self.reset()
                self.forward(torch.tensor(([2] + list(tokens)) * n)[:n], 0)

    def head_timings(self, rows, reps: int, text=None) -> dict | None:
        """Milliseconds of the LM head for each row count and candidate kernel (CPU). The screened
        exact argmax (greedy path) is timed on the model's own final hidden states, at the last
        positions of ``text`` (token ids of real text) when given, else of random tokens."""
        m = self.model
        head = m.lm_head
        if head is None or not getattr(head, "autotune", False):
            return None
        g = torch.Generator().manual_seed(0)
        out = {}
        for n in rows:
            x = torch.randn(n, head.weight.shape[1], generator=g).to(head.weight)
            out[str(n)] = {k: v * 1000 for k, v in head.time_kernels(x, reps).items()} | {
                "chosen": _kernel_name(head.choice.get(n), n)}
        exact = m.greedy.exact_head()
        if exact is not None:  # the greedy path: screened exact argmax, timed on the model's own final hidden states
            if text is not None and len(text) >= max(rows):
                ids = torch.tensor(text[: m.max_context])
            else:
                ids = torch.randint(10, min(m.vocab_size, 20000), (max(rows),), generator=g)
            self.reset()
            h = self.forward(ids, 0, logits=False, return_hidden=True).hidden[-max(rows):]
            self.reset()
            for n in rows:
                out[str(n)]["exact_argmax"] = median_s(lambda: exact.argmax(h[:n]), reps) * 1000
        return out

    def prepare_graphs(self, up_to: int, progress: bool = True) -> int:
        """Capture this sequence's CUDA graphs for passes up to position ``up_to`` now
        (``FixedRows.prepare``); 0 where the model does not replay graphs."""
        fixed = self.model.fixed
        return 0 if fixed is None else fixed.prepare(self.model, self.cache, up_to, progress=progress)


def _kernel_name(choice, rows: int) -> str | None:
    if choice is None:
        return None
    how, padded = choice
    return how if padded == rows else f"{how} (padded to {padded} rows)"
