/*
 * state_dtype="int8": Adam's m and v (Lion's m) as 8-bit float-like codes, block-wise scaled.
 *
 * Layout: elements are grouped into blocks of ZO_QBLOCK (256) from element 0
 * of the arrays passed in (the server passes shard slices that start on a
 * block: shards and kernel windows are block aligned).  Per block one fp32
 * scale per moment, so 2 * 4 / 256 = 0.03 B/param on top of the codes.
 *
 *   m: sign | e (4 bits) | f (3 bits)   |m| = scale_m * (e ? 2^(e-15) (1 + f/8) : 2^-14 f/8)
 *   v:        e (5 bits) | f (3 bits)    v  = scale_v * (e ? 2^(e-31) (1 + f/8) : 2^-30 f/8)
 *
 * These are small floats (e4m3 and e5m3 with subnormals) relative to the block's
 * scale, so they code and decode by integer operations on fp32 bit patterns:
 * a code is the float's exponent and top mantissa bits, rebiased.  Rounding is
 * stochastic (unbiased) by adding random bits below the kept ones before
 * truncating; within a binade the codes are evenly spaced, so that is rounding in
 * value space, and the carry out of the mantissa steps into the next binade.  No
 * square root, no table, no search: the power-law codes this replaced (m =
 * scale (q/127)^4, v = scale (q/255)^8; format-1 checkpoints still hold them)
 * took three to five square roots and two code values per element to encode, on
 * the one divider that the update's own square root and division already keep
 * busy, and ran at 0.3-0.5x the fp32 kernel's speed (BENCHMARKS.md,
 * bench_adam_state, has what these run at).  Their cost: 3 mantissa bits (a
 * relative step of 6-12%, against 3-25% for the power laws over their range), so
 * m and v are ~2x less accurate, and Adam's displacement moved 1.4x further from
 * float64 on gradients that spread within a block and 2.5x on pure noise
 * (tests/test_cpu_adam_int8.py measures both).
 * Ranges: m's smallest non-zero code is 2^-17 of the block's scale, v's 2^-33
 * (v's codes have the range of m's squared).  A v is never coded 0 unless it is
 * below 2^-54 of its block's scale (0 in the encoder's fixed point): an element
 * whose v rounded to 0 while its m did not would take a step of m / eps, so v
 * rounds up to the smallest code instead (a bias upward, towards smaller steps,
 * for elements 2^-33 below their block's largest); a v of 0 (a parameter that
 * never had a gradient) stays 0.
 *
 * Subnormal codes are decoded as f * 2^-17 (2^-33) and encoded with the
 * magic-number addition x + 2^-14 (2^-30), never through denormal fp32
 * operands: some CPUs take a microcode assist on those.
 *
 * One pass over memory per block, in three loops over a 2 KiB block buffer (in
 * L1): the old m and v decoded into it; every element's Adam update (the same
 * arithmetic as the fp32 kernel) reading them there and parking the new ones,
 * with the block's largest |m| and v; then the new scales (those maxima) and the
 * codes.  Three loops, not one, because the update's square root and division
 * leave ~60 vector operations of a long loop body waiting in the scheduler, so
 * the core cannot overlap one turn with the next: decoding and encoding inside
 * the update's loop made the kernel ~1.6x slower on Zen 3 (BENCHMARKS.md), and
 * decoding inside it 4% slower on Zen 5.  A block's encode waits until the next
 * block is updated (zo_opt8_chunk says why).  Each loop has an AVX-512 body (16
 * lanes), an AVX2 one (8) and the scalar one, which the others match bit for bit.
 *
 * A block may hold elements of several segments (param groups, parameters
 * without a gradient this step): each gets its own hyper-parameters; kept
 * elements are decoded and, if the block has updated elements too,
 * re-encoded with its new scale (a block with no updated element is left
 * untouched).  The random bits are zo_rand32's (16 for m, 16 for v), keyed by
 * step and model-wide index.
 *
 * Lion (zo_state8.lion) has one moment, m, coded as Adam's m is; v and its scales
 * are absent.  Its update is zo_lion_scalar's arithmetic on the decoded m: the sign
 * of b1 m + (1 - b1) g moves the weights, b2 m + (1 - b2) g is the new m.
 */
#ifndef ZO_KERNELS_INT8_H
#define ZO_KERNELS_INT8_H

#include <float.h>

#include "_kernels.h"

#define ZO_QBLOCK 256

typedef struct {
    uint8_t *m, *v;        /* codes */
    float *ms, *vs;        /* per-block scales (index: element / ZO_QBLOCK) */
    uint16_t *rem;         /* the exact master's low halves, or NULL: the master is p (fp32) */
    const uint16_t *hi;    /* with rem: its high halves (the last update's bf16 weights) */
    uint32_t key;          /* per-step key of the stochastic rounding */
    uint32_t index_base;   /* model-wide index of element 0, mod 2^32 */
    int rounding;          /* zo_rounding */
    int lion;              /* 1: Lion, one moment (m; v and vs unused), 0: Adam/AdamW */
} zo_state8;

/* One run of elements [lo, hi) with one set of hyper-parameters, or kept (no
 * gradient this step: master and moments stay, the out slot gets the weights). */
typedef struct {
    int64_t lo, hi;
    zo_hparams h;
    int keep;
} zo_seg8;

/* ---------------------------------------------------------------- scalar codes */
/* The two formats, as fp32 bit arithmetic.  ZO8_M_BIAS / ZO8_V_BIAS rebias a code's
 * exponent into fp32's (e + 112: e = 15 is 2^0; e + 96: e = 31 is 2^0); below
 * ZO8_M_TINY / ZO8_V_TINY (2^-14, 2^-30: e = 0) a code is subnormal. */
#define ZO8_M_BIAS (112u << 23)
#define ZO8_V_BIAS (96u << 23)
#define ZO8_M_TINY 0x1p-14f
#define ZO8_V_TINY 0x1p-30f
#define ZO8_M_SUB 0x1p-17f   /* value of subnormal code f: f * 2^-17 (m), f * 2^-33 (v) */
#define ZO8_V_SUB 0x1p-33f
#define ZO8_SHIFT 20         /* 23 - 3 mantissa bits */
#define ZO8_HALF (1u << 19)  /* round to nearest (ties up): half a code step */

static inline float zo_f32_of(uint32_t x) { float f; memcpy(&f, &x, 4); return f; }
static inline uint32_t zo_bits_of(float f) { uint32_t x; memcpy(&x, &f, 4); return x; }

static inline float zo8_inv(float scale) { return scale >= FLT_MIN ? 1.0f / scale : 0.0f; }

/* the normalised value of a code (without sign, before the scale) */
static inline float zo8_unit_m(uint32_t c7) {
    return c7 < 8u ? (float)c7 * ZO8_M_SUB : zo_f32_of((c7 << ZO8_SHIFT) + ZO8_M_BIAS);
}
static inline float zo8_unit_v(uint32_t c) {
    return c < 8u ? (float)c * ZO8_V_SUB : zo_f32_of((c << ZO8_SHIFT) + ZO8_V_BIAS);
}
static inline float zo8_decode_m(uint8_t c, float scale) {
    float x = zo8_unit_m(c & 0x7fu) * scale;
    return (c & 0x80u) ? -x : x;
}
static inline float zo8_decode_v(uint8_t c, float scale) { return zo8_unit_v(c) * scale; }

