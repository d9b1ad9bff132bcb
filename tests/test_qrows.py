"""The integer kernels of ``qrows.c``: every GGUF type, every build the CPU runs (portable, AVX2,
AVX-512 VNNI), against one reference of the block sums; rows independent of the pass size."""

import numpy as np
import pytest
import torch

from forerun.backends import ckernels
from forerun.backends.block_weights import Codes, unpack
from forerun.backends.qweights import FACTORED, S8, U4, U5, U6, QLinear, QPart, qrows_lib
from forerun.gguf_file import BLOCKS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

needs_kernels = pytest.mark.skipif(qrows_lib() is None, reason="the integer kernels need a C compiler")

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
    """Every build of qrows.c this CPU runs, with the test-only ones (the VNNI code path with
    emulated vpdpbusd, so an AVX2 machine checks that path's logic too)."""
    return [(b, lib) for b in ckernels.runnable_builds() if (lib := ckernels.load("qrows", b)) is not None]


def _bound(part, x):
    q, d = quantize_reference(x)
    w = np.abs(part.dequantize())
    mag = np.abs((q * d).reshape(x.shape[0], -1)) @ w.T
    return 1e-6 * mag + 1e-6  # float32 accumulation over a few dozen blocks: far inside this


@needs_kernels
@pytest.mark.parametrize("name", list(TYPES))
def test_every_type_and_build_matches_the_reference(name):
    typ = TYPES[name]
    rows, cols = 37, 512  # rows not a multiple of 8: the last group is padded
    c = unpack(random_blocks(typ, rows, cols, seed=typ), typ)
    lin = QLinear([(c, typ)])
    # 8 rows: one register tile of 8 where the build has 32 vector registers, 4 + 4 elsewhere
    x = np.random.default_rng(1).standard_normal((8, cols)).astype(np.float32)
    want = reference(lin.parts[0], x)
    got = {}
    avail = builds()
    assert any(isa == "portable" for isa, _ in avail)
    assert any(isa == "vnni-emulated" for isa, _ in avail) == ckernels.isa_runs("avx2")
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


def test_five_and_six_bit_codes_are_held_in_their_bits():
    """Q5_0, Q5_1 and Q5_K as U5 (U4's nibbles and one bit plane), Q6_K as U6 (two planes): a step
    reads what the GGUF blocks hold, not a byte a code."""
    kinds = {Q4_0: U4, Q4_1: U4, Q4_K: U4, Q5_0: U5, Q5_1: U5, Q5_K: U5, Q6_K: U6, Q8_0: S8}
    for typ, kind in kinds.items():
        part = QPart(unpack(random_blocks(typ, 16, 256, seed=3), typ), typ)
        assert part.kind == kind, typ
    for typ in (Q5_0, Q5_1):  # float16 scales (and offsets): exactly the file's bytes
        part = QPart(unpack(random_blocks(typ, 16, 256, seed=3), typ), typ)
        assert part.nbytes == 16 * 256 // BLOCKS[typ][0] * BLOCKS[typ][1], typ
    part = QPart(unpack(random_blocks(Q6_K, 16, 256, seed=3), Q6_K), Q6_K)
    assert part.codes.numel() == 16 * 256 * 6 // 8


@needs_kernels
@pytest.mark.parametrize("name", list(TYPES))
def test_a_row_does_not_depend_on_the_pass(name):
    typ = TYPES[name]
    c = unpack(random_blocks(typ, 64, 256, seed=5), typ)
    lin = QLinear([(c, typ)])
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    whole = lin(x)
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64):
        part = lin(x[:n])
        assert torch.equal(part, whole[:n]), n
    for i in (0, 7, 63):
        assert torch.equal(lin(x[i: i + 1])[0], whole[i])


@needs_kernels
def test_stacked_parts_of_different_types():
    a = unpack(random_blocks(Q4_K, 24, 256, seed=7), Q4_K)
    b = unpack(random_blocks(Q6_K, 11, 256, seed=8), Q6_K)
    both = QLinear([(a, Q4_K), (b, Q6_K)])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    out = both(x)
    assert out.shape == (3, 35)
    assert torch.equal(out[:, :24], QLinear([(a, Q4_K)])(x))
    assert torch.equal(out[:, 24:], QLinear([(b, Q6_K)])(x))


