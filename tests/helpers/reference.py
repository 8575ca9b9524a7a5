"""Plain-PyTorch references the engine is tested against (no project code).

MixedPrecisionReference: 16-bit weights for forward/backward, an fp32 master
updated by torch.optim.AdamW/Adam, GradScaler-style loss scaling,
torch.nn.utils.clip_grad_norm_ (with compute=torch.float32: forward and backward in fp32
on weights holding the 16-bit values, each gradient rounded to 16 bits once, as the
engine's CPU device computes without native 16-bit matmul), and optionally the One-Step Delayed Parameter
Update schedule of the ZeRO-Offload paper's DPU schedule written out literally: keep every
M_k and put W_(i+1) = M_i for i+1 <= N, else M_(i-1), on the model (with
weight prediction: M_(i-1) + predict * (M_(i-1) - M_(i-2)) once M_(i-1) itself
came from a delayed update).
"""
from __future__ import annotations

import copy

import torch

DT = {"fp16": torch.float16, "bf16": torch.bfloat16}


class MixedPrecisionReference:
    def __init__(self, model: torch.nn.Module, *, dtype="fp16", lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, optimizer="adamw", clip=None, scale=2.0 ** 16, dynamic=True,
                 dpu_warmup=None, accum=1, predict=0.0, compute=None):
        self.model = copy.deepcopy(model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.d16 = DT[dtype]
        self.model.to(self.d16)
        if compute is not None and compute != self.d16:  # the 16-bit values, held in fp32
            self.model.to(compute)
        cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[optimizer]
        self.opt = cls(self.master, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.clip = clip
        self.scale = 1.0 if dtype == "bf16" else scale
        self.dynamic = dynamic and dtype == "fp16"
        self.dpu_warmup = dpu_warmup
        self.predict = predict
        self.accum = accum
        self.history = [[m.detach().clone() for m in self.master]]  # M_0
        self.i = 0
        self.skipped = 0

    def _set_weights(self, ms):
        with torch.no_grad():
            for p, m in zip(self.params, ms):
                p.copy_(m.to(self.d16))  # (into an fp32 model: the 16-bit value, exactly)

    def current_weights(self) -> list[torch.Tensor]:
        """The 16-bit weights the schedule puts on the model for the coming step."""
        return [p.detach().clone() for p in self.params]

    def step(self, loss_fns, force_weights=None) -> list[float]:
        """loss_fns: one callable(model) -> loss per micro-batch.

        force_weights: run forward/backward on these 16-bit weights instead of the
        schedule's (teacher forcing: the master then sees exactly the gradients the
        engine saw, so 16-bit rounding flips cannot amplify through the forward).
        """
        if force_weights is not None:
            self._set_weights(force_weights)
        losses = []
        for fn in loss_fns:
            loss = fn(self.model)
            (loss * (self.scale / self.accum)).backward()
            losses.append(float(loss.detach()))
        grads = [p.grad.to(self.d16).float() for p in self.params]  # the one rounding to 16 bits
        for p in self.params:
            p.grad = None
        self.i += 1
        if not all(torch.isfinite(g).all() for g in grads):
            self.skipped += 1
            if self.dynamic:
                self.scale *= 0.5
            return losses
        for m, g in zip(self.master, grads):
            m.grad = g / self.scale
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.master, self.clip)
        self.opt.step()
        self.history.append([m.detach().clone() for m in self.master])
        k = len(self.history) - 1  # M_k just computed
        if self.dpu_warmup is not None and self.i + 1 > self.dpu_warmup:
            w = self.history[k - 1]  # W_(i+1) = M_(i-1)
            if self.predict and self.i - 1 >= self.dpu_warmup:  # M_(i-1) came from a delayed update
                w = [a + self.predict * (a - b) for a, b in zip(w, self.history[k - 2])]
            self._set_weights(w)
        else:
            self._set_weights(self.history[k])      # W_(i+1) = M_i
        return losses

    def master_flat(self) -> torch.Tensor:
        return torch.cat([m.detach().reshape(-1) for m in self.master])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if float(b.norm()) > 0 else float((a - b).norm())
