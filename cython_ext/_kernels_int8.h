/*
 * state_dtype="int8": Adam's m and v as 8-bit codes, block-wise scaled.
 *
 * Layout: elements are grouped into blocks of ZO_QBLOCK (256) from element 0
 * of the arrays passed in (the server passes shard slices that start on a
 * block: shards and kernel windows are block aligned).  Per block one fp32
 * scale per moment, so 2 * 4 / 256 = 0.03 B/param on top of the codes.
 *
 *   m: 1 sign bit + 7 bits q, value = scale_m * (q / 127)^4 * sign   (scale_m = max |m|)
 *   v: 8 bits q,               value = scale_v * (q / 255)^8          (scale_v = max v)
 *
 * The codes are non-linear, as in the 8-bit optimizers paper (Dettmers et al.
 * 2022): dense near zero, where most moments of a block lie, and wide: the
 * smallest non-zero m is 3.8e-9 of the block's largest, v 5.6e-20 (an element
 * whose v rounds to 0 while its m does not would take a step of m/eps).
 * Their dynamic tree code needs a table search per element; a power law
 * encodes with two (m) or three (v) square roots.  The exponents are measured:
 * on Adam runs whose per-element gradient scales spread lognormally within a
 * block (sigma 0.5 and 1.5), m^(1/2), m^(1/3), m^(1/4) gave 1.8/10.7%,
 * 1.9/5.4%, 2.2/4.5% error of the displacement after 60 steps, and v^(1/4),
 * v^(1/6), v^(1/8) 1.4/10.7%, 1.6/4.8%, 1.9/4.1% (a float-like e4m4 code for v
 * lacked the range: 450x); the exponents that hold up when the spread is wide
 * were kept.
 *
 * Rounding: stochastic between the two neighbouring codes, in value space
 * (P(up) = (x - lo) / (hi - lo)), so the stored moment is unbiased.  A bias
 * of d per step in v grows to d / (1 - beta2) = 1000 d in the steady state,
 * which is why the rounding is not done in code space (where the quartic
 * code's convexity would bias v upward).  The random bits are bf16's
 * (zo_rand32: 16 for m, 16 for v), keyed by step and model-wide index.
 *
 * One pass per block: every element's Adam update (the same arithmetic as the
 * fp32 kernel, with m and v decoded), the new m and v parked in a 2 KiB block
 * buffer, then the block's new scales and codes.  A block may hold elements of
 * several segments (param groups, parameters without a gradient this step):
 * each gets its own hyper-parameters; kept elements are decoded and, if the
 * block has updated elements too, re-encoded with its new scale (a block with
 * no updated element is left untouched).
 */
#ifndef ZO_KERNELS_INT8_H
#define ZO_KERNELS_INT8_H

#include <float.h>

#include "_kernels.h"

#define ZO_QBLOCK 256
#define ZO_INV65536 (1.0f / 65536.0f)

typedef struct {
    uint8_t *m, *v;        /* codes */
    float *ms, *vs;        /* per-block scales (index: element / ZO_QBLOCK) */
    uint16_t *rem;         /* the exact master's low halves, or NULL: the master is p (fp32) */
    const uint16_t *hi;    /* with rem: its high halves (the last update's bf16 weights) */
    uint32_t key;          /* per-step key of the stochastic rounding */
    uint32_t index_base;   /* model-wide index of element 0, mod 2^32 */
    int rounding;          /* zo_rounding */
} zo_state8;

/* One run of elements [lo, hi) with one set of hyper-parameters, or kept (no
 * gradient this step: master and moments stay, the out slot gets the weights). */
typedef struct {
    int64_t lo, hi;
    zo_hparams h;
    int keep;
} zo_seg8;

/* ---------------------------------------------------------------- scalar codes */
/* Encoding works on u = |m| / scale (v / scale) in [0, 1]: the code below u is
 * q0 = floor(127 * u^(1/4)) (255 * u^(1/8)), by repeated square roots, and
 * rounding up to the next code has probability (u - lo) / (hi - lo).  sqrt is
 * correctly rounded everywhere (IEEE), so the scalar and vector paths find the
 * same q; a scale below FLT_MIN counts as an all-zero block (its inverse would
 * overflow). */
