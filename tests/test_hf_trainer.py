"""runtime.hf.OffloadTrainer against transformers.Trainer with its default AdamW: a
tiny GPT-2 built from its config (no download) on real text (this interpreter's
stdlib source, as bytes), the same TrainingArguments for both."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import safetensors.torch  # noqa: E402  (a dependency of transformers)

from tests.helpers import procs  # noqa: E402
from zero_offload.hf import OffloadTrainer  # noqa: E402

pytestmark = pytest.mark.timeout(300)
log = logging.getLogger(__name__)
SEED = 1234  # Trainer's seed and data_seed (model init and sampling)


class TextWindows(torch.utils.data.Dataset):
    """Fixed 33-byte windows of real text: input_ids and labels (the model shifts them)."""

    def __init__(self, n=256, seq=32):
        data = b"".join(open(m.__file__, "rb").read() for m in (json, logging, os))
        stride = (len(data) - seq - 1) // n
        self.rows = [torch.tensor(list(data[i * stride:i * stride + seq]), dtype=torch.long) for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def tiny_gpt2():
    torch.manual_seed(SEED)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


class Record(transformers.TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.logs.append((state.global_step, logs["loss"], logs.get("grad_norm")))


def args(out, **over):
    kw = dict(output_dir=str(out), max_steps=30, per_device_train_batch_size=4, gradient_accumulation_steps=2,
              learning_rate=3e-3, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=5,
              logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=SEED, data_seed=SEED,
              bf16=True, dataloader_num_workers=0, disable_tqdm=True)
    kw.update(over)
    return transformers.TrainingArguments(**kw)


def run(cls, out, resume=None, offload=None, evaluate_first=False, **over):
    model = tiny_gpt2()
    rec = Record()
    extra = {"offload": {"server": {"threads": 1}, **(offload or {})}} if cls is OffloadTrainer else {}
    if evaluate_first:
        extra["eval_dataset"] = TextWindows(n=8)
    t = cls(model=model, args=args(out, **over), train_dataset=TextWindows(), callbacks=[rec], **extra)
    if evaluate_first:  # Accelerate wraps the model here, before the optimizer exists
        t.evaluate()
    t.train(resume_from_checkpoint=resume)
    return rec.logs, model


def test_offload_trainer_matches_trainer(tmp_path):
    """Losses within 1% over 30 steps (weight decay 0.1 with Trainer's no-decay groups,
    clipping at 1.0, accumulation 2, linear warmup); the logged grad_norm is the true one."""
    log.info("seed %d", SEED)
    ref, _ = run(transformers.Trainer, tmp_path / "ref")
    got, _ = run(OffloadTrainer, tmp_path / "off")
    assert [s for s, _, _ in got] == [s for s, _, _ in ref] == list(range(1, 31))
    for (s, a, na), (_, b, nb) in zip(got, ref):
        assert abs(a - b) / b < 1e-2, (s, a, b)
    assert ref[-1][1] < 0.8 * ref[0][1]  # it learns: the comparison is not of two flat lines
    # the first step's norm (same weights; 16-bit gradients against autocast's)
    assert abs(float(got[0][2]) - float(ref[0][2])) / float(ref[0][2]) < 2e-2, (got[0], ref[0])
    assert all(float(n) > 0 for _, _, n in got)


def test_resume_from_checkpoint_is_bitwise(tmp_path):
    """Stopped at step 10 (save_steps) and resumed with resume_from_checkpoint: the
    losses after and the final weights equal the uninterrupted run's, bit for bit."""
    full, m_full = run(OffloadTrainer, tmp_path / "a", max_steps=20, save_strategy="steps", save_steps=10)
    ck = tmp_path / "a" / "checkpoint-10"
    assert (ck / "zero_offload" / "latest").exists()
    resumed, m_res = run(OffloadTrainer, tmp_path / "a", resume=str(ck), max_steps=20, save_strategy="no")
    assert [x[:2] for x in resumed] == [x[:2] for x in full[10:]]
    for (n, a), (_, b) in zip(m_full.state_dict().items(), m_res.state_dict().items()):
        assert torch.equal(a, b), n


