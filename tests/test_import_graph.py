"""The package's import graph, read with ``ast`` (nothing imported): no cycle, counting
imports made inside functions too, and the ground floor (``prism_select/runtime/``)
importing nothing above it. The slow test imports every module alone in a fresh
interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "prism_select"
#: what a runtime/ module may import besides the standard library, torch and runtime/ itself
FLOOR = {"prism_select.errors", "prism_select.settings"}
#: parallel interpreters of the import-alone test
WORKERS = 2


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    """``{module name: path}`` of every module of the package."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, mods: dict):
    """``(imported name, line, local, package module or None)`` for each name an import of
    ``path`` brings in: the package module it loads (the longest known prefix), or None for
    a module outside the package (then the name is that module's)."""
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    local = {n.lineno for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = pkg
                for _ in range(n.level - 1):
                    base = base.rpartition(".")[0]
                src = f"{base}.{n.module}" if n.module else base
            else:
                src = n.module or ""
            names = [f"{src}.{a.name}" for a in n.names]
        elif isinstance(n, ast.Import):
            src, names = None, [a.name for a in n.names]
        else:
            continue
        for name in names:
            c = name
            while c and c not in mods:
                c = c.rpartition(".")[0]
            if not c and src is not None:  # a name of a module outside the package
                c, name = None, src
            yield name, n.lineno, n.lineno in local, c or None


def graph() -> dict:
    mods = modules()
    out = {}
    for m, p in mods.items():
        out[m] = {c: (line, local) for _, line, local, c in imports(p, mods) if c and c != m}
    return out


def cycles(g: dict) -> list:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_a_cycle_through_a_local_import(tmp_path, monkeypatch):
    """The reader counts a function-local import as an edge: two modules importing each
    other, one of them inside a function, are a cycle."""
    pkg = tmp_path / "prism_select"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    g = graph()
    assert g["prism_select.sub.b"] == {"prism_select.a": (2, True)}
    assert cycles(g) == [["prism_select.a", "prism_select.sub.b"]]


def test_no_import_cycle():
    g = graph()
    found = cycles(g)
    where = ["; ".join(f"{m} -> {t} (line {g[m][t][0]}{' local' if g[m][t][1] else ''})"
                       for m in grp for t in g[m] if t in grp) for grp in found]
    assert not found, "import cycles:\n" + "\n".join(where)


def floor_violations() -> list:
    """Each import of a runtime/ module from above the ground floor, as ``module line N: name``."""
    mods = modules()
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for m, p in mods.items():
        if not m.startswith("prism_select.runtime"):
            continue
        for name, line, local, c in imports(p, mods):
            top = name.split(".")[0]
            if c is None and top not in stdlib and top not in ("torch", "__future__"):
                bad.append(f"{m} line {line}: {name}")
            elif c is not None and c not in FLOOR and not c.startswith("prism_select.runtime") \
                    and c != "prism_select":
                bad.append(f"{m} line {line}: {c}")
    return bad


def test_the_floor_check_names_an_upward_import(tmp_path, monkeypatch):
    """A runtime/ module importing a module above it (here inside a function) or a third-party
    package is named; errors, settings, torch and the standard library are not."""
    pkg = tmp_path / "prism_select"
    (pkg / "runtime").mkdir(parents=True)
    for f in ("__init__.py", "runtime/__init__.py", "errors.py", "settings.py", "plan.py"):
        (pkg / f).write_text("")
    (pkg / "runtime" / "x.py").write_text("import os\nimport torch\nimport numpy\nfrom ..errors import E\n"
                                          "from .. import settings\n\n\ndef f():\n    from ..plan import g\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert floor_violations() == ["prism_select.runtime.x line 3: numpy", "prism_select.runtime.x line 9: prism_select.plan"]


def test_the_ground_floor_imports_nothing_above_it():
    """A runtime/ module imports the standard library, torch, errors, settings and the
    other runtime/ modules only (inside functions too)."""
    bad = floor_violations()
    assert not bad, "runtime/ imports from above the ground floor:\n" + "\n".join(bad)


@pytest.mark.slow
def test_every_module_imports_alone():
    """``python -c "import prism_select.X"`` in a fresh interpreter, for every module."""
    root = PACKAGE.parent

    def one(m):
        r = subprocess.run([sys.executable, "-c", f"import {m}"], cwd=root, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
        return m, r.returncode, r.stderr.strip().splitlines()[-1:] if r.returncode else []

    with ThreadPoolExecutor(WORKERS) as pool:
        failed = [f"{m}: {err}" for m, rc, err in pool.map(one, sorted(modules())) if rc]
    assert not failed, "modules that fail to import alone:\n" + "\n".join(failed)
