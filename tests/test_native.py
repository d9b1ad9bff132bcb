import torch
from conftest import tiny_gemma, wrap


def test_native_matches_transformers_logits():
    model = tiny_gemma(0)
    lm = wrap(model)
    assert type(lm.backend).__name__ == "NativeBackend"
    ids = torch.randint(4, 96, (40,), generator=torch.Generator().manual_seed(0))  # longer than the window (8)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    out = lm.backend.forward(ids, 0).logits
    assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()


def test_incremental_equals_full_and_rollback():
    be = wrap(tiny_gemma(0)).backend
    ids = torch.randint(4, 96, (30,), generator=torch.Generator().manual_seed(1))
    be.reset()
    full = be.forward(ids, 0).logits
    be.reset()
    be.forward(ids[:20], 0)
    for i in range(20, 30):  # one token at a time across the sliding window
        step = be.forward(ids[i : i + 1], i).logits
        assert torch.allclose(step[0], full[i], atol=1e-4)
    # Roll back to 25, write different tokens, roll back again: the original continuation is unchanged.
    be.truncate(25)
    assert be.length == 25
    be.forward(torch.tensor([5, 6, 7]), 25)
    be.truncate(25)
    again = be.forward(ids[25:], 25).logits
    assert torch.allclose(again, full[25:], atol=1e-4)


def test_hf_backend_rollback():
    """transformers' own module behind ``HFBackend``: rolling back by one position and by several,
    then writing other tokens, leaves no stale position in its cache."""
    from conftest import tiny_llama

    from forerun.backends.hf import HFBackend
    from forerun.drafters import make_drafter
    from forerun.engine import Engine

    lm = wrap(tiny_llama(0), backend="hf")
    be = lm.backend
    assert type(be) is HFBackend
    ids = torch.randint(4, 96, (16,), generator=torch.Generator().manual_seed(2))
    be.reset()
    full = be.forward(ids, 0).logits
    for back in (1, 3):  # write `back` wrong tokens after position 10, roll them back, continue
        be.reset()
        be.forward(ids[:10], 0)
        be.forward(torch.tensor([9] * back), 10)
        be.truncate(10)
        assert be.length == 10
        assert torch.allclose(be.forward(ids[10:11], 10).logits, full[10:11], atol=1e-5), back
        be.forward(torch.tensor([9, 9]), 11)
        be.truncate(11)
        assert torch.allclose(be.forward(ids[11:], 11).logits, full[11:], atol=1e-5), back
    # speculation on it: every rejected draft is rolled back; the output is plain decoding's
    prompt = [2, 7, 8, 7, 8, 7]
    plain = Engine(be, None, lm.eos_token_ids).generate(prompt, max_new_tokens=24).token_ids
    res = Engine(be, make_drafter("ngram", lm), lm.eos_token_ids).generate(prompt, max_new_tokens=24, k=3)
    assert res.token_ids == plain
    assert res.stats.drafted > res.stats.accepted > 0  # accepted drafts and rejected ones (rollbacks)
    # and in the batch engine (one sequence after another on this backend), two requests at once
    from conftest import run_batch

    from forerun.batching import BatchEngine, BatchRequest

    eng = BatchEngine(be, lm.eos_token_ids, drafter=make_drafter("ngram", lm), max_batch=2)
    eng.policy.costs["pass"] = {r: 1.0 for r in range(1, 80)}  # drafts look free: every step drafts
    eng.policy.margin = -1.0
    reqs = [BatchRequest(prompt=prompt, max_new_tokens=24), BatchRequest(prompt=[2, 9, 4, 9, 4, 9], max_new_tokens=24)]
    outs = run_batch(eng, reqs)
    assert outs == [plain, Engine(be, None, lm.eos_token_ids).generate(reqs[1].prompt, max_new_tokens=24).token_ids]
    assert sum(r.stats.drafted for r in reqs) > sum(r.stats.accepted for r in reqs) > 0


def test_layer_skip_and_sub_head():
    be = wrap(tiny_gemma(0)).backend
    ids = torch.arange(4, 20)
    be.reset()
    full = be.forward(ids, 0).logits
    be.reset()
    skipped = be.forward(ids, 0, skip_layers=[1, 3]).logits
    assert not torch.allclose(full, skipped)
    rows = torch.tensor([5, 9, 40])
    be.reset()
    sub = be.forward(ids, 0, head=be.sub_head(rows)).logits
    assert torch.allclose(sub, full[:, rows], atol=1e-5)


