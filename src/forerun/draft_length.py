"""Draft length K: fixed, or chosen each step from measured acceptance and measured cost."""

from __future__ import annotations

MAX_K = 32


def expected_tokens(a: float, k: float) -> float:
    """Tokens a verify pass of ``k`` drafts yields when each is accepted with probability ``a``
    (i.i.d., Leviathan et al.): the accepted run plus the target's own token. Needs a < 1."""
    return (1 - a ** (k + 1)) / (1 - a)


def update_acceptance(b: list[float], decay: float, accepted: int, drafted: int) -> None:
    """One round into a decayed acceptance estimate ``b`` = [accepted, rejections] (per-token
    acceptance ~ b[0] / (b[0] + b[1])): ``accepted`` of ``drafted`` tokens passed, and a rejection
    ended the run unless all passed."""
    b[0] = decay * b[0] + accepted
    b[1] = decay * b[1] + (1 if accepted < drafted else 0)


def chain_yield(conf: list[float]) -> list[float]:
    """Expected tokens of a verify pass over the first k tokens of a chain, for k = 0..len(conf),
    when ``conf[j]`` is the chance the target accepts token j once every token before it was:
    the target's own token plus, per position, the chance the run reaches past it."""
    out, reach = [1.0], 1.0
    for c in conf:
        reach *= c
        out.append(out[-1] + reach)
    return out


class AcceptanceTable:
    """How often the target took a drafted token, per trust key, given that every token before it
    in the draft was taken: decayed counts with a prior (``prior_hits`` of ``prior_seen``), so an
    estimate follows the workload and a key seen rarely stays near the prior."""

    def __init__(self, decay: float = 0.99, prior_hits: float = 1.0, prior_seen: float = 2.0):
        if not 0.0 < decay <= 1.0 or not 0.0 <= prior_hits <= prior_seen or prior_seen <= 0:
            raise ValueError("need 0 < decay <= 1 and 0 <= prior_hits <= prior_seen, prior_seen > 0")
        self.decay, self.prior_hits, self.prior_seen = decay, prior_hits, prior_seen
        self.counts: dict[object, list[float]] = {}  # key -> [hits, seen]

    def rate(self, key) -> float:
        hits, seen = self.counts.get(key, (0.0, 0.0))
        return (hits + self.prior_hits) / (seen + self.prior_seen)

    def observe(self, key, hit: bool) -> None:
        c = self.counts.setdefault(key, [0.0, 0.0])
        c[0] = self.decay * c[0] + (1.0 if hit else 0.0)
        c[1] = self.decay * c[1] + 1.0

    def observe_run(self, keys: list, proposed: list[int], committed: list[int]) -> None:
        """A draft's outcome as the committed tokens show it, whatever length was verified: every
        position up to the first disagreement (or the end of what was committed) is one sample."""
        for key, p, c in zip(keys, proposed, committed):
            self.observe(key, p == c)
            if p != c:
                break


def measured_cost(points: dict[int, float], x: int) -> float:
    """Seconds at size ``x`` from averages measured at some sizes (at least one): the measured
    value itself, else the least-squares line through the points (flat while only one is known),
    never below the cheapest measured."""
    if x in points:
        return points[x]
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    n = len(xs)
    mx = sum(xs) / n
    my = sum(points[v] for v in xs) / n
    sxx = sum((v - mx) ** 2 for v in xs)
    b = sum((v - mx) * (points[v] - my) for v in xs) / sxx
    return max(my + b * (x - mx), min(points.values()))


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
        self.round_draft = 0.0  # seconds of drafting per round, whatever was kept (cheap proposals)
        self.verify = {}  # k -> EMA seconds of a verify pass over k + 1 tokens
        self.steps_at_zero = 0

    def observe(self, k: int, accepted: int, draft_s: float, verify_s: float, bucket: int | None = None) -> None:
        if k > 0:
            missed = 1 if accepted < k else 0
            self.acc = self.decay * self.acc + accepted
            self.rej = self.decay * self.rej + missed
            if bucket is not None:
                update_acceptance(self.buckets.setdefault(bucket, [2.0, 2.0, 0]), self.decay, accepted, k)
            per_tok = draft_s / k
            self.draft_cost = per_tok if self.draft_cost is None else 0.8 * self.draft_cost + 0.2 * per_tok
        self.round_draft = 0.8 * self.round_draft + 0.2 * draft_s
        old = self.verify.get(k)
        self.verify[k] = verify_s if old is None else 0.8 * old + 0.2 * verify_s
        self.k = self._choose(self.acc, self.rej)

    def _verify_cost(self, k: int) -> float:
        return measured_cost(self.verify, k)

    def _choose(self, acc: float, rej: float, k_max: int | None = None) -> int:
        k_max = self.k_max if k_max is None else k_max
        if not self.verify or self.draft_cost is None:
            return min(self.k, k_max)
        a = min(acc / (acc + rej), 0.999)
        best_k, best = 0, 1.0 / self._verify_cost(0) if 0 in self.verify else 0.0
        for k in range(max(1, self.k_min), k_max + 1):
            rate = expected_tokens(a, k) / (k * self.draft_cost + self._verify_cost(k))
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

    def choose_by_confidence(self, conf: list[float]) -> int:
        """K for a chain whose drafter estimates, per token, the chance the target accepts it once
        the tokens before it were (``Draft.conf``): the prefix with the most expected tokens per
        second. The chain was proposed whole before this choice, so drafting costs a round the
        same whatever K is kept (its measured average per round). Such a drafter learns from the
        committed tokens even when nothing was verified, so K = 0 needs no probes."""
        if not conf:
            return 0
        if not self.verify:
            return min(self.k_start, len(conf))
        gain = chain_yield(conf[: self.k_max])
        d = self.round_draft
        best_k, best = 0, 1.0 / (d + self._verify_cost(0)) if 0 in self.verify else 0.0
        for k in range(1, len(gain)):
            rate = gain[k] / (d + self._verify_cost(k))
            if rate > best:
                best_k, best = k, rate
        return best_k

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


