"""Gradients down: from backward's hooks into this rank's shard of the shared gradient slot.

One GradientsDown per engine picks, at construction, the step class for the
topology; backward() asks it for a GradStep (``begin``), whose ``on_grad`` the
parameters' post-accumulate-grad hooks call, ``finish`` ends backward (unused
parameters are zeros in the slot, gloo reduces are waited for) and ``totals``
gives the global sum of squares behind the norm and the overflow decision, and
which parameters got a gradient on some rank (the others the server leaves
alone); step() drops it.  Topologies:

  HostDirectStep    one rank, the device is this CPU: each hook copies its gradient
                    straight into the shared slot and sums its squares in the same
                    pass (no bucket buffer in between).
  DeviceBucketStep  a device bucket buffer per bucket, copied down (this rank's part)
                    once complete; on CUDA on a side stream with the norm taken on
                    the device; across ranks reduced first (runtime.distributed).
  GlooStep          several CPU ranks: each complete bucket's fp32 all-reduce starts
                    asynchronously and is waited for at the end of backward.

Speculation (runtime.speculation): ``on_ready(n)`` hears that the gradients of shard
elements [0, n) are final in the host slot, as that prefix grows during backward:
parameter by parameter on one CPU rank, whose hooks copy straight into the slot;
bucket by bucket on CUDA, once the copy stream's event for the bucket has passed
(after its reduce, with several ranks); with gloo, once a bucket's all-reduce has
finished and a hook has copied it down.  Across ranks the shards are contiguous and
backward fills the flat space front to back, so the first ranks' shards get their
final gradients during backward and the last rank's mostly at its end.  It hears of
growth by at least ``progress_block`` elements (and of the end), so the server gets
pieces worth a kernel call.  What finish() completes (unused
parameters, gradients of earlier micro-batches) is not announced: its step counts are
not the ones speculation assumes.

The one-slot gate (SlotGate): with one gradient slot under DPU, step t+1's
gradients go into the slot the update of step t still reads, so each range is
written only once the update has published that it is past it.
"""
from __future__ import annotations

import time

import torch

from zero_offload.kernels import cpu_adam
from zero_offload.server.errors import OptimizerServerTimeoutError

from .flat import Bucket, FlatParams, ParamSpan
from .parts import GateCycle, Tracing
from .stats import Counters

# How long a gradient hook sleeps between looks at the progress word while the
# update in flight still reads the range it must write (one DPU gradient slot).
# An update block (DEFAULT_PROGRESS_BLOCK) takes milliseconds: 0.1 ms loses little.
GRAD_SLOT_POLL_S = 0.0001


class SlotGate:
    """Waits, for one gradient slot, until the update in flight has read [0, hi).

    cycle: the update cycle (in_flight, published, reply_ready, request_timeout_s).
    Backward and the update both run front to back and the update starts a forward
    earlier, so this rarely waits.  Its blocks' reads end at the block's barrier,
    before the release store of the progress word."""

    def __init__(self, cycle: GateCycle, *, enabled: bool, tracer: Tracing, counters: Counters):
        self.cycle, self.enabled, self.tracer, self.counters = cycle, enabled, tracer, counters

    def wait_free(self, hi: int) -> None:
        c = self.cycle
        k = c.in_flight
        if not self.enabled or k is None or c.published(k) >= hi:
            return
        with self.tracer.span("grad_slot_wait", step=k, upto=hi):
            t0 = time.monotonic()
            while c.published(k) < hi:
                if c.reply_ready(0):
                    break  # DONE (or the error wait_done will raise) is there: the slot is free
                if time.monotonic() - t0 > c.request_timeout_s:
                    raise OptimizerServerTimeoutError(f"update {k} did not pass element {hi} of the gradient "
                                                      f"slot within {c.request_timeout_s:.0f} s; if the server is "
                                                      f"just slow, raise server.request_timeout_s (or expert.dpu_grad_slots=2 "
                                                      f"never waits)")
                time.sleep(GRAD_SLOT_POLL_S)
            self.counters.grad_slot_wait_s += time.monotonic() - t0


