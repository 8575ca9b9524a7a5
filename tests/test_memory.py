"""Host memory at the moments it peaks: engine set-up (the user's fp32 model still alive) and LOAD.

Each process's peak resident set (VmHWM, reset by writing 5 to /proc/PID/clear_refs)
is compared with what it must hold.  Full-size temporaries, a flat fp32 copy of the
model in the worker, NumPy casts or a second copy of the state read from a
checkpoint in the server, show up as several bytes per parameter above that.
"""
from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from zero_offload import OffloadConfig, OffloadEngine

pytestmark = pytest.mark.timeout(240)  # xdist group "memory" (tests/conftest.py XDIST_GROUPS)

WIDTH, DEPTH = 2048, 4  # 16.8M parameters: 67 MB in fp32, far above allocator noise
WINDOW = 1 << 20  # staging chunks of 4 MiB: 16 INIT round trips
SERVER_BASE_BYTES = 48 << 20  # the server's interpreter, NumPy and ZeroMQ (about 20 MiB)


def _kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise AssertionError(f"{key} not in /proc/{pid}/status")


def _reset_peak(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:  # pragma: no cover - a kernel without it
        pytest.skip(f"cannot reset the peak resident set of {pid}: {e}")


def _held(pid: int) -> int:
    """Bytes of anonymous memory pid holds, less what it lent back (MADV_FREE: the save
    pool's buffers, which the kernel takes at need and MemAvailable counts as free)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        kb = {line.split(":")[0]: int(line.split()[1]) for line in f if line.rstrip().endswith("kB")}
    return (kb["Anonymous"] - kb.get("LazyFree", 0)) * 1024


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)])


def _step(model, eng) -> None:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    eng.backward(model(x).float().square().mean())
    eng.step()


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "copy"])
def test_setup_and_load_make_no_full_size_temporaries(tmp_path, zero_copy):
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    me = os.getpid()
    _reset_peak(me)
    rss0 = _kb(me, "VmRSS:") * 1024
    eng = OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1},
                                             expert={"cpu_zero_copy": zero_copy, "staging_numel": WINDOW,
                                                     "compute_dtype": "bf16"}))  # the 16-bit layout
    try:
        srv = eng._server.pid
        # worker: the 16-bit weights it casts into (2 B/param) and the staging window
        # it fills chunk by chunk (0.25); a flat fp32 copy of the model would add 4,
        # a staging area as long as the shard 4 more
        worker_peak = (_kb(me, "VmHWM:") * 1024 - rss0) / n
        assert worker_peak < 3.0, f"engine set-up raised the worker's resident set by {worker_peak:.1f} B/param"
        assert len(eng.client.grads) == 1  # synchronous steps: one gradient slot (2 B/param less)
        # server: whatever INIT touched it still holds (master 4, weights16 2, the window);
        # a transient above that is a temporary (NumPy's bf16 cast made ~12 B/param)
        over = (_kb(srv, "VmHWM:") - _kb(srv, "VmRSS:")) * 1024 / n
        assert over < 1.0, f"INIT peaked {over:.1f} B/param above what the server holds after it"
        # m and v are not touched before the first update: the set-up peak stays below
        # the steady state, while the user's fp32 model is still alive
        anon = _kb(srv, "RssAnon:") * 1024
        assert anon < 4 * n + SERVER_BASE_BYTES, f"the server holds {anon / n:.1f} B/param privately after INIT"

        _step(model, eng)
        eng.save_checkpoint(str(tmp_path))
        _step(model, eng)
        _reset_peak(srv)
        anon_before = _held(srv)
        eng.load_checkpoint(str(tmp_path))
        # LOAD takes at most one second state (12 B/param, the one-pass read where
        # admission gives it room; it replaces the running one once the file verified)
        # and its reading threads' blocks, whatever the model's size: no more
        # temporaries than that at the moment a resumed job starts
        from zero_offload.server.ckpt_io import IO_CHUNK_BYTES, IO_THREADS
        over = (_kb(srv, "VmHWM:") - _kb(srv, "VmRSS:")) * 1024 / n
        allowed = 12 + 1.0 + IO_THREADS * IO_CHUNK_BYTES / n
        assert over < allowed, f"LOAD peaked {over:.1f} B/param above what the server holds after it"
        # and after it the server holds one state, not two: the last save's job kept views
        # of the replaced state's arrays, so it stayed resident until the next save (12
        # B/param; allowed: one save buffer the pool's fill may be touching, 3 B/param here)
        grown = (_held(srv) - anon_before) / n
        assert grown < 4.0, f"the server holds {grown:.1f} B/param more after LOAD than before"
        assert _kb(srv, "RssAnon:") * 1024 > 12 * n  # master, m, v all resident: the checks are not vacuous
    finally:
        eng.close()


def _build(kind: str, model: torch.nn.Module):
    from zero_offload import OffloadAdamW
    if kind == "adamw":  # with model=: the forward pipeline's hooks and the engine inside
        return OffloadAdamW(model.parameters(), lr=1e-3, model=model, server={"threads": 1})
    expert = {"exact_strategy": "overlap_update+speculation", "undo_log_bytes": 1 << 20} if kind == "speculation" \
        else {"compute_dtype": "fp32"} if kind == "fp32-compute" else {}
    return OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", mode="dpu" if kind == "dpu" else "exact",
                                              server={"threads": 1}, expert=expert))


def _train_and_close(kind: str, model: torch.nn.Module) -> tuple:
    """Two steps and close(), in a frame of its own: returns weak references only."""
    opt = _build(kind, model)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for _ in range(2):
        loss = model(x).float().square().mean()
        if kind == "adamw":
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            opt.backward(loss)
            opt.step()
    opt.close()
    engine = opt.engine if kind == "adamw" else opt
    return weakref.ref(opt), weakref.ref(engine)


@pytest.mark.parametrize("kind", ["speculation", "dpu", "adamw", "fp32-compute"])
def test_a_closed_engine_goes_with_its_last_reference(kind):
    """close(), then the last reference dropped: the engine and the model (whose weights
    close() gave back in private memory, 2 B/param) are freed at once, not when Python's
    cyclic collector next runs.  A part holding a bound method of the engine (the
    speculator's expected STEP, the checkpoint's agree and barrier, the picker's agree)
    made a reference cycle: at 1e9 parameters the closed engine's model, 2 GB, outlived
    it, and a new engine's admission counted that memory as taken (scripts/bench_scale.py,
    three sizes in one process, refused the third).  (Mutation: the speculator given
    engine._expected_step itself fails "speculation" and "adamw", whose auto strategy
    speculates; the checkpoint given a bound method of the engine fails all of them;
    "fp32-compute" (bf16 inputs cast by runtime.compute_dtype's hook, which stays on the
    model): a cast function that calls itself as a closure keeps the first parameter, and
    fails it.)"""
    model = _model()
    was = gc.isenabled()
    gc.collect()
    gc.disable()  # only reference counting frees anything below
    try:
        opt, engine = _train_and_close(kind, model)
        held = weakref.ref(model)
        weights = [weakref.ref(p) for p in model.parameters()]
        del model
        assert opt() is None and engine() is None, "the closed engine is still alive: a reference cycle holds it"
        assert held() is None, "the model is still alive after its engine was closed and dropped"
        assert all(w() is None for w in weights), "a weight outlived its model: a reference cycle holds it"
    finally:
        if was:
            gc.enable()


def test_a_whole_model_copy_that_would_not_fit_is_refused_and_the_server_lives(monkeypatch, tmp_path):
    """master_state_dict() and torch.save(opt.state_dict()) without state_dir build a
    whole-model copy in the worker: where MemAvailable (faked small here, as on a host
    whose server holds most of it) cannot hold it, each is refused with a MemoryError
    naming what streams instead, before anything is built; the server lives, training
    goes on, and with ZERO_OFFLOAD_MAX_RAM_FRACTION=0 (the check off) both work.
    (Mutation: the check removed from master_state_dict: it returns instead of raising.)"""
    import io
    from zero_offload import OffloadAdamW, host_memory
    from tests.helpers.models import gpt, gpt_batch
    model = gpt()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, model=model, server={"threads": 1})
    try:
        for t in range(1, 3):
            gpt_batch(t, "bf16")(model).backward()
            opt.step()
            opt.zero_grad()
        monkeypatch.setattr(host_memory, "read_mem_available", lambda: 64 << 10)  # 64 KiB left
        # the message says what may be taken (the fraction of MemAvailable), not MemAvailable
        # alone (which read as more than the need when the fraction refused it)
        with pytest.raises(MemoryError, match=r"master_state_dict.*may be taken .*\(0\.9 of the .* GiB available\)"
                                              r".*zero-offload-export"):
            opt.master_state_dict()
        with pytest.raises(MemoryError, match="state_dict.*state_dir="):
            torch.save(opt.state_dict(), io.BytesIO())
        assert opt.engine._server.proc.poll() is None  # the server lives
        gpt_batch(3, "bf16")(model).backward()
        opt.step()  # and training goes on
        monkeypatch.setenv("ZERO_OFFLOAD_MAX_RAM_FRACTION", "0")
        assert set(opt.master_state_dict()) <= set(model.state_dict()) and opt.master_state_dict()
        torch.save(opt.state_dict(), io.BytesIO())
    finally:
        opt.close()


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "copy"])
def test_close_unmaps_the_shared_segment(zero_copy):
    """After close() this process maps nothing of the shard's segment (it is unlinked
    then; a view the update cycle kept, the copy up's source, held all of it mapped,
    ~4 B/param, until the engine object was collected, and the client's unmap failed
    in silence), while the engine object is still referenced.  (Mutation: UpdateCycle
    .release keeping its WeightReturn: the copy path's segment stays mapped.)"""
    from tests.helpers.models import gpt, gpt_batch, train_engine
    eng = OffloadEngine(gpt(), OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1},
                                             expert={"cpu_zero_copy": zero_copy}))
    train_engine(eng, gpt_batch, 2, "bf16")
    name = eng.client.segment.name
    with open("/proc/self/maps") as f:
        assert name in f.read()
    eng.close()
    with open("/proc/self/maps") as f:
        assert name not in f.read(), "the closed engine still maps its segment"
    assert eng.closed  # (the engine itself is still here)


def test_lent_back_save_buffers_leave_admissions_reservations_alone():
    """Reservations.outstanding (what admitted shards may still take) subtracts the
    server's resident growth; the save pool's buffers are lent back to the kernel
    (MADV_FREE) and counted as free by MemAvailable, so they must not count as a shard
    having taken its reservation: 256 MiB touched and lent back leave outstanding as it
    was, 256 MiB touched and kept lower it by that much.  (Mutation: read_rss from statm,
    which counts lent-back pages: outstanding falls by 256 MiB.)"""
    from zero_offload.server.admission import Reservations
    from zero_offload.server.ckpt_io import chunk_buffer, lend_back
    r = Reservations()
    r.add("s", 4 << 30)
    before = r.outstanding
    lent = chunk_buffer(256 << 20, touch=True)
    lend_back(lent)
    assert abs(r.outstanding - before) < 32 << 20, (before, r.outstanding)
    kept = chunk_buffer(256 << 20, touch=True)
    assert 224 << 20 < before - r.outstanding < 288 << 20, (before, r.outstanding)
    del lent, kept
