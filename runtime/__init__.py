"""Training-side runtime of zero-offload.

    from runtime import OffloadEngine, OffloadConfig
"""
from optimizer_server.errors import OptimizerServerDeadError, OptimizerServerError, OptimizerServerTimeoutError

from .config import OffloadConfig
from .engine import OffloadEngine
from .in_turn import in_turn

__all__ = ["OffloadEngine", "OffloadConfig", "in_turn", "OptimizerServerError", "OptimizerServerDeadError",
           "OptimizerServerTimeoutError"]
