"""``forerun export-draft``: a trained EAGLE head as a checkpoint that vLLM or SGLang load.

forerun's EAGLE head is EAGLE-3's draft model: fused low/mid/high target features through one
linear layer (``fc``), one Llama decoder layer reading [norm(embedding); norm(hidden)], a final
norm and an LM head over a reduced draft vocabulary. Two layouts hold it, with the same tensor
names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``):

* ``speculators``: vLLM's format (the ``speculators`` library's): a ``transformer_layer_config``
  for the decoder layer and a ``speculators_config`` naming the verifier and the draft length.
  vLLM also reads forerun's per-layer feature norms (``fc_norm``) and the last layer's output.
* ``eagle3``: the original EAGLE-3 checkpoint layout (``LlamaForCausalLMEagle3``), the one SGLang
  loads (vLLM too). SGLang has no feature norms and cannot hand a drafter the last layer's output:
  only heads trained with ``forerun train-draft --shape eagle3`` fit it.
* ``llama.cpp``: a GGUF file ``llama-server --spec-type draft-eagle3 -md FILE`` loads: the
  ``eagle3`` layout with its layer ids named, converted by llama.cpp's own ``convert_hf_to_gguf.py``
  (the copy ``bench/llama_cpp_tools.sh`` keeps from the source llama-cpp-python vendors, with that
  source's ``gguf-py``). llama.cpp has no per-layer feature norms either (only one norm over the
  fused features), so heads trained with ``--shape eagle3`` fit it; it reads the layers' inputs as
  vLLM numbers them, and the last layer's output too.

Layer numbering differs between the engines. forerun names a feature by the layer whose output it
is (0-based); vLLM's ``eagle_aux_hidden_state_layer_ids`` count the embedding as 0 (id j = output
of layer j - 1), while SGLang reads the same field as layer outputs. Only the engines' common
default (the inputs of layers 2, N/2 and N - 3) means the same in both, so the ``eagle3`` layout
holds heads on exactly those layers and names none; the ``speculators`` config names its layers in
vLLM's numbering.

``d2t`` holds, per draft token, the offset to add to get the target token id (not the id itself);
``t2d`` marks the target tokens the draft vocabulary holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from forerun.drafters.heads import DraftHead, eagle3_feature_layers
from forerun.errors import ForerunError

FORMATS = ("speculators", "eagle3", "llama.cpp")
# target model types whose EAGLE-3 drafting vLLM implements (and forerun's native backend runs);
# Mistral targets load as Llama in both engines.
TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# fields vLLM reads from a speculators config (its SpeculatorsConfig and the eagle3 updater)
SPECULATORS_REQUIRED = ("speculators_model_type", "transformer_layer_config", "draft_vocab_size",
                        "target_hidden_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
                        "speculators_config")
LAYER_REQUIRED = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "num_hidden_layers", "rms_norm_eps", "vocab_size", "hidden_act")


def refusal(head: DraftHead, fmt: str, target: dict) -> str | None:
    """Why ``head`` cannot be exported as ``fmt`` for a target with HF config ``target`` (None: it can)."""
    cfg = head.cfg
    if fmt not in FORMATS:
        return f"unknown format {fmt!r} (choose {', '.join(FORMATS)})"
    if cfg.kind != "eagle":
        return (f"{cfg.kind} heads have no EAGLE-3 counterpart: vLLM and SGLang load EAGLE-3 drafters; "
                "export an eagle head (forerun train-draft --kind eagle)")
    model_type = str(target.get("model_type", "?"))
    if model_type not in TARGET_TYPES:
        return (f"the target is a {model_type} model: vLLM's EAGLE-3 drafting runs Llama, Mistral, Qwen2 and Qwen3 "
                "targets, not this one")
    for key, ours in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size),
                      ("num_hidden_layers", cfg.target.get("num_layers"))):
        if target.get(key) != ours:
            return f"the head was trained for a target with {key} {ours}, this target has {target.get(key)}"
    if cfg.embed_scale != 1.0:
        return f"the head scales token embeddings by {cfg.embed_scale}; the engines feed them unscaled"
    if fmt == "llama.cpp":
        if cfg.feature_norms:
            return ("the head normalises each feature layer before fusing them; llama.cpp's EAGLE-3 drafter "
                    "has no such norms: train one with --shape eagle3")
        if len(cfg.feature_layers) != 3:
            return f"llama.cpp's EAGLE-3 drafter fuses 3 feature layers, this head {len(cfg.feature_layers)}"
    if fmt == "eagle3":
        n = target["num_hidden_layers"]
        if cfg.feature_norms:
            return ("the head normalises each feature layer before fusing them, which SGLang's EAGLE-3 drafter "
                    "does not: export it as speculators (vLLM), or train one with --shape eagle3")
        if len(cfg.feature_layers) != 3:
            return f"SGLang's EAGLE-3 drafter fuses 3 feature layers, this head {len(cfg.feature_layers)}"
        if max(cfg.feature_layers) >= n - 1:
            return ("the head reads the last layer's output, which SGLang cannot hand to a drafter: export it as "
                    "speculators (vLLM), or train one with --shape eagle3")
        if list(cfg.feature_layers) != eagle3_feature_layers(n):
            return (f"the head reads the outputs of layers {cfg.feature_layers}; the EAGLE-3 layout holds heads on "
                    f"EAGLE-3's own layers {eagle3_feature_layers(n)} only (vLLM and SGLang number other layers "
                    "differently): export it as speculators (vLLM), or train one with --shape eagle3")
    return None


def export_tensors(head: DraftHead, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The head's weights under EAGLE-3's names and shapes."""
    cfg = head.cfg
    A = cfg.n_heads * cfg.head_dim
    q, k, v = head.qkv.weight.split(A)
    gate, up = head.gate_up.weight.chunk(2)
    t = {"fc.weight": head.fuse.weight,
         "midlayer.input_layernorm.weight": head.norm_emb.weight,
         "midlayer.hidden_norm.weight": head.norm_hid.weight,
         "midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
         "midlayer.self_attn.v_proj.weight": v, "midlayer.self_attn.o_proj.weight": head.o.weight,
         "midlayer.post_attention_layernorm.weight": head.norm_mlp.weight,
         "midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up,
         "midlayer.mlp.down_proj.weight": head.down.weight,
         "norm.weight": head.norm_out.weight, "lm_head.weight": head.lm_head.weight}
    if head.feat_norms is not None:
        t.update({f"fc_norm.{i}.weight": n.weight for i, n in enumerate(head.feat_norms)})
    t = {name: w.detach().to("cpu", dtype).contiguous() for name, w in t.items()}
    d2t = head.draft_to_target.detach().cpu().long()
    t["d2t"] = d2t - torch.arange(len(d2t))
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    t["t2d"] = t2d
    return t


