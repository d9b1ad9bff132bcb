"""Backend over llama.cpp: its quantized kernels run the model, our engine runs the speculation.

Uses llama-cpp-python's low-level API only: one ``llama_model`` (the weights, loaded once)
and one ``llama_context`` per backend (its own KV cache). A forward is one ``llama_decode``
of a batch with logits requested at every position (or the last one); rollback removes the
tail of the sequence from the context's memory (``llama_memory_seq_rm``), which is
bookkeeping in llama.cpp too.

What llama.cpp can return: logits for any position of a batch, and, with embeddings switched
on, the *final* hidden state after the output norm (``llama_get_embeddings_ith``). It has no
per-call way to skip layers and no public way to read intermediate layers (only through a
graph evaluation callback), so layer skipping needs the torch backend.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from forerun import kept
from forerun.backends.base import ArgmaxOutput, BackendBase, Capabilities, ForwardOutput, check_forward
from forerun.backends.greedy_head import Q8Head
from forerun.backends.llamacpp_lib import HiddenTap, load_llama_cpp, tap_lib
from forerun.draft_length import LONGEST_DRAFT
from forerun.errors import ForerunError
from forerun.gguf_file import Q8_0, GGUFFile
from forerun.timing import median_s

DEFAULT_CONTEXT = 8192
_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)

        logging.getLogger("forerun").warning(msg)


def default_threads() -> int:
    return max(1, torch.get_num_threads())


class LlamaCppModel:
    """The weights of one GGUF file, shared by every context (target, draft, peer)."""

    def __init__(self, path: str | Path, exact: bool = True):
        L = load_llama_cpp()
        self.L = L
        self.path = str(path)
        self.exact = exact
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        # Repacked weights use one kernel for passes of >= 4 rows and another for fewer, which
        # round differently; exact mode keeps the plain layout so every pass size agrees.
        params.use_extra_bufts = not exact
        ptr = L.llama_model_load_from_file(self.path.encode(), params)
        if not ptr:
            raise ForerunError(f"llama.cpp could not load {self.path} (unsupported architecture or damaged file)")
        self.ptr = ptr
        self.vocab = L.llama_model_get_vocab(ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_layer = L.llama_model_n_layer(ptr)
        self.n_embd = L.llama_model_n_embd(ptr)
        self.n_ctx_train = L.llama_model_n_ctx_train(ptr)

    _head = None
    _head_reason = ""

    def greedy_head(self):
        """The exact multi-row greedy head (Q8_0 heads only), built once per model; None if unsupported."""
        if self._head is None and not self._head_reason:
            self._head, self._head_reason = _build_greedy_head(self.path, self.n_embd, self.n_vocab)
        return self._head

    def greedy_head_possible(self) -> bool:
        """Whether ``greedy_head`` can be built, known without building it (the file's head type
        and shape, and a C compiler)."""
        if self._head is not None:
            return True
        if self._head_reason:
            return False
        return tap_lib() is not None and _greedy_head_obstacle(self.path, self.n_embd, self.n_vocab) is None

    _head_pays: dict | None = None

    def head_pays(self, threads: int, rows: int = 1) -> bool:
        """Whether the certified greedy head beats llama.cpp's own LM head for passes of ``rows``
        rows, timed once per model for one-token steps and for five-row verify passes.

        The certified head skips llama.cpp's head (the body stops at the final norm) and screens
        the Q8_0 rows itself, all rows of a pass in one sweep over the weights; llama.cpp's head
        costs about one more head pass per extra row. Which wins depends on the vocabulary and the
        pass: on SmolLM2 (49,152 rows) llama.cpp's own head is the faster for one-token steps.
        Both give llama.cpp's own argmax, so mixing them per pass size changes no token. Timed in
        runs of consecutive passes, as decoding runs them: timed alone, the certified head's rows
        stay in cache between calls and it looks faster than it is. Kept per model file and machine
        after the first time (``forerun.kept``)."""
        if self._head_pays is None:
            head = self.greedy_head()
            if head is None or tap_lib() is None:
                self._head_pays = {1: False, "multi": False}
            else:  # timed once per model and machine (``kept``)
                import llama_cpp  # optional (the llamacpp extra); loaded by now

                key = [kept.file_key(self.path), threads, self.exact, getattr(llama_cpp, "__version__", "?")]
                v = kept.measured("llamacpp-heads", key, lambda: {str(k): v for k, v in self._time_heads(head, threads).items()},
                                  f"timing llama.cpp's greedy heads on {Path(self.path).name} once for this machine (seconds)")
                self._head_pays = {1: v["1"], "multi": v["multi"]}
        return self._head_pays[1 if rows == 1 else "multi"]

    def _time_heads(self, head, threads: int) -> dict:
        ctx = _Context(self, 256, threads, tap=True)
        ids = np.random.default_rng(1).integers(100, min(self.n_vocab, 20000), 100).astype(np.int32)
        ctx.decode(ids[:64], 0, "none")

        def own(i, n):
            ctx.decode(ids[i: i + n], i, "all")
            ctx.argmax(n, self.n_vocab)

        def certified(i, n):
            ctx.tap.start(stop=True)
            try:
                ctx.decode(ids[i: i + n], i, "all")
            finally:
                ctx.tap.stop()
            head.argmax(torch.from_numpy(ctx.tap.hidden(n)))

        def passes(fn, n):  # 6 passes of n rows at consecutive positions
            ctx.remove_from(64)
            for i in range(64, 64 + 6 * n, n):
                fn(i, n)

        out, times = {}, {}
        for key, n in ((1, 1), ("multi", 5)):
            t_own, t_cert = median_s(lambda: passes(own, n), 5), median_s(lambda: passes(certified, n), 5)
            out[key] = t_cert < t_own
            times[n] = (t_cert * 1000 / 6, t_own * 1000 / 6)
        ctx = None  # frees the timing context now
        logging.getLogger("forerun").info(
            "llama.cpp greedy head per pass: 1 row %s (certified %.1f ms, own %.1f ms), 5 rows %s (%.1f ms, %.1f ms)",
            "certified" if out[1] else "own", *times[1], "certified" if out["multi"] else "own", *times[5])
        return out

    _invariant: bool | None = None

    def batch_invariant(self, threads: int) -> bool:
        """Probe once: do the rows of one multi-token pass equal one-token steps, bit for bit?

        Greedy speculation is token-identical to plain decoding only if they do. Exact mode
        (the default) chooses llama.cpp settings under which ggml computes every row the same
        way whatever the pass size; the probe confirms it on this machine and build (a pass of
        the longest verification, LONGEST_DRAFT + 1 tokens, after a 600-token prompt, against one-token
        steps).
        """
        if self._invariant is None:
            rng = np.random.default_rng(0)
            hi = min(self.n_vocab, 20000)
            n = LONGEST_DRAFT + 1
            P = 600  # the pass straddles 512 and 640 cached cells, where the one-token attention kernel used to change
            prompt = rng.integers(100, hi, P).astype(np.int32)
            extra = rng.integers(100, hi, n).astype(np.int32)
            ctx = _Context(self, 1024, threads)
            for s in range(0, P, ctx.n_batch):
                ctx.decode(prompt[s: s + ctx.n_batch], s, "none")
            ctx.decode(extra, P, "all")
            together = ctx.logits(n, self.n_vocab)
            ctx.remove_from(P)
            ok = True
            for k in range(n):
                ctx.decode(extra[k: k + 1], P + k, "last")
                ok = ok and torch.equal(ctx.logits(1, self.n_vocab)[0], together[k])
            del ctx
            self._invariant = ok
            if not ok:
                _warn_once("llama.cpp computes passes of several tokens differently from one-token steps on this "
                           "machine" + ("" if self.exact else " (exact mode is off)") + ": greedy speculation "
                           "may differ from plain decoding where the top two tokens are close.")
        return self._invariant

    def eos_token_ids(self) -> set[int]:
        ids = set()
        for fn in ("llama_vocab_eos", "llama_vocab_eot"):
            t = getattr(self.L, fn)(self.vocab)
            if t is not None and t >= 0:
                ids.add(int(t))
        return ids

    def __del__(self):  # pragma: no cover - interpreter shutdown order varies
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            try:
                self.L.llama_model_free(ptr)
            except Exception:  # noqa: BLE001 - freeing at teardown: the library may be half unloaded already
                pass


def _greedy_head_obstacle(path: str, n_embd: int, n_vocab: int) -> str | None:
    """Why the file's LM head cannot serve as the exact greedy head (None: it can)."""
    g = GGUFFile.open(path)
    for key, value in g.metadata.items():
        if key.endswith("final_logit_softcapping") and value and float(value) > 0:
            return "the model caps its logits"
    t = g.tensors.get("output.weight") or g.tensors.get("token_embd.weight")
    if t is None:
        return "no LM head tensor found"
    if t.type != Q8_0:
        return "the LM head is not Q8_0"
    if n_embd % 32 or t.shape != (n_embd, n_vocab):
        return "unexpected LM head shape"
    return None


