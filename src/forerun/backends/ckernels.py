"""The package's C kernels (``*.c`` beside this file): how each is built, loaded and declared.

Every kernel is built for a named instruction set (``BUILDS``: compiler flags and the CPU flags
they need), never with ``-march=native``: the C files choose their code paths with ``#if`` on the
compiler's macros, so building each file for each set this CPU runs lets the tests run every
path there is on this machine (``use_build``), and a build is loaded only where the CPU reports
what it needs, so a cache folder shared between machines (a network home, a container image)
cannot hand one CPU another's instructions. The set used at run time is the fastest this CPU
runs (``chosen_isa``); ``FORERUN_KERNEL`` forces one. Each kernel is compiled once per build into
the cache folder; every caller has a slower path for machines without a C compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from forerun.errors import ForerunError
from forerun.machine import cpu_flags
from forerun.paths import cache_dir

log = logging.getLogger("forerun")

_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX2_NEEDS = ("avx2", "fma", "f16c")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
_AVX512_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


@dataclass(frozen=True)
class Build:
    flags: tuple[str, ...]  # compiler flags
    needs: tuple[str, ...]  # CPU flags (``/proc/cpuinfo``) it runs on
    test_only: bool = False  # a code path of another set compiled with this machine's instructions


BUILDS = {
    "vnni": Build((*_AVX2, *_AVX512), (*_AVX2_NEEDS, *_AVX512_NEEDS)),  # AVX-512 with VNNI (Ice Lake, Zen 4)
    "avx-vnni": Build((*_AVX2, "-mavxvnni"), (*_AVX2_NEEDS, "avx_vnni")),  # 256-bit VNNI without AVX-512 (Alder Lake)
    "avx2": Build(_AVX2, _AVX2_NEEDS),
    "portable": Build((), ()),
    # tests only, so that an AVX2 machine runs the logic of paths written for AVX-512: qrows.c's
    # VNNI path with vpdpbusd done in AVX2, block_rows.c's 4-row groups (AVX-512's 32 registers)
    "vnni-emulated": Build((*_AVX2, "-DFORERUN_EMULATE_VNNI"), _AVX2_NEEDS, test_only=True),
    "avx2-wide-groups": Build((*_AVX2, "-DFORERUN_WIDE_GROUPS"), _AVX2_NEEDS, test_only=True),
}
ISAS = tuple(name for name, b in BUILDS.items() if not b.test_only)  # fastest first; what FORERUN_KERNEL names

P, I, I64, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ROWS = [P, I64, I, P, I, P]
_MULTI = [P, P, P, P, I, I, I, I, P, P, P, P, F, P]


@dataclass(frozen=True)
class Kernel:
    without: str  # what runs instead where it cannot be built
    functions: dict = field(default_factory=dict)  # name: (restype, argtypes)
    flags: tuple[str, ...] = ()
    more_sources: tuple[str, ...] = ()  # files built into the same library after ``<name>.c``


# ``-ffp-contract=off``: products and sums as written (no fused multiply-adds the compiler chooses),
# where two loops over the same values must give the same bits.
KERNELS = {
    "qrows": Kernel("GGUF models run on float32 weights (slower)", {
        "forerun_q_threads": (I, [I]), "forerun_q_linear": (I, [P, I, P, I, P, I64, I]),
        "forerun_q_top": (I, [P, I, P, I, I, I, P, P]), "forerun_q_layer": (I, [P, P, I, P]),
        "forerun_q_layers": (I, [P, I, P, P, P, P]), "forerun_q_portable": (None, [I]),
        "forerun_q_to_half": (None, [P, P, I])}, ("-ffp-contract=off",), ("qact.c", "qlayer.c")),
    "block_rows": Kernel("quantized layers run on their float32 weights", {
        "forerun_q4_rows": (I, [P, P, P, I, I64, I, P, I, P]), "forerun_q8w_rows": (I, [P, P, P, I64, I, P, I, P]),
        "forerun_block_threads": (I, [I])}, ("-ffp-contract=off",)),
    "f32_rows": Kernel("the LM head uses the oneDNN/MKL kernels only", {
        "forerun_f32_rows": (I, _ROWS), "forerun_f16w_rows": (I, _ROWS), "forerun_f32_threads": (I, [I])}),
    "attn_rows": Kernel("batch-invariant attention runs row by row through PyTorch (slower)", {
        "forerun_attn_rows": (I, [P, P, P, I64, I, I, I, I, P, P, P, P, F, P]),
        "forerun_attn_rows_multi": (I, _MULTI), "forerun_attn_rows_multi_f16": (I, _MULTI),
        "forerun_attn_threads": (I, [I]), "forerun_store_rows": (None, [P, P, P, P, P, P, I, I, I])},
        ("-ffp-contract=off",)),
    "tap": Kernel("trained heads cannot read layer outputs on this backend"),
}


@functools.lru_cache(maxsize=1)
def isa_runs(build: str) -> bool:
    """Whether this CPU can run code built as ``build`` (a key of ``BUILDS``)."""
    if not BUILDS[build].needs:
        return True
    return platform.machine() in ("x86_64", "AMD64") and set(BUILDS[build].needs) <= cpu_flags()


@functools.lru_cache(maxsize=4)
def compiler_version(cc: str) -> str:
    try:
        r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return (r.stdout.strip().splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


_SAID: set[str] = set()


def _say_once(key: str, msg: str, *args) -> None:
    if key not in _SAID:
        _SAID.add(key)
        log.warning(msg, *args)


def kernel_path(name: str, cc: str, build: str) -> Path:
    """Where ``<name>.c`` built as ``build`` with this compiler is cached: the key holds the source
    and the headers beside it, the compiler and its version, the machine type and the flags."""
    sources = b"".join(p.read_bytes() for p in _sources(name))
    headers = b"".join(h.read_bytes() for h in sorted(Path(__file__).parent.glob("*.h")))  # what the sources include
    flags = BUILDS[build].flags + KERNELS[name].flags
    key = hashlib.sha1(b"\0".join([sources, headers, cc.encode(), compiler_version(cc).encode(),
                                   platform.machine().encode(), " ".join(flags).encode()])).hexdigest()[:12]
    return cache_dir() / "kernels" / f"{name}-{build}-{key}.so"


@functools.lru_cache(maxsize=1)
def sources_id() -> str:
    """A digest of every kernel source and header: what a timing of our kernels depends on besides
    the machine (the kept batch costs and backend timings are keyed by it, so changed kernels are
    timed again)."""
    here = Path(__file__).parent
    return hashlib.sha1(b"\0".join(p.read_bytes() for p in sorted([*here.glob("*.c"), *here.glob("*.h")]))).hexdigest()[:12]


def _sources(name: str) -> list[Path]:
    here = Path(__file__).parent
    return [here / f"{name}.c", *(here / f for f in KERNELS[name].more_sources)]


def _compile(name: str, build: str) -> Path | None:
    without = KERNELS[name].without
    cc = _compiler()
    if cc is None or shutil.which(cc) is None:
        _say_once(f"nocc:{name}", "no C compiler found%s for %s.c: %s", f" ({cc})" if cc else "", name, without)
        return None
    out = kernel_path(name, cc, build)
    if out.exists():
        return out
    _say_once(f"build:{name}:{build}", "compiling %s.c (%s) once for this machine (seconds)", name, build)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    err = ""
    for omp in (("-fopenmp",), ()):  # without OpenMP the kernels run on one thread
        cmd = [cc, "-O3", *BUILDS[build].flags, *omp, *KERNELS[name].flags, "-shared", "-fPIC", *map(str, _sources(name)), "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            if not omp:
                _say_once(f"noomp:{name}", "%s.c built without OpenMP (%s): its kernels run on one thread", name, err)
            break
        err = (r.stderr.strip().splitlines() or ["?"])[-1]
    else:
        _say_once(f"fail:{name}:{build}", "could not compile %s.c (%s, %s); %s", name, build, err, without)
        return None
    os.replace(tmp, out)
    return out


_LOADED: dict[tuple[str, str], object] = {}


def load(name: str, build: str):
    """``<name>.c`` built as ``build``, loaded with its functions declared; None where this CPU
    cannot run that build or it cannot be compiled."""
    if (name, build) not in _LOADED:
        lib = None
        if isa_runs(build) and (path := _compile(name, build)) is not None:
            lib = ctypes.CDLL(str(path))
            for fn, (restype, argtypes) in KERNELS[name].functions.items():
                getattr(lib, fn).restype = restype
                getattr(lib, fn).argtypes = argtypes
        _LOADED[name, build] = lib
    return _LOADED[name, build]


_CHOSEN: list = []  # [the chosen instruction set or None], filled on first use
_FORCED: list = []  # [build] while ``use_build`` holds one


def chosen_isa() -> str | None:
    """The instruction set the kernels run with here: ``FORERUN_KERNEL`` where set (and this CPU
    runs it), else the fastest this CPU runs whose ``qrows.c`` builds; None without a C compiler."""
    if _FORCED:
        return _FORCED[-1]
    if not _CHOSEN:
        want = os.environ.get("FORERUN_KERNEL", "").strip().lower()
        if want and want not in ISAS:
            raise ForerunError(f"FORERUN_KERNEL={want!r}: expected one of {', '.join(ISAS)}")
        if want and load("qrows", want) is None:
            log.warning("FORERUN_KERNEL=%s: this CPU or compiler cannot run it; choosing another", want)
            want = ""
        isa = want or next((isa for isa in ISAS if load("qrows", isa) is not None), None)
        if isa is None:
            log.warning("no C kernels (no C compiler): GGUF models run on float32 weights, the slow path")
        elif isa == "portable":
            log.warning("C kernels: portable C only (no AVX2 here), the slow path")
        _CHOSEN.append(isa)
    return _CHOSEN[0]


def kernel(name: str):
    """The loaded ``<name>.c`` of the chosen instruction set (``chosen_isa``), or of the next one
    down where that does not build; None where none builds (logged once)."""
    isa = chosen_isa()
    if isa is None:
        return None
    for b in (isa, *ISAS[ISAS.index(isa) + 1:]) if isa in ISAS else (isa,):
        if (lib := load(name, b)) is not None:
            return lib
    return None


def release_threads() -> None:
    """Give back the calling thread's kernel worker threads (OpenMP's team of that thread).

    Every thread that runs our kernels gets a team of workers of its own, kept for its next pass.
    While two threads hold teams there are more workers than cores; libgomp then stops letting idle
    workers spin, and each of a pass's parallel regions (about 150 in a one-token step of a 30-layer
    model) waits to wake them: a step of SmolLM2 took 8.2 ms on a second thread against 1.9 ms on
    the thread that had loaded the model, and 2.0 ms once that thread gave its team back. So what
    runs the model on the calling thread and then ends gives the team back: loading, timing passes
    (``BatchEngine.calibrate``), zeroing the slots' caches, each ``Engine.generate`` (``stream``),
    the batch engine going idle. The next pass on any thread builds a team again: about 0.2 ms
    (one step of SmolLM2 right after a release, 2.55 against 2.32 ms)."""
    gomp = _openmp_runtime()
    if gomp is not None:
        gomp.omp_pause_resource_all(2)  # omp_pause_hard: the calling thread's team ends


@functools.lru_cache(maxsize=1)
def _openmp_runtime():
    """The process's libgomp where one is loaded already (torch's CPU build brings it, and our
    kernels, built with -fopenmp, bind to that same copy by its name), with OpenMP 5.0's pause
    (GCC 9 and later); else None (nothing to give back)."""
    if not hasattr(os, "RTLD_NOLOAD"):
        return None
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        fn = lib.omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    return lib


@contextlib.contextmanager
def use_build(build: str):
    """Tests: every kernel fetched inside runs as ``build`` (which this CPU must run)."""
    if not isa_runs(build):
        raise ValueError(f"this CPU cannot run the {build} build")
    _FORCED.append(build)
    try:
        yield
    finally:
        _FORCED.pop()


def runnable_builds() -> list[str]:
    """Every build this CPU runs, test-only ones included: what the tests run each kernel as."""
    return [b for b in BUILDS if isa_runs(b)]
