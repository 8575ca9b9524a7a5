"""One rank of the FSDP2 tests, run under zero-offload-launch (one optimizer server per node).

    python -m zero_offload.launch --nproc-per-node 2 tests/helpers/fsdp2_worker.py OUT MODES STEPS

A tiny GPT-2 from its config (no download), fully_shard on each block and on the root,
trained on real text (this interpreter's json, logging and os sources as bytes), each
rank its own rows of a fixed global batch.  MODES: ","-joined runs in turn in one launch,
each "+"-joined options:
  ref      the reference: torch.optim.AdamW over fp32 masters of the local shards fed the
           same gradients (Reference); else OffloadAdamW (the changed line)
  dpu      DPU from step DPU_WARMUP (mode="dpu"; the reference follows the same schedule)
  zero2    reshard_after_forward=False (FSDP2's ZeRO-2); else True (ZeRO-3)
  frozen   the position embedding frozen (requires_grad=False), still in the optimizer's groups
  accum    two micro-batches a step, FSDP2's accumulation (set_requires_gradient_sync)
  sync, speculation   mode "exact" with that strategy forced (else the engine picks)
  statedir OffloadAdamW(..., state_dir=...): state_dict() holds a checkpoint's path
  resume   halfway, torch.save each rank's model and optimizer state dicts, build a new
           model and optimizer, load them and go on (torch.optim's contract)
  fromtorch  torch.optim.AdamW on the FSDP2 model itself for the first half, then
           OffloadAdamW on the same model loads its state_dict() and goes on
  dcpdict  (with fromtorch) the dict is DCP's get_optimizer_state_dict (keyed by name)
  shadow   beside the offloaded run, teacher-forced torch AdamW fed its gradients (Shadow)
  libwrap  the model left plain: OffloadAdamW shards it (expert.multi_rank "fsdp2-zero3", with
           zero2 "fsdp2-zero2")
  mixedcpu rank 1 reads a CPU without native bf16 matmul (it alone would compute in fp32)
  nozerocopy expert.cpu_zero_copy=False: the engine's weights a tensor of its own (as on a
           GPU), which the local shards then view
The model is cast to bf16 before fully_shard (16-bit local shards) with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32).
Both use two param groups (weight decay 0.1 on matrices, 0 on the rest) and clip at CLIP.
Writes OUT/MODE/rank{r}.pt: losses, the final masters (fp32, gathered: full tensors by
name), the local shards' dtype and numel, and the offload stats.
"""
import io
import json
import logging
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SEED = 20261203
CLIP = 0.5
LR = 1e-3
ROWS, SEQ = 12, 32  # the global batch; each rank takes ROWS / world of it (2 or 3 ranks)
DPU_WARMUP = 3


def text_rows(step: int) -> torch.Tensor:
    data = b"".join(open(m.__file__, "rb").read() for m in (json, logging, os))
    g = torch.Generator().manual_seed(SEED + step)
    starts = torch.randint(0, len(data) - SEQ - 1, (ROWS,), generator=g)
    return torch.tensor([list(data[s:s + SEQ]) for s in starts.tolist()], dtype=torch.long)


def make_model():
    import transformers
    torch.manual_seed(SEED)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def main():
    out, modes, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    for mode in modes.split(","):
        run(out, mode, steps)
    dist.destroy_process_group()


