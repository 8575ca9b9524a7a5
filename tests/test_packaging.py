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
