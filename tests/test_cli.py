"""The command line: every bad input is one clear line and a non-zero exit, never a traceback."""

import json

import pytest
from conftest import tiny_gemma, word_tokenizer

from forerun.cli import main


def run(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse rejects some values itself
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean_error(rc, err, *needles):
    assert rc != 0
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines, "no error message"
    msg = lines[-1].lower()
    for n in needles:
        assert n.lower() in msg, msg


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", ""], "empty prompt"),
        (["generate", "   "], "empty prompt"),
        (["generate", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "0"], "top-p"),
        (["generate", "hi", "--top-p", "1.5"], "top-p"),
        (["generate", "hi", "--top-k", "-2"], "top-k"),
        (["generate", "hi", "--k", "0"], "--k"),
        (["generate", "hi", "--k", "33"], "--k"),
        (["generate", "hi", "--k", "many"], "--k"),
        (["generate", "hi", "--method", "magic"], "unknown method"),
        (["generate", "hi", "--method", "draft"], "draft model"),
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "not found"),
        (["generate", "hi", "--model", "./no/such/folder"], "not found"),
        (["generate", "hi", "--dtype", "int3", "--model", "./no/such/folder"], "int3"),
        (["generate", "hi", "--method", "ngram", "--adapt"], "--adapt trains eagle and medusa"),
        (["generate", "hi", "--method", "eagle", "--adapt-save", "out"], "give --adapt too"),
        (["bench", "--prompts", "none.jsonl", "--methods", "ngram:auto+adapt"], "+adapt trains eagle and medusa"),
        (["bench", "--prompts", "none.jsonl", "--methods", "ngram-tree"], "unknown method"),
        (["bench", "--prompts", "none.jsonl", "--methods", "ngram+suffix"], "draft+suffix"),
        (["generate", "hi", "--method", "draft", "--draft", "x", "--draft-window", "-1"], "--draft-window"),
        (["generate", "hi", "--method", "draft", "--draft", "x", "--draft-p-min", "1.5"], "--draft-p-min"),
        (["generate", "hi", "--regex", "(ab"], "regex cannot be compiled"),
        (["generate", "hi", "--json-schema", "/no/such/schema.json"], "--json-schema"),
        (["generate", "hi", "--grammar", "/no/such/grammar.lark"], "--grammar"),
        (["loadtest", "--url", "http://127.0.0.1:9", "--extra-body", "/no/such/body.json"], "--extra-body"),
    ],
)
def test_bad_inputs_before_loading(capsys, argv, needle):
    rc, out, err = run(capsys, *argv)
    assert_clean_error(rc, err, needle)


def test_corrupt_gguf(capsys, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model at all")
    rc, _, err = run(capsys, "generate", "hi", "--model", str(junk))
    assert_clean_error(rc, err, "not a gguf file")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7)
    rc, _, err = run(capsys, "generate", "hi", "--model", str(truncated))
    assert_clean_error(rc, err, "gguf")
    unreadable = tmp_path / "folder.gguf"
    unreadable.mkdir()
    rc, _, err = run(capsys, "generate", "hi", "--model", str(unreadable))
    assert_clean_error(rc, err, "not a file")


def test_generate_suffix(capsys, tiny_folder):
    rc, out, err = run(capsys, "generate", "w5 w6 w7 w5 w6", "--model", str(tiny_folder), "--method", "suffix",
                       "--k", "auto", "--max-new-tokens", "12", "--json")
    assert rc == 0, err
    assert json.loads(out)["method"] == "suffix"


def test_generate_json(capsys, tiny_folder):
    rc, out, err = run(capsys, "generate", "w5 w6 w7 w5 w6", "--model", str(tiny_folder), "--method", "ngram",
                       "--max-new-tokens", "12", "--json")
    assert rc == 0, err
    obj = json.loads(out)
    for key in ("text", "token_ids", "new_tokens", "wall_s", "tokens_per_s", "target_passes", "drafted",
                "accepted", "acceptance_rate", "alpha", "rejections", "mean_accepted_len", "acceptance_per_position",
                "draft_s", "verify_s"):
        assert key in obj, key
    assert obj["new_tokens"] == len(obj["token_ids"]) <= 12


def test_generate_sampling_seeded(capsys, tiny_folder):
    args = ["generate", "w5 w6 w7", "--model", str(tiny_folder), "--temperature", "0.9", "--top-p", "0.9",
            "--seed", "3", "--max-new-tokens", "10", "--json"]
    a = json.loads(run(capsys, *args)[1])["token_ids"]
    b = json.loads(run(capsys, *args)[1])["token_ids"]
    assert a == b