def build(opts: set, out: str = ""):
    """The model, fully_shard on each block and the root, and its optimizer."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = make_model()
    if "fp32shards" not in opts:  # torchtitan's recipe keeps fp32 shards, bf16 compute (param_dtype)
        model = model.to(torch.bfloat16)  # cast before fully_shard: the device keeps 16-bit shards
    if "frozen" in opts:
        model.transformer.wpe.weight.requires_grad_(False)  # torch.optim leaves it: no gradient, no decay
    # fp32compute (with fp32shards): FSDP2 computes in the shards' fp32, as on a CPU without
    # native bf16 matmul one would
    mp = MixedPrecisionPolicy(param_dtype=None if "fp32compute" in opts else torch.bfloat16,
                              reduce_dtype=torch.float32)
    reshard = "zero2" not in opts
    if "libwrap" not in opts:  # libwrap: OffloadAdamW shards the plain model itself (expert.multi_rank)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
    dpu = "dpu" in opts
    if "ref" in opts:
        return model, Reference(model, dpu)
    if "shadow" in opts:  # its hooks first: they see each gradient shard before the engine's take it
        model.shadow = Shadow(model)
    if "fromtorch" in opts:  # torch.optim.AdamW on the model itself until the switch
        return model, torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.99), weight_decay=0.1)
    return model, offload(model, opts, out)


def offload(model, opts: set, out: str):
    """OffloadAdamW on the FSDP2 model, with the options `opts` name."""
    dpu = "dpu" in opts
    from zero_offload import OffloadAdamW
    kw = dict(mode="dpu", expert={"dpu_warmup_steps": DPU_WARMUP}) if dpu else {}
    for strategy in ("sync", "speculation"):  # mode "exact" with its strategy forced
        if strategy in opts:
            kw["expert"] = {"exact_strategy": strategy}
    if "libwrap" in opts:
        kw.setdefault("expert", {})["multi_rank"] = "fsdp2-zero2" if "zero2" in opts else "fsdp2-zero3"
        if "fp32compute" in opts:  # asked for: the library then wraps with no param_dtype
            kw["expert"]["compute_dtype"] = "fp32"
    if "nozerocopy" in opts:  # the engine's weights a tensor of its own, as on a GPU: the local shards view it
        kw.setdefault("expert", {})["cpu_zero_copy"] = False
    if "statedir" in opts:  # state_dict() writes the state there (a checkpoint, a collective)
        kw["state_dir"] = os.path.join(out, "+".join(sorted(opts)) + "-state")
    return OffloadAdamW(groups(model), lr=LR, betas=(0.9, 0.99), weight_decay=0.1, model=model,
                        server={"threads": 1}, **kw)


def run(out: str, mode: str, steps: int) -> None:
    opts = set(mode.split("+"))
    rank, world = dist.get_rank(), dist.get_world_size()
    if "mixedcpu" in opts and rank == 1:  # this rank alone sees a CPU that emulates 16-bit matmul
        from zero_offload import compute_dtype
        compute_dtype.cpu_flags = lambda: set()
        compute_dtype.isa_cap = lambda: None
    model, opt = build(opts, out)
    per = ROWS // world
    losses, norms = [], []
    for t in range(1, steps + 1):
        if "resume" in opts and t == steps // 2 + 1:
            # torch.optim's contract, per rank: torch.save the state dicts, then a new
            # model and a new optimizer load them and go on
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            opt.close()
            del model, opt
            model, opt = build(opts, out)
            buf.seek(0)
            sd = torch.load(buf)  # torch.load's default, weights_only
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["opt"])
        if "fromtorch" in opts and t == steps // 2 + 1:
            # a run moving onto offload: torch AdamW's state dict (DTensor moments, each
            # rank its own) loaded into OffloadAdamW on the same model (runtime.torch_state)
            if "dcpdict" in opts:  # DCP's form of it (torchtitan's checkpoints): keyed by parameter name
                from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
                sd = get_optimizer_state_dict(model, opt)
            else:
                sd = opt.state_dict()
            del opt
            opt = offload(model, opts, out)
            opt.load_state_dict(sd)
        x = text_rows(t)[rank * per:(rank + 1) * per]
        if "accum" in opts:
            # FSDP2's accumulation: no reduce-scatter until the last micro-batch
            half = per // 2
            model.set_requires_gradient_sync(False)
            (model(input_ids=x[:half], labels=x[:half]).loss / 2).backward()
            model.set_requires_gradient_sync(True)
            loss = model(input_ids=x[half:], labels=x[half:]).loss / 2
        else:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        if "shadow" in opts:
            model.shadow.step(norms[-1])
        opt.zero_grad()
        lt = loss.detach().float().reshape(1)
        dist.all_reduce(lt)
        losses.append(float(lt) / world)
    res = {"losses": losses, "norms": norms,
           "local": {n: (str(p.to_local().dtype), p.to_local().numel()) for n, p in model.named_parameters()}}
    if "ref" in opts:
        res["master"] = opt.master_state_dict()
    else:
        res["stats"] = opt.stats()
        flat16 = opt.engine.flat16  # how many local shards are the engine's weights' memory
        lo, hi = flat16.data_ptr(), flat16.data_ptr() + flat16.numel() * flat16.element_size()
        res["in_flat16"] = sum(lo <= p.to_local().data_ptr() < hi for p in model.parameters() if p.requires_grad)
        res["master"] = opt.master_state_dict()  # a collective: whole tensors from every rank's shards
        if "shadow" in opts:
            res["shadow"] = model.shadow.master_state_dict()
        opt.close()  # the last update lands in the local shards
    os.makedirs(os.path.join(out, mode), exist_ok=True)
    torch.save(res, os.path.join(out, mode, f"rank{rank}.pt"))


class Reference:
    """FSDP2 with torch.optim.AdamW over fp32 masters of the local shards, fed the same
    16-bit gradient shards the offload run gets (FSDP2 reduces in fp32 and hands the
    bf16 shard's gradient); the local shards get the masters' bf16 values after each
    step.  dpu: the engine's schedule: from step DPU_WARMUP on, the device gets the
    master of one update before (the forward of step t computes on M_(t-2))."""

    def __init__(self, model, dpu: bool):
        self.params = list(model.parameters())
        self.master = {id(p): p.to_local().detach().float().clone().requires_grad_(True) for p in self.params}
        gs = [{**g, "params": [self.master[id(p)] for p in g["params"]]} for g in groups(model)]
        self.opt = torch.optim.AdamW(gs, lr=LR, betas=(0.9, 0.99), weight_decay=0.1)
        self.dpu, self.t = dpu, 0
        self.names = {id(p): n for n, p in model.named_parameters()}

    @torch.no_grad()
    def step(self):
        self.t += 1
        for p in self.params:
            self.master[id(p)].grad = p.grad.to_local().float() if p.grad is not None else None
        before = [m.clone() for m in self.master.values()] if self.dpu and self.t >= DPU_WARMUP else None
        self.opt.step()
        src = before if before is not None else list(self.master.values())
        for p, m in zip(self.params, src):
            p.to_local().copy_(m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def master_state_dict(self) -> dict:
        from torch.distributed.tensor import DTensor
        out = {}
        for p in self.params:
            d = DTensor.from_local(self.master[id(p)].detach(), p.device_mesh, p.placements, shape=p.shape,
                                   stride=p.stride(), run_check=False)
            out[self.names[id(p)]] = d.full_tensor()
        return out


class Shadow(Reference):
    """Teacher forcing on FSDP2: torch.optim.AdamW over fp32 copies of the local shards,
    fed each step the gradient shard the offloaded run's engine gets (caught by a
    post-accumulate-grad hook registered before OffloadAdamW's, which frees it; in the
    engine's bf16, as its proxy holds it) times torch's clip coefficient of the global
    norm that clip_grad_norm_ returned.  Its masters never reach the model, so they
    differ from the offloaded run's only by the order of fp32 arithmetic: a bound on
    that difference sees every term of the update (weight decay is ~1% of it here)."""

    def __init__(self, model):
        super().__init__(model, dpu=False)
        self.grads = {}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._take)

    def _take(self, p):
        self.grads[id(p)] = p.grad.to_local().to(torch.bfloat16).float()

    @torch.no_grad()
    def step(self, norm: float):
        coef = min(1.0, CLIP / (norm + 1e-6))
        for p in self.params:
            g = self.grads.pop(id(p), None)
            self.master[id(p)].grad = None if g is None else g * coef
        self.opt.step()


if __name__ == "__main__":
    main()
