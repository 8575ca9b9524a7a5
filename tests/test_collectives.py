"""runtime.distributed on 2 CPU ranks: both the gloo path and the NCCL-style path (fp32
reduce to each shard's owner, run over gloo) with ranks that complete their buckets in
different orders, a padded last shard, an fp16 gradient whose 16-bit sum would
overflow, and the windowed gather of the master."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from zero_offload.distributed import backend_for

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("config, device, want", [
    ("nccl", "cuda", "nccl"), ("gloo", "cpu", "gloo"),
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"),   # init_process_group() with no backend named, on a GPU machine
    ("cpu:gloo,cuda:nccl", "cpu", "gloo"), ("cpu:gloo", "cuda", ""),
])
def test_backend_for(config, device, want):
    assert backend_for(config, device) == want


def run(tmp_path, modes):
    """One launch of 2 ranks running each mode in turn; per mode, each rank's results and master."""
    cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "helpers", "collective_worker.py"), str(tmp_path), ",".join(modes)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return {mode: ([json.loads((tmp_path / f"{mode}-r{r}.json").read_text()) for r in range(2)],
                   [torch.load(tmp_path / f"{mode}-master-r{r}.pt") for r in range(2)]) for mode in modes}


def test_gloo_and_owner_reduce_agree_in_any_bucket_order(tmp_path):
    res = {}
    for mode, (info, masters) in run(tmp_path, ("gloo", "owner")).items():
        for r in range(2):
            assert info[r]["skipped"] == 0, (mode, info[r])  # 2 x 40000 summed in fp32, not in 16 bits
            assert info[r]["windowed_equal"], mode              # windows of 7 assemble the same master
        assert info[0]["rank0_only_len"] > 0 and info[1]["rank0_only_len"] == 0
        last = info[1]
        assert last["pad"] > 0 and last["master_pad"] == [0.0] * last["pad"], last  # padding stays zero
        assert last["grad_pad"] == [0] * last["pad"], last
        assert torch.equal(masters[0], masters[1]) and torch.isfinite(masters[0]).all()
        res[mode] = masters[0]
    # the NCCL-style path (fp32 sum at the owner) gives bitwise the gloo path's result
    assert torch.equal(res["gloo"], res["owner"])
