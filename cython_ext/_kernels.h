/*
 * One-pass CPU optimizer kernels for ZeRO-Offload (Adam/AdamW, Adagrad, Lion).
 *
 * Every kernel reads the 16-bit (or fp32) gradient, reads and writes the fp32
 * state and optionally writes the 16-bit copy of the weights, all in a single
 * pass over memory.  The update is memory bound (28 B/param for Adam), so the
 * one thing that matters for speed is to touch each byte exactly once; the
 * casts that torch's fused AdamW needs as separate passes are done in registers.
 *
 * SIMD is chosen at run time (zo_cpu_best_level): AVX-512F, AVX2+F16C, or the
 * portable scalar path.  The vector functions carry GCC/Clang target attributes
 * so the binary is built for baseline x86-64 and still runs everywhere.
 *
 * Bitwise contract: the vector and scalar paths perform the same IEEE operations
 * in the same order (no FMA: the build uses -ffp-contract=off), and sqrt/div are
 * correctly rounded, so both paths give identical fp32 results.  Rounding to
 * 16 bits is round-to-nearest-even in both.
 *
 * Compact state (state_dtype="bf16", zo_adam16_*): the same arithmetic with m and v
 * stored as bf16 and, for bf16 weights, the exact master (the weights' bf16 plus a
 * 16-bit remainder): 18 B/param instead of 28.  Its section below says how.
 *
 * The caller (cpu_adam.pyx) validates every argument; nothing here checks.
 */
#ifndef ZO_KERNELS_H
#define ZO_KERNELS_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#ifdef _OPENMP
#include <omp.h>
static int zo_openmp_enabled(void) { return 1; }
static int zo_max_threads(void) { return omp_get_max_threads(); }
#else
static int zo_openmp_enabled(void) { return 0; }
static int zo_max_threads(void) { return 1; }
#endif

/*
 * Progress word of a blocked update: (tag << ZO_PROGRESS_SHIFT) | elements done.
 * The release store comes after the OpenMP barrier that ends a block, so a
 * reader whose acquire load sees the value also sees every weight written
 * before it (this is what lets the worker copy finished weights while the rest
 * of the update still runs, possibly from another process on another core).
 */
#define ZO_PROGRESS_SHIFT 40
static inline void zo_progress_store(uint64_t *w, uint64_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }
static inline uint64_t zo_progress_load(const uint64_t *w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }

/* Element kinds of the gradient and output buffers, and the SIMD levels: named
 * enums shared with the Cython wrapper (cdef extern), never bare integers. */
enum zo_kind { ZO_F32 = 0, ZO_F16 = 1, ZO_BF16 = 2, ZO_NONE = 3 };
enum zo_level { ZO_SCALAR = 0, ZO_AVX2 = 1, ZO_AVX512 = 2 };

/* Hyper-parameters, already folded into the constants the loop needs.
 * Bias corrections and 1-beta are computed in double by the caller and only
 * then rounded to fp32 (DeepSpeed computes 1-beta in fp32, which biases v). */
typedef struct {
    float grad_scale;
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
    float eps;
    float step_size;      /* lr / (1 - beta1^t)          (adam), lr (adagrad, lion) */
    float inv_sqrt_bc2;   /* 1 / sqrt(1 - beta2^t)       (adam) */
    float decay;          /* 1 - lr*wd for decoupled decay, else 1 */
    float l2;             /* wd for L2 (Adam, Adagrad), else 0 */
    int decoupled;        /* apply `decay` to p before the update */
    float predict;        /* param_out gets p_new + predict * (p_new - p_old): weight
                             prediction for DPU, free since p_old is in a register */
    /* fp32 Adam only: where the old p, m, v are read (NULL: from p, m, v themselves,
     * in place).  Out of place, the update of a speculation leaves the state it
     * started from untouched, so undoing it costs no copy (optimizer_server.state's
     * twin); the arithmetic is the same, so are the bits. */
    const float *src_p, *src_m, *src_v;
} zo_hparams;

/* ---------------------------------------------------------------- scalar conversions */

static inline float zo_f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t em = (uint32_t)h & 0x7fffu;
    uint32_t x;
    float r;
    if (em >= 0x7c00u) {
        x = sign | 0x7f800000u | ((em & 0x3ffu) << 13);
    } else if (em >= 0x0400u) {
        x = sign | ((em + ((127u - 15u) << 10)) << 13);
    } else {
        float f = (float)em * 5.9604644775390625e-08f; /* exact: em * 2^-24 */
        memcpy(&x, &f, 4);
        x |= sign;
    }
    memcpy(&r, &x, 4);
    return r;
}

static inline uint16_t zo_f32_to_f16(float f) {
    uint32_t x, ax, sign;
    memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000u;
    ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf stays inf; NaN stays a quiet NaN */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? (0x200u | ((ax >> 13) & 0x3ffu)) : 0u));
    if (ax >= 0x477ff000u) /* >= 65520 rounds (to even) past the largest half */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) { /* result is subnormal: let the FPU round at 2^-24 */
        float af, s;
        uint32_t r;
        memcpy(&af, &ax, 4);
        s = af + 0.5f;
        memcpy(&r, &s, 4);
        return (uint16_t)(sign | (r - 0x3f000000u));
    }
    ax += 0xc8000fffu + ((ax >> 13) & 1u); /* rebias (-112 << 23) and round to even */
    return (uint16_t)(sign | (ax >> 13));
}

static inline float zo_bf16_to_f32(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    float r;
    memcpy(&r, &x, 4);
    return r;
}

static inline uint16_t zo_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static inline float zo_load_grad(const void *g, int kind, int64_t i) {
    if (kind == ZO_F16) return zo_f16_to_f32(((const uint16_t *)g)[i]);
    if (kind == ZO_BF16) return zo_bf16_to_f32(((const uint16_t *)g)[i]);
    return ((const float *)g)[i];
}

static inline void zo_store_out(void *o, int kind, int64_t i, float v) {
    if (kind == ZO_F16) ((uint16_t *)o)[i] = zo_f32_to_f16(v);
    else if (kind == ZO_BF16) ((uint16_t *)o)[i] = zo_f32_to_bf16(v);
}

/* fp32 -> 16-bit words, rounded as the update's own stores round (RNE; NaN
 * stays NaN): the 16-bit weights after INIT and LOAD are exactly what a step
 * that left the master unchanged would write.  Compilers vectorise this. */
static void zo_cast_chunk(const float *src, uint16_t *dst, int ok, int64_t lo, int64_t hi) {
    int64_t i;
    if (ok == ZO_F16)
        for (i = lo; i < hi; i++) dst[i] = zo_f32_to_f16(src[i]);
    else
        for (i = lo; i < hi; i++) dst[i] = zo_f32_to_bf16(src[i]);
}

/* ---------------------------------------------------------------- scalar loops */
/* These are the reference the vector paths are tested against, and the tail
 * of every vector loop, so each line mirrors the vector code op for op. */

/* Which of the loop's optional operations run, decided once per call (the AVX2
 * bodies take them as a constant mask, so each variant's loop has no tests):
 * the same decisions as the scalar loop's "x * 1 and x + 0 * p are skipped". */
enum { ZO_F_SCALE = 1, ZO_F_L2 = 2, ZO_F_DECAY = 4 };
#define ZO_FLAG(h, f) (zo_flags_ & (f))
static inline int zo_flags_of(const zo_hparams *h) {
    return (h->grad_scale != 1.0f ? ZO_F_SCALE : 0) | (h->l2 != 0.0f ? ZO_F_L2 : 0) | (h->decoupled ? ZO_F_DECAY : 0);
}

static void zo_adam_scalar(float *p, float *m, float *v, const void *g, int gk,
                           void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *h) {
    const float *rp = h->src_p ? h->src_p : p, *rm = h->src_m ? h->src_m : m, *rv = h->src_v ? h->src_v : v;
    int64_t i;
    /* x * 1 and x + 0 * p are skipped, as the vector loops skip them (they change no
     * finite value; the AVX2 loop is specialised on these flags) */
    const int zo_flags_ = zo_flags_of(h);
    for (i = lo; i < hi; i++) {
        float gi = zo_load_grad(g, gk, i);
        float pi = rp[i];
        float mi, vi, denom;
        if (ZO_FLAG(h, ZO_F_SCALE)) gi = gi * h->grad_scale;
        if (ZO_FLAG(h, ZO_F_L2)) gi = gi + h->l2 * pi;
        mi = h->beta1 * rm[i] + h->one_minus_beta1 * gi;
        vi = h->beta2 * rv[i] + h->one_minus_beta2 * (gi * gi);
        denom = sqrtf(vi) * h->inv_sqrt_bc2 + h->eps;
        float p0 = pi;
        if (h->decoupled) pi = pi * h->decay;
        pi = pi - h->step_size * (mi / denom);
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        zo_store_out(out, ok, i, h->predict != 0.0f ? pi + h->predict * (pi - p0) : pi);
    }
}

static void zo_adagrad_scalar(float *p, float *s, const void *g, int gk,
                              void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *h) {
    int64_t i;
    for (i = lo; i < hi; i++) {
        float gi = zo_load_grad(g, gk, i) * h->grad_scale;
        float pi = p[i];
        float si;
        gi = gi + h->l2 * pi;
        si = s[i] + gi * gi;
        pi = pi - h->step_size * (gi / (sqrtf(si) + h->eps));
        s[i] = si;
        p[i] = pi;
        zo_store_out(out, ok, i, pi);
    }
}

static inline float zo_signf(float x) {
    return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
}

static void zo_lion_scalar(float *p, float *m, const void *g, int gk,
                           void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *h) {
    int64_t i;
    for (i = lo; i < hi; i++) {
        float gi = zo_load_grad(g, gk, i) * h->grad_scale;
        float mi = m[i];
        float c = h->beta1 * mi + h->one_minus_beta1 * gi;
        float pi = p[i] * h->decay;
        pi = pi - h->step_size * zo_signf(c);
        m[i] = h->beta2 * mi + h->one_minus_beta2 * gi;
        p[i] = pi;
        zo_store_out(out, ok, i, pi);
    }
}


/* ---------------------------------------------------------------- compact state (bf16 moments) */
/*
 * state_dtype="bf16": m and v are bf16 words, read as fp32 (exact) and rounded
 * back after the update.  Round-to-nearest freezes v: with beta2 = 0.999 it
 * moves by ~0.1% a step, below bf16's half ulp (0.39%), so a stored v that
 * should grow or decay stays put.  Stochastic rounding adds 16 random bits
 * below the kept ones before truncating, so the stored value is unbiased.
 * The bits come from a counter-based hash of (key, element index): the key
 * is derived from the step, the index is the element's place in the whole
 * model, so the result depends on neither the thread count nor the sharding.
 *
 * The exact master (rem != NULL): the fp32 master is never stored whole.  Its
 * high 16 bits, rounded (ties away from zero), are the bf16 weights the
 * update writes anyway; rem keeps its low 16 bits.  Joining them gives the
 * same fp32 bits back: H = hi - (rem >= 0x8000) undoes the rounding.  Ties
 * away from zero (not to even) is what makes every fp32 value reachable from
 * one (hi, rem) pair; it differs from round-to-nearest-even only when the low
 * half is exactly 0x8000, by one bf16 ulp.
 */
enum zo_rounding { ZO_ROUND_NEAREST = 0, ZO_ROUND_STOCHASTIC = 1 };

typedef struct {
    uint16_t *m, *v;       /* bf16 moments (v is NULL for Lion) */
    uint16_t *rem;         /* low halves of the fp32 master, or NULL: the master is p (fp32) */
    const uint16_t *hi;    /* with rem: the master's high halves (the last update's bf16 weights) */
    uint32_t key;          /* per-step key of the stochastic rounding */
    uint32_t index_base;   /* model-wide index of element 0, mod 2^32 */
    int rounding;          /* zo_rounding */
    /* Adam with the exact master only: where the old m, v and remainder are read (all
     * three, or none: in place), as zo_hparams' src_p for fp32 state (the twin) */
    const uint16_t *src_m, *src_v, *src_rem;
} zo_state16;

/* What an update reads of a state array: its source when out of place, else itself. */
static inline const uint16_t *zo16_rd(const uint16_t *src, const uint16_t *dst) { return src ? src : dst; }

/* zo_stream_start for 16-bit state: the first element from lo at which m, v (if any)
 * and rem all start a 32-byte line, or -1 when they are aligned differently. */
static inline int64_t zo_stream_start16(const uint16_t *m, const uint16_t *v, const uint16_t *rem, int64_t lo,
                                        int64_t hi) {
    int64_t a = lo;
    while (a < hi && ((uintptr_t)(m + a) & 31)) a++;
    if ((v && ((uintptr_t)(v + a) & 31)) || ((uintptr_t)(rem + a) & 31)) return -1;
    return a;
}

/* lowbias32 (C. Wellons): a full-avalanche 32-bit mix; it makes the per-step key
 * (cpu_adam.rounding_key), which must look independent from step to step */
static inline uint32_t zo_mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}
/* The element's random bits: a Weyl sequence idx * phi + key, folded once.  With the
 * key fresh each step, every element's bits are uniform and independent from step
 * to step, which is what unbiased rounding needs; within a step neighbouring
 * elements get evenly spread values (a low-discrepancy sequence), which only makes
 * the rounding errors of a block cancel better.  A full mix per element would cost
 * ~16 vector operations per 16 elements, a sixth of the update's compute (measured:
 * bench_adam --state-dtypes). */
static inline uint32_t zo_rand32(uint32_t key, uint32_t idx) {
    uint32_t x = idx * 0x9e3779b9u + key;
    return x ^ (x >> 16);
}


/* fp32 -> bf16 adding r16 (< 2^16) below the kept bits, then truncating.  No NaN
 * case (it would cost a third of the rounding): a NaN moment gets its payload from
 * a 16-bit gradient or moment, or is the default NaN, so its top 16 bits already
 * mark it NaN and the add never carries into them (short of an fp16 NaN with an
 * all-ones payload; the engine never passes a non-finite gradient: it skips the step). */
static inline uint16_t zo_f32_to_bf16_sr(float f, uint32_t r16) {
    uint32_t x;
    memcpy(&x, &f, 4);
    return (uint16_t)((x + r16) >> 16);
}

static inline float zo_join_master(uint16_t hi, uint16_t rem) {
    uint32_t x = ((uint32_t)(uint16_t)(hi - (rem >> 15)) << 16) | rem;
    float r;
    memcpy(&r, &x, 4);
    return r;
}

/* No NaN case, as in zo_f32_to_bf16_sr: a NaN master's payload comes from torch
 * (the default NaN) or from 16-bit inputs, so the add never carries out of its
 * low half; and whatever the payload, join gives the same 32 bits back. */
