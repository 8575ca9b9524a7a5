"""The compute dtype (runtime.compute_dtype): fp32 forward and backward on a CPU device
without native 16-bit matmul, the 16-bit dtype elsewhere, and what the engine does
with each.  The reference is plain torch (tests.helpers.reference): fp32 forward and
backward on the 16-bit-rounded weights, each gradient rounded to 16 bits, AdamW on an
fp32 master."""
from __future__ import annotations

import io
import os
import platform
import subprocess
import sys

import pytest
import torch

from zero_offload import OffloadConfig, OffloadEngine
from zero_offload import compute_dtype as cd
from tests.helpers.models import gpt, gpt_batch, mlp, mlp_batch, run_pair, train_engine
from tests.helpers.reference import rel_err

pytestmark = pytest.mark.timeout(240)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_isa_cap(monkeypatch):
    """The choice's tests see the CPU's flags, whatever oneDNN cap the caller's shell sets."""
    for var in cd.ISA_CAP_VARS:
        monkeypatch.delenv(var, raising=False)


# ----------------------------------------------------------------------------- the choice
@pytest.mark.parametrize("flags, dtype, want", [
    ({"avx2", "f16c", "fma"}, "bf16", torch.float32),                        # AVX2 EPYC: emulated
    ({"avx2", "avx512f", "avx512bw"}, "bf16", torch.float32),                # AVX-512 without BF16
    ({"avx2", "avx512f", "avx512_bf16"}, "bf16", torch.bfloat16),            # Cooper Lake, Zen 4
    ({"avx2", "amx_bf16", "amx_tile"}, "bf16", torch.bfloat16),              # Sapphire Rapids
    ({"avx2", "avx512_bf16"}, "fp16", torch.float32),                        # native bf16 is not fp16
    ({"avx2", "avx512_fp16", "avx512_bf16"}, "fp16", torch.float16),
])
def test_auto_follows_the_cpus_features(monkeypatch, flags, dtype, want):
    """(Mutation: auto returning the 16-bit dtype always fails the emulated rows.)"""
    monkeypatch.setattr(cd, "cpu_flags", lambda: flags)
    got, why = cd.resolve("auto", dtype, CPU)
    assert got == want, why
    assert why


def test_auto_measures_where_the_cpu_does_not_say(monkeypatch):
    monkeypatch.setattr(cd, "cpu_flags", lambda: None)
    monkeypatch.setattr(cd, "_probe", lambda dt: 40.0)
    assert cd.resolve("auto", "bf16", CPU)[0] == torch.float32
    monkeypatch.setattr(cd, "_probe", lambda dt: 1.3)
    assert cd.resolve("auto", "bf16", CPU)[0] == torch.bfloat16


def test_a_onednn_isa_cap_is_measured_not_read_from_the_flags(monkeypatch):
    """ONEDNN_MAX_CPU_ISA below the CPU's 16-bit units makes torch's 16-bit matmul emulated
    on a CPU whose flags say native: the choice then measures.  (Mutation: resolve
    reading the flags whatever the cap fails it.)"""
    native = {"avx2", "avx512_bf16", "amx_bf16"}
    monkeypatch.setattr(cd, "cpu_flags", lambda: native)
    monkeypatch.setattr(cd, "_probe", lambda dt: 40.0)
    for value in ("ALL", "default", ""):  # caps nothing: the flags decide
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", value)
        assert cd.resolve("auto", "bf16", CPU)[0] == torch.bfloat16, value
    for var in cd.ISA_CAP_VARS:
        monkeypatch.setenv(var, "avx2")
        got, why = cd.resolve("auto", "bf16", CPU)
        assert got == torch.float32 and f"{var}=AVX2" in why and "40.0x" in why, why
        monkeypatch.delenv(var)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    monkeypatch.setattr(cd, "_probe", lambda dt: 0.2)
    assert cd.resolve("auto", "bf16", CPU)[0] == torch.bfloat16


def test_the_probe_measures_once_per_process(monkeypatch):
    """OffloadTrainer asks for the compute dtype before its engine exists, and the engine
    asks again: one measurement, so both get the same answer.  (Mutation: _probe
    measuring on every call fails it.)"""
    calls = []
    monkeypatch.setattr(cd, "_measure", lambda dt: calls.append(dt) or 50.0)
    monkeypatch.setattr(cd, "_PROBED", {})
    assert cd._probe(torch.bfloat16) == cd._probe(torch.bfloat16) == 50.0
    cd._probe(torch.float16)
    assert calls == [torch.bfloat16, torch.float16]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN's x86 ISA names")
