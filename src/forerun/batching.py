"""Batched speculative decoding: many sequences, one target pass per step.

Each active sequence owns a slot: a fork of the target backend (its own KV cache) and its own
drafter. A step drafts for every sequence, verifies all drafts in one target pass (the
native backend runs the linear layers on every row at once and attention per sequence),
then accepts, rolls back and emits per sequence, exactly as ``Engine.stream`` does for one.
Sequences join (prefill) and leave between steps.

How many tokens each sequence drafts is chosen every step by ``LoadAwareK`` from the measured
cost of a target pass as a function of its rows and the measured acceptance, so that
speculation is used only where it is predicted to raise throughput; under heavy load the
draft length falls to zero and the step is plain batched decoding.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from forerun.draft_length import update_acceptance
from forerun.drafters.base import Draft, empty_draft
from forerun.engine import clip_draft, commit_tokens, first_nodes
from forerun.verify import accept, kept_rows, pass_outputs
from forerun.errors import ForerunError
from forerun.prefix_cache import PrefixCache, prefill
from forerun.sampling import SamplingParams
from forerun.stats import GenerationStats

_ids = itertools.count(1)


log = logging.getLogger("forerun")


class EngineStopped(ForerunError):
    """The engine loop has died: no request can be served."""


class QueueFull(ForerunError):
    """The waiting queue is at its bound: the caller should retry later."""


@dataclass
class BatchRequest:
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    # Called on the engine thread: (new tokens, finish reason or None). Finish reasons: "stop"
    # (EOS), "length", "context", "cancelled", "error".
    on_event: Callable[[list[int], str | None], None] = lambda tokens, finish: None
    id: int = field(default_factory=lambda: next(_ids))
    stats: GenerationStats = field(default_factory=GenerationStats)
    error: str | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    # engine-side state
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)
    produced: int = 0
    slot: "_Slot | None" = None
    generator: torch.Generator | None = None


@dataclass
class _Slot:
    backend: object
    drafter: object


class LoadAwareK:
    """Draft lengths for one step of a batch, from measured pass costs and acceptance.

    A target pass over R rows is modelled by measured times (calibrated at start, refined with
    every pass; linear interpolation between measured row counts). Acceptance is estimated per
    trust bucket (e.g. the n-gram match length) with exponential forgetting; the j-th draft token
    of a sequence adds a^j expected tokens. Candidates are taken in order of expected gain and
    the prefix with the best predicted tokens per second wins; speculation must beat plain
    batched decoding by ``margin`` or the step drafts nothing. ``sequential``: the backend runs
    the sequences of a step one after another, so a step costs the sum of one pass per sequence
    (costs are then per-sequence passes of 1 + k rows). A bucket that had drafts on offer but got
    none for ``probe_every`` choices gets one draft token once (a probe), so that an acceptance
    estimate that fell too low is measured again instead of staying there.
    """

    def __init__(self, k_max: int = 8, decay: float = 0.95, margin: float = 0.03, sequential: bool = False,
                 probe_every: int = 32):
        self.k_max = k_max
        self.sequential = sequential
        self.probe_every = probe_every
        self.idle: dict[object, int] = {}  # bucket -> choices in a row with drafts on offer and none kept
        self.decay = decay
        self.margin = margin
        self.costs: dict[int, float | None] = {}  # rows -> EMA seconds of a target pass (None: seen once)
        self.buckets: dict[object, list[float]] = {}  # bucket -> [accepted, rejections]
        self.draft_cost = 0.0  # seconds per drafted token (drafters that are not cheap)

    # -- measurements ----------------------------------------------------------------------
    def observe_pass(self, rows: int, seconds: float) -> None:
        if rows not in self.costs:  # the first pass of a row count may include one-time kernel tuning: not a cost sample
            self.costs[rows] = None  # type: ignore[assignment]
            return
        old = self.costs[rows]
        self.costs[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens:
            per = seconds / tokens
            self.draft_cost = per if not self.draft_cost else 0.8 * self.draft_cost + 0.2 * per

    def observe(self, bucket, k: int, accepted: int) -> None:
        if k <= 0:
            return
        update_acceptance(self.buckets.setdefault(bucket, [2.0, 2.0]), self.decay, accepted, k)

    def acceptance(self, bucket) -> float:
        b = self.buckets.get(bucket) or self.buckets.get(None) or [2.0, 2.0]
        return min(b[0] / (b[0] + b[1]), 0.98)

    def cost(self, rows: int) -> float:
        if self.costs.get(rows) is not None:
            return self.costs[rows]
        known = sorted(r for r, t in self.costs.items() if t is not None)
        if not known:
            return 1.0
        lo = max((r for r in known if r < rows), default=None)
        hi = min((r for r in known if r > rows), default=None)
        if lo is not None and hi is not None:
            w = (rows - lo) / (hi - lo)
            return (1 - w) * self.costs[lo] + w * self.costs[hi]
        if len(known) == 1:
            return self.costs[known[0]]
        a, b = (known[-2], known[-1]) if hi is None else (known[0], known[1])
        slope = max(0.0, (self.costs[b] - self.costs[a]) / (b - a))
        ref = b if hi is None else a
        return max(1e-6, self.costs[ref] + slope * (rows - ref))

    # -- choice ----------------------------------------------------------------------------
    def choose(self, available: list[int], buckets: list, charge_drafting: bool,
               confs: list[list[float] | None] | None = None) -> list[int]:
        """Draft tokens to keep per sequence, given ``available[i]`` proposed (or proposable) ones;
        ``confs[i]``: the drafter's own per-token acceptance estimates (``Draft.conf``), used
        instead of the bucket's where given."""
        n = len(available)
        if n == 0:
            return []
        cands = []
        for i, (avail, bucket) in enumerate(zip(available, buckets)):
            conf = confs[i] if confs is not None else None
            a, reach = self.acceptance(bucket), 1.0
            for j in range(1, min(avail, self.k_max) + 1):
                reach *= conf[j - 1] if conf is not None else a
                cands.append((reach, i))
        if not cands:
            return [0] * n
        cands.sort(key=lambda c: -c[0])
        base = n / (n * self.cost(1) if self.sequential else self.cost(n))
        best, best_m, tokens = base * (1 + self.margin), 0, float(n)
        per_draft = self.draft_cost if charge_drafting else 0.0
        rows = [1] * n
        total = n * self.cost(1)  # sequential: the sum of the sequences' passes
        for m, (gain, i) in enumerate(cands, 1):
            tokens += gain
            if self.sequential:
                total += self.cost(rows[i] + 1) - self.cost(rows[i])
                rows[i] += 1
            rate = tokens / ((total if self.sequential else self.cost(n + m)) + m * per_draft)
            if rate > best:
                best, best_m = rate, m
        ks = [0] * n
        for _, i in cands[:best_m]:
            ks[i] += 1
        return self._probe(available, buckets, ks)

    def _probe(self, available: list[int], buckets: list, ks: list[int]) -> list[int]:
        first: dict[object, int] = {}  # bucket -> its first sequence with drafts on offer
        kept: set = set()
        for i, (avail, bucket) in enumerate(zip(available, buckets)):
            if avail > 0 and self.k_max > 0:
                first.setdefault(bucket, i)
                if ks[i] > 0:
                    kept.add(bucket)
        for bucket, i in first.items():
            idle = 0 if bucket in kept else self.idle.get(bucket, 0) + 1
            if idle >= self.probe_every:
                ks[i], idle = 1, 0
            self.idle[bucket] = idle
        return ks