static inline void zo_split_master(float f, uint16_t *hi, uint16_t *rem) {
    uint32_t x;
    memcpy(&x, &f, 4);
    *rem = (uint16_t)(x & 0xffffu);
    *hi = (uint16_t)((x + 0x8000u) >> 16);
}

/* The master of element i, exact (joined) or fp32; and its new value stored back with the
 * weights: split into (weights, remainder), or kept whole with `w` rounded into out. */
static inline float zo16_master(const float *p, const zo_state16 *s, int64_t i) {
    return s->rem ? zo_join_master(s->hi[i], zo16_rd(s->src_rem, s->rem)[i]) : p[i];
}
static inline void zo16_store(float *p, const zo_state16 *s, void *out, int ok, int64_t i, float pi, float w) {
    if (s->rem) {
        zo_split_master(pi, (uint16_t *)out + i, s->rem + i);
    } else {
        p[i] = pi;
        zo_store_out(out, ok, i, w);
    }
}

static void zo_adam16_scalar(float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                             const zo_hparams *h, const zo_state16 *s) {
    const uint16_t *rm = zo16_rd(s->src_m, s->m), *rv = zo16_rd(s->src_v, s->v);
    int64_t i;
    for (i = lo; i < hi; i++) {
        float gi = zo_load_grad(g, gk, i);
        float pi = zo16_master(p, s, i);
        float mi, vi, denom;
        /* x * 1 and x + 0 * p change no finite value: skipped (AdamW, no clipping) */
        if (h->grad_scale != 1.0f) gi = gi * h->grad_scale;
        if (h->l2 != 0.0f) gi = gi + h->l2 * pi;
        mi = h->beta1 * zo_bf16_to_f32(rm[i]) + h->one_minus_beta1 * gi;
        vi = h->beta2 * zo_bf16_to_f32(rv[i]) + h->one_minus_beta2 * (gi * gi);
        denom = sqrtf(vi) * h->inv_sqrt_bc2 + h->eps;
        float p0 = pi;
        if (h->decoupled) pi = pi * h->decay;
        pi = pi - h->step_size * (mi / denom);
        if (s->rounding == ZO_ROUND_STOCHASTIC) {
            /* 16 random bits each: v's per-step change can be ~1/150 of its ulp, which
             * 8 bits would round with a 40% bias (measured: the v test below) */
            uint32_t r = zo_rand32(s->key, s->index_base + (uint32_t)i);
            s->m[i] = zo_f32_to_bf16_sr(mi, r & 0xffffu);
            s->v[i] = zo_f32_to_bf16_sr(vi, r >> 16);
        } else {
            s->m[i] = zo_f32_to_bf16(mi);
            s->v[i] = zo_f32_to_bf16(vi);
        }
        zo16_store(p, s, out, ok, i, pi, h->predict != 0.0f ? pi + h->predict * (pi - p0) : pi);
    }
}

/* Lion with a bf16 moment (zo_lion_scalar's arithmetic; m rounded like Adam's m) */
static void zo_lion16_scalar(float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                             const zo_hparams *h, const zo_state16 *s) {
    int64_t i;
    for (i = lo; i < hi; i++) {
        float gi = zo_load_grad(g, gk, i);
        float pi = zo16_master(p, s, i);
        float mi = zo_bf16_to_f32(zo16_rd(s->src_m, s->m)[i]);
        float c, mn;
        if (h->grad_scale != 1.0f) gi = gi * h->grad_scale;
        c = h->beta1 * mi + h->one_minus_beta1 * gi;
        pi = pi * h->decay;
        pi = pi - h->step_size * zo_signf(c);
        mn = h->beta2 * mi + h->one_minus_beta2 * gi;
        if (s->rounding == ZO_ROUND_STOCHASTIC)
            s->m[i] = zo_f32_to_bf16_sr(mn, zo_rand32(s->key, s->index_base + (uint32_t)i) & 0xffffu);
        else
            s->m[i] = zo_f32_to_bf16(mn);
        zo16_store(p, s, out, ok, i, pi, pi);
    }
}

static void zo_opt16_scalar(int lion, float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                            const zo_hparams *h, const zo_state16 *s) {
    if (lion) zo_lion16_scalar(p, g, gk, out, ok, lo, hi, h, s);
    else zo_adam16_scalar(p, g, gk, out, ok, lo, hi, h, s);
}

/* the exact master's high halves for [lo, hi): master -> (hi, rem), as an update would
 * leave them (INIT and LOAD) */
static void zo_split_chunk(const float *src, uint16_t *hi16, uint16_t *rem, int64_t lo, int64_t hi) {
    int64_t i;
    for (i = lo; i < hi; i++) zo_split_master(src[i], hi16 + i, rem + i);
}

static void zo_join_chunk(const uint16_t *hi16, const uint16_t *rem, float *dst, int64_t lo, int64_t hi) {
    int64_t i;
    for (i = lo; i < hi; i++) dst[i] = zo_join_master(hi16[i], rem[i]);
}

/* ---------------------------------------------------------------- x86 vector paths */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ZO_HAVE_X86 1
#include <immintrin.h>

/* Software prefetch ZO_PREFETCH_AHEAD elements ahead on each read stream, once per
 * 64-byte line of the fp32 arrays (every 16 elements; the 16-bit gradient every 32).
 * One core spends as long on Adam's arithmetic (the square root and division share
 * one unit) as on memory, and its out-of-order window fills with that arithmetic, so
 * without this the hardware prefetchers left the AVX2 loop at ~70% of its access
 * pattern's bound at one thread on Zen 1; with it, ~90% (BENCHMARKS.md, bench_adam).
 * The AVX-512 body makes the same prefetches.  The results are unchanged: a
 * prefetch only warms the cache. */
#ifndef ZO_ADAM_WINDOW
#define ZO_ADAM_WINDOW 128  /* elements in the fp32 Adam bodies' two loops (and their probes') */
#endif
#ifndef ZO_PREFETCH_AHEAD
#define ZO_PREFETCH_AHEAD 256
#endif
static inline __attribute__((always_inline)) void zo_adam_prefetch(
        const float *p, const float *m, const float *v, const void *g, int gk, int64_t i, int64_t lo) {
    _mm_prefetch((const char *)(p + i + ZO_PREFETCH_AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char *)(m + i + ZO_PREFETCH_AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char *)(v + i + ZO_PREFETCH_AHEAD), _MM_HINT_T0);
    if (gk == ZO_F32)
        _mm_prefetch((const char *)((const float *)g + i + ZO_PREFETCH_AHEAD), _MM_HINT_T0);
    else if (((i - lo) & 16) == 0)
        _mm_prefetch((const char *)((const uint16_t *)g + i + ZO_PREFETCH_AHEAD), _MM_HINT_T0);
}

/* The same for the 16-bit state bodies: every stream ZO_PREFETCH16_AHEAD elements
 * ahead, the 16-bit ones every other turn of 16 elements (one 64-byte line), the fp32
 * master every turn.  On a Zen 4 core this made the bf16-exact update 1.26-1.44x
 * faster at both levels (BENCHMARKS.md). */
#ifndef ZO_PREFETCH16_AHEAD
#define ZO_PREFETCH16_AHEAD 512
#endif
#define ZO_PF16(a, e) _mm_prefetch((const char *)((a) + (e) + ZO_PREFETCH16_AHEAD), _MM_HINT_T0)
/* the exact master's body: g, m, v, rem and hi; call every other turn of 16 */
static inline __attribute__((always_inline)) void zo16_prefetch(
        const uint16_t *g, const uint16_t *m, const uint16_t *v, const uint16_t *rem, const uint16_t *hi, int64_t e) {
    ZO_PF16(g, e);
    ZO_PF16(m, e);
    ZO_PF16(v, e);
    ZO_PF16(rem, e);
    ZO_PF16(hi, e);
}
/* the fp32 master's body: p every turn of 16; g (by its kind), m and v on even turns */
static inline __attribute__((always_inline)) void zo16p_prefetch(
        const float *p, const void *g, int gk, const uint16_t *m, const uint16_t *v, int64_t e, int even) {
    ZO_PF16(p, e);
    if (gk == ZO_F32) ZO_PF16((const float *)g, e);
    if (even) {
        if (gk != ZO_F32) ZO_PF16((const uint16_t *)g, e);
        ZO_PF16(m, e);
        ZO_PF16(v, e);
    }
}

#define ZO_T512 __attribute__((target("avx512f,avx2,f16c,fma")))
#define ZO_T256 __attribute__((target("avx2,f16c,fma")))
/* A vector body calls its scalar loop only when there is a tail (if (i < hi)): GCC
 * makes that closing call a jump without vzeroupper, and SSE code run with the upper
 * halves dirty costs Intel cores hundreds of cycles (zo_opt8_chunk in _kernels_int8.h,
 * which calls its parts once per 256-element block, ran at half its speed). */

/* ---- AVX-512: 16 lanes */
static inline ZO_T512 __m512 zo512_load_grad(const void *g, int gk, int64_t i) {
    if (gk == ZO_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
    if (gk == ZO_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i))), 16));
    return _mm512_loadu_ps((const float *)g + i);
}

static inline ZO_T512 void zo512_store_out(void *o, int ok, int64_t i, __m512 v) {
    if (ok == ZO_F16) {
        _mm256_storeu_si256((__m256i *)((uint16_t *)o + i),
                            _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else if (ok == ZO_BF16) {
        __m512i x = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        __m512i ax = _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff));
        __mmask16 nan = _mm512_cmpgt_epi32_mask(ax, _mm512_set1_epi32(0x7f800000));
        __m512i q = _mm512_or_si512(x, _mm512_set1_epi32(0x400000));
        r = _mm512_mask_mov_epi32(r, nan, q);
        _mm256_storeu_si256((__m256i *)((uint16_t *)o + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    }
}

/* Where an out-of-place body can start streaming its stores: the first element from
 * lo at which p, m and v all start an (mask + 1)-byte line (the scalar loop takes the
 * ones before it), or -1 when they are aligned differently (plain stores throughout). */
static inline int64_t zo_stream_start(const float *p, const float *m, const float *v, int64_t lo, int64_t hi,
                                      uintptr_t mask) {
    int64_t a = lo;
    while (a < hi && ((uintptr_t)(p + a) & mask)) a++;
    if (((uintptr_t)(m + a) & mask) || ((uintptr_t)(v + a) & mask)) return -1;
    return a;
}

static inline ZO_T512 __attribute__((always_inline)) void zo512_adam_body(
        float *p, float *m, float *v, const void *g, int gk, void *out, int ok,
        int64_t lo, int64_t hi, const zo_hparams *h) {
    const __m512 gs = _mm512_set1_ps(h->grad_scale), l2 = _mm512_set1_ps(h->l2);
    const __m512 b1 = _mm512_set1_ps(h->beta1), omb1 = _mm512_set1_ps(h->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(h->beta2), omb2 = _mm512_set1_ps(h->one_minus_beta2);
    const __m512 ibc2 = _mm512_set1_ps(h->inv_sqrt_bc2), eps = _mm512_set1_ps(h->eps);
    const __m512 dec = _mm512_set1_ps(h->decay), ss = _mm512_set1_ps(h->step_size);
    const float *rp = h->src_p ? h->src_p : p, *rm = h->src_m ? h->src_m : m, *rv = h->src_v ? h->src_v : v;
    int64_t i = lo;
    /* Out of place the new state is not read again this step, so streaming stores
     * write it without first reading the lines they overwrite (the read for
     * ownership made an out-of-place update 1.6x slower than one in place,
     * BENCHMARKS.md); they need aligned addresses, which the twin's arrays share. */
    int nt = 0;
    if (h->src_p != NULL) {
        int64_t a = zo_stream_start(p, m, v, lo, hi, 63);
        if (a >= 0) {
            zo_adam_scalar(p, m, v, g, gk, out, ok, lo, a, h);
            i = a;
            nt = 1;
        }
    }
    const int zo_flags_ = zo_flags_of(h);  /* the scalar loop's decisions */
    const float predict = h->predict;  /* a local: a vector store may alias *h */
    const __m512 pr = _mm512_set1_ps(predict);
    /* zo256_adam_body's two loops a window (its comment says why): on a Zen 4 core the
     * one-loop body, with every stream in flight at once, ran at ~1.2x the time of the
     * AVX2 split body from DRAM (BENCHMARKS.md) */
    float mq[ZO_ADAM_WINDOW] __attribute__((aligned(64))), dq[ZO_ADAM_WINDOW] __attribute__((aligned(64)));
#define ZO512_MOMENTS16(J, Q) do {                                                                 \
        const int64_t j_ = (J);                                                                 \
        __m512 gi = zo512_load_grad(g, gk, j_), mi, vi;                                          \
        if (ZO_FLAG(h, ZO_F_SCALE)) gi = _mm512_mul_ps(gi, gs);                                  \
        if (ZO_FLAG(h, ZO_F_L2)) gi = _mm512_add_ps(gi, _mm512_mul_ps(l2, _mm512_loadu_ps(rp + j_))); \
        mi = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_loadu_ps(rm + j_)), _mm512_mul_ps(omb1, gi));  \
        vi = _mm512_add_ps(_mm512_mul_ps(b2, _mm512_loadu_ps(rv + j_)),                         \
                           _mm512_mul_ps(omb2, _mm512_mul_ps(gi, gi)));                          \
        _mm512_store_ps(mq + (Q), mi);                                                           \
        _mm512_store_ps(dq + (Q), _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), ibc2), eps));  \
        if (nt) {                                                                                \
            _mm512_stream_ps(m + j_, mi);                                                        \
            _mm512_stream_ps(v + j_, vi);                                                        \
        } else {                                                                                 \
            _mm512_storeu_ps(m + j_, mi);                                                        \
            _mm512_storeu_ps(v + j_, vi);                                                        \
        }                                                                                        \
    } while (0)
#define ZO512_WEIGHTS16(J, Q) do {                                                                 \
        const int64_t j_ = (J);                                                                 \
        __m512 pi = _mm512_loadu_ps(rp + j_), p0 = pi;                                           \
        if (ZO_FLAG(h, ZO_F_DECAY)) pi = _mm512_mul_ps(pi, dec);                                 \
        pi = _mm512_sub_ps(pi, _mm512_mul_ps(ss, _mm512_div_ps(_mm512_load_ps(mq + (Q)),        \
                                                               _mm512_load_ps(dq + (Q)))));      \
        if (nt) _mm512_stream_ps(p + j_, pi);                                                    \
        else _mm512_storeu_ps(p + j_, pi);                                                       \
        zo512_store_out(out, ok, j_, predict != 0.0f                                             \
                        ? _mm512_add_ps(pi, _mm512_mul_ps(pr, _mm512_sub_ps(pi, p0))) : pi);     \
    } while (0)
    while (i + 16 <= hi) {
        int64_t w = (hi - i) & ~(int64_t)15, j;
        if (w > ZO_ADAM_WINDOW) w = ZO_ADAM_WINDOW;
        for (j = 0; j < w; j += 16) {
            zo_adam_prefetch(rp, rm, rv, g, gk, i + j, lo);  /* one 64-byte line of each fp32 stream */
            ZO512_MOMENTS16(i + j, j);
        }
        for (j = 0; j < w; j += 16) ZO512_WEIGHTS16(i + j, j);
        i += w;
    }
