"""OffloadEngine: the training worker's side of ZeRO-Offload.

    engine = OffloadEngine(model, OffloadConfig(lr=3e-4, dtype="bf16", dpu=True))
    for x, y in loader:
        loss = model(x, y)          # the model holds 16-bit weights on its device
        engine.backward(loss)
        engine.step()               # with DPU this returns while the CPU updates
    engine.close()

What crosses between device and host per step is the 16-bit gradient shard
(down, copied bucket by bucket from post-accumulate-grad hooks, overlapping
backward) and the 16-bit weight shard (up): 4 B/param in all.  The worker never
holds an fp32 master, m or v.

DPU (One-Step Delayed Parameter Update, ../shared/REFERENCE.md §4): steps
1..N-1 are synchronous.  From step N on, step() hands the gradients to the
server and returns; at the end of the next step it waits for that update,
copies the weights up and hands over the new gradients.  So with M_k the
master after k updates, the device computes step i on W_i = M_(i-2) for i > N.

The weights go up as the server publishes them (runtime.weights_up): during
the wait when synchronous, and inside the next backward as buckets free with
DPU.  When the device is this CPU and there is one rank, they do not go up at
all: the model's 16-bit weights live in one of two weights16 slots of the
shared segment, the server writes the next weights into the other, and landing
an update rebinds the parameters to it (cpu_zero_copy).

State machine across step() calls:  in_flight (a STEP awaits DONE) ->
stale (DONE came, the new weights are in the shared buffer, not yet on the
device) -> copied.  Checkpoints wait for the update in flight but keep the
device weights as they are (and save them), so training that resumes from a
checkpoint is bitwise the training that went on.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cython_ext import cpu_adam
from optimizer_server.atomic import atomic_write_bytes, fsync_dir
from optimizer_server.client import ShardClient
from optimizer_server.errors import OptimizerServerDeadError, OptimizerServerError, OptimizerServerTimeoutError
from optimizer_server.reshard import pick_world_size, rank_file, read_range
from optimizer_server.tracing import Tracer

from . import distributed
from .config import OffloadConfig
from .flat import Bucket, FlatParams
from .loss_scaler import LossScaler
from .optimizer_proxy import ServerOptimizer
from .weights_up import WeightReturn

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ENGINE_STATE_VERSION = 1
LATEST = "latest"  # in a checkpoint directory: the name of the newest complete step-N
# How long a gradient hook sleeps between looks at the progress word while the
# update in flight still reads the range it must write (one DPU gradient slot).
# An update block (DEFAULT_PROGRESS_BLOCK) takes milliseconds: 0.1 ms loses little.
GRAD_SLOT_POLL_S = 0.0001


class OffloadEngine:
    def __init__(self, model: torch.nn.Module, config: OffloadConfig | None = None, **overrides):
        if config is None:
            config = OffloadConfig(**overrides)
        elif overrides:
            raise TypeError("pass either an OffloadConfig or keyword overrides, not both")
        self.cfg = cfg = config
        self.model = model
        self.dtype = DTYPES[cfg.dtype]
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        src = params[0].device
        if any(p.device != src for p in params):
            raise ValueError("all trainable parameters must be on one device; move the model with .to(device) first")
        self.device = torch.device(cfg.device) if cfg.device else src
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {cfg.device!r} asked for CUDA but torch.cuda.is_available() is False")
        self.is_cuda = self.device.type == "cuda"
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # one CPU rank: device memory is host memory, so gradients go straight into
        # the shared slot from the hooks, with no bucket buffer in between
        self._direct_host = self.world_size == 1 and not self.is_cuda
        # ... and its 16-bit weights can live in the shared segment itself: two slots,
        # the server writes the next weights into the one the model is not using,
        # and landing an update swaps the model onto it (no copy up at all)
        self._zero_copy = self._direct_host and cfg.cpu_zero_copy
        self._cur = 0  # zero-copy: the weights16 slot the model's parameters view
        # DPU writes step t+1's gradients while the server still reads step t's: with
        # one slot each range waits until the update has passed it (_grad_range_free),
        # with two it never waits (+2 B/param of host RAM).  Synchronous steps wait
        # for DONE before the next backward anyway.
        self._grad_slots = cfg.dpu_grad_slots if cfg.dpu else 1
        self.tracer = Tracer(cfg.trace_dir, "worker", self.rank)
        self.flat = FlatParams(params, bucket_numel=cfg.bucket_numel, world_size=self.world_size)
        S = self.flat.shard_numel
        self.shard_lo, self.shard_hi = self.rank * S, (self.rank + 1) * S
        # Name of each parameter, for master_state_dict().
        self._names = {id(p): n for n, p in model.named_parameters()}

        self._server = None
        self.client: ShardClient | None = None
        self._registered_ptr = None
        self._hooks = []
        self._closed = False
        try:
            self._connect(cfg)
            self._init_weights()
            self._install_hooks()
        except BaseException:
            self.close()
            raise

        self.scaler = LossScaler(dynamic=(cfg.dtype == "fp16" and cfg.loss_scale == "dynamic"),
                                 scale=(1.0 if cfg.dtype == "bf16" else
                                        cfg.initial_scale if cfg.loss_scale == "dynamic" else cfg.loss_scale),
                                 growth_factor=cfg.growth_factor, backoff_factor=cfg.backoff_factor,
                                 growth_interval=cfg.growth_interval)
        self.optimizer = ServerOptimizer(self)
        self.iteration = 0        # step() calls, skipped ones included
        self.updates = 0          # updates applied (the Adam step count)
        self.skipped_steps = 0
        self._micro = 0
        self._grads_ready = False
        self._sq = None
        self._sq_host = 0.0
        self._cpu_threads = torch.get_num_threads()
        self._final = False
        self._front = 0
        self._seen: set[int] = set()
        self._pending_reduces: list = []
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.wait_s = 0.0
        self.grad_slot_wait_s = 0.0  # backward's hooks waiting for the update to pass (one DPU slot)
        self.update_s = 0.0
        self.last_grad_norm = float("nan")

    # ------------------------------------------------------------------ set-up
    def _connect(self, cfg: OffloadConfig) -> None:
        addr, token = cfg.resolved_server()
        proc = None
        if not addr:
            from optimizer_server.spawn import spawn
            # exit_when_idle: if this worker is killed, the server drops it after the
            # heartbeat timeout and exits, so no orphan stays behind
            self._server = spawn(threads=cfg.server_threads, exit_when_idle=True, trace_dir=cfg.trace_dir)
            addr, token, proc = self._server.address, self._server.token, self._server.proc
        hp = {"lr": float(cfg.lr_at(1)), "beta1": cfg.betas[0], "beta2": cfg.betas[1], "eps": cfg.eps,
              "weight_decay": cfg.weight_decay}
        self.client = ShardClient(addr, token, rank=self.rank, world_size=self.world_size,
                                  numel=self.flat.shard_numel, dtype=cfg.dtype, optimizer=cfg.optimizer,
                                  hparams=hp, request_timeout_s=cfg.request_timeout_s, server_proc=proc,
                                  progress_block=cfg.progress_block_numel,
                                  weight_slots=2 if self._zero_copy else 1, grad_slots=self._grad_slots,
                                  staging_numel=cfg.staging_numel)
        c = self.client
        as16 = lambda a: torch.from_numpy(a.view(np.int16)).view(self.dtype)  # noqa: E731
        self._host_grads = [as16(g) for g in c.grads]
        self._w16_slots = [as16(w) for w in c.weights16_slots]
        if self.is_cuda:
            self._register_host_memory()
            self._copy_stream = torch.cuda.Stream(self.device)  # gradients down
        self._up = WeightReturn(self)  # weights up (its own stream on CUDA)

    def _register_host_memory(self) -> None:
        """Page-lock the shared segment so device copies are DMA, truly async."""
        if self.cfg.pin_host_memory == "off":
            return
        seg = self.client.segment
        ptr = np.frombuffer(seg.buffer, np.uint8).ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, seg.size, 0)
        if int(err) != 0:
            _clear_cuda_last_error()
            msg = (f"cudaHostRegister of the shared segment ({seg.size} bytes) failed with {err}; raise the "
                   f"locked-memory limit (ulimit -l) or use more ranks (smaller shards)")
            if self.cfg.pin_host_memory == "require":
                raise RuntimeError(msg)
            warnings.warn(msg + "; going on with pageable copies, which are slower and do not overlap compute "
                          "(pin_host_memory='require' makes this an error)", RuntimeWarning, stacklevel=3)
            return
        self._registered_ptr = ptr

    def _init_weights(self) -> None:
        with self.tracer.span("init_weights"):
            # Host memory peaks here: the user's fp32 model is still alive.  So only
            # this rank's shard goes to the server, straight from the parameters
            # through the staging window, chunk by chunk (no flat fp32 copy of the
            # model), and then each parameter is cast into flat16 and released in
            # turn.  INIT comes first: if it fails the model is untouched.
            lo0 = self.shard_lo
            self.client.init_weights(fill=lambda out, lo, hi: self.flat.copy_fp32_range(
                torch.from_numpy(out), lo0 + lo, lo0 + hi))
            # every rank casts the full model itself (identical on all ranks); the
            # server's 16-bit copy of our shard rounds the same way (RNE)
            if self._zero_copy:
                self.flat16 = self._w16_slots[self._cur]
            else:
                self.flat16 = torch.empty(self.flat.padded_numel, dtype=self.dtype, device=self.device)
            self.flat.cast_and_bind(self.flat16)
            for b in self.model.buffers():
                b.data = b.data.to(self.device, self.dtype if b.is_floating_point() else b.dtype)
        _return_freed_heap()

    def _install_hooks(self) -> None:
        for s in self.flat.slots:
            self._hooks.append(s.param.register_post_accumulate_grad_hook(self._on_grad))

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; on the last one of a step the gradients
        stream to the host as buckets complete."""
        self._check_open()
        if self._grads_ready:
            raise RuntimeError("backward() called twice for one step: call engine.step() after the last "
                               "micro-batch's backward")
        self._micro += 1
        final = self._micro % self.cfg.grad_accumulation_steps == 0
        if final:
            self._slot = self.iteration % self._grad_slots
            for b in self.flat.buckets:
                b.remaining = len(b.slots)
                b.buf = None
            self._front = 0  # buckets [0, _front) are done: their weights are free on the device
            self._sq = torch.zeros((), dtype=torch.float32, device=self.device)
            self._sq_host = 0.0
            self._seen = set()
        self._final = final
        with self.tracer.span("backward"), self._record("zo.backward"):
            (loss * (self.scaler.scale / self.cfg.grad_accumulation_steps)).backward()
        if final:
            self._finish_buckets()
            self._finish_reduces()
            self._grads_ready = True

    def _record(self, name: str):
        if self.is_cuda:
            return torch.profiler.record_function(name)
        return _NullCtx

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._final:
            return  # accumulation pending: autograd keeps summing into p.grad
        s = self.flat.by_param[id(p)]
        b = self.flat.buckets[s.bucket]
        g = p.grad.reshape(-1)
        if self._direct_host:
            # copy into the shared slot and take the norm's share in one pass over
            # memory (the sum is read from cache, right behind the copy)
            self._grad_range_free(s.offset + s.numel)
            dst = self.client.grads[self._slot][s.offset:s.offset + s.numel]
            if g.dtype == self.dtype and g.is_contiguous():
                self._sq_host += cpu_adam.copy_grad_sumsq(g.view(torch.int16).numpy(), dst,
                                                          grad_dtype=self.cfg.dtype, num_threads=self._cpu_threads)
            else:  # a hook or a custom autograd.Function handed back another layout
                self._host_grads[self._slot][s.offset:s.offset + s.numel].copy_(g)
                self._sq_host += cpu_adam.grad_sumsq(dst, grad_dtype=self.cfg.dtype, num_threads=self._cpu_threads)
        else:
            if b.buf is None:
                b.buf = torch.empty(b.numel, dtype=self.dtype, device=self.device)
            b.buf[s.offset - b.lo:s.offset - b.lo + s.numel].copy_(g)
        p.grad = None  # the device gradient is released as soon as it is copied
        self._seen.add(id(p))
        b.remaining -= 1
        if b.remaining == 0:
            self._bucket_done(b)

    def _finish_buckets(self) -> None:
        """Parameters that got no gradient (unused in forward) count as zeros."""
        for b in self.flat.buckets:
            if b.remaining == 0:
                continue
            if b.buf is None and not self._direct_host:
                b.buf = torch.empty(b.numel, dtype=self.dtype, device=self.device)
            for s in b.slots:
                if id(s.param) in self._seen:
                    continue
                if self._direct_host:
                    self._grad_range_free(s.offset + s.numel)
                    self._host_grads[self._slot][s.offset:s.offset + s.numel].zero_()
                else:
                    b.buf[s.offset - b.lo:s.offset - b.lo + s.numel].zero_()
            b.remaining = 0
            self._bucket_done(b)

    @property
    def _stale(self) -> bool:
        """An update has landed whose weights are not (all) on the device yet."""
        return self._up.pending and self._up.landed

    @property
    def _incoming_slot(self) -> int:
        """The weights16 slot the next update writes (zero-copy: the one the model is not on)."""
        return 1 - self._cur if self._zero_copy else 0

    @property
    def _host_w16(self) -> torch.Tensor:
        return self._w16_slots[self._incoming_slot]

    def _incoming_words(self) -> np.ndarray:
        return self.client.weights16_slots[self._incoming_slot]

    def _swap_weights(self) -> None:
        """Zero-copy landing: the model's parameters move onto the slot the server
        just wrote (a view change per parameter, microseconds; no bytes move)."""
        self._cur = 1 - self._cur
        self.flat16 = self._w16_slots[self._cur]
        self.flat.bind(self.flat16)
        self._up.reset()

    def _weights_free(self) -> None:
        """Backward is done with a prefix of buckets: copy the pending update's
        weights there (those published so far; runtime.weights_up)."""
        bs = self.flat.buckets
        while self._front < len(bs) and bs[self._front].remaining == 0:
            self._front += 1
        free = bs[self._front].lo if self._front < len(bs) else self.flat.padded_numel
        self._up.pump(min(max(free - self.shard_lo, 0), self.flat.shard_numel))

    def _bucket_done(self, b: Bucket) -> None:
        """The bucket is complete: reduce across ranks, copy our shard's part down."""
        if self._up.pending and not self._zero_copy:
            self._weights_free()
        lo, hi = max(b.lo, self.shard_lo), min(b.hi, self.shard_hi)
        if self._direct_host:
            # the hooks copied the bytes and summed their squares already; the
            # (empty) span marks the bucket's completion and bytes in the trace
            with self.tracer.span("grad_bucket", bucket=b.index, bytes=2 * b.numel):
                pass
            self.bytes_to_host += 2 * b.numel
            return
        if self.world_size > 1 and not self.is_cuda:
            # gloo: start the all-reduce and let backward go on; finished in _finish_reduces
            with self.tracer.span("grad_reduce_start", bucket=b.index):
                self._pending_reduces.append((b, lo, hi, *distributed.start_bucket_reduce(self, b)))
            b.buf = None
            return
        with self.tracer.span("grad_bucket", bucket=b.index, bytes=2 * max(0, hi - lo)):
            if self.world_size > 1:
                distributed.reduce_bucket(self, b)
            if hi > lo:
                part = b.buf[lo - b.lo:hi - b.lo]
                self._grad_range_free(hi - self.shard_lo)
                host = self._host_grads[self._slot][lo - self.shard_lo:hi - self.shard_lo]
                if self.is_cuda:
                    # on the device, where the bucket is: no extra host pass
                    self._sq += torch.linalg.vector_norm(part, dtype=torch.float32).square()
                    # side stream: the copy overlaps the rest of backward
                    cur = torch.cuda.current_stream(self.device)
                    self._copy_stream.wait_stream(cur)
                    with torch.cuda.stream(self._copy_stream):
                        host.copy_(part, non_blocking=True)
                    b.buf.record_stream(self._copy_stream)
                else:
                    host.copy_(part)
                    self._sq_host += self._host_sumsq(lo - self.shard_lo, hi - self.shard_lo)
                self.bytes_to_host += 2 * (hi - lo)
            b.buf = None

    def _finish_reduces(self) -> None:
        """Wait for the gloo all-reduces started during backward; copy our shard's parts down."""
        for b, lo, hi, acc, work in self._pending_reduces:
            with self.tracer.span("grad_bucket", bucket=b.index, bytes=2 * max(0, hi - lo)):
                distributed.finish_bucket_reduce(self, work, acc)
                if hi > lo:
                    self._grad_range_free(hi - self.shard_lo)
                    host = self._host_grads[self._slot][lo - self.shard_lo:hi - self.shard_lo]
                    host.copy_(acc[lo - b.lo:hi - b.lo])  # fp32 average -> 16 bits, one rounding
                    self._sq_host += self._host_sumsq(lo - self.shard_lo, hi - self.shard_lo)
                    self.bytes_to_host += 2 * (hi - lo)
        self._pending_reduces = []

    def _grad_range_free(self, hi: int) -> None:
        """One gradient slot under DPU: wait until the update in flight has read the
        slot's [0, hi) (shard elements), which it publishes block by block (the
        progress word; its blocks' reads end at the block's barrier, before the
        release store).  Backward and the update both run front to back and the
        update starts a forward earlier, so this rarely waits."""
        k = self.client.in_flight
        if k is None or self._grad_slots == 2 or self.client.published(k) >= hi:
            return
        c = self.client
        with self.tracer.span("grad_slot_wait", step=k, upto=hi):
            t0 = time.monotonic()
            while c.published(k) < hi:
                if c.reply_ready(0):
                    break  # DONE (or the error wait_done will raise) is there: the slot is free
                if time.monotonic() - t0 > c.request_timeout_s:
                    raise OptimizerServerTimeoutError(f"update {k} did not pass element {hi} of the gradient "
                                                      f"slot within {c.request_timeout_s:.0f} s; if the server is "
                                                      f"just slow, raise request_timeout_s (or dpu_grad_slots=2 "
                                                      f"never waits)")
                time.sleep(GRAD_SLOT_POLL_S)
            self.grad_slot_wait_s += time.monotonic() - t0

    def _host_sumsq(self, lo: int, hi: int) -> float:
        """Sum of squares of the host gradient slot [lo, hi) (shard coordinates).

        The one-pass SIMD kernel, right after the copy while the bytes are hot;
        torch's vector_norm on 16-bit CPU tensors is several times slower and,
        for tens of millions of elements, off by about 1% (fp32 accumulation)."""
        return cpu_adam.grad_sumsq(self.client.grads[self._slot][lo:hi], grad_dtype=self.cfg.dtype,
                                   num_threads=self._cpu_threads)

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """Apply the gradients of the last backward (see the module docstring for DPU)."""
        self._check_open()
        if not self._grads_ready:
            raise RuntimeError("step() before backward(): call engine.backward(loss) on the last micro-batch first")
        self._grads_ready = False
        self.iteration += 1
        with self.tracer.span("step", iteration=self.iteration), self._record("zo.step"):
            self._step()

    def _step(self) -> None:
        delayed = self.cfg.dpu and self.iteration >= self.cfg.dpu_warmup_steps
        with self.tracer.span("grad_check"):
            if self.is_cuda:
                self._copy_stream.synchronize()  # all gradient bytes are on the host
            sq = self._sq + self._sq_host if self._sq_host else self._sq
            if self.world_size > 1:
                sq = distributed.all_reduce_sum(self, sq)
            sq = float(sq)  # sync point: one scalar per step
        overflow = not math.isfinite(sq)
        # the update in flight (DPU) lands before anything else touches the server
        self._land_inflight(copy=True)
        if overflow:
            with self.tracer.span("skip"):
                self.client.skip(self.updates + 1)
            self.skipped_steps += 1
            self.scaler.update(True)
            self.last_grad_norm = float("inf")
            return
        scale = self.scaler.scale
        norm = math.sqrt(sq) / scale
        self.last_grad_norm = norm
        clip = 1.0
        if self.cfg.clip_grad_norm is not None:
            clip = min(1.0, self.cfg.clip_grad_norm / (norm + 1e-6))
        k = self.updates + 1
        lr = self.optimizer.lr_for(k)
        pg = self.optimizer.param_groups[0]
        hp = {"weight_decay": float(pg["weight_decay"])}
        with self.tracer.span("signal", step=k):
            self.client.step_async(k, self._slot, lr, clip / scale, hp,
                                   predict=self.cfg.dpu_predict if delayed else 0.0,
                                   out_slot=self._incoming_slot)
            self._up.begin(k)
        self.updates = k
        self.scaler.update(False)
        self.optimizer.step()  # keeps torch LR schedulers' bookkeeping happy
        if not delayed:
            self._land_inflight(copy=True)

    def _land_inflight(self, copy: bool) -> None:
        """Wait for the update in flight; with copy, its weights go up (as they are
        published, while it runs) and every rank gets the whole model."""
        if self.client.in_flight is not None:
            t0 = time.perf_counter()
            with self.tracer.span("wait_server"), self._record("zo.wait_server"):
                if copy and not self._zero_copy:
                    done = self._up.wait_landed()
                else:
                    done = self.client.wait_done()
                    self._up.land()
            self.wait_s += time.perf_counter() - t0
            self.update_s += done.update_s
        if copy and self._stale:
            if self._zero_copy:
                with self.tracer.span("weights_swap"):
                    self._swap_weights()
            else:
                with self.tracer.span("weights_up_tail"), self._record("zo.weights_up"):
                    self._up.finish()
                    if self.world_size > 1:
                        distributed.all_gather_weights(self)

    def synchronize(self, copy_weights: bool = False) -> None:
        """Wait for the update in flight.  With copy_weights the device gets the
        newest weights now (this moves the DPU schedule; training code leaves it off)."""
        self._check_open()
        self._land_inflight(copy=copy_weights)

    # ------------------------------------------------------------------ state
    def master_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """The fp32 master weights (all shards) as CPU tensors, keyed like model.state_dict()."""
        self.synchronize()
        shard = torch.from_numpy(self.client.get_master())
        if self.world_size > 1:
            full = distributed.all_gather_cpu(self, shard)
        else:
            full = shard
        out = OrderedDict()
        for p in self.flat.params:
            s = self.flat.by_param[id(p)]
            out[self._names.get(id(p), f"param{len(out)}")] = full[s.offset:s.offset + s.numel].view(p.shape).clone()
        return out

    def _pending_file(self, d: Path) -> Path:
        return rank_file(d, "pending16", self.rank, self.world_size, ".bin")

    def _read_saved_shard(self, d: Path, prefix: str, src: int, out: np.ndarray | None = None) -> np.ndarray:
        """This rank's shard of the 16-bit files {prefix}-r*-of-{src}.bin (saved by src ranks)."""
        files = [rank_file(d, prefix, k, src, ".bin") for k in range(src)]
        sizes = {f.stat().st_size if f.exists() else -1 for f in files}
        per_file = sizes.pop() // 2 if len(sizes) == 1 else -1
        if per_file < 0 or per_file * src < self.flat.numel:
            raise ValueError(f"checkpoint {d}: {prefix} files of {src} rank(s) are missing or of unequal or "
                             f"too small sizes ({sorted(f.name for f in files if f.exists())}); load another "
                             f"checkpoint (an earlier step-N beside it)")
        if out is None:
            out = np.empty(self.flat.shard_numel, np.int16)
        read_range(files, per_file, 0, self.shard_lo, self.shard_hi, out)
        return out

    def _engine_files(self, d: Path) -> tuple[Path, Path]:
        return (rank_file(d, "engine", self.rank, self.world_size, ".json"),
                rank_file(d, "device16", self.rank, self.world_size, ".bin"))

    def save_checkpoint(self, directory: str, keep: int = 2) -> str:
        """Write a checkpoint under directory/step-NNNNNNNN and point directory/latest at it.

        Server: this shard's master/m/v (fsync'd).  Engine: counters, loss scale
        and the device weights as they are (they may be one update behind, DPU).
        Everything goes to a temporary sub-directory first and is renamed into
        place only when every rank has finished, then `latest` is replaced
        atomically: a failed save (full or read-only disk) raises and leaves the
        previous checkpoint intact and current.  The newest `keep` are kept.
        """
        self._check_open()
        if self._grads_ready or self._micro % self.cfg.grad_accumulation_steps:
            raise RuntimeError("save_checkpoint() in the middle of a step would lose its gradients: call it "
                               "after engine.step()")
        self._land_inflight(copy=False)
        root = Path(directory)
        name = f"step-{self.iteration:08d}"
        tmp = root / f"tmp-{name}"
        with self.tracer.span("save_checkpoint"):
            try:
                tmp.mkdir(parents=True, exist_ok=True)
                self.client.save(str(tmp))
                meta_path, dev_path = self._engine_files(tmp)
                dev = self.flat16[self.shard_lo:self.shard_hi].detach().cpu().contiguous()
                atomic_write_bytes(dev_path, dev.view(torch.int16).numpy().tobytes())
                if self._stale:
                    # the landed update not yet on the device (with dpu_predict it is
                    # not simply RNE(master), so it is saved as it is)
                    atomic_write_bytes(self._pending_file(tmp), self._incoming_words().tobytes())
                meta = {"version": ENGINE_STATE_VERSION, "world_size": self.world_size, "rank": self.rank,
                        "numel": self.flat.numel, "dtype": self.cfg.dtype, "optimizer": self.cfg.optimizer,
                        "iteration": self.iteration, "updates": self.updates, "skipped_steps": self.skipped_steps,
                        "micro": self._micro, "stale": self._stale, "scaler": self.scaler.state_dict(),
                        "optimizer_proxy": self.optimizer.state_dict_small()}
                atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())
                ok = True
            except (OSError, OptimizerServerError) as e:
                ok, err = False, e
            if self.world_size > 1:
                ok_all = distributed.all_ranks_ok(self, ok)
            else:
                ok_all = ok
            if not ok_all:
                if self.rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                if not ok and isinstance(err, OptimizerServerDeadError):
                    raise err  # a dead server is the one named error, whatever it interrupted
                if not ok:
                    raise OptimizerServerError(f"saving checkpoint {name} in {root} failed ({err}); the previous "
                                               f"checkpoint is intact", code="checkpoint") from err
                raise OptimizerServerError(f"saving checkpoint {name} failed on another rank; the previous "
                                           f"checkpoint is intact", code="checkpoint")
            if self.rank == 0:
                final = root / name
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                fsync_dir(root)
                atomic_write_bytes(root / LATEST, name.encode())
                old = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name != name)
                for p in old[:max(0, len(old) - (keep - 1))]:
                    shutil.rmtree(p, ignore_errors=True)
            if self.world_size > 1:
                distributed.barrier(self)
        return str(root / name)

    @staticmethod
    def has_checkpoint(directory: str) -> bool:
        """True once save_checkpoint(directory) has completed (its `latest` pointer exists)."""
        return (Path(directory) / LATEST).exists()

    @staticmethod
    def resolve_checkpoint(directory: str) -> Path:
        """directory/latest's target, or the directory itself if it holds the files."""
        d = Path(directory)
        latest = d / LATEST
        if latest.exists():
            return d / latest.read_text().strip()
        return d

    def load_checkpoint(self, directory: str) -> None:
        """Restore a checkpoint saved with this world size or another: each rank
        reads its shard's range of every saved shard (optimizer_server.reshard),
        so a job can resume on fewer or more ranks."""
        self._check_open()
        self._land_inflight(copy=False)
        d = self.resolve_checkpoint(directory)
        src = pick_world_size(d, "engine", self.world_size)
        meta_path = rank_file(d, "engine", self.rank if src == self.world_size else 0, src, ".json")
        if not meta_path.exists():
            raise ValueError(f"checkpoint {d} is incomplete: {meta_path.name} is missing; load another checkpoint "
                             f"(an earlier step-N beside it)")
        meta = json.loads(meta_path.read_text())
        for k, mine in (("numel", self.flat.numel), ("dtype", self.cfg.dtype), ("optimizer", self.cfg.optimizer)):
            if meta[k] != mine:
                raise ValueError(f"checkpoint {d} has {k}={meta[k]!r} but this engine has {mine!r}")
        with self.tracer.span("load_checkpoint", world_size_saved=src):
            self.client.load(str(d))
            raw = self._read_saved_shard(d, "device16", src)
            self.flat16[self.shard_lo:self.shard_hi].copy_(torch.from_numpy(raw).view(self.dtype))
            if self.world_size > 1:
                distributed.all_gather_weights(self)
        self.iteration = meta["iteration"]
        self.updates = meta["updates"]
        self.skipped_steps = meta["skipped_steps"]
        self._micro = meta["micro"]
        self._up.reset()
        if meta["stale"]:
            # nothing is in flight: the server does not touch the buffer until the next STEP
            self._read_saved_shard(d, "pending16", src, out=self._incoming_words().view(np.int16))
            self._up.begin(self.updates)
            self._up.land()
        self.scaler.load_state_dict(meta["scaler"])
        self.optimizer.load_state_dict_small(meta["optimizer_proxy"])

    def stats(self) -> dict:
        return {"steps": self.iteration, "updates": self.updates, "skipped_steps": self.skipped_steps,
                "loss_scale": self.scaler.scale, "bytes_to_host": self.bytes_to_host,
                "bytes_to_device": self.bytes_to_device, "bytes_to_device_early": self._up.early_bytes,
                "wait_s": self.wait_s, "grad_slot_wait_s": self.grad_slot_wait_s,
                "server_update_s": self.update_s,
                "grad_norm": self.last_grad_norm, "weights_zero_copy": self._zero_copy, "num_params": self.flat.numel,
                "shard_numel": self.flat.shard_numel, "rank": self.rank, "world_size": self.world_size}

    # ------------------------------------------------------------------ teardown
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def close(self) -> None:
        """Land the last update on the device, say BYE, stop a private server."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.client is not None and getattr(self, "flat16", None) is not None:
                try:
                    self._land_inflight(copy=True)
                except OptimizerServerError:
                    pass
        finally:
            if self._zero_copy and getattr(self, "flat16", None) is not None:
                # the parameters view the shared segment, which goes away now: give
                # the model its weights in private memory (the user may keep using it)
                self.flat16 = self.flat16.clone()
                self.flat.bind(self.flat16)
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._host_grads = []
            self._w16_slots = []
            if self._registered_ptr is not None:
                torch.cuda.synchronize(self.device)
                torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
                self._registered_ptr = None
            if self.client is not None:
                self.client.close()
            if self._server is not None:
                self._server.stop()
            self.tracer.flush()

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clear_cuda_last_error() -> None:
    """Reset the CUDA runtime's per-thread last error after a failed call we handled.

    torch checks cudaGetLastError() after its kernel launches, so a refused
    cudaHostRegister would otherwise surface as an unrelated error at the next
    launch.  torch.cuda.cudart() has no cudaGetLastError, so call it in the
    libcudart this process already loaded (the same instance, hence the same
    error state); best effort: a statically linked runtime is not reachable."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libcudart" in line}
        for path in libs:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def _return_freed_heap() -> None:
    """Give the heap pages freed by the cast (the user's fp32 parameters) back to the OS.

    glibc keeps freed chunks below its mmap threshold in the heap, so a model of
    many few-MB tensors would otherwise keep its 4 B/param of fp32 resident after
    the engine let go of it: host RAM the optimizer server needs.  Best effort
    (other C libraries have no malloc_trim)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _NullCtxType:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NullCtx = _NullCtxType()
