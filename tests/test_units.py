"""Unit tests of the small parts: the launcher's argument parsing and core split, the
loss scaler, the LR schedule, checkpoint range reading, the optimizer proxy's lr, and
the trace analysis."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from zero_offload.server import checkpoint as C
from zero_offload.server.reshard import read_range
from zero_offload import OffloadConfig
from zero_offload.demo.schedule import WarmupCosine
from zero_offload.launch import gpus_visible, parse, rendezvous, split_cores
from zero_offload.loss_scaler import LossScaler
from zero_offload.optimizer_proxy import ServerOptimizer
from zero_offload.trace_analysis import Span, bytes_per_step, has_server, hidden_fraction

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- launcher
def test_parse_splits_our_options_torchruns_and_the_script():
    opts, torch_opts, script = parse(["--nproc-per-node", "4", "--server-threads=3", "--nnodes", "2",
                                      "--standalone", "--rdzv-id=x", "--trace-dir", "/tmp/t", "train.py", "--lr",
                                      "1", "--nproc-per-node", "9"])
    assert opts["nproc"] == 4 and opts["server_threads"] == 3 and opts["trace_dir"] == "/tmp/t"
    assert torch_opts == ["--nnodes", "2", "--standalone", "--rdzv-id=x"]
    assert script == ["train.py", "--lr", "1", "--nproc-per-node", "9"]  # the script's own arguments stay its own


def test_a_single_node_job_meets_on_a_free_port_unless_told_otherwise():
    # torchrun's default 127.0.0.1:29500 would make two jobs on one machine collide
    assert rendezvous([]) == ["--standalone"]
    assert rendezvous(["--redirects=3"]) == ["--standalone", "--redirects=3"]
    for given in (["--nnodes", "2", "--master-addr", "h"], ["--master_port=1234"], ["--rdzv-endpoint", "h:1"],
                  ["--standalone"], ["--node-rank", "0"]):
        assert rendezvous(given) == given


@pytest.mark.parametrize("argv, msg", [
    (["--nproc-per-node", "0", "t.py"], "must be >= 1"),
    (["--max-restarts", "x", "t.py"], "must be an integer"),
    (["--nproc-per-node"], "needs a value"),
    (["--nnodes", "2"], "no training script"),
    (["--max_restarts", "3", "t.py"], "use --max-restarts N"),  # torchrun's spelling, refused and named
])
def test_parse_refuses_with_the_fix(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        parse(argv)


def test_gpus_visible_follows_the_device_nodes_and_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr("glob.glob", lambda pat: ["/dev/nvidia0"] if pat.startswith("/dev/nvidia") else [])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not gpus_visible()  # every device hidden
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpus_visible()
    monkeypatch.setattr("glob.glob", lambda pat: [])
    monkeypatch.setattr("os.path.exists", lambda p: False)
    assert not gpus_visible()  # no device node: a CPU machine


def test_split_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(8)))
    server, workers, st, wt = split_cores(2, 0, 0, cuda=False)  # CPU workers: one share each, the server one
    assert st == 2 and server == [0, 1] and workers == [2, 3, 4, 5, 6, 7] and wt == 3
    server, workers, st, wt = split_cores(2, 0, 0, cuda=True)   # GPU workers need little CPU
    assert st == 6 and workers == [6, 7] and wt == 1
    server, workers, st, wt = split_cores(1, 20, 5, cuda=False)  # asked for more than there is
    assert st == 8 and workers == list(range(8)) and wt == 5


# ----------------------------------------------------------------------------- loss scaler
def test_loss_scaler_follows_gradscaler_rules():
    s = LossScaler(dynamic=True, scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    s.update(True)
    assert s.scale == 256.0
    for _ in range(2):
        s.update(False)
    assert s.scale == 256.0
    s.update(False)
    assert s.scale == 1024.0 and s.good_steps == 0
    s.update(False)
    s.update(True)  # an overflow resets the clean-step count
    s.update(False)
    s.update(False)
    assert s.scale == 256.0
    t = LossScaler(dynamic=True, scale=1.0)
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.good_steps) == (s.scale, s.good_steps)
    fixed = LossScaler(dynamic=False, scale=8.0)
    fixed.update(True)
    assert fixed.scale == 8.0


def test_loss_scaler_for_config():
    s = LossScaler.for_config(OffloadConfig(dtype="fp16", loss_scaling={"initial_scale": 512.0, "growth_interval": 7}))
    assert s.dynamic and s.scale == 512.0 and s.growth_interval == 7
    assert LossScaler.for_config(OffloadConfig(dtype="bf16")).scale == 1.0
    f = LossScaler.for_config(OffloadConfig(dtype="fp16", loss_scaling={"scale": 64.0}))
    assert not f.dynamic and f.scale == 64.0


def test_loss_scaling_with_bf16_is_said_to_be_ignored():
    for kw in (dict(scale=64.0), dict(initial_scale=512.0), dict(growth_interval=7)):
        with pytest.warns(UserWarning, match="loss scaling is for fp16.*ignored"):
            cfg = OffloadConfig(dtype="bf16", loss_scaling=kw)
        assert LossScaler.for_config(cfg).scale == 1.0  # and it is indeed ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OffloadConfig(dtype="bf16")       # the defaults say nothing
        OffloadConfig(dtype="fp16", loss_scaling={"scale": 64.0})



# ----------------------------------------------------------------------------- config: groups, old names
# every flat name of the versions before the groups, a value for it, and where it lands
OLD_NAMES = [("loss_scale", 64.0, "loss_scaling.scale"), ("initial_scale", 512.0, "loss_scaling.initial_scale"),
             ("growth_factor", 4.0, "loss_scaling.growth_factor"),
             ("backoff_factor", 0.25, "loss_scaling.backoff_factor"),
             ("growth_interval", 7, "loss_scaling.growth_interval"),
             ("server_address", "ipc:///tmp/x", "server.address"), ("server_token", "t", "server.token"),
             ("server_threads", 3, "server.threads"), ("request_timeout_s", 9.0, "server.request_timeout_s"),
             ("compute_dtype", "fp32", "expert.compute_dtype"), ("dpu_warmup_steps", 5, "expert.dpu_warmup_steps"),
             ("dpu_predict", 1.0, "expert.dpu_predict"), ("dpu_grad_slots", 2, "expert.dpu_grad_slots"),
             ("bucket_numel", 4096, "expert.bucket_numel"), ("progress_block_numel", 64, "expert.progress_block_numel"),
             ("staging_numel", 100, "expert.staging_numel"), ("param_align_numel", 64, "expert.param_align_numel"),
             ("pin_host_memory", "off", "expert.pin_host_memory"), ("trace_dir", "/tmp/t", "expert.trace_dir"),
             ("cpu_zero_copy", False, "expert.cpu_zero_copy"), ("overlap_weights_up", False,
                                                                "expert.overlap_weights_up"),
             ("undo_log_bytes", 1 << 20, "expert.undo_log_bytes")]


def _get(cfg, dotted):
    group, name = dotted.split(".")
    return getattr(getattr(cfg, group), name)


def test_config_groups_cover_every_old_name():
    """The table above is every deprecated name the config knows (a new field that forgot
    its old name, or an old name left out here, fails)."""
    from zero_offload.config import DEPRECATED, MODE_SWITCHES
    assert {n for n, _, _ in OLD_NAMES} == set(DEPRECATED)
    assert set(MODE_SWITCHES) == {"dpu", "overlap_update"}
    assert {f"{g}.{f}" for g, f in DEPRECATED.values()} == {d for _, _, d in OLD_NAMES}


@pytest.mark.parametrize("old,value,new", OLD_NAMES, ids=[n for n, _, _ in OLD_NAMES])
def test_old_flat_name_maps_to_its_group_with_a_deprecation_warning(old, value, new):
    """Each old name sets its new field, warns naming it, and reads back (warning); given
    together with its group it is refused, naming the new field.  (Mutation: mapping an
    old name to a wrong field, or dropping the warning, fails here.)"""
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.") if "." in new else new):
        cfg = OffloadConfig(dtype="fp16", **{old: value})
    assert _get(cfg, new) == value
    with pytest.warns(DeprecationWarning, match=f"read {new}"):
        assert getattr(cfg, old) == value
    group = new.split(".")[0]
    with pytest.raises(ValueError, match=new.replace(".", r"\.")):
        OffloadConfig(dtype="fp16", **{old: value, group: {}})


@pytest.mark.parametrize("old,want", [
    (dict(dpu=True), ("dpu", "auto")), (dict(dpu=False), ("exact", "auto")),
    (dict(overlap_update=True), ("exact", "overlap_update")), (dict(overlap_update=False), ("exact", "sync")),
    (dict(undo_log_bytes=1 << 20), ("exact", "speculation")),
    (dict(overlap_update=True, undo_log_bytes=1 << 20), ("exact", "overlap_update+speculation")),
    (dict(dpu=True, undo_log_bytes=0), ("dpu", "auto")),
])
def test_old_mode_switches_name_the_mode_and_strategy(old, want):
    """dpu / overlap_update / undo_log_bytes > 0 were the mode: they map to mode and the
    exact strategy they meant (explicitly off: sync), each with a DeprecationWarning."""
    with pytest.warns(DeprecationWarning):
        cfg = OffloadConfig(**old)
    assert (cfg.mode, cfg.expert.exact_strategy) == want


def test_old_mode_switch_with_its_new_field_is_refused():
    with pytest.raises(ValueError, match="set mode only"):
        OffloadConfig(dpu=True, mode="dpu")
    with pytest.raises(ValueError, match="set expert.exact_strategy only"):
        OffloadConfig(overlap_update=True, expert={"bucket_numel": 4096})


def test_config_top_level_is_small_and_documented():
    """The user's level: at most ~12 fields and three groups, each field of every group
    with a docstring under it (the attribute docstrings are read from the source)."""
    import ast
    import dataclasses
    import inspect
    from zero_offload import config as C
    top = [f.name for f in dataclasses.fields(OffloadConfig)]
    assert len(top) <= 14 and {"mode", "loss_scaling", "server", "expert"} <= set(top), top
    tree = ast.parse(inspect.getsource(C))
    for cls in (C.OffloadConfig, C.LossScaling, C.ServerConnection, C.ExpertConfig):
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        body = node.body
        documented = {body[i].target.id for i in range(len(body) - 1)
                      if isinstance(body[i], ast.AnnAssign) and isinstance(body[i + 1], ast.Expr)
                      and isinstance(body[i + 1].value, ast.Constant) and isinstance(body[i + 1].value.value, str)}
        assert documented == {f.name for f in dataclasses.fields(cls)}, cls.__name__


def test_config_groups_accept_dicts_and_name_unknown_fields():
    cfg = OffloadConfig(server={"threads": 2}, expert={"bucket_numel": 4096})
    assert cfg.server.threads == 2 and cfg.expert.bucket_numel == 4096 and cfg.loss_scaling.scale == "dynamic"
    with pytest.raises(ValueError, match=r"expert: unknown field\(s\) \['bucket_size'\]"):
        OffloadConfig(expert={"bucket_size": 4096})

# ----------------------------------------------------------------------------- schedule, proxy
def test_warmup_cosine():
    s = WarmupCosine(peak=1.0, warmup=4, total=14, min_ratio=0.1)
    assert [s(k) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(14) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="peak lr"):
        WarmupCosine(peak=-1.0, warmup=0, total=1)


def test_optimizer_proxy_lr_for():
    opt = ServerOptimizer(OffloadConfig(lr=lambda k: 0.1 * k))
    assert opt.lr_for(3) == pytest.approx(0.3) and opt.param_groups[0]["lr"] == pytest.approx(0.3)
    opt = ServerOptimizer(OffloadConfig(lr=0.01))
    opt.param_groups[0]["lr"] = 0.5  # what a torch scheduler does
    assert opt.lr_for(7) == 0.5
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="finite float"):
        opt.lr_for(8)


# ----------------------------------------------------------------------------- checkpoint ranges
def _files(tmp_path, world, per_file, total):
    data = np.arange(total, dtype=np.float32)
    padded = np.zeros(world * per_file, np.float32)
    padded[:total] = data
    files = []
    for k in range(world):
        f = tmp_path / f"x-r{k}-of-{world}.bin"
        # two arrays per file, as the server writes master then state: [a_k | b_k]
        np.concatenate([padded[k * per_file:(k + 1) * per_file], -padded[k * per_file:(k + 1) * per_file]]).tofile(f)
        files.append(f)
    return files, padded


@pytest.mark.parametrize("lo, hi", [(0, 10), (3, 17), (9, 12), (20, 26), (0, 26)])
def test_read_range_across_files_and_into_the_padding(tmp_path, lo, hi):
    files, padded = _files(tmp_path, world=4, per_file=6, total=22)  # 22 real elements, padded to 24
    out = np.full(hi - lo, 7.0, np.float32)
    read_range(files, 6, 0, lo, hi, out)
    expect = np.zeros(hi - lo, np.float32)
    n = max(0, min(hi, 24) - lo)
    expect[:n] = padded[lo:lo + n]  # past the last file: zeros (a larger world's padding)
    np.testing.assert_array_equal(out, expect)
    read_range(files, 6, 6 * 4, lo, hi, out)  # the second array of every file (base in bytes)
    np.testing.assert_array_equal(out, -expect)


def test_read_range_refuses_a_short_file(tmp_path):
    files, _ = _files(tmp_path, world=2, per_file=6, total=12)
    files[1].write_bytes(files[1].read_bytes()[:8])
    with pytest.raises(OSError, match="unexpected end of file"):
        read_range(files, 6, 0, 0, 12, np.empty(12, np.float32))


def test_pick_world_size(tmp_path):
    with pytest.raises(C.CheckpointError, match="found nothing"):
        C.pick_world_size(tmp_path, "shard", 2)
    (tmp_path / "shard-r0-of-4.json").write_text("{}")
    assert C.pick_world_size(tmp_path, "shard", 2) == 4  # the only one there
    (tmp_path / "shard-r0-of-2.json").write_text("{}")
    assert C.pick_world_size(tmp_path, "shard", 2) == 2  # ours
    with pytest.raises(C.CheckpointError, match="one world size"):
        C.pick_world_size(tmp_path, "shard", 8)


# ----------------------------------------------------------------------------- trace analysis
def _span(name, role, ts, dur, rank=0, **args):
    return Span(name, role, rank, 1 if role == "worker" else 2, float(ts), float(dur), args)


def test_hidden_fraction_is_the_steady_state_overlap():
    spans = []
    for i in range(12):  # iterations of 100 us: forward [0, 30), backward [30, 80)
        t = 100 * i
        spans += [_span("iteration", "worker", t, 100), _span("forward", "worker", t, 30),
                  _span("backward", "worker", t + 30, 50)]
        # early updates (a synchronous warm-up) run after backward: nothing hidden;
        # the last ones start at 60 and end at 100: half hidden
        spans.append(_span("update", "server", t + 80, 20) if i < 6 else _span("update", "server", t + 60, 40))
    assert hidden_fraction(spans) == pytest.approx(0.5)  # the last 8 iterations (at least half the run)
    assert hidden_fraction(spans, since=float("-inf")) == pytest.approx(6 * 20 / (6 * 20 + 6 * 40))
    assert has_server(spans)
    workers_only = [s for s in spans if s.role == "worker"]
    assert not has_server(workers_only) and hidden_fraction(workers_only) is None  # said, not nan


def test_bytes_per_step():
    spans = [_span("iteration", "worker", 0, 10), _span("iteration", "worker", 10, 10),
             _span("grad_bucket", "worker", 1, 1, bytes=100), _span("grad_bucket", "worker", 11, 1, bytes=100),
             _span("weights_up", "worker", 2, 2, bytes=400, early=1), _span("weights_up", "worker", 12, 2, bytes=400),
             _span("update", "server", 3, 4, bytes=2800)]
    b = bytes_per_step(spans)
    assert b["to_host_B"] == 100 and b["to_device_B"] == 400 and b["to_device_early_B"] == 200
    assert b["to_device_GBps"] == pytest.approx(800 / 4e3) and b["update_GBps"] == pytest.approx(2800 / 4e3)
    assert bytes_per_step(spans[:4])["update_GBps"] is None


# ----------------------------------------------------------------------------- device choice
def test_cuda_device_without_cuda_is_the_intended_error(monkeypatch):
    """device="cuda" on a machine without CUDA: the error naming is_available(), not
    whatever torch.cuda.current_device() raises first."""
    import torch

    from zero_offload.devices import resolve_device
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="torch.cuda.is_available\\(\\) is False"):
        resolve_device("cuda", torch.device("cpu"))
    assert resolve_device("", torch.device("cpu")) == torch.device("cpu")


def test_a_launched_rank_takes_its_local_gpu(monkeypatch):
    """With LOCAL_RANK set, device="cuda" means that rank's GPU (torchrun numbers them), not GPU 0."""
    import torch

    from zero_offload.devices import resolve_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cuda", torch.device("cpu")) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", torch.device("cpu")) == torch.device("cuda", 1)
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device("cuda", torch.device("cpu")) == torch.device("cuda", 0)