def test_under_an_avx2_cap_auto_computes_in_fp32_on_any_x86():
    """The real thing, in a fresh process (oneDNN reads the cap when it starts): capped at
    AVX2, bf16 matmul is emulated on every x86 CPU (on an AVX512_BF16 one: 280 ms against
    3.6 ms in fp32), and auto picks fp32 by measuring it."""
    code = ("import torch; from zero_offload import compute_dtype as cd\n"
            "got, why = cd.resolve('auto', 'bf16', torch.device('cpu')); print(got, '|', why)")
    env = {k: v for k, v in os.environ.items() if k not in cd.ISA_CAP_VARS}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("torch.float32 |") and "ONEDNN_MAX_CPU_ISA=AVX2" in p.stdout, p.stdout


def test_forcing_and_refusals(monkeypatch):
    monkeypatch.setattr(cd, "cpu_flags", lambda: {"avx2"})
    assert cd.resolve("bf16", "bf16", CPU)[0] == torch.bfloat16      # forced 16-bit on an emulating CPU
    assert cd.resolve("fp32", "bf16", CPU)[0] == torch.float32
    assert cd.resolve("auto", "bf16", torch.device("cuda"))[0] == torch.bfloat16  # a GPU: as before
    with pytest.raises(ValueError, match="CPU device"):
        cd.resolve("fp32", "bf16", torch.device("cuda"))
    with pytest.raises(ValueError, match="compute_dtype"):
        OffloadConfig(dtype="bf16", expert={"compute_dtype": "fp16"})
    with pytest.raises(ValueError, match="compute_dtype"):
        OffloadConfig(expert={"compute_dtype": "float32"})


@pytest.mark.parametrize("compute", ["bf16", "fp32"])
def test_each_compute_dtype_does_what_it_says(compute):
    """Forced 16-bit: the parameters are bf16 views of the shared slot (zero-copy).  Forced
    fp32: fp32 parameters holding bf16 values, refreshed from the slot after every update
    (2 B/param/update of traffic up, as before), frozen weights rounded, float buffers fp32.
    (Mutation: a weights-up copy that skipped the cast, or cast_and_bind without
    rounding through bf16, fails the 16-bit-value check.)"""
    model = gpt()
    model.pos.weight.requires_grad_(False)  # a frozen weight
    model.register_buffer("scale_buf", torch.full((3,), 1.0 + 2 ** -12))
    cfg = OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1}, expert={"compute_dtype": compute})
    with OffloadEngine(model, cfg) as eng:
        train_engine(eng, gpt_batch, 3, "bf16")
        st = eng.stats()
        ps = list(model.parameters())
        if compute == "bf16":
            assert st["compute_dtype"] == "bfloat16" and st["cpu_zero_copy"]
            assert all(p.dtype == torch.bfloat16 for p in ps)
            assert model.scale_buf.dtype == torch.bfloat16
        else:
            assert st["compute_dtype"] == "float32" and not st["cpu_zero_copy"]
            assert all(p.dtype == torch.float32 for p in ps)
            for p in ps:  # every weight, trained or frozen, is a bf16 value
                assert torch.equal(p.detach().bfloat16().float(), p.detach())
            assert model.scale_buf.dtype == torch.float32 and float(model.scale_buf[0]) == 1.0 + 2 ** -12
            assert st["bytes_to_device"] == 2 * st["shard_numel"] * st["updates"]
            # the parameters are what the server wrote: its 16-bit weights, cast
            eng.synchronize(copy_weights=True)
            slot = eng.cycle.incoming_tensor()
            assert torch.equal(eng.flat16[:eng.flat.numel], slot[:eng.flat.numel].float())
        assert st["compute_dtype_why"] == "asked for"


