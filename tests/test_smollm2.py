"""Integration tests on a second real model nobody tuned for: SmolLM2-135M-Instruct (Q4_1 GGUF,
Llama architecture, 49,152-token vocabulary, a chat template)."""

import json
from pathlib import Path

import pytest
import torch

from forerun.chat import chat_ids
from forerun.drafters import make_drafter
from forerun.engine import Engine

pytestmark = pytest.mark.bundled

# Answered correctly on the integer path (llama.cpp-like numerics); "the capital of France" is
# answered in rambling French there, as by llama.cpp itself, and correctly on the float32 path.
QUESTION = [{"role": "user", "content": "What is the capital of Germany?"}]
ANSWER = "Berlin"
PROMPTS = ["Write a Python function that returns the squares of a list of numbers.",
           "Summarize: The cat sat on the mat. The cat sat on the mat because the mat was warm.",
           "List three colors:"]


def _lossless(lm, drafter, prompts=PROMPTS, max_new_tokens=40, k=4) -> int:
    """Each prompt as a chat turn: speculative output equals plain decoding; the tokens accepted."""
    ref = Engine(lm.backend, None, lm.eos_token_ids)
    eng = Engine(lm.backend, drafter, lm.eos_token_ids)
    accepted = 0
    for p in prompts:
        ids = chat_ids(lm.tokenizer, [{"role": "user", "content": p}])
        res = eng.generate(ids, max_new_tokens=max_new_tokens, k=k)
        assert res.token_ids == ref.generate(ids, max_new_tokens=max_new_tokens).token_ids, p
        accepted += res.stats.accepted
    return accepted


def test_runs_on_the_native_backend_and_matches_transformers(smollm2):
    from forerun.backends.native import NativeBackend

    assert type(smollm2.backend).__name__ == "NativeBackend" and smollm2.backend.model.quant is not None
    be = NativeBackend(smollm2.hf_model)  # the float32 path: transformers' numbers
    assert be.vocab_size == 49152
    ids = smollm2.tokenizer("The quick brown fox jumps over the lazy dog. " * 3).input_ids
    with torch.inference_mode():
        ref = smollm2.hf_model(torch.tensor([ids])).logits[0].float()
    be.reset()
    ours = be.forward(torch.tensor(ids), 0).logits
    assert (ours - ref).abs().max() < 2e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_real_chat_template_answers(smollm2):
    ids = chat_ids(smollm2.tokenizer, QUESTION)
    text = smollm2.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nWhat is the capital of Germany?"
                                                                      "<|im_end|>\n<|im_start|>assistant\n")
    out = Engine(smollm2.backend, None, smollm2.eos_token_ids).generate(ids, max_new_tokens=16)
    assert ANSWER in smollm2.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == "stop"  # <|im_end|> ends the turn


def test_plain_decoding_equals_transformers_generate(smollm2):
    from forerun.backends.native import NativeBackend

    ids = chat_ids(smollm2.tokenizer, QUESTION)
    ours = Engine(NativeBackend(smollm2.hf_model), None, smollm2.eos_token_ids).generate(ids, max_new_tokens=24).token_ids
    with torch.inference_mode():
        theirs = smollm2.hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, top_p=None,
                                           top_k=None, eos_token_id=sorted(smollm2.eos_token_ids))
    assert ours == theirs[0, len(ids):].tolist()


@pytest.mark.parametrize("method", ["ngram", "suffix", "layerskip"])
def test_speculation_is_lossless_on_torch(smollm2, method):
    drafter = make_drafter(method, smollm2, skip_layers=list(range(10, 20)) if method == "layerskip" else None)
    assert _lossless(smollm2, drafter) > 0
    _lossless(smollm2, drafter, k="auto")


def test_speculation_is_lossless_on_llamacpp(smollm2_cpp):
    _lossless(smollm2_cpp, make_drafter("ngram", smollm2_cpp), k="auto")
    suffix = make_drafter("suffix", smollm2_cpp)
    _lossless(smollm2_cpp, suffix, k="auto")
    assert _lossless(smollm2_cpp, suffix, k=4) > 0  # the second pass drafts from the first one's outputs too


