"""Copying the updated 16-bit weights up to the device while the update still runs.

The server publishes, block by block, how much of the shard's weights16 already
holds the new weights (the progress word, optimizer_server.shm).  The engine
copies each published range up as soon as it is also free on the device:

- synchronous step: at once, while the rest of the update runs; the worker
  would otherwise sit idle in the wait, and only the last block's copy is left
  after DONE instead of the whole shard's.
- DPU: the update of step t runs during step t+1's forward and backward, which
  still read the old weights.  A range is free once backward has produced the
  gradient of every parameter in it.  Buckets complete front to back in
  backward (runtime.flat lays the flat buffer out in reverse), which is also
  the order the server updates in, so most of the copy happens inside
  backward and only the tail is left after it.

Why writing under a running backward is safe: every parameter is its own
tensor (``param.data = view`` gives it its own version counter), and a
parameter's post-accumulate-grad hook fires only after every node that saved
it has run, so nothing reads a freed range again in this backward.

On CUDA each range is a non-blocking copy on a stream of its own (gradients go
down on another, so the two directions overlap), ordered after the compute
stream's work so far: the bucket's backward kernels are queued, not finished,
when its hook runs.  Before the next STEP lets the server overwrite weights16,
the copies must have finished reading it (``finish`` synchronizes).
"""
from __future__ import annotations

import time

import torch

# How long one wait for DONE sleeps between looks at the progress word.  A
# block of DEFAULT_PROGRESS_BLOCK elements takes a few ms to update, so 1 ms
# polling costs nothing and leaves little idle time.
PROGRESS_POLL_S = 0.001


class WeightReturn:
    """The copy up of one update's weights: which update, how much is on the device."""

    def __init__(self, engine):
        self.e = engine
        self.step: int | None = None   # the update whose weights are (partly) not on the device
        self.landed = False            # its DONE came: all of weights16 is final
        self.copied = 0                # shard elements [0, copied) are on the device
        self.early_bytes = 0           # copied before DONE or inside backward (the point of all this)
        self.stream = torch.cuda.Stream(engine.device) if engine.is_cuda else None

    @property
    def pending(self) -> bool:
        return self.step is not None

    def begin(self, step: int) -> None:
        assert self.step is None, "the previous update's weights were never copied up"
        self.step, self.landed, self.copied = step, False, 0

    def land(self) -> None:
        """DONE came by another way (or the pending weights were restored from a checkpoint)."""
        self.landed = True

    def reset(self) -> None:
        """Nothing to copy (the device weights were replaced, e.g. by load_checkpoint)."""
        self.step, self.landed, self.copied = None, False, 0

    def pump(self, free: int, early: bool = True) -> int:
        """Copy what is both published and below `free` (shard elements); returns
        how far the device is now.  early: overlapping backward or the update."""
        if self.step is None or (early and not self.e.cfg.overlap_weights_up):
            return self.copied
        S = self.e.flat.shard_numel
        done = S if self.landed else self.e.client.published(self.step)
        hi = min(done, free, S)
        if hi > self.copied:
            self._copy(self.copied, hi, early)
            self.copied = hi
        return self.copied

    def wait_landed(self):
        """Wait for DONE of the update in flight, copying its weights as they are published."""
        c, S = self.e.client, self.e.flat.shard_numel
        deadline = time.monotonic() + c.request_timeout_s
        while self.pump(S) < S and time.monotonic() < deadline:
            if c.reply_ready(PROGRESS_POLL_S):
                break  # DONE (or an error) is there: wait_done reads it
        done = c.wait_done(timeout_s=max(1.0, deadline - time.monotonic()))
        self.landed = True
        return done

    def finish(self) -> None:
        """Copy the rest (DONE has come), make it visible to the device's next work."""
        assert self.landed and self.step is not None
        self.pump(self.e.flat.shard_numel, early=False)
        if self.stream is not None:
            # the next forward runs on the compute stream; the host buffer is
            # rewritten by the server once the next STEP goes out
            torch.cuda.current_stream(self.e.device).wait_stream(self.stream)
            self.stream.synchronize()
        self.step, self.landed = None, False

    def _copy(self, lo: int, hi: int, early: bool) -> None:
        e = self.e
        with e.tracer.span("weights_up", bytes=2 * (hi - lo), early=int(early)):
            dst = e.flat16[e.shard_lo + lo:e.shard_lo + hi]
            src = e._host_w16[lo:hi]
            if self.stream is not None:
                # after the compute stream's queued work: the bucket's backward
                # kernels may still read these weights
                self.stream.wait_stream(torch.cuda.current_stream(e.device))
                with torch.cuda.stream(self.stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
        e.bytes_to_device += 2 * (hi - lo)
        if early:
            self.early_bytes += 2 * (hi - lo)
