"""OffloadAdamW: torch.optim.AdamW's interface over an OffloadEngine.

    model = MyModel()                                   # fp32, as the user built it
    opt = OffloadAdamW(groups_or_params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                       model=model, mode="dpu")         # + any OffloadConfig field
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-4, total_steps=N)
    for x, y in loader:
        loss = model(x, y)                              # 16-bit weights on the device
        loss.backward()                                 # gradients stream to the host
        opt.clip_grad_norm_(1.0)                        # (or torch.nn.utils.clip_grad_norm_)
        opt.step(); sched.step(); opt.zero_grad()
    opt.close()

The fp32 master, m and v live in the optimizer server, which runs the update;
this object holds the param groups torch code reads and writes (schedulers
included): every group's lr, betas, eps and weight_decay go with every step.
Construction casts the parameters to the 16-bit dtype on their device (bf16 by
default; fp16 needs loss scaling a plain loss.backward() does not do, so it is
refused: use bf16, or OffloadEngine with engine.backward).  With model= the
model's frozen parameters and floating buffers are cast too and master_state_dict
uses its names; without it only the given parameters are.

What differs from torch.optim.AdamW, and why:
- Parameters hold no .grad after backward (they went to the host as backward
  produced them).  Clip with clip_grad_norm_ (here, or torch's, which is routed
  here for these parameters: runtime.clipping).
- Gradient accumulation over k backwards per step needs grad_accumulation_steps=k
  (the engine must know which backward is the last to send them down then).
- state_dict() keeps torch.optim's contract: without state_dir it holds the
  state lazily (runtime.optim_state: torch.save copies it into the worker, one
  rank); with state_dir it writes a checkpoint there (any world size, a collective)
  and holds its path.  torch.distributed.checkpoint's get_state_dict is refused
  (it would keep none of the server's state).
- With mode="dpu" the model computes on weights one update old (see OffloadEngine).
- On an FSDP2 (fully_shard) model each rank offloads its own local shards
  (runtime.fsdp2), and save_checkpoint/load_checkpoint use the layout every
  topology shares (runtime.fsdp2_checkpoint).
"""
from __future__ import annotations

import dataclasses
import uuid
import weakref

import torch
import torch.distributed as dist

from . import accelerate_prep, compute_dtype, fsdp2, fsdp2_checkpoint
from .config import MULTI_RANK, OffloadConfig
from .devices import resolve_device
from .dtypes import TORCH_DTYPES
from .engine import OffloadEngine
from .optimizer_proxy import optim_method
from .param_groups import state_dict_names
from .optim_state import FILES_KEY, InMemoryState, load_files, refuse_dcp
from . import torch_state

_TORCH_ONLY = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
STATE_KEY = "zero_offload"   # the key of OffloadAdamW's own entry in state_dict()


class _Params(torch.nn.Module):
    """The parameters an OffloadAdamW was given without model=, as a module the engine owns."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"param{i}", p)


def _close(engine: OffloadEngine, shards, sync) -> None:
    """Land the last update, stop the server; an FSDP2 model's local shards get it too,
    and a model the library wrapped loses the accumulation's forward hook."""
    engine.close()
    if shards is not None:
        shards.copy_back()
        shards.detach()
    if sync is not None:
        sync.handle.remove()