def test_prompt_longer_than_context(capsys, tiny_folder):
    prompt = " ".join(["w5"] * 300)  # the tiny model's context is 256
    rc, _, err = run(capsys, "generate", prompt, "--model", str(tiny_folder))
    assert_clean_error(rc, err, "context limit")


def test_draft_vocab_mismatch(capsys, tiny_folder, tmp_path):
    other = tmp_path / "other"
    tiny_gemma(1, vocab=80, layers=2).save_pretrained(other)
    word_tokenizer(80).save_pretrained(other)
    rc, _, err = run(capsys, "generate", "w5", "--model", str(tiny_folder), "--method", "draft", "--draft", str(other))
    assert_clean_error(rc, err, "vocabulary")


def test_bench_writes_results(capsys, tiny_folder, tmp_path):
    prompts = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [t]} for i, (c, t) in enumerate(
        [("a", "w5 w6 w7 w5 w6"), ("a", "w9 w10"), ("b", "w11 w12 w11 w12")])]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    rc, stdout, err = run(capsys, "bench", "--prompts", str(prompts), "--model", str(tiny_folder), "--methods",
                          "none,ngram,layerskip:2", "--peers", "hf,hf-lookup", "--max-new-tokens", "8",
                          "--skip-layers", "1", "--out", str(out))
    assert rc == 0, err
    res = json.loads((out / "results.json").read_text())
    assert {"machine", "config", "methods"} <= set(res)
    for name in ("none", "ngram", "layerskip:2", "hf", "hf-lookup"):
        m = res["methods"][name]
        for key in ("tokens_per_s", "greedy_equal", "prompts", "speedup_vs_none", "speedup_vs_hf", "by_category"):
            assert key in m, (name, key)
        assert m["prompts"] == 3
        assert set(m["by_category"]) == {"a", "b"}
    assert res["methods"]["ngram"]["greedy_equal"] == 3
    assert res["methods"]["layerskip:2"]["greedy_equal"] == 3
    # methods and peers rotate: each prompt starts one further along the list (none first, then ngram, ...)
    first = [next(r["method"] for r in res["records"] if r["id"] == i and r["order"] == 0) for i in range(3)]
    assert first == ["none", "ngram", "layerskip:2"]
    for name in ("ngram", "layerskip:2"):  # alpha from the tested drafts: never below accepted / drafted
        m = res["methods"][name]
        rej = sum(r["rejections"] for r in res["records"] if r["method"] == name)
        assert m["rejections"] == rej <= m["target_passes"]
        if m["accepted"] + rej:
            assert m["alpha"] == m["accepted"] / (m["accepted"] + rej) >= m["acceptance_rate"]
    assert (out / "results.md").exists()
    # the draft lengths the methods ran with, not the --k default they did not use
    assert "k per method: ngram 4, layerskip:2 2" in (out / "results.md").read_text()
    from forerun.bench_report import k_text

    assert k_text({"k": 4, "peers": ["llama.cpp"], "method_k": {"none": 4, "ngram:auto": "auto"}}) == "k=auto"
    # charts beside the report, linked from it: real PNG files
    for chart in ("tokens_per_s", "acceptance_by_position", "verify_cost"):
        png = out / f"{chart}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, chart
        assert f"({chart}.png)" in (out / "results.md").read_text()


def test_bench_bad_inputs(capsys, tmp_path):
    rc, _, err = run(capsys, "bench", "--prompts", str(tmp_path / "missing.jsonl"))
    assert_clean_error(rc, err, "not found")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    rc, _, err = run(capsys, "bench", "--prompts", str(bad))
    assert_clean_error(rc, err, "bad.jsonl:1")
    rc, _, err = run(capsys, "bench", "--prompts", str(bad), "--methods", "none,bogus")
    assert_clean_error(rc, err, "unknown method")
    for methods in ("none,eagle+lookup", "none,ngram-tree", "none,ngram-tree+lookup", "none,ngram-tree+auto",
                    "none,eagle+auto"):
        rc, _, err = run(capsys, "bench", "--prompts", str(bad), "--methods", methods)
        assert_clean_error(rc, err, "unknown method")



