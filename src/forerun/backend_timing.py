"""``--backend auto`` for a GGUF file both backends run: measured on this machine, once.

Which of the torch backend's integer path and llama.cpp decodes a GGUF model faster depends on
the model's size and the CPU (on our 2-core AVX2 machine the integer path is ahead at 135M and
270M parameters and behind at 1B, see docs/benchmarks.md). So the first time ``auto`` meets such
a file it times both on it: a one-token step (what plain decoding runs) and a pass of 5 rows (a
verify pass of 4 drafted tokens), each the median of a few runs at a context of 128 tokens, the
greedy path of each backend, and takes the one with the shorter sum for every method that can run
on either (one backend per file: every such method gives the same text). The result is kept per file, machine, kernel build, thread count
and library versions (``kept``: a measurement taken on a busy machine is used but taken again
by the next process that finds the machine quiet).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from forerun import kept
from forerun.backends.ckernels import chosen_isa, sources_id
from forerun.backends.llamacpp import LlamaCppBackend, LlamaCppModel
from forerun.timing import median_forward_s

CONTEXT, REPS = 128, 5


def _time(backend) -> dict:
    ids = torch.randint(10, min(backend.vocab_size, 20000), (CONTEXT + 5,), generator=torch.Generator().manual_seed(0), device="cpu")
    fn = "argmax_forward" if backend.capabilities.exact_argmax else "forward"
    step = median_forward_s(backend, ids[: CONTEXT + 1], 1, REPS, method=fn)
    five = median_forward_s(backend, ids, 5, REPS, method=fn)
    backend.reset()
    return {"step_ms": step * 1000, "pass5_ms": five * 1000}


def measure(path: Path, threads: int, load_torch) -> dict:
    """Time both backends on the file at ``path`` (seconds: both load it). ``load_torch()``: the
    torch backend's integer path on the file, or None where it cannot run it (the caller loads it,
    and may keep it for the run that follows)."""
    bar = tqdm(total=4, desc=f"timing both backends on {path.name} (once)", unit="step", leave=False)
    torch_backend = load_torch()
    bar.update(1)
    out = {"threads": threads}
    if torch_backend is not None:
        out["torch"] = _time(torch_backend)
    bar.update(1)
    cpp = LlamaCppBackend(LlamaCppModel(path), threads=threads, max_context=CONTEXT + 8)
    bar.update(1)
    out["llama.cpp"] = _time(cpp)
    bar.update(1)
    bar.close()
    return out


def _key(path: Path, threads: int) -> list:
    import llama_cpp  # optional (the llamacpp extra): only a llama.cpp timing asks

    return [kept.file_key(path), chosen_isa(), sources_id(), threads, getattr(llama_cpp, "__version__", "?")]


def timing(path: str | Path, load_torch, threads: int | None = None) -> dict:
    """Both backends' times on this file and machine (kept, or measured now; ``load_torch``: see
    ``measure``)."""
    path = Path(path)
    threads = threads or torch.get_num_threads()
    return kept.measured("backend-timing", _key(path, threads), lambda: measure(path, threads, load_torch),
                         f"timing the torch backend's integer path and llama.cpp on {path.name} once for this "
                         "machine (--backend auto; seconds)")


def faster(t: dict) -> str:
    """The backend with the shorter one-token step plus 5-row pass (plain decoding runs the
    first, speculation both); llama.cpp where torch was not timed. One choice per file, so that
    every method that can run on either gives the same text."""
    if "torch" not in t:
        return "llama.cpp"
    cost = {b: t[b]["step_ms"] + t[b]["pass5_ms"] for b in ("torch", "llama.cpp")}
    return "torch" if cost["torch"] <= cost["llama.cpp"] else "llama.cpp"


def kept_timing(path: str | Path, threads: int | None = None) -> dict | None:
    """The measurement kept for a GGUF file on this machine, with when and under which load it
    was taken (None: nothing kept), for reports."""
    try:
        rec = kept.read("backend-timing", _key(Path(path), threads or torch.get_num_threads()))
    except Exception:  # noqa: BLE001 - nothing kept, or the file cannot be read: the report says nothing
        return None
    return None if rec is None else {**rec["value"], "measured": rec["measured"], "load_per_core": rec["load_per_core"]}
