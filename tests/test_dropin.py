"""What real training code brings: frozen parameters, tied weights, torch.compile's
names, a scheduler that writes betas, a second engine on the same model."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from zero_offload import OffloadConfig, OffloadEngine
from tests.helpers.models import gpt, gpt_batch, train_engine
from tests.helpers.reference import rel_err

pytestmark = pytest.mark.timeout(120)


class Tied(torch.nn.Module):
    """An embedding and an output head sharing one weight (GPT-2's lm_head), plus a
    frozen positional table."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(64, 16)
        self.pos = torch.nn.Embedding(8, 16)
        self.pos.weight.requires_grad_(False)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        logits = self.head(torch.tanh(self.mix(x)))
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), targets.reshape(-1))


def batch(t):
    g = torch.Generator().manual_seed(t)
    idx = torch.randint(0, 64, (4, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def test_frozen_parameters_are_cast_and_kept():
    model = Tied()
    frozen = model.pos.weight.detach().clone()
    with OffloadEngine(model, OffloadConfig(lr=1e-2, dtype="bf16", server={"threads": 1})) as eng:
        # the compute dtype (bf16, or fp32 holding the bf16 values: runtime.compute_dtype)
        assert model.pos.weight.dtype == eng.compute_dtype and not model.pos.weight.requires_grad
        for t in range(1, 4):
            eng.backward(model(*batch(t)))  # no dtype clash between frozen and trained weights
            eng.step()
        assert torch.equal(model.pos.weight, frozen.to(torch.bfloat16).to(eng.compute_dtype))  # never updated
        assert eng.stats()["num_params"] == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_master_state_dict_loads_strictly_into_a_plain_model():
    model = Tied()
    with OffloadEngine(model, OffloadConfig(lr=1e-2, dtype="bf16", server={"threads": 1})) as eng:
        for t in range(1, 3):
            eng.backward(model(*batch(t)))
            eng.step()
        sd = eng.master_state_dict()
    assert "head.weight" in sd and sd["head.weight"] is sd["tok.weight"]  # the tied alias, one tensor
    fresh = Tied()
    missing = set(fresh.state_dict()) - set(sd)
    assert missing == {"pos.weight"}  # the frozen table is not the optimizer's: it is the model's own
    sd["pos.weight"] = fresh.pos.weight.detach()
    fresh.load_state_dict(sd, strict=True)


def test_torch_compile_names_have_no_prefix():
    model = gpt()
    compiled = torch.compile(model, backend="eager")
    with OffloadEngine(compiled, OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1})) as eng:
        train_engine(eng, gpt_batch, 2, "bf16")
        keys = set(eng.master_state_dict())
    assert keys == set(gpt().state_dict()) and not any(k.startswith("_orig_mod.") for k in keys)


def test_a_second_engine_on_an_open_engines_model_is_refused():
    model = gpt()
    first = OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1}))
    try:
        with pytest.raises(ValueError, match="already has an open OffloadEngine.*close"):
            OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1}))
        twin = copy.deepcopy(model)  # a copy is another model
        OffloadEngine(twin, OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1})).close()
    finally:
        first.close()
    with OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1})) as again:
        train_engine(again, gpt_batch, 1, "bf16")  # after close: a new engine takes the model


def test_a_scheduler_that_writes_betas_is_followed(tmp_path):
    model = gpt()
    with OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1})) as eng:
        sched = torch.optim.lr_scheduler.OneCycleLR(eng.optimizer, max_lr=1e-3, total_steps=10)  # cycles beta1
        betas = []
        for t in range(1, 5):
            betas.append(eng.optimizer.param_groups[0]["betas"][0])
            train_engine(eng, gpt_batch, 1, "bf16", start=t)
            sched.step()
        d = eng.save_checkpoint(str(tmp_path))
    man = json.loads(open(f"{d}/shard-r0-of-1.json").read())
    assert len(set(betas)) > 1 and man["hparams"]["beta1"] == pytest.approx(betas[-1])  # the server used them


def test_add_param_group_is_refused_not_ignored():
    with OffloadEngine(gpt(), OffloadConfig(lr=1e-3, dtype="bf16", server={"threads": 1})) as eng:
        with pytest.raises(ValueError, match="param groups it was built with"):
            eng.optimizer.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "lr": 0.0})