def test_exact_float_argmax_equals_float64_argmax():
    """The Q8_0-screened argmax equals the argmax of float64 logits, for a float head (not Q8_0)
    and for a head dequantized from Q8_0, on rows with near ties too."""
    import pytest

    from forerun.backends.greedy_head import ExactFloatArgmax, quantize_q8_0

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3000, 64, generator=g)
    q, d = quantize_q8_0(w)
    for weight in (w, (q * d[..., None]).reshape(w.shape)):
        head = ExactFloatArgmax(weight)
        if not head.available:
            pytest.skip("no C compiler for the Q8_0 kernel")
        h = torch.randn(40, 64, generator=g) * 3
        h[20:] = weight[:20] * 0.5 + weight[20:40] * 0.5  # rows 20..: a two-way tie (up to rounding)
        ref = (weight.double() @ h.double().T).T.argmax(-1)
        assert torch.equal(head.argmax(h), ref)
        # Any split into passes gives the same answer.
        assert torch.equal(torch.cat([head.argmax(h[i: i + 7]) for i in range(0, 40, 7)]), ref)


def test_q8_head_products_match_exact_products(each_build):
    """The Q8_0 head's products (the GGUF path's kernel with ggml's fp16 activation scales) give
    each logit within the float32 rounding bound of the exact product of the quantized operands
    (``quantize_q8_0``: the codes and scales ggml forms), on every build, for pass sizes that fill
    the kernel's row tiles and that do not; its top two are the two largest of those logits."""
    import pytest

    from forerun.backends.greedy_head import _U32, Q8Head, q8_0_blocks, quantize_q8_0

    g = torch.Generator().manual_seed(5)
    V, D = 1003, 96  # V: not a multiple of 8
    raw = q8_0_blocks(torch.randn(V, D, generator=g))[0]
    head = Q8Head(raw, D)
    if not head.available:
        pytest.skip("no C compiler for the integer kernels")
    for n in (1, 3, 4, 5, 9):
        h = torch.randn(n, D, generator=g) * 4
        q, d = quantize_q8_0(h)
        out = head.logits(h)
        scale = head.d.double()[None] * d.double()[:, None]  # [n, V, nb]
        exact = (torch.einsum("vbj,rbj->rvb", head.q.double(), q.double()) * scale).sum(-1)
        # each float term the kernel rounds is a partial sum of products: bounded by sum |w x|
        bound = (head.nb + 6) * _U32 * (torch.einsum("vbj,rbj->rvb", head.q.double().abs(), q.double().abs()) * scale).sum(-1)
        assert ((out.double() - exact).abs() <= bound).all(), (each_build, n)
        # float32 scales instead of ggml's fp16 ones would be off by far more than the bound
        assert not ((head.lin(h).double() - exact).abs() <= bound).all()
        top, idx = head.top2(h)
        two = out.topk(2, dim=-1)
        assert torch.equal(top, two.values) and torch.equal(idx[:, 0], out.argmax(-1)), (each_build, n)


def test_argmax_forward_matches_logits_for_chains_and_trees():
    be = wrap(tiny_gemma(0)).backend
    be.model.greedy.exact_greedy = True  # opt-in (see README, performance notes)
    if be.model.greedy.exact_head() is None:
        import pytest

        pytest.skip("no C compiler for the Q8_0 kernel")
    ids = torch.randint(4, 96, (24,), generator=torch.Generator().manual_seed(3))
    be.reset()
    be.forward(ids[:16], 0)
    ref = be.forward(ids[16:], 16).logits.double().argmax(-1)
    be.truncate(16)
    assert torch.equal(be.argmax_forward(ids[16:], 16).ids, ref)
    parents = torch.tensor([-1, 0, 0, 1])  # rows 1..4 hang off the root and each other
    be.truncate(16)
    tree_logits = be.forward(ids[16:21], 16, tree=parents).logits
    be.truncate(16)
    out = be.argmax_forward(ids[16:21], 16, layers=[1, 3], tree=parents)
    ids_tree, feats = out.ids, out.layers
    assert torch.equal(ids_tree, tree_logits.argmax(-1)) and feats.shape == (5, 128)


