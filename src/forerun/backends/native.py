"""Our own forward pass for Llama, Mistral, Qwen2/3 and Gemma 1/2/3 text models, with a static
per-position KV cache.

Why not the transformers module: we need positions we choose, a cache rolled back by
bookkeeping, layer skipping for self-speculation, hidden states, and the least possible
per-step overhead. The weights are the transformers model's own tensors (no copy),
except that linear layers are prepacked for oneDNN on CPU. Here: loading, the forward and the
batched forward. Beside this file, the class's other parts: the cache (``kv_cache.py``), positions
and masks (``positions.py``), attention over the cache (``attention.py``), the body's kernel choice
(``linear.py``), greedy targets (``greedy_targets.py``), GGUF blocks (``gguf_weights.py``); and the
architecture and its layers (``arch.py``), fixed-shape passes for GPUs (``fixed_rows.py``).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from forerun.backends.arch import Arch, Layer, add_bias, decoder_layer, norm_weight, rms_norm, rotate_half
from forerun.backends.attention import CacheAttention, SequenceRows, attn_rows_kernel
from forerun.backends.base import ArgmaxOutput, BackendBase, Capabilities, ForwardOutput
from forerun.backends.fixed_rows import FIXED_DEFAULT_CONTEXT, FixedRows, fixed_takes
from forerun.backends.gguf_weights import GGUFWeights
from forerun.backends.greedy_targets import GreedyTargets
from forerun.backends.kv_cache import KVCache
from forerun.backends.linear import ROWS_ANY, BodyKernelChoice, PackedLinear
from forerun.backends.positions import PassPositions
from forerun.backends.qweights import KIND, QPassC, qrows_lib

log = logging.getLogger("forerun")


class NativeBackend(KVCache, PassPositions, CacheAttention, BodyKernelChoice, GreedyTargets, GGUFWeights,
                    BackendBase):
    """Our own forward pass for the architectures in ``SUPPORTED_MODEL_TYPES``."""

    @property
    def capabilities(self) -> Capabilities:
        """Exact argmax passes (chains, trees, with layer outputs), token trees, batched passes,
        layer skipping; greedy trees run the LM head lazily on the CPU only (see ``lazy_tree_head``)."""
        return Capabilities(exact_argmax=True, argmax_features=True, argmax_tree=True,
                            lazy_tree_head=self.lazy_tree_head, token_trees=True, batched=True, layer_skip=True,
                            kv_segments=True, hidden_states=True, draft_batch=self._fixed is None)

    def __init__(self, hf_model, *, max_context: int | None = None, pack_linear: bool = True,
                 exact_greedy: bool | str = "auto", batch_invariant: bool = True, gguf: str | None = None,
                 integer: bool = True, file_tensors=None, fixed_rows: bool | None = None):
        """``gguf``: the GGUF file the weights were dequantized from. With ``integer`` (the default)
        every layer then runs in ``qrows.c`` on the file's blocks with 8-bit activations, one native
        call per pass (see ``qweights``), where every linear weight is of a handled type and the
        kernels build; otherwise the blocks serve the layers' small passes in float32, bit for bit
        as the dequantized weights (see ``block_weights``). A model built by ``gguf_model.skeleton``
        (weights on the meta device, ``file_tensors`` from it) runs on the integer path or not at
        all (ValueError); its token embeddings and LM head are read from the file when used.
        ``fixed_rows``: passes of up to ``fixed_rows.MAX_ROWS`` rows run in fixed shapes (see
        ``fixed_rows``; lossless in any dtype): None (the default) everywhere but the CPU's float32
        path, which is batch-invariant by its own kernels."""
        cfg = hf_model.config
        arch = Arch.of(cfg)
        self.arch = arch
        inner = hf_model.model
        self.config = cfg
        self.device = torch.device("cpu") if file_tensors is not None else inner.embed_tokens.weight.device
        self.dtype = inner.embed_tokens.weight.dtype
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = arch.scale
        self.window = arch.window
        self.max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if fixed_rows is None:  # the CPU's float32 kernels are batch-invariant on their own; nothing else is
            fixed_rows = self.device.type != "cpu" or self.dtype != torch.float32
        if fixed_rows and max_context is None and self.max_context > FIXED_DEFAULT_CONTEXT:
            # fixed-shape passes allocate the whole cache at once: a long-context model gets a
            # default the GPU can hold for several sequences; ``max_context`` raises it
            log.info("cache for %d positions (the model allows %d; max_context raises it)", FIXED_DEFAULT_CONTEXT,
                     self.max_context)
            self.max_context = FIXED_DEFAULT_CONTEXT
        self._files = file_tensors
        # the token embeddings, shared with forks: {"t": tensor}, on the meta device until
        # ``embed`` is first asked for where the file holds them (steps read their rows alone)
        self._embed = {"t": inner.embed_tokens.weight.detach()}
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5 if arch.gemma_norms else 1.0, dtype=self.dtype, device=self.device)
        self.final_norm = norm_weight(inner.norm) if arch.gemma_norms else inner.norm.weight.detach()
        head_source = None
        if file_tensors is not None:
            head_source = ((lambda: self.embed) if file_tensors.head_name is None
                           else (lambda: file_tensors.full(file_tensors.head_name)))
        self.lm_head = PackedLinear(hf_model.lm_head.weight.detach(), pack_linear, autotune=True, source=head_source)
        self.softcap = arch.final_softcap
        self.layers = [Layer(layer, arch.layer_types[i], pack_linear, arch) for i, layer in enumerate(inner.layers)]
        self.quant = None  # QLayer per layer: the integer path (``_qbody``)
        self._head_file = None  # the GGUF file and tensor the integer path's LM head came from
        lean = file_tensors is not None
        if gguf and pack_linear and self.device.type == "cpu" and self.dtype == torch.float32:
            if not (integer and self._attach_integer(gguf)):
                if lean:
                    raise ValueError("the integer kernels cannot run this GGUF file's layers")
                self._attach_blocks(gguf)
        elif lean:
            raise ValueError("a model without its linear weights runs on the integer path only")
        # Rotary tables per attention type, from the transformers module (it knows every rope variant).
        rot = inner.rotary_emb
        self._inv_freq = {}
        self._rope_scale = {}
        for t in set(arch.layer_types):
            per_type = hasattr(rot, f"{t}_inv_freq")  # Gemma 3: local and global layers rotate differently
            self._inv_freq[t] = getattr(rot, f"{t}_inv_freq" if per_type else "inv_freq").detach().float().to(self.device)
            self._rope_scale[t] = getattr(rot, f"{t}_attention_scaling" if per_type else "attention_scaling", 1.0)
        self._pack = pack_linear
        self._body_choice = {"kernel": None}  # shared with forks: chosen once (see body_kernel)
        self._want_invariant = batch_invariant
        self.exact_greedy = exact_greedy
        self._exact = None  # undecided; then the screened exact head, or False (float32 logits)
        self._hf_model = hf_model
        self._cap = 0
        self._rope_tabs = {}  # the integer path's rotary tables (see _rope_table), shared with forks
        self._len = 0
        self.k_cache = self.v_cache = None
        self._fixed = FixedRows(self) if fixed_rows and self.quant is None else None
        self.tree_scratch = None  # keys and values of a tree row, laid out for its pass (``fixed_rows``)
        self.graphs = {}  # this sequence's CUDA graphs (``fixed_rows``): they read its cache, and go with it
        if self.quant is not None:
            self._tune_wide_tiles()  # measured once per model shape and machine, then kept

    @property
    def embed(self) -> torch.Tensor:
        """The token embeddings [vocab, hidden] (drafters and training read them whole; a model
        read from its GGUF file builds them here, once, on first use)."""
        box = self._embed
        if box["t"].is_meta:
            log.info("reading the token embeddings whole (%s)", self._files.embed_name)
            box["t"] = self._files.full(self._files.embed_name)
        return box["t"]

    def embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self._embed["t"]
        if t.is_meta:
            return self._files.embed_rows(tokens).to(self.dtype)
        return F.embedding(tokens, t)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.arch.gemma_norms)


    def fork(self) -> NativeBackend:
        self.exact_head()  # decided once, so that every twin takes greedy tokens the same way
        return self._twin()

    def _twin(self) -> NativeBackend:
        twin = object.__new__(NativeBackend)
        twin.__dict__.update(self.__dict__)
        twin._cap, twin._len, twin.k_cache, twin.v_cache, twin.graphs = 0, 0, None, None, {}
        return twin

    @property
    def batch_invariant(self) -> bool:
        """Whether every row of a pass of up to ``INVARIANT_ROWS`` rows (a chain, a token tree) is
        computed bit for bit as a one-token step at that position computes it: the layers' products
        by ``rows`` (each row's sums alone), attention row by row over exactly the keys that row
        sees, in cache order, and the LM head's logits by the same row kernel (``lm_logits``; also in
        a batched pass of any size), so sampled rows read the logits a one-token step gives them.
        With the screened exact head deciding each row from its hidden state,
        greedy verification then cannot differ from plain decoding, not even on near ties. On by
        default on the CPU where ``f32_rows.c`` builds (float32); ``batch_invariant=False`` lets the
        body take whichever kernel times faster and attention take all rows at once."""
        if self._fixed is not None:
            return True  # fixed shapes (``fixed_rows``)
        return self.body_kernel in ("rows", "int8") and self._want_invariant

    def report(self) -> dict:
        out = {"threads": torch.get_num_threads(), "greedy_head": self.greedy_head, "body_kernel": self.body_kernel,
               "batch_invariant": self.batch_invariant}
        if self.quant is not None:
            out["weights"] = "gguf blocks (integer kernels)"
        if self._fixed is not None:
            out["fixed_rows"] = True
            if not self._fixed.graphs_off:  # captured, replayed, and every failed capture (an error)
                out["cuda_graphs"] = self._fixed.stats()
        return out

    def sub_head(self, rows: torch.Tensor) -> PackedLinear:
        """An LM head over the vocabulary rows ``rows`` only (logits come back in that order)."""
        return PackedLinear(self.lm_head.weight[rows.to(self.device)].contiguous(), self._pack)

    # -- forward ---------------------------------------------------------------------------
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
        self._check_forward(tokens, pos)
        T = tokens.numel()
        end = pos + T
        self.ensure_capacity(end)
        if self._fixed is not None and fixed_takes(T, tree) and not skip_layers and head is None:
            h, lg, feats = self._fixed.forward(self, tokens, pos, tree, layers, logits)  # tokens go in with positions
            self._len = end
            if last_only:
                h, lg = h[-1:], None if lg is None else lg[-1:]
            return ForwardOutput(logits=lg, hidden=h if return_hidden else None, layers=feats)
        tokens = tokens.to(self.device)
        if tree is None:
            positions = torch.arange(pos, end, device=self.device)
            masks = self._masks(pos, T)
            rope = self.rope(positions, pos)
        else:
            positions, masks = self._tree_masks(pos, tree)
            rope = self.rope(positions)
        h = self.embeddings(tokens) * self.embed_scale  # [T, hidden]
        h, feats = self._body(h, [(self, pos, T, rope, masks)], set(skip_layers), layers)
        self._len = end
        if not logits and not return_hidden:
            return ForwardOutput(logits=None, layers=feats)
        h = self._norm(h[-1:] if last_only else h, self.final_norm)
        return ForwardOutput(logits=self.lm_logits(h, head) if logits else None, hidden=h if return_hidden else None,
                             layers=feats)


    def _body(self, h, parts, skip, layers):
        """The transformer layers over the rows ``h`` [rows, hidden] of one or more sequences.

        ``parts``: per sequence (backend holding its cache, pos, T, rope, masks), in row order.
        Linear layers run on every row at once; attention runs per sequence on its own cache.
        Returns the last hidden states and the asked-for layers' outputs (or None)."""
        if self.quant is not None:
            return self._qbody(h, parts, skip, layers)
        want = {l: None for l in layers}
        how = self.body_kernel
        if len(parts) > 1 and self.batch_invariant:
            how = ROWS_ANY
        # rotary tables of every row of the pass, per attention type: rows rotate all at once
        # (elementwise, so each row's values do not depend on the others)
        ropes = {kind: tuple(torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*(p[3][kind] for p in parts)))
                 for kind in parts[0][3]}
        D, n_all = self.head_dim, h.shape[0]
        # several sequences, every row batch-invariant: one attention call per layer for all of them
        joined = None
        if (len(parts) > 1 and not self.arch.attn_softcap and self.dtype == torch.float32 and self.device.type == "cpu"
                and attn_rows_kernel() is not None and all(len(p[4][sl]) > 2 for p in parts for sl in p[4])):
            joined = {sl: SequenceRows([p[0] for p in parts], [p[4][sl][2] for p in parts], [p[1] for p in parts])
                      for sl in parts[0][4]}

        def linear(lin, x, bias):
            return add_bias(lin(x, how), bias)

        def qkv(i, layer, t):
            q = t[:, : layer.n_q].view(n_all, self.n_heads, D)
            k = t[:, layer.n_q : layer.n_q + layer.n_kv].view(n_all, self.n_kv_heads, D)
            v = t[:, layer.n_q + layer.n_kv :].view(n_all, self.n_kv_heads, D)
            if layer.q_norm is not None:
                q = self._norm(q, layer.q_norm)
                k = self._norm(k, layer.k_norm)
            kind = "sliding_attention" if layer.sliding else "full_attention"
            cos, sin = ropes[kind] if kind in ropes else next(iter(ropes.values()))
            c, s = cos[:, None, :], sin[:, None, :]
            return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v

        def attend(i, layer, q, k, v):
            if joined is not None:
                rows = joined[layer.sliding]
                rows.store(k, v, i)
                return rows.attend(q, i, self.scale)
            outs, r = [], 0
            for seq, pos, T, _, masks in parts:
                outs.append(seq._attention(layer, i, q[r: r + T], k[r: r + T], v[r: r + T], pos, masks[layer.sliding]))
                r += T
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        for i, layer in enumerate(self.layers):
            if i in skip:
                continue
            h = decoder_layer(i, layer, h, self.arch.sandwich, self._norm, linear, qkv, attend)
            if i in want:
                want[i] = h
        return h, (torch.cat([want[l] for l in layers], -1) if layers else None)

    def _qbody(self, h, parts, skip, layers):
        """``_body`` on the integer path: one ``forerun_q_layers`` call for every layer and every row of
        every sequence (norms, products, rotary embeddings, the cache writes and attention in C)."""
        lib = qrows_lib()
        lib.forerun_q_threads(torch.get_num_threads())
        kinds = {KIND[kind]: tuple(torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*(p[3][kind] for p in parts)))
                 for kind in parts[0][3]}
        ps = QPassC()
        ps.N, ps.hidden, ps.H, ps.KVH, ps.D = h.shape[0], self.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim
        ps.eps, ps.scale, ps.softcap = self.eps, self.scale, self.arch.attn_softcap or 0.0
        rows = {False: SequenceRows([p[0] for p in parts], [p[4][False][2] for p in parts], [p[1] for p in parts])}
        same = all(p[4][True][2].rows == p[4][False][2].rows for p in parts)  # no sliding window reaches back that far
        rows[True] = rows[False] if same else SequenceRows([p[0] for p in parts], [p[4][True][2] for p in parts],
                                                           [p[1] for p in parts])
        keep = []  # tensors the pass reads through pointers, alive until the layers have run
        for k in (0, 1):
            cos, sin = kinds.get(k) or next(iter(kinds.values()))
            cos, sin = cos.float().contiguous(), sin.float().contiguous()
            r = rows[bool(k)]
            keep += [cos, sin]
            ps.cos[k], ps.sin[k] = cos.data_ptr(), sin.data_ptr()
            ps.lo[k], ps.hi[k], ps.xp[k], ps.extra[k] = (r.lo.data_ptr(), r.hi.data_ptr(), r.xp.data_ptr(),
                                                         r.extra.data_ptr())
        r = rows[False]
        ps.kbase, ps.vbase, ps.cap, ps.slot = r.k_base.data_ptr(), r.v_base.data_ptr(), r.caps.data_ptr(), r.pos.data_ptr()
        kinds_kv = {p[0].k_cache.dtype for p in parts}
        if len(kinds_kv) != 1:  # one flag tells the kernels how every sequence's cache is stored
            raise ValueError(f"a batched pass over caches of different types: {sorted(map(str, kinds_kv))}")
        ps.kv_f16 = int(kinds_kv.pop() == torch.float16)
        h = h.to(torch.float32).contiguous().clone()
        n = len(self.quant)
        want = {l: torch.empty_like(h) for l in layers}
        keep_at = (ctypes.c_void_p * n)(*[want[i].data_ptr() if i in want else None for i in range(n)]) if want else None
        skips = (ctypes.c_uint8 * n)(*[i in skip for i in range(n)]) if skip else None
        if lib.forerun_q_layers(self._qlayers, n, skips, keep_at, ctypes.byref(ps), h.data_ptr()) != 0:
            raise MemoryError("qrows: out of memory in a layer")
        return h, (torch.cat([want[l] for l in layers], -1) if layers else None)

    def _fixed_batch(self, seqs, feeds, positions, layers, trees) -> list:
        """``forward_batch`` on fixed-shape passes: every verify pass (a chain, a token tree of any
        size) in shared fixed-shape chunks, so a row's result cannot depend on the batch; a feed
        as long as a prompt runs on its own sequence alone, as ``forward`` runs it alone."""
        trees = [trees[i] if i < len(trees) else None for i in range(len(feeds))]
        for seq, feed, pos, tree in zip(seqs, feeds, positions, trees):
            seq._check_forward(feed, pos)
            seq.ensure_capacity(pos + feed.numel())
            if tree is not None and tree.numel() != feed.numel() - 1:
                raise ValueError(f"a tree of {tree.numel()} parents for a feed of {feed.numel()} rows")
        chunked = [i for i, (f, t) in enumerate(zip(feeds, trees)) if fixed_takes(f.numel(), t)]
        outs: list = [None] * len(feeds)
        if chunked:
            got = self._fixed.forward_batch(self, [seqs[i] for i in chunked], [feeds[i] for i in chunked],
                                            [positions[i] for i in chunked], [trees[i] for i in chunked], layers, True)
            for i, (_, lg, ft) in zip(chunked, got):
                seqs[i]._len = positions[i] + feeds[i].numel()
                outs[i] = ForwardOutput(logits=lg, layers=ft)
        for i in range(len(feeds)):
            if outs[i] is None:
                passed = seqs[i].forward(feeds[i], positions[i], layers=layers)
                outs[i] = ForwardOutput(logits=passed.logits, layers=passed.layers)
        return outs

    @torch.inference_mode()
    def forward_batch(self, seqs: Sequence[NativeBackend], feeds: Sequence[torch.Tensor],
                      positions: Sequence[int], layers: Sequence[int] = (),
                      greedy: Sequence[bool] = (), trees: Sequence[torch.Tensor | None] = (),
                      head: PackedLinear | None = None, last_only: bool = False) -> list:
        """One pass over several sequences: ``feeds[i]`` runs at ``positions[i]`` on ``seqs[i]``'s
        cache (forks of this backend); where ``trees[i]`` is given, its rows 1.. are a token tree
        with those parents (as ``forward(tree=)``). Returns each sequence's logits [T_i, vocab]
        (float32) and, with ``layers``, those layers' outputs; a sequence marked in ``greedy`` gets
        the exact argmax of every row instead of logits (``ArgmaxOutput``), where it is found without logits
        (``argmax_hidden``: the integer path or the screened exact head). ``head`` replaces the LM
        head and ``last_only`` keeps each sequence's last row only (a draft model's step; not on
        fixed-shape passes)."""
        if self._fixed is not None:
            if head is not None or last_only:
                raise ValueError("fixed-shape passes run the whole LM head on every row")
            return self._fixed_batch(seqs, feeds, positions, layers, trees)
        parts, ids = [], []
        for i, (seq, feed, pos) in enumerate(zip(seqs, feeds, positions)):
            seq._check_forward(feed, pos)
            T = feed.numel()
            seq.ensure_capacity(pos + T)
            tree = trees[i] if i < len(trees) else None
            if tree is None:
                rope, masks = self.rope(torch.arange(pos, pos + T, device=self.device), pos), seq._masks(pos, T)
            else:
                if tree.numel() != T - 1:
                    raise ValueError(f"a tree of {tree.numel()} parents for a feed of {T} rows")
                qpos, masks = seq._tree_masks(pos, tree)
                rope = self.rope(qpos)
            parts.append((seq, pos, T, rope, masks))
            ids.append(feed.to(self.device))
        h = self.embeddings(torch.cat(ids)) * self.embed_scale  # [rows, hidden]
        h, feats = self._body(h, parts, set(), layers)
        for seq, pos, T, _, _ in parts:
            seq._len = pos + T
        sizes = [p[2] for p in parts]
        hn = self._norm(h, self.final_norm).split(sizes)
        if last_only:
            hn = [x[-1:] for x in hn]
        per_seq = feats.split(sizes) if feats is not None else [None] * len(parts)
        argmax = self._argmax_without_logits() if any(greedy) else None
        flags = [argmax is not None and i < len(greedy) and bool(greedy[i]) for i in range(len(parts))]

        def run(fn, chosen):  # one pass of fn over the chosen sequences' rows, split back per sequence
            rows = [x for x, f in zip(hn, flags) if f == chosen]
            return iter(fn(torch.cat(rows)).split([len(x) for x in rows]) if rows else [])

        lg, am = run(lambda x: self.lm_logits(x, head, batched=len(parts) > 1), False), run(argmax, True)
        return [ArgmaxOutput(next(am), f) if g else ForwardOutput(logits=next(lg), layers=f)
                for g, f in zip(flags, per_seq)]
