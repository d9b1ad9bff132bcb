"""One verify round, asked of a backend in one call: the single place where a draft meets the target.

The engine (one sequence) and the batch engine (many) both ask the same question through
``verify``, "verify these chains or trees, greedy or sampled, with or without the drafter's
feature layers", and get back what each accepted: one sequence on its own cache, several in one
batched pass. How the backend answers depends only on what it declares it can do
(``backends.base.Capabilities``, declared by every backend), never on probing it:

- greedy, a tree, ``lazy_tree_head``: one pass to the final hidden states, then the LM head only
  on the rows the acceptance walk reaches (``tree.greedy_tree_walk``);
- greedy, ``exact_argmax`` (with ``argmax_tree`` for trees and ``argmax_features`` when features
  are wanted): the backend's exact argmax at every row, no logits;
- otherwise: float32 logits at every row, then greedy or rejection-sampling acceptance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from forerun.backends.base import Backend, Capabilities
from forerun.drafters.base import Draft
from forerun.sampling import (
    SamplingParams,
    SeededNoise,
    greedy_accept,
    greedy_verify,
    logits_to_probs,
    rejection_sample,
)
from forerun.tree import greedy_tree_accept, greedy_tree_walk, sample_tree_accept, tree_depths


@dataclass
class Verdict:
    """What one verify round accepted."""

    tokens: list[int]  # the accepted drafts, then the target's own token (and possibly more, unused)
    accepted: int  # drafts accepted
    rows: list[int] | None  # trees: the pass rows of the accepted path, in order (None for chains)
    features: torch.Tensor | None  # the asked-for layers' outputs at every row of the pass
    head_rows: int  # rows the LM head ran on
    head_calls: int  # LM head calls


def kept_rows(path: list[int] | None, accepted: int) -> list[int]:
    """The pass rows kept after ``accepted`` drafts: 0.. for a chain (``path`` None), else the root
    and the first ``accepted`` rows of a tree's accepted ``path``."""
    return list(range(accepted + 1)) if path is None else [0] + path[:accepted]


def feed_of(last_token: int, draft: Draft) -> torch.Tensor:
    """The rows of a verify pass: the last committed token, then the draft."""
    return torch.cat([torch.tensor([last_token], dtype=torch.long, device="cpu"), draft.tokens.cpu()])


@dataclass
class Check:
    """One sequence's question for a verify round: its ``draft`` after ``last_token``, run at
    positions ``root``.. on ``backend`` (the sequence's own cache), accepted under ``params``."""

    backend: Backend
    draft: Draft
    last_token: int
    root: int
    params: SamplingParams
    generator: torch.Generator | None = None
    # structured output: the tokens a grammar allows at each row of the pass [rows, vocab], or a
    # call that gives them once the pass is done (computed meanwhile); None: every token
    masks: torch.Tensor | Callable[[], torch.Tensor] | None = None

    @property
    def greedy_pass(self) -> bool:
        """Whether the pass may answer with argmaxes alone (a grammar needs every row's logits)."""
        return self.params.greedy and self.masks is None


def verify(target, checks: list[Check], layers: tuple = ()) -> list[Verdict]:
    """The verdicts on one sequence's draft or many, in one target pass: a lone sequence on its
    own cache (with the greedy fast paths: the lazy tree head, the exact argmax), several in one
    batched pass of ``target`` (``forward_batch``, needing ``capabilities.batched``)."""
    if len(checks) == 1:
        return [_verify_one(checks[0], layers)]
    if not target.capabilities.batched:
        raise ValueError(f"{type(target).__name__} verifies one sequence per pass, not {len(checks)}")
    feeds = [feed_of(c.last_token, c.draft) for c in checks]
    trees = [c.draft.parents for c in checks]
    tree_kw = {"trees": trees} if any(x is not None for x in trees) else {}
    layer_kw = {"layers": layers} if layers else {}
    outs = target.forward_batch([c.backend for c in checks], feeds, [c.root for c in checks],
                                greedy=[c.greedy_pass for c in checks], **layer_kw, **tree_kw)
    return [judge(c.draft, out, c.params, c.generator, c.root, c.masks) for c, out in zip(checks, outs)]


def _verify_one(c: Check, layers: tuple) -> Verdict:
    backend, draft = c.backend, c.draft
    caps: Capabilities = backend.capabilities
    feed = feed_of(c.last_token, draft)
    tree = draft.parents
    layer_kw = {"layers": layers} if layers else {}
    if c.greedy_pass and tree is not None and caps.lazy_tree_head:
        passed = backend.forward(feed, c.root, tree=tree, logits=False, return_hidden=True, **layer_kw)
        hidden, calls = passed.hidden, [0]

        def head_argmax(rs):
            calls[0] += 1
            return backend.argmax_hidden(hidden[rs]).tolist()

        rows, out, head_rows = greedy_tree_walk(draft.tokens, draft.parents, head_argmax, conf=draft.conf)
        return Verdict(out, len(rows), rows, passed.layers, head_rows, calls[0])
    return judge(draft, pass_outputs(backend, feed, c.root, greedy=c.greedy_pass, layers=layers, tree=tree),
                 c.params, c.generator, c.root, c.masks)


