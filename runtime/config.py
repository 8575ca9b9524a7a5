"""OffloadConfig: every knob of the training-side engine, validated up front."""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Callable, Union

from zero_offload.server.config import ADDRESS_ENV, TOKEN_ENV, TRACE_DIR_ENV

REQUEST_TIMEOUT_ENV = "ZERO_OFFLOAD_REQUEST_TIMEOUT_S"
from zero_offload.server.protocol import COMPACT_OPTIMIZERS, DTYPES, MAX_PREDICT, OPTIMIZERS, STATE_DTYPES

LrType = Union[float, Callable[[int], float]]
# the loss-scaling fields: any of them away from its default under bf16 warns
LOSS_SCALING_FIELDS = ("loss_scale", "initial_scale", "growth_factor", "backoff_factor", "growth_interval")


@dataclass(kw_only=True)
class OffloadConfig:
    """Settings of OffloadEngine.

    lr: a float, or a callable of the 1-based update number returning the lr
        (a torch LR scheduler on engine.optimizer works too).
    betas, eps, weight_decay: optimizer hyper-parameters (Lion uses betas; Adagrad eps).
    optimizer: "adamw" (decoupled decay), "adam" (L2), "adagrad" or "lion".
    dtype: 16-bit type of the weights and gradients on the device: "fp16" or "bf16".
    compute_dtype: what forward and backward compute in (runtime.compute_dtype): "auto"
        (default): the 16-bit dtype, except on a CPU device without native 16-bit matrix
        units (no AVX512_BF16/AMX for bf16), where it is emulated and "fp32" is used: the
        parameters are fp32 tensors holding the 16-bit weights' values, refreshed from the
        16-bit slot as each update lands (4 B/param of worker RAM, the same 4 B/param/step
        of traffic).  "fp32" or the 16-bit dtype forces either ("fp32": CPU device only).
        stats()["compute_dtype"] and ["compute_dtype_why"] say what was picked and why.
    loss_scale: "dynamic" (GradScaler's rules) or a fixed positive float; fp16 only (with bf16
        any loss-scaling field set away from its default warns that it is ignored).
    initial_scale, growth_factor, backoff_factor, growth_interval: dynamic scaling
        (torch.amp.GradScaler's defaults).
    clip_grad_norm: None, or the max global L2 norm of the unscaled gradients.
    grad_accumulation_steps: micro-batches per optimizer step; each backward's loss
        is divided by it, so k micro-batches equal one k times larger batch.
    dpu: One-Step Delayed Parameter Update after dpu_warmup_steps synchronous steps.
    dpu_warmup_steps: synchronous steps before DPU starts (the ZeRO-Offload paper's N = 40).
    dpu_predict: weight prediction under DPU (adam/adamw): the device gets
        M_k + dpu_predict * (M_k - M_(k-1)) instead of the stale M_k, an estimate of the
        weights a synchronous run would have; computed in the update's own pass, no
        extra memory traffic.  0 = plain DPU (the paper's), 1 = linear extrapolation.
    dpu_grad_slots: 1 (default): DPU's next gradients go into the slot the update in
        flight is still reading, each range only once the server has published that it
        is past it (its progress word; backward and the update both run front to back,
        so this rarely waits): host RAM stays 16 B/param.  2: a second gradient slot
        (+2 B/param) and backward never waits (1.00-1.10x faster on the CPU device in two
        bench_pipeline runs at the balanced 85M case: BENCHMARKS.md).
    overlap_update: results bitwise those of the synchronous engine, with the CPU
        update running during the next forward (runtime.overlap): step() returns once
        the norm is known and STEP is sent; the server updates back to front (the next
        forward's order) and each module's forward pre-hook waits only for its own
        parameters' new weights.  One rank: the update hides behind the next forward
        as far as that forward lasts; several ranks: the first forward hook waits for
        the whole update (exact, little overlap).  Not with dpu (a choice between the
        two: dpu hides more and computes on weights one update old).
    undo_log_bytes: speculation during backward (sync or overlap_update, not dpu; any ranks):
        0 (default) turns it off.  Otherwise, as each bucket's gradients land in the host
        slot the server updates them at once, assuming no clipping and no overflow, after
        saving what it overwrites in an undo log of at most this many bytes of host RAM
        (the state: 12 B/param of model with fp32 state, 6 with bf16 state, 4.03 with
        int8; plus the weights slot's 2 where there is one weights slot, as on a GPU:
        a CPU worker has two, and a STEP writes the one it does not compute with); it
        stops where the log is full.  With adam/adamw and fp32 state, or bf16 state
        with the exact master, a log that holds all of it is spent instead on a twin of
        the state (12 or 6 B/param) and a log of the weights slot (2, where it is
        logged): the update writes the new state beside the old, so speculating moves
        about the bytes of a plain update and a rollback copies no state back
        (BENCHMARKS.md).  step() then keeps
        the speculated part when its values turn out as assumed, else the server puts the
        saved bytes back and runs the whole update (a clip that fires, an overflow, an lr
        changed after backward): bitwise the synchronous result either way.  It pays when
        clipping rarely fires (README, "Choose a mode"); runtime.speculation backs off after
        rollbacks.
    state_dtype: the optimizer state's dtype on the server (adam/adamw/lion): "fp32" (default:
        12 B/param of master, m and v, plus 4 shared) or "bf16": m and v in bf16 with
        stochastic rounding, and with bf16 weights (and no dpu_predict) the exact
        master, the fp32 master kept as the weights' bf16 plus a 16-bit remainder, the
        same fp32 bits as an fp32 master: 6 B/param plus 4 shared, and an update that
        moves 18 B/param instead of 28 (optimizer_server.state; README, "Choose a state dtype");
        or "int8": m and v (Lion: m) as 8-bit codes with a scale per block of 256
        (cython_ext/_kernels_int8.h), the same exact master: 4.03 B/param plus 4 shared
        (Lion: 3.02).
    bucket_numel: gradient elements per bucket copied to the host as one transfer.
    cpu_zero_copy: when the device is this CPU and there is one rank, the model's 16-bit
        weights live in the shared segment (two slots): the server writes the next weights
        into the slot the model is not using and landing an update swaps the model onto
        it, so no weight bytes are copied (the gradients still are).  False: copy them
        like a GPU would (what the copy path's CPU tests use).
    overlap_weights_up: copy the new weights up as the server publishes them (during
        the wait, and with DPU inside the next backward as it frees each bucket).
        False: the whole shard after DONE, as before version 2 of the protocol (for A/B).
    progress_block_numel: the server publishes its progress through an update every
        this many elements, and the engine copies finished weights up that soon
        (runtime.weights_up).  Smaller: less copy left after the update, more
        publications (each a few microseconds).
    staging_numel: fp32 elements per chunk of the initial weights and GET_MASTER
        (the staging window of the shared segment; 0 = the server's 16M, 64 MiB).
        Within the gradient slots it costs nothing; smaller only means more round trips.
    server_address / server_token: connect to a running server; "" = the launcher's
        environment variables, or a private server started (and stopped) by the engine.
    server_threads: OpenMP threads of a private server's updates (0 = its default).
    request_timeout_s: bound on a wait for the server with no progress (the server reports
        the bytes its long requests move; a STEP its published blocks), so a checkpoint of
        any size is never cut short while it moves.  Default: $ZERO_OFFLOAD_REQUEST_TIMEOUT_S
        or 300 (scripts/gpu_check.sh sets 30, so a hung request costs the GPU run little).
    trace_dir: write this process's Chrome trace here ("" = $ZERO_OFFLOAD_TRACE_DIR, which
        zero-offload-launch --trace-dir sets for every worker, else no tracing).
    param_align_numel: each parameter's offset in the flat space is a multiple of it
        (0 = 128 on a GPU, 256 bytes of 16-bit weights, which cuBLAS needs for its fast
        kernels; 1, packed, on the CPU).  A checkpoint loads only under the alignment it
        was saved with: the error names the value to set.
    pin_host_memory: CUDA only: page-lock the shared segment (cudaHostRegister) so copies
        are DMA overlapping compute.  "auto": try, and if the system refuses (locked-memory
        limit, a sandbox) warn and go on with pageable copies, which are slower and block;
        "require": raise instead; "off": do not try.
    device: where the 16-bit weights live ("" = where the model's parameters are).
        Build the fp32 model on the CPU and pass device="cuda" to train a model whose
        fp32 copy would not fit on the GPU: only 2 B/param ever reach the device.
    """

    lr: LrType = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    optimizer: str = "adamw"
    dtype: str = "fp16"
    compute_dtype: str = "auto"
    loss_scale: Union[str, float] = "dynamic"
    initial_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clip_grad_norm: float | None = None
    grad_accumulation_steps: int = 1
    dpu: bool = False
    dpu_warmup_steps: int = 40
    dpu_predict: float = 0.0
    dpu_grad_slots: int = 1
    overlap_update: bool = False
    undo_log_bytes: int = 0
    state_dtype: str = "fp32"
    bucket_numel: int = 1 << 24
    cpu_zero_copy: bool = True
    overlap_weights_up: bool = True
    progress_block_numel: int = 1 << 20
    staging_numel: int = 0
    server_address: str = ""
    server_token: str = ""
    server_threads: int = 0
    request_timeout_s: float = field(default_factory=lambda: float(os.environ.get(REQUEST_TIMEOUT_ENV, "300")))
    trace_dir: str = ""
    device: str = ""
    pin_host_memory: str = "auto"
    param_align_numel: int = 0

    def __post_init__(self) -> None:
        if callable(self.lr):
            pass
        elif not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) or self.lr < 0:
            raise ValueError(f"lr must be a finite float >= 0 or a callable(step) -> float, got {self.lr!r}")
        if (not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2
                or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas)):
            raise ValueError(f"betas must be two floats in [0, 1), got {self.betas!r}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not (isinstance(self.eps, (int, float)) and self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be a finite float > 0, got {self.eps!r}")
        if not (isinstance(self.weight_decay, (int, float)) and 0 <= self.weight_decay < math.inf):
            raise ValueError(f"weight_decay must be a finite float >= 0, got {self.weight_decay!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.compute_dtype not in ("auto", "fp32", self.dtype):
            raise ValueError(f"compute_dtype must be 'auto', 'fp32' or the weights' dtype {self.dtype!r}, "
                             f"got {self.compute_dtype!r}")
        if self.loss_scale != "dynamic":
            if not (isinstance(self.loss_scale, (int, float)) and math.isfinite(self.loss_scale)
                    and self.loss_scale > 0):
                raise ValueError(f"loss_scale must be 'dynamic' or a finite float > 0, got {self.loss_scale!r}")
        if not self.initial_scale > 0:
            raise ValueError(f"initial_scale must be > 0, got {self.initial_scale}")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(f"growth_interval must be an int >= 1, got {self.growth_interval!r}")
        if self.dtype == "bf16":
            scaling = {f.name: getattr(self, f.name) for f in fields(self)
                       if f.name in LOSS_SCALING_FIELDS and getattr(self, f.name) != f.default}
            if scaling:
                # said, not silently dropped: a script ported from fp16 may count on it
                warnings.warn(f"{', '.join(f'{k}={v!r}' for k, v in scaling.items())}: loss scaling is for fp16, "
                              f"and with dtype='bf16' (fp32's exponent range, no overflow to guard against) it is "
                              f"ignored; remove it", UserWarning, stacklevel=3)
        if self.clip_grad_norm is not None and not (self.clip_grad_norm > 0 and math.isfinite(self.clip_grad_norm)):
            raise ValueError(f"clip_grad_norm must be None or a finite float > 0, got {self.clip_grad_norm!r}")
        if not (isinstance(self.grad_accumulation_steps, int) and self.grad_accumulation_steps >= 1):
            raise ValueError(f"grad_accumulation_steps must be an int >= 1, got {self.grad_accumulation_steps!r}")
        if not (isinstance(self.dpu_warmup_steps, int) and self.dpu_warmup_steps >= 1):
            raise ValueError(f"dpu_warmup_steps must be an int >= 1, got {self.dpu_warmup_steps!r}")
        if self.overlap_update and self.dpu:
            raise ValueError("overlap_update and dpu are two ways to hide the CPU update: choose one (overlap_update "
                             "keeps the synchronous result bit for bit; dpu hides more, on weights one update old)")
        if not (isinstance(self.undo_log_bytes, int) and self.undo_log_bytes >= 0):
            raise ValueError(f"undo_log_bytes must be an int >= 0 (0: no speculation), got {self.undo_log_bytes!r}")
        if self.undo_log_bytes and self.dpu:
            raise ValueError("undo_log_bytes (speculation during backward) and dpu do not combine: under DPU the "
                             "server is still running the previous update while backward runs; choose dpu, or "
                             "overlap_update with undo_log_bytes (bitwise the synchronous result)")
        if self.dpu_grad_slots not in (1, 2):
            raise ValueError(f"dpu_grad_slots must be 1 or 2, got {self.dpu_grad_slots!r}")
        if not (isinstance(self.dpu_predict, (int, float)) and 0.0 <= self.dpu_predict <= MAX_PREDICT):
            raise ValueError(f"dpu_predict must be in [0, {MAX_PREDICT:g}], got {self.dpu_predict!r}")
        if self.dpu_predict and self.optimizer not in ("adamw", "adam"):
            raise ValueError(f"dpu_predict works with optimizer adamw or adam, not {self.optimizer!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {self.state_dtype!r}")
        if self.state_dtype != "fp32" and self.optimizer not in COMPACT_OPTIMIZERS:
            raise ValueError(f"state_dtype {self.state_dtype!r} works with optimizer {' or '.join(COMPACT_OPTIMIZERS)}, "
                             f"not {self.optimizer!r}: use state_dtype='fp32'")
        if not (isinstance(self.bucket_numel, int) and self.bucket_numel >= 1024):
            raise ValueError(f"bucket_numel must be an int >= 1024, got {self.bucket_numel!r}")
        if not (isinstance(self.progress_block_numel, int) and self.progress_block_numel >= 1):
            raise ValueError(f"progress_block_numel must be an int >= 1, got {self.progress_block_numel!r}")
        if not (isinstance(self.staging_numel, int) and self.staging_numel >= 0):
            raise ValueError(f"staging_numel must be an int >= 0 (0: the server's default), got {self.staging_numel!r}")
        if self.server_address and not self.server_address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"server_address must start with ipc:// or tcp://, got {self.server_address!r}")
        if not (isinstance(self.server_threads, int) and self.server_threads >= 0):
            raise ValueError(f"server_threads must be an int >= 0, got {self.server_threads!r}")
        if self.pin_host_memory not in ("auto", "require", "off"):
            raise ValueError(f"pin_host_memory must be 'auto', 'require' or 'off', got {self.pin_host_memory!r}")
        if self.device and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be '', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not (isinstance(self.param_align_numel, int) and 0 <= self.param_align_numel <= 1 << 16):
            raise ValueError(f"param_align_numel must be an int in [0, 65536] (0: auto), got {self.param_align_numel!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

    def resolved_server(self) -> tuple[str, str]:
        """(address, token) to connect to, or ("", "") for a private server."""
        addr = self.server_address or os.environ.get(ADDRESS_ENV, "")
        token = self.server_token or os.environ.get(TOKEN_ENV, "")
        if addr and not token:
            raise ValueError(f"server_address {addr!r} given without a token: set server_token or ${TOKEN_ENV} "
                             f"(the server writes it to ADDRESS_FILE.token)")
        return addr, token

    def resolved_trace_dir(self) -> str:
        """trace_dir, or the launcher's $ZERO_OFFLOAD_TRACE_DIR when it is empty."""
        return self.trace_dir or os.environ.get(TRACE_DIR_ENV, "")

    @property
    def exact_master(self) -> bool:
        """The server keeps the fp32 master as the bf16 weights plus a remainder: with a
        compact state_dtype, where the weights slot holds the master's rounding (bf16
        weights, no weight prediction)."""
        return self.state_dtype != "fp32" and self.dtype == "bf16" and not (self.dpu and self.dpu_predict)

    def lr_at(self, update: int) -> float:
        lr = self.lr(update) if callable(self.lr) else self.lr
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr schedule returned {lr!r} at update {update}; it must be a finite float >= 0")
        return float(lr)
