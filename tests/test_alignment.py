"""Parameter alignment in the flat space (runtime.flat, the GPU issue's D5): each
parameter starts at a multiple of param_align_numel elements (128 on a GPU: 256 bytes),
the gaps are zeros everywhere, and training is bitwise that of the packed layout
(the update is elementwise; the clip's norm sums the same values plus zeros).  Run on
the CPU device with the alignment forced, so every path the GPU's layout takes is
checked here too."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from zero_offload.server.checkpoint import CheckpointError
from zero_offload import OffloadConfig, OffloadEngine
from zero_offload.flat import FlatParams
from tests.helpers.models import gpt, gpt_batch, train_engine

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("align", [1, 16, 128])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_layout_aligns_each_parameter_and_covers_every_shard(align, world):
    """Offsets are multiples of align; buckets and groups tile [0, numel) with no hole;
    each shard's runs tile the shard.  (Mutation: starting a run at its span's offset
    instead of where the last run ended leaves each gap outside every STEP range.)"""
    torch.manual_seed(0)
    sizes = [5, 130, 7, 300, 1, 64, 129]
    ps = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    groups = [0, 0, 1, 1, 0, 1, 1]
    f = FlatParams(ps, bucket_numel=1024, world_size=world, groups=groups, align=align)
    assert f.param_numel == sum(sizes)
    assert all(s.offset % align == 0 and 0 <= s.lead < align for s in f.spans)
    ends = [0] + [s.offset + s.numel for s in f.spans[:-1]]
    assert [s.offset - s.lead for s in f.spans] == ends  # each gap lies right before its span
    assert f.has_gaps == (align > 1)
    assert f.buckets[0].lo == 0 and f.buckets[-1].hi == f.numel
    assert all(a.hi == b.lo for a, b in zip(f.buckets, f.buckets[1:]))
    assert f.group_ranges[0][1] == 0 and f.group_ranges[-1][2] == f.numel
    assert all(a[2] == b[1] for a, b in zip(f.group_ranges, f.group_ranges[1:]))
    for r in range(world):
        runs = f.shard_runs(r, list(range(len(sizes))))
        assert runs[0][1] == 0 and runs[-1][2] == f.shard_numel
        assert all(a[2] == b[1] for a, b in zip(runs, runs[1:]))


def _run(tmp_path, align, steps=8, **kw):
    model = gpt()
    expert = {"param_align_numel": align, "progress_block_numel": 256, "bucket_numel": 4096, **kw.pop("expert", {})}
    cfg = OffloadConfig(lr=3e-3, weight_decay=0.1, dtype="bf16", server={"threads": 1}, expert=expert, **kw)
    with OffloadEngine(model, cfg) as eng:
        flat16 = eng.flat16
        for s in eng.flat.spans:  # the alignment holds in memory, relative to flat16
            assert (s.param.data_ptr() - flat16.data_ptr()) % (align * flat16.element_size()) == 0
        losses = train_engine(eng, gpt_batch, steps, "bf16")
        eng.synchronize(copy_weights=True)
        st = eng.stats()
        master = eng.master_state_dict()
        shard = torch.from_numpy(eng.client.get_master().copy())
        gaps = [(s.offset - s.lead, s.offset) for s in eng.flat.spans if s.lead]
        w = [p.detach().clone() for p in model.parameters()]
        for a, b in gaps:  # zeros in the master and the device weights
            assert not shard[a:b].any() and not eng.flat16[a:b].any(), (a, b)
        assert st["num_params"] == eng.flat.param_numel
        # the traffic: 2 B down per element of the flat space, the parameters' and the gaps'
        assert st["bytes_to_host"] == 2 * eng.flat.numel * steps
        ids = {id(t): n for n, t in master.items()}
        return losses, {ids[id(t)]: t.clone() for t in master.values()}, w, eng.flat.numel


@pytest.mark.parametrize("mode", ["zero-copy", "dpu", "overlap-spec", "clip"])
def test_aligned_training_is_bitwise_the_packed_layout(tmp_path, mode):
    """fp32 state (elementwise; bf16/int8 state's stochastic rounding is keyed by the flat
    index, so its draws move with the layout): losses, masters and device weights bitwise
    those of the packed run.  zero-copy: 16-bit compute, the parameters in the shared
    slots; overlap-spec: the per-module copies up and speculation's ready prefix, which
    must not announce a gap before it is zeroed.  (Mutation: dropping the gap's zeroing in
    HostDirectStep._take leaves the staging window's bytes there: the gap's master moves.)"""
    kw = {"zero-copy": dict(expert={"compute_dtype": "bf16"}),
          "dpu": dict(mode="dpu", expert={"dpu_warmup_steps": 3}),
          "overlap-spec": dict(expert={"exact_strategy": "overlap_update+speculation", "undo_log_bytes": 1 << 26}),
          "clip": dict(clip_grad_norm=0.5)}[mode]
    packed = _run(tmp_path, 1, **kw)
    aligned = _run(tmp_path, 128, **kw)
    assert aligned[3] > packed[3]  # there are gaps
    if mode != "clip":
        assert aligned[0] == packed[0]
        for n in packed[1]:
            assert torch.equal(aligned[1][n], packed[1][n]), n
        for a, b in zip(aligned[2], packed[2]):
            assert torch.equal(a, b)
    else:  # the norm sums the same squares in another order: within rounding
        for n in packed[1]:
            assert torch.allclose(aligned[1][n], packed[1][n], rtol=1e-5, atol=1e-7), n


def test_aligned_checkpoint_resumes_and_a_packed_one_is_refused_naming_the_fix(tmp_path):
    """An aligned checkpoint resumes an aligned engine bitwise; a checkpoint from the other
    layout is refused before anything is touched, naming param_align_numel, and loads once
    it is set."""
    model = gpt()

    def cfg(align):
        return OffloadConfig(lr=3e-3, dtype="bf16", mode="dpu", server={"threads": 1},
                             expert={"param_align_numel": align, "dpu_warmup_steps": 2})
    with OffloadEngine(copy.deepcopy(model), cfg(128)) as eng:
        train_engine(eng, gpt_batch, 4, "bf16")
        eng.save_checkpoint(str(tmp_path / "aligned"))
        want = train_engine(eng, gpt_batch, 3, "bf16", start=5)
    with OffloadEngine(copy.deepcopy(model), cfg(1)) as eng:
        train_engine(eng, gpt_batch, 4, "bf16")
        eng.save_checkpoint(str(tmp_path / "packed"))
        want_packed = train_engine(eng, gpt_batch, 3, "bf16", start=5)
    with OffloadEngine(copy.deepcopy(model), cfg(128)) as eng:
        before = np.array(eng.client.get_master())
        with pytest.raises(CheckpointError, match=r"'param_align_numel': 1"):
            eng.load_checkpoint(str(tmp_path / "packed"))
        assert np.array_equal(np.array(eng.client.get_master()), before)  # nothing was touched
        eng.load_checkpoint(str(tmp_path / "aligned"))
        assert train_engine(eng, gpt_batch, 3, "bf16", start=5) == want
    with OffloadEngine(copy.deepcopy(model), cfg(1)) as eng:
        eng.load_checkpoint(str(tmp_path / "packed"))
        assert train_engine(eng, gpt_batch, 3, "bf16", start=5) == want_packed
