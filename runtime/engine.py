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

This module is the facade; the engine owns its parts and calls them, each with one concern:

    runtime.engine_fsdp2   several ranks on FSDP2: the model sharded, its local shards as the engine's parameters
    runtime.wiring         set-up: checks, device and ranks, layout, the server, the shard, first weights
    runtime.step_state     where a step is (phases and their transitions)
    runtime.grads_down     gradients down (hooks, buckets, reduces, the one-slot gate, the norm)
    runtime.step_message   what STEP carries
    runtime.update_cycle   the update in flight and its weights' way to the device (phases)
    runtime.exact_mode     mode="exact": which strategy hides the update (measured)
    runtime.overlap        overlap_update's forward pipeline
    runtime.speculation    speculation during backward
    runtime.engine_backward  backward, the gradient hooks, clip_grad_norm_ (runtime.clipping: the rule)
    runtime.engine_checkpoint  save/load/master_state_dict (runtime.checkpoint: the engine's files)
    runtime.owners         which engine trains a parameter (torch's clip_grad_norm_ finds it)
    runtime.optimizer_proxy  engine.optimizer, so torch LR schedulers drive the lr
    runtime.stats          the counters stats() reports
    runtime.teardown       releasing it all
    runtime.parts          what each part needs of another (typed protocols)

mode="dpu" (One-Step Delayed Parameter Update): steps 1..N-1 are synchronous; from
step N on, step() hands the gradients over and returns, and the next step waits for
that update, so the device computes step i on W_i = M_(i-2) (M_k: the master after k
updates).  Checkpoints keep the device weights as they are, so a resumed run is
bitwise the one that went on (docs/modes.md).
"""
from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from zero_offload.server.client import ShardClient
from zero_offload.server.errors import OptimizerServerError
from zero_offload.server.protocol import E_ORDER

from . import clipping, engine_fsdp2, exact_mode, owners, step_message, wiring
from .checkpoint import EngineCheckpoint
from .config import OffloadConfig
from .engine_backward import BackwardAPI
from .engine_checkpoint import CheckpointAPI
from .grads_down import GradientsDown, GradStep
from .loss_scaler import LossScaler
from .overlap import ForwardPipeline
from .profiling import marker
from .speculation import Speculator
from .step_state import StepPhase, next_phase
from .teardown import release_all
from .update_cycle import UpdateCycle

log = logging.getLogger("zero_offload")


def _agreed(ok: bool) -> bool:  # one rank: its own answer is everyone's
    return ok


def _no_barrier() -> None:
    pass


class OffloadEngine(BackwardAPI, CheckpointAPI):
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
        model.state_dict() saved there); forcing overlap_update still works.

        Several ranks (runtime.engine_fsdp2): a model the user sharded with FSDP2
        (fully_shard) is taken as it is, and a plain one is sharded with FSDP2 here
        (expert.multi_rank; "builtin": the engine's own ZeRO-2 collectives instead).  On
        FSDP2 each rank's engine trains its local shards as one rank would, and each
        step's sum of squared gradients is all-reduced over FSDP2's group for the global
        norm that clipping and the overflow check use."""
        if config is None:
            config = OffloadConfig(**overrides)
        elif overrides:
            raise TypeError("pass either an OffloadConfig or keyword overrides, not both")
        self.phase = StepPhase.IDLE  # runtime.step_state: where the step is
        # an FSDP2 model (the user's, or sharded here on several ranks): this rank's local
        # shards are what the engine trains, with no collective of its own
        self.fsdp2 = engine_fsdp2.take(model, config, param_groups, backward_mode)
        self.model = model  # the user's (on several ranks: sharded by FSDP2 in place)
        # the module whose parameters the engine lays out and trains: the model, or the proxies
        self.trained = model
        if self.fsdp2 is not None:
            self.trained, config, param_groups, overlap_ok = (self.fsdp2.module, self.fsdp2.cfg, self.fsdp2.groups,
                                                              False)
        self.cfg = cfg = config
        # the device, the ranks, the compute dtype, the flat layout, the candidate strategies
        params = wiring.prepare(self, self.trained, cfg, param_groups, backward_mode, overlap_ok, auto_overlap,
                                local=self.fsdp2 is not None)
        self.norm_reduce = self.fsdp2.shards.reduce_sumsq if self.fsdp2 is not None else None
        self.param_aliases: dict[int, torch.Tensor] = {}  # runtime.owners: other tensors this engine trains
        S = self.flat.shard_numel

        self._server = None
        self.client: ShardClient | None = None
        self.cycle: UpdateCycle | None = None
        self.pipeline: ForwardPipeline | None = None  # a candidate overlaps
        self.speculator: Speculator | None = None  # a candidate speculates
        self.grads: GradientsDown | None = None
        self._pinned = None
        self._hooks = []
        self._step_grads: GradStep | None = None  # the step whose gradients backward is producing
        self._bound = False  # the parameters view flat16 (set-up got that far)
        self._server_kernels: dict = {}  # server_simd, server_threads: asked once at set-up (stats())
        self._micro = 0
        self._clip_now: float | None = None  # clip_grad_norm_'s max_norm for the coming step
        try:
            wiring.connect(self, cfg)
            wiring.init_weights(self)
            self._hooks = [s.param.register_post_accumulate_grad_hook(self._on_grad) for s in self.flat.spans]
            if self.picker is not None and any(map(exact_mode.overlaps, self.picker.order)):
                self.pipeline = ForwardPipeline(self.trained, self.flat, self.cycle, world_size=self.world_size,
                                                tracer=self.tracer, counters=self.counters)
        except BaseException:
            self.close()
            raise

        owners.claim(self, params)
        clipping.install()  # torch's (and Accelerate's) clip_grad_norm_ on our parameters reach clip_grad_norm_
        self.scaler = LossScaler.for_config(cfg)
        # the collectives' methods, not the engine's: a part holding a bound method of the
        # engine makes a reference cycle, and the engine (with the user's model and its
        # weights) would then outlive its last reference until the cyclic collector ran
        agree, barrier = (_agreed, _no_barrier) if self.coll is None else (self.coll.all_ok, self.coll.barrier)
        self.checkpoints = EngineCheckpoint(rank=self.rank, world_size=self.world_size, numel=self.flat.numel,
                                            shard_numel=S, agree=agree, barrier=barrier, tracer=self.tracer)
        self.iteration = 0        # step() calls, skipped ones included
        self.updates = 0          # updates applied (the Adam step count)
        # each parameter's (span order) own step count: it lags `updates` by the steps
        # in which no rank computed a gradient for it (torch.optim's state["step"])
        self.param_updates = np.zeros(len(self.flat.spans), dtype=np.int64)
        self.skipped_steps = 0
        self.last_grad_norm = float("nan")
        if self.fsdp2 is not None:
            self.fsdp2.attach(self)  # the local shards 16-bit, FSDP2's gradient shards to this engine
            # what the model computes in is FSDP2's param_dtype (the proxies hold the
            # 16-bit weights and are never computed with): the inputs' dtype
            self.compute_dtype, self._compute_why = self.fsdp2.compute_dtype(), "FSDP2's param_dtype"

    @property
    def flat16(self) -> torch.Tensor:
        """The device's weights (all shards), which the parameters view: 16-bit, or fp32
        holding 16-bit values under compute dtype fp32 (runtime.compute_dtype)."""
        return self.cycle.flat16

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """Apply the gradients of the last backward (see the module docstring for DPU)."""
        self._check_trainable()
        if self.phase is not StepPhase.GRADS_READY:
            raise RuntimeError("step() before backward(): call engine.backward(loss) on the last micro-batch first")
        self.phase = next_phase(self.phase, "step")
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
        if self.fsdp2 is not None:
            self.fsdp2.copy_back()  # the landed weights into the local shards, before the next all-gather

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
        norm = self.last_grad_norm = clipping.unscaled_norm(sq, self.scaler.scale)
        clip = clipping.clip_coefficient(norm, self.cfg.clip_grad_norm, clip_now)  # clip_now: clip_grad_norm_'s
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
        """What STEP updates + 1 carries (runtime.step_message)."""
        return step_message.step_args(self.flat, self.optimizer, rank=self.rank, k=self.updates + 1,
                                      param_updates=self.param_updates, used=used, grad_scale=clip / self.scaler.scale,
                                      grad_slot=slot, predict=predict,
                                      reverse=self._overlapping() and self.pipeline.per_module)

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
        if copy_weights and self.fsdp2 is not None:
            self.fsdp2.copy_back()

    # ------------------------------------------------------------------ state
    def stats(self) -> dict:
        """Counts, bytes, waits and the picks (docs/usage.md lists the keys)."""
        return {"steps": self.iteration, "updates": self.updates, "skipped_steps": self.skipped_steps,
                "loss_scale": self.scaler.scale, **self.counters.report(), "grad_norm": self.last_grad_norm, "cpu_zero_copy": self._zero_copy,
                "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
                "compute_dtype_why": self._compute_why, "num_params": self.flat.param_numel,
                "shard_numel": self.flat.shard_numel, **self._ranks(), "mode": self.cfg.mode, **self._server_kernels,
                **(self.picker.report() if self.picker is not None else {})}

    def _ranks(self) -> dict:
        """The job's ranks and the path between them (FSDP2: each rank's engine is a one-rank
        engine over its local shards; shard_numel is then theirs)."""
        if self.fsdp2 is not None:
            return {"rank": self.fsdp2.shards.rank, "world_size": self.fsdp2.shards.world, "multi_rank": "fsdp2"}
        return {"rank": self.rank, "world_size": self.world_size,
                "multi_rank": "builtin" if self.world_size > 1 else "none"}

    # ------------------------------------------------------------------ teardown
    @property
    def closed(self) -> bool:
        return self.phase is StepPhase.CLOSED

    def _check_open(self) -> None:
        if self.phase is StepPhase.CLOSED:
            raise RuntimeError("the engine is closed")

    def _check_trainable(self) -> None:
        """Before a backward or a step: no update was refused since set-up or the last load
        (the engine counted it, the server did not: every later STEP would be out of order)."""
        self._check_open()
        if self.cycle is not None and self.cycle.refused:
            raise OptimizerServerError(
                f"the optimizer server refused {self.cycle.refused}; this engine's step count and the server's "
                f"state no longer agree, so it trains no further: load_checkpoint (the last checkpoint) to go on, "
                f"or close it", code=E_ORDER)

    def close(self) -> None:
        """Land the last update on the device, say BYE, stop a private server."""
        if self.phase is StepPhase.CLOSED:
            return
        self.phase = next_phase(self.phase, "close")
        owners.release(self, self.flat.params)
        try:
            if self._bound:
                try:
                    self._finish_overlap()
                    self.cycle.land(copy=True)
                    ck = getattr(self, "checkpoints", None)  # (absent if set-up failed before it)
                    if ck is not None:  # a background save is published first (and the old ones pruned)
                        ck.finish(self.client)
                except OptimizerServerError as e:
                    log.warning("closing: %s", e)
        finally:
            try:
                self._release_all()
            finally:
                if self.fsdp2 is not None:  # the last weights into the local shards
                    self.fsdp2.close()

    def _release_all(self) -> None:
        release_all(self)

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
