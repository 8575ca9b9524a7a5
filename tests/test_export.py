"""zero_offload.export: a checkpoint's fp32 master as the model's state dict, read from
the files alone, against the live engine's master_state_dict() (the server's state)
and loaded by transformers' from_pretrained.  FSDP2's and two ranks' checkpoints:
tests/test_fsdp2_checkpoint.py (the chain's checkpoints against the names' truth)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig, OffloadEngine
from zero_offload.export import export_safetensors, master_state_dict_from_checkpoint, to_16
from zero_offload.server import checkpoint as C
from tests.helpers.models import gpt, gpt_batch, train_engine

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.timeout(240)
SEED = 0
ROOT = Path(__file__).resolve().parent.parent


def tiny_gpt2():
    torch.manual_seed(SEED)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    """A GPT-2 (its lm_head tied to the token embedding) after three OffloadAdamW steps:
    the checkpoint, the live master at the save, and the model's config beside it."""
    d = tmp_path_factory.mktemp("export")
    model = tiny_gpt2()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model)
    g = torch.Generator().manual_seed(SEED)
    for _ in range(3):
        x = torch.randint(0, 96, (2, 16), generator=g)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    path = opt.engine.save_checkpoint(str(d / "ckpt"))
    live = {k: v.clone() for k, v in opt.engine.master_state_dict().items()}
    names = [n for n, _ in model.named_parameters()]  # each parameter once, first name
    opt.engine.close()
    model.config.save_pretrained(d / "hf")
    return d, Path(path), live, names


def test_the_files_hold_the_live_master_under_every_name(gpt2_ckpt):
    """master_state_dict_from_checkpoint reads what the server held at the save, bitwise,
    under every state_dict name, a tied weight's one tensor under both.  (Mutation: a
    row's offset one element off in engine_checkpoint._param_table fails it.)"""
    d, _, live, _ = gpt2_ckpt
    got = master_state_dict_from_checkpoint(d / "ckpt")
    assert sorted(got) == sorted(live)
    for k, v in live.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
    assert got["lm_head.weight"].data_ptr() == got["transformer.wte.weight"].data_ptr()


def test_safetensors_loads_in_transformers_and_bf16_rounds_as_torch(gpt2_ckpt, tmp_path):
    """The safetensors file: each parameter once under its first name (the tied head in
    the metadata's aliases), bitwise the live master; GPT2LMHeadModel.from_pretrained of
    it and the config has the master's values, head included; --dtype bf16 / fp16 are
    torch's round-to-nearest-even of the master.  (Mutations: to_16 truncating instead
    of rounding fails the bf16 check; the header's shapes transposed fail from_pretrained.)"""
    d, _, live, names = gpt2_ckpt
    hf = d / "hf"
    export_safetensors(d / "ckpt", hf / "model.safetensors", overwrite=True)
    f = safetensors_torch.load_file(hf / "model.safetensors")
    assert sorted(f) == sorted(names)
    for k in names:
        assert torch.equal(f[k], live[k]), k
    from safetensors import safe_open
    with safe_open(hf / "model.safetensors", "pt") as s:
        meta = s.metadata()
    assert meta["format"] == "pt" and json.loads(meta["aliases"]) == {"lm_head.weight": "transformer.wte.weight"}
    model = transformers.GPT2LMHeadModel.from_pretrained(hf)
    for k, v in model.state_dict().items():
        if k in live:
            assert torch.equal(v, live[k]), k
    assert torch.equal(model.lm_head.weight, live["transformer.wte.weight"])
    for dt, tdt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        export_safetensors(d / "ckpt", tmp_path / f"{dt}.safetensors", dtype=dt)
        f = safetensors_torch.load_file(tmp_path / f"{dt}.safetensors")
        for k in names:
            assert f[k].dtype == tdt and torch.equal(f[k], live[k].to(tdt)), (dt, k)


