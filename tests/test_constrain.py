"""Structured output under speculation: every method's constrained output equals constrained
plain decoding (greedy and seeded, alone and in a batch), which equals the target with the
grammar's mask on its logits, computed here step by step without the engine; sampled output has
the masked target's exact distribution."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import VOCAB, run_batch

from forerun.batching import BatchEngine, BatchRequest
from forerun.constrain import Grammar
from forerun.drafters import make_drafter
from forerun.engine import Engine
from forerun.errors import ForerunError
from forerun.sampling import SamplingParams

pytest.importorskip("llguidance")

# the tiny models' tokens 4..95 read as one character each (0..3: pad, eos, bos, unk)
CHARS = ' "{}[]:,.-_0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!#$%&()*+/;<=>?@^|~'
assert len(CHARS) == VOCAB - 4
EOS = 1

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"type": "string", "maxLength": 5},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"], "additionalProperties": False}
REGEX = r"[a-f]{2,3}(-[0-9]{2}){2,3}"


class _Chars:
    """The tiny models' tokenizer as llguidance reads one: every token's bytes."""

    eos_token_id = EOS
    bos_token_id = 2
    special_token_ids = [0, 1, 2, 3]
    tokens = [b"<pad>", b"<eos>", b"<bos>", b"<unk>"] + [c.encode() for c in CHARS]

    def __call__(self, s):
        return encode(s.decode() if isinstance(s, bytes) else s)


def encode(text: str) -> list[int]:
    return [4 + CHARS.index(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(CHARS[t - 4] for t in ids if t >= 4)


@pytest.fixture(scope="module")
def table():
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Chars()), n_vocab=VOCAB, eos_token=[EOS])


def bound(grammar: Grammar, table):
    return grammar.bind(table, VOCAB, [EOS])


GRAMMARS = {"schema": Grammar.json_schema(SCHEMA), "regex": Grammar.regex(REGEX)}
PROMPTS = {"schema": encode('{"id":12,"tag":"ab","ok":true} {"id":7,"tag":"ab","ok":false} '),
           "regex": encode("ab-12-34 abc-12-34-56 ab-12-")}


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (list(obj) == ["id", "tag", "ok"] and isinstance(obj["id"], int) and 0 <= obj["id"] <= 999
            and isinstance(obj["tag"], str) and len(obj["tag"]) <= 5 and isinstance(obj["ok"], bool))


def masked_reference(lm, grammar, prompt: list[int], new: int) -> list[int]:
    """Greedy decoding of the target with the grammar's mask, one token at a time, no engine."""
    be = lm.backend.fork()
    be.reset()
    c = grammar.start()
    out: list[int] = []
    logits = be.forward(torch.tensor(prompt), 0).logits[-1].float()
    while len(out) < new:
        t = int(logits.masked_fill(~c.allowed(), float("-inf")).argmax())
        out.append(t)
        c.commit([t])
        if t == EOS or c.stopped:
            break
        logits = be.forward(torch.tensor([t]), len(prompt) + len(out) - 1).logits[-1].float()
    return out


def drafters(lm, draft_lm):
    return [("ngram", make_drafter("ngram", lm)), ("suffix", make_drafter("suffix", lm)),
            ("draft", make_drafter("draft", lm, draft_model=draft_lm)),
            ("layerskip", make_drafter("layerskip", lm, skip_layers=[1])),
            ("suffix-tree", make_drafter("suffix", lm, tree=(8, None)))]


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_greedy_output_is_the_masked_targets_for_every_method(gemma, gemma_draft, table, kind):
    g = bound(GRAMMARS[kind], table)
    prompt, new = PROMPTS[kind], 40
    want = masked_reference(gemma, g, prompt, new)
    assert valid(kind, decode(want)), decode(want)
    plain = Engine(gemma.backend, None, [EOS]).generate(prompt, max_new_tokens=new, grammar=g)
    assert plain.token_ids == want and plain.stats.forced == 0
    forced = 0
    for name, d in drafters(gemma, gemma_draft):
        for k in (3, "auto"):
            res = Engine(gemma.backend, d, [EOS]).generate(prompt, max_new_tokens=new, grammar=g, k=k)
            assert res.token_ids == want, (name, k, decode(res.token_ids), decode(want))
            assert res.finish_reason == "stop"
            forced += res.stats.forced_accepted
    if kind == "schema":  # the keys' names and punctuation come from the grammar, drafted free
        assert forced > 0


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_seeded_output_is_constrained_plain_decodings_text(gemma, gemma_draft, table, kind):
    g = bound(GRAMMARS[kind], table)
    prompt = PROMPTS[kind]
    plain = Engine(gemma.backend, None, [EOS])
    for seed in (1, 2, 3):
        params = SamplingParams(temperature=1.0, top_k=8, seed=seed)
        want = plain.generate(prompt, max_new_tokens=40, params=params, grammar=g).token_ids
        assert valid(kind, decode(want)), decode(want)
        for name, d in drafters(gemma, gemma_draft):
            got = Engine(gemma.backend, d, [EOS]).generate(prompt, max_new_tokens=40, params=params, grammar=g, k=3)
            assert got.token_ids == want, (name, seed)