def ready_buckets(buckets: list[Bucket], n: int, front: int, events: list, shard_lo: int, shard_hi: int) -> int:
    """How many buckets from the front hold final gradients in this rank's host slot,
    scanning on from n: buckets [0, front) are complete in backward; one with a part in
    [shard_lo, shard_hi) counts once its copy's event has passed; one without a part has
    nothing to copy (it never gets an event) and counts as soon as it is complete.  (Had
    those stopped the scan, a rank above 0, whose shard starts past the first buckets,
    would never hear of a ready prefix: no speculation there.)"""
    while n < front:
        b = buckets[n]
        if min(b.hi, shard_hi) > max(b.lo, shard_lo):
            ev = events[n]
            if ev is None or not ev.query():
                break
        n += 1
    return n


class GradientsDown:
    """The topology's gradient path, chosen once.

    host_words: the shared gradient slots as raw 16-bit NumPy words (the client's);
    on_free(n): backward no longer reads the weights of shard elements [0, n) (the
    update cycle's pump)."""

    def __init__(self, flat: FlatParams, host_words: list, *, dtype: torch.dtype, dtype_name: str,
                 device: torch.device, rank: int, world_size: int, gate: SlotGate, on_free, tracer,
                 counters: Counters, collectives=None, on_ready=None, progress_block: int = 1, norm_reduce=None):
        self.flat = flat
        self.coll = collectives  # runtime.distributed.Collectives, with world_size > 1
        self.dtype, self.dtype_name, self.device = dtype, dtype_name, device
        self.rank, self.world_size = rank, world_size
        self.gate, self.on_free, self.tracer, self.counters = gate, on_free, tracer, counters
        self.on_ready = on_ready
        self.progress_block = max(1, progress_block)
        self.norm_reduce = norm_reduce  # one rank's shards of a model sharded elsewhere (FSDP2): the global sum
        self.cuda = device.type == "cuda"
        S = flat.shard_numel
        self.shard_lo, self.shard_hi = flat.shard_range(rank)
        # the shard elements past the model's end (the last shard's padding): no bucket
        # covers them, so each step zeroes them (the staging window lies over slot 0)
        self.pad_lo = min(max(flat.numel - self.shard_lo, 0), S)
        self.host_words = host_words
        self.host = [torch.from_numpy(w.view("int16")).view(dtype) for w in host_words]
        self.cpu_threads = torch.get_num_threads()
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        if world_size == 1 and not self.cuda:
            self.kind = HostDirectStep
        elif world_size > 1 and not self.cuda:
            self.kind = GlooStep
        else:
            self.kind = DeviceBucketStep

    def begin(self, slot: int) -> "GradStep":
        return self.kind(self, slot)

    def host_sumsq(self, slot: int, lo: int, hi: int) -> float:
        """Sum of squares of the host gradient slot [lo, hi) (shard coordinates).

        The one-pass SIMD kernel, right after the copy while the bytes are hot;
        torch's vector_norm on 16-bit CPU tensors is several times slower and,
        for tens of millions of elements, off by about 1% (fp32 accumulation)."""
        return cpu_adam.grad_sumsq(self.host_words[slot][lo:hi], grad_dtype=self.dtype_name,
                                   num_threads=self.cpu_threads)

    def quiesce(self) -> None:
        """The copies down have finished (before anything else touches the slots)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def release(self) -> None:
        self.host, self.host_words = [], []


class GradStep:
    """One step's gradients on their way down (created in backward, dropped in step)."""

    def __init__(self, down: GradientsDown, slot: int):
        self.d = down
        self.slot = slot
        buckets = down.flat.buckets
        self.remaining = [len(b.params) for b in buckets]  # parameters still without a gradient
        self.bufs: list = [None] * len(buckets)           # device buffers of this step (transient)
        # CUDA: each bucket's writers' streams (a gradient is copied into its bucket on the
        # stream that produced it: a part of the model on a side stream writes from there),
        # and the event after a zero-filled buffer's fill, which a writer on another stream waits for
        self.writers: list = [None] * len(buckets)
        self.zeroed: list = [None] * len(buckets)
        self.front = 0   # buckets [0, front) are done: their weights are free on the device
        # Across ranks every rank issues its buckets' collectives in index order (DDP's
        # rule): a bucket that completes before its predecessors waits for them.
        self.ordered = down.world_size > 1
        self.issued = 0  # buckets [0, issued) went to _bucket_done
        self.sq = torch.zeros((), dtype=torch.float32, device=down.device)
        self.sq_host = 0.0
        self.seen: set[int] = set()
        self.finished = False
        self.finishing = False  # finish() runs: what it completes is not announced to on_ready
        self._totals: tuple[float, list[bool]] | None = None
        self.events: list = [None] * len(buckets)  # CUDA + on_ready: each bucket's copy-done event
        self.ready_front = 0  # CUDA: buckets [0, ready_front) are on the host; CPU: spans [0, ready_front) are
        self.announced = 0    # on_ready was told [0, announced) (shard coordinates)

    def on_grad(self, p: torch.Tensor) -> None:
        s = self.d.flat.by_param[id(p)]
        b = self.d.flat.buckets[s.bucket]
        self._take(s, b, p.grad.reshape(-1))
        p.grad = None  # the device gradient is released as soon as it is copied
        self.seen.add(id(p))
        self.remaining[b.index] -= 1
        if self.remaining[b.index] == 0:
            self._done(b)
        else:
            self._announce()  # CPU: this parameter; CUDA: a bucket's copy that was still running may be done

    def finish(self) -> None:
        """End of backward: a gradient that only earlier micro-batches produced (it sits in
        .grad: the last backward never reached the parameter) goes down now; parameters
        with none at all are zeros in the slot and reported by ``totals`` as unused."""
        self.finishing = True
        for b in self.d.flat.buckets:
            if self.remaining[b.index] == 0:
                continue
            for s in list(self._unseen(b)):
                if s.param.grad is not None:
                    self.on_grad(s.param)  # completes the bucket when it is the last one
            if self.remaining[b.index] == 0:
                continue
            self._fill_unused(b)
            self.remaining[b.index] = 0
            self._done(b)
        assert not self.ordered or self.issued == len(self.d.flat.buckets)
        self._finish_reduces()
        d = self.d
        if d.pad_lo < d.flat.shard_numel:
            d.gate.wait_free(d.flat.shard_numel)
            d.host[self.slot][d.pad_lo:].zero_()
        self.finished = True

    def sumsq(self) -> float:
        """The global sum of squares of the (scaled) gradients; a sync point: one scalar per step."""
        return self.totals()[0]

    def totals(self) -> tuple[float, list[bool]]:
        """(the global sum of squares of the (scaled) gradients, whether each parameter, in
        span order, got a gradient on some rank), computed once per step.

        A sync point.  Across ranks one all-reduce carries both: the sum and, per
        parameter, how many ranks saw a gradient (DDP's rule: a parameter unused on
        every rank is left alone, one unused on some ranks gets their zeros)."""
        if self._totals is None:
            self.d.quiesce()  # all gradient bytes are on the host
            sq = self.sq + self.sq_host if self.sq_host else self.sq
            seen = [id(s.param) in self.seen for s in self.d.flat.spans]
            if self.d.world_size > 1:
                v = torch.tensor([0.0] + [float(x) for x in seen], dtype=torch.float32, device=sq.device)
                v[0] = sq
                v = self.d.coll.all_reduce_sum(v)
                sq, seen = v[0], [bool(x > 0) for x in v[1:].tolist()]
            elif self.d.norm_reduce is not None:
                sq = self.d.norm_reduce(torch.tensor(float(sq), dtype=torch.float64))
            self._totals = (float(sq), seen)
        return self._totals

    def _done(self, b: Bucket) -> None:
        # backward is done with a prefix of buckets: the pending update's weights may go there
        bs, d = self.d.flat.buckets, self.d
        while self.front < len(bs) and self.remaining[self.front] == 0:
            self.front += 1
        free = bs[self.front].lo if self.front < len(bs) else d.flat.padded_numel
        d.on_free(min(max(free - d.shard_lo, 0), d.flat.shard_numel))
        if not self.ordered:
            self._bucket_done(b)
            self._announce()
            return
        while self.issued < len(bs) and self.remaining[self.issued] == 0:
            self._bucket_done(bs[self.issued])
            self.issued += 1
        self._announce()

    def _announce(self) -> None:
        """Tell on_ready how far the host slot holds final gradients: the prefix of buckets
        complete during backward (and, on CUDA, copied: their events have passed)."""
        d = self.d
        if d.on_ready is None or self.finishing:
            return
        hi = min(max(self._ready_hi() - d.shard_lo, 0), d.pad_lo)  # never the padding: finish() zeroes it
        if hi - self.announced >= d.progress_block or (hi == d.pad_lo and hi > self.announced):
            self.announced = hi
            d.on_ready(hi)

    def _ready_hi(self) -> int:
        """Flat elements [0, hi) whose final gradients are in the host slot (as far as
        this rank's shard goes)."""
        d = self.d
        n = self.ready_front
        if d.cuda:
            bs = d.flat.buckets
            n = ready_buckets(bs, n, self.front, self.events, d.shard_lo, d.shard_hi)
            hi = bs[n].lo if n < len(bs) else d.flat.padded_numel
        else:  # the hooks copied straight into the slot: every seen parameter's bytes are there
            spans = d.flat.spans  # in offset order, tiling the flat space
            while n < len(spans) and id(spans[n].param) in self.seen:
                n += 1
            # (the alignment gap before span n is zeroed with n's gradient: not ready either)
            hi = spans[n].offset - spans[n].lead if n < len(spans) else d.flat.padded_numel
        self.ready_front = n
        return hi

    def _unseen(self, b: Bucket):
        return (s for s in b.params if id(s.param) not in self.seen)

    # topology-specific
    def _take(self, s: ParamSpan, b: Bucket, g: torch.Tensor) -> None:
        raise NotImplementedError

    def _fill_unused(self, b: Bucket) -> None:
        raise NotImplementedError

    def _bucket_done(self, b: Bucket) -> None:
        raise NotImplementedError

    def _finish_reduces(self) -> None:
        pass


