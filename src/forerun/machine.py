"""What the CPU at hand reports: its name and its feature flags (read from ``/proc/cpuinfo``).

Both the kernel builds (``backends.ckernels``: which instruction sets run here) and the kept
measurements (``kept``: a measurement belongs to the machine it was taken on) ask it.
"""

from __future__ import annotations

import platform
from pathlib import Path


def _cpuinfo_field(prefixes: tuple[str, ...]) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(prefixes):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (the platform's processor or machine name where Linux does not say)."""
    return _cpuinfo_field(("model name",)) or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The feature flags this CPU reports (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    return frozenset((_cpuinfo_field(("flags", "Features")) or "").split())