def test_suffix_trees_and_adaptation_are_lossless(smollm2):
    assert _lossless(smollm2, make_drafter("suffix", smollm2, tree=(8, None)), k=4) > 0
    eagle = make_drafter("eagle", smollm2, adapt={"every": 2, "guard_rounds": 4})
    _lossless(smollm2, eagle, k=4)
    assert eagle.adapter.updates > 0


def test_cli_generate_chats_by_default(capsys):
    from forerun.cli import main

    rc = main(["generate", "What is the capital of Germany?", "--backend", "torch", "--max-new-tokens", "16", "--json"])
    obj = json.loads(capsys.readouterr().out)
    assert rc == 0 and obj["chat"] is True and ANSWER in obj["text"]
    rc = main(["generate", "The capital of France is", "--no-chat", "--backend", "torch", "--max-new-tokens", "4", "--json"])
    obj = json.loads(capsys.readouterr().out)
    assert rc == 0 and obj["chat"] is False


def test_openai_client_chat_on_smollm2(smollm2):
    """The official client's chat.completions.create, plain and streaming, against the real template."""
    pytest.importorskip("openai")
    from serving import setup_for
    from test_server import Live

    from forerun.server.run import build_service

    srv = Live(build_service(setup_for(smollm2, "ngram"), max_batch=2, max_tokens=64))
    try:
        client = srv.client()
        ids = [m.id for m in client.models.list().data]
        assert ids == ["SmolLM2-135M-Instruct.Q4_1"]
        for name in (ids[0], "smollm2"):  # the listed id, or the name it was loaded by
            r = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=16, temperature=0)
            assert ANSWER in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(model=ids[0], messages=QUESTION, max_tokens=16, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    finally:
        srv.close()


def test_bench_auto_backend_per_method(tmp_path, capsys, monkeypatch):
    """--backend auto on a GGUF model: where the integer path runs, the backend measured faster on
    this machine; else (as here, where the test says it does not) none/ngram on llama.cpp and layerskip on torch in one
    bench, each compared with plain decoding on its own backend; the report says which backend ran
    each method."""
    pytest.importorskip("llama_cpp")
    import forerun.kept as kept
    import forerun.models as models
    from forerun.backend_timing import faster, kept_timing
    from forerun.build import method_backend

    monkeypatch.setattr(kept, "BUSY", float("inf"))  # one measurement for the whole test, however busy
    path = models.smollm2_gguf_path()
    if models.integer_ready(path):  # both run it: the faster here, measured once (and kept)
        chosen = models.timed_backend(path)
        t = kept_timing(path)
        assert t["torch"]["step_ms"] > 0 and t["llama.cpp"]["pass5_ms"] > 0 and faster(t) == chosen
        want = {"none": chosen, "ngram": chosen}  # one backend per file
    else:
        want = {"none": "llama.cpp", "ngram": "llama.cpp"}
    assert {m: method_backend(m, "smollm2") for m in want} == want
    assert method_backend("eagle", "smollm2") == "torch"
    monkeypatch.setattr(models, "integer_ready", lambda path: False)
    from conftest import spec_bench_prompts  # noqa: F401  (skips without the prompts)

    from forerun.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "coding", "turns": [PROMPTS[0]]}) + "\n")
    rc = main(["bench", "--model", "smollm2", "--prompts", str(prompts), "--methods", "none,ngram,layerskip",
               "--peers", "", "--max-new-tokens", "12", "--threads", "2", "--skip-layers", "10,11,12",
               "--out", str(tmp_path / "b")])
    assert rc == 0
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["config"]["backend_by_method"] == {"none": "llama.cpp", "ngram": "llama.cpp", "layerskip": "torch",
                                                  "none@torch": "torch"}
    assert res["config"]["chat_template"] is True
    m = res["methods"]
    assert list(m)[:2] == ["none", "none@torch"]  # the references run first on every prompt
    assert all(m[k]["greedy_equal"] == 1 for k in ("ngram", "layerskip", "none@torch"))
    assert m["layerskip"]["speedup_vs_none"] == pytest.approx(m["layerskip"]["tokens_per_s"] / m["none@torch"]["tokens_per_s"])
    table = (tmp_path / "b" / "results.md").read_text()
    assert "| layerskip | torch |" in table and "| ngram | llama.cpp |" in table