@needs_kernels
@pytest.mark.parametrize("name", list(TYPES))
def test_argmax_is_the_first_maximum_of_the_outputs(name):
    """The fused greedy head: the index and value torch.argmax / max give on forerun_q_linear's
    outputs, on every build and path, equal outputs resolved to the first (also across the
    threads' ranges), a partial last row group and stacked parts included."""
    typ = TYPES[name]
    raw = random_blocks(typ, 2603, 256, seed=11)  # several chunks of 512 per thread; a partial last group
    one = raw[:1]
    same = np.concatenate([one] * 50)  # 50 equal rows: every output ties, row 0 must win
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(6))
    for parts in ([(unpack(raw, typ), typ)], [(unpack(same, typ), typ)],
                  [(unpack(raw[:40], typ), typ), (unpack(raw, typ), typ)]):  # row 0 again at column 40
        lin = QLinear(parts)
        for isa, lib in builds():
            for portable in (0, 1):
                lib.forerun_q_portable(portable)
                try:
                    out = lin(x, lib=lib)
                    idx, val = lin.argmax(x, lib=lib)
                    idx2, val2 = lin.top(x, 2, lib=lib)
                    out16 = lin(x, lib=lib, f16_scales=True)
                    idx16, val16 = lin.top(x, 2, f16_scales=True, lib=lib)
                finally:
                    lib.forerun_q_portable(0)
                assert torch.equal(idx, out.argmax(-1)), (name, isa, portable)
                assert torch.equal(val, out.max(-1).values), (name, isa, portable)
                # the top two: the largest, then the largest of the rest (equal values: lower index first)
                assert torch.equal(idx2[:, 0], idx) and torch.equal(val2[:, 0], val), (name, isa, portable)
                rest = out.clone()
                rest[torch.arange(len(x)), idx] = -float("inf")
                assert torch.equal(idx2[:, 1], rest.argmax(-1)) and torch.equal(val2[:, 1], rest.max(-1).values)
                assert torch.equal(idx16[:, 0], out16.argmax(-1)) and torch.equal(val16[:, 0], out16.max(-1).values)
                assert not torch.equal(out16, out)  # fp16 activation scales: other sums
        if len(parts[0][0].codes) == 50:
            assert idx.tolist() == [0] * 9
    assert lin.argmax(x[:0])[0].shape == (0,)  # no rows: nothing to find


@needs_kernels
def test_bad_sizes_are_refused():
    c = unpack(random_blocks(Q8_0, 8, 64, seed=1), Q8_0)
    with pytest.raises(ValueError):
        QLinear([(c, Q8_0)])(torch.zeros(2, 32))


