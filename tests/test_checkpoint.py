"""Checkpoints: the directory protocol (tmp, rename, latest, retention, stale tmp-*),
checksums verified on load, the version check, and refusals in the middle of a step."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from zero_offload.server import checkpoint as C
from zero_offload.server.errors import OptimizerServerError
from zero_offload import OffloadConfig, OffloadEngine
from tests.helpers.models import flat_master, gpt, gpt_batch, train_engine

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg(**kw):
    return OffloadConfig(lr=3e-3, dtype="bf16", mode="dpu", server={"threads": 1}, expert={"dpu_warmup_steps": 3}, **kw)


def test_directory_protocol_latest_retention_and_stale_tmp(tmp_path):
    stale = tmp_path / "tmp-step-00000003"  # what a crashed save leaves
    stale.mkdir()
    (stale / "shard-r0-of-1.bin").write_bytes(b"half")
    with OffloadEngine(gpt(), cfg()) as eng:
        paths = []
        for k in range(3):
            train_engine(eng, gpt_batch, 2, "bf16", start=2 * k + 1)
            paths.append(eng.save_checkpoint(str(tmp_path), keep=2))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-00000004", "step-00000006"]  # the oldest pruned, no tmp-* left
    assert (tmp_path / "latest").read_text() == "step-00000006" and paths[-1].endswith("step-00000006")
    d = tmp_path / "step-00000006"
    man = json.loads((d / "shard-r0-of-1.json").read_text())
    assert man["checksum"] == C.file_checksum(d / "shard-r0-of-1.bin")
    meta = json.loads((d / "engine-r0-of-1.json").read_text())
    assert meta["version"] == C.ENGINE_VERSION and meta["stale"]  # DPU: a landed update is pending
    assert set(meta["checksums"]) == {"device16", "pending16"}


@pytest.mark.parametrize("victim", ["shard-r0-of-1.bin", "device16-r0-of-1.bin", "pending16-r0-of-1.bin"])
def test_a_flipped_bit_is_refused_naming_the_file(tmp_path, victim):
    model = gpt()
    with OffloadEngine(copy.deepcopy(model), cfg()) as eng:
        train_engine(eng, gpt_batch, 5, "bf16")
        d = eng.save_checkpoint(str(tmp_path))
    path = os.path.join(d, victim)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 3] ^= 0x10  # one bit, in m or v for the shard file
    open(path, "wb").write(bytes(data))
    with OffloadEngine(copy.deepcopy(model), cfg()) as eng:
        before = flat_master(eng)
        with pytest.raises((OptimizerServerError, C.CheckpointError), match=f"{victim} is corrupt"):
            eng.load_checkpoint(str(tmp_path))
        assert torch.equal(flat_master(eng), before)  # refused before anything was read into the state
        train_engine(eng, gpt_batch, 1, "bf16")       # and the engine trains on


def test_another_version_is_refused(tmp_path):
    with OffloadEngine(gpt(), cfg()) as eng:
        train_engine(eng, gpt_batch, 2, "bf16")
        d = eng.save_checkpoint(str(tmp_path))
        meta_path = os.path.join(d, "engine-r0-of-1.json")
        meta = json.loads(open(meta_path).read())
        meta["version"] = C.ENGINE_VERSION + 1
        open(meta_path, "w").write(json.dumps(meta))
        with pytest.raises(C.CheckpointError, match="version=2 but this version reads version=1"):
            eng.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("what", ["master_state_dict", "load_checkpoint", "save_checkpoint"])
def test_state_calls_between_backward_and_step_are_refused(tmp_path, what):
    """The staging window lies over gradient slot 0: GET_MASTER or LOAD there would
    overwrite the step's gradients (the master became NaN).  Refused, and the step
    then is bitwise the one a twin engine takes."""
    model = gpt()
    with OffloadEngine(copy.deepcopy(model), cfg()) as eng, OffloadEngine(copy.deepcopy(model), cfg()) as twin:
        train_engine(eng, gpt_batch, 2, "bf16")
        train_engine(twin, gpt_batch, 2, "bf16")
        eng.save_checkpoint(str(tmp_path))
        eng.backward(gpt_batch(3, "bf16")(eng.model))
        call = {"master_state_dict": lambda: eng.master_state_dict(),
                "load_checkpoint": lambda: eng.load_checkpoint(str(tmp_path)),
                "save_checkpoint": lambda: eng.save_checkpoint(str(tmp_path / "b"))}[what]
        with pytest.raises(RuntimeError, match="in the middle of a step .* call it after engine.step"):
            call()
        eng.step()
        train_engine(twin, gpt_batch, 1, "bf16", start=3)
        assert torch.equal(flat_master(eng), flat_master(twin))


def test_a_directory_not_every_rank_sees_is_refused(tmp_path):
    """Two ranks save to what are, for them, different directories (as node-local
    disks would be): rank 0 does not see rank 1's files, so nothing is published
    and both ranks raise the error naming the fix.  On the default path (FSDP2) every
    rank writes its rows into the same files, so each rank leaves a mark
    (fsdp2_checkpoint.SEEN) that rank 0 must see.  (Mutation: the marks not expected in
    _publish's commit: each rank publishes a file of holes, and says "saved".)"""
    cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "helpers", "dist_worker.py"), str(tmp_path), "unshared", "3"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(2):
        said = (tmp_path / f"unshared-rank{r}.txt").read_text()
        assert "not one filesystem for every rank" in said and "shared mount" in said, said
        assert not (tmp_path / f"ckpt-rank{r}" / "latest").exists()
    assert not list((tmp_path / "ckpt-rank0").glob("*step-*"))  # rank 0 removed its tmp-step-N