#undef ZO512_MOMENTS16
#undef ZO512_WEIGHTS16
    if (nt) _mm_sfence();  /* weakly ordered: visible before the progress word's release store */
    if (i < hi) zo_adam_scalar(p, m, v, g, gk, out, ok, i, hi, h);
}

static inline ZO_T512 __attribute__((always_inline)) void zo512_adagrad_body(
        float *p, float *s, const void *g, int gk, void *out, int ok,
        int64_t lo, int64_t hi, const zo_hparams *h) {
    const __m512 gs = _mm512_set1_ps(h->grad_scale), l2 = _mm512_set1_ps(h->l2);
    const __m512 eps = _mm512_set1_ps(h->eps), ss = _mm512_set1_ps(h->step_size);
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 gi = _mm512_mul_ps(zo512_load_grad(g, gk, i), gs);
        __m512 pi = _mm512_loadu_ps(p + i);
        __m512 si;
        gi = _mm512_add_ps(gi, _mm512_mul_ps(l2, pi));
        si = _mm512_add_ps(_mm512_loadu_ps(s + i), _mm512_mul_ps(gi, gi));
        pi = _mm512_sub_ps(pi, _mm512_mul_ps(ss, _mm512_div_ps(gi, _mm512_add_ps(_mm512_sqrt_ps(si), eps))));
        _mm512_storeu_ps(s + i, si);
        _mm512_storeu_ps(p + i, pi);
        zo512_store_out(out, ok, i, pi);
    }
    if (i < hi) zo_adagrad_scalar(p, s, g, gk, out, ok, i, hi, h);
}

static inline ZO_T512 __attribute__((always_inline)) void zo512_lion_body(
        float *p, float *m, const void *g, int gk, void *out, int ok,
        int64_t lo, int64_t hi, const zo_hparams *h) {
    const __m512 gs = _mm512_set1_ps(h->grad_scale);
    const __m512 b1 = _mm512_set1_ps(h->beta1), omb1 = _mm512_set1_ps(h->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(h->beta2), omb2 = _mm512_set1_ps(h->one_minus_beta2);
    const __m512 dec = _mm512_set1_ps(h->decay), ss = _mm512_set1_ps(h->step_size);
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f), mone = _mm512_set1_ps(-1.0f);
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 gi = _mm512_mul_ps(zo512_load_grad(g, gk, i), gs);
        __m512 mi = _mm512_loadu_ps(m + i);
        __m512 c = _mm512_add_ps(_mm512_mul_ps(b1, mi), _mm512_mul_ps(omb1, gi));
        __m512 sg = _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ), one);
        __m512 pi;
        sg = _mm512_mask_mov_ps(sg, _mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ), mone);
        pi = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p + i), dec), _mm512_mul_ps(ss, sg));
        _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_mul_ps(b2, mi), _mm512_mul_ps(omb2, gi)));
        _mm512_storeu_ps(p + i, pi);
        zo512_store_out(out, ok, i, pi);
    }
    if (i < hi) zo_lion_scalar(p, m, g, gk, out, ok, i, hi, h);
}


/* ---- AVX2 + F16C: 8 lanes */
static inline ZO_T256 __m256 zo256_load_grad(const void *g, int gk, int64_t i) {
    if (gk == ZO_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i)));
    if (gk == ZO_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i))), 16));
    return _mm256_loadu_ps((const float *)g + i);
}

static inline ZO_T256 void zo256_store_out(void *o, int ok, int64_t i, __m256 v) {
    if (ok == ZO_F16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)o + i),
                         _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else if (ok == ZO_BF16) {
        __m256i x = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
        __m256i ax = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
        __m256i nan = _mm256_cmpgt_epi32(ax, _mm256_set1_epi32(0x7f800000));
        __m256i q = _mm256_or_si256(x, _mm256_set1_epi32(0x400000));
        __m256i hi16;
        r = _mm256_blendv_epi8(r, q, nan);
        hi16 = _mm256_srli_epi32(r, 16);
        /* pack 8 x u32 (all < 65536) to 8 x u16 in order */
        hi16 = _mm256_packus_epi32(hi16, hi16);
        hi16 = _mm256_permute4x64_epi64(hi16, 0x08);
        _mm_storeu_si128((__m128i *)((uint16_t *)o + i), _mm256_castsi256_si128(hi16));
    }
}

static inline ZO_T256 __attribute__((always_inline)) void zo256_adam_body(
        float *p, float *m, float *v, const void *g, int gk, void *out, int ok,
        int64_t lo, int64_t hi, const zo_hparams *h, const int zo_flags_) {
    const __m256 gs = _mm256_set1_ps(h->grad_scale), l2 = _mm256_set1_ps(h->l2);
    const __m256 b1 = _mm256_set1_ps(h->beta1), omb1 = _mm256_set1_ps(h->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(h->beta2), omb2 = _mm256_set1_ps(h->one_minus_beta2);
    const __m256 ibc2 = _mm256_set1_ps(h->inv_sqrt_bc2), eps = _mm256_set1_ps(h->eps);
    const __m256 dec = _mm256_set1_ps(h->decay), ss = _mm256_set1_ps(h->step_size);
    const float *rp = h->src_p ? h->src_p : p, *rm = h->src_m ? h->src_m : m, *rv = h->src_v ? h->src_v : v;
    int64_t i = lo;
    /* Out of place the new state is not read again this step, so streaming stores
     * write it without first reading the lines they overwrite (the read for
     * ownership made an out-of-place update 1.6x slower than one in place,
     * BENCHMARKS.md); they need aligned addresses, which the twin's arrays share. */
    int nt = 0;
    if (h->src_p != NULL) {
        int64_t a = zo_stream_start(p, m, v, lo, hi, 31);
        if (a >= 0) {
            zo_adam_scalar(p, m, v, g, gk, out, ok, lo, a, h);
            i = a;
            nt = 1;
        }
    }
    {
        /* a local, not h->: a vector store may alias *h, which would make every turn reload it */
        const float predict = h->predict;
        const __m256 pr = _mm256_set1_ps(predict);
        /* In windows of up to ZO_ADAM_WINDOW elements, two loops each: the moments and
         * the denominators (the square roots), parked in L1, then the divisions and the
         * weights.  In one loop Adam's long chain (square root, multiply, add, division)
         * was in flight for every element and the scheduler filled with operations
         * waiting on the one divider; on a Zen 1 core (a slow divider) the split made the
         * loop ~18% faster in cache (BENCHMARKS.md).  Each element's operations are the
         * same, in the same order, so are the bits. */
        float mq[ZO_ADAM_WINDOW] __attribute__((aligned(32))), dq[ZO_ADAM_WINDOW] __attribute__((aligned(32)));
#define ZO256_MOMENTS8(J, Q) do {                                                                  \
            const int64_t j_ = (J);                                                             \
            __m256 gi, mi, vi;                                                                  \
            gi = zo256_load_grad(g, gk, j_);                                                    \
            if (ZO_FLAG(h, ZO_F_SCALE)) gi = _mm256_mul_ps(gi, gs);                             \
            if (ZO_FLAG(h, ZO_F_L2)) gi = _mm256_add_ps(gi, _mm256_mul_ps(l2, _mm256_loadu_ps(rp + j_))); \
            mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(rm + j_)), _mm256_mul_ps(omb1, gi)); \
            vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(rv + j_)),                    \
                               _mm256_mul_ps(omb2, _mm256_mul_ps(gi, gi)));                     \
            _mm256_store_ps(mq + (Q), mi);                                                      \
            _mm256_store_ps(dq + (Q), _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), ibc2), eps)); \
            if (nt) {                                                                           \
                _mm256_stream_ps(m + j_, mi);                                                   \
                _mm256_stream_ps(v + j_, vi);                                                   \
            } else {                                                                            \
                _mm256_storeu_ps(m + j_, mi);                                                   \
                _mm256_storeu_ps(v + j_, vi);                                                   \
            }                                                                                   \
        } while (0)
#define ZO256_WEIGHTS8(J, Q) do {                                                                  \
            const int64_t j_ = (J);                                                             \
            __m256 pi = _mm256_loadu_ps(rp + j_), p0 = pi;                                      \
            if (ZO_FLAG(h, ZO_F_DECAY)) pi = _mm256_mul_ps(pi, dec);                            \
            pi = _mm256_sub_ps(pi, _mm256_mul_ps(ss, _mm256_div_ps(_mm256_load_ps(mq + (Q)),   \
                                                                   _mm256_load_ps(dq + (Q))))); \
            if (nt) _mm256_stream_ps(p + j_, pi);                                               \
            else _mm256_storeu_ps(p + j_, pi);                                                  \
            zo256_store_out(out, ok, j_, predict != 0.0f                                        \
                            ? _mm256_add_ps(pi, _mm256_mul_ps(pr, _mm256_sub_ps(pi, p0))) : pi); \
        } while (0)
        while (i + 8 <= hi) {
            int64_t w = (hi - i) & ~(int64_t)7, j;
            if (w > ZO_ADAM_WINDOW) w = ZO_ADAM_WINDOW;
            /* 16 elements a turn: one prefetch per 64-byte line of each fp32 stream */
            for (j = 0; j + 16 <= w; j += 16) {
                zo_adam_prefetch(rp, rm, rv, g, gk, i + j, lo);
                ZO256_MOMENTS8(i + j, j);
                ZO256_MOMENTS8(i + j + 8, j + 8);
            }
            if (j < w) ZO256_MOMENTS8(i + j, j);
            for (j = 0; j + 16 <= w; j += 16) {
                ZO256_WEIGHTS8(i + j, j);
                ZO256_WEIGHTS8(i + j + 8, j + 8);
            }
            if (j < w) ZO256_WEIGHTS8(i + j, j);
            i += w;
        }
#undef ZO256_MOMENTS8
#undef ZO256_WEIGHTS8
    }
    if (nt) _mm_sfence();  /* weakly ordered: visible before the progress word's release store */
    if (i < hi) zo_adam_scalar(p, m, v, g, gk, out, ok, i, hi, h);
}

static inline ZO_T256 __attribute__((always_inline)) void zo256_adagrad_body(
        float *p, float *s, const void *g, int gk, void *out, int ok,
        int64_t lo, int64_t hi, const zo_hparams *h) {
    const __m256 gs = _mm256_set1_ps(h->grad_scale), l2 = _mm256_set1_ps(h->l2);
    const __m256 eps = _mm256_set1_ps(h->eps), ss = _mm256_set1_ps(h->step_size);
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 gi = _mm256_mul_ps(zo256_load_grad(g, gk, i), gs);
        __m256 pi = _mm256_loadu_ps(p + i);
        __m256 si;
        gi = _mm256_add_ps(gi, _mm256_mul_ps(l2, pi));
        si = _mm256_add_ps(_mm256_loadu_ps(s + i), _mm256_mul_ps(gi, gi));
        pi = _mm256_sub_ps(pi, _mm256_mul_ps(ss, _mm256_div_ps(gi, _mm256_add_ps(_mm256_sqrt_ps(si), eps))));
        _mm256_storeu_ps(s + i, si);
        _mm256_storeu_ps(p + i, pi);
        zo256_store_out(out, ok, i, pi);
    }
    if (i < hi) zo_adagrad_scalar(p, s, g, gk, out, ok, i, hi, h);
}

static inline ZO_T256 __attribute__((always_inline)) void zo256_lion_body(
        float *p, float *m, const void *g, int gk, void *out, int ok,
        int64_t lo, int64_t hi, const zo_hparams *h) {
    const __m256 gs = _mm256_set1_ps(h->grad_scale);
    const __m256 b1 = _mm256_set1_ps(h->beta1), omb1 = _mm256_set1_ps(h->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(h->beta2), omb2 = _mm256_set1_ps(h->one_minus_beta2);
    const __m256 dec = _mm256_set1_ps(h->decay), ss = _mm256_set1_ps(h->step_size);
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), mone = _mm256_set1_ps(-1.0f);
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 gi = _mm256_mul_ps(zo256_load_grad(g, gk, i), gs);
        __m256 mi = _mm256_loadu_ps(m + i);
        __m256 c = _mm256_add_ps(_mm256_mul_ps(b1, mi), _mm256_mul_ps(omb1, gi));
        __m256 sg = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_GT_OQ), one),
                                 _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_LT_OQ), mone));
        __m256 pi = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i), dec), _mm256_mul_ps(ss, sg));
        _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_mul_ps(b2, mi), _mm256_mul_ps(omb2, gi)));
        _mm256_storeu_ps(p + i, pi);
        zo256_store_out(out, ok, i, pi);
    }
    if (i < hi) zo_lion_scalar(p, m, g, gk, out, ok, i, hi, h);
}


/* ---- compact state, AVX2: 8 lanes.  Integer ops on the bit patterns, the same as the
 * scalar helpers above, so the paths agree bitwise. */
static inline ZO_T256 __m256i zo256_load_u16(const uint16_t *a, int64_t i) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a + i)));
}
static inline ZO_T256 void zo256_store_u16(uint16_t *a, int64_t i, __m256i x) {
    /* 8 x u32 (all < 65536) -> 8 x u16 in order */
    __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(x, x), 0x08);
    _mm_storeu_si128((__m128i *)(a + i), _mm256_castsi256_si128(pk));
}
/* 8 lanes of the master: the exact master joined from its halves (zo_join_master), or
 * the fp32 master */
static inline ZO_T256 __attribute__((always_inline)) __m256 zo256_load_master(
        const float *p, const uint16_t *rem, const uint16_t *hi16, int64_t i, const int exact) {
    __m256i r16, h16;
    if (!exact) return _mm256_loadu_ps(p + i);
    r16 = zo256_load_u16(rem, i);
    h16 = _mm256_sub_epi32(zo256_load_u16(hi16, i), _mm256_srli_epi32(r16, 15));
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(h16, 16), r16));
}
/* the new master pi stored: split into its low halves and the weights (zo_split_master),
 * or as fp32 with the weights w (pi, or DPU's prediction) in the out slot.
 * The split from one sum: y = x + 0x8000 has the weights (x rounded) as its high half
 * and x's low half with bit 15 flipped as its low one, so one byte shuffle and one
 * 64-bit permute sort all 16 halves and an xor mends the low ones: 4 operations where
 * shifting and packing each half took 8 (the int8 kernel is bound by its operations). */
