"""Training-side runtime of zero-offload.

    from runtime import OffloadAdamW            # torch.optim.AdamW's interface
    from runtime import OffloadLion             # lion-pytorch's Lion interface
    from runtime import OffloadEngine, OffloadConfig  # explicit control
    from runtime.hf import OffloadTrainer       # transformers.Trainer (needs transformers)
"""
from optimizer_server.errors import OptimizerServerDeadError, OptimizerServerError, OptimizerServerTimeoutError

from .config import OffloadConfig
from .engine import OffloadEngine
from .offload_adamw import OffloadAdamW
from .offload_lion import OffloadLion

__all__ = ["OffloadAdamW", "OffloadLion", "OffloadEngine", "OffloadConfig", "OptimizerServerError",
           "OptimizerServerDeadError", "OptimizerServerTimeoutError"]