def test_llama_cpp_peers_say_what_they_need(capsys, tiny_folder, tmp_path):
    """The llama.cpp tool peers: llama-bench runs on a .gguf file only, and without the built tools
    the error names the script that builds them; the report sets llama-bench's rates beside ours."""
    from forerun.bench_peers import find_tool
    from forerun.bench_report import llama_bench_text
    from forerun.errors import ForerunError

    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "a", "turns": ["w5 w9"]}) + "\n")
    rc, _, err = run(capsys, "bench", "--prompts", str(q), "--model", str(tiny_folder), "--peers", "llama-bench")
    assert_clean_error(rc, err, "needs a .gguf model")
    with pytest.raises(ForerunError, match="bench/llama_cpp_tools.sh"):
        find_tool("llama-bench", str(tmp_path))
    text = llama_bench_text({"command": "llama-bench -m f.gguf", "build": "abc", "pp512": {"tokens_per_s": 500.0},
                             "tg128": {"tokens_per_s": 100.0}, "forerun_pp512": 1000.0},
                            {"none": {"decode_tokens_per_s": 150.0}, "ngram:auto": {"decode_tokens_per_s": 250.0}})
    assert "pp512 500.0 tok/s (ours, one 512-token pass: 1000.0, 2.00x)" in text
    assert "none 1.50x, ngram:auto 2.50x" in text

