"""Prompt prefixes shared between requests: chunk keys, eviction, and exact reuse."""

from __future__ import annotations

import pytest
import torch
from conftest import always_draft, run_batch

import forerun.prefix_cache as pc
from forerun.batching import BatchEngine, BatchRequest
from forerun.drafters.ngram import NgramDrafter
from forerun.engine import Engine
from forerun.prefix_cache import PrefixCache, chunk_bounds, chunk_keys, prefill


@pytest.fixture
def chunk16(monkeypatch):
    monkeypatch.setattr(pc, "CHUNK", 16)  # the tiny model holds 256 positions: several chunks per prompt


def test_chunk_keys_name_the_whole_prefix_and_the_chunk_length(chunk16):
    a = list(range(4, 44))  # 40 positions: chunks of 16, 16, 8
    assert chunk_bounds(40) == [(0, 16), (16, 32), (32, 40)]
    ka = chunk_keys(a)
    assert len(ka) == 3 and len(set(ka)) == 3
    longer = chunk_keys(a + [50, 51])  # same first two chunks; the third is longer: another key
    assert longer[:2] == ka[:2] and longer[2] != ka[2]
    changed = chunk_keys([5] + a[1:])  # a change in the first chunk changes every key after it
    assert all(x != y for x, y in zip(changed, ka))
    assert chunk_keys(a[:32])[:2] == ka[:2]


def test_least_recently_used_chunks_leave_first():
    seg = lambda: (torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))  # 64 bytes each  # noqa: E731
    c = PrefixCache(max_bytes=3 * 64)
    for key in (b"a", b"b", b"c"):
        c.put(key, seg())
    assert c.get(b"a") is not None  # a is now the most recent
    c.put(b"d", seg())
    assert c.get(b"b") is None and c.get(b"a") is not None and c.get(b"d") is not None
    assert c.bytes == 3 * 64 and len(c.entries) == 3
    c.put(b"huge", (torch.zeros(1000), torch.zeros(1000)))  # larger than the whole budget: not kept
    assert c.get(b"huge") is None and c.bytes == 3 * 64
    assert c.hits == 3 and c.hit_positions == 12
    with pytest.raises(ValueError):
        PrefixCache(-1)


def test_prefill_from_the_cache_equals_prefill_computed(gemma, chunk16):
    """A prompt whose first chunks an earlier prompt computed: its cache holds the same bits as a
    prefill computed from scratch (and so does an exact repeat)."""
    be = gemma.backend
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(4, 96, (40,), generator=g).tolist()
    first = shared + torch.randint(4, 96, (30,), generator=g).tolist()
    second = shared + torch.randint(4, 96, (57,), generator=g).tolist()
    cache = PrefixCache(64 << 20)
    a = be.fork()
    prefill(a, first, cache=cache)
    assert cache.hits == 0 and len(cache.entries) == 5
    for prompt, hits in ((second, 2), (first, 5)):  # two shared chunks (32 positions); then every chunk
        before = cache.hits
        b, ref = be.fork(), be.fork()
        prefill(b, prompt, cache=cache)
        prefill(ref, prompt)
        assert cache.hits - before == hits
        n = len(prompt)
        assert b.length == ref.length == n
        assert torch.equal(b.cache.k[:, :, :n], ref.cache.k[:, :, :n])
        assert torch.equal(b.cache.v[:, :, :n], ref.cache.v[:, :, :n])


def test_served_with_the_cache_equals_plain_decoding(gemma, chunk16):
    """Long prompts sharing prefixes, served twice in a batch with the cache: every output equals
    plain decoding of its prompt alone, and the second round takes its prompts from the cache."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(4, 96, (35,), generator=g).tolist()
    prompts = [[2] + system + torch.randint(4, 96, (8 + 9 * i,), generator=g).tolist() for i in range(4)]
    plain = [Engine(gemma.backend, None, gemma.eos_token_ids).generate(p, max_new_tokens=12).token_ids for p in prompts]
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, drafter=NgramDrafter(), max_batch=3,
                      prefix_cache_bytes=64 << 20)
    first = run_batch(eng, [BatchRequest(prompt=p, max_new_tokens=12) for p in prompts])
    hits = eng.prefix_cache.hits
    assert hits >= 2 * 3  # the shared system prompt's two full chunks, for the 2nd..4th prompt
    again = run_batch(eng, [BatchRequest(prompt=p, max_new_tokens=12) for p in prompts])
    assert first == again == plain
    assert eng.prefix_cache.hits - hits == sum(len(chunk_bounds(len(p) - 1)) for p in prompts)


def test_a_batched_pass_past_the_invariant_rows_is_still_row_by_row(gemma):
    """Sixteen sequences of five rows (80 rows, more than one pass computes row by row on its own):
    every sequence's layer outputs equal, bit for bit, its pass alone."""
    from forerun.backends.linear import INVARIANT_ROWS

    be = gemma.backend
    if not be.model.batch_invariant:
        pytest.skip("the backend is not batch-invariant here (no C compiler)")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 96, (10 + i,), generator=g) for i in range(16)]
    feeds = [torch.randint(4, 96, (5,), generator=g) for _ in range(16)]
    assert sum(f.numel() for f in feeds) > INVARIANT_ROWS
    seqs = []
    for p in prompts:
        s = be.fork()
        s.forward(p, 0)
        seqs.append(s)
    layers = list(range(be.num_layers))
    out = be.forward_batch(seqs, feeds, [len(p) for p in prompts], layers=layers)
    for o, p, f in zip(out, prompts, feeds):
        alone = be.fork()
        alone.forward(p, 0)
        assert torch.equal(o.layers, alone.forward(f, len(p), layers=layers).layers)


