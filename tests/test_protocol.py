"""optimizer_server.protocol: round trips and rejections (no server involved)."""
import dataclasses
import subprocess
import sys

import msgpack
import pytest

from zero_offload.server import protocol as P

SAMPLES = [
    P.Hello(version=1, token="t", rank=0, world_size=2, numel=10, dtype="fp16", optimizer="adamw",
            hparams={"lr": 1e-3, "beta1": 0.9}, pid=5, progress_block=64, weights_slots=2, grad_slots=1,
            staging_numel=7, state_dtype="bf16", exact_master=False, frees_bytes=40, undo_log_bytes=1 << 20,
            worker_peak_bytes=1 << 21),
    P.HelloOk(session="s", segment="zo-x", segment_bytes=4096, numel=10, grad_offsets=[0, 20],
              weights_offsets=[4096, 8192], staging_offset=0, staging_numel=10, progress_offset=8256, ready_offset=8320,
              server_pid=1),
    P.Init(session="s", offset=16, count=8),
    P.Step(session="s", step=3, grad_slot=1, lr=1e-3, grad_scale=0.5, hparams={"weight_decay": 0.1}, weights_slot=1,
           groups=[[0, 4, 1e-3, 0.9, 0.99, 1e-8, 0.1, 3], [4, 6, 0.0, 0.9, 0.99, 1e-8, 0.0, 0]], reverse=True),
    P.Speculate(session="s", step=3, grad_slot=0, lr=1e-3, grad_scale=0.5, hparams={"weight_decay": 0.1}, weights_slot=1,
                groups=[[0, 4, 1e-3, 0.9, 0.99, 1e-8, 0.1, 3], [4, 6, 0.0, 0.9, 0.99, 1e-8, 0.0, 3]], reverse=True,
                upto=4),
    P.Done(step=3, update_s=0.01, speculated=4, rolled_back=0),
    P.Skip(session="s", step=4),
    P.ReleaseTwin(session="s"),
    P.GetMaster(session="s", offset=0, count=10),
    P.Save(session="s", dir="/tmp/x"),
    P.Save(session="s", dir="/tmp/x", background=True, pieces=bytes(range(48)), flat_numel=100),
    P.Load(session="s", dir="/tmp/x", weights_slot=1),
    P.Load(session="s", dir="/tmp/x", pieces=bytes(24), flat_numel=7, verified=True),
    P.Stats(session="s"),
    P.StatsOk(updates=1, skipped=0, last_update_s=0.1, mean_update_s=0.1, bytes_read=1, bytes_written=2,
              threads=1, simd="avx512", speculate_dropped=2, last_drop_reason="no undo log", speculated=7),
    P.Heartbeat(session="s"),
    P.HeartbeatOk(server_pid=3),
    P.Bye(session="s"),
    P.Ok(info={"a": 1}),
    P.Error(code="decode", message="m"),
]


def test_every_type_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(P.MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE)
def test_round_trip(msg):
    assert P.decode(msg.encode()) == msg


def _raw(d):
    return msgpack.packb(d, use_bin_type=True)


def _hello_dict(**over):
    d = {"t": "HELLO", **dataclasses.asdict(SAMPLES[0])}
    d.update(over)
    return d


