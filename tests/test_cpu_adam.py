"""cython_ext.cpu_adam against independent references.

Adam/AdamW and Adagrad are checked against torch.optim in float64 on the same
(16-bit) gradients; Lion against a float64 NumPy transcription of its paper.
Every SIMD path this CPU has is run, and compared with the scalar path.
"""
import numpy as np
import pytest
import torch

from tests.helpers import seeded_rng
from tests.helpers.simd import LEVELS, level  # noqa: F401  (level: a fixture)

from zero_offload.kernels import cpu_adam as ca

DT16 = {"fp16": torch.float16, "bf16": torch.bfloat16}



def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    den = np.linalg.norm(b)
    return np.linalg.norm(a - b) / den if den > 0 else np.linalg.norm(a - b)


def _buffers(rng, n, offset):
    """fp32 state at an odd offset into a larger array (unaligned on purpose)."""
    def make(x, dtype):
        big = np.zeros(n + offset + 3, dtype)
        big[offset:offset + n] = x
        return big[offset:offset + n]
    p0 = rng.standard_normal(n).astype(np.float32)
    return make(p0, np.float32), make(np.zeros(n), np.float32), make(np.zeros(n), np.float32), p0


@pytest.mark.parametrize("n,offset", [(0, 0), (1, 0), (15, 0), (17, 0), (1000, 0), (1000, 3), (1_000_003, 0)])
@pytest.mark.parametrize("adamw", [True, False])
def test_adam_matches_torch_float64(level, n, offset, adamw):
    """20 steps on fresh random data.  Short lengths are run as many independent
    calls (each a kernel call of exactly n elements at an odd offset) pooled into
    one error norm: one element's update can be as small as its own fp32 ulp."""
    rng = seeded_rng()
    reps = max(1, 2048 // max(n, 1))
    total = n * reps
    p, m, v, p0 = _buffers(rng, total, offset)
    out = np.empty(total, np.float16)
    ref = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref], **hp)
    scale = 1.0 / 1024.0
    for t in range(1, 21):
        g16 = (rng.standard_normal(total) * 1024.0).astype(np.float16)
        for r in range(reps):
            s = slice(r * n, (r + 1) * n)
            ca.adam_step(p[s], m[s], v[s], g16[s], out[s], step=t, lr=1e-2, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.1, adamw=adamw, grad_scale=scale, num_threads=2)
        ref.grad = torch.tensor(g16.astype(np.float64) * scale)
        opt.step()
    if n == 0:
        return
    st = opt.state[ref]
    r = ref.detach().numpy()
    assert rel(p, r) < 1e-6
    assert rel(m, st["exp_avg"].numpy()) < 1e-6
    assert rel(v, st["exp_avg_sq"].numpy()) < 1e-6
    assert rel(p.astype(np.float64) - p0, r - p0) < 1e-4
    # the 16-bit copy is exactly round-to-nearest-even of the fp32 result
    np.testing.assert_array_equal(out, torch.from_numpy(p.copy()).to(torch.float16).numpy())