def test_a_draft_model_reads_a_chats_next_turn_from_its_own_cache(gemma, gemma_draft, chunk16, monkeypatch):
    """Served with a draft model and the cache, a chat's next turn (the first turn's prompt and
    answer, then more) has its draft model compute only what is new: the whole chunks it read of
    the first turn, answer included, come from its own cache, bit for bit what reading them
    computes, and every output still equals plain decoding."""
    from forerun.drafters.draft_model import DraftModelDrafter

    g = torch.Generator().manual_seed(7)
    turn1 = [2] + torch.randint(4, 96, (50,), generator=g).tolist()
    plain1 = Engine(gemma.backend, None, gemma.eos_token_ids).generate(turn1, max_new_tokens=30).token_ids
    turn2 = turn1 + plain1 + torch.randint(4, 96, (9,), generator=g).tolist()
    plain2 = Engine(gemma.backend, None, gemma.eos_token_ids).generate(turn2, max_new_tokens=10).token_ids
    eng = BatchEngine(gemma.backend, gemma.eos_token_ids, max_batch=2, drafter=DraftModelDrafter(gemma_draft.backend.fork()),
                      prefix_cache_bytes=64 << 20)
    always_draft(eng.policy, monkeypatch)  # so the draft model reads every prompt, on any machine
    cache = eng.drafter.prefix_cache
    assert cache is not None and cache is not eng.prefix_cache
    assert run_batch(eng, [BatchRequest(prompt=turn1, max_new_tokens=30)]) == [plain1]
    assert cache.hits == 0
    held = cache.cached_positions(turn2[:-1])
    assert held >= 64  # past turn 1's prompt (50 positions): the answer's chunks were kept when it finished
    # the target's own cache keeps prompt chunks only on this float path (a pass of many rows is not
    # computed row by row: its chunks' bits could differ from those steps left)
    assert not gemma.backend.capabilities.kv_any_pass and eng.prefix_cache.cached_positions(turn2[:-1]) == 48
    with torch.inference_mode():  # what the next turn's draft model computes, as the engine runs it
        fresh = eng.drafter.fork()
        fresh.begin(turn2, None, None)
        assert fresh.unread(turn2) == len(turn2) - 1 - held
    for slot in eng._free:  # as on another slot: the one that served turn 1 keeps it all (``_kept``)
        slot.drafter.forget_history()
    reqs = [BatchRequest(prompt=turn2, max_new_tokens=10)]
    assert run_batch(eng, reqs) == [plain2]
    assert reqs[0].stats.drafted > 0
    assert cache.hit_positions == held
    with torch.inference_mode():  # its cache read through the cache: what reading in chunks computes
        via, ref = eng.drafter.fork(), gemma_draft.backend.fork()
        via.begin(turn2, None, None)
        via.catch_up(turn2)
        prefill(ref, turn2[:-1])
    n = len(turn2) - 1
    assert via.backend.length == ref.length == n
    assert torch.equal(via.backend.cache.k[:, :, :n], ref.cache.k[:, :, :n])
    assert torch.equal(via.backend.cache.v[:, :, :n], ref.cache.v[:, :, :n])


@pytest.mark.bundled
@pytest.mark.parametrize("name", ["smollm2", "bundled"])
def test_a_chats_next_turn_takes_its_answer_from_the_targets_cache_on_the_integer_path(name, request):
    """Where any pass gives a position's keys and values the same bits (``kv_any_pass``: the
    integer path), a finished request's whole chunks are kept, its answer's included: they hold
    what a prompt pass computes, bit for bit, a chat's next turn takes them, and its output equals
    plain decoding (SmolLM2; the bundled Gemma 3, whose sliding-window layers read fewer keys)."""
    from forerun.chat import chat_ids

    smollm2 = request.getfixturevalue(name)
    be = smollm2.backend
    if not be.capabilities.kv_any_pass:
        pytest.skip("not the integer path here (no C compiler)")
    tok = smollm2.tokenizer
    turn1 = chat_ids(tok, [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}])
    plain = Engine(be, None, smollm2.eos_token_ids)
    answer = plain.generate(turn1, max_new_tokens=240).token_ids
    seq = turn1 + answer
    assert len(seq) - 1 >= 256 > len(turn1)  # two whole chunks, the second one all answer
    eng = BatchEngine(be, smollm2.eos_token_ids, max_batch=2, drafter=NgramDrafter(), prefix_cache_bytes=256 << 20)
    assert run_batch(eng, [BatchRequest(prompt=turn1, max_new_tokens=240)]) == [answer]
    cache = eng.prefix_cache
    held = cache.cached_positions(seq[:-1])
    assert held == (len(seq) - 1) // 128 * 128
    with torch.inference_mode():
        ref = be.fork()
        prefill(ref, seq[:-1])
        for (s, e), key in zip(chunk_bounds(held), chunk_keys(seq[:held])):
            kept = cache.entries[key].kv
            computed = ref.kv_segment(s, e)
            assert torch.equal(kept[0], computed[0]) and torch.equal(kept[1], computed[1]), (s, e)
    turn2 = seq + chat_ids(tok, [{"role": "user", "content": "Now make it shorter."}])[1:]
    before = cache.hit_positions
    assert run_batch(eng, [BatchRequest(prompt=turn2, max_new_tokens=24)]) == [
        plain.generate(turn2, max_new_tokens=24).token_ids]
    assert cache.hit_positions - before >= held
