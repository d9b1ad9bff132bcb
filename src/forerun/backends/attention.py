"""Attention that computes every row as a one-token step at its position would (``attn_rows.c``):
each row over exactly the cache slots it sees, in an order fixed by those slots alone, and the
rows of several sequences of a batched pass in one call."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from forerun.backends.ckernels import kernel


def attn_rows_kernel():
    """The compiled ``attn_rows.c`` (see there), or None where it cannot be built (logged once)."""
    return kernel("attn_rows")


class RowKeys:
    """The cache slots each row of a pass attends to, in order: ``lo[t]``..``hi[t]``-1, then
    ``extra[xp[t]:xp[t+1]]`` (a tree row: its ancestors and itself). Exactly the slots a one-token
    step at that row's position sees once the row's path is the cache's content."""

    def __init__(self, lo, hi, extras=None):
        extras = extras or [[] for _ in range(len(lo))]
        self.rows = [(a, b, e) for a, b, e in zip(lo, hi, extras)]

    # int32 tensors for the C kernels, made on first use
    @functools.cached_property
    def lo(self) -> torch.Tensor:
        return torch.tensor([r[0] for r in self.rows], dtype=torch.int32, device="cpu")

    @functools.cached_property
    def hi(self) -> torch.Tensor:
        return torch.tensor([r[1] for r in self.rows], dtype=torch.int32, device="cpu")

    @functools.cached_property
    def xp(self) -> torch.Tensor:
        return torch.tensor([0] + [len(r[2]) for r in self.rows], dtype=torch.int32, device="cpu").cumsum(0, dtype=torch.int32)

    @functools.cached_property
    def extra(self) -> torch.Tensor:
        return torch.tensor([j for r in self.rows for j in r[2]] or [0], dtype=torch.int32, device="cpu")

    @classmethod
    def chain(cls, pos: int, T: int, window: int | None) -> RowKeys:
        ends = range(pos + 1, pos + T + 1)
        return cls([max(0, e - window) if window else 0 for e in ends], list(ends))

    def slots(self, t: int) -> torch.Tensor | tuple[int, int]:
        a, b, e = self.rows[t]
        return (a, b) if not e else torch.cat([torch.arange(a, b, device="cpu"), torch.tensor(e, dtype=torch.long, device="cpu")])

    def keys_values(self, t: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row t's keys and values [kv_heads, S_t, D] from one layer's cache k, v [kv_heads, cap, D]."""
        sel = self.slots(t)
        return (k[:, sel[0]: sel[1]], v[:, sel[0]: sel[1]]) if isinstance(sel, tuple) else (k[:, sel], v[:, sel])


class SequenceRows:
    """The rows of a batched pass over several sequences, for one ``attn_rows.c`` call per layer:
    every row's keys (``RowKeys`` joined), and where each row's sequence keeps its cache."""

    def __init__(self, caches: Sequence, keys: Sequence[RowKeys], positions: Sequence[int]):  # one KVCache a sequence
        """``positions``: where each sequence's rows start in its cache. Built from plain lists, one
        tensor per field: a one-token step spends little here."""
        pos, lo, hi, xp, extra, kb, vb, caps = [], [], [], [0], [], [], [], []
        for s, k, p in zip(caches, keys, positions):
            n = len(k.rows)
            pos += range(p, p + n)
            for a, b, e in k.rows:
                lo.append(a)
                hi.append(b)
                extra += e
                xp.append(xp[-1] + len(e))
            kb += [s.k.data_ptr()] * n
            vb += [s.v.data_ptr()] * n
            caps += [s.k.shape[2]] * n
        i32 = lambda v: torch.from_numpy(np.array(v, dtype=np.int32))  # noqa: E731  (numpy: cheaper than torch.tensor)
        i64 = lambda v: torch.from_numpy(np.array(v, dtype=np.int64))  # noqa: E731
        self.pos, self.lo, self.hi, self.xp, self.extra = i32(pos), i32(lo), i32(hi), i32(xp), i32(extra + [0])
        self.k_base, self.v_base, self.caps = i64(kb), i64(vb), i64(caps)
        _, self.kv_heads, _, D = caches[0].k.shape  # [layers, kv_heads, cap, D]
        self.layer_bytes = i64([c * self.kv_heads * D * 4 for c in caps])  # one layer of one cache, float32

    def store(self, k: torch.Tensor, v: torch.Tensor, idx: int) -> None:
        """Keys and values k, v [rows, kv_heads, D] of every row into layer ``idx`` of its own cache."""
        k, v = k.contiguous(), v.contiguous()
        kp = self.k_base + idx * self.layer_bytes  # held here: the kernel reads these addresses
        vp = self.v_base + idx * self.layer_bytes
        attn_rows_kernel().forerun_store_rows(k.data_ptr(), v.data_ptr(), kp.data_ptr(), vp.data_ptr(), self.caps.data_ptr(),
                                              self.pos.data_ptr(), k.shape[0], self.kv_heads, k.shape[2])

    def attend(self, q: torch.Tensor, idx: int, scale: float) -> torch.Tensor:
        """q [rows, heads, D] of every sequence against layer ``idx`` of each row's own cache."""
        T, H, D = q.shape
        lib = attn_rows_kernel()
        q = q.contiguous()
        out = torch.empty(T, H, D, dtype=torch.float32, device="cpu")
        kp = self.k_base + idx * self.layer_bytes
        vp = self.v_base + idx * self.layer_bytes
        lib.forerun_attn_threads(torch.get_num_threads())
        rc = lib.forerun_attn_rows_multi(q.data_ptr(), kp.data_ptr(), vp.data_ptr(), self.caps.data_ptr(), T, H,
                                         self.kv_heads, D, self.lo.data_ptr(), self.hi.data_ptr(), self.xp.data_ptr(),
                                         self.extra.data_ptr(), scale, out.data_ptr())
        if rc != 0:
            raise MemoryError("attn_rows: out of memory")
        return out.view(T, H * D)


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: RowKeys, scale: float) -> torch.Tensor:
    """Batch-invariant attention: q [T, heads, D] over one layer's cache k, v [kv_heads, cap, D],
    row t over ``keys``' slots for row t only; [T, heads * D]. ``attn_rows.c`` where it builds,
    else one PyTorch call per row (each row then as a one-token step computes it)."""
    T, H, D = q.shape
    lib = attn_rows_kernel()
    if lib is None or q.dtype != torch.float32 or q.device.type != "cpu":
        qt = q.transpose(0, 1)[None]
        outs = []
        for t in range(T):
            kk, vv = keys.keys_values(t, k, v)
            outs.append(F.scaled_dot_product_attention(qt[:, :, t: t + 1], kk[None], vv[None], scale=scale,
                                                       enable_gqa=H != k.shape[0]))
        return torch.cat(outs, 2)[0].transpose(0, 1).reshape(T, H * D)
    q = q.contiguous()
    out = torch.empty(T, H, D, dtype=torch.float32, device="cpu")
    lib.forerun_attn_threads(torch.get_num_threads())
    rc = lib.forerun_attn_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.shape[1], T, H, k.shape[0], D,
                               keys.lo.data_ptr(), keys.hi.data_ptr(), keys.xp.data_ptr(), keys.extra.data_ptr(),
                               scale, out.data_ptr())
    if rc != 0:
        raise MemoryError("attn_rows: out of memory")
    return out.view(T, H * D)


