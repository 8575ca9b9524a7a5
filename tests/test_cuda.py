"""The CUDA path: page-locked shared segments, side-stream gradient copies, weight copies.

Marked `cuda` and skipped without a CUDA device; scripts/gpu_check.sh runs them
on a lent GPU.  The references are the same plain-PyTorch ones as the CPU tests,
run on the GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

from zero_offload import OffloadConfig, OffloadEngine
from tests.conftest import our_segments
from tests.helpers.reference import rel_err
from tests.helpers.models import gpt, gpt_batch, mlp, mlp_batch, run_pair, train_engine

# gpu_check.sh sets 30 s: one hung test must not eat a lent GPU's whole budget
TIMEOUT_S = int(os.environ.get("ZERO_OFFLOAD_TEST_TIMEOUT_S", "300"))
# an unregister that fails is a defect here, not a warning to read past
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(TIMEOUT_S),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.filterwarnings("error:cudaHostUnregister:RuntimeWarning")]


def _warm_cublas() -> None:
    """cuBLAS takes its workspaces (32 MiB on Hopper) from the caching allocator the first
    time a thread multiplies, once in this thread and once in autograd's device thread:
    before any memory baseline, or a bound passes only when an earlier test warmed it."""
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    (x @ x).sum().backward()
    (x.detach().bfloat16() @ x.detach().bfloat16()).sum().item()
    torch.cuda.synchronize()


def _lagged(stream) -> None:
    """~10 ms of GPU sleep queued on a side stream: a copy queued after it runs late, so a
    reader not ordered after that copy (a missing wait or host sync) reads old bytes."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)


@pytest.fixture
def lagging_side_streams(monkeypatch):
    """Every copy on a side stream runs late: the gradient copies down (copy stream), the
    weights going up block by block (weights-up stream) and overlap_update's per-module
    copies (the same stream)."""
    from zero_offload import grads_down, overlap, weights_up
    bucket_done, copy, expose = (grads_down.DeviceBucketStep._bucket_done, weights_up.WeightReturn._copy,
                                 overlap.ForwardPipeline._expose)

    def lag_bucket(self, b):
        _lagged(self.d.copy_stream)
        return bucket_done(self, b)

    def lag_copy(self, lo, hi, early):
        _lagged(self.stream)
        return copy(self, lo, hi, early)

    def lag_expose(self, spans):
        if self._stream is not None:
            _lagged(self._stream)
        return expose(self, spans)

    monkeypatch.setattr(grads_down.DeviceBucketStep, "_bucket_done", lag_bucket)
    monkeypatch.setattr(weights_up.WeightReturn, "_copy", lag_copy)
    monkeypatch.setattr(overlap.ForwardPipeline, "_expose", lag_expose)


def test_segment_is_page_locked_then_released():
    model = mlp().cuda()
    eng = OffloadEngine(model, OffloadConfig(dtype="bf16", server={"threads": 1}))
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
        with OffloadEngine(model, OffloadConfig(lr=1e-3, dtype=dtype, server={"threads": 1},
                                                expert={"bucket_numel": bucket})) as eng:
            assert (len(eng.flat.buckets) > 10) == (bucket == 1024)
            train_engine(eng, gpt_batch, 5, dtype)
            out.append(torch.cat([v.reshape(-1) for v in eng.master_state_dict().values()]))
    assert torch.equal(out[0], out[1])


def test_model_built_on_cpu_trains_on_gpu():
    """device="cuda" with a ~25M-parameter fp32 model on the CPU: only 16-bit weights reach
    the GPU (a full fp32 copy would be 100 MB over the bound, far outside its slack)."""
    from zero_offload.demo.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=8, d_model=704, seq_len=64))
    n = sum(p.numel() for p in model.parameters())
    _warm_cublas()
    base = torch.cuda.memory_allocated()
    with OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", device="cuda", server={"threads": 2})) as eng:
        assert next(model.parameters()).is_cuda
        train_engine(eng, gpt_batch, 2, "bf16")
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        assert held <= 2 * eng.flat.padded_numel * 1.05 + (4 << 20), held / n
    assert n == eng.flat.param_numel


