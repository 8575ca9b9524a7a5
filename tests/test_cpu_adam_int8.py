"""cython_ext.cpu_adam's int8 moments (state_dtype="int8") against independent references.

Block-wise 8-bit m and v against Adam in float64 on the same gradients (whose
scales spread within a block, where a block-wise code is tested hardest);
round-to-nearest v shown to stall where stochastic rounding does not; every SIMD
path against the scalar one; threads and sharding never change a bit; blocks
without an update left untouched; the conversions; bad calls refused before
anything is written.
"""
import numpy as np
import pytest

from tests.helpers import seeded_rng
from tests.helpers.int8_codes import code_step, decode_f64
from tests.helpers.simd import LEVELS, level  # noqa: F401  (level: a fixture)
from tests.helpers.words import Master, adamw_f64, bf16_words, widen

from zero_offload.kernels import cpu_adam as ca

Q = ca.QBLOCK


def spread_grads(rng, n, steps, sigma=1.0):
    """bf16 gradient words whose per-element scale is lognormal (sigma): neighbours in a
    block differ by up to ~e^(3 sigma), as rows of a weight matrix do."""
    scale = 0.1 * np.exp(sigma * rng.standard_normal(n))
    mu = 0.3 * rng.standard_normal(n)
    return [bf16_words((mu + rng.standard_normal(n)) * scale) for _ in range(steps)]


def blocks(n):
    return (n + Q - 1) // Q


def run_int8(p0, gs, *, exact, level="avx2", rounding="stochastic", threads=1, index_base=0, adamw=True,
             grad_scale=1.0, lr=1e-3, wd=0.01, groups=None):
    """Adam with int8 moments from master p0 over the gradient words gs.  groups: a
    function of the step giving adam_step_int8's groups (None: one set of hparams).
    Returns (master fp32, m codes, v codes, m scales, v scales, weights words)."""
    prev = ca.set_simd_level(level if level in LEVELS else None)
    try:
        n = p0.size
        m, v, out = np.zeros(n, np.uint8), np.zeros(n, np.uint8), np.zeros(n, np.uint16)
        ms, vs = np.zeros(blocks(n), np.float32), np.zeros(blocks(n), np.float32)
        master = Master(p0, out, exact)
        for t, g in enumerate(gs, 1):
            kw = dict(adamw=adamw, grad_dtype="bf16", out_dtype="bf16", rounding=rounding,
                      sr_key=ca.rounding_key(t, 5), index_base=index_base, num_threads=threads, grad_scale=grad_scale)
            if groups is None:
                kw.update(step=t, lr=lr, weight_decay=wd)
            else:
                kw.update(groups=groups(t))
            ca.adam_step_int8(master.param, m, v, ms, vs, g, out, **master.kw, **kw)
        return master.fp32(), m, v, ms, vs, out
    finally:
        ca.set_simd_level(prev)


def decoded(codes, scales, moment):
    out = np.empty(codes.size, np.float32)
    ca.dequantize_int8(codes, scales, out, moment=moment)
    return out


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_int8_moments_track_adam_in_float64(level, rounding):
    """200 steps on gradients whose scales spread within each block: the master's
    displacement against float64 Adam.  Measured here: 6.4-6.5e-2 stochastic, 9.6-9.9e-2
    nearest (bf16 moments: 7e-3; the power-law codes before: 4.7e-2); m 8.0-8.5e-2 and v
    1.0-1.5e-1 stochastic (v's rounding noise, a random walk that decays by beta2 a step).
    Bounds 8e-2 stochastic (1.5e-1 nearest, which stalls small changes), m 1.2e-1, v 2e-1
    (5e-1 nearest), what the docs say of int8."""
    rng = seeded_rng()
    n = 20_000  # not a multiple of the block: the last one is partial
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = spread_grads(rng, n, 200)
    p, m, v, ms, vs, _ = run_int8(p0, gs, exact=True, level=level, rounding=rounding)
    rp, rm, rv = adamw_f64(p0, gs)
    err = np.linalg.norm(p - rp) / np.linalg.norm(rp - p0)
    verr = np.linalg.norm(decoded(v, vs, "exp_avg_sq") - rv) / np.linalg.norm(rv)
    merr = np.linalg.norm(decoded(m, ms, "exp_avg") - rm) / np.linalg.norm(rm)
    print(f"displacement rel err {err:.2e}, m {merr:.2e}, v {verr:.2e}")
    stochastic = rounding == "stochastic"
    assert err < (8e-2 if stochastic else 1.5e-1)
    assert merr < 1.2e-1 and verr < (2e-1 if stochastic else 5e-1)


