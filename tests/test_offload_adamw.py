"""runtime.OffloadAdamW: a training loop written for torch.optim.AdamW, unchanged but
for the class, against torch.optim.AdamW itself (references written here)."""
from __future__ import annotations


import pytest
import torch

from zero_offload import OffloadAdamW
from tests.helpers.models import gpt, gpt_batch
from tests.helpers.reference import rel_err
from tests.helpers.teacher import reference_of, teach

pytestmark = pytest.mark.timeout(180)


def torch_loop(model, opt, steps, clip=1.0, sched=None):
    """A plain loop for torch.optim: backward, torch's clipping, step, scheduler, zero_grad."""
    losses, norms = [], []
    for t in range(1, steps + 1):
        loss = gpt_batch(t, "bf16")(model)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


def test_unchanged_torch_loop_trains_like_torch_adamw():
    """The same loop with torch.optim.AdamW on the fp32 model and with OffloadAdamW
    (16-bit weights): losses and norms within 16-bit noise (the batches are random
    tokens: the loss stays near ln 256; trajectories part slowly, so norms are compared
    over the first steps)."""
    ref_model, model = gpt(), gpt()
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ref_losses, ref_norms = torch_loop(ref_model, torch.optim.AdamW(ref_model.parameters(), **kw), 25)
    with OffloadAdamW(model.parameters(), **kw, server={"threads": 1}) as opt:
        losses, norms = torch_loop(model, opt, 25)
    assert all(abs(a - b) / b < 3e-3 for a, b in zip(losses, ref_losses)), list(zip(losses, ref_losses))
    assert all(abs(a - b) / b < 2e-2 for a, b in zip(norms[:12], ref_norms)), list(zip(norms, ref_norms))


def nogroups(model):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
def test_matches_torch_adamw_with_clipping_groups_and_onecycle(dpu):
    """Teacher forcing: torch.optim.AdamW over fp32 masters fed the same 16-bit gradients,
    clipped by torch.nn.utils.clip_grad_norm_ (fp32) at a max_norm that fires on every
    step, two groups, OneCycleLR cycling lr and beta1: updates within 1e-4, and the
    norm torch's clip_grad_norm_ returns on the offloaded parameters is the true one."""
    model = gpt()
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref, masters, ref_groups = reference_of(model, nogroups)
    ref_opt = torch.optim.AdamW(ref_groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=3e-3, total_steps=40)
    opt = OffloadAdamW(nogroups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, model=model,
                       mode="dpu" if dpu else "exact", server={"threads": 1}, expert={"dpu_warmup_steps": 3})
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=40)

    def same_betas(t):
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"], t
    got, norms = teach(model, opt, sched, ref, masters, ref_opt, ref_sched, 15, 0.5, same_betas)
    for t, (ref_norm, norm) in enumerate(norms, 1):
        assert ref_norm > 0.5 and abs(norm - ref_norm) / ref_norm < 1e-5, (t, norm, ref_norm)
    for n in p0:
        assert rel_err(got[n] - p0[n], masters[n].detach() - p0[n]) < 1e-4, (n, rel_err(got[n] - p0[n],
                                                                                        masters[n].detach() - p0[n]))


def steps_of(m, o, steps, first, sched=None) -> list[float]:
    """A torch loop's steps first .. first+steps-1 (the test batches); their losses."""
    out = []
    for t in range(first, first + steps):
        loss = gpt_batch(t, "bf16")(m)
        loss.backward()
        o.step()
        if sched is not None:
            sched.step()
        o.zero_grad()
        out.append(float(loss.detach()))
    return out


