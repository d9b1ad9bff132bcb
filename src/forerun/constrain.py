"""Structured output: a grammar every generated token keeps to (a JSON schema, any JSON object, a
regular expression or a Lark grammar), checked by llguidance.

The lossless reference is plain decoding of the target with the grammar's mask on its logits at
every step: greedy takes the argmax among the allowed tokens, sampling draws from the masked and
renormalised distribution (temperature, top-k and top-p applied after the mask), a seeded
request draws that distribution's seeded sample. Speculation gives exactly that:

- before a verify pass, each draft is walked through the grammar (``Constraint.cut``; a tree's
  ``Constraint.plan_tree``): a drafted token the grammar forbids is cut with everything after it
  (where it came from a sampled q, it is kept as the last token instead: the acceptance rule
  rejects it, p being 0 there, and draws from the residual as it must); every row of the pass
  gets the mask of the state its prefix reaches (``Constraint.chain_bits``, one llguidance call a
  chain, computed while the pass runs where a core is free for it: ``decode.PassMasks``);
- the verifier masks every row's logits before acceptance (``verify.judge``), so every accepted
  token and the target's own token are the masked target's;
- the grammar advances only on committed tokens (``Constraint.commit``); a draft's walk is rolled
  back before the pass;
- where the grammar forces the next tokens (a key's name, ``": "``, a closing brace) they are the
  draft, proposed at no drafting cost (``Constraint.forced``) and counted apart in the stats.

``Grammar`` is what a user asks for; ``TokenGrammar`` binds it to one model's tokenizer and
vocabulary (compiled once); ``TokenGrammar.start()`` gives the per-request ``Constraint``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch

from forerun.errors import ForerunError

KINDS = ("json_schema", "json_object", "regex", "lark")


@dataclass(frozen=True)
class Grammar:
    """What the output must match. ``kind``: one of ``KINDS``; ``source``: the schema as a JSON
    string, the pattern, or the Lark text (empty for ``json_object``)."""

    kind: str
    source: str = ""

    @staticmethod
    def json_schema(schema: dict | str) -> Grammar:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ForerunError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ForerunError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return Grammar("json_schema", json.dumps(schema)).checked()  # key order kept: it is the output's

    @staticmethod
    def json_object() -> Grammar:
        return Grammar("json_object")

    @staticmethod
    def regex(pattern: str) -> Grammar:
        if not isinstance(pattern, str) or not pattern:
            raise ForerunError("a regex must be a non-empty string")
        return Grammar("regex", pattern).checked()

    @staticmethod
    def lark(text: str) -> Grammar:
        if not isinstance(text, str) or not text.strip():
            raise ForerunError("a grammar must be a non-empty Lark text")
        return Grammar("lark", text).checked()

    def compiled(self) -> str:
        """The grammar in llguidance's own form."""
        m = llguidance.LLMatcher
        if self.kind == "json_schema":
            return m.grammar_from_json_schema(self.source, defaults={"whitespace_flexible": False})
        if self.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
        if self.kind == "regex":
            return m.grammar_from_regex(self.source)
        if self.kind == "lark":
            return m.grammar_from_lark(self.source)
        raise ForerunError(f"unknown grammar kind {self.kind!r}; one of {', '.join(KINDS)}")

    def checked(self) -> Grammar:
        """This grammar, or a ForerunError saying why llguidance cannot compile it."""
        try:
            text = self.compiled()
            error = llguidance.LLMatcher.validate_grammar(text)
        except ForerunError:
            raise
        except Exception as e:  # noqa: BLE001 - the library's own message, whatever it raises
            error = str(e) or type(e).__name__
        if error and not error.startswith("WARNING"):
            what = {"json_schema": "JSON schema", "regex": "regex", "lark": "grammar"}.get(self.kind, self.kind)
            lines = [ln.strip() for ln in error.splitlines() if ln.strip().strip("^|0123456789 ")]
            raise ForerunError(f"the {what} cannot be compiled: {'; '.join(lines)}")  # one line
        return self

    def bind(self, tokenizer, vocab_size: int, eos_token_ids) -> TokenGrammar:
        """This grammar over one model's tokens (``vocab_size``: its logits' width)."""
        eos = tuple(sorted(int(t) for t in eos_token_ids)) or (int(tokenizer.eos_token_id),)
        return TokenGrammar(self, token_table(tokenizer, vocab_size, eos), vocab_size, eos)


