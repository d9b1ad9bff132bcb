"""An independent small model with the target's tokenizer drafts autoregressively."""

from __future__ import annotations

import torch

from forerun.draft_length import Acceptance
from forerun.drafters.base import Draft, Drafter
from forerun.drafters.lookup import common_prefix
from forerun.errors import ForerunError
from forerun.prefix_cache import PrefixCache, keep_chunks, prefill
from forerun.sampling import SeededNoise, logits_to_probs, sample

PROB_BINS = 20  # a drafted token's confidence is learnt per twentieth of its draft probability
MAX_CONTEXT_TOKENS = 4096  # the most tokens contexts add to a draft vocabulary before it starts afresh
MAX_HEAD_PARTS = 8  # parts of one integer weight (qrows.c): the added rows' parts joined into one past it


class ContextVocab:
    """A draft vocabulary (``vocab``, its head ``head``) grown by every token of the contexts the
    draft model reads that it lacks: a prompt's names and words, which a fixed vocabulary chosen
    from other text misses and the target then copies (the Qwen2.5-Coder pair, Spec-Bench chat
    turns, 2026-12-02: 7.8% of the target's tokens outside the 32,768-token vocabulary, 4.1% outside
    it and the prompt; the draft model's top-1 agreement with the target 0.764 -> 0.796). Shared by
    a drafter's forks (one head for a batched step); the added rows come after the vocabulary's
    own, so a head built later holds every row of an earlier one at the same place (each batch of
    new rows one more part of the head, from the file's blocks of those rows only; past
    ``MAX_HEAD_PARTS`` the added rows are joined into one part again). Where the added tokens pass
    ``max_added``, ``start_request`` drops them (between rounds: each round's drafts take one head
    and its map). Only heads on the integer kernels grow (``joined_head``)."""

    def __init__(self, backend, vocab: torch.Tensor, head, max_added: int = MAX_CONTEXT_TOKENS):
        self.backend, self.vocab, self.base_head, self.max_added = backend, vocab, head, max_added
        self.rows = backend.vocab_size  # the draft model's head rows (a target's tokenizer may count more)
        self.known = set(vocab.tolist())
        self.added: list[int] = []
        self.head, self.map = head, vocab
        self._pending: set[int] = set()

    def start_request(self) -> None:
        if len(self.added) > self.max_added:
            self.known.difference_update(self.added)
            self.added, self.head, self.map = [], self.base_head, self.vocab

    def add(self, tokens) -> None:
        """Tokens the vocabulary should hold from the next ``current`` on."""
        self._pending.update(t for t in tokens if t not in self.known and 0 <= t < self.rows)

    def current(self):
        """(head, map) with every token added so far."""
        if self._pending:
            fresh = sorted(self._pending)
            self._pending.clear()
            if len(self.head.qlin.parts) < MAX_HEAD_PARTS:  # the new rows one more part: nothing built again
                head = self.backend.joined_head(self.head, torch.tensor(fresh, dtype=torch.long))
            else:  # the added rows in one part again
                head = self.backend.joined_head(self.base_head, torch.tensor(self.added + fresh, dtype=torch.long))
            if head is not None:
                self.added += fresh
                self.known.update(fresh)
                self.head = head
                self.map = torch.cat([self.vocab, torch.tensor(self.added, dtype=torch.long, device=self.vocab.device)])
        return self.head, self.map


