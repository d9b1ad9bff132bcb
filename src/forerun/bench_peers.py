"""The peers ``forerun bench`` runs beside forerun's methods, each as its users run it.

- ``hf``, ``hf-lookup``: transformers' ``generate()`` (greedy; with prompt lookup), in process.
- ``llama.cpp``: llama.cpp's plain greedy decoding through llama-cpp-python, in a process of its own
  at llama.cpp's defaults (``llamacpp_peer``), reset outside the clock.
- ``llama-bench``: llama.cpp's own benchmark tool on the same file: pp512 and tg128 once before the
  prompts, then tg128 once between each prompt's methods (the figure the report compares); the
  binary is built from the llama.cpp source the installed llama-cpp-python vendors
  (``bench/llama_cpp_tools.sh``), found where that script puts it or under ``--llama-tools``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from forerun.errors import ForerunError
from forerun.machine import cpu_flags
from forerun.paths import cache_dir

PEERS = ("hf", "hf-lookup", "llama.cpp", "llama-bench")
PER_PROMPT = ("hf", "hf-lookup", "llama.cpp")  # peers that decode the bench's prompts (llama-bench has its own)
LLAMA_BENCH_TG = "llama-bench tg128"  # llama-bench's place in a prompt's rotation of methods


def hf_generate(model, ids, max_new, eos, lookup: bool):
    inp = torch.tensor([ids], device=model.device)
    kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0],
              attention_mask=torch.ones_like(inp), top_p=None, top_k=None, temperature=None)
    if lookup:
        kw["prompt_lookup_num_tokens"] = 10
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inp, **kw)
    wall = time.perf_counter() - t
    return out[0, len(ids):].tolist(), wall


def llama_defaults_env() -> dict:
    """This process's environment without forerun's switch of ggml's tiled product
    (``GGML_CPU_TILED_MM``): what llama.cpp runs with by default."""
    return {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}


def _signal_hint(code: int | None) -> str:
    """What a llama.cpp process killed by an illegal instruction most likely needs."""
    if code != -signal.SIGILL:
        return ""
    return ("; it was killed by SIGILL: the installed llama-cpp-python runs instructions this CPU refuses "
            "(a native build on a VM that lists AMX but does not grant it, or a build made on another CPU). "
            "Reinstall it built for this CPU: CMAKE_ARGS=\"$(bench/llama_cpp_flags.sh)\" pip install --no-cache-dir "
            "--force-reinstall --no-deps llama-cpp-python")


class LlamaCppPeer:
    """The llama.cpp peer: a child process (``python -m forerun.llamacpp_peer``) with llama.cpp's
    defaults, asked one prompt at a time. ``info``: its llama-cpp-python version, llama.cpp's
    system info and the settings it runs with."""

    def __init__(self, path: str, threads: int | None, n_ctx: int):
        self._log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "forerun.llamacpp_peer", path, "--threads", str(threads or torch.get_num_threads()),
               "--n-ctx", str(n_ctx)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=llama_defaults_env())
        self.info = self._reply()["info"]

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@"):
                return json.loads(line[1:])
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        self._log.seek(0)
        tail = self._log.read().decode(errors="replace").strip().splitlines()[-5:]
        raise ForerunError("the llama.cpp peer stopped: " + (" | ".join(tail) or f"exit code {code}") + _signal_hint(code))

    def generate(self, ids: list[int], max_new: int, eos) -> tuple[list[int], float, float]:
        """(tokens, wall seconds, prompt-pass seconds), timed inside the peer's process."""
        self.proc.stdin.write(json.dumps({"prompt": list(ids), "max_new": max_new, "eos": sorted(eos)}) + "\n")
        self.proc.stdin.flush()
        r = self._reply()
        return r["out"], r["wall_s"], r["prefill_s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def llama_tools_dir() -> Path:
    """Where ``bench/llama_cpp_tools.sh`` puts llama.cpp's own tools for the installed
    llama-cpp-python and this CPU (its flags in the key: a build for another CPU is never used)."""
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    cpu = hashlib.sha1(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:10]
    return cache_dir() / "llama.cpp-tools" / f"{version}-{cpu}" / "bin"


def find_tool(name: str, where: str | None = None) -> Path:
    """llama.cpp's tool ``name`` (``llama-bench``, ``llama-server``) in ``where`` or the built tools' folder."""
    folder = Path(where) if where else llama_tools_dir()
    exe = folder / name
    if not exe.is_file():
        raise ForerunError(f"{name} not found in {folder}: build llama.cpp's tools first with bench/llama_cpp_tools.sh "
                           "(or give the folder holding them with --llama-tools)")
    return exe


def _llama_bench_rows(model_path: str, threads: int | None, tools: str | None, args: list[str]) -> tuple[list, list]:
    """Run ``llama-bench`` on the file with ``args`` (JSON output); its rows and the command as said."""
    exe = find_tool("llama-bench", tools)
    cmd = [str(exe), "-m", model_path, "-t", str(threads or torch.get_num_threads()), *args, "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=llama_defaults_env())
    if r.returncode != 0:
        raise ForerunError(f"llama-bench failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:] or ''}")
    try:
        rows = json.loads(r.stdout)
    except ValueError:
        rows = None
    if not (isinstance(rows, list) and rows and all(isinstance(row, dict) and "avg_ts" in row for row in rows)):
        raise ForerunError(f"llama-bench wrote no results we can read: {r.stdout.strip()[:200]!r}")
    return rows, ["llama-bench", "-m", Path(model_path).name] + cmd[3:]


def llama_bench(model_path: str, threads: int | None, tools: str | None = None, reps: int = 3) -> dict:
    """llama.cpp's own ``llama-bench -p 512 -n 128`` on the file: tokens/s of a 512-token prompt pass
    (pp512) and of 128 one-token decode steps (tg128), mean and standard deviation over ``reps``."""
    rows, said = _llama_bench_rows(model_path, threads, tools, ["-p", "512", "-n", "128", "-r", str(reps)])
    out = {"command": " ".join(said), "build": rows[0].get("build_commit"), "cpu_info": rows[0].get("cpu_info")}
    for row in rows:
        key = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        out[key] = {"tokens_per_s": row["avg_ts"], "stddev": row["stddev_ts"]}
    return out


def llama_bench_tg(model_path: str, threads: int | None, tools: str | None = None, n: int = 128) -> float:
    """One ``llama-bench -p 0 -n 128 -r 1`` on the file: tokens/s of 128 one-token decode steps. The
    bench runs it once between each prompt's methods, so that llama.cpp's decode rate is taken in the
    same minutes as ours (this machine's speed drifts by tens of percent within minutes)."""
    rows, _ = _llama_bench_rows(model_path, threads, tools, ["-p", "0", "-n", str(n), "-r", "1"])
    return float(rows[0]["avg_ts"])


def interleaved_tg(before: dict, rates: list[float]) -> dict:
    """tg128 as the report compares it: the decode rate over the runs taken between the prompts'
    methods (total tokens over total time: each run decodes as many tokens, so the harmonic mean of
    their rates), with the run before the bench kept beside it."""
    rate = len(rates) / sum(1 / r for r in rates)
    spread = (sum((r - rate) ** 2 for r in rates) / len(rates)) ** 0.5
    return {"tokens_per_s": rate, "stddev": spread, "runs": len(rates), "interleaved": True, "before": before}


def prompt_rate(backend, vocab: int, n: int = 512, reps: int = 3) -> float:
    """Our prompt pass at llama-bench's pp512 terms: tokens/s of one pass of ``n`` random tokens into
    an empty cache (logits of the last row only), best of ``reps``."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, min(vocab, 20000), (min(n, backend.max_context - 1),), generator=g)
    best = float("inf")
    for _ in range(reps):
        backend.reset()
        t = time.perf_counter()
        backend.forward(ids, 0, last_only=True)
        best = min(best, time.perf_counter() - t)
    backend.reset()
    return len(ids) / best