def test_a_sharded_export_is_what_save_pretrained_writes_and_loads_in_transformers(gpt2_ckpt, tmp_path, monkeypatch):
    """--max-shard-size: files of at most that many bytes of tensors (a larger parameter
    alone in its file), named and indexed as transformers' save_pretrained names them;
    from_pretrained of the directory has the master's values, tied head included, and
    the index's weight_map and total_size are the files'.  One file's worth gives
    model.safetensors and no index, and an export over an earlier one (overwrite)
    leaves none of the earlier shards behind.  (Mutations: _plan opening a new file
    only after the limit is passed makes a file over the limit; writing the index
    before the shards is not seen here, only in a crash.)"""
    import shutil
    d, _, live, names = gpt2_ckpt
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(d / "hf" / "config.json", out)
    limit = 12_000  # bytes of fp32 tensors: wte (96 x 32 x 4 = 12288) is over it
    _cli(d / "ckpt", out, "--max-shard-size", f"{limit / 1000}KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 3 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(index["weight_map"]) == sorted(names)
    total = 0
    for name in files:
        f = safetensors_torch.load_file(out / name)
        size = sum(t.numel() * t.element_size() for t in f.values())
        assert size <= limit or len(f) == 1, (name, size)
        total += size
        for k, t in f.items():
            assert index["weight_map"][k] == name and torch.equal(t, live[k]), k
    assert index["metadata"]["total_size"] == total
    model = transformers.GPT2LMHeadModel.from_pretrained(out)
    for k, v in model.state_dict().items():
        if k in live:
            assert torch.equal(v, live[k]), k
    assert torch.equal(model.lm_head.weight, live["transformer.wte.weight"])
    # it all fits: one model.safetensors, and the earlier export's shards and index are gone
    p = _cli(d / "ckpt", out, "--max-shard-size", "5GB", check=False)
    assert p.returncode == 1 and "--overwrite" in p.stderr
    _cli(d / "ckpt", out, "--max-shard-size", "5GB", "--overwrite")
    assert sorted(x.name for x in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == export_safetensors(
        d / "ckpt", tmp_path / "one.safetensors").read_bytes()
    # an overwrite that fails half-way leaves no index (the old one would name a mix of
    # two exports' shards): mutation, not removing the old index first, fails it
    from zero_offload import export as E
    _cli(d / "ckpt", out, "--max-shard-size", f"{limit / 1000}KB", "--overwrite")
    assert (out / "model.safetensors.index.json").exists()
    written = []

    def fail_second(path, *a, **k):
        if written:
            raise OSError("disk full (the test's)")
        written.append(path)
        return real(path, *a, **k)
    real = E._write_file
    monkeypatch.setattr(E, "_write_file", fail_second)
    with pytest.raises(OSError, match="the test's"):
        E.export_safetensors(d / "ckpt", out, max_shard_bytes=limit, overwrite=True)
    assert not (out / "model.safetensors.index.json").exists()
    from zero_offload.export import parse_size
    assert (parse_size("5GB"), parse_size("2GiB"), parse_size("1.5 MB"), parse_size("77")) == \
        (5 * 10 ** 9, 2 << 30, 1_500_000, 77)
    with pytest.raises(ValueError, match="KB, MB, GB"):
        parse_size("5 potatoes")


def test_to_16_rounds_to_nearest_even_like_torch():
    """Every tie, carry, infinity and NaN: to_16's bf16 bits are torch's (seeded draw)."""
    g = np.random.default_rng(SEED)
    bits = np.concatenate([g.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32),
                           np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001,
                                     0x7F800001, 0xFFFFFFFF, 0x00008000, 0x80018000], np.uint32)])
    x = bits.view(np.float32)
    got = torch.from_numpy(to_16(x, "bf16").view(np.int16)).view(torch.bfloat16)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_an_aligned_layout_exports_around_its_padding(tmp_path):
    """A layout with each parameter at a multiple of 128 elements (a GPU's default) has
    gaps between the parameters: the export skips them.  Against the live master."""
    torch.manual_seed(SEED)
    with OffloadEngine(gpt(), OffloadConfig(lr=3e-3, dtype="bf16", expert={"param_align_numel": 128},
                                            server={"threads": 1})) as eng:
        train_engine(eng, gpt_batch, 2, "bf16")
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        live = {k: v.clone() for k, v in eng.master_state_dict().items()}
    rows = _engine_json(tmp_path / "ckpt")["params"]
    ends = [r["offset"] + int(np.prod(r["shape"])) for r in rows]
    assert all(r["offset"] % 128 == 0 for r in rows)
    assert any(e < r["offset"] for e, r in zip(ends, rows[1:]))  # gaps: padding between parameters
    export_safetensors(tmp_path / "ckpt", tmp_path / "m.safetensors")
    f = safetensors_torch.load_file(tmp_path / "m.safetensors")
    assert sorted(f) == sorted(r["names"][0] for r in rows)
    for r in rows:
        for name in r["names"]:
            assert torch.equal(f[r["names"][0]], live[name]), name


def _engine_json(root: Path) -> dict:
    return json.loads(C.rank_file(C.resolve(root), C.ENGINE, 0, 1, ".json").read_text())