def test_round_to_nearest_v_stalls_and_stochastic_rounding_does_not(level):
    """In each block one element holds v = 4 steady (it sets the scale); the others sit
    on a code at v0 ~ 1 and are fed g^2 = 1.05 v0, so v should rise 5e-5 a step, a
    thousandth of the code's step there.  Round-to-nearest keeps every code for ever;
    stochastic rounding follows float64 on average."""
    n, steps = 64 * Q, 1500
    lead = np.arange(n) % Q == 0
    v0 = np.where(lead, 4.0, 1.0).astype(np.float32)
    vq, vs = np.zeros(n, np.uint8), np.zeros(blocks(n), np.float32)
    ca.quantize_int8(v0, vq, vs, moment="exp_avg_sq")
    v0 = decoded(vq, vs, "exp_avg_sq")  # start exactly on a code
    g = bf16_words(np.sqrt(np.where(lead, v0, 1.05 * v0)))
    gsq = widen(g).astype(np.float64) ** 2
    v_true = v0 + (gsq - v0) * (1 - 0.999 ** steps)
    res = {}
    for rounding in ("nearest", "stochastic"):
        prev = ca.set_simd_level(level)
        try:
            p, m, ms = np.zeros(n, np.float32), np.zeros(n, np.uint8), np.zeros(blocks(n), np.float32)
            v, s = vq.copy(), vs.copy()
            for t in range(1, steps + 1):
                ca.adam_step_int8(p, m, v, ms, s, g, np.empty(n, np.uint16), step=t, lr=0.0, grad_dtype="bf16",
                                  out_dtype="bf16", rounding=rounding, sr_key=ca.rounding_key(t))
        finally:
            ca.set_simd_level(prev)
        res[rounding] = (v.copy(), decoded(v, s, "exp_avg_sq").astype(np.float64))
    near, stoch = res["nearest"], res["stochastic"]
    gain = lambda x: float(x[~lead].mean() / v0[~lead].mean())  # noqa: E731
    want = float(v_true[~lead].mean() / v0[~lead].mean())
    print(f"v after {steps} steps, relative to v0: float64 {want:.5f}, nearest {gain(near[1]):.5f}, "
          f"stochastic {gain(stoch[1]):.5f}")
    assert np.array_equal(near[0], vq)  # stalled: not one code moved
    assert abs(gain(stoch[1]) - want) < 3e-3


def _two_groups(n):
    """Two param groups and a kept run (no gradient) that ends inside a block."""
    a, b = 3 * Q + 17, 5 * Q + 100
    return lambda t: [(0, a, dict(step=t, lr=1e-3, weight_decay=0.01)), (a, b, None),
                      (b, n, dict(step=t + 3, lr=2e-3, beta1=0.8, weight_decay=0.0))]


@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU has no SIMD path to compare with the scalar one")
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("adamw,grad_scale,groups", [(True, 1.0, False), (True, 0.5, True), (False, 0.5, False)])
def test_simd_paths_agree_with_scalar(exact, rounding, adamw, grad_scale, groups):
    rng = seeded_rng()
    n = 70_001
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = spread_grads(rng, n, 5)
    kw = dict(exact=exact, rounding=rounding, adamw=adamw, grad_scale=grad_scale, index_base=9,
              groups=_two_groups(n) if groups else None)
    ref = run_int8(p0, gs, level="scalar", **kw)
    for lv in LEVELS[1:]:
        got = run_int8(p0, gs, level=lv, **kw)
        for name, a, b in zip(("master", "m", "v", "m scales", "v scales", "weights"), ref, got):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{lv} {name} differs from scalar"


