"""The CPU optimizer server of zero-offload and its worker-side client.

    from zero_offload.server import spawn, ShardClient
    with spawn(threads=1) as srv:
        c = ShardClient(srv.address, srv.token, numel=n, dtype="fp16", server_proc=srv.proc)

Run standalone with ``zero-offload-server`` / ``python -m zero_offload.server``.
"""
from .client import ShardClient
from .errors import OptimizerServerDeadError, OptimizerServerError, OptimizerServerTimeoutError
from .spawn import ServerHandle, spawn

__all__ = ["spawn", "ServerHandle", "ShardClient", "OptimizerServerError", "OptimizerServerDeadError",
           "OptimizerServerTimeoutError"]
