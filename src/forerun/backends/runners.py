"""The native model's layers over the rows of a pass, two ways with one signature,
``runner(model, h, parts, skip, layers) -> (h, layer outputs)``:

- ``float_rows``: the torch path (float32 or half precision), the decoder layer of ``arch``
  given this path's norm, products, rotation and attention;
- ``integer_rows``: the integer path, every layer of every row in one ``qrows.c`` call.

``parts``: per sequence, in row order, a ``Part`` (its cache, where its rows start, how many, its
rotary tables and masks; see ``NativeModel.run_rows``). Fixed-shape passes (``fixed_rows``) run
whole chunks of their own, embedding and LM head included."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from forerun.backends.arch import add_bias, decoder_layer, rotate_half
from forerun.backends.attention import SequenceRows, attn_rows_kernel, cache_attention
from forerun.backends.kv_cache import KVCache
from forerun.backends.linear import ROWS_ANY
from forerun.backends.qweights import KIND, QPassC, qrows_lib


class Part(NamedTuple):
    """One sequence's rows in a pass."""

    cache: KVCache
    pos: int  # the position of its first row
    rows: int
    rope: dict  # per attention type: (cos, sin) [rows, head_dim]
    masks: dict  # per sliding (bool): (first key, mask or None[, RowKeys]) (``positions``)


def float_rows(model, h, parts, skip, layers):
    """The layers over the rows ``h`` [rows, hidden] of one or more sequences on the torch path.
    Linear layers run on every row at once; attention runs per sequence on its own cache (or, with
    several sequences and every row batch-invariant, in one ``attn_rows.c`` call per layer).
    Returns the last hidden states and the asked-for layers' outputs (or None)."""
    want = {l: None for l in layers}
    how = model.body_kernel
    if len(parts) > 1 and model.batch_invariant:
        how = ROWS_ANY
    ropes = _joined_ropes(parts)
    D, n_all = model.head_dim, h.shape[0]
    joined = None
    if (len(parts) > 1 and not model.arch.attn_softcap and model.dtype == torch.float32 and model.device.type == "cpu"
            and attn_rows_kernel() is not None and all(len(p.masks[sl]) > 2 for p in parts for sl in p.masks)):
        joined = {sl: SequenceRows([p.cache for p in parts], [p.masks[sl][2] for p in parts], [p.pos for p in parts])
                  for sl in parts[0].masks}

    def linear(lin, x, bias):
        return add_bias(lin(x, how), bias)

    def qkv(i, layer, t):
        q = t[:, : layer.n_q].view(n_all, model.n_heads, D)
        k = t[:, layer.n_q : layer.n_q + layer.n_kv].view(n_all, model.n_kv_heads, D)
        v = t[:, layer.n_q + layer.n_kv :].view(n_all, model.n_kv_heads, D)
        if layer.q_norm is not None:
            q = model.norm(q, layer.q_norm)
            k = model.norm(k, layer.k_norm)
        kind = "sliding_attention" if layer.sliding else "full_attention"
        cos, sin = ropes[kind] if kind in ropes else next(iter(ropes.values()))
        c, s = cos[:, None, :], sin[:, None, :]
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v

    def attend(i, layer, q, k, v):
        if joined is not None:
            rows = joined[layer.sliding]
            rows.store(k, v, i)
            return rows.attend(q, i, model.scale)
        outs, r = [], 0
        for p in parts:
            T = p.rows
            outs.append(cache_attention(model, p.cache, layer, i, q[r: r + T], k[r: r + T], v[r: r + T], p.pos,
                                        p.masks[layer.sliding]))
            r += T
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    for i, layer in enumerate(model.layers):
        if i in skip:
            continue
        h = decoder_layer(i, layer, h, model.arch.sandwich, model.norm, linear, qkv, attend)
        if i in want:
            want[i] = h
    return h, (torch.cat([want[l] for l in layers], -1) if layers else None)


def integer_rows(model, h, parts, skip, layers):
    """``float_rows`` on the integer path: one ``forerun_q_layers`` call for every layer and every
    row of every sequence (norms, products, rotary embeddings, the cache writes and attention in C)."""
    lib = qrows_lib()
    lib.forerun_q_threads(torch.get_num_threads())
    kinds = {KIND[kind]: tabs for kind, tabs in _joined_ropes(parts).items()}
    ps = QPassC()
    ps.N, ps.hidden, ps.H, ps.KVH, ps.D = h.shape[0], model.hidden_size, model.n_heads, model.n_kv_heads, model.head_dim
    ps.eps, ps.scale, ps.softcap = model.eps, model.scale, model.arch.attn_softcap or 0.0
    caches, starts = [p.cache for p in parts], [p.pos for p in parts]
    rows = {False: SequenceRows(caches, [p.masks[False][2] for p in parts], starts)}
    same = all(p.masks[True][2].rows == p.masks[False][2].rows for p in parts)  # no sliding window reaches back that far
    rows[True] = rows[False] if same else SequenceRows(caches, [p.masks[True][2] for p in parts], starts)
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
    kinds_kv = {c.k.dtype for c in caches}
    if len(kinds_kv) != 1:  # one flag tells the kernels how every sequence's cache is stored
        raise ValueError(f"a batched pass over caches of different types: {sorted(map(str, kinds_kv))}")
    ps.kv_f16 = int(kinds_kv.pop() == torch.float16)
    h = h.to(torch.float32).contiguous().clone()
    n = len(model.quant)
    want = {l: torch.empty_like(h) for l in layers}
    keep_at = (ctypes.c_void_p * n)(*[want[i].data_ptr() if i in want else None for i in range(n)]) if want else None
    skips = (ctypes.c_uint8 * n)(*[i in skip for i in range(n)]) if skip else None
    if lib.forerun_q_layers(model.qlayers, n, skips, keep_at, ctypes.byref(ps), h.data_ptr()) != 0:
        raise MemoryError("qrows: out of memory in a layer")
    return h, (torch.cat([want[l] for l in layers], -1) if layers else None)


def _joined_ropes(parts) -> dict:
    """Rotary tables of every row of the pass, per attention type: rows rotate all at once
    (elementwise, so each row's values do not depend on the others)."""
    return {kind: tuple(torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*(p.rope[kind] for p in parts)))
            for kind in parts[0].rope}
