"""The planted-bug list (``mutants.py``) stays runnable: every snippet it replaces occurs exactly
once in the package, so a refactor that moves the code shows here, not at the next mutation run."""

from pathlib import Path

import pytest
from mutants import MUTANTS

import forerun

SRC = Path(forerun.__file__).parent


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_each_planted_bug_still_finds_its_snippet(mutant):
    mid, path, old = mutant[:3]
    assert (SRC / path).read_text().count(old) == 1, f"{mid}: its snippet is gone from {path} (or repeated)"
