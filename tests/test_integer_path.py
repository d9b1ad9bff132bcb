"""The native backend's integer path (``qrows.c``: GGUF blocks, 8-bit activations, one native call
per layer) on every architecture it claims, with tiny random models quantized in the test.

Checked: logits near the float32 forward on the same weights; every row of a pass bit for bit a
one-token step at that position (chains of 1-64 rows, past 64 cached positions, token trees,
several sequences in one batched pass); greedy speculation equal to plain decoding."""

import numpy as np
import pytest
import torch
from conftest import run_batch, wrap
from test_architectures import ARCHS, _build
from test_engine import PROMPTS
from test_qrows import quantize_reference

from forerun.backends.block_weights import Codes
from forerun.backends.gguf_weights import GGUF_PARTS
from forerun.backends.qweights import qrows_lib
from forerun.drafters import make_drafter
from forerun.engine import Engine
from forerun.gguf_file import Q4_0, Q4_1, Q5_0, Q6_K, Q8_0

pytestmark = pytest.mark.skipif(qrows_lib() is None, reason="the integer kernels need a C compiler")


def quantize(w: torch.Tensor, typ: int) -> Codes:
    """w [V, D] as GGUF-like codes of ``typ`` (round to nearest; scales as float16 where the type has them)."""
    w = w.detach().float().numpy()
    V, D = w.shape
    group = 16 if typ == Q6_K else 32
    g = w.reshape(V, D // group, group)
    if typ == Q4_1:
        mn, mx = g.min(-1), g.max(-1)
        scale = np.maximum((mx - mn) / 15, 1e-4).astype(np.float16).astype(np.float32)
        off = mn.astype(np.float16).astype(np.float32)
        codes = np.clip(np.rint((g - off[..., None]) / scale[..., None]), 0, 15)
        return Codes(codes.reshape(V, D).astype(np.int16), scale, off, 32)
    top = {Q4_0: 8, Q5_0: 16, Q6_K: 32, Q8_0: 127}[typ]
    scale = np.maximum(np.abs(g).max(-1) / top, 1e-4).astype(np.float16).astype(np.float32)
    codes = np.clip(np.rint(g / scale[..., None]), -top, top - 1 if typ != Q8_0 else top)
    return Codes(codes.reshape(V, D).astype(np.int16), scale, None, group)


def codes_of(mix: str):
    """A ``NativeBackend.attach_integer`` source: Q8_0 everywhere, or a mix of every kernel kind."""
    kinds = {"qkv": Q4_1, "o": Q5_0, "gate_up": Q4_0, "down": Q6_K}

    def get(names, weight):
        if mix == "q8" or names == ["output"]:
            return [(quantize(weight, Q8_0), Q8_0)]
        attr = next(a for a, p in (("qkv", "attn_q"), ("o", "attn_output"), ("gate_up", "ffn_gate"), ("down", "ffn_down"))
                    if p in names[0])
        return [(quantize(weight, kinds[attr]), kinds[attr])]

    return get


def integer_model(arch: str, mix: str = "mixed", seed: int = 0):
    model = _build(arch, seed)
    lm = wrap(model, name=f"tiny-{arch}-int")
    assert lm.backend.attach_integer(codes_of(mix))
    assert lm.backend.model.greedy.kind == "integer" and lm.backend.model.batch_invariant
    return model, lm


class _Reference:
    """A linear layer as the integer path computes it, in float64: activations quantized per row and
    32 values to 8 bits, times the dequantized codes (``test_qrows.quantize_reference``)."""

    def __init__(self, codes: Codes):
        self.w = torch.from_numpy(codes.dequantize().astype(np.float64))

    def __call__(self, x, how=None):
        q, d = quantize_reference(x.detach().float().numpy())
        xq = torch.from_numpy((q * d).reshape(x.shape[0], -1).astype(np.float64))
        return (xq @ self.w.T).float()


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_compute_what_the_reference_computes(arch):
    """The whole forward against the float path with every product replaced by its reference: a
    wrong norm, rotation, attention, activation or residual gives errors far above rounding."""
    model, lm = integer_model(arch)
    ref = wrap(model, name="tiny-reference").backend
    m = ref.model
    m.fixed = None  # its products are replaced below: the library path, whatever the test run asks
    get = codes_of("mixed")
    for i, layer in enumerate(m.layers):
        for attr, parts in GGUF_PARTS.items():
            lin = getattr(layer, attr)
            setattr(layer, attr, _Reference(get([f"blk.{i}.{p}.weight" for p in parts], lin.weight)[0][0]))
    m.lm_head = _Reference(get(["output"], m.lm_head.weight)[0][0])
    m.body_kernel, m.want_invariant, m.greedy.exact = "onednn", False, False
    assert lm.backend.model.kv_dtype == torch.float16  # the integer path keeps float16 keys and values: so does the reference
    store = ref.cache.store
    ref.cache.store = lambda idx, k, v, pos: store(idx, k.half().float(), v.half().float(), pos)
    ids = torch.tensor([2, 7, 8, 9, 10, 7, 8, 9, 11, 12, 13, 7, 8])
    got = lm.backend.forward(ids, 0).logits
    want = ref.forward(ids, 0).logits
    rows = (got - want).abs().amax(-1) / want.abs().max()  # each row's error, relative to the largest logit
    # The same quantized operands, float32 sums in another order (torch's order depends on the
    # vector width it picked for this CPU: AVX-512 and AVX2 differ in the last bit). Two steps of
    # either path are discontinuous, the float16 rounding of a cached key or value and the 8-bit
    # code of an activation: where a value lies within a last-bit difference of such a rounding
    # boundary, the two paths round it apart by a whole step, and a tiny random model carries that
    # step to the logits of the rows after it (seen: 1.3e-2 on a few rows of one model on an
    # AVX-512 machine, every other row 1e-7). So most rows must agree to float32 rounding, and none
    # may be off by more than such a step; a wrong norm, rotation, attention scale, bias, activation
    # or residual moves nearly every row by 2e-3 or more.
    assert rows.median() < 1e-5, rows
    assert rows.max() < 5e-2, rows


@pytest.mark.parametrize("arch", ARCHS)
def test_every_row_of_a_pass_is_a_one_token_step(arch):
    _, lm = integer_model(arch)
    be = lm.backend
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 96, (150,), generator=g)
    be.reset()
    be.forward(ids[:70], 0, logits=False)  # a prompt pass past 64 rows
    steps = torch.cat([be.forward(ids[i: i + 1], i).logits for i in range(70, 150)])
    for n in (1, 2, 5, 9, 33, 64):
        for start in (70, 150 - n):
            be.truncate(70)
            if start > 70:  # one pass over the rows in between: by invariance, the steps' cache
                be.forward(ids[70: start], 70, logits=False)
            chain = be.forward(ids[start: start + n], start).logits
            assert torch.equal(chain, steps[start - 70: start - 70 + n]), (n, start)