@pytest.mark.parametrize("data,match", [
    (b"", "not valid msgpack"),
    (b"\xc1", "not valid msgpack"),
    (_raw([1, 2]), "map"),
    (_raw({"t": "NOPE"}), "unknown message type"),
    (_raw({"x": 1}), "unknown message type"),
    (_raw(_hello_dict(extra=1)), "unknown field"),
    (_raw({"t": "STEP", "session": "s", "step": 1, "grad_slot": 0}), "missing field 'lr'"),
    (_raw(_hello_dict(rank="0")), "'rank' must be an int"),
    (_raw(_hello_dict(numel=True)), "'numel' must be an int"),
    (_raw(_hello_dict(numel=-1)), "numel"),
    (_raw(_hello_dict(rank=2)), "rank"),
    (_raw(_hello_dict(dtype="fp8")), "dtype"),
    (_raw(_hello_dict(hparams={"lr": float("nan")})), "finite"),
    (_raw(_hello_dict(hparams={"momentum": 0.9})), "unknown hyper-parameter"),
    (_raw({"t": "STEP", "session": "s", "step": 1, "grad_slot": 2, "lr": 0.1}), "slot"),
    (_raw({"t": "STEP", "session": "s", "step": 0, "grad_slot": 0, "lr": 0.1}), "step"),
    (_raw({"t": "STEP", "session": "s", "step": 1, "grad_slot": 0, "lr": float("inf")}), "lr"),
    (_raw({"t": "STEP", "session": "s", "step": 1, "grad_slot": 0, "lr": 0.1, "weights_slot": 2}), "weights_slot"),
    (_raw({"t": "STEP", "session": "s", "step": 2, "grad_slot": 0, "lr": 0.1,
           "groups": [[0, 4, 0.1, 0.9, 0.99, 1e-8, 0.0]]}), "updates"),  # a version-5 range
    (_raw({"t": "STEP", "session": "s", "step": 2, "grad_slot": 0, "lr": 0.1,
           "groups": [[0, 4, 0.1, 0.9, 0.99, 1e-8, 0.0, 3]]}), "updates must be an int in"),
    (_raw({"t": "STEP", "session": "s", "step": 2, "grad_slot": 0, "lr": 0.1,
           "groups": [[0, 4, 0.1, 0.9, 0.99, 1e-8, 0.0, 1], [5, 4, 0.1, 0.9, 0.99, 1e-8, 0.0, 1]]}), "start where"),
    (_raw(_hello_dict(weights_slots=3)), "weights_slots"),
    (_raw(_hello_dict(progress_block=-1)), "progress_block"),
    (_raw(_hello_dict(grad_slots=0)), "grad_slots"),
    (_raw(_hello_dict(grad_slots=3)), "grad_slots"),
    (_raw(_hello_dict(staging_numel=-1)), "staging_numel"),
    (_raw(_hello_dict(state_dtype="fp64")), "state_dtype must be one of"),
    (_raw(_hello_dict(state_dtype="int8")), "multiple of 256"),  # 2 ranks, numel 10: a block across ranks
    (_raw(_hello_dict(state_dtype="bf16", optimizer="adagrad")), "state_dtype 'bf16' is implemented for"),
    (_raw(_hello_dict(exact_master=True)), "exact_master needs bf16"),       # the sample's weights are fp16
    (_raw(_hello_dict(exact_master=1)), "'exact_master' must be a bool"),
    (_raw(_hello_dict(frees_bytes=-1)), "frees_bytes"),
    (_raw(_hello_dict(worker_peak_bytes=-1)), "worker_peak_bytes"),
    (_raw(_hello_dict(undo_log_bytes=-1)), "undo_log_bytes"),
    (_raw({"t": "SPECULATE", "session": "s", "step": 1, "grad_slot": 0, "lr": 0.1, "upto": -1}), "upto"),
    (_raw({"t": "SPECULATE", "session": "s", "step": 0, "grad_slot": 0, "lr": 0.1, "upto": 1}), "step"),
    (_raw({"t": "LOAD", "session": "s", "dir": "/x", "weights_slot": 2}), "weights_slot"),
    (_raw({"t": "SAVE", "session": "s", "dir": "/x", "pieces": b"\0" * 25, "flat_numel": 9}), "24-byte pieces"),
    (_raw({"t": "SAVE", "session": "s", "dir": "/x", "pieces": "abc", "flat_numel": 9}), "'pieces' must be bytes"),
    (_raw({"t": "LOAD", "session": "s", "dir": "/x", "pieces": b"\0" * 24}), "pieces without a flat_numel"),
    (_raw({"t": "LOAD", "session": "s", "dir": "/x", "flat_numel": -1}), "flat_numel"),
    (_raw({"t": "INIT", "session": "s"}), "missing field 'offset'"),
    (_raw({"t": "INIT", "session": "s", "offset": -1, "count": 1}), "offset and count"),
    (_raw({"t": "GET_MASTER", "session": "s", "offset": 0, "count": 1 << 41}), "offset and count"),
    (b"\x00" * (P.MAX_MESSAGE_BYTES + 1), "exceeds"),
])
def test_rejections(data, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(data)


def test_truncated_messages_are_rejected():
    full = SAMPLES[0].encode()
    for cut in range(len(full)):
        with pytest.raises(P.ProtocolError, match="not valid msgpack"):
            P.decode(full[:cut])


def test_importable_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import zero_offload.server.protocol, zero_offload.server.client, zero_offload.server.spawn\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_error_codes_are_a_closed_set():
    """Every code a worker can see is in protocol.ERROR_CODES, the server's and the
    worker-side ones alike; an ERROR with another code is not a message."""
    from zero_offload.server.errors import (OptimizerServerDeadError, OptimizerServerError,
                                            OptimizerServerTimeoutError)
    assert OptimizerServerDeadError("x").code == P.E_DEAD
    assert OptimizerServerTimeoutError("x").code == P.E_TIMEOUT
    assert OptimizerServerError("x").code == P.E_INTERNAL
    assert {P.E_DEAD, P.E_TIMEOUT, P.E_ORDER, P.E_INVALID} <= P.ERROR_CODES
    for code in P.ERROR_CODES:
        assert P.decode(P.error(code, "m")).code == code
    with pytest.raises(ValueError, match="unknown error code"):
        P.error("oops", "m")
    forged = msgpack.packb({"t": "ERROR", "code": "oops", "message": "m"}, use_bin_type=True)
    with pytest.raises(P.ProtocolError, match="unknown error code"):
        P.decode(forged)