def test_grad_scale_equals_prescaled_gradient(level):
    rng = seeded_rng()
    n = 4099
    a = [x.copy() for x in _buffers(rng, n, 0)[:3]]
    b = [x.copy() for x in a]
    for t in range(1, 6):
        g = (rng.standard_normal(n) * 8).astype(np.float32)
        ca.adam_step(*a, g, step=t, lr=1e-3, grad_scale=0.25)
        ca.adam_step(*b, g * np.float32(0.25), step=t, lr=1e-3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("which", ["adam", "adagrad", "lion"])
@pytest.mark.parametrize("gdt", ["fp16", "bf16", "fp32"])
@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU has no SIMD path to compare with the scalar one")
def test_simd_paths_agree_with_scalar(which, gdt):
    rng = seeded_rng()
    n = 70_001
    g32 = rng.standard_normal(n).astype(np.float32)
    if gdt == "fp16":
        g, kw = g32.astype(np.float16), {}
    elif gdt == "bf16":
        g, kw = torch.from_numpy(g32).to(torch.bfloat16).view(torch.int16).numpy(), {"grad_dtype": "bf16"}
    else:
        g, kw = g32, {}
    p0 = rng.standard_normal(n).astype(np.float32)
    s0 = np.abs(rng.standard_normal(n)).astype(np.float32)

    def run():
        p, s1, s2 = p0.copy(), s0.copy(), s0.copy() * 0.5
        out = np.empty(n, np.float16)
        if which == "adam":
            ca.adam_step(p, s1, s2, g, out, step=3, lr=1e-3, weight_decay=0.01, **kw)
        elif which == "adagrad":
            ca.adagrad_step(p, s1, g, out, lr=1e-2, weight_decay=0.01, **kw)
        else:
            ca.lion_step(p, s1, g, out, lr=1e-4, weight_decay=0.1, **kw)
        return p, s1, s2, out
    _bitwise_at_every_level(run)


def _bitwise_at_every_level(run) -> None:
    """run() at each SIMD level; every array it returns bitwise the scalar level's (the same
    IEEE operations in the same order)."""
    results = {}
    for lv in LEVELS:
        prev = ca.set_simd_level(lv)
        try:
            results[lv] = [x.view(np.uint32 if x.dtype == np.float32 else np.uint16) for x in run()]
        finally:
            ca.set_simd_level(prev)
    for lv, res in results.items():
        for x, y in zip(res, results["scalar"]):
            np.testing.assert_array_equal(x, y, err_msg=lv)


# Every combination of the Adam loop's optional operations (the AVX2 loop is compiled
# once per combination: grad_scale != 1, an L2 term, decoupled decay != 1) and DPU's
# prediction, each against the scalar loop, bitwise.
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("decay", ["adamw", "adamw-wd0", "adam-l2", "adam"])
@pytest.mark.parametrize("predict", [0.0, 1.0])
@pytest.mark.parametrize("gdt", ["fp16", "bf16", "fp32"])
@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU has no SIMD path to compare with the scalar one")
def test_every_adam_variant_agrees_with_scalar_bitwise(scale, decay, predict, gdt):
    rng = seeded_rng()
    n = 20_011
    g32 = rng.standard_normal(n).astype(np.float32)
    kw = dict(grad_scale=scale, predict=predict,
              adamw=decay.startswith("adamw"), weight_decay=0.0 if decay in ("adamw-wd0", "adam") else 0.05)
    if gdt == "fp16":
        g = g32.astype(np.float16)
    elif gdt == "bf16":
        g, kw["grad_dtype"], kw["out_dtype"] = torch.from_numpy(g32).to(torch.bfloat16).view(torch.int16).numpy(), "bf16", "bf16"
    else:
        g = g32
    p0 = rng.standard_normal(n).astype(np.float32)
    s0 = np.abs(rng.standard_normal(n)).astype(np.float32)

    def run():
        p, m, v = p0.copy(), s0.copy() - 0.5, s0.copy() * 0.5
        out = np.empty(n, np.int16 if gdt == "bf16" else np.float16)
        ca.adam_step(p, m, v, g, out, step=5, lr=1e-3, **kw)
        return p, m, v, out
    _bitwise_at_every_level(run)


def test_fp16_words_with_keyword_equal_float16_arrays():
    rng = seeded_rng()
    n = 4099
    g = rng.standard_normal(n).astype(np.float16)
    a = [rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    b = [x.copy() for x in a]
    out_a, out_b = np.empty(n, np.float16), np.empty(n, np.uint16)
    ca.adam_step(*a, g, out_a, step=1, lr=1e-3)
    ca.adam_step(*b, g.view(np.uint16), out_b, step=1, lr=1e-3, grad_dtype="fp16", out_dtype="fp16")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(out_a.view(np.uint16), out_b)
    assert ca.grad_sumsq(g.view(np.uint16), grad_dtype="fp16") == ca.grad_sumsq(g)


def test_threads_bitwise_identical():
    """Any thread count, and progress blocks that do not divide among the threads (each
    range is split into one part per thread), give the one-thread bits."""
    if not ca.openmp_enabled():
        pytest.skip("built without OpenMP")
    rng = seeded_rng()
    n = 3_000_017
    base = [x.copy() for x in _buffers(rng, n, 0)[:3]]
    g = rng.standard_normal(n).astype(np.float16)
    res = []
    for nt, block in ((1, 0), (2, 0), (3, 0), (7, 0), (3, 5 * 65536 + 16), (5, 1 << 20)):
        bufs = [x.copy() for x in base]
        out = np.empty(n, np.float16)
        word = np.zeros(1, np.uint64)
        ca.adam_step(*bufs, g, out, step=1, lr=1e-3, num_threads=nt, progress=word if block else None,
                     progress_tag=1, progress_block=block)
        res.append(bufs + [out])
    for r in res[1:]:
        for a, b in zip(res[0], r):
            np.testing.assert_array_equal(a, b)


def test_fp16_conversions_exhaustive(level):
    """Every finite fp16 value loads exactly; every fp32 rounds like torch (RNE)."""
    h = np.arange(65536, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h)]
    n = h.size
    p, m, v = np.zeros(n, np.float32), np.full(n, 7.0, np.float32), np.zeros(n, np.float32)
    # beta1 = 0 makes m == g exactly
    ca.adam_step(p, m, v, h, step=1, lr=0.0, beta1=0.0)
    np.testing.assert_array_equal(m, h.astype(np.float32))
    # fp32 -> fp16 over all exponents, subnormals, ties and overflow
    rng = seeded_rng()
    bits = rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32)
    f = bits.view(np.float32)
    f = f[np.isfinite(f)]
    ties = (h.astype(np.float32)[:-1] + h.astype(np.float32)[1:]) / 2  # exact halfway points
    f = np.ascontiguousarray(np.concatenate([f, ties[np.isfinite(ties)], np.float32([65504, 65519.99, 65520, 1e-8, -0.0])]))
    n = f.size
    out16 = np.empty(n, np.float16)
    outbf = np.empty(n, np.uint16)
    z = np.zeros(n, np.float32)
    ca.adam_step(f.copy(), z.copy(), z.copy(), np.zeros(n, np.float16), out16, step=1, lr=0.0)
    ca.adam_step(f.copy(), z.copy(), z.copy(), np.zeros(n, np.float16), outbf, step=1, lr=0.0, out_dtype="bf16")
    t = torch.from_numpy(f)
    np.testing.assert_array_equal(out16.view(np.uint16), t.to(torch.float16).view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(outbf, t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_bf16_grad_and_out_match_reference(level):
    rng = seeded_rng()
    n = 5003
    p0 = rng.standard_normal(n).astype(np.float32)
    p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    out = np.empty(n, np.uint16)
    ref = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.0)
    for t in range(1, 11):
        gb = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
        ca.adam_step(p, m, v, gb.view(torch.int16).numpy(), out, step=t, lr=1e-3,
                     grad_dtype="bf16", out_dtype="bf16")
        ref.grad = gb.double()
        opt.step()
    assert rel(p, ref.detach().numpy()) < 1e-6
    np.testing.assert_array_equal(out, torch.from_numpy(p).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_adagrad_matches_torch(level):
    rng = seeded_rng()
    n = 10_007
    p0 = rng.standard_normal(n).astype(np.float32)
    p, s = p0.copy(), np.zeros(n, np.float32)
    ref = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adagrad([ref], lr=1e-2, eps=1e-10, weight_decay=0.05)
    for _ in range(20):
        g = rng.standard_normal(n).astype(np.float16)
        ca.adagrad_step(p, s, g, lr=1e-2, eps=1e-10, weight_decay=0.05)
        ref.grad = torch.tensor(g.astype(np.float64))
        opt.step()
    r = ref.detach().numpy()
    assert rel(p, r) < 1e-6
    assert rel(s, opt.state[ref]["sum"].numpy()) < 1e-6
    assert rel(p - p0, r - p0) < 1e-4


def test_lion_matches_float64_reference(level):
    """Lion's update is lr * sign(c): where the float64 c lies within fp32 rounding of
    zero its sign is a coin toss between the two (and a flip moves p by 2 lr), so p is
    compared where every step's sign was well conditioned; m, which sign does not
    touch, everywhere."""
    rng = seeded_rng()
    n = 10_007
    p0 = rng.standard_normal(n).astype(np.float32)
    p, m = p0.copy(), np.zeros(n, np.float32)
    rp, rm = p0.astype(np.float64), np.zeros(n)
    lr, b1, b2, wd = 1e-3, 0.9, 0.99, 0.1
    ill = np.zeros(n, bool)
    for _ in range(20):
        g = rng.standard_normal(n).astype(np.float16)
        ca.lion_step(p, m, g, lr=lr, beta1=b1, beta2=b2, weight_decay=wd)
        g64 = g.astype(np.float64)
        c = b1 * rm + (1 - b1) * g64
        # fp32 rounds each term and the sum: 1e-6 relative to the terms is well above that
        ill |= np.abs(c) <= 1e-6 * (np.abs(b1 * rm) + np.abs((1 - b1) * g64)) + 1e-30
        rp = rp * (1 - lr * wd) - lr * np.sign(c)
        rm = b2 * rm + (1 - b2) * g64
    ok = ~ill
    assert ok.mean() > 0.99  # the comparison covers nearly every element
    assert rel(p[ok], rp[ok]) < 1e-6
    assert rel(m, rm) < 1e-6
    assert rel((p - p0)[ok], (rp - p0)[ok]) < 1e-4


def test_predict_writes_extrapolated_weights_only(level):
    rng = seeded_rng()
    n = 4101
    p0 = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float16)
    a = [p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    b = [x.copy() for x in a]
    out_a, out_b = np.empty(n, np.float16), np.empty(n, np.float16)
    ca.adam_step(*a, g, out_a, step=1, lr=1e-2, predict=1.0)
    ca.adam_step(*b, g, out_b, step=1, lr=1e-2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)  # the fp32 update is exact either way
    np.testing.assert_array_equal(out_a, (a[0] + (a[0] - p0)).astype(np.float16))


def test_nonfinite_gradient_is_not_masked():
    n = 64
    p, m, v = np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    g = np.zeros(n, np.float16)
    g[3], g[40] = np.inf, np.nan
    out = np.empty(n, np.float16)
    ca.adam_step(p, m, v, g, out, step=1, lr=1e-3)
    assert not np.isfinite(p[3]) and not np.isfinite(p[40])
    assert np.isnan(out[40]) and np.isfinite(out[0])


def _bad_calls():
    n = 33
    f = lambda: np.ones(n, np.float32)  # noqa: E731
    g = np.ones(n, np.float16)
    # (the exception, what its message must say, the call): a wrong reason fails the test
    return [
        (TypeError, 'grad must be float16', lambda p, m, v: ca.adam_step(p, m, v, np.ones(n, np.float64), step=1, lr=1e-3)),
        (TypeError, 'exp_avg must be float32', lambda p, m, v: ca.adam_step(p, m.astype(np.float64), v, g, step=1, lr=1e-3)),
        (ValueError, 'grad has 34 elements but param has 33', lambda p, m, v: ca.adam_step(p, m, v, np.ones(n + 1, np.float16), step=1, lr=1e-3)),
        (ValueError, 'param_out has 32 elements', lambda p, m, v: ca.adam_step(p, m, v, g, np.empty(n - 1, np.float16), step=1, lr=1e-3)),
        (ValueError, 'grad must be a C-contiguous', lambda p, m, v: ca.adam_step(p, m, v, np.ones(2 * n, np.float16)[::2], step=1, lr=1e-3)),
        (ValueError, 'step must be an int >= 1', lambda p, m, v: ca.adam_step(p, m, v, g, step=0, lr=1e-3)),
        (ValueError, 'lr must be finite, got nan', lambda p, m, v: ca.adam_step(p, m, v, g, step=1, lr=float("nan"))),
        (ValueError, 'lr must be finite, got inf', lambda p, m, v: ca.adam_step(p, m, v, g, step=1, lr=float("inf"))),
        (ValueError, 'beta1 must be in \\[0, 1\\), got 1.0', lambda p, m, v: ca.adam_step(p, m, v, g, step=1, lr=1e-3, beta1=1.0)),
        (ValueError, 'beta2 must be in \\[0, 1\\), got -0.1', lambda p, m, v: ca.adam_step(p, m, v, g, step=1, lr=1e-3, beta2=-0.1)),
        (ValueError, 'eps must be > 0', lambda p, m, v: ca.adam_step(p, m, v, g, step=1, lr=1e-3, eps=0.0)),
        (ValueError, 'num_threads must be an int >= 0', lambda p, m, v: ca.adam_step(p, m, v, g, step=1, lr=1e-3, num_threads=-1)),
        (ValueError, 'param must be 1-D', lambda p, m, v: ca.adam_step(p.reshape(3, 11), m, v, g, step=1, lr=1e-3)),
        (TypeError, "grad_dtype='bf16'", lambda p, m, v: ca.adam_step(p, m, v, g.view(np.uint16), step=1, lr=1e-3)),
        (TypeError, 'buffer protocol', lambda p, m, v: ca.adam_step(p, m, v, [1.0] * n, step=1, lr=1e-3)),
        (TypeError, 'lr must be a real number', lambda p, m, v: ca.adam_step(p, m, v, g, step=1, lr="x")),
        (ValueError, 'beta2 must be in \\[0, 1\\), got 1.5', lambda p, m, v: ca.lion_step(p, m, g, lr=1e-3, beta2=1.5)),
        (ValueError, 'lr and weight_decay must be >= 0', lambda p, m, v: ca.adagrad_step(p, m, g, lr=-1.0)),
    ], f


def test_bad_arguments_raise_and_change_nothing():
    calls, f = _bad_calls()
    for exc, why, call in calls:
        p, m, v = f() * 2, f() * 3, f() * 4
        ro = f()
        ro.flags.writeable = False
        with pytest.raises(exc, match=why):
            call(p, m, v)
        np.testing.assert_array_equal(p, f() * 2)
        np.testing.assert_array_equal(m, f() * 3)
        np.testing.assert_array_equal(v, f() * 4)
    with pytest.raises(ValueError, match="writable"):
        ca.adam_step(ro, f(), f(), np.ones(33, np.float16), step=1, lr=1e-3)


def test_set_simd_level_validates():
    with pytest.raises(ValueError, match="simd level must be one of"):
        ca.set_simd_level("sse9")
    assert ca.simd_level() in ("scalar", "avx2", "avx512")


@pytest.mark.parametrize("gdt", ["fp16", "bf16", "fp32"])
def test_grad_sumsq_matches_float64(level, gdt):
    rng = seeded_rng()
    n = 1_000_003
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    if gdt == "fp16":
        g, kw, ref = x.astype(np.float16), {}, x.astype(np.float16).astype(np.float64)
    elif gdt == "bf16":
        t = torch.from_numpy(x).to(torch.bfloat16)
        g, kw, ref = t.view(torch.int16).numpy(), {"grad_dtype": "bf16"}, t.double().numpy()
    else:
        g, kw, ref = x, {}, x.astype(np.float64)
    exact = float(np.sum(ref * ref))
    one = ca.grad_sumsq(g, num_threads=1, **kw)
    assert abs(one - exact) <= 1e-4 * exact
    if ca.openmp_enabled():
        assert ca.grad_sumsq(g, num_threads=2, **kw) == one  # chunk sums added in order
    assert ca.grad_sumsq(g[:0], **kw) == 0.0


def test_grad_sumsq_propagates_nonfinite():
    g = np.ones(100_000, np.float16)
    g[77_777] = np.inf
    assert ca.grad_sumsq(g) == float("inf")
    g[5] = np.nan
    assert np.isnan(ca.grad_sumsq(g))


# --------------------------------------------------------------------------- progress publication

def _step_all(which, bufs, g, out, **kw):
    if which == "adam":
        ca.adam_step(*bufs, g, out, step=3, lr=1e-3, weight_decay=0.1, **kw)
    elif which == "adagrad":
        ca.adagrad_step(bufs[0], bufs[2], g, out, lr=1e-2, **kw)
    else:
        ca.lion_step(bufs[0], bufs[1], g, out, lr=1e-4, **kw)


@pytest.mark.parametrize("which", ["adam", "adagrad", "lion"])
@pytest.mark.parametrize("n,block", [(0, 7), (1, 1), (1000, 7), (300_001, 65_536), (300_001, 0)])
def test_blocked_update_is_bitwise_the_whole_update(which, n, block):
    """Publishing progress splits the update into blocks; the result must not change,
    and the word ends at (tag << 40) | n."""
    rng = seeded_rng()
    p0 = rng.standard_normal(n).astype(np.float32)
    base = [p0, (0.1 * rng.standard_normal(n)).astype(np.float32), np.abs(rng.standard_normal(n)).astype(np.float32)]
    g = rng.standard_normal(n).astype(np.float16)
    res = []
    for kw in ({}, {"progress": np.zeros(1, np.uint64), "progress_tag": (1 << 24) + 5, "progress_block": block}):
        bufs = [x.copy() for x in base]
        out = np.zeros(n, np.float16)
        _step_all(which, bufs, g, out, num_threads=2, **kw)
        res.append(bufs + [out])
        if kw:
            w = kw["progress"]
            assert int(w[0]) == (5 << ca.PROGRESS_SHIFT) | n  # tag taken mod 2**24
            assert ca.load_progress(w) == n
            assert ca.load_progress(w, tag=5) == n and ca.load_progress(w, tag=(1 << 24) + 5) == n
            assert ca.load_progress(w, tag=4) == 0
    for a, b in zip(*res):
        np.testing.assert_array_equal(a, b)


def test_progress_never_runs_ahead_of_the_weights():
    """A reader polling the word while the update runs on another thread must find
    weights16[:done] already final every time it looks (release/acquire order)."""
    import threading
    rng = seeded_rng()
    n, block = 4_000_000, 65_536
    base = [rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    g = rng.standard_normal(n).astype(np.float16)
    expect = np.zeros(n, np.float16)
    ca.adam_step(*[x.copy() for x in base], g, expect, step=1, lr=1e-2, num_threads=1)
    out = np.zeros(n, np.float16)  # the update writes nonzero weights: zeros mark "not yet"
    word = np.zeros(1, np.uint64)
    t = threading.Thread(target=ca.adam_step, args=(*base, g, out),
                         kwargs=dict(step=1, lr=1e-2, num_threads=1, progress=word, progress_tag=1,
                                     progress_block=block))
    seen = []
    t.start()
    while True:
        done = ca.load_progress(word, tag=1)
        np.testing.assert_array_equal(out[:done], expect[:done])
        seen.append(done)
        if done == n:
            break
        t.join(0.0005)
        assert t.is_alive() or ca.load_progress(word, tag=1) == n, "the update ended without publishing n"
    t.join(10)
    assert seen == sorted(seen) and all(d % block == 0 or d == n for d in seen)
    np.testing.assert_array_equal(out, expect)


def test_progress_arguments_are_validated():
    n = 64
    f = lambda: np.ones(n, np.float32)  # noqa: E731
    g = np.ones(n, np.float16)
    bad = [(TypeError, "got format 'l' with 1", dict(progress=np.zeros(1, np.int64))),
           (TypeError, "with 0 element", dict(progress=np.zeros(0, np.uint64))),
           (ValueError, "progress_tag must be", dict(progress=np.zeros(2, np.uint64)[1:], progress_tag=-1)),
           (ValueError, "progress_block must be", dict(progress=np.zeros(1, np.uint64), progress_block=-1)),
           (ValueError, "8-byte aligned", dict(progress=np.zeros(3, np.uint64).view(np.uint8)[4:12].view(np.uint64)))]
    for exc, why, kw in bad:
        p = f()
        with pytest.raises(exc, match=why):
            ca.adam_step(p, f(), f(), g, step=1, lr=1e-3, **kw)
        np.testing.assert_array_equal(p, f())  # nothing written


@pytest.mark.parametrize("gdt", ["fp16", "bf16"])
@pytest.mark.parametrize("n", [0, 1, 65_537, 1_000_003])
def test_copy_grad_sumsq_copies_and_sums_like_grad_sumsq(level, gdt, n):
    """The fused copy + norm the engine's CPU hooks use: an exact copy, and bitwise the
    sum grad_sumsq gives for the copy, for any thread count; both close to float64."""
    rng = seeded_rng()
    x = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 3).to(DT16[gdt])
    words = x.view(torch.int16).numpy()
    ref = float((x.double() ** 2).sum())
    for nt in (1, 2):
        dst = np.full(n, 7, np.uint16)
        s = ca.copy_grad_sumsq(words, dst, grad_dtype=gdt, num_threads=nt)
        np.testing.assert_array_equal(dst, words.view(np.uint16))
        assert s == ca.grad_sumsq(dst, grad_dtype=gdt, num_threads=nt)
        assert abs(s - ref) <= 1e-4 * ref + 1e-12  # fp32 sums within a chunk, as grad_sumsq


def test_copy_grad_sumsq_validates():
    src = np.ones(8, np.float16)
    for exc, why, dst, kw in [(ValueError, "dst has 7 elements", np.zeros(7, np.uint16), {}),
                              (TypeError, "dst must hold 16-bit values", np.zeros(8, np.float32), {}),
                              (TypeError, "grad_dtype says 'fp32'", np.zeros(8, np.uint16), {"grad_dtype": "fp32"})]:
        with pytest.raises(exc, match=why):
            ca.copy_grad_sumsq(src, dst, **kw)
    with pytest.raises(TypeError, match="grad_dtype"):
        ca.copy_grad_sumsq(np.ones(8, np.uint16), np.zeros(8, np.uint16))  # words need a dtype keyword


@pytest.mark.parametrize("odt", ["fp16", "bf16"])
@pytest.mark.parametrize("n", [0, 1, 17, 1_000_003])
def test_cast_to_16_rounds_as_torch(odt, n):
    """The server's INIT/LOAD cast of the master: torch's round-to-nearest-even,
    infinities and overflow included; NaN stays NaN; any thread count."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-9, 6, n)).astype(np.float32)
    if n > 8:
        x[:8] = [np.nan, np.inf, -np.inf, 65519.0, 65520.0, 1e-30, -0.0, 3e38]
    ref = torch.from_numpy(x).to(DT16[odt]).view(torch.int16).numpy().view(np.uint16)
    for nt in (1, 2):
        out = np.full(n, 7, np.uint16)
        ca.cast_to_16(x, out, out_dtype=odt, num_threads=nt)
        back = torch.from_numpy(out.view(np.int16)).view(DT16[odt]).float().numpy()
        nan = np.isnan(x)
        np.testing.assert_array_equal(out[~nan], ref[~nan])
        assert np.isnan(back[nan]).all()
    f16 = np.empty(n, np.float16)  # a float16 array needs no keyword
    ca.cast_to_16(x, f16)
    if odt == "fp16":
        np.testing.assert_array_equal(f16.view(np.uint16)[~np.isnan(x)], ref[~np.isnan(x)])


def test_cast_to_16_validates():
    for exc, why, src, dst, kw in [
            (ValueError, "dst has 7 elements", np.ones(8, np.float32), np.zeros(7, np.uint16), {"out_dtype": "bf16"}),
            (TypeError, "src must be float32", np.ones(8, np.float64), np.zeros(8, np.uint16), {"out_dtype": "bf16"}),
            (TypeError, "out_dtype='bf16'", np.ones(8, np.float32), np.zeros(8, np.uint16), {}),
            (TypeError, "dst must be float16", np.ones(8, np.float32), np.zeros(8, np.float32), {})]:
        with pytest.raises(exc, match=why):
            ca.cast_to_16(src, dst, **kw)


@pytest.mark.parametrize("shift", [0, 1, 5], ids=["aligned", "unaligned", "unaligned-5"])
@pytest.mark.parametrize("predict", [0.0, 1.0])
def test_out_of_place_update_is_bitwise_in_place(level, shift, predict):
    """read_from (speculation's twin): the old state read from other arrays, the new one
    written to the destinations with streaming stores when they share a 64-byte line
    start (aligned), plain stores otherwise; the same bits as the update in place, and
    the sources untouched.  Overlapping source and destination are refused."""
    from zero_offload.server.state import _zeros64
    rng = seeded_rng()
    n = 4099
    p, m = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    v = np.abs(rng.standard_normal(n)).astype(np.float32)
    g = (rng.standard_normal(n) * 0.1).astype(np.float16)
    kw = dict(step=7, lr=1e-3, weight_decay=0.1, predict=predict)
    ref = [a.copy() for a in (p, m, v)]
    ref_out = np.empty(n, np.float16)
    ca.adam_step(*ref, g, ref_out, **kw)
    dst = [_zeros64(n + 8)[shift * (i + 1) % 3:][:n] if shift else _zeros64(n) for i in range(3)]
    out = np.empty(n, np.float16)
    src = [a.copy() for a in (p, m, v)]
    for lo, hi in [(0, 1000), (1000, 1003), (1003, n)]:  # ranges that start off a line, as param ranges do
        ca.adam_step(*(a[lo:hi] for a in dst), g[lo:hi], out[lo:hi], read_from=tuple(a[lo:hi] for a in src), **kw)
    for a, b in zip(dst, ref):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.array_equal(out.view(np.uint16), ref_out.view(np.uint16))
    for a, b in zip(src, (p, m, v)):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="overlaps"):
        ca.adam_step(*src, g, out, read_from=(src[0], dst[1], dst[2]), **kw)
    with pytest.raises(TypeError, match="read_from"):
        ca.adam_step(*dst, g, out, read_from=(src[0], src[1]), **kw)


def test_out_of_place_update_threads_bitwise_identical():
    """The twin's out-of-place update split over threads (each chunk peels to its own
    line start and fences its streaming stores) gives the one-thread bits."""
    from zero_offload.server.state import _zeros64
    rng = seeded_rng()
    n = 3 * 262144 + 77  # past MIN_PARALLEL: the OpenMP split runs
    src = [rng.standard_normal(n).astype(np.float32) for _ in range(2)] + [np.abs(rng.standard_normal(n)).astype(np.float32)]
    g = (rng.standard_normal(n) * 0.1).astype(np.float16)
    outs = []
    for threads in (1, 2):
        dst = [_zeros64(n) for _ in range(3)]
        o = np.empty(n, np.float16)
        ca.adam_step(*(a[5:] for a in dst), g[5:], o[5:], step=3, lr=1e-3, weight_decay=0.1, num_threads=threads,
                     read_from=tuple(a[5:] for a in src))
        outs.append([a[5:].view(np.uint32).copy() for a in dst] + [o[5:].view(np.uint16).copy()])
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("n", [1000, 4099])
def test_stream_probe_computes_its_pattern(level, n):
    """The bandwidth probe at each level is the documented trivial arithmetic (p += g,
    m += g, v += g * g, out = fp16(p)) on every element, its windows and tails
    included: a bound that skipped elements would flatter the kernel it bounds."""
    rng = seeded_rng()
    g = rng.standard_normal(n).astype(np.float16)
    p0, m0, v0 = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    p, m, v, out = p0.copy(), m0.copy(), v0.copy(), np.empty(n, np.float16)
    ca.stream_probe(p, m, v, g, out, num_threads=1)
    gf = g.astype(np.float32)
    assert np.array_equal(p, p0 + gf) and np.array_equal(m, m0 + gf) and np.array_equal(v, v0 + gf * gf)
    assert np.array_equal(out, (p0 + gf).astype(np.float16))
