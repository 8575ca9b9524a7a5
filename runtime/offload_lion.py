"""OffloadLion: Lion (Chen et al. 2023) with lion-pytorch's interface over an OffloadEngine.

    opt = OffloadLion(model.parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1,
                      model=model, state_dtype="int8")   # + any OffloadConfig field

Everything but the update is OffloadAdamW's (runtime/offload_adamw.py: param groups,
schedulers, clipping, state_dict, checkpoints).  Lion keeps one moment, so the server
holds 8 B/param with fp32 state, 4 with bf16, 3.02 with int8 (optimizer_server.state).
Its groups carry lr, betas and weight_decay (decoupled, as lion-pytorch's: the weights
shrink by lr * weight_decay a step), no eps.
"""
from __future__ import annotations

import torch

from .config import OffloadConfig
from .offload_adamw import OffloadAdamW


class OffloadLion(OffloadAdamW):
    OPTIMIZER = "lion"
    MOMENTS = ("exp_avg",)  # lion_pytorch.Lion's state: a dict of it loads (runtime.torch_state)

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, *,
                 model: torch.nn.Module | None = None, offload: OffloadConfig | None = None,
                 state_dir: str | None = None, **options):
        """params, lr, betas, weight_decay: as lion_pytorch.Lion (betas[0] weighs the
        sign's momentum, betas[1] the moment's decay).  model, offload, state_dir and the
        OffloadConfig fields as keywords: as OffloadAdamW's."""
        self._build(params, dict(lr=lr, betas=tuple(betas), weight_decay=float(weight_decay)), model, offload,
                    state_dir, options)