#define ZO8_INVM (1.0f / 127.0f)
#define ZO8_INVV (1.0f / 255.0f)

static inline float zo8_inv(float scale) { return scale >= FLT_MIN ? 1.0f / scale : 0.0f; }

/* the code values, normalised: (q/127)^4 and (q/255)^8 */
static inline float zo8_val_m(float q) { float t = q * ZO8_INVM; t = t * t; return t * t; }
static inline float zo8_val_v(float q) { float t = q * ZO8_INVV; t = t * t; t = t * t; return t * t; }

static inline float zo8_decode_m(uint8_t c, float scale) {
    float t = (float)(c & 0x7fu) * ZO8_INVM;
    float t2 = t * t;
    float x = (scale * t2) * t2;
    return (c & 0x80u) ? -x : x;
}
static inline float zo8_decode_v(uint8_t c, float scale) {
    float t = (float)c * ZO8_INVV;
    float t2 = t * t;
    float t4 = t2 * t2;
    return (scale * t4) * t4;  /* not scale * t^8: that underflows for small scales */
}
/* round u in [lo, hi] up? (stochastic: with probability (u - lo) / (hi - lo)) */
static inline int zo8_up(float x, float lo, float hi, uint32_t r16, int sr) {
    if (sr) return (x - lo) > (float)r16 * ZO_INV65536 * (hi - lo);
    return (x - lo) > (hi - x);
}
static inline uint8_t zo8_encode_m(float mi, float inv, uint32_t r16, int sr) {
    uint32_t bits;
    float x = fabsf(mi) * inv;
    int q0 = (int)(sqrtf(sqrtf(x)) * 127.0f);
    float f0;
    if (q0 > 126) q0 = 126;
    f0 = (float)q0;
    q0 += zo8_up(x, zo8_val_m(f0), zo8_val_m(f0 + 1.0f), r16, sr);
    memcpy(&bits, &mi, 4);
    return (uint8_t)(q0 | ((bits >> 24) & 0x80u));
}
static inline uint8_t zo8_encode_v(float vi, float inv, uint32_t r16, int sr) {
    float x = vi * inv;
    int q0 = (int)(sqrtf(sqrtf(sqrtf(x))) * 255.0f);
    float f0;
    if (q0 > 254) q0 = 254;
    f0 = (float)q0;
    return (uint8_t)(q0 + zo8_up(x, zo8_val_v(f0), zo8_val_v(f0 + 1.0f), r16, sr));
}

/* ---------------------------------------------------------------- scalar block parts */
/* Adam over [lo, hi) (inside one block b): decode, update, park m and v in mb/vb
 * (indexed from the block's first element b0), master and weights stored. */
static void zo8_adam_span_scalar(float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                                 int64_t b0, const zo_hparams *h, const zo_state8 *s, float *mb, float *vb) {
    const float msc = s->ms[b0 / ZO_QBLOCK], vsc = s->vs[b0 / ZO_QBLOCK];
    int64_t i;
    for (i = lo; i < hi; i++) {
        float gi = zo_load_grad(g, gk, i);
        float pi = s->rem ? zo_join_master(s->hi[i], s->rem[i]) : p[i];
        float mi, vi, denom, p0;
        if (h->grad_scale != 1.0f) gi = gi * h->grad_scale;
        if (h->l2 != 0.0f) gi = gi + h->l2 * pi;
        mi = h->beta1 * zo8_decode_m(s->m[i], msc) + h->one_minus_beta1 * gi;
        vi = h->beta2 * zo8_decode_v(s->v[i], vsc) + h->one_minus_beta2 * (gi * gi);
        denom = sqrtf(vi) * h->inv_sqrt_bc2 + h->eps;
        p0 = pi;
        if (h->decoupled) pi = pi * h->decay;
        pi = pi - h->step_size * (mi / denom);
        mb[i - b0] = mi;
        vb[i - b0] = vi;
        if (s->rem) {
            zo_split_master(pi, (uint16_t *)out + i, s->rem + i);
        } else {
            p[i] = pi;
            zo_store_out(out, ok, i, h->predict != 0.0f ? pi + h->predict * (pi - p0) : pi);
        }
    }
}