static inline ZO_T256 __attribute__((always_inline)) void zo256_store_master(
        float *p, uint16_t *rem, void *out, int ok, int64_t i, __m256 pi, __m256 w, const int exact) {
    /* in each 128-bit lane: the low halves to its low 8 bytes, the high halves to its high 8 */
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i flip = _mm256_setr_epi32(0x80008000, 0x80008000, 0x80008000, 0x80008000, 0, 0, 0, 0);
    __m256i y;
    if (!exact) {
        _mm256_storeu_ps(p + i, pi);
        zo256_store_out(out, ok, i, w);
        return;
    }
    y = _mm256_shuffle_epi8(_mm256_add_epi32(_mm256_castps_si256(pi), _mm256_set1_epi32(0x8000)), split);
    y = _mm256_xor_si256(_mm256_permute4x64_epi64(y, 0xd8), flip);  /* low halves 0-7 | high halves 0-7 */
    _mm_storeu_si128((__m128i *)(rem + i), _mm256_castsi256_si128(y));
    _mm_storeu_si128((__m128i *)((uint16_t *)out + i), _mm256_extracti128_si256(y, 1));
}
static inline ZO_T256 __m256i zo256_isnan(__m256i x) {
    return _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
}
/* fp32 bits -> bf16 bits (in u32 lanes) adding `add` below the kept bits; NaN stays quiet */
static inline ZO_T256 __m256i zo256_round_add(__m256i x, __m256i add) {
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, add), 16);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, q, zo256_isnan(x));
}
static inline ZO_T256 __m256i zo256_rne_add(__m256i x) {
    return _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1)),
                            _mm256_set1_epi32(0x7fff));
}
static inline ZO_T256 __m256i zo256_fold(__m256i x) {  /* zo_rand32's fold */
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}
static inline ZO_T256 __m256i zo256_mix32(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

static inline ZO_T256 __attribute__((always_inline)) void zo256_adam16_body(
        float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
        const zo_hparams *h, const zo_state16 *s) {
    const __m256 gs = _mm256_set1_ps(h->grad_scale), l2 = _mm256_set1_ps(h->l2);
    const __m256 b1 = _mm256_set1_ps(h->beta1), omb1 = _mm256_set1_ps(h->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(h->beta2), omb2 = _mm256_set1_ps(h->one_minus_beta2);
    const __m256 ibc2 = _mm256_set1_ps(h->inv_sqrt_bc2), eps = _mm256_set1_ps(h->eps);
    const __m256 dec = _mm256_set1_ps(h->decay), ss = _mm256_set1_ps(h->step_size);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), low = _mm256_set1_epi32(0xffff);
    const __m256i gold = _mm256_set1_epi32((int)0x9e3779b9u), key = _mm256_set1_epi32((int)s->key);
    const int sr = s->rounding == ZO_ROUND_STOCHASTIC;
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 gi = zo256_load_grad(g, gk, i);
        __m256 pi, mi, vi, denom, p0;
        __m256i mb, vb;
        if (h->grad_scale != 1.0f) gi = _mm256_mul_ps(gi, gs);
        pi = zo256_load_master(p, zo16_rd(s->src_rem, s->rem), s->hi, i, s->rem != NULL);
        if (h->l2 != 0.0f) gi = _mm256_add_ps(gi, _mm256_mul_ps(l2, pi));
        mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_castsi256_ps(_mm256_slli_epi32(
                               zo256_load_u16(zo16_rd(s->src_m, s->m), i), 16))),
                           _mm256_mul_ps(omb1, gi));
        vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_castsi256_ps(_mm256_slli_epi32(
                               zo256_load_u16(zo16_rd(s->src_v, s->v), i), 16))),
                           _mm256_mul_ps(omb2, _mm256_mul_ps(gi, gi)));
        denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), ibc2), eps);
        p0 = pi;
        if (h->decoupled) pi = _mm256_mul_ps(pi, dec);
        pi = _mm256_sub_ps(pi, _mm256_mul_ps(ss, _mm256_div_ps(mi, denom)));
        mb = _mm256_castps_si256(mi);
        vb = _mm256_castps_si256(vi);
        if (sr) {
            __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)(s->index_base + (uint32_t)i)), lanes);
            __m256i r = zo256_fold(_mm256_add_epi32(_mm256_mullo_epi32(idx, gold), key));
            mb = _mm256_srli_epi32(_mm256_add_epi32(mb, _mm256_and_si256(r, low)), 16);
            vb = _mm256_srli_epi32(_mm256_add_epi32(vb, _mm256_srli_epi32(r, 16)), 16);
        } else {
            mb = zo256_round_add(mb, zo256_rne_add(mb));
            vb = zo256_round_add(vb, zo256_rne_add(vb));
        }
        zo256_store_u16(s->m, i, mb);
        zo256_store_u16(s->v, i, vb);
        zo256_store_master(p, s->rem, out, ok, i, pi, h->predict != 0.0f
                           ? _mm256_add_ps(pi, _mm256_mul_ps(_mm256_set1_ps(h->predict), _mm256_sub_ps(pi, p0))) : pi,
                           s->rem != NULL);
    }
    if (i < hi) zo_adam16_scalar(p, g, gk, out, ok, i, hi, h, s);
}


/* The exact master with bf16 gradients, AVX2, 16 elements a turn: every array is
 * 16-bit, so unpacking against zero widens bf16 to fp32 (and packing the high
 * halves narrows it back) inside each 128-bit lane, with no cross-lane shuffle.
 * The lanes then hold elements {0-3, 8-11} and {4-7, 12-15}; the arithmetic is
 * elementwise and the random bits are keyed by each element's own index, so the
 * order changes no bit (the scalar loop is still the reference). */
static inline ZO_T256 __m256i zo256_quiet_round(__m256 xf, __m256i add) {
    /* fp32 -> bf16 in u32 lanes: (x + add) >> 16, NaN -> a quiet NaN */
    __m256i x = _mm256_castps_si256(xf);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(xf, xf, _CMP_UNORD_Q));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_andnot_si256(nan, add)), 16);
    return _mm256_or_si256(r, _mm256_and_si256(nan, _mm256_set1_epi32(0x40)));
}


/* Lion on 8 lanes in any order (zo_lion16_scalar); m out as bf16 in u32 lanes */
static inline ZO_T256 __attribute__((always_inline)) __m256 zo256_lion16_core(
        __m256 gi, __m256 pi, __m256i m32, __m256i rnd, __m256i *m_out, const zo_hparams *h, int sr, int zo_flags_) {
    const __m256 gs = _mm256_set1_ps(h->grad_scale);
    const __m256 b1 = _mm256_set1_ps(h->beta1), omb1 = _mm256_set1_ps(h->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(h->beta2), omb2 = _mm256_set1_ps(h->one_minus_beta2);
    const __m256 dec = _mm256_set1_ps(h->decay), ss = _mm256_set1_ps(h->step_size);
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), mone = _mm256_set1_ps(-1.0f);
    __m256 mi = _mm256_castsi256_ps(m32), c, sg, mn;
    if (ZO_FLAG(h, ZO_F_SCALE)) gi = _mm256_mul_ps(gi, gs);
    c = _mm256_add_ps(_mm256_mul_ps(b1, mi), _mm256_mul_ps(omb1, gi));
    sg = _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_GT_OQ), one),
                      _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_LT_OQ), mone));
    pi = _mm256_sub_ps(_mm256_mul_ps(pi, dec), _mm256_mul_ps(ss, sg));
    mn = _mm256_add_ps(_mm256_mul_ps(b2, mi), _mm256_mul_ps(omb2, gi));
    if (sr)
        *m_out = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(mn),
                                                    _mm256_and_si256(rnd, _mm256_set1_epi32(0xffff))), 16);
    else
        *m_out = zo256_quiet_round(mn, zo256_rne_add(_mm256_castps_si256(mn)));
    return pi;
}

/* zo_rand32's Weyl words (idx * phi + key) of a 16-element turn from element index
 * `first`, in the unpacked lane layout: lanes {0-3, 8-11} into *klo, {4-7, 12-15} into *khi */
static inline ZO_T256 void zo256_weyl16(uint32_t first, uint32_t key, __m256i *klo, __m256i *khi) {
    const __m256i base = _mm256_set1_epi32((int)first), gold = _mm256_set1_epi32((int)0x9e3779b9u);
    *klo = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_add_epi32(base, _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11)), gold),
                            _mm256_set1_epi32((int)key));
    *khi = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_add_epi32(base, _mm256_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15)), gold),
                            _mm256_set1_epi32((int)key));
}

/* Lion on 8 lanes of the exact master: g, m and the unpacked (rem, hi) words in; m, the
 * new master's high halves and its low halves out (u32 lanes) */
static inline ZO_T256 __attribute__((always_inline)) void zo256_lion16x_half(
        __m256i g32, __m256i m32, __m256i x32, __m256i rnd, __m256i *m_out, __m256i *hi_out, __m256i *rem_out,
        const zo_hparams *h, int sr, int zo_flags_) {
    /* join: (hi << 16 | rem), minus one in the high half where rem >= 0x8000 */
    __m256i xb = _mm256_sub_epi32(x32, _mm256_slli_epi32(_mm256_and_si256(x32, _mm256_set1_epi32(0x8000)), 1));
    __m256 pi = zo256_lion16_core(_mm256_castsi256_ps(g32), _mm256_castsi256_ps(xb), m32, rnd, m_out, h, sr, zo_flags_);
    *hi_out = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(pi), _mm256_set1_epi32(0x8000)), 16);
    *rem_out = _mm256_and_si256(_mm256_castps_si256(pi), _mm256_set1_epi32(0xffff));
}

static inline ZO_T256 __attribute__((always_inline)) void zo256_lion16x_body(
        const void *g, int64_t lo, int64_t hi, void *out, const zo_hparams *hp, const zo_state16 *s, int sr,
        int zo_flags_) {
    /* a private copy: vector stores may alias anything (__m256i is may_alias), so
     * through hp every constant would be reloaded and re-broadcast each turn */
    const zo_hparams hh = *hp, *h = &hh;
    const uint16_t *gw = (const uint16_t *)g, *hw = s->hi;
    uint16_t *m = s->m, *rem = s->rem, *o = (uint16_t *)out;
    const uint16_t *rm = zo16_rd(s->src_m, m), *rr = zo16_rd(s->src_rem, rem);
    const __m256i zero = _mm256_setzero_si256();
    /* zo256_weyl16's words advance by 16 phi a turn */
    const __m256i step16 = _mm256_set1_epi32((int)(16u * 0x9e3779b9u));
    int64_t i = lo;
    /* out of place (the twin): streaming stores of the new state, as zo512_adam_body */
    int nt = 0;
    if (s->src_m != NULL) {
        int64_t a = zo_stream_start16(m, NULL, rem, lo, hi);
        if (a >= 0) {
            zo_opt16_scalar(1, NULL, g, ZO_BF16, out, ZO_BF16, lo, a, h, s);
            i = a;
            nt = 1;
        }
    }
    __m256i klo, khi;
    zo256_weyl16(s->index_base + (uint32_t)i, s->key, &klo, &khi);
    for (; i + 16 <= hi; i += 16) {
        __m256i G = _mm256_loadu_si256((const __m256i *)(gw + i));
        __m256i M = _mm256_loadu_si256((const __m256i *)(rm + i));
        __m256i R = _mm256_loadu_si256((const __m256i *)(rr + i));
        __m256i H = _mm256_loadu_si256((const __m256i *)(hw + i));
        __m256i rl = sr ? zo256_fold(klo) : zero, rh = sr ? zo256_fold(khi) : zero;
        __m256i m0, h0, r0, m1, h1, r1;
        zo256_lion16x_half(_mm256_unpacklo_epi16(zero, G), _mm256_unpacklo_epi16(zero, M), _mm256_unpacklo_epi16(R, H),
                           rl, &m0, &h0, &r0, h, sr, zo_flags_);
        zo256_lion16x_half(_mm256_unpackhi_epi16(zero, G), _mm256_unpackhi_epi16(zero, M), _mm256_unpackhi_epi16(R, H),
                           rh, &m1, &h1, &r1, h, sr, zo_flags_);
        if (nt) {
            _mm256_stream_si256((__m256i *)(m + i), _mm256_packus_epi32(m0, m1));
            _mm256_stream_si256((__m256i *)(rem + i), _mm256_packus_epi32(r0, r1));
        } else {
            _mm256_storeu_si256((__m256i *)(m + i), _mm256_packus_epi32(m0, m1));
            _mm256_storeu_si256((__m256i *)(rem + i), _mm256_packus_epi32(r0, r1));
        }
        _mm256_storeu_si256((__m256i *)(o + i), _mm256_packus_epi32(h0, h1));
        klo = _mm256_add_epi32(klo, step16);
        khi = _mm256_add_epi32(khi, step16);
    }
    if (nt) _mm_sfence();  /* weakly ordered: visible before the progress word's release store */
    if (i < hi) zo_opt16_scalar(1, NULL, g, ZO_BF16, out, ZO_BF16, i, hi, h, s);
}

/* The split Adam bodies below, AVX2, in windows of up to ZO16_WINDOW elements, each
 * in two loops: the moments and the denominators (the square roots), parked in L1,
 * then the divisions and the master.  One loop with both left Adam's long chain
 * (square root, multiply, add, division) in flight for every element, and the core's
 * scheduler filled with operations waiting on the one divider: on a Zen 1 core, whose
 * divider is slow, the split took the update loop from ~2.1 to ~1.9 ns/element in
 * cache (BENCHMARKS.md).  Each element's operations are zo_adam16_scalar's, in its
 * order, so are the bits. */
#define ZO16_WINDOW 128

/* the first loop's 8 lanes: m and v rounded to bf16 (u32 lanes) into *m_out, *v_out;
 * the new m and the denominator parked at mq, dq (pi: the master, read for L2 only) */