class TwoInputs(torch.nn.Module):
    """A model called with a positional tuple and a keyword dict (module level: it pickles)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)

    def forward(self, xs, *, extra):
        assert extra["keep"].dtype == torch.float16  # not the weights' dtype: as it was
        return self.a(xs[0]) + self.b(extra["y"])


def test_a_script_written_for_16_bit_inputs_runs_under_fp32_compute():
    """A loop that feeds the model bf16 inputs (as on a GPU, or an AVX512_BF16 CPU) runs
    unchanged where the engine computes in fp32: the model's floating-point inputs in the
    16-bit dtype are cast at its call, in args, kwargs and nested containers; other
    dtypes pass as they are.  The losses are bitwise those of the same loop feeding fp32
    inputs, and the cast stays after close() (the parameters stay fp32 then).
    The model still pickles with the hook on it (torch.save(model)).  (Mutation: no input
    cast fails with torch's "mat1 and mat2 must have the same dtype"; casting every
    floating input to fp32, ignoring the dtype, fails the fp16 pass-through; the hook as
    a closure fails the pickling.)"""
    out = {}
    for cast_here in (False, True):
        torch.manual_seed(0)
        model = TwoInputs()
        cfg = OffloadConfig(lr=1e-2, dtype="bf16", server={"threads": 1}, expert={"compute_dtype": "fp32"})
        losses = []
        with OffloadEngine(model, cfg) as eng:
            want = eng.compute_dtype if cast_here else torch.bfloat16
            for t in range(4):
                g = torch.Generator().manual_seed(t)
                x, y = (torch.randn(8, 16, generator=g).bfloat16().to(want) for _ in range(2))
                keep = torch.zeros(2, dtype=torch.float16)
                loss = model((x,), extra={"y": y, "keep": keep}).float().square().mean()
                eng.backward(loss)
                eng.step()
                losses.append(float(loss.detach()))
        assert all(p.dtype == torch.float32 for p in model.parameters())
        x = torch.ones(3, 16, dtype=torch.bfloat16)
        losses.append(float(model((x,), extra={"y": x, "keep": torch.zeros(1, dtype=torch.float16)}).sum().detach()))
        out[cast_here] = losses
    assert out[False] == out[True], out
    # the model, hook and all, still pickles (torch.save(model)) and casts once loaded
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    got = float(again((x,), extra={"y": x, "keep": torch.zeros(1, dtype=torch.float16)}).sum().detach())
    assert got == out[True][-1]


# ----------------------------------------------------------------------------- against plain torch
@pytest.mark.parametrize("mode", ["sync", "dpu", "overlap"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fp32_compute_matches_the_plain_torch_reference(mode, dtype):
    """30 steps, teacher-forced: each step the engine's weights are the schedule's (bf16 or
    fp16 values, within a rounding flip), the reference computes fp32 forward and backward
    on them, rounds each gradient to 16 bits and runs torch AdamW on an fp32 master.
    (Mutation: sending the fp32 gradients' bytes unrounded, or computing the forward on
    weights that are not the 16-bit values, moves the master beyond 1e-4.)"""
    make, batch = (gpt, gpt_batch) if dtype == "bf16" else (mlp, mlp_batch)
    p0, master, ref_master, losses, ref_losses, st = run_pair(
        make, batch, dtype, steps=30, dpu=4 if mode == "dpu" else None, compute="fp32",
        overlap=mode == "overlap", progress_block=512)
    assert st["compute_dtype"] == "float32"
    assert rel_err(master - p0, ref_master - p0) < 1e-4
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-3 * abs(b)


@pytest.mark.parametrize("undo", [0, 1 << 26], ids=["overlap", "overlap-spec"])
def test_fp32_compute_overlap_is_bitwise_sync(tmp_path, undo):
    """overlap_update's per-module copies up cast into the fp32 parameters in the forward's
    pre-hooks (and speculation during backward): bitwise the synchronous fp32 run.
    (Mutation: a hook that skipped the copy leaves a module on the old weights.)"""
    from tests.helpers.overlap_runs import assert_bitwise, run
    kw = dict(compute_dtype="fp32", clip_grad_norm=0.2)
    sync = run(tmp_path, mlp, mlp_batch, "bf16", False, **kw)
    over = run(tmp_path, mlp, mlp_batch, "bf16", True, undo_log_bytes=undo, **kw)
    assert_bitwise(over, sync, kw)
    assert over[4]["compute_dtype"] == "float32"


def test_fp32_compute_is_not_the_16_bit_run():
    """The two compute dtypes differ only in the forward and backward's rounding: close
    masters, not equal ones (were they equal, the fp32 path would not be in use)."""
    out = {}
    for compute in ("bf16", "fp32"):
        p0, master, *_ = run_pair(gpt, gpt_batch, "bf16", steps=10, compute=compute)
        out[compute] = master - p0
    assert 0 < rel_err(out["fp32"], out["bf16"]) < 0.1


def test_fp32_compute_checkpoint_resumes_bitwise(tmp_path):
    """A checkpoint stores the 16-bit weights (2 B/param, as with 16-bit compute); resuming
    under fp32 compute continues the uninterrupted run bit for bit."""
    cfg = dict(lr=1e-3, dtype="bf16", server={"threads": 1}, mode="dpu",
               expert={"compute_dtype": "fp32", "dpu_warmup_steps": 2})
    with OffloadEngine(gpt(), OffloadConfig(**cfg)) as eng:
        train_engine(eng, gpt_batch, 4, "bf16")
        eng.save_checkpoint(str(tmp_path))
        want = train_engine(eng, gpt_batch, 3, "bf16", start=5)
        want_w = eng.flat16.clone()
    with OffloadEngine(gpt(seed=1), OffloadConfig(**cfg)) as eng:
        eng.load_checkpoint(str(tmp_path))
        got = train_engine(eng, gpt_batch, 3, "bf16", start=5)
        assert got == want
        assert torch.equal(eng.flat16, want_w)