/* A kept span: moments decoded into mb/vb unchanged, the out slot gets the weights
 * (the exact master's high halves, or the fp32 master rounded as INIT rounds it). */
static void zo8_keep_span(const float *p, void *out, int ok, int64_t lo, int64_t hi, int64_t b0,
                          const zo_state8 *s, float *mb, float *vb) {
    const float msc = s->ms[b0 / ZO_QBLOCK], vsc = s->vs[b0 / ZO_QBLOCK];
    int64_t i;
    for (i = lo; i < hi; i++) {
        mb[i - b0] = zo8_decode_m(s->m[i], msc);
        vb[i - b0] = zo8_decode_v(s->v[i], vsc);
        if (s->rem) {
            if ((const void *)s->hi != out) ((uint16_t *)out)[i] = s->hi[i];
        } else {
            zo_store_out(out, ok, i, p[i]);
        }
    }
}

static inline void zo8_block_max(const float *mb, const float *vb, int64_t n, float *am, float *av) {
    float a = 0.0f, b = 0.0f;
    int64_t i;
    for (i = 0; i < n; i++) {
        float x = fabsf(mb[i]);
        a = x > a ? x : a;
        b = vb[i] > b ? vb[i] : b;
    }
    *am = a;
    *av = b;
}

/* codes of mb/vb[from, n) for elements from e0, with the block's encode factors im/iv */
static void zo8_encode_scalar(const float *mb, const float *vb, int64_t from, int64_t n, int64_t e0,
                              float im, float iv, const zo_state8 *s) {
    const int sr = s->rounding == ZO_ROUND_STOCHASTIC;
    int64_t k;
    for (k = from; k < n; k++) {
        uint32_t r = zo_rand32(s->key, s->index_base + (uint32_t)(e0 + k));
        s->m[e0 + k] = zo8_encode_m(mb[k], im, r & 0xffffu, sr);
        s->v[e0 + k] = zo8_encode_v(vb[k], iv, r >> 16, sr);
    }
}

/* ---------------------------------------------------------------- AVX2 block parts */
#if ZO_HAVE_X86
static inline ZO_T256 __m256 zo8_256_decode_m(const uint8_t *c, __m256 scale) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(0x80)), 24);
    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x7f))),
                             _mm256_set1_ps(ZO8_INVM));
    __m256 t2 = _mm256_mul_ps(t, t);
    __m256 x = _mm256_mul_ps(_mm256_mul_ps(scale, t2), t2);
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(x), sign));
}
static inline ZO_T256 __m256 zo8_256_decode_v(const uint8_t *c, __m256 scale) {
    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c))),
                             _mm256_set1_ps(ZO8_INVV));
    __m256 t2 = _mm256_mul_ps(t, t);
    __m256 t4 = _mm256_mul_ps(t2, t2);
    return _mm256_mul_ps(_mm256_mul_ps(scale, t4), t4);
}
/* 8 x i32 codes (each < 256) -> 8 bytes in order */
static inline ZO_T256 void zo8_256_store_codes(uint8_t *dst, __m256i q) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q, pick), _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64((__m128i *)dst, _mm256_castsi256_si128(b));
}

