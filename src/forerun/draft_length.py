"""How many drafted tokens to verify: one policy for one sequence or a batch.

Drafters offer what they can propose (a chain with a trust bucket or per-token confidences, a
token tree, a prompt-lookup chain beside a tree); ``DraftLength`` chooses, every step, from one
record of measured acceptance and measured costs kept by the decode core (``forerun.decode``),
which times every pass itself. Drafters never time the engine.
"""

from __future__ import annotations

LONGEST_DRAFT = 32  # the longest draft anyone may ask for (--k)
K_MAX = 16  # the longest draft --k auto chooses, one sequence or a batch (the server's --k-max)
ANSWER_PRIOR = 16  # the tokens an answer is taken to run to at least, when a draft model's reading is priced
READ_SAMPLE = 32  # the fewest tokens a draft model's reading must have to time its cost per token


def expected_tokens(a: float, k: float) -> float:
    """Tokens a verify pass of ``k`` drafts yields when each is accepted with probability ``a``
    (i.i.d., Leviathan et al.): the accepted run plus the target's own token. Needs a < 1."""
    return (1 - a ** (k + 1)) / (1 - a)


def ema(old: float | None, new: float, weight: float = 0.2) -> float:
    """The running average every measured cost and yield keeps."""
    return new if old is None else (1 - weight) * old + weight * new


def bounded_ema(old: float | None, new: float) -> float:
    """``ema`` with the sample counted at most twice (at least half) the current average: one
    outlier (a page fault, another process, a head catching up on a long prompt) moves it up by a
    fifth at most. A sample below the average weighs half: what makes a sample stray is nearly
    always something slowing the machine, so a low one is its speed coming back, and an average
    left high by a slow spell must come down within a few samples, for a cost the policy thinks
    too high stops the very drafting that would measure it again."""
    if old is None:
        return new
    if new < old:
        return ema(old, max(new, 0.5 * old), 0.5)
    return ema(old, min(new, 2.0 * old))


def chain_yield(conf: list[float]) -> list[float]:
    """Expected tokens of a verify pass over the first k tokens of a chain, for k = 0..len(conf),
    when ``conf[j]`` is the chance the target accepts token j once every token before it was:
    the target's own token plus, per position, the chance the run reaches past it."""
    out, reach = [1.0], 1.0
    for c in conf:
        reach *= c
        out.append(out[-1] + reach)
    return out


class Acceptance:
    """How often the target took a drafted token, per key (a trust bucket, a probability bin, an
    n-gram length), given that every token before it in the draft was taken: the one estimate of
    acceptance that the draft-length policy and the drafters keep. Per key, decayed counts
    [taken, refused] start from ``prior``; a round multiplies them by ``decay`` and adds its
    outcome, so an estimate follows the workload and a key seen rarely stays near its prior. The
    estimate is taken / (taken + refused), the maximum-likelihood per-token acceptance for runs
    cut off at the draft length, at most ``cap``."""

    def __init__(self, decay: float = 0.99, prior: tuple[float, float] = (1.0, 1.0), cap: float = 1.0):
        if not 0.0 < decay <= 1.0 or min(prior) < 0 or sum(prior) <= 0:
            raise ValueError("need 0 < decay <= 1 and a prior of counts >= 0, not both 0")
        self.decay, self.prior, self.cap = decay, prior, cap
        self.counts: dict[object, list[float]] = {}  # key -> [taken, refused]

    def rate(self, key, *fallbacks) -> float:
        """The estimate for ``key``; where it was never observed, that of the first of ``fallbacks``
        that was, else the prior's."""
        for k in (key, *fallbacks):
            c = self.counts.get(k)
            if c is not None:
                break
        else:
            c = self.prior
        return min(c[0] / (c[0] + c[1]), self.cap)

    def observe(self, key, accepted: int, drafted: int) -> None:
        """One round of ``drafted`` tokens under ``key``: the first ``accepted`` taken, and a
        refusal ended the run unless all were."""
        if drafted > 0:
            c = self.counts.setdefault(key, list(self.prior))
            c[0] = self.decay * c[0] + accepted
            c[1] = self.decay * c[1] + (1 if accepted < drafted else 0)

    def observe_run(self, keys: list, proposed: list[int], committed: list[int]) -> None:
        """A draft with a key per token, its outcome as the committed tokens show it (whatever
        length was verified): each position up to the first disagreement, or the end of what was
        committed, is a round of one token under its key."""
        for key, p, c in zip(keys, proposed, committed):
            self.observe(key, int(p == c), 1)
            if p != c:
                break


