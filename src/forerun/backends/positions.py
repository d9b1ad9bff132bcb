"""Where a pass's rows sit: rotary tables for their positions, and the masks (or, on a
batch-invariant backend, the exact key slots) each row attends over, for chains and token trees."""

from __future__ import annotations

import torch

from forerun.backends.attention import RowKeys
from forerun.backends.linear import INVARIANT_ROWS
from forerun.tree import tree_layout


def rope(model, positions: torch.Tensor, start: int | None = None) -> dict:
    """Rotary cos and sin [T, head_dim] per attention type for ``positions`` (``start``: they
    are start, start + 1, ..., read as a slice). The integer path reads them from tables kept
    for every cached position (``rope_table``); the float path computes them as transformers does."""
    if model.quant is not None:
        tab = rope_table(model, int(positions.max()) + 1 if positions.numel() else 0)
        if start is not None:
            end = start + positions.numel()
            return {t: (c[start:end], s[start:end]) for t, (c, s) in tab.items()}
        return {t: (c[positions], s[positions]) for t, (c, s) in tab.items()}
    out = {}
    for t, inv in model.inv_freq.items():
        freqs = positions[:, None].float() * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        s = model.rope_scale[t]
        out[t] = ((emb.cos() * s).to(model.dtype), (emb.sin() * s).to(model.dtype))
    return out


def rope_table(model, n: int) -> dict:
    """cos and sin [>= n, head_dim] (float32) per attention type for positions 0.., shared with
    forks, grown by doubling: every row of every pass reads the same values for its position
    (one-token steps and verify passes alike). The angle is the float32 product transformers
    forms (position x inverse frequency); its cos and sin are taken in float64, then rounded."""
    tab = model.rope_tables
    have = next(iter(tab.values()))[0].shape[0] if tab else 0
    if n > have:
        size = max(256, 2 * have, n)
        pos = torch.arange(size, dtype=torch.float32, device="cpu")  # the table is made on the CPU (float64)
        for t, inv in model.inv_freq.items():
            freqs = (pos[:, None] * inv.cpu()[None, :]).double()
            emb = torch.cat((freqs, freqs), dim=-1)
            sc = model.rope_scale[t]
            tab[t] = ((emb.cos() * sc).float().contiguous(), (emb.sin() * sc).float().contiguous())
    return tab


def chain_masks(model, pos: int, T: int) -> dict:
    """Boolean masks [T, S] (True = attend) with the first key index, for full and sliding layers."""
    end = pos + T
    if model.quant is not None:  # the integer path reads each row's keys only
        start = max(0, pos - model.window + 1) if model.window else 0
        return {False: (0, None, RowKeys.chain(pos, T, None)), True: (start, None, RowKeys.chain(pos, T, model.window))}
    q = torch.arange(pos, end, device=model.device)[:, None]
    full_k = torch.arange(0, end, device=model.device)[None, :]
    full = None if T == 1 else (full_k <= q)
    start = max(0, pos - model.window + 1) if model.window else 0
    k = torch.arange(start, end, device=model.device)[None, :]
    sliding = (k <= q) & (k > q - model.window) if model.window else (k <= q)
    if T == 1 and bool(sliding.all()):
        sliding = None
    if (T <= INVARIANT_ROWS or model.quant is not None) and model.batch_invariant:  # each row: exactly the keys a one-token step sees
        return {False: (0, full, RowKeys.chain(pos, T, None)), True: (start, sliding, RowKeys.chain(pos, T, model.window))}
    return {False: (0, full), True: (start, sliding)}


def tree_masks(model, pos: int, parents: torch.Tensor):
    """Positions [T] and masks like ``chain_masks`` for a tree pass (keys: the prefix, then the rows)."""
    depth, anc = tree_layout(parents)
    T = depth.numel()
    dev = model.device
    qpos = (pos + depth).to(dev)
    kpos = torch.cat([torch.arange(pos, device=dev), qpos])
    seen = torch.cat([torch.ones(T, pos, dtype=torch.bool, device=dev), anc.to(dev)], 1)  # [T, pos + T]
    start = max(0, pos - model.window + 1) if model.window else 0
    sliding = seen
    if model.window:
        sliding = seen & (kpos[None, :] > qpos[:, None] - model.window)
    if (T <= INVARIANT_ROWS or model.quant is not None) and model.batch_invariant:  # the prefix, then the row's ancestors and itself
        rows = [r.nonzero().view(-1).tolist() for r in anc]  # each row's ancestors and itself, in row order
        dep = depth.tolist()
        w = model.window
        extras = [[pos + j for j in a] for a in rows]
        return qpos, {False: (0, seen, RowKeys([0] * T, [pos] * T, extras)),
                      True: (start, sliding[:, start:], RowKeys(
                          [min(pos, max(0, pos + dep[i] - w + 1)) if w else 0 for i in range(T)], [pos] * T,
                          [[pos + j for j in a if not w or dep[j] > dep[i] - w] for i, a in enumerate(rows)]))}
    return qpos, {False: (0, seen), True: (start, sliding[:, start:])}