static inline ZO_T256 __attribute__((always_inline)) void zo8_256_adam_span_body(
        float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, int64_t b0,
        const zo_hparams *hp, const zo_state8 *s, float *mb, float *vb) {
    const zo_hparams hc = *hp;  /* a private copy: the stores below may alias *hp as far as C knows */
    const zo_hparams *h = &hc;
    const __m256 gs = _mm256_set1_ps(h->grad_scale), l2 = _mm256_set1_ps(h->l2);
    const __m256 b1 = _mm256_set1_ps(h->beta1), omb1 = _mm256_set1_ps(h->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(h->beta2), omb2 = _mm256_set1_ps(h->one_minus_beta2);
    const __m256 ibc2 = _mm256_set1_ps(h->inv_sqrt_bc2), eps = _mm256_set1_ps(h->eps);
    const __m256 dec = _mm256_set1_ps(h->decay), ss = _mm256_set1_ps(h->step_size);
    const __m256 msc = _mm256_set1_ps(s->ms[b0 / ZO_QBLOCK]), vsc = _mm256_set1_ps(s->vs[b0 / ZO_QBLOCK]);
    const __m256i low = _mm256_set1_epi32(0xffff);
    /* locals, not loads through h and s: the float stores below may alias those as far
     * as C knows, which would reload (and re-test) them on every turn */
    uint16_t *rem = s->rem;
    const uint16_t *hi16 = s->hi;
    const uint8_t *mc = s->m, *vc = s->v;
    const int scale = h->grad_scale != 1.0f, has_l2 = h->l2 != 0.0f, decoupled = h->decoupled;
    const int predict = h->predict != 0.0f;
    const __m256 pr = _mm256_set1_ps(h->predict);
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 gi = zo256_load_grad(g, gk, i);
        __m256 pi, mi, vi, denom, p0;
        if (scale) gi = _mm256_mul_ps(gi, gs);
        if (rem) {
            __m256i r16 = zo256_load_u16(rem, i);
            __m256i h16 = _mm256_sub_epi32(zo256_load_u16(hi16, i), _mm256_srli_epi32(r16, 15));
            pi = _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(h16, low), 16), r16));
        } else {
            pi = _mm256_loadu_ps(p + i);
        }
        if (has_l2) gi = _mm256_add_ps(gi, _mm256_mul_ps(l2, pi));
        mi = _mm256_add_ps(_mm256_mul_ps(b1, zo8_256_decode_m(mc + i, msc)), _mm256_mul_ps(omb1, gi));
        vi = _mm256_add_ps(_mm256_mul_ps(b2, zo8_256_decode_v(vc + i, vsc)),
                           _mm256_mul_ps(omb2, _mm256_mul_ps(gi, gi)));
        denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), ibc2), eps);
        p0 = pi;
        if (decoupled) pi = _mm256_mul_ps(pi, dec);
        pi = _mm256_sub_ps(pi, _mm256_mul_ps(ss, _mm256_div_ps(mi, denom)));
        _mm256_storeu_ps(mb + (i - b0), mi);
        _mm256_storeu_ps(vb + (i - b0), vi);
        if (rem) {
            __m256i x = _mm256_castps_si256(pi);
            zo256_store_u16(rem, i, _mm256_and_si256(x, low));
            zo256_store_u16((uint16_t *)out, i, _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x8000)), 16));
        } else {
            _mm256_storeu_ps(p + i, pi);
            zo256_store_out(out, ok, i, predict ? _mm256_add_ps(pi, _mm256_mul_ps(pr, _mm256_sub_ps(pi, p0))) : pi);
        }
    }
    zo8_adam_span_scalar(p, g, gk, out, ok, i, hi, b0, h, s, mb, vb);
}

#define ADAM8_SPAN_PARAMS (float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, \
                           int64_t b0, const zo_hparams *hp, const zo_state8 *s, float *mb, float *vb)
#define ARGS_F16_F16 p, g, ZO_F16, out, ZO_F16, lo, hi, b0, hp, s, mb, vb
#define ARGS_BF16_BF16 p, g, ZO_BF16, out, ZO_BF16, lo, hi, b0, hp, s, mb, vb
ZO_SPECIALISE(zo8_256_adam_span, zo8_256_adam_span_body, ZO_T256, ADAM8_SPAN_PARAMS,
              (p, g, gk, out, ok, lo, hi, b0, hp, s, mb, vb))
#undef ARGS_F16_F16
#undef ARGS_BF16_BF16

/* the rounding decision of 8 lanes (zo8_up) as 0/1 ints */
static inline ZO_T256 __m256i zo8_256_up(__m256 x, __m256 lo, __m256 hi, __m256 r, int sr) {
    __m256 lhs = _mm256_sub_ps(x, lo);
    __m256 rhs = sr ? _mm256_mul_ps(r, _mm256_sub_ps(hi, lo)) : _mm256_sub_ps(hi, x);
    return _mm256_srli_epi32(_mm256_castps_si256(_mm256_cmp_ps(lhs, rhs, _CMP_GT_OQ)), 31);
}