def test_admission_counts_state_dtype_and_what_the_worker_frees(monkeypatch):
    """HELLO's host-RAM check: 12 B/param of fp32 state, 6 with bf16 state and the exact
    master, against MemAvailable plus the fp32 model the worker lets go of after INIT."""
    from zero_offload.server import admission
    from zero_offload.server import protocol as P
    from zero_offload.server.state import bytes_per_param
    assert bytes_per_param("adamw") == 12 and bytes_per_param("adamw", "bf16", True) == 6
    assert bytes_per_param("adamw", "bf16", False) == 8 and bytes_per_param("lion") == 8
    assert bytes_per_param("adamw", "int8", True) == 4 + 8 / 256  # codes, remainder, a scale per 256 each
    n = 1 << 30
    monkeypatch.setattr(admission, "read_mem_available", lambda: 14 * n)
    monkeypatch.setattr(admission, "shm_free_bytes", lambda: None)

    def hello(**kw):
        return P.Hello(version=P.PROTOCOL_VERSION, token="t", rank=0, world_size=1, numel=n, dtype="bf16",
                       optimizer="adamw", **kw)
    with pytest.raises(admission.Refused, match="state_dtype='bf16'"):  # 12 + 4 = 16 B > 0.9 * 14
        admission.admit(hello(), token="t", max_ram_fraction=0.9)
    admission.admit(hello(state_dtype="bf16", exact_master=True), token="t", max_ram_fraction=0.9)  # 10 B
    with pytest.raises(admission.Refused, match="frees"):
        admission.admit(hello(frees_bytes=2 * n), token="t", max_ram_fraction=0.9)  # 16 > 0.9 * 16
    admission.admit(hello(frees_bytes=4 * n), token="t", max_ram_fraction=0.9)  # 16 <= 0.9 * 18
    monkeypatch.setattr(admission, "read_mem_available", lambda: 9 * n)
    with pytest.raises(admission.Refused, match="state_dtype='int8'"):  # bf16: 10 B > 0.9 * 9, names int8
        admission.admit(hello(state_dtype="bf16", exact_master=True), token="t", max_ram_fraction=0.9)
    admission.admit(hello(state_dtype="int8", exact_master=True), token="t", max_ram_fraction=0.9)  # 8.03 B
    # the worker's own peak counts as taken (mutation: shard_need leaving it out admits this)
    with pytest.raises(admission.Refused, match="3.00 GiB of it the worker's own peak"):  # 8.03 + 3 > 0.9 * 9
        admission.admit(hello(state_dtype="int8", exact_master=True, worker_peak_bytes=3 * n), token="t",
                        max_ram_fraction=0.9)