class HostDirectStep(GradStep):
    def _take(self, s: ParamSpan, b: Bucket, g: torch.Tensor) -> None:
        d = self.d
        # copy into the shared slot and take the norm's share in one pass over
        # memory (the sum is read from cache, right behind the copy)
        d.gate.wait_free(s.offset + s.numel)
        if s.lead:  # the alignment gap before it: zeros, before the ready scan can announce it
            d.host[self.slot][s.offset - s.lead:s.offset].zero_()
        dst = d.host_words[self.slot][s.offset:s.offset + s.numel]
        if g.dtype == d.dtype and g.is_contiguous():
            self.sq_host += cpu_adam.copy_grad_sumsq(g.view(torch.int16).numpy(), dst, grad_dtype=d.dtype_name,
                                                     num_threads=d.cpu_threads)
        else:  # a hook or a custom autograd.Function handed back another layout
            d.host[self.slot][s.offset:s.offset + s.numel].copy_(g)
            self.sq_host += cpu_adam.grad_sumsq(dst, grad_dtype=d.dtype_name, num_threads=d.cpu_threads)

    def _fill_unused(self, b: Bucket) -> None:
        for s in self._unseen(b):
            self.d.gate.wait_free(s.offset + s.numel)
            self.d.host[self.slot][s.offset - s.lead:s.offset + s.numel].zero_()

    def _bucket_done(self, b: Bucket) -> None:
        # the hooks copied the bytes and summed their squares already; the
        # (empty) span marks the bucket's completion and bytes in the trace
        with self.d.tracer.span("grad_bucket", bucket=b.index, bytes=2 * b.numel):
            pass
        self.d.counters.bytes_to_host += 2 * b.numel