/* x >= 0 (the moment times its block's inverse scale) as a code's bits before the
 * rounding bits are added and the mantissa cut to 3 bits: its fp32 bits rebiased, or
 * below tiny the magic-number sum x + tiny less tiny's bits (x * 2^37 or x * 2^53, a
 * subnormal code's fixed point).  Each is at least the other exactly where it is the
 * right one (x + tiny <= 2x above tiny; bits(x) - bias is below 2^23 or negative under
 * it), so the larger of the two is the answer and no comparison is needed. */
static inline uint32_t zo8_rebias(float x, float tiny, uint32_t bias) {
    int32_t nrm = (int32_t)(zo_bits_of(x) - bias), sub = (int32_t)(zo_bits_of(x + tiny) - zo_bits_of(tiny));
    return (uint32_t)(nrm > sub ? nrm : sub);
}
/* r: 20 bits added below the kept ones (random for stochastic rounding, ZO8_HALF for
 * nearest).  No clamp: the block's scale bounds x by 1, far below 2, where m's code
 * would reach the sign bit.  Only a NaN or inf moment (the engine sends no such
 * gradient) makes a code of 256 or more, which the vector path saturates and this
 * one truncates. */
static inline uint8_t zo8_encode_m(float mi, float inv, uint32_t r) {
    uint32_t q = (zo8_rebias(fabsf(mi) * inv, ZO8_M_TINY, ZO8_M_BIAS) + r) >> ZO8_SHIFT;
    return (uint8_t)(q | ((zo_bits_of(mi) >> 31) << 7));
}
static inline uint8_t zo8_encode_v(float vi, float inv, uint32_t r) {
    uint32_t t = zo8_rebias(vi * inv, ZO8_V_TINY, ZO8_V_BIAS), q = (t + r) >> ZO8_SHIFT, nz = t < 1u ? t : 1u;
    return (uint8_t)(q > nz ? q : nz);  /* not 0 unless t is: see the header */
}
/* the 20 rounding bits of m and of v from one zo_rand32 word (16 random bits each) */
static inline uint32_t zo8_rbits_m(uint32_t r, int sr) { return sr ? (r & 0xffffu) << 4 : ZO8_HALF; }
static inline uint32_t zo8_rbits_v(uint32_t r, int sr) { return sr ? (r >> 16) << 4 : ZO8_HALF; }

/* ---------------------------------------------------------------- scalar block parts */
/* the old moments of [lo, hi) in the block from b0, decoded into mb/vb (indexed from b0) */
static void zo8_decode_scalar(const zo_state8 *s, int64_t b0, int64_t lo, int64_t hi, float *mb, float *vb) {
    const float msc = s->ms[b0 / ZO_QBLOCK], vsc = s->lion ? 0.0f : s->vs[b0 / ZO_QBLOCK];
    int64_t i;
    for (i = lo; i < hi; i++) mb[i - b0] = zo8_decode_m(s->m[i], msc);
    if (!s->lion)
        for (i = lo; i < hi; i++) vb[i - b0] = zo8_decode_v(s->v[i], vsc);
}

/* Adam over [lo, hi) (inside one block b): the old m and v from mb/vb, the new ones back
 * there, master and weights stored; am/av take the largest new |m| and v. */
static void zo8_adam_span_scalar(float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                                 int64_t b0, const zo_hparams *h, const zo_state8 *s, float *mb, float *vb,
                                 float *am, float *av) {
    float a = *am, b = *av;
    int64_t i;
    for (i = lo; i < hi; i++) {
        float gi = zo_load_grad(g, gk, i);
        float pi = s->rem ? zo_join_master(s->hi[i], s->rem[i]) : p[i];
        float mi, vi, denom, p0;
        if (h->grad_scale != 1.0f) gi = gi * h->grad_scale;
        if (h->l2 != 0.0f) gi = gi + h->l2 * pi;
        mi = h->beta1 * mb[i - b0] + h->one_minus_beta1 * gi;
        vi = h->beta2 * vb[i - b0] + h->one_minus_beta2 * (gi * gi);
        denom = sqrtf(vi) * h->inv_sqrt_bc2 + h->eps;
        p0 = pi;
        if (h->decoupled) pi = pi * h->decay;
        pi = pi - h->step_size * (mi / denom);
        mb[i - b0] = mi;
        vb[i - b0] = vi;
        a = fabsf(mi) > a ? fabsf(mi) : a;
        b = vi > b ? vi : b;
        if (s->rem) {
            zo_split_master(pi, (uint16_t *)out + i, s->rem + i);
        } else {
            p[i] = pi;
            zo_store_out(out, ok, i, h->predict != 0.0f ? pi + h->predict * (pi - p0) : pi);
        }
    }
    *am = a;
    *av = b;
}

/* Lion over [lo, hi) (inside one block b): the old m from mb, the new one back there,
 * master and weights stored; am takes the largest new |m|.  zo_lion_scalar's arithmetic. */
static void zo8_lion_span_scalar(float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                                 int64_t b0, const zo_hparams *h, const zo_state8 *s, float *mb, float *am) {
    float a = *am;
    int64_t i;
    for (i = lo; i < hi; i++) {
        float gi = zo_load_grad(g, gk, i);
        float pi = s->rem ? zo_join_master(s->hi[i], s->rem[i]) : p[i];
        float mi = mb[i - b0], c, mn;
        if (h->grad_scale != 1.0f) gi = gi * h->grad_scale;
        c = h->beta1 * mi + h->one_minus_beta1 * gi;
        pi = pi * h->decay;
        pi = pi - h->step_size * zo_signf(c);
        mn = h->beta2 * mi + h->one_minus_beta2 * gi;
        mb[i - b0] = mn;
        a = fabsf(mn) > a ? fabsf(mn) : a;
        if (s->rem) {
            zo_split_master(pi, (uint16_t *)out + i, s->rem + i);
        } else {
            p[i] = pi;
            zo_store_out(out, ok, i, pi);
        }
    }
    *am = a;
}

/* the out slot of a kept span: the exact master's high halves, or the fp32 master
 * rounded as INIT rounds it */
static void zo8_keep_weights(const float *p, void *out, int ok, int64_t lo, int64_t hi, const zo_state8 *s) {
    int64_t i;
    if (s->rem) {
        if ((const void *)s->hi != out) memcpy((uint16_t *)out + lo, s->hi + lo, (size_t)(hi - lo) * 2);
        return;
    }
    for (i = lo; i < hi; i++) zo_store_out(out, ok, i, p[i]);
}

/* A kept span: its decoded moments (in mb/vb) stay and count towards the block's maxima,
 * the out slot gets the weights. */
static void zo8_keep_span(const float *p, void *out, int ok, int64_t lo, int64_t hi, int64_t b0,
                          const zo_state8 *s, const float *mb, const float *vb, float *am, float *av) {
    int64_t i;
    for (i = lo; i < hi; i++) {
        *am = fabsf(mb[i - b0]) > *am ? fabsf(mb[i - b0]) : *am;
        if (!s->lion) *av = vb[i - b0] > *av ? vb[i - b0] : *av;
    }
    zo8_keep_weights(p, out, ok, lo, hi, s);
}

