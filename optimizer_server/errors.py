"""Exceptions a worker sees when talking to the optimizer server.

Errors cross the process boundary as values (an ERROR reply) and become one of
these at the next call; a dead server is never a hang.  Every `code` is one of
the protocol's closed set (protocol.ERROR_CODES).
"""
from .protocol import E_DEAD, E_INTERNAL, E_TIMEOUT


class OptimizerServerError(RuntimeError):
    """The server answered a request with an error reply."""

    def __init__(self, message: str, code: str = E_INTERNAL):
        super().__init__(message)
        self.code = code


class OptimizerServerDeadError(OptimizerServerError):
    """The optimizer server process is gone (crashed, killed, or unreachable)."""

    def __init__(self, message: str):
        super().__init__(message, code=E_DEAD)


class OptimizerServerTimeoutError(OptimizerServerError, TimeoutError):
    """The server is alive but did not answer within the timeout."""

    def __init__(self, message: str):
        super().__init__(message, code=E_TIMEOUT)
