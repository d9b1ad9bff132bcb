"""The tracked tree stays small enough to copy to a GPU machine (those accept at most 64 MiB) and
to keep the wheel light: at most 32 MiB, the shipped draft heads included (stored as 5- and 6-bit
blocks: docs/drafters.md)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 32 * 2**20


def test_tracked_files_fit_in_32_mib():
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / n for n in names.decode().split("\0") if n]
    total = sum(f.stat().st_size for f in files if f.is_file())
    biggest = sorted(files, key=lambda f: f.stat().st_size if f.is_file() else 0)[-3:]
    assert total <= LIMIT, f"{total / 2**20:.1f} MiB tracked; largest: {[str(f.relative_to(ROOT)) for f in biggest]}"


def test_shipped_heads_are_stored_in_blocks_of_five_or_six_bits():
    from safetensors import safe_open

    from forerun.drafters.heads import Q_BITS

    heads = sorted((ROOT / "src/forerun/data/heads").glob("*/model.safetensors"))
    assert len(heads) == 3
    for path in heads:
        with safe_open(str(path), "pt") as f:
            assert f.metadata().get(Q_BITS) in ("5", "6"), path
