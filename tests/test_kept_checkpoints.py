"""Checkpoints kept from earlier versions (tests/data) load on today's paths."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent

KEPT = str(ROOT / "tests" / "data" / "builtin-2rank-20261207")


def kept_load(tmp_path, nproc: int) -> dict:
    out = tmp_path / f"kept-{nproc}.pt"
    cmd = ([sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", str(nproc)] if nproc > 1
           else [sys.executable]) + [str(ROOT / "tests" / "helpers" / "kept_ckpt_worker.py"), "load", KEPT, str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out)


def test_a_checkpoint_saved_before_fsdp2_became_the_default_loads_on_it(tmp_path):
    """tests/data/builtin-2rank-20261207: 3 steps of the built-in 2-rank path, saved before
    FSDP2 became OffloadAdamW's default multi-rank path (tests/helpers/kept_ckpt_worker.py
    says how).  Loaded today on 2 ranks (the library shards the model with FSDP2) and on
    one: the masters are the checkpoint's as zero-offload-export reads them (an
    independent reader of the files), bit for bit, on both; the step counts are the
    saved ones; 2 more steps on 2 ranks log losses within 1e-2 of one rank's.
    (Mutation: fsdp2_checkpoint.flat_map placing each rank's piece one row early fails
    the masters.)"""
    from zero_offload.export import master_state_dict_from_checkpoint
    want = master_state_dict_from_checkpoint(KEPT)
    one, two = kept_load(tmp_path, 1), kept_load(tmp_path, 2)
    for got in (one, two):
        assert sorted(got["master"]) == sorted(want)
        assert all(torch.equal(got["master"][k], want[k]) for k in want), \
            [k for k in want if not torch.equal(got["master"][k], want[k])]
        assert got["updates"] == 3 and set(got["param_updates"]) == {3}
    for a, b in zip(two["losses"], one["losses"]):
        assert abs(a - b) / b < 1e-2, (two["losses"], one["losses"])
