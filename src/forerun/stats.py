"""Statistics of one generation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_passes: int = 0  # verify passes after the prefill (each also yields one target token)
    drafted: int = 0
    accepted: int = 0
    head_rows: int = 0  # rows of the verify passes that went through the target's LM head
    head_calls: int = 0  # LM-head calls those rows took (a lazy greedy tree walk may take several per pass)
    verified_rows: int = 0  # rows of the verify passes (draft tokens or tree nodes, plus one each)
    rejections: int = 0  # verify passes whose draft had a token rejected (the rest of it went untested)
    # structured output: tokens a grammar forced, verified as a draft no drafter made (not in drafted)
    forced: int = 0
    forced_accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    k_history: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    read_s: float = 0.0  # of draft_s: a draft model reading what it had not read (a prompt, a stretch without drafts)
    verify_s: float = 0.0

    def record_forced(self, k: int, n_accepted: int) -> None:
        self.target_passes += 1
        self.forced += k
        self.forced_accepted += n_accepted

    def record_step(self, k: int, n_accepted: int) -> None:
        self.target_passes += 1
        self.drafted += k
        self.accepted += n_accepted
        self.rejections += n_accepted < k
        self.k_history.append(k)
        while len(self.drafted_per_position) < k:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(k):
            self.drafted_per_position[i] += 1
            if i < n_accepted:
                self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance as in Leviathan et al.'s i.i.d. model, estimated from the drafts that
        were tested: accepted / (accepted + rejections). Drafts after a rejected one are never
        checked, so ``acceptance_rate`` (accepted / drafted) undercounts it."""
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """tau: tokens produced per target verify pass (accepted drafts + 1)."""
        return (self.accepted + self.target_passes) / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("k_history")
        d.update(
            acceptance_rate=self.acceptance_rate,
            alpha=self.alpha,
            mean_accepted_len=self.mean_accepted_len,
            tokens_per_s=self.tokens_per_s,
            acceptance_per_position=self.acceptance_per_position,
            other_s=self.other_s,
            mean_k=sum(self.k_history) / len(self.k_history) if self.k_history else 0.0,
        )
        return d