def test_fp16_gradients_with_an_fp32_master_and_prediction(level):
    """fp16 training: an fp32 master, int8 moments, DPU's predicted weights in the
    fp16 output; against float64 Adam (measured 1.67-1.69e-1 after 30 steps of pure-noise
    gradients, where the displacement is small and m's 3 mantissa bits show most; the
    power-law codes before: 6.7e-2; bound 2.5e-1) and bitwise against the scalar path."""
    rng = seeded_rng()
    n, steps = 50_003, 30
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = [(rng.standard_normal(n) * 0.1).astype(np.float16) for _ in range(steps)]

    def run(lv):
        prev = ca.set_simd_level(lv)
        try:
            p, m, v, out = p0.copy(), np.zeros(n, np.uint8), np.zeros(n, np.uint8), np.empty(n, np.float16)
            ms, vs = np.zeros(blocks(n), np.float32), np.zeros(blocks(n), np.float32)
            for t, g in enumerate(gs, 1):
                ca.adam_step_int8(p, m, v, ms, vs, g, out, step=t, lr=1e-3, weight_decay=0.01, sr_key=t,
                                  predict=0.5)
            return p, m, v, ms, vs, out
        finally:
            ca.set_simd_level(prev)
    got = run(level)
    ref, _, _ = adamw_f64(p0, gs)  # float64 AdamW on the fp16 gradients
    err = np.linalg.norm(got[0] - ref) / np.linalg.norm(ref - p0)
    print(f"displacement rel err {err:.2e}")
    assert err < 2.5e-1
    if level != "scalar":
        for a, b in zip(run("scalar"), got):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_threads_and_sharding_change_no_bit():
    """Two, three and seven threads against one; and a model split into two shards at a block boundary,
    each with its model-wide index_base, against one shard."""
    if not ca.openmp_enabled():
        pytest.skip("built without OpenMP")
    rng = seeded_rng()
    n, cut = 600_001, 1172 * Q  # past the kernel's parallel threshold
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = spread_grads(rng, n, 3)
    one = run_int8(p0, gs, exact=True, threads=1)
    two = run_int8(p0, gs, exact=True, threads=2)
    # threads that share a range unevenly: one part each, whole blocks (a part
    # that split a block would give its two parts different scales)
    others = [run_int8(p0, gs, exact=True, threads=t) for t in (3, 7)]
    a = run_int8(p0[:cut], [g[:cut] for g in gs], exact=True, index_base=0)
    b = run_int8(p0[cut:], [g[cut:] for g in gs], exact=True, index_base=cut)
    for k, name in enumerate(("master", "m", "v", "m scales", "v scales", "weights")):
        for got in [two] + others:
            assert np.array_equal(one[k].view(np.uint8), got[k].view(np.uint8)), f"threads change {name}"
        joined = np.concatenate([a[k], b[k]])
        assert np.array_equal(one[k].view(np.uint8), joined.view(np.uint8)), f"sharding changes {name}"


