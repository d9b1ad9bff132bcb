"""The native backend's key/value cache: one tensor per keys and values [layers, kv heads, slots,
head dim], written by position and rolled back by bookkeeping (the next pass overwrites), a tree
pass's accepted rows moved into place, segments copied out and back for shared prompt prefixes."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    """Cache methods of ``NativeBackend`` (its ``_cap``, ``_len``, ``k_cache``, ``v_cache``)."""

    @property
    def length(self) -> int:
        return self._len

    @property
    def kv_dtype(self) -> torch.dtype:
        """The cache's type: float16 on the integer path (its kernels widen each value exactly), else
        the model's."""
        return torch.float16 if self.quant is not None else self.dtype

    def ensure_capacity(self, n: int) -> None:
        if n <= self._cap:
            return
        if self._fixed is not None:  # whole at once (its strides never change), and a spare slot for padding rows
            cap = self.max_context + 1
        else:
            cap = max(256, self._cap)
            while cap < n:
                cap *= 2
            cap = min(cap, self.max_context)
        shape = (self.num_layers, self.n_kv_heads, cap, self.head_dim)
        k = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        if self.k_cache is not None:
            k[:, :, : self._cap] = self.k_cache
            v[:, :, : self._cap] = self.v_cache
        self.k_cache, self.v_cache, self._cap = k, v, cap
        self.graphs = {}  # graphs captured on the old cache read the old cache

    def reserve(self, n: int) -> None:
        """Allocate the cache for ``n`` positions now (a server slot: memory stays flat afterwards)."""
        self.ensure_capacity(min(n, self.max_context))

    def truncate(self, length: int) -> None:
        # Static cache: positions past `length` are overwritten by the next forward.
        self._len = min(self._len, max(0, length))

    def reset(self) -> None:
        self._len = 0

    def kv_segment(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the cached keys and values of positions start..end-1 (see ``load_kv_segment``)."""
        if not 0 <= start <= end <= self._len:
            raise ValueError(f"kv_segment({start}, {end}) but {self._len} positions are cached")
        return self.k_cache[:, :, start:end].clone(), self.v_cache[:, :, start:end].clone()

    def load_kv_segment(self, pos: int, segment: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Put a ``kv_segment`` back at positions pos..: the cache then holds exactly what the
        forward pass that made it left there (a prompt's prefix shared by an earlier request)."""
        k, v = segment
        n = k.shape[2]
        if pos > self._len or pos + n > self.max_context:
            raise ValueError(f"load_kv_segment at {pos} of {n} positions with {self._len} cached")
        self.ensure_capacity(pos + n)
        self.k_cache[:, :, pos: pos + n] = k
        self.v_cache[:, :, pos: pos + n] = v
        self._len = pos + n

    @torch.inference_mode()
    def keep_rows(self, pos: int, rows: Sequence[int]) -> None:
        """After a tree pass at ``pos``: move the kept rows (1-based, in path order) to the slots
        right after the root's, so the cache holds the accepted path only."""
        if rows:
            src = torch.tensor([pos + r for r in rows], device=self.device)
            n = len(rows)
            self.k_cache[:, :, pos + 1 : pos + 1 + n] = self.k_cache[:, :, src]
            self.v_cache[:, :, pos + 1 : pos + 1 + n] = self.v_cache[:, :, src]
        self._len = min(self._len, pos + 1 + len(rows))

    def _store(self, idx: int, k: torch.Tensor, v: torch.Tensor, pos: int) -> None:
        """Keys and values k, v [T, kv_heads, D] of positions pos.. into layer ``idx`` of the cache."""
        self.k_cache[idx, :, pos: pos + k.shape[0]] = k.transpose(0, 1)
        self.v_cache[idx, :, pos: pos + k.shape[0]] = v.transpose(0, 1)
