"""The small models, batches and training loops the engine tests share.

run_pair trains an engine and MixedPrecisionReference side by side (teacher forcing).
"""
from __future__ import annotations

import torch

from zero_offload import OffloadConfig, OffloadEngine
from zero_offload.compute_dtype import resolve as resolve_compute
from zero_offload.demo.gpt import GPT, GPTConfig
from tests.helpers.reference import DT, MixedPrecisionReference


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8))


def gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16))


def mlp_batch(step: int, dtype: str, micro: int = 0, bs: int = 32):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(bs, 16, generator=g)
    y = torch.randn(bs, 8, generator=g)
    def loss(m):  # the input in the model's compute dtype: 16-bit, or fp32 (runtime.compute_dtype)
        p = next(m.parameters())
        return torch.nn.functional.mse_loss(m(x.to(p.device, p.dtype)).float(), y.to(p.device))
    return loss


def gpt_batch(step: int, dtype: str, micro: int = 0, bs: int = 4):
    g = torch.Generator().manual_seed(1000 * step + micro)
    idx = torch.randint(0, 256, (bs, 17), generator=g)

    def loss(m):
        i = idx.to(next(m.parameters()).device)
        return m(i[:, :-1], i[:, 1:])
    return loss


def flat_master(engine) -> torch.Tensor:
    """The fp32 master, each parameter once (a tied weight is one tensor under several names)."""
    uniq = {id(t): t for t in engine.master_state_dict().values()}
    return torch.cat([t.reshape(-1) for t in uniq.values()])


def train_engine(engine, batch, steps, dtype, start=1, accum=1):
    losses = []
    for t in range(start, start + steps):
        for mi in range(accum):
            loss = batch(t, dtype, mi)(engine.model)
            engine.backward(loss)
        losses.append(float(loss.detach()))
        engine.step()
    return losses


def run_pair(make, batch, dtype, steps=30, dpu=None, device="cpu", land_early=False, **hp):
    """Engine and reference side by side.  Each step first checks that the engine's
    16-bit weights are the ones the reference schedule prescribes (up to a rare
    1-ulp rounding flip from fp32 arithmetic order), then the reference takes its
    gradients on the engine's weights (teacher forcing) so the fp32 masters can be
    compared after many steps without chaotic amplification."""
    model = make().to(device)
    p0 = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
    compute, _ = resolve_compute(hp.get("compute", "auto"), dtype, torch.device(device))  # the engine's pick
    ref = MixedPrecisionReference(model, dtype=dtype, lr=hp.get("lr", 3e-3), weight_decay=0.01, dpu_warmup=dpu,
                                  clip=hp.get("clip"), predict=hp.get("predict", 0.0), compute=compute)
    # the weights are read between steps (below), so the strategy is fixed: sync, or
    # overlap_update, whose update is landed before reading
    cfg = OffloadConfig(lr=hp.get("lr", 3e-3), weight_decay=0.01, dtype=dtype, mode="exact" if dpu is None else "dpu",
                        clip_grad_norm=hp.get("clip"), server={"threads": 1},
                        expert=dict(dpu_warmup_steps=dpu or 40, dpu_predict=hp.get("predict", 0.0),
                                    bucket_numel=hp.get("bucket_numel", 1 << 24),
                                    progress_block_numel=hp.get("progress_block", 1 << 20),
                                    pin_host_memory=hp.get("pin", "auto"), cpu_zero_copy=hp.get("zero_copy", True),
                                    staging_numel=hp.get("staging", 0), compute_dtype=hp.get("compute", "auto"),
                                    exact_strategy="auto" if dpu is not None else
                                    "overlap_update" if hp.get("overlap") else "sync"))
    losses, ref_losses = [], []
    with OffloadEngine(model, cfg) as eng:
        params = list(eng.model.parameters())
        for t in range(1, steps + 1):
            if hp.get("overlap"):  # the update lands in the forward's hooks: land it now to read it
                eng.synchronize(copy_weights=True)
            w_eng = [p.detach().clone() for p in params]
            flips = check_weights_match(w_eng, ref.current_weights(), DT[dtype])
            assert flips <= 1e-3, f"step {t}: engine weights are not the schedule's ({flips:.2%} differ)"
            ref_losses.append(ref.step([batch(t, dtype)], force_weights=w_eng)[0])
            losses += train_engine(eng, batch, 1, dtype, start=t)
            if land_early:
                eng.synchronize()  # DONE now; the copy up still waits for backward to free each bucket
        master = flat_master(eng)
        stats = eng.stats()
    return p0, master, ref.master_flat().cpu(), losses, ref_losses, stats


def check_weights_match(a, b, d16) -> float:
    """Fraction of 16-bit weights (d16 values, held in d16 or fp32) that differ; each
    difference must be at most one 16-bit ulp of the larger value (or tiny in absolute
    terms, around zero)."""
    n = diff = 0
    for x, y in zip(a, b):
        assert x.dtype == y.dtype, (x.dtype, y.dtype)
        assert torch.equal(x.to(d16).to(x.dtype), x), "a weight is not a 16-bit value"
        ulp = 2.0 ** -7 if d16 == torch.bfloat16 else 2.0 ** -10
        xf, yf = x.float(), y.float()
        d = (xf - yf).abs()
        bound = torch.maximum(xf.abs(), yf.abs()) * ulp + 1e-6
        assert bool((d <= bound).all()), f"a weight differs by more than one 16-bit ulp: {float(d.max())}"
        diff += int((d > 0).sum())
        n += d.numel()
    return diff / n
