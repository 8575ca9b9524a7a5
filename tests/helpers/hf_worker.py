"""One rank of the several-process OffloadTrainer test, run under zero-offload-launch
(as torchrun would run a Trainer script):

    python -m zero_offload.launch --nproc-per-node 2 tests/helpers/hf_worker.py OUT STEPS BATCH [RESUME]

tests/test_hf_trainer.py's tiny GPT-2, text and TrainingArguments, with a per-device batch of
BATCH / world (the same global batch as one process with BATCH), save_steps=5, and
resume_from_checkpoint=RESUME if given.  Rank 0 writes OUT/rank0.json: the logged
(step, loss, grad_norm) and the update counter after each step.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.test_hf_trainer import TextWindows, Record, Updates, args, tiny_gpt2  # noqa: E402
from zero_offload.hf import OffloadTrainer  # noqa: E402


def main():
    out, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rec, upd = Record(), Updates()
    t = OffloadTrainer(model=tiny_gpt2(), args=args(out, max_steps=steps, per_device_train_batch_size=batch // world,
                                                    save_strategy="steps", save_steps=5),
                       train_dataset=TextWindows(), callbacks=[rec, upd], offload={"server": {"threads": 1}})
    t.train(resume_from_checkpoint=resume)
    if t.args.process_index == 0:
        with open(os.path.join(out, "rank0.json"), "w") as f:
            json.dump({"logs": rec.logs, "updates": upd.seen, "world": t.args.world_size}, f)


if __name__ == "__main__":
    main()
