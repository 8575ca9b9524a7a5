"""The security review's findings, each reproduced: files others could touch, the
segment registry, admission that adds up, manifests and `latest` taken on their
word, signals that left files behind, binds and paths."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import numpy as np
import pytest
import zmq

from zero_offload.server import ShardClient, spawn
from zero_offload.server import protocol as P
from zero_offload.server.admission import read_mem_available
from zero_offload.server.checkpoint import CheckpointError, resolve
from zero_offload.server.config import ServerConfig
from zero_offload.server.errors import OptimizerServerError
from zero_offload.server.shm import Segment

pytestmark = pytest.mark.timeout(180)


def _hello_reply(address: str, **over) -> P.Message:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    f = dict(version=P.PROTOCOL_VERSION, token=over.pop("token"), rank=0, world_size=1, numel=1024, dtype="fp16",
             optimizer="adamw", pid=os.getpid())
    f.update(over)
    s.send(P.Hello(**f).encode())
    assert s.poll(30_000), "no reply to HELLO"
    reply = P.decode(s.recv())
    s.close()
    ctx.term()
    return reply


def test_a_precreated_or_symlinked_temp_file_gets_nothing(tmp_path):
    """The fixed temp names of before (ADDR.token.tmp opened O_CREAT|O_TRUNC): a file made
    there in advance received the token, and a link there made the server overwrite its
    target.  Now the temp names are random and opened O_EXCL|O_NOFOLLOW."""
    addr = tmp_path / "zo.addr"
    spy = tmp_path / "zo.addr.token.tmp"
    spy.write_text("")
    os.chmod(spy, 0o666)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "zo.addr.tmp")
    os.symlink(victim, tmp_path / "zo.addr.segments.tmp")
    with spawn(threads=1, address_file=str(addr)) as srv:
        assert spy.read_text() == ""                       # the token never went there
        assert victim.read_text() == "precious"            # nor through a link
        tok = tmp_path / "zo.addr.token"
        assert tok.read_text() == srv.token and (os.stat(tok).st_mode & 0o777) == 0o600
        assert (os.stat(tmp_path / "zo.addr.segments").st_mode & 0o777) == 0o600


def test_a_symlinked_lock_file_is_refused(tmp_path):
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, d / "server.sock.lock")
    with pytest.raises(RuntimeError, match="lock file.*symbolic link is refused"):
        spawn(threads=1, address=f"ipc://{d}/server.sock", address_file=str(tmp_path / "a"),
              stderr=subprocess.PIPE)
    assert victim.read_text() == "precious"


def test_an_address_file_in_a_directory_others_can_write_is_refused(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)  # writable by all, not sticky
    with pytest.raises(RuntimeError, match="writable by other users.*mkdir -m 700"):
        spawn(threads=1, address_file=str(d / "zo.addr"), stderr=subprocess.PIPE)


def test_a_planted_registry_unlinks_nothing(tmp_path):
    """A .segments file not written by this user's server (mode 0644 here) naming
    another job's segment, and one naming '..': the server starts and the segment lives."""
    other = Segment.create("zo-planted" + "0" * 8 + "-r0-" + "1" * 16, 4096)
    try:
        reg = tmp_path / "zo.addr.segments"
        reg.write_text(json.dumps({"pid": 999_999_999, "segments": [other.name, ".."], "private_dir": "/tmp"}))
        os.chmod(reg, 0o644)
        with spawn(threads=1, address_file=str(tmp_path / "zo.addr")):
            assert os.path.exists(f"/dev/shm/{other.name}")
        # a registry of ours (0600) with a name that is not a segment's: no harm either
        reg.write_text(json.dumps({"pid": 999_999_999, "segments": ["..", "../etc/passwd"]}))
        os.chmod(reg, 0o600)
        with spawn(threads=1, address_file=str(tmp_path / "zo.addr")):
            assert os.path.exists(f"/dev/shm/{other.name}")
    finally:
        other.close()
        other.unlink()


