"""cython_ext.cpu_adam's compact state (state_dtype="bf16") against independent references.

The exact master against the fp32 master bit for bit; bf16 moments against Adam in
float64 on the same gradients; round-to-nearest v shown to stall where stochastic
rounding does not; every SIMD path against the scalar one; threads and sharding
never change a bit; bad calls refused before anything is written.
"""
import numpy as np
import pytest

from tests.helpers import seeded_rng
from tests.helpers.simd import LEVELS, level  # noqa: F401  (level: a fixture)
from tests.helpers.words import Master, adamw_f64, bf16_words, widen

from zero_offload.kernels import cpu_adam as ca


def grads(rng, n, steps, scale=0.1):
    return [bf16_words(rng.standard_normal(n) * scale) for _ in range(steps)]


def run_bf16(p0, gs, *, exact, level="avx2", rounding="stochastic", threads=1, index_base=0, adamw=True,
             grad_scale=1.0, lr=1e-3, wd=0.01, record=False):
    """Adam with bf16 moments from master p0 over the gradient words gs.  Returns
    (master fp32, m words, v words, weights words[, masters per step])."""
    prev = ca.set_simd_level(level if level in LEVELS else None)
    try:
        n = p0.size
        m, v, out = np.zeros(n, np.uint16), np.zeros(n, np.uint16), np.zeros(n, np.uint16)
        master = Master(p0, out, exact)
        seen = []
        for t, g in enumerate(gs, 1):
            kw = dict(step=t, lr=lr, weight_decay=wd, adamw=adamw, grad_dtype="bf16", out_dtype="bf16",
                      rounding=rounding, sr_key=ca.rounding_key(t, 5), index_base=index_base, num_threads=threads,
                      grad_scale=grad_scale)
            ca.adam_step_bf16(master.param, m, v, g, out, **master.kw, **kw)
            if record:
                seen.append(master.fp32())
        p = master.fp32()
        return (p, m, v, out, seen) if record else (p, m, v, out)
    finally:
        ca.set_simd_level(prev)


@pytest.mark.parametrize("n,index_base", [(1, 0), (15, 3), (17, 0), (1000, 5), (100_003, 2**32 - 7)])
def test_exact_master_reproduces_the_fp32_master_bit_for_bit(level, n, index_base):
    """100 steps: the master joined from (weights, remainder) has every bit of the
    fp32 master that the same kernel keeps whole, and m and v agree too."""
    rng = seeded_rng()
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = grads(rng, n, 100)
    _, _, _, _, a = run_bf16(p0, gs, exact=False, level=level, index_base=index_base, record=True)
    _, m1, v1, w1, b = run_bf16(p0, gs, exact=True, level=level, index_base=index_base, record=True)
    for t, (x, y) in enumerate(zip(a, b), 1):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), f"master differs at step {t}"
    pa, ma, va, wa = run_bf16(p0, gs, exact=False, level=level, index_base=index_base)
    assert np.array_equal(ma, m1) and np.array_equal(va, v1)
    # the weights: the master rounded; ties go away from zero (the one difference from
    # round-to-nearest-even, when the low half is exactly 0x8000)
    ties = (pa.view(np.uint32) & 0xffff) == 0x8000
    assert np.array_equal(w1[~ties], wa[~ties])
    assert np.all(np.abs(widen(w1[ties])) >= np.abs(pa[ties]))


def test_split_and_join_are_lossless_for_every_kind_of_float(level):
    rng = seeded_rng()
    bits = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x00000001, 0x00008000,
                        0x00018000, 0x7f7fffff, 0xff7fffff, 0x3f808000, 0x3f818000, 0x7fffffff, 0xffffffff,
                        0xffff8000, 0x00007fff], np.uint32)
    x = np.concatenate([bits, special]).view(np.float32)
    hi, rem, back = (np.empty(x.size, np.uint16), np.empty(x.size, np.uint16), np.empty(x.size, np.float32))
    ca.split_master(x, hi, rem)
    ca.join_master(hi, rem, back)
    assert np.array_equal(back.view(np.uint32), x.view(np.uint32))
    finite = np.isfinite(x)
    rne = bf16_words(x)
    ties = (x.view(np.uint32) & 0xffff) == 0x8000
    assert np.array_equal(hi[finite & ~ties], rne[finite & ~ties])
    # a NaN whose high half is NaN already (every NaN torch or a 16-bit value makes) stays NaN
    ax = x.view(np.uint32) & 0x7fffffff
    assert np.isnan(widen(hi[((ax & 0x7fff0000) > 0x7f800000) & (ax < 0x7fff8000)])).all()


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_bf16_moments_track_adam_in_float64(level, rounding):
    """200 steps: the master's displacement against float64 Adam on the same
    gradients.  Measured here: 7.2e-3 with stochastic rounding, 5.0e-3 nearest (on
    random gradients the rounding's variance, not v's stall, is what shows); the
    bound 1e-2 is what the docs promise for bf16 moments."""
    rng = seeded_rng()
    n = 20_000
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = grads(rng, n, 200)
    p, m, v, _ = run_bf16(p0, gs, exact=True, level=level, rounding=rounding)
    rp, rm, rv = adamw_f64(p0, gs)
    err = np.linalg.norm(p - rp) / np.linalg.norm(rp - p0)
    print(f"displacement rel err {err:.2e}")
    assert err < 1e-2
    assert np.linalg.norm(widen(v) - rv) / np.linalg.norm(rv) < 2e-2