def test_f32_rows_kernel_matches_float64_and_is_a_tuning_candidate(each_build):
    """The multi-row float32 kernel (the LM head of verify passes) gives float64's product up to
    float32 rounding, for vector-sized and odd shapes, and the LM head's autotuner offers it."""
    import pytest

    from forerun.backends.linear import PackedLinear, f32_rows, f32_rows_kernel

    if f32_rows_kernel() is None:
        pytest.skip("no C compiler for the f32_rows kernel")
    g = torch.Generator().manual_seed(0)
    for V, D, n in [(1001, 64, 1), (1001, 64, 17), (37, 24, 7), (5, 12, 3), (3, 640, 32)]:
        w = torch.randn(V, D, generator=g)
        x = torch.randn(n, D, generator=g)
        ref = x.double() @ w.double().T
        out = f32_rows(w, x)
        assert out.shape == (n, V) and out.dtype == torch.float32
        bound = 4 * D * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)  # a loose float32 error bound
        assert ((out.double() - ref).abs() <= bound).all()
        # Each row's sums are the same whatever the other rows of the pass (the body relies on it).
        assert all(torch.equal(f32_rows(w, x[i: i + 1])[0], out[i]) for i in range(n))
    with pytest.raises(ValueError):
        f32_rows(w.double(), x)
    lin = PackedLinear(torch.randn(500, 64, generator=g), pack=True, autotune=True)
    if lin.packed is None:
        pytest.skip("no oneDNN in this torch build")
    assert "rows" in lin.kernels
    x = torch.randn(5, 64, generator=g)
    assert torch.allclose(lin._run(x, "rows"), lin._run(x, "plain"), atol=1e-4)


def test_f16_weight_rows_kernel_matches_float64_and_is_used_only_where_exact(each_build):
    """Float16 weights read by the rows kernel give float64's product of those weights up to
    float32 rounding (vector-sized shapes, odd shapes, subnormal and negative halves), each row
    alone; a layer takes the float16 copy only when float16 holds its weights exactly."""
    import pytest

    from forerun.backends.linear import PackedLinear, f16w_rows, f32_rows_kernel

    if f32_rows_kernel() is None:
        pytest.skip("no C compiler for the f32_rows kernel")
    g = torch.Generator().manual_seed(1)
    for V, D, n in [(1001, 64, 1), (1001, 64, 17), (37, 24, 7), (5, 12, 3)]:
        w16 = torch.randn(V, D, generator=g).half()
        w16[0, :4] = torch.tensor([6e-8, -6e-8, 3e-5, -0.0]).half()  # subnormals and a negative zero
        x = torch.randn(n, D, generator=g)
        ref = x.double() @ w16.double().T
        out = f16w_rows(w16, x)
        bound = 4 * D * 2.0 ** -24 * (x.double().abs() @ w16.double().abs().T) + 1e-30
        assert out.shape == (n, V) and ((out.double() - ref).abs() <= bound).all()
        assert all(torch.equal(f16w_rows(w16, x[i: i + 1])[0], out[i]) for i in range(n))
    exact = PackedLinear(torch.randn(64, 32, generator=g).half().float(), pack=True, half=True)
    if exact.packed is None:
        pytest.skip("no oneDNN in this torch build")
    assert exact.half is not None
    x = torch.randn(3, 32, generator=g)
    assert torch.allclose(exact(x), x @ exact.weight.T, atol=1e-5)
    assert PackedLinear(torch.randn(64, 32, generator=g), pack=True, half=True).half is None  # float16 would round it


def test_body_kernel_is_chosen_once_and_both_kernels_agree():
    """The body's linear kernel is timed once per model (shared with forks); both candidates give
    the same logits up to float32 rounding, and the rows kernel (chains, trees) keeps greedy
    generation identical to oneDNN's on the tiny model."""
    import pytest

    from forerun.backends.linear import f32_rows_kernel
    from forerun.engine import Engine

    be = wrap(tiny_gemma(1)).backend
    kernel = be.model.body_kernel
    assert kernel in ("onednn", "rows")
    twin = be.fork()
    assert twin.model is be.model and twin.model.body_kernel == kernel
    if f32_rows_kernel() is None or be.model.pack is False:
        pytest.skip("no C compiler for the f32_rows kernel")
    ids = torch.randint(4, 96, (30,), generator=torch.Generator().manual_seed(5))
    out = {}
    for how in ("onednn", "rows"):
        be.model.body_kernel = how
        be.reset()
        be.forward(ids[:20], 0)
        out[how] = (be.forward(ids[20:26], 20).logits, Engine(be, None, set()).generate(ids[:8].tolist(), max_new_tokens=12).token_ids)
    assert torch.allclose(out["onednn"][0], out["rows"][0], atol=1e-4, rtol=1e-4)
    assert out["onednn"][1] == out["rows"][1]