static ZO_T256 void zo8_256_block_max(const float *mb, const float *vb, int64_t n, float *am, float *av) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    float ta[8], tb[8], ra, rb;
    int64_t k = 0;
    int j;
    for (; k + 8 <= n; k += 8) {
        a = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(mb + k), absmask), a);
        b = _mm256_max_ps(_mm256_loadu_ps(vb + k), b);
    }
    _mm256_storeu_ps(ta, a);
    _mm256_storeu_ps(tb, b);
    zo8_block_max(mb + k, vb + k, n - k, &ra, &rb);
    for (j = 0; j < 8; j++) {  /* max is exact: any order gives the scalar loop's result */
        ra = ta[j] > ra ? ta[j] : ra;
        rb = tb[j] > rb ? tb[j] : rb;
    }
    *am = ra;
    *av = rb;
}

static inline ZO_T256 __m256 zo8_256_val_m(__m256 q) {
    __m256 t = _mm256_mul_ps(q, _mm256_set1_ps(ZO8_INVM));
    t = _mm256_mul_ps(t, t);
    return _mm256_mul_ps(t, t);
}
static inline ZO_T256 __m256 zo8_256_val_v(__m256 q) {
    __m256 t = _mm256_mul_ps(q, _mm256_set1_ps(ZO8_INVV));
    t = _mm256_mul_ps(t, t);
    t = _mm256_mul_ps(t, t);
    return _mm256_mul_ps(t, t);
}

static ZO_T256 void zo8_256_encode(const float *mb, const float *vb, int64_t n, int64_t e0,
                                   float im, float iv, const zo_state8 *s) {
    const int sr = s->rounding == ZO_ROUND_STOCHASTIC;
    const __m256 vim = _mm256_set1_ps(im), viv = _mm256_set1_ps(iv);
    const __m256 i16 = _mm256_set1_ps(ZO_INV65536), onef = _mm256_set1_ps(1.0f);
    const __m256 c127 = _mm256_set1_ps(127.0f), c255 = _mm256_set1_ps(255.0f);
    const __m256i low = _mm256_set1_epi32(0xffff), smask = _mm256_set1_epi32(0x80);
    const __m256i q126 = _mm256_set1_epi32(126), q254 = _mm256_set1_epi32(254);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i gold = _mm256_set1_epi32((int)0x9e3779b9u), key = _mm256_set1_epi32((int)s->key);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 mi = _mm256_loadu_ps(mb + k);
        __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)(s->index_base + (uint32_t)(e0 + k))), lanes);
        __m256i r = zo256_fold(_mm256_add_epi32(_mm256_mullo_epi32(idx, gold), key));
        /* m */
        __m256 x = _mm256_mul_ps(_mm256_and_ps(mi, absmask), vim);
        __m256i q0 = _mm256_min_epi32(_mm256_cvttps_epi32(_mm256_mul_ps(_mm256_sqrt_ps(_mm256_sqrt_ps(x)), c127)), q126);
        __m256 f0 = _mm256_cvtepi32_ps(q0);
        __m256i qm = _mm256_add_epi32(q0, zo8_256_up(x, zo8_256_val_m(f0), zo8_256_val_m(_mm256_add_ps(f0, onef)),
                                                     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(r, low)), i16), sr));
        __m256i qv;
        qm = _mm256_or_si256(qm, _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(mi), 24), smask));
        /* v */
        x = _mm256_mul_ps(_mm256_loadu_ps(vb + k), viv);
        q0 = _mm256_min_epi32(_mm256_cvttps_epi32(_mm256_mul_ps(
                 _mm256_sqrt_ps(_mm256_sqrt_ps(_mm256_sqrt_ps(x))), c255)), q254);
        f0 = _mm256_cvtepi32_ps(q0);
        qv = _mm256_add_epi32(q0, zo8_256_up(x, zo8_256_val_v(f0), zo8_256_val_v(_mm256_add_ps(f0, onef)),
                                             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r, 16)), i16), sr));
        zo8_256_store_codes(s->m + e0 + k, qm);
        zo8_256_store_codes(s->v + e0 + k, qv);
    }
    zo8_encode_scalar(mb, vb, k, n, e0, im, iv, s);
}
#endif

