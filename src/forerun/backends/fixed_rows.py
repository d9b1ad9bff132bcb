"""Fixed-shape passes: the native forward on a GPU (and for half-precision weights on the CPU),
lossless by construction in any dtype.

A GPU's matrix and attention kernels sum in an order that depends on the shapes they are given, so
a row computed in a pass of 5 rows can differ in its last bits from the same row computed alone,
and in bfloat16 that flips near-tied greedy tokens. Here every pass that is not a prompt (a
one-token step, a verify chain of up to ``MAX_ROWS`` rows, a token tree of any size, a batched pass
over several sequences: see ``fixed_takes``) runs in the same shapes whatever its size:

- rows go through the layers in chunks of exactly ``ROW_BUCKET`` rows (a short chunk is padded;
  padding rows write their keys and values to a slot no position reads), so every product has the
  same shape, and a row's sums never depend on the other rows of its chunk;
- a row at position p attends over the first ``key_span(p)`` slots of the cache (a power of two,
  a function of p alone), the slots it must not see masked, so the reductions over keys have the
  same length for that row in every pass; the cache is allocated whole at the start (its strides
  never change);
- a token-tree row reads its keys through a gather that lays them out as a one-token step at its
  position sees them (the prefix, then its ancestors by depth), in a scratch buffer shaped like the
  cache.

Chunks run one after another (the rows of a pass are in causal order: parents before children), so
a row sees exactly what it would see as a one-token step. A batched pass puts its sequences' rows
one after another into shared chunks, each row writing and reading its own sequence's cache. A
greedy token is the argmax of the chunk's logits, for a tree row as for a one-token step.

On CUDA, a chunk of one sequence's chain rows is a captured graph, replayed (``CUDA_GRAPHS``): one
launch instead of a few hundred per pass. A sequence's graphs are held by its backend, beside the
cache they read, and go with it; every capture runs on one stream into one memory pool.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from forerun.backends.arch import add_bias, decoder_layer
from forerun.backends.positions import rope
from forerun.backends.runners import Rows, check_trees
from forerun.tree import tree_layout

log = logging.getLogger("forerun")

ROW_BUCKET = 16  # rows of every product
MAX_ROWS = 64  # longer chains are prompts: they take the library kernels, for every method alike
MIN_KEYS = 256
FIXED_DEFAULT_CONTEXT = 16384  # positions cached when the caller names no context (the cache is allocated whole)
CUDA_GRAPHS = True  # replay captured graphs of chain chunks on CUDA


def fixed_takes(rows: int, tree) -> bool:
    """Whether a pass of ``rows`` rows (``tree``: a token tree's parents, or None) runs in fixed
    shapes: every token tree, whatever its size, and every chain of up to ``MAX_ROWS`` rows (a
    verify chain is at most ``draft_length.LONGEST_DRAFT`` + 1 rows). A longer chain is a prompt, read once
    and the same way by every method."""
    return tree is not None or rows <= MAX_ROWS


def key_span(position: int, limit: int) -> int:
    """The slots a row at ``position`` attends over: the smallest power of two above it (at least
    ``MIN_KEYS``), at most ``limit`` (the model's context)."""
    return min(limit, max(MIN_KEYS, 1 << int(position).bit_length()))


def _linear(lin, x: torch.Tensor, bias) -> torch.Tensor:
    return add_bias(F.linear(x, lin.weight), bias)  # the library product at this chunk's fixed shape


def _norm(model, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMS norm over the last dimension, as ``arch.rms_norm`` (its weight before or after the cast
    back), through torch's own norm (one kernel where the device has a fused one)."""
    xf = F.rms_norm(x.float(), (x.shape[-1],), eps=model.eps)
    return (xf * weight).type_as(x) if model.arch.gemma_norms else weight * xf.type_as(x)


def _rotary(ropes: dict) -> dict:
    """Per attention type, (cos, signed sin) [B, 1, head_dim] for ``_rotate``: the sin's first half
    negated, so that x * cos + roll(x) * signed sin is ``x * cos + rotate_half(x) * sin``."""
    out = {}
    for kind, (cos, sin) in ropes.items():
        half = sin.shape[-1] // 2
        out[kind] = (cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), -1)[:, None, :])
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, D] (queries and keys in one call): three kernels."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, -1), signed_sin)


