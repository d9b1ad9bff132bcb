"""Every tensor the engine, the drafters, the batch engine and the samplers make names its device.

A GPU is where a tensor made on the wrong device fails (a CUDA logit masked with a CPU mask), and CI
has none: here the models are built on the CPU first, then every path runs with torch's default
device set to ``meta``, so a tensor made without an explicit device is a meta tensor, and the first
operation that mixes it with a real one, or reads it, fails loudly."""

import pytest
import torch
from conftest import run_batch, tiny_gemma, wrap
from test_heads import _train

from forerun.batching import BatchEngine, BatchRequest
from forerun.drafters import make_drafter
from forerun.engine import Engine
from forerun.sampling import SamplingParams

PROMPT = [2, 5, 6, 7, 8, 5, 6, 7, 9, 10, 11, 5, 6, 7]
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=3)


def test_an_undeviced_tensor_fails_under_the_check():
    """The check itself: a tensor made without a device cannot mix with the model's."""
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        (torch.ones(3, device="cpu") + torch.ones(3)).tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    lm = wrap(tiny_gemma(0))
    draft = wrap(tiny_gemma(1, layers=2))
    paths = {}
    for kind in ("eagle", "medusa"):
        head, _ = _train(lm, kind, tmp_path_factory.mktemp(kind), epochs=1)
        paths[kind] = tmp_path_factory.mktemp(kind + "-head")
        head.save(paths[kind])
    return lm, draft, paths


CASES = [("none", {}), ("ngram", {}), ("suffix", {}), ("suffix", {"tree": (8, 4)}), ("layerskip", {}),
         ("draft", {}), ("eagle", {}), ("eagle", {"tree": (8, 3), "tree_lookup": True}), ("medusa", {}),
         ("medusa", {"tree": (8, 2)})]


@pytest.mark.parametrize("method,kw", CASES, ids=[m + ("-tree" if "tree" in kw else "") for m, kw in CASES])
def test_every_method_runs_with_no_default_device(setup, method, kw):
    lm, draft, paths = setup
    for params in (GREEDY, SAMPLED):
        def drafter():
            if method == "none":
                return None
            return make_drafter(method, lm, draft_model=draft if method == "draft" else None,
                                skip_layers=[1, 2] if method == "layerskip" else None,
                                head_path=paths.get(method), **kw)

        want = Engine(lm.backend, drafter(), lm.eos_token_ids).generate(PROMPT, max_new_tokens=10, k=3, params=params)
        eng = Engine(lm.backend, drafter(), lm.eos_token_ids)
        with torch.device("meta"):
            got = eng.generate(PROMPT, max_new_tokens=10, k=3, params=params)
        assert got.token_ids == want.token_ids  # the same run, only the default device differs
        batch = BatchEngine(lm.backend, lm.eos_token_ids, drafter=drafter(), max_batch=2)
        reqs = [BatchRequest(prompt=PROMPT, max_new_tokens=8, params=params),
                BatchRequest(prompt=PROMPT[:9], max_new_tokens=8, params=params)]
        with torch.device("meta"):
            run_batch(batch, reqs)
        assert all(r.error is None for r in reqs), [r.error for r in reqs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fixed_shape_passes_run_with_no_default_device(dtype):
    """The GPU's fixed-shape passes (``backends/fixed_rows.py``): chains, token trees, the batch engine."""
    from forerun.backends.native import NativeBackend

    lm = wrap(tiny_gemma(2))
    lm.backend = NativeBackend(lm.hf_model.to(dtype), fixed_rows=True, pack_linear=False)
    for method, kw in (("ngram", {}), ("suffix", {"tree": (8, 4)})):
        for params in (GREEDY, SAMPLED):
            want = Engine(lm.backend, make_drafter(method, lm, **kw), lm.eos_token_ids).generate(
                PROMPT, max_new_tokens=10, k=3, params=params)
            eng = Engine(lm.backend, make_drafter(method, lm, **kw), lm.eos_token_ids)
            with torch.device("meta"):
                got = eng.generate(PROMPT, max_new_tokens=10, k=3, params=params)
            assert got.token_ids == want.token_ids
            batch = BatchEngine(lm.backend, lm.eos_token_ids, drafter=make_drafter(method, lm, **kw), max_batch=2)
            reqs = [BatchRequest(prompt=PROMPT, max_new_tokens=8, params=params),
                    BatchRequest(prompt=PROMPT[:9], max_new_tokens=8, params=params)]
            with torch.device("meta"):
                run_batch(batch, reqs)
            assert all(r.error is None for r in reqs), [r.error for r in reqs]
