import torch

from conftest import tiny_gemma, wrap


def test_native_matches_transformers_logits():
    model = tiny_gemma(0)
    lm = wrap(model)
    assert type(lm.backend).__name__ == "NativeGemma3"
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


def test_hf_backend_rollback(llama):
    be = llama.backend
    ids = torch.randint(4, 96, (16,), generator=torch.Generator().manual_seed(2))
    be.reset()
    full = be.forward(ids, 0).logits
    be.reset()
    be.forward(ids[:10], 0)
    be.forward(torch.tensor([9, 9, 9]), 10)
    be.truncate(10)
    assert be.length == 10
    assert torch.allclose(be.forward(ids[10:], 10).logits, full[10:], atol=1e-4)


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
