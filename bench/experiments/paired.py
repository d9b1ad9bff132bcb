"""What the paired experiments share (``byte_codes.py``, ``prefetch_level.py``): every prompt decoded
by every method under two settings of the kernels, the order alternating prompt by prompt, each
output checked equal across the settings, then the target's verify passes of 1..8 rows timed after
each prompt under both (3 rounds)."""

from __future__ import annotations

import time

import torch


def paired_runs(engines: dict, methods: list[str], ids: list[list[int]], setting, settings: tuple, backend,
                max_new_tokens: int, ref: str) -> tuple[dict, dict]:
    """``setting(s)`` switches to ``s`` (one of the two ``settings``). Returns ``res[(s, method)] =
    [tokens, seconds]`` and ``passes[(s, n)] = [seconds, ...]``; the passes run on each prompt
    followed by method ``ref``'s output, its last 8 tokens fed."""
    from forerun.sampling import SamplingParams

    res = {(s, m): [0, 0.0] for s in settings for m in methods}
    passes = {(s, n): [] for s in settings for n in range(1, 9)}
    outs = {}
    for i, p in enumerate(ids):
        order = settings if i % 2 == 0 else settings[::-1]
        for s in order:
            setting(s)
            for m in methods:
                t0 = time.perf_counter()
                r = engines[m].generate(p, max_new_tokens=max_new_tokens, params=SamplingParams(), k="auto")
                res[(s, m)][0] += len(r.token_ids)
                res[(s, m)][1] += time.perf_counter() - t0
                outs.setdefault((i, m), r.token_ids)
                assert r.token_ids == outs[(i, m)], f"prompt {i} {m}: the output differs between settings"
        ctx = torch.tensor(p + outs[(i, ref)])[:-8]
        backend.reset()
        backend.forward(ctx, 0, last_only=True)
        feed = torch.tensor(outs[(i, ref)][-8:])
        for _ in range(3):
            for s in order:
                setting(s)
                for n in range(1, 9):
                    backend.truncate(len(ctx))
                    t0 = time.perf_counter()
                    backend.argmax_forward(feed[:n], len(ctx))
                    passes[(s, n)].append(time.perf_counter() - t0)
        print(f"prompt {i + 1}/{len(ids)} done", flush=True)
    return res, passes
