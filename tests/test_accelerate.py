"""Accelerate: a script written for accelerator.prepare / accumulate / backward /
clip_grad_norm_ trains with OffloadAdamW as with torch.optim.AdamW, 1 process and 2
through the launcher (tests/helpers/accelerate_worker.py); preparing the model with
several processes (DDP) is refused naming the fix."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "helpers", "accelerate_worker.py")
STEPS = 8


def run(out, which, nproc):
    cmd = [sys.executable, WORKER, str(out), which, str(STEPS)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", str(nproc), *cmd[1:]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=dict(env, PYTHONPATH=ROOT))


@pytest.mark.parametrize("nproc,which", [(1, "offload"), (2, "offload"), (2, "offload-builtin"),
                                         (2, "offload-prepared")])
def test_accelerate_script_trains_like_torch_adamw(tmp_path, nproc, which):
    """One process, and two on each multi-rank path: the default (expert.multi_rank="auto":
    the library shards the plain model with FSDP2, one unit per block, the root last, and
    the script's accumulation of 2 micro-batches becomes FSDP2's, fsdp2.SyncEveryK) and
    the built-in ZeRO-2: the same bounds against torch AdamW; 16-bit local shards where
    FSDP2 shards.  offload-prepared: the default path with the model prepared too, as a
    plain Accelerate script does (accelerate_prep keeps Accelerate from wrapping FSDP2's
    shards in DDP).  close() removes SyncEveryK's hook (mutation: not removing it fails
    the hook count).  (Mutations: SyncEveryK syncing every micro-batch hands the engine
    two backwards per step, which it refuses; accelerate_prep.install() not called fails
    offload-prepared in DDP's constructor.)"""
    for w in ("torch", which):
        p = run(tmp_path, w, nproc)
        assert p.returncode == 0, p.stdout + p.stderr
    sharded = nproc > 1 and which != "offload-builtin"
    for r in range(nproc):
        a, b = (torch.load(tmp_path / f"{w}-rank{r}.pt") for w in (which, "torch"))
        assert a["shards"] == (["torch.bfloat16"] if sharded else [])
        if sharded:  # close() takes the accumulation's forward hook off the model
            assert a["hooks"][1] == a["hooks"][0] - 1, a["hooks"]
        assert a["world"] == nproc and len(a["losses"]) == STEPS
        assert all(abs(x - y) / y < 1e-3 for x, y in zip(a["losses"], b["losses"])), (a["losses"], b["losses"])
        # accelerator.clip_grad_norm_ returns the true global norm (torch's on the reference)
        assert all(abs(x - y) / y < 1e-2 for x, y in zip(a["norms"], b["norms"])), (a["norms"], b["norms"])
        moved = [float((a["weights"][k] - b["weights"][k]).abs().max()) for k in a["weights"]]
        assert max(moved) < 5e-2  # the weights went where torch's did (16-bit rounding apart)


def test_prepared_model_with_several_processes_is_refused(tmp_path):
    p = run(tmp_path, "offload-ddp", 2)
    assert p.returncode != 0
    said = (tmp_path / "error-rank0.txt").read_text()
    assert "do not wrap the model in DDP" in said and "prepare the optimizer, dataloader and scheduler" in said


def test_accelerator_made_after_the_engine_clips_through_it():
    """Accelerate's clip_grad_norm_ sums the norms of parameters that hold .grad itself
    (1.16 on), so it would return 0 for offloaded ones: the engine routes it, also
    for an Accelerator whose class was not yet patched when the engine was built
    (the next backward patches it).  The norm is torch's on a copy holding .grad."""
    import copy

    from accelerate import Accelerator
    from accelerate import accelerator as acc_mod

    from zero_offload import OffloadAdamW
    from zero_offload import clipping
    from tests.helpers.models import gpt, gpt_batch

    model = gpt()
    ref = copy.deepcopy(model)
    with OffloadAdamW(model.parameters(), lr=1e-3, server={"threads": 1}) as opt:
        # as if accelerate had been imported after the engine was made
        acc_mod.Accelerator.clip_grad_norm_ = clipping._TORCH["accelerate"]
        acc = Accelerator(cpu=True)
        gpt_batch(1, "bf16")(model).backward()
        norm = float(acc.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
    gpt_batch(1, "bf16")(ref.to(torch.bfloat16)).backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
    assert norm > 0 and abs(norm - want) / want < 1e-2, (norm, want)