@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
def test_state_dict_resume_is_bitwise(tmp_path, dpu):
    """torch.save(model.state_dict(), opt.state_dict(), sched.state_dict()); a new process
    (here: new objects) loads them and goes on bitwise like the uninterrupted run."""
    def make():
        m = gpt()
        o = OffloadAdamW(m.parameters(), lr=3e-3, model=m, mode="dpu" if dpu else "exact", server={"threads": 1},
                         expert={"dpu_warmup_steps": 2},
                         state_dir=str(tmp_path / "opt"))
        return m, o, torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))

    def run(m, o, s, steps, first):
        return steps_of(m, o, steps, first, s)

    m, o, s = make()
    with o:
        full = run(m, o, s, 8, 1)
        full_master = o.master_state_dict()
    m, o, s = make()
    with o:
        run(m, o, s, 4, 1)
        torch.save({"model": m.state_dict(), "opt": o.state_dict(), "sched": s.state_dict()}, tmp_path / "ck.pt")
    saved = torch.load(tmp_path / "ck.pt")
    assert saved["opt"]["state"] == {} and "zero_offload" in saved["opt"]
    m, o, s = make()
    with o:
        m.load_state_dict(saved["model"])
        o.load_state_dict(saved["opt"])
        s.load_state_dict(saved["sched"])
        rest = run(m, o, s, 4, 5)
        got = o.master_state_dict()
    assert rest == full[4:]
    for k in got:
        assert torch.equal(got[k], full_master[k]), k


@pytest.mark.parametrize("state_dtype,dpu", [("fp32", False), ("bf16", True), ("int8", False)])
def test_torch_save_of_state_dict_without_state_dir_resumes_bitwise(tmp_path, state_dtype, dpu):
    """torch.optim's contract without state_dir: torch.save(opt.state_dict()), then a new
    model and optimizer load it (torch.load's default weights_only) and go on bitwise like
    the uninterrupted run, in each state dtype (DPU: the pending weights travel too).  The
    dict is lazy: taken and loaded back in-process it copies nothing, and saving it after
    a further step is refused.  (Mutation: leaving out the engine's own files, or the
    server's m, breaks the equality.)"""
    def make():
        m = gpt()
        o = OffloadAdamW(m.parameters(), lr=3e-3, model=m, state_dtype=state_dtype,
                         mode="dpu" if dpu else "exact", server={"threads": 1}, expert={"dpu_warmup_steps": 2})
        return m, o

    def run(m, o, steps, first):
        return steps_of(m, o, steps, first)

    m, o = make()
    with o:
        full = run(m, o, 8, 1)
        full_master = o.master_state_dict()
    m, o = make()
    with o:
        run(m, o, 4, 1)
        sd = o.state_dict()
        o.load_state_dict(sd)  # in-process, same step: a no-op (what Accelerate's prepare() does)
        torch.save({"model": m.state_dict(), "opt": sd}, tmp_path / "ck.pt")
        late = o.state_dict()
        run(m, o, 1, 5)
        with pytest.raises(ValueError, match="state_dir"):
            torch.save(late, tmp_path / "late.pt")
    saved = torch.load(tmp_path / "ck.pt")
    assert saved["opt"]["zero_offload"]["files"], "the state travels as files"
    m, o = make()
    with o:
        m.load_state_dict(saved["model"])
        o.load_state_dict(saved["opt"])
        rest = run(m, o, 4, 5)
        got = o.master_state_dict()
    assert rest == full[4:]
    for k in got:
        assert torch.equal(got[k], full_master[k]), k


def test_closure_accumulation_and_frozen_parameters():
    """step(closure) returns the closure's loss; grad_accumulation_steps=2 sums two
    backwards like torch (one step per two); a frozen embedding (model=) is cast, never moved."""
    model = gpt()
    model.pos.weight.requires_grad_(False)
    frozen = model.pos.weight.detach().clone()
    with OffloadAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, model=model,
                      grad_accumulation_steps=2, server={"threads": 1}) as opt:
        for t in range(1, 4):
            def closure():
                opt.zero_grad()
                total = 0.0
                for mi in range(2):
                    loss = gpt_batch(t, "bf16", mi)(model) / 2
                    loss.backward()
                    total += float(loss.detach())
                return total
            assert isinstance(opt.step(closure), float)
        assert opt.stats()["updates"] == 3
        assert torch.equal(model.pos.weight, frozen.to(torch.bfloat16))


