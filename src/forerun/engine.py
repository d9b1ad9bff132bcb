"""One sequence at a time: ``Engine.generate`` / ``Engine.stream`` drive the decode step
(``forerun.decode``) with a batch of one, on the target's own cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from forerun.backends.ckernels import release_threads
from forerun.decode import Decoder, Sequence, check_request
from forerun.draft_length import LONGEST_DRAFT, DraftLength
from forerun.drafters.base import Drafter
from forerun.errors import OptionError
from forerun.sampling import SamplingParams
from forerun.stats import GenerationStats


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
        raise OptionError("{k} must be an integer in 1..{most} or 'auto', got {got}", most=LONGEST_DRAFT,
                          got=repr(k)) from None
    if not 1 <= k <= LONGEST_DRAFT:
        raise OptionError("{k} must be in 1..{most} or 'auto', got {got}", most=LONGEST_DRAFT, got=k)
    return k


class Engine:
    def __init__(self, target, drafter: Drafter | None = None, eos_token_ids=()):
        self.target = target  # a Backend
        self.drafter = drafter
        # the last request's draft-length policy: the next one starts from its measured costs
        self.policy = DraftLength()
        self.decoder = Decoder(target, drafter, eos_token_ids, self.policy)
        self.eos = self.decoder.eos

    def stream(
        self,
        prompt: list[int],
        *,
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        k: int | str = 4,
        stats: GenerationStats | None = None,
        grammar=None,
    ) -> Iterator[StepOutput]:
        """Yield the tokens committed by each step; ``stats`` is filled in as it goes. ``grammar``:
        a ``forerun.constrain.TokenGrammar`` every new token keeps to (structured output)."""
        check_request(prompt, max_new_tokens, self.target, grammar)
        k = check_k(k) if self.drafter is not None else 1
        self.policy = self.decoder.policy = self.policy.renewed(k)
        seq = Sequence(list(prompt), max_new_tokens, self.target, self.drafter, params,
                       stats if stats is not None else GenerationStats(),
                       constraint=grammar.start() if grammar is not None else None)
        self.decoder.start(seq)
        try:
            while True:
                (out,) = self.decoder.step([seq])
                yield StepOutput(tokens=out.tokens, finish_reason=out.finish)
                if out.finish is not None:
                    return
        finally:  # another thread may drive the model next (ckernels.release_threads)
            release_threads()

    def generate(self, prompt: list[int], **kw) -> GenerationResult:
        stats = GenerationStats()
        out: list[int] = []
        finish = "length"
        for step in self.stream(prompt, stats=stats, **kw):
            out.extend(step.tokens)
            finish = step.finish_reason or finish
        return GenerationResult(token_ids=out, stats=stats, finish_reason=finish)
