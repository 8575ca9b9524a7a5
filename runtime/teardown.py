"""Releasing what an engine holds, in order, each part even if one before it failed."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import OffloadEngine

log = logging.getLogger("zero_offload")


def release_all(engine: "OffloadEngine") -> None:
    """Release every resource in turn, each even if one before it raised (a broken
    CUDA context makes unregistering the page-locked segment raise: the server must
    still be told BYE and stopped, its segment unlinked); the first error is raised
    at the end."""
    def hooks():
        for h in engine._hooks:
            h.remove()
        engine._hooks = []

    def pinned():
        p, engine._pinned = engine._pinned, None
        p.release()
    steps = [(engine._bound, lambda: engine.cycle.release()), (True, hooks),
             (engine.pipeline is not None, lambda: engine.pipeline.release()),
             (engine.grads is not None, lambda: engine.grads.release()),
             (engine._pinned is not None, pinned),
             (engine.client is not None, lambda: engine.client.close()),
             (engine._server is not None, lambda: engine._server.stop()),
             (True, engine.tracer.flush)]
    first: BaseException | None = None
    for needed, fn in steps:
        if not needed:
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the rest must still run
            log.warning("closing: %s: %s", type(e).__name__, e)
            first = first or e
    if first is not None:
        raise first
