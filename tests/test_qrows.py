"""The integer kernels of ``qrows.c``: every GGUF type, every build the CPU runs (portable, AVX2,
AVX-512 VNNI), against one reference of the block sums; rows independent of the pass size."""

import numpy as np
import pytest
import torch

from forerun.backends.block_weights import unpack
from forerun.backends.qweights import ISAS, QLinear, QPart, load_isa
from forerun.gguf_file import BLOCKS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

TYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q8_0": Q8_0, "Q4_K": Q4_K, "Q5_K": Q5_K,
         "Q6_K": Q6_K}


def random_blocks(typ: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes shaped as GGUF blocks of ``typ`` with sane float16 scales."""
    per, nbytes = BLOCKS[typ]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // per, nbytes), dtype=np.uint8)
    halves = {Q4_0: [0], Q4_1: [0, 2], Q5_0: [0], Q5_1: [0, 2], Q8_0: [0], Q4_K: [0, 2], Q5_K: [0, 2], Q6_K: [208]}
    for off in halves[typ]:
        raw[:, off: off + 2] = rng.uniform(0.001, 0.02, size=len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def quantize_reference(x: np.ndarray):
    """Per row and 32 values: int8 codes, scale amax / 127 (round half to even), as ``qrows.c``."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    return q, d.astype(np.float32)


def reference(part: QPart, x: np.ndarray) -> np.ndarray:
    """The block sums in float64: sum over blocks of w_code-sum * scale * dx, from the packed weights."""
    q, d = quantize_reference(x)
    w = part.dequantize()  # [V, D] float64
    xr = (q * d).reshape(x.shape[0], -1).astype(np.float64)
    return xr @ w.T


def builds():
    return [(isa, lib) for isa in ISAS if (lib := load_isa(isa)) is not None]


def _bound(part, x):
    q, d = quantize_reference(x)
    w = np.abs(part.dequantize())
    mag = np.abs((q * d).reshape(x.shape[0], -1)) @ w.T
    return 1e-6 * mag + 1e-6  # float32 accumulation over a few dozen blocks: far inside this


@pytest.mark.parametrize("name", list(TYPES))
def test_every_type_and_build_matches_the_reference(name):
    typ = TYPES[name]
    rows, cols = 37, 512  # rows not a multiple of 8: the last group is padded
    c = unpack(random_blocks(typ, rows, cols, seed=typ), typ)
    lin = QLinear([(c, typ)])
    x = np.random.default_rng(1).standard_normal((5, cols)).astype(np.float32)
    want = reference(lin.parts[0], x)
    got = {}
    avail = builds()
    assert any(isa == "portable" for isa, _ in avail)
    for isa, lib in avail:
        for portable in (0, 1):  # every build also carries the plain C reference path
            lib.forerun_q_portable(portable)
            try:
                out = lin(torch.from_numpy(x), lib=lib).numpy()
            finally:
                lib.forerun_q_portable(0)
            got[(isa, portable)] = out
            assert np.all(np.abs(out - want) <= _bound(lin.parts[0], x)), (name, isa, portable)
    first = next(iter(got.values()))
    for key, out in got.items():  # every path: the same bits
        assert np.array_equal(out.view(np.uint32), first.view(np.uint32)), key


def test_the_weights_rebuild_exactly():
    for name, typ in TYPES.items():
        c = unpack(random_blocks(typ, 16, 256, seed=3), typ)
        assert np.array_equal(QPart(c, typ).dequantize().astype(np.float32), c.dequantize()), name


@pytest.mark.parametrize("name", list(TYPES))
def test_a_row_does_not_depend_on_the_pass(name):
    typ = TYPES[name]
    c = unpack(random_blocks(typ, 64, 256, seed=5), typ)
    lin = QLinear([(c, typ)])
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    whole = lin(x)
    for n in (1, 2, 3, 5, 9, 17, 64):
        part = lin(x[:n])
        assert torch.equal(part, whole[:n]), n
    for i in (0, 7, 63):
        assert torch.equal(lin(x[i: i + 1])[0], whole[i])


def test_stacked_parts_of_different_types():
    a = unpack(random_blocks(Q4_K, 24, 256, seed=7), Q4_K)
    b = unpack(random_blocks(Q6_K, 11, 256, seed=8), Q6_K)
    both = QLinear([(a, Q4_K), (b, Q6_K)])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    out = both(x)
    assert out.shape == (3, 35)
    assert torch.equal(out[:, :24], QLinear([(a, Q4_K)])(x))
    assert torch.equal(out[:, 24:], QLinear([(b, Q6_K)])(x))


def test_bad_sizes_are_refused():
    c = unpack(random_blocks(Q8_0, 8, 64, seed=1), Q8_0)
    with pytest.raises(ValueError):
        QLinear([(c, Q8_0)])(torch.zeros(2, 32))