def test_a_batch_of_16_mixing_grammars_equals_each_alone(gemma, gemma_draft, table):
    """16 requests in one batch engine: the two grammars and none, greedy and seeded."""
    gs = [bound(GRAMMARS["schema"], table), bound(GRAMMARS["regex"], table), None]
    reqs = []
    for i in range(16):
        g = gs[i % 3]
        prompt = PROMPTS["regex" if g is gs[1] else "schema"]
        params = SamplingParams() if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.95, seed=i)
        reqs.append((prompt, params, g))
    plain = Engine(gemma.backend, None, [EOS])
    want = [plain.generate(p, max_new_tokens=24, params=params, grammar=g).token_ids for p, params, g in reqs]
    for name, d in [("ngram", make_drafter("ngram", gemma)), ("draft", make_drafter("draft", gemma, draft_model=gemma_draft)),
                    ("suffix-tree", make_drafter("suffix", gemma, tree=(8, None)))]:
        eng = BatchEngine(gemma.backend, [EOS], drafter=d, max_batch=16)
        got = run_batch(eng, [BatchRequest(prompt=p, max_new_tokens=24, params=params, grammar=g) for p, params, g in reqs])
        assert got == want, (name, [i for i, (a, b) in enumerate(zip(got, want)) if a != b])


def _random_walk(c, gen, limit: int = 40) -> list[int]:
    """A text the grammar allows, drawn token by token among its allowed tokens (committed)."""
    out = []
    while len(out) < limit and not c.stopped:
        ok = c.allowed().nonzero().flatten()
        t = int(ok[torch.randint(len(ok), (1,), generator=gen)])
        out.append(t)
        c.commit([t])
    return out


def _stepwise_masks(c, tokens: list[int], rows: int) -> torch.Tensor:
    """The masks a chain's rows get, the slow way: a mask, a token consumed, a mask, ... (the
    grammar's end: its end tokens alone), the last repeated up to ``rows``, the walk rolled back."""
    masks = [c.allowed()]
    for t in tokens:
        assert c.m.consume_token(t)
        masks.append(c.allowed() if not c.stopped else c._only_end(masks[-1]))
    if tokens:
        c.m.rollback(len(tokens))
    return torch.stack(masks + masks[-1:] * (rows - len(masks)))


def test_a_chains_masks_from_one_call_are_its_masks_step_by_step(table):
    """The decode step cuts a chain with a token check per token (``cut``) and gets its rows'
    masks from one llguidance call (``chain_bits``, run while the pass runs): those are the masks
    of each prefix, wherever the grammar stands, up to and past its end, sampled drafts' kept
    forbidden token included; and the grammar is left where it was."""
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for g in GRAMMARS.values():
        tg = bound(g, table)
        for trial in range(6):
            text = _random_walk(tg.start(), gen)
            for at in range(0, len(text), 3):
                c = tg.start()
                c.commit(text[:at])
                before = c.allowed().clone()
                ahead = text[at: at + 6] + [EOS, 4 + CHARS.index("a")]
                bad = list(ahead)
                j = int(torch.randint(len(bad), (1,), generator=gen))
                bad[j] = int(torch.randint(4, VOCAB, (1,), generator=gen))
                for chain in (ahead, bad):
                    for sampled_q in (False, True):
                        keep, masks = c.plan(chain, sampled_q)
                        walked = c.cut(chain, sampled_q)[1]
                        assert walked <= keep <= walked + 1 and (keep == walked or sampled_q)
                        assert torch.equal(masks, _stepwise_masks(c, chain[:walked], keep + 1))
                        assert torch.equal(c.allowed(), before)
                        checked += 1
    assert checked > 200


