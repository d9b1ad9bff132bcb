"""The lookup branch of a head's token tree: a model-free chain offered beside (or grafted onto)
the head's tree.

Two sources, one interface (``begin``, ``chain``, ``accepted``, ``fork``):

* ``NgramLookup``: prompt lookup (``ngram.lookup_match``) in the request's own context; its
  per-token confidence is the chain's measured acceptance for the n-gram length that matched.
* ``SuffixLookup``: a ``SuffixDrafter`` chain (the longest match in the context and in earlier
  outputs, shared by every fork), with that drafter's learned per-token confidences.

``chain`` returns a ``Draft`` (tokens, trust bucket, ``conf``: the chance each token is taken once
every token before it was). ``accepted`` is called after every round, whether or not a chain was
offered or verified, with every committed token: both sources learn from what the target chose.
"""

from __future__ import annotations

import torch

from forerun.draft_length import Acceptance
from forerun.drafters.base import Draft
from forerun.drafters.ngram import lookup_match
from forerun.drafters.suffix import SuffixDrafter


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` begin with alike."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class NgramLookup:
    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # per n-gram length, how often the chain's tokens were taken: its offered confidence
        self.acc = Acceptance(decay=0.9, prior=(2.0, 2.0))
        self._offer = None  # (context length, chain, bucket) of this round

    def fork(self) -> NgramLookup:
        return NgramLookup(self.max_ngram, self.min_ngram)

    def begin(self, prompt, params, generator) -> None:
        self._offer = None

    def forget_history(self) -> None:
        """Nothing outlives a request here."""

    def rate(self, bucket: int) -> float:
        return self.acc.rate(bucket)

    def chain(self, tokens: list[int], k: int) -> Draft:
        chain, n = lookup_match(tokens, k, self.max_ngram, self.min_ngram)
        self._offer = (len(tokens), chain, n)
        return Draft(tokens=torch.tensor(chain, dtype=torch.long, device="cpu"), bucket=n, conf=[self.rate(n)] * len(chain))

    def accepted(self, tokens: list[int], num_accepted: int) -> None:
        offer, self._offer = self._offer, None
        if offer is not None and offer[1]:
            # How far the chain alone would have gone: the committed tokens are the target's own.
            base, chain, bucket = offer
            new = tokens[base:]
            self.acc.observe(bucket, common_prefix(chain, new), min(len(chain), len(new)))


class SuffixLookup:
    name = "suffix"

    def __init__(self, drafter=None):
        self.drafter = drafter if drafter is not None else SuffixDrafter()
        if self.drafter.tree_nodes:
            raise ValueError("the lookup branch is a chain: give a suffix drafter without tree_nodes")

    def fork(self) -> SuffixLookup:
        return SuffixLookup(self.drafter.fork())  # earlier outputs and their acceptance stay shared

    def begin(self, prompt, params, generator) -> None:
        self.drafter.begin(prompt, params, generator)

    def forget_history(self) -> None:
        """Drop the earlier outputs and what drafting from them was worth (e.g. after a warm-up)."""
        self.drafter.forget_history()

    def chain(self, tokens: list[int], k: int) -> Draft:
        return self.drafter.propose(tokens, k)

    def accepted(self, tokens: list[int], num_accepted: int) -> None:
        self.drafter.accepted(tokens, num_accepted)