def layer_config(head: DraftHead, target: dict, dtype: str) -> dict:
    """The draft's one decoder layer as a Llama config."""
    cfg = head.cfg
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": cfg.eps, "hidden_act": "silu", "vocab_size": cfg.vocab_size,
            "max_position_embeddings": int(target.get("max_position_embeddings") or 8192),
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype}


def export_config(head: DraftHead, fmt: str, target: dict, verifier: str, k: int, dtype: str) -> dict:
    cfg = head.cfg
    layer = layer_config(head, target, dtype)
    ids = [i + 1 for i in cfg.feature_layers]  # vLLM's numbering (the layers' inputs), llama.cpp's converter's too
    if fmt in ("eagle3", "llama.cpp"):
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": cfg.draft_vocab,
                  "target_hidden_size": cfg.hidden_size}
        # eagle3 names no layer ids: vLLM and SGLang then read their common default, the layers the head was trained on
        return {**config, "eagle_aux_hidden_state_layer_ids": ids} if fmt == "llama.cpp" else config
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab,
            "target_hidden_size": cfg.hidden_size, "norm_before_residual": False, "norm_before_fc": False,
            "fc_norm": bool(cfg.feature_norms),
            "eagle_aux_hidden_state_layer_ids": ids,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier, "architectures": list(target.get("architectures") or [])}},
            "torch_dtype": dtype}