def test_round_to_nearest_v_stalls_and_stochastic_rounding_does_not(level):
    """v below bf16's resolution: with beta2 = 0.999 a v at 1.0 fed g^2 = 1.05 moves by
    5e-5 a step, a sixtieth of bf16's half ulp (2^-8 relative), so round-to-nearest
    keeps it at 1.0 for ever; stochastic rounding follows float64 on average."""
    n, steps = 8192, 1500
    p0 = np.zeros(n, np.float32)
    g = bf16_words(np.full(n, np.sqrt(1.05)))
    gsq = float(widen(g[:1])[0]) ** 2
    v_true = 1.0 + (gsq - 1.0) * (1 - 0.999 ** steps)  # from v0 = 1.0
    res = {}
    for rounding in ("nearest", "stochastic"):
        prev = ca.set_simd_level(level)
        try:
            p, m = p0.copy(), np.zeros(n, np.uint16)
            v = bf16_words(np.ones(n))
            for t in range(1, steps + 1):
                ca.adam_step_bf16(p, m, v, g, np.empty(n, np.uint16), step=t, lr=0.0, grad_dtype="bf16",
                                  out_dtype="bf16", rounding=rounding, sr_key=ca.rounding_key(t))
        finally:
            ca.set_simd_level(prev)
        res[rounding] = float(widen(v).astype(np.float64).mean())
    print(f"v after {steps} steps: float64 {v_true:.5f}, nearest {res['nearest']:.5f}, "
          f"stochastic {res['stochastic']:.5f}")
    assert res["nearest"] == 1.0  # stalled
    assert abs(res["stochastic"] - v_true) / v_true < 2e-3


@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU has no SIMD path to compare with the scalar one")
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("adamw,grad_scale", [(True, 1.0), (True, 0.5), (False, 0.5)])
def test_simd_paths_agree_with_scalar(exact, rounding, adamw, grad_scale):
    rng = seeded_rng()
    n = 70_001
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = grads(rng, n, 5)
    ref = run_bf16(p0, gs, exact=exact, level="scalar", rounding=rounding, adamw=adamw, grad_scale=grad_scale,
                   index_base=9)
    for lv in LEVELS[1:]:
        got = run_bf16(p0, gs, exact=exact, level=lv, rounding=rounding, adamw=adamw, grad_scale=grad_scale,
                       index_base=9)
        for name, a, b in zip(("master", "m", "v", "weights"), ref, got):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{lv} {name} differs from scalar"


def test_fp16_gradients_with_an_fp32_master(level):
    """fp16 training keeps an fp32 master; its moments can still be bf16.  Against
    float64 Adam on the same gradients, and bitwise against the scalar path, with
    DPU's weight prediction in the fp16 weights."""
    rng = seeded_rng()
    n, steps = 50_003, 30
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = [(rng.standard_normal(n) * 0.1).astype(np.float16) for _ in range(steps)]

    def run(lv):
        prev = ca.set_simd_level(lv)
        try:
            p, m, v, out = p0.copy(), np.zeros(n, np.uint16), np.zeros(n, np.uint16), np.empty(n, np.float16)
            for t, g in enumerate(gs, 1):
                pp = p.copy()
                ca.adam_step_bf16(p, m, v, g, out, step=t, lr=1e-3, weight_decay=0.01, sr_key=t, predict=0.5)
            return p, m, v, out, pp
        finally:
            ca.set_simd_level(prev)
    p, m, v, out, pp = run(level)
    ref, _, _ = adamw_f64(p0, gs)  # float64 AdamW on the fp16 gradients
    assert np.linalg.norm(p - ref) / np.linalg.norm(ref - p0) < 1e-2
    want = (p + np.float32(0.5) * (p - pp)).astype(np.float16)  # the predicted weights, rounded once
    assert np.mean(out != want) < 1e-3  # the kernel rounds p + 0.5 (p - p_prev) in fp32 first
    if level != "scalar":
        for a, b in zip(run("scalar"), (p, m, v, out, pp)):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU has no SIMD path to compare with the scalar one")
