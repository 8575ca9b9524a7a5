"""One rank of the checkpoint-across-topologies test, run under zero-offload-launch.

    python -m zero_offload.launch --nproc-per-node N tests/helpers/fsdp2_ckpt_worker.py ROOT TOPOLOGY ACTION \
        [then TOPOLOGY ACTION ...]

Stages joined by "then" run one after another in the same processes (a launch of 2
ranks costs ~10 s on 2 cores; the ranks' process group is the same for every stage).
TOPOLOGY: "fsdp2" (fully_shard on each block and the root, bf16 shards) or "builtin"
(the plain bf16 model; with several ranks the engine's own ZeRO-2).  The model, the
text and the optimizer's groups are tests/helpers/fsdp2_worker's.  For each VARIANT
(below), in ROOT/VARIANT/:
  train A     train STEPS_A steps, save_checkpoint(A) (the masters then, gathered, in
              at_save.pt), train STEPS_B more: the uninterrupted run (its losses
              after the save and final masters in whole.pt)
  relay A B   load_checkpoint(A), then save_checkpoint(B) at once
  resume A    load_checkpoint(A), train the STEPS_B steps: resumed.pt as whole.pt
  corrupt A   (the first variant only) rank 0 flips a byte near the end of A's shard
              file, in the last rank's share of the load's checksum reading; every rank
              loads A and writes what happened to corrupt-rRANK.txt; the byte is put back
  killed A B  (the first variant) a blocking save into A, a background one into B, then
              steps until the test SIGKILLs the server (killed_stage)
  background A B   (the first two variants) a blocking save into A and a background one
              into B at the same step, training on while B is written (background_stage)
  refuse A    (the first variant only) rank 1's session with the node's optimizer server
              is closed just before the load, so its load fails after the shared checks,
              at its server's LOAD; every rank writes what happened to refuse-rRANK.txt
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.fsdp2_worker import CLIP, LR, ROWS, groups, make_model, text_rows  # noqa: E402

STEPS_A, STEPS_B = 5, 3
# (name, mode, state dtype): DPU leaves a landed update the device does not have yet (pending16)
# "fp32shards": the FSDP2 model is left fp32 before fully_shard (torchtitan's recipe: bf16
# param_dtype), the built-in path's is bf16 as always; one layout holds either
VARIANTS = [("sync-fp32", "exact", "fp32"), ("dpu-bf16", "dpu", "bf16"), ("dpu-bf16-fp32shards", "dpu", "bf16")]


class Scaled(torch.nn.Module):
    """The GPT-2 with its loss times one parameter of a single row: FSDP2 gives that row
    to rank 0 alone, so every other rank holds an empty local shard of it (an empty
    proxy and no piece in the checkpoint)."""

    def __init__(self):
        super().__init__()
        self.gpt = make_model()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.gpt(input_ids=x, labels=x).loss * self.scale


def build(topology: str, mode: str, state_dtype: str, fp32_shards: bool = False):
    from zero_offload import OffloadAdamW
    model = Scaled()
    if not (fp32_shards and topology == "fsdp2"):
        model = model.to(torch.bfloat16)
    if topology == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.gpt.transformer.h:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    kw = dict(mode="dpu", expert={"dpu_warmup_steps": 2}) if mode == "dpu" else {}
    opt = OffloadAdamW(groups(model), lr=LR, betas=(0.9, 0.99), weight_decay=0.1, model=model,
                       server={"threads": 1}, state_dtype=state_dtype, **kw)
    return model, opt


def train(model, opt, first: int, n: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = ROWS // world
    losses = []
    for t in range(first, first + n):
        x = text_rows(t)[rank * per:(rank + 1) * per]
        loss = model(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        lt = loss.detach().float().reshape(1)
        dist.all_reduce(lt)
        losses.append(float(lt) / world)
    return losses


def corrupt_stage(root: str, topology: str, name: str) -> None:
    from zero_offload.server import checkpoint as C
    d = os.path.join(root, VARIANTS[0][0])
    path = C.rank_file(C.resolve(os.path.join(d, name)), C.SHARD, 0, 1, ".bin")
    at = path.stat().st_size - 5
    if dist.get_rank() == 0:
        with open(path, "r+b") as f:
            f.seek(at)
            old = f.read(1)
            f.seek(at)
            f.write(bytes([old[0] ^ 0x40]))
    dist.barrier()
    load_and_record(d, topology, name, "corrupt")
    dist.barrier()
    if dist.get_rank() == 0:
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(old)


def refuse_stage(root: str, topology: str, name: str) -> None:
    def close_rank1s_session(opt):
        if dist.get_rank() == 1:
            opt.engine.client.close()  # BYE: the server drops this rank's shard
    load_and_record(os.path.join(root, VARIANTS[0][0]), topology, name, "refuse", before=close_rank1s_session)


def load_and_record(d: str, topology: str, name: str, tag: str, before=None) -> None:
    """The first variant's optimizer loads d/name; what happened ("loaded", or the error's
    type and message) goes to d/TAG-rRANK.txt for the test to read."""
    model, opt = build(topology, VARIANTS[0][1], VARIANTS[0][2])
    if before is not None:
        before(opt)
    try:
        opt.load_checkpoint(os.path.join(d, name))
        what = "loaded"
    except Exception as e:  # noqa: BLE001 - the test reads what each rank saw
        what = f"{type(e).__name__}: {e}"
    opt.close()
    with open(os.path.join(d, f"{tag}-r{dist.get_rank()}.txt"), "w") as f:
        f.write(what)


def background_stage(root: str, topology: str, blocking: str, background: str) -> None:
    """The first two variants (fp32 and bf16 state): STEPS_A steps, a blocking save into
    d/blocking, a background save of the same state into d/background (the server paced
    by the test, so it is still writing when save_checkpoint returns: each rank records
    its server's save state then), STEPS_B steps while it writes, wait_checkpoint; the
    run's losses and master go to d/bg.pt, for the test to hold against the chain's
    train stage (the same steps with no background save)."""
    for name, mode, state_dtype in VARIANTS[:2]:
        d = os.path.join(root, name)
        model, opt = build(topology, mode, state_dtype)
        train(model, opt, 1, STEPS_A)
        opt.save_checkpoint(os.path.join(d, blocking))
        where = opt.save_checkpoint(os.path.join(d, background), background=True)
        state = opt.engine.client.save_status()["state"]
        published = os.path.exists(where)
        out = {"losses": train(model, opt, STEPS_A + 1, STEPS_B)}
        done = opt.wait_checkpoint()
        out["master"] = opt.master_state_dict()
        opt.close()
        with open(os.path.join(d, f"bg-r{dist.get_rank()}.txt"), "w") as f:
            f.write(f"{state} {published} {done == where}")
        if dist.get_rank() == 0:
            torch.save(out, os.path.join(d, "bg.pt"))


def killed_stage(root: str, topology: str, first: str, second: str) -> None:
    """The first variant: STEPS_A steps, a blocking save into root/first, then a background
    save into root/second (the server paced by the test, so it is still writing), then
    steps until the test kills the server: this process should end with the server's
    death named, not hang."""
    name, mode, state_dtype = VARIANTS[0]
    model, opt = build(topology, mode, state_dtype)
    train(model, opt, 1, STEPS_A)
    opt.save_checkpoint(os.path.join(root, first))
    opt.save_checkpoint(os.path.join(root, second), background=True)
    if dist.get_rank() == 0:
        open(os.path.join(root, "saving"), "w").close()  # the test's sign to kill
    train(model, opt, STEPS_A + 1, 100000)


def run_stage(root: str, topology: str, action: list[str]) -> None:
    if action[0] == "killed":
        return killed_stage(root, topology, action[1], action[2])
    if action[0] == "background":
        return background_stage(root, topology, action[1], action[2])
    if action[0] == "corrupt":
        return corrupt_stage(root, topology, action[1])
    if action[0] == "refuse":
        return refuse_stage(root, topology, action[1])
    for name, mode, state_dtype in VARIANTS:
        d = os.path.join(root, name)
        model, opt = build(topology, mode, state_dtype, "fp32shards" in name)
        if action[0] == "train":
            train(model, opt, 1, STEPS_A)
            opt.save_checkpoint(os.path.join(d, action[1]))
            at_save = opt.master_state_dict()  # what the checkpoint's master must hold, by name
            if dist.get_rank() == 0:
                torch.save(at_save, os.path.join(d, "at_save.pt"))
            out = {"losses": train(model, opt, STEPS_A + 1, STEPS_B)}
            out["master"] = opt.master_state_dict()
            out["shard_dtypes"] = sorted({str(getattr(p, "to_local", lambda: p)().dtype) for p in model.parameters()})
            path = "whole.pt"
        else:
            opt.load_checkpoint(os.path.join(d, action[1]))
            if action[0] == "relay":
                opt.save_checkpoint(os.path.join(d, action[2]))
                out, path = None, None
            else:
                out = {"losses": train(model, opt, STEPS_A + 1, STEPS_B)}
                out["master"] = opt.master_state_dict()
                path = "resumed.pt"
        opt.close()
        if out is not None and dist.get_rank() == 0:
            torch.save(out, os.path.join(d, path))


def main():
    root, stages = sys.argv[1], " ".join(sys.argv[2:]).split(" then ")
    dist.init_process_group("gloo")
    for stage in stages:
        topology, *action = stage.split()
        run_stage(root, topology, action)
        dist.barrier()  # the stage's checkpoint is complete on every rank before the next reads it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