class DraftModelDrafter(Drafter):
    """Drafts token by token with its own model. Every token carries a confidence (``Draft.conf``):
    how often the target took a token drafted with about that probability, learnt from every
    round (``calibration``: an ``Acceptance`` shared by forks, kept across requests, for it
    describes the pair of models); and every position one, how often a draft reached past it
    (``plan_conf``), from which the policy plans how far to draft before it starts. While drafting,
    ``more`` (the policy's ``draft_more``) decides after each token whether the next one pays."""

    name = "draft"
    stops_early = True  # propose takes ``more``; the policy plans with ``plan_conf``
    batchable = True  # propose_batch: forks draft together, a step one batched pass of the draft model

    def __init__(self, backend, vocab: torch.Tensor | None = None, head=None, window: int | None = None,
                 p_min: float = 0.0, calibration: Acceptance | None = None, lookup=None,
                 prefix_cache: PrefixCache | None = None, context_vocab: bool | ContextVocab = True):
        """``vocab``: the token ids the draft may propose (``draft_vocab``), its LM head cut to them.
        ``window``: the most committed tokens the draft reads when it (re)starts: a long prompt, or
        a long stretch it did not draft for, is read from its last ``window`` tokens only (None: all).
        The target verifies every draft, so what the draft reads changes its speed, never the output.
        ``p_min``: drafting stops before a token the draft gives less than this probability (its
        own, over its vocabulary): the draft's length depends on the draft alone, so it stays lossless.
        ``lookup``: a model-free chain (``drafters.lookup``: ``NgramLookup`` or ``SuffixLookup``)
        offered every round beside the model (``lookup_chain``); the policy verifies it alone where
        it promises more tokens per second than the model's draft, and the model then drafts nothing.
        ``prefix_cache``: the draft model's keys and values of prompt chunks, shared by forks
        (``share_prefixes``); a prompt is then read in the cache's chunks from position 0, those
        an earlier prompt computed taken from it (a windowed draft reads as before).
        ``context_vocab``: with ``vocab``, every token of the context that the vocabulary lacks joins
        it (``ContextVocab``; on the integer kernels; False: the vocabulary as given)."""
        if window is not None and window < 1:
            raise ForerunError(f"the draft model's context window must be at least 1 token, got {window}")
        if not 0.0 <= p_min < 1.0:
            raise ForerunError(f"the draft's minimum probability must be in [0, 1), got {p_min}")
        self.p_min = p_min
        self.backend = backend  # its own KV cache, kept in step with the committed tokens
        self.vocab = None if vocab is None else vocab.to(backend.device)
        self.head = head
        self.window = window
        self.offset = 0  # the committed token at the draft cache's position 0
        self.calibration = calibration or Acceptance()
        self._last = None  # the last proposal: (its first token's index, its tokens, its probability bins)
        self.lookup = lookup
        self.prefix_cache = prefix_cache
        if vocab is not None and head is None:  # the integer kernels' rows where the model runs on them
            self.head = getattr(backend, "integer_sub_head", lambda r: None)(vocab) or backend.sub_head(vocab)
        self.context = context_vocab if isinstance(context_vocab, ContextVocab) else None
        if (context_vocab is True and self.vocab is not None and hasattr(backend, "joined_head")
                and getattr(self.head, "qlin", None) is not None):
            self.context = ContextVocab(backend, self.vocab, self.head)
        self._shown = 0  # how many of the sequence's tokens ``context`` has been shown
        self._held = None  # the last sequence's committed tokens (its cache holds a prefix of them)
        self._settled = True  # no draft in the cache beyond the committed tokens (``accepted`` came last)

    def begin(self, prompt, params, generator):
        super().begin(prompt, params, generator)
        keep = self._kept(prompt)
        if keep:
            self.backend.truncate(keep)
        else:
            self.backend.reset()
        self._held = prompt  # the sequence's own list: it grows with every committed token
        self.offset = 0
        self._last = None
        self._shown = 0
        if self.context is not None:
            self.context.start_request()
        if self.lookup is not None:
            self.lookup.begin(prompt, params, generator)

    def fork(self) -> DraftModelDrafter:
        return DraftModelDrafter(self.backend.fork(), self.vocab, self.head, self.window, self.p_min, self.calibration,
                                 None if self.lookup is None else self.lookup.fork(), self.prefix_cache,
                                 self.context if self.context is not None else False)

    def share_prefixes(self, max_bytes: int) -> None:
        if max_bytes > 0 and self.window is None and self.backend.capabilities.kv_segments:
            self.prefix_cache = PrefixCache(max_bytes)

    def _kept(self, prompt: list[int]) -> int:
        """The draft cache positions a new sequence keeps from the last one: those of the tokens the
        two begin with alike (a chat's system prompt and earlier turns, a prompt asked again), so
        that the model does not read them again. Keys and values depend only on the tokens up to
        their position, and the target verifies every draft whatever the draft read: the output
        never depends on what was kept. Only on a backend that holds its cache by position
        (``kv_segments``; a sliding-window cache of transformers cannot go back that far). None where
        the prefix cache would give more of the prompt (it is read through the cache), after a
        windowed read (offset), or where the last sequence ended with drafts in the cache (it failed
        before their verdict)."""
        held = self._held
        if held is None or not self._settled or self.offset != 0 or not self.backend.capabilities.kv_segments:
            return 0
        n = min(common_prefix(held, prompt), self.backend.length, len(held) - 1, len(prompt) - 1)  # committed tokens only
        if n and self.prefix_cache is not None and self.window is None \
                and self.prefix_cache.cached_positions(prompt[:-1]) > n:
            return 0
        return n

    def forget_history(self) -> None:
        """Forget what earlier sequences left: the positions a next one would keep (``_kept``) and
        the lookup's history."""
        self._held = None
        if self.lookup is not None:
            self.lookup.forget_history()

    def lookup_chain(self, tokens: list[int], k: int) -> Draft | None:
        """(``lookup``) this round's model-free chain, with its confidences; None without a lookup."""
        return None if self.lookup is None else self.lookup.chain(tokens, k)

    def plan_conf(self, k: int) -> list[float]:
        """Per position j < k: how often a draft that reached j had its token j taken."""
        return [self.calibration.rate(("at", j)) for j in range(k)]

    def _unread(self, tokens: list[int]) -> int:
        """The draft cache position from which ``tokens`` are unread (restarting a windowed draft
        whose unread stretch is longer than its window)."""
        start = min(self.backend.length, len(tokens) - 1 - self.offset)
        if self.window is not None and len(tokens) - self.offset - start > self.window:
            self.backend.reset()  # more to read than the window: read its last ``window`` tokens afresh
            self.offset, start = len(tokens) - self.window, 0
        return start

    def finished(self, tokens: list[int]) -> None:
        """Keep the whole chunks the draft model read of the finished sequence (the answer too), so
        that a chat's next turn, whose prompt repeats them, is not read again."""
        if self.prefix_cache is not None and self.offset == 0:
            keep_chunks(self.backend, tokens, self.prefix_cache)

    def _from_cache(self, tokens: list[int]) -> bool:
        """Whether ``catch_up`` reads ``tokens`` through the prefix cache: it has one, reads whole
        contexts (no window), and nothing of this sequence is read yet."""
        return (self.prefix_cache is not None and self.window is None and self.backend.length == 0 and self.offset == 0
                and len(tokens) > 2)

    def unread(self, tokens: list[int]) -> int:
        """How many committed tokens ``catch_up`` would compute now (at most its window's; those
        the prefix cache holds are not computed)."""
        start = min(self.backend.length, len(tokens) - 1 - self.offset)
        n = len(tokens) - 1 - self.offset - start
        if self._from_cache(tokens):
            return n - self.prefix_cache.cached_positions(tokens[:-1])
        return n if self.window is None else min(n, self.window)

    def catch_up(self, tokens: list[int]) -> None:
        """Read every committed token but the last where more than a round's usual two are unread
        (the prompt, a stretch without drafting), so that drafting starts from a one-token step."""
        if self._from_cache(tokens):
            prefill(self.backend, tokens[:-1], cache=self.prefix_cache)
            return
        start = self._unread(tokens)
        end = len(tokens) - 1 - self.offset
        if end - start > 1:
            feed = torch.tensor(tokens[self.offset + start: self.offset + end], dtype=torch.long, device=self.backend.device)
            # no logits where the backend can skip its LM head (a full head's row cost the Qwen2.5-Coder
            # 0.5B 5 ms a reading, a third of a 2-token one); elsewhere one row's, which every backend takes
            skip = {"logits": False} if self.backend.capabilities.kv_segments else {}
            self.backend.forward(feed, start, last_only=True, **skip)

    def propose(self, tokens: list[int], k: int, more=None) -> Draft:
        """Up to ``k`` tokens; ``more(conf)``: whether to draft one more after tokens of those
        confidences (None: all ``k``, unless ``p_min`` stops it)."""
        chain, fwd = self._chain(tokens, k, more)
        be = self.backend
        while k > 0 and chain.take(be.forward(chain.feed, chain.pos, last_only=True, **fwd).logits[-1]):
            pass
        return self._drafted(tokens, chain)

    @staticmethod
    def propose_batch(drafters: list[DraftModelDrafter], tokens: list[list[int]], ks: list[int], more=None
                      ) -> list[Draft]:
        """``propose`` for several sequences (forks of one drafter, ``batchable``), each step of
        the draft model one batched pass over the sequences still drafting."""
        for d, t in zip(drafters, tokens):  # every context's tokens first: one head, built once, for every chain
            d._show(t)
        chains, fwd = zip(*(d._chain(t, k, more) for d, t, k in zip(drafters, tokens, ks)))
        be, kw = drafters[0].backend, fwd[0]
        live = [i for i, k in enumerate(ks) if k > 0]
        while live:
            outs = be.forward_batch([drafters[i].backend for i in live], [chains[i].feed for i in live],
                                    [chains[i].pos for i in live], head=kw.get("head"), last_only=True)
            live = [i for i, o in zip(live, outs) if chains[i].take(o.logits[-1])]
        return [d._drafted(t, c) for d, t, c in zip(drafters, tokens, chains)]

    def _chain(self, tokens: list[int], k: int, more) -> tuple[Chain, dict]:
        """This round's draft, ready to draw (what was not read yet fed first), and the forward's options."""
        start = self._unread(tokens)
        feed = torch.tensor(tokens[self.offset + start:], dtype=torch.long, device=self.backend.device)
        fwd = self.forward_kwargs(tokens)
        self._settled = False  # drafts go into the cache until the verdict (``accepted``) cuts them
        chain = Chain(feed, start, k, self.params, self.generator, self.backend.vocab_size, fwd.pop("vocab_map", None),
                      self.offset, self.p_min, lambda p: self.calibration.rate(("p", _bin(p))), more)
        return chain, fwd

    def _drafted(self, tokens: list[int], chain: Chain) -> Draft:
        d = chain.draft()
        self._last = (len(tokens), d.tokens.tolist(), [_bin(p) for p in chain.probs])
        return d

    def forward_kwargs(self, tokens: list[int]) -> dict:
        """Extra arguments for the draft backend's forward (a draft vocabulary's head; subclasses:
        skipped layers)."""
        if self.vocab is None:
            return {}
        if self.context is None:
            return {"head": self.head, "vocab_map": self.vocab}
        self._show(tokens)
        head, vocab_map = self.context.current()
        return {"head": head, "vocab_map": vocab_map}

    def _show(self, tokens: list[int]) -> None:
        """The tokens ``context`` has not been shown yet, to join it at its next ``current``."""
        if self.context is not None:
            self.context.add(tokens[self._shown:])
            self._shown = len(tokens)

    def accepted(self, tokens: list[int], num_accepted: int) -> None:
        # Cached positions are valid up to the last accepted draft; the new token is fed next time.
        self.backend.truncate(max(0, min(self.backend.length, len(tokens) - 1 - self.offset)))
        self._settled = True
        if self.lookup is not None:  # it learns from every committed token, whoever drafted them
            self.lookup.accepted(tokens, num_accepted)
        if self._last is not None:  # every drafted token the committed ones decide (the verified ones, and
            at, proposed, bins = self._last  # the one the target put after them)
            self._last = None
            self.calibration.observe_run([("p", b) for b in bins], proposed, tokens[at:])
            self.calibration.observe_run([("at", j) for j in range(len(proposed))], proposed, tokens[at:])