def _fresh(code: str, **env) -> tuple[str, str]:
    """Run ``code`` in a new interpreter (fresh kernel choice) with ``env`` added; (stdout, stderr)."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env})
    return r.stdout.strip(), r.stderr


def test_without_a_compiler_the_slow_path_is_said_once(tmp_path):
    out, err = _fresh("from forerun.backends.qweights import qrows_lib; print(qrows_lib(), qrows_lib())",
                      CC=str(tmp_path / "no-such-cc"), FORERUN_CACHE=str(tmp_path))
    assert out == "None None"
    assert err.count("no C compiler found") == 1
    assert err.count("the slow path") == 1


@needs_kernels
def test_a_kernel_build_can_be_forced_and_a_bad_name_is_refused(tmp_path):
    show = "from forerun.backends.ckernels import chosen_isa; print(chosen_isa())"
    out, _ = _fresh(show, FORERUN_KERNEL="portable")
    assert out == "portable"
    out, err = _fresh(show, FORERUN_KERNEL="sse9")
    assert "FORERUN_KERNEL='sse9': expected one of vnni, avx-vnni, avx2, portable" in err


def test_cached_builds_are_keyed_by_compiler_and_build_and_load_only_where_the_cpu_runs_them(monkeypatch, tmp_path):
    a = ckernels.kernel_path("f32_rows", "cc", "avx2")
    b = ckernels.kernel_path("f32_rows", "cc", "vnni")
    monkeypatch.setattr(ckernels, "compiler_version", lambda cc: "cc 99")
    c = ckernels.kernel_path("f32_rows", "cc", "avx2")
    assert len({a, b, c}) == 3
    # a build for a named instruction set runs wherever the CPU has it: not keyed by the CPU's flags,
    # and never loaded where the CPU lacks one of them, even from a cache another CPU filled
    monkeypatch.setattr(ckernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "sse2"}))
    assert ckernels.kernel_path("f32_rows", "cc", "avx2") == c
    monkeypatch.setattr(ckernels, "_LOADED", {})
    monkeypatch.setattr(ckernels, "_compile", lambda name, build: pytest.fail(f"{build} built on a CPU without it"))
    assert ckernels.load("f32_rows", "vnni") is None and ckernels.load("qrows", "avx-vnni") is None
    assert "vnni" not in ckernels.runnable_builds() and "avx2" in ckernels.runnable_builds()


# (type, code range, group, has offset): codes at the ends of each type's range
EXTREMES = {"Q4_0": (Q4_0, -8, 7, 32, False), "Q4_1": (Q4_1, 0, 15, 32, True), "Q5_0": (Q5_0, -16, 15, 32, False),
            "Q5_1": (Q5_1, 0, 31, 32, True), "Q4_K": (Q4_K, 0, 15, 32, True), "Q5_K": (Q5_K, 0, 31, 32, True),
            "Q6_K": (Q6_K, -32, 31, 16, False), "Q8_0": (Q8_0, -127, 127, 32, False)}


@needs_kernels
@pytest.mark.parametrize("name", [*EXTREMES, "Q8_0-positive"])
def test_largest_products_do_not_overflow(name):
    """Every weight at the largest stored code against activations of one sign (every code 127):
    the int16 partial sums of vpmaddubsw sit at their limit, so adding one more vector before
    widening, in any build, saturates and fails here. Pass sizes 1-5 cover every row tile."""
    from forerun.backends.block_weights import Codes

    typ, lo, hi, group, off = EXTREMES[name.split("-")[0]]
    rows, cols = 16, 128
    rng = np.random.default_rng(11)
    if name == "Q8_0":  # signed: weight signs random, activation signs matched (products all +127 * 127)
        codes = np.where(rng.random((rows, cols)) < 0.5, lo, hi)
    elif name == "Q8_0-positive":  # all codes >= 0: stored unsigned with codes up to 127
        codes = np.full((rows, cols), hi)
    else:  # the largest stored code (code minus the type's signed offset) is the top of the range
        codes = np.full((rows, cols), hi)
    scale = np.full((rows, cols // group), 0.01, np.float32)
    c = Codes(codes.astype(np.int64), scale, np.full_like(scale, 0.002) if off else None, group)
    lin = QLinear([(c, typ)])
    x = np.ones((5, cols), np.float32)
    if name == "Q8_0":
        x = np.broadcast_to(np.sign(codes[0]).astype(np.float32), (5, cols)).copy()
    x[1] *= 2.0  # scales differ per row, codes stay at 127
    for isa, lib in builds():
        for portable in (0, 1):
            lib.forerun_q_portable(portable)
            try:
                for n in range(1, 6):
                    out = lin(torch.from_numpy(x[:n]), lib=lib).numpy()
                    want = reference(lin.parts[0], x[:n])
                    assert np.all(np.abs(out - want) <= _bound(lin.parts[0], x[:n])), (name, isa, portable, n)
            finally:
                lib.forerun_q_portable(0)


@needs_kernels
@pytest.mark.parametrize("name", list(TYPES))
def test_the_tile_width_threshold_changes_no_bit(name):
    """``QLinear.set_wide``: the 512-bit tile from 2 rows, from 5, or never; every build the CPU runs
    (where a build has no 512-bit tile the setting is inert) gives the same outputs, and the
    argmax the head takes."""
    from forerun.backends.qweights import NEVER_WIDE

    typ = TYPES[name]
    lin = QLinear([(unpack(random_blocks(typ, 61, 256, seed=9), typ), typ)])
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4))
    for build, lib in builds():
        outs = []
        for wide in (0, 2, 5, NEVER_WIDE):
            lin.set_wide(wide)
            assert all(s.wide == wide for s in lin.structs)
            outs.append([lin(x[:n], lib=lib) for n in (1, 2, 4, 5, 9)] + [lin.argmax(x, lib=lib)[0]])
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other)), (build, name)


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_where_the_weights_are_prefetched_changes_no_bit(name):
    """``QLinear.set_prefetch``: the stream prefetched into L1 or L2, at both tile widths and with
    the byte copy where the type has one: every build the CPU runs gives the same outputs and
    argmax either way, and the setting reaches the C structs (the copy's too)."""
    from forerun.backends.qweights import NEVER_WIDE

    typ = TYPES[name]
    lin = QLinear([(unpack(random_blocks(typ, 61, 512, seed=13), typ), typ)])
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(6))
    if lin.has_planes:
        lin.set_many(3)
    for build, lib in builds():
        outs = []
        for l1 in (0, 1):
            lin.set_prefetch(l1)
            assert all(s.pf_l1 == l1 for s in lin.structs)
            assert all(p.many is None or p.many.pf_l1 == l1 for p in lin.parts)
            for wide in (2, NEVER_WIDE):
                lin.set_wide(wide)
                outs.append([lin(x[:n], lib=lib) for n in (1, 2, 3, 5, 9)] + [lin.argmax(x[:5], lib=lib)[0]])
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other)), (build, name)


