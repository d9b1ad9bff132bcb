"""The interface the engine drives. Every model (target or draft) sits behind it.

A backend owns one sequence's KV cache. ``forward(tokens, pos)`` runs ``tokens`` at
positions ``pos .. pos + T - 1``, attending to cached positions ``0 .. pos - 1``;
afterwards the cache holds ``pos + T`` positions. Positions past ``pos`` that were
cached earlier (rejected drafts) are simply overwritten or dropped: rollback is
bookkeeping, see ``truncate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [T, vocab], float32
    hidden: torch.Tensor | None = None  # [T, hidden] last hidden state (pre-norm), when asked for
    layers: torch.Tensor | None = None  # [T, len(layers) * hidden] outputs of the asked-for layers


@dataclass
class ArgmaxOutput:
    """A verify pass's result from a backend's exact greedy path: the target's argmax at every row
    (no logits), and the outputs of the asked-for layers."""

    ids: torch.Tensor  # [T] int64
    layers: torch.Tensor | None = None
    logits: None = None


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond ``forward`` returning logits (see ``backends.base``)."""

    exact_argmax: bool = False  # argmax_forward(tokens, pos): the greedy token of every row, cheaper than logits
    argmax_features: bool = False  # ... with layers=: and the asked-for layers' outputs
    argmax_tree: bool = False  # ... with tree=: over a token tree
    lazy_tree_head: bool = False  # argmax_hidden(rows): greedy trees run the LM head on reached rows only
    token_trees: bool = False  # forward(tree=) and keep_rows(): token-tree verification
    batched: bool = False  # forward_batch(): several sequences in one pass
    draft_batch: bool = False  # forward_batch(head=, last_only=): a draft model's step for several sequences
    layer_skip: bool = False  # forward(skip_layers=): self-speculation
    kv_segments: bool = False  # kv_segment(start, end) / load_kv_segment(pos, seg): prompt prefixes reused exactly
    kv_any_pass: bool = False  # a position's keys and values have the same bits whichever pass computed them
    hidden_states: bool = False  # embed and layers=: the token embeddings and layer outputs trained heads read


class Backend(Protocol):
    vocab_size: int
    max_context: int
    num_layers: int
    device: torch.device

    @property
    def length(self) -> int:
        """Number of positions currently held in the KV cache."""

    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        pos: int,
        *,
        skip_layers: Sequence[int] = (),
        return_hidden: bool = False,
        last_only: bool = False,
        layers: Sequence[int] = (),
        logits: bool = True,
        tree: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Run tokens at positions pos..pos+T-1. ``last_only`` returns logits for the last position only.
        ``layers``: also return those layers' outputs at every position (trained draft heads read them).
        ``logits=False``: no LM head (``lazy_tree_head``: the hidden states only). ``tree``
        (``token_trees``): parents [T - 1] of rows 1.. (``forerun.tree``): rows sit at pos + depth
        and see only their ancestors."""

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""

    def reset(self) -> None:
        """Drop the whole cache (a new sequence starts)."""

    def fork(self) -> Backend:
        """A second backend over the same weights with its own empty cache."""

    # What a backend has where its ``capabilities`` say so (each flag names its methods):

    def argmax_forward(self, tokens: torch.Tensor, pos: int, layers: Sequence[int] = (),
                       tree: torch.Tensor | None = None) -> ArgmaxOutput:
        """``exact_argmax``: the greedy token [T] of every row, decided from that row alone
        (``ids``); with ``layers`` (``argmax_features``) also those layers' outputs (``layers``);
        with ``tree`` (``argmax_tree``) over a token tree."""

    def argmax_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """``lazy_tree_head``: greedy tokens of final normed hidden states, for the rows a tree
        walk reaches."""

    def keep_rows(self, pos: int, rows: Sequence[int]) -> None:
        """``token_trees``: after a tree pass at ``pos``, keep the cache rows of the accepted path."""

    def forward_batch(self, seqs: Sequence[Backend], feeds: Sequence[torch.Tensor], positions: Sequence[int],
                      layers: Sequence[int] = (), greedy: Sequence[bool] = (),
                      trees: Sequence[torch.Tensor | None] = ()) -> list:
        """``batched``: one pass over several sequences (forks of this backend); with ``trees``
        (``token_trees``), sequence i's rows 1.. form the token tree of parents ``trees[i]``;
        ``draft_batch``: also ``head=`` (a cut LM head, as ``forward``'s) and ``last_only=``."""

    def kv_segment(self, start: int, end: int):
        """``kv_segments``: the cache rows ``start:end``, to be loaded back by ``load_kv_segment``."""

    def load_kv_segment(self, pos: int, segment) -> None:
        """``kv_segments``: put a segment from ``kv_segment`` back at ``pos``."""

    @property
    def embed(self) -> torch.Tensor:
        """``hidden_states``: the token embeddings [vocab, hidden]."""


class BackendBase:
    """Shared bookkeeping for backends, and what a backend declares it can do beyond ``forward``:
    ``capabilities`` (the verify round, ``forerun.verify``, reads it)."""

    capabilities = Capabilities()

    def reserve(self, n: int) -> None:
        """Allocate the cache for ``n`` positions now, where the backend can (a server slot)."""

    def report(self) -> dict:
        """What this backend chose on this machine, for a benchmark's report: its threads, the
        kernels it picked by timing, whether its passes are batch-invariant, what its weights are."""
        return {}

    def warm_up(self, tokens: list[int], rows: int) -> None:
        """Before a timed run: settle what the backend picks by timing for passes of up to ``rows``
        rows (``tokens``: real text to run)."""

    def head_timings(self, rows: Sequence[int], reps: int, text: list[int] | None = None) -> dict | None:
        """Milliseconds of the LM head per row count and candidate kernel where the backend chooses
        between kernels (else None); ``text``: token ids to time the greedy head on."""
        return None


def check_forward(backend: Backend, tokens: torch.Tensor, pos: int) -> None:
    """A pass of ``tokens`` at ``pos`` on ``backend``: ValueError where ``pos`` is past the cached
    positions or the pass past the context limit."""
    if pos > backend.length:
        raise ValueError(f"forward at position {pos} but only {backend.length} positions are cached")
    if pos + tokens.numel() > backend.max_context:
        raise ValueError(f"position {pos + tokens.numel()} is past the context limit {backend.max_context}")