static inline ZO_T256 __attribute__((always_inline)) void zo256_adam16_moments(
        __m256 gi, __m256 pi, __m256i m32, __m256i v32, __m256i rnd, __m256i *m_out, __m256i *v_out,
        float *mq, float *dq, const zo_hparams *h, int sr, int zo_flags_) {
    const __m256 gs = _mm256_set1_ps(h->grad_scale), l2 = _mm256_set1_ps(h->l2);
    const __m256 b1 = _mm256_set1_ps(h->beta1), omb1 = _mm256_set1_ps(h->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(h->beta2), omb2 = _mm256_set1_ps(h->one_minus_beta2);
    const __m256 ibc2 = _mm256_set1_ps(h->inv_sqrt_bc2), eps = _mm256_set1_ps(h->eps);
    const __m256i low = _mm256_set1_epi32(0xffff);
    __m256 mi, vi;
    if (ZO_FLAG(h, ZO_F_SCALE)) gi = _mm256_mul_ps(gi, gs);
    if (ZO_FLAG(h, ZO_F_L2)) gi = _mm256_add_ps(gi, _mm256_mul_ps(l2, pi));
    mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_castsi256_ps(m32)), _mm256_mul_ps(omb1, gi));
    vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_castsi256_ps(v32)), _mm256_mul_ps(omb2, _mm256_mul_ps(gi, gi)));
    _mm256_store_ps(mq, mi);
    _mm256_store_ps(dq, _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), ibc2), eps));
    if (sr) {  /* zo_f32_to_bf16_sr: no NaN case */
        *m_out = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(mi), _mm256_and_si256(rnd, low)), 16);
        *v_out = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(vi), _mm256_srli_epi32(rnd, 16)), 16);
    } else {
        *m_out = zo256_quiet_round(mi, zo256_rne_add(_mm256_castps_si256(mi)));
        *v_out = zo256_quiet_round(vi, zo256_rne_add(_mm256_castps_si256(vi)));
    }
}

/* the second loop's 8 lanes: the new master from the old one and the parked m and denominator */
static inline ZO_T256 __attribute__((always_inline)) __m256 zo256_adam16_step(
        __m256 pi, const float *mq, const float *dq, const zo_hparams *h, int zo_flags_) {
    if (ZO_FLAG(h, ZO_F_DECAY)) pi = _mm256_mul_ps(pi, _mm256_set1_ps(h->decay));
    return _mm256_sub_ps(pi, _mm256_mul_ps(_mm256_set1_ps(h->step_size),
                                           _mm256_div_ps(_mm256_load_ps(mq), _mm256_load_ps(dq))));
}

/* the exact master of 8 lanes from unpacked (rem, hi) words: hi << 16 | rem, minus one
 * in the high half where rem >= 0x8000 */
static inline ZO_T256 __m256 zo256_join16(__m256i x) {
    return _mm256_castsi256_ps(_mm256_sub_epi32(x, _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x8000)), 1)));
}

/* Adam with the exact master and bf16 gradients in two loops a window, in
 * zo256_lion16x_body's lane layout */
static inline ZO_T256 __attribute__((always_inline)) void zo256_adam16x_split_body(
        const void *g, int64_t lo, int64_t hi, void *out, const zo_hparams *hp, const zo_state16 *s, int sr,
        int zo_flags_) {
    const zo_hparams hh = *hp, *h = &hh;  /* a private copy: zo256_lion16x_body says why */
    const uint16_t *gw = (const uint16_t *)g, *hw = s->hi;
    uint16_t *m = s->m, *v = s->v, *rem = s->rem, *o = (uint16_t *)out;
    const uint16_t *rm = zo16_rd(s->src_m, m), *rv = zo16_rd(s->src_v, v), *rr = zo16_rd(s->src_rem, rem);
    const __m256i zero = _mm256_setzero_si256(), low = _mm256_set1_epi32(0xffff);
    const __m256i half = _mm256_set1_epi32(0x8000);
    const __m256i step16 = _mm256_set1_epi32((int)(16u * 0x9e3779b9u));
    float mq[ZO16_WINDOW] __attribute__((aligned(32))), dq[ZO16_WINDOW] __attribute__((aligned(32)));
    int64_t i = lo;
    int nt = 0;
    if (s->src_m != NULL) {
        int64_t a = zo_stream_start16(m, v, rem, lo, hi);
        if (a >= 0) {
            zo_opt16_scalar(0, NULL, g, ZO_BF16, out, ZO_BF16, lo, a, h, s);
            i = a;
            nt = 1;
        }
    }
    __m256i klo, khi;
    zo256_weyl16(s->index_base + (uint32_t)i, s->key, &klo, &khi);
    while (i + 16 <= hi) {
        int64_t w = (hi - i) & ~(int64_t)15, j;
        if (w > ZO16_WINDOW) w = ZO16_WINDOW;
        for (j = 0; j < w; j += 16) {
            const int64_t e = i + j;
            if ((j & 16) == 0) zo16_prefetch(gw, rm, rv, rr, hw, e);
            __m256i G = _mm256_loadu_si256((const __m256i *)(gw + e));
            __m256i M = _mm256_loadu_si256((const __m256i *)(rm + e));
            __m256i V = _mm256_loadu_si256((const __m256i *)(rv + e));
            __m256i rl = sr ? zo256_fold(klo) : zero, rh = sr ? zo256_fold(khi) : zero, m0, v0, m1, v1;
            __m256 plo = _mm256_setzero_ps(), phi = _mm256_setzero_ps();
            if (ZO_FLAG(h, ZO_F_L2)) {
                __m256i R = _mm256_loadu_si256((const __m256i *)(rr + e));
                __m256i H = _mm256_loadu_si256((const __m256i *)(hw + e));
                plo = zo256_join16(_mm256_unpacklo_epi16(R, H));
                phi = zo256_join16(_mm256_unpackhi_epi16(R, H));
            }
            zo256_adam16_moments(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, G)), plo,
                                 _mm256_unpacklo_epi16(zero, M), _mm256_unpacklo_epi16(zero, V), rl, &m0, &v0,
                                 mq + j, dq + j, h, sr, zo_flags_);
            zo256_adam16_moments(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, G)), phi,
                                 _mm256_unpackhi_epi16(zero, M), _mm256_unpackhi_epi16(zero, V), rh, &m1, &v1,
                                 mq + j + 8, dq + j + 8, h, sr, zo_flags_);
            if (nt) {
                _mm256_stream_si256((__m256i *)(m + e), _mm256_packus_epi32(m0, m1));
                _mm256_stream_si256((__m256i *)(v + e), _mm256_packus_epi32(v0, v1));
            } else {
                _mm256_storeu_si256((__m256i *)(m + e), _mm256_packus_epi32(m0, m1));
                _mm256_storeu_si256((__m256i *)(v + e), _mm256_packus_epi32(v0, v1));
            }
            klo = _mm256_add_epi32(klo, step16);
            khi = _mm256_add_epi32(khi, step16);
        }
        for (j = 0; j < w; j += 16) {
            const int64_t e = i + j;
            __m256i R = _mm256_loadu_si256((const __m256i *)(rr + e));
            __m256i H = _mm256_loadu_si256((const __m256i *)(hw + e));
            __m256i q0 = _mm256_castps_si256(zo256_adam16_step(zo256_join16(_mm256_unpacklo_epi16(R, H)), mq + j,
                                                               dq + j, h, zo_flags_));
            __m256i q1 = _mm256_castps_si256(zo256_adam16_step(zo256_join16(_mm256_unpackhi_epi16(R, H)), mq + j + 8,
                                                               dq + j + 8, h, zo_flags_));
            /* the high halves rounded (zo_split_master), the low halves as they are */
            __m256i h0 = _mm256_srli_epi32(_mm256_add_epi32(q0, half), 16), r0 = _mm256_and_si256(q0, low);
            __m256i h1 = _mm256_srli_epi32(_mm256_add_epi32(q1, half), 16), r1 = _mm256_and_si256(q1, low);
            if (nt) _mm256_stream_si256((__m256i *)(rem + e), _mm256_packus_epi32(r0, r1));
            else _mm256_storeu_si256((__m256i *)(rem + e), _mm256_packus_epi32(r0, r1));
            _mm256_storeu_si256((__m256i *)(o + e), _mm256_packus_epi32(h0, h1));
        }
        i += w;
    }
    if (nt) _mm_sfence();  /* weakly ordered: visible before the progress word's release store */
    if (i < hi) zo_opt16_scalar(0, NULL, g, ZO_BF16, out, ZO_BF16, i, hi, h, s);
}

static ZO_T256 void zo256_adam16x(int lion, const void *g, int64_t lo, int64_t hi, void *out, const zo_hparams *h,
                                  const zo_state16 *s) {
    int sr = s->rounding == ZO_ROUND_STOCHASTIC, f = zo_flags_of(h);
    /* constant flags for the common cases: AdamW (decay, no L2) with and without a scale */
    if (!lion && sr && f == ZO_F_DECAY) zo256_adam16x_split_body(g, lo, hi, out, h, s, 1, ZO_F_DECAY);
    else if (!lion && sr && f == (ZO_F_DECAY | ZO_F_SCALE))
        zo256_adam16x_split_body(g, lo, hi, out, h, s, 1, ZO_F_DECAY | ZO_F_SCALE);
    else if (lion) zo256_lion16x_body(g, lo, hi, out, h, s, sr, f);
    else zo256_adam16x_split_body(g, lo, hi, out, h, s, sr, f);
}


/* The fp32 master with bf16 moments (fp16 weights, or DPU's prediction), AVX2, 16
 * elements a turn in the same lane layout as the exact body: the 16-bit arrays
 * unpack, and the fp32 master and fp16 values are regrouped with 128-bit permutes
 * (lanes {0-3, 8-11} and {4-7, 12-15}). */
static inline ZO_T256 __attribute__((always_inline)) void zo256_lion16p_body(
        float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *hp,
        const zo_state16 *s, int sr, int zo_flags_) {
    const zo_hparams hh = *hp, *h = &hh;  /* as in zo256_lion16x_body */
    uint16_t *m = s->m;
    const __m256i zero = _mm256_setzero_si256();
    const __m256i step16 = _mm256_set1_epi32((int)(16u * 0x9e3779b9u));
    const __m256 pr = _mm256_set1_ps(h->predict);
    const int predict = h->predict != 0.0f;
    int64_t i = lo;
    __m256i klo, khi;
    zo256_weyl16(s->index_base + (uint32_t)lo, s->key, &klo, &khi);
    for (; i + 16 <= hi; i += 16) {
        __m256 a = _mm256_loadu_ps(p + i), b = _mm256_loadu_ps(p + i + 8);
        __m256 plo = _mm256_permute2f128_ps(a, b, 0x20), phi = _mm256_permute2f128_ps(a, b, 0x31);
        __m256 glo, ghi, qlo, qhi, olo, ohi;
        __m256i M = _mm256_loadu_si256((const __m256i *)(m + i));
        __m256i rl = sr ? zo256_fold(klo) : zero, rh = sr ? zo256_fold(khi) : zero;
        __m256i m0, m1;
        if (gk == ZO_BF16) {
            __m256i G = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
            glo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, G));
            ghi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, G));
        } else {
            __m256 g0 = zo256_load_grad(g, gk, i), g1 = zo256_load_grad(g, gk, i + 8);
            glo = _mm256_permute2f128_ps(g0, g1, 0x20);
            ghi = _mm256_permute2f128_ps(g0, g1, 0x31);
        }
        qlo = zo256_lion16_core(glo, plo, _mm256_unpacklo_epi16(zero, M), rl, &m0, h, sr, zo_flags_);
        qhi = zo256_lion16_core(ghi, phi, _mm256_unpackhi_epi16(zero, M), rh, &m1, h, sr, zo_flags_);
        _mm256_storeu_si256((__m256i *)(m + i), _mm256_packus_epi32(m0, m1));
        _mm256_storeu_ps(p + i, _mm256_permute2f128_ps(qlo, qhi, 0x20));
        _mm256_storeu_ps(p + i + 8, _mm256_permute2f128_ps(qlo, qhi, 0x31));
        olo = predict ? _mm256_add_ps(qlo, _mm256_mul_ps(pr, _mm256_sub_ps(qlo, plo))) : qlo;
        ohi = predict ? _mm256_add_ps(qhi, _mm256_mul_ps(pr, _mm256_sub_ps(qhi, phi))) : qhi;
        if (ok == ZO_BF16) {
            __m256i xl = zo256_quiet_round(olo, zo256_rne_add(_mm256_castps_si256(olo)));
            __m256i xh = zo256_quiet_round(ohi, zo256_rne_add(_mm256_castps_si256(ohi)));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm256_packus_epi32(xl, xh));
        } else {
            zo256_store_out(out, ok, i, _mm256_permute2f128_ps(olo, ohi, 0x20));
            zo256_store_out(out, ok, i + 8, _mm256_permute2f128_ps(olo, ohi, 0x31));
        }
        klo = _mm256_add_epi32(klo, step16);
        khi = _mm256_add_epi32(khi, step16);
    }
    if (i < hi) zo_opt16_scalar(1, p, g, gk, out, ok, i, hi, h, s);
}

/* Adam with the fp32 master and bf16 moments in two loops a window (zo256_adam16x_split_body's
 * comment says why), in zo256_lion16p_body's lane layout */
