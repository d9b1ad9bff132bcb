"""Fixed-shape passes (``backends/fixed_rows.py``), the GPU's lossless path, run here on the CPU with
the same torch operations: every row of a chain, a token tree or a batched pass is bit for bit the
one-token step at its position, in float32, bfloat16 and float16, across the chunk boundary (16
rows) and the key-span boundary (256 positions); the function itself is the model's."""

import pytest
import torch

from conftest import TEST_DEVICE, run_batch, word_tokenizer
from forerun.backends.fixed_rows import ROW_BUCKET, key_span
from forerun.backends.native import NativeBackend
from test_architectures import ARCHS, _build

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fixed(arch: str, dtype=torch.float32, **cfg):
    model = _build(arch, **cfg).to(TEST_DEVICE, dtype)
    return model, NativeBackend(model, fixed_rows=True, pack_linear=False)


def test_key_spans_are_powers_of_two_of_the_position_alone():
    assert [key_span(p, 8192) for p in (0, 255, 256, 511, 512, 5000)] == [256, 256, 512, 512, 1024, 8192]
    assert key_span(300, 400) == 400


@pytest.mark.parametrize("arch", ARCHS)
def test_fixed_passes_compute_the_model(arch):
    model, be = fixed(arch)
    ids = torch.randint(4, 96, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None].to(model.device)).logits[0].float()
    be.reset()
    be.forward(ids[:20], 0, logits=False)  # 20 rows: two chunks
    out = torch.cat([be.forward(ids[20:33], 20).logits, be.forward(ids[33:40], 33).logits])
    assert torch.allclose(out, ref[20:], atol=2e-4), (out - ref[20:]).abs().max()


def _steps(be, ids, start, end):
    be.truncate(start)
    return torch.cat([be.forward(ids[i: i + 1], i).logits for i in range(start, end)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3", "qwen2"])
def test_every_row_of_every_pass_is_its_one_token_step(arch, dtype):
    _, be = fixed(arch, dtype, max_position_embeddings=512)
    ids = torch.randint(4, 96, (300,), generator=torch.Generator().manual_seed(1))
    be.reset()
    be.forward(ids[:40], 0, logits=False)
    be.forward(ids[40:240], 40, logits=False)  # a prompt pass (library kernels), shared by every method
    steps = _steps(be, ids, 240, 290)  # crosses 256: rows with key spans of 256 and 512
    for n in (1, 2, 5, ROW_BUCKET, ROW_BUCKET + 1, 33):
        for start in (240, 250):
            be.truncate(240)
            if start > 240:
                be.forward(ids[240:start], 240, logits=False)
            chain = be.forward(ids[start: start + n], start).logits
            assert torch.equal(chain, steps[start - 240: start - 240 + n]), (n, start)
    # a tree: root, two children, a grandchild under each; each row is its path's steps
    root, a, b, c = (int(t) for t in ids[240:244])
    parents = torch.tensor([-1, -1, 0, 1])  # rows 1, 2 under the root; 3 under 1; 4 under 2
    tree = torch.tensor([root, a, 50, b, 60])
    be.truncate(240)
    out = be.forward(tree, 240, tree=parents).logits
    assert torch.equal(out[[0, 1, 3]], steps[:3])
    be.truncate(240)
    other = torch.cat([be.forward(torch.tensor([t]), 240 + i).logits for i, t in enumerate([root, 50, 60])])
    assert torch.equal(out[[0, 2, 4]], other)
    # two sequences in one batched pass: each row as its own sequence's steps give it
    s1, s2 = be.fork(), be.fork()
    s1.forward(ids[:40], 0, logits=False)  # the prompt as ``be`` read it (prompt passes are the library's)
    s1.forward(ids[40:240], 40, logits=False)
    s2.forward(ids[:100], 0, logits=False)
    both = be.forward_batch([s1, s2], [ids[240:245], ids[100:101]], [240, 100])
    assert torch.equal(both[0].logits, steps[:5])
    assert torch.equal(both[1].logits, _steps(s2, ids, 100, 101))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_batched_pass_is_each_sequence_alone_across_shared_chunks(dtype):
    """Three sequences in one batched pass (20 rows: the second's tree spans both chunks, which mix
    sequences): every row bit for bit what that sequence's pass alone gives."""
    _, be = fixed("gemma3", dtype)
    ids = torch.randint(4, 96, (120,), generator=torch.Generator().manual_seed(4))
    parents = torch.tensor([-1, 0, 0, 1])  # root, a chain of two under it, a second child
    feeds = [ids[60:72], ids[30:35], ids[90:93]]
    starts, trees = [60, 30, 90], [None, parents, None]
    alone = []
    for feed, pos, tree in zip(feeds, starts, trees):
        s = be.fork()
        s.forward(ids[:pos], 0, logits=False)
        alone.append(s.forward(feed, pos, **({} if tree is None else {"tree": tree})).logits)
    seqs = []
    for pos in starts:
        s = be.fork()
        s.forward(ids[:pos], 0, logits=False)
        seqs.append(s)
    both = be.forward_batch(seqs, feeds, starts, trees=trees)
    for i, (out, want) in enumerate(zip(both, alone)):
        assert torch.equal(out.logits, want), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_greedy_speculation_equals_plain_decoding_in_half_precision(dtype):
    from forerun.batching import BatchEngine, BatchRequest
    from forerun.drafters import make_drafter
    from forerun.engine import Engine
    from forerun.models import wrap_model

    model, be = fixed("llama", dtype)
    lm = wrap_model("tiny-fixed", model, word_tokenizer(model.config.vocab_size), backend="native")
    lm.backend = be
    prompts = [[2] + [int(t) for t in torch.randint(4, 96, (12,), generator=torch.Generator().manual_seed(s))] * 2
               for s in range(3)]
    plain = [Engine(be, None, {1}).generate(p, max_new_tokens=24).token_ids for p in prompts]
    twin = wrap_model("tiny-fixed-draft", model, word_tokenizer(model.config.vocab_size), backend="native")
    twin.backend = NativeBackend(model, pack_linear=False)  # the library path: drafts need not be exact
    for method in ("ngram", "suffix", "draft"):  # draft: the target's own weights, so most drafts are taken
        eng = Engine(be, make_drafter(method, lm, draft_model=twin if method == "draft" else None), {1})
        outs = [eng.generate(p, max_new_tokens=24, k=4) for p in prompts]
        assert [o.token_ids for o in outs] == plain, method
        if method == "draft":
            assert sum(o.stats.accepted for o in outs) > 40  # equality earned over multi-row verify passes
    batch = BatchEngine(be, {1}, drafter=make_drafter("ngram", lm), max_batch=3)
    got = run_batch(batch, [BatchRequest(prompt=list(p), max_new_tokens=24) for p in prompts])
    assert got == plain


def test_the_gpu_check_script_runs_and_finds_equality(tmp_path):
    """``bench/gpu_check.py`` (what ``bench/gpu_check.sh`` runs on a GPU), small enough for the CPU,
    on the fixed-shape path: its table, and every method and the batch of 16 equal to plain decoding."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench/gpu_check.py"), "--quick", "--fixed-rows", "--no-hf",
                        "--device", "cpu", "--dtypes", "bfloat16", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert rows[0]["fixed_rows"] and rows[0]["batch16_equal"] == "16/16" and rows[0]["equal"]["ngram"] == "6/6"
    assert "| tiny | bfloat16 |" in (tmp_path / "gpu_check.md").read_text()