class DeviceBucketStep(GradStep):
    def _buf(self, b: Bucket) -> torch.Tensor:
        if self.bufs[b.index] is None:  # zeros where alignment gaps lie in it (no hook writes those)
            gaps = self.d.flat.has_gaps and any(s.lead for s in b.params)
            self.bufs[b.index] = (torch.zeros if gaps else torch.empty)(b.numel, dtype=self.d.dtype,
                                                                        device=self.d.device)
            if self.d.cuda and gaps:
                self.zeroed[b.index] = torch.cuda.Event()
                self.zeroed[b.index].record(torch.cuda.current_stream(self.d.device))
        return self.bufs[b.index]

    def _writing(self, b: Bucket) -> torch.Tensor:
        """The bucket's buffer, for a write on the current stream: on CUDA that stream is
        remembered (the bucket's reduce and copy down wait for every writer's, not only the
        last hook's) and, where the buffer was zero-filled on another, waits for the fill."""
        buf = self._buf(b)
        if self.d.cuda:
            cur = torch.cuda.current_stream(self.d.device)
            seen = self.writers[b.index] = self.writers[b.index] or {}
            if cur.cuda_stream not in seen:
                seen[cur.cuda_stream] = cur
                if self.zeroed[b.index] is not None:
                    cur.wait_event(self.zeroed[b.index])
        return buf

    def _take(self, s: ParamSpan, b: Bucket, g: torch.Tensor) -> None:
        self._writing(b)[s.offset - b.lo:s.offset - b.lo + s.numel].copy_(g)

    def _fill_unused(self, b: Bucket) -> None:
        buf = self._writing(b)
        for s in self._unseen(b):
            buf[s.offset - b.lo:s.offset - b.lo + s.numel].zero_()

    def _shard_part(self, b: Bucket) -> tuple[int, int]:
        return max(b.lo, self.d.shard_lo), min(b.hi, self.d.shard_hi)

    def _bucket_done(self, b: Bucket) -> None:
        """The bucket is complete: reduce across ranks, copy our shard's part down.

        CUDA: everything after the hook's copy into the bucket runs on the copy
        stream, ordered after the compute stream's work so far (the bucket's
        backward kernels are queued, not finished): the reduce's wait, the norm of
        the 16-bit values that go down, and the copy; the compute stream never
        waits for communication."""
        d = self.d
        lo, hi = self._shard_part(b)
        buf = self.bufs[b.index]
        if d.cuda:  # the current stream (which the reduce and the copy stream follow) after every writer's
            cur = torch.cuda.current_stream(d.device)
            for st in (self.writers[b.index] or {}).values():
                if st.cuda_stream != cur.cuda_stream:
                    cur.wait_stream(st)
            self.writers[b.index] = self.zeroed[b.index] = None
        with d.tracer.span("grad_bucket", bucket=b.index, bytes=2 * max(0, hi - lo)):
            red = d.coll.start_bucket_reduce(buf, b.lo) if d.world_size > 1 else None
            if not d.cuda:  # a CPU device with a process group (GlooStep serves gloo)
                avg = red.wait() if red is not None else None
                if hi > lo:
                    if avg is None:
                        part = buf[lo - b.lo:hi - b.lo]
                    else:  # NCCL's reduce leaves this rank its part; gloo's all-reduce the bucket
                        part = avg if d.coll.nccl else avg[lo - b.lo:hi - b.lo]
                    d.gate.wait_free(hi - d.shard_lo)
                    host = d.host[self.slot][lo - d.shard_lo:hi - d.shard_lo]
                    host.copy_(part)
                    self.sq_host += d.host_sumsq(self.slot, lo - d.shard_lo, hi - d.shard_lo)
                    d.counters.bytes_to_host += 2 * (hi - lo)
            elif hi > lo or red is not None:
                cur = torch.cuda.current_stream(d.device)
                d.copy_stream.wait_stream(cur)
                with torch.cuda.stream(d.copy_stream):
                    if red is None:
                        part = buf[lo - b.lo:hi - b.lo]
                    else:
                        avg = red.wait()  # the copy stream waits for the reduce, not the host
                        red.record_stream(d.copy_stream)
                        part = None
                        if avg is not None:
                            part = avg if d.coll.nccl else avg[lo - b.lo:hi - b.lo]
                            part = part.to(d.dtype)  # the one rounding to 16 bits
                    if hi > lo:
                        d.gate.wait_free(hi - d.shard_lo)
                        host = d.host[self.slot][lo - d.shard_lo:hi - d.shard_lo]
                        # the norm of exactly the 16-bit values that go down (an fp32 average
                        # beyond fp16's range is inf there, and must skip the step)
                        self.sq += torch.linalg.vector_norm(part, dtype=torch.float32).square()
                        host.copy_(part, non_blocking=True)
                        part.record_stream(d.copy_stream)
                        d.counters.bytes_to_host += 2 * (hi - lo)
                        if d.on_ready is not None:  # speculation: announced once the copy has run
                            ev = torch.cuda.Event()
                            ev.record(d.copy_stream)
                            self.events[b.index] = ev
                buf.record_stream(d.copy_stream)
        self.bufs[b.index] = None


