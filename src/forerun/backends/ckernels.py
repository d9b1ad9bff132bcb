"""The package's C kernels (``*.c`` beside this file), compiled once per machine into the cache
folder with -O3 -march=native and loaded with ctypes. Every caller has a slower path for
machines without a C compiler."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from forerun.paths import cache_dir

log = logging.getLogger("forerun")


def compile_c(name: str, without: str = "verification uses llama.cpp's LM head (slower)", flags: tuple = ()):
    """Compile the package's ``<name>.c`` once (with extra compiler ``flags``) into the cache
    folder and load it; None (logged, with ``without``: what happens instead) when impossible."""
    src = Path(__file__).with_name(f"{name}.c")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found for %s.c: %s", name, without)
        return None
    key = hashlib.sha1(src.read_bytes() + cc.encode() + os.uname().machine.encode()
                       + " ".join(flags).encode()).hexdigest()[:12]
    out = cache_dir() / "kernels" / f"{name}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, "-O3", "-march=native", "-fopenmp", *flags, "-shared", "-fPIC", str(src), "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log.warning("could not compile %s.c (%s); %s", name, (r.stderr.strip().splitlines() or ["?"])[-1], without)
            return None
        os.replace(tmp, out)
    return ctypes.CDLL(str(out))