def test_tree_rows_and_batched_sequences_are_one_token_steps():
    _, lm = integer_model("gemma3")
    be = lm.backend
    prompt = torch.tensor([2, 7, 8, 9, 10, 11, 12, 13, 14])
    be.reset()
    be.forward(prompt, 0, logits=False)
    P = len(prompt)
    # tree: root 20, children 21 and 22, 23 under 21
    tree_tokens = torch.tensor([20, 21, 22, 23])
    parents = torch.tensor([-1, -1, 0])  # node i is row i + 1; -1: the root
    out = be.forward(tree_tokens, P, tree=parents).logits
    for path, rows in (([20, 21, 23], [0, 1, 3]), ([20, 22], [0, 2])):
        be.truncate(P)
        steps = torch.cat([be.forward(torch.tensor([t]), P + i).logits for i, t in enumerate(path)])
        assert torch.equal(out[rows], steps), path
    # two sequences in one pass: each row as its own sequence's one-token steps give it
    a, b = be.fork(), be.fork()
    a.forward(prompt, 0, logits=False)
    b.forward(prompt[:5], 0, logits=False)
    both = be.forward_batch([a, b], [torch.tensor([30, 31, 32]), torch.tensor([40])], [P, 5])
    a.truncate(P)
    b.truncate(5)
    sa = torch.cat([a.forward(torch.tensor([t]), P + i).logits for i, t in enumerate([30, 31, 32])])
    sb = b.forward(torch.tensor([40]), 5).logits
    assert torch.equal(both[0].logits, sa) and torch.equal(both[1].logits, sb)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_greedy_rows_take_the_argmax_of_the_logits(arch):
    """The integer path's greedy tokens (found inside the kernel, no logits formed; Gemma 2's
    soft-capped head takes its logits) are the argmax of its logits, alone and in a batched pass."""
    _, lm = integer_model(arch)
    be = lm.backend
    ids = torch.randint(4, 96, (40,), generator=torch.Generator().manual_seed(3))
    be.reset()
    h = be.forward(ids, 0, logits=False, return_hidden=True).hidden
    assert torch.equal(be.argmax_hidden(h), be.model.lm_logits(h).argmax(-1))
    a, b = be.fork(), be.fork()
    a.forward(ids[:30], 0, logits=False)
    b.forward(ids[:20], 0, logits=False)
    both = be.forward_batch([a, b], [ids[30:35], ids[20:22]], [30, 20], greedy=[True, False])
    a.truncate(30)
    want = a.forward(ids[30:35], 30).logits.argmax(-1)
    if be.model.softcap:  # Gemma 2: logits, as for sampled rows
        assert torch.equal(both[0].logits.argmax(-1), want)
    else:
        assert torch.equal(both[0].ids, want)
    assert both[1].logits is not None


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_greedy_speculation_equals_plain_decoding(arch):
    _, lm = integer_model(arch)
    plain = Engine(lm.backend, None, lm.eos_token_ids)
    for method, k in (("ngram", 4), ("ngram", "auto"), ("layerskip", 3)):
        eng = Engine(lm.backend, make_drafter(method, lm), lm.eos_token_ids)
        for p in PROMPTS:
            want = plain.generate(p, max_new_tokens=40, k=0).token_ids
            assert eng.generate(p, max_new_tokens=40, k=k).token_ids == want, (arch, method, p)