static inline ZO_T256 __attribute__((always_inline)) void zo256_adam16p_split_body(
        float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *hp,
        const zo_state16 *s, int sr, int zo_flags_) {
    const zo_hparams hh = *hp, *h = &hh;  /* as in zo256_lion16x_body */
    uint16_t *m = s->m, *v = s->v;
    const __m256i zero = _mm256_setzero_si256();
    const __m256i step16 = _mm256_set1_epi32((int)(16u * 0x9e3779b9u));
    const __m256 pr = _mm256_set1_ps(h->predict);
    const int predict = h->predict != 0.0f;
    float mq[ZO16_WINDOW] __attribute__((aligned(32))), dq[ZO16_WINDOW] __attribute__((aligned(32)));
    int64_t i = lo;
    __m256i klo, khi;
    zo256_weyl16(s->index_base + (uint32_t)lo, s->key, &klo, &khi);
    while (i + 16 <= hi) {
        int64_t w = (hi - i) & ~(int64_t)15, j;
        if (w > ZO16_WINDOW) w = ZO16_WINDOW;
        for (j = 0; j < w; j += 16) {
            const int64_t e = i + j;
            zo16p_prefetch(p, g, gk, m, v, e, (j & 16) == 0);
            __m256 glo, ghi, plo = _mm256_setzero_ps(), phi = _mm256_setzero_ps();
            __m256i M = _mm256_loadu_si256((const __m256i *)(m + e));
            __m256i V = _mm256_loadu_si256((const __m256i *)(v + e));
            __m256i rl = sr ? zo256_fold(klo) : zero, rh = sr ? zo256_fold(khi) : zero, m0, v0, m1, v1;
            if (gk == ZO_BF16) {
                __m256i G = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + e));
                glo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, G));
                ghi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, G));
            } else {
                __m256 g0 = zo256_load_grad(g, gk, e), g1 = zo256_load_grad(g, gk, e + 8);
                glo = _mm256_permute2f128_ps(g0, g1, 0x20);
                ghi = _mm256_permute2f128_ps(g0, g1, 0x31);
            }
            if (ZO_FLAG(h, ZO_F_L2)) {
                __m256 a = _mm256_loadu_ps(p + e), b = _mm256_loadu_ps(p + e + 8);
                plo = _mm256_permute2f128_ps(a, b, 0x20);
                phi = _mm256_permute2f128_ps(a, b, 0x31);
            }
            zo256_adam16_moments(glo, plo, _mm256_unpacklo_epi16(zero, M), _mm256_unpacklo_epi16(zero, V), rl, &m0,
                                 &v0, mq + j, dq + j, h, sr, zo_flags_);
            zo256_adam16_moments(ghi, phi, _mm256_unpackhi_epi16(zero, M), _mm256_unpackhi_epi16(zero, V), rh, &m1,
                                 &v1, mq + j + 8, dq + j + 8, h, sr, zo_flags_);
            _mm256_storeu_si256((__m256i *)(m + e), _mm256_packus_epi32(m0, m1));
            _mm256_storeu_si256((__m256i *)(v + e), _mm256_packus_epi32(v0, v1));
            klo = _mm256_add_epi32(klo, step16);
            khi = _mm256_add_epi32(khi, step16);
        }
        for (j = 0; j < w; j += 16) {
            const int64_t e = i + j;
            __m256 a = _mm256_loadu_ps(p + e), b = _mm256_loadu_ps(p + e + 8);
            __m256 plo = _mm256_permute2f128_ps(a, b, 0x20), phi = _mm256_permute2f128_ps(a, b, 0x31);
            __m256 qlo = zo256_adam16_step(plo, mq + j, dq + j, h, zo_flags_);
            __m256 qhi = zo256_adam16_step(phi, mq + j + 8, dq + j + 8, h, zo_flags_);
            __m256 olo = predict ? _mm256_add_ps(qlo, _mm256_mul_ps(pr, _mm256_sub_ps(qlo, plo))) : qlo;
            __m256 ohi = predict ? _mm256_add_ps(qhi, _mm256_mul_ps(pr, _mm256_sub_ps(qhi, phi))) : qhi;
            _mm256_storeu_ps(p + e, _mm256_permute2f128_ps(qlo, qhi, 0x20));
            _mm256_storeu_ps(p + e + 8, _mm256_permute2f128_ps(qlo, qhi, 0x31));
            if (ok == ZO_BF16) {
                __m256i xl = zo256_quiet_round(olo, zo256_rne_add(_mm256_castps_si256(olo)));
                __m256i xh = zo256_quiet_round(ohi, zo256_rne_add(_mm256_castps_si256(ohi)));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + e), _mm256_packus_epi32(xl, xh));
            } else {
                zo256_store_out(out, ok, e, _mm256_permute2f128_ps(olo, ohi, 0x20));
                zo256_store_out(out, ok, e + 8, _mm256_permute2f128_ps(olo, ohi, 0x31));
            }
        }
        i += w;
    }
    if (i < hi) zo_opt16_scalar(0, p, g, gk, out, ok, i, hi, h, s);
}

static ZO_T256 void zo256_adam16p(int lion, float *p, const void *g, int gk, void *out, int ok, int64_t lo,
                                  int64_t hi, const zo_hparams *h, const zo_state16 *s) {
    int sr = s->rounding == ZO_ROUND_STOCHASTIC, f = zo_flags_of(h);
    if (lion) {  /* Lion is rarer: only its loop invariants are constant */
        zo256_lion16p_body(p, g, gk, out, ok, lo, hi, h, s, sr, f);
    } else if (gk == ZO_BF16 && ok == ZO_BF16 && sr) {
        zo256_adam16p_split_body(p, g, ZO_BF16, out, ZO_BF16, lo, hi, h, s, 1, f);
    } else if (gk == ZO_F16 && ok == ZO_F16 && sr) {
        zo256_adam16p_split_body(p, g, ZO_F16, out, ZO_F16, lo, hi, h, s, 1, f);
    } else {
        zo256_adam16p_split_body(p, g, gk, out, ok, lo, hi, h, s, sr, f);
    }
}

/* ---- compact state (bf16 moments), AVX-512: 16 lanes in element order.  The AVX2
 * bodies above op for op, with 16-bit arrays widened by vpmovzxwd and narrowed by
 * vpmovdw (every narrowed value is below 2^16, where the AVX2 packs' saturation is
 * the identity), and masks for the NaN and sign selections. */
static inline ZO_T512 __m512i zo512_load_u16(const uint16_t *a, int64_t i) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + i)));
}
static inline ZO_T512 void zo512_store_u16(uint16_t *a, int64_t i, __m512i x) {  /* the low halves */
    _mm256_storeu_si256((__m256i *)(a + i), _mm512_cvtepi32_epi16(x));
}
/* zo256_load_master and zo256_store_master, 16 lanes */
static inline ZO_T512 __attribute__((always_inline)) __m512 zo512_load_master(
        const float *p, const uint16_t *rem, const uint16_t *hi16, int64_t i, const int exact) {
    __m512i r16, h16;
    if (!exact) return _mm512_loadu_ps(p + i);
    r16 = zo512_load_u16(rem, i);
    h16 = _mm512_sub_epi32(zo512_load_u16(hi16, i), _mm512_srli_epi32(r16, 15));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(h16, 16), r16));
}
static inline ZO_T512 __attribute__((always_inline)) void zo512_store_master(
        float *p, uint16_t *rem, void *out, int ok, int64_t i, __m512 pi, __m512 w, const int exact) {
    __m512i x = _mm512_castps_si512(pi);
    if (!exact) {
        _mm512_storeu_ps(p + i, pi);
        zo512_store_out(out, ok, i, w);
        return;
    }
    zo512_store_u16(rem, i, x);  /* the low halves */
    zo512_store_u16((uint16_t *)out, i, _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x8000)), 16));
}
static inline ZO_T512 __m512i zo512_rne_add(__m512i x) {
    return _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1)),
                            _mm512_set1_epi32(0x7fff));
}
/* zo256_quiet_round: (x + add) >> 16, NaN -> a quiet NaN */
static inline ZO_T512 __m512i zo512_quiet_round(__m512 xf, __m512i add) {
    __m512i x = _mm512_castps_si512(xf);
    __mmask16 nan = _mm512_cmp_ps_mask(xf, xf, _CMP_UNORD_Q);
    __m512i r = _mm512_srli_epi32(_mm512_mask_add_epi32(x, (__mmask16)~nan, x, add), 16);
    return _mm512_mask_or_epi32(r, nan, r, _mm512_set1_epi32(0x40));
}
static inline ZO_T512 __m512i zo512_fold(__m512i x) {  /* zo_rand32's fold */
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* zo_rand32's Weyl words idx * phi + key of the 16 elements from first, in lane order
 * (zo256_weyl16's, without its split into two halves) */
static inline ZO_T512 __m512i zo512_weyl16(uint32_t first, uint32_t key) {
    return _mm512_add_epi32(_mm512_mullo_epi32(
        _mm512_add_epi32(_mm512_set1_epi32((int)first),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
        _mm512_set1_epi32((int)0x9e3779b9u)), _mm512_set1_epi32((int)key));
}

/* zo256_lion16_core, 16 lanes */
static inline ZO_T512 __attribute__((always_inline)) __m512 zo512_lion16_core(
        __m512 gi, __m512 pi, __m512i m32, __m512i rnd, __m512i *m_out, const zo_hparams *h, int sr, int zo_flags_) {
    const __m512 gs = _mm512_set1_ps(h->grad_scale);
    const __m512 b1 = _mm512_set1_ps(h->beta1), omb1 = _mm512_set1_ps(h->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(h->beta2), omb2 = _mm512_set1_ps(h->one_minus_beta2);
    const __m512 dec = _mm512_set1_ps(h->decay), ss = _mm512_set1_ps(h->step_size);
    const __m512 zero = _mm512_setzero_ps();
    __m512 mi = _mm512_castsi512_ps(m32), c, sg, mn;
    if (ZO_FLAG(h, ZO_F_SCALE)) gi = _mm512_mul_ps(gi, gs);
    c = _mm512_add_ps(_mm512_mul_ps(b1, mi), _mm512_mul_ps(omb1, gi));
    sg = _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    sg = _mm512_mask_mov_ps(sg, _mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
    pi = _mm512_sub_ps(_mm512_mul_ps(pi, dec), _mm512_mul_ps(ss, sg));
    mn = _mm512_add_ps(_mm512_mul_ps(b2, mi), _mm512_mul_ps(omb2, gi));
    if (sr)
        *m_out = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(mn),
                                                    _mm512_and_si512(rnd, _mm512_set1_epi32(0xffff))), 16);
    else
        *m_out = zo512_quiet_round(mn, zo512_rne_add(_mm512_castps_si512(mn)));
    return pi;
}

/* zo256_lion16x_body, 16 lanes: Lion with the exact master and bf16 gradients (Adam's
 * is zo512_adam16x_split_body below) */
static inline ZO_T512 __attribute__((always_inline)) void zo512_lion16x_body(
        const void *g, int64_t lo, int64_t hi, void *out, const zo_hparams *hp, const zo_state16 *s, int sr,
        int zo_flags_) {
    const zo_hparams hh = *hp, *h = &hh;  /* as in zo256_lion16x_body */
    const uint16_t *gw = (const uint16_t *)g, *hw = s->hi;
    uint16_t *m = s->m, *rem = s->rem, *o = (uint16_t *)out;
    const uint16_t *rm = zo16_rd(s->src_m, m), *rr = zo16_rd(s->src_rem, rem);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i step16 = _mm512_set1_epi32((int)(16u * 0x9e3779b9u));
    int64_t i = lo;
    int nt = 0;  /* out of place (the twin): streaming stores, as in zo256_lion16x_body */
    if (s->src_m != NULL) {
        int64_t a = zo_stream_start16(m, s->v, rem, lo, hi);
        if (a >= 0) {
            zo_opt16_scalar(1, NULL, g, ZO_BF16, out, ZO_BF16, lo, a, h, s);
            i = a;
            nt = 1;
        }
    }
    __m512i kw = zo512_weyl16(s->index_base + (uint32_t)i, s->key);
    for (; i + 16 <= hi; i += 16) {
        __m512i g32 = _mm512_slli_epi32(zo512_load_u16(gw, i), 16);
        __m512i m32 = _mm512_slli_epi32(zo512_load_u16(rm, i), 16);
        __m512i x32 = _mm512_or_si512(_mm512_slli_epi32(zo512_load_u16(hw, i), 16), zo512_load_u16(rr, i));
        __m512i rnd = sr ? zo512_fold(kw) : zero, m0;
        /* join: (hi << 16 | rem), minus one in the high half where rem >= 0x8000 */
        __m512i xb = _mm512_sub_epi32(x32, _mm512_slli_epi32(_mm512_and_si512(x32, _mm512_set1_epi32(0x8000)), 1));
        __m512 pi = zo512_lion16_core(_mm512_castsi512_ps(g32), _mm512_castsi512_ps(xb), m32, rnd, &m0, h, sr,
                                      zo_flags_);
        if (nt) {
            _mm256_stream_si256((__m256i *)(m + i), _mm512_cvtepi32_epi16(m0));
            _mm256_stream_si256((__m256i *)(rem + i), _mm512_cvtepi32_epi16(_mm512_castps_si512(pi)));
        } else {
            zo512_store_u16(m, i, m0);
            zo512_store_u16(rem, i, _mm512_castps_si512(pi));
        }
        zo512_store_u16(o, i, _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(pi), _mm512_set1_epi32(0x8000)), 16));
        kw = _mm512_add_epi32(kw, step16);
    }
    if (nt) _mm_sfence();  /* weakly ordered: visible before the progress word's release store */
    if (i < hi) zo_opt16_scalar(1, NULL, g, ZO_BF16, out, ZO_BF16, i, hi, h, s);
}

/* the first loop's 16 lanes of zo512_adam16x_split_body: zo256_adam16_moments */
static inline ZO_T512 __attribute__((always_inline)) void zo512_adam16_moments(
        __m512 gi, __m512 pi, __m512i m32, __m512i v32, __m512i rnd, __m512i *m_out, __m512i *v_out,
        float *mq, float *dq, const zo_hparams *h, int sr, int zo_flags_) {
    const __m512 gs = _mm512_set1_ps(h->grad_scale), l2 = _mm512_set1_ps(h->l2);
    const __m512 b1 = _mm512_set1_ps(h->beta1), omb1 = _mm512_set1_ps(h->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(h->beta2), omb2 = _mm512_set1_ps(h->one_minus_beta2);
    const __m512 ibc2 = _mm512_set1_ps(h->inv_sqrt_bc2), eps = _mm512_set1_ps(h->eps);
    const __m512i low = _mm512_set1_epi32(0xffff);
    __m512 mi, vi;
    if (ZO_FLAG(h, ZO_F_SCALE)) gi = _mm512_mul_ps(gi, gs);
    if (ZO_FLAG(h, ZO_F_L2)) gi = _mm512_add_ps(gi, _mm512_mul_ps(l2, pi));
    mi = _mm512_add_ps(_mm512_mul_ps(b1, _mm512_castsi512_ps(m32)), _mm512_mul_ps(omb1, gi));
    vi = _mm512_add_ps(_mm512_mul_ps(b2, _mm512_castsi512_ps(v32)), _mm512_mul_ps(omb2, _mm512_mul_ps(gi, gi)));
    _mm512_store_ps(mq, mi);
    _mm512_store_ps(dq, _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), ibc2), eps));
    if (sr) {  /* zo_f32_to_bf16_sr: no NaN case */
        *m_out = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(mi), _mm512_and_si512(rnd, low)), 16);
        *v_out = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(vi), _mm512_srli_epi32(rnd, 16)), 16);
    } else {
        *m_out = zo512_quiet_round(mi, zo512_rne_add(_mm512_castps_si512(mi)));
        *v_out = zo512_quiet_round(vi, zo512_rne_add(_mm512_castps_si512(vi)));
    }
}

/* the exact master of 16 lanes: (hi << 16 | rem), minus one in the high half where rem >= 0x8000 */
static inline ZO_T512 __m512 zo512_join16(const uint16_t *hw, const uint16_t *rr, int64_t i) {
    __m512i x32 = _mm512_or_si512(_mm512_slli_epi32(zo512_load_u16(hw, i), 16), zo512_load_u16(rr, i));
    return _mm512_castsi512_ps(_mm512_sub_epi32(x32, _mm512_slli_epi32(_mm512_and_si512(x32, _mm512_set1_epi32(0x8000)), 1)));
}

/* Adam with the exact master and bf16 gradients, zo256_adam16x_split_body at 16 lanes:
 * two loops a window, the moments and the denominators (parked in L1), then the
 * divisions and the master.  On an Intel core with AVX-512 the one-loop body ran at
 * ~85% of its access pattern's bound, the split at more (BENCHMARKS.md). */