/* ---------------------------------------------------------------- a window of blocks */
/* Adam over whole blocks [lo, hi) (lo on a block; hi on a block or the arrays' end),
 * with the segments covering it (sorted, contiguous). */
static void zo_adam8_chunk(int level, float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                           const zo_seg8 *segs, int nseg, const zo_state8 *s) {
    float mb[ZO_QBLOCK] __attribute__((aligned(32)));
    float vb[ZO_QBLOCK] __attribute__((aligned(32)));
    int k = 0;
    int64_t b0;
    for (b0 = lo; b0 < hi; b0 += ZO_QBLOCK) {
        int64_t be = b0 + ZO_QBLOCK < hi ? b0 + ZO_QBLOCK : hi, x = b0;
        int updated = 0;
        float am, av, im, iv;  /* block maxima, encode factors */
        while (x < be) {
            int64_t y;
            while (k < nseg - 1 && segs[k].hi <= x) k++;
            y = segs[k].hi < be ? segs[k].hi : be;
            if (segs[k].keep) {
                zo8_keep_span(p, out, ok, x, y, b0, s, mb, vb);
            } else {
                updated = 1;
#if ZO_HAVE_X86
                if (level >= ZO_AVX2) zo8_256_adam_span(p, g, gk, out, ok, x, y, b0, &segs[k].h, s, mb, vb);
                else
#endif
                zo8_adam_span_scalar(p, g, gk, out, ok, x, y, b0, &segs[k].h, s, mb, vb);
            }
            x = y;
        }
        if (!updated) continue;  /* nothing moved: codes and scales stay as they are */
#if ZO_HAVE_X86
        if (level >= ZO_AVX2) zo8_256_block_max(mb, vb, be - b0, &am, &av);
        else
#endif
        zo8_block_max(mb, vb, be - b0, &am, &av);
        s->ms[b0 / ZO_QBLOCK] = am;
        s->vs[b0 / ZO_QBLOCK] = av;
        im = zo8_inv(am);
        iv = zo8_inv(av);
#if ZO_HAVE_X86
        if (level >= ZO_AVX2) { zo8_256_encode(mb, vb, be - b0, b0, im, iv, s); continue; }
#endif
        zo8_encode_scalar(mb, vb, 0, be - b0, b0, im, iv, s);
    }
}

/* ---------------------------------------------------------------- conversions */
/* src (fp32 moments) -> codes + scales over whole blocks [lo, hi); which: 0 m, 1 v.
 * Rounds to nearest (a checkpoint converted on load). */
static void zo8_quantize_chunk(const float *src, uint8_t *codes, float *scales, int which, int64_t lo, int64_t hi) {
    int64_t b0, i;
    for (b0 = lo; b0 < hi; b0 += ZO_QBLOCK) {
        int64_t be = b0 + ZO_QBLOCK < hi ? b0 + ZO_QBLOCK : hi;
        float a = 0.0f, inv;
        for (i = b0; i < be; i++) {
            float x = which ? src[i] : fabsf(src[i]);
            a = x > a ? x : a;
        }
        scales[b0 / ZO_QBLOCK] = a;
        inv = zo8_inv(a);
        for (i = b0; i < be; i++)
            codes[i] = which ? zo8_encode_v(src[i], inv, 0, 0) : zo8_encode_m(src[i], inv, 0, 0);
    }
}

static void zo8_dequantize_chunk(const uint8_t *codes, const float *scales, float *dst, int which,
                                 int64_t lo, int64_t hi) {
    int64_t i;
    for (i = lo; i < hi; i++)
        dst[i] = which ? zo8_decode_v(codes[i], scales[i / ZO_QBLOCK]) : zo8_decode_m(codes[i], scales[i / ZO_QBLOCK]);
}

