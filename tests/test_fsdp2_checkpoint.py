"""One checkpoint layout for every topology: OffloadAdamW's checkpoint of an FSDP2 model
saved on 2 ranks loads under FSDP2 on 3 ranks, on one rank without FSDP2, on 2 ranks of
the built-in ZeRO-2 path and back under FSDP2 on 2 ranks (tests/helpers/fsdp2_ckpt_worker.py,
under zero-offload-launch over gloo), for sync with fp32 state, DPU with bf16 state, and DPU
with bf16 state on fp32 FSDP2 shards (torchtitan's recipe: bf16 param_dtype).  The
model has a one-row parameter, so every rank but 0 holds an empty local shard of it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import procs

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "helpers" / "fsdp2_ckpt_worker.py"
VARIANTS = ["sync-fp32", "dpu-bf16", "dpu-bf16-fp32shards"]
# (ranks, stages): each stage loads what the one before saved, and saves it again at once;
# the last launch's two stages run in the same two processes, one after the other
CHAIN = [(2, ["fsdp2", "train", "a"]),
         (3, ["fsdp2", "corrupt", "a", "then", "fsdp2", "refuse", "a", "then", "fsdp2", "relay", "a", "b"]),
         (1, ["builtin", "relay", "b", "c"]),
         (2, ["builtin", "relay", "c", "d", "then", "fsdp2", "resume", "d"])]


def launch(out: Path, nproc: int, args: list[str], **env_extra) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", str(nproc), str(WORKER), str(out), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2-ckpt")
    for nproc, stages in CHAIN:
        launch(out, nproc, stages)
    return out


def read_flat(root: Path) -> dict:
    """Every array of a checkpoint (root/latest) over the whole flat space, as raw bytes:
    the shard files' arrays laid end to end across the ranks that saved them, cut at
    the flat space's end, and the device's 16-bit weights (and pending ones)."""
    from zero_offload.server import checkpoint as C
    from zero_offload.server.state import ITEM_BYTES, ShardStateArrays
    d = C.resolve(root)
    (world,) = C.saved_world_sizes(d, C.SHARD)
    mans = [json.loads(C.rank_file(d, C.SHARD, k, world, ".json").read_text()) for k in range(world)]
    meta = json.loads(C.rank_file(d, C.ENGINE, 0, world, ".json").read_text())
    n, per = meta["numel"], mans[0]["numel"]
    names, dtypes = mans[0]["arrays"], mans[0].get("array_dtypes", {})
    at, _ = ShardStateArrays.file_layout(names, dtypes, per)
    out = {}
    for name in names:
        item = ITEM_BYTES[dtypes.get(name, "fp32")]
        parts = [np.fromfile(C.rank_file(d, C.SHARD, k, world, ".bin"), np.uint8, per * item, offset=at[name])
                 for k in range(world)]
        out[name] = np.concatenate(parts)[:n * item]
    for role in (C.DEVICE16, C.PENDING16):
        files = [C.rank_file(d, role, k, world, ".bin") for k in range(world)]
        if files[0].exists():
            out[role] = np.concatenate([np.fromfile(f, np.uint8) for f in files])[:2 * n]
    out["param_updates"] = meta["param_updates"]
    out["updates"] = meta["updates"]
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_moves_between_topologies_bitwise(chain, variant):
    """Saved by FSDP2 on 2 ranks (a), loaded and saved again by FSDP2 on 3 ranks (b), by
    one rank without FSDP2 (c), by the built-in ZeRO-2 on 2 ranks (d): master, moments,
    the device weights (and DPU's pending ones) and each parameter's step count are
    bitwise the same over the whole flat space after every load, and the master is
    each parameter's, gathered from FSDP2 when it was saved, where the plain model's
    one-rank layout puts it.  (Mutation: a piece's place off by one row in
    fsdp2_checkpoint.flat_map fails the last check: every topology then reads the
    misplaced rows alike.  Their export: a row's offset off by one in flat_map's table
    fails it for a and b, in engine_checkpoint._param_table for c and d.)"""
    flats = [read_flat(chain / variant / name) for name in "abcd"]
    for name in "ab":  # FSDP2's saves leave nothing of their own beside the checkpoints
        assert sorted(p.name for p in (chain / variant / name).iterdir()) == ["latest", "step-00000005"]
    assert flats[0]["updates"] == 5
    if variant.startswith("dpu"):
        assert "pending16" in flats[0]  # the case the relay must carry
    for name, f in zip("bcd", flats[1:]):
        assert sorted(f) == sorted(flats[0]), (name, sorted(f))
        for k, v in flats[0].items():
            if isinstance(v, np.ndarray):
                assert np.array_equal(f[k], v), (name, k)
            else:
                assert f[k] == v, (name, k)
    # and what they hold is the model's: each parameter's fp32 master where the one-rank
    # layout of the plain model (FlatParams, the groups' order) puts it
    from tests.helpers.fsdp2_ckpt_worker import Scaled
    from tests.helpers.fsdp2_worker import groups
    from zero_offload.flat import FlatParams
    model = Scaled()
    gs = groups(model)
    group_of = {id(p): gi for gi, g in enumerate(gs) for p in g["params"]}
    params = list(model.parameters())
    layout = FlatParams(params, bucket_numel=1 << 40, world_size=1, groups=[group_of[id(p)] for p in params])
    names = {id(p): n for n, p in model.named_parameters()}
    truth = torch.load(chain / variant / "at_save.pt")
    master = flats[0]["master"].view(np.float32)
    assert layout.numel == master.size
    for s in layout.spans:
        want = truth[names[id(s.param)]].reshape(-1).numpy()
        assert np.array_equal(master[s.offset:s.offset + s.numel], want), names[id(s.param)]
    # and each checkpoint, FSDP2's (2 and 3 ranks) and the built-in path's (1 and 2), exports
    # to the same state dict without the model (zero_offload.export: its "params" table)
    # (FSDP2's master_state_dict() keys each parameter once; the table has every
    # state_dict name, GPT-2's tied lm_head.weight too, as the built-in path's has)
    from zero_offload.export import master_state_dict_from_checkpoint
    keys = sorted(truth) + ["gpt.lm_head.weight"]
    for name in "abcd":
        got = master_state_dict_from_checkpoint(chain / variant / name)
        assert sorted(got) == sorted(keys), (name, sorted(got))
        for k, v in truth.items():
            assert torch.equal(got[k], v), (name, k)
        assert torch.equal(got["gpt.lm_head.weight"], truth["gpt.transformer.wte.weight"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_resumed_after_the_round_trip_is_the_uninterrupted_run(chain, variant):
    """Back under FSDP2 on 2 ranks from the built-in path's checkpoint (d), the next steps'
    losses and the final masters are bitwise those of the run that never stopped.
    (Mutation: the save copying only the master, not the moments, fails it; so does a
    piece's place off by one row.)"""
    whole = torch.load(chain / variant / "whole.pt")
    resumed = torch.load(chain / variant / "resumed.pt")
    # the saving run's FSDP2 shards: bf16, also where the model was left fp32 (torchtitan's
    # recipe: OffloadAdamW makes them 16-bit once the master has their fp32 values)
    assert whole["shard_dtypes"] == ["torch.bfloat16"]
    assert resumed["losses"] == whole["losses"]
    for k, v in whole["master"].items():
        assert torch.equal(resumed["master"][k], v), k


def test_a_corrupt_byte_fails_the_load_on_every_rank(chain):
    """FSDP2 on 3 ranks verifies a checkpoint's checksums together (each rank reads a third
    of every file, the CRCs combined): a byte flipped in the last rank's third fails the
    load on all three ranks alike, naming the file, and the same checkpoint, put back,
    then loads (the chain's next stage relays it, so a wrong combination of the CRCs
    fails the chain).  (Mutation: without the check, each rank builds its local
    checkpoint from the corrupt bytes with fresh checksums and loads it.)"""
    for r in range(3):
        what = (chain / VARIANTS[0] / f"corrupt-r{r}.txt").read_text()
        assert what.startswith("CheckpointError") and "is corrupt" in what and "shard-r0-of-1.bin" in what, what


def test_a_load_that_fails_on_one_rank_fails_on_every_rank(chain):
    """FSDP2 on 3 ranks, rank 1's load failing after the checks (its session with the server
    was closed just before, so its LOAD fails): rank 1 raises its own error, ranks 0 and 2, which loaded, raise saying
    another rank failed and the ranks now differ, instead of training on (or waiting in
    the next collective) beside a rank that gave up.  (Mutation: without the agreement
    after the load, ranks 0 and 2 report "loaded".)"""
    what = [(chain / VARIANTS[0] / f"refuse-r{r}.txt").read_text() for r in range(3)]
    assert what[1].startswith("OptimizerServerError") and "client is closed" in what[1], what[1]
    for r in (0, 2):
        assert what[r].startswith("OptimizerServerError") and "failed on another rank" in what[r], what[r]


def test_a_checkpoint_of_another_model_or_int8_state_is_refused_naming_the_fix(tmp_path):
    """One FSDP2 rank in this process (gloo): a checkpoint of another model is refused
    naming the model it came from, and the optimizer that refused it trains on as before
    (its state untouched: the refusal comes before the engine's load); an FSDP2 save with
    int8 state is refused naming bf16/fp32, and the previous checkpoint stays `latest`.
    (Mutation: dropping the layout check in fsdp2_checkpoint.load lets the other
    model's checkpoint load without a word.)"""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from zero_offload import OffloadAdamW
    from zero_offload.server.checkpoint import CheckpointError
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    opts = []
    try:
        def build(width: int, **kw):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Linear(width, 4)).to(torch.bfloat16)
            for layer in m:
                fully_shard(layer)
            fully_shard(m)
            opts.append(OffloadAdamW(m.parameters(), lr=1e-3, model=m, server={"threads": 1}, **kw))
            return m, opts[-1]

        def step(m, opt):
            m(torch.ones(2, 16, dtype=torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        a, oa = build(16)
        step(a, oa)
        oa.save_checkpoint(str(tmp_path / "a"))
        b, ob = build(24)
        step(b, ob)
        before = [p.detach().full_tensor().clone() for p in b.parameters()]
        with pytest.raises(CheckpointError, match="load it into the model it was saved from"):
            ob.load_checkpoint(str(tmp_path / "a"))
        assert all(torch.equal(x, p.detach().full_tensor()) for x, p in zip(before, b.parameters()))
        step(b, ob)
        assert ob.stats()["updates"] == 2
        c, oc = build(16, state_dtype="int8")
        step(c, oc)
        latest = (tmp_path / "a" / "latest").read_text()
        with pytest.raises(ValueError, match="int8 state.*bf16"):
            oc.save_checkpoint(str(tmp_path / "a"))
        assert (tmp_path / "a" / "latest").read_text() == latest
        assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["latest", latest]
    finally:
        for o in opts:
            o.close()
        dist.destroy_process_group()


def test_a_background_save_writes_the_blocking_saves_bytes_while_training_goes_on(chain):
    """FSDP2 on 2 ranks (fp32 and bf16 state): a background save at step 5 returns while
    both ranks' servers are still writing (paced at 100 kB/s, ZERO_OFFLOAD_SAVE_MAX_BYTES_PER_S),
    unpublished; three steps run during it, with the losses and master of the chain's run
    that saved nothing in the background, bitwise; wait_checkpoint publishes the directory
    it returned, whose files are byte for byte a blocking save's of the same state (so the
    chain's resume from that one holds for it too).  (Mutation: the worker asking its
    server for a blocking save makes the state "done".  The state here is one save chunk
    per rank, which a writer copies at once, so the snapshot of later chunks is held to
    account by test_ckpt_io's placed save jobs instead.)"""
    from zero_offload.server import checkpoint as C
    launch(chain, 2, ["fsdp2", "background", "blk", "bg"], ZERO_OFFLOAD_SAVE_MAX_BYTES_PER_S="100000")
    for name in VARIANTS[:2]:
        d = chain / name
        for r in range(2):
            assert (d / f"bg-r{r}.txt").read_text() == "writing False True", name
        a, b = C.resolve(d / "blk"), C.resolve(d / "bg")
        assert a.name == b.name == "step-00000005"
        files = sorted(p.name for p in a.iterdir())
        assert files == sorted(p.name for p in b.iterdir()) and "shard-r0-of-1.bin" in files
        for f in files:
            assert (a / f).read_bytes() == (b / f).read_bytes(), (name, f)
        bg, ref = torch.load(d / "bg.pt"), torch.load(d / "whole.pt")
        assert bg["losses"] == ref["losses"], name
        for k in ref["master"]:
            assert torch.equal(bg["master"][k], ref["master"][k]), (name, k)


def test_a_background_save_killed_with_its_server_leaves_the_previous_checkpoint(tmp_path):
    """FSDP2 on 2 ranks: a blocking save A, then a background save B (its server paced at
    100 kB/s, so still writing), then the node's server SIGKILLed: the launcher exits
    non-zero naming the server's death, `latest` still names A, whose files verify, no
    step directory of B exists (only its tmp-step, which the next save sweeps), and no
    process of the run is left.  (Mutation: CheckpointDir.begin writing into the step's
    own name instead of tmp-step-N leaves B's half-written step directory there.)"""
    from zero_offload.server import checkpoint as C
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ZERO_OFFLOAD_SAVE_MAX_BYTES_PER_S="100000")
    cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", "2", str(WORKER), str(tmp_path),
           "fsdp2", "killed", "a", "b"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "saving").exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert (tmp_path / "saving").exists(), p.communicate(timeout=30)[0][-3000:]
        servers = procs.children(p.pid, "zero_offload.server")
        assert len(servers) == 1, servers
        os.kill(int(servers[0]), 9)
        out = p.communicate(timeout=90)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait(10)
    assert p.returncode != 0 and "optimizer server was killed by SIGKILL" in out, out[-3000:]
    a = C.resolve(tmp_path / "a")
    assert C.resolve(tmp_path / "b") == tmp_path / "b" and not (tmp_path / "b" / "latest").exists()
    assert not [d for d in (tmp_path / "b").iterdir() if d.name.startswith("step-")]
    for f in a.glob("*.bin"):
        role = f.name.split("-r")[0]
        meta = json.loads(C.rank_file(a, C.ENGINE, 0, 1, ".json").read_text())
        man = json.loads(C.rank_file(a, C.SHARD, 0, 1, ".json").read_text())
        C.verify(f, man["checksum"] if role == C.SHARD else meta["checksums"][role])
    assert procs.matching(str(tmp_path)) == []


def test_a_dpu_background_save_is_published_by_a_step(tmp_path):
    """One FSDP2 rank in this process (gloo), mode="dpu": the background save is published
    by a step()'s poll, when an update is in flight and the server can answer only through
    its heartbeat (STATS waits for no STEP); the heartbeat carries the save's masked CRC, so
    rank 0 can write the manifest then.  The published checkpoint's files verify.
    (Mutation: HEARTBEAT_OK without save_crc: the publish fails, "the server gave no
    checksum", and nothing is published.)"""
    from tests.helpers.one_rank import one_rank_group, sharded_mlp
    from zero_offload import OffloadAdamW
    from zero_offload.server import checkpoint as C
    with one_rank_group(tmp_path):
        m = sharded_mlp()
        opt = OffloadAdamW(m.parameters(), lr=1e-3, model=m, server={"threads": 1}, mode="dpu",
                           expert={"dpu_warmup_steps": 1})
        try:
            def step():
                m(torch.ones(2, 16, dtype=torch.bfloat16)).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
            for _ in range(3):
                step()
            where = opt.save_checkpoint(str(tmp_path / "ck"), background=True)
            deadline = time.monotonic() + 60
            while opt.engine.checkpoint_in_flight() and time.monotonic() < deadline:
                step()
                time.sleep(0.05)  # the heartbeat's word comes every heartbeat interval
            assert not opt.engine.checkpoint_in_flight()
            assert C.has_checkpoint(tmp_path / "ck") and str(C.resolve(tmp_path / "ck")) == where
            d = C.resolve(tmp_path / "ck")
            man = json.loads(C.rank_file(d, C.SHARD, 0, 1, ".json").read_text())
            meta = json.loads(C.rank_file(d, C.ENGINE, 0, 1, ".json").read_text())
            C.verify(C.rank_file(d, C.SHARD, 0, 1, ".bin"), man["checksum"])
            for role, crc in meta["checksums"].items():
                C.verify(C.rank_file(d, role, 0, 1, ".bin"), crc)
        finally:
            opt.close()