def test_kept_elements_stay_and_their_weights_are_written(level):
    """A run without a gradient: its master stays bit for bit, param_out gets its
    weights, the blocks wholly inside it keep their codes and scales; the elements it
    shares a block with updated ones are re-encoded with the block's new scale (their
    values move by at most the code's step there: 2^-3 of the binade's bottom)."""
    rng = seeded_rng()
    n = 8 * Q
    a, b = Q + 10, 6 * Q  # kept: [a, b); blocks 2..5 wholly, block 1 shared
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = spread_grads(rng, n, 4)
    full = lambda t: [(0, n, dict(step=t, lr=1e-3))]  # noqa: E731
    p, m, v, ms, vs, w = run_int8(p0, gs[:3], exact=False, level=level, groups=full)
    before = [x.copy() for x in (p, m, v, ms, vs)]
    out = np.zeros(n, np.uint16)
    ca.adam_step_int8(p, m, v, ms, vs, gs[3], out, groups=[(0, a, dict(step=4, lr=1e-3)), (a, b, None),
                                                              (b, n, dict(step=4, lr=1e-3))],
                      grad_dtype="bf16", out_dtype="bf16", sr_key=ca.rounding_key(4, 5))
    assert np.array_equal(p[a:b].view(np.uint32), before[0][a:b].view(np.uint32))
    assert np.array_equal(out[a:b], bf16_words(p[a:b]))
    assert np.array_equal(m[2 * Q:b], before[1][2 * Q:b]) and np.array_equal(v[2 * Q:b], before[2][2 * Q:b])
    assert np.array_equal(ms[2:6], before[3][2:6]) and np.array_equal(vs[2:6], before[4][2:6])
    assert not np.array_equal(p[:a], before[0][:a])  # the updated runs did move
    old = decoded(before[2], before[4], "exp_avg_sq")[a:2 * Q]
    new = decoded(v, vs, "exp_avg_sq")[a:2 * Q]
    big = old > 1e-3 * old.max()
    assert np.all(np.abs(new[big] / old[big] - 1) <= 0.125 * 1.001)


def test_every_code_decodes_to_its_float64_value():
    """All 256 codes of each moment, in blocks with different scales (a power of two, an
    odd one, one below FLT_MIN's inverse range), against the formats decoded in float64
    (tests/helpers/int8_codes.py): the e4m3 / e5m3 values are exact in fp32."""
    codes = np.tile(np.arange(256, dtype=np.uint8), 3)
    scales = np.array([1.0, 3.7e-3, 1e-30], np.float32)
    for moment in ("exp_avg", "exp_avg_sq"):
        got = decoded(codes, scales, moment)
        want = decode_f64(codes, scales, moment)
        assert np.array_equal(got, want.astype(np.float32)), moment
        assert np.all(np.diff(np.abs(want[:128 if moment == "exp_avg" else 256])) > 0)  # monotone


def test_quantize_and_dequantize_round_trip():
    """Nearest codes: within half the code's step of the value (relative to the block
    scale), zero stays zero, the block maximum is exact, and re-encoding decoded
    values gives the same codes (so converting a checkpoint twice changes nothing)."""
    rng = seeded_rng()
    n = 10 * Q + 3
    for moment, x in (("exp_avg", rng.standard_normal(n) * np.exp(rng.standard_normal(n))),
                      ("exp_avg_sq", np.exp(3 * rng.standard_normal(n)))):
        x = x.astype(np.float32)
        x[5] = 0.0
        c, s = np.zeros(n, np.uint8), np.zeros(blocks(n), np.float32)
        ca.quantize_int8(x, c, s, moment=moment)
        y = decoded(c, s, moment)
        scale = np.repeat(s, Q)[:n]
        assert y[5] == 0.0
        at_max = np.abs(x) == scale
        assert np.array_equal(y[at_max], x[at_max])
        step = scale * code_step(np.abs(x) / scale, moment)
        assert np.all(np.abs(y - x) <= 0.5 * step * 1.01 + 1e-30)
        c2, s2 = np.zeros(n, np.uint8), np.zeros(blocks(n), np.float32)
        ca.quantize_int8(y, c2, s2, moment=moment)
        assert np.array_equal(c2, c) and np.array_equal(s2, s)


def test_all_zero_and_tiny_blocks_decode_to_finite_values():
    """A block of zeros (scale 0) and one whose scale is below FLT_MIN (its inverse would
    overflow): every code 0, nothing NaN or inf, and the update still runs."""
    n = 2 * Q
    p = np.ones(n, np.float32)
    g = np.zeros(n, np.float32)
    g[Q:] = 1e-30  # v ~ 1e-63: below fp32's range, so 0; m ~ 1e-31
    m, v, out = np.zeros(n, np.uint8), np.zeros(n, np.uint8), np.zeros(n, np.uint16)
    ms, vs = np.zeros(2, np.float32), np.zeros(2, np.float32)
    for t in range(1, 4):
        ca.adam_step_int8(p, m, v, ms, vs, g, out, step=t, lr=1e-3, out_dtype="bf16")
    assert np.isfinite(p).all() and (v == 0).all()
    assert np.isfinite(decoded(m, ms, "exp_avg")).all()