class Branchy(torch.nn.Module):
    """`side` gets a gradient on some steps (and, with accumulation, in some
    micro-batches only); `never` is never called."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.side = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32)
        self.never, self.out = torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)

    def forward(self, x, use_side):
        h = torch.tanh(self.inp(x))
        if use_side:
            h = h + torch.tanh(self.side(h))
        return self.out(h)


def branchy_loss(m, t, micro):
    g = torch.Generator().manual_seed(100 * t + micro)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g)
    use_side = t % 3 != 0 and (micro == 0 or t % 2 == 0)  # accumulation 2: odd steps, micro-batch 0 only
    return torch.nn.functional.mse_loss(m(x.to(next(m.parameters()).dtype), use_side).float(), y)


@pytest.mark.parametrize("dpu,accum", [(False, 1), (True, 1), (False, 2)], ids=["sync", "dpu", "accum2"])
def test_parameters_without_gradient_are_left_as_torch_leaves_them(dpu, accum):
    """torch.optim.AdamW skips a parameter whose .grad is None: no decay, no moment
    update, no step count (its bias correction lags).  The engine matches it, fed the
    same 16-bit gradients (teacher forcing), and a never-used layer stays bitwise."""
    model = Branchy()
    ref = copy.deepcopy(model)
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the weights are read between step() and the next forward: sync, not an overlapped update
    cfg = OffloadConfig(lr=1e-2, weight_decay=0.1, dtype="bf16", mode="dpu" if dpu else "exact", server={"threads": 1},
                        expert={"dpu_warmup_steps": 3, "exact_strategy": "auto" if dpu else "sync"},
                        grad_accumulation_steps=accum)
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(list(masters.values()), lr=1e-2, weight_decay=0.1)
    ref.to(torch.bfloat16)
    with OffloadEngine(model, cfg) as eng:
        ref.to(eng.compute_dtype)  # bf16, or fp32 on the bf16 values (runtime.compute_dtype)
        for t in range(1, 13):
            with torch.no_grad():
                for p, q in zip(model.parameters(), ref.parameters()):
                    q.copy_(p)
            for mi in range(accum):
                (branchy_loss(ref, t, mi) / accum).backward()  # the engine divides by accum alike
                eng.backward(branchy_loss(model, t, mi))
            for n, q in ref.named_parameters():
                masters[n].grad = None if q.grad is None else q.grad.bfloat16().float()
                q.grad = None
            opt.step()
            eng.step()
        eng.synchronize()
        got = eng.master_state_dict()
        by_id = {id(s.param): int(c) for s, c in zip(eng.flat.spans, eng.param_updates)}
        steps = {n: by_id[id(p)] for n, p in model.named_parameters()}
    for n in ("never.weight", "never.bias"):
        assert torch.equal(got[n], p0[n]), n          # the fp32 master, bitwise
        assert torch.equal(model.get_parameter(n).bfloat16(), p0[n].to(torch.bfloat16)), n  # the device's weights
    for n in p0:
        if n.startswith("never"):
            continue
        assert rel_err(got[n] - p0[n], masters[n].detach() - p0[n]) < 1e-4, (n, rel_err(got[n] - p0[n],
                                                                                        masters[n].detach() - p0[n]))
        assert steps[n] == opt.state[masters[n]]["step"].item(), n


def test_the_engine_trains_an_fsdp2_model_as_offload_adamw_does(tmp_path):
    """OffloadEngine on a model under torch's fully_shard (FSDP2: DTensor parameters) takes
    it as OffloadAdamW does (runtime.engine_fsdp2: the engine trains the rank's local
    shards): engine.backward and step over 4 steps give bitwise OffloadAdamW's masters
    and local shards on the same model and batches; OffloadAdamW over a mix of DTensors
    and plain tensors is refused naming fully_shard of the whole model.  One rank over
    gloo, the process group taken down after.  (Mutation: Fsdp2Part.copy_back not called
    in step(): the engine's local shards stay at their first values and differ.)"""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zero_offload import OffloadAdamW
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        def build():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
            model.to(torch.bfloat16)
            for layer in (model[0], model[2]):
                fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            fully_shard(model)
            return model

        def train(model, opt, backward, step):
            g = torch.Generator().manual_seed(7)
            for _ in range(4):
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                backward(torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y))
                step()
            return opt.master_state_dict(), [p.detach().to_local().clone() for p in model.parameters()]

        first = [p.detach().to_local().clone() for p in build().parameters()]
        m1 = build()
        with OffloadEngine(m1, lr=1e-2, weight_decay=0.0, dtype="bf16", server={"threads": 1},
                           expert={"exact_strategy": "sync"}) as eng:
            assert eng.fsdp2 is not None and eng.stats()["multi_rank"] == "fsdp2"
            got = train(m1, eng, eng.backward, eng.step)
        m2 = build()
        with OffloadAdamW(m2.parameters(), model=m2, lr=1e-2, weight_decay=0.0, server={"threads": 1},
                          expert={"exact_strategy": "sync"}) as opt:
            want = train(m2, opt, lambda loss: loss.backward(), opt.step)
        assert list(got[0]) == list(want[0]) == [n for n, _ in m1.named_parameters()]
        for k in want[0]:
            assert torch.equal(got[0][k], want[0][k]), k
        for a, b, f in zip(got[1], want[1], first):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b) and not torch.equal(a, f)
        plain = torch.nn.Linear(4, 4)
        with pytest.raises(ValueError, match="some parameters are DTensors.*fully_shard the whole model"):
            OffloadAdamW(list(m2.parameters()) + list(plain.parameters()), lr=1e-3, server={"threads": 1})
    finally:
        dist.destroy_process_group()
