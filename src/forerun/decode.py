"""The decode step, written once: draft, verify, accept and roll back for one sequence or many.

Invariant between steps, per sequence: ``tokens`` holds the committed sequence; the sequence's
backend (its KV cache) holds every position except the last token, which the next verify pass runs
together with the drafts. Plain decoding is the same step with empty drafts. ``Engine`` drives it
with one sequence, ``BatchEngine`` (and so the server) with every active request; bench and the
CLI go through ``Engine``.

A step: 1. the drafters offer, the one draft-length policy (``DraftLength``) chooses what each
sequence verifies; 2. every draft is verified through ``verify.verify``: in one batched target
pass where the backend batches and several sequences step together, else one pass per sequence
(with its greedy fast paths); 3. each sequence accepts the longest agreeing prefix plus one token
of the target's own, 4. its cache keeps the accepted positions only, and its drafter hears the outcome
(and the kept rows' features). Every pass is timed here, and only here.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch

from forerun.backends.base import Backend
from forerun.draft_length import DraftLength
from forerun.drafters.base import Draft, Drafter, empty_draft
from forerun.errors import ForerunError
from forerun.prefix_cache import prefill
from forerun.sampling import SamplingParams, SeededNoise
from forerun.stats import GenerationStats
from forerun.verify import Check, Verdict, kept_rows, verify

log = logging.getLogger("forerun")
FORCED_MAX = 16  # the most grammar-forced tokens verified in one pass


@dataclass
class Sequence:
    """One sequence being decoded: what it has committed, its budget, cache and drafter."""

    tokens: list[int]
    max_new_tokens: int
    backend: Backend  # holding this sequence's cache
    drafter: Drafter | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    stats: GenerationStats = field(default_factory=GenerationStats)
    generator: torch.Generator | None = None
    constraint: object = None  # a ``forerun.constrain.Constraint``: the grammar every token keeps to
    produced: int = 0
    t_start: float = field(default_factory=time.perf_counter)


@dataclass
class Outcome:
    """What one step did for one sequence."""

    seq: Sequence
    tokens: list[int]  # committed by this step
    finish: str | None  # "stop" (EOS), "length", "context" or None
    drafted: int  # the draft's depth (its length for a chain)
    accepted: int
    rows: int  # rows it had in the verify pass


def _raise(seq: Sequence, error: Exception) -> None:
    raise error


class Decoder:
    """The step function for one target, one kind of drafter and one draft-length policy.

    ``on_fail(seq, error)`` (per ``step``): where a failure touching one sequence (its drafter, its
    pass, its acceptance) goes; that sequence takes no further part in the step. Without it, the
    error is raised."""

    def __init__(self, target, drafter: Drafter | None, eos_token_ids, policy: DraftLength):
        if drafter is not None and drafter.proposes_trees and not target.capabilities.token_trees:
            raise ForerunError(f"this {drafter.name} drafter proposes token trees, which this backend cannot verify: "
                               "build it without a tree (no tree=..., no --tree-nodes), or use --backend torch")
        self.target = target
        self.drafter = drafter  # the kind of drafter every sequence has (None: plain decoding)
        self.eos = set(int(i) for i in eos_token_ids)
        self.policy = policy
        # trained heads read the target's hidden states at some layers, sent after the prefill and every pass
        self.layers = tuple(drafter.feature_layers) if drafter is not None else ()
        self.batched = target.capabilities.batched
        # a drafter whose forks draft together on a draft model that batches (method draft)
        drafts_with = getattr(drafter, "backend", None)
        self._draft_batch = (getattr(drafter, "batchable", False) and drafts_with is not None
                             and drafts_with.capabilities.draft_batch)
        self.cuda = getattr(target, "device", torch.device("cpu")).type == "cuda"
        # constrained chains' masks: computed while the pass runs where a core is free for it
        self.masks = PassMasks(self.cuda or (os.cpu_count() or 1) > torch.get_num_threads())

    def start(self, seq: Sequence, prefix_cache=None) -> None:
        """Prefill everything but the last token (the first verify pass runs it)."""
        t0 = time.perf_counter()
        seq.stats.prompt_tokens = len(seq.tokens)
        if seq.generator is None and not seq.params.greedy:
            seq.generator = seq.params.generator(getattr(seq.backend, "device", torch.device("cpu")))
        seq.backend.reset()
        if seq.drafter is not None:
            seq.drafter.begin(seq.tokens, seq.params, seq.generator)
        take = seq.drafter.take_features if self.layers else None
        prefill(seq.backend, seq.tokens[:-1], self.layers, take, prefix_cache)
        seq.stats.prefill_s = time.perf_counter() - t0

    def step(self, seqs: list[Sequence], on_fail: Callable[[Sequence, Exception], None] | None = None) -> list[Outcome]:
        """One draft / verify / accept / roll-back round for every sequence."""
        fail = on_fail or _raise
        t0 = time.perf_counter()
        alive = list(range(len(seqs)))
        forced = self._forced(seqs, alive, fail)
        drafting = [i for i in alive if i not in forced]
        drafts, rounds, draft_s = self._draft(seqs, drafting, fail)
        alive = sorted(drafting + list(forced))
        for i, d in forced.items():
            drafts[i] = d
        masks = self._constrain(seqs, drafts, alive, fail)
        try:
            verdicts, pass_s = self._verify(seqs, drafts, alive, fail, masks)
        finally:
            self.masks.wait()  # no grammar is touched while its masks are computed
        rows = sum(len(drafts[i]) + 1 for i in alive) or 1
        share = {i: pass_s * (len(drafts[i]) + 1) / rows for i in alive}  # each sequence's share of the passes
        done = []
        for i in alive:
            try:
                done.append((i, self._commit(seqs[i], drafts[i], verdicts[i], draft_s[i], share[i], i in forced)))
            except Exception as e:  # noqa: BLE001 - this sequence only
                fail(seqs[i], e)
        t = time.perf_counter()
        other = (t - t0 - pass_s - sum(draft_s)) / max(len(done), 1)  # a sequence's share of the step's other work
        for i, o in done:
            o.seq.stats.wall_s = t - o.seq.t_start
            if rounds[i] is None:
                continue
            kind, bucket = rounds[i]  # a round timed whole
            if kind == "model":
                if len(drafts[i]):
                    self.policy.observe_model_round(o.accepted + 1, draft_s[i] + share[i] + other)
                continue
            self.policy.observe_pass(len(drafts[i]) + 1, draft_s[i] + share[i] + other, kind=kind)
            if kind == "tree":
                self.policy.observe_tree(bucket, o.accepted + 1)
        return [o for _, o in done]

    # -- 1. draft ----------------------------------------------------------------------------
    def _forced(self, seqs, alive, fail) -> dict[int, Draft]:
        """Where a grammar forces the next tokens and a drafter is in use: those tokens are the
        draft (no drafter runs for that sequence this round)."""
        if self.drafter is None:  # plain decoding stays plain
            return {}
        out = {}
        limit = self.target.max_context
        for i in list(alive):
            s = seqs[i]
            if s.constraint is None:
                continue
            room = max(0, min(s.max_new_tokens - s.produced, limit - len(s.tokens)) - 1)
            try:
                toks = s.constraint.forced(min(room, FORCED_MAX))
            except Exception as e:  # noqa: BLE001 - this sequence only
                fail(s, e)
                alive.remove(i)
                continue
            if toks:
                out[i] = Draft(tokens=torch.tensor(toks, dtype=torch.long))
        return out

    def _constrain(self, seqs, drafts, alive, fail) -> dict:
        """Each constrained sequence's draft walked through its grammar: a chain cut now where the
        grammar forbids it (``Constraint.cut``) and the mask of every row of its pass computed
        while the pass runs where a core is free for it (``PassMasks``); a tree's nodes and masks
        now (``Constraint.plan_tree``)."""
        jobs = {}
        for i in list(alive):
            s, d = seqs[i], drafts[i]
            if s.constraint is None:
                continue
            toks = d.tokens.tolist()
            try:
                if d.parents is None:
                    sampled_q = d.q is not None and not s.params.greedy and not isinstance(s.generator, SeededNoise)
                    keep, walked = s.constraint.cut(toks, sampled_q)
                    drafts[i] = clip_draft(d, keep)
                    jobs[i] = (s.constraint, toks[:walked], keep + 1)
                else:
                    keep, jobs[i] = s.constraint.plan_tree(toks, d.parents.tolist())
                    drafts[i] = tree_nodes(d, keep)
            except Exception as e:  # noqa: BLE001 - this sequence only
                fail(s, e)
                alive.remove(i)
        return self.masks.start(jobs)

    def _draft(self, seqs, alive, fail):
        """Every sequence's draft; ``rounds[i]``: for a tree-or-chain drafter, ("tree" or "chain",
        this round's trust bucket); for a draft model that drafted without reading first, ("model",
        None); None otherwise."""
        n, pol, proto = len(seqs), self.policy, self.drafter
        drafts: list[Draft] = [empty_draft() for _ in range(n)]
        rounds: list = [None] * n
        secs = [0.0] * n
        if proto is None:
            return drafts, rounds, secs
        limit = self.target.max_context
        caps = [max(0, min(s.max_new_tokens - s.produced, limit - len(s.tokens)) - 1) for s in seqs]

        def timed(i, fn):
            t = time.perf_counter()
            try:
                d = fn()
                if d.parents is not None and not self.target.capabilities.token_trees:
                    raise ForerunError(f"the {seqs[i].drafter.name} drafter proposed a token tree, which this "
                                       "backend cannot verify")
            except Exception as e:  # noqa: BLE001 - a drafter failing ends its own sequence only
                fail(seqs[i], e)
                alive.remove(i)
                d = empty_draft()
            secs[i] += time.perf_counter() - t
            return d

        def propose(i, k):
            return timed(i, lambda: seqs[i].drafter.propose(seqs[i].tokens, k) if k > 0 else empty_draft())

        if proto.offers_tree_or_chain:  # per round: the drafter's tree, or its lookup chain alone
            # how far each sequence drafts at all (under load: maybe not), then tree or chain
            wants = pol.choose([caps[i] for i in alive], [None] * len(alive), charge_drafting=True)
            for i, want in zip(list(alive), wants):
                s = seqs[i]
                chain = timed(i, lambda: s.drafter.lookup_chain(s.tokens, want)) if want > 0 else None
                if chain is None or i not in alive:
                    continue
                cut = pol.tree_or_chain(chain.bucket, chain.conf or [], s.drafter.tree_rows(len(chain)))
                if cut is None:
                    drafts[i] = propose(i, want)
                    rounds[i] = ("tree", chain.bucket)
                else:  # its acceptance counts with the drafter's other rounds, as a tree's does
                    drafts[i] = Draft(tokens=chain.tokens[:cut])
                    rounds[i] = ("chain", chain.bucket)
            pol.observe_draft(sum(len(drafts[i]) for i in alive), sum(secs[i] for i in alive))
        elif proto.cheap_proposals:  # proposed at full length, then cut where it stops paying
            for i in list(alive):
                drafts[i] = propose(i, min(pol.k_max, caps[i]))
            live = [drafts[i] for i in alive]
            ks = pol.choose([len(d) if d.parents is None else 0 for d in live], [d.bucket for d in live],
                            [d.conf if d.parents is None else None for d in live])
            for i, k in zip(alive, ks):
                if drafts[i].parents is None:  # a tree's size is its drafter's
                    drafts[i] = clip_draft(drafts[i], k)
        elif getattr(proto, "stops_early", False):  # a draft model: drafts while the next token pays
            self._draft_model(seqs, alive, caps, drafts, rounds, secs, timed)
        else:  # lengths planned first: drafting costs per token
            ks = pol.choose([caps[i] for i in alive], [None] * len(alive), charge_drafting=True)
            for i, k in zip(list(alive), ks):
                drafts[i] = clip_draft(propose(i, k), k)
            pol.observe_draft(sum(len(drafts[i]) for i in alive), sum(secs[i] for i in alive))
        for i in alive:  # a tree's pass needs a cache position per node
            d, room = drafts[i], limit - len(seqs[i].tokens)
            if d.parents is not None and len(d) > room:
                drafts[i] = first_nodes(d, room)
        return drafts, rounds, secs

    def _draft_model(self, seqs, alive, caps, drafts, rounds, secs, timed) -> None:
        """The drafts of a drafter that stops early (``stops_early``: a draft model). Where it offers
        a model-free chain (``lookup_chain``) and that chain promises more, the chain alone; else
        whether to draft at all is planned from what its first token was worth, it reads what it
        has not read (timed apart: not a draft token's cost), and drafts while the next token pays
        (``DraftLength.draft_more``), every sequence's step in one batched pass where it can."""
        pol = self.policy
        pol.batch(len(alive), len(alive))  # each sequence's rows priced as they cost in this pass
        model = []  # sequences the model may draft for
        for i in list(alive):
            s, k = seqs[i], min(caps[i], pol.k_max)
            chain = timed(i, lambda: s.drafter.lookup_chain(s.tokens, k) or empty_draft()) if k > 0 else empty_draft()
            m = pol.lookup_or_model(chain.conf or [], s.drafter.plan_conf(k)) if len(chain) else None
            if m:
                drafts[i] = Draft(tokens=chain.tokens[:m], bucket=chain.bucket, conf=chain.conf[:m])
            elif i in alive:
                model.append(i)
        ks = pol.choose([min(caps[i], 1) for i in model], [None] * len(model),
                        [seqs[i].drafter.plan_conf(min(caps[i], 1)) for i in model], charge_drafting=True)
        planned = [(i, min(caps[i], pol.k_max)) for i, k in zip(model, ks) if k]
        unread = {i: seqs[i].drafter.unread(seqs[i].tokens) for i, _ in planned}
        planned = [(i, k) for i, k in planned  # a long prompt is read once the request shows it pays
                   if pol.worth_reading(unread[i], seqs[i].produced, caps[i], seqs[i].drafter.plan_conf(k))]
        for i, _ in planned:  # what it has not read (a prompt, a stretch without drafts)
            before = secs[i]
            timed(i, lambda: seqs[i].drafter.catch_up(seqs[i].tokens) or empty_draft())
            pol.observe_reading(unread[i], secs[i] - before)
            if unread[i] > 1:  # it read (``catch_up``): part of its drafting time (``_commit``)
                seqs[i].stats.read_s += secs[i] - before
        reading = list(secs)
        planned = [(i, k) for i, k in planned if i in alive]
        got = self._propose_batch(seqs, planned, secs) if len(planned) > 1 and self._draft_batch else None
        for i, k in planned:
            d = got[i] if got else timed(i, lambda: seqs[i].drafter.propose(seqs[i].tokens, k, pol.draft_more))
            if i in alive:
                drafts[i] = clip_draft(d, pol.cut(d.conf) if d.conf is not None else len(d))
        drafted = [i for i, _ in planned if i in alive]
        for i in drafted:  # a round with no reading in it prices what the model's drafts save
            if unread[i] <= 1:
                rounds[i] = ("model", None)
        # Alone, a sequence's reading (its prompt, mostly) is not what a drafted token costs. In a
        # batch it is: a sequence drafts on and off there, and each time it resumes it first reads
        # what was committed meanwhile, so drafting is priced with its reading.
        spent = secs if len(alive) > 1 else [s - r for s, r in zip(secs, reading)]
        pol.observe_draft(sum(drafts[i].steps or 0 for i in drafted), sum(spent[i] for i in drafted), apart=True)

    def _propose_batch(self, seqs, together, secs) -> dict[int, Draft] | None:
        """The drafts of ``together`` [(sequence, k)], every draft model step one batched pass;
        its time shared out evenly. None where the batched drafting failed (each drafts alone then)."""
        t = time.perf_counter()
        try:
            drafters = [seqs[i].drafter for i, _ in together]
            got = type(drafters[0]).propose_batch(drafters, [seqs[i].tokens for i, _ in together],
                                                 [k for _, k in together], self.policy.draft_more)
        except Exception as e:  # noqa: BLE001 - each sequence drafts on its own, where its failure stays its own
            log.warning("a batched draft of %d sequences failed (%s: %s): each one again on its own", len(together),
                        type(e).__name__, e)
            return None
        spent = (time.perf_counter() - t) / len(together)
        for i, _ in together:
            secs[i] += spent
        return {i: d for (i, _), d in zip(together, got)}

    # -- 2. verify ---------------------------------------------------------------------------
    def _verify(self, seqs, drafts, alive, fail, masks) -> tuple[dict[int, Verdict], float]:
        """Every live sequence's verdict, and the seconds its passes took."""
        t = time.perf_counter()

        def check(i):
            s = seqs[i]
            return Check(s.backend, drafts[i], s.tokens[-1], len(s.tokens) - 1, s.params, s.generator, masks.get(i))

        if self.batched and len(alive) > 1:
            try:
                verdicts = verify(self.target, [check(i) for i in alive], self.layers)
                self._synchronize()
                self.policy.observe_pass(sum(len(drafts[i]) + 1 for i in alive), time.perf_counter() - t)
                return dict(zip(alive, verdicts)), time.perf_counter() - t
            except Exception as e:  # noqa: BLE001 - find which sequences fail: each one again on its own
                log.warning("a batched pass of %d sequences failed (%s: %s): each one again on its own", len(alive),
                            type(e).__name__, e)
        verdicts = {}
        for i in list(alive):
            t_i = time.perf_counter()
            try:
                verdicts[i] = verify(self.target, [check(i)], self.layers)[0]
                self._synchronize()
            except Exception as e:  # noqa: BLE001
                fail(seqs[i], e)
                alive.remove(i)
                continue
            if drafts[i].parents is None:
                self.policy.observe_pass(len(drafts[i]) + 1, time.perf_counter() - t_i)
        return verdicts, time.perf_counter() - t

    def _synchronize(self) -> None:
        if self.cuda:  # kernels run asynchronously: time the pass, not its launch
            torch.cuda.synchronize()

    # -- 3. accept, 4. roll back ----------------------------------------------------------------
    def _commit(self, s: Sequence, d: Draft, v: Verdict, draft_s: float, verify_s: float, forced: bool = False
                ) -> Outcome:
        limit = self.target.max_context
        root = len(s.tokens) - 1
        new, n_acc, finish = commit_tokens(v.tokens, v.accepted, self.eos, s.max_new_tokens - s.produced,
                                           limit - len(s.tokens))
        if s.constraint is not None:  # the grammar moves on committed tokens only
            n = s.constraint.commit(new)
            if n < len(new) or s.constraint.stopped:  # complete: the generation ends here
                new, n_acc, finish = new[:n], min(n_acc, n), "stop"
        s.tokens.extend(new)
        s.produced += len(new)
        if v.rows is not None:  # the cache keeps the accepted path's rows, right after the root
            s.backend.keep_rows(root, v.rows[:n_acc])
        if self.layers:  # features of the kept positions: the last committed token and the accepted drafts
            s.drafter.take_features(root, v.features[kept_rows(v.rows, n_acc)])
        s.backend.truncate(len(s.tokens) - 1)
        if s.drafter is not None:
            s.drafter.accepted(s.tokens, n_acc)
        st = s.stats
        if forced:  # no drafter's guess: the policy and the acceptance figures leave it out
            st.record_forced(len(d), n_acc)
        else:
            self.policy.observe(d.bucket, d.depth, n_acc)
            st.record_step(d.depth, n_acc)
        st.draft_s += draft_s
        st.verify_s += verify_s
        st.head_rows += v.head_rows
        st.head_calls += v.head_calls
        st.verified_rows += len(d) + 1
        st.new_tokens = s.produced
        return Outcome(s, new, finish, d.depth, n_acc, len(d) + 1)


def check_request(prompt, max_new_tokens, target, grammar=None) -> None:
    """What every entry (``Engine``, ``BatchEngine``, the server before them) refuses: an empty
    prompt, token ids outside the vocabulary, a prompt that leaves no room in the context,
    ``max_new_tokens`` that is not an integer >= 1, and a grammar bound to another vocabulary."""
    if not prompt:
        raise ForerunError("empty prompt")
    vocab = target.vocab_size
    try:
        bad = any(isinstance(t, bool) or not 0 <= operator.index(t) < vocab for t in prompt)
    except TypeError:  # not an integer
        bad = True
    if bad:
        raise ForerunError(f"prompt token ids must be integers in 0..{vocab - 1}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ForerunError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if grammar is not None and getattr(grammar, "vocab_size", None) != vocab:
        raise ForerunError(f"the grammar was bound to a vocabulary of {getattr(grammar, 'vocab_size', None)} tokens, "
                           f"the model has {vocab}: bind it with this model's tokenizer (Grammar.bind)")
    limit = target.max_context
    if len(prompt) >= limit:
        raise ForerunError(f"prompt is {len(prompt)} tokens; the context limit is {limit} (room for at least one "
                           "new token is needed)")


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


class PassMasks:
    """The masks of a decode step's constrained chains, computed while the target's pass runs
    where a core is free for it (a GPU's pass, or fewer CPU threads than cores): llguidance walks a
    draft and computes its masks without Python's lock (``Constraint.chain_bits``), and the masks
    are needed only once the pass's logits are out (``verify.judge``); the draft was cut before
    the pass by the walk without masks (``Constraint.cut``). Where every core runs the pass the
    masks are computed before it (on a 2-core CPU with both threads in the pass, computing them
    meanwhile measured the same within noise; a walk in Python holding the lock had cost 18-23%).
    Token trees' masks are always computed before the pass (``Constraint.plan_tree``, in Python).
    One worker thread for the process, started when first needed; each sequence's masks are a job
    of their own, so one grammar's failure is its sequence's alone."""

    _pool: ThreadPoolExecutor | None = None
    _lock = threading.Lock()

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._pending: list = []

    @classmethod
    def _worker(cls) -> ThreadPoolExecutor:
        with cls._lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(1, thread_name_prefix="forerun-masks")
            return cls._pool

    def start(self, jobs: dict) -> dict[int, torch.Tensor | Callable[[], torch.Tensor]]:
        """``jobs``: sequence -> its masks (a tree's), or (the constraint, the chain's allowed
        tokens, the rows of its pass). Returns sequence -> its masks, or a call that waits for them."""
        out = {}
        for i, job in jobs.items():
            if isinstance(job, torch.Tensor):
                out[i] = job
                continue
            c, walked, rows = job
            if not self.overlap:
                try:
                    out[i] = c.unpack(c.chain_bits(walked), rows)
                except Exception as e:  # noqa: BLE001 - raised where this sequence's masks are read
                    out[i] = partial(_reraise, e)
                continue
            fut = self._worker().submit(c.chain_bits, walked)
            self._pending.append(fut)
            out[i] = partial(_unpacked, c, fut, rows)
        return out

    def wait(self) -> None:
        """Wait for every job started (their errors are their sequences', raised where the masks are read)."""
        for job in self._pending:
            job.exception()
        self._pending = []


def _reraise(e: Exception):
    raise e


def _unpacked(c, fut, rows: int) -> torch.Tensor:
    return c.unpack(fut.result(), rows)


def clip_draft(draft: Draft, k: int) -> Draft:
    if draft.parents is not None:  # a tree's depth is bounded by the drafter itself
        if draft.depth > k:
            raise ForerunError(f"drafter returned a tree of depth {draft.depth}, more than the {k} asked for")
        return draft
    if len(draft) <= k:
        return draft
    return Draft(tokens=draft.tokens[:k], q=None if draft.q is None else draft.q[:k], bucket=draft.bucket,
                 conf=None if draft.conf is None else draft.conf[:k], steps=draft.steps)


def tree_nodes(draft: Draft, keep: list[int]) -> Draft:
    """The tree of the nodes ``keep`` (each kept node's parent kept too, in order), renumbered."""
    if len(keep) == len(draft):
        return draft
    new = {-1: -1}
    for j, i in enumerate(keep):
        new[i] = j
    parents = torch.tensor([new[int(draft.parents[i])] for i in keep], dtype=torch.long)
    return Draft(tokens=draft.tokens[keep], q=None, bucket=draft.bucket, parents=parents,
                 conf=None if draft.conf is None else [draft.conf[i] for i in keep])


def first_nodes(draft: Draft, n: int) -> Draft:
    """The tree's first ``n`` nodes (parents come first, so they form a tree)."""
    n = max(0, n)
    return Draft(tokens=draft.tokens[:n], q=None, bucket=draft.bucket, parents=draft.parents[:n],
                 conf=None if draft.conf is None else draft.conf[:n])
