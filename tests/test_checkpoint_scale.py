"""Checkpoints at a user's size: no false death while a long SAVE or LOAD runs, waits
bounded by progress, background saves that hold exactly the saved step's bytes, and
one save-and-load round trip at >= 0.3e9 parameters."""
from __future__ import annotations

import copy
import filecmp
import os
import threading
import time

import numpy as np
import pytest
import torch

from zero_offload.server import ShardClient, spawn
from zero_offload.server.config import SAVE_RATE_ENV
from zero_offload import OffloadConfig, OffloadEngine
from tests.helpers.models import flat_master, gpt, gpt_batch, train_engine
from tests.conftest import our_segments

pytestmark = pytest.mark.timeout(240)  # xdist group "memory" (tests/conftest.py XDIST_GROUPS)
SEED = 20261203


class Poller:
    """A second client of the same server polling STATS every 0.5 s, as a second rank's
    engine would: records each answer's latency and any error."""

    def __init__(self, srv, numel=1024):
        self.c = ShardClient(srv.address, srv.token, numel=numel, server_proc=srv.proc)
        self.c.init_weights(np.zeros(numel, np.float32))
        self.latencies: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        try:
            while not self._stop.wait(0.5):
                t0 = time.monotonic()
                self.c.stats()
                self.latencies.append(time.monotonic() - t0)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def stop(self):
        self._stop.set()
        self._t.join(30)
        self.c.stats()  # and it goes on afterwards
        self.c.close()
        assert self.error is None, f"the polling client failed: {self.error!r}"
        return max(self.latencies, default=0.0)


def _segments():
    return our_segments()  # this test process's servers' segments, not another run's beside it


def test_a_load_stalled_past_the_heartbeat_bound_kills_nobody(tmp_path, monkeypatch):
    """The manifest is a FIFO that gets its bytes only after 8 s, past the heartbeat bound
    (cut to 3 s here from its default 10, so that the wait is short): LOAD waits on the
    update thread, heartbeats and the second client's STATS are answered throughout, and
    both clients go on.  Fails if LOAD runs on the socket thread (run: a STATS waited 7.5 s).
    Applying the heartbeat rule to a local server does not fail it: heartbeats are answered
    during the LOAD, which is what the rule would need."""
    from zero_offload.server import client as client_mod
    monkeypatch.setattr(client_mod, "HEARTBEAT_DEAD_AFTER_S", 3.0)
    stall_s = 8.0
    n = 1 << 16
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    w = rng.standard_normal(n).astype(np.float32)
    with spawn(threads=1) as srv:
        c = ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc, heartbeat_interval_s=0.2)
        c.init_weights(w)
        c.save(str(tmp_path / "ck"))
        man = tmp_path / "ck" / "shard-r0-of-1.json"
        text = man.read_bytes()
        man.unlink()
        os.mkfifo(man)

        def feed():
            time.sleep(stall_s)
            with open(man, "wb") as f:
                f.write(text)
        feeder = threading.Thread(target=feed, daemon=True)
        poll = Poller(srv)
        feeder.start()
        t0 = time.monotonic()
        c.load(str(tmp_path / "ck"))
        took = time.monotonic() - t0
        feeder.join()
        worst = poll.stop()
        assert took >= stall_s - 1.0, took  # it did wait for the FIFO
        assert worst < 4.0, f"a STATS waited {worst:.1f} s behind the LOAD"
        np.testing.assert_array_equal(c.get_master(), w)  # the loading client goes on
        assert srv.proc.poll() is None
        c.close()


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_background_save_holds_the_saved_step_while_later_steps_run(tmp_path, state_dtype):
    """SAVE(background) at step k, then STEPs k+1..k+5 while it writes: the files equal a
    blocking save at step k of a twin shard byte for byte (int8: the block kernel's path).
    The server's writes are capped at 128 MB/s (a slow disk, made so on purpose): right
    after SAVE answers, the save is still writing.  (Mutations: the update not waiting for
    the chunks it overwrites (Shard._guard) fails the byte check; the server answering a
    background SAVE only once the file is written fails the "writing" check.)"""
    n = 1 << 25  # 32M elements: 384 MiB of fp32 state, several save chunks
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    w = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float16) for _ in range(3)]
    with spawn(threads=2, extra_args=["--save-max-bytes-per-s", str(128e6)]) as srv:
        a, b = (ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc, state_dtype=state_dtype)
                for _ in range(2))
        for c in (a, b):
            c.init_weights(w)
            for t in (1, 2):
                c.grads[0].view(np.float16)[:] = grads[t - 1]
                c.step(t, 0, 1e-3)
        b.save(str(tmp_path / "blocking"))
        info = a.save(str(tmp_path / "background"), background=True)
        assert info["background"]
        during = a.save_status()
        assert during["state"] == "writing" and during["bytes_done"] < during["bytes_total"], during
        for t in range(3, 8):
            a.grads[0].view(np.float16)[:] = grads[t % 3]
            a.step(t, 0, 1e-3)
        st = a.wait_save()
        print("right after SAVE:", during, "status:", st)
        assert st["state"] == "done" and st["bytes_done"] == st["bytes_total"] == during["bytes_total"], st
        # the snapshot: the steps copied what the slow writers had not reached, and never wrote
        assert st["snapshot"] and st["update_writes"] == 0 and 0 < st["snapshot_peak"] <= st["bytes_total"], st
        for name in ("shard-r0-of-1.bin", "shard-r0-of-1.json"):
            assert filecmp.cmp(tmp_path / "blocking" / name, tmp_path / "background" / name, shallow=False), name
        # and the shard saved at step 2 went on to step 7 meanwhile
        assert a.stats().updates == 7
        a.close()
        b.close()


