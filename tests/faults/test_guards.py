"""Non-finite gradients, resource limits, security defaults, and a bounded soak."""
from __future__ import annotations

import filecmp
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from zero_offload.server import OptimizerServerError, ShardClient, spawn
from zero_offload.server import protocol as P
from zero_offload import OffloadConfig, OffloadEngine
from tests.helpers.dist_worker import global_batch, make_model
from tests.conftest import our_segments
from tests.faults.test_crashes import record

pytestmark = pytest.mark.timeout(300)


def train(eng, model, steps, start=1):
    for t in range(start, start + steps):
        x, y = global_batch(t)
        loss = torch.nn.functional.mse_loss(model(x.to(eng.compute_dtype)).float(), y)
        eng.backward(loss)
        eng.step()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("dpu", [False, True])
def test_nonfinite_gradient_skips_and_keeps_state(tmp_path, dtype, bad, dpu):
    """Documented behaviour, fp16 and bf16 alike: the step is skipped, the fp32 state is
    bitwise unchanged, and (fp16, dynamic scaling) the loss scale backs off."""
    model = make_model()
    with OffloadEngine(model, OffloadConfig(lr=1e-2, dtype=dtype, mode="dpu" if dpu else "exact",
                                            server={"threads": 1}, expert={"dpu_warmup_steps": 2})) as eng:
        train(eng, model, 4)
        eng.save_checkpoint(str(tmp_path / "a"))
        scale = eng.scaler.scale
        h = next(model.parameters()).register_hook(lambda g: g.index_fill(0, torch.tensor([1]), bad))
        train(eng, model, 1, start=5)
        h.remove()
        assert eng.skipped_steps == 1 and eng.updates == 4
        assert eng.scaler.scale == (scale / 2 if dtype == "fp16" else 1.0)
        eng.save_checkpoint(str(tmp_path / "b"))
        a = OffloadEngine.resolve_checkpoint(str(tmp_path / "a")) / "shard-r0-of-1.bin"
        b = OffloadEngine.resolve_checkpoint(str(tmp_path / "b")) / "shard-r0-of-1.bin"
        assert filecmp.cmp(a, b, shallow=False)
        train(eng, model, 3, start=6)
        master = torch.cat([v.reshape(-1) for v in eng.master_state_dict().values()])
        assert torch.isfinite(master).all() and eng.updates == 7


def test_shard_larger_than_ram_is_refused():
    with spawn(threads=1) as srv:
        with pytest.raises(OptimizerServerError, match="needs .* GiB of host RAM .* available") as e:
            ShardClient(srv.address, srv.token, numel=1 << 38, server_proc=srv.proc)
        assert e.value.code == P.E_RESOURCE and "ZERO_OFFLOAD_MAX_RAM_FRACTION=0" in str(e.value)


