"""The update cycle: one update's way from STEP to the weights the device computes with.

Phases (CyclePhase) and the events that move between them:

    from                event                              to
    IDLE, ON_DEVICE     send(k): STEP k goes out           IN_FLIGHT
    IDLE, ON_DEVICE     speculate(k): SPECULATE goes out   (the same; runtime.speculation)
    IN_FLIGHT           land(): DONE k is read             LANDED     (copy=True goes on below)
    LANDED              land(copy=True): weights on device ON_DEVICE  (tail copied, or slot swapped)
    LANDED              mark_on_device(): the caller       ON_DEVICE  (the forward pipeline copied
                          copied the weights up                         a reversed update's ranges)
    IDLE, ON_DEVICE,    reset(): the device weights were   IDLE
      LANDED              replaced (load_checkpoint)
    IDLE, ON_DEVICE,    restore(k): a checkpoint held      LANDED
      LANDED              update k, not yet on the device
    IN_FLIGHT           a wait that times out              IN_FLIGHT  (retry land(); nothing was lost)
    IN_FLIGHT           land() reads an ERROR: the server  IDLE       (the error is raised; the device
                          refused STEP k (or died)                      keeps the weights it had)

Anything else is an internal error (AssertionError naming the phase).  While
IN_FLIGHT or LANDED, ``pump(free)`` copies the published weights that lie below
`free` up to the device (runtime.weights_up): during the wait when synchronous,
inside the next backward with DPU.

The weights slots: with cpu_zero_copy the model's parameters view one of the two
weights16 slots of the shared segment (``flat16``) and the server writes the next
update into the other one (``incoming_slot``); landing swaps them.  Otherwise
flat16 is the device's own tensor and the server always writes slot 0.
"""
from __future__ import annotations

import enum
import time

import numpy as np
import torch

from zero_offload.server.errors import OptimizerServerError, OptimizerServerTimeoutError

from .flat import FlatParams
from .parts import ShardServer
from .profiling import marker
from .stats import Counters
from .weights_up import WeightReturn

# How long one wait for DONE sleeps between looks at the progress word.  A
# block of DEFAULT_PROGRESS_BLOCK elements takes a few ms to update, so 1 ms
# polling costs nothing and leaves little idle time.
PROGRESS_POLL_S = 0.001


class CyclePhase(enum.Enum):
    IDLE = "idle"            # nothing sent since set-up or a load; the device has the newest weights
    IN_FLIGHT = "in_flight"  # STEP k sent, DONE not read yet; published weights may be going up
    LANDED = "landed"        # DONE k read: the weights slot holds k's weights, the device not (all) yet
    ON_DEVICE = "on_device"  # k's weights are what the device computes with