def test_refusals_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="bf16.*OffloadEngine"):
        OffloadAdamW(gpt().parameters(), dtype="fp16")
    with pytest.raises(ValueError, match="amsgrad"):
        OffloadAdamW(gpt().parameters(), amsgrad=True)
    model = gpt()
    with OffloadAdamW(model.parameters(), server={"threads": 1}) as opt:
        with pytest.raises(ValueError, match="already has an open"):
            OffloadAdamW(model.parameters(), server={"threads": 1})
        with pytest.raises(ValueError, match="constructor"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        sd = opt.state_dict()  # without state_dir: only back into this optimizer, at this step
        opt.load_state_dict(sd)
        with pytest.raises(RuntimeError, match="after the last micro-batch's backward"):
            opt.clip_grad_norm_(1.0)
        gpt_batch(1, "bf16")(model).backward()
        with pytest.raises(RuntimeError, match="grad_accumulation_steps"):
            gpt_batch(2, "bf16")(model).backward()
        opt.step()  # the first backward's gradients were kept
        assert opt.stats()["updates"] == 1
        with pytest.raises(ValueError, match="state_dir"):
            opt.load_state_dict(sd)  # a step later: it holds no master, m and v to go back to
        with pytest.raises(ValueError, match="neither an OffloadAdamW's nor a torch optimizer's"):
            opt.load_state_dict({"params": list(range(len(opt.param_groups[0]["params"])))})


START_SCRIPT = """
import sys
import torch
from zero_offload import OffloadAdamW
from zero_offload.optimizer_proxy import optim_method

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
with OffloadAdamW(model.parameters(), lr=1e-3, model=model, server={"threads": 1}) as opt:
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    for t in range(2):
        model(torch.randn(8, 16, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    for p in model.parameters():  # torch.optim's zero_grad on grads the hooks did not take
        p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    sd = opt.state_dict()
    assert sd["param_groups"][0]["lr"] == 0.5e-3, sd["param_groups"]
    heavy = [m for m in ("torch._dynamo", "torch.distributed.tensor") if m in sys.modules]
    assert not heavy, f"imported at start: {heavy}"
    import torch._dynamo  # torch.compile in use: torch.optim's own (wrapped) methods again
    assert optim_method("zero_grad") is torch.optim.Optimizer.zero_grad
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
print("ok")
"""


def test_start_imports_neither_dynamo_nor_dtensor():
    """An OffloadAdamW's start, steps under a scheduler, zero_grad and state_dict import
    neither torch._dynamo (torch.optim's wrapper of add_param_group and zero_grad does, on
    its first call) nor DTensor's module (~2.4 s of every process's start): in a fresh
    process, with torch.optim's semantics kept (grads None, or zeroed; the groups' lr)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", START_SCRIPT], capture_output=True, text=True, timeout=120, cwd=root,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout[-2000:] + r.stderr[-3000:]


def test_an_offload_config_with_only_its_own_fields_works_as_given():
    """OffloadAdamW(..., offload=OffloadConfig(state_dtype="bf16")), as a new user writes it:
    OffloadConfig's dtype defaults to bf16, as OffloadAdamW's does, so it trains (it was
    refused: "dtype='fp16' needs loss scaling", for an fp16 nobody asked for) and the
    server keeps the state dtype the config set.  (Mutation: OffloadConfig's default
    back to fp16: refused at construction.)"""
    from zero_offload import OffloadConfig
    model = gpt()
    with OffloadAdamW(model.parameters(), lr=1e-3, model=model,
                      offload=OffloadConfig(state_dtype="bf16", server={"threads": 1})) as opt:
        for t in range(1, 3):
            gpt_batch(t, "bf16")(model).backward()
            opt.step()
            opt.zero_grad()
        st = opt.stats()
    assert st["server_state_dtype"] == "bf16" and st["updates"] == 2
