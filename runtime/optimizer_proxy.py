"""A torch.optim.Optimizer stand-in so torch LR schedulers drive the server's lr.

The real update runs in the optimizer server; this object only carries one
param group that schedulers read and write.  Of its keys the engine sends lr
and weight_decay with every STEP; betas and eps stay the config's (a scheduler
that writes them changes nothing yet).  Its step() is called by
OffloadEngine.step() and does nothing else.
"""
from __future__ import annotations

import torch


class ServerOptimizer(torch.optim.Optimizer):
    def __init__(self, cfg):
        self._cfg = cfg
        self._schedule = cfg.lr if callable(cfg.lr) else None
        lr0 = cfg.lr_at(1)
        # one placeholder tensor: Optimizer insists on a non-empty param list
        super().__init__([torch.zeros(1)], dict(lr=lr0, betas=cfg.betas, eps=cfg.eps,
                                                  weight_decay=cfg.weight_decay))

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
