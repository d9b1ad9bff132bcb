"""Start-up measurements kept per machine: timed once, read back by every later process.

Some choices are made by timing on the machine at hand (which backend decodes a GGUF file
faster, whether llama.cpp's greedy head pays, what a batched pass costs). Timing them in every
process made every start slow, and most under load, when it is slowest. A measurement here is
kept in the cache folder under a key of what it depends on (the caller's: a model file, a thread
count; a digest of our kernels' sources, ``ckernels.sources_id``, where it times them) and of the
machine (CPU model and flags, library versions), with the load average it was taken under. One
taken on a busy machine (a 1-minute load average above half a process per core before it started)
is used but taken again by the first process that finds the machine quiet; a busy retake never
replaces a quiet measurement.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from forerun import __version__
from forerun.machine import cpu_flags, cpu_name
from forerun.paths import cache_dir

log = logging.getLogger("forerun")

BUSY = 0.5  # load average per core above which a measurement is not kept for good


def load_per_core() -> float:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def file_key(path) -> str:
    """A file's identity for a key: its real path, size and modification time."""
    p = Path(path)
    st = p.stat()
    return f"{p.resolve()}|{st.st_size}|{int(st.st_mtime)}"


def _machine() -> list[str]:
    return [cpu_name(), " ".join(sorted(cpu_flags())), str(os.cpu_count()), torch.__version__, __version__]


def path_of(name: str, key: list) -> Path:
    digest = hashlib.sha1("|".join(map(str, [*key, *_machine()])).encode()).hexdigest()[:16]
    return cache_dir() / "measured" / f"{name}-{digest}.json"


def read(name: str, key: list) -> dict | None:
    """The record kept for ``name`` and ``key`` (value, measured, load_per_core, busy), or None."""
    try:
        return json.loads(path_of(name, key).read_text())
    except (OSError, ValueError):
        return None


def measured(name: str, key: list, measure: Callable[[], object], note: str | None = None) -> object:
    """``measure()``'s value for ``key`` on this machine: kept from an earlier process, or taken
    now (``note`` logged first: say what runs and for how long) and kept."""
    old = read(name, key)
    if old is not None and not (old.get("busy") and load_per_core() <= BUSY):
        return old["value"]
    if note:
        log.warning(note)
    load = load_per_core()
    value = json.loads(json.dumps(measure()))  # as later processes will read it back
    if old is not None and load > BUSY:
        return old["value"]  # no better than what was kept
    store(name, key, value, load)
    return value


def store(name: str, key: list, value, load: float) -> None:
    """Keep ``value`` for ``name`` and ``key``, measured under ``load`` (per core)."""
    rec = {"value": value, "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_per_core": round(load, 2), "busy": load > BUSY}
    f = path_of(name, key)
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        tmp.replace(f)
    except OSError as e:  # a read-only cache: measured again next time
        log.info("could not keep the %s measurement (%s)", name, e)