def test_a_v_above_zero_is_never_coded_zero(level):
    """In a block whose largest v is ~1, elements with v ~ 1e-15 of it (below the smallest
    code, 2^-33 ~ 1.2e-10 of the scale) round up to that code, stochastically or to
    nearest, and never to 0, where their step would be m / eps; an element whose gradient
    is exactly 0 keeps v = 0 and code 0."""
    n = 2 * Q
    g = np.full(n, 1e-6, np.float32)  # v = 1e-15 after one step
    g[::Q] = 30.0  # v ~ 0.9: each block's scale
    g[2::Q] = 0.0
    for rounding in ("stochastic", "nearest"):
        prev = ca.set_simd_level(level)
        try:
            p, m, v, out = np.zeros(n, np.float32), np.zeros(n, np.uint8), np.zeros(n, np.uint8), np.zeros(n, np.uint16)
            ms, vs = np.zeros(2, np.float32), np.zeros(2, np.float32)
            ca.adam_step_int8(p, m, v, ms, vs, g, out, step=1, lr=1e-3, out_dtype="bf16", rounding=rounding,
                              sr_key=ca.rounding_key(1))
        finally:
            ca.set_simd_level(prev)
        small = np.arange(n) % Q != 2
        assert (v[small] >= 1).all(), rounding
        assert (v[1::Q] == 1).all() and (v[2::Q] == 0).all() and (m[2::Q] == 0).all(), rounding
        assert np.isfinite(p).all() and np.abs(p).max() <= 1.01e-3, rounding  # no step of m / eps


def _bad_calls(n):
    rem, out = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    m, v = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    ms, vs = np.zeros(blocks(n), np.float32), np.zeros(blocks(n), np.float32)
    p = np.zeros(n, np.float32)
    g = np.zeros(n, np.uint16)
    kw = dict(step=1, lr=1e-3, grad_dtype="bf16", out_dtype="bf16")
    seg = dict(grad_dtype="bf16", out_dtype="bf16")
    hp = dict(step=1, lr=1e-3)
    return (rem, out, m, v, ms, vs, p), [
        (lambda: ca.adam_step_int8(rem, m, v, ms, vs, g, out, **kw), TypeError, "master_hi"),
        (lambda: ca.adam_step_int8(p, rem, v, ms, vs, g, out, **kw), TypeError, "exp_avg"),
        (lambda: ca.adam_step_int8(p, m, v, ms[:-1], vs, g, out, **kw), ValueError, "exp_avg_scale"),
        (lambda: ca.adam_step_int8(p, m, v, ms, vs.astype(np.float64), g, out, **kw), TypeError, "exp_avg_sq_scale"),
        (lambda: ca.adam_step_int8(p, m, v, ms, vs, g, out, rounding="up", **kw), ValueError, "rounding"),
        (lambda: ca.adam_step_int8(p, m, v, ms, vs, g, out, grad_dtype="bf16", out_dtype="bf16"), TypeError, "step"),
        (lambda: ca.adam_step_int8(p, m, v, ms, vs, g, out, groups=[(0, n - 1, hp)], **seg), ValueError, "cover"),
        (lambda: ca.adam_step_int8(p, m, v, ms, vs, g, out, groups=[(0, 5, hp), (6, n, hp)], **seg),
         ValueError, "tile"),
        (lambda: ca.adam_step_int8(p, m, v, ms, vs, g, out, groups=[(0, n, dict(lr=1e-3))], **seg),
         ValueError, "step"),
        (lambda: ca.adam_step_int8(p, m, v, ms, vs, g, out, groups=[(0, n, dict(step=1, lr=-1.0))], **seg),
         ValueError, "lr"),
        (lambda: ca.adam_step_int8(p, m, v, ms, vs, g, out, groups=[(0, n, hp)], step=1, **seg), TypeError, "both"),
        (lambda: ca.quantize_int8(p, m, ms, moment="v"), ValueError, "moment"),
    ]


