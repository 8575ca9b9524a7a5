"""An engine on a model sharded by torch's FSDP2 (torch.distributed.fsdp.fully_shard): the
local shards, the library's wrapping and FSDP2's row rule (runtime.engine_fsdp2 is the
part of OffloadEngine that uses them).

FSDP2 already gives each rank its part of every parameter: a DTensor sharded on dim 0
whose local tensor (``p.to_local()``) is the rank's rows, which FSDP2 all-gathers
before a unit's forward and backward, and whose gradient it reduce-scatters after the
unit's backward.  So the optimizer has nothing to shard: each rank offloads its own
local shards, as a one-rank engine would, to the optimizer server.

    model = GPT(cfg).to(torch.bfloat16)          # 16-bit shards on the device
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = OffloadAdamW(model.parameters(), lr=3e-4)   # the one changed line
    loss = model(x).loss; loss.backward(); opt.step(); opt.zero_grad()

How it is wired (LocalShards):
  - the engine trains one plain tensor per parameter, a "proxy" as long as the rank's
    local shard, laid out in its flat space as any model's parameters are;
  - FSDP2 calls each parameter's post-accumulate-grad hook once its reduce-scatter has
    put the rank's gradient shard in ``p.grad``: the hook hands that shard to the
    engine as the proxy's gradient (it goes to the host as any gradient does) and frees
    it;
  - the global gradient norm (clipping, and the overflow check of fp16 loss scaling)
    is the sum of every rank's squares: one scalar all-reduce over FSDP2's group;
  - after each step() (and at close) the proxies' weights, which the engine's update
    cycle has landed, are copied into the local shards in place, before the next
    forward's all-gather (under DPU the schedule is the engine's: the forward after
    step t computes on the weights of update t-1).

Choices (docs/fsdp2.md has the why):
  - gradient accumulation is FSDP2's (``set_requires_gradient_sync(False)`` on the
    micro-batches before the last): the engine sees one backward per step, so
    grad_accumulation_steps must be 1;
  - the exact strategies that wait in the model's forward hooks (overlap_update) are
    not used: FSDP2's own pre-forward all-gather reads the local shards;
  - checkpoints: ``save_checkpoint``/``state_dir`` write the layout every topology
    shares (runtime.fsdp2_checkpoint); each rank's ``opt.state_dict()`` holds its own
    shards' state (same world size and sharding to load it);
  - the device holds the local shards and the proxies (2 B/param/world each with bf16
    shards): on the CPU device the proxies live in the shared segment, so nothing more;
    on a GPU the proxies are a second copy (docs/fsdp2.md);
  - fp32 local shards that FSDP2 computes in a 16-bit param_dtype (torchtitan's recipe)
    are made 16-bit in place once the engine has taken their fp32 values for its master
    (``sixteen_bit_shards``; the engine's FSDP2 part does it where it has the FSDP2 modules).
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from . import host_memory, owners

# torch >= 2.13 renamed all_gather_into_tensor (the old name warns)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch before 2.4 kept it private
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


# where torch defines DTensor (the second before torch 2.4)
DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")


def is_dtensor(p: torch.Tensor) -> bool:
    # No DTensor exists in a process that has not imported its module, and importing it
    # costs ~1.3 s of every engine's start where nothing else does (BENCHMARKS.md)
    if not any(m in sys.modules for m in DTENSOR_MODULES):
        return False
    cls = dtensor_class()
    return cls is not None and isinstance(p, cls)


def check_fsdp2(params: list) -> None:
    """ValueError naming the fix unless every parameter is an FSDP2 shard (a DTensor
    sharded on dim 0 over a 1-D mesh)."""
    if not all(is_dtensor(p) for p in params):
        raise ValueError("some parameters are DTensors (FSDP2) and some are not: fully_shard the whole model "
                         "(each block, then the root), so every parameter is sharded")
    for p in params:
        pl = tuple(p.placements)
        if len(pl) != 1 or not (hasattr(pl[0], "dim") and pl[0].is_shard() and pl[0].dim == 0):
            raise ValueError(f"a parameter is placed {pl}: the engine takes FSDP2's sharding (fully_shard on a "
                             f"1-D mesh: Shard(0)); tensor parallelism and HSDP are not supported")


def collective_device(device_type: str) -> torch.device:
    """Where tensors for a collective over a group of `device_type` (a mesh's, or the
    model's device's) live: that type, the current CUDA device for "cuda" (NCCL takes
    CUDA tensors only)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: a Hugging Face model's `_no_split_modules`
    classes (its transformer blocks), else the children of its largest ModuleList whose
    children are all of one class (a GPT's blocks); [] if it has neither (the root alone
    is then one unit)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
        if found:
            return found
    best: list = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1 and len(m) > len(best):
            best = list(m)
    return best


