"""An OffloadTrainer run in processes of its own, for tests/test_hf_trainer.py: under
zero-offload-launch with several processes (as torchrun would run a Trainer script), or
alone to be killed mid-run.

    python -m zero_offload.launch --nproc-per-node 2 tests/helpers/hf_worker.py OUT --steps 10 --batch 4
    python tests/helpers/hf_worker.py OUT --steps 6 --save-steps 2 --kill-at-save 4

The test module's tiny GPT-2, text and TrainingArguments, with a per-device batch of
BATCH / world (the same global batch as one process with BATCH).  --resume: the
resume_from_checkpoint argument (a path, or "true").  --multi-rank: expert.multi_rank.  --kill-at-save N: SIGKILL this
process in on_save at step N (after Trainer's checkpoint-N is written, before the next
step: a background optimizer save is not yet published).  --best: evaluate at every save,
load_best_model_at_end, the "best" being the highest eval loss (so an earlier checkpoint than
the last is the one loaded).  Rank 0 writes OUT/rank0.json:
the logged (step, loss, grad_norm), the update counter after each step, and the final
weights' sum of squares per parameter, at full precision, as a fingerprint.
"""
import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

from tests.test_hf_trainer import TextWindows, Record, Updates, args, tiny_gpt2  # noqa: E402
from zero_offload import fsdp2  # noqa: E402
from zero_offload.hf import OffloadTrainer  # noqa: E402


class KillAtSave(transformers.TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_save(self, a, state, control, **kw):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--save-steps", type=int, default=5)
    ap.add_argument("--save-total-limit", type=int, default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--kill-at-save", type=int, default=None)
    ap.add_argument("--best", action="store_true",
                    help="evaluate at every save and load the best (highest eval loss) checkpoint's model at the end")
    ap.add_argument("--multi-rank", default=None, help="OffloadConfig.expert.multi_rank (default: the library's)")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rec, upd = Record(), Updates()
    cbs = [rec, upd] + ([KillAtSave(a.kill_at_save)] if a.kill_at_save else [])
    model = tiny_gpt2()
    t = OffloadTrainer(model=model, args=args(a.out, max_steps=a.steps, per_device_train_batch_size=a.batch // world,
                                              save_strategy="steps", save_steps=a.save_steps,
                                              save_total_limit=a.save_total_limit,
                                              **(dict(eval_strategy="steps", eval_steps=a.save_steps,
                                                      load_best_model_at_end=True, metric_for_best_model="loss",
                                                      greater_is_better=True) if a.best else {})),
                       train_dataset=TextWindows(), callbacks=cbs,
                       **(dict(eval_dataset=TextWindows(n=8)) if a.best else {}),
                       offload={"server": {"threads": 1},
                                **({"expert": {"multi_rank": a.multi_rank}} if a.multi_rank else {})})
    t.train(resume_from_checkpoint=True if a.resume == "true" else a.resume)
    # a model FSDP2 shards (the library's wrapping) holds each rank's rows: the whole
    # weights are gathered on every rank (a collective), then fingerprinted on rank 0
    names = [n for n, _ in model.named_parameters()]
    state = fsdp2.full_state_dict(model) if fsdp2.is_sharded(model) else dict(model.named_parameters())
    if t.args.process_index == 0:
        weights = {n: state[n].detach().float().double().square().sum().item() for n in names}
        with open(os.path.join(a.out, "rank0.json"), "w") as f:
            json.dump({"logs": rec.logs, "updates": upd.seen, "world": t.args.world_size, "weights": weights}, f)
    if dist.is_initialized():  # as a torchrun script ends
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