/* codes of mb/vb[from, n) for elements from e0, with the block's encode factors im/iv */
static void zo8_encode_scalar(const float *mb, const float *vb, int64_t from, int64_t n, int64_t e0,
                              float im, float iv, const zo_state8 *s) {
    const int sr = s->rounding == ZO_ROUND_STOCHASTIC;
    int64_t k;
    for (k = from; k < n; k++) {
        uint32_t r = zo_rand32(s->key, s->index_base + (uint32_t)(e0 + k));
        s->m[e0 + k] = zo8_encode_m(mb[k], im, zo8_rbits_m(r, sr));
        if (!s->lion) s->v[e0 + k] = zo8_encode_v(vb[k], iv, zo8_rbits_v(r, sr));
    }
}

/* ---------------------------------------------------------------- AVX2 block parts */
#if ZO_HAVE_X86
/* 8 codes decoded (times the scale).  m's code is an fp16 bit pattern cut short: its
 * sign | e4 | f3 placed at fp16's sign, exponent (bias 15, as m's) and top mantissa
 * bits is exactly m's unit value, subnormals (e = 0: 2^-14 f/8) included, so the F16C
 * conversion decodes it (zo8_unit_m's value, signed).  Sign-extended to 16 bits and
 * shifted by 7, the code's sign lands on fp16's (bit 15, from the extension) and on
 * bit 14 (cleared by the mask): 4 operations instead of 12.  The kernel is bound by
 * its vector operations, not by memory (BENCHMARKS.md), so each one saved counts.
 * v's e5 has one binade more than fp16's exponent holds (e = 31 would be inf), so v
 * is rebuilt from its fields as zo8_unit_v does. */
static inline ZO_T256 __attribute__((always_inline)) __m256 zo8_256_decode_m(const uint8_t *c, __m256 scale) {
    __m128i q = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)c));
    __m128i h = _mm_and_si128(_mm_slli_epi16(q, 7), _mm_set1_epi16((short)0xbf80));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), scale);
}
static inline ZO_T256 __attribute__((always_inline)) __m256 zo8_256_decode_v(const uint8_t *c, __m256 scale) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(ZO8_V_SUB));
    __m256 nrm = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(q, ZO8_SHIFT),
                                                      _mm256_set1_epi32((int)ZO8_V_BIAS)));
    __m256 x = _mm256_blendv_ps(nrm, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), q)));
    return _mm256_mul_ps(x, scale);
}
/* v's 8 codes decoded where none is subnormal (c >= 8): zo8_256_decode_v's normal half alone */
static inline ZO_T256 __attribute__((always_inline)) __m256 zo8_256_decode_v_normal(const uint8_t *c, __m256 scale) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(q, ZO8_SHIFT),
                                                              _mm256_set1_epi32((int)ZO8_V_BIAS))), scale);
}
/* Whether a whole block's v codes are all normal (>= 8), so its decode can skip the
 * subnormal half (5 of 9 operations a lane group), and whether its moments' codes will be
 * (zo8_256_codes_normal), so its encode can skip the subnormal sums and v's floor at one
 * code (8 of 23).  A subnormal code is a moment below 2^-14 (m) or 2^-30 (v) of its
 * block's largest: most blocks have none, and the checks cost ~3 operations per 8
 * elements against ~13 saved on a kernel bound by its operations (BENCHMARKS.md).  Both
 * paths give the same bits: each is the general one where it is taken. */
static inline ZO_T256 int zo8_256_vcodes_normal(const uint8_t *c) {
    __m256i mn = _mm256_loadu_si256((const __m256i *)c);
    int j;
    for (j = 32; j < ZO_QBLOCK; j += 32) mn = _mm256_min_epu8(mn, _mm256_loadu_si256((const __m256i *)(c + j)));
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(mn, _mm256_set1_epi8(8)), mn)) == -1;
}
/* Whether every m of mb[0, n) times im (and v of vb times iv) is at least ZO8_M_TINY
 * (ZO8_V_TINY) or NaN, where zo8_rebias is its normal half (the larger one there: see
 * zo8_rebias) and a v's code is at least 8 (no floor needed).  The smallest |m| (v) by
 * its bits (non-negative floats order as their bits; a NaN's are above every number's,
 * a v with its sign set is below them all and fails), times the factor: the product is
 * monotonic, so the smallest product is the smallest moment's. */
static inline ZO_T256 int zo8_256_codes_normal(const float *mb, const float *vb, int64_t n, float im, float iv,
                                               const int lion) {
    const __m256i abs = _mm256_set1_epi32(0x7fffffff);
    __m256i am = abs, av = abs;
    int32_t ta[8], tv[8], a = INT32_MAX, b = INT32_MAX;
    int64_t k;
    int j;
    if (n % 8) return 0;
    for (k = 0; k < n; k += 8) {
        am = _mm256_min_epi32(am, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(mb + k)), abs));
        if (!lion) av = _mm256_min_epi32(av, _mm256_loadu_si256((const __m256i *)(vb + k)));
    }
    _mm256_storeu_si256((__m256i *)ta, am);
    _mm256_storeu_si256((__m256i *)tv, av);
    for (j = 0; j < 8; j++) {
        a = ta[j] < a ? ta[j] : a;
        b = tv[j] < b ? tv[j] : b;
    }
    if (!(zo_f32_of((uint32_t)a) * im >= ZO8_M_TINY)) return 0;
    return lion || (b >= 0 && zo_f32_of((uint32_t)b) * iv >= ZO8_V_TINY);
}
/* zo8_rebias, 8 lanes */
static inline ZO_T256 __attribute__((always_inline)) __m256i zo8_256_rebias(__m256 x, __m256 tiny, int bias) {
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(x, tiny)), _mm256_castps_si256(tiny));
    return _mm256_max_epi32(_mm256_sub_epi32(_mm256_castps_si256(x), _mm256_set1_epi32(bias)), sub);
}
/* the block's old moments decoded into mb/vb, 8 lanes a turn: a loop of its own, apart
 * from the update's (the header says why) */
static ZO_T256 void zo8_256_decode(const zo_state8 *s, int64_t b0, int64_t be, float *mb, float *vb) {
    const __m256 msc = _mm256_set1_ps(s->ms[b0 / ZO_QBLOCK]);
    const uint8_t *mc = s->m, *vc = s->v;
    int64_t i = b0;
    if (s->lion) {
        for (; i + 8 <= be; i += 8) _mm256_storeu_ps(mb + (i - b0), zo8_256_decode_m(mc + i, msc));
    } else if (be - b0 == ZO_QBLOCK && zo8_256_vcodes_normal(vc + b0)) {
        const __m256 vsc = _mm256_set1_ps(s->vs[b0 / ZO_QBLOCK]);
        for (; i + 8 <= be; i += 8) {
            _mm256_storeu_ps(mb + (i - b0), zo8_256_decode_m(mc + i, msc));
            _mm256_storeu_ps(vb + (i - b0), zo8_256_decode_v_normal(vc + i, vsc));
        }
    } else {
        const __m256 vsc = _mm256_set1_ps(s->vs[b0 / ZO_QBLOCK]);
        for (; i + 8 <= be; i += 8) {
            _mm256_storeu_ps(mb + (i - b0), zo8_256_decode_m(mc + i, msc));
            _mm256_storeu_ps(vb + (i - b0), zo8_256_decode_v(vc + i, vsc));
        }
    }
    if (i < be) zo8_decode_scalar(s, b0, i, be, mb, vb);  /* only for a tail: see zo_opt8_chunk */
}