@pytest.mark.parametrize("overlap", [True, False])
def test_masks_are_computed_while_the_pass_runs_where_a_core_is_free(gemma, table, monkeypatch, overlap):
    """With a core to spare every chain's masks are computed off the thread that runs the
    passes, and read only after the pass; without one, before it on that thread. Same output."""
    import threading

    import forerun.decode as decode
    from forerun.constrain import Constraint

    where, real = [], Constraint.chain_bits

    def chain_bits(self, tokens):
        where.append(threading.current_thread() is threading.main_thread())
        return real(self, tokens)

    g = bound(GRAMMARS["schema"], table)
    want = masked_reference(gemma, g, PROMPTS["schema"], 24)
    monkeypatch.setattr(Constraint, "chain_bits", chain_bits)
    monkeypatch.setattr(decode.os, "cpu_count", lambda: 64 if overlap else 1)
    for d in (None, make_drafter("ngram", gemma), make_drafter("draft", gemma, draft_model=gemma)):
        where.clear()
        got = Engine(gemma.backend, d, [EOS]).generate(PROMPTS["schema"], max_new_tokens=24, grammar=g).token_ids
        assert got == want and where and set(where) == {not overlap}, d


@pytest.mark.parametrize("overlap", [True, False])
def test_a_grammar_failing_at_its_masks_ends_only_its_own_request(gemma, table, monkeypatch, overlap):
    """A grammar whose masks fail (on the worker, or before the pass) ends its request with an
    error; the others in the batch finish with constrained plain decoding's tokens."""
    import llguidance

    import forerun.decode as decode
    from forerun.constrain import Constraint

    class Breaks(Constraint):
        def chain_bits(self, tokens):
            if tokens:
                raise RuntimeError("mask broke")
            return super().chain_bits(tokens)

    monkeypatch.setattr(decode.os, "cpu_count", lambda: 64 if overlap else 1)
    good = bound(GRAMMARS["schema"], table)
    bad = bound(GRAMMARS["schema"], table)
    bad.start = lambda: Breaks(llguidance.LLMatcher(bad.table, bad.text), bad.vocab_size, bad.eos)
    want = Engine(gemma.backend, None, [EOS]).generate(PROMPTS["schema"], max_new_tokens=24, grammar=good).token_ids
    eng = BatchEngine(gemma.backend, [EOS], drafter=make_drafter("ngram", gemma), max_batch=4)
    reqs = [BatchRequest(prompt=PROMPTS["schema"], max_new_tokens=24, grammar=g) for g in (bad, good, good)]
    got = run_batch(eng, reqs)
    assert reqs[0].error == "RuntimeError: mask broke"
    assert got[1:] == [want, want]


def test_bad_grammars_are_refused_with_the_reason():
    with pytest.raises(ForerunError, match="not valid JSON"):
        Grammar.json_schema("{not json")
    with pytest.raises(ForerunError, match="JSON object"):
        Grammar.json_schema([1, 2])
    with pytest.raises(ForerunError, match="regex cannot be compiled"):
        Grammar.regex("(ab")
    with pytest.raises(ForerunError, match="grammar cannot be compiled"):
        Grammar.lark("start: undefined_rule")
    with pytest.raises(ForerunError, match="JSON schema cannot be compiled"):
        Grammar.json_schema({"type": "no-such-type"})


def test_a_grammar_bound_to_another_vocabulary_is_refused(gemma, table):
    g = Grammar.regex("[a-c]+").bind(table, VOCAB + 4, [EOS])
    with pytest.raises(ForerunError, match="vocabulary"):
        Engine(gemma.backend, None, [EOS]).generate(encode("ab"), max_new_tokens=4, grammar=g)


# -- sampled: the masked target's exact distribution --------------------------------------------
SPREAD_REGEX = "[" + re.escape(CHARS[4:60:2]) + "]" + "[" + re.escape(CHARS[5:61:2]) + "]" + "[a-zA-Z0-9]{3}"


def masked_exact(lm, grammar, setting: str):
    """The exact per-position marginals and joint of the target sampling alone with the grammar's
    mask (``spread.exact`` with every prefix's mask)."""
    from spread import PROMPT, exact

    def mask(prefix):
        c = grammar.start()
        c.commit(prefix)
        return c.allowed()

    return exact(lm, setting, PROMPT, mask=mask)


@pytest.mark.parametrize("method,setting", [("draft", "t1.4-k6-p0.85"),
                                            ("suffix-tree", "t1.4-k6-p0.85")])