def test_ram_check_can_be_turned_off_for_machines_whose_ram_grows():
    """ZERO_OFFLOAD_MAX_RAM_FRACTION=0 (inherited by a server an engine spawns) skips
    the MemAvailable check; the /dev/shm check still refuses what cannot fit."""
    env = dict(os.environ, ZERO_OFFLOAD_MAX_RAM_FRACTION="0")
    with spawn(threads=1, env=env) as srv:
        with pytest.raises(OptimizerServerError, match="/dev/shm") as e:
            ShardClient(srv.address, srv.token, numel=1 << 38, server_proc=srv.proc)
        assert e.value.code == P.E_RESOURCE and "host RAM" not in str(e.value)
    bad = dict(os.environ, ZERO_OFFLOAD_MAX_RAM_FRACTION="lots")
    with pytest.raises(RuntimeError, match="max-ram-fraction"):
        spawn(threads=1, env=bad, ready_timeout_s=20, stderr=subprocess.PIPE)


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_and_readonly_disk_keep_previous_checkpoint(small_tmpfs):
    model = make_model()  # 6.5K params: a checkpoint is ~40 KiB, two do not fit in 96 KiB
    with OffloadEngine(model, OffloadConfig(lr=1e-2, dtype="bf16", server={"threads": 1})) as eng:
        train(eng, model, 2)
        first = Path(eng.save_checkpoint(str(small_tmpfs)))
        snapshot = {p.name: p.read_bytes() for p in first.iterdir()}
        train(eng, model, 2, start=3)
        with pytest.raises(OptimizerServerError, match="previous checkpoint is intact") as e:
            eng.save_checkpoint(str(small_tmpfs))
        assert "No space left" in str(e.value) or "space" in str(e.value).lower()
        assert (small_tmpfs / "latest").read_text() == first.name
        assert {p.name: p.read_bytes() for p in first.iterdir()} == snapshot
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
        with pytest.raises(OptimizerServerError, match="previous checkpoint is intact"):
            eng.save_checkpoint(str(small_tmpfs))
        assert {p.name: p.read_bytes() for p in first.iterdir()} == snapshot
        train(eng, model, 1, start=5)  # training goes on
    # and the intact checkpoint still loads
    model2 = make_model()
    with OffloadEngine(model2, OffloadConfig(lr=1e-2, dtype="bf16", server={"threads": 1})) as eng2:
        eng2.load_checkpoint(str(small_tmpfs))
        assert eng2.iteration == 2


def listening_sockets(pid: int) -> list[str]:
    """Addresses of TCP sockets in LISTEN state owned by pid."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                out.append(f[1])
    return out


def test_security_defaults(tmp_path):
    with spawn(threads=1) as srv:
        assert srv.address.startswith("ipc://")
        assert listening_sockets(srv.pid) == []  # nothing on any network interface
        d = os.path.dirname(srv.address[len("ipc://"):])
        assert os.stat(d).st_mode & 0o777 == 0o700
        assert os.stat(srv.address_file + ".token").st_mode & 0o777 == 0o600
        c = ShardClient(srv.address, srv.token, numel=100, server_proc=srv.proc)
        assert os.stat(f"/dev/shm/{c.segment_name}").st_mode & 0o777 == 0o600
        c.close()
        for token in ("", "wrong"):
            with pytest.raises(OptimizerServerError, match="token") as e:
                ShardClient(srv.address, token, numel=100, server_proc=srv.proc)
            assert e.value.code == P.E_AUTH
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with spawn(threads=1, address=f"tcp://:{port}") as srv:
        assert srv.address == f"tcp://127.0.0.1:{port}"
        ls = listening_sockets(srv.pid)
        assert ls == [f"0100007F:{port:04X}"], ls  # 127.0.0.1 only


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_soak_no_growth():
    steps, warm = 2000, 300
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x, y = torch.randn(8, 32), torch.randn(8, 4)
    samples = {}
    t0 = time.monotonic()
    with OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", mode="dpu", server={"threads": 1},
                                            expert={"dpu_warmup_steps": 5})) as eng:
        spid = eng._server.pid
        for t in range(1, steps + 1):
            loss = torch.nn.functional.mse_loss(model(x.to(eng.compute_dtype)).float(), y)
            eng.backward(loss)
            eng.step()
            if t in (warm, steps):
                samples[t] = {"worker_rss_kb": rss_kb(os.getpid()), "server_rss_kb": rss_kb(spid),
                              "worker_fds": len(os.listdir("/proc/self/fd")),
                              "server_fds": len(os.listdir(f"/proc/{spid}/fd")),
                              "shm": len(our_segments())}
    a, b = samples[warm], samples[steps]
    for k in a:
        assert b[k] <= a[k] * 1.01 + (64 if "rss" in k else 0), (k, a[k], b[k])  # 1% (+64 KiB of allocator noise)
    record("soak", {"steps": steps, "seconds": time.monotonic() - t0, "after_warmup": a, "end": b})