def test_greedy_head_auto_decides_once_and_matches_float_argmax():
    """exact_greedy="auto" (the default) times the screened exact head against float32 logits on
    first use and keeps one answer for the model and its forks; either way greedy tokens are the
    argmax of the logits (no near ties on the tiny model)."""
    be = wrap(tiny_gemma(2)).backend
    assert be.model.greedy.exact_greedy == "auto"
    twin = be.fork()  # decides first
    assert be.model.greedy.kind in ("exact-q8-screened", "float32") and twin.model.greedy is be.model.greedy
    ids = torch.randint(4, 96, (20,), generator=torch.Generator().manual_seed(6))
    be.reset()
    ref = be.forward(ids, 0).logits.double().argmax(-1)
    be.reset()
    assert torch.equal(be.argmax_forward(ids, 0).ids, ref)
    h = be.forward(ids[:3], 0, logits=False, return_hidden=True).hidden
    assert torch.equal(be.argmax_hidden(h), ref[:3])


def test_exact_argmax_narrows_flat_rows_with_float32_logits():
    """A row whose Q8_0 screen leaves many candidates (near-identical vocabulary rows) is narrowed
    with float32 logits and their error bound, by gathered rows or by the whole float32 head, and
    still gives the float64 argmax."""
    import pytest

    from forerun.backends.greedy_head import ExactFloatArgmax

    g = torch.Generator().manual_seed(1)
    w = torch.randn(3000, 64, generator=g)
    for flat in (30, 2000):  # 30 rows: gathered (under 1/64 of 3000 rows is 46); 2000: the whole head
        wf = w.clone()
        wf[:flat] = w[0] + 1e-4 * torch.randn(flat, 64, generator=g)
        calls = []
        head = ExactFloatArgmax(wf, float_logits=lambda x: calls.append(len(x)) or x @ wf.T)
        if not head.available:
            pytest.skip("no C compiler for the Q8_0 kernel")
        head.RESCORE_F32 = 8
        narrow, narrowed = head._narrow, []
        head._narrow = lambda cand, row: narrowed.append(len(cand)) or narrow(cand, row)
        h = wf[:4] * 3 + 0.01 * torch.randn(4, 64, generator=g)
        ref = (wf.double() @ h.double().T).T.argmax(-1)
        head.candidates = 0
        assert torch.equal(head.argmax(h), ref)
        assert narrowed and head.candidates < sum(narrowed)  # the screen left many; float32 narrowed them
        assert bool(calls) == (flat > 3000 // 64)


def test_verify_rows_equal_one_token_steps_bit_for_bit():
    """Batch-invariant (the default on the CPU): every row of a chain pass and of a branching tree
    pass, across the sliding window, has exactly the hidden state a one-token step at that
    position computes with the row's path in the cache, so greedy verification cannot differ from
    plain decoding even on a near tie."""
    import pytest

    be = wrap(tiny_gemma(2)).backend
    if not be.model.batch_invariant:
        pytest.skip("no C compiler for the row kernels")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 96, (40,), generator=g)
    pos = 20  # past the sliding window (8)

    def steps(path):  # hidden states of one-token steps over path, after the same prefill
        be.reset()
        be.forward(ids[:pos], 0, logits=False)
        return torch.cat([be.forward(torch.tensor([t]), pos + i, logits=False, return_hidden=True).hidden
                          for i, t in enumerate(path)])

    chain = steps(ids[pos: pos + 12].tolist())
    for n in (2, 5, 12):
        be.reset()
        be.forward(ids[:pos], 0, logits=False)
        assert torch.equal(be.forward(ids[pos: pos + n], pos, logits=False, return_hidden=True).hidden, chain[:n])
    # rows 1.. (row 0 is the root); the last branch runs 10 deep, past the sliding window (8)
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 2, 4, 5, 7, 3, 9, 11, 12, 13, 14, 15])
    tokens = torch.randint(4, 96, (len(parents) + 1,), generator=g)
    be.reset()
    be.forward(ids[:pos], 0, logits=False)
    tree_h = be.forward(tokens, pos, logits=False, return_hidden=True, tree=parents).hidden
    for r in range(len(tokens)):
        path, a = [], r
        while a > 0:
            path.append(a)
            a = int(parents[a - 1]) + 1
        path = [0] + path[::-1]
        assert torch.equal(steps(tokens[path].tolist())[-1], tree_h[r]), r
    # the library path (batch_invariant=False) computes the same values up to float32 rounding
    be2 = wrap(tiny_gemma(2)).backend
    be2.model.want_invariant = False
    be2.reset()
    be2.forward(ids[:pos], 0, logits=False)
    assert torch.allclose(be2.forward(ids[pos: pos + 12], pos, logits=False, return_hidden=True).hidden, chain, atol=1e-4)


