"""The dtype forward and backward compute in: the 16-bit dtype, or fp32 on a CPU that
only emulates 16-bit matrix products.

On a CUDA device, and on a CPU with native 16-bit matrix units (AVX512_BF16 or AMX
for bf16, AVX512_FP16 or AMX-FP16 for fp16), the model computes in the 16-bit dtype
of its weights.  On a CPU without them, torch's 16-bit matmul is emulated element by
element: on a 2-core AVX2 EPYC a 1024x256 @ 256x768 bf16 product took 551 ms against
9.9 ms in fp32.  There the CPU device computes in fp32 ("compute dtype fp32"):

- the shared segment keeps the 16-bit weights the server writes (the traffic stays
  4 B/param/step: 16-bit gradients down, 16-bit weights up);
- the model's parameters are fp32 tensors, views of one fp32 flat buffer of the
  worker (4 B/param of worker RAM instead of the 2 of the 16-bit weights), refreshed
  from the 16-bit slot as each update lands: the copy up casts (one pass, in the
  weights-up path, no second copy of the model per step);
- so forward and backward run in fp32 on weights that hold 16-bit values exactly
  (every parameter's value is representable in the 16-bit dtype), and each gradient
  is rounded to 16 bits once, on its way down into the gradient slot.

The CPU's feature flags decide, unless oneDNN (which runs torch's CPU matmul) is
capped below them: ONEDNN_MAX_CPU_ISA=AVX2 (or DNNL_MAX_CPU_ISA, its older name) on an
AVX512_BF16 CPU makes the bf16 product as slow as on an AVX2 one (measured: 280 ms
against 3.6 ms in fp32 for the product above).  Where the variable caps the ISA, the
choice is measured instead (_probe, ~0.1 s once per engine).

Frozen parameters are rounded to 16-bit values too (they are weights); floating-point
buffers stay fp32.  Compared with 16-bit compute, only the rounding inside the
forward and backward differs (fp32 products and sums instead of 16-bit ones).
"""
from __future__ import annotations

import os
import time

import torch

# the CPU features that make torch's (oneDNN's) 16-bit matmul native, per dtype
NATIVE_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
CHOICES = ("auto", "fp32", "bf16", "fp16")


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


# oneDNN's ISA cap (its documented variable, and the older name it still reads)
ISA_CAP_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def isa_cap() -> str | None:
    """The ISA oneDNN is capped at by the environment (e.g. "AVX2"), None where it is not
    ("ALL" and "DEFAULT" cap nothing)."""
    for var in ISA_CAP_VARS:
        v = os.environ.get(var, "").strip().upper()
        if v and v not in ("ALL", "DEFAULT"):
            return f"{var}={v}"
    return None


# _probe's answers in this process: oneDNN reads its cap once, at start, so they hold for
# the process's life, and a second engine (or OffloadTrainer, which asks before its
# engine exists) gets the same answer without measuring again
_PROBED: dict[torch.dtype, float] = {}


def _probe(dtype: torch.dtype) -> float:
    """How many times slower a small 16-bit matmul is than fp32 on this CPU (~10 ms, once
    per process and dtype)."""
    if dtype not in _PROBED:
        _PROBED[dtype] = _measure(dtype)
    return _PROBED[dtype]


def _measure(dtype: torch.dtype) -> float:
    a, b = torch.ones(128, 256), torch.ones(256, 256)
    times = []
    for x, y in ((a, b), (a.to(dtype), b.to(dtype))):
        x @ y  # first call: oneDNN's set-up
        t0 = time.perf_counter()
        for _ in range(3):
            x @ y
        times.append(time.perf_counter() - t0)
    return times[1] / max(times[0], 1e-9)


def resolve(choice: str, dtype: str, device: torch.device) -> tuple[torch.dtype, str]:
    """(the compute dtype, why) for the config's compute_dtype, the 16-bit dtype and the device."""
    d16 = torch.bfloat16 if dtype == "bf16" else torch.float16
    if choice == dtype:
        return d16, "asked for"
    if choice == "fp32":
        if device.type != "cpu":
            raise ValueError("expert.compute_dtype='fp32' is for the CPU device (on a GPU the device would hold 4 "
                             "B/param of weights instead of 2): use expert.compute_dtype='auto' there")
        return torch.float32, "asked for"
    if choice != "auto":
        raise ValueError(f"expert.compute_dtype must be 'auto', 'fp32' or the weights' dtype {dtype!r}, got {choice!r}")
    if device.type != "cpu":
        return d16, f"{device.type} device"
    flags = cpu_flags()
    cap = isa_cap()
    if flags is not None and cap is None:
        have = [f for f in NATIVE_FLAGS[dtype] if f in flags]
        if have:
            return d16, f"CPU has {'/'.join(have)}"
        return torch.float32, f"CPU has none of {'/'.join(NATIVE_FLAGS[dtype])}: {dtype} matmul is emulated"
    ratio = _probe(d16)  # no feature list, or oneDNN capped below it: measure
    under = f" under {cap}" if cap else ""
    if ratio > 4.0:
        return torch.float32, f"{dtype} matmul measured {ratio:.1f}x slower than fp32{under}"
    return d16, f"{dtype} matmul measured {ratio:.1f}x the time of fp32{under}"


# the attribute on a model that holds its input cast's hook (one per model, however many
# engines it has had)
_CAST_ATTR = "_zero_offload_input_cast"


def install_input_cast(model: torch.nn.Module, dtype: torch.dtype, ref: torch.Tensor) -> None:
    """Cast the model's floating-point inputs in the 16-bit `dtype` to the dtype `ref` (a
    trained parameter) now has, at each call of the model, as FSDP2's MixedPrecisionPolicy
    (cast_forward_inputs) does: a script written for 16-bit compute (inputs made with
    .to(torch.bfloat16)) runs unchanged where the engine computes in fp32.  Inputs in other
    dtypes (token ids, fp32) pass as they are; nested tuples, lists and dicts are walked.
    The hook stays after close(): the model's parameters stay fp32 then, and a model cast
    back to 16 bits gets its inputs as they are.  It costs one walk of the arguments per
    forward of the root module (not of its submodules)."""
    if getattr(model, _CAST_ATTR, None) is not None:
        return
    setattr(model, _CAST_ATTR, model.register_forward_pre_hook(InputCast(dtype, ref), with_kwargs=True))


class InputCast:
    """The hook install_input_cast registers: an object, not a closure, so that a model
    that has it still pickles (torch.save(model) after training)."""

    def __init__(self, dtype: torch.dtype, ref: torch.Tensor):
        self.dtype, self.ref = dtype, ref

    def __call__(self, module, args, kwargs):
        want = self.ref.dtype
        if want == self.dtype:
            return None
        return _cast(args, self.dtype, want), _cast(kwargs, self.dtype, want)


def _cast(x, dtype: torch.dtype, want: torch.dtype):
    """x with its tensors in `dtype` cast to `want` (a module-level function: a nested one
    that called itself would make a reference cycle holding `ref` until the cyclic
    collector ran)."""
    if isinstance(x, torch.Tensor):
        return x.to(want) if x.dtype == dtype else x
    if type(x) in (tuple, list):
        return type(x)(_cast(y, dtype, want) for y in x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_cast(y, dtype, want) for y in x))
    if type(x) is dict:
        return {k: _cast(v, dtype, want) for k, v in x.items()}
    return x  # other containers pass as they are