def test_sampling_with_a_grammar_has_the_masked_distribution(spread, copy_model, table, method, setting):
    """The grammar cuts some of the target's likeliest tokens at each position (a test checks it), the
    draft model draws from its unmasked q (so it drafts tokens the grammar forbids, which must be
    rejected and the residual drawn from the masked target), and the counts follow the masked
    target's exact marginals and joint."""
    from spread import NEW, PROMPT, SETTINGS, K, check, exact, sample

    g = bound(Grammar.regex(SPREAD_REGEX), table)
    want = masked_exact(spread, g, setting)
    marg, plain = want[0], exact(spread, setting)[0]
    assert all(float((marg[j] - plain[j]).abs().sum()) > 0.2 for j in range(2))  # the mask matters
    tree = (8, None) if method.endswith("-tree") else None
    d = make_drafter(method.removesuffix("-tree"), spread, draft_model=copy_model, tree=tree)
    eng = Engine(spread.backend, d, eos_token_ids=())
    drafted = [0]

    def run(params):
        res = eng.generate(PROMPT, max_new_tokens=NEW, params=params, k=K, grammar=g)
        drafted[0] += res.stats.drafted
        return res.token_ids, res.stats.drafted

    counts, joint, _ = sample(run, setting)
    check(spread, setting, counts, joint, exact_result=want)
    assert drafted[0] > 200, drafted[0]
    assert SETTINGS[setting]


# -- the server, on a real tokenizer ----------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"], "additionalProperties": False}
TEXT = "Extract the person as JSON: Maria Lopez is 34 years old and lives in Madrid, where Maria Lopez works."


@pytest.fixture(scope="module")
def smol_live(smollm2):
    pytest.importorskip("fastapi")
    from serving import setup_for
    from test_server import Live

    from forerun.server.run import build_service

    srv = Live(build_service(setup_for(smollm2, "suffix"), name="smol", max_batch=4, max_tokens=100))
    yield srv
    srv.close()