def test_the_workers_peak_is_its_largest_gradient_or_all_of_them_or_a_cast():
    """HELLO.worker_peak_bytes, from the engine that sends it: its largest gradient in the
    compute dtype (2 B/element, 4 under fp32 compute), all of them with accumulation, and
    without zero-copy the cast of its largest parameter into its own flat16; a frozen
    parameter's cast when that is larger.  This is what made a 1.5e9-parameter embedding
    under fp32 compute refused at HELLO instead of killed by the OOM killer in set-up
    (BENCHMARKS.md).  (Mutation: counting 2 B whatever the compute dtype fails the fp32
    rows.)"""
    import torch
    from zero_offload import OffloadEngine, wiring

    def peak(compute="bf16", accum=1, frozen=False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 300))
        if frozen:
            model[0].requires_grad_(False)  # the 8000-element embedding: the largest trained is 2400
        cfg = OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1}, grad_accumulation_steps=accum,
                            expert={"compute_dtype": compute})
        with OffloadEngine(model, cfg) as eng:
            return wiring.worker_peak_bytes(eng, cfg), eng.flat.numel
    got, total = peak()
    assert got == 8000 * 2  # the embedding's gradient in bf16; zero-copy: no cast of its own
    assert peak("fp32")[0] == 8000 * 4  # fp32 gradient, and the cast into the worker's fp32 flat16
    assert peak(accum=2)[0] == total * 2  # every gradient, kept until the last micro-batch
    assert peak("fp32", accum=2)[0] == total * 4
    assert peak(frozen=True)[0] == 8000 * 2  # its bf16 copy beside the fp32 one, more than 2400 x 2
    assert peak("fp32", frozen=True)[0] == 8000 * (2 + 4)  # and its fp32 copy of that