def wrap(model: torch.nn.Module, *, device: torch.device, param_dtype: torch.dtype | None,
         reshard_after_forward: bool) -> int:
    """A plain model sharded with FSDP2 by the library (expert.multi_rank="fsdp2"): each of
    ``units(model)`` with fully_shard, then the root, over every rank of the default
    process group, with MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32).
    reshard_after_forward=False is ZeRO-2 (the default: the units' parameters stay
    gathered from forward to backward), True ZeRO-3.  The model's fp32 parameters become
    fp32 local shards (the master starts from them; sixteen_bit_shards then makes them
    16-bit); on CUDA FSDP2 moves each rank's rows to the device.  Returns the number of
    units (the root not counted)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    found = units(model)
    for u in found:
        fully_shard(u, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return len(found)


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """[r0, r1): the rows of dim 0 that FSDP2's Shard(0) gives `rank` of `world` (torch.chunk's
    rule: chunks of ceil(rows / world), the last ones shorter or empty)."""
    chunk = -(-rows // world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards `model` (fully_shard on it or a submodule): its state_dict()
    then holds each rank's rows, and gathering it is a collective of every rank.  Asked
    of the modules, not the parameters: between a forward and its reshard (ZeRO-2 keeps
    them gathered after an evaluation's forward) the registered parameters are FSDP2's
    plain unsharded tensors."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = ()
    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(is_dtensor(p) for p in model.parameters())


def full_state_dict(model: torch.nn.Module) -> dict:
    """The whole model's state dict of an FSDP2 model, as a plain one would give it, on
    rank 0 (host tensors); an empty dict on the other ranks.  A collective: every rank
    calls it, and every rank must.  Each sharded tensor is gathered to rank 0 on its own
    with one blocking gather of equal padded pieces (FSDP2's dim-0 chunks: all but the
    last ones ``ceil(rows / world)`` long), so the peak beside the model is one parameter
    gathered on rank 0, plus the host copy rank 0 builds (2 B/param with 16-bit shards:
    what Trainer's save_pretrained writes anyway).  Each gather's buffers are held until
    the backend's threads have let go of them (released_by_collective_threads)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, v in model.state_dict().items():
        if is_dtensor(v):
            v = gather_whole(v.to_local(), tuple(v.shape), v.device_mesh, to_first=True)
        if rank0:
            out[name] = v.detach().to("cpu", copy=True)
    return out


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full: dict) -> None:
    """A whole (plain) state dict, as every rank read it, into an FSDP2 model: each
    sharded tensor takes its rows (local_rows) into its local shard in place, every other
    tensor its value.  A name the dict lacks is fine where a tied tensor of another name
    is in it (save_pretrained drops tied copies); otherwise a ValueError naming them, with
    nothing changed.  No collective."""
    mine = model.state_dict()
    by_tensor: dict[int, list[str]] = {}
    for k, v in mine.items():
        by_tensor.setdefault(id(v), []).append(k)
    missing = [ks[0] for ks in by_tensor.values() if not any(k in full for k in ks)]
    if missing:
        raise ValueError(f"the state dict lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}: not this "
                         f"model's (build the model it was saved from)")
    for ks in by_tensor.values():
        v, src = mine[ks[0]], full[next(k for k in ks if k in full)]
        if is_dtensor(v):
            v.to_local().copy_(local_rows(src, v))
        else:
            v.copy_(src)


def gather_whole(local: torch.Tensor, shape: tuple, mesh, to_first: bool = False) -> torch.Tensor | None:
    """The whole tensor of `shape` whose dim-0 chunks (FSDP2's Shard(0)) the ranks of
    `mesh` hold, `local` this rank's, on every rank: one blocking all-gather of equal
    padded pieces (all chunks but the last ones are ``ceil(rows / world)`` long).
    to_first: on the mesh's first rank only (one gather; the others get None and hold
    no whole copy).  A collective of the mesh's ranks."""
    group, world = mesh.get_group(), mesh.size()
    rows = shape[0] if shape else 0
    per = chunk_rows(rows, world, 0)[1]  # every piece padded to the first (longest) chunk
    piece = local.new_zeros((per, *shape[1:]))
    piece[:local.shape[0]].copy_(local.reshape(-1, *shape[1:]))
    if to_first:
        first = mesh.get_local_rank() == 0
        parts = [local.new_empty(piece.shape) for _ in range(world)] if first else None
        dist.gather(piece, parts, dst=dist.get_global_rank(group, 0), group=group)
        released_by_collective_threads(piece, *(parts or ()))
        return torch.cat(parts)[:rows] if first else None
    whole = local.new_empty((per * world, *shape[1:]))
    _all_gather(whole, piece, group=group)
    released_by_collective_threads(whole, piece)
    return whole[:rows]


