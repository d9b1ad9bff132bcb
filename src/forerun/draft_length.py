"""Draft length K: fixed, or chosen each step from measured acceptance and measured cost."""

from __future__ import annotations

MAX_K = 32


class FixedK:
    def __init__(self, k: int):
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, k: int, accepted: int, draft_s: float, verify_s: float, bucket: int | None = None) -> None:
        pass


class AdaptiveK:
    """Pick K maximising expected tokens per second under the Leviathan et al. model.

    With per-token acceptance a, a step drafting k tokens yields (1 - a^(k+1)) / (1 - a)
    tokens and costs k * c_draft + c_verify(k). a is estimated as accepted / (accepted +
    rejections) with exponential forgetting (the maximum-likelihood estimate for geometric
    acceptance runs cut off at k); c_draft is the measured time per drafted token and
    c_verify(k) a line a + b*k fitted to measured verify passes. K = 0 (plain decoding) is
    allowed when nothing pays; a probe at K = 1 every few steps keeps the estimates fresh.

    Drafters that say how much to trust each proposal (``Draft.bucket``, e.g. the length of
    the n-gram that matched) get one acceptance estimate per bucket: the draft is proposed
    at full length, then cut to the K that pays for that bucket (``choose``).
    """

    def __init__(self, k_min: int = 0, k_max: int = 16, k_start: int = 4, decay: float = 0.9, probe_every: int = 8):
        self.k_min, self.k_max = k_min, k_max
        self.k = k_start
        self.k_start = k_start
        self.decay = decay
        self.probe_every = probe_every
        self.acc = 2.0  # prior: acceptance 0.5 (2 accepted per 2 rejections)
        self.rej = 2.0
        self.buckets: dict[int, list[float]] = {}  # bucket -> [accepted, rejections, steps chosen at zero]
        self.draft_cost = None  # seconds per drafted token
        self.verify = {}  # k -> EMA seconds of a verify pass over k + 1 tokens
        self.steps_at_zero = 0

    def observe(self, k: int, accepted: int, draft_s: float, verify_s: float, bucket: int | None = None) -> None:
        if k > 0:
            missed = 1 if accepted < k else 0
            self.acc = self.decay * self.acc + accepted
            self.rej = self.decay * self.rej + missed
            if bucket is not None:
                b = self.buckets.setdefault(bucket, [2.0, 2.0, 0])
                b[0] = self.decay * b[0] + accepted
                b[1] = self.decay * b[1] + missed
            per_tok = draft_s / k
            self.draft_cost = per_tok if self.draft_cost is None else 0.8 * self.draft_cost + 0.2 * per_tok
        old = self.verify.get(k)
        self.verify[k] = verify_s if old is None else 0.8 * old + 0.2 * verify_s
        self.k = self._choose(self.acc, self.rej)

    def _verify_cost(self, k: int) -> float:
        if k in self.verify:
            return self.verify[k]
        ks = sorted(self.verify)
        if len(ks) >= 2:  # least-squares line through the measured points
            n = len(ks)
            mx = sum(ks) / n
            my = sum(self.verify[x] for x in ks) / n
            sxx = sum((x - mx) ** 2 for x in ks)
            b = sum((x - mx) * (self.verify[x] - my) for x in ks) / sxx if sxx else 0.0
            return max(my + b * (k - mx), min(self.verify.values()))
        return self.verify[ks[0]]  # one point only: assume flat until measured

    def _choose(self, acc: float, rej: float, k_max: int | None = None) -> int:
        k_max = self.k_max if k_max is None else k_max
        if not self.verify or self.draft_cost is None:
            return min(self.k, k_max)
        a = min(acc / (acc + rej), 0.999)
        best_k, best = 0, 1.0 / self._verify_cost(0) if 0 in self.verify else 0.0
        for k in range(max(1, self.k_min), k_max + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            rate = tokens / (k * self.draft_cost + self._verify_cost(k))
            if rate > best:
                best_k, best = k, rate
        if best_k < self.k_min:
            best_k = min(self.k_min, k_max)
        return best_k

    def next_k(self) -> int:
        if self.k == 0:
            self.steps_at_zero += 1
            if self.steps_at_zero % self.probe_every == 0:
                return 1
        return self.k

    def choose(self, bucket: int, available: int) -> int:
        """K for a draft of ``available`` tokens whose trust bucket is ``bucket``."""
        b = self.buckets.setdefault(bucket, [2.0, 2.0, 0])
        if not self.verify or self.draft_cost is None:
            return min(self.k_start, available)
        k = self._choose(b[0], b[1], available)
        if k == 0 and available:
            b[2] += 1
            if b[2] % self.probe_every == 0:
                return 1  # probe: keep this bucket's estimate fresh
        return k


def make_policy(k: int | str):
    if k == "auto":
        return AdaptiveK()
    return FixedK(int(k))