# ----------------------------------------------------------------------------- tests that can fail on a GPU
class _Lag(torch.autograd.Function):
    """Identity whose backward first queues a long sleep on the compute stream: the
    hooks of the parameters behind it run while the GPU is still far behind, so a
    copy not ordered after the compute stream (a missing wait_stream or
    record_stream) reads gradients that are not written yet."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU cycles
        return g


class _LaggingGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = gpt()

    def forward(self, idx, targets=None):
        m = self.inner
        B, T = idx.shape
        x = _Lag.apply(m.tok(idx) + m.pos(torch.arange(T, device=idx.device)))
        for b in m.blocks:
            x = _Lag.apply(b(x))
        logits = m.head(m.ln_f(x))
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


@pytest.mark.parametrize("dpu", [None, 3])
def test_cuda_ordering_with_a_lagging_gpu(dpu):
    p0, master, ref_master, losses, ref_losses, st = run_pair(_LaggingGPT, gpt_batch, "bf16", steps=8, dpu=dpu,
                                                              device="cuda", bucket_numel=1024, progress_block=100)
    assert rel_err(master - p0, ref_master - p0) < 1e-4
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-2 * abs(b)


def test_cuda_one_gradient_slot_waits_for_a_slow_server(monkeypatch):
    """The one-slot DPU gate on the GPU path: bitwise the two-slot run, and it waited."""
    from tests.test_engine import _Tables
    monkeypatch.setenv("ZERO_OFFLOAD_SIMD", "scalar")  # the server's update, several times slower
    results = []
    for slots in (1, 2):
        model = _Tables().cuda()
        cfg = OffloadConfig(lr=1e-2, dtype="bf16", mode="dpu", server={"threads": 1},
                            expert={"dpu_warmup_steps": 2, "dpu_grad_slots": slots, "progress_block_numel": 1 << 16})
        with OffloadEngine(model, cfg) as eng:
            for t in range(1, 7):
                idx = torch.randint(0, 1 << 18, (64,), generator=torch.Generator().manual_seed(t)).cuda()
                eng.backward(model(idx) / 64)
                eng.step()
            results.append((torch.cat([v.reshape(-1) for v in eng.master_state_dict().values()]),
                            eng.stats()["grad_slot_wait_s"]))
    (m1, wait1), (m2, wait2) = results
    assert torch.equal(m1, m2)
    assert wait1 > 0 and wait2 == 0


def test_device_memory_of_a_25m_model_is_the_16_bit_weights():
    """~25M parameters built on the CPU: after a step the device holds the 16-bit
    weights (2 B/param) and little else; a full fp32 copy (4 B/param) would show."""
    from zero_offload.demo.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=8, d_model=704, seq_len=64))
    n = sum(p.numel() for p in model.parameters())
    assert n > 20_000_000
    _warm_cublas()
    base = torch.cuda.memory_allocated()
    with OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", device="cuda", server={"threads": 4})) as eng:
        train_engine(eng, gpt_batch, 2, "bf16")
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        assert held <= 2 * eng.flat.padded_numel * 1.05 + (4 << 20), held / n


@pytest.mark.parametrize("sd,dpu", [("bf16", None), ("bf16", 3), ("int8", None), ("int8", 3)])
def test_cuda_compact_state_matches_the_cpu_device(sd, dpu):
    """The compact state on a GPU: the exact master's weights slot is copied up and never
    written by the engine; int8 shards are whole blocks.  Against the same run with the
    CPU as the device (the kernels and the server are the same; only the forward and
    backward run elsewhere, so the gradients differ by their matmuls' rounding)."""
    from tests.helpers.models import flat_master
    res = {}
    for device in ("cpu", "cuda"):
        model = gpt()
        p0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        cfg = OffloadConfig(lr=3e-3, weight_decay=0.01, dtype="bf16", mode="dpu" if dpu is not None else "exact",
                            server={"threads": 1}, expert={"dpu_warmup_steps": dpu or 1}, state_dtype=sd)
        with OffloadEngine(model.to(device), cfg) as eng:
            assert eng.cfg.exact_master
            losses = train_engine(eng, gpt_batch, 20, "bf16")
            res[device] = (losses, flat_master(eng).cpu())
    assert rel_err(res["cuda"][1] - p0, res["cpu"][1] - p0) < (0.3 if sd == "int8" else 0.1)
    assert max(abs(a - b) for a, b in zip(res["cuda"][0], res["cpu"][0])) < 0.05


@pytest.mark.parametrize("undo", [0, 1 << 26], ids=["overlap", "overlap-spec"])
def test_cuda_overlap_and_speculation_are_bitwise_sync(tmp_path, undo):
    """On the GPU: overlap_update's per-module copies up during the forward, and speculation
    announcing a bucket only once the copy stream's event for it has passed (and only after
    the forward's copies from the slot it rewrites have run).  Against sync on the GPU; an
    MLP, whose matmuls repeat bit for bit run to run (an embedding's backward need not)."""
    from tests.helpers.overlap_runs import assert_bitwise, run
    # clip 0.2: the MLP's norms run 0.14-0.28 (on the CPU device), so it fires on some steps
    kw = dict(device="cuda", clip_grad_norm=0.2, bucket_numel=1024, cpu_zero_copy=False)
    sync = run(tmp_path, mlp, mlp_batch, "bf16", False, **kw)
    over = run(tmp_path, mlp, mlp_batch, "bf16", True, undo_log_bytes=undo, **kw)
    assert_bitwise(over, sync, kw)
    if undo:
        assert over[4]["spec_steps"] > 0, over[4]


@pytest.mark.parametrize("dpu", [None, 3])
def test_cuda_side_stream_copies_that_run_late_are_waited_for(lagging_side_streams, dpu):
    """Each gradient copy down and each weights copy up queued ~10 ms late on its side
    stream: the engine must still read only finished bytes (the host sync before the
    server reads the gradient slot, the compute stream's wait for the weights)."""
    p0, master, ref_master, losses, ref_losses, st = run_pair(gpt, gpt_batch, "bf16", steps=6, dpu=dpu,
                                                              device="cuda", bucket_numel=4096,
                                                              progress_block=2048, zero_copy=False)
    assert rel_err(master - p0, ref_master - p0) < 1e-4
    assert st["bytes_to_device"] > 0


class _SideBranch(torch.nn.Module):
    """Three layers whose middle one runs on a side stream (side: a torch.cuda.Stream, or
    None: all on the current stream), its backward queued behind ~10 ms of GPU sleep: its
    gradients reach the engine's hooks on that stream, late, and their bucket's last hook
    (the first layer's) on the current one."""

    def __init__(self, side):
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)
        self.side = side

    def forward(self, x):
        h = self.a(x)
        if self.side is None:
            return self.head(h + self.b(h))
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            s = self.b(h)
        main.wait_stream(self.side)
        s.register_hook(self._late)
        return self.head(h + s)

    def _late(self, g):
        _lagged(self.side)  # before the side layer's backward kernels, which autograd queues there
        return g


