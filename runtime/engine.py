"""OffloadEngine: the training worker's side of ZeRO-Offload.

    engine = OffloadEngine(model, OffloadConfig(lr=3e-4, dtype="bf16", mode="dpu"))
    for x, y in loader:
        loss = model(x, y)          # the model holds 16-bit weights on its device
        engine.backward(loss)
        engine.step()               # with DPU this returns while the CPU updates
    engine.close()

What crosses between device and host per step is the 16-bit gradient shard
(down, copied bucket by bucket from post-accumulate-grad hooks, overlapping
backward) and the 16-bit weight shard (up): 4 B/param in all.  The worker never
holds an fp32 master, m or v.

The engine owns its parts and calls them; each has one concern:

    runtime.grads_down     gradients down (hooks, buckets, reduces, the one-slot gate, the norm)
    runtime.update_cycle   the update in flight and its weights' way to the device (phases)
    runtime.exact_mode     mode="exact": which strategy hides the update (measured)
    runtime.overlap        overlap_update's forward pipeline
    runtime.speculation    speculation during backward
    runtime.checkpoint     the engine's checkpoint files (optimizer_server.checkpoint: the format)
    runtime.host_memory    page-locking the shared segment, returning freed heap
    runtime.optimizer_proxy  engine.optimizer, so torch LR schedulers drive the lr
    runtime.stats          the counters stats() reports

DPU (One-Step Delayed Parameter Update): steps 1..N-1 are synchronous.  From
step N on, step() hands the gradients to the server and returns; at the end of
the next step it waits for that update, copies the weights up and hands over
the new gradients.  So with M_k the master after k updates, the device computes
step i on W_i = M_(i-2) for i > N.  Checkpoints wait for the update in flight
but keep the device weights as they are (and save them), so training that
resumes from a checkpoint is bitwise the training that went on.
"""
from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist

from zero_offload.server import checkpoint as ckpt_format
from zero_offload.server.client import ShardClient
from zero_offload.server.errors import OptimizerServerDeadError, OptimizerServerError
from zero_offload.server.admission import read_mem_available
from zero_offload.server.protocol import MAX_GROUPS, QBLOCK, ShardSpec
from zero_offload.server.state import bytes_per_param
from zero_offload.server.tracing import Tracer

from . import clipping, compute_dtype, distributed, host_memory
from .checkpoint import EngineCheckpoint
from . import exact_mode
from .config import OffloadConfig
from .dtypes import TORCH_DTYPES
from .flat import FlatParams
from .grads_down import GradientsDown, GradStep, SlotGate
from .loss_scaler import LossScaler
from .optimizer_proxy import ServerOptimizer
from .overlap import ForwardPipeline
from .profiling import marker
from .speculation import Speculator
from .stats import Counters
from .update_cycle import UpdateCycle

log = logging.getLogger("zero_offload")

PARAM_ALIGN_CUDA = 128  # elements: 256 bytes of 16-bit weights

MID_STEP = ("{what} in the middle of a step would lose its gradients (backward() has run, step() has not): "
            "call it after engine.step()")