def test_attention_rows_of_a_pass_read_the_cache_once_and_give_each_rows_own_bits(each_build):
    """``attn_rows.c`` (and ``qrows.c``, same code) attends the rows of one sequence together, a block
    of keys and values at a time for all of them: each row must still get, bit for bit, what it gets
    alone. Head sizes 64 and 256 (values summed in registers across blocks) and 80 (element by
    element), contexts of several key blocks, a pass of more rows than one group holds (16), a sliding
    window (rows start at different slots) and tree rows (extra slots), on float32 caches and on the
    integer path's float16 ones (widened a block at a time); and attention itself checked against
    float64."""
    import pytest

    from forerun.backends.attention import RowKeys, attention_rows, attn_rows_kernel

    lib = attn_rows_kernel()
    if lib is None:
        pytest.skip("no C compiler for the row kernels")

    def attend16(q, k, v, keys, scale):  # the integer path's float16 caches, through the same code
        T, H, D = q.shape
        out = torch.empty(T, H, D)
        ptr = lambda t: torch.tensor([t.data_ptr()] * T, dtype=torch.int64)  # noqa: E731
        kp, vp, caps = ptr(k), ptr(v), torch.full((T,), k.shape[1], dtype=torch.int64)
        assert lib.forerun_attn_rows_multi_f16(q.contiguous().data_ptr(), kp.data_ptr(), vp.data_ptr(), caps.data_ptr(),
                                               T, H, k.shape[0], D, keys.lo.data_ptr(), keys.hi.data_ptr(),
                                               keys.xp.data_ptr(), keys.extra.data_ptr(), scale, out.data_ptr()) == 0
        return out.view(T, H * D)

    g = torch.Generator().manual_seed(3)
    for (D, H, KVH), half in [(shape, half) for shape in ((64, 9, 3), (256, 4, 1), (80, 8, 8)) for half in (False, True)]:
        cap = 400
        k = torch.randn(KVH, cap, D, generator=g)
        v = torch.randn(KVH, cap, D, generator=g)
        attention = attention_rows
        if half:
            k, v, attention = k.half(), v.half(), attend16
        pos = 300
        cases = [RowKeys.chain(pos, 20, None), RowKeys.chain(pos, 5, 130),
                 RowKeys([0, 0, 0], [pos, pos, pos], [[pos], [pos, pos + 1], [pos, pos + 2]])]
        for keys in cases:
            T = len(keys.rows)
            q = torch.randn(T, H, D, generator=g)
            together = attention(q, k, v, keys, 0.125)
            for t in range(T):
                a, b, e = keys.rows[t]
                alone = attention(q[t:t + 1], k, v, RowKeys([a], [b], [e]), 0.125)
                assert torch.equal(together[t:t + 1], alone), (D, t)
                kk, vv = keys.keys_values(t, k.double(), v.double())
                qq = q[t].double().view(KVH, H // KVH, D)
                w = torch.softmax(torch.einsum("gqd,gsd->gqs", qq, kk) * 0.125, -1)
                want = torch.einsum("gqs,gsd->gqd", w, vv).reshape(-1)
                assert (together[t].double() - want).abs().max() < 1e-5, (D, t)


def test_lm_head_logits_are_a_rows_own_in_passes_of_every_size():
    """Batch-invariant (the CPU float32 default): a row's logits, not only its hidden state, are
    the bits a one-token step gives it, in chain passes of every size from 1 to 64 rows, in a token
    tree's pass and in batched passes of 1 to 16 sequences (80 rows: past the 64-row limit of a single sequence's
    pass). Sampled rows read these logits, so a seeded request's text cannot depend on the pass.
    The head is wide enough (3,000 x 256) that the library's kernels give a row other bits in
    passes of other sizes."""
    import pytest
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=3000, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.3)
    be = wrap(LlamaForCausalLM(cfg).eval()).backend
    if not be.model.batch_invariant:
        pytest.skip("no C compiler for the row kernels")
    ids = torch.randint(4, 3000, (100,), generator=torch.Generator().manual_seed(5))
    pos = 20
    be.reset()
    be.forward(ids[:pos], 0, logits=False)
    steps = torch.cat([be.forward(ids[pos + i: pos + i + 1], pos + i).logits for i in range(64)])
    for n in range(1, 65):
        be.truncate(pos)
        assert torch.equal(be.forward(ids[pos: pos + n], pos).logits, steps[:n]), n
    for m in (1, 2, 5, 16):
        seqs = [be.fork() for _ in range(m)]
        for s in seqs:
            s.forward(ids[:pos], 0, logits=False)
        outs = be.forward_batch(seqs, [ids[pos: pos + 5]] * m, [pos] * m)
        assert all(torch.equal(o.logits, steps[:5]) for o in outs), m
    # a token tree: rows 1.. hang off their parents; each row's logits are a one-token step's on its path
    parents = torch.tensor([-1, -1, 0, 1, 3])
    tokens = ids[60:66]
    be.truncate(pos)
    tree = be.forward(tokens, pos, tree=parents).logits
    for r in range(len(tokens)):
        path, a = [], r
        while a > 0:
            path.append(a)
            a = int(parents[a - 1]) + 1
        be.truncate(pos)
        for i, t in enumerate([0] + path[::-1]):
            step = be.forward(tokens[t: t + 1], pos + i).logits
        assert torch.equal(step[0], tree[r]), r