def test_bf16_true_does_not_autocast_under_fp32_compute(tmp_path, monkeypatch):
    """Where the engine computes in fp32 (a CPU without native bf16 matmul; forced here),
    bf16=True must not put the forward back under Accelerate's bf16 autocast, whose
    matmuls are emulated there (a 4-layer GPT-2 of width 512 under an AVX2 oneDNN cap:
    95 s for 8 steps with it, 2.6 s without): the run is bitwise the bf16=False run, in
    which nothing autocasts, and the layers compute in fp32.  With 16-bit compute bf16=True
    autocasts as before.  evaluate() before train() wraps the model first: no autocast
    there either.  (Mutation: not turning the autocast handler off fails the dtype check,
    before the bitwise one; turning it off only once the optimizer exists fails it too,
    through the evaluate() first.)"""
    fp32 = {"expert": {"compute_dtype": "fp32"}}
    seen = []
    def hook(m, i, o):
        seen.append((o.dtype, torch.is_autocast_enabled("cpu")))
    orig = tiny_gpt2

    def spied():
        model = orig()
        model.lm_head.register_forward_hook(hook)
        return model
    monkeypatch.setitem(globals(), "tiny_gpt2", spied)  # run() builds its model through it
    with_bf16, m1 = run(OffloadTrainer, tmp_path / "a", offload=fp32, max_steps=4, evaluate_first=True)
    assert set(seen) == {(torch.float32, False)}, set(seen)  # evaluate() first, then train()
    seen.clear()
    without, m2 = run(OffloadTrainer, tmp_path / "b", offload=fp32, max_steps=4, bf16=False)
    seen.clear()
    run(OffloadTrainer, tmp_path / "c", offload={"expert": {"compute_dtype": "bf16"}}, max_steps=1)
    assert set(seen) == {(torch.bfloat16, True)}, set(seen)
    assert [x[:2] for x in with_bf16] == [x[:2] for x in without]
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n


def test_fp16_and_misplaced_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="learning_rate"):
        OffloadTrainer(model=tiny_gpt2(), args=args(tmp_path, bf16=False), train_dataset=TextWindows(),
                       offload={"lr": 1e-3})


@pytest.mark.parametrize("eight,thirty_two,optimizer", [("adamw_8bit", "adamw_torch", "adamw"),
                                                       ("lion_8bit", "lion_32bit", "lion")])
def test_optim_picks_the_optimizer_and_state_dtype(tmp_path, eight, thirty_two, optimizer):
    """An 8-bit optim name trains exactly as its 32-bit one with offload={"state_dtype":
    "int8"} does (the logged losses and grad norms equal; the optimizer's config says
    which optimizer and int8)."""
    def logs(optim, offload):
        rec = Record()
        t = OffloadTrainer(model=tiny_gpt2(), args=args(tmp_path / optim, max_steps=6, optim=optim,
                                                        learning_rate=3e-4 if optimizer == "lion" else 3e-3),
                           train_dataset=TextWindows(), callbacks=[rec], offload=dict(offload, server={"threads": 1}))
        t.create_optimizer()
        cfg = t.offload_optimizer.engine.cfg
        t.train()
        return rec.logs, (cfg.optimizer, cfg.state_dtype)
    by_name, picked = logs(eight, {})
    explicit, _ = logs(thirty_two, {"state_dtype": "int8"})
    assert picked == (optimizer, "int8") and len(by_name) == 6
    assert by_name == explicit


def test_other_optimizers_and_contradictions_are_refused(tmp_path):
    """A non-AdamW, non-Lion optim, or an 8-bit one against another state dtype, is
    refused at construction, before a server starts."""
    for optim, offload, word in [("adagrad", {}, "offloads AdamW and Lion"), ("adafactor", {}, "lion_8bit"),
                                 ("adamw_8bit", {"state_dtype": "bf16"}, "drop one")]:
        with pytest.raises(ValueError, match=word):
            OffloadTrainer(model=tiny_gpt2(), args=args(tmp_path, optim=optim), train_dataset=TextWindows(),
                           offload=offload)


