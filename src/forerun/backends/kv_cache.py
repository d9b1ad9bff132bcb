"""One sequence's key/value cache on the native backend: one tensor per keys and values [layers,
kv heads, slots, head dim], written by position and rolled back by bookkeeping (the next pass
overwrites), a tree pass's accepted rows moved into place, segments copied out and back for shared
prompt prefixes. Beside it, what else belongs to the sequence: its CUDA graphs (they read this
cache) and a tree row's scratch keys (``fixed_rows``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    """The cache of one sequence over a ``NativeModel`` (its shapes, type and device)."""

    def __init__(self, model):
        self.model = model
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.cap = 0  # slots allocated
        self.length = 0  # positions held
        self.graphs: dict = {}  # this sequence's CUDA graphs (``fixed_rows``): they read this cache
        self.tree_scratch = None  # keys and values of a tree row, laid out for its pass (``fixed_rows``)

    def ensure_capacity(self, n: int) -> None:
        if n <= self.cap:
            return
        m = self.model
        if m.fixed is not None:  # whole at once (its strides never change), and a spare slot for padding rows
            cap = m.max_context + 1
        else:
            cap = max(256, self.cap)
            while cap < n:
                cap *= 2
            cap = min(cap, m.max_context)
        shape = (m.num_layers, m.n_kv_heads, cap, m.head_dim)
        k = torch.zeros(shape, dtype=m.kv_dtype, device=m.device)
        v = torch.zeros(shape, dtype=m.kv_dtype, device=m.device)
        if self.k is not None:
            k[:, :, : self.cap] = self.k
            v[:, :, : self.cap] = self.v
        self.k, self.v, self.cap = k, v, cap
        self.graphs = {}  # graphs captured on the old cache read the old cache

    def reserve(self, n: int) -> None:
        """Allocate the cache for ``n`` positions now (a server slot: memory stays flat afterwards)."""
        self.ensure_capacity(min(n, self.model.max_context))

    def truncate(self, length: int) -> None:
        # Static cache: positions past `length` are overwritten by the next forward.
        self.length = min(self.length, max(0, length))

    def segment(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the cached keys and values of positions start..end-1 (see ``load_segment``)."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"kv_segment({start}, {end}) but {self.length} positions are cached")
        return self.k[:, :, start:end].clone(), self.v[:, :, start:end].clone()

    @torch.inference_mode()  # the cache may have been grown in a forward pass (a draft model's, unreserved)
    def load_segment(self, pos: int, segment: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Put a ``segment`` back at positions pos..: the cache then holds exactly what the forward
        pass that made it left there (a prompt's prefix shared by an earlier request)."""
        k, v = segment
        n = k.shape[2]
        if pos > self.length or pos + n > self.model.max_context:
            raise ValueError(f"load_kv_segment at {pos} of {n} positions with {self.length} cached")
        self.ensure_capacity(pos + n)
        self.k[:, :, pos: pos + n] = k
        self.v[:, :, pos: pos + n] = v
        self.length = pos + n

    @torch.inference_mode()
    def keep_rows(self, pos: int, rows: Sequence[int]) -> None:
        """After a tree pass at ``pos``: move the kept rows (1-based, in path order) to the slots
        right after the root's, so the cache holds the accepted path only."""
        if rows:
            src = torch.tensor([pos + r for r in rows], device=self.k.device)
            n = len(rows)
            self.k[:, :, pos + 1 : pos + 1 + n] = self.k[:, :, src]
            self.v[:, :, pos + 1 : pos + 1 + n] = self.v[:, :, src]
        self.length = min(self.length, pos + 1 + len(rows))

    def store(self, idx: int, k: torch.Tensor, v: torch.Tensor, pos: int) -> None:
        """Keys and values k, v [T, kv_heads, D] of positions pos.. into layer ``idx``."""
        self.k[idx, :, pos: pos + k.shape[0]] = k.transpose(0, 1)
        self.v[idx, :, pos: pos + k.shape[0]] = v.transpose(0, 1)