def _build_greedy_head(path: str, n_embd: int, n_vocab: int):
    """Read the LM head from the GGUF file; return (Q8Head, "") or (None, why not)."""
    why = _greedy_head_obstacle(path, n_embd, n_vocab)
    if why is not None:
        return None, why
    g = GGUFFile.open(path)
    t = g.tensors.get("output.weight") or g.tensors.get("token_embd.weight")

    logging.getLogger("forerun").info("building the exact multi-row greedy head from %s", path)
    head = Q8Head(g.raw_rows(t.name), n_embd, threads=default_threads())
    if not head.available:
        return None, "no C compiler for the head kernel"
    return head, ""


class _Context:
    """One llama_context plus a reusable batch."""

    def __init__(self, model: LlamaCppModel, n_ctx: int, threads: int, n_batch: int = 512, embeddings: bool = False,
                 tap: bool = False):
        L = model.L
        self.L, self.model = L, model
        p = L.llama_context_default_params()
        tap_kernels = tap_lib() if tap else None
        self.tap = HiddenTap(L, tap_kernels, model.n_embd, n_batch) if tap_kernels is not None else None
        if self.tap is not None:
            p.cb_eval = self.tap.fn
            p.cb_eval_user_data = self.tap.user_data
        if model.exact:
            # Flash attention over a Q8_0 cache computes every row of a pass with the same
            # row-by-row kernel whatever the pass size and however many cells the cache holds
            # (measured: passes of 1 and of 33 rows bit-identical past 1,100 cached positions, on
            # both real models). Over an f16 cache it does not: one-token passes over >= 512 cells
            # take a thread-split kernel and long passes a tiled one, which round differently. Without
            # flash attention llamafile's sgemm takes the products of >= 2 rows, which round
            # differently from the one-row product. The Q8_0 cache is also the faster one here.
            p.flash_attn_type = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED
            p.type_k = p.type_v = 8  # GGML_TYPE_Q8_0
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_batch
        p.n_seq_max = 1
        p.n_threads = threads
        p.n_threads_batch = threads
        p.swa_full = True  # rollback may remove recent positions of sliding-window layers
        p.embeddings = embeddings
        p.no_perf = True
        ctx = L.llama_init_from_model(model.ptr, p)
        if not ctx:
            raise ForerunError(f"llama.cpp could not create a context of {n_ctx} positions")
        self.ptr = ctx
        self.n_ctx = L.llama_n_ctx(ctx)
        self.n_batch = n_batch
        self.mem = L.llama_get_memory(ctx)
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        b = self.batch
        self.tok = np.ctypeslib.as_array(b.token, shape=(n_batch,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        self.nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(n_batch,))
        self.out = np.ctypeslib.as_array(b.logits, shape=(n_batch,))
        for i in range(n_batch):
            b.seq_id[i][0] = 0
        self.nseq[:] = 1
        self.embeddings = embeddings

    def set_threads(self, threads: int) -> None:
        self.L.llama_set_n_threads(self.ptr, threads, threads)

    def set_embeddings(self, on: bool) -> None:
        if on != self.embeddings:
            self.L.llama_set_embeddings(self.ptr, on)
            self.embeddings = on

    def remove_from(self, pos: int) -> None:
        self.L.llama_memory_seq_rm(self.mem, 0, pos, -1)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)

    def decode(self, tokens: np.ndarray, pos: int, outputs: str) -> int:
        """Decode one chunk (<= n_batch tokens); outputs: 'all', 'last' or 'none'. Returns rows out."""
        n = len(tokens)
        self.tok[:n] = tokens
        self.pos[:n] = np.arange(pos, pos + n, dtype=np.int32)
        self.out[:n] = 1 if outputs == "all" else 0
        if outputs == "last":
            self.out[n - 1] = 1
        self.batch.n_tokens = n
        rc = self.L.llama_decode(self.ptr, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} at position {pos} ({n} tokens)")
        return n if outputs == "all" else (1 if outputs == "last" else 0)

    def logits(self, rows: int, n_vocab: int) -> torch.Tensor:
        ptr = self.L.llama_get_logits(self.ptr)
        arr = np.ctypeslib.as_array(ptr, shape=(rows, n_vocab))
        return torch.from_numpy(arr.copy())  # llama.cpp reuses its buffer on the next decode

    def argmax(self, rows: int, n_vocab: int) -> torch.Tensor:
        """The argmax [rows] of the last decode's logits, read in place."""
        arr = np.ctypeslib.as_array(self.L.llama_get_logits(self.ptr), shape=(rows, n_vocab))
        return torch.from_numpy(arr.argmax(-1).astype(np.int64))

    def hidden(self, rows: int, n_embd: int) -> torch.Tensor:
        ptr = self.L.llama_get_embeddings(self.ptr)
        if not ptr:
            raise RuntimeError("llama.cpp returned no embeddings")
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(rows, n_embd)).copy())

    def __del__(self):  # pragma: no cover
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            try:
                self.L.llama_batch_free(self.batch)
                self.L.llama_free(ptr)
            except Exception:  # noqa: BLE001 - freeing at teardown: the library may be half unloaded already
                pass