static inline ZO_T512 __attribute__((always_inline)) void zo512_adam16x_split_body(
        const void *g, int64_t lo, int64_t hi, void *out, const zo_hparams *hp, const zo_state16 *s, int sr,
        int zo_flags_) {
    const zo_hparams hh = *hp, *h = &hh;  /* as in zo256_lion16x_body */
    const uint16_t *gw = (const uint16_t *)g, *hw = s->hi;
    uint16_t *m = s->m, *v = s->v, *rem = s->rem, *o = (uint16_t *)out;
    const uint16_t *rm = zo16_rd(s->src_m, m), *rv = zo16_rd(s->src_v, v), *rr = zo16_rd(s->src_rem, rem);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i step16 = _mm512_set1_epi32((int)(16u * 0x9e3779b9u));
    float mq[ZO16_WINDOW] __attribute__((aligned(64))), dq[ZO16_WINDOW] __attribute__((aligned(64)));
    int64_t i = lo;
    int nt = 0;  /* out of place (the twin): streaming stores, as in zo256_lion16x_body */
    if (s->src_m != NULL) {
        int64_t a = zo_stream_start16(m, v, rem, lo, hi);
        if (a >= 0) {
            zo_opt16_scalar(0, NULL, g, ZO_BF16, out, ZO_BF16, lo, a, h, s);
            i = a;
            nt = 1;
        }
    }
    __m512i kw = zo512_weyl16(s->index_base + (uint32_t)i, s->key);
    while (i + 16 <= hi) {
        int64_t w = (hi - i) & ~(int64_t)15, j;
        if (w > ZO16_WINDOW) w = ZO16_WINDOW;
        for (j = 0; j < w; j += 16) {
            const int64_t e = i + j;
            if ((j & 16) == 0) zo16_prefetch(gw, rm, rv, rr, hw, e);
            __m512i g32 = _mm512_slli_epi32(zo512_load_u16(gw, e), 16);
            __m512i m32 = _mm512_slli_epi32(zo512_load_u16(rm, e), 16);
            __m512i v32 = _mm512_slli_epi32(zo512_load_u16(rv, e), 16);
            __m512i rnd = sr ? zo512_fold(kw) : zero, m0, v0;
            __m512 pi = ZO_FLAG(h, ZO_F_L2) ? zo512_join16(hw, rr, e) : _mm512_setzero_ps();
            zo512_adam16_moments(_mm512_castsi512_ps(g32), pi, m32, v32, rnd, &m0, &v0, mq + j, dq + j, h, sr,
                                 zo_flags_);
            if (nt) {
                _mm256_stream_si256((__m256i *)(m + e), _mm512_cvtepi32_epi16(m0));
                _mm256_stream_si256((__m256i *)(v + e), _mm512_cvtepi32_epi16(v0));
            } else {
                zo512_store_u16(m, e, m0);
                zo512_store_u16(v, e, v0);
            }
            kw = _mm512_add_epi32(kw, step16);
        }
        for (j = 0; j < w; j += 16) {
            const int64_t e = i + j;
            __m512 pi = zo512_join16(hw, rr, e);
            if (ZO_FLAG(h, ZO_F_DECAY)) pi = _mm512_mul_ps(pi, _mm512_set1_ps(h->decay));
            pi = _mm512_sub_ps(pi, _mm512_mul_ps(_mm512_set1_ps(h->step_size),
                                                 _mm512_div_ps(_mm512_load_ps(mq + j), _mm512_load_ps(dq + j))));
            if (nt) _mm256_stream_si256((__m256i *)(rem + e), _mm512_cvtepi32_epi16(_mm512_castps_si512(pi)));
            else zo512_store_u16(rem, e, _mm512_castps_si512(pi));
            zo512_store_u16(o, e, _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(pi),
                                                                     _mm512_set1_epi32(0x8000)), 16));
        }
        i += w;
    }
    if (nt) _mm_sfence();  /* weakly ordered: visible before the progress word's release store */
    if (i < hi) zo_opt16_scalar(0, NULL, g, ZO_BF16, out, ZO_BF16, i, hi, h, s);
}

static ZO_T512 void zo512_adam16x(int lion, const void *g, int64_t lo, int64_t hi, void *out, const zo_hparams *h,
                                  const zo_state16 *s) {
    int sr = s->rounding == ZO_ROUND_STOCHASTIC, f = zo_flags_of(h);
    if (!lion && sr && f == ZO_F_DECAY) zo512_adam16x_split_body(g, lo, hi, out, h, s, 1, ZO_F_DECAY);
    else if (!lion && sr && f == (ZO_F_DECAY | ZO_F_SCALE))
        zo512_adam16x_split_body(g, lo, hi, out, h, s, 1, ZO_F_DECAY | ZO_F_SCALE);
    else if (lion) zo512_lion16x_body(g, lo, hi, out, h, s, sr, f);
    else zo512_adam16x_split_body(g, lo, hi, out, h, s, sr, f);
}

/* zo256_lion16p_body, 16 lanes: Lion with the fp32 master and a bf16 moment (Adam's is
 * zo512_adam16p_split_body below) */
static inline ZO_T512 __attribute__((always_inline)) void zo512_lion16p_body(
        float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *hp,
        const zo_state16 *s, int sr, int zo_flags_) {
    const zo_hparams hh = *hp, *h = &hh;
    uint16_t *m = s->m;
    const __m512i zero = _mm512_setzero_si512();
    const __m512i step16 = _mm512_set1_epi32((int)(16u * 0x9e3779b9u));
    const __m512 pr = _mm512_set1_ps(h->predict);
    const int predict = h->predict != 0.0f;
    __m512i kw = zo512_weyl16(s->index_base + (uint32_t)lo, s->key);
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 p0 = _mm512_loadu_ps(p + i), q;
        __m512i m32 = _mm512_slli_epi32(zo512_load_u16(m, i), 16);
        __m512i rnd = sr ? zo512_fold(kw) : zero, m0;
        q = zo512_lion16_core(zo512_load_grad(g, gk, i), p0, m32, rnd, &m0, h, sr, zo_flags_);
        zo512_store_u16(m, i, m0);
        _mm512_storeu_ps(p + i, q);
        zo512_store_out(out, ok, i, predict ? _mm512_add_ps(q, _mm512_mul_ps(pr, _mm512_sub_ps(q, p0))) : q);
        kw = _mm512_add_epi32(kw, step16);
    }
    if (i < hi) zo_opt16_scalar(1, p, g, gk, out, ok, i, hi, h, s);
}

/* Adam with the fp32 master and bf16 moments in two loops a window, zo256_adam16p_split_body
 * at 16 lanes: on a Zen 4 core 1.38x faster than the one-loop body at one thread
 * (BENCHMARKS.md) */
static inline ZO_T512 __attribute__((always_inline)) void zo512_adam16p_split_body(
        float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *hp,
        const zo_state16 *s, int sr, int zo_flags_) {
    const zo_hparams hh = *hp, *h = &hh;
    uint16_t *m = s->m, *v = s->v;
    const __m512i zero = _mm512_setzero_si512();
    const __m512i step16 = _mm512_set1_epi32((int)(16u * 0x9e3779b9u));
    const __m512 pr = _mm512_set1_ps(h->predict), dec = _mm512_set1_ps(h->decay), ss = _mm512_set1_ps(h->step_size);
    const int predict = h->predict != 0.0f;
    float mq[ZO16_WINDOW] __attribute__((aligned(64))), dq[ZO16_WINDOW] __attribute__((aligned(64)));
    __m512i kw = zo512_weyl16(s->index_base + (uint32_t)lo, s->key);
    int64_t i = lo;
    while (i + 16 <= hi) {
        int64_t w = (hi - i) & ~(int64_t)15, j;
        if (w > ZO16_WINDOW) w = ZO16_WINDOW;
        for (j = 0; j < w; j += 16) {
            const int64_t e = i + j;
            zo16p_prefetch(p, g, gk, m, v, e, (j & 16) == 0);
            __m512i m32 = _mm512_slli_epi32(zo512_load_u16(m, e), 16);
            __m512i v32 = _mm512_slli_epi32(zo512_load_u16(v, e), 16);
            __m512i rnd = sr ? zo512_fold(kw) : zero, m0, v0;
            __m512 pi = ZO_FLAG(h, ZO_F_L2) ? _mm512_loadu_ps(p + e) : _mm512_setzero_ps();
            zo512_adam16_moments(zo512_load_grad(g, gk, e), pi, m32, v32, rnd, &m0, &v0, mq + j, dq + j, h, sr,
                                 zo_flags_);
            zo512_store_u16(m, e, m0);
            zo512_store_u16(v, e, v0);
            kw = _mm512_add_epi32(kw, step16);
        }
        for (j = 0; j < w; j += 16) {
            const int64_t e = i + j;
            __m512 p0 = _mm512_loadu_ps(p + e), q = p0;
            if (ZO_FLAG(h, ZO_F_DECAY)) q = _mm512_mul_ps(q, dec);
            q = _mm512_sub_ps(q, _mm512_mul_ps(ss, _mm512_div_ps(_mm512_load_ps(mq + j), _mm512_load_ps(dq + j))));
            _mm512_storeu_ps(p + e, q);
            zo512_store_out(out, ok, e, predict ? _mm512_add_ps(q, _mm512_mul_ps(pr, _mm512_sub_ps(q, p0))) : q);
        }
        i += w;
    }
    if (i < hi) zo_opt16_scalar(0, p, g, gk, out, ok, i, hi, h, s);
}

static ZO_T512 void zo512_adam16p(int lion, float *p, const void *g, int gk, void *out, int ok, int64_t lo,
                                  int64_t hi, const zo_hparams *h, const zo_state16 *s) {
    int sr = s->rounding == ZO_ROUND_STOCHASTIC, f = zo_flags_of(h);
    if (lion) {
        zo512_lion16p_body(p, g, gk, out, ok, lo, hi, h, s, sr, f);
    } else if (gk == ZO_BF16 && ok == ZO_BF16 && sr) {
        zo512_adam16p_split_body(p, g, ZO_BF16, out, ZO_BF16, lo, hi, h, s, 1, f);
    } else if (gk == ZO_F16 && ok == ZO_F16 && sr) {
        zo512_adam16p_split_body(p, g, ZO_F16, out, ZO_F16, lo, hi, h, s, 1, f);
    } else {
        zo512_adam16p_split_body(p, g, gk, out, ok, lo, hi, h, s, sr, f);
    }
}

/* Specialise each body on the (grad kind, out kind) pair: with both constant the
 * per-vector dtype branches fold away. */
#define ZO_SPECIALISE(FN, BODY, ATTR, PARAMS, ARGS)                                  \
    static ATTR void FN PARAMS {                                                     \
        if (gk == ZO_F16 && ok == ZO_F16) BODY(ARGS_F16_F16);                        \
        else if (gk == ZO_BF16 && ok == ZO_BF16) BODY(ARGS_BF16_BF16);               \
        else BODY ARGS;                                                              \
    }

#define ADAM_PARAMS (float *p, float *m, float *v, const void *g, int gk, void *out, int ok, \
                     int64_t lo, int64_t hi, const zo_hparams *h)
#define ADAGRAD_PARAMS (float *p, float *m, const void *g, int gk, void *out, int ok, \
                        int64_t lo, int64_t hi, const zo_hparams *h)

#define ARGS_F16_F16 p, m, v, g, ZO_F16, out, ZO_F16, lo, hi, h
#define ARGS_BF16_BF16 p, m, v, g, ZO_BF16, out, ZO_BF16, lo, hi, h
ZO_SPECIALISE(zo512_adam, zo512_adam_body, ZO_T512, ADAM_PARAMS, (p, m, v, g, gk, out, ok, lo, hi, h))
/* The AVX2 Adam body is also specialised on its optional operations (zo_flags_of;
 * weight decay of 1.0 is a multiply by one, skipped too): on one AVX2 core the
 * loop is at the edge of compute, and each multiply it drops is ~3% of it. */
#define ZO256_ADAM_FLAGS(GK, OK)                                                            \
    switch (f) {                                                                            \
    case 0: zo256_adam_body(p, m, v, g, GK, out, OK, lo, hi, h, 0); break;                  \
    case 1: zo256_adam_body(p, m, v, g, GK, out, OK, lo, hi, h, 1); break;                  \
    case 2: zo256_adam_body(p, m, v, g, GK, out, OK, lo, hi, h, 2); break;                  \
    case 3: zo256_adam_body(p, m, v, g, GK, out, OK, lo, hi, h, 3); break;                  \
    case 4: zo256_adam_body(p, m, v, g, GK, out, OK, lo, hi, h, 4); break;                  \
    case 5: zo256_adam_body(p, m, v, g, GK, out, OK, lo, hi, h, 5); break;                  \
    case 6: zo256_adam_body(p, m, v, g, GK, out, OK, lo, hi, h, 6); break;                  \
    default: zo256_adam_body(p, m, v, g, GK, out, OK, lo, hi, h, 7); break;                 \
    }
static ZO_T256 void zo256_adam ADAM_PARAMS {
    int f = zo_flags_of(h);
    if ((f & ZO_F_DECAY) && h->decay == 1.0f) f &= ~ZO_F_DECAY;
    if (gk == ZO_F16 && ok == ZO_F16) { ZO256_ADAM_FLAGS(ZO_F16, ZO_F16) }
    else if (gk == ZO_BF16 && ok == ZO_BF16) { ZO256_ADAM_FLAGS(ZO_BF16, ZO_BF16) }
    else { ZO256_ADAM_FLAGS(gk, ok) }
}
#undef ZO256_ADAM_FLAGS
#undef ARGS_F16_F16
#undef ARGS_BF16_BF16
#define ARGS_F16_F16 p, m, g, ZO_F16, out, ZO_F16, lo, hi, h
#define ARGS_BF16_BF16 p, m, g, ZO_BF16, out, ZO_BF16, lo, hi, h
ZO_SPECIALISE(zo512_adagrad, zo512_adagrad_body, ZO_T512, ADAGRAD_PARAMS, (p, m, g, gk, out, ok, lo, hi, h))
ZO_SPECIALISE(zo256_adagrad, zo256_adagrad_body, ZO_T256, ADAGRAD_PARAMS, (p, m, g, gk, out, ok, lo, hi, h))
ZO_SPECIALISE(zo512_lion, zo512_lion_body, ZO_T512, ADAGRAD_PARAMS, (p, m, g, gk, out, ok, lo, hi, h))
ZO_SPECIALISE(zo256_lion, zo256_lion_body, ZO_T256, ADAGRAD_PARAMS, (p, m, g, gk, out, ok, lo, hi, h))
#undef ARGS_F16_F16
#undef ARGS_BF16_BF16