def test_wrong_head_is_refused_and_shipped_heads_found_by_fingerprint(smollm2, tmp_path):
    from forerun.drafters import shipped_head
    from forerun.drafters.heads import target_fingerprint
    from forerun.errors import ForerunError

    fp = target_fingerprint(smollm2.backend.embed, smollm2.backend.num_layers)
    gemma_head = shipped_head("eagle", {**fp, "vocab_size": 262144, "hidden_size": 640, "num_layers": 18,
                                        "embed_checksum": None, "embed_row_sums": None})
    assert gemma_head is not None and "gemma3" in gemma_head.name
    with pytest.raises(ForerunError, match="trained for another target"):
        make_drafter("eagle", smollm2, head_path=gemma_head)


@pytest.mark.parametrize("tree,lookup", [(None, False), ((4, 3), True)])
def test_shipped_eagle_head_is_lossless_on_torch(smollm2, tree, lookup):
    """--method eagle works out of the box on SmolLM2: the shipped head is found by fingerprint."""
    drafter = make_drafter("eagle", smollm2, tree=tree, tree_lookup=lookup)
    assert _lossless(smollm2, drafter, max_new_tokens=32, k=3) > 0


def test_shipped_eagle_head_is_lossless_on_llamacpp(smollm2_cpp):
    assert _lossless(smollm2_cpp, make_drafter("eagle", smollm2_cpp), PROMPTS[:2], max_new_tokens=32, k=3) > 0


def test_export_draft_writes_the_shipped_head_for_vllm(tmp_path, capsys):
    """`forerun export-draft` on SmolLM2 (Llama architecture): a speculators checkpoint holding the
    shipped head's weights, pointing at the folder vLLM loads; the SGLang layout is refused with
    the reason (the shipped head normalises its feature layers); Gemma 3 is refused."""
    from safetensors.torch import load_file

    from forerun.cli import main
    from forerun.drafters import load_trained_head
    from forerun.models import load_model
    from forerun.training.export import check_speculators_config

    rc = main(["export-draft", "--model", "smollm2", "--format", "speculators", "--k", "3", "--out",
               str(tmp_path / "spec")])
    info = json.loads(capsys.readouterr().out)
    assert rc == 0
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    check_speculators_config(config)
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == info["verifier"] and json.loads((Path(verifier) / "config.json").read_text())["model_type"] == "llama"
    assert config["eagle_aux_hidden_state_layer_ids"] == [3, 16, 30]  # outputs of layers 2, 15, 29
    head = load_trained_head("eagle", load_model("smollm2", backend="torch"))
    t = load_file(str(tmp_path / "spec" / "model.safetensors"))
    assert torch.equal(t["fc.weight"].float(), head.fuse.weight) and torch.equal(t["lm_head.weight"].float(),
                                                                                  head.lm_head.weight)
    assert torch.equal(t["d2t"] + torch.arange(len(t["d2t"])), head.draft_to_target)
    rc = main(["export-draft", "--model", "smollm2", "--format", "eagle3", "--out", str(tmp_path / "e3")])
    assert rc == 2 and "--shape eagle3" in capsys.readouterr().err and not (tmp_path / "e3").exists()
    rc = main(["export-draft", "--model", "bundled", "--format", "speculators", "--out", str(tmp_path / "g")])
    assert rc == 2 and "gemma3_text model" in capsys.readouterr().err
    from forerun.drafters import shipped_head
    from forerun.drafters.heads import target_fingerprint

    be = load_model("bundled", backend="torch").backend
    medusa = shipped_head("medusa", target_fingerprint(be.embed, be.num_layers))
    rc = main(["export-draft", "--draft", str(medusa), "--format", "speculators", "--out", str(tmp_path / "m")])
    assert rc == 2 and "holds a medusa head" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    rc = main(["export-draft", "--format", "speculators", "--out", str(tmp_path / "file")])
    assert rc == 2 and "is a file" in capsys.readouterr().err


