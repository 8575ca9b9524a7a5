"""A torch.optim.Optimizer stand-in so torch LR schedulers drive the server's hyper-parameters.

The real update runs in the optimizer server; this object only carries the
param groups that schedulers read and write: one per group the engine was given
(one by default), each with lr, betas, eps and weight_decay.  The engine sends
every group's values with every STEP, so a scheduler that writes any of them
(OneCycleLR cycles betas by default) is followed from the next update on.  Its
step() is called by OffloadEngine.step() and does nothing else.  The groups are
fixed at construction: add_param_group raises rather than ignore a group.
"""
from __future__ import annotations

import math
import sys

import torch

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def optim_method(name: str):
    """torch.optim.Optimizer's method `name` (add_param_group, zero_grad, state_dict), without
    the torch._disable_dynamo wrapper while torch._dynamo is not imported: the wrapper's first
    call imports it, ~1 s of every process's start where nothing else does (BENCHMARKS.md).
    The wrapper only keeps torch.compile from tracing the method, so once torch.compile is in
    use (it has imported torch._dynamo) the wrapped method is returned."""
    fn = getattr(torch.optim.Optimizer, name)
    return fn if "torch._dynamo" in sys.modules else getattr(fn, "__wrapped__", fn)


class ServerOptimizer(torch.optim.Optimizer):
    def __init__(self, cfg, groups: list[dict] | None = None):
        """groups: each group's overrides of the config's lr, betas, eps and weight_decay."""
        self._cfg = cfg
        self._schedule = cfg.lr if callable(cfg.lr) else None
        defaults = dict(lr=cfg.lr_at(1), betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        groups = groups or [{}]
        if self._schedule is not None and any("lr" in g for g in groups):
            raise ValueError("OffloadConfig.lr is a callable and a param group sets its own lr: give the groups "
                             "their lrs and drive them with a torch LR scheduler on engine.optimizer instead")
        # one placeholder tensor per group: Optimizer insists on non-empty, distinct params
        super().__init__([dict(g, params=[torch.zeros(1)]) for g in groups], defaults)
        self._constructed = True

    def lrs_for(self, update: int) -> list[float]:
        """Each group's lr for 1-based update `update`: the config's callable, else the group's."""
        if self._schedule is not None:
            lr = self._cfg.lr_at(update)
            for g in self.param_groups:
                g["lr"] = lr
            return [lr] * len(self.param_groups)
        out = []
        for g in self.param_groups:
            lr = float(g["lr"])
            if not (lr >= 0 and lr < float("inf")):
                raise ValueError(f"lr in param_groups is {lr!r}; it must be a finite float >= 0")
            out.append(lr)
        return out

    def lr_for(self, update: int) -> float:
        """The first group's lr (the only one's, by default)."""
        return self.lrs_for(update)[0]

    def step_hparams(self) -> list[dict]:
        """Each group's hyper-parameters for the next STEP (lr apart), checked as torch.optim does."""
        out = []
        for g in self.param_groups:
            b1, b2 = (float(b) for b in g["betas"])
            # Lion's groups (OffloadLion) have no eps: the config's stands in, unused
            eps, wd = float(g.get("eps", self._cfg.eps)), float(g["weight_decay"])
            if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
                raise ValueError(f"betas in param_groups are {g['betas']!r}; each must be in [0, 1)")
            if not (eps > 0 and math.isfinite(eps)) or not (wd >= 0 and math.isfinite(wd)):
                raise ValueError(f"eps {eps!r} must be a finite float > 0 and weight_decay {wd!r} a finite float >= 0")
            out.append({"beta1": b1, "beta2": b2, "eps": eps, "weight_decay": wd})
        return out

    def follow(self, param_groups: list[dict]) -> None:
        """Read the groups' values from these dicts from now on: an OffloadAdamW's own
        param_groups, which its schedulers and its user write."""
        assert len(param_groups) == len(self.param_groups), (len(param_groups), len(self.param_groups))
        self.param_groups = param_groups

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", False):
            raise ValueError("OffloadEngine's optimizer has the param groups it was built with (OffloadEngine's "
                             "param_groups argument); adding one would be ignored, so it is refused: pass every "
                             "group when the engine is created")
        optim_method("add_param_group")(self, param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """No-op: OffloadEngine.step() does the work (call that, not this)."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are freed by the engine's hooks once copied; nothing to do."""

    def state_dict_small(self):
        """The groups' hyper-parameters (a dict for one group, as before groups existed)."""
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                  for g in self.param_groups]
        return groups[0] if len(groups) == 1 else groups

    def check_state_dict_small(self, d, where: str = "the checkpoint") -> list[dict]:
        """The groups' values a checkpoint holds (state_dict_small's form), checked as
        step() would check them, before anything is loaded: a bad one found after the
        server's LOAD would leave the run half-loaded.  ValueError naming the value."""
        groups = [d] if isinstance(d, dict) else d
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ValueError(f"{where}: optimizer_proxy must be a dict or a list of dicts, got {type(d).__name__}")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the checkpoint has {len(groups)} param group(s), this engine {len(self.param_groups)}; "
                             f"build the engine with the groups it was saved with")

        def num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for i, g in enumerate(groups):
            bad = []
            for k in ("lr", "weight_decay", "eps"):
                if k in g and not (num(g[k]) and g[k] >= 0 and (k != "eps" or g[k] > 0)):
                    bad.append(f"{k}={g[k]!r}")
            if "betas" in g and not (isinstance(g["betas"], (list, tuple)) and len(g["betas"]) == 2
                                     and all(num(b) and 0 <= b < 1 for b in g["betas"])):
                bad.append(f"betas={g['betas']!r}")
            if "params" in g:
                bad.append("params (a group's values only)")
            if bad:
                raise ValueError(f"{where}: param group {i} holds {', '.join(bad)}; the file is damaged or not "
                                 f"this engine's: load another checkpoint")
        return groups

    def load_state_dict_small(self, d) -> None:
        groups = self.check_state_dict_small(d)
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                g[k] = tuple(v) if isinstance(v, list) else v