/* The update of 8 lanes a turn.  The flags (exact master, grad scale, L2, decoupled decay,
 * prediction) are arguments that the dispatcher below passes as constants for the
 * common cases: the loop holds more constants than AVX2 has registers, and with a flag
 * tested on every turn the compiler re-materialised them. */
static inline ZO_T256 __attribute__((always_inline)) void zo8_256_adam_span_body(
        float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, int64_t b0,
        const zo_hparams *hp, const zo_state8 *s, float *mb, float *vb, float *am, float *av,
        const int exact, const int scale, const int has_l2, const int decoupled, const int predict) {
    const zo_hparams hc = *hp;  /* a private copy: the stores below may alias *hp as far as C knows */
    const zo_hparams *h = &hc;
    const __m256 gs = _mm256_set1_ps(h->grad_scale), l2 = _mm256_set1_ps(h->l2);
    const __m256 b1 = _mm256_set1_ps(h->beta1), omb1 = _mm256_set1_ps(h->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(h->beta2), omb2 = _mm256_set1_ps(h->one_minus_beta2);
    const __m256 ibc2 = _mm256_set1_ps(h->inv_sqrt_bc2), eps = _mm256_set1_ps(h->eps);
    const __m256 dec = _mm256_set1_ps(h->decay), ss = _mm256_set1_ps(h->step_size);
    const __m256 pr = _mm256_set1_ps(h->predict);
    /* locals, not loads through s: the stores below may alias it as far as C knows */
    uint16_t *rem = s->rem;
    const uint16_t *hi16 = s->hi;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 ma = _mm256_setzero_ps(), va = _mm256_setzero_ps();  /* the span's largest |m|, v */
    /* the denominators, between the square roots' loop and the divisions' (in L1) */
    float db[ZO_QBLOCK] __attribute__((aligned(32)));
    float ta[8], tv[8], a, b;
    int64_t i = lo, k;
    int j;
    for (; i + 8 <= hi; i += 8) {
        __m256 gi = zo256_load_grad(g, gk, i);
        __m256 mi, vi;
        if (scale) gi = _mm256_mul_ps(gi, gs);
        if (has_l2) gi = _mm256_add_ps(gi, _mm256_mul_ps(l2, zo256_load_master(p, rem, hi16, i, exact)));
        mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(mb + (i - b0))), _mm256_mul_ps(omb1, gi));
        vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(vb + (i - b0))),
                           _mm256_mul_ps(omb2, _mm256_mul_ps(gi, gi)));
        _mm256_store_ps(db + (i - lo), _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), ibc2), eps));
        _mm256_storeu_ps(mb + (i - b0), mi);
        _mm256_storeu_ps(vb + (i - b0), vi);
        /* max_ps(x, a) returns a for a NaN x, as the scalar x > a ? x : a does */
        ma = _mm256_max_ps(_mm256_and_ps(mi, absmask), ma);
        va = _mm256_max_ps(vi, va);
    }
    for (k = lo; k < i; k += 8) {
        __m256 pi = zo256_load_master(p, rem, hi16, k, exact), p0 = pi;
        if (decoupled) pi = _mm256_mul_ps(pi, dec);
        pi = _mm256_sub_ps(pi, _mm256_mul_ps(ss, _mm256_div_ps(_mm256_loadu_ps(mb + (k - b0)),
                                                               _mm256_load_ps(db + (k - lo)))));
        zo256_store_master(p, rem, out, ok, k, pi,
                             predict ? _mm256_add_ps(pi, _mm256_mul_ps(pr, _mm256_sub_ps(pi, p0))) : pi, exact);
    }
    _mm256_storeu_ps(ta, ma);
    _mm256_storeu_ps(tv, va);
    /* max is exact: any order gives the scalar loop's result.  Into locals: through am
     * and av (which may alias ta as far as C knows) each step was a store and a reload,
     * one long dependent chain a block */
    a = *am;
    b = *av;
    for (j = 0; j < 8; j++) {
        a = ta[j] > a ? ta[j] : a;
        b = tv[j] > b ? tv[j] : b;
    }
    *am = a;
    *av = b;
    if (i < hi) zo8_adam_span_scalar(p, g, gk, out, ok, i, hi, b0, h, s, mb, vb, am, av);
}

static ZO_T256 void zo8_256_adam_span(float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                                      int64_t b0, const zo_hparams *h, const zo_state8 *s, float *mb, float *vb,
                                      float *am, float *av) {
    const int exact = s->rem != NULL, scale = h->grad_scale != 1.0f, has_l2 = h->l2 != 0.0f;
    const int decoupled = h->decoupled, predict = h->predict != 0.0f;
    if (gk == ZO_BF16 && ok == ZO_BF16 && exact && !scale && !has_l2 && decoupled)  /* bf16 AdamW */
        zo8_256_adam_span_body(p, g, ZO_BF16, out, ZO_BF16, lo, hi, b0, h, s, mb, vb, am, av, 1, 0, 0, 1, 0);
    else if (gk == ZO_F16 && ok == ZO_F16 && !exact && !has_l2 && decoupled)  /* fp16 AdamW, fp32 master */
        zo8_256_adam_span_body(p, g, ZO_F16, out, ZO_F16, lo, hi, b0, h, s, mb, vb, am, av, 0, scale, 0, 1, predict);
    else if (gk == ZO_BF16 && ok == ZO_BF16 && !exact && !scale && !has_l2 && decoupled)  /* bf16, DPU's prediction */
        zo8_256_adam_span_body(p, g, ZO_BF16, out, ZO_BF16, lo, hi, b0, h, s, mb, vb, am, av, 0, 0, 0, 1, predict);
    else
        zo8_256_adam_span_body(p, g, gk, out, ok, lo, hi, b0, h, s, mb, vb, am, av,
                               exact, scale, has_l2, decoupled, predict);
}

/* Lion, 8 lanes a turn (zo8_lion_span_scalar); exact and scale as in the Adam body */
static inline ZO_T256 __attribute__((always_inline)) void zo8_256_lion_span_body(
        float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, int64_t b0,
        const zo_hparams *hp, const zo_state8 *s, float *mb, float *am, const int exact, const int scale) {
    const zo_hparams hc = *hp;  /* a private copy, as in the Adam body */
    const zo_hparams *h = &hc;
    const __m256 gs = _mm256_set1_ps(h->grad_scale);
    const __m256 b1 = _mm256_set1_ps(h->beta1), omb1 = _mm256_set1_ps(h->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(h->beta2), omb2 = _mm256_set1_ps(h->one_minus_beta2);
    const __m256 dec = _mm256_set1_ps(h->decay), ss = _mm256_set1_ps(h->step_size);
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), mone = _mm256_set1_ps(-1.0f);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    uint16_t *rem = s->rem;
    const uint16_t *hi16 = s->hi;
    __m256 ma = _mm256_setzero_ps();
    float ta[8], a;
    int64_t i = lo;
    int j;
    for (; i + 8 <= hi; i += 8) {
        __m256 gi = zo256_load_grad(g, gk, i), mi = _mm256_loadu_ps(mb + (i - b0));
        __m256 pi, c, sg, mn;
        if (scale) gi = _mm256_mul_ps(gi, gs);
        pi = zo256_load_master(p, rem, hi16, i, exact);
        c = _mm256_add_ps(_mm256_mul_ps(b1, mi), _mm256_mul_ps(omb1, gi));
        sg = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_GT_OQ), one),
                          _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_LT_OQ), mone));
        pi = _mm256_sub_ps(_mm256_mul_ps(pi, dec), _mm256_mul_ps(ss, sg));
        mn = _mm256_add_ps(_mm256_mul_ps(b2, mi), _mm256_mul_ps(omb2, gi));
        _mm256_storeu_ps(mb + (i - b0), mn);
        ma = _mm256_max_ps(_mm256_and_ps(mn, absmask), ma);
        zo256_store_master(p, rem, out, ok, i, pi, pi, exact);
    }
    _mm256_storeu_ps(ta, ma);
    a = *am;
    for (j = 0; j < 8; j++) a = ta[j] > a ? ta[j] : a;
    *am = a;
    if (i < hi) zo8_lion_span_scalar(p, g, gk, out, ok, i, hi, b0, h, s, mb, am);
}