class Updates(transformers.TrainerCallback):
    """The offloaded optimizer's update counter after each step."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        self.seen.append((state.global_step, optimizer.optimizer.engine.updates))  # under Accelerate's wrapper


def test_a_plain_trainer_checkpoint_resumes_offloaded(tmp_path):
    """A run saved by transformers.Trainer (torch AdamW: optimizer.pt) resumed with
    OffloadTrainer: m, v and the step counts go on (the update counter continues from
    step 10; not loading optimizer.pt restarts it at 1), and steps 11-20 log losses within
    1% of the plain Trainer's uninterrupted run (16-bit weights against fp32 ones)."""
    log.info("seed %d", SEED)
    ref, _ = run(transformers.Trainer, tmp_path / "a", max_steps=20, save_strategy="steps", save_steps=10)
    ck = tmp_path / "a" / "checkpoint-10"
    assert (ck / "optimizer.pt").exists() and not (ck / "zero_offload").exists()
    model, rec, upd = tiny_gpt2(), Record(), Updates()
    t = OffloadTrainer(model=model, args=args(tmp_path / "a", max_steps=20, save_strategy="no"),
                       train_dataset=TextWindows(), callbacks=[rec, upd], offload={"server": {"threads": 1}})
    t.train(resume_from_checkpoint=str(ck))
    assert upd.seen == [(s, s) for s in range(11, 21)]
    assert [s for s, _, _ in rec.logs] == list(range(11, 21))
    for (s, a, _), (_, b, _) in zip(rec.logs, ref[10:]):
        assert abs(a - b) / b < 1e-2, (s, a, b)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "helpers", "hf_worker.py")


