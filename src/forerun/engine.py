"""The speculative decoding loop, written once for every drafter and backend.

Invariant between steps: ``tokens`` holds the committed sequence; the target's KV cache
holds every position except the last token, which is run at the start of the next verify
pass together with the drafts. Plain decoding is the same loop with an empty draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from forerun.draft_length import MAX_K, AdaptiveK, make_policy
from forerun.drafters.base import Draft, Drafter, empty_draft
from forerun.errors import ForerunError
from forerun.prefix_cache import prefill
from forerun.sampling import SamplingParams
from forerun.stats import GenerationStats
from forerun.verify import verify


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS), "length" (max_new_tokens) or "context" (context limit)
    text: str = ""


@dataclass
class StepOutput:
    tokens: list[int]  # tokens committed by this step
    finish_reason: str | None


def check_k(k) -> int | str:
    if k == "auto":
        return k
    try:
        k = int(k)
    except (TypeError, ValueError):
        raise ForerunError(f"--k must be an integer in 1..{MAX_K} or 'auto', got {k!r}") from None
    if not 1 <= k <= MAX_K:
        raise ForerunError(f"--k must be in 1..{MAX_K} or 'auto', got {k}")
    return k


class Engine:
    def __init__(self, target, drafter: Drafter | None = None, eos_token_ids=()):
        self.target = target  # a Backend
        self.drafter = drafter
        self.eos = set(int(i) for i in eos_token_ids)
        self.policy = None  # the last request's draft-length policy: the next one starts from its measured costs

    def stream(
        self,
        prompt: list[int],
        *,
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        k: int | str = 4,
        stats: GenerationStats | None = None,
    ) -> Iterator[StepOutput]:
        """Yield the tokens committed by each step; ``stats`` is filled in as it goes."""
        if not prompt:
            raise ForerunError("empty prompt")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ForerunError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = self.target.max_context
        if len(prompt) >= limit:
            raise ForerunError(f"prompt is {len(prompt)} tokens; the context limit is {limit} (room for at least one new token is needed)")
        k = check_k(k) if self.drafter is not None else 1
        policy = self.policy = make_policy(k, self.policy)
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(prompt)
        device = getattr(self.target, "device", torch.device("cpu"))
        generator = None if params.greedy else params.generator(device)
        t_start = time.perf_counter()

        # Prefill: everything but the last prompt token, which the first verify pass runs.
        target = self.target
        # Trained heads read the target's hidden states at some layers, sent after every pass.
        layers = tuple(self.drafter.feature_layers) if self.drafter is not None else ()
        target.reset()
        tokens = list(prompt)
        if self.drafter is not None:
            self.drafter.begin(tokens, params, generator)
        prefill(target, tokens[:-1], layers, self.drafter.take_features if layers else None)
        stats.prefill_s = time.perf_counter() - t_start

        # Drafts that cost nothing to propose at full length are cut per trust bucket afterwards.
        per_bucket = self.drafter is not None and self.drafter.cheap_proposals and isinstance(policy, AdaptiveK)
        produced = 0
        while True:
            # Never overshoot max_new_tokens or the context, even mid-draft.
            room = min(max_new_tokens - produced, limit - len(tokens))
            if per_bucket:  # propose at full length, then keep what pays for this draft's trust bucket
                want = min(policy.k_max, room - 1)
            else:
                want = 0 if self.drafter is None else min(policy.next_k(), room - 1)

            # 1. Draft.
            t0 = time.perf_counter()
            draft = self.drafter.propose(tokens, want) if want > 0 else empty_draft()
            draft = clip_draft(draft, want)
            if per_bucket and draft.parents is None:  # a tree's size is the drafter's
                if draft.conf is not None:  # the drafter's own per-token estimates
                    draft = clip_draft(draft, policy.choose_by_confidence(draft.conf))
                elif draft.bucket is not None:
                    draft = clip_draft(draft, policy.choose(draft.bucket, len(draft)))
            t1 = time.perf_counter()

            # 2. Verify every draft position (and one more) in one target pass, and 3. accept: the
            # longest agreeing prefix, plus a recovered or bonus token.
            if draft.parents is not None and len(tokens) + len(draft) > limit:
                draft = first_nodes(draft, limit - len(tokens))  # the pass needs a cache slot per node
            n_draft = draft.depth
            root = len(tokens) - 1
            verdict = verify(target, draft, tokens[-1], root, params, generator, layers)
            if device.type == "cuda":  # kernels run asynchronously: time the pass, not its launch
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            new, n_acc, finish = commit_tokens(verdict.tokens, verdict.accepted, self.eos, max_new_tokens - produced,
                                               limit - len(tokens))
            tokens.extend(new)
            produced += len(new)

            # 4. Roll back: the cache keeps the positions of accepted tokens only.
            verdict.accepted = n_acc  # an EOS inside the accepted run ends it there
            if verdict.rows is not None:
                target.keep_rows(root, verdict.rows[:n_acc])
            if layers:  # features of the positions kept: the last committed token and the accepted drafts
                self.drafter.take_features(root, verdict.features[verdict.kept_rows])
            target.truncate(len(tokens) - 1)
            if self.drafter is not None:
                self.drafter.accepted(tokens, n_acc)

            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.head_rows += verdict.head_rows
            stats.head_calls += verdict.head_calls
            stats.verified_rows += len(draft) + 1
            stats.record_step(n_draft, n_acc)
            stats.new_tokens = produced
            policy.observe(n_draft, n_acc, t1 - t0, t2 - t1,
                           bucket=draft.bucket if per_bucket and draft.conf is None else None)
            stats.wall_s = time.perf_counter() - t_start
            yield StepOutput(tokens=new, finish_reason=finish)
            if finish is not None:
                return

    def generate(self, prompt: list[int], **kw) -> GenerationResult:
        stats = GenerationStats()
        out: list[int] = []
        finish = "length"
        for step in self.stream(prompt, stats=stats, **kw):
            out.extend(step.tokens)
            finish = step.finish_reason or finish
        return GenerationResult(token_ids=out, stats=stats, finish_reason=finish)


def commit_tokens(out: list[int], n_acc: int, eos: set[int], left_new: int, left_context: int
                  ) -> tuple[list[int], int, str | None]:
    """What a step commits: the accepted drafts plus one token, cut after an EOS inside the run.
    ``left_new`` / ``left_context``: room left under max_new_tokens / the context limit before
    this step. Returns (tokens, accepted drafts among them, finish reason: "stop" (EOS),
    "length", "context" or None)."""
    new = out[: n_acc + 1]
    for i, tok in enumerate(new):
        if tok in eos:
            return new[: i + 1], min(n_acc, i), "stop"
    if len(new) >= left_new:
        return new, n_acc, "length"
    return new, n_acc, "context" if len(new) >= left_context else None


def clip_draft(draft: Draft, k: int) -> Draft:
    if draft.parents is not None:  # a tree's depth is bounded by the drafter itself
        if draft.depth > k:
            raise ForerunError(f"drafter returned a tree of depth {draft.depth}, more than the {k} asked for")
        return draft
    if len(draft) <= k:
        return draft
    return Draft(tokens=draft.tokens[:k], q=None if draft.q is None else draft.q[:k], bucket=draft.bucket,
                 conf=None if draft.conf is None else draft.conf[:k])


def first_nodes(draft: Draft, n: int) -> Draft:
    """The tree's first ``n`` nodes (parents come first, so they form a tree)."""
    n = max(0, n)
    return Draft(tokens=draft.tokens[:n], q=None, bucket=draft.bucket, parents=draft.parents[:n],
                 conf=None if draft.conf is None else draft.conf[:n])