def released_by_collective_threads(*tensors: torch.Tensor, bound_s: float = 1.0) -> bool:
    """Wait (at most bound_s) until no collective's work holds `tensors` any more.  A
    gloo work is released on the backend's own thread just after wait() returns, and
    releasing a tensor that has a Python object takes the GIL: if the interpreter is
    exiting by then (a script whose last collective was this one), that thread is
    killed inside a C++ destructor and the process aborts ("terminate called without
    an active exception": 2-4 of 10 runs of a 2-rank Trainer saving at its last step
    here).  Microseconds in practice; True when they were released in time."""
    deadline = time.monotonic() + bound_s
    while any(t._use_count() > 1 for t in tensors):
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-4)
    return True


def local_rows(full: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a whole (unsharded) tensor shaped like `shard`'s parameter:
    FSDP2's dim-0 sharding (chunk_rows), e.g. a plain torch optimizer's moment loaded
    onto FSDP2's local shards.  A ValueError if the rows found are not the local shard's shape (another sharding)."""
    from torch.distributed.tensor import Shard
    if len(shard.placements) != 1 or not isinstance(shard.placements[0], Shard) or shard.placements[0].dim != 0:
        raise ValueError(f"a parameter sharded as {shard.placements}, not FSDP2's Shard(0) over one mesh "
                         f"dimension: a whole tensor cannot be cut into its local rows here")
    if tuple(full.shape) != tuple(shard.shape):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} for a parameter of shape {tuple(shard.shape)}")
    mesh = shard.device_mesh
    r0, r1 = chunk_rows(full.shape[0], mesh.size(), mesh.get_local_rank())
    rows = full[r0:r1]
    local = shard.to_local()
    if tuple(rows.shape) != tuple(local.shape):
        raise ValueError(f"rows {tuple(rows.shape)} of a whole tensor against a local shard of "
                         f"{tuple(local.shape)}: the parameter is not sharded as FSDP2's fully_shard shards")
    return rows


class SyncEveryK:
    """grad_accumulation_steps=k on a model the library wrapped: FSDP2 reduce-scatters the
    gradients only in the backward of every k-th micro-batch (set_requires_gradient_sync,
    FSDP2's own accumulation), counted by the root's forward pre-hook over forwards with
    grad enabled since the last step (an evaluation under no_grad does not count)."""

    def __init__(self, root: torch.nn.Module, k: int):
        self.k, self.n = k, 0
        self.handle = root.register_forward_pre_hook(self._pre)

    def _pre(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.n += 1
            module.set_requires_gradient_sync(self.n % self.k == 0)

    def stepped(self) -> None:
        self.n = 0


def sixteen_bit_shards(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """torchtitan's recipe (an fp32 model before fully_shard, MixedPrecisionPolicy with a
    16-bit param_dtype) leaves fp32 local shards, 4 B/param/world on the device, though
    FSDP2 all-gathers and computes them in the param_dtype and the engine's weights are
    16-bit.  Each trainable fp32 shard of a unit whose param_dtype is `dtype` is made a
    `dtype` shard in place, once: 2 B/param/world, the same values FSDP2 computed with
    (the rounding the all-gather's cast did, now done once), and FSDP2 hands `dtype`
    gradients (reduced in its reduce_dtype, then rounded to nearest as the engine's
    copy into the gradient slot would).  Frozen shards, fp32 compute (no param_dtype) and
    other dtypes are left as they are.

    It goes through what FSDP2 does when nn.Module._apply changes a sharded parameter
    (FSDPParam.reset_sharded_param re-derives its padded shard) and what its lazy init
    does for the dtypes (FSDPParamGroup._init_mp_dtypes); torch.utils.swap_tensors keeps
    each parameter the same Python object, so the optimizer's groups and every reference
    the user holds stay valid.  Returns how many shards it converted (0 where this torch's
    FSDP2 lacks those methods: the shards then stay fp32, as before)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return 0
    DTensor = dtensor_class()
    done = 0
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            if group.mp_policy.param_dtype != dtype or not hasattr(group, "_init_mp_dtypes"):
                continue
            changed = False
            for fp in group.fsdp_params:
                old = fp.sharded_param
                if old.dtype != torch.float32 or not old.requires_grad or not hasattr(fp, "reset_sharded_param"):
                    continue
                rows = old._local_tensor.size(0) if old._local_tensor.dim() else 0
                with torch.no_grad():
                    padded = fp._sharded_param_data.to(dtype)
                    local = padded.view(fp.padded_sharded_param_size).narrow(0, 0, rows)
                    new = torch.nn.Parameter(DTensor.from_local(local, old.device_mesh, old.placements, shape=old.shape,
                                                                stride=old.stride(), run_check=False))
                    torch.utils.swap_tensors(old, new)
                    fp.reset_sharded_param()
                changed = True
                done += 1
            if changed:
                group._init_mp_dtypes()
    return done


def fsdp_params(model: torch.nn.Module) -> dict:
    """id(a sharded parameter) -> FSDP2's FSDPParam for it, over every FSDP2 unit of model."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    out = {}
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            for group in getattr(mod._get_fsdp_state(), "_fsdp_param_groups", None) or []:
                for fp in group.fsdp_params:
                    out[id(fp.sharded_param)] = fp
    return out


def alias_into(p: torch.nn.Parameter, fp, view: torch.Tensor) -> bool:
    """Make FSDP2's local shard of p (FSDPParam fp) the memory of `view` (the engine's
    weights of that shard, on the device), so the engine's copy up of new weights is also
    FSDP2's next all-gather input: one 2 B/param/world copy of the weights on the device
    instead of two (the engine's and FSDP2's), and no copy between them after a step.

    Only where the view is exactly FSDP2's padded shard (its rows divide evenly, or this
    rank's shard is the full padded size) and of its dtype: FSDP2 re-pads any other shard
    into fresh memory.  Done as sixteen_bit_shards does (torch.utils.swap_tensors keeps p
    the same object; FSDPParam.reset_sharded_param re-derives its flat shard, which then
    views `view`).  Returns whether p now views it."""
    DTensor = dtensor_class()
    local = p._local_tensor
    padded = tuple(fp.padded_sharded_param_size)
    if (not hasattr(fp, "reset_sharded_param") or DTensor is None or local.numel() == 0
            or tuple(local.shape) != padded or view.dtype != local.dtype or view.numel() != local.numel()
            or view.device != local.device):
        return False
    with torch.no_grad():
        new = torch.nn.Parameter(DTensor.from_local(view.view(padded), p.device_mesh, p.placements, shape=p.shape,
                                                    stride=p.stride(), run_check=False),
                                 requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, new)
        fp.reset_sharded_param()
    return p._local_tensor.data_ptr() == view.data_ptr() and fp._sharded_param_data.data_ptr() == view.data_ptr()


class _Proxies(torch.nn.Module):
    def __init__(self, proxies: list[torch.nn.Parameter]):
        super().__init__()
        for i, q in enumerate(proxies):
            self.register_parameter(f"shard{i}", q)


class LocalShards:
    """The rank's local shards of an FSDP2 model, as plain tensors an engine trains."""

    def __init__(self, params: list):
        check_fsdp2(params)
        # frozen shards (requires_grad=False) get no gradient and are never touched, as
        # torch.optim leaves them; only the trainable ones get a proxy
        self.frozen = [p for p in params if not p.requires_grad]
        params = [p for p in params if p.requires_grad]
        self.params = params
        self.local = [p.to_local() for p in params]
        # the engine lays these out and rebinds them (its flat space views its own weights);
        # fp32 shards start the master from their fp32 values.  Views of the local shards,
        # not clones: the engine only reads them before it rebinds them, so construction
        # holds no second copy of the shards (2-4 B/param/world more on the device)
        self.proxies = [torch.nn.Parameter(t.detach()) for t in self.local]
        self.proxy_of = {id(p): q for p, q in zip(params, self.proxies)}  # id(a trainable DTensor) -> its proxy
        self.aliased = [False] * len(params)  # the local shard is its proxy's memory (alias)
        self.module = _Proxies(self.proxies)
        self.group = params[0].device_mesh.get_group() if params else None
        # this rank's place in FSDP2's group: where its rows of each parameter lie
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        # the device of FSDP2's collectives (NCCL takes CUDA tensors only): the scalars
        # this module reduces over its group go there
        self.coll_device = collective_device(params[0].device_mesh.device_type) if params else torch.device("cpu")
        self.engine = None
        self._hooks = []

    def attach(self, engine) -> None:
        """Route FSDP2's gradient shards to `engine` (which trains the proxies)."""
        self.engine = engine
        # torch's clip_grad_norm_ on the model's parameters finds the engine (runtime.clipping)
        for p in self.params:
            engine.param_aliases[id(p)] = p
        owners.claim(engine, self.params)
        for p, q in zip(self.params, self.proxies):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(q)))

    def _hook(self, q: torch.nn.Parameter):
        def on_grad(p: torch.Tensor) -> None:
            g = p.grad
            p.grad = None  # FSDP2's sharded gradient is freed once it is on its way to the host
            g = g.to_local() if is_dtensor(g) else g
            # fp32 shards (torchtitan's recipe: fp32 parameters, bf16 param_dtype) get fp32
            # gradients; the proxy is 16-bit, and the gradient goes down in 16 bits anyway:
            # rounded here (to nearest even, as the copy into the slot would round it)
            q.grad = g if g.dtype == q.dtype else g.to(q.dtype)
            self.engine._on_grad(q)
        return on_grad

    def reduce_sumsq(self, sq: torch.Tensor) -> torch.Tensor:
        """The global sum of squares: this rank's plus every other's (FSDP2's group)."""
        if self.world == 1:
            return sq
        v = sq.detach().reshape(1).to(self.coll_device, copy=True)
        dist.all_reduce(v, group=self.group)
        released_by_collective_threads(v)
        return v[0].cpu()

    def refresh(self) -> None:
        """After sixteen_bit_shards: the local shards' new tensors, and the engine's
        weights in them."""
        self.local = [p.to_local() for p in self.params]
        self.copy_back()

    def alias(self, model: torch.nn.Module) -> int:
        """Where the engine's weights are its own device tensor (a GPU, or a CPU without
        zero-copy; each proxy then views it), the local shards become those views
        (alias_into), before any hook is registered on them.  Returns how many did; the
        rest are copied back after each step, as before."""
        fps = fsdp_params(model)
        done = 0
        for i, (p, q) in enumerate(zip(self.params, self.proxies)):
            fp = fps.get(id(p))
            if fp is not None and alias_into(p, fp, q.detach().view(-1)):
                self.aliased[i] = True
                done += 1
        self.local = [p.to_local() for p in self.params]
        return done

    @torch.no_grad()
    def copy_back(self) -> None:
        """The engine's weights into the local shards, in place (FSDP2 all-gathers from
        them); an aliased shard is the engine's weights already."""
        for t, q, same in zip(self.local, self.proxies, self.aliased):
            if not same:
                t.copy_(q.detach().view(t.shape))

    def gather(self, names: dict, local_masters: list[torch.Tensor], rank0_only: bool = False) -> dict:
        """Whole fp32 tensors by name (names: id of an FSDP2 parameter -> its state_dict
        names, of which the first, its named_parameters() name, is the key) from every
        rank's local masters, and the frozen parameters' values in fp32 (a collective
        over FSDP2's group: each rank calls it).  rank0_only: on the group's first rank
        only (one gather per tensor), the others return {} and hold no whole copy, so a
        node holds one fp32 model, not one per rank."""
        keeps = not rank0_only or self.rank == 0
        # the whole model where it is kept
        need = 4 * sum(p.numel() for p in (*self.params, *self.frozen)) if keeps else 0
        ok = torch.tensor([float(host_memory.has_room(need))],
                          device=self.coll_device)
        if self.world > 1:  # one rank's refusal is every rank's
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
            released_by_collective_threads(ok)
        if not float(ok[0]):
            raise host_memory.room_error(need, "master_state_dict() of an FSDP2 model (the whole fp32 model on "
                                         "every rank)", host_memory.MASTER_INSTEAD)
        out = {}
        for p, m in [(p, p.detach().to_local()) for p in self.frozen] + list(zip(self.params, local_masters)):
            whole = gather_whole(m.to(p.device), tuple(p.shape), p.device_mesh, to_first=rank0_only)
            if keeps:
                out[names[id(p)][0]] = whole.float().cpu()
        return out

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.engine = None  # the engine holds reduce_sumsq: no cycle once it is closed