def test_bad_calls_are_refused_before_anything_is_written():
    n = 3 * Q + 5
    bufs, calls = _bad_calls(n)
    for b in bufs:
        b.view(np.uint8)[:] = 7
    before = [b.copy() for b in bufs]
    for fn, exc, word in calls:
        with pytest.raises(exc, match=word):
            fn()
        for a, b in zip(before, bufs):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_progress_is_published_in_whole_blocks():
    """progress_block rounds up to whole blocks; the last word counts every element."""
    n = 5 * Q + 7
    p, g, out = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.uint16)
    m, v = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    ms, vs = np.zeros(blocks(n), np.float32), np.zeros(blocks(n), np.float32)
    word = np.zeros(1, np.uint64)
    ca.adam_step_int8(p, m, v, ms, vs, g, out, step=1, lr=1e-3, out_dtype="bf16", progress=word, progress_tag=3,
                      progress_block=100, progress_base=10)
    assert ca.load_progress(word, tag=3) == 10 + n


def test_stream_probe_int8_runs_both_patterns():
    n = 1000
    w = [np.ones(n, np.uint16) for _ in range(3)]
    m, v = np.ones(n, np.uint8), np.ones(n, np.uint8)
    ca.stream_probe_int8(w[0], m, v, w[1], w[2], master_hi=w[2])
    assert (m == 2).all() and (v == 2).all() and (w[0] == 2).all() and (w[2] == 2).all()
    p = np.zeros(n, np.float32)
    ca.stream_probe_int8(p, m, v, w[1], w[2])
    assert (m == 3).all() and (v == 3).all()


# ---------------------------------------------------------------- Lion's one int8 moment

def run_lion8(p0, gs, *, exact, level="avx2", rounding="stochastic", threads=1, index_base=0, grad_scale=1.0,
              lr=1e-3, wd=0.1, groups=None):
    """Lion with an int8 moment from master p0 over the gradient words gs.  groups: a
    function of the step giving lion_step_int8's groups.  Returns (master fp32, m
    codes, m scales, weights words)."""
    prev = ca.set_simd_level(level if level in LEVELS else None)
    try:
        n = p0.size
        m, out, ms = np.zeros(n, np.uint8), np.zeros(n, np.uint16), np.zeros(blocks(n), np.float32)
        master = Master(p0, out, exact)
        for t, g in enumerate(gs, 1):
            kw = dict(grad_dtype="bf16", out_dtype="bf16", rounding=rounding, sr_key=ca.rounding_key(t, 5),
                      index_base=index_base, num_threads=threads, grad_scale=grad_scale)
            kw.update(dict(lr=lr, weight_decay=wd) if groups is None else dict(groups=groups(t)))
            ca.lion_step_int8(master.param, m, ms, g, out, **master.kw, **kw)
        return master.fp32(), m, ms, out
    finally:
        ca.set_simd_level(prev)


def lion_f64(p0, gs, *, lr=1e-3, wd=0.1, b1=0.9, b2=0.99):
    """Lion (Chen et al. 2023) in float64 on the same gradient words: (master, m)."""
    p, m = p0.astype(np.float64), np.zeros(p0.size)
    for g in gs:
        gf = widen(g).astype(np.float64)
        c = b1 * m + (1 - b1) * gf
        p = p * (1 - lr * wd) - lr * np.sign(c)
        m = b2 * m + (1 - b2) * gf
    return p, m


