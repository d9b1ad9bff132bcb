"""The GPU machine, rehearsed on a CPU: what ``bench/gpu_check.sh`` meets there, short of the GPU.

That machine has its image's packages (``image.txt``), the wheels the check carries (``carry.txt``)
and no network. This script:

1. checks that every carried wheel's own requirements are met by the image (and by the versions
   read there, where known) or by another carried wheel;
2. makes a clean virtual environment holding only the packages of this environment that the
   image or the carry list names (each linked in, nothing installed), with ``src/`` on the path as
   ``gpu_check.sh`` puts it, so any import of a package that will not be there fails here too;
3. in it: starts ``bench/gpu_check.py`` (``--help``), collects the CUDA test subset that
   ``gpu_check.sh`` runs (``cuda_tests.txt``), then runs ``gpu_check.py --quick`` on the CPU's
   fixed-shape path (``--out`` names where its files go).

    python bench/gpu/rehearse.py [--out DIR] [--keep] [--script]

Exit status 0 when all three pass; each failure is printed with what to do about it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: Path) -> dict[str, str | None]:
    """``name`` or ``name==version`` per line (``#`` comments): {canonical name: version or None}."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canon(name)] = version or None
    return out


def test_ids() -> list[str]:
    """The CUDA test subset ``gpu_check.sh`` runs."""
    return [l.strip() for l in (HERE / "cuda_tests.txt").read_text().splitlines() if l.strip() and not l.startswith("#")]


def check_requirements(image: dict, carry: dict) -> list[str]:
    """Problems with the carried wheels' requirements on the GPU machine (Python 3.12, Linux)."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    problems = []
    for name in carry:
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            problems.append(f"carry.txt names {name}, which is not installed here (wheels.sh downloads the installed version)")
            continue
        for text in reqs:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue  # an extra, or another platform's
            dep = canon(req.name)
            if dep in carry:
                continue
            if dep not in image:
                problems.append(f"{name} needs {req}, which the GPU image lacks: add it to carry.txt")
            elif image[dep] is not None and not req.specifier.contains(image[dep], prereleases=True):
                problems.append(f"{name} needs {req}, the GPU image has {dep} {image[dep]}: add it to carry.txt")
    return problems


def closure(allowed: set[str]) -> tuple[set[str], set[str]]:
    """``allowed`` and what the installed versions of those need here ({names}, {the needs added}).
    An image package installed here at another version than the image's may need packages that
    the image's version does not (huggingface_hub 2 needs httpx2, 1.33 does not): those are linked
    too, so that only imports the GPU machine would refuse fail."""
    from packaging.requirements import Requirement

    installed = {canon(d.metadata["Name"] or ""): d for d in md.distributions()}
    names, added, todo = set(allowed), set(), [n for n in allowed if n in installed]
    while todo:
        for text in installed[todo.pop()].requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dep = canon(req.name)
            if dep not in names and dep in installed:
                names.add(dep)
                added.add(dep)
                todo.append(dep)
    return names, added


def clean_env(where: Path, allowed: set[str]) -> tuple[Path, list[str]]:
    """A virtual environment at ``where`` whose site-packages links in, from this environment, the
    distributions named in ``allowed`` and nothing else. Returns its python and the names linked."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    py = where / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    here = Path(sysconfig.get_paths()["purelib"])
    linked = []
    for dist in md.distributions():
        name = canon(dist.metadata["Name"] or "")
        if name not in allowed or name in linked:
            continue
        tops = {Path(str(f)).parts[0] for f in (dist.files or []) if not str(f).startswith("..")}
        for top in tops:
            src, dst = here / top, site / top
            if (src.exists() or src.is_symlink()) and not dst.exists() and not top.endswith(".pth"):
                dst.symlink_to(src)
        linked.append(name)
    return py, sorted(linked)


def run(cmd: list[str], env: dict, what: str, timeout: int) -> bool:
    print(f"== {what}: {' '.join(cmd)}", flush=True)
    try:
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"FAILED: {what} took over {timeout} s")
        return False
    if r.returncode != 0:
        print(f"FAILED: {what} (exit {r.returncode})\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
        return False
    print(r.stdout[-1500:])
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="where gpu_check.py --quick writes (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the clean environment (its path is printed)")
    ap.add_argument("--script", action="store_true",
                    help="then bench/gpu_check.sh itself, quick, on the CPU, with the clean environment's python3 "
                         "(it installs bench/gpu/wheels if there, and runs the CUDA test subset on the CPU)")
    args = ap.parse_args(argv)
    image, carry = listed(HERE / "image.txt"), listed(HERE / "carry.txt")
    problems = check_requirements(image, carry)
    for p in problems:
        print("FAILED:", p)
    work = Path(tempfile.mkdtemp(prefix="forerun-gpu-rehearsal-"))
    try:
        allowed, added = closure(set(image) | set(carry))
        py, linked = clean_env(work / "env", allowed)
        print(f"clean environment: {len(linked)} distributions of this one that the GPU image or carry.txt names"
              + (f" (and {', '.join(sorted(added & set(linked)))}: what their versions here need)" if added else ""))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
        out = args.out or work / "out"
        ids = test_ids()
        ok = not problems
        ok &= run([str(py), "bench/gpu_check.py", "--help"], env, "gpu_check.py starts", 120)
        ok &= run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *ids], env,
                  "the CUDA test subset collects", 300)
        ok &= run([str(py), "bench/gpu_check.py", "--quick", "--device", "cpu", "--fixed-rows", "--out", str(out)], env,
                  "gpu_check.py --quick", 600)
        if args.script:
            sh_env = {**env, "PATH": f"{py.parent}:{env.get('PATH', '')}", "OUT": str(out / "sh")}
            sh_env.pop("PYTHONPATH")  # the script sets it, as on the GPU machine
            ok &= run(["bash", "bench/gpu_check.sh", "--quick", "--device", "cpu", "--fixed-rows", "--budget", "400"],
                      sh_env, "bench/gpu_check.sh --quick", 900)
        print("rehearsal", "passed" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        if args.keep:
            print("kept:", work)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
