"""Two nodes on this machine: two network namespaces joined by a veth pair (no address
outside the machine), zero-offload-launch --nnodes 2 in each (one optimizer server per
"node"), torchrun's rendezvous and gloo over the veth addresses, the FSDP2 worker of
tests/test_fsdp2.py.  Skipped, saying why, where the machine does not allow network
namespaces (not root, no `ip`)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import procs as live

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "helpers" / "fsdp2_worker.py"
SUBNET = "10.77.{}.{}"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_nodes():
    """Namespaces zoN-PID-0/1 with veth ends 10.77.X.1 and .2 (X from this process's pid,
    so parallel test workers do not collide); removed after the test."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): network namespaces cannot be made here")
    tag = os.getpid() % 10000
    names = [f"zon{tag}-{k}" for k in range(2)]
    veth = [f"zov{tag}{k}" for k in range(2)]  # at most 15 characters
    made = _ip("netns", "add", names[0])
    if made.returncode != 0:
        pytest.skip(f"network namespaces are not allowed here: {made.stderr.strip()}")
    subnet = tag % 250 + 1
    try:
        _ip("netns", "add", names[1])
        steps = [("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])]
        for k in range(2):
            steps += [("link", "set", veth[k], "netns", names[k]),
                      ("-n", names[k], "addr", "add", SUBNET.format(subnet, k + 1) + "/24", "dev", veth[k]),
                      ("-n", names[k], "link", "set", veth[k], "up"),
                      ("-n", names[k], "link", "set", "lo", "up")]
        for s in steps:
            r = _ip(*s)
            if r.returncode != 0:
                pytest.skip(f"`ip {' '.join(s)}` failed: {r.stderr.strip()}")
        yield names, veth, [SUBNET.format(subnet, k + 1) for k in range(2)]
    finally:
        for n in names:
            _ip("netns", "del", n)


def _start_nodes(names, veth, addrs, out: Path, mode: str, steps: int, port: int) -> list[subprocess.Popen]:
    procs = []
    for k in range(2):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=veth[k])
        cmd = ["ip", "netns", "exec", names[k], sys.executable, "-m", "zero_offload.launch", "--nnodes", "2",
               "--node-rank", str(k), "--master-addr", addrs[0], "--master-port", str(port), "--nproc-per-node", "1",
               str(WORKER), str(out), mode, str(steps)]
        log = open(out.parent / f"{out.name}-node{k}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def test_two_nodes_end_where_one_node_ends_and_a_dead_server_stops_both(two_nodes, tmp_path):
    """Two "nodes" of one rank each, over the veth pair: 6 steps of the FSDP2 worker end
    with the losses and masters of one node with two ranks, bitwise.  Then a longer run,
    and node 1's optimizer server SIGKILLed once training runs: both launchers exit
    non-zero within a minute, node 1's log names the dead server, and no process of the
    run is left.  (Mutation: the launcher not watching its server: node 1's log no longer
    says the server was killed by SIGKILL, only the worker's own error that it is gone.)"""
    names, veth, addrs = two_nodes
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", "2", str(WORKER),
                          str(tmp_path / "one"), "offload", "6"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    port = 29600 + os.getpid() % 300
    procs = _start_nodes(names, veth, addrs, tmp_path / "two", "offload", 6, port)
    rcs = [p.wait(240) for p in procs]
    assert rcs == [0, 0], [(tmp_path / f"two-node{k}.log").read_text()[-3000:] for k in range(2)]
    for r in range(2):
        a, b = torch.load(tmp_path / "two" / "offload" / f"rank{r}.pt"), torch.load(tmp_path / "one" / "offload" /
                                                                                  f"rank{r}.pt")
        assert a["losses"] == b["losses"], r
        assert all(torch.equal(a["master"][k], b["master"][k]) for k in b["master"]), r

    procs = _start_nodes(names, veth, addrs, tmp_path / "kill", "offload", 100000, port + 1)
    try:
        server = None
        deadline = time.monotonic() + 120
        while server is None and time.monotonic() < deadline:  # node 1's server, once its worker trains
            pids = _ip("netns", "pids", names[1]).stdout.split()
            for pid in pids:
                cmd = " ".join(live.argv(pid))
                if "zero_offload.server" in cmd or "zero-offload-server" in cmd:
                    server = int(pid)
            time.sleep(0.5)
        assert server is not None, "node 1's optimizer server never appeared"
        # training runs once the server maps a shard's segment (a HELLO: past the rendezvous,
        # the process group and FSDP2's wrapping), whatever this machine's speed
        while time.monotonic() < deadline and "/dev/shm/" not in Path(f"/proc/{server}/maps").read_text():
            time.sleep(0.2)
        assert "/dev/shm/" in Path(f"/proc/{server}/maps").read_text(), "node 1's worker never reached its server"
        time.sleep(2)  # a few steps
        os.kill(server, 9)
        t0 = time.monotonic()
        rcs = [p.wait(90) for p in procs]
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)
    logs = [(tmp_path / f"kill-node{k}.log").read_text() for k in range(2)]
    assert all(rc != 0 for rc in rcs), (rcs, logs[0][-2000:], logs[1][-2000:])
    assert took < 60, took
    assert "optimizer server" in logs[1] and "SIGKILL" in logs[1], logs[1][-3000:]
    time.sleep(1)
    assert live.matching(str(tmp_path)) == []  # none of the run's processes outlived it
