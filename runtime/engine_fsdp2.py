"""The engine's FSDP2 side: a part OffloadEngine owns when its model is sharded by torch's
FSDP2 (the user's fully_shard, or the library's own on several ranks).

Each rank's engine is then a one-rank engine: it trains plain tensors as long as the
rank's local shards (runtime.fsdp2.LocalShards: the proxies), FSDP2 does every
collective of the model (all-gather, reduce-scatter), and the engine's only ones are
FSDP2-group scalars (the gradient norm, agreements) and its checkpoints' layout
(runtime.fsdp2_checkpoint).

    plain model, several ranks ──shard()──▶ FSDP2 model (ZeRO-2 or ZeRO-3 units)
    FSDP2 model ──Fsdp2Part──▶ proxies ─▶ the engine's flat space ─▶ the server
    step() / load / close ──copy_back──▶ local shards (before the next all-gather)

What every rank decides alike, agreed before use: the path (agree_on_path), FSDP2's
param_dtype (fp32 compute where any rank would emulate 16-bit matmul), and through the
engine's agree_ranks (Fsdp2Part.agree: FSDP2's group) a server's refusal of a rank's
shard and speculation's undo log; no rank has a collective the others lack.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from . import accelerate_prep, compute_dtype, fsdp2, fsdp2_checkpoint
from .config import MULTI_RANK, OffloadConfig
from .devices import resolve_device
from .dtypes import TORCH_DTYPES
from .param_groups import state_dict_names

# the exact strategies that leave the forward alone: FSDP2's own pre-forward all-gather
# reads the local shards, so the update cannot run during the forward
EXACT_OK = ("auto", "sync", "speculation")


def resolve_path(cfg: OffloadConfig) -> str:
    """expert.multi_rank with "auto" resolved: "fsdp2-zero2", but "builtin" for int8 state
    (its scale per 256 elements does not follow FSDP2's rows, so its checkpoints refuse it)
    and for an exact strategy that runs the update during the forward (overlap_update:
    FSDP2's all-gather reads the local shards before the forward)."""
    how = cfg.expert.multi_rank
    if how == "auto":
        how = "builtin" if cfg.state_dtype == "int8" or cfg.expert.exact_strategy not in EXACT_OK else "fsdp2-zero2"
    return how


def several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree_on_path(how: str, device: torch.device) -> None:
    """The multi-rank path every rank resolved, agreed before any rank takes it: ranks on
    different paths would pair unrelated collectives and hang.  One all-reduce of
    (path, -path) with MAX; ranks that differ all raise."""
    code = MULTI_RANK.index(how)
    t = torch.tensor([code, -code], dtype=torch.int32, device=fsdp2.collective_device(device.type))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    fsdp2.released_by_collective_threads(t)
    if int(t[0]) != -int(t[1]):
        raise ValueError(f"the ranks resolved expert.multi_rank to different paths ({MULTI_RANK[-int(t[1])]!r} "
                         f"and {MULTI_RANK[int(t[0])]!r}; this rank {how!r}): give every rank the same "
                         f"offload options (multi_rank, and state_dtype, which 'auto' reads)")


def shard(model: torch.nn.Module, params: list, cfg: OffloadConfig, device: torch.device, how: str):
    """A plain model sharded with FSDP2 by the library (how: "fsdp2-zero2" or "fsdp2-zero3";
    runtime.fsdp2.wrap).  params: the parameters (or torch.optim param groups of them) the
    caller trains, replaced by the model's new sharded ones of the same names.  Returns
    the new params."""
    name_of: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(p), n)
    if any(id(p) not in name_of for p in tensors_of(params)):
        raise ValueError("a parameter to train is not one of the model's: with expert.multi_rank="
                         f"{how!r} the library shards the model, so pass the model the parameters belong to")
    compute, _ = compute_dtype.resolve(cfg.expert.compute_dtype, cfg.dtype, device)
    # agreed before use: each rank reads its own CPU, and FSDP2's all-gathers need one
    # param_dtype on every rank (fp32 compute if any rank would emulate 16-bit matmul)
    wide = torch.tensor([1 if compute == torch.float32 else 0], dtype=torch.int32,
                        device=fsdp2.collective_device(device.type))
    dist.all_reduce(wide, op=dist.ReduceOp.MAX)
    fsdp2.released_by_collective_threads(wide)
    fsdp2.wrap(model, device=device, param_dtype=None if int(wide.item()) else TORCH_DTYPES[cfg.dtype],
               reshard_after_forward=how == "fsdp2-zero3")
    new = dict(model.named_parameters(remove_duplicate=False))

    return [dict(g, params=[new[name_of[id(p)]] for p in group_params(g)]) if isinstance(g, dict)
            else new[name_of[id(g)]] for g in params]


def take(model: torch.nn.Module, cfg: OffloadConfig, param_groups: list | None,
         backward_mode: str) -> "Fsdp2Part | None":
    """OffloadEngine's first decision: the part, where the model is an FSDP2 model or
    becomes one here (several ranks, a plain model, expert.multi_rank resolving to
    "fsdp2-zero2"/"fsdp2-zero3"; the path agreed by every rank first); None for the
    engine's own path (one rank, or "builtin").  param_groups: the engine's, over the
    model's parameters (None: one group of every trainable one)."""
    given = _params_of(model, param_groups)
    if not any(fsdp2.is_dtensor(p) for p in given):
        if not several_ranks():
            return None
        new, sharded = shard_if_asked(model, param_groups if param_groups is not None else given, cfg)
        if not sharded:
            return None
        param_groups = new if param_groups is not None else None
        given = _params_of(model, param_groups)
    return Fsdp2Part(model, given, param_groups, cfg, backward_mode)


def shard_if_asked(model: torch.nn.Module, params: list, cfg: OffloadConfig) -> tuple[list, bool]:
    """Several ranks and a plain model: the path resolved (resolve_path) and agreed by
    every rank (agree_on_path), and for FSDP2's paths the model sharded here (shard).
    params: the parameters to train, or torch.optim param groups of them.  Returns (the
    params, replaced by the sharded ones where it sharded; whether it did)."""
    given = tensors_of(params)
    device = resolve_device(cfg.device, given[0].device if given else torch.device("cpu"))
    how = resolve_path(cfg)
    agree_on_path(how, device)
    if how == "builtin":
        return params, False
    return shard(model, params, cfg, device, how), True


class Fsdp2Part:
    """An FSDP2 model's local shards as the engine's parameters, and what the engine does
    differently for them: the weights copied back into the shards, FSDP2's accumulation
    switch, the shared checkpoint layout, the whole master gathered."""

    def __init__(self, model: torch.nn.Module, params: list, param_groups: list | None, cfg: OffloadConfig,
                 backward_mode: str):
        """model: the FSDP2 model (or a module holding the sharded parameters); params: the
        parameters to train (DTensors: the groups', in their order); param_groups:
        torch.optim's groups over them (None: one group).  backward_mode: the engine's ("hooks": FSDP2's
        accumulation must then be the caller's, so grad_accumulation_steps must be 1)."""
        if backward_mode == "hooks" and cfg.grad_accumulation_steps != 1:
            raise ValueError(f"grad_accumulation_steps={cfg.grad_accumulation_steps} with an FSDP2 model: "
                             f"accumulate with FSDP2 (model.set_requires_gradient_sync(False) on the micro-batches "
                             f"before the last), so the optimizer sees one backward per step, and leave it at 1")
        if cfg.expert.exact_strategy not in EXACT_OK:
            raise ValueError(f"expert.exact_strategy={cfg.expert.exact_strategy!r} with an FSDP2 model: FSDP2's "
                             f"all-gather reads the local shards before the forward, so the update cannot run "
                             f"during it; use 'sync' (or mode='dpu')")
        self.model = model
        self.shards = fsdp2.LocalShards(params)
        accelerate_prep.install()  # Accelerate's prepare(model) would wrap these shards in DDP
        proxy = self.shards.proxy_of
        self.groups = None
        if param_groups is not None:  # frozen shards have no proxy: left alone, as torch.optim leaves them
            self.groups = [dict(g, params=[proxy[id(p)] for p in group_params(g) if id(p) in proxy])
                           for g in param_groups]
        # every name model.state_dict() gives a parameter (a tied weight has several; the
        # first is its named_parameters() name, master_state_dict()'s key), for the
        # checkpoint's parameter table, which then reads as the built-in path's
        names = state_dict_names(model)
        self.names = {id(p): names.get(id(p)) or [f"param{i}"] for i, p in enumerate(params)}
        # the built-in path's layout of the same parameters (runtime.fsdp2_checkpoint):
        # the model's trainable ones in its order, by group
        groups = param_groups if param_groups is not None else [{"params": [p for p in params if p.requires_grad]}]
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in group_params(g)}
        self.layout = ([p for p in model.parameters() if p.requires_grad and id(p) in group_of], group_of)
        self._flat_map = None
        # the proxies are never computed with (FSDP2 computes on its own all-gathered
        # parameters): they hold the 16-bit weights whatever the CPU's matmul
        self.cfg = dataclasses.replace(cfg, expert=dataclasses.replace(cfg.expert, compute_dtype=cfg.dtype))
        self.roots = _fsdp_modules(model)
        self.sync_handle = None  # fsdp2.SyncEveryK's, where the caller made one (closed with the part)

    @property
    def module(self) -> torch.nn.Module:
        """What the engine lays out and trains: the proxies."""
        return self.shards.module

    def attach(self, engine) -> None:
        """Once the engine holds the shards' values (its master started from them): fp32
        shards computed in a 16-bit param_dtype become 16-bit; where the engine's weights
        are a device tensor of its own (not the CPU's zero-copy slots, which alternate),
        the local shards become views of it (LocalShards.alias: 2 B/param/world on the
        device, not 4); and FSDP2's gradient shards go to the engine."""
        if fsdp2.sixteen_bit_shards(self.model, engine.dtype):
            self.shards.refresh()
        if not engine._zero_copy:
            self.shards.alias(self.model)
        self.shards.attach(engine)

    def compute_dtype(self) -> torch.dtype:
        """What FSDP2 computes forward and backward in: its units' param_dtype
        (MixedPrecisionPolicy), else the local shards' own dtype; the inputs a forward
        takes (MixedPrecisionPolicy casts float inputs to the param_dtype, none without it)."""
        for m in self.roots:
            for group in getattr(m._get_fsdp_state(), "_fsdp_param_groups", None) or []:
                if group.mp_policy.param_dtype is not None:
                    return group.mp_policy.param_dtype
        return self.shards.params[0].dtype if self.shards.params else TORCH_DTYPES[self.cfg.dtype]

    def before_backward(self, final: bool) -> None:
        """engine.backward of a micro-batch: FSDP2 reduce-scatters only on the step's last
        (its own accumulation), so each gradient shard reaches the engine once a step."""
        for m in self.roots:
            m.set_requires_gradient_sync(final, recurse=False)

    def copy_back(self) -> None:
        self.shards.copy_back()

    def flat_map(self, engine) -> "fsdp2_checkpoint.FlatMap":
        if self._flat_map is None:
            sh = self.shards
            self._flat_map = fsdp2_checkpoint.flat_map(engine, sh, *self.layout, sh.rank, sh.world, self.names)
        return self._flat_map

    def save(self, engine, directory: str, keep: int, background: bool) -> str:
        """A collective over FSDP2's group, in the layout every topology reads."""
        return fsdp2_checkpoint.save(engine, self.flat_map(engine), self.shards, directory, keep, background=background)

    def load(self, engine, directory: str) -> None:
        fsdp2_checkpoint.load(engine, self.flat_map(engine), directory, self.shards)
        self.copy_back()  # the loaded device weights into the local shards

    def gather_master(self, local: list[torch.Tensor], rank0_only: bool) -> dict:
        """Whole fp32 tensors by the model's names, in its order (as model.state_dict()
        orders them), from every rank's local masters (a collective; rank0_only: on the
        first rank of FSDP2's group only, {} on the others)."""
        out = self.shards.gather(self.names, local, rank0_only)
        at = {n: i for i, (n, _) in enumerate(self.model.named_parameters())}
        return {k: out[k] for k in sorted(out, key=lambda k: at.get(k, len(at)))}

    def agree(self):
        """FSDP2's group's all-ranks-ok (fsdp2_checkpoint.Group.agree), or None on one rank."""
        return fsdp2_checkpoint.Group(self.shards).agree if self.shards.world > 1 else None

    def close(self) -> None:
        """The last weights into the local shards; FSDP2's hooks no longer reach the engine."""
        self.copy_back()
        self.shards.detach()
        if self.sync_handle is not None:
            self.sync_handle.remove()
            self.sync_handle = None


def group_params(group: dict) -> list:
    """A torch.optim param group's tensors: its "params" is a list of them, or one tensor
    (torch.optim takes both; iterating a bare tensor would give its rows)."""
    ps = group["params"]
    return [ps] if isinstance(ps, torch.Tensor) else list(ps)


def tensors_of(params: list) -> list:
    """The tensors of a list of tensors or of torch.optim param groups."""
    out = []
    for g in params:
        out.extend(group_params(g) if isinstance(g, dict) else [g])
    return out


def _params_of(model: torch.nn.Module, param_groups: list | None) -> list:
    if not (isinstance(param_groups, (list, tuple))
            and all(isinstance(g, dict) and "params" in g for g in param_groups)):
        return list(model.parameters())  # (malformed groups: index_groups refuses them, naming the fix)
    return tensors_of(param_groups)


def _fsdp_modules(model: torch.nn.Module) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]
