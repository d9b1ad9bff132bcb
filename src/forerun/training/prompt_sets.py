"""Chat prompt sets for self-distillation, built from instruction data a user may use.

A drafter learns what the target answers, so a prompt set only needs the questions: the
answers are always the target's own (``data.self_distill``). ``build_prompt_set`` reads prompt
records from instruction datasets (JSON lists or JSONL: ``instruction`` with an optional
``input``, ``prompt``, ``question``, or self-instruct's ``instances``), mixes them with the
project's own task families (``seeds.py``), and drops every prompt that shares a run of words
with a benchmark file (Spec-Bench, MT-bench, ...), so that a head is never trained on what it is
measured on. Output: JSONL, one ``{"prompt", "source"}`` per line, which ``forerun train-draft
--prompts`` reads.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from forerun.errors import ForerunError
from forerun.training.seeds import builtin_prompts

OVERLAP_WORDS = 8  # a prompt sharing this many consecutive words with a benchmark text is dropped


def _records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, list):
        return [r for r in data if isinstance(r, dict)]
    if isinstance(data, dict):
        return [data]
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ForerunError(f"{path}:{i}: not JSON ({e.msg})") from None
            if isinstance(obj, dict):
                out.append(obj)
    return out


def _join(instruction: str, inp: str) -> str:
    instruction, inp = instruction.strip(), (inp or "").strip()
    return f"{instruction}\n\n{inp}" if inp else instruction


def prompts_of(path: str | Path) -> list[str]:
    """The prompts of an instruction dataset file (answers, if any, are ignored)."""
    path = Path(path)
    if not path.exists():
        raise ForerunError(f"prompt source {path} does not exist")
    out = []
    for r in _records(path):
        if isinstance(r.get("instruction"), str) and isinstance(r.get("instances"), list):  # self-instruct seeds
            out += [_join(r["instruction"], inst.get("input", "")) for inst in r["instances"] if isinstance(inst, dict)]
        elif isinstance(r.get("instruction"), str):
            out.append(_join(r["instruction"], r.get("input") or r.get("context") or ""))
        else:
            for key in ("prompt", "question", "text"):
                if isinstance(r.get(key), str):
                    out.append(r[key].strip())
                    break
            else:
                if isinstance(r.get("turns"), list) and r["turns"] and isinstance(r["turns"][0], str):
                    out.append(r["turns"][0].strip())
    return [p for p in out if p]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _grams(text: str, n: int) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def benchmark_grams(paths, n: int = OVERLAP_WORDS) -> set[tuple[str, ...]]:
    """Every run of ``n`` words in the benchmark files (all their string fields)."""
    grams: set[tuple[str, ...]] = set()

    def walk(x):
        if isinstance(x, str):
            grams.update(_grams(x, n))
        elif isinstance(x, list):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    for p in paths:
        p = Path(p)
        if not p.exists():
            raise ForerunError(f"benchmark file {p} does not exist")
        for r in _records(p):
            walk(r)
    return grams


def build_prompt_set(sources: dict[str, str | Path], *, exclude=(), builtin: int = 0, limit: int = 0,
                     seed: int = 0, log=print) -> list[dict]:
    """``sources``: name -> dataset file. ``builtin``: add this many prompts of the project's own
    task families. ``limit``: at most this many prompts per source (0: all). Prompts are deduplicated,
    checked against ``exclude`` (benchmark files) and shuffled with ``seed``."""
    rng = random.Random(seed)
    picked: list[dict] = []
    for name, path in sources.items():
        ps = prompts_of(path)
        rng.shuffle(ps)
        if limit:
            ps = ps[:limit]
        picked += [{"prompt": p, "source": name} for p in ps]
        log(f"{name}: {len(ps)} prompts from {Path(path).name}")
    if builtin:
        picked += [{"prompt": p, "source": "forerun"} for p in builtin_prompts([], builtin, seed)]
    grams = benchmark_grams(exclude) if exclude else set()
    seen, out, dropped = set(), [], 0
    for r in picked:
        key = " ".join(_words(r["prompt"]))
        if not key or key in seen:
            continue
        seen.add(key)
        if grams and _grams(r["prompt"], OVERLAP_WORDS) & grams:
            dropped += 1
            continue
        out.append(r)
    if exclude:
        log(f"{dropped} prompts dropped: they share {OVERLAP_WORDS} consecutive words with a benchmark file")
    rng.shuffle(out)
    return out


def read_prompt_set(path: str | Path) -> list[str]:
    """Prompts of a prompt-set file (``{"prompt": ...}`` per line) or of any instruction dataset."""
    ps = prompts_of(path)
    if not ps:
        raise ForerunError(f"{path} holds no prompts")
    return list(dict.fromkeys(ps))