@pytest.mark.parametrize("exact", [True, False])
def test_non_finite_gradients_take_the_scalar_paths_bits(exact):
    """The engine skips a step whose gradients overflowed, but a direct caller may
    not: NaN (with payloads whose rounding would carry into the sign) and inf
    gradients must still give every SIMD path the scalar path's bits, NaN moments
    staying NaN under round to nearest."""
    rng = seeded_rng()
    n = 4099
    p0 = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * 0.1).astype(np.float16 if not exact else np.float32)
    bad = rng.choice(n, 300, replace=False)
    if exact:  # bf16 gradients: NaNs with the largest payloads bf16 can carry, and infs
        words = bf16_words(g)
        words[bad[:100]], words[bad[100:200]], words[bad[200:]] = 0x7fff, 0xffc1, 0x7f80
    else:  # fp16 gradients: 0x7fff widens to 0x7fffe000, which + 0x7fff carries out of the exponent
        words = g.view(np.uint16).copy()
        words[bad[:100]], words[bad[100:200]], words[bad[200:]] = 0x7fff, 0xfe01, 0x7c00

    def run(lv):
        prev = ca.set_simd_level(lv)
        try:
            m, v, out = np.zeros(n, np.uint16), np.zeros(n, np.uint16), np.zeros(n, np.uint16)
            kw = dict(step=1, lr=1e-3, weight_decay=0.01, rounding="nearest")
            if exact:
                rem = np.zeros(n, np.uint16)
                ca.split_master(p0, out, rem)
                ca.adam_step_bf16(rem, m, v, words, out, master_hi=out, grad_dtype="bf16", out_dtype="bf16", **kw)
                return rem, m, v, out
            p = p0.copy()
            ca.adam_step_bf16(p, m, v, words.view(np.float16), out.view(np.float16), predict=0.5, **kw)
            return p, m, v, out
        finally:
            ca.set_simd_level(prev)
    ref = run("scalar")
    for moment in ref[1:3]:  # NaN gradients made NaN moments, infs infinite ones
        assert np.isnan(widen(moment[bad[:200]])).all() and np.isinf(widen(moment[bad[200:]])).all()
    for lv in LEVELS[1:]:
        for name, a, b in zip(("master", "m", "v", "weights"), ref, run(lv)):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{lv} {name} differs from scalar"


def test_threads_and_sharding_change_no_bit():
    """Two, three and seven threads against one; and a model split into two shards at an odd point,
    each with its model-wide index_base, against one shard."""
    if not ca.openmp_enabled():
        pytest.skip("built without OpenMP")
    rng = seeded_rng()
    n, cut = 600_001, 300_007  # past the kernel's parallel threshold, cut off any 16-element group
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = grads(rng, n, 3)
    one = run_bf16(p0, gs, exact=True, threads=1)
    two = run_bf16(p0, gs, exact=True, threads=2)
    # threads that share a range unevenly: one part each
    others = [run_bf16(p0, gs, exact=True, threads=t) for t in (3, 7)]
    a = run_bf16(p0[:cut], [g[:cut] for g in gs], exact=True, index_base=0)
    b = run_bf16(p0[cut:], [g[cut:] for g in gs], exact=True, index_base=cut)
    for k, name in enumerate(("master", "m", "v", "weights")):
        for got in [two] + others:
            assert np.array_equal(one[k].view(np.uint8), got[k].view(np.uint8)), f"threads change {name}"
        joined = np.concatenate([a[k], b[k]])
        assert np.array_equal(one[k].view(np.uint8), joined.view(np.uint8)), f"sharding changes {name}"


def _mix32(x: int) -> int:
    """lowbias32 in Python integers: an independent reference of the kernel's mix."""
    m = 0xffffffff
    x ^= x >> 16
    x = (x * 0x7feb352d) & m
    x ^= x >> 15
    x = (x * 0x846ca68b) & m
    return x ^ (x >> 16)


