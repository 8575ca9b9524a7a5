"""The no-offload baseline: plain PyTorch mixed precision with AdamW on the device.

With simulate_dpu it also serves as the plain-PyTorch simulation of the DPU
schedule of the ZeRO-Offload paper: after update i >= dpu_warmup_steps the
model gets M_(i-1) (kept from before the update) instead of M_i, or with
dpu_predict the prediction M_(i-1) + dpu_predict * (M_(i-1) - M_(i-2)).

16-bit weights for forward/backward, an fp32 master with torch.optim.AdamW
(fused where the build has it) on the same device, GradScaler-style loss
scaling for fp16.  Same interface as OffloadEngine (backward, step, stats,
master_state_dict, close) so scripts can swap one for the other.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict

import torch

from zero_offload.server.tracing import Tracer

from ..config import OffloadConfig
from ..dtypes import TORCH_DTYPES
from ..loss_scaler import LossScaler


class DeviceMixedPrecision:
    def __init__(self, model: torch.nn.Module, config: OffloadConfig, simulate_dpu: bool = False):
        self.cfg = cfg = config
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        model.to(TORCH_DTYPES[cfg.dtype])
        cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}.get(cfg.optimizer)
        if cls is None:
            raise ValueError(f"the baseline supports adamw and adam, not {cfg.optimizer!r}")
        kw = dict(lr=cfg.lr_at(1), betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        try:
            self.optimizer = cls(self.master, fused=True, **kw)
        except (RuntimeError, TypeError):
            self.optimizer = cls(self.master, **kw)
        self.scaler = LossScaler.for_config(cfg)
        self.iteration = self.updates = self.skipped_steps = 0
        self.update_s = 0.0
        self.tracer = Tracer(cfg.expert.trace_dir, "baseline", 0)
        self.simulate_dpu = simulate_dpu
        self._prev2 = None  # M_(i-2) while simulating DPU with prediction

    def backward(self, loss: torch.Tensor) -> None:
        (loss * (self.scaler.scale / self.cfg.grad_accumulation_steps)).backward()

    def step(self) -> None:
        self.iteration += 1
        t0 = time.perf_counter()
        with torch.no_grad():
            grads = [p.grad for p in self.params]
            # one host sync for the whole step (a float() per parameter would be hundreds)
            sq = [torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in grads if g is not None]
            norm_sq = float(torch.stack(sq).double().sum()) if sq else 0.0
            if not math.isfinite(norm_sq):
                for p in self.params:
                    p.grad = None
                self.skipped_steps += 1
                self.scaler.update(True)
                return
            scale = self.scaler.scale
            clip = 1.0
            if self.cfg.clip_grad_norm is not None:
                clip = min(1.0, self.cfg.clip_grad_norm / (math.sqrt(norm_sq) / scale + 1e-6))
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float().mul_(clip / scale)
                p.grad = None
            k = self.updates + 1
            if callable(self.cfg.lr):
                for g in self.optimizer.param_groups:
                    g["lr"] = self.cfg.lr_at(k)
            N = self.cfg.expert.dpu_warmup_steps
            delayed = self.simulate_dpu and self.iteration >= N
            prev = [m.detach().clone() for m in self.master] if delayed else None  # M_(i-1)
            self.optimizer.step()                                                # M_i
            weights = prev or self.master
            if delayed and self.cfg.expert.dpu_predict and self.iteration - 1 >= N:
                # M_(i-1) came from a delayed update, sent up with weight prediction
                weights = [a + self.cfg.expert.dpu_predict * (a - b) for a, b in zip(prev, self._prev2)]
            for p, m in zip(self.params, weights):
                p.copy_(m)
            for m in self.master:
                m.grad = None  # as zero_grad(set_to_none=True): fp32 grads are transient
            self._prev2 = prev
        self.updates = k
        self.scaler.update(False)
        self.update_s += time.perf_counter() - t0

    def synchronize(self, copy_weights: bool = False) -> None:
        pass

    def master_state_dict(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        return OrderedDict((names[id(p)], m.detach().cpu().clone()) for p, m in zip(self.params, self.master))

    def stats(self) -> dict:
        return {"steps": self.iteration, "updates": self.updates, "skipped_steps": self.skipped_steps,
                "loss_scale": self.scaler.scale, "wait_s": 0.0, "bytes_to_host": 0, "bytes_to_device": 0,
                "server_update_s": self.update_s}

    def close(self) -> None:
        self.tracer.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
