"""10,000+ random and mutated control messages against a live server with a registered shard."""
from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
import zmq

from zero_offload.server import ShardClient, spawn
from zero_offload.server import protocol as P
from tests.faults.test_crashes import record

pytestmark = pytest.mark.timeout(300)
N_MESSAGES = 10_000


SEED = 20261201


def mutations(rng: random.Random, token: str, session: str, next_step: int):
    """Yield messages as bytes.  Never a valid STEP/INIT/LOAD of the live shard, never a
    HELLO that would register one: HELLOs carry this version (so admission's token,
    RAM and /dev/shm checks are what refuses them), with the real token only for
    a shard larger than any machine's RAM.  SPECULATEs of the live shard are sent (the
    server may run them into its undo log; they are never answered)."""
    hello = dict(version=P.PROTOCOL_VERSION, rank=0, world_size=1, dtype="fp16", optimizer="adamw")
    valid = [
        P.Step(session=session, step=next_step, grad_slot=0, lr=1e-3).encode(),
        P.Hello(token="not-the-token", numel=64, **hello).encode(),
        P.Hello(token=token, numel=2**39, **hello).encode(),
        P.Stats(session=session).encode(),
        P.Skip(session=session, step=next_step + 5).encode(),
        P.Speculate(session=session, step=next_step, grad_slot=0, lr=1e-3, upto=500).encode(),
    ]
    junk_values = [None, -1, -2**63, 2**64 - 1, 2**40, 1e308, float("nan"), float("inf"), "", "x" * 300, b"\x00",
                   [], {}, [1, 2], {"a": 1}, True, 3.5]
    while True:
        kind = rng.randrange(7)
        if kind == 0:  # random bytes
            yield bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200)))
        elif kind == 1:  # valid msgpack of the wrong shape
            yield msgpack.packb(rng.choice([[1, 2, 3], 42, "STEP", None, {"t": 5}, {"t": "STEP", 1: 2}]),
                                use_bin_type=True)
        elif kind == 2:  # a valid message with one field replaced by junk
            d = msgpack.unpackb(rng.choice(valid), raw=False)
            k = rng.choice(list(d))
            d[k] = rng.choice(junk_values)
            if d.get("t") == "STEP" and d.get("step") == next_step and d.get("grad_slot") in (0, 1) \
                    and isinstance(d.get("lr"), (int, float)) and d.get("session") == session:
                d["step"] = next_step + 3  # never a real update
            if d.get("t") == "HELLO" and d.get("token") == token:
                d["numel"] = 2**39  # a real token only with a size beyond any RAM (valid on the wire)
            try:
                yield msgpack.packb(d, use_bin_type=True)
            except (TypeError, ValueError, OverflowError):
                continue
        elif kind == 3:  # wrong step, wrong slot, unknown session
            step = rng.choice([0, -1, next_step + rng.randrange(1, 1000), 2**31])
            yield msgpack.packb({"t": "STEP", "session": rng.choice([session, "nope", ""]), "step": step,
                                 "grad_slot": rng.choice([0, 1, 2, -1]), "lr": 1e-3}, use_bin_type=True)
        elif kind == 4:  # truncated valid message
            b = rng.choice(valid)
            yield b[:rng.randrange(len(b))]
        elif kind == 5:  # bit flips
            b = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            out = bytes(b)
            try:
                m = P.decode(out)
                if isinstance(m, P.Step) and m.session == session and m.step == next_step:
                    continue  # the flip landed on a valid update of the live shard
                if isinstance(m, P.Hello) and m.token == token and m.numel < 2**30:
                    continue  # would register a real shard
            except P.ProtocolError:
                pass
            yield out
        else:  # oversized
            yield b"\x91" + b"a" * (P.MAX_MESSAGE_BYTES + rng.randrange(1, 1000))


def test_fuzz_control_socket(tmp_path):
    seed = SEED
    print(f"fuzz seed {seed}")
    rng = random.Random(seed)
    with spawn(threads=1) as srv:
        c = ShardClient(srv.address, srv.token, numel=1000, server_proc=srv.proc, grad_slots=2,
                        undo_log_bytes=1 << 16)
        c.init_weights(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
        c.grads[1].view(np.float16)[:] = 0.5
        c.step(1, 1, 1e-2)
        before = c.get_master()
        c.save(str(tmp_path / "before"))
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(srv.address)
        errors = sent = hints = 0
        codes: dict[str, int] = {}
        gen = mutations(rng, srv.token, c.session, 2)
        try:
            while sent < N_MESSAGES:
                data = next(gen)
                s.send(data)
                sent += 1
                try:
                    m = P.decode(data)
                except P.ProtocolError:
                    m = None
                if isinstance(m, P.Speculate) and m.session == c.session:
                    hints += 1  # a hint of the live shard: no reply (a STEP or GET_MASTER settles it)
                    continue
                assert s.poll(5000), f"no reply to message {sent} (seed {seed}): {data[:80]!r}"
                r = P.decode(s.recv())
                if isinstance(r, P.Error):
                    errors += 1
                    codes[r.code] = codes.get(r.code, 0) + 1
                assert srv.alive(), f"server died on message {sent} (seed {seed})"
                if sent % 500 == 0:  # the real worker's heartbeats keep it registered meanwhile
                    assert c.stats().updates == 1
        finally:
            s.close()
            ctx.term()
        st = c.stats()
        after = c.get_master()  # rolls back whatever the hints speculated
        np.testing.assert_array_equal(before, after)
        c.save(str(tmp_path / "after"))
        b1 = (tmp_path / "before" / "shard-r0-of-1.bin").read_bytes()
        b2 = (tmp_path / "after" / "shard-r0-of-1.bin").read_bytes()
        assert b1 == b2  # master, m and v bitwise unchanged
        c.step(2, 0, 1e-2)  # and the shard still trains
        c.close()
    # every check of the server was reached, admission's included
    for code in (P.E_DECODE, P.E_VERSION, P.E_AUTH, P.E_RESOURCE, P.E_SESSION, P.E_ORDER):
        assert codes.get(code, 0) > 0, (code, codes, seed)
    assert hints > 0 and st.speculate_dropped > 0, (hints, st)
    record("fuzz", {"messages": sent, "error_replies": errors, "speculate_hints": hints, "seed": seed, "codes": codes})