_TABLES: dict = {}
_TABLES_LOCK = threading.Lock()


def token_table(tokenizer, vocab_size: int, eos_token_ids):
    """llguidance's view of a tokenizer (every token's bytes), built once per tokenizer (1.5 s for
    49,152 tokens, 4.7 s for 262,144 on a 2-core CPU). ``vocab_size``: the model's logits width (ids past
    the tokenizer's are never allowed); ``eos_token_ids``: what ends a generation."""
    eos = sorted(int(t) for t in eos_token_ids)
    key = (id(tokenizer), vocab_size, tuple(eos))
    if isinstance(tokenizer, llguidance.LLTokenizer):  # already llguidance's (a tokenizer of one's own making)
        return tokenizer
    with _TABLES_LOCK:  # one build per tokenizer, whichever thread asks first
        if key not in _TABLES:
            try:
                _TABLES[key] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos))
            except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read
                raise ForerunError(f"structured output cannot use this tokenizer ({type(e).__name__}: {e})") from None
        return _TABLES[key][1]


@dataclass
class TokenGrammar:
    """A grammar bound to one model's tokens: ``start()`` gives each request its own state."""

    grammar: Grammar
    table: object  # llguidance.LLTokenizer
    vocab_size: int
    eos: tuple = ()  # the tokens that end a generation: the only ones allowed once the grammar is complete

    def __post_init__(self):
        self.text = self.grammar.compiled()
        self.start()  # a grammar the tokenizer cannot serve fails here, before any request runs

    def start(self) -> Constraint:
        matcher = llguidance.LLMatcher(self.table, self.text)
        if matcher.is_error():
            raise ForerunError(f"the {self.grammar.kind} grammar cannot be used: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, self.eos)


class Constraint:
    """One request's place in its grammar: the committed tokens consumed, nothing else."""

    def __init__(self, matcher, vocab_size: int, eos=()):
        self.m = matcher
        self.vocab_size = vocab_size
        self.eos = [t for t in eos if 0 <= t < vocab_size]
        self._bits = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # a bit per token
        self._shifts = torch.arange(32, dtype=torch.int32)

    @property
    def stopped(self) -> bool:
        """Nothing more is allowed (the grammar is complete): only an end-of-sequence token."""
        return self.m.is_stopped()

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next, [vocab_size] bool."""
        # (llguidance.torch does the same, but importing it sets torch's compiler up behind our caller)
        self.m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        return self.unpack(self._bits[None], 1)[0]

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here (none where it allows a choice)."""
        if limit <= 0 or self.m.is_stopped():
            return []
        return list(self.m.compute_ff_tokens())[:limit]

    def cut(self, tokens: list[int], sampled_q: bool) -> tuple[int, int]:
        """How far a chain draft's ``tokens`` keep to the grammar, walked without committing them
        (a token check each, not a pass over the vocabulary): (how many to verify, how many the
        grammar allows in a row). A token the grammar forbids is cut with everything after it; with
        ``sampled_q`` (an unseeded draft drawn from a q) it is kept as the last one, for the
        acceptance rule to reject. Nothing may follow the token that completes the grammar."""
        ok = self.m.validate_tokens(tokens) if tokens else 0
        walked = 0
        for t in tokens[:ok]:
            if self.m.is_stopped() or not self.m.consume_token(t):
                break
            walked += 1
        if walked:
            self.m.rollback(walked)
        return (walked + 1 if sampled_q and walked < len(tokens) else walked), walked

    def chain_bits(self, tokens: list[int]) -> torch.Tensor:
        """The masks after each prefix of ``tokens`` (all allowed, as ``cut`` found them), as bits
        [len + 1, words]: one call into llguidance, which walks them, computes each mask and rolls
        back without Python's lock."""
        bits = torch.zeros((len(tokens) + 1, self._bits.numel()), dtype=torch.int32)
        if tokens:
            _executor().unsafe_compute_mask_ptr_with_draft_token([(self.m, 0, list(tokens))], bits.data_ptr(),
                                                                 self._bits.numel() * 4, len(tokens) + 1)
        else:
            self.m.unsafe_compute_mask_ptr(bits.data_ptr(), self._bits.numel() * 4)
        return bits

    def unpack(self, bits: torch.Tensor, rows: int) -> torch.Tensor:
        """``chain_bits`` as [rows, vocab_size] bool, the last mask repeated where ``rows`` is more
        (the row after a kept forbidden token: never reached)."""
        out = ((bits[:, :, None] >> self._shifts) & 1).flatten(1)[:, : self.vocab_size].bool()
        return torch.cat([out, out[-1:].expand(rows - len(out), -1)]) if rows > len(out) else out

    def plan(self, tokens: list[int], sampled_q: bool) -> tuple[int, torch.Tensor]:
        """``cut``, and the mask of every row of the pass [kept + 1, vocab_size]. (The decode step
        cuts before the target's pass and computes the masks while it runs: ``PassMasks``.)"""
        keep, walked = self.cut(tokens, sampled_q)
        return keep, self.unpack(self.chain_bits(tokens[:walked]), keep + 1)

    def plan_tree(self, tokens: list[int], parents: list[int]) -> tuple[list[int], torch.Tensor]:
        """A token tree's nodes the grammar allows (a forbidden node goes with its subtree), and
        the mask of every row of the pass for those nodes [1 + kept, vocab_size] (row 0 the root).
        Tree drafts are deterministic proposals, so a cut node is one the target would reject."""
        masks = {-1: self.allowed()}
        paths: dict[int, list[int]] = {-1: []}  # each kept node's path from the root, itself last
        keep: list[int] = []
        path: list[int] = []  # the nodes consumed now, root first
        ended: set[int] = set()  # nodes that complete the grammar: nothing may follow them
        for i, (t, par) in enumerate(zip(tokens, parents)):
            if par not in paths or par in ended or not bool(masks[par][t]):  # parent cut or final, or forbidden
                continue
            want = paths[par]
            common = 0
            while common < min(len(path), len(want)) and path[common] == want[common]:
                common += 1
            if len(path) > common:  # back to where the parent's path leaves the current one
                self.m.rollback(len(path) - common)
                del path[common:]
            for n in want[common:]:  # then down to the parent
                self.m.consume_token(tokens[n])
                path.append(n)
            if not self.m.consume_token(t):
                raise ForerunError(f"the grammar refused token {t} its mask allowed: {self.m.get_error()}")
            path.append(i)
            paths[i] = want + [i]
            if self.m.is_stopped():
                ended.add(i)
                masks[i] = self._only_end(masks[par])
            else:
                masks[i] = self.allowed()
            keep.append(i)
        if path:
            self.m.rollback(len(path))
        return keep, torch.stack([masks[-1]] + [masks[i] for i in keep])

    def _only_end(self, like: torch.Tensor) -> torch.Tensor:
        """The mask after the grammar is complete: the end-of-sequence tokens alone."""
        mask = torch.zeros_like(like)
        mask[self.eos] = True
        return mask if self.eos else like

    def commit(self, tokens: list[int]) -> int:
        """Advance over committed tokens; how many were consumed before the grammar completed
        (the rest, if any, come after its end)."""
        for n, t in enumerate(tokens):
            if self.m.is_stopped():
                return n
            if not self.m.consume_token(t):
                raise ForerunError(f"token {t} broke the grammar ({self.m.get_error()}): a bug, please report it")
        return len(tokens)


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor():
    """llguidance's executor for ``Constraint.chain_bits``, made on first use."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor(1)
        return _EXECUTOR
