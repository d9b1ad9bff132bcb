"""Fixed-shape passes: the native forward on a GPU (and for half-precision weights on the CPU),
lossless by construction in any dtype.

A GPU's matrix and attention kernels sum in an order that depends on the shapes they are given, so
a row computed in a pass of 5 rows can differ in its last bits from the same row computed alone,
and in bfloat16 that flips near-tied greedy tokens. Here every pass of up to ``MAX_ROWS`` rows (a
one-token step, a verify chain or token tree, a batched pass over several sequences) runs in the
same shapes whatever its size:

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
one after another into shared chunks, each row writing and reading its own sequence's cache. On CUDA, a chunk of chain rows is a
captured graph, replayed (``CUDA_GRAPHS``): one launch instead of a few hundred per pass.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from forerun.backends.arch import add_bias, rotate_half
from forerun.tree import tree_layout

log = logging.getLogger("forerun")

ROW_BUCKET = 16  # rows of every product
MAX_ROWS = 64  # longer passes (prompts) take the library kernels, for every method alike
MIN_KEYS = 256
FIXED_DEFAULT_CONTEXT = 16384  # positions cached when the caller names no context (the cache is allocated whole)
CUDA_GRAPHS = True  # replay captured graphs of chain chunks on CUDA


def key_span(position: int, limit: int) -> int:
    """The slots a row at ``position`` attends over: the smallest power of two above it (at least
    ``MIN_KEYS``), at most ``limit`` (the model's context)."""
    return min(limit, max(MIN_KEYS, 1 << int(position).bit_length()))


def _linear(lin, x: torch.Tensor, bias) -> torch.Tensor:
    return add_bias(F.linear(x, lin.weight), bias)  # the library product at this chunk's fixed shape


class FixedRows:
    """The fixed-shape passes of one ``NativeBackend`` and its forks (graphs are per cache)."""

    def __init__(self, be):
        self.graphs: dict = {}  # (cache address, key span, layers, logits) -> (graph, inputs, outputs)
        self.graphs_off = not (CUDA_GRAPHS and be.device.type == "cuda")
        self.captures = 0

    # -- passes ------------------------------------------------------------------------------
    @staticmethod
    def _rows(seq, pos: int, T: int, tree) -> list[tuple]:
        """A pass's rows: (position, slot written, key map or None, sequence's backend)."""
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

    def forward(self, be, tokens: torch.Tensor, pos: int, tree, layers, want_logits: bool):
        """Final normed hidden states [T, hidden], float32 logits [T, vocab] (or None) and the
        outputs of ``layers`` [T, len(layers) * hidden] (or None) of a pass at ``pos``."""
        return self._run(be, tokens, self._rows(be, pos, tokens.numel(), tree), tuple(layers), want_logits)

    def forward_batch(self, be, seqs, feeds, positions, trees, layers, want_logits: bool) -> list[tuple]:
        """One pass over several sequences (forks of ``be``): their rows one after another, in
        chunks that may hold rows of several sequences (the products read each weight once per
        chunk); each sequence's rows write and read its own cache. Per sequence, as ``forward``."""
        rows, sizes = [], []
        for i, (seq, feed, pos) in enumerate(zip(seqs, feeds, positions)):
            rows += self._rows(seq, pos, feed.numel(), trees[i] if i < len(trees) else None)
            sizes.append(feed.numel())
        tokens = torch.cat([f.to(be.device) for f in feeds])
        outs = self._run(be, tokens, rows, tuple(layers), want_logits)
        split = [x.split(sizes) if x is not None else [None] * len(sizes) for x in outs]
        return list(zip(*split))

    def _run(self, be, tokens, rows, layers, want_logits):
        hs, logits, feats = [], [], []
        for c in range(0, len(rows), ROW_BUCKET):
            h, lg, ft = self._chunk(be, tokens[c: c + ROW_BUCKET], rows[c: c + ROW_BUCKET], layers, want_logits)
            hs.append(h)
            logits.append(lg)
            feats.append(ft)
        cat = lambda xs: None if xs[0] is None else torch.cat(xs)  # noqa: E731
        return cat(hs), cat(logits), cat(feats)

    def _chunk(self, be, tokens, rows, layers, want_logits):
        n, B, dev = len(rows), ROW_BUCKET, be.device
        limit = be.max_context
        spans = {key_span(r[0], limit) for r in rows}
        tok = torch.zeros(B, dtype=torch.long, device=dev)
        tok[:n] = tokens
        p = torch.zeros(B, dtype=torch.long, device="cpu")
        p[:n] = torch.tensor([r[0] for r in rows], device="cpu")
        p = p.to(dev)
        seq = rows[0][3]
        one_chain = all(r[2] is None and r[3] is seq for r in rows) and len(spans) == 1
        if one_chain and not self.graphs_off:
            slot = torch.full((B,), limit, dtype=torch.long, device="cpu")  # padding rows: the spare slot
            slot[:n] = torch.tensor([r[1] for r in rows], device="cpu")
            h, lg, ft = self._replay(seq, tok, p, slot.to(dev), spans.pop(), layers, want_logits)
        else:
            h, lg, ft = self.core(be, tok, p, None, rows, layers, want_logits)
        return h[:n], None if lg is None else lg[:n], None if ft is None else ft[:n]

    def core(self, be, tok, p, slot, rows, layers, want_logits):
        """The layers over one chunk of ``ROW_BUCKET`` rows (static shapes: what a graph captures).
        ``rows``: an int, the one key span of a chain chunk of ``be``'s own rows whose cache slots
        are ``slot``; or per real row (position, slot, key map or None, sequence's backend)."""
        B, D, H, KVH = ROW_BUCKET, be.head_dim, be.n_heads, be.n_kv_heads
        limit = be.max_context
        if isinstance(rows, int):
            writes = [(be, slot)]
            groups = {(be, rows, None): None}  # every row: one key span, keys in cache order
        else:
            writes = []  # per sequence: where each row's keys and values go (other rows: the spare slot)
            for seq in dict.fromkeys(r[3] for r in rows):
                sl = torch.full((B,), limit, dtype=torch.long, device="cpu")
                for j, r in enumerate(rows):
                    if r[3] is seq:
                        sl[j] = r[1]
                writes.append((seq, sl.to(be.device)))
            groups = {}  # rows of a sequence sharing a key span attend together; a tree row alone
            for j, (pos_j, _, path, seq) in enumerate(rows):
                groups.setdefault((seq, key_span(pos_j, limit), None if path is None else j), []).append(j)
        keys_at = torch.arange(limit, device=be.device)
        h = be._embeddings(tok) * be.embed_scale
        ropes = be._rope(p)  # elementwise per row, as the float path rotates
        want = {}
        for i, layer in enumerate(be.layers):
            x = be._norm(h, layer.norms[0])
            qkv = _linear(layer.qkv, x, layer.qkv_bias)
            q = qkv[:, : layer.n_q].view(B, H, D)
            k = qkv[:, layer.n_q: layer.n_q + layer.n_kv].view(B, KVH, D)
            v = qkv[:, layer.n_q + layer.n_kv:].view(B, KVH, D)
            if layer.q_norm is not None:
                q, k = be._norm(q, layer.q_norm), be._norm(k, layer.k_norm)
            kind = "sliding_attention" if layer.sliding else "full_attention"
            cos, sin = ropes[kind] if kind in ropes else next(iter(ropes.values()))
            c, s = cos[:, None, :], sin[:, None, :]
            q = q * c + rotate_half(q) * s
            k = k * c + rotate_half(k) * s
            for seq, sl in writes:  # [kv_heads, slots, D] per layer
                seq.k_cache[i].index_copy_(1, sl, k.transpose(0, 1))
                seq.v_cache[i].index_copy_(1, sl, v.transpose(0, 1))
            window = be.window if layer.sliding else None
            att = None
            for (seq, span, tree_row), members in groups.items():
                kc, vc = seq.k_cache[i], seq.v_cache[i]
                if tree_row is None:
                    out = self._attend(be, q, kc[:, :span], vc[:, :span], p, keys_at[:span], window)
                else:  # the row's keys laid out as a one-token step at its position reads them
                    kk, vk = self._gathered(seq, kc, vc, rows[tree_row], span)
                    out = self._attend(be, q, kk, vk, p, keys_at[:span], window)
                if members is None or len(groups) == 1:
                    att = out
                else:
                    att = torch.zeros_like(out) if att is None else att
                    att[members] = out[members]
            x = _linear(layer.o, att, layer.o_bias)
            if be.arch.sandwich:
                h = h + be._norm(x, layer.norms[1])
                x = be._norm(h, layer.norms[2])
            else:
                h = h + x
                x = be._norm(h, layer.norms[1])
            gu = _linear(layer.gate_up, x, layer.gate_up_bias)
            x = _linear(layer.down, layer.act(gu[:, : layer.inter]) * gu[:, layer.inter:], layer.down_bias)
            h = h + (be._norm(x, layer.norms[3]) if be.arch.sandwich else x)
            if i in layers:
                want[i] = h
        hn = be._norm(h, be.final_norm)
        logits = be._logits(hn) if want_logits else None
        return hn, logits, (torch.cat([want[l] for l in layers], -1) if layers else None)

    @staticmethod
    def _attend(be, q, kk, vv, p, keys, window):
        """q [B, heads, D] over keys kk, vv [kv_heads, L, D]: slot j visible to row b when j <= p[b]
        (and j > p[b] - window); [B, heads * D]."""
        B, H, D = q.shape
        KVH = kk.shape[0]
        g = H // KVH
        qg = q.view(B, KVH, g, D).permute(1, 2, 0, 3).reshape(KVH, g * B, D)
        scores = torch.matmul(qg, kk.transpose(1, 2)).float() * be.scale  # [kv_heads, g * B, L]
        if be.arch.attn_softcap:
            cap = be.arch.attn_softcap
            scores = torch.tanh(scores / cap) * cap
        seen = keys[None, :] <= p[:, None]  # [B, L]
        if window:
            seen = seen & (keys[None, :] > p[:, None] - window)
        scores = scores.view(KVH, g, B, -1).masked_fill(~seen[None, None], float("-inf"))
        w = torch.softmax(scores, -1).to(vv.dtype).view(KVH, g * B, -1)
        out = torch.matmul(w, vv)  # [kv_heads, g * B, D]
        return out.view(KVH, g, B, D).permute(2, 0, 1, 3).reshape(B, H * D)

    @staticmethod
    def _gathered(be, kc, vc, row, span):
        """A tree row's keys and values in a scratch buffer shaped like the cache: slot s < pos is
        cache slot s, slot pos + d is its ancestor at depth d; the rest masked (slot 0)."""
        position, _, path, _ = row
        pos = position - (len(path) - 1)
        idx = torch.zeros(span, dtype=torch.long, device="cpu")
        idx[:pos] = torch.arange(pos, device="cpu")
        idx[pos: pos + len(path)] = torch.tensor(path, device="cpu")
        idx = idx.to(be.device)
        scratch = be._tree_scratch
        if scratch is None or scratch[0].shape != kc.shape or scratch[0].dtype != kc.dtype:
            scratch = be._tree_scratch = (torch.empty_like(kc), torch.empty_like(vc))
        kk, vk = scratch[0][:, :span], scratch[1][:, :span]
        kk.copy_(kc.index_select(1, idx))
        vk.copy_(vc.index_select(1, idx))
        return kk, vk

    # -- CUDA graphs ---------------------------------------------------------------------------
    def prepare(self, be, up_to: int, layers=(), progress: bool = True) -> int:
        """Capture now, with a progress bar, the graphs of chain chunks at every key span a pass
        up to position ``up_to`` can read (otherwise each is captured on its first use); the
        padding rows' spare slot is all they write. Returns how many were captured."""
        if self.graphs_off:
            return 0
        be._ensure_capacity(1)
        last = min(up_to, be.max_context) - 1
        spans = sorted({key_span(q, be.max_context) for q in [0, last] + [1 << i for i in range(last.bit_length())]})
        before = self.captures
        dev, B = be.device, ROW_BUCKET
        tok = torch.zeros(B, dtype=torch.long, device=dev)
        p = torch.zeros(B, dtype=torch.long, device=dev)
        slot = torch.full((B,), be.max_context, dtype=torch.long, device=dev)
        with torch.inference_mode():
            for span in tqdm(spans, desc="capturing CUDA graphs", unit="graph", disable=not progress, leave=False):
                for want_logits in (True, False):
                    self._replay(be, tok, p, slot, span, tuple(layers), want_logits)
        return self.captures - before

    def _replay(self, be, tok, p, slot, span, layers, want_logits):
        key = (be.k_cache.data_ptr(), span, layers, want_logits)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(be, tok, p, slot, span, layers, want_logits)
        if entry is False:  # capture failed once: eager from now on for this shape
            return self.core(be, tok, p, slot, span, layers, want_logits)
        graph, (t_in, p_in, s_in), outs = entry
        t_in.copy_(tok)
        p_in.copy_(p)
        s_in.copy_(slot)
        graph.replay()
        return tuple(None if o is None else o.clone() for o in outs)  # the buffers are the next replay's

    def _capture(self, be, tok, p, slot, span, layers, want_logits):
        """A graph of ``core`` for one chain chunk shape (replayed with new inputs; its outputs are
        static buffers, read before the next replay). False where capture fails (logged once)."""
        ins = (tok.clone(), p.clone(), slot.clone())
        t0 = time.perf_counter()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: lazy initialisations happen outside the capture
                self.core(be, *ins, span, layers, want_logits)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = self.core(be, *ins, span, layers, want_logits)
        except Exception as e:  # noqa: BLE001 - a graph is an optimisation: fall back to eager
            log.warning("CUDA graph capture failed (%s: %s): this pass shape runs eagerly", type(e).__name__, e)
            return False
        self.captures += 1
        log.info("CUDA graph of a %d-row pass over %d keys captured in %.0f ms (once per cache and shape)",
                 ROW_BUCKET, span, (time.perf_counter() - t0) * 1e3)
        return graph, ins, outs