def test_admission_adds_up_the_sessions_it_admitted():
    """Shards that each fit alone but not together: before, every HELLO was checked on
    its own and all were admitted (sparse state, an OOM kill later); now the third is
    refused, counting what the first two reserved."""
    avail = read_mem_available()
    # fp32 state + one grad and one weights slot: 16 B/param.  Each shard is 0.4 of the
    # allowance: two fit, three do not, while MemAvailable stays within 20% of this reading
    n = int(avail * 0.9 * 0.4 / 16)
    n -= n % 4096
    print(f"MemAvailable {avail / 2**30:.1f} GiB, {n} params per shard")
    with spawn(threads=1) as srv:
        clients = [ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc) for _ in range(2)]
        try:
            with pytest.raises(OptimizerServerError, match="admitted shards have reserved"):
                ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc)
        finally:
            for c in clients:
                c.close()


def test_a_lying_frees_bytes_and_too_many_sessions_are_refused(tmp_path):
    with spawn(threads=1, extra_args=["--max-sessions", "2"]) as srv:
        r = _hello_reply(srv.address, token=srv.token, frees_bytes=2 ** 61)
        assert isinstance(r, P.Error) and r.code == P.E_INVALID and "frees_bytes" in r.message
        clients = [ShardClient(srv.address, srv.token, numel=1024, server_proc=srv.proc) for _ in range(2)]
        r = _hello_reply(srv.address, token=srv.token)
        assert isinstance(r, P.Error) and r.code == P.E_RESOURCE and "max-sessions" in r.message
        for c in clients:
            c.close()


def test_frees_bytes_cannot_be_inflated_by_claiming_a_large_world(tmp_path):
    """frees_bytes counts as freed RAM at admission; its bound was 4 B x numel x world_size
    with the world size the client's own word, so claiming 2^20 ranks admitted a shard
    that needed more than the host had.  Now the bound is this shard's own 4 B x numel:
    a HELLO that claims more is refused, whatever world size it states.  (Mutation: the
    bound multiplied by world_size again admits the claim.)"""
    n = 1 << 20
    with spawn(threads=1) as srv:
        r = _hello_reply(srv.address, token=srv.token, numel=n, rank=0, world_size=1 << 20,
                         frees_bytes=4 * n * 1024)
        assert isinstance(r, P.Error) and r.code == P.E_INVALID and "frees_bytes" in r.message, r
        c = ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc)  # an honest one is admitted
        c.close()


def test_one_speculate_over_a_whole_shard_does_not_stall_the_other_clients(tmp_path):
    """A token holder's worst SPECULATE: the smallest progress block HELLO takes (and
    progress_block=1 refused), an undo log, and one SPECULATE with upto=numel.  The
    socket thread hands the update thread one range (it built a tuple and a future per
    piece: 7.7 s of every other client's STATS waiting at 131,072 elements, 226 MiB of
    server memory); another client's STATS is answered at once meanwhile.  (Mutation:
    pieces listed again on the socket thread: the STATS waits seconds.)"""
    import threading
    import time
    n = 1 << 24  # 262,144 pieces of the smallest block
    with spawn(threads=1) as srv:
        r = _hello_reply(srv.address, token=srv.token, numel=n, progress_block=1)
        assert isinstance(r, P.Error) and "progress_block" in r.message, r
        spec = ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc, undo_log_bytes=1 << 30,
                           progress_block=P.MIN_PROGRESS_BLOCK)
        other = ShardClient(srv.address, srv.token, numel=1024, server_proc=srv.proc)
        try:
            spec.init_weights(np.ones(n, np.float32))
            spec.grads[0].view(np.float16)[:] = 0.5
            other.init_weights(np.ones(1024, np.float32))
            lat = []
            sent = threading.Event()

            def poll():  # STATS in a loop from before the SPECULATE until 1 s after it
                end = None
                while end is None or time.monotonic() < end:
                    if end is None and sent.is_set():
                        end = time.monotonic() + 1.0
                    t0 = time.monotonic()
                    other.stats()
                    lat.append(time.monotonic() - t0)
            th = threading.Thread(target=poll)
            th.start()
            time.sleep(0.1)
            spec.speculate(1, 0, 1e-3, 1.0, {}, upto=n)
            sent.set()
            th.join(60)
            print(f"{len(lat)} STATS beside the SPECULATE, the slowest {max(lat):.3f} s")
            assert not th.is_alive() and max(lat) < 1.0, max(lat)
            spec.step(1, 0, 1e-3)  # and the STEP settles it
        finally:
            spec.close()
            other.close()


