"""runtime.torch_state: a run that trained with torch.optim.AdamW moves onto offload by
loading its optimizer's state_dict() into OffloadAdamW, and goes on as torch would.

The reference is torch itself: the same torch state dict loaded into torch.optim.AdamW
over fp32 masters, fed the offloaded model's 16-bit gradients (teacher forcing), and
the files of the engine's own checkpoint, read back as bytes."""
from __future__ import annotations

import copy
import glob
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from zero_offload import OffloadAdamW, OffloadLion
from tests.helpers.models import gpt, gpt_batch
from tests.helpers.reference import rel_err
from tests.helpers.state_files import shard_arrays
from tests.helpers.teacher import reference_of, teach

pytestmark = pytest.mark.timeout(240)
log = logging.getLogger(__name__)
KW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
SEED = 0  # gpt(SEED): the model's initialisation; the batches are gpt_batch's, seeded by step


def groups(model):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-3}]


def torch_run(steps=5):
    """A model trained `steps` steps by torch.optim.AdamW in fp32: (model, a copy of the
    optimizer's state_dict(), the names of a parameter that never had a gradient and of
    one that had its first two taken away).  So the dict holds a parameter without
    state and per-parameter step counts that differ (torch skips a parameter whose
    .grad is None)."""
    log.info("seed %d", SEED)
    model = gpt(SEED)
    opt = torch.optim.AdamW(groups(model), **KW)
    named = dict(model.named_parameters())
    biases = [n for n, p in named.items() if p.dim() < 2]
    never, late = biases[0], biases[1]
    for t in range(101, 101 + steps):
        gpt_batch(t, "fp32")(model).backward()
        named[never].grad = None
        if t < 103:
            named[late].grad = None
        opt.step()
        opt.zero_grad()
    return model, copy.deepcopy(opt.state_dict()), never, late


@pytest.mark.parametrize("state_dtype,mode", [("fp32", "exact"), ("fp32", "dpu"), ("int8", "exact")])
def test_training_goes_on_as_torch_adamw_would(state_dtype, mode):
    """After load_state_dict of torch AdamW's dict, 10 steps move the masters as torch
    AdamW loaded with the same dict moves its fp32 masters, fed the same 16-bit
    gradients (teacher forcing: under DPU both take the delayed weights' gradients):
    each parameter within 1e-4 of its displacement with fp32 state (measured 2e-7), the whole model within 0.1 with int8 (measured 0.053: the codes' rounding;
    per parameter the q and k biases, whose gradients are ~0, stray to 0.5).  Moments
    not written: 0.8 away; every step count set to the furthest: a norm weight 0.25."""
    model, sd, never, late = torch_run()
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref, masters, ref_groups = reference_of(model, groups)
    ref_opt = torch.optim.AdamW(ref_groups, **KW)
    ref_opt.load_state_dict(sd)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0)
    opt = OffloadAdamW(groups(model), **KW, model=model, state_dtype=state_dtype, mode=mode, server={"threads": 1},
                       expert={"dpu_warmup_steps": 3})
    opt.load_state_dict(sd)
    assert opt.engine.updates == 5 and opt.param_groups[1]["lr"] == 1e-3
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    got, _ = teach(model, opt, sched, ref, masters, ref_opt, ref_sched, 10, 1e9)
    if state_dtype == "fp32":
        for n in p0:
            err = rel_err(got[n] - p0[n], masters[n].detach() - p0[n])
            assert err < 1e-4, (n, err)
    else:  # the whole model: a few elements of 8-bit codes stray (q and k biases, whose gradients are ~0)
        err = rel_err(torch.cat([(got[n] - p0[n]).reshape(-1) for n in p0]),
                      torch.cat([(masters[n].detach() - p0[n]).reshape(-1) for n in p0]))
        assert err < 0.1, err