def test_cuda_gradients_from_a_side_stream_are_waited_for():
    """A model with a layer on a side stream (forward and backward; the backward late):
    the gradient bucket it shares with layers on the current stream goes down only after
    every writer's stream (DeviceBucketStep._writing), so 5 steps end with the masters
    bitwise those of the same model on one stream.  (Mutation: _bucket_done waiting for the
    last hook's stream only, as before: the side layer's gradient is read before it is
    copied.)"""
    out = []
    for side in (None, torch.cuda.Stream()):
        torch.manual_seed(0)
        model = _SideBranch(side).cuda()
        with OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1})) as eng:
            assert len(eng.flat.buckets) == 1  # the side layer's gradient and the others' in one bucket
            g = torch.Generator().manual_seed(7)
            for _ in range(5):
                x = torch.randn(32, 64, generator=g).cuda().bfloat16()
                y = torch.randint(0, 8, (32,), generator=g).cuda()
                eng.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
                eng.step()
            out.append(torch.cat([v.reshape(-1) for v in eng.master_state_dict().values()]))
    assert torch.equal(out[0], out[1])


def test_cuda_overlap_copies_that_run_late_are_waited_for(tmp_path, lagging_side_streams):
    """overlap_update's per-module copies up on the weights-up stream, each queued late:
    the module's forward must wait for its own copy (bitwise sync)."""
    from tests.helpers.overlap_runs import assert_bitwise, run
    kw = dict(device="cuda", bucket_numel=1024, cpu_zero_copy=False)
    sync = run(tmp_path, mlp, mlp_batch, "bf16", False, **kw)
    over = run(tmp_path, mlp, mlp_batch, "bf16", True, **kw)
    assert_bitwise(over, sync, kw)