static ZO_T256 void zo8_256_lion_span(float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                                      int64_t b0, const zo_hparams *h, const zo_state8 *s, float *mb, float *am) {
    if (gk == ZO_BF16 && ok == ZO_BF16 && s->rem != NULL && h->grad_scale == 1.0f)  /* bf16 Lion */
        zo8_256_lion_span_body(p, g, ZO_BF16, out, ZO_BF16, lo, hi, b0, h, s, mb, am, 1, 0);
    else
        zo8_256_lion_span_body(p, g, gk, out, ok, lo, hi, b0, h, s, mb, am, s->rem != NULL, h->grad_scale != 1.0f);
}

/* the codes of 8 lanes, m's without its sign and v's, as i32 (zo8_encode_m / zo8_encode_v).
 * x: the lanes' Weyl words before zo_rand32's fold; folded, x ^ (x >> 16) keeps x's high
 * half, so v's 16 random bits are x >> 16 and only m's need the fold. */
static inline ZO_T256 __attribute__((always_inline)) void zo8_256_encode8(
        __m256 mi, __m256 vi, __m256i x, __m256 im, __m256 iv, const int sr, const int normal,
        __m256i *qm, __m256i *qv) {
    const __m256i half = _mm256_set1_epi32((int)ZO8_HALF);
    const __m256i xh = _mm256_srli_epi32(x, 16);
    __m256i tm, tv;
    __m256 xm = _mm256_mul_ps(_mm256_and_ps(mi, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))), im);
    /* normal (zo8_256_codes_normal): zo8_rebias's normal half alone, v's code floor dropped */
    tm = normal ? _mm256_sub_epi32(_mm256_castps_si256(xm), _mm256_set1_epi32((int)ZO8_M_BIAS))
                : zo8_256_rebias(xm, _mm256_set1_ps(ZO8_M_TINY), (int)ZO8_M_BIAS);
    /* 16 random bits each, at bits 4..19 (zo8_rbits_m / zo8_rbits_v) */
    *qm = _mm256_srli_epi32(_mm256_add_epi32(tm, sr ? _mm256_srli_epi32(_mm256_slli_epi32(_mm256_xor_si256(x, xh), 16), 12)
                                                    : half), ZO8_SHIFT);
    if (normal) {
        tv = _mm256_sub_epi32(_mm256_castps_si256(_mm256_mul_ps(vi, iv)), _mm256_set1_epi32((int)ZO8_V_BIAS));
        *qv = _mm256_srli_epi32(_mm256_add_epi32(tv, sr ? _mm256_slli_epi32(xh, 4) : half), ZO8_SHIFT);
        return;
    }
    tv = zo8_256_rebias(_mm256_mul_ps(vi, iv), _mm256_set1_ps(ZO8_V_TINY), (int)ZO8_V_BIAS);
    *qv = _mm256_max_epu32(_mm256_srli_epi32(_mm256_add_epi32(tv, sr ? _mm256_slli_epi32(xh, 4) : half), ZO8_SHIFT),
                           _mm256_min_epu32(tv, _mm256_set1_epi32(1)));
}

/* 16 elements a turn: their 32 codes (each < 256) packed in three operations, m's signs
 * put in with two more packs (signed saturation keeps a float's sign in its byte's top
 * bit, for two operations fewer than each lane's shifts), and stored as two 16-byte
 * runs, m's and v's */
static inline ZO_T256 __attribute__((always_inline)) void zo8_256_encode_body(
        const float *mb, const float *vb, int64_t n, int64_t e0, float im_, float iv_, const zo_state8 *s,
        const int sr, const int lion, const int normal) {
    const __m256 im = _mm256_set1_ps(im_), iv = _mm256_set1_ps(iv_);
    /* zo_rand32's Weyl sequence idx * phi + key, stepped by 8 phi a half-turn: the same words */
    const __m256i step8 = _mm256_set1_epi32((int)(8u * 0x9e3779b9u));
    /* packus_epi32 then packus_epi16 leave the bytes as m0-3 m8-11 v0-3 v8-11 | m4-7 m12-15 v4-7 v12-15
     * (in 32-bit groups); this puts m0-15 in the low half and v0-15 in the high one */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    /* the sign bits' mask: m's bytes only (the v bytes' packs are against zero anyway) */
    const __m256i sbit = _mm256_set1_epi8((char)0x80);
    __m256i weyl = _mm256_add_epi32(_mm256_mullo_epi32(
        _mm256_add_epi32(_mm256_set1_epi32((int)(s->index_base + (uint32_t)e0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
        _mm256_set1_epi32((int)0x9e3779b9u)), _mm256_set1_epi32((int)s->key));
    uint8_t *mc = s->m + e0, *vc = s->v + e0;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        __m256i qm0, qv0, qm1, qv1, b, sg;
        __m256 m0 = _mm256_loadu_ps(mb + k), m1 = _mm256_loadu_ps(mb + k + 8);
        /* Lion: no v (its lanes read m, and are dropped) */
        zo8_256_encode8(m0, _mm256_loadu_ps((lion ? mb : vb) + k), weyl, im, iv, sr, normal, &qm0, &qv0);
        weyl = _mm256_add_epi32(weyl, step8);
        zo8_256_encode8(m1, _mm256_loadu_ps((lion ? mb : vb) + k + 8), weyl, im, iv, sr, normal, &qm1, &qv1);
        weyl = _mm256_add_epi32(weyl, step8);
        if (lion) qv0 = qv1 = _mm256_setzero_si256();  /* so the compiler drops v's arithmetic */
        b = _mm256_packus_epi16(_mm256_packus_epi32(qm0, qm1), _mm256_packus_epi32(qv0, qv1));
        /* the same packs' order: a negative float (-0 too) saturates to 0x8000, then 0x80 */
        sg = _mm256_packs_epi16(_mm256_packs_epi32(_mm256_castps_si256(m0), _mm256_castps_si256(m1)),
                                _mm256_setzero_si256());
        b = _mm256_or_si256(b, _mm256_and_si256(sg, sbit));
        b = _mm256_permutevar8x32_epi32(b, order);
        _mm_storeu_si128((__m128i *)(mc + k), _mm256_castsi256_si128(b));
        if (!lion) _mm_storeu_si128((__m128i *)(vc + k), _mm256_extracti128_si256(b, 1));
    }
    if (k < n) zo8_encode_scalar(mb, vb, k, n, e0, im_, iv_, s);
}
/* an encode body called with its three flags as constants, one body for each combination
 * (so each is compiled without the others' arithmetic); both levels' dispatchers */
#define ZO8_ENCODE_CASES(body, sr, lion, normal)                                  \
    switch ((sr) * 4 + (lion) * 2 + (normal)) {                                    \
        case 0: body(mb, vb, n, e0, im, iv, s, 0, 0, 0); break;                    \
        case 1: body(mb, vb, n, e0, im, iv, s, 0, 0, 1); break;                    \
        case 2: body(mb, vb, n, e0, im, iv, s, 0, 1, 0); break;                    \
        case 3: body(mb, vb, n, e0, im, iv, s, 0, 1, 1); break;                    \
        case 4: body(mb, vb, n, e0, im, iv, s, 1, 0, 0); break;                    \
        case 5: body(mb, vb, n, e0, im, iv, s, 1, 0, 1); break;                    \
        case 6: body(mb, vb, n, e0, im, iv, s, 1, 1, 0); break;                    \
        default: body(mb, vb, n, e0, im, iv, s, 1, 1, 1); break;                   \
    }
static ZO_T256 void zo8_256_encode(const float *mb, const float *vb, int64_t n, int64_t e0,
                                   float im, float iv, const zo_state8 *s) {
    const int sr = s->rounding == ZO_ROUND_STOCHASTIC, lion = s->lion;
    const int normal = zo8_256_codes_normal(mb, vb, n, im, iv, lion);
    ZO8_ENCODE_CASES(zo8_256_encode_body, sr, lion, normal);
}

/* ---------------------------------------------------------------- AVX-512 block parts */
/* The AVX2 parts above at 16 lanes, op for op (so the paths agree bitwise): masks in
 * place of blends, vpmov* truncations in place of the pack-and-permute stores, m's
 * sign put in by a ternary-logic operation in place of the sign packs. */
/* zo8_256_decode_m (m's code as an fp16 bit pattern) and _v, 16 lanes */
static inline ZO_T512 __attribute__((always_inline)) __m512 zo8_512_decode_m(const uint8_t *c, __m512 scale) {
    __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c));
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(q, 7), _mm256_set1_epi16((short)0xbf80));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), scale);
}
static inline ZO_T512 __attribute__((always_inline)) __m512 zo8_512_decode_v(const uint8_t *c, __m512 scale) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(ZO8_V_SUB));
    __m512 nrm = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(q, ZO8_SHIFT),
                                                      _mm512_set1_epi32((int)ZO8_V_BIAS)));
    __m512 x = _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(q, _mm512_set1_epi32(8)), nrm, sub);
    return _mm512_mul_ps(x, scale);
}
static inline ZO_T512 __attribute__((always_inline)) __m512 zo8_512_decode_v_normal(const uint8_t *c, __m512 scale) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(q, ZO8_SHIFT),
                                                              _mm512_set1_epi32((int)ZO8_V_BIAS))), scale);
}
static inline ZO_T512 __attribute__((always_inline)) __m512i zo8_512_rebias(__m512 x, __m512 tiny, int bias) {
    __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(x, tiny)), _mm512_castps_si512(tiny));
    return _mm512_max_epi32(_mm512_sub_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(bias)), sub);
}

