"""Batched speculative decoding: many sequences, one target pass per step.

Each active request owns a slot: a fork of the target backend (its own KV cache) and its own
drafter. Every step drives the decode step (``forerun.decode``) over all active requests: it
drafts for each, verifies every draft in one target pass (the native backend runs the linear
layers on every row at once and attention per sequence; token trees included), then accepts,
rolls back and emits per request. Requests join (prefill) and leave between steps.

How many tokens each request drafts is chosen every step by the one draft-length policy
(``DraftLength``) from the measured cost of a target pass as a function of its rows and the
measured acceptance, so that speculation is used only where it is predicted to raise throughput;
under heavy load the draft length falls to zero and the step is plain batched decoding.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from forerun import kept
from forerun.backends.base import Backend
from forerun.backends.ckernels import release_threads, sources_id
from forerun.decode import Decoder, Sequence, check_request
from forerun.draft_length import K_MAX, DraftLength
from forerun.drafters.base import Drafter
from forerun.errors import ForerunError
from forerun.prefix_cache import PrefixCache, keep_chunks
from forerun.sampling import SamplingParams
from forerun.stats import GenerationStats
from forerun.verify import pass_outputs

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
    grammar: object = None  # a ``forerun.constrain.TokenGrammar`` every new token keeps to
    # Called on the engine thread: (new tokens, finish reason or None). Finish reasons: "stop"
    # (EOS), "length", "context", "cancelled", "error".
    on_event: Callable[[list[int], str | None], None] = lambda tokens, finish: None
    id: int = field(default_factory=lambda: next(_ids))
    stats: GenerationStats = field(default_factory=GenerationStats)
    error: str | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    # engine-side state
    cancelled: bool = False
    slot: _Slot | None = None
    seq: Sequence | None = None  # the decode state while it runs

    @property
    def produced(self) -> int:
        return self.seq.produced if self.seq is not None else 0

    @property
    def tokens(self) -> list[int]:
        """The prompt and every token committed so far."""
        return self.seq.tokens if self.seq is not None else list(self.prompt)


@dataclass
class _Slot:
    backend: Backend
    drafter: Drafter | None


class BatchEngine:
    """Decodes many requests together; drive it with ``run`` on its own thread (or ``step``)."""

    HOUSEKEEPING_STEPS = 50
    RESERVE_POSITIONS = 4096  # cache positions each slot allocates at its start
    # seconds idle before the engine gives its kernel workers back (ckernels.release_threads): a
    # client's next request mostly comes sooner, and would otherwise pay for ending the team and
    # building a new one (a few milliseconds a request at one client)
    RELEASE_IDLE_S = 0.5

    def __init__(self, target, eos_token_ids=(), *, drafter=None, max_batch: int = 8, max_waiting: int = 64,
                 k_max: int = K_MAX, speculate: bool = True, prefix_cache_bytes: int = 0):
        """``drafter``: a prototype; every slot gets its own ``drafter.fork()``. None (or
        ``speculate=False``): plain batched decoding. ``prefix_cache_bytes``: memory for prompt
        prefixes shared between requests (``forerun.prefix_cache``; 0: none), on backends that can
        copy their cache (``kv_segments``); there every prompt is prefilled in the cache's chunks,
        with or without it, so that output never depends on what was cached."""
        if max_batch < 1:
            raise ForerunError(f"max_batch must be >= 1, got {max_batch}")
        if prefix_cache_bytes < 0:
            raise ForerunError(f"the prefix cache size must be >= 0, got {prefix_cache_bytes}")
        self.target = target
        self.drafter = drafter if speculate else None
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.batched = target.capabilities.batched
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if target.capabilities.kv_segments and prefix_cache_bytes else None
        if self.drafter is not None and prefix_cache_bytes:  # a draft model keeps its own prefixes, as much again
            self.drafter.share_prefixes(prefix_cache_bytes)
        # the server's draft lengths: slower to forget, and drafting must beat plain batched decoding by 3%
        self.policy = DraftLength(k_max=k_max, decay=0.95, margin=0.03, probe_every=32, sequential=not self.batched)
        self.decoder = Decoder(target, self.drafter, eos_token_ids, self.policy)
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
        self.housekeeping: Callable | None = None  # called every HOUSEKEEPING_STEPS steps by run (e.g. heap trimming)
        self._steps = 0

    # -- requests (any thread) --------------------------------------------------------------
    def submit(self, req: BatchRequest) -> BatchRequest:
        check_request(req.prompt, req.max_new_tokens, self.target, req.grammar)
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
        busy, idle_since = False, 0.0
        try:
            while not self._stop.is_set() and not (until is not None and until()):
                if not self.active and not self.waiting:
                    now = time.monotonic()
                    if busy:
                        busy, idle_since = False, now
                    elif idle_since and now - idle_since >= self.RELEASE_IDLE_S:
                        # idle a while: another thread may run the model meanwhile (ckernels.release_threads)
                        release_threads()
                        idle_since = 0.0
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                busy = True
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
            key = [*keep_as, self.max_batch, self.policy.k_max, rows, reps, torch.get_num_threads(),
                   type(self.target).__name__, self.target.report().get("body_kernel"), sources_id()]
            costs = kept.measured("batch-costs", key, lambda: {str(r): t for r, t in self.calibrate(
                rows, reps, budget_s, progress).items()}, "timing batched passes once for this model and machine")
            self.policy.costs["pass"].update({int(r): t for r, t in costs.items()})
            return dict(sorted(self.policy.costs["pass"].items()))
        # every row count up to 16 (kernels are chosen per row count on first use), then a coarser grid
        rows = rows or sorted((set(range(1, 17)) | {24, 32, 48, 64, 96, 128}) & set(
            range(1, self.max_batch * (self.policy.k_max + 1) + 1)))
        powers = [r for r in rows if r & (r - 1) == 0]
        order = powers + [r for r in rows if r not in powers]
        scratch = self.target.fork()
        g = torch.Generator().manual_seed(0)
        t_start = time.perf_counter()

        bar = tqdm(order, desc="timing batched passes", unit="size", disable=not progress, leave=False)
        for r in bar:
            if r + 64 > scratch.max_context:
                continue
            if time.perf_counter() - t_start > budget_s and len(self.policy.costs["pass"]) >= 2:
                break  # the rest is interpolated
            feed = torch.randint(3, min(self.target.vocab_size, 1000), (64 + r,), generator=g, device="cpu")
            scratch.reset()
            scratch.forward(feed[:64], 0, last_only=True)
            times = []
            for _ in range(reps + 1):
                t = time.perf_counter()
                self._pass(scratch, feed[64:], 64)
                times.append(time.perf_counter() - t)
            self.policy.costs["pass"][r] = sorted(times[1:])[len(times[1:]) // 2]
        bar.close()
        del scratch
        release_threads()  # timed on this thread; the engine may run on another
        return dict(sorted(self.policy.costs["pass"].items()))

    def _pass(self, backend, feed: torch.Tensor, position: int) -> None:
        """One greedy pass of one sequence, as decoding runs it (calibration)."""
        if self.batched:
            self.target.forward_batch([backend], [feed], [position], greedy=[True])
        else:
            pass_outputs(backend, feed, position, greedy=True)

    def prepare_slots(self) -> None:
        """Make every slot now (its cache allocated in full), as a server does at start: no request
        pays for zeroing a new slot's cache, and memory is what it will be under full load."""
        while self._n_slots < self.max_batch:
            self._free.append(self._new_slot())
        release_threads()  # the caches were zeroed on this thread; the engine may run on another

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
        if req.slot is not None and req.seq is not None and reason != "error":
            self._keep(req)
        if req.slot is not None:
            self._free.append(req.slot)
            req.slot = None
        _emit(req, tokens, reason)

    def _keep(self, req: BatchRequest) -> None:
        """What a finished request leaves for a later prompt that starts with its tokens (a chat's
        next turn): its drafter's prefixes, and the target's whole chunks, answer included, where
        any pass would have computed the same bits (``kv_any_pass``; not where a trained head's
        features would be wanted with them). Never the request's failure."""
        try:
            if req.slot.drafter is not None:
                req.slot.drafter.finished(req.seq.tokens)
            if self.prefix_cache is not None and self.target.capabilities.kv_any_pass and not self.decoder.layers:
                keep_chunks(req.slot.backend, req.seq.tokens, self.prefix_cache)
        except Exception as e:  # noqa: BLE001
            log.warning("request %s: its prefix could not be kept: %s", req.id, e)

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
        req.seq = Sequence(list(req.prompt), req.max_new_tokens, req.slot.backend, req.slot.drafter, req.params,
                           req.stats, t_start=req.t_submit,
                           constraint=req.grammar.start() if req.grammar is not None else None)
        self.decoder.start(req.seq, self.prefix_cache)

    def step(self) -> None:
        """Admit waiting requests, then one draft / verify / accept round for every active one."""
        for req in [r for r in self.active if r.cancelled]:
            self._finish(req, [], "cancelled")
        self._admit()
        reqs = list(self.active)
        if not reqs:
            return
        of = {id(r.seq): r for r in reqs}
        t = time.perf_counter()
        outs = self.decoder.step([r.seq for r in reqs], on_fail=lambda seq, e: self._fail(of[id(seq)], e))
        seconds = time.perf_counter() - t
        report = []
        for o in outs:
            r = of[id(o.seq)]
            report.append((r, o.drafted, o.accepted))
            if o.finish is not None:
                self._finish(r, o.tokens, o.finish)
            else:
                _emit(r, o.tokens, None)
        if self.on_step is not None and outs:
            try:
                self.on_step(sum(o.rows for o in outs), seconds, report)
            except Exception:  # noqa: BLE001 - metrics must not stop the engine
                pass

def _emit(req: BatchRequest, tokens: list[int], finish: str | None) -> None:
    try:
        req.on_event(tokens, finish)
    except Exception:  # noqa: BLE001 - a broken listener must not stop the engine
        pass
