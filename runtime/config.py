"""OffloadConfig: every knob of the training-side engine, validated up front.

The top level holds what a user sets (the optimizer's values, the 16-bit dtype, the
state dtype, the mode); three groups hold the rest, each a dataclass of its own that
may also be given as a dict of its fields:

    loss_scaling  LossScaling      fp16's loss scaling (torch.amp.GradScaler's rules)
    server        ServerConnection which optimizer server, its threads, the request bound
    expert        ExpertConfig     tuning knobs, DPU's details, the exact mode's strategy,
                                   and the A/B switches benchmarks and tests use

The flat names of the versions before the groups (dpu=True, overlap_update=True,
undo_log_bytes=..., server_threads=..., loss_scale=..., bucket_numel=..., ...) still
work, with a DeprecationWarning naming the new field (DEPRECATED below); giving one
together with its new place is refused.
"""
from __future__ import annotations

import inspect
import math
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Union

from zero_offload.server.config import ADDRESS_ENV, TOKEN_ENV, TRACE_DIR_ENV
from zero_offload.server.protocol import (COMPACT_OPTIMIZERS, DTYPES, MAX_PREDICT, MIN_PROGRESS_BLOCK, OPTIMIZERS,
                                          STATE_DTYPES)

from .exact_mode import STRATEGIES, strategy_of

REQUEST_TIMEOUT_ENV = "ZERO_OFFLOAD_REQUEST_TIMEOUT_S"

LrType = Union[float, Callable[[int], float]]
MODES = ("exact", "dpu")
# how mode="exact" hides the CPU update (runtime.exact_mode: every one gives the bits of sync)
EXACT_STRATEGIES = ("auto", *STRATEGIES)
MULTI_RANK = ("auto", "builtin", "fsdp2-zero2", "fsdp2-zero3")  # ExpertConfig.multi_rank