class UpdateCycle:
    """Owns the weights slots, the copy up (WeightReturn) and the update in flight.

    client: the shard's ShardClient (step_async, wait_done, reply_ready, published,
    weights16_slots, request_timeout_s); gather(flat16): after the copy up, make every
    rank's flat16 whole (an all-gather), or None on one rank.
    """

    def __init__(self, client: ShardServer, flat: FlatParams, *, dtype: torch.dtype, device: torch.device, shard_lo: int,
                 zero_copy: bool, compute_dtype: torch.dtype | None = None, overlap_weights_up: bool, tracer,
                 counters: Counters, gather=None):
        self.client = client
        self.flat = flat
        self.zero_copy = zero_copy
        self.overlap = overlap_weights_up
        self.tracer = tracer
        self.counters = counters
        self.gather = gather
        self._cuda = device.type == "cuda"
        self._host = [torch.from_numpy(w.view(np.int16)).view(dtype) for w in client.weights16_slots]
        self._cur = 0  # zero-copy: the slot the model's parameters view
        self.phase = CyclePhase.IDLE
        self._reads = None  # CUDA: an event after the forward pipeline's copies from the incoming slot
        self.step: int | None = None  # the update IN_FLIGHT or LANDED
        self.refused: str | None = None  # the server refused an update (land()): why, until reset()
        self.reverse = False          # that update runs back to front (published counts from the end)
        if zero_copy:
            assert len(self._host) == 2, "cpu_zero_copy needs two weights slots"
            self.flat16 = self._host[self._cur]
            self._up = None
        else:
            # fp32 compute (runtime.compute_dtype): the copy up casts the 16-bit slot into it
            self.flat16 = torch.empty(flat.padded_numel, dtype=compute_dtype or dtype, device=device)
            S = flat.shard_numel
            self._up = WeightReturn(self.flat16[shard_lo:shard_lo + S], self._host[0], tracer=tracer,
                                    counters=counters)

    # ------------------------------------------------------------------ queries
    @property
    def in_flight(self) -> int | None:
        return self.step if self.phase is CyclePhase.IN_FLIGHT else None

    @property
    def can_speculate(self) -> bool:
        """Nothing in flight, and the incoming slot holds nothing the device still needs
        (a checkpoint's restored update is LANDED there until the next step copies it)."""
        return self.phase in (CyclePhase.IDLE, CyclePhase.ON_DEVICE)

    @property
    def landed(self) -> bool:
        """An update has landed whose weights are not (all) on the device yet."""
        return self.phase is CyclePhase.LANDED

    @property
    def model_slot(self) -> int:
        """Zero-copy: the weights16 slot the model's parameters view (0, never swapped, otherwise)."""
        return self._cur

    @property
    def incoming_slot(self) -> int:
        """The weights16 slot the next update writes (zero-copy: the one the model is not on)."""
        return 1 - self._cur if self.zero_copy else 0

    def incoming_tensor(self) -> torch.Tensor:
        """The slot the update in flight writes, as a 16-bit tensor of the shard (host memory)."""
        return self._host[self.incoming_slot]

    def incoming_words(self) -> np.ndarray:
        """The raw 16-bit words of that slot (a checkpoint saves and restores a landed update there)."""
        return self.client.weights16_slots[self.incoming_slot]

    @property
    def up_stream(self):
        """CUDA: the stream the weights go up on (the forward pipeline's copies too); else None."""
        return self._up.stream if self._up is not None else None

    def published(self, k: int) -> int:
        return self.client.published(k)

    def reply_ready(self, timeout_s: float) -> bool:
        return self.client.reply_ready(timeout_s)

    @property
    def request_timeout_s(self) -> float:
        return self.client.request_timeout_s

    def _expect(self, event: str, *phases: CyclePhase) -> None:
        assert self.phase in phases, f"{event} in phase {self.phase.value}"

    # ------------------------------------------------------------------ events
    def send(self, k: int, *, grad_slot: int, lr: float, grad_scale: float, hparams: dict, predict: float,
             groups: list | None = None, reverse: bool = False) -> None:
        """reverse: the server updates back to front (runtime.overlap's forward pipeline)."""
        self._expect("send", CyclePhase.IDLE, CyclePhase.ON_DEVICE)
        self._incoming_read()
        self.reverse = reverse
        kw = {"groups": groups} if groups else {}
        if reverse:
            kw["reverse"] = True
        self.client.step_async(k, grad_slot, lr, grad_scale, hparams, predict=predict, weights_slot=self.incoming_slot,
                               **kw)
        self.step, self.phase = k, CyclePhase.IN_FLIGHT
        if self._up is not None:
            self._up.start()

    def speculate(self, k: int, *, upto: int, grad_slot: int, lr: float, grad_scale: float, hparams: dict,
                  predict: float, groups: list | None = None, reverse: bool = False) -> None:
        """SPECULATE for update k (runtime.speculation): what send() is expected to carry,
        and that the gradients of [0, upto) are final.  Nothing may be in flight."""
        self._expect("speculate", CyclePhase.IDLE, CyclePhase.ON_DEVICE)
        self._incoming_read()
        self.client.announce(k, upto)  # first: the server follows the word once SPECULATE is in
        self.client.speculate(k, grad_slot, lr, grad_scale, hparams, upto=upto, predict=predict,
                              weights_slot=self.incoming_slot, groups=groups or [], reverse=reverse)

    def _incoming_read(self) -> None:
        """Before a STEP or SPECULATE lets the server rewrite the incoming slot: the copies
        the forward pipeline queued from it (CUDA, asynchronous) have run.  Long done by
        the end of the backward that follows them; without this wait only a host sync
        elsewhere (a loss's float()) kept a lagging copy from reading the next weights."""
        if self._reads is not None:
            self._reads.synchronize()
            self._reads = None

    def announce(self, k: int, upto: int) -> None:
        """After update k's SPECULATE: the gradients of [0, upto) are final (the ready
        word; no message)."""
        self._expect("announce", CyclePhase.IDLE, CyclePhase.ON_DEVICE)
        self.client.announce(k, upto)

    def pump(self, free: int, early: bool = True) -> int:
        """Copy what is both published and below `free` (shard elements) up; returns
        how far the device is.  early: overlapping backward or the update."""
        if self.reverse:  # the forward pipeline copies a reversed update's weights itself
            return self._up.copied if self._up is not None else 0
        if self._up is None or self.phase not in (CyclePhase.IN_FLIGHT, CyclePhase.LANDED) or (early and not self.overlap):
            return self._up.copied if self._up is not None else 0
        S = self._up.numel
        done = S if self.phase is CyclePhase.LANDED else self.client.published(self.step)
        return self._up.copy_upto(min(done, free, S), early)

    def land(self, copy: bool) -> None:
        """Wait for the update in flight; with copy, its weights reach the device (as they
        are published, while it runs) and every rank gets the whole model."""
        if self.phase is CyclePhase.IN_FLIGHT:
            t0 = time.perf_counter()
            with self.tracer.span("wait_server"), marker("zo.wait_server", self._cuda):
                copying = copy and self._up is not None and not self.reverse
                try:
                    done = self._wait_copying() if copying else self.client.wait_done()
                except OptimizerServerTimeoutError:
                    raise  # still in flight: land() again reads its DONE
                except OptimizerServerError as e:
                    # the server answered ERROR (or is gone): update k will never land, and
                    # no DONE is coming, so a later land() (close()) must not wait for one
                    self.refused = f"update {self.step}: {e}"
                    self.step, self.phase, self.reverse = None, CyclePhase.IDLE, False
                    raise
            self.phase = CyclePhase.LANDED
            self.counters.wait_s += time.perf_counter() - t0
            self.counters.update_s += done.update_s
            if done.speculated or done.rolled_back:  # runtime.speculation
                self.counters.spec_kept_steps += done.speculated > 0
                self.counters.spec_rollback_steps += done.rolled_back > 0
                self.counters.spec_kept_numel += done.speculated
                self.counters.spec_rolled_back_numel += done.rolled_back
        if copy and self.phase is CyclePhase.LANDED:
            if self.zero_copy:
                with self.tracer.span("weights_swap"):
                    self._swap()
            else:
                with self.tracer.span("weights_up_tail"), marker("zo.weights_up", self._cuda):
                    self._up.finish()
                    if self.gather is not None:
                        self.gather(self.flat16)
            self.step, self.phase = None, CyclePhase.ON_DEVICE

    def mark_on_device(self) -> None:
        """LANDED -> ON_DEVICE where the caller put the weights on the device itself (the
        forward pipeline copied every range of a reversed update, asynchronously on CUDA:
        an event marks the end of those copies for speculate())."""
        self._expect("mark_on_device", CyclePhase.LANDED)
        if self._cuda:
            self._reads = torch.cuda.Event()
            self._reads.record(torch.cuda.current_stream(self.flat16.device))
        if self.gather is not None:
            self.gather(self.flat16)
        self.step, self.phase = None, CyclePhase.ON_DEVICE

    def _wait_copying(self):
        """Wait for DONE, copying the weights up as they are published."""
        c, S = self.client, self._up.numel
        deadline = time.monotonic() + c.request_timeout_s
        while self.pump(S) < S and time.monotonic() < deadline:
            if c.reply_ready(PROGRESS_POLL_S):
                break  # DONE (or an error) is there: wait_done reads it
        return c.wait_done(timeout_s=max(1.0, deadline - time.monotonic()))

    def _swap(self) -> None:
        """Zero-copy landing: the model's parameters move onto the slot the server
        just wrote (a view change per parameter, microseconds; no bytes move)."""
        self._cur = 1 - self._cur
        self.flat16 = self._host[self._cur]
        self.flat.bind(self.flat16)

    def reset(self) -> None:
        """The device weights were replaced (a checkpoint was loaded into flat16)."""
        self._expect("reset", CyclePhase.IDLE, CyclePhase.ON_DEVICE, CyclePhase.LANDED)
        self.step, self.phase, self.reverse = None, CyclePhase.IDLE, False
        self.refused = None  # a loaded state: the engine and the server agree again

    def restore(self, k: int) -> None:
        """The incoming slot holds update k's weights (read from a checkpoint); they
        go to the device at the next land(copy=True), as if k had just landed."""
        self._expect("restore", CyclePhase.IDLE, CyclePhase.ON_DEVICE, CyclePhase.LANDED)
        self.step, self.phase, self.reverse = k, CyclePhase.LANDED, False
        if self._up is not None:
            self._up.start()

    def quiesce(self) -> None:
        """The copies up have finished reading the weights slot (before anything
        rewrites it outside a STEP: a LOAD)."""
        if self._up is not None and self._up.stream is not None:
            self._up.stream.synchronize()

    def release(self) -> None:
        """At close: the parameters view the shared segment, which goes away now, so
        the model gets its weights in private memory (the user may keep using it); and
        no view of the segment stays here (the copy up's source), so the client can
        unmap it: a view kept the whole unlinked segment (~4 B/param) mapped until the
        engine object was collected."""
        if self.zero_copy:
            self.flat16 = self.flat16.clone()
            self.flat.bind(self.flat16)
        self.quiesce()  # CUDA: the copies up have read the slot
        self._host = []
        self._up = None
