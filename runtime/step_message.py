"""STEP's contents: what the engine tells the server to do with a step's gradients."""
from __future__ import annotations

import numpy as np

from zero_offload.server.protocol import MAX_GROUPS

from .flat import FlatParams
from .optimizer_proxy import ServerOptimizer


def step_args(flat: FlatParams, optimizer: ServerOptimizer, *, rank: int, k: int, param_updates: np.ndarray,
              used: list[bool], grad_scale: float, grad_slot: int, predict: float, reverse: bool) -> dict:
    """UpdateCycle.send's keywords for update k: gradients in `grad_slot`, of which `used` says
    per parameter which got one (on any rank), multiplied by grad_scale (the clip over the
    loss scale); each parameter's own step count follows param_updates."""
    lrs = optimizer.lrs_for(k)
    hps = optimizer.step_hparams()
    # each parameter's own Adam step count after this update; 0: it got no gradient
    # (on any rank), so the server leaves it exactly as it is, as torch.optim does
    counts = [int(c) + 1 if u else 0 for c, u in zip(param_updates, used)]
    groups = []
    if len(hps) > 1 or any(c != k for c in counts):  # ranges of this shard, each with its values
        groups = [[lo, hi - lo, lrs[g], hps[g]["beta1"], hps[g]["beta2"], hps[g]["eps"], hps[g]["weight_decay"], c]
                  for g, lo, hi, c in flat.shard_runs(rank, counts)]
        if len(groups) > MAX_GROUPS:
            raise RuntimeError(f"this step's shard splits into {len(groups)} ranges (param groups, and "
                               f"parameters with and without a gradient, alternating), more than one STEP "
                               f"carries ({MAX_GROUPS}): put parameters that are often unused in a param "
                               f"group of their own")
    return dict(grad_slot=grad_slot, lr=lrs[0], grad_scale=grad_scale, hparams=hps[0], predict=predict, groups=groups,
                reverse=reverse)