# ----------------------------------------------------------------------------- gradients down: the ready scan
class _Event:
    """What the scan asks of a CUDA event: has it passed."""

    def __init__(self, passed: bool):
        self.passed = passed

    def query(self) -> bool:
        return self.passed


def test_ready_scan_passes_buckets_outside_the_shard():
    """Rank 1 of 2 (shard [40, 80)): the buckets before its shard never get a copy event
    (nothing of them goes down from this rank), and must not stop the scan; a bucket in
    the shard counts once its event has passed.  (Mutation: requiring an event for every
    bucket, the old scan, stops at 0 here: that rank never speculates.)"""
    from zero_offload.flat import Bucket
    from zero_offload.grads_down import ready_buckets
    bs = [Bucket(index=i, lo=20 * i, hi=20 * i + 20) for i in range(4)]  # flat [0, 80)
    events = [None, None, _Event(True), _Event(False)]
    assert ready_buckets(bs, 0, 4, events, 40, 80) == 3   # bucket 3's copy still runs
    assert ready_buckets(bs, 0, 2, events, 40, 80) == 2   # only [0, 2) complete in backward
    events[3].passed = True
    assert ready_buckets(bs, 0, 4, events, 40, 80) == 4
    # rank 0 (shard [0, 40)): its own buckets need their events; the later ones have no part
    assert ready_buckets(bs, 0, 4, [_Event(True), None, None, None], 0, 40) == 1
    assert ready_buckets(bs, 0, 4, [_Event(True), _Event(True), None, None], 0, 40) == 4
    # a bucket straddling the shard's start has a part: it waits for its event
    bs2 = [Bucket(index=0, lo=0, hi=50), Bucket(index=1, lo=50, hi=80)]
    assert ready_buckets(bs2, 0, 2, [None, _Event(True)], 40, 80) == 0