def test_batched_engine_equals_plain_decoding():
    from forerun.batching import BatchEngine, BatchRequest
    from forerun.drafters.ngram import NgramDrafter

    _, lm = integer_model("llama")
    plain = Engine(lm.backend, None, lm.eos_token_ids)
    want = [plain.generate(p, max_new_tokens=24, k=0).token_ids for p in PROMPTS]
    be = BatchEngine(lm.backend, lm.eos_token_ids, drafter=NgramDrafter(), max_batch=4)
    got = run_batch(be, [BatchRequest(prompt=list(p), max_new_tokens=24) for p in PROMPTS])
    assert got == want


@pytest.mark.parametrize("arch", ARCHS)
def test_every_build_computes_the_same_bits(arch, monkeypatch):
    """Whole passes (activation quantization, products, norms, rotation, attention with blocks of 8
    keys and a tail, the gated activation) give the same bits with the portable, AVX2 and (emulated)
    VNNI builds of qrows.c: each build's vector code keeps the plain loops' float operations."""
    from test_qrows import builds

    from forerun.backends.ckernels import use_build

    _, lm = integer_model(arch)
    be = lm.backend
    ids = torch.randint(4, 96, (45,), generator=torch.Generator().manual_seed(3))
    outs = {}
    for isa, _ in builds():
        with use_build(isa):
            be.reset()
            prompt = be.forward(ids[:37], 0).logits
            chain = be.forward(ids[37:], 37, layers=(0,)).logits
        outs[isa] = (prompt, chain)
    assert "portable" in outs and len(outs) > 1
    for isa, (prompt, chain) in outs.items():
        assert torch.equal(prompt, outs["portable"][0]) and torch.equal(chain, outs["portable"][1]), isa


def test_cache_keys_round_to_float16_as_torch_does_on_every_build():
    """The integer path keeps keys and values as float16: F16C's conversion and the portable one
    must both round like torch's ``half()`` (nearest, ties to even; subnormals; overflow to
    infinity), or builds and the reference would disagree."""
    import ctypes

    from test_qrows import builds

    g = torch.Generator().manual_seed(5)
    tiny = 2.0 ** -24
    x = torch.cat([torch.randn(4000, generator=g) * 10 ** torch.empty(4000).uniform_(-9, 5, generator=g),
                   torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, float("inf"), float("-inf"),
                                 tiny, tiny / 2, tiny * 1.5, tiny * 2.5, -tiny * 0.5000001, 2.0 ** -14,
                                 2.0 ** -14 - tiny / 2, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1e-30])]).float()
    want = x.half().view(torch.int16)
    for isa, lib in builds():
        out = torch.empty(len(x), dtype=torch.int16)
        lib.forerun_q_to_half.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.forerun_q_to_half(x.data_ptr(), out.data_ptr(), len(x))
        assert torch.equal(out, want), (isa, x[out != want][:5])


def test_a_draft_model_recoded_to_4_bits_reads_fewer_bytes_and_changes_no_output():
    """``requantize_4bit`` on a draft model: every layer weight 4 bits a code, and greedy and seeded
    output through it still plain decoding's, its drafts often taken and sometimes not."""
    from forerun.sampling import SamplingParams

    _, target = integer_model("llama")
    _, draft = integer_model("llama", mix="q8")  # the target's weights at 8 bits a code
    be = draft.backend
    before = sum(q.nbytes for q in be.model.quant)
    assert be.requantize_4bit() and not be.requantize_4bit()  # once
    assert sum(q.nbytes for q in be.model.quant) < 0.6 * before
    assert all(p.kind == 0 for q in be.model.quant for p in q.parts)
    plain = Engine(target.backend, None, target.eos_token_ids)
    eng = Engine(target.backend, make_drafter("draft", target, draft_model=draft), target.eos_token_ids)
    drafted = accepted = 0
    for p in PROMPTS:
        for k in (4, "auto"):
            out = eng.generate(p, max_new_tokens=40, k=k)
            assert out.token_ids == plain.generate(p, max_new_tokens=40, k=0).token_ids, (p, k)
            drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
        params = SamplingParams(temperature=0.9, top_k=20, seed=3)
        assert (eng.generate(p, max_new_tokens=30, k=4, params=params).token_ids
                == plain.generate(p, max_new_tokens=30, k=0, params=params).token_ids), p
    assert 0 < accepted < drafted