def test_rounding_key_depends_on_step_and_seed():
    """Every (step, seed) its own key, each the documented mix of both, so that a resumed
    run (same seed, same step) repeats its rounding.  (Mutation: the key ignoring the
    seed, or a constant changed in zo_mix32, fails the reference check.)"""
    keys = {ca.rounding_key(t, s) for t in range(100) for s in range(3)}
    assert len(keys) == 300
    for t, s in [(0, 0), (7, 1), (123456, 2), (2**32 + 5, 2**32 + 9)]:
        key = _mix32(((s & 0xffffffff) ^ 0x5bd1e995))
        assert ca.rounding_key(t, s) == _mix32((key + (t & 0xffffffff) * 0x9e3779b9) & 0xffffffff), (t, s)


def _bad_calls(n):
    rem, m, v, out = (np.zeros(n, np.uint16) for _ in range(4))
    p = np.zeros(n, np.float32)
    g = np.zeros(n, np.uint16)
    kw = dict(step=1, lr=1e-3, grad_dtype="bf16", out_dtype="bf16")
    return rem, m, v, out, p, [
        (lambda: ca.adam_step_bf16(rem, m, v, g, out, **kw), TypeError, "master_hi"),
        (lambda: ca.adam_step_bf16(rem, m, v, g, np.zeros(n, np.float16), master_hi=out, step=1, lr=1e-3,
                                   grad_dtype="bf16"), ValueError, "bf16"),
        (lambda: ca.adam_step_bf16(rem, m, v, g, out, master_hi=out, predict=1.0, **kw), ValueError, "predict"),
        (lambda: ca.adam_step_bf16(p, p, v, g, out, **kw), TypeError, "exp_avg"),
        (lambda: ca.adam_step_bf16(p, m, v[:-1], g, out, **kw), ValueError, "exp_avg_sq"),
        (lambda: ca.adam_step_bf16(p, m, v, g, out, rounding="up", **kw), ValueError, "rounding"),
        (lambda: ca.adam_step_bf16(p, m, v, g, out, sr_key=2**32, **kw), ValueError, "sr_key"),
        (lambda: ca.adam_step_bf16(p, m, v, g, out, master_hi=out, **kw), TypeError, "master_hi"),
        (lambda: ca.adam_step_bf16(p, m, v, g, None, **kw), TypeError, "param_out"),
        (lambda: ca.adam_step_bf16(p, m, v, g, out, index_base=-1, **kw), ValueError, "index_base"),
    ]


def test_bad_calls_are_refused_before_anything_is_written():
    n = 33
    rem, m, v, out, p, calls = _bad_calls(n)
    for buf in (rem, m, v, out):
        buf[:] = 0x3f80
    p[:] = 1.0
    before = [b.copy() for b in (rem, m, v, out, p)]
    for fn, exc, word in calls:
        with pytest.raises(exc, match=word):
            fn()
        for a, b in zip(before, (rem, m, v, out, p)):
            assert np.array_equal(a, b)


def test_stream_probe_bf16_runs_both_patterns():
    n = 1000
    w = [np.ones(n, np.uint16) for _ in range(5)]
    ca.stream_probe_bf16(w[0], w[1], w[2], w[3], w[4], master_hi=w[4])
    assert (w[1] == 2).all() and (w[0] == 2).all() and (w[4] == 2).all()
    p = np.zeros(n, np.float32)
    ca.stream_probe_bf16(p, w[1], w[2], w[3], w[4])
    assert (w[1] == 3).all()


def run_lion16(p0, gs, *, exact, level, rounding="stochastic", index_base=0, lr=1e-3, wd=0.1):
    prev = ca.set_simd_level(level)
    try:
        n = p0.size
        m, out = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
        master = Master(p0, out, exact)
        for t, g in enumerate(gs, 1):
            ca.lion_step_bf16(master.param, m, g, out, lr=lr, weight_decay=wd, grad_dtype="bf16", out_dtype="bf16",
                              rounding=rounding, sr_key=ca.rounding_key(t), index_base=index_base, **master.kw)
        return master.fp32(), m, out
    finally:
        ca.set_simd_level(prev)


def test_lion_with_a_bf16_moment(level):
    """Lion's one moment in bf16: the exact master bit for bit against the fp32 master,
    the scalar path bitwise, and float64 Lion (Chen et al. 2023) on the same gradients."""
    rng = seeded_rng()
    n, steps = 30_011, 60
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = grads(rng, n, steps)
    pe, me, _ = run_lion16(p0, gs, exact=True, level=level, index_base=3)
    pf, mf, _ = run_lion16(p0, gs, exact=False, level=level, index_base=3)
    assert np.array_equal(pe.view(np.uint32), pf.view(np.uint32)) and np.array_equal(me, mf)
    ps, ms, _ = run_lion16(p0, gs, exact=True, level="scalar", index_base=3)
    assert np.array_equal(pe.view(np.uint32), ps.view(np.uint32)) and np.array_equal(me, ms)
    p, m = p0.astype(np.float64), np.zeros(n)
    for g in gs:
        gf = widen(g).astype(np.float64)
        c = 0.9 * m + 0.1 * gf
        p = p * (1 - 1e-3 * 0.1) - 1e-3 * np.sign(c)
        m = 0.99 * m + 0.01 * gf
    # sign(c) flips where c is near 0 and m's rounding tips it: a few elements, each by 2 lr
    err = np.linalg.norm(pe - p) / np.linalg.norm(p - p0)
    print(f"lion displacement rel err {err:.2e}")
    assert err < 5e-2