static ZO_T512 void zo8_512_decode(const zo_state8 *s, int64_t b0, int64_t be, float *mb, float *vb) {
    const __m512 msc = _mm512_set1_ps(s->ms[b0 / ZO_QBLOCK]);
    const uint8_t *mc = s->m, *vc = s->v;
    int64_t i = b0;
    if (s->lion) {
        for (; i + 16 <= be; i += 16) _mm512_storeu_ps(mb + (i - b0), zo8_512_decode_m(mc + i, msc));
    } else if (be - b0 == ZO_QBLOCK && zo8_256_vcodes_normal(vc + b0)) {
        const __m512 vsc = _mm512_set1_ps(s->vs[b0 / ZO_QBLOCK]);
        for (; i + 16 <= be; i += 16) {
            _mm512_storeu_ps(mb + (i - b0), zo8_512_decode_m(mc + i, msc));
            _mm512_storeu_ps(vb + (i - b0), zo8_512_decode_v_normal(vc + i, vsc));
        }
    } else {
        const __m512 vsc = _mm512_set1_ps(s->vs[b0 / ZO_QBLOCK]);
        for (; i + 16 <= be; i += 16) {
            _mm512_storeu_ps(mb + (i - b0), zo8_512_decode_m(mc + i, msc));
            _mm512_storeu_ps(vb + (i - b0), zo8_512_decode_v(vc + i, vsc));
        }
    }
    if (i < be) zo8_decode_scalar(s, b0, i, be, mb, vb);  /* only for a tail: see zo_opt8_chunk */
}

static inline ZO_T512 __attribute__((always_inline)) void zo8_512_adam_span_body(
        float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, int64_t b0,
        const zo_hparams *hp, const zo_state8 *s, float *mb, float *vb, float *am, float *av,
        const int exact, const int scale, const int has_l2, const int decoupled, const int predict) {
    const zo_hparams hc = *hp;  /* a private copy, as in the AVX2 body */
    const zo_hparams *h = &hc;
    const __m512 gs = _mm512_set1_ps(h->grad_scale), l2 = _mm512_set1_ps(h->l2);
    const __m512 b1 = _mm512_set1_ps(h->beta1), omb1 = _mm512_set1_ps(h->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(h->beta2), omb2 = _mm512_set1_ps(h->one_minus_beta2);
    const __m512 ibc2 = _mm512_set1_ps(h->inv_sqrt_bc2), eps = _mm512_set1_ps(h->eps);
    const __m512 dec = _mm512_set1_ps(h->decay), ss = _mm512_set1_ps(h->step_size);
    const __m512 pr = _mm512_set1_ps(h->predict);
    uint16_t *rem = s->rem;
    const uint16_t *hi16 = s->hi;
    __m512 ma = _mm512_setzero_ps(), va = _mm512_setzero_ps();
    float a, b;
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 gi = zo512_load_grad(g, gk, i);
        __m512 pi, mi, vi, denom, p0;
        if (scale) gi = _mm512_mul_ps(gi, gs);
        pi = zo512_load_master(p, rem, hi16, i, exact);
        if (has_l2) gi = _mm512_add_ps(gi, _mm512_mul_ps(l2, pi));
        mi = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_loadu_ps(mb + (i - b0))), _mm512_mul_ps(omb1, gi));
        vi = _mm512_add_ps(_mm512_mul_ps(b2, _mm512_loadu_ps(vb + (i - b0))),
                           _mm512_mul_ps(omb2, _mm512_mul_ps(gi, gi)));
        denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), ibc2), eps);
        p0 = pi;
        if (decoupled) pi = _mm512_mul_ps(pi, dec);
        pi = _mm512_sub_ps(pi, _mm512_mul_ps(ss, _mm512_div_ps(mi, denom)));
        _mm512_storeu_ps(mb + (i - b0), mi);
        _mm512_storeu_ps(vb + (i - b0), vi);
        ma = _mm512_max_ps(_mm512_abs_ps(mi), ma);  /* a NaN x gives a, as in the AVX2 body */
        va = _mm512_max_ps(vi, va);
        zo512_store_master(p, rem, out, ok, i, pi,
                             predict ? _mm512_add_ps(pi, _mm512_mul_ps(pr, _mm512_sub_ps(pi, p0))) : pi, exact);
    }
    /* max is exact and no lane holds a NaN, so a tree gives the scalar loop's result;
     * it ends the block's update sooner than a chain of 16 (2-3% of the kernel) */
    a = _mm512_reduce_max_ps(ma);
    b = _mm512_reduce_max_ps(va);
    *am = a > *am ? a : *am;
    *av = b > *av ? b : *av;
    if (i < hi) zo8_adam_span_scalar(p, g, gk, out, ok, i, hi, b0, h, s, mb, vb, am, av);
}