@pytest.mark.parametrize("role", ["shard", "engine"])
def test_a_crafted_world_size_in_a_file_name_is_refused_naming_the_file(tmp_path, role):
    """A checkpoint beside a file named `{role}-r0-of-999999999999.json`: the engine's load
    (the server's LOAD reads the shard files, the engine its own), zero-offload-export and
    load_into_torch_optimizer each refuse it naming the file, before building anything
    from that number (each made a list of 10^12 paths: out of memory), and the engine
    goes on from the state it had.  (Mutation: saved_world_sizes without its bound runs
    out of memory or past the test's timeout.)"""
    from zero_offload.export import main as export_main
    from zero_offload.torch_state import load_into_torch_optimizer
    model = gpt()
    with OffloadEngine(copy.deepcopy(model), cfg()) as eng:
        train_engine(eng, gpt_batch, 3, "bf16")
        d = eng.save_checkpoint(str(tmp_path / "ck"))
        crafted = os.path.join(d, f"{role}-r0-of-999999999999.json")
        with open(crafted, "w") as f:
            f.write("{}")
        before = flat_master(eng)
        with pytest.raises((OptimizerServerError, C.CheckpointError),
                           match=f"{role}-r0-of-999999999999.json names world size 999999999999"):
            eng.load_checkpoint(str(tmp_path / "ck"))
        assert torch.equal(flat_master(eng), before)
        train_engine(eng, gpt_batch, 1, "bf16", start=4)  # and it trains on
    if role == "engine":  # the export and the way back read the engine files' world size
        assert export_main([d, str(tmp_path / "out.safetensors")]) != 0
        torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with pytest.raises(C.CheckpointError, match="names world size 999999999999"):
            load_into_torch_optimizer(d, torch_opt, model)


def test_bad_group_values_in_the_engine_file_are_refused_before_the_server_loads(tmp_path):
    """The engine file's optimizer_proxy (the groups' lr, betas, eps, weight decay) is
    checked before LOAD replaces the server's state: a damaged value is refused naming
    it, and the master is what it was (it used to fail after LOAD: half loaded).
    (Mutation: the check moved after client.load leaves the master changed.)"""
    model = gpt()
    with OffloadEngine(copy.deepcopy(model), cfg()) as eng:
        train_engine(eng, gpt_batch, 3, "bf16")
        d = eng.save_checkpoint(str(tmp_path / "ck"))
        train_engine(eng, gpt_batch, 2, "bf16", start=4)  # away from the saved state
        meta_path = os.path.join(d, "engine-r0-of-1.json")
        meta = json.loads(open(meta_path).read())
        meta["optimizer_proxy"]["lr"] = -1.0
        open(meta_path, "w").write(json.dumps(meta))
        before = flat_master(eng)
        with pytest.raises(ValueError, match=r"param group 0 holds lr=-1\.0"):
            eng.load_checkpoint(str(tmp_path / "ck"))
        assert torch.equal(flat_master(eng), before)
        train_engine(eng, gpt_batch, 1, "bf16", start=6)