def test_exact_argmax_narrows_half_precision_heads_with_float32_products():
    """A bfloat16 or float16 head's flat rows (more candidates than ``RESCORE_F32``, all with
    logits near 0: rows spread in every direction but h's; every other row far below) are narrowed
    with float32 products of the exactly widened weights, to which the float32 error bound applies.
    Products in the weights' own type round h first, which moves each row's logit by its own share
    of h's rounding, far more than the rows' logits differ: the true maximum would be cut (3 of 4
    trials at bfloat16 when the gathered rows were multiplied so)."""
    import pytest

    from forerun.backends.greedy_head import ExactFloatArgmax

    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float16):
        for flat in (30, 2000):  # gathered rows; the whole head in slices
            wrong = 0
            for trial in range(4):
                h = torch.randn(64, generator=g) * 3
                w = -h / h.norm() + 0.01 * torch.randn(3000, 64, generator=g)  # logits about -24
                spread = torch.randn(flat, 64, generator=g) * 0.5
                w[:flat] = spread - (spread @ h)[:, None] * h / (h @ h)  # no component along h: logits near 0
                w = w.to(dtype)
                head = ExactFloatArgmax(w)
                if not head.available:
                    pytest.skip("no C compiler for the Q8_0 kernel")
                head.RESCORE_F32 = 8
                ref = int((w.double() @ h.double()).argmax())
                wrong += int(head.argmax(h[None])[0]) != ref
            assert wrong == 0, (dtype, flat, wrong)