static ZO_T512 void zo8_512_adam_span(float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                                      int64_t b0, const zo_hparams *h, const zo_state8 *s, float *mb, float *vb,
                                      float *am, float *av) {
    const int exact = s->rem != NULL, scale = h->grad_scale != 1.0f, has_l2 = h->l2 != 0.0f;
    const int decoupled = h->decoupled, predict = h->predict != 0.0f;
    if (gk == ZO_BF16 && ok == ZO_BF16 && exact && !scale && !has_l2 && decoupled)  /* bf16 AdamW */
        zo8_512_adam_span_body(p, g, ZO_BF16, out, ZO_BF16, lo, hi, b0, h, s, mb, vb, am, av, 1, 0, 0, 1, 0);
    else if (gk == ZO_F16 && ok == ZO_F16 && !exact && !has_l2 && decoupled)  /* fp16 AdamW, fp32 master */
        zo8_512_adam_span_body(p, g, ZO_F16, out, ZO_F16, lo, hi, b0, h, s, mb, vb, am, av, 0, scale, 0, 1, predict);
    else if (gk == ZO_BF16 && ok == ZO_BF16 && !exact && !scale && !has_l2 && decoupled)  /* bf16, DPU's prediction */
        zo8_512_adam_span_body(p, g, ZO_BF16, out, ZO_BF16, lo, hi, b0, h, s, mb, vb, am, av, 0, 0, 0, 1, predict);
    else
        zo8_512_adam_span_body(p, g, gk, out, ok, lo, hi, b0, h, s, mb, vb, am, av,
                               exact, scale, has_l2, decoupled, predict);
}

/* Lion, 16 lanes a turn (zo8_256_lion_span_body, op for op) */
static inline ZO_T512 __attribute__((always_inline)) void zo8_512_lion_span_body(
        float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, int64_t b0,
        const zo_hparams *hp, const zo_state8 *s, float *mb, float *am, const int exact, const int scale) {
    const zo_hparams hc = *hp;  /* a private copy, as in the Adam body */
    const zo_hparams *h = &hc;
    const __m512 gs = _mm512_set1_ps(h->grad_scale);
    const __m512 b1 = _mm512_set1_ps(h->beta1), omb1 = _mm512_set1_ps(h->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(h->beta2), omb2 = _mm512_set1_ps(h->one_minus_beta2);
    const __m512 dec = _mm512_set1_ps(h->decay), ss = _mm512_set1_ps(h->step_size);
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f), mone = _mm512_set1_ps(-1.0f);
    uint16_t *rem = s->rem;
    const uint16_t *hi16 = s->hi;
    __m512 ma = _mm512_setzero_ps();
    float a;
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 gi = zo512_load_grad(g, gk, i), mi = _mm512_loadu_ps(mb + (i - b0));
        __m512 pi, c, sg, mn;
        if (scale) gi = _mm512_mul_ps(gi, gs);
        pi = zo512_load_master(p, rem, hi16, i, exact);
        c = _mm512_add_ps(_mm512_mul_ps(b1, mi), _mm512_mul_ps(omb1, gi));
        sg = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ),
                                  _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ), zero, one), mone);
        pi = _mm512_sub_ps(_mm512_mul_ps(pi, dec), _mm512_mul_ps(ss, sg));
        mn = _mm512_add_ps(_mm512_mul_ps(b2, mi), _mm512_mul_ps(omb2, gi));
        _mm512_storeu_ps(mb + (i - b0), mn);
        ma = _mm512_max_ps(_mm512_abs_ps(mn), ma);
        zo512_store_master(p, rem, out, ok, i, pi, pi, exact);
    }
    a = _mm512_reduce_max_ps(ma);  /* as in the Adam body */
    *am = a > *am ? a : *am;
    if (i < hi) zo8_lion_span_scalar(p, g, gk, out, ok, i, hi, b0, h, s, mb, am);
}

static ZO_T512 void zo8_512_lion_span(float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                                      int64_t b0, const zo_hparams *h, const zo_state8 *s, float *mb, float *am) {
    if (gk == ZO_BF16 && ok == ZO_BF16 && s->rem != NULL && h->grad_scale == 1.0f)  /* bf16 Lion */
        zo8_512_lion_span_body(p, g, ZO_BF16, out, ZO_BF16, lo, hi, b0, h, s, mb, am, 1, 0);
    else
        zo8_512_lion_span_body(p, g, gk, out, ok, lo, hi, b0, h, s, mb, am, s->rem != NULL, h->grad_scale != 1.0f);
}

/* 16 elements a turn: zo8_256_encode8's arithmetic, then vpmovusdb (unsigned saturation,
 * as the AVX2 packs saturate a NaN's code) */
static inline ZO_T512 __attribute__((always_inline)) void zo8_512_encode_body(
        const float *mb, const float *vb, int64_t n, int64_t e0, float im_, float iv_, const zo_state8 *s,
        const int sr, const int lion, const int normal) {
    const __m512 im = _mm512_set1_ps(im_), iv = _mm512_set1_ps(iv_);
    const __m512 mtiny = _mm512_set1_ps(ZO8_M_TINY), vtiny = _mm512_set1_ps(ZO8_V_TINY);
    const __m512i half = _mm512_set1_epi32((int)ZO8_HALF), one = _mm512_set1_epi32(1);
    const __m512i step16 = _mm512_set1_epi32((int)(16u * 0x9e3779b9u)), sbit = _mm512_set1_epi32(0x80);
    __m512i weyl = _mm512_add_epi32(_mm512_mullo_epi32(
        _mm512_add_epi32(_mm512_set1_epi32((int)(s->index_base + (uint32_t)e0)),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
        _mm512_set1_epi32((int)0x9e3779b9u)), _mm512_set1_epi32((int)s->key));
    uint8_t *mc = s->m + e0, *vc = s->v + e0;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        __m512 mi = _mm512_loadu_ps(mb + k), vi;
        __m512i xh = _mm512_srli_epi32(weyl, 16), tm, tv, qm, qv;  /* as zo8_256_encode8's */
        __m512 xm = _mm512_mul_ps(_mm512_abs_ps(mi), im);
        tm = normal ? _mm512_sub_epi32(_mm512_castps_si512(xm), _mm512_set1_epi32((int)ZO8_M_BIAS))
                    : zo8_512_rebias(xm, mtiny, (int)ZO8_M_BIAS);
        tm = _mm512_srli_epi32(_mm512_add_epi32(tm, sr ? _mm512_srli_epi32(_mm512_slli_epi32(
                                                             _mm512_xor_si512(weyl, xh), 16), 12) : half),
                               ZO8_SHIFT);
        weyl = _mm512_add_epi32(weyl, step16);
        /* tm | (bits(mi) >> 24 & 0x80): the sign at bit 7, in one operation (0xf8: a | (b & c)) */
        qm = _mm512_ternarylogic_epi32(tm, _mm512_srli_epi32(_mm512_castps_si512(mi), 24), sbit, 0xf8);
        if (lion) {  /* no v */
            _mm_storeu_si128((__m128i *)(mc + k), _mm512_cvtusepi32_epi8(qm));
            continue;
        }
        vi = _mm512_loadu_ps(vb + k);
        if (normal) {
            tv = _mm512_sub_epi32(_mm512_castps_si512(_mm512_mul_ps(vi, iv)), _mm512_set1_epi32((int)ZO8_V_BIAS));
            qv = _mm512_srli_epi32(_mm512_add_epi32(tv, sr ? _mm512_slli_epi32(xh, 4) : half), ZO8_SHIFT);
        } else {
            tv = zo8_512_rebias(_mm512_mul_ps(vi, iv), vtiny, (int)ZO8_V_BIAS);
            qv = _mm512_max_epu32(_mm512_srli_epi32(_mm512_add_epi32(tv, sr ? _mm512_slli_epi32(xh, 4)
                                                                             : half), ZO8_SHIFT),
                                  _mm512_min_epu32(tv, one));
        }
        _mm_storeu_si128((__m128i *)(mc + k), _mm512_cvtusepi32_epi8(qm));
        _mm_storeu_si128((__m128i *)(vc + k), _mm512_cvtusepi32_epi8(qv));
    }
    if (k < n) zo8_encode_scalar(mb, vb, k, n, e0, im_, iv_, s);
}
static ZO_T512 void zo8_512_encode(const float *mb, const float *vb, int64_t n, int64_t e0,
                                   float im, float iv, const zo_state8 *s) {
    const int sr = s->rounding == ZO_ROUND_STOCHASTIC, lion = s->lion;
    const int normal = zo8_256_codes_normal(mb, vb, n, im, iv, lion);
    ZO8_ENCODE_CASES(zo8_512_encode_body, sr, lion, normal);
}
#endif