/* The int8-state access pattern with trivial (integer) arithmetic: g 2 B, m and v 1 + 1 B each,
 * and the exact master (hi 2, rem 2 + 2, out 2: 14 B/element) or an fp32 one (4 + 4,
 * out 2: 16 B/element).  Scales (0.03 B) left out. */
#define ZO_STREAM8_BODY                                                                   \
    int64_t i;                                                                            \
    if (rem) {                                                                            \
        for (i = lo; i < hi; i++) {                                                       \
            uint16_t gi = g[i];                                                           \
            rem[i] = (uint16_t)(rem[i] + gi); m[i] = (uint8_t)(m[i] + gi);                \
            v[i] = (uint8_t)(v[i] + gi); out[i] = (uint16_t)(hi16[i] + gi);               \
        }                                                                                 \
    } else {                                                                              \
        for (i = lo; i < hi; i++) {                                                       \
            uint16_t gi = g[i];                                                           \
            uint32_t pi = p[i] + gi;                                                      \
            p[i] = pi; m[i] = (uint8_t)(m[i] + gi);                                       \
            v[i] = (uint8_t)(v[i] + gi); out[i] = (uint16_t)(pi >> 16);                   \
        }                                                                                 \
    }
#define ZO_STREAM8_PARAMS (uint32_t *p, uint16_t *rem, const uint16_t *hi16, uint8_t *m, uint8_t *v, \
                           const uint16_t *g, uint16_t *out, int64_t lo, int64_t hi)
static void zo8_stream_scalar ZO_STREAM8_PARAMS { ZO_STREAM8_BODY }
#if ZO_HAVE_X86
/* written out: the mixed 8/16-bit widths keep the compiler from vectorising the
 * loop above (it ran at a quarter of the memory's speed) */
static ZO_T256 void zo8_256_stream ZO_STREAM8_PARAMS {
    const __m256i one = _mm256_set1_epi8(1);
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {
        __m256i g0 = _mm256_loadu_si256((const __m256i *)(g + i)), g1 = _mm256_loadu_si256((const __m256i *)(g + i + 16));
        _mm256_storeu_si256((__m256i *)(m + i), _mm256_add_epi8(_mm256_loadu_si256((const __m256i *)(m + i)), one));
        _mm256_storeu_si256((__m256i *)(v + i), _mm256_add_epi8(_mm256_loadu_si256((const __m256i *)(v + i)), one));
        if (rem) {
            _mm256_storeu_si256((__m256i *)(rem + i), _mm256_add_epi16(_mm256_loadu_si256((const __m256i *)(rem + i)), g0));
            _mm256_storeu_si256((__m256i *)(rem + i + 16),
                                _mm256_add_epi16(_mm256_loadu_si256((const __m256i *)(rem + i + 16)), g1));
            _mm256_storeu_si256((__m256i *)(out + i), _mm256_add_epi16(_mm256_loadu_si256((const __m256i *)(hi16 + i)), g0));
            _mm256_storeu_si256((__m256i *)(out + i + 16),
                                _mm256_add_epi16(_mm256_loadu_si256((const __m256i *)(hi16 + i + 16)), g1));
        } else {
            int k;
            for (k = 0; k < 4; k++) {
                __m256i gk = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + i + 8 * k)));
                __m256i pk = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(p + i + 8 * k)), gk);
                _mm256_storeu_si256((__m256i *)(p + i + 8 * k), pk);
                zo256_store_u16(out, i + 8 * k, _mm256_srli_epi32(pk, 16));
            }
        }
    }
    zo8_stream_scalar(p, rem, hi16, m, v, g, out, i, hi);
}
#endif
static void zo8_stream_chunk(int level, uint32_t *p, uint16_t *rem, const uint16_t *hi16, uint8_t *m, uint8_t *v,
                             const uint16_t *g, uint16_t *out, int64_t lo, int64_t hi) {
#if ZO_HAVE_X86
    if (level >= ZO_AVX2) { zo8_256_stream(p, rem, hi16, m, v, g, out, lo, hi); return; }
#endif
    zo8_stream_scalar(p, rem, hi16, m, v, g, out, lo, hi);
}

#endif /* ZO_KERNELS_INT8_H */