def test_engine_background_save_resumes_bitwise(tmp_path, monkeypatch):
    """engine.save_checkpoint(background=True) at step 4, five more steps, published by
    wait_checkpoint: the same bytes as a blocking save at step 4, and a resume from it
    trains bitwise like the uninterrupted run.  The private server's saves are capped at
    100 kB/s (ZERO_OFFLOAD_SAVE_MAX_BYTES_PER_S), so the save outlasts a step: when
    save_checkpoint returns the server is still writing, and after a step it is still
    not published.  (Mutation: the server answering a background SAVE only once written
    fails the "writing" check.)"""
    torch.manual_seed(SEED)
    model = gpt()
    cfg = dict(lr=3e-3, dtype="bf16", server={"threads": 1})
    with OffloadEngine(copy.deepcopy(model), OffloadConfig(**cfg)) as eng:
        train_engine(eng, gpt_batch, 4, "bf16")
        blocking = eng.save_checkpoint(str(tmp_path / "blocking"))
        ref_losses = train_engine(eng, gpt_batch, 5, "bf16", start=5)
        ref = flat_master(eng)
    monkeypatch.setenv(SAVE_RATE_ENV, "100000")
    with OffloadEngine(copy.deepcopy(model), OffloadConfig(**cfg)) as eng:
        monkeypatch.delenv(SAVE_RATE_ENV)  # the private server has it: the next engines' do not
        train_engine(eng, gpt_batch, 4, "bf16")
        path = eng.save_checkpoint(str(tmp_path / "bg"), background=True)
        st = eng.client.save_status()
        assert st["state"] == "writing" and st["bytes_done"] < st["bytes_total"], st
        train_engine(eng, gpt_batch, 1, "bf16", start=5)
        assert eng.checkpoint_in_flight() and not os.path.exists(path)  # not published yet
        train_engine(eng, gpt_batch, 4, "bf16", start=6)
        assert eng.wait_checkpoint() in (path, None)  # None: a step already published it
        assert not eng.checkpoint_in_flight()
    assert os.path.basename(path) == "step-00000004" and os.path.isdir(path)
    for name in sorted(os.listdir(blocking)):
        assert filecmp.cmp(os.path.join(blocking, name), os.path.join(path, name), shallow=False), name
    with OffloadEngine(copy.deepcopy(model), OffloadConfig(**cfg)) as eng:
        eng.load_checkpoint(str(tmp_path / "bg"))
        losses = train_engine(eng, gpt_batch, 5, "bf16", start=5)
        assert losses == ref_losses
        assert torch.equal(flat_master(eng), ref)


def test_save_and_load_at_0_3e9_parameters(tmp_path):
    """Size is a dimension of correctness: a 0.3e9-parameter shard (bf16 state with the
    exact master: 6 B/param private) saves and loads bitwise, with a second client
    polling throughout and answered each time."""
    n = 300_000_000
    before = _segments()
    with spawn(threads=2) as srv:
        poll = Poller(srv)
        c = ShardClient(srv.address, srv.token, numel=n, dtype="bf16", server_proc=srv.proc,
                        state_dtype="bf16", exact_master=True)
        ramp = np.linspace(-1, 1, 1 << 20, dtype=np.float32)
        for lo, hi in c.init_chunks():  # a cheap, varied master without a 1.2 GB temporary
            k = hi - lo
            c.staging[:k] = np.resize(ramp, k) * np.float32(1 + lo / n)
            c.init_chunk(lo, hi)
        c.grads[0][:] = 0x3C00  # bf16 1.0 (written in one pass, no temporary)
        c.step(1, 0, 1e-3)
        t0 = time.monotonic()
        info = c.save(str(tmp_path / "big"))
        save_s = time.monotonic() - t0
        crc_before = c.stats()
        w_saved = c.weights16.copy()
        c.step(2, 0, 1e-3)  # moves the state away from what was saved
        t0 = time.monotonic()
        c.load(str(tmp_path / "big"))
        load_s = time.monotonic() - t0
        print(f"save {info['bytes'] / 2**30:.2f} GiB in {save_s:.1f} s, load in {load_s:.1f} s")
        assert c.stats().updates == crc_before.updates == 1
        np.testing.assert_array_equal(c.weights16, w_saved)
        c.save(str(tmp_path / "again"))
        assert filecmp.cmp(tmp_path / "big" / "shard-r0-of-1.bin", tmp_path / "again" / "shard-r0-of-1.bin",
                           shallow=False)
        c.close()
        poll.stop()
    assert _segments() == before
