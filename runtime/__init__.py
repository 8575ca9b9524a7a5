"""zero_offload: ZeRO-Offload for PyTorch.

    from zero_offload import OffloadAdamW            # torch.optim.AdamW's interface
    from zero_offload import OffloadLion             # lion-pytorch's Lion interface
    from zero_offload import OffloadEngine, OffloadConfig  # explicit control
    from zero_offload.hf import OffloadTrainer       # transformers.Trainer (needs transformers)

Subpackages: zero_offload.server (the optimizer server process and its client, which
import no torch), zero_offload.kernels (the Cython/OpenMP kernels).  The names above
are imported lazily, on first use, so that ``python -m zero_offload.server`` starts
without importing torch.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "OffloadConfig": ".config",
    "OffloadEngine": ".engine",
    "OffloadAdamW": ".offload_adamw",
    "OffloadLion": ".offload_lion",
    "OptimizerServerError": ".server.errors",
    "OptimizerServerDeadError": ".server.errors",
    "OptimizerServerTimeoutError": ".server.errors",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