class OffloadAdamW(torch.optim.Optimizer):
    OPTIMIZER = "adamw"  # the server's update (OffloadConfig.optimizer)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, model: torch.nn.Module | None = None,
                 offload: OffloadConfig | None = None, state_dir: str | None = None,
                 foreach=None, fused=None, **options):
        """params, lr, betas, eps, weight_decay: as torch.optim.AdamW (foreach and fused
        are accepted and mean nothing here: the CPU update is one fused pass).
        model: the module the parameters belong to (casts its frozen parameters and
        buffers too; names for master_state_dict).  offload: an OffloadConfig, or its
        fields as keywords (dtype, dpu, clip_grad_norm, grad_accumulation_steps,
        server_threads, ...); the AdamW arguments override its lr, betas, eps,
        weight_decay and optimizer.  state_dir: where state_dict() writes master, m and v."""
        for k, default in _TORCH_ONLY.items():
            if options.get(k, default) != default:
                raise ValueError(f"OffloadAdamW does not implement {k}={options[k]!r} (torch.optim.AdamW's); "
                                 f"leave it at {default}")
            options.pop(k, None)
        self._build(params, dict(lr=lr, betas=tuple(betas), eps=float(eps), weight_decay=float(weight_decay)),
                    model, offload, state_dir, options)

    def _build(self, params, defaults: dict, model, offload, state_dir, options: dict) -> None:
        """The engine for params with the optimizer's own defaults (lr, betas, weight_decay,
        and eps where it has one), which override the offload config's."""
        lr = defaults["lr"]
        if callable(lr) or isinstance(lr, torch.Tensor):
            raise TypeError(f"lr must be a float (drive it with a torch LR scheduler), got {type(lr).__name__}")
        defaults["lr"] = float(lr)
        if offload is not None and options:
            raise TypeError("pass either offload=OffloadConfig(...) or its fields as keywords, not both")
        if offload is None:
            options.setdefault("dtype", "bf16")
            offload = OffloadConfig(**options)
        cfg = dataclasses.replace(offload, optimizer=self.OPTIMIZER, **defaults)
        self._sync = None  # FSDP2's accumulation on a model the library wrapped (fsdp2.SyncEveryK)
        params, cfg = self._library_fsdp2(params, model, cfg)
        super().__init__(params, defaults)
        params_all = [p for g in self.param_groups for p in g["params"]]
        groups = [{k: g[k] for k in ("params", *defaults)} for g in self.param_groups]
        self.state_dir = state_dir
        self._names = None
        self._shards = None  # an FSDP2 model's local shards (runtime.fsdp2)
        norm_reduce = None
        user_model = model
        if any(fsdp2.is_dtensor(p) for p in params_all):
            cfg = self._fsdp2(params_all, groups, model, cfg)
            model, overlap_ok, norm_reduce = self._shards.module, False, self._shards.reduce_sumsq
        else:
            overlap_ok = model is not None  # a forward of the user's model runs the overlap's hooks
            if model is None:
                model = _Params(params_all)
        # auto_overlap=False: torch.optim's contract, the parameters are the new ones after step()
        self.engine = OffloadEngine(model, cfg, param_groups=groups, backward_mode="hooks", overlap_ok=overlap_ok,
                                    auto_overlap=False, norm_reduce=norm_reduce)
        # the engine reads each group's values from these dicts, where schedulers write
        self.engine.optimizer.follow(self.param_groups)
        if self._shards is not None:
            # fp32 shards computed in a 16-bit param_dtype: 16-bit from here on (the
            # master has their fp32 values); the FSDP2 modules are the model's
            if user_model is not None and fsdp2.sixteen_bit_shards(user_model, self.engine.dtype):
                self._shards.refresh()
            self._shards.attach(self.engine)
        self._close = weakref.finalize(self, _close, self.engine, self._shards, self._sync)
        self._instance = uuid.uuid4().hex  # tells this optimizer's own state_dict() apart (no state_dir)
        # one empty entry per parameter: the state is in the server, and torch.optim code
        # that tells "not stepped yet" by an empty opt.state (DCP's get_state_dict, which
        # then runs a step with zero gradients and lr set to 0) must not take it for none
        for p in params_all:
            self.state[p] = {}
        self._constructed = True

    def _library_fsdp2(self, params, model, cfg: OffloadConfig):
        """expert.multi_rank="fsdp2-zero2"/"fsdp2-zero3" with several ranks and a plain model:
        shard it with FSDP2 here (fsdp2.wrap), then take it as a model the user wrapped.
        The parameters given (plain tensors, or param groups of them) are replaced by the
        model's new sharded ones of the same names.  grad_accumulation_steps=k becomes
        FSDP2's own accumulation (fsdp2.SyncEveryK) and the engine sees one backward per
        step.  Returns (params, cfg) to build with."""
        how = cfg.expert.multi_rank
        if how == "auto":  # (config.py) int8 state's checkpoints do not go through FSDP2
            how = "builtin" if cfg.state_dtype == "int8" else "fsdp2-zero2"
        if model is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return params, cfg
        params = list(params)
        given = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        device = resolve_device(cfg.device, given[0].device if given else torch.device("cpu"))
        self._agree_on_path(how, device)
        if how == "builtin" or any(fsdp2.is_dtensor(p) for p in given):
            return params, cfg  # the engine's own collectives, or a model the user wrapped already
        name_of: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            name_of.setdefault(id(p), n)
        missing = [p for p in given if id(p) not in name_of]
        if missing:
            raise ValueError("a parameter of the optimizer is not one of the model's: with expert.multi_rank="
                             f"{how!r} the library shards the model, so pass the model the parameters belong to")
        compute, _ = compute_dtype.resolve(cfg.expert.compute_dtype, cfg.dtype, device)
        # agreed before use: each rank reads its own CPU, and FSDP2's all-gathers need one
        # param_dtype on every rank (fp32 compute if any rank would emulate 16-bit matmul)
        wide = torch.tensor([1 if compute == torch.float32 else 0], dtype=torch.int32,
                            device=fsdp2.collective_device(device.type))
        dist.all_reduce(wide, op=dist.ReduceOp.MAX)
        fsdp2.wrap(model, device=device, param_dtype=None if int(wide.item()) else TORCH_DTYPES[cfg.dtype],
                   reshard_after_forward=how == "fsdp2-zero3")
        new = dict(model.named_parameters(remove_duplicate=False))

        def swap(ps):
            return [new[name_of[id(p)]] for p in ps]
        params = [dict(g, params=swap(g["params"])) if isinstance(g, dict) else new[name_of[id(g)]] for g in params]
        if cfg.grad_accumulation_steps > 1:
            self._sync = fsdp2.SyncEveryK(model, cfg.grad_accumulation_steps)
            cfg = dataclasses.replace(cfg, grad_accumulation_steps=1)
        return params, cfg

    @staticmethod
    def _agree_on_path(how: str, device: torch.device) -> None:
        """The multi-rank path every rank resolved (expert.multi_rank; "auto" reads
        state_dtype), agreed before any rank takes it: ranks on different paths would
        pair unrelated collectives and hang.  One all-reduce of (path, -path) with MAX."""
        code = MULTI_RANK.index(how)
        t = torch.tensor([code, -code], dtype=torch.int32, device=fsdp2.collective_device(device.type))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        fsdp2.released_by_collective_threads(t)
        if int(t[0]) != -int(t[1]):
            raise ValueError(f"the ranks resolved expert.multi_rank to different paths ({MULTI_RANK[-int(t[1])]!r} "
                             f"and {MULTI_RANK[int(t[0])]!r}; this rank {how!r}): give every rank the same "
                             f"offload options (multi_rank, and state_dtype, which 'auto' reads)")

    def _fsdp2(self, params: list, groups: list, model, cfg: OffloadConfig) -> OffloadConfig:
        """An FSDP2 (fully_shard) model: the engine trains proxies of this rank's local shards
        (runtime.fsdp2); `groups` is rewritten onto them.  Returns the config it runs with."""
        if cfg.grad_accumulation_steps != 1:
            raise ValueError(f"grad_accumulation_steps={cfg.grad_accumulation_steps} with an FSDP2 model: accumulate "
                             f"with FSDP2 (model.set_requires_gradient_sync(False) on the micro-batches before the "
                             f"last), so the optimizer sees one backward per step, and leave it at 1")
        if cfg.expert.exact_strategy not in ("auto", "sync", "speculation"):
            raise ValueError(f"expert.exact_strategy={cfg.expert.exact_strategy!r} with an FSDP2 model: FSDP2's "
                             f"all-gather reads the local shards before the forward, so the update cannot run "
                             f"during it; use 'sync' (or mode='dpu')")
        self._shards = fsdp2.LocalShards(params)
        accelerate_prep.install()  # Accelerate's prepare(model) would wrap these shards in DDP
        proxy = self._shards.proxy_of
        for g in groups:  # frozen shards have no proxy: left alone, as torch.optim leaves them
            g["params"] = [proxy[id(p)] for p in g["params"] if id(p) in proxy]
        # every name model.state_dict() gives a parameter (a tied weight has several; the first
        # is its named_parameters() name, master_state_dict()'s key here), for the checkpoint's
        # parameter table, which then reads as the built-in path's
        names = state_dict_names(model) if model is not None else {}
        self._names = {id(p): names.get(id(p)) or [f"param{i}"] for i, p in enumerate(params)}
        # the built-in path's layout of the same parameters (runtime.fsdp2_checkpoint):
        # the model's trainable ones in its order (the optimizer's without model=), by group
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        order = [p for p in (model.parameters() if model is not None else params)
                 if p.requires_grad and id(p) in group_of]
        self._layout = (order, group_of)
        self._flat_map = None
        # the proxies are never computed with (FSDP2 computes on its own all-gathered
        # parameters): they hold the 16-bit weights whatever the CPU's matmul
        return dataclasses.replace(cfg, expert=dataclasses.replace(cfg.expert, compute_dtype=cfg.dtype))

    # ------------------------------------------------------------------ torch.optim API
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_constructed", False):
            raise ValueError(f"{type(self).__name__} lays its parameters out in the optimizer server when it is "
                             f"built: pass every param group to the constructor")
        optim_method("add_param_group")(self, param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """Apply this step's gradients (the last backward's); with closure, call it first
        (with grad enabled) and return its loss, as torch.optim does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.engine.step()
        if self._shards is not None:
            self._shards.copy_back()  # before the next forward's all-gather
        if self._sync is not None:
            self._sync.stepped()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's: every parameter's grad set to None (or zeroed)."""
        optim_method("zero_grad")(self, set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """The global L2 norm of this step's gradients (all ranks) as a tensor, and
        clip them to max_norm in the coming step(); call it after the last backward."""
        return torch.tensor(self.engine.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite))

    def state_dict(self) -> dict:
        """torch.optim's layout: the groups, and under STATE_KEY master, m and v.

        With state_dir: a checkpoint written there now, and its path.  Without: the state
        itself, as torch.optim keeps it, lazily (runtime.optim_state): nothing is copied
        while the dict stays in this process (loading it straight back costs nothing),
        and torch.save (or a deep copy) turns it into the checkpoint's files as uint8 CPU
        tensors, which load_state_dict of a new optimizer on a new model resumes from,
        bitwise.  That copy holds the server's whole state in worker memory (14 B/param
        with fp32 state); state_dir avoids it.  One rank (several: state_dir), or each rank
        of an FSDP2 model (its own shards; it loads at the same world size)."""
        refuse_dcp("OffloadAdamW.state_dict()")
        sd = optim_method("state_dict")(self)
        sd["state"] = {}
        if self.state_dir is not None:
            path = self.save_checkpoint(self.state_dir)
            sd[STATE_KEY] = {"checkpoint": str(path), "instance": self._instance, "iteration": self.engine.iteration}
        else:
            sd[STATE_KEY] = InMemoryState(self, self.engine.iteration)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state_dict() of this optimizer's class: its groups' values, and master,
        m and v (and the device weights as they were) from its checkpoint.  A torch
        optimizer's (torch.optim.AdamW's, a Trainer's optimizer.pt) loads too: its groups'
        values, m, v and step counts, on the master the model had when this optimizer was
        built (runtime.torch_state: load the fp32 weights into the model first)."""
        refuse_dcp("OffloadAdamW.load_state_dict()")
        own = state_dict.get(STATE_KEY) if isinstance(state_dict, dict) else None
        if own is None and not torch_state.is_torch_state_dict(state_dict):
            raise ValueError(f"this state dict is neither an {type(self).__name__}'s nor a torch optimizer's (it has "
                             f"no 'state' and 'param_groups'): pass what opt.state_dict() returned")
        if own is None:
            self._load_torch_state(state_dict, self.state_dir)
            return
        saved = state_dict["param_groups"]
        self._check_group_sizes(saved)
        if isinstance(own, InMemoryState):
            if own.opt is not self or own.iteration != self.engine.iteration:
                load_files(self, own.materialize()[FILES_KEY])  # another optimizer (or step): its files
            # else this optimizer at this step: nothing to restore but the groups' values
        elif own.get(FILES_KEY):
            load_files(self, own[FILES_KEY])
        elif own.get("checkpoint") is not None:
            self.load_checkpoint(own["checkpoint"])
        elif own.get("instance") != self._instance or own.get("iteration") != self.engine.iteration:
            raise ValueError("this state dict holds no master, m and v (an earlier version's, taken without "
                             "state_dir) and restores only into the optimizer it came from at the step it was "
                             f"taken: build {type(self).__name__}(..., state_dir='...') or take it anew")
        self._set_groups(saved)
        if self._shards is not None:
            self._shards.copy_back()  # the loaded device weights into the local shards

    def _check_group_sizes(self, saved: list) -> None:
        if len(saved) != len(self.param_groups) or any(len(a["params"]) != len(b["params"])
                                                       for a, b in zip(saved, self.param_groups)):
            raise ValueError("the state dict's param groups differ from this optimizer's in number or size: "
                             "build the optimizer with the groups it was saved with")

    def _set_groups(self, saved: list) -> None:
        """The saved groups' values into ours (the parameters stay ours)."""
        for g, s in zip(self.param_groups, saved):
            for k, v in s.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v

    MOMENTS = ("exp_avg", "exp_avg_sq")  # a torch optimizer's state of this update, per parameter

    def _load_torch_state(self, state_dict: dict, directory: str | None) -> None:
        """A torch optimizer's state dict (torch.optim.AdamW's, or another with the same
        moments): its m, v and step counts into the server, through a checkpoint in
        directory (None: TMPDIR; several ranks: one every rank sees), and its groups'
        values (runtime.torch_state)."""
        self._check_group_sizes(state_dict["param_groups"])
        torch_state.check_groups(state_dict["param_groups"], self.OPTIMIZER)
        proxy = self._shards.proxy_of if self._shards is not None else None
        states, pairs = state_dict["state"], []
        named = {k for s in state_dict["param_groups"] for k in s["params"]}
        stray = [k for k in states if k not in named]
        if stray:  # they would be dropped: refused, not loaded as zeros
            raise ValueError(f"the state dict holds state for {stray[:4]}{' ...' if len(stray) > 4 else ''}, which "
                             f"its param_groups do not name: not a torch optimizer's state_dict() as it saved it")
        for s, g in zip(state_dict["param_groups"], self.param_groups):
            for key, p in zip(s["params"], g["params"]):
                st = states.get(key)
                if proxy is not None:
                    if id(p) not in proxy:
                        continue  # a frozen shard: no proxy, nothing to load
                    st = _rows_of(st, p)
                    p = proxy[id(p)]
                pairs.append((p, st, f"parameter {key} of the state dict"))
        # FSDP2's ranks (each a one-rank engine) refuse, write and load together
        together = self._shards is not None and self._shards.world > 1
        torch_state.load(self.engine, pairs, self.MOMENTS, directory,
                         agree=fsdp2_checkpoint.Group(self._shards).agree if together else None)
        self._set_groups([torch_state.group_values(s) for s in state_dict["param_groups"]])
        if self._shards is not None:
            self._shards.copy_back()  # the loaded device weights into the local shards

    # ------------------------------------------------------------------ offload API
    def save_checkpoint(self, directory: str, keep: int = 2, background: bool = False) -> str:
        """OffloadEngine.save_checkpoint: directory/step-N with master, m, v, device weights
        (background=True: written while training goes on; wait_checkpoint() publishes it)."""
        if self._shards is not None:  # a collective over FSDP2's group, in the layout every topology reads
            return fsdp2_checkpoint.save(self.engine, self._fsdp2_map(), self._shards, directory, keep,
                                         background=background)
        return self.engine.save_checkpoint(directory, keep=keep, background=background)

    def _fsdp2_map(self) -> "fsdp2_checkpoint.FlatMap":
        if self._flat_map is None:
            sh = self._shards
            self._flat_map = fsdp2_checkpoint.flat_map(self.engine, sh, *self._layout, sh.rank, sh.world, self._names)
        return self._flat_map

    def wait_checkpoint(self) -> str | None:
        """OffloadEngine.wait_checkpoint: publish the background save in flight."""
        return self.engine.wait_checkpoint()

    def load_checkpoint(self, directory: str) -> None:
        """OffloadEngine.load_checkpoint: any checkpoint of this model's optimizer, saved at any
        world size, with FSDP2 or the built-in path (with FSDP2 a collective)."""
        if self._shards is not None:
            fsdp2_checkpoint.load(self.engine, self._fsdp2_map(), directory, self._shards)
            self._shards.copy_back()  # the loaded device weights into the local shards
            return
        self.engine.load_checkpoint(directory)

    def master_state_dict(self, rank0_only: bool = False):
        """The fp32 master weights, keyed like model.state_dict() (with model=).  An FSDP2
        model: whole tensors gathered from every rank's shards (a collective), keyed by
        the model's parameter names (with model=) or param0, param1, ..."""
        if self._shards is None:
            return self.engine.master_state_dict(rank0_only)
        local = list(self.engine.master_state_dict().values())  # the proxies' masters, in order
        return self._shards.gather(self._names, local)

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Land the last update on the device and stop the server (also at garbage collection)."""
        self._close()

    def __enter__(self) -> "OffloadAdamW":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rows_of(st, p: torch.Tensor):
    """A torch optimizer's state entry for FSDP2 parameter `p` as this rank's local shard
    has it: a whole moment (a plain Trainer's optimizer.pt, saved on one process) is cut
    to the rank's rows; a sharded one (DCP's, a DTensor) and the step count stay."""
    if not isinstance(st, dict):
        return st
    return {k: fsdp2.local_rows(v, p) if (k != "step" and isinstance(v, torch.Tensor) and not fsdp2.is_dtensor(v)
                                          and v.dim() > 0 and tuple(v.shape) == tuple(p.shape)) else v
            for k, v in st.items()}
