"""The update rules: one small object per optimizer x state dtype, behind one interface.

A rule knows which kernel of cython_ext updates its state and which of a range's
hyper-parameters that kernel takes; ShardStateArrays (optimizer_server.state) owns
the arrays and hands a rule the slices.  The table of rules is the one place that
says what combination exists:

    optimizer   fp32                 bf16                      int8 (whole blocks)
    adam/adamw  adam_step            adam_step_bf16            adam_step_int8
    adagrad     adagrad_step         -                         -
    lion        lion_step            lion_step_bf16            lion_step_int8

HELLO refuses the rest (protocol.COMPACT_OPTIMIZERS).  Elementwise rules (fp32,
bf16) update any range; int8 rules update whole blocks, one call over groups that
each carry their range's hyper-parameters (the kernel's `groups`) (a block's scale depends on all of it).
"""
from __future__ import annotations

from typing import ClassVar

from zero_offload.kernels import cpu_adam


class UpdateRule:
    """How one optimizer's state in one dtype is updated.

    moments: the moment arrays' names, in the kernel's argument order.
    blockwise: the kernel takes whole int8 blocks and segments (``update_blocks``),
    else any range (``update``)."""
    blockwise: ClassVar[bool] = False

    def __init__(self, optimizer: str):
        self.optimizer = optimizer

    def update(self, p, st: dict, g, o, h: dict, updates: int, *, sr: dict, kw: dict) -> None:
        """One elementwise kernel call: master (or remainder) p, moments st (sliced), the
        gradient g and out weights o, at Adam step `updates` with hyper-parameters h.
        sr: the bf16 rules' rounding key and index base, and the exact master's high
        halves (master_hi); kw: the dtype, scale, thread and progress keywords."""
        raise NotImplementedError

    def group_hparams(self, h: dict) -> dict:
        """blockwise rules: what one group of the call carries of a range's hyper-parameters."""
        raise NotImplementedError

    def update_blocks(self, p, st: dict, scales: dict, g, o, *, extra: dict, kw: dict) -> None:
        """blockwise rules: one kernel call over whole blocks, moments st and their
        block scales (sliced), extra: the groups, rounding key, index base and
        master_hi."""
        raise NotImplementedError


class AdamFP32(UpdateRule):
    def update(self, p, st, g, o, h, updates, *, sr, kw):
        cpu_adam.adam_step(p, st["exp_avg"], st["exp_avg_sq"], g, o,
                           step=updates, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"],
                           weight_decay=h["weight_decay"], adamw=self.optimizer == "adamw", **kw)


class AdagradFP32(UpdateRule):
    def update(self, p, st, g, o, h, updates, *, sr, kw):
        cpu_adam.adagrad_step(p, st["state_sum"], g, o, lr=h["lr"], eps=h["eps"],
                              weight_decay=h["weight_decay"], **kw)


class LionFP32(UpdateRule):
    def update(self, p, st, g, o, h, updates, *, sr, kw):
        cpu_adam.lion_step(p, st["exp_avg"], g, o, lr=h["lr"], beta1=h["beta1"],
                           beta2=h["beta2"], weight_decay=h["weight_decay"], **kw)


class AdamBF16(UpdateRule):
    def update(self, p, st, g, o, h, updates, *, sr, kw):
        cpu_adam.adam_step_bf16(p, st["exp_avg"], st["exp_avg_sq"], g, o,
                                step=updates, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"],
                                weight_decay=h["weight_decay"], adamw=self.optimizer == "adamw", **sr, **kw)


class LionBF16(UpdateRule):
    def update(self, p, st, g, o, h, updates, *, sr, kw):
        cpu_adam.lion_step_bf16(p, st["exp_avg"], g, o, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"],
                                weight_decay=h["weight_decay"], **sr, **kw)


class AdamInt8(UpdateRule):
    blockwise = True

    def group_hparams(self, h):
        return dict(lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], weight_decay=h["weight_decay"],
                    step=h["updates"], eps=h["eps"])

    def update_blocks(self, p, st, scales, g, o, *, extra, kw):
        cpu_adam.adam_step_int8(p, st["exp_avg"], st["exp_avg_sq"], scales["exp_avg"], scales["exp_avg_sq"], g, o,
                                adamw=self.optimizer == "adamw", **extra, **kw)


class LionInt8(UpdateRule):
    blockwise = True

    def group_hparams(self, h):  # Lion has no bias correction and no eps
        return dict(lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], weight_decay=h["weight_decay"])

    def update_blocks(self, p, st, scales, g, o, *, extra, kw):
        cpu_adam.lion_step_int8(p, st["exp_avg"], scales["exp_avg"], g, o, **extra, **kw)


# (optimizer, state dtype) -> its rule's class: the combinations that exist
RULES: dict[tuple[str, str], type[UpdateRule]] = {
    ("adam", "fp32"): AdamFP32, ("adamw", "fp32"): AdamFP32,
    ("adagrad", "fp32"): AdagradFP32, ("lion", "fp32"): LionFP32,
    ("adam", "bf16"): AdamBF16, ("adamw", "bf16"): AdamBF16, ("lion", "bf16"): LionBF16,
    ("adam", "int8"): AdamInt8, ("adamw", "int8"): AdamInt8, ("lion", "int8"): LionInt8,
}


def rule_for(optimizer: str, state_dtype: str) -> UpdateRule:
    """The rule of an optimizer with its state in state_dtype (HELLO refused any other)."""
    cls = RULES.get((optimizer, state_dtype))
    if cls is None:
        raise ValueError(f"no update rule for optimizer {optimizer!r} with state_dtype {state_dtype!r}")
    return cls(optimizer)