def make_policy(k: int | str, measured: AdaptiveK | None = None):
    """The draft-length policy for ``k``; ``measured``: an earlier request's adaptive policy on the
    same target, whose measured costs (verify passes, drafting) the new one starts from: they
    belong to the machine and the model, while acceptance starts afresh with each request."""
    if k == "auto":
        policy = AdaptiveK()
        if isinstance(measured, AdaptiveK):
            policy.verify = dict(measured.verify)
            policy.draft_cost = measured.draft_cost
            policy.round_draft = measured.round_draft
        return policy
    return FixedK(int(k))


class TreeOrLookup:
    """Per round, for a head's token tree that can also carry a prompt-lookup chain: verify the
    tree (head tree with the chain grafted on), or the chain alone cut to the K that pays (K = 0:
    a plain step, the head not even run) — whichever the measured yields and costs say gives
    more tokens per second for this round's trust bucket (the length of the n-gram that matched).

    The chain's acceptance per bucket is a geometric estimate as in ``AdaptiveK``, updated in
    every round that had a chain: in a tree round the committed tokens show how far the chain
    alone would have been accepted. The tree's yield (tokens per round) is an average per bucket
    over tree rounds. Costs are whole rounds as the drafter sees them (drafting, verify pass,
    acceptance), averaged per number of verified rows, separately for rounds with and without
    the head. A bucket tries the option it has not been choosing once after ``probe_every``
    rounds; each probe that changes nothing doubles that interval (up to ``max_probe_every``), one
    that changes the choice resets it: on hardware where one option costs several times the
    other, probes must stay rare.
    """

    def __init__(self, decay: float = 0.9, probe_every: int = 16, max_probe_every: int = 256):
        self.decay = decay
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.chain_acc: dict[int, list[float]] = {}  # bucket -> [accepted, rejections]
        self.tree_yield: dict[int, float] = {}  # bucket -> average tokens per tree round
        self.probes: dict[int, dict] = {}  # bucket -> probe interval, rounds since the last, choice before it
        self.cost = {"chain": {}, "tree": {}}  # kind -> rows -> average seconds per round
        self.choices = {"tree": 0, "chain": 0, "none": 0}  # steps that verified each, for reports

    def _cost(self, kind: str, rows: int) -> float | None:
        return measured_cost(self.cost[kind], rows) if self.cost[kind] else None

    def best_chain(self, bucket: int, available: int) -> tuple[int, float | None]:
        """(K, expected tokens per second) for verifying the chain alone, K <= available."""
        acc, rej = self.chain_acc.get(bucket, (2.0, 2.0))
        a = min(acc / (acc + rej), 0.999)
        best_k, best = 0, None
        for k in range(available + 1):
            c = self._cost("chain", k + 1)
            if c is None:
                continue
            rate = expected_tokens(a, k) / c
            if best is None or rate > best:
                best_k, best = k, rate
        return best_k, best

    def choose(self, bucket: int, available: int, tree_rows: int) -> int | None:
        """None: verify the tree; else the number of chain tokens to verify alone (maybe 0)."""
        cut = self._choose(bucket, available, tree_rows)
        self.choices["tree" if cut is None else "chain" if cut else "none"] += 1
        return cut

    def _choose(self, bucket: int, available: int, tree_rows: int) -> int | None:
        k, chain_rate = self.best_chain(bucket, available)
        tree_cost = self._cost("tree", tree_rows)
        if chain_rate is None:  # nothing measured without the head yet: try the chain once
            return available if tree_cost is not None else None
        if tree_cost is None or bucket not in self.tree_yield:
            return None
        tree_better = self.tree_yield[bucket] / tree_cost > chain_rate
        st = self.probes.setdefault(bucket, {"every": self.probe_every, "since": 0, "before": None})
        if st["before"] is not None:  # first choice after a probe: probe less often while probes change nothing
            st["every"] = min(2 * st["every"], self.max_probe_every) if tree_better == st["before"] else self.probe_every
            st["before"] = None
        st["since"] += 1
        if st["since"] >= st["every"]:
            st["since"], st["before"] = 0, tree_better
            tree_better = not tree_better
        return None if tree_better else k

    def observe(self, bucket: int, chain_accepted: int | None, chain_len: int, tree: bool, accepted: int,
                rows: int, seconds: float) -> None:
        """One finished round. ``chain_accepted``: how many of the chain's ``chain_len`` tokens the
        committed tokens confirm (None: no chain this round); ``accepted``: drafts accepted."""
        if chain_accepted is not None and chain_len:
            update_acceptance(self.chain_acc.setdefault(bucket, [2.0, 2.0]), self.decay, chain_accepted, chain_len)
        if tree:
            old = self.tree_yield.get(bucket)
            self.tree_yield[bucket] = accepted + 1 if old is None else 0.8 * old + 0.2 * (accepted + 1)
        pts = self.cost["tree" if tree else "chain"]
        pts[rows] = seconds if rows not in pts else 0.8 * pts[rows] + 0.2 * seconds