def pick_token(logits, params, generator, vocab_map=None, vocab_size=None, position: int = 0):
    """One draft token from logits [n]: (token id, q over the full vocabulary, or None when greedy).

    ``vocab_map`` [n] (optional): the logits cover these token ids only; q is zero elsewhere.
    ``position``: the token's index in the sequence; a seeded sequence (``SeededNoise``) draws it
    with the noise the target's own token at that position is drawn with.
    """
    if params.greedy:
        tok = logits.argmax(-1)
        return (tok if vocab_map is None else vocab_map[tok]), None
    q = logits_to_probs(logits, params)
    if vocab_map is not None:
        q = torch.zeros(vocab_size, device=q.device).scatter_(0, vocab_map, q)
    if isinstance(generator, SeededNoise):
        return generator.sample(q, position), q
    return sample(q, generator), q


class Chain:
    """One draft drawn token by token from a model's logits (``DraftModelDrafter.propose``, and
    ``propose_batch`` for several sequences at once).

    ``feed`` runs at ``pos`` first; ``vocab_map`` [n] (optional): the logits cover these token ids
    only. ``offset``: the sequence position of the draft cache's position 0 (a windowed draft), so
    that a seeded token is drawn with its position's noise. ``p_min``: stop before a token drawn with
    less than this probability. ``confidence(p)``: each token's confidence (``Draft.conf``) from its
    draft probability p (``probs``: those of the tokens kept); ``more(conf)``: after each token,
    whether to draft another. ``steps`` counts every forward run, the last one too where ``p_min``
    stopped it."""

    def __init__(self, feed, pos, k, params, generator, vocab_size, vocab_map=None, offset: int = 0,
                 p_min: float = 0.0, confidence=None, more=None):
        self.feed, self.pos, self.k = feed, pos, k
        self.params, self.generator, self.vocab_size, self.vocab_map = params, generator, vocab_size, vocab_map
        self.offset, self.p_min, self.confidence, self.more = offset, p_min, confidence, more
        self.out, self.qs, self.conf, self.probs, self.steps = [], [], [], [], 0

    def take(self, logits) -> bool:
        """The model's logits [n] after ``feed``: draw the next token; whether to draft on (then
        ``feed`` and ``pos`` are the next step's)."""
        self.steps += 1
        self.pos += self.feed.numel()  # the drafted token's index
        tok, q = pick_token(logits, self.params, self.generator, self.vocab_map, self.vocab_size,
                            position=self.pos + self.offset)
        p = _probability(logits, tok, q) if self.p_min > 0.0 or self.confidence is not None else 1.0
        if p < self.p_min:
            return False
        if q is not None:
            self.qs.append(q)
        self.out.append(tok)
        self.probs.append(p)
        if self.confidence is not None:
            self.conf.append(self.confidence(p))
        if len(self.out) >= self.k or (self.more is not None and not self.more(self.conf)):
            return False
        self.feed = tok.view(1)
        return True

    def draft(self) -> Draft:
        tokens = torch.stack(self.out) if self.out else torch.zeros(0, dtype=torch.long, device="cpu")
        return Draft(tokens=tokens.cpu(), q=torch.stack(self.qs) if self.qs else None, steps=self.steps,
                     conf=self.conf if self.confidence is not None else None)


def _bin(p: float) -> int:
    return min(int(p * PROB_BINS), PROB_BINS - 1)


def _probability(logits, tok, q) -> float:
    """The draft's probability of the token it picked: q's where it sampled, else its softmax's
    largest value (greedy picks the argmax)."""
    if q is not None:
        return float(q[tok])
    return float(torch.softmax(logits.float(), -1).max())
