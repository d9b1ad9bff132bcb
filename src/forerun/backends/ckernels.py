"""The package's C kernels (``*.c`` beside this file), compiled once per machine into the cache
folder and loaded with ctypes. Every caller has a slower path for machines without a C compiler.

A kernel built with ``-march=native`` runs only on CPUs with the features of the one that built
it, and a cache folder can be shared between machines (a network home, a container image), so
the cache key holds the CPU's feature flags and the compiler's version as well as the source and
the flags: another CPU or compiler builds its own copy instead of loading one that could stop on
an illegal instruction. Kernels built for a named instruction set (``compile_isa``) are loaded
only where the CPU reports that set (``cpu_flags``)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

from forerun.paths import cache_dir

log = logging.getLogger("forerun")

# Compiler flags of each instruction set a kernel can be built for, and the CPU flags it needs.
ISA_FLAGS = {
    "portable": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "vnni": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    # tests only: the VNNI code path with vpdpbusd done in AVX2, on CPUs without VNNI
    "vnni-emulated": ("-mavx2", "-mfma", "-mf16c", "-DFORERUN_EMULATE_VNNI"),
}
ISA_NEEDS = {"portable": (), "avx2": ("avx2", "fma", "f16c"),
             "vnni": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
             "vnni-emulated": ("avx2", "fma", "f16c")}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The feature flags this CPU reports (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_runs(isa: str) -> bool:
    """Whether this CPU can run code built for ``isa`` (``ISA_FLAGS``)."""
    if isa == "portable":
        return True
    return platform.machine() in ("x86_64", "AMD64") and set(ISA_NEEDS[isa]) <= cpu_flags()


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


def kernel_path(name: str, cc: str, arch: tuple, flags: tuple, tag: str) -> Path:
    """Where the build of ``<name>.c`` with this compiler and these flags is cached: the key holds
    the source and the headers beside it, the compiler and its version, the machine type and the flags, and for
    ``-march=native`` builds the CPU's feature flags too."""
    src = Path(__file__).with_name(f"{name}.c")
    native = "-march=native" in arch
    headers = b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))  # what the sources include
    key = hashlib.sha1(b"\0".join([
        src.read_bytes(), headers, cc.encode(), compiler_version(cc).encode(), platform.machine().encode(),
        " ".join(arch + flags).encode(), " ".join(sorted(cpu_flags())).encode() if native else b""])).hexdigest()[:12]
    return cache_dir() / "kernels" / f"{name}-{tag}-{key}.so"


def _build(name: str, arch: tuple, flags: tuple, without: str, tag: str):
    src = Path(__file__).with_name(f"{name}.c")
    cc = _compiler()
    if cc is None or shutil.which(cc) is None:
        _say_once(f"nocc:{name}", "no C compiler found%s for %s.c: %s", f" ({cc})" if cc else "", name, without)
        return None
    out = kernel_path(name, cc, arch, flags, tag)
    if not out.exists():
        _say_once(f"build:{name}:{tag}", "compiling %s.c (%s) once for this machine (seconds)", name, tag)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        err = ""
        for omp in (("-fopenmp",), ()):  # without OpenMP the kernels run on one thread
            cmd = [cc, "-O3", *arch, *omp, *flags, "-shared", "-fPIC", str(src), "-o", str(tmp)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                if not omp:
                    _say_once(f"noomp:{name}", "%s.c built without OpenMP (%s): its kernels run on one thread",
                              name, err)
                break
            err = (r.stderr.strip().splitlines() or ["?"])[-1]
        else:
            _say_once(f"fail:{name}:{tag}", "could not compile %s.c (%s); %s", name, err, without)
            return None
        os.replace(tmp, out)
    return ctypes.CDLL(str(out))


def compile_c(name: str, without: str = "verification uses llama.cpp's LM head (slower)", flags: tuple = ()):
    """Compile the package's ``<name>.c`` once for this CPU (``-march=native``, with extra compiler
    ``flags``) into the cache folder and load it; None (logged once, with ``without``: what happens
    instead) when impossible."""
    return _build(name, ("-march=native",), flags, without, "native")


def compile_isa(name: str, isa: str, without: str, flags: tuple = ()):
    """``<name>.c`` built for the instruction set ``isa`` (a key of ``ISA_FLAGS``); None where this
    CPU cannot run it or it cannot be built."""
    if not isa_runs(isa):
        return None
    return _build(name, ISA_FLAGS[isa], flags, without, isa)
