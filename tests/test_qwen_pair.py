"""The real draft-target pair: Qwen2.5-Coder-0.5B-Instruct drafting for -1.5B-Instruct (Q4_K_M, the
torch backend's integer path). Greedy and seeded output of every method (the draft model alone
and with a suffix chain beside it, suffix) equal plain decoding's, alone and in the batch engine.
Runs where the pair is kept (``forerun models pull qwen2.5-coder-1.5b qwen2.5-coder-0.5b``, 1.6 GB);
skips, naming that command, where it is not."""

import pytest
from conftest import run_batch

from forerun.batching import BatchEngine, BatchRequest
from forerun.drafters import make_drafter
from forerun.engine import Engine
from forerun.sampling import SamplingParams
from forerun.split_models import SPLIT_MODELS, is_kept

pytestmark = pytest.mark.bundled

BIG, SMALL = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
           "    \"\"\"Check if any two numbers in the list are closer to each other than threshold.\"\"\"\n",
           "def parse_csv_line(line: str) -> list[str]:\n"]


@pytest.fixture(scope="module")
def pair():
    from forerun.models import load_model

    missing = [n for n in (BIG, SMALL) if not is_kept(SPLIT_MODELS[n])]
    if missing:
        pytest.skip(f"the Qwen2.5-Coder pair is not here: forerun models pull {' '.join(missing)}")
    return load_model(BIG, backend="torch"), load_model(SMALL, backend="torch")


def _ids(lm, text):
    return lm.tokenizer(text).input_ids


def test_draft_and_suffix_are_lossless_greedy(pair):
    target, draft = pair
    eos = target.eos_token_ids
    prompts = [_ids(target, p) for p in PROMPTS]
    plain = [Engine(target.backend, None, eos).generate(p, max_new_tokens=40).token_ids for p in prompts]
    accepted = 0
    for method, k, lookup in (("draft", 4, None), ("draft", "auto", None), ("draft", "auto", "suffix"),
                              ("suffix", "auto", None)):
        eng = Engine(target.backend, make_drafter(method, target, draft_model=draft if method == "draft" else None,
                                                  draft_lookup=lookup), eos)
        outs = [eng.generate(p, max_new_tokens=40, k=k) for p in prompts]
        assert [o.token_ids for o in outs] == plain, (method, k, lookup)
        accepted += sum(o.stats.accepted for o in outs) if method == "draft" else 0
    assert accepted > 40  # the 0.5B model agrees with the 1.5B most of the time: equality over long accepted runs


def test_seeded_sampling_through_the_draft_model_is_plain_decodings_text(pair):
    target, draft = pair
    eos = target.eos_token_ids
    prompt = _ids(target, PROMPTS[0])
    for seed in (1, 2):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
        plain = Engine(target.backend, None, eos).generate(prompt, max_new_tokens=32, params=params).token_ids
        got = Engine(target.backend, make_drafter("draft", target, draft_model=draft), eos).generate(
            prompt, max_new_tokens=32, params=params, k=4).token_ids
        assert got == plain, seed


def test_the_batch_engine_with_the_draft_model_equals_plain(pair):
    target, draft = pair
    eos = target.eos_token_ids
    prompts = [_ids(target, p) for p in PROMPTS]
    plain = [Engine(target.backend, None, eos).generate(p, max_new_tokens=24).token_ids for p in prompts]
    for lookup in (None, "suffix"):  # the draft model's steps batched over the sequences drafting
        eng = BatchEngine(target.backend, eos, drafter=make_drafter("draft", target, draft_model=draft,
                                                                    draft_lookup=lookup), max_batch=4)
        reqs = [BatchRequest(prompt=list(prompts[i % 3]), max_new_tokens=24) for i in range(4)]
        assert run_batch(eng, reqs) == [plain[i % 3] for i in range(4)], lookup
        assert sum(r.stats.drafted for r in reqs) > 0


@pytest.fixture(scope="module")
def draft_4bit(pair):
    from forerun.models import load_model

    draft = load_model(SMALL, backend="torch")
    assert draft.backend.requantize_4bit()  # as forerun's --draft-quant q4_0 (the default) loads it
    return draft


def test_the_draft_model_recoded_to_4_bits_is_lossless(pair, draft_4bit):
    target, _ = pair
    eos = target.eos_token_ids
    prompts = [_ids(target, p) for p in PROMPTS]
    plain = Engine(target.backend, None, eos)
    eng = Engine(target.backend, make_drafter("draft", target, draft_model=draft_4bit), eos)
    accepted = 0
    for p in prompts:
        want = plain.generate(p, max_new_tokens=40).token_ids
        for k in (4, "auto"):
            out = eng.generate(p, max_new_tokens=40, k=k)
            assert out.token_ids == want, k
            accepted += out.stats.accepted
    assert accepted > 40
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    assert (eng.generate(prompts[0], max_new_tokens=32, params=params, k=4).token_ids
            == plain.generate(prompts[0], max_new_tokens=32, params=params).token_ids)