def test_lion_with_an_int8_moment_tracks_lion_in_float64(level):
    """Lion's one moment as int8 codes (Adam's m format): the exact master bit for bit
    against the fp32 master; against float64 Lion on gradients whose scales spread
    within a block, 100 steps.  Measured here: the displacement 6.4-6.7e-2 off (a bf16
    moment: 1.0e-2; sign(c) flips where c is near 0 and m's rounding tips it, each
    flip 2 lr), m 1.8e-1 off: stochastic rounding's noise is a random walk that decays
    by beta2 = 0.99 a step, so it adds up over ~50 steps, as Adam's v's does (round to
    nearest: 4.8e-2 and 1.1e-1 on these noisy gradients, but it stalls an m that
    drifts by less than half a code a step).  Bounds 1e-1 and 2.5e-1."""
    rng = seeded_rng()
    n, steps = 20_000, 100
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = spread_grads(rng, n, steps)
    pe, me, mse, _ = run_lion8(p0, gs, exact=True, level=level, index_base=3)
    pf, mf, msf, _ = run_lion8(p0, gs, exact=False, level=level, index_base=3)
    assert np.array_equal(pe.view(np.uint32), pf.view(np.uint32)) and np.array_equal(me, mf)
    assert np.array_equal(mse.view(np.uint32), msf.view(np.uint32))
    rp, rm = lion_f64(p0, gs)
    err = np.linalg.norm(pe - rp) / np.linalg.norm(rp - p0)
    merr = np.linalg.norm(decoded(me, mse, "exp_avg") - rm) / np.linalg.norm(rm)
    print(f"lion int8 displacement rel err {err:.2e}, m {merr:.2e}")
    assert err < 1e-1 and merr < 2.5e-1


@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU has no SIMD path to compare with the scalar one")
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("grad_scale,groups", [(1.0, False), (0.5, True)])
def test_lion_simd_paths_agree_with_scalar(exact, rounding, grad_scale, groups):
    """Every SIMD path bitwise the scalar one, with two param groups and a kept run
    inside a block, and over two threads."""
    rng = seeded_rng()
    n = 70_001
    p0 = rng.standard_normal(n).astype(np.float32)
    gs = spread_grads(rng, n, 5)
    a, b = 3 * Q + 17, 5 * Q + 100
    segs = (lambda t: [(0, a, dict(lr=1e-3, weight_decay=0.1)), (a, b, None),  # noqa: E731
                       (b, n, dict(lr=2e-3, beta1=0.8, beta2=0.95))]) if groups else None
    kw = dict(exact=exact, rounding=rounding, grad_scale=grad_scale, index_base=9, groups=segs)
    ref = run_lion8(p0, gs, level="scalar", **kw)
    runs = [(lv, 1) for lv in LEVELS[1:]] + ([(LEVELS[-1], 2)] if ca.openmp_enabled() else [])
    for lv, threads in runs:
        got = run_lion8(p0, gs, level=lv, threads=threads, **kw)
        for name, x, y in zip(("master", "m", "m scales", "weights"), ref, got):
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"{lv} x{threads} {name} differs from scalar"


def test_lion_int8_bad_calls_are_refused_before_anything_is_written():
    n = 3 * Q + 5
    p, g, out = np.zeros(n, np.float32), np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    m, ms = np.full(n, 7, np.uint8), np.full(blocks(n), 7.0, np.float32)
    kw = dict(grad_dtype="bf16", out_dtype="bf16")
    calls = [
        (lambda: ca.lion_step_int8(p, m, ms, g, out, **kw), TypeError, "needs lr"),
        (lambda: ca.lion_step_int8(p, m, ms[:-1], g, out, lr=1e-3, **kw), ValueError, "one scale per block"),
        (lambda: ca.lion_step_int8(p, m, ms, g, out, groups=[(0, n, dict(step=1, lr=1e-3))], **kw),
         ValueError, "may give"),
        (lambda: ca.lion_step_int8(p, m, ms, g, out, groups=[(0, n, dict(lr=1e-3))], lr=1e-3, **kw),
         TypeError, "both"),
        (lambda: ca.lion_step_int8(p, m.view(np.int8).astype(np.int16), ms, g, out, lr=1e-3, **kw),
         TypeError, "8-bit codes"),
    ]
    before = [x.copy() for x in (p, m, ms, out)]
    for fn, exc, word in calls:
        with pytest.raises(exc, match=word):
            fn()
        for x, y in zip(before, (p, m, ms, out)):
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
