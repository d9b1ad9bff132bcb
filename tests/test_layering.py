"""The package's layers: drafters and backends never import what drives them (the engines, the
server, the CLI, bench), and no module imports another that imports it back at load time."""

import ast
from pathlib import Path

import forerun

ROOT = Path(forerun.__file__).parent
DRIVERS = ("forerun.engine", "forerun.batching", "forerun.decode", "forerun.build", "forerun.server", "forerun.cli",
           "forerun.bench")


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, top_level_only: bool):
    """forerun modules imported by the file (at load time only, or anywhere in it)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("forerun"):
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("forerun"))


def test_drafters_and_backends_do_not_import_their_drivers():
    bad = []
    for sub in ("drafters", "backends"):
        for f in sorted((ROOT / sub).rglob("*.py")):
            bad += [(_module(f), m) for m in _imports(f, top_level_only=False) if m.startswith(DRIVERS)]
    assert not bad, bad


def test_no_import_cycles_at_load_time():
    files = {_module(f): f for f in ROOT.rglob("*.py")}
    graph = {m: {i for i in _imports(f, top_level_only=True) if i in files} for m, f in files.items()}
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, cycles


def test_no_private_imports_across_modules():
    """No module reaches into another's private names (``from forerun.x import _y``)."""
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("forerun"):
                bad += [(_module(f), node.module, a.name) for a in node.names
                        if a.name.startswith("_") and not a.name.endswith("__")]
    assert not bad, bad


def test_importing_the_package_changes_no_global_state():
    """Importing every module leaves warnings filters, environment variables and torch's thread
    count as they were: the library sets nothing behind its caller's back."""
    import subprocess
    import sys

    code = (
        "import os, warnings, torch, pkgutil, importlib\n"
        "before = (list(warnings.filters), dict(os.environ), torch.get_num_threads())\n"
        "import forerun\n"
        "for m in pkgutil.walk_packages(forerun.__path__, 'forerun.'):\n"
        "    if m.name != 'forerun.__main__':\n"
        "        importlib.import_module(m.name)\n"
        "after = (list(warnings.filters), dict(os.environ), torch.get_num_threads())\n"
        "changed = [name for name, a, b in zip(('warnings', 'environment', 'threads'), before, after) if a != b]\n"
        "print(changed)\n"
        "raise SystemExit(1 if changed else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