def test_the_q8_certificate_bounds_llama_cpps_lane_sums_where_blocks_cancel():
    """``Q8Head.exact_logits``'s error bound holds for llama.cpp's Q8_0 dot as it sums: 8 float
    lanes per block (4 products each), a fused multiply-add of the two scales' product into each
    lane over the blocks, then the lanes' pairwise sum. On rows whose every block sums to zero with
    lanes that do not (+3L against -L three times), the exact logit is 0 and a bound from the
    blocks' totals would be 0 too; the lanes' rounding is not, and the bound must cover it."""
    import numpy as np
    import pytest

    from forerun.backends.greedy_head import Q8Head

    rng = np.random.default_rng(0)
    V, nb = 4, 24
    D = nb * 32
    codes = np.full((V, nb, 32), 127, np.int8)
    w_d = rng.uniform(0.001, 0.05, (V, nb)).astype(np.float16)
    raw = np.concatenate([w_d.view(np.uint8).reshape(V, nb, 2), codes.view(np.uint8)], -1).reshape(V, -1)
    head = Q8Head(raw, D)
    if not head.available:
        pytest.skip("no C compiler for the Q8_0 kernel")
    f32 = np.float32
    worst, nonzero = 0.0, 0
    for _ in range(300):
        lanes = np.zeros((nb, 8), np.int64)
        for b in range(nb):
            a = rng.integers(1, 40, 2)
            lanes[b] = rng.permutation([3 * a[0], -a[0], -a[0], -a[0], 3 * a[1], -a[1], -a[1], -a[1]])
        xq = np.repeat(lanes, 4, axis=1)  # [nb, 32]: each lane's 4 codes alike
        x_d = rng.uniform(0.001, 0.05, nb).astype(np.float16)
        q, d = torch.from_numpy(xq.astype(np.float32)), torch.from_numpy(x_d.astype(np.float32))
        logit, bound = head.exact_logits(q, d, torch.arange(V))
        for v in range(V):  # llama.cpp's sums, in float32
            acc = np.zeros(8, f32)
            for b in range(nb):
                scale = f32(f32(w_d[v, b]) * f32(x_d[b]))
                lane = (codes[v, b].astype(np.int64) * xq[b]).reshape(8, 4).sum(-1).astype(f32)
                acc = (acc.astype(np.float64) + np.float64(scale) * lane.astype(np.float64)).astype(f32)  # fma
            s4 = acc[4:] + acc[:4]
            s2 = s4[:2] + s4[2:]
            got = float(f32(s2[0] + s2[1]))
            err = abs(got - float(logit[v]))
            assert float(logit[v]) == 0.0 and err <= float(bound[v]), (err, float(bound[v]))
            worst, nonzero = max(worst, err / float(bound[v])), nonzero + (err > 0)
    assert nonzero > 0  # the lanes did round: a bound of 0 would not hold


def test_the_q8_certificate_never_certifies_an_exact_tie():
    """``Q8Head.argmax`` certifies a row only where its winner leads by more than both float32
    sums' error: on rows whose logits tie exactly (every vocabulary row a permutation of one row's
    blocks, against activations whose blocks are all alike) the float32 sums still differ in their
    last bits, and a certificate without that margin would pick one of the tied tokens as llama.cpp's."""
    import numpy as np
    import pytest

    from forerun.backends.greedy_head import Q8Head

    rng = np.random.default_rng(1)
    V, nb = 64, 16
    codes = rng.integers(-127, 128, (nb, 32)).astype(np.int8)
    scales = rng.uniform(0.001, 0.05, nb).astype(np.float16)
    rows = []
    for _ in range(V):
        order = rng.permutation(nb)
        rows.append(np.concatenate([scales[order].view(np.uint8).reshape(nb, 2), codes[order].view(np.uint8)], -1))
    head = Q8Head(np.stack(rows).reshape(V, -1), nb * 32)
    if not head.available:
        pytest.skip("no C compiler for the Q8_0 kernel")
    h = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).repeat(1, nb)  # every block alike
    top, _ = head.top2(h)
    assert bool((top[:, 0] > top[:, 1]).any())  # the float32 sums do differ: a margin is needed
    _, ok = head.argmax(h)
    assert not ok.any()


def test_exact_float_argmax_on_true_near_ties_of_a_q8_exact_head():
    """Rows of a head that Q8_0 holds exactly (so the weights' own rounding term is 0) against hidden
    states built so that two vocabulary rows tie to within 1e-4 while every other row is far below:
    quantizing h to 8 bits moves the two logits apart by far more than that, in either order, so
    only the bound's activation-rounding term keeps both as candidates. All 60 answers are the
    float64 argmax."""
    import pytest

    from forerun.backends.greedy_head import ExactFloatArgmax, quantize_q8_0

    g = torch.Generator().manual_seed(6)
    w = torch.randn(500, 64, generator=g)
    w[2:] *= 0.05  # rows 0 and 1 lead
    q, d = quantize_q8_0(w)
    w = (q * d[..., None]).reshape(w.shape)  # Q8_0-exact
    head = ExactFloatArgmax(w)
    if not head.available:
        pytest.skip("no C compiler for the Q8_0 kernel")
    diff = w[0] - w[1]
    hs = []
    for i in range(60):
        h = torch.randn(64, generator=g) * 2 + w[0] + w[1]
        h -= (h @ diff) / (diff @ diff) * diff  # rows 0 and 1 tie exactly
        h += (1e-4 if i % 2 else -1e-4) * diff / (diff @ diff)  # then one leads by 1e-4
        hs.append(h)
    h = torch.stack(hs)
    ref = (w.double() @ h.double().T).T.argmax(-1)
    assert set(ref.tolist()) == {0, 1}
    assert torch.equal(head.argmax(h), ref)
