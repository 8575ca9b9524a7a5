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

from . import engine_fsdp2, fsdp2
from .config import OffloadConfig
from .engine import OffloadEngine
from .optimizer_proxy import optim_method
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
        # a forward of the user's model runs the overlap's hooks (FSDP2: the engine's part refuses them)
        overlap_ok = model is not None
        if model is None:
            model = _Params(params_all)
        # auto_overlap=False: torch.optim's contract, the parameters are the new ones after step()
        self.engine = OffloadEngine(model, cfg, param_groups=groups, backward_mode="hooks", overlap_ok=overlap_ok,
                                    auto_overlap=False)
        # the engine reads each group's values from these dicts, where schedulers write
        self.engine.optimizer.follow(self.param_groups)
        if self._sync is not None and self.engine.fsdp2 is not None:
            self.engine.fsdp2.sync_handle, self._sync.handle = self._sync.handle, None  # closed with the engine
        self._close = weakref.finalize(self, self.engine.close)
        self._instance = uuid.uuid4().hex  # tells this optimizer's own state_dict() apart (no state_dir)
        # one empty entry per parameter: the state is in the server, and torch.optim code
        # that tells "not stepped yet" by an empty opt.state (DCP's get_state_dict, which
        # then runs a step with zero gradients and lr set to 0) must not take it for none
        for p in params_all:
            self.state[p] = {}
        self._constructed = True

    @property
    def _shards(self):
        """An FSDP2 model's local shards (runtime.fsdp2.LocalShards), or None."""
        return self.engine.fsdp2.shards if self.engine.fsdp2 is not None else None

    def _library_fsdp2(self, params, model, cfg: OffloadConfig):
        """expert.multi_rank="fsdp2-zero2"/"fsdp2-zero3" (or "auto") with several ranks and a
        plain model: shard it with FSDP2 here (runtime.engine_fsdp2.shard), before the param
        groups are made, so they hold the model's new sharded parameters; the engine then
        takes it as a model the user wrapped.  grad_accumulation_steps=k becomes FSDP2's own
        accumulation (fsdp2.SyncEveryK) and the engine sees one backward per step.  Without
        model= the engine's own collectives ("builtin").  Returns (params, cfg) to build with."""
        if not engine_fsdp2.several_ranks():
            return params, cfg
        if model is None:  # nothing to shard: the engine agrees on "builtin" with the other ranks
            return params, dataclasses.replace(cfg, expert=dataclasses.replace(cfg.expert, multi_rank="builtin"))
        params = list(params)
        if any(fsdp2.is_dtensor(p) for p in engine_fsdp2.tensors_of(params)):
            return params, cfg  # a model the user wrapped already: the engine takes it
        params, sharded = engine_fsdp2.shard_if_asked(model, params, cfg)
        if not sharded:  # the built-in path (its engine agrees once more, as every engine on it does)
            return params, cfg
        if cfg.grad_accumulation_steps > 1:
            self._sync = fsdp2.SyncEveryK(model, cfg.grad_accumulation_steps)
            cfg = dataclasses.replace(cfg, grad_accumulation_steps=1)
        return params, cfg

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
        self.engine.step()  # (FSDP2: the new weights are in the local shards before the next all-gather)
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
        torch_state.load(self.engine, pairs, self.MOMENTS, directory,
                         agree=self.engine.fsdp2.agree() if self.engine.fsdp2 is not None else None)
        self._set_groups([torch_state.group_values(s) for s in state_dict["param_groups"]])

    # ------------------------------------------------------------------ offload API
    def save_checkpoint(self, directory: str, keep: int = 2, background: bool = False) -> str:
        """OffloadEngine.save_checkpoint: directory/step-N with master, m, v, device weights
        (background=True: written while training goes on; wait_checkpoint() publishes it;
        FSDP2: a collective, in the layout every topology reads)."""
        return self.engine.save_checkpoint(directory, keep=keep, background=background)

    def wait_checkpoint(self) -> str | None:
        """OffloadEngine.wait_checkpoint: publish the background save in flight."""
        return self.engine.wait_checkpoint()

    def load_checkpoint(self, directory: str) -> None:
        """OffloadEngine.load_checkpoint: any checkpoint of this model's optimizer, saved at any
        world size, with FSDP2 or the built-in path (with FSDP2 a collective)."""
        self.engine.load_checkpoint(directory)

    def master_state_dict(self, rank0_only: bool = False):
        """The fp32 master weights, keyed like model.state_dict() (with model=).  An FSDP2
        model: whole tensors gathered from every rank's shards (a collective), keyed by
        the model's parameter names (with model=) or param0, param1, ..."""
        return self.engine.master_state_dict(rank0_only)

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
