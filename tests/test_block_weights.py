"""GGUF blocks as the native backend's layer weights: the unpacking agrees with the gguf package's
dequantizer for every handled type, the kernels agree bit for bit with ``f32_rows`` on the float32
weights, and on both real models every layer is served from its blocks with unchanged outputs."""

import numpy as np
import pytest
import torch

from forerun.backends import block_weights as bw
from forerun.backends.linear import f32_rows, f32_rows_kernel
from forerun.gguf_file import BLOCKS

needs_kernels = pytest.mark.skipif(bw.block_rows_kernel() is None or f32_rows_kernel() is None,
                                   reason="no C compiler")


def _random_blocks(typ: int, rows: int, D: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks of type ``typ`` [rows, bytes per row] with finite float16 fields."""
    rng = np.random.default_rng(seed)
    per, nbytes = BLOCKS[typ]
    raw = rng.integers(0, 256, size=(rows * D // per, nbytes), dtype=np.uint8)
    halves = {bw.Q4_0: [0], bw.Q4_1: [0, 2], bw.Q5_0: [0], bw.Q5_1: [0, 2], bw.Q8_0: [0],
              bw.Q4_K: [0, 2], bw.Q5_K: [0, 2], bw.Q6_K: [208]}[typ]
    for off in halves:  # scales of either sign, small enough that no product overflows
        raw[:, off: off + 2] = rng.uniform(-0.05, 0.05, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("typ", sorted(BLOCKS))
def test_unpacked_codes_rebuild_the_gguf_dequantizer_bit_for_bit(typ):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = _random_blocks(typ, 6, 512)
    ref = dequantize(raw, GGMLQuantizationType(typ)).astype(np.float32)
    codes = bw.unpack(raw, typ)
    assert codes.codes.shape == (6, 512)
    assert np.array_equal(codes.dequantize().view(np.uint32), ref.view(np.uint32))


@needs_kernels
@pytest.mark.parametrize("types,layout", [((bw.Q4_1,), "q4"), ((bw.Q4_0,), "q4"), ((bw.Q4_K, bw.Q4_1), "q4"),
                                          ((bw.Q8_0,), "q8"), ((bw.Q6_K,), "q8"), ((bw.Q5_0, bw.Q5_0, bw.Q8_0), "q8"),
                                          ((bw.Q4_0, bw.Q4_1), "q8"), ((bw.Q5_K,), "q8"), ((bw.Q5_1,), "q8")])
def test_kernels_equal_f32_rows_for_every_pass_size(types, layout, each_build):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raws = [_random_blocks(t, 40 + 8 * i, 512, seed=i) for i, t in enumerate(types)]
    weight = torch.from_numpy(np.concatenate([dequantize(r, GGMLQuantizationType(t)) for r, t in zip(raws, types)])
                              .astype(np.float32))
    block = bw.BlockWeight([bw.unpack(r, t) for r, t in zip(raws, types)])
    assert block.layout == layout
    assert block.nbytes < weight.numel() * 2
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    for n in range(1, 10):
        out = block(x[:n])
        assert torch.equal(out, f32_rows(weight, x[:n])), n
        assert torch.equal(out[0], block(x[:1])[0])  # a row's result does not depend on the others
    # float32 rounding of sums of 512 products (the portable build's one sequential sum included)
    bound = 4 * 512 * 2.0 ** -24 * x.double().abs().mm(weight.double().abs().t())
    assert ((block(x).double() - x.double().mm(weight.double().t())).abs() <= bound).all()


def test_row_order_is_found_and_other_weights_are_refused():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 8)).astype(np.float32)
    order = np.array([3, 1, 0, 5, 4, 2])
    assert np.array_equal(bw.match_rows(a, a[order]), order)
    b = a.copy()
    b[2, 3] = np.nextafter(b[2, 3], np.float32(1))
    assert bw.match_rows(a, b) is None


@needs_kernels
@pytest.mark.bundled
@pytest.mark.parametrize("name", ["smollm2", "bundled"])
def test_real_models_run_every_layer_from_blocks_with_identical_outputs(name, request):
    from forerun.backends.native import NativeBackend
    from forerun.models import bundled_gguf_path, smollm2_gguf_path

    lm = request.getfixturevalue(name)
    path = (smollm2_gguf_path if name == "smollm2" else bundled_gguf_path)()
    be = NativeBackend(lm.hf_model, gguf=str(path), integer=False)  # the float32 path on the blocks
    linears = [getattr(layer, a) for layer in be.model.layers for a in ("qkv", "o", "gate_up", "down")]
    assert all(lin.blocks is not None for lin in linears)
    floats = NativeBackend(lm.hf_model)  # the same model without its GGUF blocks
    assert all(lin.blocks is None for layer in floats.model.layers for lin in (layer.qkv, layer.down))
    ids = torch.tensor(lm.tokenizer("def squares(xs):\n    return [x * x for x in xs]\n").input_ids)
    for b in (be, floats):
        b.reset()
        b.forward(ids[:-5], 0, logits=False)
    chain = [b.forward(ids[-5:], len(ids) - 5, return_hidden=True) for b in (be, floats)]
    assert torch.equal(chain[0].hidden, chain[1].hidden)
    logits = f32_rows(floats.model.lm_head.weight, chain[1].hidden)  # the head's blocks sum as f32_rows does
    if be.model.softcap:
        logits = torch.tanh(logits / be.model.softcap) * be.model.softcap
    assert torch.equal(chain[0].logits, logits)
    # batch invariance holds on the blocks: one-token steps give the chain's hidden states
    be.truncate(len(ids) - 5)
    steps = torch.cat([be.forward(ids[i: i + 1], i, logits=False, return_hidden=True).hidden
                       for i in range(len(ids) - 5, len(ids))])
    assert torch.equal(steps, chain[0].hidden)