/* ---------------------------------------------------------------- a window of blocks */
/* the codes of a block whose update is done (zo_opt8_chunk's deferred encode) */
static void zo8_encode_block(int level, const float *mb, const float *vb, int64_t n, int64_t b0,
                             float im, float iv, const zo_state8 *s) {
#if ZO_HAVE_X86
    if (level >= ZO_AVX512) { zo8_512_encode(mb, vb, n, b0, im, iv, s); return; }
    if (level >= ZO_AVX2) { zo8_256_encode(mb, vb, n, b0, im, iv, s); return; }
#endif
    zo8_encode_scalar(mb, vb, 0, n, b0, im, iv, s);
}

/* Adam, or Lion (s->lion), over whole blocks [lo, hi) (lo on a block; hi on a block
 * or the arrays' end), with the segments covering it (sorted, contiguous).  A block's
 * encode runs after the next block's update, from the other of two block buffers: it
 * needs the block's maxima and their inverses (a reduction and two divisions, ~60
 * cycles in a row), and deferred, that latency hides behind the next update instead
 * of stalling every block (BENCHMARKS.md, after bench_adam_state).  The bytes are the
 * same: every block gets the same operations, only later.
 * The vector parts call their scalar loops only for a tail (i < be), as every vector
 * body does (_kernels.h says why): called once per block, an empty tail's call cost
 * this loop half its speed on Intel cores (BENCHMARKS.md, "vzeroupper"). */
static void zo_opt8_chunk(int level, float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                          const zo_seg8 *segs, int nseg, const zo_state8 *s) {
    float buf[2][2][ZO_QBLOCK] __attribute__((aligned(64)));  /* [which buffer][m, v] */
    int k = 0, cur = 0;
    int64_t b0, pend_b0 = -1, pend_n = 0;  /* the block whose encode is pending */
    float pend_im = 0.0f, pend_iv = 0.0f;
    for (b0 = lo; b0 < hi; b0 += ZO_QBLOCK) {
        int64_t be = b0 + ZO_QBLOCK < hi ? b0 + ZO_QBLOCK : hi, x = b0;
        int updated = 0, k0;
        float am = 0.0f, av = 0.0f;  /* block maxima (of |m| and v) */
        float *mb = buf[cur][0], *vb = buf[cur][1];
        while (k < nseg - 1 && segs[k].hi <= b0) k++;
        for (k0 = k; k0 < nseg && segs[k0].lo < be; k0++) updated |= !segs[k0].keep;
        if (!updated) {  /* every segment kept: codes and scales stay, the out slot gets the weights */
            zo8_keep_weights(p, out, ok, b0, be, s);
            k = k0 - 1;
            continue;
        }
#if ZO_HAVE_X86
        if (level >= ZO_AVX512) zo8_512_decode(s, b0, be, mb, vb);
        else if (level >= ZO_AVX2) zo8_256_decode(s, b0, be, mb, vb);
        else
#endif
        zo8_decode_scalar(s, b0, b0, be, mb, vb);
        for (; x < be; k++) {
            int64_t y = segs[k].hi < be ? segs[k].hi : be;
            if (segs[k].keep) {
                zo8_keep_span(p, out, ok, x, y, b0, s, mb, vb, &am, &av);
            } else if (s->lion) {
#if ZO_HAVE_X86
                if (level >= ZO_AVX512) zo8_512_lion_span(p, g, gk, out, ok, x, y, b0, &segs[k].h, s, mb, &am);
                else if (level >= ZO_AVX2) zo8_256_lion_span(p, g, gk, out, ok, x, y, b0, &segs[k].h, s, mb, &am);
                else
#endif
                zo8_lion_span_scalar(p, g, gk, out, ok, x, y, b0, &segs[k].h, s, mb, &am);
            } else {
#if ZO_HAVE_X86
                if (level >= ZO_AVX512) zo8_512_adam_span(p, g, gk, out, ok, x, y, b0, &segs[k].h, s, mb, vb, &am, &av);
                else if (level >= ZO_AVX2) zo8_256_adam_span(p, g, gk, out, ok, x, y, b0, &segs[k].h, s, mb, vb, &am, &av);
                else
#endif
                zo8_adam_span_scalar(p, g, gk, out, ok, x, y, b0, &segs[k].h, s, mb, vb, &am, &av);
            }
            x = y;
        }
        k = k0 - 1;  /* the block's last segment may go on into the next block */
        s->ms[b0 / ZO_QBLOCK] = am;
        if (!s->lion) s->vs[b0 / ZO_QBLOCK] = av;
        if (pend_b0 >= 0)
            zo8_encode_block(level, buf[cur ^ 1][0], buf[cur ^ 1][1], pend_n, pend_b0, pend_im, pend_iv, s);
        pend_b0 = b0;
        pend_n = be - b0;
        pend_im = zo8_inv(am);  /* the encode factors, computed now and used a block later */
        pend_iv = zo8_inv(av);
        cur ^= 1;
    }
    if (pend_b0 >= 0)
        zo8_encode_block(level, buf[cur ^ 1][0], buf[cur ^ 1][1], pend_n, pend_b0, pend_im, pend_iv, s);
}

/* ---------------------------------------------------------------- conversions */
/* src (fp32 moments) -> codes + scales over whole blocks [lo, hi); which: 0 m, 1 v.
 * Rounds to nearest (a checkpoint converted on load); the scale is the block's
 * largest |m| (v). */
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
            codes[i] = which ? zo8_encode_v(src[i], inv, ZO8_HALF) : zo8_encode_m(src[i], inv, ZO8_HALF);
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
    if (i < hi) zo8_stream_scalar(p, rem, hi16, m, v, g, out, i, hi);
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
