"""Timing a backend's forward pass the same way everywhere (bench, calibration)."""

from __future__ import annotations

import time

import torch


def median_s(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn()``, after one untimed call (kernel choice, allocation)."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2]


def median_forward_s(backend, ids: torch.Tensor, n: int, reps: int = 7, method: str = "forward", **forward_kw) -> float:
    """Median seconds of a forward over the last ``n`` of ``ids``, the rest already cached.

    The cache is filled once (logits for the last position only, so the prefill does not
    stream a [T, vocab] product through the caches) and rolled back before every run; one
    untimed run first absorbs one-off work (kernel choice, allocation).
    """
    ctx = len(ids) - n
    backend.reset()
    if ctx > 0:
        backend.forward(ids[:ctx], 0, last_only=True)
    cuda = getattr(backend, "device", torch.device("cpu")).type == "cuda"
    times = []
    for i in range(reps + 1):
        backend.truncate(ctx)
        t = time.perf_counter()
        (method if callable(method) else getattr(backend, method))(ids[ctx:], ctx, **forward_kw)
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    backend.reset()
    return sorted(times)[reps // 2]