@pytest.mark.parametrize("cls", [OffloadAdamW, OffloadLion])
def test_the_loaded_state_is_the_dicts_bit_for_bit(tmp_path, cls):
    """fp32 state: the engine's checkpoint after the load holds torch's m and v (Lion:
    lion-pytorch's one exp_avg) in every parameter's place, zeros for the parameter
    without state, the model's fp32 weights as the master, and torch's step counts;
    the update counter stands at the furthest step, so the next checkpoint is step 6."""
    model, sd, never, late = torch_run()
    names = [n for g in groups(model) for n in
             [k for k, p in model.named_parameters() if any(p is q for q in g["params"])]]
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    if cls is OffloadLion:  # lion-pytorch's state: exp_avg only, no step
        sd = {"state": {i: {"exp_avg": s["exp_avg"]} for i, s in sd["state"].items()},
              "param_groups": [{k: v for k, v in g.items() if k != "eps"} for g in sd["param_groups"]]}
    moments = cls.MOMENTS
    opt = cls(groups(model), lr=1e-3, model=model, server={"threads": 1})
    try:
        opt.load_state_dict(sd)
        d = opt.save_checkpoint(str(tmp_path / "ck"))
        arrays = shard_arrays(d)
        rows = {r["names"][0]: r for r in opt.engine._param_rows()}
        for i, n in enumerate(names):
            lo, k = rows[n]["offset"], rows[n]["numel"]
            assert np.array_equal(arrays["r0.master"][lo:lo + k], w[n].reshape(-1).numpy()), n
            for m in moments:
                want = sd["state"][i][m].reshape(-1).numpy() if i in sd["state"] else np.zeros(k, np.float32)
                assert np.array_equal(arrays[f"r0.{m}"][lo:lo + k], want), (n, m)
        if cls is OffloadAdamW:
            steps = {n: int(sd["state"][i]["step"]) if i in sd["state"] else 0 for i, n in enumerate(names)}
            assert steps[never] == 0 and steps[late] == 3 and max(steps.values()) == 5
            got = {n: int(opt.engine.param_updates[i]) for i, n in
                   enumerate(opt.engine._names.get(id(s.param), [None])[0] for s in opt.engine.flat.spans)}
            assert got == steps
            assert opt.engine.updates == 5 and d.endswith("step-00000005")
        gpt_batch(1, "bf16")(model).backward()
        opt.step()  # Lion's dict has no step count: it goes on from update 1
        nxt = "step-00000006" if cls is OffloadAdamW else "step-00000001"
        assert opt.save_checkpoint(str(tmp_path / "ck")).endswith(nxt)
    finally:
        opt.close()


