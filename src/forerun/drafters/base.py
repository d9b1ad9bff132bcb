"""The drafter interface: every drafting method is one small class behind it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.sampling import SamplingParams
from forerun.tree import tree_depths


@dataclass
class Draft:
    tokens: torch.Tensor  # [k] int64, k may be smaller than asked (even 0)
    q: torch.Tensor | None = None  # [k, vocab] draft probs; None = deterministic (one-hot) proposals
    bucket: int | None = None  # how far to trust it (e.g. n-gram match length); adaptive K learns per bucket
    parents: torch.Tensor | None = None  # [k] a token tree (see forerun.tree); None: a chain
    # The drafter's estimate per token (a tree: per node) that the target accepts it once its
    # parent is reached (None: unknown). Trees: steers which rows a lazy greedy walk asks the LM
    # head for together (``forerun.tree.greedy_tree_walk``). Chains of cheap drafters: adaptive K
    # cuts the chain where it stops paying (``DraftLength.choose``). Acceptance itself
    # never reads it.
    conf: list[float] | None = None
    # Drafting steps the drafter ran for it, where that differs from its length (a draft model
    # that ran one more step and stopped, unsure of the token): what the policy charges per step.
    steps: int | None = None

    @property
    def depth(self) -> int:
        """Longest run of tokens the draft can add (its length for a chain)."""
        if self.parents is None:
            return len(self)

        return max(tree_depths(self.parents))

    def __len__(self) -> int:
        return int(self.tokens.numel())


class Drafter:
    """Proposes tokens that the target then verifies.

    Lifecycle for one generation: ``begin`` once, then per step ``propose`` followed by
    ``accepted`` with the verified outcome. ``tokens`` is always the whole committed
    sequence (prompt and output); its last token has not been run through the target yet.
    """

    name = "base"
    cheap_proposals = False  # True: proposing k_max tokens costs next to nothing, so adaptive K may cut after
    feature_layers: tuple = ()  # target layers whose outputs the drafter reads (take_features after every pass)
    # True: every round the drafter offers a token tree or a prompt-lookup chain (``lookup_chain``,
    # then ``propose`` builds the tree only if the draft-length policy chooses it)
    offers_tree_or_chain = False

    @property
    def proposes_trees(self) -> bool:
        """Whether ``propose`` may return a token tree (``Draft.parents``) rather than a chain."""
        return bool(getattr(self, "tree_nodes", None))

    def take_features(self, pos: int, features: torch.Tensor) -> None:
        """The outputs of ``feature_layers`` at positions pos.. that the target kept (trained heads)."""

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        self.params = params
        self.generator = generator

    def propose(self, tokens: list[int], k: int) -> Draft:
        raise NotImplementedError

    def lookup_chain(self, tokens: list[int], k: int) -> Draft:
        """(``offers_tree_or_chain``) this round's lookup chain, with its trust bucket and confidences."""
        raise NotImplementedError

    def tree_rows(self, chain_len: int) -> int:
        """(``offers_tree_or_chain``) the rows this round's tree would take in the verify pass."""
        raise NotImplementedError

    def unread(self, tokens: list[int]) -> int:
        """(drafters that cost per token) how many committed tokens ``catch_up`` would read now."""
        return 0

    def catch_up(self, tokens: list[int]) -> None:
        """Before a ``propose`` (drafters that cost per token): read what the drafter has not read
        of ``tokens`` yet, all but the last token, where that is more than a round's usual share (a
        prompt, a stretch without drafts). The decode step times it apart from drafting."""

    def share_prefixes(self, max_bytes: int) -> None:
        """(drafters with a model of their own) keep what the model computed for prompt prefixes, in
        ``max_bytes`` shared by this drafter and its later forks, so that a prompt that starts as an
        earlier one did (the earlier turns of a chat, a system prompt) is not read again from its
        start. Others: nothing to keep."""

    def finished(self, tokens: list[int]) -> None:
        """A sequence this drafter served ended with ``tokens`` committed (a request answered): keep
        what may serve a later prompt that starts with them (``share_prefixes``). Others: nothing."""

    def accepted(self, tokens: list[int], num_accepted: int) -> None:
        """Called after a verify pass; ``tokens`` now holds the accepted drafts and the new token."""

    def forget_history(self) -> None:
        """Drop what was learnt across earlier sequences (a benchmark's runs start afresh)."""

    def fork(self) -> Drafter:
        """A drafter of the same kind over the same weights with state (and caches) of its own:
        one per sequence when several are decoded together."""
        raise NotImplementedError(f"{type(self).__name__} cannot be forked")


def empty_draft() -> Draft:
    return Draft(tokens=torch.zeros(0, dtype=torch.long, device="cpu"))