class BatchEngine:
    """Decodes many requests together; drive it with ``run`` on its own thread (or ``step``)."""

    HOUSEKEEPING_STEPS = 50
    RESERVE_POSITIONS = 4096  # cache positions each slot allocates at its start

    def __init__(self, target, eos_token_ids=(), *, drafter=None, max_batch: int = 8, max_waiting: int = 64,
                 k_max: int = 8, speculate: bool = True, prefix_cache_bytes: int = 0):
        """``drafter``: a prototype; every slot gets its own ``drafter.fork()``. None (or
        ``speculate=False``): plain batched decoding. ``prefix_cache_bytes``: memory for prompt
        prefixes shared between requests (``forerun.prefix_cache``; 0: none), on backends that can
        copy their cache (``kv_segments``); there every prompt is prefilled in the cache's chunks,
        with or without it, so that output never depends on what was cached."""
        if max_batch < 1:
            raise ForerunError(f"max_batch must be >= 1, got {max_batch}")
        if speculate and drafter is not None and drafter.proposes_trees and not target.capabilities.token_trees:
            raise ForerunError(f"this {drafter.name} drafter proposes token trees, which this backend cannot verify: "
                               "build it without a tree (no tree=..., no --tree-nodes), or use --backend torch")
        self.target = target
        self.eos = set(int(i) for i in eos_token_ids)
        self.drafter = drafter if speculate else None
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.batched = target.capabilities.batched
        if prefix_cache_bytes < 0:
            raise ForerunError(f"the prefix cache size must be >= 0, got {prefix_cache_bytes}")
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if target.capabilities.kv_segments and prefix_cache_bytes else None
        self.policy = LoadAwareK(k_max=k_max, sequential=not self.batched)
        self.waiting: deque[BatchRequest] = deque()
        self.active: list[BatchRequest] = []
        self._free: list[_Slot] = []
        self._n_slots = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.dead: str | None = None  # why the engine loop stopped, if it died
        # observers (metrics): on_step(rows, seconds, [(request, drafted, accepted)])
        self.on_step: Callable | None = None
        # Trained heads read target features at some layers, after the prefill and every pass.
        self.layers = tuple(self.drafter.feature_layers) if self.drafter is not None else ()
        self._fwd = {"layers": self.layers} if self.layers else {}
        self.housekeeping: Callable | None = None  # called every HOUSEKEEPING_STEPS steps by run (e.g. heap trimming)
        self._steps = 0

    # -- requests (any thread) --------------------------------------------------------------
    def submit(self, req: BatchRequest) -> BatchRequest:
        if not req.prompt:
            raise ForerunError("empty prompt")
        if len(req.prompt) >= self.target.max_context:
            raise ForerunError(f"prompt is {len(req.prompt)} tokens; the context limit is {self.target.max_context}")
        if self.dead:
            raise EngineStopped(f"the engine has stopped ({self.dead})")
        with self._lock:
            # max_waiting counts requests beyond the free slots: those wait at least one step
            if len(self.waiting) >= self.max_waiting + max(0, self.max_batch - len(self.active)):
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the limit); retry later")
            self.waiting.append(req)
        self._wake.set()
        return req

    def cancel(self, req: BatchRequest) -> None:
        """Stop a request. One still waiting leaves the queue at once (it no longer counts against
        ``max_waiting``) and is told it was cancelled; a running one frees its slot before the next step."""
        req.cancelled = True
        with self._lock:
            try:
                self.waiting.remove(req)
            except ValueError:
                queued = False
            else:
                queued = True
        if queued:
            _emit(req, [], "cancelled")
        self._wake.set()

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    @property
    def n_running(self) -> int:
        return len(self.active)

    # -- engine thread ------------------------------------------------------------------------
    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step until ``stop`` (or ``until()`` is true); failures are reported to the requests they
        touched (``step`` isolates them per request where it can) and logged. Should the loop itself
        die, ``dead`` says why (the server's /health reports it)."""
        try:
            while not self._stop.is_set() and not (until is not None and until()):
                if not self.active and not self.waiting:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._steps += 1
                if self.housekeeping is not None and self._steps % self.HOUSEKEEPING_STEPS == 0:
                    try:
                        self.housekeeping()
                    except Exception:  # noqa: BLE001 - housekeeping is optional work
                        log.exception("engine housekeeping failed (ignored)")
                try:
                    self.step()
                except Exception as e:  # noqa: BLE001 - a failure step() could not pin on one request
                    log.exception("engine step failed: ending the %d requests of the step", len(self.active))
                    for req in list(self.active):
                        self._fail(req, e)
        except BaseException as e:
            self.dead = f"{type(e).__name__}: {e}"
            log.exception("the engine loop stopped")
            with self._lock:
                left, self.waiting = list(self.active) + list(self.waiting), deque()
            for req in left:  # nobody will serve them now: answer them
                req.error = f"the engine stopped ({self.dead})"
                _emit(req, [], "error")
            raise

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def calibrate(self, rows: list[int] | None = None, reps: int = 2, budget_s: float = 30.0,
                  progress: bool = False, keep_as: list | None = None) -> dict[int, float]:
        """Time target passes of several row counts (a scratch sequence), seeding the cost model.

        Row counts are timed coarse to fine (1, 2, 4, 8, ... first, then those between), and
        timing stops once ``budget_s`` seconds have gone by: the cost model interpolates the rest,
        and a slow or busy machine starts in bounded time. ``progress``: a progress bar on stderr.
        ``keep_as``: what identifies the model (a file's key): the costs are then kept per model,
        machine and engine shape and read back by later starts (``forerun.kept``)."""
        if self.drafter is None:
            return {}
        if keep_as is not None:
            from forerun import kept

            key = [*keep_as, self.max_batch, self.policy.k_max, rows, reps, torch.get_num_threads(),
                   type(self.target).__name__, getattr(self.target, "body_kernel", None)]
            costs = kept.measured("batch-costs", key, lambda: {str(r): t for r, t in self.calibrate(
                rows, reps, budget_s, progress).items()}, "timing batched passes once for this model and machine")
            self.policy.costs.update({int(r): t for r, t in costs.items()})
            return dict(sorted(self.policy.costs.items()))
        # every row count up to 16 (kernels are chosen per row count on first use), then a coarser grid
        rows = rows or sorted((set(range(1, 17)) | {24, 32, 48, 64, 96, 128}) & set(
            range(1, self.max_batch * (self.policy.k_max + 1) + 1)))
        powers = [r for r in rows if r & (r - 1) == 0]
        order = powers + [r for r in rows if r not in powers]
        scratch = self.target.fork()
        g = torch.Generator().manual_seed(0)
        t_start = time.perf_counter()
        from tqdm import tqdm

        bar = tqdm(order, desc="timing batched passes", unit="size", disable=not progress, leave=False)
        for r in bar:
            if r + 64 > scratch.max_context:
                continue
            if time.perf_counter() - t_start > budget_s and len(self.policy.costs) >= 2:
                break  # the rest is interpolated
            feed = torch.randint(3, min(self.target.vocab_size, 1000), (64 + r,), generator=g)
            scratch.reset()
            scratch.forward(feed[:64], 0, last_only=True)
            times = []
            for _ in range(reps + 1):
                t = time.perf_counter()
                self._pass([scratch], [feed[64:]], [64], greedy=[True])
                times.append(time.perf_counter() - t)
            self.policy.costs[r] = sorted(times[1:])[len(times[1:]) // 2]
        bar.close()
        del scratch
        return dict(sorted(self.policy.costs.items()))

    def prepare_slots(self) -> None:
        """Make every slot now (its cache allocated in full), as a server does at start: no request
        pays for zeroing a new slot's cache, and memory is what it will be under full load."""
        while self._n_slots < self.max_batch:
            self._free.append(self._new_slot())

    def _slot(self) -> _Slot:
        return self._free.pop() if self._free else self._new_slot()

    def _new_slot(self) -> _Slot:
        self._n_slots += 1
        backend = self.target.fork()
        # the context up front (the server's --max-context), so that memory does not creep up with long
        # prompts; at most RESERVE_POSITIONS: a long-context model's whole context would cost gigabytes
        # per slot (Gemma 3: 32,768 positions), and a longer request still grows its own cache
        backend.reserve(min(backend.max_context, self.RESERVE_POSITIONS))
        return _Slot(backend, None if self.drafter is None else self.drafter.fork())

    def _finish(self, req: BatchRequest, tokens: list[int], reason: str) -> None:
        if req in self.active:
            self.active.remove(req)
        if req.slot is not None:
            self._free.append(req.slot)
            req.slot = None
        _emit(req, tokens, reason)

    def _fail(self, req: BatchRequest, e: Exception) -> None:
        """End a request with an error; its cache is dropped (the failure may have left it half written)."""
        req.error = f"{type(e).__name__}: {e}"
        log.warning("request %s failed: %s", req.id, req.error, exc_info=log.isEnabledFor(logging.DEBUG))
        if req.slot is not None:
            req.slot.backend.reset()
        self._finish(req, [], "error")

    def _admit(self) -> None:
        while len(self.active) < self.max_batch:
            with self._lock:
                if not self.waiting:
                    return
                req = self.waiting.popleft()
            if req.cancelled:
                self._finish(req, [], "cancelled")
                continue
            try:  # a request off the queue is answered whatever happens next
                req.slot = self._slot()
                self._prefill(req)
            except Exception as e:  # noqa: BLE001 - reported to this request only
                self._fail(req, e)
                continue
            self.active.append(req)

    def _prefill(self, req: BatchRequest) -> None:
        t0 = time.perf_counter()
        be, drafter = req.slot.backend, req.slot.drafter
        req.tokens = list(req.prompt)
        req.produced = 0
        req.stats.prompt_tokens = len(req.prompt)
        req.generator = None if req.params.greedy else req.params.generator(getattr(be, "device", torch.device("cpu")))
        be.reset()
        if drafter is not None:
            drafter.begin(req.tokens, req.params, req.generator)
        # the last prompt token is fed with the first verify pass
        prefill(be, req.tokens[:-1], self.layers, drafter.take_features if self.layers else None, self.prefix_cache)
        req.stats.prefill_s = time.perf_counter() - t0

    def _pass(self, backends, feeds, positions, greedy=None, trees=None) -> tuple[list, list[tuple[int, float]]]:
        """Target outputs (logits, and the drafters' feature layers) for every sequence, and the
        (rows, seconds) of each target pass made: one batched pass (token trees included), or, on
        backends that cannot batch, one pass per sequence, where a greedy sequence takes the
        backend's exact argmax pass if it has one (llama.cpp: no full logits)."""
        trees = trees or [None] * len(backends)
        if self.batched:
            t = time.perf_counter()
            tree_kw = {"trees": trees} if any(x is not None for x in trees) else {}
            out = self.target.forward_batch(backends, feeds, positions, greedy=greedy or (), **self._fwd, **tree_kw)
            return out, [(sum(f.numel() for f in feeds), time.perf_counter() - t)]
        greedy = greedy or [False] * len(backends)
        out, times = [], []
        for be, f, p, g, tr in zip(backends, feeds, positions, greedy, trees):
            t = time.perf_counter()
            out.append(pass_outputs(be, f, p, greedy=g, layers=self.layers, tree=tr))
            times.append((f.numel(), time.perf_counter() - t))
        return out, times

    def step(self) -> None:
        """Admit waiting requests, then one draft / verify / accept round for every active one."""
        for req in [r for r in self.active if r.cancelled]:
            self._finish(req, [], "cancelled")
        self._admit()
        reqs = list(self.active)
        if not reqs:
            return
        limit = self.target.max_context
        rooms = [min(r.max_new_tokens - r.produced, limit - len(r.tokens)) for r in reqs]
        # 1. Draft: cheap drafters propose at full length and are cut after; others propose what the policy plans.
        t0 = time.perf_counter()
        drafts: list[Draft] = []
        failed: set[int] = set()

        def propose(r: BatchRequest, k: int) -> Draft:  # a drafter failing ends its own request only
            try:
                d = r.slot.drafter.propose(r.tokens, k) if k > 0 else empty_draft()
                if d.parents is not None and not self.target.capabilities.token_trees:
                    raise ForerunError(f"the {r.slot.drafter.name} drafter proposed a token tree, which this "
                                       "backend cannot verify")
                if d.parents is not None and len(r.tokens) + len(d) > limit:
                    d = first_nodes(d, limit - len(r.tokens))  # the pass needs a cache slot per node
                return d
            except Exception as e:  # noqa: BLE001
                self._fail(r, e)
                failed.add(r.id)
                return empty_draft()

        cheap = self.drafter is None or self.drafter.cheap_proposals
        if self.drafter is None:
            drafts = [empty_draft() for _ in reqs]
        elif cheap:
            for r, room in zip(reqs, rooms):
                drafts.append(propose(r, min(self.policy.k_max, room - 1)))
            ks = self.policy.choose([len(d) for d in drafts], [d.bucket for d in drafts], charge_drafting=False,
                                    confs=[d.conf if d.parents is None else None for d in drafts])
            drafts = [clip_draft(d, k) if d.parents is None else d for d, k in zip(drafts, ks)]  # a tree's size is its drafter's
        else:
            ks = self.policy.choose([max(0, room - 1) for room in rooms], [None] * len(reqs), charge_drafting=True)
            for r, k in zip(reqs, ks):
                drafts.append(clip_draft(propose(r, k), k))
        if failed:
            reqs, drafts = [r for r in reqs if r.id not in failed], [d for r, d in zip(reqs, drafts) if r.id not in failed]
            if not reqs:
                return
        t1 = time.perf_counter()
        if not cheap:
            self.policy.observe_draft(sum(len(d) for d in drafts), t1 - t0)

        # 2. Verify every sequence's draft in one target pass.
        feeds = [torch.cat([torch.tensor(r.tokens[-1:], dtype=torch.long), d.tokens.cpu()]) for r, d in zip(reqs, drafts)]
        rows = sum(f.numel() for f in feeds)
        try:
            passed, pass_times = self._pass([r.slot.backend for r in reqs], feeds, [len(r.tokens) - 1 for r in reqs],
                                            greedy=[r.params.greedy for r in reqs], trees=[d.parents for d in drafts])
        except Exception as e:  # noqa: BLE001 - find which requests fail: each one again on its own
            reqs, drafts, feeds, passed, pass_times = self._pass_alone(reqs, drafts, feeds, e)
            if not reqs:
                return
            rows = sum(f.numel() for f in feeds)
        t2 = time.perf_counter()
        for n_rows, secs in pass_times:
            self.policy.observe_pass(n_rows, secs)

        # 3. Accept, 4. roll back, per sequence.
        report = []
        for r, d, out_i in zip(reqs, drafts, passed):
            try:
                n_acc = self._commit(r, d, out_i, limit, t0, t1, t2, rows, len(reqs))
            except Exception as e:  # noqa: BLE001 - this request only
                self._fail(r, e)
                continue
            report.append((r, len(d), n_acc))
        if self.on_step is not None:
            try:
                self.on_step(rows, t2 - t1, report)
            except Exception:
                pass

    def _pass_alone(self, reqs, drafts, feeds, error: Exception):
        """After a failed batched pass: each sequence's pass on its own; those that fail again end
        with their error, the others go on. Returns what survives as (reqs, drafts, feeds, outputs,
        pass times)."""
        if len(reqs) == 1:
            self._fail(reqs[0], error)
            return [], [], [], [], []
        log.warning("a batched pass of %d sequences failed (%s: %s): each one again on its own", len(reqs),
                    type(error).__name__, error)
        kept = []
        for r, d, f in zip(reqs, drafts, feeds):
            t = time.perf_counter()
            try:
                out = pass_outputs(r.slot.backend, f, len(r.tokens) - 1, greedy=r.params.greedy, layers=self.layers,
                                   tree=d.parents)
            except Exception as e:  # noqa: BLE001
                self._fail(r, e)
                continue
            kept.append((r, d, f, out, (f.numel(), time.perf_counter() - t)))
        return tuple(list(x) for x in zip(*kept)) if kept else ([], [], [], [], [])

    def _commit(self, r: BatchRequest, d: Draft, out_i, limit: int, t0: float, t1: float, t2: float, rows: int,
                n_reqs: int) -> int:
        """Accept one sequence's draft, commit, roll back, report; the drafts accepted."""
        path, out, n_acc = accept(d, out_i, r.params, r.generator)  # path: a tree's accepted rows
        root = len(r.tokens) - 1
        new, n_acc, finish = commit_tokens(out, n_acc, self.eos, r.max_new_tokens - r.produced, limit - len(r.tokens))
        r.tokens.extend(new)
        r.produced += len(new)
        if path is not None:  # the cache keeps the accepted path's rows, right after the root
            r.slot.backend.keep_rows(root, path[:n_acc])
        r.slot.backend.truncate(len(r.tokens) - 1)
        if self.layers:  # features of the kept positions: the last committed token and the accepted drafts
            r.slot.drafter.take_features(root, out_i.layers[kept_rows(path, n_acc)])
        if r.slot.drafter is not None:
            r.slot.drafter.accepted(r.tokens, n_acc)
        self.policy.observe(d.bucket, d.depth, n_acc)
        s = r.stats
        s.record_step(d.depth, n_acc)
        s.verify_s += (t2 - t1) * (len(d) + 1) / rows  # this sequence's share of the pass
        s.draft_s += (t1 - t0) / n_reqs
        s.new_tokens = r.produced
        s.wall_s = time.perf_counter() - r.t_submit
        if finish is not None:
            self._finish(r, new, finish)
        else:
            _emit(r, new, None)
        return n_acc


def _emit(req: BatchRequest, tokens: list[int], finish: str | None) -> None:
    try:
        req.on_event(tokens, finish)
    except Exception:  # noqa: BLE001 - a broken listener must not stop the engine
        pass