@pytest.mark.parametrize("shift", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("threads", [1, 2])
def test_exact_master_out_of_place_is_bitwise_in_place(level, shift, threads):
    """read_from with the exact master (speculation's twin for bf16 state): the old
    remainder and moments read from other arrays, the new ones written with streaming
    stores where the destinations share a 32-byte line start (plain stores otherwise);
    the same bits as in place for the state and the weights, the sources untouched,
    over ranges that start off a line and over two threads.  Without master_hi (an
    fp32 master) it is refused."""
    from zero_offload.server.state import _zeros64
    rng = seeded_rng()
    n = 3 * 262144 + 77 if threads > 1 else 4099  # past MIN_PARALLEL when split
    hi = bf16_words(rng.standard_normal(n))
    rem = rng.integers(0, 1 << 16, n).astype(np.uint16)
    m, v = bf16_words(rng.standard_normal(n) * 1e-2), bf16_words(np.abs(rng.standard_normal(n)) * 1e-4)
    g = bf16_words(rng.standard_normal(n) * 0.1)
    kw = dict(step=5, lr=1e-3, weight_decay=0.1, grad_dtype="bf16", out_dtype="bf16", sr_key=99, num_threads=threads)
    ref = [rem.copy(), m.copy(), v.copy()]
    ref_out = np.zeros(n, np.uint16)
    ca.adam_step_bf16(*ref, g, ref_out, master_hi=hi, index_base=3, **kw)
    dst = [_zeros64(n + 32, np.uint16)[shift * (i + 1) % 3:][:n] for i in range(3)]
    out = np.zeros(n, np.uint16)
    src = [rem.copy(), m.copy(), v.copy()]
    for lo, end in [(0, 1000), (1000, 1003), (1003, n)]:
        ca.adam_step_bf16(*(a[lo:end] for a in dst), g[lo:end], out[lo:end], master_hi=hi[lo:end],
                          read_from=tuple(a[lo:end] for a in src), index_base=3 + lo, **kw)
    for a, b in zip(dst, ref):
        assert np.array_equal(a, b)
    assert np.array_equal(out, ref_out)
    for a, b in zip(src, (rem, m, v)):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="exact master"):
        ca.adam_step_bf16(np.zeros(n, np.float32), *dst[1:], g, out, read_from=tuple(src), **kw)
    with pytest.raises(ValueError, match="overlaps"):
        ca.adam_step_bf16(*src, g, out, master_hi=hi, read_from=(src[0], dst[1], dst[2]), **kw)


@pytest.mark.parametrize("n", [1000, 4099])
def test_stream_probe_bf16_computes_its_pattern(level, n):
    """The compact-state probe at each level: 16-bit wrap-around adds of g to m, v and
    the remainder (out = hi + g), or the fp32 master's words (p += g, out = p >> 16),
    on every element of its windows and tail."""
    rng = seeded_rng()
    g, m0, v0, r0, h0 = (rng.integers(0, 1 << 16, n, dtype=np.uint16) for _ in range(5))
    m, v, rem, hi = m0.copy(), v0.copy(), r0.copy(), h0.copy()
    ca.stream_probe_bf16(rem, m, v, g, hi, master_hi=hi, num_threads=1)
    for a, b in ((m, m0 + g), (v, v0 + g), (rem, r0 + g), (hi, h0 + g)):
        assert np.array_equal(a, b)
    p0 = rng.integers(0, 1 << 31, n, dtype=np.uint32)
    p, m, v, out = p0.view(np.float32).copy(), m0.copy(), v0.copy(), np.empty(n, np.uint16)
    ca.stream_probe_bf16(p, m, v, g, out, num_threads=1)
    pw = p0 + g.astype(np.uint32)
    assert np.array_equal(p.view(np.uint32), pw) and np.array_equal(out, (pw >> 16).astype(np.uint16))
    assert np.array_equal(m, m0 + g) and np.array_equal(v, v0 + g)
