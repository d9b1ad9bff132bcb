"""Prompt lookup: continue the most recent earlier occurrence of the last n tokens."""

from __future__ import annotations

import torch

from forerun.drafters.base import Draft, Drafter


class NgramDrafter(Drafter):
    name = "ngram"
    cheap_proposals = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.max_ngram, self.min_ngram)

    def propose(self, tokens: list[int], k: int) -> Draft:
        follow, n = lookup_match(tokens, k, self.max_ngram, self.min_ngram)
        # A longer matched suffix is a far better predictor (measured on Spec-Bench: first-token
        # acceptance ~0.4 after a 1-token match, ~0.9 after a 4-token one): it is the trust bucket.
        return Draft(tokens=torch.tensor(follow, dtype=torch.long, device="cpu"), bucket=n)


def lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Tokens that followed the latest earlier match of the longest suffix (max_ngram down to min_ngram)."""
    return lookup_match(tokens, k, max_ngram, min_ngram)[0]


def lookup_match(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """``lookup`` and the length of the suffix that matched (0: no match)."""
    n_tok = len(tokens)
    if k <= 0:
        return [], 0
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n :]
        first = suffix[0]
        # Scan right to left so the most recent occurrence wins; the suffix itself is excluded.
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow, n
    return [], 0
