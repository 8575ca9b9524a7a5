"""overlap_update: the CPU update runs during the next forward, and the result stays
bitwise that of the synchronous engine.

step() knows the norm and the overflow decision before it sends STEP, exactly as
the synchronous engine does; it then returns without waiting (``arm``).  The flat
space lies last layer first (runtime.flat), so the server runs this update back to
front (STEP.reverse), which is the next forward's order, publishing after each block
how many elements from the shard's end are final.  Each module that holds trainable
parameters itself gets a forward pre-hook that waits until its own parameters are
final and makes them visible: on the CPU's zero-copy model it points them at the
slot the server wrote (no bytes move), otherwise it copies their ranges up.  So the
forward of step t+1 computes on exactly the weights of update t, like sync, and the
update hides behind that forward as far as the forward lasts.  The next backward
(or anything that needs the state: a checkpoint, the master, close) first lands the
whole update (``finish``): nothing of it is left by then but its last block.

Assumption, stated because exactness rests on it: a parameter is first used inside
the forward of the module that holds it, or of a module that contains that one.  A
module reading another module's parameter before that module ran would read old
weights (the tests cover tied embeddings, whose owner runs first).

Several ranks: each rank updates its shard, and the forward needs every shard, so
landing the update means an all-gather, a collective.  It happens at the end of
step(), which every rank reaches, never in a forward hook: a forward that runs on
some ranks only (rank 0's evaluation, then a barrier) would issue a collective the
others do not, and hang.  So with several ranks overlap_update is exact and
overlaps nothing (a reversed STEP landed at once); DPU is the multi-rank overlap.
"""
from __future__ import annotations

import contextlib
import time

import torch

from zero_offload.server.errors import OptimizerServerTimeoutError

from .flat import FlatParams, ParamSpan
from .parts import PipelineCycle, Tracing
from .stats import Counters

# How long a forward pre-hook sleeps between looks at the progress word.  A block
# (progress_block_numel) takes milliseconds to update, so 0.1 ms loses little.
OVERLAP_POLL_S = 0.0001


class ForwardPipeline:
    """Owns the forward pre-hooks of overlap_update and the update they wait for.

    cycle: the update cycle (published, reply_ready, land, mark_on_device, up_stream,
    incoming_tensor, flat16, zero_copy, request_timeout_s)."""

    def __init__(self, model: torch.nn.Module, flat: FlatParams, cycle: PipelineCycle, *, world_size: int,
                 tracer: Tracing, counters: Counters):
        self.flat, self.cycle, self.tracer, self.counters = flat, cycle, tracer, counters
        self.k: int | None = None     # the update the next forward waits for
        self.per_module = world_size == 1
        self._visible: set[int] = set()  # spans (by id) already final on the device for update k
        # CUDA: the copies up run on the weights-up stream, beside the forward's kernels (on
        # the compute stream they would queue behind the modules before them, in series
        # with the forward they should overlap); _after marks the end of the work that
        # read the old weights (the backward step() followed), which they must wait for
        self._stream = cycle.up_stream
        self._after = None
        self._hooks = []
        if not self.per_module:
            return  # arm() lands it: see the module docstring
        S = flat.shard_numel
        for m in model.modules():
            spans = [flat.by_param[id(p)] for p in m.parameters(recurse=False) if id(p) in flat.by_param]
            if spans:
                need = S - min(s.offset for s in spans)  # final from the end: covers the lowest offset
                self._hooks.append(m.register_forward_pre_hook(self._hook(spans, need)))

    @property
    def armed(self) -> bool:
        return self.k is not None

    def arm(self, k: int) -> None:
        """STEP k went out (reversed on one rank); the next forward waits for it.  Several
        ranks: it lands here, in step(), where every rank is (the all-gather)."""
        self.k = k
        self._visible.clear()
        self.counters.overlap_steps += self.per_module  # several ranks: landed below, overlapping nothing
        if self._stream is not None:
            self._after = torch.cuda.Event()
            self._after.record(torch.cuda.current_stream(self._stream.device))
        if not self.per_module:
            self.finish()

    def _hook(self, spans: list[ParamSpan], need: int):
        def before_forward(module, args):
            if self.k is None:
                return
            if self._wait(need):
                fresh = [s for s in spans if id(s) not in self._visible]
                self._expose(fresh)
                self.counters.overlap_forward_params += len(fresh)
        return before_forward

    def _wait(self, need: int) -> bool:
        """Until `need` elements from the end are final; False if the update ended (or
        failed) otherwise, which finish() has then dealt with."""
        c, k = self.cycle, self.k
        if c.published(k) >= need:
            return True
        with self.tracer.span("overlap_wait", step=k, need=need):
            t0 = time.monotonic()
            try:
                while c.published(k) < need:
                    if c.reply_ready(0):  # DONE (or the error finish() will raise) is there
                        self.finish()
                        return False
                    if time.monotonic() - t0 > c.request_timeout_s:
                        raise OptimizerServerTimeoutError(
                            f"update {k} did not publish the weights a forward needs within "
                            f"{c.request_timeout_s:.0f} s; if the server is just slow, raise server.request_timeout_s")
                    time.sleep(OVERLAP_POLL_S)
            finally:
                self.counters.overlap_wait_s += time.monotonic() - t0
        return True

    def _expose(self, spans: list[ParamSpan]) -> None:
        """These spans' new weights become what the model computes with.

        CUDA: the copies go on the weights-up stream, after the old weights' last
        reader (``_after``), and the compute stream waits for an event after them, so
        this module's kernels, and only what follows, see the new weights."""
        c = self.cycle
        src = c.incoming_tensor()
        stream = self._stream  # None on the CPU, and so under zero-copy (a CPU rank's)
        if stream is not None:
            if self._after is not None:
                stream.wait_event(self._after)
                self._after = None
            ctx = torch.cuda.stream(stream)
        else:
            ctx = contextlib.nullcontext()
        with torch.no_grad(), ctx:
            for s in spans:
                if c.zero_copy:  # point the parameter at the slot the server wrote
                    s.param.data = src[s.offset:s.offset + s.numel].view(s.param.shape)
                else:            # copy its range up (host slot -> device; pinned, so asynchronous)
                    c.flat16[s.offset:s.offset + s.numel].copy_(src[s.offset:s.offset + s.numel],
                                                                non_blocking=True)
                    self.counters.bytes_to_device += 2 * s.numel
                    self.counters.bytes_to_device_early += 2 * s.numel
                self._visible.add(id(s))
        if stream is not None and spans:
            done = torch.cuda.Event()
            done.record(stream)
            torch.cuda.current_stream(stream.device).wait_event(done)

    def finish(self) -> None:
        """Land update k entirely (before the next backward, a checkpoint, the master, close)."""
        if self.k is None:
            return
        self.k = None
        c = self.cycle
        if not self.per_module or c.zero_copy:
            c.land(copy=True)  # several ranks: copy up and all-gather; zero-copy: swap every parameter
            return
        c.land(copy=False)
        self._expose([s for s in self.flat.spans if id(s) not in self._visible])
        c.mark_on_device()

    def release(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