def judge(draft: Draft, out, params: SamplingParams, generator=None, root: int = 0,
          masks: torch.Tensor | Callable[[], torch.Tensor] | None = None) -> Verdict:
    """The verdict on ``draft`` from one pass's outputs over its rows (the LM head ran on all of
    them; row 0 at position ``root``). ``masks``: the tokens a grammar allows at each row; the
    rest get no probability (and are never an argmax) before acceptance."""
    if masks is not None:
        out = masked(out, masks() if callable(masks) else masks)
    rows, tokens, n = accept(draft, out, params, generator, root)
    return Verdict(tokens, n, rows, out.layers, len(draft) + 1, 1)


def masked(out, masks: torch.Tensor):
    """A pass's outputs with every token a row's mask forbids at -inf in its logits."""
    if out.logits is None:
        raise ValueError("a constrained row needs its logits, not an argmax")
    logits = out.logits.float()
    width = min(logits.shape[-1], masks.shape[-1])
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    keep[..., :width] = masks[: logits.shape[0], :width].to(logits.device)
    return replace(out, logits=logits.masked_fill(~keep, float("-inf")))


def uses_argmax(caps: Capabilities, greedy: bool, layers: tuple = (), tree: torch.Tensor | None = None) -> bool:
    """Whether a pass with these needs takes the backend's exact argmax instead of logits."""
    return (greedy and caps.exact_argmax and (not layers or caps.argmax_features)
            and (tree is None or caps.argmax_tree))


def pass_outputs(backend, feed: torch.Tensor, root: int, *, greedy: bool, layers: tuple = (),
                 tree: torch.Tensor | None = None):
    """One verify pass without acceptance: an ``ArgmaxOutput`` where the backend's exact argmax
    serves (greedy), else a ``ForwardOutput`` with logits."""
    tree_kw = {} if tree is None else {"tree": tree}
    if uses_argmax(backend.capabilities, greedy, layers, tree):
        return backend.argmax_forward(feed, root, **({"layers": layers} if layers else {}), **tree_kw)
    return backend.forward(feed, root, **({"layers": layers} if layers else {}), **tree_kw)


def accept(draft: Draft, out, params: SamplingParams, generator=None, root: int = 0
           ) -> tuple[list[int] | None, list[int], int]:
    """Acceptance of ``draft`` against a pass's outputs (argmaxes or logits): (tree rows of the
    accepted path or None for a chain, tokens, drafts accepted). A seeded sequence
    (``generator`` a ``SeededNoise``) keeps a drafted token when it equals the target's own
    sample at its position: the row at depth j (row 0 at ``root``) predicts the token at
    root + 1 + j."""
    if isinstance(generator, SeededNoise) and not params.greedy:
        depth = range(len(draft) + 1) if draft.parents is None else tree_depths(draft.parents)
        targets = generator.samples(logits_to_probs(out.logits, params), [root + 1 + d for d in depth])
        if draft.parents is not None:
            rows, toks = greedy_tree_accept(draft.tokens, draft.parents, targets)
            return rows, toks, len(rows)
        return (None, *accept_argmax(draft, targets))
    if draft.parents is not None:
        if out.logits is None:
            rows, toks = greedy_tree_accept(draft.tokens, draft.parents, out.ids.cpu())
        elif params.greedy:
            rows, toks = greedy_tree_accept(draft.tokens, draft.parents, out.logits.argmax(-1).cpu())
        else:
            rows, toks = sample_tree_accept(draft.tokens, draft.parents, logits_to_probs(out.logits, params), generator)
        return rows, toks, len(rows)
    if out.logits is None:
        return (None, *accept_argmax(draft, out.ids))
    return (None, *accept_chain(draft, out.logits, params, generator))


def accept_chain(draft: Draft, logits: torch.Tensor, params: SamplingParams, generator) -> tuple[list[int], int]:
    """Verify a chain draft against the target's logits [k + 1, vocab]: (tokens, accepted drafts)."""
    k = len(draft)
    d = draft.tokens.to(logits.device)[None]  # [1, k]
    if params.greedy:
        out, n = greedy_verify(d, logits[None])
    else:
        p = logits_to_probs(logits, params)[None]  # [1, k + 1, vocab]
        if draft.q is not None:
            q = draft.q.to(p.device)[None]
        else:  # deterministic drafter: q is one-hot on its proposal
            q = torch.zeros_like(p[:, :k]).scatter_(-1, d[..., None], 1.0)
        out, n = rejection_sample(d, q, p, generator)
    return out[0].tolist(), int(n[0])


def accept_argmax(draft: Draft, target_ids: torch.Tensor) -> tuple[list[int], int]:
    """Verify a chain draft greedily against the target's argmax at every position [k + 1]."""
    if len(draft) == 0:  # plain decoding: the target's token
        return [int(target_ids[0])], 0
    out, n = greedy_accept(draft.tokens[None].cpu(), target_ids[None].cpu())
    return out[0].tolist(), int(n[0])