def test_what_cannot_continue_is_refused_and_loses_nothing(tmp_path, monkeypatch):
    """amsgrad, maximize, torch.optim.Adam's L2 decay, another model's shapes, a dict
    with another optimizer's moments: each refused naming the fix, before anything is
    written; the optimizer goes on from the state it had, and no temporary directory
    is left."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    model, sd, _, _ = torch_run(2)
    opt = OffloadAdamW(groups(model), **KW, model=model, server={"threads": 1})
    try:
        opt.load_state_dict(sd)
        before = {n: t.clone() for n, t in opt.master_state_dict().items()}

        def with_groups(**kv):
            return dict(sd, param_groups=[dict(g, **kv) for g in sd["param_groups"]])
        bad = [
            (with_groups(amsgrad=True), "amsgrad"),
            (with_groups(maximize=True), "maximize"),
            (with_groups(decoupled_weight_decay=False), "L2.*optimizer='adam'"),
            (dict(sd, state={**sd["state"], 0: {**sd["state"][0], "max_exp_avg_sq": sd["state"][0]["exp_avg_sq"]}}),
             "max_exp_avg_sq"),
            (dict(sd, state={**sd["state"], 0: {**sd["state"][0], "exp_avg": sd["state"][0]["exp_avg"][:1]}}),
             "shape .* the model the state dict was saved with"),
            (dict(sd, state={i: {"exp_avg": s["exp_avg"], "step": s["step"]} for i, s in sd["state"].items()}),
             r"no \['exp_avg_sq'\]"),
            (dict(sd, state={**sd["state"], 0: {**sd["state"][0], "step": torch.tensor(2.5)}}), "whole number"),
            (dict(sd, state={f"w{i}": s for i, s in sd["state"].items()}), "param_groups do not name"),
        ]
        for d, match in bad:
            with pytest.raises(ValueError, match=match):
                opt.load_state_dict(d)
        assert opt.engine.updates == 2 and opt.param_groups[0].get("amsgrad") is None
        after = opt.master_state_dict()
        assert all(torch.equal(before[n], after[n]) for n in before)
        gpt_batch(3, "bf16")(model).backward()
        opt.step()
        assert opt.engine.updates == 3
    finally:
        opt.close()
    assert not glob.glob(os.path.join(str(tmp_path), "zero-offload-*"))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_worker(out, nproc: int, multi_rank: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "tests", "helpers", "torch_state_worker.py"), str(out), *([multi_rank] if multi_rank else [])]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200,
                       env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(os.path.join(out, "result.pt"))


@pytest.mark.parametrize("multi_rank", ["builtin", None], ids=["builtin", "fsdp2-default"])
def test_several_ranks_load_one_dict_each_into_their_shards(tmp_path, multi_rank):
    """2 ranks, each with the same torch AdamW dict (tests/helpers/torch_state_worker.py),
    on the built-in ZeRO-2 and on the default path (the library's FSDP2 wrapping: each
    rank's local rows of every moment, fsdp2.local_rows): 5 steps later the masters are
    the one-rank run's within 1e-2 of the distance they moved (measured 3e-3: the halves'
    16-bit gradients), with the same step counts (one parameter one behind: it had no
    gradient in torch's first step); the temporary checkpoint is gone.  Built-in: each
    rank writes its shard's range into one checkpoint in state_dir, so without state_dir
    the load is refused on every rank, naming it; FSDP2: each rank's engine is a
    one-rank one with a private temporary, so it loads without.  With a bad dict on rank
    1 alone, rank 0 refuses too (without the agreement rank 0 would train on, or wait in
    a collective, while rank 1 had raised).  (Mutations: each rank writing its moments
    at the flat space's offsets instead of its shard's; under FSDP2, no agreement
    (agree=None) leaves rank 0 without the refusal.)"""
    one, two = launch_worker(tmp_path / "one", 1), launch_worker(tmp_path / "two", 2, multi_rank)
    assert one["updates"] == two["updates"] == 8
    assert one["param_updates"] == two["param_updates"] and sorted(set(one["param_updates"])) == [7, 8]
    assert one["left"] == two["left"] == []
    assert "without_state_dir" not in one
    if multi_rank == "builtin":
        assert "state_dir=" in two["without_state_dir"]
    else:
        assert "without_state_dir" not in two
    assert "another rank refused" in two["one_refused"]  # rank 1's dict was the bad one
    for n, w in one["start"].items():
        err = rel_err(two["master"][n] - w, one["master"][n] - w)
        assert err < 1e-2, (n, err)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_a_run_leaves_offload_with_its_moments(tmp_path, state_dtype):
    """torch AdamW -> OffloadAdamW (load_state_dict) -> its checkpoint -> torch AdamW
    (load_into_torch_optimizer, on a model given the checkpoint's master): with fp32
    state every moment and step count is torch's own, bit for bit, and the next 3 torch
    steps are bitwise those of the run that never left; bf16 and int8 state give the
    moments within their rounding (1e-2 and 0.12 relative, measured 2e-3 and 3e-2: int8's
    codes keep 3 mantissa bits).  The
    parameter that never had a gradient gets no state, as torch leaves it.  (Mutation: a
    moment read from the block's start instead of the parameter's offset fails every
    dtype; step counts all set to the update counter fails the fp32 case.)"""
    from zero_offload.export import master_state_dict_from_checkpoint
    from zero_offload.torch_state import load_into_torch_optimizer
    model, sd, never, late = torch_run()
    w = copy.deepcopy(model.state_dict())
    with OffloadAdamW(groups(model), **KW, model=model, state_dtype=state_dtype, server={"threads": 1}) as opt:
        opt.load_state_dict(sd)
        ck = opt.save_checkpoint(str(tmp_path / "ck"))
    back = gpt(SEED)
    back.load_state_dict(master_state_dict_from_checkpoint(ck))
    assert all(torch.equal(back.state_dict()[n], w[n]) for n in w)  # fp32 weights: the master, exactly
    opt2 = torch.optim.AdamW(groups(back), **KW)
    load_into_torch_optimizer(ck, opt2, back)
    names = {id(p): n for n, p in back.named_parameters()}
    got = {names[id(p)]: s for p, s in opt2.state.items()}
    want = {names[id(p)]: sd["state"][i] for i, p in enumerate(p for g in opt2.param_groups for p in g["params"])
            if i in sd["state"]}
    assert sorted(got) == sorted(want) and never not in got and int(got[late]["step"]) == 3
    tol = {"fp32": 0.0, "bf16": 1e-2, "int8": 0.12}[state_dtype]
    for n, s in want.items():
        assert int(got[n]["step"]) == int(s["step"]), n
        for m in ("exp_avg", "exp_avg_sq"):
            err = rel_err(got[n][m], s[m])
            assert err <= tol, (n, m, err)
    if state_dtype == "fp32":
        model2 = gpt(SEED)  # the run that never left: torch's own dict, loaded by torch
        model2.load_state_dict(w)
        ref = torch.optim.AdamW(groups(model2), **KW)
        ref.load_state_dict(sd)
        for t in range(201, 204):
            for mdl, o in ((model2, ref), (back, opt2)):
                gpt_batch(t, "fp32")(mdl).backward()
                o.step()
                o.zero_grad()
        for n, v in model2.state_dict().items():
            assert torch.equal(back.state_dict()[n], v), n


def test_a_frozen_parameter_in_the_groups_is_left_alone():
    """A parameter frozen (requires_grad=False) but still in the optimizer's groups has no
    state in torch's dict (it never had a gradient), and none here: the load goes on
    with the others; a frozen parameter the dict has state for is refused.  (Mutation:
    refusing every frozen parameter fails the first load.)"""
    model, sd, _, _ = torch_run()
    frozen = model.pos.weight
    frozen.requires_grad_(False)
    i = next(i for i, p in enumerate(p for g in groups(model) for p in g["params"]) if p is frozen)
    sd_frozen = dict(sd, state={k: v for k, v in sd["state"].items() if k != i})
    with OffloadAdamW(groups(model), **KW, model=model, server={"threads": 1}) as opt:
        opt.load_state_dict(sd_frozen)
        assert opt.engine.updates == 5
        with pytest.raises(ValueError, match="frozen here"):
            opt.load_state_dict(sd)