def check_speculators_config(config: dict) -> None:
    """Raise ForerunError unless ``config`` has every field vLLM's speculators loader reads, well formed."""
    missing = [f for f in SPECULATORS_REQUIRED if f not in config]
    if missing:
        raise ForerunError(f"speculators config lacks {', '.join(missing)}")
    if config["speculators_model_type"] != "eagle3":
        raise ForerunError(f"speculators_model_type is {config['speculators_model_type']!r}, not 'eagle3'")
    layer = config["transformer_layer_config"]
    if not isinstance(layer, dict) or any(f not in layer for f in LAYER_REQUIRED):
        raise ForerunError(f"transformer_layer_config must be a dict with {', '.join(LAYER_REQUIRED)}")
    if layer["model_type"] not in ("llama", "qwen3"):
        raise ForerunError(f"vLLM builds EAGLE-3 layers of Llama or Qwen3 type, not {layer['model_type']!r}")
    try:
        method = config["speculators_config"]["proposal_methods"][0]
        k = method["speculative_tokens"]
        verifier = config["speculators_config"]["verifier"]["name_or_path"]
    except (KeyError, IndexError, TypeError):
        raise ForerunError("speculators_config needs proposal_methods[0].speculative_tokens and "
                           "verifier.name_or_path") from None
    if not isinstance(k, int) or k < 1:
        raise ForerunError(f"speculative_tokens must be a positive integer, got {k!r}")
    if not isinstance(verifier, str) or not verifier:
        raise ForerunError("verifier.name_or_path is empty")
    ids = config["eagle_aux_hidden_state_layer_ids"]
    if not isinstance(ids, list) or not ids or any(not isinstance(i, int) or i < 1 for i in ids):
        raise ForerunError(f"eagle_aux_hidden_state_layer_ids must be layer ids >= 1, got {ids!r}")


def export_head(head: DraftHead, out: str | Path, *, fmt: str, target: dict, verifier: str, k: int = 4,
                dtype: torch.dtype | None = None, converter: Path | None = None) -> Path:
    """Write ``head`` to ``out`` as ``fmt`` for the target with HF config ``target``; ``verifier``:
    the target as the engine should load it (hub id or folder; for ``llama.cpp`` a local folder with
    the target's config and tokenizer); ``k``: the draft length recorded. ``llama.cpp``: ``out`` is
    the GGUF file, written by llama.cpp's ``converter`` (its ``convert_hf_to_gguf.py``)."""
    why = refusal(head, fmt, target)
    if why:
        raise ForerunError(f"cannot export this head as {fmt}: {why}")
    if k < 1:
        raise ForerunError(f"the draft length must be >= 1, got {k}")
    if dtype is None:  # float16 where every weight is a float16 value (heads are stored so), else float32
        exact = all(torch.equal(p.detach().half().float(), p.detach().float()) for p in head.parameters())
        dtype = torch.float16 if exact else torch.float32
    name = str(dtype).removeprefix("torch.")
    tensors = export_tensors(head, dtype)
    config = export_config(head, fmt, target, verifier, k, name)
    if fmt == "speculators":
        check_speculators_config(config)
    if fmt == "llama.cpp":
        with tempfile.TemporaryDirectory() as tmp:
            _write(Path(tmp), tensors, config)
            return to_gguf(Path(tmp), Path(verifier), Path(out), converter, "f16" if dtype == torch.float16 else "f32")
    return _write(Path(out), tensors, config)


def _write(out: Path, tensors: dict, config: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def to_gguf(folder: Path, target_dir: Path, out: Path, converter: Path | None, outtype: str) -> Path:
    """An EAGLE-3 checkpoint ``folder`` as the GGUF file ``out``, by llama.cpp's own converter (run
    with the ``gguf-py`` beside it), the target's config and tokenizer read from ``target_dir``."""
    if converter is None or not converter.is_file():
        raise ForerunError(f"llama.cpp's convert_hf_to_gguf.py not found ({converter}): build llama.cpp's tools with "
                           "bench/llama_cpp_tools.sh (it keeps the converter of the same source)")
    if not (target_dir / "config.json").is_file() or not (target_dir / "tokenizer.json").is_file():
        raise ForerunError(f"{target_dir} lacks the target's config.json or tokenizer.json: give --verifier a local "
                           "folder holding them")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(converter.parent / "gguf-py"), str(converter.parent)]))
    cmd = [sys.executable, str(converter), str(folder), "--target-model-dir", str(target_dir), "--outfile", str(out),
           "--outtype", outtype]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if "No module named 'sentencepiece'" in r.stderr:
        raise ForerunError("llama.cpp's converter needs sentencepiece: pip install sentencepiece (or 'forerun[llamacpp]')")
    if r.returncode != 0 or not out.is_file():
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise ForerunError(f"llama.cpp's converter failed ({r.returncode}): {tail}")
    return out