def launch_worker(out, nproc: int, *opts, killed: bool = False) -> dict:
    """tests/helpers/hf_worker.py under the launcher (nproc > 1) or alone; its rank0.json."""
    cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", str(nproc)] if nproc > 1 else [sys.executable]
    p = subprocess.Popen(cmd + [WORKER, str(out), *map(str, opts)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    said, _ = p.communicate(timeout=250)
    if killed:
        assert p.returncode == -9, said[-3000:]
        # its private optimizer server sees its parent gone and exits (heartbeat bound)
        deadline = time.monotonic() + 15
        while procs.servers_for(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not procs.servers_for(p.pid), "the killed worker's optimizer server is still running"
        return {}
    assert p.returncode == 0, said[-3000:]
    with open(os.path.join(out, "rank0.json")) as f:
        return json.load(f)


def test_two_processes_train_like_one_and_resume_a_plain_trainer_checkpoint(tmp_path):
    """OffloadTrainer under a launcher with 2 processes (as torchrun), on the built-in
    multi-rank path (expert.multi_rank="builtin"; the default is FSDP2's, the test
    after): Accelerate would wrap the model in DDP (and copy it to cpu:0), which the
    engine refuses; OffloadTrainer prepares it without either, the engine reducing the
    gradients itself (ZeRO-2).  Each
    process takes half of the same global batch: losses within 1e-3 relative of the
    one-process run's (measured 1e-5) and grad norms within 1e-2, both ranks' checkpoint
    files at save_steps.  Then a plain Trainer's checkpoint (torch AdamW, one process)
    resumed on 2 processes: the update counter goes on from step 5, and the losses of
    steps 6-10 are within 1% of the plain run's.  (Mutation: prepare_model left as
    Accelerate's fails the first backward on both ranks, naming DDP.)"""
    log.info("seed %d", SEED)
    one, _ = run(OffloadTrainer, tmp_path / "one", max_steps=10, per_device_train_batch_size=4)
    two = launch_worker(tmp_path / "two", 2, "--steps", 10, "--batch", 4, "--multi-rank", "builtin")
    assert two["world"] == 2 and [s for s, _, _ in two["logs"]] == list(range(1, 11))
    for (s, a, na), (_, b, nb) in zip(two["logs"], one):
        assert abs(a - b) / b < 1e-3, (s, a, b)
        assert abs(float(na) - float(nb)) / float(nb) < 1e-2, (s, na, nb)
    assert sorted(os.listdir(tmp_path / "two" / "checkpoint-5" / "zero_offload" / "step-00000005")) == [
        "device16-r0-of-2.bin", "device16-r1-of-2.bin", "engine-r0-of-2.json", "engine-r1-of-2.json",
        "shard-r0-of-2.bin", "shard-r0-of-2.json", "shard-r1-of-2.bin", "shard-r1-of-2.json"]
    ref, _ = run(transformers.Trainer, tmp_path / "plain", max_steps=10, per_device_train_batch_size=4,
                 save_strategy="steps", save_steps=5)
    ck = tmp_path / "plain" / "checkpoint-5"
    resumed = launch_worker(tmp_path / "plain", 2, "--steps", 10, "--batch", 4, "--resume", ck,
                            "--multi-rank", "builtin")
    assert resumed["updates"] == [[s, s] for s in range(6, 11)]
    for (s, a, _), (_, b, _) in zip(resumed["logs"], ref[5:]):
        assert abs(a - b) / b < 1e-2, (s, a, b)
    assert not [n for n in os.listdir(tmp_path / "plain") if n.startswith("zero-offload-torch-state-")]


@pytest.mark.parametrize("limit", [None, 1], ids=["background", "save_total_limit"])
def test_a_run_killed_after_a_save_resumes_from_a_whole_checkpoint(tmp_path, limit):
    """SIGKILL right after Trainer wrote checkpoint-4 (on_save), before the next step: a
    background optimizer save is not published yet, so checkpoint-4 holds no whole
    optimizer state, and resume_from_checkpoint=True takes checkpoint-2 instead of
    failing on it.  With save_total_limit=1 the save is blocking, since Trainer deletes
    checkpoint-2 as soon as it returns: checkpoint-4 is whole and taken.  Either way the
    resumed run ends with the uninterrupted run's losses and weights, bit for bit; nothing
    of the killed run is left running.  (Mutations: Trainer's own pick of the newest
    checkpoint fails the background case loading checkpoint-4; a background save
    under save_total_limit leaves no whole checkpoint.)"""
    opts = ["--steps", 6, "--save-steps", 2] + (["--save-total-limit", limit] if limit else [])
    whole = launch_worker(tmp_path / "whole", 1, *opts)
    launch_worker(tmp_path / "run", 1, *opts, "--kill-at-save", 4, killed=True)
    cks = sorted(os.listdir(tmp_path / "run"))
    assert cks == (["checkpoint-2", "checkpoint-4"] if limit is None else ["checkpoint-4"]), cks
    resumed = launch_worker(tmp_path / "run", 1, *opts, "--resume", "true")
    first = 3 if limit is None else 5  # checkpoint-2, or checkpoint-4, was taken
    assert [x[0] for x in resumed["updates"]] == list(range(first, 7))
    assert [x[:2] for x in resumed["logs"]] == [x[:2] for x in whole["logs"][first - 1:]]
    assert resumed["weights"] == whole["weights"]


def test_trainer_checkpoints_of_a_model_the_library_shards_resume_bitwise(tmp_path):
    """OffloadTrainer on 2 processes on the default multi-rank path (the library shards
    the model with FSDP2, ZeRO-2) saves Trainer checkpoints: the model file holds the whole
    weights (the plain model's shapes, gathered from every rank's rows), the optimizer's
    checkpoint the shared layout.  Losses within 1e-3 of one process's; resumed from
    checkpoint-5 on 2 processes, steps 6-10 log the uninterrupted run's losses and end on
    its weights, bit for bit; a plain Trainer's checkpoint (torch AdamW's whole moments in
    optimizer.pt) resumes onto the FSDP2 shards, the update counter going on from step 5
    and losses within 1% of the plain run's.  (Mutations: full_state_dict returning each
    rank's own rows fails the shapes; local_rows returning the whole moment fails the
    plain resume on its shape check; without the save_model override the first save
    hangs until this test's timeout.)"""
    log.info("seed %d", SEED)
    opts = ["--steps", 10, "--batch", 4]  # no --multi-rank: the library's default
    one, _ = run(OffloadTrainer, tmp_path / "one", max_steps=10, per_device_train_batch_size=4)
    whole = launch_worker(tmp_path / "whole", 2, *opts)
    assert whole["world"] == 2 and [s for s, _, _ in whole["logs"]] == list(range(1, 11))
    for (s, a, _), (_, b, _) in zip(whole["logs"], one):
        assert abs(a - b) / b < 1e-3, (s, a, b)
    ck = tmp_path / "whole" / "checkpoint-5"
    saved = safetensors.torch.load_file(str(ck / "model.safetensors"))
    plain = tiny_gpt2().state_dict()
    assert saved and all(tuple(v.shape) == tuple(plain[k].shape) for k, v in saved.items()), \
        {k: (tuple(v.shape), tuple(plain[k].shape)) for k, v in saved.items()}
    assert (ck / "zero_offload" / "step-00000005" / "shard-r0-of-1.json").exists()
    resumed = launch_worker(tmp_path / "whole", 2, *opts, "--resume", ck)
    assert resumed["updates"] == [[s, s] for s in range(6, 11)]
    assert resumed["logs"] == whole["logs"][5:]
    assert resumed["weights"] == whole["weights"]
    ref, _ = run(transformers.Trainer, tmp_path / "plain", max_steps=10, per_device_train_batch_size=4,
                 save_strategy="steps", save_steps=5)
    from_plain = launch_worker(tmp_path / "plain", 2, *opts, "--resume", tmp_path / "plain" / "checkpoint-5")
    assert from_plain["updates"] == [[s, s] for s in range(6, 11)]
    for (s, a, _), (_, b, _) in zip(from_plain["logs"], ref[5:]):
        assert abs(a - b) / b < 1e-2, (s, a, b)


def test_load_best_model_at_end_on_a_model_the_library_shards(tmp_path):
    """load_best_model_at_end on 2 processes on the default (FSDP2) path, evaluating at
    every save (so ZeRO-2 leaves the parameters gathered after the evaluation's forward
    when the save comes), with the "best" the highest eval loss: checkpoint-5 is taken,
    and the model ends on its weights exactly (each tensor's sum of squares against the
    checkpoint's file), not the last step's.  (Mutations: not closing the optimizer
    before the load lets its close overwrite the shards with the last step's weights;
    fsdp2.is_sharded asked of the parameters sends the save after an evaluation down
    Trainer's own path on rank 0 alone, which hangs until this test's timeout.)"""
    res = launch_worker(tmp_path, 2, "--steps", 10, "--batch", 4, "--best")
    state = json.loads((tmp_path / "checkpoint-10" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"].endswith("checkpoint-5"), state["best_model_checkpoint"]

    def sums(ck):
        d = safetensors.torch.load_file(str(tmp_path / ck / "model.safetensors"))
        return {k: d[k].double().square().sum().item() for k in res["weights"] if k in d}
    best, last = sums("checkpoint-5"), sums("checkpoint-10")
    assert len(best) == len(res["weights"]) and best == res["weights"]
    assert last != best


def test_three_processes_on_the_default_path_train_like_one_and_resume_bitwise(tmp_path):
    """3 processes (FSDP2's rows split 3 ways, uneven for most tensors), each a third of
    a global batch of 6: losses within 1e-3 of one process's over 6 steps, and a resume
    from checkpoint-3 on 3 processes logs steps 4-6 and ends on the weights of the run
    that was not interrupted, bit for bit.  (Mutation: fsdp2.gather_whole padding every
    chunk to rows // world instead of its ceiling fails the saved model's shapes, so the
    resume.)"""
    log.info("seed %d", SEED)
    opts = ["--steps", 6, "--batch", 6, "--save-steps", 3]
    one, _ = run(OffloadTrainer, tmp_path / "one", max_steps=6, per_device_train_batch_size=6)
    whole = launch_worker(tmp_path / "three", 3, *opts)
    assert whole["world"] == 3 and [s for s, _, _ in whole["logs"]] == list(range(1, 7))
    for (s, a, _), (_, b, _) in zip(whole["logs"], one):
        assert abs(a - b) / b < 1e-3, (s, a, b)
    resumed = launch_worker(tmp_path / "three", 3, *opts, "--resume", tmp_path / "three" / "checkpoint-3")
    assert resumed["logs"] == whole["logs"][3:] and resumed["weights"] == whole["weights"]


def test_two_processes_killed_after_a_save_resume_from_a_whole_checkpoint(tmp_path):
    """The default (FSDP2) path on 2 processes, each SIGKILLed right after Trainer wrote
    checkpoint-4 (on_save), before the next step: the background optimizer save of step 4
    is not published, so resume_from_checkpoint=True takes checkpoint-2, and the resumed
    run (2 processes) redoes steps 3-6 with the uninterrupted run's losses and ends on its
    weights, bit for bit; nothing of the killed run is left running.  (Mutation: Trainer's
    own pick of the newest checkpoint fails the resume on checkpoint-4's missing optimizer
    state.)"""
    opts = ["--steps", 6, "--save-steps", 2, "--batch", 4]
    whole = launch_worker(tmp_path / "whole", 2, *opts)
    cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", "2", WORKER, str(tmp_path / "run"),
           *map(str, opts), "--kill-at-save", "4"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=250,
                       env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert p.returncode != 0, p.stdout[-2000:]
    assert not procs.matching(str(tmp_path / "run")), "a process of the killed run is still running"
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-2", "checkpoint-4"]
    resumed = launch_worker(tmp_path / "run", 2, *opts, "--resume", "true")
    assert [x[0] for x in resumed["updates"]] == [3, 4, 5, 6]
    assert [x[:2] for x in resumed["logs"]] == [x[:2] for x in whole["logs"][2:]]
    assert resumed["weights"] == whole["weights"]