@pytest.mark.parametrize("edit,match", [
    (lambda m: m["hparams"].update(beta1=5.0), "beta1 must be in"),
    (lambda m: m["hparams"].update(eps=1e-45), "eps must be"),
    (lambda m: m.update(world_size=10 ** 9), "world_size"),
    (lambda m: m.update(evil=1), "unknown keys"),
])
def test_a_manifest_with_bad_values_is_refused(tmp_path, edit, match):
    n = 4096
    with spawn(threads=1) as srv:
        c = ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc)
        c.init_weights(np.ones(n, np.float32))
        c.save(str(tmp_path))
        path = tmp_path / "shard-r0-of-1.json"
        man = json.loads(path.read_text())
        edit(man)
        path.write_text(json.dumps(man))
        with pytest.raises(OptimizerServerError, match=match):
            c.load(str(tmp_path))
        c.close()


def test_latest_must_name_a_step_directory_inside_the_root(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root" / "latest").write_text("../elsewhere")
    with pytest.raises(CheckpointError, match="not a step-NNNNNNNN directory inside"):
        resolve(tmp_path / "root")
    (tmp_path / "root" / "step-00000001").mkdir()
    (tmp_path / "root" / "latest").write_text("step-00000001")
    assert resolve(tmp_path / "root") == tmp_path / "root" / "step-00000001"


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_sighup_and_sigquit_clean_up_like_sigterm(tmp_path, sig):
    addr = tmp_path / "zo.addr"
    srv = spawn(threads=1, address_file=str(addr))
    c = ShardClient(srv.address, srv.token, numel=1024, server_proc=srv.proc)
    seg = c.segment_name
    sock = srv.address[len("ipc://"):]
    os.kill(srv.pid, sig)
    srv.proc.wait(30)
    c.close()
    assert not os.path.exists(f"/dev/shm/{seg}") and not os.path.exists(sock)
    assert not any(p.name.startswith("zo.addr") for p in tmp_path.iterdir())
    srv.stop()


def test_binds_and_paths():
    with pytest.raises(ValueError, match="--allow-remote"):
        ServerConfig(address="tcp://*:5555")
    with pytest.raises(ValueError, match="--allow-remote"):
        ServerConfig(address="tcp://0.0.0.0:5555")
    ServerConfig(address="tcp://*:5555", allow_remote=True)
    ServerConfig(address="tcp://127.0.0.1:5555")
    for bad in ("relative/dir", "", "x" * 5000):
        with pytest.raises(P.ProtocolError, match="absolute path"):
            P.decode(P.Save(session="s", dir=bad).encode())
    big = P.Save(session="s", dir="/" + "x" * 100).encode()
    assert len(big) < P.MAX_MESSAGE_BYTES


def test_traces_in_a_shared_directory_overwrite_nothing_planted(tmp_path):
    """--trace-dir on a shared disk: a directory others may write (0777, not sticky) is
    refused naming the fix; in our own, links planted at the file's old fixed temporary
    name and at its final name redirect nothing (the writer used to open
    `server-0-PID.json.tmp` with open(..., "w"): a link there overwrote its target).
    (Mutation: the plain open of a fixed .tmp name again overwrites the victim.)"""
    from zero_offload.server.tracing import Tracer
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(RuntimeError, match="writable by other users"):
        Tracer(str(shared), "server", 0)
    mine = tmp_path / "mine"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.chmod(victim, 0o600)
    t = Tracer(str(mine), "server", 0)
    assert (os.stat(mine).st_mode & 0o777) == 0o700
    os.symlink(victim, t.path() + ".tmp")
    with t.span("update", step=1):
        pass
    path = t.flush()
    assert victim.read_text() == "precious"
    assert json.loads(open(path).read())["traceEvents"][-1]["name"] == "update"
    os.unlink(path)
    os.symlink(victim, path)  # a link at the final name is replaced, its target untouched
    t.flush()
    assert victim.read_text() == "precious" and not os.path.islink(path)


def test_an_old_worker_leaves_a_restarted_servers_socket_alone(tmp_path):
    """A supervisor restarts a SIGKILLed server at the same ipc:// path; a worker of the
    dead one then notices the death: it raises the named error and leaves the new
    server's socket and lock in place (it used to remove them: the new server lost its
    clients, and a third server could start beside it).  A new client reaches the new
    server, and a third server at that path is refused.  (Mutation: the client
    removing the files unconditionally, as before, fails the checks after the death.)"""
    from zero_offload.server.errors import OptimizerServerDeadError
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    address = f"ipc://{d}/server.sock"
    sock, lock = d / "server.sock", d / "server.sock.lock"
    old = spawn(threads=1, address=address)
    c = ShardClient(address, old.token, numel=1024, server_proc=None)
    c.init_weights(np.zeros(1024, np.float32))
    os.kill(old.pid, signal.SIGSTOP)  # a STEP in flight when it dies: the worker waits for its DONE
    c.step_async(1, 0, 1e-3)
    os.kill(old.pid, signal.SIGKILL)
    old.proc.wait(10)  # reaped: a supervisor did, and starts the next server at the same path
    new = spawn(threads=1, address=address)
    try:
        with pytest.raises(OptimizerServerDeadError, match=f"pid {old.pid}"):
            c.wait_done()
        assert sock.exists() and lock.exists(), "the old worker removed the new server's files"
        fresh = ShardClient(address, new.token, numel=1024, server_proc=new.proc)
        fresh.init_weights(np.ones(1024, np.float32))
        fresh.close()
        with pytest.raises(RuntimeError, match="already serving"):
            third = spawn(threads=1, address=address, ready_timeout_s=20, stderr=subprocess.PIPE)
            third.stop()
    finally:
        c.close()
        new.stop()
        old.stop()


def test_the_token_never_travels_on_the_command_line(tmp_path):
    """Every user of a machine can read a process's arguments (ps), so `--token` is
    refused naming the ways that keep it secret; a 0600 `--token-file` (or
    ZERO_OFFLOAD_TOKEN) works, and the running server's command line holds no token;
    a token file others can read is refused.  (Mutation: --token accepted again, as an
    argparse option: the first check fails.)"""
    import sys
    p = subprocess.run([sys.executable, "-m", "zero_offload.server", "--token", "s3cret"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "ZERO_OFFLOAD_TOKEN" in p.stderr and "--token-file" in p.stderr, p.stderr
    tok = tmp_path / "token"
    tok.write_text("s3cret-" + "ab" * 8 + "\n")
    os.chmod(tok, 0o644)
    p = subprocess.run([sys.executable, "-m", "zero_offload.server", "--token-file", str(tok)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "chmod 600" in p.stderr, p.stderr
    os.chmod(tok, 0o600)
    env = {k: v for k, v in os.environ.items() if k != "ZERO_OFFLOAD_TOKEN"}
    with spawn(threads=1, env=env, extra_args=["--token-file", str(tok)], token="ignored-by-the-file") as srv:
        with open(f"/proc/{srv.pid}/cmdline", "rb") as f:
            assert b"s3cret" not in f.read()
        c = ShardClient(srv.address, tok.read_text().strip(), numel=64, server_proc=srv.proc)
        c.close()
