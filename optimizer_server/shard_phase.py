"""Where one shard is on the server: its phases and what moves between them.

Phases (ShardPhase) and what moves between them:

    from            event                                  to
    UNINITIALIZED   INIT's last chunk, or a LOAD that reads  READY
    READY           an INIT chunk that is not the last       UNINITIALIZED (a partial master)
    READY           a LOAD that fails midway                 UNINITIALIZED (a mixed master)
    READY           accept_speculation (a usable SPECULATE)  SPECULATING
    SPECULATING     accept_speculation (more of the same)    SPECULATING
    READY,          accept_step (STEP in order)              UPDATING   (the update thread first keeps
      SPECULATING                                                         or rolls back what was speculated)
    UPDATING        finish_update (the thread is done)       READY
    SPECULATING     rollback (before SKIP, GET_MASTER, SAVE,  READY      (the undo log restored)
                      LOAD, INIT: the server settles first)
    READY           skip (SKIP in order)                     READY (skipped + 1)

Only READY takes STEP, SKIP, GET_MASTER and SAVE (SPECULATING too, settled first);
UPDATING takes nothing but HEARTBEAT and STATS (the server answers the rest with
E_ORDER, and drops a SPECULATE).  INIT, LOAD, GET_MASTER and SAVE also run on the
update thread (``working`` names the one running; the shard is busy meanwhile), so
the socket thread answers heartbeats and other workers however long they take.
"""
from __future__ import annotations

import enum


class ShardPhase(enum.Enum):
    UNINITIALIZED = "uninitialized"  # no complete master: STEP is refused
    READY = "ready"                  # idle, state complete
    UPDATING = "updating"            # a STEP runs on the shard's thread
    SPECULATING = "speculating"      # SPECULATE accepted: speculative pieces queued or in the undo log
