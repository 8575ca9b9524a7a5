"""A training worker for the fault tests (tests/faults/).

    python tests/helpers/fault_worker.py MODE CKPT_DIR STEPS [--private]

Trains the test MLP (bf16) through OffloadEngine: on the server named by
ZERO_OFFLOAD_ADDRESS / ZERO_OFFLOAD_TOKEN, or a private one with --private
(its pid is printed).  Saves a checkpoint every 5 steps.  Prints
"STEP n <monotonic>" after each step; on OptimizerServerDeadError prints
"DEAD <monotonic> <message>" and exits 3.  MODE: sync | dpu | resume (load
CKPT_DIR first, then train STEPS more and save the fp32 master to CKPT_DIR/master-<pid>.pt).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from zero_offload import OffloadConfig, OffloadEngine, OptimizerServerDeadError  # noqa: E402
from tests.helpers.dist_worker import global_batch, make_model  # noqa: E402


def main():
    mode, ckpt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    private = "--private" in sys.argv
    if private:  # no address in the environment: the engine starts its own server
        os.environ.pop("ZERO_OFFLOAD_ADDRESS", None)
    model = make_model()
    # resume continues a DPU run; full is that run without the interruption
    cfg = OffloadConfig(lr=3e-3, dtype="bf16", mode="dpu" if mode in ("dpu", "resume", "full") else "exact",
                        server={"threads": 1}, expert={"dpu_warmup_steps": 3})
    try:
        eng = OffloadEngine(model, cfg)
        if private:
            print(f"SERVER {eng._server.pid} {eng.client.address}", flush=True)
        start = 1
        if mode == "resume":
            eng.load_checkpoint(ckpt)
            start = eng.iteration + 1
        for t in range(start, start + steps):
            x, y = global_batch(t)
            loss = torch.nn.functional.mse_loss(model(x.to(eng.compute_dtype)).float(), y)
            eng.backward(loss)
            eng.step()
            if mode in ("sync", "dpu") and t % 5 == 0:
                eng.save_checkpoint(ckpt)
            print(f"STEP {t} {time.monotonic()}", flush=True)
        if mode in ("resume", "full"):
            torch.save({"master": eng.master_state_dict(), "w16": {k: v.clone() for k, v in model.state_dict().items()}},
                       os.path.join(ckpt, f"{mode}-{os.getpid()}.pt"))
        eng.close()
    except OptimizerServerDeadError as e:
        print(f"DEAD {time.monotonic()} {e}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
