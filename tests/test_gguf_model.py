"""A GGUF model read straight onto the integer path (``gguf_model``) computes what the same file
converted by transformers computes on that path, bit for bit, without its float32 weights."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_gguf import VOCAB, write_tiny_gguf

CASES = [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", True), ("gemma3", True)]


def lean_backend(path):
    """(a native backend read straight from the file on the integer path, its skeleton model, its
    file tensors); skips where the integer kernels do not build."""
    from transformers import AutoConfig

    from forerun.backends.gguf_model import skeleton
    from forerun.backends.native import NativeBackend
    from forerun.backends.qweights import qrows_lib

    if qrows_lib() is None:
        pytest.skip("the integer kernels do not build here (no C compiler)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model, files = skeleton(path, cfg)
    return NativeBackend(model, gguf=str(path), file_tensors=files), model, files


def _both(path):
    """(read from the file, converted by transformers): native backends on the integer path."""
    from transformers import AutoModelForCausalLM

    from forerun.backends.native import NativeBackend

    lean, model, files = lean_backend(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    full = NativeBackend(ref, gguf=str(path))
    assert lean.model.quant is not None and full.model.quant is not None
    return lean, full, model, ref, files


@pytest.mark.parametrize("arch,tied", CASES)
def test_read_from_the_file_equals_the_conversion(tmp_path, arch, tied):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tied=tied)
    lean, full, model, ref, files = _both(path)
    # no float32 copy of a layer weight exists, and the embeddings stay in the file while decoding
    assert all(getattr(layer, a).weight.is_meta for layer in lean.model.layers for a in ("qkv", "o", "gate_up", "down"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (20,), generator=g)
    assert torch.equal(lean.forward(ids[:12], 0).logits, full.forward(ids[:12], 0).logits)
    for i in range(12, 15):  # one-token steps
        assert torch.equal(lean.forward(ids[i: i + 1], i).logits, full.forward(ids[i: i + 1], i).logits)
    parents = torch.tensor([-1, -1, 0, 0])  # a token tree: two children of row 0, two of row 1
    assert torch.equal(lean.forward(ids[15:20], 15, tree=parents).logits, full.forward(ids[15:20], 15, tree=parents).logits)
    # a batched pass over two forks
    la, lb_, fa, fb = lean.fork(), lean.fork(), full.fork(), full.fork()
    for be in (la, lb_, fa, fb):
        be.forward(ids[:8], 0)
    feeds, pos = [ids[8:11], ids[8:9]], [8, 8]
    for x, y in zip(lean.forward_batch([la, lb_], feeds, pos), full.forward_batch([fa, fb], feeds, pos)):
        assert torch.equal(x.logits, y.logits)
    assert lean.model.embed_in_file  # decoding read embedding rows only
    files.ROWS_KEPT = 3  # rows dropped oldest first still come back the same
    files._rows.clear()
    assert torch.equal(lean.model.embeddings(ids), torch.nn.functional.embedding(ids, full.embed)) and len(files._rows) <= 3
    # whole tensors when asked for: the conversion's values
    assert torch.equal(lean.embed, full.embed)
    assert torch.equal(lean.model.lm_head.weight, ref.lm_head.weight)
    assert (lean.model.lm_head.weight.data_ptr() == lean.embed.data_ptr()) == tied
    if arch == "llama":  # its query and key rows are stored permuted: the order is not the file's
        assert sum(o is not None for o in files.row_orders.values()) == 2 * 2


@pytest.mark.parametrize("arch,tied", CASES[:1] + CASES[2:])
def test_weight_names_map_as_transformers_maps_them(tmp_path, arch, tied):
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    from forerun.backends.gguf_model import _processor, skeleton, weights_map
    from forerun.gguf_file import GGUFFile

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tied=tied)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    g = GGUFFile.open(path)
    model, _ = skeleton(path, cfg)
    proc = _processor(g, cfg)
    assert weights_map(model, g.metadata["general.architecture"], proc) == get_gguf_hf_weights_map(model, proc)


def test_a_file_that_does_not_fit_is_refused_with_a_reason(tmp_path):
    from transformers import AutoConfig

    from forerun.backends.gguf_model import skeleton

    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    cfg.intermediate_size = 96  # the file's feed-forward weights are 128 wide
    from forerun.backends.native import NativeBackend

    model, files = skeleton(path, cfg)
    with pytest.raises(ValueError, match="integer kernels"):
        NativeBackend(model, gguf=str(path), file_tensors=files)
    cfg.intermediate_size, cfg.hidden_size = 128, 32
    with pytest.raises(ValueError, match="shape"):
        skeleton(path, cfg)


def test_load_model_reads_a_gguf_file_without_converting_it(tmp_path, monkeypatch):
    """``load_model`` on a GGUF file of the integer path: no transformers model until asked for,
    then the converted one (its float32 weights)."""
    import forerun.models as models
    from forerun.backends.qweights import qrows_lib

    if qrows_lib() is None:
        pytest.skip("the integer kernels do not build here (no C compiler)")
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    monkeypatch.setattr(models, "_gguf_tokenizer", lambda p: None)  # the tiny file has no tokenizer
    converted = []
    monkeypatch.setattr(models, "_convert_gguf", lambda p: converted.append(p) or _convert(p, tmp_path / "conv"))
    lm = models.load_model(str(path), backend="torch")
    assert lm.backend.model.quant is not None and lm._hf is None and not converted
    assert lm.config.num_hidden_layers == 2 and lm.eos_token_ids
    ids = torch.arange(3, 9)
    lean_logits = lm.backend.forward(ids, 0).logits
    hf = lm.hf_model  # converted on first use
    assert converted and hf.model.layers[0].self_attn.q_proj.weight.device.type == "cpu"
    with torch.no_grad():
        assert torch.allclose(hf(ids[None]).logits[0], lean_logits, atol=0.1)  # float32 vs 8-bit activations


def _convert(path, out):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    del model.config.quantization_config  # as models._convert_gguf saves it: plain float32 weights
    model.hf_quantizer, model.is_quantized = None, False
    model.save_pretrained(out)
    return out


@pytest.mark.bundled
@pytest.mark.parametrize("name", ["smollm2", "bundled"])
def test_real_models_are_read_from_their_files_with_the_conversions_numbers(name, request):
    """Both real models load straight from their GGUF files (no transformers model, no float32
    layer weights) and compute what their conversions compute on the integer path."""
    from forerun.backends.native import NativeBackend
    from forerun.models import bundled_gguf_path, smollm2_gguf_path

    lm = request.getfixturevalue(name)
    lean = lm.backend
    if lean.model.quant is None:
        pytest.skip("the integer kernels do not build here (no C compiler)")
    assert lean.model.files is not None and lean.model.layers[0].qkv.weight.is_meta
    path = (smollm2_gguf_path if name == "smollm2" else bundled_gguf_path)()
    full = NativeBackend(lm.hf_model, gguf=str(path))  # the conversion, built on first use
    assert full.model.quant is not None and full.model.files is None
    ids = torch.tensor(lm.tokenizer("Write a short poem about the sea, then explain its rhyme.").input_ids)
    a, b = lean.fork(), full.fork()
    assert torch.equal(a.forward(ids, 0).logits, b.forward(ids, 0).logits)
    t = ids[-1:]
    for i in range(3):
        x, y = a.forward(t, len(ids) + i).logits, b.forward(t, len(ids) + i).logits
        assert torch.equal(x, y)
        t = x[-1].argmax().view(1)
    assert torch.equal(lean.embed, full.embed)