def test_retention_and_the_sweep_touch_only_their_own_directories(tmp_path):
    """`keep` prunes step-NNNNNNNN directories only, and a save sweeps only the
    tmp-step-NNNNNNNN ones a crash left: a user's step-best, another tool's tmp-x and
    a link named like a step stay.  (Mutation: pruning every step-* removes step-best.)"""
    tmp_path.joinpath("step-best").mkdir()
    tmp_path.joinpath("tmp-x").mkdir()
    tmp_path.joinpath("tmp-step-00000001").mkdir()  # a crashed save's
    other = tmp_path / "elsewhere"
    other.mkdir()
    os.symlink(other, tmp_path / "step-00000000")
    with OffloadEngine(gpt(), cfg()) as eng:
        for k in range(3):
            train_engine(eng, gpt_batch, 1, "bf16", start=k + 1)
            eng.save_checkpoint(str(tmp_path), keep=1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["elsewhere", "latest", "step-00000000", "step-00000003", "step-best", "tmp-x"], names
    assert other.is_dir()


def test_a_killed_calls_scratch_directory_is_swept_by_the_next(tmp_path, monkeypatch):
    """torch.save(opt.state_dict()) without state_dir goes through a temporary checkpoint
    in a scratch directory (runtime.scratch) that only a kill leaves behind: one whose
    process is gone (a real pid, reaped) is removed by the next such call, while one
    of a live process, a link and another prefix's stay.  (Mutation: sweep() not
    called from make(): the dead one stays.)"""
    import io
    from zero_offload import OffloadAdamW, scratch
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(p.stdout)  # a pid that ran and is gone
    host = scratch._host()
    stale = tmp_path / f"zero-offload-state-{host}-{dead}-abc123"
    (stale / "state").mkdir(parents=True)
    live = tmp_path / f"zero-offload-state-{host}-{os.getppid()}-def456"
    live.mkdir()
    other = tmp_path / f"zero-offload-fsdp2-{host}-{dead}-ghi789"
    other.mkdir()
    os.symlink(other, tmp_path / f"zero-offload-state-{host}-{dead}-link")
    model = gpt()
    with OffloadAdamW(model.parameters(), lr=1e-3, model=model, server={"threads": 1}) as opt:
        gpt_batch(1, "bf16")(model).backward()
        opt.step()
        torch.save(opt.state_dict(), io.BytesIO())
    names = sorted(n.name for n in tmp_path.iterdir() if n.name.startswith("zero-offload-"))
    assert names == sorted([live.name, other.name, f"zero-offload-state-{host}-{dead}-link"]), names


def test_a_save_prepares_the_next_background_saves_buffers_and_prunes_beside_training(tmp_path):
    """What keeps the steps around a background save at their speed (docs/checkpoint.md):
    a blocking save leaves the device weights' snapshot buffer made (on a lowest-priority
    thread), and the background save after it copies into that one; a background save
    published between steps (at a step's poll) leaves the superseded directory to the
    pruner's thread (unlinking GBs takes the file system about a second per 7 GB), and
    wait_checkpoint() returns with it gone.  (Mutations: prepare_snapshots not called
    after a blocking save; poll publishing with prune_later=False: fails.)"""
    with OffloadEngine(gpt(), cfg()) as eng:
        train_engine(eng, gpt_batch, 2, "bf16")
        eng.save_checkpoint(str(tmp_path), keep=1)
        ck = eng.checkpoints
        ck._wait_prepared()
        made = ck._snaps[0]
        dev, _, _ = eng._checkpoint_parts()
        assert made.shape == dev.shape and made.dtype == dev.dtype
        train_engine(eng, gpt_batch, 1, "bf16", start=3)
        path = eng.save_checkpoint(str(tmp_path), keep=1, background=True)
        ck.in_flight.writer.wait_copied()
        assert ck._snaps[0] is made
        k, until = 4, time.monotonic() + 60  # the server's word on its save comes with its heartbeat
        while eng.checkpoint_in_flight() and time.monotonic() < until:
            train_engine(eng, gpt_batch, 1, "bf16", start=k)
            k += 1
        assert not eng.checkpoint_in_flight() and ck.pruner._thread is not None  # step-2's removal beside training
        assert eng.wait_checkpoint() is None and ck.pruner._thread is None
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", os.path.basename(path)]