class LlamaCppBackend(BackendBase):
    """The Backend interface over one llama.cpp context (one sequence)."""

    @property
    def capabilities(self) -> Capabilities:
        """Exact argmax passes always; their layer outputs where the graph callback (``tap.c``)
        built; the embeddings and hidden states trained heads read where, besides, the LM head is
        Q8_0 (``LlamaCppModel.greedy_head_possible``)."""
        tap = self.ctx.tap is not None
        return Capabilities(exact_argmax=True, argmax_features=tap,
                            hidden_states=tap and self.model.greedy_head_possible())

    hidden_is_normed = True  # llama.cpp gives the hidden state after the final norm

    def __init__(self, model: LlamaCppModel, *, max_context: int | None = None, threads: int | None = None,
                 fast_greedy: bool = True):
        self.model = model
        self.threads = threads or default_threads()
        self.fast_greedy = fast_greedy
        self.head_fallbacks = 0  # verify rows whose argmax needed llama.cpp's own head (near ties)
        self._checked = False
        limit = model.n_ctx_train or DEFAULT_CONTEXT
        self.max_context = min(max_context or DEFAULT_CONTEXT, limit)
        self.vocab_size = model.n_vocab
        self.num_layers = model.n_layer
        self.device = torch.device("cpu")
        self.ctx = _Context(model, self.max_context, self.threads, tap=fast_greedy)
        self.max_context = min(self.max_context, self.ctx.n_ctx)
        self._len = 0

    @property
    def batch_invariant(self) -> bool:
        """Whether a pass of several tokens gives bit-identical logits to one-token steps (probed once per model)."""
        return self.model.batch_invariant(self.threads)

    def report(self) -> dict:
        return {"threads": self.threads, "batch_invariant": self.batch_invariant, "head_fallbacks": self.head_fallbacks,
                "weights": "gguf (llama.cpp)"}

    @property
    def length(self) -> int:
        return self._len

    def decoded_to(self, length: int) -> None:
        """The context holds ``length`` positions, decoded outside ``forward`` (llama.cpp's own
        sampler loop, ``plain_generate``)."""
        self._len = length

    def truncate(self, length: int) -> None:
        length = max(0, length)
        if length < self._len:
            self.ctx.remove_from(length)
            self._len = length

    def reset(self) -> None:
        self.ctx.clear()
        self._len = 0

    def fork(self) -> LlamaCppBackend:
        return LlamaCppBackend(self.model, max_context=self.max_context, threads=self.threads, fast_greedy=self.fast_greedy)

    def set_threads(self, threads: int) -> None:
        self.threads = threads
        self.ctx.set_threads(threads)

    def _decode(self, chunk: np.ndarray, pos: int, mode: str, start: int) -> int:
        """Decode one chunk at pos; on failure drop everything from ``start`` (this call's first position)."""
        try:
            rows = self.ctx.decode(chunk, pos, mode)
        except RuntimeError:
            self._len = pos + len(chunk)  # llama.cpp may have kept part of the chunk: remove it all
            self.truncate(start)
            raise
        self._len = pos + len(chunk)
        return rows

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        pos: int,
        *,
        skip_layers: Sequence[int] = (),
        return_hidden: bool = False,
        last_only: bool = False,
        layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """``layers``: also return those layers' outputs at every position (read through the graph
        callback). With ``last_only`` and ``layers`` (a prompt pass for a trained head) no logits
        are computed (``logits`` is None): the LM head is skipped for every row."""
        if skip_layers:
            raise ValueError("llama.cpp cannot skip layers; layer skipping needs the torch backend")
        check_forward(self, tokens, pos)
        self.truncate(pos)
        ids = tokens.detach().cpu().numpy().astype(np.int32, copy=False)
        T = len(ids)
        if T == 0:
            raise ValueError("forward needs at least one token")
        layers = tuple(layers)
        tap = self._feature_tap(layers)
        body_only = bool(layers) and last_only
        self.ctx.set_embeddings(return_hidden)
        step = self.ctx.n_batch
        logits, hidden, feats = [], [], []
        for s in range(0, T, step):
            chunk = ids[s: s + step]
            # The last layer computes only the rows that are output: every row is output when its
            # features are wanted, and then the head is skipped (the tap stops at the final norm).
            mode = "all" if (layers or not last_only) else ("last" if s + step >= T else "none")
            if tap is not None:
                tap.start(stop=body_only, layers=layers)
            try:
                rows = self._decode(chunk, pos + s, mode, start=pos)
            finally:
                if tap is not None:
                    tap.stop()
            if layers:
                feats.append(torch.from_numpy(tap.layer_outputs(len(chunk))))
            if rows and not body_only:
                logits.append(self.ctx.logits(rows, self.vocab_size))
                if return_hidden:
                    hidden.append(self.ctx.hidden(rows, self.model.n_embd))
        return ForwardOutput(logits=None if body_only else (torch.cat(logits) if len(logits) > 1 else logits[0]),
                             hidden=(torch.cat(hidden) if len(hidden) > 1 else hidden[0]) if return_hidden else None,
                             layers=(torch.cat(feats) if len(feats) > 1 else feats[0]) if layers else None)

    def _feature_tap(self, layers: tuple):
        if not layers:
            return None
        if self.ctx.tap is None:
            raise ForerunError("reading layer outputs from llama.cpp needs its graph callback (tap.c), which needs a C compiler")
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range (the model has {self.num_layers})")
        return self.ctx.tap

    @property
    def embed(self):
        """The token embeddings [vocab, hidden] (dequantized rows of the Q8_0 table, made on demand),
        for trained draft heads; absent (AttributeError) where the greedy head is unavailable."""
        head = self.model.greedy_head() if self.ctx.tap is not None else None
        if head is None:
            raise AttributeError("embed")
        return head.embedding_rows()

    def argmax_forward(self, tokens: torch.Tensor, pos: int, layers: Sequence[int] = ()) -> ArgmaxOutput:
        """Greedy targets of a verify pass: argmax [T] at every position, exactly as llama.cpp's head
        gives, and the outputs of ``layers`` [T, len(layers) * hidden].

        Rows after the first row whose argmax differs from the next input token are not needed
        by greedy verification and may be -1."""
        out = self._argmax_ids(tokens, pos, tuple(layers))
        return ArgmaxOutput(*out) if layers else ArgmaxOutput(out)

    @torch.inference_mode()
    def _argmax_ids(self, tokens: torch.Tensor, pos: int, layers: tuple):
        """``argmax_forward``'s work: the argmax, or (argmax, layer outputs) with ``layers``."""
        T = tokens.numel()
        layers = tuple(layers)
        use = self.fast_greedy and self.ctx.tap is not None and 0 < T <= self.ctx.n_batch
        head = self.model.greedy_head() if use and self.model.head_pays(self.threads, T) else None
        if head is None and layers:
            passed = self.forward(tokens, pos, layers=layers)
            return passed.logits.argmax(-1), passed.layers
        if head is None:  # llama.cpp's own head: the argmax straight off its logits buffer, no copy
            check_forward(self, tokens, pos)
            self.truncate(pos)
            ids = tokens.detach().cpu().numpy().astype(np.int32, copy=False)
            step = self.ctx.n_batch
            return torch.cat([self.ctx.argmax(self._decode(ids[s: s + step], pos + s, "all", start=pos), self.vocab_size)
                              for s in range(0, T, step)])
        check_forward(self, tokens, pos)
        self.truncate(pos)
        ids = tokens.detach().cpu().numpy().astype(np.int32, copy=False)
        tap = self.ctx.tap
        tap.start(stop=True, layers=layers)
        try:
            self._decode(ids, pos, "all", start=pos)
        finally:
            tap.stop()
        h = torch.from_numpy(tap.hidden(T))
        feats = torch.from_numpy(tap.layer_outputs(T)) if layers else None
        out, ok = head.argmax(h)
        if not self._checked:  # once per backend: the certified rows must equal llama.cpp's own head
            self._checked = True
            full = self.forward(tokens, pos).logits.argmax(-1)
            if not torch.equal(full[ok], out[ok]):
                logging.getLogger("forerun").warning("the fast greedy head disagreed with llama.cpp's; using llama.cpp's head")
                self.fast_greedy = False
                return (full, feats) if layers else full
        # Rows of one pass are bit-identical to one-token steps (exact mode), so the features of
        # this pass stay valid even where a near tie below re-decodes some rows.
        out = self._settle_ties(tokens, pos, out, ok)
        return (out, feats) if layers else out

    def _settle_ties(self, tokens: torch.Tensor, pos: int, out: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        T = tokens.numel()
        nxt = tokens.cpu()
        for i in range(T):
            if not ok[i]:
                break
            if i + 1 < T and out[i] != nxt[i + 1]:
                return out  # every row up to the first mismatch is certified
        else:
            return out
        # Row i is a near tie: decode from there one position at a time, as plain decoding does.
        self.head_fallbacks += 1
        out[i:] = -1
        for j in range(i, T):
            out[j] = self.forward(tokens[j: j + 1], pos + j).logits[0].argmax()
            if j + 1 < T and out[j] != nxt[j + 1]:
                break
        return out


def plain_generate(backend: LlamaCppBackend, prompt: list[int], max_new_tokens: int, eos: set[int],
                   prefilled: int = 0, timings: dict | None = None) -> list[int]:
    """llama.cpp's own greedy decoding (its sampler picks each token): the ``llama.cpp`` peer.

    ``prefilled``: that many prompt positions are already in the backend's cache.
    ``timings``: if given, receives ``prefill_s`` (the prompt pass).
    """
    t0 = time.perf_counter()
    L = backend.model.L
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    try:
        if not prefilled:
            backend.reset()
        else:
            backend.truncate(prefilled)
        ctx = backend.ctx
        backend.forward(torch.tensor(prompt[prefilled:], dtype=torch.long, device="cpu"), prefilled, last_only=True)
        if timings is not None:
            timings["prefill_s"] = time.perf_counter() - t0
        limit = min(max_new_tokens, backend.max_context - len(prompt))
        pos, out = len(prompt), []
        one = np.zeros(1, dtype=np.int32)
        while len(out) < limit:
            tok = int(L.llama_sampler_sample(chain, ctx.ptr, -1))
            out.append(tok)
            if tok in eos or len(out) >= limit:
                break
            one[0] = tok
            ctx.decode(one, pos, "last")
            pos += 1
        backend.decoded_to(pos)
        return out
    finally:
        L.llama_sampler_free(chain)