@pytest.mark.bundled
def test_response_format_through_the_openai_client_equals_constrained_plain_decoding(smollm2, smol_live):
    """The openai package's ``response_format`` unchanged: json_schema (strict) and json_object,
    chat and completions; greedy and seeded texts equal to constrained plain decoding's."""
    from forerun.chat import prompt_ids

    client = smol_live.client()
    plain = Engine(smollm2.backend.fork(), None, smollm2.eos_token_ids)
    g = Grammar.json_schema(PERSON).bind(smollm2.tokenizer, smollm2.backend.vocab_size, smollm2.eos_token_ids)
    ids = prompt_ids(smollm2.tokenizer, TEXT)
    for params, kw in [(SamplingParams(), {"temperature": 0}),
                       (SamplingParams(temperature=0.8, seed=5), {"temperature": 0.8, "seed": 5})]:
        want = smollm2.tokenizer.decode(plain.generate(ids, max_new_tokens=60, params=params, grammar=g).token_ids,
                                        skip_special_tokens=True)
        r = client.chat.completions.create(
            model="smol", max_tokens=60, messages=[{"role": "user", "content": TEXT}], **kw,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        got = r.choices[0].message.content
        assert got == want and list(json.loads(got)) == ["name", "age", "city"], (got, want)
    r = client.completions.create(model="smol", prompt='A JSON object about Paris: ', max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert r.choices[0].text.startswith("{")
    r = client.completions.create(model="smol", prompt="The year it happened: ", max_tokens=10, temperature=0,
                                  extra_body={"regex": "[12][0-9]{3}"})
    assert re.fullmatch("[12][0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"


@pytest.mark.bundled
@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": 5}, "regex"),
    ({"grammar": "start: nowhere"}, "grammar"),
    ({"json_schema": "x"}, "json_schema"),
    ({"regex": "a+", "grammar": "start: \"a\""}, "grammar"),
])
def test_bad_schemas_and_grammars_are_400s_naming_the_field(smol_live, body, param):
    code, resp = smol_live.request("POST", "/v1/completions", body={"model": "smol", "prompt": "Hi", **body})
    assert code == 400 and resp["error"]["param"] == param, resp
    assert resp["error"]["message"]


@pytest.mark.bundled
def test_generate_from_the_command_line_keeps_to_a_schema(smollm2, tmp_path, capsys):
    from forerun.cli import main

    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    rc = main(["generate", TEXT, "--model", "smollm2", "--backend", "torch", "--method", "suffix",
               "--json-schema", str(path), "--max-new-tokens", "60", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["finish_reason"] == "stop"
    assert list(json.loads(out["text"])) == ["name", "age", "city"]


@pytest.mark.bundled
def test_every_method_keeps_constrained_plain_decodings_text_on_smollm2(smollm2):
    """The real model and tokenizer, the shipped head included (eagle, chains and a tree):
    greedy and seeded outputs under the extraction schema equal constrained plain decoding's,
    alone and in a batch of 16 with unconstrained requests."""
    from forerun.chat import prompt_ids

    lm = smollm2
    g = Grammar.json_schema(PERSON).bind(lm.tokenizer, lm.backend.vocab_size, lm.eos_token_ids)
    texts = [TEXT, "Extract the person as JSON: Tom Berg, 61, has lived in Oslo all his life."]
    ids = [prompt_ids(lm.tokenizer, t) for t in texts]
    settings = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=3)]
    plain = Engine(lm.backend, None, lm.eos_token_ids)
    want = {(i, j): plain.generate(p, max_new_tokens=48, params=s, grammar=g).token_ids
            for i, p in enumerate(ids) for j, s in enumerate(settings)}
    methods = [("ngram", make_drafter("ngram", lm)), ("suffix", make_drafter("suffix", lm)),
               ("eagle", make_drafter("eagle", lm)),
               ("eagle-tree", make_drafter("eagle", lm, tree=(16, 4)))]
    for name, d in methods:
        eng = Engine(lm.backend, d, lm.eos_token_ids)
        for (i, j), w in want.items():
            got = eng.generate(ids[i], max_new_tokens=48, params=settings[j], grammar=g, k="auto").token_ids
            assert got == w, (name, i, j)
    free = plain.generate(ids[0], max_new_tokens=24).token_ids
    reqs = [(ids[i % 2], settings[(i // 2) % 2], g) for i in range(12)] + [(ids[0], SamplingParams(), None)] * 4
    expect = [want[(i % 2, (i // 2) % 2)] for i in range(12)] + [free] * 4
    for name, d in [methods[1], methods[2]]:
        eng = BatchEngine(lm.backend, lm.eos_token_ids, drafter=d, max_batch=16)
        got = run_batch(eng, [BatchRequest(prompt=p, max_new_tokens=48 if gr else 24, params=s, grammar=gr)
                              for p, s, gr in reqs])
        assert got == expect, (name, [i for i, (a, b) in enumerate(zip(got, expect)) if a != b])


@pytest.mark.bundled
def test_the_llama_cpp_backend_keeps_the_grammar_losslessly(smollm2_cpp):
    """Its passes give logits (never its argmax alone) where a grammar masks them."""
    from forerun.chat import prompt_ids

    lm = smollm2_cpp
    g = Grammar.json_schema(PERSON).bind(lm.tokenizer, lm.backend.vocab_size, lm.eos_token_ids)
    ids = prompt_ids(lm.tokenizer, TEXT)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=7)):
        outs = [Engine(lm.backend, make_drafter(m, lm) if m != "none" else None, lm.eos_token_ids)
                .generate(ids, max_new_tokens=48, params=params, grammar=g, k=3).token_ids
                for m in ("none", "ngram", "suffix")]
        assert outs[0] == outs[1] == outs[2]
        assert list(json.loads(lm.tokenizer.decode(outs[0], skip_special_tokens=True))) == ["name", "age", "city"]


@pytest.mark.bundled
def test_the_bundled_models_heads_keep_a_regex_losslessly(bundled):
    """The bundled Gemma 3 (262,144 tokens) with its shipped medusa and eagle heads: greedy and
    seeded outputs under a regex equal constrained plain decoding's."""
    lm = bundled
    pattern = r"[A-Z][a-z]{1,12}( [a-z]{1,12}){2,6}\."
    g = Grammar.regex(pattern).bind(lm.tokenizer, lm.backend.vocab_size, lm.eos_token_ids)
    ids = lm.tokenizer.encode("The capital of France is Paris. The capital of Spain is")
    plain = Engine(lm.backend, None, lm.eos_token_ids)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=11)):
        want = plain.generate(ids, max_new_tokens=40, params=params, grammar=g).token_ids
        assert re.fullmatch(pattern, lm.tokenizer.decode(want, skip_special_tokens=True))
        for method in ("medusa", "eagle"):
            got = Engine(lm.backend, make_drafter(method, lm), lm.eos_token_ids).generate(
                ids, max_new_tokens=40, params=params, grammar=g, k=3).token_ids
            assert got == want, (method, params)