#define ADAM16_PARAMS (float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi, \
                       const zo_hparams *h, const zo_state16 *s)
#define ARGS_F16_F16 p, g, ZO_F16, out, ZO_F16, lo, hi, h, s
#define ARGS_BF16_BF16 p, g, ZO_BF16, out, ZO_BF16, lo, hi, h, s
ZO_SPECIALISE(zo256_adam16, zo256_adam16_body, ZO_T256, ADAM16_PARAMS, (p, g, gk, out, ok, lo, hi, h, s))
#undef ARGS_F16_F16
#undef ARGS_BF16_BF16

static int zo_cpu_best_level(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return ZO_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return ZO_AVX2;
    return ZO_SCALAR;
}
#else
#define ZO_HAVE_X86 0
static int zo_cpu_best_level(void) { return ZO_SCALAR; }
#endif

/* ---------------------------------------------------------------- bandwidth probe */
/* The Adam access pattern with trivial arithmetic: read 2 B, read+write 3 x 4 B,
 * write 2 B per element.  Its speed is the bound the real kernel is held to. */
static void zo_stream_scalar(float *p, float *m, float *v, const uint16_t *g, uint16_t *out,
                             int64_t lo, int64_t hi) {
    int64_t i;
    for (i = lo; i < hi; i++) {
        float gi = zo_f16_to_f32(g[i]);
        p[i] += gi; m[i] += gi; v[i] += gi * gi;
        out[i] = zo_f32_to_f16(p[i]);
    }
}
#if ZO_HAVE_X86
/* In the kernels' windows (zo256_adam_body): the moments' streams (g, m, v) in one
 * loop, the weights' (p, out) in a second.  On a Zen 4 core the loop that touched all
 * five streams each turn ran at 0.6-0.9x the kernel's own speed from DRAM, so it was
 * no bound (BENCHMARKS.md). */
static ZO_T512 void zo512_stream(float *p, float *m, float *v, const uint16_t *g, uint16_t *out,
                                 int64_t lo, int64_t hi) {
    int64_t i = lo, j;
    while (i + 16 <= hi) {
        int64_t w = (hi - i) & ~(int64_t)15;
        if (w > ZO_ADAM_WINDOW) w = ZO_ADAM_WINDOW;
        for (j = i; j < i + w; j += 16) {
            zo_adam_prefetch(p, m, v, g, ZO_F16, j, lo);  /* as the kernel does */
            __m512 gi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + j)));
            __m512 mi = _mm512_add_ps(_mm512_loadu_ps(m + j), gi);
            __m512 vi = _mm512_add_ps(_mm512_loadu_ps(v + j), _mm512_mul_ps(gi, gi));
            _mm512_storeu_ps(m + j, mi);
            _mm512_storeu_ps(v + j, vi);
        }
        for (j = i; j < i + w; j += 16) {
            __m512 pi = _mm512_add_ps(_mm512_loadu_ps(p + j),
                                      _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + j))));
            _mm512_storeu_ps(p + j, pi);
            _mm256_storeu_si256((__m256i *)(out + j), _mm512_cvtps_ph(pi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        i += w;
    }
    if (i < hi) zo_stream_scalar(p, m, v, g, out, i, hi);
}
static ZO_T256 void zo256_stream(float *p, float *m, float *v, const uint16_t *g, uint16_t *out,
                                 int64_t lo, int64_t hi) {
    int64_t i = lo, j;
    while (i + 16 <= hi) {  /* as zo512_stream */
        int64_t w = (hi - i) & ~(int64_t)15;
        if (w > ZO_ADAM_WINDOW) w = ZO_ADAM_WINDOW;
        for (j = i; j < i + w; j += 8) {
            if (((j - i) & 8) == 0) zo_adam_prefetch(p, m, v, g, ZO_F16, j, lo);
            __m256 gi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + j)));
            __m256 mi = _mm256_add_ps(_mm256_loadu_ps(m + j), gi);
            __m256 vi = _mm256_add_ps(_mm256_loadu_ps(v + j), _mm256_mul_ps(gi, gi));
            _mm256_storeu_ps(m + j, mi);
            _mm256_storeu_ps(v + j, vi);
        }
        for (j = i; j < i + w; j += 8) {
            __m256 pi = _mm256_add_ps(_mm256_loadu_ps(p + j), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + j))));
            _mm256_storeu_ps(p + j, pi);
            _mm_storeu_si128((__m128i *)(out + j), _mm256_cvtps_ph(pi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        i += w;
    }
    if (i < hi) zo_stream_scalar(p, m, v, g, out, i, hi);
}
#endif
static void zo_stream_chunk(int level, float *p, float *m, float *v, const uint16_t *g, uint16_t *out,
                            int64_t lo, int64_t hi) {
#if ZO_HAVE_X86
    if (level == ZO_AVX512) { zo512_stream(p, m, v, g, out, lo, hi); return; }
    if (level == ZO_AVX2) { zo256_stream(p, m, v, g, out, lo, hi); return; }
#endif
    zo_stream_scalar(p, m, v, g, out, lo, hi);
}

/* The compact-state access pattern with trivial (integer) arithmetic: read g 2 B,
 * m and v 2 + 2 B read and written, and either the exact master (read hi 2,
 * read+write rem 2, write out 2: 18 B/element) or the fp32 master (read+write 4,
 * write out 2: 20 B/element). */
static void zo_stream16_scalar(uint32_t *p, uint16_t *rem, const uint16_t *hi16, uint16_t *m, uint16_t *v,
                               const uint16_t *g, uint16_t *out, int64_t lo, int64_t hi) {
    int64_t i;
    if (rem) {
        for (i = lo; i < hi; i++) {
            uint16_t gi = g[i];
            rem[i] = (uint16_t)(rem[i] + gi); m[i] = (uint16_t)(m[i] + gi);
            v[i] = (uint16_t)(v[i] + gi); out[i] = (uint16_t)(hi16[i] + gi);
        }
    } else {
        for (i = lo; i < hi; i++) {
            uint16_t gi = g[i];
            uint32_t pi = p[i] + gi;
            p[i] = pi; m[i] = (uint16_t)(m[i] + gi);
            v[i] = (uint16_t)(v[i] + gi); out[i] = (uint16_t)(pi >> 16);
        }
    }
}
#if ZO_HAVE_X86
/* In the kernels' windows, as zo512_stream: g, m and v in one loop, the master and
 * out in a second.  out may be hi16 itself (one weights slot), which stops the
 * compiler from vectorising the exact pattern: those loops are written out. */
static ZO_T256 void zo256_stream16(uint32_t *p, uint16_t *rem, const uint16_t *hi16, uint16_t *m, uint16_t *v,
                                   const uint16_t *g, uint16_t *out, int64_t lo, int64_t hi) {
    int64_t i = lo, j;
    while (i + 16 <= hi) {
        int64_t w = (hi - i) & ~(int64_t)15;
        if (w > ZO16_WINDOW) w = ZO16_WINDOW;
        for (j = i; j < i + w; j += 16) {
            __m256i gi = _mm256_loadu_si256((const __m256i *)(g + j));
            __m256i mi = _mm256_add_epi16(_mm256_loadu_si256((const __m256i *)(m + j)), gi);
            __m256i vi = _mm256_add_epi16(_mm256_loadu_si256((const __m256i *)(v + j)), gi);
            if (!rem) zo16p_prefetch((const float *)p, g, ZO_BF16, m, v, j, ((j - i) & 16) == 0);  /* the kernels' */
            else if (((j - i) & 16) == 0) zo16_prefetch(g, m, v, rem, hi16, j);
            _mm256_storeu_si256((__m256i *)(m + j), mi);
            _mm256_storeu_si256((__m256i *)(v + j), vi);
        }
        if (rem) {
            for (j = i; j < i + w; j += 16) {
                __m256i gi = _mm256_loadu_si256((const __m256i *)(g + j));
                __m256i ri = _mm256_add_epi16(_mm256_loadu_si256((const __m256i *)(rem + j)), gi);
                __m256i oi = _mm256_add_epi16(_mm256_loadu_si256((const __m256i *)(hi16 + j)), gi);
                _mm256_storeu_si256((__m256i *)(rem + j), ri);
                _mm256_storeu_si256((__m256i *)(out + j), oi);
            }
        } else {
            for (j = i; j < i + w; j += 8) {
                __m256i pi = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(p + j)),
                                              _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + j))));
                _mm256_storeu_si256((__m256i *)(p + j), pi);
                zo256_store_u16(out, j, _mm256_srli_epi32(pi, 16));
            }
        }
        i += w;
    }
    if (i < hi) zo_stream16_scalar(p, rem, hi16, m, v, g, out, i, hi);
}
#endif
static void zo_stream16_chunk(int level, uint32_t *p, uint16_t *rem, const uint16_t *hi16, uint16_t *m,
                              uint16_t *v, const uint16_t *g, uint16_t *out, int64_t lo, int64_t hi) {
#if ZO_HAVE_X86
    if (level >= ZO_AVX2) { zo256_stream16(p, rem, hi16, m, v, g, out, lo, hi); return; }  /* as zo_adam16_chunk */
#endif
    zo_stream16_scalar(p, rem, hi16, m, v, g, out, lo, hi);
}

/* ---------------------------------------------------------------- sum of squares */
/* For the global gradient norm on the CPU path: one read of the 16-bit shard.
 * fp32 partial sums per chunk (at most 64K elements, so the relative error stays
 * ~1e-5, far below what clipping cares about); the caller adds the chunks in
 * order in double, so the result does not depend on the thread count.  inf/NaN
 * propagate, which is how overflow is detected. */
static double zo_sumsq_scalar(const void *g, int gk, int64_t lo, int64_t hi) {
    float acc = 0.0f;
    int64_t i;
    for (i = lo; i < hi; i++) {
        float x = zo_load_grad(g, gk, i);
        acc += x * x;
    }
    return (double)acc;
}
#if ZO_HAVE_X86
static ZO_T512 double zo512_sumsq(const void *g, int gk, int64_t lo, int64_t hi) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {
        __m512 x0 = zo512_load_grad(g, gk, i), x1 = zo512_load_grad(g, gk, i + 16);
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(x0, x0));
        a1 = _mm512_add_ps(a1, _mm512_mul_ps(x1, x1));
    }
    return (double)_mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + zo_sumsq_scalar(g, gk, i, hi);
}
static ZO_T256 double zo256_sumsq(const void *g, int gk, int64_t lo, int64_t hi) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    float tmp[8];
    double s = 0.0;
    int64_t i = lo;
    int k;
    for (; i + 16 <= hi; i += 16) {
        __m256 x0 = zo256_load_grad(g, gk, i), x1 = zo256_load_grad(g, gk, i + 8);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(x0, x0));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(x1, x1));
    }
    _mm256_storeu_ps(tmp, _mm256_add_ps(a0, a1));
    for (k = 0; k < 8; k++) s += tmp[k];
    return s + zo_sumsq_scalar(g, gk, i, hi);
}
#endif
static double zo_sumsq_chunk(int level, const void *g, int gk, int64_t lo, int64_t hi) {
#if ZO_HAVE_X86
    if (level == ZO_AVX512) return zo512_sumsq(g, gk, lo, hi);
    if (level == ZO_AVX2) return zo256_sumsq(g, gk, lo, hi);
#endif
    return zo_sumsq_scalar(g, gk, lo, hi);
}

/* ---------------------------------------------------------------- dispatch on one chunk */

static void zo_adam_chunk(int level, float *p, float *m, float *v, const void *g, int gk,
                          void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *h) {
#if ZO_HAVE_X86
    if (level == ZO_AVX512) { zo512_adam(p, m, v, g, gk, out, ok, lo, hi, h); return; }
    if (level == ZO_AVX2) { zo256_adam(p, m, v, g, gk, out, ok, lo, hi, h); return; }
#endif
    zo_adam_scalar(p, m, v, g, gk, out, ok, lo, hi, h);
}

static void zo_adagrad_chunk(int level, float *p, float *s, const void *g, int gk,
                             void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *h) {
#if ZO_HAVE_X86
    if (level == ZO_AVX512) { zo512_adagrad(p, s, g, gk, out, ok, lo, hi, h); return; }
    if (level == ZO_AVX2) { zo256_adagrad(p, s, g, gk, out, ok, lo, hi, h); return; }
#endif
    zo_adagrad_scalar(p, s, g, gk, out, ok, lo, hi, h);
}

static void zo_lion_chunk(int level, float *p, float *m, const void *g, int gk,
                          void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *h) {
#if ZO_HAVE_X86
    if (level == ZO_AVX512) { zo512_lion(p, m, g, gk, out, ok, lo, hi, h); return; }
    if (level == ZO_AVX2) { zo256_lion(p, m, g, gk, out, ok, lo, hi, h); return; }
#endif
    zo_lion_scalar(p, m, g, gk, out, ok, lo, hi, h);
}

static void zo_opt16_chunk(int lion, int level, float *p, const void *g, int gk, void *out, int ok,
                           int64_t lo, int64_t hi, const zo_hparams *h, const zo_state16 *s) {
#if ZO_HAVE_X86
    if (level >= ZO_AVX512 && s->rem && gk == ZO_BF16) { zo512_adam16x(lion, g, lo, hi, out, h, s); return; }
    if (level >= ZO_AVX512 && !s->rem && gk != ZO_F32) { zo512_adam16p(lion, p, g, gk, out, ok, lo, hi, h, s); return; }
    /* the rest (fp32 gradients, or the exact master with fp16 ones: no engine sends
     * those) runs the AVX2 body at AVX-512 too */
    if (level >= ZO_AVX2 && s->rem && gk == ZO_BF16) { zo256_adam16x(lion, g, lo, hi, out, h, s); return; }
    if (level >= ZO_AVX2 && !s->rem && gk != ZO_F32) { zo256_adam16p(lion, p, g, gk, out, ok, lo, hi, h, s); return; }
    if (level >= ZO_AVX2 && !lion) { zo256_adam16(p, g, gk, out, ok, lo, hi, h, s); return; }
#endif
    zo_opt16_scalar(lion, p, g, gk, out, ok, lo, hi, h, s);
}

static void zo_adam16_chunk(int level, float *p, const void *g, int gk, void *out, int ok,
                            int64_t lo, int64_t hi, const zo_hparams *h, const zo_state16 *s) {
    zo_opt16_chunk(0, level, p, g, gk, out, ok, lo, hi, h, s);
}

static void zo_lion16_chunk(int level, float *p, const void *g, int gk, void *out, int ok,
                            int64_t lo, int64_t hi, const zo_hparams *h, const zo_state16 *s) {
    zo_opt16_chunk(1, level, p, g, gk, out, ok, lo, hi, h, s);
}

#endif /* ZO_KERNELS_H */
