"""A torch.optim.Optimizer stand-in so torch LR schedulers drive the server's lr.

The real update runs in the optimizer server; this object only carries one
param group that schedulers read and write.  The engine sends its lr,
weight_decay, betas and eps with every STEP, so a scheduler that writes any of
them (OneCycleLR cycles betas by default) is followed from the next update on.
Its step() is called by OffloadEngine.step() and does nothing else.  There is
one group: add_param_group raises rather than ignore a group.
"""
from __future__ import annotations

import math

import torch


class ServerOptimizer(torch.optim.Optimizer):
    def __init__(self, cfg):
        self._cfg = cfg
        self._schedule = cfg.lr if callable(cfg.lr) else None
        lr0 = cfg.lr_at(1)
        # one placeholder tensor: Optimizer insists on a non-empty param list
        super().__init__([torch.zeros(1)], dict(lr=lr0, betas=cfg.betas, eps=cfg.eps,
                                                  weight_decay=cfg.weight_decay))
        self._constructed = True

    def lr_for(self, update: int) -> float:
        """The lr for 1-based update `update`: the config's callable, else the param group."""
        if self._schedule is not None:
            lr = self._cfg.lr_at(update)
            self.param_groups[0]["lr"] = lr
            return lr
        lr = float(self.param_groups[0]["lr"])
        if not (lr >= 0 and lr < float("inf")):
            raise ValueError(f"lr in param_groups is {lr!r}; it must be a finite float >= 0")
        return lr

    def step_hparams(self) -> dict:
        """The group's hyper-parameters for the next STEP (lr apart), checked as torch.optim does."""
        g = self.param_groups[0]
        b1, b2 = (float(b) for b in g["betas"])
        eps, wd = float(g["eps"]), float(g["weight_decay"])
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas in param_groups are {g['betas']!r}; each must be in [0, 1)")
        if not (eps > 0 and math.isfinite(eps)) or not (wd >= 0 and math.isfinite(wd)):
            raise ValueError(f"eps {eps!r} must be a finite float > 0 and weight_decay {wd!r} a finite float >= 0")
        return {"beta1": b1, "beta2": b2, "eps": eps, "weight_decay": wd}

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", False):
            raise ValueError("OffloadEngine's optimizer has one param group (all trainable parameters, with "
                             "OffloadConfig's settings); adding a group would be ignored, so it is refused: "
                             "set lr/weight_decay/betas in OffloadConfig or in param_groups[0]")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """No-op: OffloadEngine.step() does the work (call that, not this)."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are freed by the engine's hooks once copied; nothing to do."""

    def state_dict_small(self) -> dict:
        g = self.param_groups[0]
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}

    def load_state_dict_small(self, d: dict) -> None:
        g = self.param_groups[0]
        for k, v in d.items():
            g[k] = tuple(v) if isinstance(v, list) else v