def test_the_prefetch_choice_is_the_setting_whose_passes_take_less_time():
    """``tune_prefetch_level``: L1 where its passes (summed over the row counts) are plainly
    faster, L2 where they are or where L1 wins by a hair; the weights left set to the choice."""
    from forerun.backends.qweights import tune_prefetch_level

    def chosen(l1_s, l2_s):
        state = {}

        def run(n):
            import time as _t
            _t.sleep(l1_s[n] if state["l1"] else l2_s[n])

        got = tune_prefetch_level(lambda v: state.__setitem__("l1", v), run, rows=(1, 5), reps=3)
        assert state["l1"] == got
        return got

    assert chosen({1: 0.002, 5: 0.004}, {1: 0.004, 5: 0.008}) == 1
    assert chosen({1: 0.004, 5: 0.008}, {1: 0.002, 5: 0.004}) == 0
    assert chosen({1: 0.002, 5: 0.012}, {1: 0.003, 5: 0.006}) == 0  # one row faster, the pair slower
    assert chosen({1: 0.0099, 5: 0.0099}, {1: 0.01, 5: 0.01}) == 0  # 1% faster: not plainly


@needs_kernels
@pytest.mark.parametrize("name", ["Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_codes_read_as_bytes_change_no_bit(name):
    """``QLinear.set_many``: 5- and 6-bit parts read from a copy laid a byte a code by passes of
    3 rows or more (or of every size, or never), at both tile widths: every build the CPU runs
    gives the outputs and the argmax of the packed codes, and the copy holds the same weights."""
    from forerun.backends.qweights import NEVER_WIDE, U8

    typ = TYPES[name]
    lin = QLinear([(unpack(random_blocks(typ, 61, 256, seed=11), typ), typ)])
    assert lin.has_planes
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(5))
    lin.set_many(1)
    copy = lin.parts[0].many
    assert copy.kind == U8 and np.array_equal(copy.dequantize(), lin.parts[0].dequantize())
    for build, lib in builds():
        outs = []
        for many in (NEVER_WIDE, 1, 3):
            for wide in (2, NEVER_WIDE):
                lin.set_wide(wide)
                lin.set_many(many)
                assert all(s.many_rows == (many if many < NEVER_WIDE else s.many_rows) for s in lin.structs)
                outs.append([lin(x[:n], lib=lib) for n in (1, 2, 3, 5, 8, 9)] + [lin.argmax(x[:5], lib=lib)[0]])
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other)), (build, name)
    lin.drop_many()
    assert lin.parts[0].many is None and not lin.structs[0].many


def test_the_width_choice_is_the_smallest_row_count_from_which_the_wide_tile_keeps_winning():
    from forerun.backends.qweights import NEVER_WIDE, PAIR_ROWS, tune_wide

    def chosen(wide_wins_at):
        state = {}

        def run(n):  # a stand-in cost: the wide tile fast where it wins, slow elsewhere
            import time as _t
            _t.sleep(0.002 if (state["w"] == PAIR_ROWS) == (n in wide_wins_at) else 0.006)

        got = tune_wide(lambda w: state.__setitem__("w", w), run, rows=(2, 4, 8), reps=1)
        assert state["w"] == got  # left set to the choice
        return got

    assert chosen({2, 4, 8}) == 2
    assert chosen({4, 8}) == 4
    assert chosen({2, 8}) == 8  # a loss at 4 rows: only from 8 on
    assert chosen({2, 4}) == NEVER_WIDE


