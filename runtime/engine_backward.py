"""The engine's backward side: OffloadEngine inherits it.

A micro-batch's backward in either mode (engine.backward(loss), or the user's
loss.backward() seen through the gradient hooks and autograd's end-of-backward
callback), the start of a step's gradients' way down (runtime.grads_down), and
clip_grad_norm_ between the last backward and step().  It moves the engine's step
phase (runtime.step_state) and reads its parts (grads, cycle, pipeline, speculator,
picker, checkpoints, scaler, client); the clip rule itself is runtime.clipping's.
"""
from __future__ import annotations

import math

import torch

from . import clipping, exact_mode
from .profiling import marker
from .step_state import StepPhase, next_phase


class BackwardAPI:
    """backward / clip_grad_norm_ of OffloadEngine, and its gradient hooks."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; on the last one of a step the gradients
        stream to the host as buckets complete."""
        self._check_trainable()
        if self.backward_mode == "hooks":
            raise RuntimeError("this engine was built with backward_mode='hooks': call loss.backward() itself")
        if self.phase is StepPhase.GRADS_READY:
            raise RuntimeError("backward() called twice for one step: call engine.step() after the last "
                               "micro-batch's backward")
        final = self._start_micro()
        if self.fsdp2 is not None:  # FSDP2 reduce-scatters on the step's last micro-batch only
            self.fsdp2.before_backward(final)
        with self.tracer.span("backward"), marker("zo.backward", self.is_cuda):
            (loss * (self.scaler.scale / self.cfg.grad_accumulation_steps)).backward()
        if final:
            self._step_grads.finish()
        self.phase = next_phase(self.phase, "backward", final)

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.backward_mode == "hooks" and self.phase is not StepPhase.IN_BACKWARD:
            self._begin_pass()
        g = self._step_grads
        if g is None or g.finished:
            return  # accumulation pending: autograd keeps summing into p.grad
        g.on_grad(p)

    def _begin_pass(self) -> None:
        """backward_mode "hooks": the first gradient hook of a loss.backward()."""
        self._check_trainable()
        if self.phase is StepPhase.GRADS_READY:
            raise RuntimeError(f"a second backward before step(): call step() after each backward, or, to "
                               f"accumulate gradients over micro-batches, say how many with grad_accumulation_steps "
                               f"(now {self.cfg.grad_accumulation_steps})")
        self._start_micro()  # raises (the DDP check) before this pass is marked as begun
        self.phase = next_phase(self.phase, "pass_begins")
        # runs once this backward has finished (DDP ends its reduces the same way)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)

    def _start_micro(self) -> bool:
        """A micro-batch's backward begins (either mode): the pipelined update lands, the
        parameters are checked, and on the step's last micro-batch its gradients' way
        down starts.  Returns whether this is that last one."""
        self.checkpoints.wait_snapshot()  # a background save has copied the weights (DPU lands here)
        self._finish_overlap()
        if self.picker is not None and self.picker.speculation_unused and self.cycle.in_flight is None:
            # the kept strategy does not speculate: the twin's host RAM goes back now, with
            # nothing in flight (RELEASE_TWIN), and later trials leave speculation out
            self.client.release_twin()
            self.picker.drop_speculation()
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
        if self.phase is not StepPhase.IN_BACKWARD:
            return  # closed meanwhile
        g = self._step_grads
        final = g is not None and not g.finished  # this pass was the step's last micro-batch
        if final:
            g.finish()
        self.phase = next_phase(self.phase, "pass_ends", final)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> float:
        """Between the last backward of a step and step(): the global L2 norm of the step's
        gradients (all ranks, unscaled), and clip them to max_norm in that step (as
        torch.nn.utils.clip_grad_norm_ does: coefficient min(1, max_norm / (norm + 1e-6)),
        applied inside the CPU update).  max_norm=inf only measures.  The parameters hold
        no .grad (their gradients went to the host as backward produced them), so torch's
        own clip_grad_norm_ on them is routed here (runtime.clipping)."""
        self._check_open()
        if self.phase is not StepPhase.GRADS_READY:
            raise RuntimeError("clip_grad_norm_() needs this step's gradients: call it after the last micro-batch's "
                               "backward and before step()")
        max_norm = clipping.check_request(max_norm, norm_type)
        norm = clipping.unscaled_norm(self._step_grads.totals()[0], self.scaler.scale)
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {norm}, so they cannot be clipped; pass "
                               f"error_if_nonfinite=False to skip this step instead")
        self._clip_now = max_norm if self._clip_now is None else min(self._clip_now, max_norm)
        return norm

    def _finish_overlap(self) -> None:
        """overlap_update: the update the forward pipelined is landed whole (its last blocks)
        before anything else reads or writes the slots or the weights."""
        if self.pipeline is not None:
            self.pipeline.finish()

    def _check_views(self) -> None:
        """The parameters must still view flat16 (FlatParams.check_views)."""
        self.flat.check_views(self.cycle.flat16, self.cycle.flat16.dtype)
