"""forerun export-draft: an eagle head as vLLM's speculators checkpoint or the EAGLE-3 layout SGLang
loads. The exported tensors must be the head's, the maps complete, the config what vLLM reads, and
the checkpoint the same function as the head (checked against an EAGLE-3 forward written here
from the format alone); heads that cannot be exported are refused with the reason."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama, wrap
from test_engine import PROMPTS
from test_heads import _train

from forerun.drafters import make_drafter
from forerun.drafters.head_training import TrainConfig, Trainer
from forerun.drafters.heads import eagle3_feature_layers, load_head
from forerun.engine import Engine
from forerun.errors import ForerunError
from forerun.training.export import SPECULATORS_REQUIRED, check_speculators_config, export_head, export_tensors, refusal

LAYERS = 8  # enough for EAGLE-3's three feature layers (outputs of 1, 3 and 4)


@pytest.fixture(scope="module")
def llama8():
    return wrap(tiny_llama(3, layers=LAYERS))


@pytest.fixture(scope="module")
def heads(llama8, tmp_path_factory):
    out = {}
    for shape in ("forerun", "eagle3"):
        head, report = _train(llama8, "eagle", tmp_path_factory.mktemp(shape), epochs=6, shape=shape,
                              soft_labels=0.3 if shape == "eagle3" else 0.0)
        path = tmp_path_factory.mktemp(shape + "-head")
        head.save(path)
        out[shape] = (path, report)
    return out


def _target_config(lm) -> dict:
    return lm.hf_model.config.to_dict()


def test_eagle3_shape_trains_without_feature_norms(heads, llama8):
    head = load_head(heads["eagle3"][0])
    assert head.cfg.feature_norms is False and head.feat_norms is None
    assert head.cfg.feature_layers == eagle3_feature_layers(LAYERS) == [1, 3, 4]
    assert not any(k.startswith("feat_norms") for k in head.state_dict())
    hist = heads["eagle3"][1]["history"]
    assert sum(hist[-1]["val_agreement"]) > sum(hist[0]["val_agreement"]) + 0.05, hist
    # the default shape keeps its norms and the last layer, and its file says nothing of the new field
    assert load_head(heads["forerun"][0]).cfg.feature_layers[-1] == LAYERS - 1
    assert "feature_norms" not in json.loads((heads["forerun"][0] / "config.json").read_text())
    assert json.loads((heads["eagle3"][0] / "config.json").read_text())["feature_norms"] is False


@pytest.mark.parametrize("shape", ["forerun", "eagle3"])
@pytest.mark.parametrize("k,tree", [(3, None), ("auto", None), (4, (8, 3))])
def test_both_shapes_are_lossless(heads, llama8, shape, k, tree):
    drafter = make_drafter("eagle", llama8, head_path=heads[shape][0], tree=tree)
    ref = Engine(llama8.backend, None, llama8.eos_token_ids)
    eng = Engine(llama8.backend, drafter, llama8.eos_token_ids)
    for p in PROMPTS:
        res = eng.generate(p, max_new_tokens=20, k=k)
        assert res.token_ids == ref.generate(p, max_new_tokens=20).token_ids
    assert res.stats.drafted > 0


@pytest.mark.parametrize("shape", ["forerun", "eagle3"])
def test_exported_tensors_are_the_heads(heads, shape):
    head = load_head(heads[shape][0])
    t = export_tensors(head)
    A = head.cfg.n_heads * head.cfg.head_dim
    assert torch.equal(torch.cat([t[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]), head.qkv.weight)
    assert t["midlayer.self_attn.q_proj.weight"].shape == (A, 2 * head.cfg.hidden_size)
    assert torch.equal(torch.cat([t["midlayer.mlp.gate_proj.weight"], t["midlayer.mlp.up_proj.weight"]]),
                       head.gate_up.weight)
    for name, mod in (("fc", head.fuse), ("midlayer.self_attn.o_proj", head.o), ("midlayer.mlp.down_proj", head.down),
                      ("lm_head", head.lm_head), ("norm", head.norm_out), ("midlayer.input_layernorm", head.norm_emb),
                      ("midlayer.hidden_norm", head.norm_hid), ("midlayer.post_attention_layernorm", head.norm_mlp)):
        assert torch.equal(t[name + ".weight"], mod.weight), name
    assert any(k.startswith("fc_norm.") for k in t) == (shape == "forerun")
    # d2t: offsets to the target id, complete and in range; t2d marks exactly those ids
    d2t = t["d2t"] + torch.arange(len(t["d2t"]))
    assert torch.equal(d2t, head.draft_to_target) and len(d2t) == head.cfg.draft_vocab
    assert int(d2t.min()) >= 0 and int(d2t.max()) < head.cfg.vocab_size and len(set(d2t.tolist())) == len(d2t)
    assert t["t2d"].dtype == torch.bool and t["t2d"].shape == (head.cfg.vocab_size,)
    assert int(t["t2d"].sum()) == len(d2t) and bool(t["t2d"][d2t].all())


def _eagle3_reference(tensors: dict, config: dict, feats, tokens, embed, positions, cache=None):
    """EAGLE-3's draft step as vLLM and SGLang compute it, from the checkpoint alone: returns
    (logits over the target vocabulary [T, V], the hidden state passed on [T, H], the cache)."""
    spec = "transformer_layer_config" in config
    layer = config["transformer_layer_config"] if spec else config
    eps, H = layer["rms_norm_eps"], layer["hidden_size"]
    n, d = layer["num_attention_heads"], layer["head_dim"]
    w = {k: v.float() for k, v in tensors.items() if v.is_floating_point()}

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    if feats.shape[-1] != H:  # target features: through the (optionally per-chunk normed) fc
        if config.get("fc_norm"):
            chunks = feats.split(H, -1)
            feats = torch.cat([rms(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(chunks)], -1)
        hidden = feats @ w["fc.weight"].T
    else:
        hidden = feats
    x = torch.cat([rms(embed[tokens], w["midlayer.input_layernorm.weight"]),
                   rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    T = x.shape[0]
    q, k, v = (x @ w[f"midlayer.self_attn.{p}_proj.weight"].T for p in "qkv")
    q, k, v = (t.view(T, n, d).transpose(0, 1) for t in (q, k, v))
    theta = layer["rope_parameters"]["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(t):  # neox style: rotate the two halves
        return t * cos + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * sin

    q, k = rope(q), rope(k)
    if cache is not None:
        k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
    S = k.shape[1]
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    att = ((q @ k.transpose(-1, -2)) / math.sqrt(d)).masked_fill(~mask, float("-inf")).softmax(-1) @ v
    res = hidden + att.transpose(0, 1).reshape(T, n * d) @ w["midlayer.self_attn.o_proj.weight"].T
    h = rms(res, w["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(h @ w["midlayer.mlp.gate_proj.weight"].T) * (h @ w["midlayer.mlp.up_proj.weight"].T)) \
        @ w["midlayer.mlp.down_proj.weight"].T
    out = res + mlp
    draft_logits = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    V = layer["vocab_size"]
    logits = torch.full((T, V), float("-inf"))
    logits[:, torch.arange(len(tensors["d2t"])) + tensors["d2t"]] = draft_logits
    return logits, out, (k, v)


@pytest.mark.parametrize("shape,fmt", [("forerun", "speculators"), ("eagle3", "speculators"), ("eagle3", "eagle3")])
def test_exported_checkpoint_is_the_same_function(heads, llama8, shape, fmt, tmp_path):
    """The checkpoint, run as EAGLE-3 runs it, drafts what the head drafts in forerun: the same
    logits for a pass over verified entries and for a step run ahead on its own output."""
    from safetensors.torch import load_file

    head = load_head(heads[shape][0])
    out = export_head(head, tmp_path / "x", fmt=fmt, target=_target_config(llama8), verifier="tiny", k=3)
    tensors, config = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    be = llama8.backend
    tokens = torch.tensor(PROMPTS[0][:7])
    be.reset()
    feats = be.forward(tokens[:-1], 0, layers=tuple(head.cfg.feature_layers)).layers.float()  # [T, n * H]
    embed = be.embed.float()
    with torch.no_grad():
        g, cache = head.step(embed[tokens[1:]], head.fuse_features(feats), 0, None)
        ours = torch.full((len(g), head.cfg.vocab_size), float("-inf"))
        ours[:, head.draft_to_target] = head.logits(g)
        T = len(tokens) - 1
        ref, hid, ref_cache = _eagle3_reference(tensors, config, feats, tokens[1:], embed, torch.arange(T))
        torch.testing.assert_close(ref, ours, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hid, g, rtol=1e-4, atol=1e-4)
        # one step ahead on the head's own guess, fed its own output state
        guess = int(head.draft_to_target[head.logits(g[-1]).argmax()])
        g2, _ = head.step(embed[[guess]], g[-1:], T, cache)
        ours2 = torch.full((1, head.cfg.vocab_size), float("-inf"))
        ours2[:, head.draft_to_target] = head.logits(g2)
        ref2, _, _ = _eagle3_reference(tensors, config, hid[-1:], torch.tensor([guess]), embed, torch.tensor([T]),
                                       ref_cache)
        torch.testing.assert_close(ref2, ours2, rtol=1e-4, atol=1e-4)


def test_speculators_config_has_what_vllm_reads(heads, llama8, tmp_path):
    head = load_head(heads["forerun"][0])
    out = export_head(head, tmp_path / "s", fmt="speculators", target=_target_config(llama8), verifier="org/tiny", k=5)
    config = json.loads((out / "config.json").read_text())
    check_speculators_config(config)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    # vLLM counts the embedding as layer 0: a layer's output has the next id
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.cfg.feature_layers]
    assert config["fc_norm"] is True and config["draft_vocab_size"] == head.cfg.draft_vocab
    for field in SPECULATORS_REQUIRED:
        broken = {k: v for k, v in config.items() if k != field}
        with pytest.raises(ForerunError, match=field):
            check_speculators_config(broken)
    bad = json.loads(json.dumps(config))
    del bad["speculators_config"]["verifier"]
    with pytest.raises(ForerunError, match="verifier"):
        check_speculators_config(bad)
    bad = json.loads(json.dumps(config))
    bad["transformer_layer_config"]["model_type"] = "gemma3"
    with pytest.raises(ForerunError, match="Llama or Qwen3"):
        check_speculators_config(bad)
    # the original EAGLE-3 layout names no layers: vLLM and SGLang number explicit ids differently, and
    # their common default (inputs of layers 2, N/2, N - 3) is what an --shape eagle3 head reads
    e3 = export_head(load_head(heads["eagle3"][0]), tmp_path / "e", fmt="eagle3", target=_target_config(llama8),
                     verifier="org/tiny")
    c3 = json.loads((e3 / "config.json").read_text())
    assert c3["architectures"] == ["LlamaForCausalLMEagle3"] and c3["num_hidden_layers"] == 1
    assert "eagle_config" not in c3 and "eagle_aux_hidden_state_layer_ids" not in c3
    assert [i + 1 for i in eagle3_feature_layers(LAYERS)] == [2, LAYERS // 2, LAYERS - 3]
    assert c3["tie_word_embeddings"] is False and "fc_norm" not in c3


def test_float16_heads_export_exactly(heads, llama8, tmp_path):
    from safetensors.torch import load_file

    head = load_head(heads["forerun"][0])  # saved as float16: float16 holds every weight
    out = export_head(head, tmp_path / "h", fmt="speculators", target=_target_config(llama8), verifier="t")
    t = load_file(str(out / "model.safetensors"))
    assert t["fc.weight"].dtype == torch.float16 and torch.equal(t["fc.weight"].float(), head.fuse.weight)
    with torch.no_grad():
        head.fuse.weight.add_(1e-5)  # no longer float16 values: kept as float32
    out = export_head(head, tmp_path / "f", fmt="speculators", target=_target_config(llama8), verifier="t")
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.float32


def test_refusals_say_why(heads, llama8, tmp_path):
    from dataclasses import replace

    from forerun.drafters.heads import build_head

    head = load_head(heads["forerun"][0])
    cfg = _target_config(llama8)
    assert refusal(head, "speculators", cfg) is None
    assert "--shape eagle3" in refusal(head, "eagle3", cfg)
    from dataclasses import replace as _r

    moved = build_head(_r(load_head(heads["eagle3"][0]).cfg, feature_layers=[1, 2, 4]), head.draft_to_target)
    assert "EAGLE-3's own layers [1, 3, 4]" in refusal(moved, "eagle3", cfg)
    assert refusal(moved, "speculators", cfg) is None
    assert "unknown format" in refusal(head, "onnx", cfg)
    assert "gemma3_text" in refusal(head, "speculators", {**cfg, "model_type": "gemma3_text"})
    assert "hidden_size" in refusal(head, "speculators", {**cfg, "hidden_size": 128})
    medusa = build_head(replace(head.cfg, kind="medusa"), head.draft_to_target)
    assert "medusa heads have no EAGLE-3 counterpart" in refusal(medusa, "speculators", cfg)
    with pytest.raises(ForerunError, match="cannot export this head as eagle3"):
        export_head(head, tmp_path / "no", fmt="eagle3", target=cfg, verifier="t")
    assert not (tmp_path / "no").exists()  # nothing written
    with pytest.raises(ForerunError, match="medusa"):
        Trainer.of_target(TrainConfig(kind="medusa", shape="eagle3"), llama8.backend.model)


def test_llama_cpp_format_refuses_feature_norms_and_needs_the_converter(heads, llama8, tmp_path):
    """--format llama.cpp: heads with per-layer feature norms are refused (llama.cpp's EAGLE-3 has
    none), any three feature layers go (their ids named, the inputs' numbering), and without
    llama.cpp's converter the error says how to get it, writing nothing."""
    from forerun.training.export import export_config

    cfg = _target_config(llama8)
    norms, plain = load_head(heads["forerun"][0]), load_head(heads["eagle3"][0])
    assert "--shape eagle3" in refusal(norms, "llama.cpp", cfg)
    assert refusal(plain, "llama.cpp", cfg) is None
    c = export_config(plain, "llama.cpp", cfg, "t", 4, "float32")
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and c["draft_vocab_size"] == plain.cfg.draft_vocab
    assert c["num_hidden_layers"] == 1 and c["architectures"] == ["LlamaForCausalLMEagle3"]
    with pytest.raises(ForerunError, match="bench/llama_cpp_tools.sh"):
        export_head(plain, tmp_path / "d.gguf", fmt="llama.cpp", target=cfg, verifier=str(tmp_path),
                    converter=tmp_path / "none.py")
    assert not (tmp_path / "d.gguf").exists()