def cache_attention(model, cache, layer, idx: int, q, k, v, pos: int, mask_info) -> torch.Tensor:
    """Attention of rows q [T, heads, D] at pos.. over one sequence's ``cache`` (a ``KVCache``),
    after their keys and values k, v [T, kv_heads, D] (normed and rotated) join it; [T, heads * D],
    before the output projection. The library's fused kernel for prompt passes and backends that
    need not be batch-invariant; the batch-invariant one row by row (``attention_rows``)."""
    T, D = q.shape[0], model.head_dim
    end = pos + T
    cache.store(idx, k, v, pos)
    start, mask = mask_info[:2]
    if model.arch.attn_softcap:
        return _capped_attention(model, cache, q, idx, start, end, mask_info)
    if len(mask_info) > 2:  # batch-invariant: every row as a one-token step over its own keys
        return attention_rows(q, cache.k[idx], cache.v[idx], mask_info[2], model.scale)
    keys = cache.k[idx, :, start:end]  # [kv_heads, S, D]
    vals = cache.v[idx, :, start:end]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        vals[None],
        attn_mask=None if mask is None else mask[None, None],
        scale=model.scale,
        enable_gqa=model.n_heads != model.n_kv_heads,
    )  # [1, heads, T, D]
    return out[0].transpose(0, 1).reshape(T, model.n_heads * D)


def _capped_attention(model, cache, q, idx, start, end, mask_info):
    """Attention with Gemma 2's soft cap on the scores (cap * tanh(s / cap)), which the fused
    kernels lack: q [T, heads, D] -> [T, heads * D]. Batch-invariant passes take each row alone
    over its own keys (as a one-token step does)."""
    T, H, D = q.shape
    cap, group = model.arch.attn_softcap, model.n_heads // model.n_kv_heads
    k_all, v_all = cache.k[idx], cache.v[idx]

    def attend(qr, kk, vv, mask=None):  # qr [H, t, D], kk/vv [kv_heads, S, D]
        kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
        scores = torch.tanh((qr @ kk.transpose(1, 2)).float() * model.scale / cap) * cap
        if mask is not None:
            scores = scores.masked_fill(~mask[None], float("-inf"))
        return (scores.softmax(-1).to(vv.dtype) @ vv).transpose(0, 1)  # [t, H, D]

    qt = q.transpose(0, 1)
    if len(mask_info) > 2:
        keys = mask_info[2]
        outs = [attend(qt[:, t: t + 1], *keys.keys_values(t, k_all, v_all)) for t in range(T)]
        return torch.cat(outs).reshape(T, H * D)
    mask = mask_info[1]
    if mask is None:
        mask = torch.ones(T, end - start, dtype=torch.bool, device=q.device)
    return attend(qt, k_all[:, start:end], v_all[:, start:end], mask).reshape(T, H * D)