class OffloadEngine:
    def __init__(self, model: torch.nn.Module, config: OffloadConfig | None = None, *,
                 param_groups: list | None = None, backward_mode: str = "engine", overlap_ok: bool = True,
                 auto_overlap: bool = True, **overrides):
        """param_groups: torch.optim's groups, [{"params": [...], "weight_decay": 0.0, "lr": ...}, ...]
        over the model's trainable parameters (each in exactly one group), each with its own
        lr, betas, eps and weight_decay (the config's where a group does not say);
        engine.optimizer.param_groups follows them, and schedulers drive them.  None: one
        group of every trainable parameter.

        backward_mode: "engine": call engine.backward(loss) (loss scaling, the loss divided
        by grad_accumulation_steps).  "hooks": call loss.backward() yourself, as with a
        torch optimizer (runtime.OffloadAdamW): the engine sees each backward through its
        gradient hooks and autograd's end-of-backward callback; the loss is used as given
        (divide it for accumulation yourself), so fp16 (which needs loss scaling) is refused.

        overlap_ok: the model's forward runs its modules' hooks (False: `model` only holds
        the parameters, as OffloadAdamW's without model=; overlap_update is then no
        candidate of mode="exact", and forcing it is refused).  auto_overlap: mode="exact"'s
        "auto" may pick overlap_update, under which the parameters hold the previous
        update's weights between step() and the next forward (that forward, backward, a
        checkpoint, master_state_dict() or synchronize(copy_weights=True) lands the new
        ones).  OffloadAdamW and OffloadLion pass False: torch.optim's contract is that
        after step() the parameters are the new ones (an EMA of them, a
        model.state_dict() saved there); forcing overlap_update still works."""
        if config is None:
            config = OffloadConfig(**overrides)
        elif overrides:
            raise TypeError("pass either an OffloadConfig or keyword overrides, not both")
        self.cfg = cfg = config
        self.model = model
        self.dtype = TORCH_DTYPES[cfg.dtype]
        if backward_mode not in ("engine", "hooks"):
            raise ValueError(f"backward_mode must be 'engine' or 'hooks', got {backward_mode!r}")
        if backward_mode == "hooks" and cfg.dtype == "fp16":
            raise ValueError("dtype='fp16' needs loss scaling, which a plain loss.backward() does not apply: use "
                             "dtype='bf16', or OffloadEngine(model, cfg) with engine.backward(loss), which scales "
                             "the loss and skips overflowing steps")
        self.backward_mode = backward_mode
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        for p in params:
            other = _OWNER.get(id(p))
            if other is not None and not other._closed and _trains(other, p):
                raise ValueError("a parameter of this model already has an open OffloadEngine or OffloadAdamW (it "
                                 "views that one's weights, and its close() would take them back): close that one "
                                 "first (engine.close() / optimizer.close()), or build the model anew")
        src = params[0].device
        if any(p.device != src for p in params):
            raise ValueError("all trainable parameters must be on one device; move the model with .to(device) first")
        self.device = _resolve_device(cfg.device, src)
        self.is_cuda = self.device.type == "cuda"
        # fp32 forward and backward on a CPU that only emulates 16-bit matmul
        self.compute_dtype, self._compute_why = compute_dtype.resolve(cfg.expert.compute_dtype, cfg.dtype,
                                                                      self.device)
        self.distributed = _process_group()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # one CPU rank: its 16-bit weights can live in the shared segment itself (two
        # slots: the server writes the next weights into the one the model is not
        # using, and landing an update swaps the model onto it; no copy up at all)
        # (fp32 compute: the parameters are fp32, so they cannot view the 16-bit slots)
        self._zero_copy = (self.world_size == 1 and not self.is_cuda and cfg.expert.cpu_zero_copy
                           and self.compute_dtype == self.dtype)
        # DPU writes step t+1's gradients while the server still reads step t's: with
        # one slot each range waits until the update has passed it (SlotGate), with
        # two it never waits (+2 B/param of host RAM).  Synchronous steps wait for
        # DONE before the next backward anyway.
        self._grad_slots = cfg.expert.dpu_grad_slots if cfg.mode == "dpu" else 1
        self.tracer = Tracer(cfg.resolved_trace_dir(), "worker", self.rank)
        group_of, group_opts = _index_groups(param_groups, params, model) if param_groups is not None else (None, None)
        self.optimizer = ServerOptimizer(cfg, group_opts)  # validates the groups' values before any process starts
        # each parameter 256-byte aligned on a GPU (cuBLAS picks slower kernels for operands
        # that are not); packed on the CPU (runtime.flat)
        self.param_align = cfg.expert.param_align_numel or (PARAM_ALIGN_CUDA if self.is_cuda else 1)
        self.flat = FlatParams(params, bucket_numel=cfg.expert.bucket_numel, world_size=self.world_size,
                               groups=group_of,
                               shard_multiple=QBLOCK if cfg.state_dtype == "int8" else 1, align=self.param_align)
        S = self.flat.shard_numel
        self.shard_lo, self.shard_hi = self.flat.shard_range(self.rank)
        self._names = _state_dict_names(model)  # for master_state_dict()
        self.counters = Counters()
        self.coll = distributed.Collectives(self.device, self.rank, self.world_size, S) if self.distributed else None
        # mode="exact": the strategies this engine may use (runtime.exact_mode); the undo
        # log speculation needs is asked for at HELLO, so it is settled here
        self.picker: exact_mode.ExactModePicker | None = None
        self._undo_log_bytes = 0
        if cfg.mode == "exact":
            self.picker, self._undo_log_bytes = self._exact_strategies(cfg, overlap_ok, auto_overlap)

        self._server = None
        self.client: ShardClient | None = None
        self.cycle: UpdateCycle | None = None
        self.pipeline: ForwardPipeline | None = None  # a candidate overlaps
        self.speculator: Speculator | None = None  # a candidate speculates
        self.grads: GradientsDown | None = None
        self._pinned = None
        self._hooks = []
        self._closed = False
        self._step_grads: GradStep | None = None  # the step whose gradients backward is producing
        self._bound = False  # the parameters view flat16 (set-up got that far)
        self._grads_ready = False
        self._micro = 0
        self._in_backward = False  # backward_mode "hooks": a backward pass is running
        self._clip_now: float | None = None  # clip_grad_norm_'s max_norm for the coming step
        try:
            self._connect(cfg)
            self._init_weights()
            self._hooks = [s.param.register_post_accumulate_grad_hook(self._on_grad) for s in self.flat.spans]
            if self.picker is not None and any(map(exact_mode.overlaps, self.picker.order)):
                self.pipeline = ForwardPipeline(model, self.flat, self.cycle, world_size=self.world_size,
                                                tracer=self.tracer, counters=self.counters)
        except BaseException:
            self.close()
            raise

        for p in params:
            _OWNER[id(p)] = self
        clipping.install()  # torch's (and Accelerate's) clip_grad_norm_ on our parameters reach clip_grad_norm_
        self.scaler = LossScaler.for_config(cfg)
        self.checkpoints = EngineCheckpoint(rank=self.rank, world_size=self.world_size, numel=self.flat.numel,
                                            shard_numel=S, agree=self._agree, barrier=self._barrier,
                                            tracer=self.tracer)
        self.iteration = 0        # step() calls, skipped ones included
        self.updates = 0          # updates applied (the Adam step count)
        # each parameter's (span order) own step count: it lags `updates` by the steps
        # in which no rank computed a gradient for it (torch.optim's state["step"])
        self.param_updates = np.zeros(len(self.flat.spans), dtype=np.int64)
        self.skipped_steps = 0
        self.last_grad_norm = float("nan")

    # ------------------------------------------------------------------ set-up
    def _exact_strategies(self, cfg: OffloadConfig, overlap_ok: bool,
                          auto_overlap: bool) -> tuple[exact_mode.ExactModePicker, int]:
        """mode="exact": the picker over the strategies this engine may use, and the undo
        log to ask the server for (0: no speculation)."""
        x = cfg.expert
        forced = None if x.exact_strategy == "auto" else x.exact_strategy
        if forced is not None and exact_mode.overlaps(forced) and not overlap_ok:
            raise ValueError(f"expert.exact_strategy={forced!r} waits in the model's forward pre-hooks, so it needs "
                             f"the model: pass model=model (OffloadAdamW(..., model=model))")
        # what a whole update overwrites (state and the weights slot): with that much the
        # server updates into a twin of the state instead of logging it (optimizer_server.shard)
        whole = math.ceil((bytes_per_param(cfg.optimizer, cfg.state_dtype, cfg.exact_master) + 2)
                          * self.flat.shard_numel) + (1 << 20)
        if forced is not None:
            undo = (x.undo_log_bytes or whole) if exact_mode.speculates(forced) else 0
            return exact_mode.ExactModePicker([forced], forced=forced), undo
        if x.undo_log_bytes is None:
            # spare RAM only: at most half of what the host has available now
            undo = whole if whole <= read_mem_available() // 2 else 0
        else:
            undo = x.undo_log_bytes
        order = exact_mode.candidates(world_size=self.world_size, overlap_ok=overlap_ok and auto_overlap,
                                      speculation_ok=undo > 0)
        agree = None
        if self.world_size > 1:
            agree = lambda values: self.coll.all_reduce_max(values)  # noqa: E731
        return exact_mode.ExactModePicker(order, agree=agree), undo

    def _connect(self, cfg: OffloadConfig) -> None:
        addr, token = cfg.resolved_server()
        proc = None
        if not addr:
            from zero_offload.server.spawn import spawn
            # exit_when_idle: if this worker is killed, the server drops it after the
            # heartbeat timeout and exits, so no orphan stays behind
            self._server = spawn(threads=cfg.server.threads, exit_when_idle=True,
                                 trace_dir=cfg.resolved_trace_dir())
            addr, token, proc = self._server.address, self._server.token, self._server.proc
        hp = {"lr": float(cfg.lr_at(1)), "beta1": cfg.betas[0], "beta2": cfg.betas[1], "eps": cfg.eps,
              "weight_decay": cfg.weight_decay}
        # host memory this worker lets go of after INIT: the fp32 trained parameters held on
        # the CPU (each becomes a view of flat16), less flat16 itself where it is the worker's own
        frees = sum(s.param.numel() * s.param.element_size() for s in self.flat.spans if not s.param.is_cuda)
        if not self.is_cuda and not self._zero_copy:
            frees = max(0, frees - self.compute_dtype.itemsize * self.flat.padded_numel)
        # the shard, described once (protocol.ShardSpec): HELLO carries it, the server's Shard keeps it
        spec = ShardSpec(rank=self.rank, world_size=self.world_size, numel=self.flat.shard_numel, dtype=cfg.dtype,
                         optimizer=cfg.optimizer, hparams=hp, progress_block=cfg.expert.progress_block_numel,
                         weight_slots=2 if self._zero_copy else 1, grad_slots=self._grad_slots,
                         staging_numel=cfg.expert.staging_numel, state_dtype=cfg.state_dtype,
                         exact_master=cfg.exact_master, frees_bytes=frees, undo_log_bytes=self._undo_log_bytes)
        self.client = c = ShardClient(addr, token, spec, request_timeout_s=cfg.server.request_timeout_s,
                                      server_proc=proc)
        if self.is_cuda:
            self._pinned = host_memory.pin(c.segment.buffer, c.segment.size, self.device, cfg.expert.pin_host_memory)
        gather = None
        if self.world_size > 1:
            gather = lambda flat16: self.coll.all_gather_weights(flat16, self.tracer)  # noqa: E731
        self.cycle = UpdateCycle(c, self.flat, dtype=self.dtype, compute_dtype=self.compute_dtype,
                                 device=self.device, shard_lo=self.shard_lo,
                                 zero_copy=self._zero_copy, overlap_weights_up=cfg.expert.overlap_weights_up,
                                 tracer=self.tracer, counters=self.counters, gather=gather)
        gate = SlotGate(self.cycle, enabled=self._grad_slots == 1, tracer=self.tracer, counters=self.counters)
        if self._undo_log_bytes:
            self.speculator = Speculator(self.cycle, self._expected_step, tracer=self.tracer, counters=self.counters)
        self.grads = GradientsDown(self.flat, c.grads, dtype=self.dtype, dtype_name=cfg.dtype, device=self.device,
                                   rank=self.rank, world_size=self.world_size, gate=gate, on_free=self.cycle.pump,
                                   tracer=self.tracer, counters=self.counters, collectives=self.coll,
                                   on_ready=self.speculator.ready if self.speculator is not None else None,
                                   ready_every=cfg.expert.progress_block_numel)

    def _init_weights(self) -> None:
        with self.tracer.span("init_weights"):
            # Host memory peaks here: the user's fp32 model is still alive.  So only
            # this rank's shard goes to the server, straight from the parameters
            # through the staging window, chunk by chunk (no flat fp32 copy of the
            # model), and then each parameter is cast into flat16 and released in
            # turn.  INIT comes first: if it fails the model is untouched.
            c, lo0 = self.client, self.shard_lo
            for lo, hi in c.init_chunks():
                self.flat.copy_fp32_range(torch.from_numpy(c.staging[:hi - lo]), lo0 + lo, lo0 + hi)
                c.init_chunk(lo, hi)
            if self._zero_copy and self.cfg.exact_master:
                # the model's slot holds the server's weights, which are also the exact
                # master's high halves: only the server writes them (optimizer_server.state)
                self.flat.bind(self.cycle.flat16)
            else:
                # every rank casts the full model itself (identical on all ranks); the
                # server's 16-bit copy of our shard rounds the same way (RNE; the exact
                # master's ties-away rounding differs at exact ties, until the first update)
                self.flat.cast_and_bind(self.cycle.flat16, via=self.dtype)
            self._bound = True
            # frozen parameters are never sent to the server, but the model computes with
            # them beside the trained ones: the same 16 bits, on the same device
            # (fp32 compute: their 16-bit values, held in fp32; buffers stay fp32)
            with torch.no_grad():
                for p in self.model.parameters():
                    if not p.requires_grad:
                        if p.is_floating_point():
                            p.data = p.data.to(self.device, self.dtype).to(self.compute_dtype)
                        else:
                            p.data = p.data.to(self.device)
            for b in self.model.buffers():
                b.data = b.data.to(self.device, self.compute_dtype if b.is_floating_point() else b.dtype)
        host_memory.return_freed_heap()

    @property
    def flat16(self) -> torch.Tensor:
        """The device's weights (all shards), which the parameters view: 16-bit, or fp32
        holding 16-bit values under compute dtype fp32 (runtime.compute_dtype)."""
        return self.cycle.flat16

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; on the last one of a step the gradients
        stream to the host as buckets complete."""
        self._check_open()
        if self.backward_mode == "hooks":
            raise RuntimeError("this engine was built with backward_mode='hooks': call loss.backward() itself")
        if self._grads_ready:
            raise RuntimeError("backward() called twice for one step: call engine.step() after the last "
                               "micro-batch's backward")
        final = self._start_micro()
        with self.tracer.span("backward"), marker("zo.backward", self.is_cuda):
            (loss * (self.scaler.scale / self.cfg.grad_accumulation_steps)).backward()
        if final:
            self._step_grads.finish()
            self._grads_ready = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.backward_mode == "hooks" and not self._in_backward:
            self._begin_pass()
        g = self._step_grads
        if g is None or g.finished:
            return  # accumulation pending: autograd keeps summing into p.grad
        g.on_grad(p)

    def _begin_pass(self) -> None:
        """backward_mode "hooks": the first gradient hook of a loss.backward()."""
        self._check_open()
        if self._grads_ready:
            raise RuntimeError(f"a second backward before step(): call step() after each backward, or, to "
                               f"accumulate gradients over micro-batches, say how many with grad_accumulation_steps "
                               f"(now {self.cfg.grad_accumulation_steps})")
        self._start_micro()  # raises (the DDP check) before this pass is marked as begun
        self._in_backward = True
        # runs once this backward has finished (DDP ends its reduces the same way)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)

    def _start_micro(self) -> bool:
        """A micro-batch's backward begins (either mode): the pipelined update lands, the
        parameters are checked, and on the step's last micro-batch its gradients' way
        down starts.  Returns whether this is that last one."""
        self.checkpoints.wait_snapshot()  # a background save has copied the weights (DPU lands here)
        self._finish_overlap()
        self._check_views()
        clipping.install()  # again: an Accelerator made after this engine (runtime.clipping)
        self._micro += 1
        final = self._micro % self.cfg.grad_accumulation_steps == 0
        if final:
            slot = self.iteration % self._grad_slots
            if self.speculator is not None and exact_mode.speculates(self.picker.current):
                # before the first hook can announce a bucket
                self.speculator.begin(self.updates + 1, slot)
            self._step_grads = self.grads.begin(slot)
        return final

    def _end_pass(self) -> None:
        self._in_backward = False
        g = self._step_grads
        if g is not None and not g.finished:
            g.finish()
            self._grads_ready = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> float:
        """Between the last backward of a step and step(): the global L2 norm of the step's
        gradients (all ranks, unscaled), and clip them to max_norm in that step (as
        torch.nn.utils.clip_grad_norm_ does: coefficient min(1, max_norm / (norm + 1e-6)),
        applied inside the CPU update).  max_norm=inf only measures.  The parameters hold
        no .grad (their gradients went to the host as backward produced them), so torch's
        own clip_grad_norm_ on them is routed here (runtime.clipping)."""
        self._check_open()
        if not self._grads_ready:
            raise RuntimeError("clip_grad_norm_() needs this step's gradients: call it after the last micro-batch's "
                               "backward and before step()")
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type {norm_type!r}: the offloaded gradients have an L2 norm only (norm_type=2)")
        max_norm = float(max_norm)
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
        norm = self._unscaled_norm(self._step_grads.totals()[0])
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {norm}, so they cannot be clipped; pass "
                               f"error_if_nonfinite=False to skip this step instead")
        self._clip_now = max_norm if self._clip_now is None else min(self._clip_now, max_norm)
        return norm

    def _unscaled_norm(self, sq: float) -> float:
        """The global L2 norm from the scaled gradients' sum of squares (inf if it overflowed):
        what clip_grad_norm_ returns and what the step clips with."""
        return math.sqrt(sq) / self.scaler.scale if math.isfinite(sq) else float("inf")

    def _finish_overlap(self) -> None:
        """overlap_update: the update the forward pipelined is landed whole (its last blocks)
        before anything else reads or writes the slots or the weights."""
        if self.pipeline is not None:
            self.pipeline.finish()

    def _check_views(self) -> None:
        """The parameters must still view flat16: what the server writes reaches the model
        only through it.  O(parameters) pointer compares per backward."""
        base = self.cycle.flat16.data_ptr()
        size = self.cycle.flat16.element_size()
        for s in self.flat.spans:
            if s.param.data_ptr() != base + size * s.offset or s.param.dtype != self.compute_dtype:
                raise RuntimeError(
                    "the model's parameters no longer view the engine's 16-bit weights: something replaced their "
                    "storage (torch DistributedDataParallel, which accelerator.prepare(model) applies with several "
                    "processes; model.to(...); load_state_dict(assign=True)), so updates would not reach the model. "
                    "The engine reduces gradients across ranks itself (ZeRO-2): do not wrap the model in DDP (with "
                    "Accelerate, prepare the optimizer, dataloader and scheduler but not the model), and move the "
                    "model to its device before creating the engine")

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """Apply the gradients of the last backward (see the module docstring for DPU)."""
        self._check_open()
        if not self._grads_ready:
            raise RuntimeError("step() before backward(): call engine.backward(loss) on the last micro-batch first")
        self._grads_ready = False
        self.checkpoints.wait_snapshot()  # a background save has copied the weights the step changes
        if self.picker is not None:
            self.picker.step_begins(time.perf_counter())
        self.iteration += 1
        grads, self._step_grads = self._step_grads, None
        clip_now, self._clip_now = self._clip_now, None
        skipped = self.skipped_steps
        with self.tracer.span("step", iteration=self.iteration), marker("zo.step", self.is_cuda):
            self._step(grads, clip_now)
        if self.picker is not None:  # every rank, at the same iterations (it may all-reduce)
            self.picker.step_ends(self.iteration, skipped=self.skipped_steps != skipped)
        if self.checkpoints.in_flight is not None:
            self._poll_checkpoint()

    def _poll_checkpoint(self) -> None:
        """A background save that the server has finished is published here, between steps;
        a failed one is logged (wait_checkpoint raises it)."""
        try:
            self.checkpoints.poll(self.client)
        except OptimizerServerDeadError:
            raise
        except OptimizerServerError as e:
            log.warning("%s", e)

    def _step(self, grads: GradStep, clip_now: float | None = None) -> None:
        delayed = self.cfg.mode == "dpu" and self.iteration >= self.cfg.expert.dpu_warmup_steps
        with self.tracer.span("grad_check"):
            sq, used = grads.totals()
        overflow = not math.isfinite(sq)
        # the update in flight (DPU) lands before anything else touches the server
        self.cycle.land(copy=True)
        if overflow:
            with self.tracer.span("skip"):
                self.client.skip(self.updates + 1)  # the server rolls a speculation back first
            if self.speculator is not None:
                self.speculator.end(skipped=True)
            self.skipped_steps += 1
            self.scaler.update(True)
            self.last_grad_norm = float("inf")
            return
        norm = self._unscaled_norm(sq)
        self.last_grad_norm = norm
        clip = 1.0
        max_norm = self.cfg.clip_grad_norm
        if clip_now is not None:  # this step's clip_grad_norm_
            max_norm = clip_now if max_norm is None else min(max_norm, clip_now)
        if max_norm is not None:
            clip = min(1.0, max_norm / (norm + 1e-6))
        k = self.updates + 1
        args = self._step_args(used, clip, grads.slot, self.cfg.expert.dpu_predict if delayed else 0.0)
        with self.tracer.span("signal", step=k):
            self.cycle.send(k, **args)
        if self.speculator is not None:
            self.speculator.end()
        self.updates = k
        self.param_updates += np.asarray(used, dtype=np.int64)
        self.scaler.update(False)
        self.optimizer.step()  # keeps torch LR schedulers' bookkeeping happy
        if self._overlapping():
            self.pipeline.arm(k)  # the next forward waits for it, module by module
        elif not delayed:
            self.cycle.land(copy=True)

    def _step_args(self, used: list[bool], clip: float, slot: int, predict: float) -> dict:
        """What STEP updates + 1 carries (UpdateCycle.send's keywords) for gradients in `slot`
        of which `used` says, per parameter, which got one, clipped by `clip`."""
        k = self.updates + 1
        lrs = self.optimizer.lrs_for(k)
        hps = self.optimizer.step_hparams()
        # each parameter's own Adam step count after this update; 0: it got no gradient
        # (on any rank), so the server leaves it exactly as it is, as torch.optim does
        counts = [int(c) + 1 if u else 0 for c, u in zip(self.param_updates, used)]
        groups = []
        if len(hps) > 1 or any(c != k for c in counts):  # ranges of this shard, each with its values
            groups = [[lo, hi - lo, lrs[g], hps[g]["beta1"], hps[g]["beta2"], hps[g]["eps"], hps[g]["weight_decay"], c]
                      for g, lo, hi, c in self.flat.shard_runs(self.rank, counts)]
            if len(groups) > MAX_GROUPS:
                raise RuntimeError(f"this step's shard splits into {len(groups)} ranges (param groups, and "
                                   f"parameters with and without a gradient, alternating), more than one STEP "
                                   f"carries ({MAX_GROUPS}): put parameters that are often unused in a param "
                                   f"group of their own")
        return dict(grad_slot=slot, lr=lrs[0], grad_scale=clip / self.scaler.scale, hparams=hps[0],
                    predict=predict, groups=groups, reverse=self._overlapping() and self.pipeline.per_module)

    def _overlapping(self) -> bool:
        """This step's update runs during the next forward (mode="exact"'s strategy)."""
        return self.pipeline is not None and exact_mode.overlaps(self.picker.current)

    def _expected_step(self, slot: int) -> dict | None:
        """runtime.speculation: the STEP this step sends if every parameter gets a gradient,
        no clip fires and nothing overflows (the server checks each of these at STEP)."""
        try:
            return self._step_args([True] * len(self.flat.spans), 1.0, slot, 0.0)
        except (RuntimeError, ValueError):
            return None  # step() will say what is wrong

    def synchronize(self, copy_weights: bool = False) -> None:
        """Wait for the update in flight.  With copy_weights the device gets the
        newest weights now (this moves the DPU schedule; training code leaves it off)."""
        self._check_open()
        self._finish_overlap()
        self.cycle.land(copy=copy_weights)

    # ------------------------------------------------------------------ state
    def _check_between_steps(self, what: str) -> None:
        """The staging window lies over gradient slot 0 and LOAD rewrites weights16:
        between backward() and step() either would destroy the step's gradients."""
        self._check_open()
        if self._grads_ready or self._step_grads is not None or self._micro % self.cfg.grad_accumulation_steps:
            raise RuntimeError(MID_STEP.format(what=what))
        self._finish_overlap()
        self.cycle.land(copy=False)
        # on CUDA the copies in either direction may still read the slots
        self.grads.quiesce()
        self.cycle.quiesce()

    def master_state_dict(self, rank0_only: bool = False) -> "OrderedDict[str, torch.Tensor]":
        """The fp32 master weights (all shards) as CPU tensors, keyed like model.state_dict().

        The values are views into one host tensor of the flat space (4 B/param, no
        copy per parameter).  Across ranks the shards are gathered window by window
        (runtime.distributed: never a full fp32 model on a device); rank0_only=True
        assembles them on rank 0 alone, and the other ranks return an empty dict
        (FSDP's full state dict convention), so a node holds one fp32 model, not one
        per rank.  Every rank must call it (a collective)."""
        self._check_between_steps("master_state_dict()")
        shard = torch.from_numpy(self.client.get_master())
        full = shard if self.world_size == 1 else self.coll.gather_master(shard, rank0_only)
        out = OrderedDict()
        if full is None:
            return out
        for p in self.flat.params:
            s = self.flat.by_param[id(p)]
            view = full[s.offset:s.offset + s.numel].view(p.shape)
            for name in self._names.get(id(p), [f"param{len(out)}"]):  # a tied weight under each of its names
                out[name] = view
        return out

    def save_checkpoint(self, directory: str, keep: int = 2, background: bool = False) -> str:
        """Write a checkpoint under directory/step-NNNNNNNN and point directory/latest at it
        (runtime.checkpoint; docs/checkpoint.md).  Server: this shard's master and
        optimizer state (fsync'd).  Engine: counters, loss scale and the device weights
        as they are (they may be one update behind, DPU).  directory must be one
        filesystem for every rank and the server.  The newest `keep` are kept.

        background=True returns as soon as the server has started writing (the engine's
        own files are snapshotted and written on a thread of its own) and training goes on; the
        files hold exactly this step's state.  The save is published (renamed, `latest`
        pointed at it) at the first step() that finds it done, or by wait_checkpoint();
        until then the previous checkpoint stays `latest`.  Returns the step directory
        (not there yet with background=True)."""
        self._check_between_steps("save_checkpoint()")
        dev = self.flat16[self.shard_lo:self.shard_hi].detach().to("cpu", self.dtype).contiguous()
        dev = dev.view(torch.int16).numpy()
        pending = self.cycle.incoming_words() if self.cycle.landed else None
        meta = {"dtype": self.cfg.dtype, "optimizer": self.cfg.optimizer, "iteration": self.iteration,
                "updates": self.updates, "skipped_steps": self.skipped_steps, "micro": self._micro,
                "scaler": self.scaler.state_dict(), "optimizer_proxy": self.optimizer.state_dict_small(),
                "param_updates": self.param_updates.tolist(), "param_align": self.param_align}
        return self.checkpoints.save(directory, self.iteration, keep, client=self.client, device16=dev,
                                     pending16=pending, meta=meta, background=background)

    def checkpoint_in_flight(self) -> bool:
        """True while a background save_checkpoint is not yet published."""
        return self.checkpoints.in_flight is not None

    def wait_checkpoint(self) -> str | None:
        """Wait for the background save in flight and publish it: its step directory
        (None if there is none).  Every rank must call it.  Raises naming the cause if
        the save failed; the previous checkpoint then stays `latest`."""
        self._check_open()
        if self.checkpoints.in_flight is None:
            return None
        self._finish_overlap()
        self.cycle.land(copy=False)  # STATS answers only with no STEP in flight
        return self.checkpoints.finish(self.client)

    @staticmethod
    def has_checkpoint(directory: str) -> bool:
        """True once save_checkpoint(directory) has completed (its `latest` pointer exists)."""
        return ckpt_format.has_checkpoint(directory)

    @staticmethod
    def resolve_checkpoint(directory: str):
        """directory/latest's target, or the directory itself if it holds the files."""
        return ckpt_format.resolve(directory)

    def load_checkpoint(self, directory: str) -> None:
        """Restore a checkpoint saved with this world size or another: each rank
        reads its shard's range of every saved shard (optimizer_server.reshard),
        so a job can resume on fewer or more ranks.  Every file read is checked
        against its checksum first."""
        self._check_between_steps("load_checkpoint()")
        self.wait_checkpoint()  # a background save of ours is published (or fails) first
        d, src, meta, metas = self.checkpoints.read_meta(
            directory, {"param_align": self.param_align, "numel": self.flat.numel, "dtype": self.cfg.dtype,
                        "optimizer": self.cfg.optimizer})
        counts = meta.get("param_updates", [meta["updates"]] * len(self.param_updates))  # older: all, every step
        if len(counts) != len(self.param_updates):
            raise ValueError(f"checkpoint {d} counts steps for {len(counts)} parameters, this model has "
                             f"{len(self.param_updates)} trainable ones: load it into the model it was saved from")
        with self.tracer.span("load_checkpoint", world_size_saved=src):
            raw = self.checkpoints.read_shard(d, "device16", src, metas)
            if meta["stale"]:  # verified before the server's state is touched
                self.checkpoints.read_shard(d, "pending16", src, metas, out=np.empty(self.flat.shard_numel, np.int16))
            # the exact master: LOAD writes the weights of the newest update into the
            # slot that will hold its high halves (the incoming one when they are still
            # to go up, else the model's), and the engine writes no slot the server owns
            exact, stale = self.cfg.exact_master, meta["stale"]
            out_slot = (self.cycle.incoming_slot if stale else self.cycle.model_slot) if exact else 0
            self.client.load(str(d), out_slot=out_slot)
            if not (exact and self._zero_copy and not stale):
                self.flat16[self.shard_lo:self.shard_hi].copy_(torch.from_numpy(raw).view(self.dtype))
            if self.world_size > 1:
                self.coll.all_gather_weights(self.flat16, self.tracer)
        self.iteration = meta["iteration"]
        self.updates = meta["updates"]
        self.skipped_steps = meta["skipped_steps"]
        self._micro = meta["micro"]
        self.param_updates[:] = counts
        self.cycle.reset()
        if meta["stale"]:
            # nothing is in flight: the server does not touch the slot until the next STEP
            if not self.cfg.exact_master:  # (with it, LOAD has written these weights there)
                self.checkpoints.read_shard(d, "pending16", src, metas,
                                            out=self.cycle.incoming_words().view(np.int16))
            self.cycle.restore(self.updates)
        self.scaler.load_state_dict(meta["scaler"])
        self.optimizer.load_state_dict_small(meta["optimizer_proxy"])

    def stats(self) -> dict:
        c = self.counters
        return {"steps": self.iteration, "updates": self.updates, "skipped_steps": self.skipped_steps,
                "loss_scale": self.scaler.scale, "bytes_to_host": c.bytes_to_host,
                "bytes_to_device": c.bytes_to_device, "bytes_to_device_early": c.bytes_to_device_early,
                "wait_s": c.wait_s, "grad_slot_wait_s": c.grad_slot_wait_s, "server_update_s": c.update_s,
                "overlap_wait_s": c.overlap_wait_s, "spec_steps": c.spec_steps, "spec_kept_steps": c.spec_kept_steps,
                "spec_rollback_steps": c.spec_rollback_steps, "spec_kept_numel": c.spec_kept_numel,
                "spec_rolled_back_numel": c.spec_rolled_back_numel,
                "grad_norm": self.last_grad_norm, "cpu_zero_copy": self._zero_copy,
                "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
                "compute_dtype_why": self._compute_why, "num_params": self.flat.param_numel,
                "shard_numel": self.flat.shard_numel, "rank": self.rank, "world_size": self.world_size,
                "mode": self.cfg.mode, **(self.picker.report() if self.picker is not None else {})}

    # ------------------------------------------------------------------ collectives (one rank: trivial)
    def _agree(self, ok: bool) -> bool:
        return self.coll.all_ok(ok) if self.world_size > 1 else ok

    def _barrier(self) -> None:
        if self.world_size > 1:
            self.coll.barrier()

    # ------------------------------------------------------------------ teardown
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def close(self) -> None:
        """Land the last update on the device, say BYE, stop a private server."""
        if self._closed:
            return
        self._closed = True
        for p in self.flat.params:
            if _OWNER.get(id(p)) is self:
                del _OWNER[id(p)]
        try:
            if self._bound:
                try:
                    self._finish_overlap()
                    self.cycle.land(copy=True)
                    ck = getattr(self, "checkpoints", None)  # (absent if set-up failed before it)
                    if ck is not None and ck.in_flight is not None:  # a background save is published first
                        ck.finish(self.client)
                except OptimizerServerError as e:
                    log.warning("closing: %s", e)
        finally:
            self._release_all()

    def _release_all(self) -> None:
        """Release every resource in turn, each even if one before it raised (a broken
        CUDA context makes unregistering the page-locked segment raise: the server must
        still be told BYE and stopped, its segment unlinked); the first error is raised
        at the end."""
        def hooks():
            for h in self._hooks:
                h.remove()
            self._hooks = []

        def pinned():
            p, self._pinned = self._pinned, None
            p.release()
        steps = [(self._bound, lambda: self.cycle.release()), (True, hooks),
                 (self.pipeline is not None, lambda: self.pipeline.release()),
                 (self.grads is not None, lambda: self.grads.release()),
                 (self._pinned is not None, pinned),
                 (self.client is not None, lambda: self.client.close()),
                 (self._server is not None, lambda: self._server.stop()),
                 (True, self.tracer.flush)]
        first: BaseException | None = None
        for needed, fn in steps:
            if not needed:
                continue
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the rest must still run
                log.warning("closing: %s: %s", type(e).__name__, e)
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The open engine of each trained parameter (by id; weak: a dropped engine leaves no
# entry), so a second engine or OffloadAdamW on a parameter is refused instead of
# fighting over its weights, and torch's clip_grad_norm_ finds the engine (runtime.clipping).
_OWNER: "weakref.WeakValueDictionary[int, OffloadEngine]" = weakref.WeakValueDictionary()


def owner_of(p: torch.Tensor) -> "OffloadEngine | None":
    """The open engine that trains parameter p, or None."""
    e = _OWNER.get(id(p))
    return e if e is not None and not e._closed and _trains(e, p) else None


def _trains(e: "OffloadEngine", p: torch.Tensor) -> bool:
    s = e.flat.by_param.get(id(p))  # ids are reused once a tensor dies: check identity
    return s is not None and s.param is p


COMPILE_PREFIX = "_orig_mod."          # what torch.compile's wrapper adds to every name


def _index_groups(param_groups, params: list, model: torch.nn.Module) -> tuple[list[int], list[dict]]:
    """(the group of each trainable parameter, each group's options) from torch.optim-style
    param groups, or ValueError naming what is wrong."""
    from .optimizer_proxy import GROUP_KEYS
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)) or not param_groups:
        raise TypeError("param_groups must be a non-empty list of dicts like torch.optim's, "
                        "[{'params': [...], 'weight_decay': 0.0}, ...]")
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = {id(p): i for i, p in enumerate(params)}
    group_of: list[int | None] = [None] * len(params)
    opts = []
    for gi, g in enumerate(param_groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"param_groups[{gi}] must be a dict with a 'params' list")
        extra = set(g) - {"params", *GROUP_KEYS}
        if extra:
            raise ValueError(f"param_groups[{gi}] has {sorted(extra)}; a group may set {list(GROUP_KEYS)}")
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in ps:
            if id(p) not in names:
                raise ValueError(f"param_groups[{gi}] holds a tensor that is not a parameter of the model")
            i = trainable.get(id(p))
            if i is None:
                continue  # frozen: cast and moved, never trained (as torch.optim leaves it without a gradient)
            if group_of[i] is not None:
                raise ValueError(f"parameter {names[id(p)]} is in param groups {group_of[i]} and {gi}; "
                                 f"put each parameter in one group")
            group_of[i] = gi
        opts.append({k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"})
    missing = [names[id(p)] for p, gi in zip(params, group_of) if gi is None]
    if missing:
        raise ValueError(f"trainable parameters in no param group: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                         f"add them to a group or set requires_grad=False")
    used = sorted(set(group_of))
    if used != list(range(len(param_groups))):
        raise ValueError(f"param groups {sorted(set(range(len(param_groups))) - set(used))} hold no trainable "
                         f"parameter; drop them")
    return group_of, opts


def _state_dict_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """Every name model.state_dict() gives each parameter (a tied weight has several),
    without torch.compile's prefix: the keys a plain model's load_state_dict expects."""
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, torch.nn.Parameter):
            names.setdefault(id(t), []).append(name.replace(COMPILE_PREFIX, ""))
    return names


def _resolve_device(name: str, src: torch.device) -> torch.device:
    device = torch.device(name) if name else src
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name or str(src)!r} asked for CUDA but torch.cuda.is_available() is False")
    if device.type == "cuda" and device.index is None:
        # a launched rank takes its node-local GPU, as torchrun numbers them
        local = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())
    return device


def _process_group() -> bool:
    """Whether torch.distributed is initialised; an error naming the fix where a
    launcher started several ranks but nobody made the process group."""
    if dist.is_available() and dist.is_initialized():
        return True
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise RuntimeError(f"WORLD_SIZE is {world} but torch.distributed is not initialised: call "
                           f"torch.distributed.init_process_group() (backend 'gloo' on the CPU, 'nccl' on GPUs) "
                           f"in each worker before creating the OffloadEngine; without it every rank would train "
                           f"a whole copy of the model on its own")
    return False