def test_export_draft_for_llama_cpp_writes_a_gguf_llama_cpp_loads(smollm2, tmp_path, capsys):
    """`forerun export-draft --format llama.cpp` on SmolLM2: an EAGLE-3-shaped head (random weights:
    the file's form is under test) becomes a GGUF file by llama.cpp's own converter, which llama.cpp
    loads as an eagle3 model reading the layers' inputs the head was trained on; the shipped head
    (feature norms) is refused with the reason, a folder as --out too. Needs llama.cpp's tools
    (bench/llama_cpp_tools.sh)."""
    from forerun.bench_peers import llama_tools_dir
    from forerun.cli import main
    from forerun.drafters.heads import HeadConfig, build_head, eagle3_feature_layers, target_fingerprint

    rc = main(["export-draft", "--model", "smollm2", "--format", "llama.cpp", "--out", str(tmp_path / "s.gguf")])
    assert rc == 2 and "--shape eagle3" in capsys.readouterr().err and not (tmp_path / "s.gguf").exists()
    rc = main(["export-draft", "--model", "smollm2", "--format", "llama.cpp", "--out", str(tmp_path)])
    assert rc == 2 and "ending in .gguf" in capsys.readouterr().err
    if not (llama_tools_dir().parent / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp's tools are not built here (bench/llama_cpp_tools.sh)")
    gguf = pytest.importorskip("gguf")
    be = smollm2.backend
    layers = eagle3_feature_layers(be.num_layers)
    cfg = HeadConfig(kind="eagle", hidden_size=be.model.hidden_size, vocab_size=be.vocab_size, draft_vocab=512,
                     feature_layers=layers, target=target_fingerprint(be.embed, be.num_layers),
                     n_heads=9, head_dim=64, feature_norms=False)
    torch.manual_seed(0)
    head = build_head(cfg, torch.arange(512) * 7)
    head.save(tmp_path / "head")
    out = tmp_path / "draft.gguf"
    rc = main(["export-draft", "--model", "smollm2", "--draft", str(tmp_path / "head"), "--format", "llama.cpp",
               "--out", str(out)])
    assert rc == 0 and out.is_file(), capsys.readouterr().err
    r = gguf.GGUFReader(str(out))
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "eagle3"
    ids = r.fields["eagle3.target_layers"]
    assert [int(ids.parts[i][0]) for i in ids.data] == [i + 1 for i in layers] == [2, 15, 27]
    from forerun.backends.llamacpp_lib import load_llama_cpp

    L = load_llama_cpp()
    params = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(out).encode(), params)
    assert model, "llama.cpp could not load the exported draft"
    assert L.llama_model_n_embd(model) == be.model.hidden_size
    L.llama_model_free(model)

