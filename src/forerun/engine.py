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
from forerun.sampling import SamplingParams, greedy_accept, greedy_verify, logits_to_probs, rejection_sample
from forerun.stats import GenerationStats
from forerun.tree import greedy_tree_accept, greedy_tree_walk, sample_tree_accept


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
        policy = make_policy(k)
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(prompt)
        device = getattr(self.target, "device", torch.device("cpu"))
        generator = None if params.greedy else params.generator(device)
        t_start = time.perf_counter()

        # Prefill: everything but the last prompt token, which the first verify pass runs.
        target = self.target
        # Trained heads read the target's hidden states at some layers, sent after every pass.
        layers = tuple(getattr(self.drafter, "feature_layers", ()))
        fwd = {"layers": layers} if layers else {}
        fast_argmax = hasattr(target, "argmax_forward") and (not layers or getattr(target, "argmax_layers", False))
        target.reset()
        tokens = list(prompt)
        if self.drafter is not None:
            self.drafter.begin(tokens, params, generator)
        if len(tokens) > 1:
            passed = target.forward(torch.tensor(tokens[:-1], dtype=torch.long), 0, last_only=True, **fwd)
            if layers:
                self.drafter.take_features(0, passed.layers)
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
            if per_bucket and draft.bucket is not None:
                draft = clip_draft(draft, policy.choose(draft.bucket, len(draft)))
            t1 = time.perf_counter()

            # 2. Verify every draft position (and one more) in one target pass.
            tree = draft.parents  # a token tree: every node is verified, one path is kept
            if tree is not None and len(tokens) + len(draft) > limit:
                draft = _first_nodes(draft, limit - len(tokens))  # the pass needs a cache slot per node
                tree = draft.parents
            n_draft = draft.depth
            root = len(tokens) - 1
            feed = torch.cat([torch.tensor(tokens[-1:], dtype=torch.long), draft.tokens.cpu()])
            lazy_rows, head_rows, head_calls = None, len(feed), 1
            if params.greedy and tree is not None and getattr(target, "lazy_tree_head", False):
                # the LM head runs only on the rows the acceptance walk reaches
                logits = None
                passed = target.forward(feed, root, tree=tree, logits=False, return_hidden=True, **fwd)
                hidden, feats = passed.hidden, passed.layers
                head_calls = 0

                def head_argmax(rs):
                    nonlocal head_calls
                    head_calls += 1
                    return target.argmax_hidden(hidden[rs]).tolist()

                lazy_rows = greedy_tree_walk(draft.tokens, draft.parents, head_argmax, conf=draft.conf)
            elif params.greedy and fast_argmax and (tree is None or getattr(target, "argmax_tree", False)):
                # the backend gives exact argmaxes cheaper than logits
                logits = None
                tree_kw = {} if tree is None else {"tree": tree}
                if layers:  # the argmaxes and the features a trained head reads
                    target_ids, feats = target.argmax_forward(feed, root, layers=layers, **tree_kw)
                else:
                    target_ids = target.argmax_forward(feed, root, **tree_kw)  # [len(draft) + 1]
            else:
                passed = target.forward(feed, root, **fwd, **({} if tree is None else {"tree": tree}))
                logits, feats = passed.logits, passed.layers  # [len(draft) + 1, vocab]
            if device.type == "cuda":  # kernels run asynchronously: time the pass, not its launch
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()

            # 3. Accept: the longest agreeing prefix, plus a recovered or bonus token.
            rows = None
            if lazy_rows is not None:
                rows, out, head_rows = lazy_rows
                n_acc = len(rows)
            elif tree is not None and logits is None:
                rows, out = greedy_tree_accept(draft.tokens, draft.parents, target_ids.cpu())
                n_acc = len(rows)
            elif tree is not None:
                rows, out = self._accept_tree(draft, logits, params, generator)
                n_acc = len(rows)
            elif logits is None:
                out, n_acc = accept_argmax(draft, target_ids)
            else:
                out, n_acc = accept_chain(draft, logits, params, generator)
            new, n_acc, finish = commit_tokens(out, n_acc, self.eos, max_new_tokens - produced, limit - len(tokens))
            tokens.extend(new)
            produced += len(new)

            # 4. Roll back: the cache keeps the positions of accepted tokens only.
            kept = list(range(n_acc + 1)) if rows is None else [0] + rows[:n_acc]  # rows of the pass kept
            if rows is not None:
                target.keep_rows(root, rows[:n_acc])
            if layers:  # features of the positions kept: the last committed token and the accepted drafts
                self.drafter.take_features(root, feats[kept])
            target.truncate(len(tokens) - 1)
            if self.drafter is not None:
                self.drafter.accepted(tokens, n_acc)

            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.head_rows += head_rows
            stats.head_calls += head_calls
            stats.verified_rows += len(feed)
            stats.record_step(n_draft, n_acc)
            stats.new_tokens = produced
            policy.observe(n_draft, n_acc, t1 - t0, t2 - t1, bucket=draft.bucket if per_bucket else None)
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

    @staticmethod
    def _accept_tree(draft: Draft, logits: torch.Tensor, params: SamplingParams, generator):
        if params.greedy:
            return greedy_tree_accept(draft.tokens, draft.parents, logits.argmax(-1).cpu())
        return sample_tree_accept(draft.tokens, draft.parents, logits_to_probs(logits, params), generator)


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
    return Draft(tokens=draft.tokens[:k], q=None if draft.q is None else draft.q[:k], bucket=draft.bucket)


def _first_nodes(draft: Draft, n: int) -> Draft:
    """The tree's first ``n`` nodes (parents come first, so they form a tree)."""
    n = max(0, n)
    return Draft(tokens=draft.tokens[:n], q=None, bucket=draft.bucket, parents=draft.parents[:n],
                 conf=None if draft.conf is None else draft.conf[:n])
