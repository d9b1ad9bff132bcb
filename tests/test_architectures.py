"""The native forward on every architecture it claims, against transformers' own modules.

Tiny random configurations, built offline. Each is checked for: the logits of a prompt pass and of
one-token steps (across a sliding window where the architecture has one), greedy decoding equal to
transformers' ``generate()``, and lossless speculation with every method that runs on a target
alone (ngram, layerskip, trained heads in chains and trees, batching)."""

import pytest
import torch
from conftest import VOCAB, run_batch, wrap
from test_engine import PROMPTS

from forerun.engine import Engine


def _cfg(cls, **kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                initializer_range=0.3)
    base.update(kw)
    return cls(**base)


def _build(arch: str, seed: int = 0, **extra):
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "llama":
        cfg = _cfg(tf.LlamaConfig)
    elif arch == "llama-bias-rope3":  # Llama 3's rope scaling and biased projections
        cfg = _cfg(tf.LlamaConfig, attention_bias=True, mlp_bias=True, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif arch == "mistral":
        cfg = _cfg(tf.MistralConfig, sliding_window=8, head_dim=16)
    elif arch == "qwen2":
        cfg = _cfg(tf.Qwen2Config)
    elif arch == "qwen3":
        cfg = _cfg(tf.Qwen3Config, head_dim=16)
    elif arch == "gemma":
        cfg = _cfg(tf.GemmaConfig, head_dim=16)
    elif arch == "gemma2":
        cfg = _cfg(tf.Gemma2Config, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    elif arch == "gemma3":
        cfg = _cfg(tf.Gemma3TextConfig, head_dim=16, sliding_window=8, num_key_value_heads=1,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    else:
        raise ValueError(arch)
    for key, value in extra.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # transformers starts biases at zero: random ones, so that a bias the forward drops shows
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.3)
    return model


ARCHS = ["llama", "llama-bias-rope3", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    model = _build(request.param)
    return request.param, model, wrap(model, name=f"tiny-{request.param}")


def test_native_backend_matches_transformers(arch_model):
    arch, model, lm = arch_model
    be = lm.backend
    assert type(be).__name__ == "NativeBackend", arch
    ids = torch.randint(4, VOCAB, (40,), generator=torch.Generator().manual_seed(0))  # past the window (8)
    with torch.no_grad():
        ref = model(ids[None].to(model.device)).logits[0].float()
    be.reset()
    full = be.forward(ids, 0).logits
    assert torch.allclose(full, ref, atol=2e-4), (arch, (full - ref).abs().max())
    be.reset()
    be.forward(ids[:30], 0)
    for i in range(30, 40):
        step = be.forward(ids[i: i + 1], i).logits[0]
        assert torch.allclose(step, ref[i], atol=2e-4), (arch, i)


def test_plain_greedy_equals_transformers_generate(arch_model):
    arch, model, lm = arch_model
    for p in PROMPTS[:2]:
        ours = Engine(lm.backend, None, lm.eos_token_ids).generate(p, max_new_tokens=20).token_ids
        with torch.inference_mode():
            theirs = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, top_p=None, top_k=None,
                                    eos_token_id=sorted(lm.eos_token_ids), pad_token_id=0)
        assert ours == theirs[0, len(p):].tolist(), arch


@pytest.mark.parametrize("method", ["ngram", "layerskip"])
def test_speculation_is_lossless(arch_model, method):
    from forerun.drafters import make_drafter

    arch, _, lm = arch_model
    drafter = make_drafter(method, lm, skip_layers=[1, 2] if method == "layerskip" else None)
    ref = Engine(lm.backend, None, lm.eos_token_ids)
    eng = Engine(lm.backend, drafter, lm.eos_token_ids)
    drafted = 0
    for p in PROMPTS:
        want = ref.generate(p, max_new_tokens=24).token_ids
        res = eng.generate(p, max_new_tokens=24, k=3)
        assert res.token_ids == want, (arch, method)
        drafted += res.stats.drafted
    assert drafted > 0


def test_trained_heads_chains_trees_and_batches(arch_model, tmp_path):
    """An EAGLE head and Medusa heads trained on the tiny target: chains, trees (with the lookup
    branch) and batched serving all give plain greedy output."""
    from test_heads import _train

    from forerun.batching import BatchEngine, BatchRequest
    from forerun.drafters import make_drafter

    arch, _, lm = arch_model
    for kind in ("eagle", "medusa"):
        head, _ = _train(lm, kind, tmp_path / kind, epochs=2)
        head.save(tmp_path / f"{kind}-head")
        if kind == "eagle":
            _check_export(arch, lm, head, tmp_path / "export")
        ref = Engine(lm.backend, None, lm.eos_token_ids)
        for tree, lookup in ((None, False), ((6, 3), False), ((4, 2), True)):
            eng = Engine(lm.backend, make_drafter(kind, lm, head_path=tmp_path / f"{kind}-head", tree=tree,
                                                  tree_lookup=lookup), lm.eos_token_ids)
            for p in PROMPTS[:3]:
                assert eng.generate(p, max_new_tokens=16, k=3).token_ids == ref.generate(p, max_new_tokens=16).token_ids, \
                    (arch, kind, tree, lookup)
        batch = BatchEngine(lm.backend, lm.eos_token_ids, max_batch=3,
                            drafter=make_drafter(kind, lm, head_path=tmp_path / f"{kind}-head"))
        batch.policy.margin = -1.0  # always draft
        batch.calibrate(reps=1)
        got = run_batch(batch, [BatchRequest(prompt=p, max_new_tokens=16) for p in PROMPTS])
        assert got == [ref.generate(p, max_new_tokens=16).token_ids for p in PROMPTS], (arch, kind)


def _check_export(arch, lm, head, out):
    """export-draft on every architecture: vLLM's EAGLE-3 path takes Llama, Mistral and Qwen
    targets (a speculators checkpoint with the fields vLLM reads), and refuses Gemma's."""
    import json

    from forerun.training.export import check_speculators_config, export_head, refusal

    cfg = lm.hf_model.config.to_dict()
    why = refusal(head, "speculators", cfg)
    if arch.startswith("gemma"):
        assert why is not None and "vLLM's EAGLE-3 drafting runs" in why, (arch, why)
        return
    assert why is None, (arch, why)
    export_head(head, out, fmt="speculators", target=cfg, verifier=f"tiny-{arch}", k=3)
    config = json.loads((out / "config.json").read_text())
    check_speculators_config(config)
    assert config["speculators_config"]["verifier"]["architectures"] == list(cfg.get("architectures") or [])
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.cfg.feature_layers]
