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

import torch

from .stats import Counters


class WeightReturn:
    """The copy up of one update's 16-bit weights, range by range, front to back.

    dst: this rank's shard of the device weights; src: the shared weights slot the
    server writes (the same length).  Which ranges may go when is the update
    cycle's decision (runtime.update_cycle); this object only copies them, counts
    the bytes, and on CUDA keeps the copies on a stream of their own.
    """

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, *, tracer, counters: Counters):
        assert dst.numel() == src.numel()
        self.dst, self.src = dst, src
        self.tracer = tracer
        self.counters = counters
        self.copied = 0  # shard elements [0, copied) of the pending update are on the device
        self.stream = torch.cuda.Stream(dst.device) if dst.device.type == "cuda" else None

    @property
    def numel(self) -> int:
        return self.dst.numel()

    def start(self) -> None:
        """A new update's weights are coming: nothing of them is on the device yet."""
        self.copied = 0

    def copy_upto(self, hi: int, early: bool) -> int:
        """Copy [copied, hi) up; early: while the update still runs or inside backward."""
        hi = min(hi, self.numel)
        if hi > self.copied:
            self._copy(self.copied, hi, early)
            self.copied = hi
        return self.copied

    def finish(self) -> None:
        """Copy the rest (DONE has come) and make it visible to the device's next work."""
        self.copy_upto(self.numel, early=False)
        if self.stream is not None:
            # the next forward runs on the compute stream; the host buffer is
            # rewritten by the server once the next STEP goes out
            torch.cuda.current_stream(self.dst.device).wait_stream(self.stream)
            self.stream.synchronize()

    def _copy(self, lo: int, hi: int, early: bool) -> None:
        with self.tracer.span("weights_up", bytes=2 * (hi - lo), early=int(early)):
            dst, src = self.dst[lo:hi], self.src[lo:hi]
            if self.stream is not None:
                # after the compute stream's queued work: the bucket's backward
                # kernels may still read these weights
                self.stream.wait_stream(torch.cuda.current_stream(self.dst.device))
                with torch.cuda.stream(self.stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
        self.counters.bytes_to_device += 2 * (hi - lo)
        if early:
            self.counters.bytes_to_device_early += 2 * (hi - lo)