def test_seeded_sampling_gives_plain_decodings_text_for_every_method(smollm2):
    """Sampled with a seed, every method (a head chain and tree, suffix, n-gram, layer skip)
    gives the text plain decoding gives with that seed."""
    from forerun.sampling import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    ids = chat_ids(smollm2.tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    ref = Engine(smollm2.backend, None, smollm2.eos_token_ids).generate(ids, max_new_tokens=32, params=params)
    for method, tree in (("ngram", None), ("suffix", (8, None)), ("layerskip", None), ("eagle", None), ("eagle", (8, 4))):
        drafter = make_drafter(method, smollm2, tree=tree, skip_layers=[10, 20] if method == "layerskip" else None)
        res = Engine(smollm2.backend, drafter, smollm2.eos_token_ids).generate(ids, max_new_tokens=32, params=params, k="auto")
        assert res.token_ids == ref.token_ids, (method, tree)


def test_bench_takes_llama_bench_decode_runs_between_the_prompts(tmp_path):
    """`--peers llama-bench`: pp512/tg128 once before, then one tg128 run between each prompt's
    methods, in a rotating place; the report compares decode rates with those runs' rate (total
    tokens over total time). A stand-in llama-bench logs its calls and answers from a list."""
    from conftest import _need_smollm2

    from forerun.cli import main

    _need_smollm2()
    log, tools = tmp_path / "calls.txt", tmp_path / "tools"
    tools.mkdir()
    fake = tools / "llama-bench"
    fake.write_text(f"""#!/usr/bin/env python3
import json, sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
n = sum(1 for _ in open({str(log)!r}))
rows = []
if args[args.index("-p") + 1] != "0":
    rows.append({{"n_prompt": 512, "n_gen": 0, "avg_ts": 1000.0, "stddev_ts": 1.0, "build_commit": "x", "cpu_info": "y"}})
rows.append({{"n_prompt": 0, "n_gen": 128, "avg_ts": [50.0, 100.0, 200.0, 400.0][(n - 1) % 4], "stddev_ts": 0.0,
             "build_commit": "x", "cpu_info": "y"}})
if n == 5:  # a run that fails: the bench goes on without it
    sys.exit("llama-bench: out of luck")
print(json.dumps(rows))
""")
    fake.chmod(0o755)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [PROMPTS[i % 3]]}) + "\n"
                               for i, c in enumerate(["coding", "math", "qa", "rag"])))
    rc = main(["bench", "--model", "smollm2", "--backend", "torch", "--prompts", str(prompts), "--methods", "none,ngram",
               "--peers", "llama-bench", "--llama-tools", str(tools), "--max-new-tokens", "6", "--threads", "2",
               "--out", str(tmp_path / "b")])
    assert rc == 0
    calls = log.read_text().splitlines()
    assert len(calls) == 5 and "-p 512 -n 128 -r 3" in calls[0]
    assert all("-p 0 -n 128 -r 1" in c for c in calls[1:])
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    tg = res["llama_bench"]["tg128"]
    assert tg["runs"] == 3 and tg["failed_runs"] == 1 and tg["before"]["tokens_per_s"] == 50.0
    assert tg["tokens_per_s"] == pytest.approx(3 / (1 / 100 + 1 / 200 + 1 / 400))  # total tokens over total time
    none = res["methods"]["none"]["decode_tokens_per_s"]
    assert f"none {none / tg['tokens_per_s']:.2f}x" in (tmp_path / "b" / "results.md").read_text()
    # the methods' own order per prompt is kept apart from where llama-bench ran
    orders = sorted((r["id"], r["order"]) for r in res["records"])
    assert orders == [(i, o) for i in range(4) for o in range(2)]


def test_drafters_are_lossless_in_a_batch_of_16(smollm2):
    """The batch engine with 16 requests at once, greedy and seeded alike, on 8 chat turns: n-gram,
    suffix-tree and eagle-tree texts are plain decoding's, k chosen up to 16 or up to 4."""
    from conftest import batch_of_16_equals_plain
    from test_bundled import BATCH_PROMPTS

    prompts = [chat_ids(smollm2.tokenizer, [{"role": "user", "content": t}]) for t in BATCH_PROMPTS]
    batch_of_16_equals_plain(smollm2, [(m, make_drafter(m, smollm2, tree=tree, skip_layers=[10, 20] if m == "layerskip"
                                                        else None), k_max) for m, tree, k_max in (
        ("ngram", None, None), ("suffix", (8, None), 4), ("eagle", (8, 4), None))],
        prompts, new=12)
