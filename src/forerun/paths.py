"""Where forerun keeps what it builds once: converted GGUF models, compiled kernels, layer-skip
calibrations. ``$FORERUN_CACHE``, else ``~/.cache/forerun``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("FORERUN_CACHE") or Path.home() / ".cache" / "forerun")
