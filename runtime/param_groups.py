"""torch.optim-style param groups read into the flat space's terms, and the names
model.state_dict() gives each parameter."""
from __future__ import annotations

import torch

COMPILE_PREFIX = "_orig_mod."          # what torch.compile's wrapper adds to every name


def index_groups(param_groups, params: list, model: torch.nn.Module) -> tuple[list[int], list[dict]]:
    """(the group of each trainable parameter, each group's options) from torch.optim-style
    param groups, or ValueError naming what is wrong."""
    from .optimizer_proxy import GROUP_KEYS
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)) or not param_groups:
        raise TypeError("param_groups must be a non-empty list of dicts like torch.optim's, "
                        "[{'params': [...], 'weight_decay': 0.0}, ...]")
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = {id(p): i for i, p in enumerate(params)}
    group_of: list[int | None] = [None] * len(params)
    opts = []
    for gi, g in enumerate(param_groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"param_groups[{gi}] must be a dict with a 'params' list")
        extra = set(g) - {"params", *GROUP_KEYS}
        if extra:
            raise ValueError(f"param_groups[{gi}] has {sorted(extra)}; a group may set {list(GROUP_KEYS)}")
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in ps:
            if id(p) not in names:
                raise ValueError(f"param_groups[{gi}] holds a tensor that is not a parameter of the model")
            i = trainable.get(id(p))
            if i is None:
                continue  # frozen: cast and moved, never trained (as torch.optim leaves it without a gradient)
            if group_of[i] is not None:
                raise ValueError(f"parameter {names[id(p)]} is in param groups {group_of[i]} and {gi}; "
                                 f"put each parameter in one group")
            group_of[i] = gi
        opts.append({k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"})
    missing = [names[id(p)] for p, gi in zip(params, group_of) if gi is None]
    if missing:
        raise ValueError(f"trainable parameters in no param group: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                         f"add them to a group or set requires_grad=False")
    used = sorted(set(group_of))
    if used != list(range(len(param_groups))):
        raise ValueError(f"param groups {sorted(set(range(len(param_groups))) - set(used))} hold no trainable "
                         f"parameter; drop them")
    return group_of, opts


def state_dict_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """Every name model.state_dict() gives each parameter (a tied weight has several),
    without torch.compile's prefix: the keys a plain model's load_state_dict expects."""
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, torch.nn.Parameter):
            names.setdefault(id(t), []).append(name.replace(COMPILE_PREFIX, ""))
    return names
