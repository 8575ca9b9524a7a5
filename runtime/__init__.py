"""Training-side runtime of zero-offload.

    from runtime import OffloadEngine, OffloadConfig
"""
from optimizer_server.errors import OptimizerServerDeadError, OptimizerServerError, OptimizerServerTimeoutError

from .config import OffloadConfig
from .engine import OffloadEngine

__all__ = ["OffloadEngine", "OffloadConfig", "OptimizerServerError", "OptimizerServerDeadError",
           "OptimizerServerTimeoutError"]
