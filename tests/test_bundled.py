"""Integration tests on the bundled Gemma 3 270M (converted once into the cache)."""

import json

import pytest
import torch
from conftest import batch_of_16_equals_plain, spec_bench_prompts

from forerun.drafters import make_drafter
from forerun.engine import Engine
from forerun.errors import ForerunError

pytestmark = pytest.mark.bundled


def test_native_matches_transformers(bundled):
    """The float32 path gives transformers' numbers; the integer path (the default for a GGUF
    file) the same tokens at nearly every position."""
    from forerun.backends.native import NativeBackend

    ids = bundled.tokenizer("The quick brown fox jumps over the lazy dog because", return_tensors="pt").input_ids[0]
    with torch.no_grad():
        ref = bundled.hf_model(ids[None]).logits[0]
    integer = bundled.backend.forward(ids, 0).logits
    assert bundled.backend.model.quant is not None
    assert (integer.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
    assert (integer - ref).abs().max() < 0.1 * ref.abs().max()
    out = NativeBackend(bundled.hf_model).forward(ids, 0).logits
    assert (out - ref).abs().max().item() < 1e-3
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("category", ["summarization", "writing", "math_reasoning"])
def test_greedy_equality_every_drafter(bundled, category):
    text = spec_bench_prompts(category, 1)[0]
    ids = bundled.tokenizer(text).input_ids
    ref = Engine(bundled.backend, None, bundled.eos_token_ids).generate(ids, max_new_tokens=24)
    cases = [("ngram", 4, None), ("ngram", "auto", None), ("layerskip", 3, None),  # eagle/medusa: the shipped heads
             ("eagle", 4, None), ("eagle", 6, (16, 6)), ("medusa", 4, None), ("medusa", 4, (12, 4)),
             ("suffix", "auto", None), ("suffix", 4, (8, None)), ("eagle+adapt", 4, None)]
    for method, k, tree in cases:
        adapt = {"every": 2, "guard_rounds": 4} if method.endswith("+adapt") else None
        method = method.removesuffix("+adapt")
        eng = Engine(bundled.backend, make_drafter(method, bundled, tree=tree, adapt=adapt), bundled.eos_token_ids)
        res = eng.generate(ids, max_new_tokens=24, k=k)
        assert res.token_ids == ref.token_ids, (method, k, tree)
        if method == "eagle" and category == "math_reasoning":  # in the heads' training distribution
            assert res.stats.accepted > 0


def test_plain_decoding_matches_transformers_generate(bundled):
    ids = bundled.tokenizer("Water boils at").input_ids
    ours = Engine(bundled.backend, None, bundled.eos_token_ids).generate(ids, max_new_tokens=16).token_ids
    with torch.inference_mode():
        theirs = bundled.hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                           eos_token_id=sorted(bundled.eos_token_ids), top_p=None, top_k=None)
    assert ours == theirs[0, len(ids):].tolist()


def test_prompt_longer_than_context(bundled):
    limit = bundled.backend.max_context
    with pytest.raises(ForerunError, match="context limit"):
        Engine(bundled.backend, None).generate([2] + [107] * limit, max_new_tokens=4)


def test_cli_generate_bundled(capsys):
    from forerun.cli import main

    rc = main(["generate", "List three colors:", "--method", "ngram", "--max-new-tokens", "16", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    obj = json.loads(out)
    assert obj["new_tokens"] == 16 and obj["text"]


def test_seeded_sampling_gives_plain_decodings_text_for_every_drafter(bundled):
    """Sampled with a seed, the shipped heads (chains and trees), n-gram and suffix, k fixed and
    chosen, give the text plain decoding gives with that seed."""
    from forerun.sampling import SamplingParams

    params = SamplingParams(temperature=0.7, seed=3)
    ids = bundled.tokenizer(spec_bench_prompts("writing", 1)[0]).input_ids
    ref = Engine(bundled.backend, None, bundled.eos_token_ids).generate(ids, max_new_tokens=24, params=params)
    for method, k, tree in (("ngram", 4, None), ("ngram", "auto", None), ("eagle", 4, None), ("eagle", "auto", None),
                            ("eagle", 6, (16, 6)), ("medusa", 4, None), ("medusa", 4, (12, 4)), ("suffix", 4, (8, None)),
                            ("suffix", "auto", None)):
        eng = Engine(bundled.backend, make_drafter(method, bundled, tree=tree), bundled.eos_token_ids)
        assert eng.generate(ids, max_new_tokens=24, params=params, k=k).token_ids == ref.token_ids, (method, tree)


BATCH_PROMPTS = ["Write a short poem about the sea.", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                 "Q: A train travels 60 km in 45 minutes. What is its speed in km/h?\nA:", "List three colors: red,",
                 "The capital of France is Paris. The capital of Italy is", "Translate to French: good morning ->",
                 "Summarize: The cat sat on the mat because the mat was warm and the cat was cold.",
                 "Name: Ada Lovelace\nBorn: 1815\nKnown for:"]


def test_drafters_are_lossless_in_a_batch_of_16(bundled):
    """The batch engine (the server's) with 16 requests at once, greedy and seeded alike, on 8
    prompts of several kinds: a model-free chain's and tree's texts and a trained
    head's are plain decoding's, k chosen up to 16 or up to 4."""
    prompts = [bundled.tokenizer(t).input_ids for t in BATCH_PROMPTS]
    batch_of_16_equals_plain(bundled, [(m, make_drafter(m, bundled, tree=tree), k_max) for m, tree, k_max in (
        ("ngram", None, None), ("suffix", (8, None), 4), ("eagle", None, 4))],
        prompts, new=12)