def _cli(*args, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "zero_offload.export", *map(str, args)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_the_cli_exports_on_a_machine_without_torch(gpt2_ckpt, tmp_path):
    """The export is for a machine that has the checkpoint and not the training
    environment: with torch unimportable the CLI writes the same bytes as with it.
    (Mutation: `import torch` at the top of runtime/export.py fails it.)"""
    d = gpt2_ckpt[0]
    code = ("import sys; sys.modules['torch'] = None\n"
            "from zero_offload.export import main\n"
            f"sys.exit(main([{str(d / 'ckpt')!r}, {str(tmp_path / 'no_torch.safetensors')!r}, '--dtype', 'bf16']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    _cli(d / "ckpt", tmp_path / "with_torch.safetensors", "--dtype", "bf16")
    assert (tmp_path / "no_torch.safetensors").read_bytes() == (tmp_path / "with_torch.safetensors").read_bytes()


def test_bad_input_is_refused_naming_the_fix_and_loses_nothing(gpt2_ckpt, tmp_path):
    """An existing output (kept unless --overwrite), a flipped bit in a shard file, a
    checkpoint from before the parameter table, a table claiming more than the flat
    space, not a checkpoint: each exits 1 saying what to do, and writes nothing.
    (Mutation: verify skipped by default fails the flipped bit's case.)"""
    import shutil
    d, step, live, _ = gpt2_ckpt
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"mine")
    p = _cli(d / "ckpt", out, check=False)
    assert p.returncode == 1 and "--overwrite" in p.stderr and out.read_bytes() == b"mine"
    _cli(d / "ckpt", out, "--overwrite")
    assert out.stat().st_size > 4

    bad = tmp_path / "bad"
    shutil.copytree(step, bad)
    shard = C.rank_file(bad, C.SHARD, 0, 1, ".bin")
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1
    shard.write_bytes(bytes(raw))
    p = _cli(bad, tmp_path / "x.safetensors", check=False)
    assert p.returncode == 1 and "is corrupt" in p.stderr and "earlier step-N" in p.stderr
    assert _cli(bad, tmp_path / "x.safetensors", "--no-verify").returncode == 0  # asked for: read as it is

    for name, edit, said in (("old", lambda m: m.pop("params"), "engine.load_checkpoint"),
                             ("big", lambda m: m["params"][-1].update(shape=[10 ** 9]), "past the flat space")):
        q = tmp_path / name
        shutil.copytree(step, q)
        ej = C.rank_file(q, C.ENGINE, 0, 1, ".json")
        meta = json.loads(ej.read_text())
        edit(meta)
        ej.write_text(json.dumps(meta))
        p = _cli(q, tmp_path / f"{name}.safetensors", check=False)
        assert p.returncode == 1 and said in p.stderr, p.stderr
    p = _cli(tmp_path, tmp_path / "y.safetensors", check=False)
    assert p.returncode == 1 and "holds no checkpoint" in p.stderr
    assert sorted(x.name for x in tmp_path.iterdir() if x.is_file()) == ["m.safetensors", "x.safetensors"]


def test_a_0_3e9_parameter_checkpoint_exports_in_bounded_memory(tmp_path):
    """Size is a dimension of correctness: a 0.3e9-parameter model (one embedding table,
    bf16 state) exports through the CLI with a peak RSS far below its 1.2 GB master (the
    export streams), and the file is the live master, bitwise.  (Mutation: reading the
    whole master into one array before writing fails the RSS bound.)"""
    n_rows, dim = 300_000, 1000
    torch.manual_seed(SEED)
    model = torch.nn.Embedding(n_rows, dim)
    idx = torch.randint(0, n_rows, (64,), generator=torch.Generator().manual_seed(SEED))
    with OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", state_dtype="bf16")) as eng:
        eng.backward(eng.model(idx).float().square().mean())
        eng.step()
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        live = eng.master_state_dict()["weight"].clone()
    out = tmp_path / "m.safetensors"
    # VmHWM, the peak of this process's own memory (ru_maxrss would count the pytest process it was forked from)
    code = ("import sys; from zero_offload.export import main; rc = main(sys.argv[1:]); "
            "print('maxrss_kb', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); "
            "sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt"), str(out)], capture_output=True,
                       text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rss = int(p.stdout.split("maxrss_kb")[1].split()[0]) * 1024
    print(p.stdout.strip(), f"master {live.numel() * 4 / 1e9:.2f} GB")
    assert rss < live.numel() * 4 / 4, rss  # ~64 MiB of buffer, the interpreter and numpy: far below a copy
    from safetensors import safe_open
    with safe_open(out, "pt") as s:
        got = s.get_tensor("weight")
    assert got.shape == (n_rows, dim) and torch.equal(got, live)