def interpolate(points: dict[int, float], x: int) -> float:
    """Seconds at size ``x`` from averages measured at some sizes (at least one): the measured
    value, else the line between the nearest measured sizes around it, else that through the two
    nearest on one side (flat while only one is known), never below the cheapest measured."""
    if x in points:
        return points[x]
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    lo = max((v for v in xs if v < x), default=None)
    hi = min((v for v in xs if v > x), default=None)
    if lo is None:
        lo, hi = xs[0], xs[1]
    elif hi is None:
        lo, hi = xs[-2], xs[-1]
    y = points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return max(y, min(points.values()))


class DraftLength:
    """Draft lengths for one step of one sequence or many.

    ``k``: a fixed draft length, or ``"auto"``: every step, the tokens to verify are chosen to
    maximise the predicted tokens per second of the whole step. A target pass over R rows costs
    what passes of R rows measured (``costs["pass"]``, averaged; interpolated between row counts;
    the first pass of a row count may include one-time kernel tuning and is not a sample). The
    j-th drafted token of a sequence adds the chance that the run reaches it: the product of the
    drafter's own per-token confidences where it offers them (``Draft.conf``), else the measured
    acceptance of its trust bucket to the power j (decayed counts per bucket). Candidates are
    taken in order of expected gain and the prefix with the best predicted rate wins, which must
    beat a step without drafts by ``margin``. Drafters that are not cheap are charged their
    measured seconds per drafted token. A bucket that had drafts on offer but kept none for
    ``probe_every`` choices gets one draft token once (a probe), so that an estimate that fell too
    low is measured again; for drafters that cost per token each probe the plan does not follow up
    doubles that interval (a probe is a whole drafting round there), and a probe's drafting time is
    not a sample of what a drafted token costs (a head's probe catches up on every position since
    its last round). ``sequential``: the backend runs the sequences of a step one after another, so
    a step costs one pass per sequence.

    Measured pass and drafting times are averages that a single slow sample (a page fault, another
    process, a head catching up on a long prompt) must not poison: a sample counts at most twice
    (at least half) the current average. And the cost
    of the step without drafts is what every choice is measured against, yet while drafting pays
    it is never timed again: after ``refresh_every`` choices without a sample of it (counted across
    requests), one step runs without drafts to measure it afresh (this machine's speed drifts by tens
    of percent; each refresh is a round not drafted: every 64 choices instead of 256 ran the Qwen
    pair's code completions 2-7% slower, paired, in the engine and at one client in the batch
    engine); one never timed at all is timed before anything is drafted against it.

    Drafters that offer a token tree or a prompt-lookup chain (``tree_or_chain``) get the option
    with more tokens per second for this round's bucket: the tree's measured yield over its
    measured round cost, or the chain cut where it pays, priced by measured rounds without the
    head (``costs["tree"]`` / ``costs["chain"]``: whole rounds as the decode step timed them,
    drafting, the sequence's share of the pass and of the step's other work). A bucket tries the
    option it has not been choosing after ``tree_probe_every`` rounds; each such probe that changes
    nothing doubles that interval (up to ``max_tree_probe_every``).
    """

    def __init__(self, k: int | str = "auto", *, k_max: int = K_MAX, k_start: int = 4, decay: float = 0.9,
                 margin: float = 0.0, probe_every: int = 8, sequential: bool = False, tree_probe_every: int = 16,
                 max_tree_probe_every: int = 256, refresh_every: int = 256):
        self.fixed = None if k == "auto" else int(k)
        self.auto_k_max = k_max
        self.k_max = k_max if self.fixed is None else self.fixed
        self.k_start, self.decay, self.margin = k_start, decay, margin
        self.probe_every, self.sequential = probe_every, sequential
        self.tree_probe_every, self.max_tree_probe_every = tree_probe_every, max_tree_probe_every
        self.refresh_every = refresh_every
        self._clock = 0  # choices made
        self._seen: dict[int, int] = {}  # pass rows -> the choice at which it was last timed
        self._probed = False  # the last choice was a probe
        self._batch = (1, 1)  # (sequences, rows) of the step a costly drafter drafts for (``batch``)
        # What the machine and model cost (kept across requests by ``renewed``):
        # kind -> rows -> seconds: target passes ("pass"); whole rounds of a tree-or-chain drafter that
        # verified its tree ("tree") or its chain ("chain"), drafting and the step's other work included
        self.costs: dict[str, dict[int, float | None]] = {"pass": {}, "tree": {}, "chain": {}}
        self.draft_cost: float | None = None  # seconds per drafted token (drafters that are not cheap)
        self.read_cost: float | None = None  # seconds per token a draft model reads before drafting
        self.model_round: float | None = None  # seconds per committed token of a draft model's rounds
        # What this workload accepts:
        self.accepted = Acceptance(self.decay, prior=(2.0, 2.0), cap=0.98)  # per trust bucket
        self.tree_yield: dict[object, float] = {}  # bucket -> average tokens per tree round
        self.idle: dict[object, int] = {}  # bucket -> choices in a row with drafts on offer and none kept
        self.probe_gap: dict[object, int] = {}  # bucket -> rounds between probes (grows for costly drafters)
        self.tree_probes: dict[object, dict] = {}  # bucket -> probe interval, rounds since the last, choice before it
        self.choices = {"tree": 0, "chain": 0, "none": 0}  # tree-or-chain rounds by what they verified

    def renewed(self, k: int | str) -> DraftLength:
        """A policy for the next request on the same target: the measured costs, when they were
        timed, and tree yields carry over (they belong to the machine, the model and its head);
        acceptance starts afresh."""
        new = DraftLength(k, k_max=self.auto_k_max, k_start=self.k_start, decay=self.decay,
                          margin=self.margin, probe_every=self.probe_every, sequential=self.sequential,
                          tree_probe_every=self.tree_probe_every, max_tree_probe_every=self.max_tree_probe_every,
                          refresh_every=self.refresh_every)
        new.costs = {kind: dict(c) for kind, c in self.costs.items()}
        # and when each was last timed: a plain step's cost goes stale over many short requests too
        new._clock, new._seen = self._clock, dict(self._seen)
        new.draft_cost, new.read_cost, new.model_round = self.draft_cost, self.read_cost, self.model_round
        # what a head's tree yields per bucket, and how often that was probed, describe the head and
        # the target as much as the machine: a tree-or-chain drafter's next request starts from them
        new.tree_yield = dict(self.tree_yield)
        new.tree_probes = {b: dict(st) for b, st in self.tree_probes.items()}
        return new

    # -- measurements ----------------------------------------------------------------------
    def observe_pass(self, rows: int, seconds: float, kind: str = "pass") -> None:
        """A target pass over ``rows`` rows (``kind`` "tree" / "chain": a whole round of a
        tree-or-chain drafter)."""
        pts = self.costs[kind]
        if kind == "pass":
            self._seen[rows] = self._clock
        if rows not in pts and kind == "pass":  # the first pass of a row count may include one-time kernel tuning
            pts[rows] = None
        else:
            pts[rows] = bounded_ema(pts.get(rows), seconds)

    def observe_draft(self, tokens: int, seconds: float, apart: bool = False) -> None:
        """Seconds spent drafting ``tokens`` tokens. A probe's time counts only where it holds
        drafting alone (``apart``: a draft model's reading of what it had not read is timed apart);
        elsewhere it includes a catch-up on every position since the last round."""
        if tokens and (apart or not self._probed):
            self.draft_cost = bounded_ema(self.draft_cost, seconds / tokens)

    def observe_reading(self, tokens: int, seconds: float) -> None:
        """A draft model read ``tokens`` committed tokens it had not read (a prompt, a stretch it
        did not draft for) in ``seconds``. Short reads are not samples: a pass's fixed cost would
        count as the tokens'."""
        if tokens >= READ_SAMPLE:
            self.read_cost = bounded_ema(self.read_cost, seconds / tokens)

    def observe_model_round(self, tokens: int, seconds: float) -> None:
        """A round a draft model drafted for (no reading in it) committed ``tokens`` in ``seconds``
        (drafting, the sequence's share of the pass and of the step's other work)."""
        self.model_round = bounded_ema(self.model_round, seconds / tokens)

    def observe(self, bucket, drafted: int, accepted: int) -> None:
        self.accepted.observe(bucket, accepted, drafted)

    def observe_tree(self, bucket, tokens: int) -> None:
        """Tokens a tree round yielded (accepted drafts and the target's own)."""
        self.tree_yield[bucket] = ema(self.tree_yield.get(bucket), tokens)

    def acceptance(self, bucket) -> float:
        """A bucket's acceptance; an unseen bucket takes that of drafts without one."""
        return self.accepted.rate(bucket, None)

    def cost(self, rows: int, kind: str = "pass") -> float | None:
        """Predicted seconds of a pass of ``rows`` rows (None: nothing measured yet). A pass never
        costs more than one of more rows measured: an average left high by one slow sample (its
        first, which starts it) would otherwise keep the policy from the very passes that would
        bring it down (passes of 3 rows averaging 50 ms beside 33 ms for 4, on the Qwen pair)."""
        known, least = {}, float("inf")
        for r, t in sorted(((r, t) for r, t in self.costs[kind].items() if t is not None), reverse=True):
            least = known[r] = min(least, t)
        return interpolate(known, rows) if known else None

    # -- choice ----------------------------------------------------------------------------
    def choose(self, available: list[int], buckets: list, confs: list | None = None,
               charge_drafting: bool = False) -> list[int]:
        """Draft tokens to keep per sequence, of ``available[i]`` proposed (or proposable) ones."""
        if self.fixed is not None:
            return [min(a, self.fixed) for a in available]
        n = len(available)
        confs = confs or [None] * n
        if n == 0:
            return []
        self._clock += 1
        self._probed = False
        if self.cost(1) is None or (charge_drafting and self.draft_cost is None):  # nothing measured yet
            ks = [min(a, self.k_start, self.k_max) for a in available]
            if charge_drafting and n > 1 and self.cost(1) is not None:
                # passes measured, drafting not: one sequence drafts to measure it, the others step
                # plainly (every sequence drafting unpriced multiplies a batch's rows)
                first = next((i for i, k in enumerate(ks) if k), n)
                ks = [k if i == first else 0 for i, k in enumerate(ks)]
            return ks
        plain = 1 if self.sequential else n  # the rows of a step without drafts
        # the step without drafts timed afresh where its cost is stale, and where it was never timed
        # (twice: the first pass of a row count is not a sample), or drafting would be weighed against
        # a guess from bigger passes (a draft model that drafts from its first round never makes a
        # pass of one row by itself)
        stale = plain in self._seen and self._clock - self._seen[plain] > self.refresh_every
        if stale or self.costs["pass"].get(plain) is None:
            self._seen[plain] = self._clock
            return [0] * n
        # and, a sequence's pass alone, that of one drafted token, timed the same way: the cheapest draft
        # priced from what it costs, not from a line drawn to a longer draft's pass (a pass's cost rises
        # slowly over its first rows, and a line through a far point overprices them)
        first = next((i for i, a in enumerate(available) if a > 0), None)
        if plain == 1 and first is not None and self.costs["pass"].get(2) is None:
            return [1 if i == first else 0 for i in range(n)]
        cands = []
        for i, (avail, bucket, conf) in enumerate(zip(available, buckets, confs)):
            a, reach = self.acceptance(bucket), 1.0
            for j in range(min(avail, self.k_max)):
                reach *= conf[j] if conf is not None else a
                cands.append((reach, i))
        if not cands:
            return [0] * n
        cands.sort(key=lambda c: -c[0])
        one = self.cost(1)
        base = n / (n * one if self.sequential else self.cost(n))
        best, best_m, tokens = base * (1 + self.margin), 0, float(n)
        per_draft = self.draft_cost if charge_drafting else 0.0
        rows, total = [1] * n, n * one  # sequential: the sum of the sequences' passes
        for m, (gain, i) in enumerate(cands, 1):
            tokens += gain
            if self.sequential:
                total += self.cost(rows[i] + 1) - self.cost(rows[i])
                rows[i] += 1
            rate = tokens / ((total if self.sequential else self.batch_pass(n, n + m)) + m * per_draft)
            if rate > best:
                best, best_m = rate, m
        ks = [0] * n
        for _, i in cands[:best_m]:
            ks[i] += 1
        return self._probe(available, buckets, confs, ks, backoff=charge_drafting)

    def batch(self, sequences: int, rows: int) -> None:
        """The step a costly drafter's sequences draft for: ``sequences`` in one pass of at least
        ``rows`` rows (``seq_cost``)."""
        self._batch = (sequences, max(rows, sequences))

    def seq_cost(self, rows: int) -> float:
        """What one sequence's ``rows`` rows cost in this step's pass (``batch``): its share of the
        pass without drafts plus the rows it adds there (alone: a pass of ``rows`` rows). In a
        batch whose pass costs by the row, a drafted row costs a whole sequence's share."""
        n, base = self._batch
        if n <= 1 and base <= 1:
            return self.cost(rows)
        return self.cost(base) / n + self.batch_pass(base, base + rows - 1) - self.cost(base)

    def batch_pass(self, base: int, rows: int) -> float:
        """Predicted seconds of a pass of ``rows`` rows in a step whose sequences alone take ``base``
        rows (``rows`` >= ``base``). The averages at nearby row counts are noisy (a pass of 24 rows
        may have averaged less than one of 16, and drafted rows then look free), so a row beyond
        ``base`` costs at least what a row cost on the way from 1 row to ``base``: a pass's cost
        rises with its rows at a rate that does not fall (flat while reading the weights bounds it,
        then by the row once its products do)."""
        c = self.cost(base)
        extra = max(0.0, self.cost(rows) - c)
        if base > 1 and rows > base:
            extra = max(extra, (rows - base) * max(0.0, c - self.cost(1)) / (base - 1))
        return c + extra

    def draft_more(self, conf: list[float], lookahead: int = 4) -> bool:
        """While a costly drafter drafts (``stops_early``): after tokens of confidences ``conf``,
        whether drafting on is predicted to raise the round's tokens per second, the next tokens
        taken as likely as the last one (up to ``lookahead`` of them: a pass's cost need not rise
        evenly with its rows). Until costs are measured, ``k_start`` tokens (as ``choose`` plans
        then): drafting on to ``k_max`` would make every batched pass a row count not seen before,
        and the first pass of a row count is not a sample, so under load nothing would ever be
        measured."""
        if self.fixed is not None:
            return True
        if self.cost(1) is None or self.draft_cost is None:
            return len(conf) < self.k_start
        j = len(conf)
        if j >= self.k_max:
            return False
        gain, c = chain_yield(conf), conf[-1] if conf else 0.5
        rate = gain[j] / (j * self.draft_cost + self.seq_cost(j + 1))
        tokens, reach = gain[j], gain[j] - gain[j - 1] if j else 1.0
        for h in range(1, min(lookahead, self.k_max - j) + 1):
            reach *= c
            tokens += reach
            if tokens / ((j + h) * self.draft_cost + self.seq_cost(j + h + 1)) > rate:
                return True
        return False

    def worth_reading(self, unread: int, produced: int, left: int, model_conf: list[float]) -> bool:
        """Whether a draft model that must first read ``unread`` tokens (a long prompt, mostly)
        should read them and draft now, ``produced`` tokens into a request that may make ``left``
        more, its positions taken at the rates ``model_conf``. The reading waits until the tokens
        made so far (at least ``ANSWER_PRIOR``), were as many to follow (at most ``left``), would
        repay it at what the model's drafts save a token over a plain step: a short answer to a
        long prompt never pays for it, and an answer that went on that long may well go on as long
        again (a rule that loses at most a bounded share, whatever the answer's length), while a
        chat turn's short prompt is read at once. What a token costs where the model drafts is
        measured over its whole rounds (``observe_model_round``; before any, what its learnt
        rates promise). The saving counts as at least a quarter of a step, so that estimates left
        low never keep the model from reading for good. Only measured costs count: until the
        reading, a step and a draft token are measured, the model reads and drafts (that measures
        them). With ``k`` fixed, always."""
        if self.fixed is not None or self.read_cost is None or self.cost(1) is None or self.draft_cost is None:
            return True
        price, step = unread * self.read_cost, self.seq_cost(1)
        per_token = self.model_round
        if per_token is None:  # no round of the model measured yet: what its learnt rates promise
            rate = self._model_rate(model_conf)
            per_token = 1.0 / rate if rate else step
        return min(max(produced, ANSWER_PRIOR), left) * max(step - per_token, step / 4) >= price

    def lookup_or_model(self, chain_conf: list[float], model_conf: list[float]) -> int | None:
        """A costly drafter's round that also offers a model-free chain (confidences ``chain_conf``):
        how many of its tokens to verify alone, or None to draft with the model (whose positions were
        taken at the rates ``model_conf``), whichever promises more tokens per second. Until passes
        are measured, the chain where it has a token; until the model's drafts are, the chain cut
        where it pays, and the model where none of it does."""
        if not chain_conf:
            return None
        if self.fixed is not None:
            return min(len(chain_conf), self.fixed)
        if self.cost(1) is None:
            return len(chain_conf[: self.k_max])
        m = self._cut(chain_conf[: self.k_max])
        if self.draft_cost is None:  # the model's drafts not priced yet: the chain where it pays alone
            return m or None
        chain_rate = chain_yield(chain_conf[:m])[m] / self.seq_cost(m + 1)
        return m if m and chain_rate >= self._model_rate(model_conf) else None

    def _model_rate(self, model_conf: list[float]) -> float:
        """Tokens per second a draft model's round promises at its learnt per-position rates
        ``model_conf`` and the measured costs, at its best length (0.0: no position to draft)."""
        gain = chain_yield(model_conf[: self.k_max])
        return max((gain[j] / (j * self.draft_cost + self.seq_cost(j + 1)) for j in range(1, len(gain))), default=0.0)

    def cut(self, conf: list[float]) -> int:
        """How many tokens of a costly drafter's draft (confidences ``conf``) to verify, its
        drafting already paid for: the prefix with the most tokens per second of verifying. Where
        the plan it was drafted for was a probe, at least one: a probe is there to measure again
        what the estimates say, the pass's cost as much as the acceptance, and a draft cut to
        nothing on costs left high by a slow spell would never measure them."""
        return self._cut(conf, 1 if self._probed else 0)

    def _cut(self, conf: list[float], at_least: int = 0) -> int:
        if self.fixed is not None or self.cost(1) is None:
            return len(conf)
        gain = chain_yield(conf)
        # verifying none of it must be beaten by ``margin``, as a plan's drafts must be
        best = max(range(len(gain)), key=lambda m: (gain[m] / self.seq_cost(m + 1) * (1 + self.margin if m == 0 else 1), -m))
        return max(best, min(at_least, len(conf)))

    def _probe(self, available: list[int], buckets: list, confs: list, ks: list[int], backoff: bool = False
               ) -> list[int]:
        """One draft token for a bucket idle for its probe interval. ``backoff`` (drafters that cost
        per token, whose probe is a drafting round): each probe the plan does not follow up doubles
        the bucket's interval (up to ``max_tree_probe_every``); a plan that keeps drafts resets it."""
        first: dict[object, int] = {}  # bucket -> its first sequence with drafts on offer
        kept: set = set()
        for i, (avail, bucket, conf) in enumerate(zip(available, buckets, confs)):
            # a cheap drafter with confidences learns from every committed token; a costly one only from its drafts
            if avail > 0 and (conf is None or backoff):
                first.setdefault(bucket, i)
                if ks[i] > 0:
                    kept.add(bucket)
        for bucket, i in first.items():
            idle = 0 if bucket in kept else self.idle.get(bucket, 0) + 1
            gap = self.probe_every if bucket in kept or not backoff else self.probe_gap.get(bucket, self.probe_every)
            if idle >= gap:
                ks[i], idle = 1, 0
                self._probed = True
                if backoff:
                    gap = min(2 * gap, self.max_tree_probe_every)
            self.idle[bucket] = idle
            self.probe_gap[bucket] = gap
        return ks

    def tree_or_chain(self, bucket, chain_conf: list[float], tree_rows: int) -> int | None:
        """None: verify the drafter's tree this round; else how many tokens of its lookup chain
        (confidences ``chain_conf``) to verify alone (0: a plain step, the head not even run)."""
        cut = self._tree_or_chain(bucket, chain_conf, tree_rows)
        self.choices["tree" if cut is None else "chain" if cut else "none"] += 1
        return cut

    def _tree_or_chain(self, bucket, chain_conf: list[float], tree_rows: int) -> int | None:
        chain_conf = chain_conf[: self.k_max]
        tree_cost = self.cost(tree_rows, "tree")
        if self.cost(1, "chain") is None:  # no round without the head measured yet: the chain once
            return len(chain_conf) if tree_cost is not None else None
        gain = chain_yield(chain_conf)
        k, chain_rate = max(((j, gain[j] / self.cost(j + 1, "chain")) for j in range(len(gain))), key=lambda x: x[1])
        if tree_cost is None or bucket not in self.tree_yield:
            return None
        tree_better = self.tree_yield[bucket] / tree_cost > chain_rate
        st = self.tree_probes.setdefault(bucket, {"every": self.tree_probe_every, "since": 0, "before": None})
        if st["before"] is not None:  # the first choice after a probe: rarer probes while they change nothing
            st["every"] = (min(2 * st["every"], self.max_tree_probe_every) if tree_better == st["before"]
                           else self.tree_probe_every)
            st["before"] = None
        st["since"] += 1
        if st["since"] >= st["every"]:
            st["since"], st["before"] = 0, tree_better
            tree_better = not tree_better
        return None if tree_better else k
