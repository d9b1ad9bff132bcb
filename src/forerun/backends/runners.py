"""The native model's passes: three runners with one signature,

    runner(model, caches, feeds, positions, trees=(), skip=(), layers=(), finish="logits",
           last_only=False) -> Rows

``feeds[i]`` runs at ``positions[i]`` on ``caches[i]`` (a token tree where ``trees[i]`` gives its
rows' parents), layers ``skip`` left out; ``finish`` says how far a pass goes after the layers:
``none`` (a prompt's pass: the layers' outputs only), ``hidden`` (final normed hidden states) or
``logits`` (and the model's own LM head); ``last_only`` keeps each sequence's last row.

- ``float_rows``: the torch path (float32 or half precision), the decoder layer of ``arch`` given
  this path's norm, products, rotation and attention over each sequence's cache;
- ``integer_rows``: the integer path, every layer of every row in one ``qrows.c`` call;
- ``fixed_rows.fixed_chunks``: fixed-shape chunks of 16 rows, embedding to LM head (what a CUDA
  graph captures), for GPUs and half precision; no layer skipping there.

``NativeModel.run_rows`` picks the runner for a pass."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from forerun.backends.arch import add_bias, decoder_layer, rotate_half
from forerun.backends.attention import SequenceRows, attn_rows_kernel, cache_attention
from forerun.backends.kv_cache import KVCache
from forerun.backends.linear import ROWS_ANY
from forerun.backends.positions import chain_masks, rope, tree_masks
from forerun.backends.qweights import KIND, QPassC, qrows_lib


class Part(NamedTuple):
    """One sequence's rows in a pass."""

    cache: KVCache
    pos: int  # the position of its first row
    rows: int
    rope: dict  # per attention type: (cos, sin) [rows, head_dim]
    masks: dict  # per sliding (bool): (first key, mask or None[, RowKeys]) (``positions``)


class Rows(NamedTuple):
    """What a runner gives back."""

    hidden: torch.Tensor | None  # final normed hidden states [rows, hidden] (with last_only: each sequence's last)
    logits: torch.Tensor | None  # float32 logits of those rows from the model's LM head
    layers: torch.Tensor | None  # the asked-for layers' outputs at every row [rows, len(layers) * hidden]


def float_rows(model, caches, feeds, positions, trees=(), skip=(), layers=(), finish: str = "logits",
               last_only: bool = False) -> Rows:
    """The torch path's runner (see the module's docstring)."""
    return _run(model, _float_layers, caches, feeds, positions, trees, skip, layers, finish, last_only)


def integer_rows(model, caches, feeds, positions, trees=(), skip=(), layers=(), finish: str = "logits",
                 last_only: bool = False) -> Rows:
    """The integer path's runner (see the module's docstring)."""
    return _run(model, _integer_layers, caches, feeds, positions, trees, skip, layers, finish, last_only)


def check_trees(feeds, trees) -> None:
    """ValueError where a token tree's parents are not one fewer than its feed's rows (row 0 is
    the root); before any cache is touched."""
    for feed, tree in zip(feeds, trees):
        if tree is not None and tree.numel() != feed.numel() - 1:
            raise ValueError(f"a tree of {tree.numel()} parents for a feed of {feed.numel()} rows")


def _run(model, body, caches, feeds, positions, trees, skip, layers, finish, last_only) -> Rows:
    """Each sequence's rows as a ``Part``, all rows embedded into one matrix, the layers (``body``),
    then the final norm and the LM head as ``finish`` asks; each cache then holds its rows."""
    check_trees(feeds, trees)
    parts, ids = [], []
    for i, (cache, feed, pos) in enumerate(zip(caches, feeds, positions)):
        T = feed.numel()
        cache.ensure_capacity(pos + T)
        tree = trees[i] if i < len(trees) else None
        if tree is None:
            part = Part(cache, pos, T, rope(model, torch.arange(pos, pos + T, device=model.device), pos),
                        chain_masks(model, pos, T))
        else:
            qpos, masks = tree_masks(model, pos, tree)
            part = Part(cache, pos, T, rope(model, qpos), masks)
        parts.append(part)
        ids.append(feed.to(model.device))
    h = model.embeddings(torch.cat(ids) if len(ids) > 1 else ids[0]) * model.embed_scale  # [rows, hidden]
    h, feats = body(model, h, parts, set(skip), layers)
    for p in parts:
        p.cache.length = p.pos + p.rows
    if finish == "none":
        return Rows(None, None, feats)
    if last_only:
        h = h[-1:] if len(parts) == 1 else torch.cat([x[-1:] for x in h.split([p.rows for p in parts])])
    h = model.norm(h, model.final_norm)
    return Rows(h, model.lm_logits(h, batched=len(parts) > 1) if finish == "logits" else None, feats)


def _float_layers(model, h, parts, skip, layers):
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


def _integer_layers(model, h, parts, skip, layers):
    """``_float_layers`` on the integer path: one ``forerun_q_layers`` call for every layer and every
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
