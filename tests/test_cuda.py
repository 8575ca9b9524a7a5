"""The CUDA path: page-locked shared segments, side-stream gradient copies, weight copies.

Marked `cuda` and skipped without a CUDA device; scripts/gpu_check.sh runs them
on a lent GPU.  The references are the same plain-PyTorch ones as the CPU tests,
run on the GPU.
"""
from __future__ import annotations


import pytest
import torch

from runtime import OffloadConfig, OffloadEngine
from tests.conftest import our_segments
from tests.helpers.reference import rel_err
from tests.helpers.models import gpt, gpt_batch, mlp, mlp_batch, run_pair, train_engine

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_segment_is_page_locked_then_released():
    model = mlp().cuda()
    eng = OffloadEngine(model, OffloadConfig(dtype="bf16", server_threads=1))
    seg = eng.client.segment_name
    assert eng._pinned is not None
    assert eng.grads.host[0].is_pinned() and eng.cycle._host[0].is_pinned()  # cudaHostRegister'ed
    train_engine(eng, mlp_batch, 3, "bf16")
    eng.close()
    assert eng._pinned is None  # unregistered before the segment goes
    assert seg not in our_segments()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("dpu", [None, 4])
def test_cuda_matches_reference(dtype, dpu):
    p0, master, ref_master, losses, ref_losses, _ = run_pair(gpt, gpt_batch, dtype, steps=20, dpu=dpu,
                                                             device="cuda")
    assert rel_err(master - p0, ref_master - p0) < 1e-4
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-2 * abs(b)


@pytest.mark.parametrize("dpu", [None, 3])
def test_cuda_weights_up_block_by_block_match_reference(dpu):
    """Weights go up in many small pieces on their own stream, while the update runs
    (sync) or inside the next backward behind the bucket's kernels (DPU)."""
    p0, master, ref_master, _, _, st = run_pair(gpt, gpt_batch, "bf16", steps=12, dpu=dpu, device="cuda",
                                                bucket_numel=1024, progress_block=100)
    assert rel_err(master - p0, ref_master - p0) < 1e-4
    copied = st["updates"] - (1 if dpu else 0)
    assert st["bytes_to_device"] == 2 * st["shard_numel"] * copied


def test_cuda_dpu_copies_weights_inside_backward():
    p0, master, ref_master, _, _, st = run_pair(gpt, gpt_batch, "bf16", steps=10, dpu=3, device="cuda",
                                                land_early=True, bucket_numel=1024, progress_block=100)
    assert rel_err(master - p0, ref_master - p0) < 1e-4
    assert st["bytes_to_device_early"] >= 2 * st["shard_numel"] * (st["updates"] - 3)


def test_pageable_host_memory_matches_reference():
    """pin_host_memory="off" (what "auto" falls back to when page-locking is refused)."""
    p0, master, ref_master, _, _, _ = run_pair(gpt, gpt_batch, "bf16", steps=10, dpu=3, device="cuda", pin="off",
                                               bucket_numel=1024, progress_block=100)
    assert rel_err(master - p0, ref_master - p0) < 1e-4


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_many_small_buckets_equal_one_bucket(dtype):
    """Side-stream copies of many buckets during backward land exactly what one bucket does."""
    out = []
    for bucket in (1024, 1 << 24):
        torch.manual_seed(0)
        model = gpt().cuda()
        with OffloadEngine(model, OffloadConfig(lr=1e-3, dtype=dtype, bucket_numel=bucket,
                                                server_threads=1)) as eng:
            assert (len(eng.flat.buckets) > 10) == (bucket == 1024)
            train_engine(eng, gpt_batch, 5, dtype)
            out.append(torch.cat([v.reshape(-1) for v in eng.master_state_dict().values()]))
    assert torch.equal(out[0], out[1])


def test_model_built_on_cpu_trains_on_gpu():
    """device="cuda" with an fp32 model on the CPU: only 16-bit weights reach the GPU."""
    model = gpt()
    n = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", device="cuda", server_threads=1)) as eng:
        assert next(model.parameters()).is_cuda
        train_engine(eng, gpt_batch, 3, "bf16")
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - base <= 2 * eng.flat.padded_numel + (1 << 20)
    assert n == eng.flat.numel
