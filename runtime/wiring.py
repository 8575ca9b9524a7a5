"""The engine's set-up: which exact strategies it may use, the server and the parts
around the shard (client, update cycle, gradients down, speculation), and the first
weights.  Functions of the engine, called once from OffloadEngine.__init__."""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zero_offload.server.admission import read_mem_available
from zero_offload.server.client import ShardClient
from zero_offload.server.errors import OptimizerServerError
from zero_offload.server.protocol import E_RESOURCE, QBLOCK, ShardSpec
from zero_offload.server.state import bytes_per_param
from zero_offload.server.tracing import Tracer

from . import compute_dtype, distributed, exact_mode, host_memory, owners
from .config import OffloadConfig
from .devices import process_group, resolve_device
from .dtypes import TORCH_DTYPES
from .flat import FlatParams
from .grads_down import GradientsDown, SlotGate
from .optimizer_proxy import ServerOptimizer
from .param_groups import index_groups, state_dict_names
from .speculation import Speculator, weak_method
from .stats import Counters
from .update_cycle import UpdateCycle

if TYPE_CHECKING:
    from .engine import OffloadEngine

PARAM_ALIGN_CUDA = 128  # elements: 256 bytes of 16-bit weights


def prepare(engine: "OffloadEngine", model: torch.nn.Module, cfg: OffloadConfig, param_groups: list | None,
            backward_mode: str, overlap_ok: bool, auto_overlap: bool, local: bool = False) -> list:
    """Everything the engine decides before a process starts: the checks of what it was
    given, the device and the ranks, the compute dtype, zero-copy, the flat layout, the
    param groups and the candidate strategies.  Returns the trainable parameters."""
    engine.dtype = TORCH_DTYPES[cfg.dtype]
    if backward_mode not in ("engine", "hooks"):
        raise ValueError(f"backward_mode must be 'engine' or 'hooks', got {backward_mode!r}")
    if backward_mode == "hooks" and cfg.dtype == "fp16":
        raise ValueError("dtype='fp16' needs loss scaling, which a plain loss.backward() does not apply: use "
                         "dtype='bf16', or OffloadEngine(model, cfg) with engine.backward(loss), which scales "
                         "the loss and skips overflowing steps")
    engine.backward_mode = backward_mode
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (requires_grad=True)")
    owners.check_free(params)
    src = params[0].device
    if any(p.device != src for p in params):
        raise ValueError("all trainable parameters must be on one device; move the model with .to(device) first")
    engine.device = resolve_device(cfg.device, src)
    engine.is_cuda = engine.device.type == "cuda"
    # fp32 forward and backward on a CPU that only emulates 16-bit matmul
    engine.compute_dtype, engine._compute_why = compute_dtype.resolve(cfg.expert.compute_dtype, cfg.dtype,
                                                                      engine.device)
    # local: the parameters are this rank's own shards (FSDP2): no collective of the engine's
    engine.distributed = False if local else process_group()
    engine.rank = dist.get_rank() if engine.distributed else 0
    engine.world_size = dist.get_world_size() if engine.distributed else 1
    if engine.world_size > 1 and cfg.expert.compute_dtype == "auto" and engine.device.type == "cpu":
        # agreed before use: each rank read its own CPU (or measured it), and ranks that
        # compute in different dtypes all-gather weights of different sizes (gloo refuses,
        # or pairs the wrong buffers); fp32 if any rank needs it
        flag = torch.tensor([1 if engine.compute_dtype == torch.float32 else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) and engine.compute_dtype != torch.float32:
            engine.compute_dtype = torch.float32
            engine._compute_why = (f"another rank computes in fp32, and every rank must compute alike (this one: "
                                   f"{engine._compute_why})")
    # one CPU rank: its 16-bit weights can live in the shared segment itself (two
    # slots: the server writes the next weights into the one the model is not
    # using, and landing an update swaps the model onto it; no copy up at all)
    # (fp32 compute: the parameters are fp32, so they cannot view the 16-bit slots)
    engine._zero_copy = (engine.world_size == 1 and not engine.is_cuda and cfg.expert.cpu_zero_copy
                         and engine.compute_dtype == engine.dtype)
    # DPU writes step t+1's gradients while the server still reads step t's: with
    # one slot each range waits until the update has passed it (SlotGate), with
    # two it never waits (+2 B/param of host RAM).  Synchronous steps wait for
    # DONE before the next backward anyway.
    engine._grad_slots = cfg.expert.dpu_grad_slots if cfg.mode == "dpu" else 1
    # an FSDP2 rank's engine is a one-rank engine, but its trace file is named by its real rank
    trace_rank = dist.get_rank() if local and dist.is_available() and dist.is_initialized() else engine.rank
    engine.tracer = Tracer(cfg.resolved_trace_dir(), "worker", trace_rank)
    group_of, group_opts = index_groups(param_groups, params, model) if param_groups is not None else (None, None)
    engine.optimizer = ServerOptimizer(cfg, group_opts)  # validates the groups' values before any process starts
    # each parameter 256-byte aligned on a GPU (cuBLAS picks slower kernels for operands
    # that are not); packed on the CPU (runtime.flat)
    engine.param_align = cfg.expert.param_align_numel or (PARAM_ALIGN_CUDA if engine.is_cuda else 1)
    engine.flat = FlatParams(params, bucket_numel=cfg.expert.bucket_numel, world_size=engine.world_size,
                             groups=group_of, shard_multiple=QBLOCK if cfg.state_dtype == "int8" else 1,
                             align=engine.param_align)
    S = engine.flat.shard_numel
    engine.shard_lo, engine.shard_hi = engine.flat.shard_range(engine.rank)
    engine._names = state_dict_names(model)  # for master_state_dict()
    engine.counters = Counters()
    engine.coll = distributed.Collectives(engine.device, engine.rank, engine.world_size, S) \
        if engine.distributed else None
    # True on every rank if True on every rank, over the ranks that train together (the
    # built-in collectives, or FSDP2's group whose one-rank engines have none of their
    # own), None alone: a choice made from what one rank reads is agreed through it
    engine.agree_ranks = (engine.coll.all_ok if engine.coll is not None
                          else engine.fsdp2.agree() if engine.fsdp2 is not None else None)
    engine._worker_peak = worker_peak_bytes(engine, cfg)  # HELLO's, and the undo log's spare RAM
    # mode="exact": the strategies this engine may use (runtime.exact_mode); the undo
    # log speculation needs is asked for at HELLO, so it is settled here
    engine.picker = None
    engine._undo_log_bytes = 0
    if cfg.mode == "exact":
        engine.picker, engine._undo_log_bytes = exact_strategies(engine, cfg, overlap_ok, auto_overlap)
    return params


def exact_strategies(engine: "OffloadEngine", cfg: OffloadConfig, overlap_ok: bool,
                     auto_overlap: bool) -> tuple[exact_mode.ExactModePicker, int]:
    """mode="exact": the picker over the strategies this engine may use, and the undo
    log to ask the server for (0: no speculation)."""
    x = cfg.expert
    forced = None if x.exact_strategy == "auto" else x.exact_strategy
    if forced is not None and exact_mode.overlaps(forced) and not overlap_ok:
        raise ValueError(f"expert.exact_strategy={forced!r} waits in the model's forward pre-hooks, so it needs "
                         f"the model: pass model=model (OffloadAdamW(..., model=model))")
    # what a whole update overwrites (state and the weights slot): with that much the
    # server updates into a twin of the state instead of logging it (optimizer_server.shard)
    n = engine.flat.shard_numel
    state = bytes_per_param(cfg.optimizer, cfg.state_dtype, cfg.exact_master)
    whole = math.ceil((state + 2) * n) + (1 << 20)
    if forced is not None:
        undo = (x.undo_log_bytes or whole) if exact_mode.speculates(forced) else 0
        return exact_mode.ExactModePicker([forced], forced=forced), undo
    if x.undo_log_bytes is None:
        # spare RAM only: at most half of what the host will have left once the shard
        # holds its state and segment (~6 B/param of slots) and this worker has let go of
        # its copy of the model (worker_frees)
        spare = read_mem_available() + worker_frees(engine) - math.ceil((state + 6) * n) - engine._worker_peak
        undo = whole if 2 * whole <= spare else 0
        if engine.agree_ranks is not None:
            # agreed before use: each rank reads its own MemAvailable (on one node, while the
            # other ranks' servers still allocate), and a rank with speculation among its
            # candidates calls the picker's all-reduce where one without it never does (on
            # FSDP2 the ranks then also pick among the same candidates)
            undo = whole if engine.agree_ranks(undo > 0) else 0
    else:
        undo = x.undo_log_bytes
    order = exact_mode.candidates(world_size=engine.world_size, overlap_ok=overlap_ok and auto_overlap,
                                  speculation_ok=undo > 0)
    agree = None
    if engine.world_size > 1:
        agree = engine.coll.all_reduce_max  # not a closure over the engine: no reference cycle
    return exact_mode.ExactModePicker(order, agree=agree), undo


def worker_peak_bytes(engine: "OffloadEngine", cfg: OffloadConfig) -> int:
    """Host memory this worker takes at its peak beyond what it holds at HELLO (less what
    it frees): what admission must leave it besides the shard (HELLO.worker_peak_bytes).
    The larger of
    - the gradients autograd makes before they go down, in the compute dtype: one
      parameter's at a time (its hook copies it into the gradient slot and drops it), or,
      with grad_accumulation_steps > 1, every trained parameter's, summed into until the
      last micro-batch;
    - (set-up's cast where flat16 is the worker's own, not zero-copy, holds a parameter
      and its place in flat16 together until the parameter is dropped: the largest
      parameter's size in the compute dtype, which its gradient's term already is);
    - a frozen parameter's cast to its 16-bit value (beside the old tensor, the 16-bit
      one and, under fp32 compute, its fp32 copy).
    A GPU worker's gradients and weights are on the device: nothing."""
    if engine.is_cuda:
        return 0
    item = engine.compute_dtype.itemsize
    trained = [s.param.numel() for s in engine.flat.spans]
    largest = max(trained, default=0)
    grads = (sum(trained) if cfg.grad_accumulation_steps > 1 else largest) * item
    widen = item if engine.compute_dtype != engine.dtype else 0  # the 16-bit value cast again, to fp32
    frozen = max((p.numel() * (2 + widen) for p in engine.trained.parameters()
                  if not p.requires_grad and p.is_floating_point() and not p.is_cuda), default=0)
    return max(grads, frozen)


def worker_frees(engine: "OffloadEngine") -> int:
    """Host memory this worker lets go of after INIT (HELLO.frees_bytes): the trained
    parameters held on the CPU (each becomes a view of flat16), less flat16 itself where
    it is the worker's own."""
    frees = sum(s.param.numel() * s.param.element_size() for s in engine.flat.spans if not s.param.is_cuda)
    if not engine.is_cuda and not engine._zero_copy:
        frees = max(0, frees - engine.compute_dtype.itemsize * engine.flat.padded_numel)
    return frees


def connect(engine: "OffloadEngine", cfg: OffloadConfig) -> None:
    """The server (a private one unless the config or the launcher names one), the shard
    (ShardSpec), and the parts that work on it."""
    addr, token = cfg.resolved_server()
    proc = None
    if not addr:
        from zero_offload.server.spawn import spawn
        # exit_when_idle: if this worker is killed, the server drops it after the
        # heartbeat timeout and exits, so no orphan stays behind
        engine._server = spawn(threads=cfg.server.threads, exit_when_idle=True, trace_dir=cfg.resolved_trace_dir())
        addr, token, proc = engine._server.address, engine._server.token, engine._server.proc
    hp = {"lr": float(cfg.lr_at(1)), "beta1": cfg.betas[0], "beta2": cfg.betas[1], "eps": cfg.eps,
          "weight_decay": cfg.weight_decay}
    # what admission counts as freed: at most this shard's fp32 copy (a worker of several
    # ranks frees its whole model's, but the server cannot check a client's world size)
    frees = min(worker_frees(engine), 4 * engine.flat.shard_numel)
    # the shard, described once (protocol.ShardSpec): HELLO carries it, the server's Shard keeps it
    spec = ShardSpec(rank=engine.rank, world_size=engine.world_size, numel=engine.flat.shard_numel, dtype=cfg.dtype,
                     optimizer=cfg.optimizer, hparams=hp, progress_block=cfg.expert.progress_block_numel,
                     weights_slots=2 if engine._zero_copy else 1, grad_slots=engine._grad_slots,
                     staging_numel=cfg.expert.staging_numel, state_dtype=cfg.state_dtype,
                     exact_master=cfg.exact_master, frees_bytes=frees, undo_log_bytes=engine._undo_log_bytes,
                     worker_peak_bytes=engine._worker_peak)
    refused: OptimizerServerError | None = None
    try:
        engine.client = ShardClient(addr, token, spec, request_timeout_s=cfg.server.request_timeout_s,
                                    server_proc=proc)
    except OptimizerServerError as e:
        refused = e
        if e.code == E_RESOURCE and engine.compute_dtype != engine.dtype:
            # the server cannot know why this worker's peak is twice a 16-bit one's
            refused = OptimizerServerError(
                f"{e} (this worker computes in fp32, {engine._compute_why}: expert.compute_dtype="
                f"{cfg.dtype!r} halves its own peak, at the cost of emulated 16-bit matmul on this CPU)",
                code=e.code)
            refused.__cause__ = e
    if engine.agree_ranks is not None and not engine.agree_ranks(refused is None):
        # one rank's refusal is every rank's: the others would wait in the first
        # collective for a rank that is gone (until the process group's timeout)
        if refused is None:
            refused = OptimizerServerError(
                "another rank's optimizer server refused its shard (that rank's error says why; every rank "
                "stops here)", code=E_RESOURCE)
    if refused is not None:
        raise refused
    c = engine.client
    if engine.is_cuda:
        engine._pinned = host_memory.pin(c.segment.buffer, c.segment.size, engine.device,
                                         cfg.expert.pin_host_memory)
    gather = None
    if engine.world_size > 1:
        # the collectives' method, not a closure over the engine (a reference cycle)
        gather = functools.partial(engine.coll.all_gather_weights, tracer=engine.tracer)
    engine.cycle = UpdateCycle(c, engine.flat, dtype=engine.dtype, compute_dtype=engine.compute_dtype,
                               device=engine.device, shard_lo=engine.shard_lo,
                               zero_copy=engine._zero_copy, overlap_weights_up=cfg.expert.overlap_weights_up,
                               tracer=engine.tracer, counters=engine.counters, gather=gather)
    gate = SlotGate(engine.cycle, enabled=engine._grad_slots == 1, tracer=engine.tracer, counters=engine.counters)
    if engine._undo_log_bytes:
        # weakly: the engine owns the speculator, which must not keep it alive (a cycle)
        engine.speculator = Speculator(engine.cycle, weak_method(engine._expected_step), tracer=engine.tracer,
                                       counters=engine.counters)
    engine.grads = GradientsDown(engine.flat, c.grads, dtype=engine.dtype, dtype_name=cfg.dtype,
                                 device=engine.device, rank=engine.rank, world_size=engine.world_size, gate=gate,
                                 on_free=engine.cycle.pump, tracer=engine.tracer, counters=engine.counters,
                                 collectives=engine.coll,
                                 on_ready=engine.speculator.ready if engine.speculator is not None else None,
                                 progress_block=cfg.expert.progress_block_numel, norm_reduce=engine.norm_reduce)


def init_weights(engine: "OffloadEngine") -> None:
    with engine.tracer.span("init_weights"):
        # Host memory peaks here: the user's fp32 model is still alive.  So only
        # this rank's shard goes to the server, straight from the parameters
        # through the staging window, chunk by chunk (no flat fp32 copy of the
        # model), and then each parameter is cast into flat16 and released in
        # turn.  INIT comes first: if it fails the model is untouched.
        c, lo0 = engine.client, engine.shard_lo
        for lo, hi in c.init_chunks():
            engine.flat.copy_fp32_range(torch.from_numpy(c.staging[:hi - lo]), lo0 + lo, lo0 + hi)
            c.init_chunk(lo, hi)
        # which kernels the server's update runs (its CPU's SIMD level, ZERO_OFFLOAD_SIMD
        # there, and its threads) and what its state takes: one round trip at set-up, for stats()
        st = c.stats()
        engine._server_kernels = {"server_simd": st.simd, "server_threads": st.threads,
                                  "server_state_dtype": st.state_dtype, "server_state_bytes": st.state_bytes}
        if engine._zero_copy and engine.cfg.exact_master:
            # the model's slot holds the server's weights, which are also the exact
            # master's high halves: only the server writes them (optimizer_server.state)
            engine.flat.bind(engine.cycle.flat16)
        else:
            # every rank casts the full model itself (identical on all ranks); the
            # server's 16-bit copy of our shard rounds the same way (RNE; the exact
            # master's ties-away rounding differs at exact ties, until the first update)
            engine.flat.cast_and_bind(engine.cycle.flat16, via=engine.dtype)
        engine._bound = True
        # frozen parameters are never sent to the server, but the model computes with
        # them beside the trained ones: the same 16 bits, on the same device
        # (fp32 compute: their 16-bit values, held in fp32; buffers stay fp32)
        with torch.no_grad():
            for p in engine.trained.parameters():
                if not p.requires_grad:
                    if p.is_floating_point():
                        p.data = p.data.to(engine.device, engine.dtype).to(engine.compute_dtype)
                    else:
                        p.data = p.data.to(engine.device)
        for b in engine.trained.buffers():
            b.data = b.data.to(engine.device, engine.compute_dtype if b.is_floating_point() else b.dtype)
        if engine.compute_dtype != engine.dtype and engine.flat.spans:
            # a script's 16-bit inputs (x.to(torch.bfloat16)) meet fp32 weights
            compute_dtype.install_input_cast(engine.trained, engine.dtype, engine.flat.spans[0].param)
    host_memory.return_freed_heap()
