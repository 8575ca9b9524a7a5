"""OffloadAdamW on torch's FSDP2 (fully_shard): a tiny GPT-2 from its config, each block and
the root sharded, bf16 mixed precision, two param groups, clipping, over gloo on 2 and 3
ranks under zero-offload-launch (one optimizer server per node), against FSDP2 with
torch.optim.AdamW over fp32 masters (MixedPrecisionPolicy over fp32 parameters) on the
same text (tests/helpers/fsdp2_worker.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "helpers" / "fsdp2_worker.py"
STEPS = 30


def launch(out: Path, modes: list[str], nproc: int, steps: int = STEPS) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", str(nproc), str(WORKER), str(out),
           ",".join(modes), str(steps)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]


def initial() -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.helpers.fsdp2_worker import make_model
    return {n: p.detach().float().clone() for n, p in make_model().named_parameters()}


def flat(d: dict) -> torch.Tensor:
    return torch.cat([d[k].reshape(-1).float() for k in sorted(d)])


def moved_rel(a: dict, ref: dict, p0: dict) -> float:
    """|a - ref| relative to how far training moved ref from p0."""
    return float((flat(a) - flat(ref)).norm() / (flat(ref) - flat(p0)).norm())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2-2")
    # reshard_after_forward changes when FSDP2 frees the unsharded units, not the
    # arithmetic: the ZeRO-2 runs are held to the ZeRO-3 references
    launch(out, ["ref", "offload", "ref+dpu", "dpu", "offload+zero2", "dpu+zero2", "offload+resume", "dpu+resume",
                 "ref+frozen+accum", "offload+frozen+accum", "offload+resume+statedir",
                 "offload+sync+shadow", "offload+speculation", "offload+nozerocopy", "dpu+nozerocopy",
                 # fp32 shards: torchtitan's recipe (bf16 param_dtype), and fp32 compute
                 "ref+fp32shards", "offload+fp32shards", "ref+fp32shards+fp32compute",
                 "offload+fp32shards+fp32compute", "offload+fp32shards+resume",
                 # a run moving from torch AdamW onto offload halfway (its state dict)
                 "fromtorch+fp32shards", "fromtorch+fp32shards+dcpdict"], 2)
    return out


def load(out: Path, mode: str, world: int) -> list[dict]:
    return [torch.load(out / mode / f"rank{r}.pt") for r in range(world)]


def reference_of(mode: str) -> str:
    """The reference run a mode is held to: same schedule (DPU) and model (frozen, accum);
    reshard_after_forward changes no arithmetic, so ZeRO-2 runs meet the ZeRO-3 reference."""
    opts = mode.split("+")
    return "+".join(["ref"] + [o for o in opts if o in ("dpu", "frozen", "accum", "fp32shards", "fp32compute")])


@pytest.mark.parametrize("mode", ["offload", "dpu", "offload+zero2", "dpu+zero2", "offload+frozen+accum",
                                  "offload+fp32shards", "offload+fp32shards+fp32compute", "fromtorch+fp32shards",
                                  "fromtorch+fp32shards+dcpdict"])
def test_offload_adamw_on_fsdp2_trains_like_fsdp2_with_torch_adamw(two_ranks, mode):
    """Losses within 1e-2 relative of the reference at every step (DPU against the
    reference on DPU's schedule) and the final masters within 10% of how far the
    reference moved them; both ranks clip by the same global norm.  fp32 shards (the
    model not cast before fully_shard: torchtitan's recipe, bf16 param_dtype; and with
    no param_dtype, fp32 compute) against FSDP2 with torch AdamW on the same fp32 shards.
    (Mutation: the hook's gradient shard not passed on, or copy_back skipped in step(),
    fails it: the masters or losses stop following; frozen shards given proxies like
    the rest fail the frozen run: a hook cannot be registered on them; the hook
    assigning an fp32 shard's gradient to the bf16 proxy unrounded fails the fp32-shard
    runs: torch refuses the dtype.)  The fp32 shards computed in bf16 (torchtitan's recipe)
    are bf16 once OffloadAdamW is built (fsdp2.sixteen_bit_shards; mutation: it converting
    nothing leaves them fp32), with fp32 compute they stay fp32 (mutation: converting
    whatever the param_dtype makes them bf16).  fromtorch: torch AdamW on the FSDP2 model for 15
    steps, then OffloadAdamW loads its state_dict() (each rank's DTensor moments) and
    goes on (or DCP's get_optimizer_state_dict of it, keyed by parameter name, as
    torchtitan's checkpoints hold it); held to the same reference, and its update
    counter reaches 30.  (Mutation:
    the moments not loaded: losses 2e-2 apart, masters 17%, 15 updates.)"""
    ref, res = load(two_ranks, reference_of(mode), 2), load(two_ranks, mode, 2)
    p0 = initial()
    tol = 1e-2
    for r in range(2):
        a, b = torch.tensor(res[r]["losses"]), torch.tensor(ref[r]["losses"])
        rel = ((a - b).abs() / b.abs()).max()
        assert rel < tol, (mode, r, rel, a, b)
        assert b[-1] < b[0] - 0.5  # training moved: the comparison means something
        m = moved_rel(res[r]["master"], ref[r]["master"], p0)
        assert m < 0.10, (mode, r, m)
        if "fp32shards" in mode:  # made 16-bit in place (2 B/param/world), unless FSDP2 computes in fp32
            want = "torch.float32" if "fp32compute" in mode else "torch.bfloat16"
            assert {dt for dt, _ in res[r]["local"].values()} == {want}, r
        if "frozen" in mode:  # left as torch.optim leaves it: its bf16 start, exactly
            wpe = "transformer.wpe.weight"
            assert torch.equal(res[r]["master"][wpe], p0[wpe].bfloat16().float()), r
    # the global norm (FSDP2's group) clipped the same steps on both ranks
    assert res[0]["norms"] == res[1]["norms"]
    st = res[0]["stats"]
    assert st["updates"] == STEPS and st["mode"] == ("dpu" if "dpu" in mode else "exact")


def test_every_term_of_the_update_matches_teacher_forced_adamw(two_ranks):
    """The FSDP2 reference above runs on its own weights, so chaos allows it 10% of the
    distance moved; here torch AdamW is fed the offloaded run's own gradient shards
    (tests/helpers/fsdp2_worker.py Shadow: teacher forcing, each rank its rows, the
    global norm's clip) and the masters agree to within 2e-6 of the distance moved
    (measured: 2.0e-7).  Weight decay is about 1% of that distance, the bias
    correction, betas and the clip far more.  (Mutation: every group's weight_decay set
    to 0 on the FSDP2 path (OffloadAdamW's param_groups, which the engine reads) moves it
    to 3.8e-3.)"""
    p0 = initial()
    for r, res in enumerate(load(two_ranks, "offload+sync+shadow", 2)):
        rel = moved_rel(res["master"], res["shadow"], p0)
        print(f"rank {r}: masters {rel:.2e} of the distance moved from the teacher-forced reference")
        assert rel < 2e-6, (r, rel)
        assert max(res["norms"]) > 0.5  # the clip (CLIP = 0.5) fired: its coefficient is tested too


@pytest.mark.parametrize("mode,resumed", [("offload", "offload+resume"), ("dpu", "dpu+resume"),
                                          ("offload", "offload+resume+statedir"),
                                          ("offload+fp32shards", "offload+fp32shards+resume")])
def test_torch_save_of_each_ranks_state_dict_resumes_bitwise(two_ranks, mode, resumed):
    """Halfway, each rank torch.saves model.state_dict() and opt.state_dict() (no
    state_dir), a new FSDP2 model and a new OffloadAdamW load them and go on: losses,
    clip norms and final masters bitwise those of the uninterrupted run, sync and DPU
    (whose state dict carries the device weights the delayed update left), and with
    state_dir (the state dict then names a checkpoint in the shared layout).  (Mutation:
    load_state_dict not loading the state's files fails it: the new optimizer starts
    its master from the bf16 weights with zero moments.)"""
    whole, resumed = load(two_ranks, mode, 2), load(two_ranks, resumed, 2)
    for r in range(2):
        assert resumed[r]["losses"] == whole[r]["losses"], r
        assert resumed[r]["norms"] == whole[r]["norms"], r
        for n, v in whole[r]["master"].items():
            assert torch.equal(resumed[r]["master"][n], v), (r, n)


def test_mode_exact_on_fsdp2_is_bitwise_sync(two_ranks):
    """Mode "exact" under FSDP2, the engine's own pick and speculation forced: losses, clip
    norms and final masters bitwise those of sync forced, on both ranks; speculation did
    run (clipping at 0.5 rolls it back).  (Mutation: the shard keeping a speculation whose
    clip key differs from the STEP's, in shard_speculation._settle, fails it.)"""
    sync = load(two_ranks, "offload+sync+shadow", 2)
    for mode in ("offload", "offload+speculation"):
        res = load(two_ranks, mode, 2)
        for r in range(2):
            assert res[r]["losses"] == sync[r]["losses"], (mode, r)
            assert res[r]["norms"] == sync[r]["norms"], (mode, r)
            for k, v in sync[r]["master"].items():
                assert torch.equal(res[r]["master"][k], v), (mode, r, k)
    assert load(two_ranks, "offload+speculation", 2)[0]["stats"]["spec_steps"] > 0


def test_local_shards_are_the_engines_device_weights_where_it_has_its_own(two_ranks):
    """Where the engine's weights are a tensor of its own (a GPU; here a CPU without
    zero-copy), FSDP2's local shards are views of it (LocalShards.alias): one copy of the
    16-bit weights on the device, 2 B/param/world, not the engine's and FSDP2's.  Every
    trainable shard of this model divides evenly over 2 ranks, so every one is aliased;
    with zero-copy (the CPU's default) none is (the engine's weights move between two
    slots).  Training is bitwise the zero-copy run's: losses, clip norms, final masters,
    with and without DPU.  (Mutations: alias() not called: the count is 0; the copy back
    skipped for every shard, aliased or not, fails the zero-copy run's losses.)"""
    for mode, base in (("offload+nozerocopy", "offload"), ("dpu+nozerocopy", "dpu")):
        res, ref = load(two_ranks, mode, 2), load(two_ranks, base, 2)
        for r in range(2):
            n_trained = len(res[r]["local"])  # every parameter trains in these runs
            assert res[r]["in_flat16"] == n_trained, (mode, r, res[r]["in_flat16"], n_trained)
            assert ref[r]["in_flat16"] == 0, (base, r)
            assert res[r]["losses"] == ref[r]["losses"], (mode, r)
            assert res[r]["norms"] == ref[r]["norms"], (mode, r)
            for k, v in ref[r]["master"].items():
                assert torch.equal(res[r]["master"][k], v), (mode, r, k)


def test_the_device_holds_16_bit_local_shards_of_1_over_world(two_ranks):
    """Each rank's local shards are bf16 and about 1/world of the model: FSDP2's rows
    of every parameter (torch.chunk on dim 0), nothing gathered or widened.  (Mutation:
    casting the model after fully_shard, or an fp32 model, fails the dtype check.)"""
    p0 = initial()
    total = sum(v.numel() for v in p0.values())
    res = load(two_ranks, "offload", 2)
    for n, v in p0.items():
        rows = torch.arange(v.shape[0]).chunk(2)
        for r in range(2):
            dtype, numel = res[r]["local"][n]
            assert dtype == "torch.bfloat16", (n, dtype)
            assert numel == len(rows[r]) * (v.numel() // v.shape[0]), (n, r, numel)
    local = [sum(numel for _, numel in res[r]["local"].values()) for r in range(2)]
    assert sum(local) == total and max(local) <= total / 2 + 256


def test_three_ranks_uneven_shards(tmp_path):
    """3 ranks: FSDP2's rows of 32-row parameters are 11, 11 and 10; sync OffloadAdamW
    against the reference as above; and without zero-copy, where only some shards can
    view the engine's weights, bitwise the zero-copy run."""
    launch(tmp_path, ["ref", "offload", "offload+nozerocopy"], 3, steps=12)
    p0 = initial()
    for r in range(3):
        ref, res = torch.load(tmp_path / "ref" / f"rank{r}.pt"), torch.load(tmp_path / "offload" / f"rank{r}.pt")
        a, b = torch.tensor(res["losses"]), torch.tensor(ref["losses"])
        assert ((a - b).abs() / b.abs()).max() < 1e-2
        assert moved_rel(res["master"], ref["master"], p0) < 0.10
        # without zero-copy a shard of FSDP2's full padded size views the engine's weights
        # (ranks 0 and 1: 11 of 32 rows, 86 of 256), a shorter one is copied back (rank
        # 2's 10 and 84 rows; its 96-element biases divide evenly); the same bits
        own = torch.load(tmp_path / "offload+nozerocopy" / f"rank{r}.pt")
        if r < 2:
            assert own["in_flat16"] == len(own["local"]), (r, own["in_flat16"])
        else:
            assert 0 < own["in_flat16"] < len(own["local"]), (r, own["in_flat16"])
        assert own["losses"] == res["losses"] and own["norms"] == res["norms"], r


def test_torch_distributed_checkpoint_is_refused_naming_the_fix(tmp_path):
    """DCP's get_state_dict/set_state_dict keep only per-parameter tensors in an
    optimizer's state, and OffloadAdamW's master and moments live in the server: both are
    refused naming per-rank torch.save(opt.state_dict()), and the optimizer is left as it
    was (its lr, no gradient set, the next step trains).  One rank over gloo, in this
    process, the group taken down after.  (Mutation: without the empty per-parameter
    entries in opt.state, DCP first runs a step with zero gradients and lr 0, which the
    engine refuses with a RuntimeError and leaves lr at 0.)"""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tests.helpers.one_rank import one_rank_group, sharded_mlp
    from zero_offload import OffloadAdamW
    with one_rank_group(tmp_path):
        model = sharded_mlp(16)
        opt = OffloadAdamW(model.parameters(), lr=1e-3, model=model, server={"threads": 1})
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        try:
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            with pytest.raises(ValueError, match="torch.distributed.checkpoint.*torch.save\\(opt.state_dict\\(\\)\\)"):
                get_state_dict(model, opt)
            assert opt.param_groups[0]["lr"] == 1e-3
            assert all(p.grad is None for p in model.parameters())
            with pytest.raises(ValueError, match="torch.distributed.checkpoint"):
                set_state_dict(model, opt, model_state_dict=model.state_dict(), optim_state_dict=opt.state_dict())
            before = [p.detach().full_tensor().clone() for p in model.parameters()]
            model(x).float().square().mean().backward()
            opt.step()
            assert opt.stats()["updates"] == 2
            assert any(not torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters()))
        finally:
            opt.close()


def test_construction_clones_no_local_shard_and_fp32_shards_become_16_bit_in_place(tmp_path):
    """One FSDP2 rank in this process (gloo): the proxies LocalShards hands the engine
    are views of the local shards (no second copy of the shards during construction),
    and OffloadAdamW built over an fp32 model with bf16 param_dtype (torchtitan's recipe)
    leaves bf16 local shards: the bytes of the model's local shards halve, the parameters
    stay the same objects (the optimizer's groups hold them), the master holds the fp32
    values exactly, and a step trains.  Without model= the shards stay fp32.
    (Mutations: the proxies cloned fails the storage check; sixteen_bit_shards skipped
    fails the bytes.)"""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zero_offload import OffloadAdamW
    from zero_offload.fsdp2 import LocalShards
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    opts = []
    try:
        def build(with_model: bool):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))  # fp32
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in m:
                fully_shard(layer, mp_policy=mp)
            fully_shard(m, mp_policy=mp)
            params = list(m.parameters())
            start = {n: p.detach().to_local().clone() for n, p in m.named_parameters()}
            opts.append(OffloadAdamW(params, lr=1e-3, model=m if with_model else None, server={"threads": 1}))
            return m, params, start, opts[-1]

        def shard_bytes(m):
            return sum(p.to_local().numel() * p.to_local().element_size() for p in m.parameters())
        m, params, start, opt = build(True)
        probe = LocalShards(params)  # what the engine is handed: views, not copies
        assert all(q.data_ptr() == t.data_ptr() for q, t in zip(probe.proxies, probe.local))
        assert {p.to_local().dtype for p in m.parameters()} == {torch.bfloat16}
        assert all(a is b for a, b in zip(m.parameters(), params))
        fp32_bytes = sum(t.numel() * 4 for t in start.values())
        assert shard_bytes(m) == fp32_bytes // 2
        master = opt.master_state_dict()
        assert all(torch.equal(master[n], start[n]) for n in start)
        for p, n in zip(m.parameters(), start):  # the shards hold the engine's weights: RNE of the fp32 values
            assert torch.equal(p.to_local(), start[n].bfloat16()), n
        m(torch.ones(2, 16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        assert opt.stats()["updates"] == 1
        m2, _, _, _ = build(False)
        assert {p.to_local().dtype for p in m2.parameters()} == {torch.float32}
    finally:
        for o in opts:
            o.close()
        dist.destroy_process_group()


def test_the_units_the_library_shards_a_plain_model_by():
    """fsdp2.units: a Hugging Face model's _no_split_modules (GPT-2's blocks), else the
    largest ModuleList of one class (the demo GPT's blocks), else none (an MLP: the root
    alone); and expert.multi_rank refuses a name it does not know.  (Mutation: units()
    without its ModuleList fallback finds nothing in the demo GPT.)"""
    from tests.helpers.fsdp2_worker import make_model
    from tests.helpers.models import gpt
    from zero_offload import OffloadConfig
    from zero_offload.fsdp2 import units
    hf = make_model()
    assert [type(m).__name__ for m in units(hf)] == ["GPT2Block"] * len(hf.transformer.h)
    demo = gpt()
    assert units(demo) == list(demo.blocks)
    assert units(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())) == []
    with pytest.raises(ValueError, match="expert.multi_rank must be one of"):
        OffloadConfig(expert={"multi_rank": "fsdp"})


def test_the_librarys_own_wrapping_is_the_users_bitwise(tmp_path):
    """expert.multi_rank="fsdp2-zero3" on the plain fp32 GPT-2 (OffloadAdamW calls
    fully_shard on its blocks and the root) against the same model wrapped by the script
    (fp32 shards, each block then the root, bf16 param_dtype; fp32 compute where this CPU
    emulates bf16, as the library picks): losses, masters and the local shards' dtypes
    identical over 12 steps, on 2 ranks.  (Mutation: wrap() without the bf16 param_dtype
    computes in fp32: the losses differ on a host with native bf16 matmul.)"""
    from zero_offload.compute_dtype import resolve
    compute, _ = resolve("auto", "bf16", torch.device("cpu"))
    ref = "offload+fp32shards" + ("+fp32compute" if compute == torch.float32 else "")
    launch(tmp_path, [ref, ref + "+libwrap"], 2, steps=12)
    for r in range(2):
        a, b = (torch.load(tmp_path / m / f"rank{r}.pt") for m in (ref + "+libwrap", ref))
        assert a["losses"] == b["losses"], r
        assert all(torch.equal(a["master"][k], b["master"][k]) for k in b["master"]), r
        assert a["local"] == b["local"], r


def test_ranks_agree_on_the_compute_dtype_of_the_librarys_wrapping(tmp_path):
    """expert.multi_rank with rank 1 alone reading a CPU that emulates bf16 matmul: the
    ranks agree before FSDP2 is set up (fp32 compute if any rank needs it), so both
    compute in fp32 and the run is the fp32-compute run bitwise; unagreed, rank 0 would
    all-gather bf16 and rank 1 fp32.  (Mutation: the all-reduce left out fails the
    comparison on a host with native bf16 matmul; on one without, both ranks pick fp32
    anyway.)"""
    base = "offload+fp32shards+fp32compute+libwrap"  # fp32 compute asked for on both ranks
    # base first: mixedcpu's change to rank 1's CPU reading stays in that process
    launch(tmp_path, [base, "offload+fp32shards+libwrap+mixedcpu"], 2, steps=8)
    for r in range(2):
        a, b = (torch.load(tmp_path / m / f"rank{r}.pt") for m in ("offload+fp32shards+libwrap+mixedcpu", base))
        assert a["losses"] == b["losses"], r
        assert all(torch.equal(a["master"][k], b["master"][k]) for k in b["master"]), r
        assert {dt for dt, _ in a["local"].values()} == {"torch.float32"}, r


DIFFERENT_PATHS = '''
import os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, os.environ["PYTHONPATH"])
dist.init_process_group("gloo")
rank = dist.get_rank()
from zero_offload import OffloadAdamW
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
try:  # "auto" resolves to the built-in path for int8 state, to FSDP2's for fp32
    OffloadAdamW(model.parameters(), lr=1e-3, model=model, state_dtype="int8" if rank == 1 else "fp32",
                 server={"threads": 1}).close()
except ValueError as e:
    open(os.path.join(sys.argv[1], f"err{rank}.txt"), "w").write(str(e))
dist.destroy_process_group()
'''


def test_ranks_resolving_different_multi_rank_paths_both_refuse(tmp_path):
    """Rank 1 given int8 state ("auto": the built-in path), rank 0 fp32 (FSDP2's): the
    path is agreed before either is taken, and both ranks raise naming the options to
    align, instead of rank 0 sharding with FSDP2 while rank 1 waits in the built-in
    path's collectives.  (Mutation: _agree_on_path not called: the launch hangs or fails
    elsewhere, with no such error on both ranks.)"""
    script = tmp_path / "different_paths.py"
    script.write_text(DIFFERENT_PATHS)
    p = subprocess.run([sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", "2", str(script),
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    said = [(tmp_path / f"err{r}.txt").read_text() if (tmp_path / f"err{r}.txt").exists() else "" for r in (0, 1)]
    assert all("different paths" in s and "same offload options" in s for s in said), (said, p.stdout[-2000:],
                                                                                      p.stderr[-2000:])
