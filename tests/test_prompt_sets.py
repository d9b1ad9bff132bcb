"""Prompt sets for self-distillation (forerun build-prompts, train-draft --prompts) and batched answers."""

import json
import random

import pytest
from conftest import tiny_llama, wrap

from forerun.errors import ForerunError
from forerun.training.prompt_sets import build_prompt_set, prompts_of, read_prompt_set


def _write(path, rows, jsonl=True):
    path.write_text("\n".join(json.dumps(r) for r in rows) if jsonl else json.dumps(rows))
    return path


def test_prompts_of_every_record_shape(tmp_path):
    alpaca = _write(tmp_path / "a.json", [{"instruction": "Sort the list.", "input": "[3, 1, 2]", "output": "[1, 2, 3]"},
                                           {"instruction": "Name a colour.", "input": "", "output": "red"}], jsonl=False)
    assert prompts_of(alpaca) == ["Sort the list.\n\n[3, 1, 2]", "Name a colour."]
    seeds = _write(tmp_path / "s.jsonl", [{"instruction": "Add them.", "instances": [{"input": "1 2", "output": "3"},
                                                                                      {"input": "", "output": "0"}]}])
    assert prompts_of(seeds) == ["Add them.\n\n1 2", "Add them."]
    mixed = _write(tmp_path / "m.jsonl", [{"question": "Why is the sky blue?", "answer": "..."},
                                          {"turns": ["First turn.", "Second turn."]}, {"prompt": "A prompt."}])
    assert prompts_of(mixed) == ["Why is the sky blue?", "First turn.", "A prompt."]
    with pytest.raises(ForerunError, match="does not exist"):
        prompts_of(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ForerunError, match="bad.jsonl:2"):
        prompts_of(tmp_path / "bad.jsonl")
    with pytest.raises(ForerunError, match="holds no prompts"):
        read_prompt_set(_write(tmp_path / "e.jsonl", [{"other": 1}]))


def test_build_drops_benchmark_overlap_and_duplicates(tmp_path):
    bench = _write(tmp_path / "bench.jsonl", [{"question_id": 1, "turns": [
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."]}])
    src = _write(tmp_path / "src.jsonl", [
        {"prompt": "Please compose an engaging travel blog post about a recent trip to Hawaii now."},  # 8+ words shared
        {"prompt": "Write a travel blog post about Norway."},  # a few words shared: kept
        {"prompt": "Write a travel blog post   about NORWAY."},  # the same words: a duplicate
        {"prompt": "Explain recursion to a child."},
    ])
    rows = build_prompt_set({"src": src}, exclude=[bench], builtin=5, seed=1, log=lambda s: None)
    prompts = [r["prompt"] for r in rows]
    assert "Explain recursion to a child." in prompts
    assert not any("Hawaii" in p for p in prompts)
    assert sum("Norway" in p or "NORWAY" in p for p in prompts) == 1
    assert sum(r["source"] == "forerun" for r in rows) == 5 and len(rows) == 7
    # fixed seed: the same set in the same order
    assert rows == build_prompt_set({"src": src}, exclude=[bench], builtin=5, seed=1, log=lambda s: None)


def test_batched_answers_equal_one_at_a_time():
    """The batch engine answers exactly as one sequence at a time does (greedy, batch-invariant
    backend), whatever order the answers finish in."""
    from forerun.training.data import greedy_answers

    lm = wrap(tiny_llama(3))
    assert lm.backend.capabilities.batched
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(4, 60)}" for _ in range(rng.randrange(3, 12))) for _ in range(7)]
    alone = {p: out for p, _, out in greedy_answers(lm, prompts, max_new_tokens=12, desc="x", batch=1)}
    together = {p: out for p, _, out in greedy_answers(lm, prompts, max_new_tokens=12, desc="x", batch=3)}
    assert alone == together and len(alone) == len(prompts)
    assert all(0 < len(v) <= 12 for v in alone.values())


def run(capsys, *argv):
    from forerun.cli import main

    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_build_prompts_cli(capsys, tmp_path):
    src = _write(tmp_path / "src.jsonl", [{"prompt": f"Question number {i}?"} for i in range(10)])
    out = tmp_path / "set.jsonl"
    rc, stdout, err = run(capsys, "build-prompts", "--source", f"mine={src}", "--builtin", "3", "--out", str(out))
    assert rc == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert json.loads(stdout)["by_source"] == {"mine": 10, "forerun": 3} and len(rows) == 13
    rc, _, err = run(capsys, "build-prompts", "--source", str(src), "--out", str(out))
    assert rc != 0 and "NAME=FILE" in err
    rc, _, err = run(capsys, "build-prompts", "--out", str(out))
    assert rc != 0 and "nothing to build" in err


def test_train_draft_prompt_set_slices_per_seed(capsys, tiny_folder, tmp_path):
    """--prompts: seed s answers the s-th slice of --distill-prompts prompts of the file's fixed shuffle."""
    src = _write(tmp_path / "set.jsonl", [{"prompt": f"w{4 + i} w{5 + i} w{6 + i}"} for i in range(20)])
    pool = read_prompt_set(src)
    random.Random(0).shuffle(pool)
    work = tmp_path / "work"
    rc, _, err = run(capsys, "train-draft", "--kind", "medusa", "--model", str(tiny_folder), "--prompts", str(src),
                     "--distill-prompts", "4", "--distill-seeds", "1,2", "--distill-tokens", "3", "--draft-vocab", "64",
                     "--epochs", "1", "--steps-ahead", "2", "--distill-batch", "3", "--out", str(tmp_path / "head"),
                     "--work", str(work))
    assert rc == 0, err
    recs = [json.loads(line)["prompt"] for line in (work / "distill.jsonl").read_text().splitlines()]
    assert sorted(recs) == sorted(pool[4:12])
    assert json.loads((tmp_path / "head" / "config.json").read_text())["training"]["prompts"] == "set.jsonl"
    rc, _, err = run(capsys, "train-draft", "--kind", "medusa", "--model", str(tiny_folder), "--prompts",
                     str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "h2"))
    assert rc != 0 and "does not exist" in err


def test_running_estimate_text():
    from forerun.drafters.head_training import running_estimate

    assert running_estimate([None, None]) == ""
    # a chain of depths each agreeing half the time: 1 + 0.5 + 0.25 tokens per pass
    assert running_estimate([0.5, 0.5]) == "agree 0.50 0.50 est. tau 1.75"