def test_a_setting_that_must_win_plainly_is_not_taken_for_a_hair():
    """``tune_wide(margin=...)`` (the byte copies' rule): a setting no faster is not taken under a
    3% margin (where the plain rule takes a tie), 60% faster is."""
    from forerun.backends.qweights import NEVER_WIDE, PAIR_ROWS, tune_wide

    def chosen(on_s, off_s):
        state = {}

        def run(n):
            import time as _t
            _t.sleep(on_s if state["w"] == PAIR_ROWS else off_s)

        return tune_wide(lambda w: state.__setitem__("w", w), run, rows=(2, 4), reps=3, margin=0.97)

    assert chosen(0.05, 0.05) == NEVER_WIDE
    assert chosen(0.02, 0.05) == 2


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_scales_kept_factored_give_the_bits_of_float32_scales(name):
    """The K-quants' scales (and minimums) kept as the file has them, an int8 per group times a
    float per 256 columns (FACTORED), read about a quarter fewer bytes than float32 scales and give
    every output the same bits, on every build and tile size."""
    typ = TYPES[name]
    c = unpack(random_blocks(typ, 37, 512, seed=typ + 7), typ)
    plain = Codes(c.codes, c.scale, c.offset, c.group)  # no factors: float32 scales
    fac, f32 = QLinear([(c, typ)]), QLinear([(plain, typ)])
    assert fac.parts[0].f16 == FACTORED and f32.parts[0].f16 == 0
    file_bytes = 40 * 512 // BLOCKS[typ][0] * BLOCKS[typ][1]  # 37 rows padded to 40 (groups of 8)
    assert fac.nbytes <= 1.07 * file_bytes < f32.nbytes, (fac.nbytes, file_bytes, f32.nbytes)
    assert np.array_equal(fac.parts[0].dequantize(), f32.parts[0].dequantize())
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((16, 512)).astype(np.float32))
    for isa, lib in builds():
        for portable in (0, 1):
            lib.forerun_q_portable(portable)
            try:
                for n in (1, 2, 3, 5, 8, 9, 16):
                    a, b = fac(x[:n], lib=lib).numpy(), f32(x[:n], lib=lib).numpy()
                    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (name, isa, portable, n)
                    assert torch.equal(fac.argmax(x[:n], lib=lib)[0], f32.argmax(x[:n], lib=lib)[0])
            finally:
                lib.forerun_q_portable(0)


def test_factors_that_do_not_rebuild_the_scales_are_not_used():
    c = unpack(random_blocks(Q4_K, 16, 256, seed=5), Q4_K)
    sfac, smul, ofac, omul = c.factors
    wrong = Codes(c.codes, c.scale, c.offset, c.group, (sfac * 2, smul, ofac, omul))
    part = QPart(wrong, Q4_K)
    assert part.f16 == 0 and np.array_equal(part.dequantize().astype(np.float32), c.dequantize())


def test_requantized_weights_are_4_bit_codes_close_to_the_weights():
    """``QLinear.requantized`` (a draft model re-coded to 4 bits): parts of more than 4 bits a code
    become Q4_0 (fewer bytes), each weight within one code step of itself; 4-bit parts stay as they are."""
    for typ in (Q5_0, Q6_K, Q8_0, Q5_K, Q4_K):
        lin = QLinear([(unpack(random_blocks(typ, 16, 512, seed=11), typ), typ)])
        r = lin.requantized()
        if typ == Q4_K:
            assert r.parts[0] is lin.parts[0]
            continue
        p = r.parts[0]
        assert (p.kind, p.zb, p.f16) == (U4, -8, 1) and r.nbytes < 0.85 * lin.nbytes, typ
        w = lin.parts[0].dequantize().reshape(16, -1, 32)
        err = np.abs(p.dequantize().reshape(16, -1, 32) - w)
        step = np.abs(w).max(-1, keepdims=True) / 8  # the scale d: codes -8..7 times d, the largest weight at -8 d
        assert np.all(err <= step * 1.01 + 1e-12), typ  # within a step (7 d clips the far side)
        assert err.mean() < 0.3 * step.mean(), typ  # rounded to nearest: about a quarter step on average