def fixed_chunks(model, caches, feeds, positions, trees=(), skip=(), layers=(), finish: str = "logits",
                 last_only: bool = False) -> Rows:
    """The fixed-shape runner (``runners``' signature): every row through ``model.fixed``'s chunks,
    the final norm and the LM head inside them; every layer runs (no ``skip``)."""
    if skip:
        raise ValueError("fixed-shape passes run every layer")
    check_trees(feeds, trees)
    for cache, feed, pos in zip(caches, feeds, positions):
        cache.ensure_capacity(pos + feed.numel())
    h, lg, ft = model.fixed.rows(model, caches, feeds, positions, trees, layers, finish == "logits")
    for cache, feed, pos in zip(caches, feeds, positions):
        cache.length = pos + feed.numel()
    if finish == "none":
        return Rows(None, None, ft)
    if last_only:  # each sequence's last row
        last = [e - 1 for e in accumulate(f.numel() for f in feeds)]
        h, lg = h[last], None if lg is None else lg[last]
    return Rows(h, lg, ft)


class FixedRows:
    """The fixed-shape passes of one ``NativeModel``, for every sequence over it. The graphs of a
    sequence live in its ``KVCache``'s ``graphs`` (keyed by key span, layers and logits), made anew
    with the cache; what is shared here: the capture stream and memory pool, and the counts."""

    def __init__(self, model):
        self.graphs_off = not (CUDA_GRAPHS and model.device.type == "cuda")
        self.captures = self.replays = 0
        self.capture_s = 0.0
        self.failures: list[str] = []  # why each failed capture failed (that shape then runs eagerly)
        self._pool = self._stream = None
        # per layer with query/key norms: one weight [heads + kv heads, D] norming both in one call
        H, KVH = model.n_heads, model.n_kv_heads
        self.qk_norm = [None if l.q_norm is None else
                        torch.cat([l.q_norm.expand(H, -1), l.k_norm.expand(KVH, -1)]).contiguous() for l in model.layers]

    def stats(self) -> dict:
        """Graphs captured and replayed, capture seconds, and failed captures (each an error)."""
        return {"captured": self.captures, "replayed": self.replays, "capture_s": round(self.capture_s, 3),
                "failed": list(self.failures)}

    # -- passes ------------------------------------------------------------------------------
    @staticmethod
    def _rows(seq, pos: int, T: int, tree) -> list[tuple]:
        """A pass's rows: (position, slot written, key map or None, sequence's cache)."""
        if tree is None:
            return [(pos + r, pos + r, None, seq) for r in range(T)]
        depth, anc = tree_layout(tree)
        rows = []
        for r in range(T):
            path = [pos + j for j in anc[r].nonzero().view(-1).tolist()]  # ancestors and itself, by depth
            if path == list(range(pos, pos + len(path))):  # the path in consecutive slots: a chain row
                path = None
            rows.append((pos + int(depth[r]), pos + r, path, seq))
        return rows

    def rows(self, model, caches, feeds, positions, trees, layers, want_logits: bool):
        """One pass over one or more sequences (``caches``: theirs): their rows one after another,
        in chunks that may hold rows of several sequences (the products read each weight once per
        chunk); each sequence's rows write and read its own cache. Final normed hidden states
        [rows, hidden], float32 logits [rows, vocab] (or None) and the outputs of ``layers``
        [rows, len(layers) * hidden] (or None), the sequences' rows one after another."""
        rows = []
        for i, (cache, feed, pos) in enumerate(zip(caches, feeds, positions)):
            rows += self._rows(cache, pos, feed.numel(), trees[i] if i < len(trees) else None)
        tokens = feeds[0].cpu() if len(feeds) == 1 else torch.cat([f.cpu() for f in feeds])
        return self._run(model, tokens, rows, tuple(layers), want_logits)

    def _run(self, model, tokens, rows, layers, want_logits):
        hs, logits, feats = [], [], []
        for c in range(0, len(rows), ROW_BUCKET):
            h, lg, ft = self._chunk(model, tokens[c: c + ROW_BUCKET], rows[c: c + ROW_BUCKET], layers, want_logits)
            hs.append(h)
            logits.append(lg)
            feats.append(ft)
        cat = lambda xs: None if xs[0] is None else torch.cat(xs) if len(xs) > 1 else xs[0]  # noqa: E731
        return cat(hs), cat(logits), cat(feats)

    def _chunk(self, model, tokens, rows, layers, want_logits):
        """One chunk of up to ``ROW_BUCKET`` rows (tokens on the CPU): its inputs go to the device in
        one copy ([3, ROW_BUCKET]: tokens, positions, slots; padding rows at position 0, writing the
        spare slot), then its graph replays or the layers run eagerly."""
        n, B = len(rows), ROW_BUCKET
        limit = model.max_context
        spans = {key_span(r[0], limit) for r in rows}
        ins = torch.zeros(3, B, dtype=torch.long, device="cpu")
        ins[0, :n] = tokens
        ins[1, :n] = torch.tensor([r[0] for r in rows], device="cpu")
        ins[2] = limit
        ins[2, :n] = torch.tensor([r[1] for r in rows], device="cpu")
        seq = rows[0][3]
        one_chain = all(r[2] is None and r[3] is seq for r in rows) and len(spans) == 1
        if one_chain and not self.graphs_off:
            return self._replay(model, seq, ins, spans.pop(), layers, want_logits, n)
        h, lg, ft = self.core(model, ins.to(model.device), rows, layers, want_logits)
        return h[:n], None if lg is None else lg[:n], None if ft is None else ft[:n]

    def chunk_logits(self, model, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab] of final normed hidden states h [n, hidden], each row through
        the LM head in a ``ROW_BUCKET``-row product as a pass's chunk forms it (same shape, same bits)."""
        out = []
        for c in range(0, h.shape[0], ROW_BUCKET):
            part = h[c: c + ROW_BUCKET]
            pad = part.new_zeros(ROW_BUCKET, part.shape[1])
            pad[: part.shape[0]] = part
            out.append(model.lm_logits(pad)[: part.shape[0]])
        return torch.cat(out) if out else h.new_zeros(0, model.vocab_size, dtype=torch.float32)

    def core(self, model, ins, rows, layers, want_logits, cache=None):
        """The layers over one chunk of ``ROW_BUCKET`` rows (static shapes: what a graph captures).
        ``ins`` [3, ROW_BUCKET] on the device: tokens, positions, slots. ``rows``: an int, the one
        key span of a chain chunk of ``cache``'s own rows, whose cache slots are ``ins[2]``; or per
        real row (position, slot, key map or None, sequence's cache)."""
        B, D, H, KVH = ROW_BUCKET, model.head_dim, model.n_heads, model.n_kv_heads
        limit = model.max_context
        tok, p = ins[0], ins[1]
        if isinstance(rows, int):
            writes = [(cache, ins[2])]
            groups = {(cache, rows, None): None}  # every row: one key span, keys in cache order
        else:
            writes = []  # per sequence: where each row's keys and values go (other rows: the spare slot)
            for seq in dict.fromkeys(r[3] for r in rows):
                sl = torch.full((B,), limit, dtype=torch.long, device="cpu")
                for j, r in enumerate(rows):
                    if r[3] is seq:
                        sl[j] = r[1]
                writes.append((seq, sl.to(model.device)))
            groups = {}  # rows of a sequence sharing a key span attend together; a tree row alone
            for j, (pos_j, _, path, seq) in enumerate(rows):
                groups.setdefault((seq, key_span(pos_j, limit), None if path is None else j), []).append(j)
        keys_at = torch.arange(limit, device=model.device)
        hidden: dict = {}  # (key span, window) -> the slots each row must not see [B, span], once a chunk

        def hide(span, window):
            if (span, window) not in hidden:
                keys = keys_at[:span][None, :]
                m = keys > p[:, None]
                if window:
                    m = m | (keys <= p[:, None] - window)
                hidden[(span, window)] = m
            return hidden[(span, window)]

        h = model.embeddings(tok) * model.embed_scale
        ropes = _rotary(rope(model, p))  # elementwise per row
        sanitize = model.dtype == torch.float16  # a stale overflow in a masked value slot would give 0 x Inf = NaN
        want = {}
        def qkv(i, layer, t):
            qk = t[:, : layer.n_q + layer.n_kv].view(B, H + KVH, D)  # queries and keys, side by side
            v = t[:, layer.n_q + layer.n_kv:].view(B, KVH, D)
            if self.qk_norm[i] is not None:
                qk = _norm(model, qk, self.qk_norm[i])
            kind = "sliding_attention" if layer.sliding else "full_attention"
            qk = _rotate(qk, *(ropes[kind] if kind in ropes else next(iter(ropes.values()))))
            return qk[:, :H], qk[:, H:], torch.nan_to_num(v) if sanitize else v

        def attend(i, layer, q, k, v):
            for seq, sl in writes:  # [kv_heads, slots, D] per layer
                seq.k[i].index_copy_(1, sl, k.transpose(0, 1))
                seq.v[i].index_copy_(1, sl, v.transpose(0, 1))
            window = model.window if layer.sliding else None
            att = None
            for (seq, span, tree_row), members in groups.items():
                kc, vc = seq.k[i], seq.v[i]
                if tree_row is None:
                    out = self._attend(model, q, kc[:, :span], vc[:, :span], hide(span, window))
                else:  # the row's keys laid out as a one-token step at its position reads them
                    kk, vk = self._gathered(seq, kc, vc, rows[tree_row], span)
                    out = self._attend(model, q, kk, vk, hide(span, window))
                if members is None or len(groups) == 1:
                    att = out
                else:
                    att = torch.zeros_like(out) if att is None else att
                    att[members] = out[members]
            return att

        norm = partial(_norm, model)
        for i, layer in enumerate(model.layers):
            h = decoder_layer(i, layer, h, model.arch.sandwich, norm, _linear, qkv, attend)
            if i in layers:
                want[i] = h
        hn = _norm(model, h, model.final_norm)
        logits = model.lm_logits(hn) if want_logits else None
        return hn, logits, (torch.cat([want[l] for l in layers], -1) if layers else None)

    @staticmethod
    def _attend(model, q, kk, vv, hide):
        """q [B, heads, D] over keys kk, vv [kv_heads, L, D], slot j hidden from row b where
        ``hide[b, j]``; [B, heads * D]."""
        B, H, D = q.shape
        KVH = kk.shape[0]
        g = H // KVH
        qg = q.reshape(B, KVH, g, D).permute(1, 2, 0, 3).reshape(KVH, g * B, D)
        scores = torch.matmul(qg, kk.transpose(1, 2)).float() * model.scale  # [kv_heads, g * B, L]
        if model.arch.attn_softcap:
            cap = model.arch.attn_softcap
            scores = torch.tanh(scores / cap) * cap
        scores = scores.view(KVH, g, B, -1).masked_fill(hide[None, None], float("-inf"))
        w = torch.softmax(scores, -1).to(vv.dtype).view(KVH, g * B, -1)
        out = torch.matmul(w, vv)  # [kv_heads, g * B, D]
        return out.view(KVH, g, B, D).permute(2, 0, 1, 3).reshape(B, H * D)

    @staticmethod
    def _gathered(cache, kc, vc, row, span):
        """A tree row's keys and values in a scratch buffer shaped like the cache: slot s < pos is
        cache slot s, slot pos + d is its ancestor at depth d; the rest masked (slot 0)."""
        position, _, path, _ = row
        pos = position - (len(path) - 1)
        idx = torch.zeros(span, dtype=torch.long, device="cpu")
        idx[:pos] = torch.arange(pos, device="cpu")
        idx[pos: pos + len(path)] = torch.tensor(path, device="cpu")
        idx = idx.to(kc.device)
        scratch = cache.tree_scratch
        if scratch is None or scratch[0].shape != kc.shape or scratch[0].dtype != kc.dtype:
            scratch = cache.tree_scratch = (torch.empty_like(kc), torch.empty_like(vc))
        kk, vk = scratch[0][:, :span], scratch[1][:, :span]
        kk.copy_(kc.index_select(1, idx))
        vk.copy_(vc.index_select(1, idx))
        return kk, vk

    # -- CUDA graphs ---------------------------------------------------------------------------
    def prepare(self, model, cache, up_to: int, layers=(), progress: bool = True) -> int:
        """Capture now, with a progress bar, ``cache``'s graphs of chain chunks at every key span a
        pass up to position ``up_to`` can read (otherwise each is captured on its first use); the
        padding rows' spare slot is all they write. Returns how many were captured."""
        if self.graphs_off:
            return 0
        cache.ensure_capacity(1)
        last = min(up_to, model.max_context) - 1
        spans = sorted({key_span(q, model.max_context) for q in [0, last] + [1 << i for i in range(last.bit_length())]})
        before, t0 = self.captures, self.capture_s
        ins = torch.zeros(3, ROW_BUCKET, dtype=torch.long, device="cpu")
        ins[2] = model.max_context
        with torch.inference_mode():
            for span in tqdm(spans, desc="capturing CUDA graphs", unit="graph", disable=not progress, leave=False):
                for want_logits in (True, False):
                    self._replay(model, cache, ins, span, tuple(layers), want_logits, ROW_BUCKET)
        log.info("%d CUDA graphs captured in %.1f s (key spans %s; a sequence's others on first use)",
                 self.captures - before, self.capture_s - t0, spans)
        return self.captures - before

    def _replay(self, model, cache, ins, span, layers, want_logits, n):
        """The chain chunk ``ins`` (on the CPU) through ``cache``'s graph of this shape, captured on
        first use; the first ``n`` rows of its outputs (copies: the buffers are the next replay's)."""
        key = (span, layers, want_logits)
        entry = cache.graphs.get(key)
        if entry is None:
            entry = cache.graphs[key] = self._capture(model, cache, ins, span, layers, want_logits)
        if entry is False:  # this shape failed to capture (counted in ``failures``): eager
            h, lg, ft = self.core(model, ins.to(model.device), span, layers, want_logits, cache)
            return h[:n], None if lg is None else lg[:n], None if ft is None else ft[:n]
        graph, static_in, outs = entry
        static_in.copy_(ins)  # one host-to-device copy: tokens, positions, slots
        graph.replay()
        self.replays += 1
        return tuple(None if o is None else o[:n].clone() for o in outs)

    def _capture(self, model, cache, ins, span, layers, want_logits):
        """A graph of ``core`` for one chain chunk shape on ``cache`` (replayed with new inputs;
        its outputs are static buffers, read before the next replay), captured on the shared
        stream into the shared pool. False where capture fails: recorded in ``failures``, logged
        as an error once per reason, and that shape runs eagerly."""
        static_in = ins.to(model.device)
        t0 = time.perf_counter()
        try:
            if self._stream is None:
                self._stream, self._pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):  # warm-up: lazy initialisations happen outside the capture
                self.core(model, static_in, span, layers, want_logits, cache)
            torch.cuda.current_stream().wait_stream(self._stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
                outs = self.core(model, static_in, span, layers, want_logits, cache)
        except Exception as e:  # noqa: BLE001 - recorded and reported; the pass still runs, eagerly
            why = f"{type(e).__name__}: {e}"
            if why not in self.failures:
                log.error("CUDA graph capture failed (%s): passes of this shape run eagerly", why)
            self.failures.append(why)
            return False
        torch.cuda.current_stream().wait_stream(self._stream)
        took = time.perf_counter() - t0
        if self.captures == 0:
            log.info("first CUDA graph (%d rows over %d keys) captured in %.0f ms; each sequence captures "
                     "its shapes once", ROW_BUCKET, span, took * 1e3)
        self.captures += 1
        self.capture_s += took
        return graph, static_in, outs