class GlooStep(DeviceBucketStep):
    """Each complete bucket's all-reduce starts at once and backward goes on; a reduce
    that has finished is copied down (our shard's part) the next time a hook runs, in
    bucket order, so that speculation hears of it during backward; finish() waits for
    the rest."""

    def __init__(self, down: GradientsDown, slot: int):
        super().__init__(down, slot)
        self.pending: list = []  # (bucket, lo, hi, reduce) of reduces started, in bucket order
        self.landed = 0          # flat elements [0, landed) are averaged and in the host slot

    def _bucket_done(self, b: Bucket) -> None:
        lo, hi = self._shard_part(b)
        with self.d.tracer.span("grad_reduce_start", bucket=b.index):
            self.pending.append((b, lo, hi, self.d.coll.start_bucket_reduce(self.bufs[b.index], b.lo)))
        self.bufs[b.index] = None

    def _land(self, block: bool) -> None:
        """Copy our shard's part of the finished reduces down, in bucket order (block:
        wait for each; else stop at the first still running)."""
        d = self.d
        while self.pending:
            b, lo, hi, red = self.pending[0]
            if not block and not red.done():
                return
            with d.tracer.span("grad_bucket", bucket=b.index, bytes=2 * max(0, hi - lo)):
                acc = red.wait()
                if hi > lo:
                    d.gate.wait_free(hi - d.shard_lo)
                    host = d.host[self.slot][lo - d.shard_lo:hi - d.shard_lo]
                    host.copy_(acc[lo - b.lo:hi - b.lo])  # fp32 average -> 16 bits, one rounding
                    self.sq_host += d.host_sumsq(self.slot, lo - d.shard_lo, hi - d.shard_lo)
                    d.counters.bytes_to_host += 2 * (hi - lo)
            self.pending.pop(0)
            self.landed = b.hi

    def _ready_hi(self) -> int:
        self._land(block=False)
        return self.landed

    def _finish_reduces(self) -> None:
        self._land(block=True)