def test_cuda_weights_read_between_step_and_forward_under_overlap(lagging_side_streams):
    """Under overlap_update the update lands during the next forward; code that reads the
    weights after step() (an EMA) calls engine.synchronize(copy_weights=True) first (README,
    "exact").  With every copy up queued late and no host sync in the loop (no float() of
    the loss), the EMA of the weights and the masters after 8 steps are bitwise those of
    the synchronous strategy.  (Mutations: synchronize not finishing the forward
    pipeline; UpdateCycle.send not waiting for the copies from the incoming slot before
    the next STEP lets the server rewrite it: either reads other weights.)"""
    out = []
    for strategy in ("sync", "overlap_update"):
        model = mlp().cuda()
        cfg = OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1},
                            expert={"exact_strategy": strategy, "bucket_numel": 1024})
        with OffloadEngine(model, cfg) as eng:
            ema = None
            for t in range(1, 9):
                eng.backward(mlp_batch(t, "bf16")(model))
                eng.step()
                eng.synchronize(copy_weights=True)
                w = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
                ema = w.clone() if ema is None else ema.mul_(0.9).add_(w, alpha=0.1)
            if strategy == "overlap_update":
                assert eng.stats()["overlap_steps"] > 0
            out.append((ema.cpu(), torch.cat([v.reshape(-1) for v in eng.master_state_dict().values()])))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])


def fsdp2_run(tmp_path, kind: str, dpu: bool, device: str = "cuda", steps: int = 8) -> dict:
    """One rank in this process (NCCL on CUDA, gloo on the CPU): the demo GPT, fully_shard
    on each block and the root, bf16 shards with MixedPrecisionPolicy(bf16, fp32), two
    param groups, clipping at 0.5; kind "offload" (OffloadAdamW) or "ref" (FSDP2 with
    torch.optim.AdamW over fp32 masters fed the same gradients: tests/helpers/fsdp2_worker).
    Returns the losses, the final masters by name and the local shards' dtypes and devices."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tests.helpers import fsdp2_worker as W
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(str(tmp_path / f"store-{kind}-{dpu}"), 1), rank=0,
                            world_size=1)
    try:
        model = gpt().to(device=device, dtype=torch.bfloat16)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            fully_shard(b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        if kind == "ref":
            opt = W.Reference(model, dpu)
        else:
            from zero_offload import OffloadAdamW
            kw = dict(mode="dpu", expert={"dpu_warmup_steps": W.DPU_WARMUP}) if dpu else {}
            opt = OffloadAdamW(W.groups(model), lr=W.LR, betas=(0.9, 0.99), weight_decay=0.1, model=model,
                               server={"threads": 1}, **kw)
        losses = []
        for t in range(1, steps + 1):
            loss = gpt_batch(t, "bf16")(model)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), W.CLIP)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach().float()))
        master = {k: v.float().cpu() for k, v in opt.master_state_dict().items()}
        local = {n: (p.to_local().dtype, p.to_local().device.type) for n, p in model.named_parameters()}
        in_flat16 = 0
        if kind != "ref":  # the local shards the engine's device weights themselves (one rank: all of them)
            f = opt.engine.flat16
            lo, hi = f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()
            in_flat16 = sum(lo <= p.to_local().data_ptr() < hi for p in model.parameters())
            opt.close()
        return {"losses": losses, "master": master, "local": local, "in_flat16": in_flat16}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dpu", [False, True])
def test_cuda_fsdp2_matches_fsdp2_with_torch_adamw(tmp_path, lagging_side_streams, dpu):
    """OffloadAdamW on an FSDP2 model on the GPU, every side-stream copy queued late:
    FSDP2's gradient shards reach the host after their reduce-scatter, and the new
    weights reach the local shards before the next all-gather; losses within 1e-2 and
    masters within 10% of how far the reference moved them; the local shards stay bf16
    on the GPU, as views of the engine's device weights (one copy of them on the device:
    LocalShards.alias)."""
    ref = fsdp2_run(tmp_path, "ref", dpu)
    res = fsdp2_run(tmp_path, "offload", dpu)
    p0 = {n: p.detach().float() for n, p in gpt().to(torch.bfloat16).named_parameters()}
    a, b = torch.tensor(res["losses"]), torch.tensor(ref["losses"])
    assert ((a - b).abs() / b.abs()).max() < 1e-2, (a, b)
    d = torch.cat([(res["master"][k] - ref["master"][k]).reshape(-1) for k in sorted(p0)])
    moved = torch.cat([(ref["master"][k] - p0[k]).reshape(-1) for k in sorted(p0)])
    assert float(d.norm() / moved.norm()) < 0.10
    assert all(v == (torch.bfloat16, "cuda") for v in res["local"].values()), res["local"]
    assert res["in_flat16"] == len(res["local"]), res["in_flat16"]
