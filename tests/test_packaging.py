"""The one import name: zero_offload, its server and kernels as subpackages, nothing else
installed at the top level, and the server importable without torch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def _run(code: str) -> subprocess.CompletedProcess:
    # from an empty directory with no PYTHONPATH: what the installation provides, not the checkout
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd="/",
                          env=env)


def test_one_import_name_and_no_generic_top_level_names():
    """(Mutation: the old package list in pyproject.toml installs runtime, optimizer_server and
    cython_ext again, and `runtime` is found.)"""
    r = _run("import importlib.util as u\n"
             "from zero_offload import OffloadAdamW, OffloadLion, OffloadEngine, OffloadConfig\n"
             "import zero_offload.hf, zero_offload.server, zero_offload.launch\n"
             "from zero_offload.kernels import cpu_adam\n"
             "print([n for n in ('runtime', 'optimizer_server', 'cython_ext') if u.find_spec(n) is not None])\n"
             "print(cpu_adam.simd_level())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "[]", r.stdout


def test_the_server_starts_without_torch():
    """The package's top level imports its torch-side names lazily.  (Mutation: an eager
    `from .engine import OffloadEngine` in runtime/__init__.py imports torch here.)"""
    r = _run("import sys; sys.modules['torch'] = None\n"
             "import zero_offload.server.__main__, zero_offload.server.server, zero_offload.server.shard\n"
             "import zero_offload\n"
             "print('ok')")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def _module_imports(path, package: str, folder_of: dict) -> set[str]:
    """The package's modules that `path` imports at its top level (not inside a function
    or under TYPE_CHECKING: those run later, or never, and make no cycle at import)."""
    import ast
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for n in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else []:
            if isinstance(n, ast.ImportFrom):
                if n.level:  # relative: within the folder
                    base = package if not n.module else f"{package}.{n.module}"
                    names = [base] + [f"{base}.{a.name}" for a in n.names]
                else:
                    names = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            else:
                continue
            out.update(m for m in names if m in folder_of)
    return out


def test_no_import_cycle_in_the_package():
    """Every module of runtime/ and optimizer_server/ (zero_offload, zero_offload.server)
    imports the others at its top level without a cycle: the engine's parts depend on
    each other one way.  (Mutation: a top-level `from .engine import OffloadEngine` in
    runtime/clipping.py, the cycle the thin engine ended, makes it fail.)"""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    folders = {"zero_offload": root / "runtime", "zero_offload.server": root / "optimizer_server"}
    folder_of = {}
    for pkg, d in folders.items():
        for f in d.glob("*.py"):
            folder_of[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = (pkg, f)
    graph = {m: _module_imports(f, pkg, folder_of) - {m} for m, (pkg, f) in folder_of.items()}
    # the package's __init__ is imported by each of its modules anyway; its own (lazy)
    # imports are what the test of the server without torch checks
    graph = {m: {d for d in deps if d not in folders} for m, deps in graph.items()}
    state, cycle = {}, []

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycle, f"import cycles: {cycle}"
