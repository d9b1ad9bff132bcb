"""Prompt lookup: continue the most recent earlier occurrence of the last n tokens."""

from __future__ import annotations

import torch

from forerun.drafters.base import Draft, Drafter


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, tokens: list[int], k: int) -> Draft:
        return Draft(tokens=torch.tensor(lookup(tokens, k, self.max_ngram, self.min_ngram), dtype=torch.long))


def lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Tokens that followed the latest earlier match of the longest suffix (max_ngram down to min_ngram)."""
    n_tok = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n :]
        first = suffix[0]
        # Scan right to left so the most recent occurrence wins; the suffix itself is excluded.
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []
