"""Param groups as torch.optim has them: each group its own lr and weight decay (and
betas, eps), against torch.optim.AdamW with the same groups over an fp32 master fed the
same 16-bit gradients (teacher forcing: the reference computes on the engine's weights)."""
from __future__ import annotations

import copy

import pytest
import torch

from zero_offload import OffloadConfig, OffloadEngine
from tests.helpers.models import gpt, gpt_batch, train_engine
from tests.helpers.reference import rel_err

pytestmark = pytest.mark.timeout(300)


def nanogpt_groups(model, lr=3e-3):
    """No decay on biases and norms, a second lr (and betas) for the last layers, and a group with lr 0."""
    named = list(model.named_parameters())
    frozen_lr = [p for n, p in named if n.startswith("blocks.0.ln1")]
    head = [p for n, p in named if n.startswith(("ln_f", "blocks.1.out"))]  # a second lr
    rest = [(n, p) for n, p in named if not n.startswith(("ln_f", "blocks.1.out", "blocks.0.ln1"))]
    return [{"params": [p for n, p in rest if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in rest if p.dim() < 2], "weight_decay": 0.0},
            {"params": head, "lr": lr / 3, "weight_decay": 0.1, "betas": (0.8, 0.95)},
            {"params": frozen_lr, "lr": 0.0, "weight_decay": 0.1}]


@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
def test_param_groups_match_torch_adamw(dpu):
    model = gpt()
    ref = copy.deepcopy(model)
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the weights are read between step() and the next forward: sync, not an overlapped update
    cfg = OffloadConfig(lr=3e-3, dtype="bf16", mode="dpu" if dpu else "exact", server={"threads": 1},
                        expert={"dpu_warmup_steps": 3, "bucket_numel": 2048,
                                "exact_strategy": "auto" if dpu else "sync"})
    eng = OffloadEngine(model, cfg, param_groups=nanogpt_groups(model))
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in ref.named_parameters()}
    by_id = {id(p): n for n, p in ref.named_parameters()}
    ref_groups = nanogpt_groups(ref)
    opt = torch.optim.AdamW([dict(g, params=[masters[by_id[id(p)]] for p in g["params"]]) for g in ref_groups],
                            lr=3e-3, betas=(0.9, 0.999), eps=1e-8)
    ref.to(torch.bfloat16).to(eng.compute_dtype)  # bf16, or fp32 on bf16 values (runtime.compute_dtype)
    try:
        assert len(eng.optimizer.param_groups) == 4
        for t in range(1, 31):
            with torch.no_grad():  # the reference computes on the engine's weights
                for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                    q.copy_(p)
            gpt_batch(t, "bf16")(ref).backward()
            for n, q in ref.named_parameters():
                masters[n].grad = q.grad.bfloat16().float()  # the engine's one rounding to 16 bits
                q.grad = None
            opt.step()
            train_engine(eng, gpt_batch, 1, "bf16", start=t)
        eng.synchronize()
        got = eng.master_state_dict()
    finally:
        eng.close()
    fresh = gpt()
    for gi, g in enumerate(nanogpt_groups(fresh)):
        names = [n for n, p in fresh.named_parameters() if any(p is q for q in g["params"])]
        a = torch.cat([(got[n] - p0[n]).reshape(-1) for n in names])
        b = torch.cat([(masters[n].detach() - p0[n]).reshape(-1) for n in names])
        if g.get("lr") == 0.0:
            assert torch.equal(a, torch.zeros_like(a)), "a group with lr 0 moved"
        else:
            assert rel_err(a, b) < 1e-4, (gi, rel_err(a, b))


def test_param_groups_resume_bitwise(tmp_path):
    model = gpt()
    cfg = lambda: OffloadConfig(lr=3e-3, dtype="bf16", mode="dpu", server={"threads": 1},
                                expert={"dpu_warmup_steps": 2})  # noqa: E731
    runs = []
    for stop in (None, 4):
        m = copy.deepcopy(model)
        eng = OffloadEngine(m, cfg(), param_groups=nanogpt_groups(m))
        if stop is None:
            losses = train_engine(eng, gpt_batch, 8, "bf16")
        else:
            losses = train_engine(eng, gpt_batch, stop, "bf16")
            eng.optimizer.param_groups[2]["lr"] = 5e-4  # a scheduler's change: saved with the groups
            eng.save_checkpoint(str(tmp_path))
            eng.close()
            m = copy.deepcopy(model)
            eng = OffloadEngine(m, cfg(), param_groups=nanogpt_groups(m))
            eng.load_checkpoint(str(tmp_path))
            assert eng.optimizer.param_groups[2]["lr"] == 5e-4
            eng.optimizer.param_groups[2]["lr"] = 1e-3
            losses += train_engine(eng, gpt_batch, 4, "bf16", start=5)
        runs.append((losses, torch.cat([v.reshape(-1) for v in eng.master_state_dict().values()])))
        eng.close()
    # the uninterrupted run kept the head's lr at 1e-3 all along: the same as the resumed one
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("groups, msg", [
    (lambda m: [{"params": list(m.parameters())[:-1]}], "in no param group"),
    (lambda m: [{"params": list(m.parameters())}, {"params": list(m.parameters())[:1]}], "in param groups 0 and 1"),
    (lambda m: [{"params": list(m.parameters()), "momentum": 0.9}], "a group may set"),
    (lambda m: {"params": list(m.parameters())}, "non-empty list of dicts"),
])
def test_bad_groups_are_refused_naming_the_fix(groups, msg):
    model = gpt()
    with pytest.raises((ValueError, TypeError), match=msg):
        OffloadEngine(model, OffloadConfig(dtype="bf16", server={"threads": 1}), param_groups=groups(model))


def test_each_group_is_one_range_of_the_flat_space():
    """So a STEP carries one range per group and shard (not one per parameter)."""
    from zero_offload.flat import FlatParams
    model = gpt()
    gs = nanogpt_groups(model)
    params = list(model.parameters())
    index = {id(p): gi for gi, g in enumerate(gs) for p in g["params"]}
    flat = FlatParams(params, bucket_numel=1024, world_size=3, groups=[index[id(p)] for p in params])
    assert sorted(g for g, _, _ in flat.group_ranges) == [0, 1, 2, 3]
    assert [r[1:] for r in flat.group_ranges] == sorted(r[1:] for r in flat.group_ranges)
    for rank in range(3):
        rs = flat.shard_groups(rank)
        assert rs[0][1] == 0 and rs[-1][2] == flat.shard_numel and all(a[2] == b[1] for a, b in zip(rs, rs[1:]))


def test_shard_runs_split_groups_where_step_counts_differ():
    """A parameter without a gradient this step is a range of its own (value 0); its
    neighbours in one group with one count stay one range; every shard is covered."""
    from zero_offload.flat import FlatParams
    model = gpt()
    gs = nanogpt_groups(model)
    params = list(model.parameters())
    index = {id(p): gi for gi, g in enumerate(gs) for p in g["params"]}
    flat = FlatParams(params, bucket_numel=1024, world_size=3, groups=[index[id(p)] for p in params])
    values = [5] * len(flat.spans)
    assert [r[:3] for r in flat.shard_runs(1, values)] == flat.shard_groups(1)  # all alike: the groups
    values[3] = 0
    values[4] = 0  # two neighbours without a gradient
    for rank in range(3):
        runs = flat.shard_runs(rank, values)
        assert runs[0][1] == 0 and runs[-1][2] == flat.shard_numel
        assert all(a[2] == b[1] for a, b in zip(runs, runs[1:]))
        lo0 = flat.shard_range(rank)[0]
        for g, a, b, v in runs:
            spans = [i for i, s in enumerate(flat.spans) if s.offset < b + lo0 and s.offset + s.numel > a + lo0]
            assert {values[i] for i in spans} <= {v} and {index[id(flat.spans[i].param)] for i in spans} <= {g}
    zero = [r for r in flat.shard_runs(0, values) + flat.shard_runs(1, values) + flat.shard_runs(2, values)
            if r[3] == 0]
    s3, s4 = flat.spans[3], flat.spans[4]
    assert sum(b - a for _, a, b, _ in zero) == s3.numel + s4.numel