@dataclass(kw_only=True)
class LossScaling:
    """fp16 loss scaling, torch.amp.GradScaler's rules.  With dtype="bf16" (fp32's
    exponent range: nothing overflows) it is ignored, and a field set away from its
    default warns."""

    scale: Union[str, float] = "dynamic"
    """"dynamic" (GradScaler's rules) or a fixed positive float."""
    initial_scale: float = 2.0 ** 16
    """The dynamic scale's start."""
    growth_factor: float = 2.0
    """The dynamic scale grows by it after growth_interval clean steps in a row."""
    backoff_factor: float = 0.5
    """... and shrinks by it on a step with an inf/NaN gradient (which is skipped)."""
    growth_interval: int = 2000
    """Clean steps in a row before the scale grows."""

    def __post_init__(self) -> None:
        if self.scale != "dynamic":
            if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
                raise ValueError(f"loss_scaling.scale must be 'dynamic' or a finite float > 0, got {self.scale!r}")
        if not self.initial_scale > 0:
            raise ValueError(f"loss_scaling.initial_scale must be > 0, got {self.initial_scale}")
        if not self.growth_factor > 1:
            raise ValueError(f"loss_scaling.growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"loss_scaling.backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(f"loss_scaling.growth_interval must be an int >= 1, got {self.growth_interval!r}")


@dataclass(kw_only=True)
class ServerConnection:
    """Which optimizer server the engine talks to, and how long it waits for one."""

    address: str = ""
    """Connect to a running server (ipc:// or tcp://); "" = the launcher's
    $ZERO_OFFLOAD_ADDRESS, or a private server started and stopped by the engine."""
    token: str = ""
    """That server's token ("" = $ZERO_OFFLOAD_TOKEN; the server writes it beside its address file)."""
    threads: int = 0
    """OpenMP threads of a private server's updates (0 = its default)."""
    request_timeout_s: float = field(default_factory=lambda: float(os.environ.get(REQUEST_TIMEOUT_ENV, "300")))
    """Bound on a wait for the server with no progress (the server reports the bytes its
    long requests move, a STEP its published blocks), so a checkpoint of any size is never
    cut short while it moves.  Default: $ZERO_OFFLOAD_REQUEST_TIMEOUT_S or 300."""

    def __post_init__(self) -> None:
        if self.address and not self.address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"server.address must start with ipc:// or tcp://, got {self.address!r}")
        if not (isinstance(self.threads, int) and self.threads >= 0):
            raise ValueError(f"server.threads must be an int >= 0, got {self.threads!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"server.request_timeout_s must be > 0, got {self.request_timeout_s}")


@dataclass(kw_only=True)
class ExpertConfig:
    """Knobs a user rarely needs: tuning, DPU's details, the exact mode's strategy, and
    A/B switches for benchmarks and tests (the last group)."""

    compute_dtype: str = "auto"
    """What forward and backward compute in (runtime.compute_dtype): "auto": the 16-bit
    dtype, except on a CPU device without native 16-bit matrix units (no AVX512_BF16/AMX
    for bf16), where it is emulated and "fp32" is used: the parameters are fp32 tensors
    holding the 16-bit weights' values, refreshed from the 16-bit slot as each update
    lands (4 B/param of worker RAM, the same 4 B/param/step of traffic).  "fp32" or the
    16-bit dtype forces either ("fp32": CPU device only).  stats()["compute_dtype"] and
    ["compute_dtype_why"] say what was picked and why."""
    exact_strategy: str = "auto"
    """mode="exact" only: how the CPU update is hidden, all with the bits of sync
    (runtime.exact_mode).  "auto": the engine measures the candidates over its first
    steps, keeps the fastest, and measures again when the step time changes.  Or one
    of "sync", "overlap_update" (the update runs during the next forward),
    "speculation" (it starts during backward, undo-logged),
    "overlap_update+speculation", for benchmarks."""
    undo_log_bytes: int | None = None
    """Speculation's host RAM: the undo log's capacity; a log that holds a whole update is
    spent on a twin of the state instead (12 B/param with fp32 state, 6 with bf16 state
    and the exact master; int8 state has none: its log holds 4.03 + 2).  None: under
    exact_strategy="auto", what a whole update needs if that fits in half the host RAM
    left at set-up once the shard holds its state and segment (else speculation is not
    a candidate); 0: never speculate."""
    dpu_warmup_steps: int = 40
    """mode="dpu": synchronous steps before DPU starts (the ZeRO-Offload paper's N = 40)."""
    dpu_predict: float = 0.0
    """mode="dpu", adam/adamw: the device gets M_k + dpu_predict * (M_k - M_(k-1)) instead
    of the stale M_k, an estimate of the weights a synchronous run would have; computed in
    the update's own pass.  0 = plain DPU (the paper's), 1 = linear extrapolation."""
    dpu_grad_slots: int = 1
    """mode="dpu": 1: the next gradients go into the slot the update in flight still reads,
    each range once the server is past it (host RAM stays 16 B/param).  2: a second
    gradient slot (+2 B/param) and backward never waits."""
    bucket_numel: int = 1 << 24
    """Gradient elements per bucket copied to the host as one transfer."""
    progress_block_numel: int = 1 << 20
    """The server publishes its progress through an update every this many elements, and
    the engine copies finished weights up that soon (runtime.weights_up)."""
    staging_numel: int = 0
    """fp32 elements per chunk of the initial weights and GET_MASTER (0 = the server's 16M)."""
    param_align_numel: int = 0
    """Each parameter's offset in the flat space is a multiple of it (0 = 128 on a GPU, 256
    bytes of 16-bit weights, which cuBLAS needs for its fast kernels; 1, packed, on the
    CPU).  A checkpoint loads only under the alignment it was saved with."""
    pin_host_memory: str = "auto"
    """CUDA only: page-lock the shared segment.  "auto": try, and on refusal warn and go on
    with pageable copies (slower, blocking); "require": raise instead; "off": do not try."""
    trace_dir: str = ""
    """Write this process's Chrome trace here ("" = $ZERO_OFFLOAD_TRACE_DIR, which
    zero-offload-launch --trace-dir sets, else no tracing)."""
    multi_rank: str = "auto"
    """How several ranks train a plain model (OffloadEngine, and OffloadAdamW/OffloadLion/
    OffloadTrainer given model=): "fsdp2-zero2" or "fsdp2-zero3": the library shards the
    model with torch's FSDP2 (runtime.engine_fsdp2: one unit per transformer block, the
    root last; reshard_after_forward False or True) and each rank offloads its local
    shards, as for a model the user wrapped; "builtin": the engine's own ZeRO-2
    collectives (what an optimizer built without model= uses, and what a model whose
    ranks use different parameters in one step needs: FSDP2 reduces the same parameters
    on every rank); "auto" (the default): "fsdp2-zero2", but "builtin" for int8 state (its
    per-256 scales do not follow FSDP2's rows, so FSDP2 checkpoints refuse it) and for
    exact_strategy "overlap_update"/"overlap_update+speculation" (the update runs inside the
    forward, where FSDP2 all-gathers first).  Agreed by every rank before use.  A model
    already wrapped with fully_shard is taken as it is whatever this says."""
    # -- A/B switches for benchmarks and tests
    cpu_zero_copy: bool = True
    """One CPU rank: the model's 16-bit weights live in the shared segment (two slots, no
    weight bytes copied).  False: copy them as a GPU would."""
    overlap_weights_up: bool = True
    """Copy the new weights up as the server publishes them.  False: the whole shard after
    DONE (as before version 2 of the protocol)."""

    def __post_init__(self) -> None:
        if self.exact_strategy not in EXACT_STRATEGIES:
            raise ValueError(f"expert.exact_strategy must be one of {EXACT_STRATEGIES}, got {self.exact_strategy!r}")
        if self.undo_log_bytes is not None and not (isinstance(self.undo_log_bytes, int) and self.undo_log_bytes >= 0):
            raise ValueError(f"expert.undo_log_bytes must be None (auto) or an int >= 0 (0: no speculation), "
                             f"got {self.undo_log_bytes!r}")
        if not (isinstance(self.dpu_warmup_steps, int) and self.dpu_warmup_steps >= 1):
            raise ValueError(f"expert.dpu_warmup_steps must be an int >= 1, got {self.dpu_warmup_steps!r}")
        if self.dpu_grad_slots not in (1, 2):
            raise ValueError(f"expert.dpu_grad_slots must be 1 or 2, got {self.dpu_grad_slots!r}")
        if not (isinstance(self.dpu_predict, (int, float)) and 0.0 <= self.dpu_predict <= MAX_PREDICT):
            raise ValueError(f"expert.dpu_predict must be in [0, {MAX_PREDICT:g}], got {self.dpu_predict!r}")
        if not (isinstance(self.bucket_numel, int) and self.bucket_numel >= 1024):
            raise ValueError(f"expert.bucket_numel must be an int >= 1024, got {self.bucket_numel!r}")
        if not (isinstance(self.progress_block_numel, int) and self.progress_block_numel >= MIN_PROGRESS_BLOCK):
            raise ValueError(f"expert.progress_block_numel must be an int >= {MIN_PROGRESS_BLOCK}, "
                             f"got {self.progress_block_numel!r}")
        if not (isinstance(self.staging_numel, int) and self.staging_numel >= 0):
            raise ValueError(f"expert.staging_numel must be an int >= 0 (0: the server's default), "
                             f"got {self.staging_numel!r}")
        if not (isinstance(self.param_align_numel, int) and 0 <= self.param_align_numel <= 1 << 16):
            raise ValueError(f"expert.param_align_numel must be an int in [0, 65536] (0: auto), "
                             f"got {self.param_align_numel!r}")
        if self.multi_rank not in MULTI_RANK:
            raise ValueError(f"expert.multi_rank must be one of {MULTI_RANK}, got {self.multi_rank!r}")
        if self.pin_host_memory not in ("auto", "require", "off"):
            raise ValueError(f"expert.pin_host_memory must be 'auto', 'require' or 'off', got {self.pin_host_memory!r}")


GROUPS = {"loss_scaling": LossScaling, "server": ServerConnection, "expert": ExpertConfig}

# the flat names before the groups: old name -> (group, field); see OffloadConfig.__init__
DEPRECATED = {
    "loss_scale": ("loss_scaling", "scale"),
    **{k: ("loss_scaling", k) for k in ("initial_scale", "growth_factor", "backoff_factor", "growth_interval")},
    "server_address": ("server", "address"), "server_token": ("server", "token"),
    "server_threads": ("server", "threads"), "request_timeout_s": ("server", "request_timeout_s"),
    **{k: ("expert", k) for k in ("compute_dtype", "dpu_warmup_steps", "dpu_predict", "dpu_grad_slots",
                                  "bucket_numel", "progress_block_numel", "staging_numel", "param_align_numel",
                                  "pin_host_memory", "trace_dir", "cpu_zero_copy", "overlap_weights_up",
                                  "undo_log_bytes")},
}
# the flat mode switches: dpu=True is mode="dpu"; overlap_update and undo_log_bytes > 0
# name an exact_strategy
MODE_SWITCHES = ("dpu", "overlap_update")


@dataclass(kw_only=True)
class OffloadConfig:
    """Settings of OffloadEngine (OffloadAdamW and OffloadLion take the same as keywords)."""

    lr: LrType = 1e-3
    """A float, or a callable of the 1-based update number returning the lr (a torch LR
    scheduler on engine.optimizer works too)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (Lion's) betas."""
    eps: float = 1e-8
    """Adam's (Adagrad's) eps."""
    weight_decay: float = 0.0
    """Decoupled (adamw, lion) or L2 (adam, adagrad)."""
    optimizer: str = "adamw"
    """"adamw" (decoupled decay), "adam" (L2), "adagrad" or "lion"."""
    dtype: str = "bf16"
    """The 16-bit type of the weights and gradients on the device: "bf16" (the default, as
    OffloadAdamW's: fp32's exponent range, no loss scaling) or "fp16" (needs loss scaling:
    OffloadEngine's backward(loss) does it, loss_scaling says how)."""
    state_dtype: str = "fp32"
    """The optimizer state's dtype on the server (adam/adamw/lion): "fp32" (12 B/param of
    master, m and v, plus 4 shared); "bf16": m and v in bf16 with stochastic rounding, and
    with bf16 weights the exact master (the fp32 master kept as the weights' bf16 plus a
    16-bit remainder, the same fp32 bits): 6 B/param plus 4 shared; "int8": m and v (Lion:
    m) as 8-bit codes with a scale per block of 256, the same exact master: 4.03 B/param
    plus 4 shared.  README, "Choose a state dtype"."""
    mode: str = "exact"
    """"exact" (default): the result is bitwise the synchronous engine's; the engine picks
    how to hide the CPU update (sync, overlap_update, speculation) by measuring, and
    stats()["exact_strategy"] / ["exact_strategy_why"] say what it picked and why
    (runtime.exact_mode; expert.exact_strategy forces one).  "dpu": One-Step Delayed
    Parameter Update after expert.dpu_warmup_steps synchronous steps: the update of step
    t runs during step t+1, which computes on weights one update old (the ZeRO-Offload
    paper's; it hides the most).  README, "Choose a mode"."""
    clip_grad_norm: float | None = None
    """None, or the max global L2 norm of the unscaled gradients."""
    grad_accumulation_steps: int = 1
    """Micro-batches per optimizer step; each backward's loss is divided by it, so k
    micro-batches equal one k times larger batch."""
    device: str = ""
    """Where the 16-bit weights live ("" = where the model's parameters are).  Build the
    fp32 model on the CPU and pass device="cuda" to train a model whose fp32 copy would not
    fit on the GPU: only 2 B/param ever reach the device."""
    loss_scaling: LossScaling = field(default_factory=LossScaling)
    """fp16's loss scaling (a LossScaling, or a dict of its fields)."""
    server: ServerConnection = field(default_factory=ServerConnection)
    """The optimizer server (a ServerConnection, or a dict of its fields)."""
    expert: ExpertConfig = field(default_factory=ExpertConfig)
    """Tuning knobs and A/B switches (an ExpertConfig, or a dict of its fields)."""

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():
            v = getattr(self, name)
            if isinstance(v, dict):
                unknown = sorted(set(v) - {f.name for f in fields(cls)})
                if unknown:
                    raise ValueError(f"{name}: unknown field(s) {unknown}; {cls.__name__} has "
                                     f"{[f.name for f in fields(cls)]}")
                setattr(self, name, cls(**v))
            elif not isinstance(v, cls):
                raise ValueError(f"{name} must be a {cls.__name__} or a dict of its fields, got {type(v).__name__}")
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
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        x = self.expert
        if x.compute_dtype not in ("auto", "fp32", self.dtype):
            raise ValueError(f"expert.compute_dtype must be 'auto', 'fp32' or the weights' dtype {self.dtype!r}, "
                             f"got {x.compute_dtype!r}")
        if self.dtype == "bf16":
            scaling = {f.name: getattr(self.loss_scaling, f.name) for f in fields(LossScaling)
                       if getattr(self.loss_scaling, f.name) != f.default}
            if scaling:
                # said, not silently dropped: a script ported from fp16 may count on it
                warnings.warn(f"loss_scaling {', '.join(f'{k}={v!r}' for k, v in scaling.items())}: loss scaling is "
                              f"for fp16, and with dtype='bf16' (fp32's exponent range, no overflow to guard against) "
                              f"it is ignored; remove it", UserWarning, stacklevel=3)
        if self.clip_grad_norm is not None and not (self.clip_grad_norm > 0 and math.isfinite(self.clip_grad_norm)):
            raise ValueError(f"clip_grad_norm must be None or a finite float > 0, got {self.clip_grad_norm!r}")
        if not (isinstance(self.grad_accumulation_steps, int) and self.grad_accumulation_steps >= 1):
            raise ValueError(f"grad_accumulation_steps must be an int >= 1, got {self.grad_accumulation_steps!r}")
        if self.mode == "dpu" and x.exact_strategy != "auto":
            raise ValueError(f"expert.exact_strategy={x.exact_strategy!r} is for mode='exact'; mode='dpu' is a choice "
                             f"between the two (exact keeps the synchronous result bit for bit; dpu hides more, on "
                             f"weights one update old)")
        if self.mode == "dpu" and x.undo_log_bytes:
            raise ValueError("expert.undo_log_bytes (speculation during backward) and mode='dpu' do not combine: under "
                             "DPU the server is still running the previous update while backward runs; choose "
                             "mode='dpu', or mode='exact' (which speculates where it pays)")
        if "speculation" in x.exact_strategy and x.undo_log_bytes == 0:
            raise ValueError(f"expert.exact_strategy={x.exact_strategy!r} needs an undo log: leave "
                             f"expert.undo_log_bytes at None (what a whole update needs) or give it bytes")
        if x.dpu_predict and self.optimizer not in ("adamw", "adam"):
            raise ValueError(f"expert.dpu_predict works with optimizer adamw or adam, not {self.optimizer!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {self.state_dtype!r}")
        if self.state_dtype != "fp32" and self.optimizer not in COMPACT_OPTIMIZERS:
            raise ValueError(f"state_dtype {self.state_dtype!r} works with optimizer {' or '.join(COMPACT_OPTIMIZERS)}, "
                             f"not {self.optimizer!r}: use state_dtype='fp32'")
        if self.device and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be '', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    def __getattr__(self, name: str) -> Any:
        """The flat names of earlier versions, read: a DeprecationWarning and the value."""
        if name in DEPRECATED:
            group, new = DEPRECATED[name]
            warnings.warn(f"OffloadConfig.{name} is deprecated: read {group}.{new}", DeprecationWarning, stacklevel=2)
            return getattr(getattr(self, group), new)
        if name == "dpu":
            warnings.warn("OffloadConfig.dpu is deprecated: read mode == 'dpu'", DeprecationWarning, stacklevel=2)
            return self.mode == "dpu"
        if name == "overlap_update":
            warnings.warn("OffloadConfig.overlap_update is deprecated: read expert.exact_strategy",
                          DeprecationWarning, stacklevel=2)
            return self.expert.exact_strategy.startswith("overlap_update")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def resolved_server(self) -> tuple[str, str]:
        """(address, token) to connect to, or ("", "") for a private server."""
        addr = self.server.address or os.environ.get(ADDRESS_ENV, "")
        token = self.server.token or os.environ.get(TOKEN_ENV, "")
        if addr and not token:
            raise ValueError(f"server.address {addr!r} given without a token: set server.token or ${TOKEN_ENV} "
                             f"(the server writes it to ADDRESS_FILE.token)")
        return addr, token

    def resolved_trace_dir(self) -> str:
        """expert.trace_dir, or the launcher's $ZERO_OFFLOAD_TRACE_DIR when it is empty."""
        return self.expert.trace_dir or os.environ.get(TRACE_DIR_ENV, "")

    @property
    def exact_master(self) -> bool:
        """The server keeps the fp32 master as the bf16 weights plus a remainder: with a
        compact state_dtype, where the weights slot holds the master's rounding (bf16
        weights, no weight prediction)."""
        return self.state_dtype != "fp32" and self.dtype == "bf16" and not (self.mode == "dpu"
                                                                             and self.expert.dpu_predict)

    def lr_at(self, update: int) -> float:
        lr = self.lr(update) if callable(self.lr) else self.lr
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr schedule returned {lr!r} at update {update}; it must be a finite float >= 0")
        return float(lr)


def map_deprecated(kw: dict) -> dict:
    """OffloadConfig's keywords with the flat names of earlier versions moved to their
    groups (DEPRECATED), each with a DeprecationWarning; an old name given together with
    its group (or dpu/overlap_update with mode/expert) is refused, naming the field."""
    old = {k: kw[k] for k in kw if k in DEPRECATED or k in MODE_SWITCHES}
    if not old:
        return kw
    kw = {k: v for k, v in kw.items() if k not in old}
    moved: dict[str, dict] = {}
    for k, v in old.items():
        if k in MODE_SWITCHES:
            continue
        group, new = DEPRECATED[k]
        if group in kw:
            raise ValueError(f"{k} is the old name of {group}.{new}, and {group}= was given too: set {group}.{new} "
                             f"only")
        warnings.warn(f"OffloadConfig({k}=...) is deprecated: use {group}={{{new!r}: ...}} ({group}.{new})",
                      DeprecationWarning, stacklevel=4)
        moved.setdefault(group, {})[new] = v
    if "dpu" in old:
        if "mode" in kw:
            raise ValueError("dpu is the old name of mode='dpu', and mode= was given too: set mode only")
        warnings.warn("OffloadConfig(dpu=...) is deprecated: use mode='dpu' (or the default mode='exact')",
                      DeprecationWarning, stacklevel=4)
        kw["mode"] = "dpu" if old["dpu"] else "exact"
    overlap, undo = bool(old.get("overlap_update", False)), old.get("undo_log_bytes", 0)
    if "overlap_update" in old:
        if "expert" in kw:
            raise ValueError("overlap_update is the old name of expert.exact_strategy='overlap_update', and expert= "
                             "was given too: set expert.exact_strategy only")
        warnings.warn("OffloadConfig(overlap_update=...) is deprecated: mode='exact' picks it by itself where it "
                      "pays; to force it, expert={'exact_strategy': 'overlap_update'}", DeprecationWarning,
                      stacklevel=4)
    if kw.get("mode") == "dpu":
        if overlap:
            raise ValueError("overlap_update and dpu are two ways to hide the CPU update: choose one (overlap_update "
                             "keeps the synchronous result bit for bit; dpu hides more, on weights one update old)")
    elif "overlap_update" in old or "undo_log_bytes" in old:
        # the old switches named the strategy outright
        speculate = isinstance(undo, int) and undo > 0
        moved.setdefault("expert", {})["exact_strategy"] = strategy_of(overlap, speculate)
    kw.update(moved)
    return kw


_dataclass_init = OffloadConfig.__init__


def _init(self, **kw) -> None:
    _dataclass_init(self, **map_deprecated(kw))


_init.__doc__ = _dataclass_init.__doc__
_init.__signature__ = inspect.signature(_dataclass_init)
OffloadConfig.__init__ = _init