def test_train_draft_end_to_end(capsys, tiny_folder, tmp_path):
    """train-draft on a corpus, then generate with the head it wrote (greedy equals plain)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(f"w{4 + (i * 7 + j * 3) % 90}" for j in range(24)) for i in range(30)))
    out = tmp_path / "head"
    rc, stdout, err = run(capsys, "train-draft", "--kind", "eagle", "--model", str(tiny_folder), "--data", "corpus",
                          "--corpus", str(corpus), "--draft-vocab", "64", "--epochs", "1", "--steps-ahead", "2",
                          "--out", str(out))
    assert rc == 0, err
    report = json.loads(stdout)
    assert len(report["val_agreement"]) == 2 and (out / "model.safetensors").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["training"]["data"] == "corpus" and cfg["draft_vocab"] == 64
    outs = {}
    for name in ("none", "eagle", "eagle+lookup", "eagle+auto", "eagle+suffix"):
        extra = ["--draft", str(out), "--tree-nodes", "6"] if name != "none" else []
        extra += {"eagle+lookup": ["--tree-lookup"], "eagle+auto": ["--tree-lookup", "auto"],
                  "eagle+suffix": ["--tree-lookup", "auto", "--lookup-from", "suffix"]}.get(name, [])
        rc, stdout, err = run(capsys, "generate", "w5 w9 w13", "--model", str(tiny_folder), "--method",
                              name.partition("+")[0], "--max-new-tokens", "12", "--json", *extra)
        assert rc == 0, err
        outs[name] = json.loads(stdout)["token_ids"]
    assert outs["eagle"] == outs["none"] == outs["eagle+lookup"] == outs["eagle+auto"] == outs["eagle+suffix"]
    # bench with the head's tree methods: greedy equal, and what each eagle-tree+auto step verified
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [t]})
                                 for i, t in enumerate(["w5 w9 w13 w5 w9", "w7 w8 w7 w8"])))
    rc, _, err = run(capsys, "bench", "--prompts", str(prompts), "--model", str(tiny_folder), "--methods",
                     "none,eagle-tree+lookup:3,eagle-tree+auto:3,eagle-tree+suffix-auto:3", "--eagle-head", str(out),
                     "--tree-nodes", "4",
                     "--max-new-tokens", "10", "--out", str(tmp_path / "bench"))
    assert rc == 0, err
    res = json.loads((tmp_path / "bench" / "results.json").read_text())
    for name in ("eagle-tree+lookup:3", "eagle-tree+auto:3", "eagle-tree+suffix-auto:3"):
        assert res["methods"][name]["greedy_equal"] == 2
    steps = res["methods"]["eagle-tree+auto:3"]["steps_by_choice"]
    assert steps["tree"] >= 1 and sum(steps.values()) <= res["methods"]["eagle-tree+auto:3"]["target_passes"]
    assert "eagle-tree+auto:3: steps that verified the tree" in (tmp_path / "bench" / "results.md").read_text()
    assert "predicted_speedup_vs_none" not in res["methods"]["eagle-tree+auto:3"]  # mixed steps: no one shape to price
    assert res["methods"]["eagle-tree+lookup:3"].get("predicted_speedup_vs_none")
    import torch

    if not torch.cuda.is_available():  # CPU: greedy trees run the LM head on the walked rows only, and are priced so
        m = res["methods"]["eagle-tree+lookup:3"]  # priced by its mean pass: nodes, head rows and head calls
        from forerun.bench import lazy_tree_key

        key = lazy_tree_key(round(m["verified_rows"] / m["target_passes"]) - 1, max(1, round(m["head_rows"] / m["target_passes"])),
                            max(1, round(m["head_calls"] / m["target_passes"])))
        assert key in res["verify_cost_ratio"] and res["config"]["greedy_head"] in ("exact-q8-screened", "float32")
        assert m["head_calls"] >= m["target_passes"]
        from forerun.backends.linear import f32_rows_kernel

        assert res["config"]["batch_invariant"] == (f32_rows_kernel() is not None) and "llama_cpp" not in res["config"]
        assert res["methods"]["eagle-tree+lookup:3"]["head_rows"] > 0


def test_train_draft_distill_seeds_add_prompt_draws(capsys, tiny_folder, tmp_path):
    """Each --distill-seeds seed adds its own draw of seed prompts; a rerun with one more seed reuses the answers."""
    from forerun.training.data import distill_prompts

    work = tmp_path / "work"
    common = ["train-draft", "--kind", "medusa", "--model", str(tiny_folder), "--distill-prompts", "6",
              "--distill-tokens", "4", "--draft-vocab", "64", "--epochs", "1", "--steps-ahead", "2",
              "--out", str(tmp_path / "head"), "--work", str(work)]
    rc, _, err = run(capsys, *common, "--distill-seeds", "0")
    assert rc == 0, err
    first = [json.loads(line)["prompt"] for line in (work / "distill.jsonl").read_text().splitlines()]
    assert first == distill_prompts(None, 6, 0)
    (work / "checkpoint.pt").unlink()  # other data: train afresh
    rc, _, err = run(capsys, *common, "--distill-seeds", "0,1")
    assert rc == 0, err
    recs = [json.loads(line)["prompt"] for line in (work / "distill.jsonl").read_text().splitlines()]
    assert recs[: len(first)] == first  # seed 0's answers were kept, not asked again
    assert recs == list(dict.fromkeys(first + distill_prompts(None, 6, 1)))
    assert len(recs) > len(first)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["training"]["distill_seeds"] == [0, 1]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train-draft", "--kind", "eagle", "--out", "x", "--epochs", "0"], "--epochs"),
        (["train-draft", "--kind", "eagle", "--out", "x", "--distill-seeds", "0,x"], "--distill-seeds"),
        (["train-draft", "--kind", "eagle", "--out", "x", "--data", "corpus"], "needs --corpus"),
        (["train-draft", "--kind", "eagle", "--out", "x", "--corpus", "/no/such/file.jsonl"], "does not exist"),
        (["train-draft", "--kind", "eagle", "--out", "x", "--keep-vocab"], "give --init"),
        (["generate", "hi", "--method", "ngram", "--tree-nodes", "8", "--model", "MODEL"], "token trees"),
        (["generate", "hi", "--method", "eagle", "--tree-lookup", "--model", "MODEL"], "give --tree-nodes"),
        (["generate", "hi", "--method", "suffix", "--tree-nodes", "65", "--model", "MODEL"], "--tree-nodes must be in 0..64"),
        (["generate", "hi", "--method", "eagle", "--tree-nodes", "4", "--lookup-from", "suffix", "--model", "MODEL"],
         "give --tree-lookup"),
        (["bench", "--methods", "none,eagle-tree+auto", "--lookup-from", "suffix", "--prompts", "PROMPTS",
          "--model", "MODEL"], "eagle-tree+suffix"),
        (["generate", "hi", "--method", "eagle", "--draft", "/no/such/head", "--model", "MODEL"], "not a draft head"),
        (["eval-draft", "--kind", "eagle", "--prompts", "/no/such/prompts.jsonl", "--model", "MODEL"], "prompts file not found"),
        (["eval-draft", "--kind", "medusa", "--prompts", "PROMPTS", "--model", "MODEL"], "no medusa head is shipped"),
        (["eval-draft", "--kind", "eagle", "--prompts", "PROMPTS", "--head", "/no/such/head", "--model", "MODEL"],
         "not a draft head"),
        (["eval-draft", "--kind", "eagle", "--prompts", "PROMPTS", "--replay", "medusa-tree:4"], "not a method of the eagle"),
        (["eval-draft", "--kind", "eagle", "--prompts", "PROMPTS", "--replay", "eagle-tree+auto:6"], "measured time"),
        (["eval-draft", "--kind", "eagle", "--prompts", "PROMPTS", "--replay", "eagle:auto"], "fixed draft length"),
        (["eval-draft", "--kind", "eagle", "--prompts", "PROMPTS", "--replay", "eagle-tree", "--tree-depth", "0"],
         "--tree-depth"),
    ],
)
def test_train_draft_and_head_errors(capsys, tiny_folder, tmp_path, argv, needle):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "x", "turns": ["w5 w6"]}) + "\n")
    argv = [str(tiny_folder) if a == "MODEL" else str(prompts) if a == "PROMPTS" else a for a in argv]
    rc, _, err = run(capsys, *argv)
    assert_clean_error(rc, err, needle)


def test_loadtest_end_to_end(capsys, tiny_folder, tmp_path):
    """loadtest starts a server per method, mixes invalid requests in, reports both and their ratio."""
    out = tmp_path / "load.json"
    code = main(["loadtest", "--model", str(tiny_folder), "--methods", "none,ngram", "--concurrency", "1,3",
                 "--requests", "9", "--max-tokens", "8", "--invalid-fraction", "0.3", "--out", str(out)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    for m in ("none", "ngram"):
        for lv in report["methods"][m]["levels"]:
            assert lv["requests"] == 9 and lv["server_errors_5xx"] == 0 and lv["connection_failures"] == 0
            assert lv["invalid_answered_4xx"] == lv["invalid_sent"] and lv["ok"] == 9 - lv["invalid_sent"]
            assert lv["output_tokens"] > 0 and lv["ttft_p50_s"] > 0 and lv["server_alive"]
    ng = report["methods"]["ngram"]["levels"][1]
    assert ng["vs_none"] > 0
    a, b = ng["greedy_equal_to_none"].split("/")
    assert a == b and int(b) > 0
    a, b = ng["greedy_equal_to_first_level"].split("/")  # concurrency 3 against concurrency 1
    assert a == b
    assert "texts" in json.loads(out.read_text())["methods"]["none"]["levels"][0]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"  # throughput and latency against concurrency


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--method", "magic"], "unknown method"),
    (["serve", "--method", "draft"], "needs a draft model"),
    (["serve", "--port", "70000"], "--port"),
    (["loadtest", "--concurrency", "0"], "--concurrency"),
    (["loadtest", "--invalid-fraction", "2"], "--invalid-fraction"),
])
def test_serve_and_loadtest_bad_inputs(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_debug_flag_before_or_after_the_subcommand(capsys):
    from forerun.cli import build_parser

    ap = build_parser()
    assert ap.parse_args(["--debug", "generate", "x"]).debug is True
    assert ap.parse_args(["generate", "x", "--debug"]).debug is True
    assert ap.parse_args(["generate", "x"]).debug is False
    assert ap.parse_args(["serve", "--debug"]).debug is True


def test_serve_without_the_server_extra_says_what_to_install(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    rc, _, err = run(capsys, "serve", "--model", "./no/such/folder")
    assert rc == 2 and "forerun[server]" in err and "uvicorn" in err


def test_bench_defaults_are_quick_and_name_the_users_tools(tiny_folder):
    from forerun.bench import default_peers
    from forerun.cli import build_parser

    args = build_parser().parse_args(["bench", "--prompts", "x.jsonl"])
    assert args.methods == "none,ngram:auto,suffix:auto"  # nothing to calibrate or train first
    assert default_peers(str(tiny_folder)) == "hf"
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is not None:
        assert default_peers("bundled") == "llama.cpp,hf"


def _parser_flags(parser) -> set[str]:
    flags = set()
    for action in parser._actions:
        flags |= {s for s in action.option_strings if s.startswith("--")}
        for sub in (getattr(action, "choices", None) or {}).values() if hasattr(action, "add_parser") else ():
            flags |= _parser_flags(sub)
    return flags


def test_every_option_the_library_names_is_a_flag_of_the_command_line():
    """Library errors name options as the library's parameters (``OptionError``); the command line
    says each as its flag (``cli_args.flag_of``), and every option so named has one."""
    import ast
    import string
    from pathlib import Path

    import forerun
    from forerun.cli_args import build_parser, flag_of
    from forerun.errors import OptionError

    named = {"head_path", "head", "init"}  # load_trained_head's ``option``
    for f in Path(forerun.__file__).parent.rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "OptionError" and isinstance(n.args[0], ast.Constant):
                values = {k.arg for k in n.keywords}
                named |= {x for _, x, _, _ in string.Formatter().parse(n.args[0].value) if x and x not in values}
    assert len(named) > 20
    flags = _parser_flags(build_parser())
    assert {o: flag_of(o) for o in named if flag_of(o) not in flags} == {}
    e = OptionError("{tree_lookup} adds a branch to a token tree: give {tree_nodes} too (got {got})", got=3)
    assert str(e) == "tree_lookup adds a branch to a token tree: give tree_nodes too (got 3)"
    assert e.said(flag_of) == "--tree-lookup adds a branch to a token tree: give --tree-nodes too (got 3)"
