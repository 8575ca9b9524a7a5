# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Fused one-pass CPU optimizers for ZeRO-Offload: Adam/AdamW, Adagrad, Lion.

``adam_step_bf16`` is Adam/AdamW with bf16 moments (stochastic rounding keyed by
``rounding_key(step)`` and the element's model-wide index) and, given the
remainder words and ``master_hi``, the exact master; ``split_master`` and
``join_master`` convert between it and fp32; ``stream_probe_bf16`` is its bound.

Each ``*_step`` reads the gradient (fp16, bf16 or fp32), updates the fp32 state in
place and, when ``param_out`` is given, writes the round-to-nearest-even 16-bit
copy of the new weights in the same pass.  The thin ``def`` wrappers validate
everything first (dtype, contiguity, lengths, hyper-parameters) and only then
release the GIL and run the C loop from ``_kernels.h``, so a bad argument never
leaves a partial update behind.

bfloat16: NumPy has no bf16 dtype.  Pass the raw 16-bit words as a uint16 or
int16 array (``torch_bf16_tensor.view(torch.int16).numpy()``) together with
``grad_dtype="bf16"`` / ``out_dtype="bf16"``.  float16 arrays need no keyword;
raw words holding fp16 take ``"fp16"`` (so one shared uint16 buffer serves both).

Progress: given ``progress`` (a 1-element uint64 array, usually in shared
memory), the update runs in blocks of ``progress_block`` elements in order, and
after each block stores ``(progress_tag << PROGRESS_SHIFT) | elements_done``
with release semantics.  A reader that sees the word through
``load_progress`` (acquire) may use every weight below ``elements_done``
while the rest of the update runs: the worker copies finished weights to the
device this way.  ``progress_tag`` is taken modulo 2**24.

The SIMD path is chosen once at import from what the CPU supports; the
environment variable ``ZERO_OFFLOAD_SIMD=scalar|avx2|avx512`` or
``set_simd_level()`` forces a lower one (tests compare them).
"""
import math
import os

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy
from libc.stdlib cimport malloc, free
from cython.parallel cimport prange

cdef extern from "_kernels.h" nogil:
    ctypedef struct zo_hparams:
        float grad_scale
        float beta1
        float one_minus_beta1
        float beta2
        float one_minus_beta2
        float eps
        float step_size
        float inv_sqrt_bc2
        float decay
        float l2
        int decoupled
        float predict
        const float *src_p
        const float *src_m
        const float *src_v
    cdef enum zo_kind:
        ZO_F32, ZO_F16, ZO_BF16, ZO_NONE
    cdef enum zo_level:
        ZO_SCALAR, ZO_AVX2, ZO_AVX512
    int zo_openmp_enabled()
    int zo_max_threads()
    int zo_cpu_best_level()
    void zo_adam_chunk(int level, float *p, float *m, float *v, const void *g, int gk,
                       void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *h)
    void zo_adagrad_chunk(int level, float *p, float *s, const void *g, int gk,
                          void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *h)
    void zo_lion_chunk(int level, float *p, float *m, const void *g, int gk,
                       void *out, int ok, int64_t lo, int64_t hi, const zo_hparams *h)
    double zo_sumsq_chunk(int level, const void *g, int gk, int64_t lo, int64_t hi)
    void zo_cast_chunk(const float *src, unsigned short *dst, int ok, int64_t lo, int64_t hi)
    void zo_stream_chunk(int level, float *p, float *m, float *v, const unsigned short *g,
                         unsigned short *out, int64_t lo, int64_t hi)
    cdef enum zo_rounding:
        ZO_ROUND_NEAREST, ZO_ROUND_STOCHASTIC
    ctypedef struct zo_state16:
        unsigned short *m
        unsigned short *v
        unsigned short *rem
        const unsigned short *hi
        unsigned int key
        unsigned int index_base
        int rounding
        const unsigned short *src_m
        const unsigned short *src_v
        const unsigned short *src_rem
    void zo_adam16_chunk(int level, float *p, const void *g, int gk, void *out, int ok,
                         int64_t lo, int64_t hi, const zo_hparams *h, const zo_state16 *s)
    void zo_lion16_chunk(int level, float *p, const void *g, int gk, void *out, int ok,
                         int64_t lo, int64_t hi, const zo_hparams *h, const zo_state16 *s)
    void zo_split_chunk(const float *src, unsigned short *hi16, unsigned short *rem, int64_t lo, int64_t hi)
    void zo_join_chunk(const unsigned short *hi16, const unsigned short *rem, float *dst, int64_t lo, int64_t hi)
    void zo_stream16_chunk(int level, unsigned int *p, unsigned short *rem, const unsigned short *hi16,
                           unsigned short *m, unsigned short *v, const unsigned short *g, unsigned short *out,
                           int64_t lo, int64_t hi)
    unsigned int zo_mix32(unsigned int x)
    int ZO_PROGRESS_SHIFT
    void zo_progress_store(uint64_t *w, uint64_t v)
    uint64_t zo_progress_load(const uint64_t *w)

cdef extern from "_kernels_int8.h" nogil:
    int ZO_QBLOCK
    ctypedef struct zo_state8:
        unsigned char *m
        unsigned char *v
        float *ms
        float *vs
        unsigned short *rem
        const unsigned short *hi
        unsigned int key
        unsigned int index_base
        int rounding
        int lion
    ctypedef struct zo_seg8:
        int64_t lo
        int64_t hi
        zo_hparams h
        int keep
    void zo_opt8_chunk(int level, float *p, const void *g, int gk, void *out, int ok, int64_t lo, int64_t hi,
                       const zo_seg8 *segs, int nseg, const zo_state8 *s)
    void zo8_quantize_chunk(const float *src, unsigned char *codes, float *scales, int which, int64_t lo, int64_t hi)
    void zo8_dequantize_chunk(const unsigned char *codes, const float *scales, float *dst, int which,
                              int64_t lo, int64_t hi)
    void zo8_stream_chunk(int level, unsigned int *p, unsigned short *rem, const unsigned short *hi16,
                          unsigned char *m, unsigned char *v, const unsigned short *g, unsigned short *out,
                          int64_t lo, int64_t hi)

# Which loop _run_range runs.
cdef enum Kernel:
    K_ADAM
    K_ADAGRAD
    K_LION
    K_PROBE   # the bandwidth probe (stream_probe)
    K_CAST    # fp32 -> 16 bits, p -> o (cast_to_16)
    K_ADAM16  # Adam with bf16 moments, fp32 or exact (hi + remainder) master (adam_step_bf16)
    K_LION16  # Lion with a bf16 moment (lion_step_bf16)
    K_PROBE16 # the compact-state bandwidth probe (stream_probe_bf16)
    K_SPLIT   # fp32 master -> (hi, rem) (split_master)
    K_JOIN    # (hi, rem) -> fp32 master (join_master)

cdef enum:
    # Elements per work item of the chunked sums (grad_sumsq): fixed, so their
    # order of addition, and the sum, do not depend on the thread count.  (The
    # updates split a range into one part per thread instead: _thread_part.)
    CHUNK = 65536
    # Below this a second thread costs more to wake than it saves.
    MIN_PARALLEL = 262144

PROGRESS_SHIFT = int(ZO_PROGRESS_SHIFT)
QBLOCK = int(ZO_QBLOCK)  # elements per int8 block (one scale per moment each)
PROGRESS_TAG_MASK = (1 << (64 - PROGRESS_SHIFT)) - 1   # Python ints: no C overflow
PROGRESS_DONE_MASK = (1 << PROGRESS_SHIFT) - 1

_LEVEL_NAMES = {ZO_SCALAR: "scalar", ZO_AVX2: "avx2", ZO_AVX512: "avx512"}
_LEVEL_CODES = {v: k for k, v in _LEVEL_NAMES.items()}
cdef int _best_level = zo_cpu_best_level()
cdef int _level = _best_level


def openmp_enabled():
    """True when the extension was compiled with OpenMP (threads > 1 possible)."""
    return bool(zo_openmp_enabled())


def simd_level():
    """The SIMD path that runs: "avx512", "avx2" or "scalar"."""
    return _LEVEL_NAMES[_level]


def best_simd_level():
    """The best SIMD path this CPU supports."""
    return _LEVEL_NAMES[_best_level]


def set_simd_level(level):
    """Force a SIMD path ("scalar", "avx2", "avx512", or None for the best one).

    Raises ValueError for an unknown name or a path this CPU cannot run.
    Returns the previous level's name so tests can restore it.
    """
    global _level
    prev = _LEVEL_NAMES[_level]
    if level is None:
        _level = _best_level
        return prev
    if level not in _LEVEL_CODES:
        raise ValueError(f"simd level must be one of {sorted(_LEVEL_CODES)} or None, got {level!r}")
    code = _LEVEL_CODES[level]
    if code > _best_level:
        raise ValueError(f"simd level {level!r} is not supported by this CPU (best: {_LEVEL_NAMES[_best_level]!r})")
    _level = code
    return prev


_env_level = os.environ.get("ZERO_OFFLOAD_SIMD")
if _env_level:
    set_simd_level(_env_level)


cdef class _Buf:
    """A C-contiguous writable-or-not buffer held for the duration of one call."""
    cdef Py_buffer view
    cdef bint held
    cdef public str fmt
    cdef public Py_ssize_t n
    cdef public Py_ssize_t itemsize

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)
            self.held = False


cdef _Buf _get(obj, str name, bint writable):
    cdef _Buf b = _Buf()
    cdef int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
    if writable:
        flags |= PyBUF_WRITABLE
    if obj is None:
        raise TypeError(f"{name} must be a 1-D array, got None")
    try:
        PyObject_GetBuffer(obj, &b.view, flags)
    except (BufferError, ValueError) as e:
        need = "C-contiguous, writable" if writable else "C-contiguous"
        raise ValueError(f"{name} must be a {need} 1-D buffer ({e}); pass np.ascontiguousarray(...)") from None
    except TypeError:
        raise TypeError(f"{name} must support the buffer protocol (a NumPy array, or tensor.numpy()), "
                        f"got {type(obj).__name__}") from None
    b.held = True
    if b.view.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {b.view.ndim}-D; pass .reshape(-1)")
    fmt = (<bytes>b.view.format).decode("ascii") if b.view.format != NULL else "B"
    b.fmt = fmt.lstrip("@=<")
    b.itemsize = b.view.itemsize
    b.n = b.view.shape[0]
    return b


cdef int _kind_of(_Buf b, str name, dtype_kw, str kw_name, bint allow_f32) except -1:
    """Map a buffer's format (plus its dtype keyword, called kw_name) to a zo_kind."""
    if dtype_kw is not None and dtype_kw not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"{kw_name} must be 'fp16', 'bf16' or 'fp32', got {dtype_kw!r}")
    if b.fmt == "e":
        if dtype_kw not in (None, "fp16"):
            raise TypeError(f"{name} is float16 but {kw_name} says {dtype_kw!r}")
        return ZO_F16
    if b.fmt in ("H", "h"):
        # raw 16-bit words (e.g. a shared buffer): the keyword says how to read them
        if dtype_kw not in ("fp16", "bf16"):
            raise TypeError(f"{name} is a 16-bit integer array; say what its words hold with "
                            f"{kw_name}='bf16' (or 'fp16')")
        return ZO_BF16 if dtype_kw == "bf16" else ZO_F16
    if b.fmt == "f" and allow_f32:
        if dtype_kw not in (None, "fp32"):
            raise TypeError(f"{name} is float32 but {kw_name} says {dtype_kw!r}")
        return ZO_F32
    allowed = ("float16, float32, or uint16 words with a dtype keyword" if allow_f32
               else "float16, or uint16 words with a dtype keyword")
    raise TypeError(f"{name} must be {allowed}; got buffer format {b.fmt!r}")


cdef _check_f32(_Buf b, str name):
    if b.fmt != "f":
        raise TypeError(f"{name} must be float32, got buffer format {b.fmt!r}")


cdef _check_len(_Buf b, str name, Py_ssize_t n, str ref="param"):
    if b.n != n:
        raise ValueError(f"{name} has {b.n} elements but {ref} has {n}; all buffers must have the same length")


cdef double _finite(x, str name) except? -1.0:
    cdef double d
    try:
        d = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}") from None
    if not math.isfinite(d):
        raise ValueError(f"{name} must be finite, got {d}")
    return d


cdef double _beta(x, str name) except? -1.0:
    cdef double d = _finite(x, name)
    if not (0.0 <= d < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {d}")
    return d


cdef int _threads(num_threads) except -1:
    if not isinstance(num_threads, int) or num_threads < 0:
        raise ValueError(f"num_threads must be an int >= 0 (0 = OpenMP default), got {num_threads!r}")
    if num_threads == 0:
        return zo_max_threads()
    return num_threads


cdef class _Call:
    """One optimizer call's validated buffers: what every *_step checks first."""
    cdef _Buf p, s1, s2, g, o, bh
    cdef int gk, ok, nt
    cdef Py_ssize_t n
    cdef _Progress pg


cdef _Call _prepare(param, states, grad, param_out, grad_dtype, out_dtype, num_threads,
                    progress, progress_tag, progress_block, progress_base=0):
    """The shared preamble of adam_step, adagrad_step and lion_step: param and each
    (array, name) of states are float32, writable, C-contiguous and of one length;
    grad and param_out (optional) of that length and of a 16-bit or fp32 kind."""
    cdef _Call c = _Call()
    c.p = _get(param, "param", True)
    _check_f32(c.p, "param")
    c.n = c.p.n
    bufs = []
    for arr, name in states:
        b = _get(arr, name, True)
        _check_f32(b, name)
        _check_len(b, name, c.n)
        bufs.append(b)
    c.s1 = bufs[0]
    c.s2 = bufs[1] if len(bufs) > 1 else None
    c.g = _get(grad, "grad", False)
    _check_len(c.g, "grad", c.n)
    c.gk = _kind_of(c.g, "grad", grad_dtype, "grad_dtype", True)
    c.o = _get(param_out, "param_out", True) if param_out is not None else None
    c.ok = ZO_NONE
    if c.o is not None:
        c.ok = _kind_of(c.o, "param_out", out_dtype, "out_dtype", False)
        _check_len(c.o, "param_out", c.n)
    c.nt = _threads(num_threads)
    c.pg = _progress(progress, progress_tag, progress_block, c.n, progress_base)
    return c


cdef _check_lr_wd_scale(double lr, double wd):
    if lr < 0.0 or wd < 0.0:
        raise ValueError(f"lr and weight_decay must be >= 0, got lr={lr}, weight_decay={wd}")


cdef int _adam_hparams(zo_hparams *h, step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale,
                       predict) except -1:
    """Validate Adam's hyper-parameters and fold them into the constants the loop needs."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step must be an int >= 1 (1-based, for bias correction), got {step!r}")
    cdef double dlr = _finite(lr, "lr")
    cdef double b1 = _beta(beta1, "beta1")
    cdef double b2 = _beta(beta2, "beta2")
    cdef double deps = _finite(eps, "eps")
    cdef double wd = _finite(weight_decay, "weight_decay")
    cdef double gs = _finite(grad_scale, "grad_scale")
    cdef double pred = _finite(predict, "predict")
    if deps <= 0.0:
        raise ValueError(f"eps must be > 0, got {deps}")
    _check_lr_wd_scale(dlr, wd)
    if pred < 0.0:
        raise ValueError(f"predict must be >= 0, got {pred}")
    h.predict = <float>pred
    # Bias corrections and 1-beta in double, rounded once (torch's formula; DeepSpeed rounds 1-beta to fp32 first).
    h.grad_scale = <float>gs
    h.beta1 = <float>b1
    h.one_minus_beta1 = <float>(1.0 - b1)
    h.beta2 = <float>b2
    h.one_minus_beta2 = <float>(1.0 - b2)
    h.eps = <float>deps
    h.step_size = <float>(dlr / (1.0 - b1 ** step))
    h.inv_sqrt_bc2 = <float>(1.0 / math.sqrt(1.0 - b2 ** step))
    h.decoupled = 1 if adamw else 0
    h.decay = <float>(1.0 - dlr * wd) if adamw else 1.0
    h.l2 = 0.0 if adamw else <float>wd
    h.src_p = NULL  # in place unless adam_step's read_from says otherwise
    h.src_m = NULL
    h.src_v = NULL
    return 0


def adam_step(param, exp_avg, exp_avg_sq, grad, param_out=None, *,
              step, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
              adamw=True, grad_scale=1.0, num_threads=0, grad_dtype=None, out_dtype=None, predict=0.0,
              progress=None, progress_tag=0, progress_block=0, progress_base=0, read_from=None):
    """One Adam (adamw=False, L2 decay) or AdamW (decoupled decay) step, in place.

    param, exp_avg, exp_avg_sq: 1-D C-contiguous float32, updated in place.
    grad: float16, float32, or uint16/int16 words with grad_dtype="bf16";
    multiplied by grad_scale (1/loss_scale times the clip coefficient) first.
    param_out: optional float16 (or bf16 words with out_dtype="bf16") that gets
    the round-to-nearest-even copy of the new weights.  step is 1-based.
    Non-finite gradients are not masked: the caller decides to skip the step.
    predict: param_out gets p_new + predict * (p_new - p_old) instead of p_new (weight
    prediction for delayed updates; the fp32 param itself is the exact update).
    progress, progress_tag, progress_block: publish progress per block (module docstring);
    progress_base: these arrays start at that element of the shard the word counts (an update
    run range by range, one call per param group, publishes shard-wide progress).
    read_from: None (in place), or (param_src, exp_avg_src, exp_avg_sq_src): the old state
    is read from these (float32, of the same length, not overlapping the destinations) and
    the new state written to param, exp_avg, exp_avg_sq; the sources are not modified.
    The same arithmetic either way, so the same bits.
    """
    cdef _Call c = _prepare(param, ((exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")), grad, param_out,
                            grad_dtype, out_dtype, num_threads, progress, progress_tag, progress_block,
                            progress_base)
    cdef zo_hparams h
    cdef _Buf sp, sm, sv
    _adam_hparams(&h, step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale, predict)
    if read_from is not None:
        if not isinstance(read_from, (tuple, list)) or len(read_from) != 3:
            raise TypeError("read_from must be None or (param_src, exp_avg_src, exp_avg_sq_src)")
        sp = _source(read_from[0], "param_src", c.p, c.n)
        sm = _source(read_from[1], "exp_avg_src", c.s1, c.n)
        sv = _source(read_from[2], "exp_avg_sq_src", c.s2, c.n)
        h.src_p = <const float *>sp.view.buf
        h.src_m = <const float *>sm.view.buf
        h.src_v = <const float *>sv.view.buf
    _run(K_ADAM, &h, c)


cdef _Buf _source(obj, str name, _Buf dst, Py_ssize_t n, bint words=False):
    """An out-of-place update's source (read_from): float32, or with words 16-bit words
    (bf16 state), of length n and apart from its destination."""
    cdef _Buf b
    if words:
        b = _words(obj, name, False, n)
    else:
        b = _get(obj, name, False)
        _check_f32(b, name)
        _check_len(b, name, n)
    cdef size_t nbytes = n * b.itemsize
    cdef size_t lo = <size_t>b.view.buf
    cdef size_t dlo = <size_t>dst.view.buf
    if n and lo < dlo + nbytes and dlo < lo + nbytes:
        raise ValueError(f"{name} overlaps the array it is read for: pass read_from=None to update in place")
    return b


_ROUNDINGS = {"nearest": ZO_ROUND_NEAREST, "stochastic": ZO_ROUND_STOCHASTIC}


cdef _Buf _words(obj, str name, bint writable, Py_ssize_t n):
    """A 1-D buffer of raw 16-bit words (uint16/int16) of length n."""
    cdef _Buf b = _get(obj, name, writable)
    if b.itemsize != 2 or b.fmt not in ("H", "h"):
        raise TypeError(f"{name} must hold raw 16-bit words (uint16, e.g. tensor.view(torch.int16).numpy()), "
                        f"got buffer format {b.fmt!r}")
    _check_len(b, name, n)
    return b


def rounding_key(step, seed=0):
    """The stochastic-rounding key of update `step` (a 32-bit int): what the server
    passes as adam_step_bf16's sr_key, so that a run's rounding depends only on
    (seed, step, element) and a resumed run repeats it."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    cdef unsigned int s = zo_mix32(<unsigned int>(seed & 0xffffffff) ^ 0x5bd1e995u)
    return int(zo_mix32(s + <unsigned int>(step & 0xffffffff) * 0x9e3779b9u))


cdef class _Compact:
    """The buffers every compact-state kernel takes, validated: the master (float32, or
    the exact master's uint16 low halves with master_hi, its high halves), the gradient
    and the weights out, of one length."""
    cdef _Buf p, g, o, bh
    cdef int gk, ok
    cdef Py_ssize_t n
    cdef bint exact


cdef _Compact _compact(param, grad, param_out, master_hi, grad_dtype, out_dtype, predict):
    cdef _Compact c = _Compact()
    c.p = _get(param, "param", True)
    c.n = c.p.n
    c.exact = c.p.fmt in ("H", "h") and c.p.itemsize == 2
    if not c.exact:
        _check_f32(c.p, "param")
    c.g = _get(grad, "grad", False)
    _check_len(c.g, "grad", c.n)
    c.gk = _kind_of(c.g, "grad", grad_dtype, "grad_dtype", True)
    c.o = _get(param_out, "param_out", True)
    c.ok = _kind_of(c.o, "param_out", out_dtype, "out_dtype", False)
    _check_len(c.o, "param_out", c.n)
    c.bh = None
    if c.exact:
        if master_hi is None:
            raise TypeError("param holds 16-bit words (the exact master's low halves): pass master_hi, the "
                            "bf16 weights of the last update, too (or a float32 param for an fp32 master)")
        if c.ok != ZO_BF16:
            raise ValueError("the exact master is for bf16 weights: param_out must be bf16 (out_dtype='bf16'); "
                             "fp16 weights need an fp32 master")
        if _finite(predict, "predict") != 0.0:
            raise ValueError("predict needs an fp32 master (the weights slot must hold the master's high half)")
        c.bh = _words(master_hi, "master_hi", False, c.n)
    elif master_hi is not None:
        raise TypeError("master_hi goes with the exact master (param as 16-bit low halves); param is float32")
    return c


cdef _Compact _probe_buffers(param, grad, param_out, master_hi):
    """A bandwidth probe's master (float32, or with master_hi 16-bit words), gradient
    and weights (16-bit words), of one length."""
    cdef _Compact c = _Compact()
    c.p = _get(param, "param", True)
    c.n = c.p.n
    c.exact = master_hi is not None
    if c.exact:
        c.p = _words(param, "param", True, c.n)
    else:
        _check_f32(c.p, "param")
    c.g = _words(grad, "grad", False, c.n)
    c.o = _words(param_out, "param_out", True, c.n)
    c.bh = _words(master_hi, "master_hi", False, c.n) if c.exact else None
    return c


cdef _check_rounding(rounding, sr_key, index_base):
    """The stochastic rounding's keywords (adam_step_bf16 says what they mean)."""
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {sorted(_ROUNDINGS)}, got {rounding!r}")
    if not isinstance(sr_key, int) or isinstance(sr_key, bool) or not 0 <= sr_key < (1 << 32):
        raise ValueError(f"sr_key must be an int in [0, 2**32), got {sr_key!r}")
    if not isinstance(index_base, int) or isinstance(index_base, bool) or index_base < 0:
        raise ValueError(f"index_base must be an int >= 0, got {index_base!r}")


cdef _Call _prepare16(param, exp_avg, exp_avg_sq, grad, param_out, master_hi, grad_dtype, out_dtype, predict,
                      rounding, sr_key, index_base, num_threads, progress, progress_tag, progress_block,
                      progress_base, zo_state16 *s):
    """The bf16-state kernels' preamble (exp_avg_sq None: Lion): every buffer and
    keyword validated, and s filled, before anything is written."""
    cdef _Compact cp = _compact(param, grad, param_out, master_hi, grad_dtype, out_dtype, predict)
    cdef Py_ssize_t n = cp.n
    cdef _Buf bm = _words(exp_avg, "exp_avg", True, n)
    cdef _Buf bv = _words(exp_avg_sq, "exp_avg_sq", True, n) if exp_avg_sq is not None else None
    _check_rounding(rounding, sr_key, index_base)
    s.m = <unsigned short *>bm.view.buf
    s.v = <unsigned short *>bv.view.buf if bv is not None else NULL
    s.rem = <unsigned short *>cp.p.view.buf if cp.exact else NULL
    s.hi = <const unsigned short *>cp.bh.view.buf if cp.exact else NULL
    s.key = <unsigned int>sr_key
    s.index_base = <unsigned int>(index_base & 0xffffffff)
    s.rounding = _ROUNDINGS[rounding]
    cdef _Call c = _Call()
    c.p, c.s1, c.s2, c.g, c.o = cp.p, bm, bv, cp.g, cp.o  # held until the call returns
    c.gk, c.ok, c.n, c.nt = cp.gk, cp.ok, n, _threads(num_threads)
    c.pg = _progress(progress, progress_tag, progress_block, n, progress_base)
    c.bh = cp.bh
    return c


def adam_step_bf16(param, exp_avg, exp_avg_sq, grad, param_out, *, master_hi=None,
                   step, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                   adamw=True, grad_scale=1.0, num_threads=0, grad_dtype=None, out_dtype=None, predict=0.0,
                   rounding="stochastic", sr_key=0, index_base=0,
                   progress=None, progress_tag=0, progress_block=0, progress_base=0, read_from=None):
    """adam_step with bf16 moments (state_dtype="bf16"): the same fp32 arithmetic,
    m and v read from and rounded back to bf16 words.

    exp_avg, exp_avg_sq: uint16 words holding bf16, updated in place.
    param: the fp32 master (float32, updated in place), or, for the exact master,
    the uint16 low halves of the fp32 master (``master_hi`` then holds its bf16
    high halves: the weights the last update wrote; it may be param_out itself).
    With the exact master param_out must be bf16 and predict 0: the weights are
    the master's high half, rounded ties-away (_kernels.h explains why).
    rounding: "stochastic" (unbiased, keyed by sr_key and the element's model-wide
    index index_base + i, so neither threads nor sharding change a bit) or "nearest".
    param_out is required: the weights are the one output the caller cannot skip.
    read_from: None (in place), or, with the exact master, (param_src, exp_avg_src,
    exp_avg_sq_src): the old remainder and moments are read from these (uint16 words of
    the same length, apart from the destinations) and the new ones written to param,
    exp_avg, exp_avg_sq (adam_step's read_from); the same bits as in place.
    """
    cdef zo_hparams h
    _adam_hparams(&h, step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale, predict)
    cdef zo_state16 s
    s.src_m = NULL  # in place unless read_from says otherwise
    s.src_v = NULL
    s.src_rem = NULL
    cdef _Call c = _prepare16(param, exp_avg, exp_avg_sq, grad, param_out, master_hi, grad_dtype, out_dtype,
                              predict, rounding, sr_key, index_base, num_threads, progress, progress_tag,
                              progress_block, progress_base, &s)
    cdef _Buf sp, sm, sv
    if read_from is not None:
        if master_hi is None:
            raise ValueError("read_from needs the exact master (master_hi): with an fp32 master the update is in "
                             "place only")
        if not isinstance(read_from, (tuple, list)) or len(read_from) != 3:
            raise TypeError("read_from must be None or (param_src, exp_avg_src, exp_avg_sq_src)")
        sp = _source(read_from[0], "param_src", c.p, c.n, True)
        sm = _source(read_from[1], "exp_avg_src", c.s1, c.n, True)
        sv = _source(read_from[2], "exp_avg_sq_src", c.s2, c.n, True)
        s.src_rem = <const unsigned short *>sp.view.buf
        s.src_m = <const unsigned short *>sm.view.buf
        s.src_v = <const unsigned short *>sv.view.buf
    _run(K_ADAM16, &h, c, &s)


def lion_step_bf16(param, exp_avg, grad, param_out, *, master_hi=None, lr, beta1=0.9, beta2=0.99,
                   weight_decay=0.0, grad_scale=1.0, num_threads=0, grad_dtype=None, out_dtype=None,
                   rounding="stochastic", sr_key=0, index_base=0,
                   progress=None, progress_tag=0, progress_block=0, progress_base=0):
    """lion_step with a bf16 moment (state_dtype="bf16"): exp_avg as bf16 words, and
    param the fp32 master or, with master_hi, the exact master's low halves (as in
    adam_step_bf16)."""
    cdef zo_hparams h
    _lion_hparams(&h, lr, beta1, beta2, weight_decay, grad_scale)
    cdef zo_state16 s
    s.src_m = NULL  # in place (adam_step_bf16's read_from sets these)
    s.src_v = NULL
    s.src_rem = NULL
    cdef _Call c = _prepare16(param, exp_avg, None, grad, param_out, master_hi, grad_dtype, out_dtype, 0.0,
                              rounding, sr_key, index_base, num_threads, progress, progress_tag, progress_block,
                              progress_base, &s)
    _run(K_LION16, &h, c, &s)


def split_master(src, master_hi, master_rem, *, num_threads=0):
    """fp32 master -> the exact master's (bf16 high halves, low halves), as an update
    leaves them: master_hi gets the weights (bf16 words), master_rem the low halves.
    join_master gives src back bit for bit (NaN stays NaN)."""
    cdef _Buf bs = _get(src, "src", False)
    _check_f32(bs, "src")
    cdef _Buf bh = _words(master_hi, "master_hi", True, bs.n)
    cdef _Buf br = _words(master_rem, "master_rem", True, bs.n)
    cdef zo_state16 s
    s.src_m = NULL  # in place (adam_step_bf16's read_from sets these)
    s.src_v = NULL
    s.src_rem = NULL
    s.rem = <unsigned short *>br.view.buf
    cdef int nt = _threads(num_threads)
    with nogil:
        _run_range(K_SPLIT, _level, <float *>bs.view.buf, NULL, NULL, NULL, 0, bh.view.buf, ZO_BF16, 0, bs.n, nt,
                   NULL, &s)


def join_master(master_hi, master_rem, dst, *, num_threads=0):
    """dst[:] = the fp32 master that (master_hi, master_rem) hold (split_master's inverse)."""
    cdef _Buf bd = _get(dst, "dst", True)
    _check_f32(bd, "dst")
    cdef _Buf bh = _words(master_hi, "master_hi", False, bd.n)
    cdef _Buf br = _words(master_rem, "master_rem", False, bd.n)
    cdef zo_state16 s
    s.src_m = NULL  # in place (adam_step_bf16's read_from sets these)
    s.src_v = NULL
    s.src_rem = NULL
    s.hi = <const unsigned short *>bh.view.buf
    s.rem = <unsigned short *>br.view.buf
    cdef int nt = _threads(num_threads)
    with nogil:
        _run_range(K_JOIN, _level, <float *>bd.view.buf, NULL, NULL, NULL, 0, NULL, ZO_NONE, 0, bd.n, nt, NULL, &s)


def stream_probe_bf16(param, exp_avg, exp_avg_sq, grad, param_out, *, master_hi=None, num_threads=0):
    """Bandwidth probe of adam_step_bf16's access pattern (the same buffers, integer
    arithmetic): 18 B/element with the exact master, 20 with an fp32 one.  Modifies
    its buffers."""
    cdef _Compact cp = _probe_buffers(param, grad, param_out, master_hi)
    cdef Py_ssize_t n = cp.n
    cdef bint exact = cp.exact
    cdef _Buf bp = cp.p
    cdef _Buf bm = _words(exp_avg, "exp_avg", True, n)
    cdef _Buf bv = _words(exp_avg_sq, "exp_avg_sq", True, n)
    cdef _Buf bg = cp.g
    cdef _Buf bo = cp.o
    cdef _Buf bh = cp.bh
    cdef zo_state16 s
    s.src_m = NULL  # in place (adam_step_bf16's read_from sets these)
    s.src_v = NULL
    s.src_rem = NULL
    s.m = <unsigned short *>bm.view.buf
    s.v = <unsigned short *>bv.view.buf
    s.rem = <unsigned short *>bp.view.buf if exact else NULL
    s.hi = <const unsigned short *>bh.view.buf if exact else NULL
    cdef _Call c = _Call()
    c.p, c.s1, c.s2, c.g, c.o = bp, bm, bv, bg, bo
    c.gk, c.ok, c.n, c.nt = ZO_BF16, ZO_BF16, n, _threads(num_threads)
    c.pg = _progress(None, 0, 0, n)
    cdef zo_hparams h
    h.predict = 0.0
    _run(K_PROBE16, &h, c, &s)


def adagrad_step(param, state_sum, grad, param_out=None, *, lr, eps=1e-10, weight_decay=0.0,
                 grad_scale=1.0, num_threads=0, grad_dtype=None, out_dtype=None,
                 progress=None, progress_tag=0, progress_block=0, progress_base=0):
    """One Adagrad step in place (torch.optim.Adagrad with lr_decay=0; L2 weight decay).

    state_sum += g*g;  param -= lr * g / (sqrt(state_sum) + eps).
    """
    cdef _Call c = _prepare(param, ((state_sum, "state_sum"),), grad, param_out, grad_dtype, out_dtype,
                            num_threads, progress, progress_tag, progress_block, progress_base)
    cdef double dlr = _finite(lr, "lr")
    cdef double deps = _finite(eps, "eps")
    cdef double wd = _finite(weight_decay, "weight_decay")
    cdef double gs = _finite(grad_scale, "grad_scale")
    if deps <= 0.0:
        raise ValueError(f"eps must be > 0, got {deps}")
    _check_lr_wd_scale(dlr, wd)
    cdef zo_hparams h
    h.grad_scale = <float>gs
    h.beta1 = 0.0; h.one_minus_beta1 = 0.0; h.beta2 = 0.0; h.one_minus_beta2 = 0.0
    h.eps = <float>deps
    h.step_size = <float>dlr
    h.inv_sqrt_bc2 = 1.0
    h.decoupled = 0
    h.decay = 1.0
    h.l2 = <float>wd
    h.predict = 0.0
    h.src_p = h.src_m = h.src_v = NULL
    _run(K_ADAGRAD, &h, c)


cdef int _lion_hparams(zo_hparams *h, lr, beta1, beta2, weight_decay, grad_scale) except -1:
    """Validate Lion's hyper-parameters and fold them into the loop's constants."""
    cdef double dlr = _finite(lr, "lr")
    cdef double b1 = _beta(beta1, "beta1")
    cdef double b2 = _beta(beta2, "beta2")
    cdef double wd = _finite(weight_decay, "weight_decay")
    cdef double gs = _finite(grad_scale, "grad_scale")
    _check_lr_wd_scale(dlr, wd)
    h.grad_scale = <float>gs
    h.beta1 = <float>b1
    h.one_minus_beta1 = <float>(1.0 - b1)
    h.beta2 = <float>b2
    h.one_minus_beta2 = <float>(1.0 - b2)
    h.eps = 0.0
    h.step_size = <float>dlr
    h.inv_sqrt_bc2 = 1.0
    h.decoupled = 1
    h.decay = <float>(1.0 - dlr * wd)
    h.l2 = 0.0
    h.predict = 0.0
    h.src_p = h.src_m = h.src_v = NULL  # read only by fp32 Adam: set for hygiene
    return 0


def lion_step(param, exp_avg, grad, param_out=None, *, lr, beta1=0.9, beta2=0.99, weight_decay=0.0,
              grad_scale=1.0, num_threads=0, grad_dtype=None, out_dtype=None,
              progress=None, progress_tag=0, progress_block=0, progress_base=0):
    """One Lion step in place (Chen et al. 2023; decoupled weight decay).

    c = b1*m + (1-b1)*g;  p = p*(1 - lr*wd) - lr*sign(c);  m = b2*m + (1-b2)*g.
    """
    cdef _Call c = _prepare(param, ((exp_avg, "exp_avg"),), grad, param_out, grad_dtype, out_dtype,
                            num_threads, progress, progress_tag, progress_block, progress_base)
    cdef zo_hparams h
    _lion_hparams(&h, lr, beta1, beta2, weight_decay, grad_scale)
    _run(K_LION, &h, c)


def grad_sumsq(grad, *, grad_dtype=None, num_threads=0):
    """Sum of squares of a 1-D fp16/bf16/fp32 gradient, as a float (inf/NaN propagate).

    One read of the buffer; the same result for any thread count.  Used for the
    global gradient norm and the overflow check on the CPU path.
    """
    cdef _Buf bg = _get(grad, "grad", False)
    cdef int gk = _kind_of(bg, "grad", grad_dtype, "grad_dtype", True)
    return _sumsq(bg.view.buf, gk, NULL, bg.n, _threads(num_threads))


cdef double _sumsq(const void *g, int gk, unsigned short *copy_to, Py_ssize_t n, int nt):
    """Chunked sum of squares, chunk sums added in order (deterministic for any
    thread count).  With copy_to, each chunk is first copied there and summed
    from the copy while it is in cache (16-bit gradients only)."""
    cdef Py_ssize_t nchunks = (n + CHUNK - 1) // CHUNK
    cdef Py_ssize_t c
    cdef int64_t lo, hi
    cdef int level = _level
    cdef const void *src = <const void *>copy_to if copy_to != NULL else g
    if n == 0:
        return 0.0
    parts = bytearray(8 * nchunks)
    cdef double[::1] acc = memoryview(parts).cast("d")
    if n < MIN_PARALLEL or nt <= 1 or not zo_openmp_enabled():
        with nogil:
            for c in range(nchunks):
                lo = c * CHUNK
                hi = lo + CHUNK if lo + CHUNK < n else n
                if copy_to != NULL:
                    memcpy(copy_to + lo, <const unsigned short *>g + lo, 2 * (hi - lo))
                acc[c] = zo_sumsq_chunk(level, src, gk, lo, hi)
    else:
        for c in prange(nchunks, nogil=True, num_threads=nt, schedule="static"):
            lo = c * CHUNK
            hi = lo + CHUNK if lo + CHUNK < n else n
            if copy_to != NULL:
                memcpy(copy_to + lo, <const unsigned short *>g + lo, 2 * (hi - lo))
            acc[c] = zo_sumsq_chunk(level, src, gk, lo, hi)
    cdef double total = 0.0
    for c in range(nchunks):
        total += acc[c]
    return total


def copy_grad_sumsq(src, dst, *, grad_dtype=None, num_threads=0):
    """dst[:] = src for a 16-bit gradient, returning its sum of squares as grad_sumsq would.

    One pass over memory instead of two: each chunk is copied and then summed from
    the copy while it is still in cache.  The result is bitwise grad_sumsq(dst).
    src: float16, or 16-bit words with grad_dtype="fp16"/"bf16"; dst: 16-bit, writable.
    The engine calls it from its gradient hooks on the CPU device (copy into the
    shared slot plus the global-norm contribution).
    """
    cdef _Buf bs = _get(src, "src", False)
    cdef _Buf bd = _get(dst, "dst", True)
    cdef int gk = _kind_of(bs, "src", grad_dtype, "grad_dtype", False)
    if bd.itemsize != 2 or bd.fmt not in ("e", "H", "h"):
        raise TypeError(f"dst must hold 16-bit values (float16 or 16-bit words), got buffer format {bd.fmt!r}")
    _check_len(bd, "dst", bs.n, "src")
    return _sumsq(bs.view.buf, gk, <unsigned short *>bd.view.buf, bs.n, _threads(num_threads))


def cast_to_16(src, dst, *, out_dtype=None, num_threads=0):
    """dst[:] = src rounded to fp16/bf16 (to nearest even; NaN stays NaN), in place.

    The same rounding as the 16-bit weights every update writes, with no
    temporaries: the server casts a whole shard's master with it at INIT and
    LOAD, where NumPy's bit arithmetic would allocate several fp32-sized arrays.
    src: float32; dst: float16, or 16-bit words with out_dtype="fp16"/"bf16".
    """
    cdef _Buf bs = _get(src, "src", False)
    cdef _Buf bd = _get(dst, "dst", True)
    _check_f32(bs, "src")
    cdef int ok = _kind_of(bd, "dst", out_dtype, "out_dtype", False)
    _check_len(bd, "dst", bs.n, "src")
    cdef int nt = _threads(num_threads)
    with nogil:
        # the update's own chunking and threading; src is only read
        _run_range(K_CAST, _level, <float *>bs.view.buf, NULL, NULL, NULL, 0, bd.view.buf, ok, 0, bs.n, nt, NULL)


def stream_probe(param, exp_avg, exp_avg_sq, grad, param_out, *, num_threads=0):
    """Bandwidth probe for benchmarks: Adam's access pattern (fp16 grad in, three
    fp32 read+write, fp16 out) with trivial arithmetic.  Modifies its buffers."""
    if param_out is None:
        raise TypeError("param_out must be a 1-D array, got None")
    cdef _Call c = _prepare(param, ((exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")), grad, param_out,
                            None, None, num_threads, None, 0, 0)
    if c.gk != ZO_F16 or c.ok != ZO_F16:
        raise TypeError("stream_probe takes float16 grad and param_out")
    cdef zo_hparams h
    h.predict = 0.0
    _run(K_PROBE, &h, c)


cdef class _Progress:
    """Where and how often a blocked update publishes its progress (none: word is NULL)."""
    cdef _Buf buf
    cdef uint64_t *word
    cdef uint64_t tagbits
    cdef int64_t block
    cdef uint64_t base


cdef _Progress _progress(progress, tag, block, Py_ssize_t n, base=0):
    cdef _Progress pg = _Progress()
    pg.word = NULL
    pg.tagbits = 0
    pg.block = 0
    pg.base = 0
    if progress is None:
        return pg
    pg.buf = _word(progress, True)
    if not isinstance(tag, int) or isinstance(tag, bool) or tag < 0:
        raise ValueError(f"progress_tag must be an int >= 0, got {tag!r}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 0:
        raise ValueError(f"progress_block must be an int >= 0 (0 = publish once, at the end), got {block!r}")
    if n > PROGRESS_DONE_MASK:
        raise ValueError(f"a progress word counts at most {PROGRESS_DONE_MASK} elements, got {n}")
    pg.word = <uint64_t *>pg.buf.view.buf
    pg.tagbits = (<uint64_t>(tag & PROGRESS_TAG_MASK)) << ZO_PROGRESS_SHIFT
    if not isinstance(base, int) or isinstance(base, bool) or base < 0 or base + n > PROGRESS_DONE_MASK:
        raise ValueError(f"progress_base must be an int >= 0 with progress_base + length <= {PROGRESS_DONE_MASK}, "
                         f"got {base!r}")
    pg.base = base
    pg.block = block if block > 0 else n
    return pg


cdef _Buf _word(obj, bint writable):
    """The progress word's buffer: one aligned uint64 (its loads and stores are atomic)."""
    cdef _Buf b = _get(obj, "progress", writable)
    if b.itemsize != 8 or b.fmt not in ("Q", "L") or b.n < 1:
        raise TypeError(f"progress must be a uint64 array of at least one element, got format {b.fmt!r} "
                        f"with {b.n} element(s)")
    if (<size_t>b.view.buf) % 8 != 0:
        raise ValueError("progress must be 8-byte aligned (its loads and stores are atomic)")
    return b


def load_progress(progress, *, tag=None):
    """Read a progress word with acquire semantics.

    Returns the elements done, or, given ``tag``, the elements done if the word
    carries that tag (mod 2**24) and 0 if it carries another (an older update's).
    """
    cdef _Buf b = _word(progress, False)
    cdef uint64_t v = zo_progress_load(<const uint64_t *>b.view.buf)
    done = int(v & PROGRESS_DONE_MASK)
    if tag is None:
        return done
    return done if int(v >> ZO_PROGRESS_SHIFT) == (tag & PROGRESS_TAG_MASK) else 0


def store_progress(progress, *, tag, done):
    """Publish ``done`` elements of update ``tag`` with release semantics, as a
    kernel's block does.  For a range the server finishes without a kernel (a
    parameter with no gradient this step: its weights are only re-cast), so the
    worker's readers see the same monotone word."""
    cdef _Buf b = _word(progress, True)
    if not isinstance(tag, int) or isinstance(tag, bool) or tag < 0:
        raise ValueError(f"tag must be an int >= 0, got {tag!r}")
    if not isinstance(done, int) or isinstance(done, bool) or not 0 <= done <= PROGRESS_DONE_MASK:
        raise ValueError(f"done must be an int in [0, {PROGRESS_DONE_MASK}], got {done!r}")
    cdef uint64_t v = ((<uint64_t>(tag & PROGRESS_TAG_MASK)) << ZO_PROGRESS_SHIFT) | <uint64_t>done
    zo_progress_store(<uint64_t *>b.view.buf, v)


cdef void _run(Kernel which, zo_hparams *h, _Call c, const zo_state16 *s=NULL):
    cdef float *p = <float *>c.p.view.buf
    cdef float *s1 = <float *>c.s1.view.buf
    cdef float *s2 = <float *>c.s2.view.buf if c.s2 is not None else NULL
    cdef const void *g = c.g.view.buf
    cdef void *o = c.o.view.buf if c.o is not None else NULL
    cdef int gk = c.gk
    cdef int ok = c.ok
    cdef Py_ssize_t n = c.n
    cdef int nt = c.nt
    cdef _Progress pg = c.pg
    cdef int level = _level
    cdef uint64_t *word = pg.word
    cdef uint64_t tagbits = pg.tagbits
    cdef uint64_t base = pg.base
    cdef int64_t block = pg.block if word != NULL else n
    cdef int64_t b0 = 0
    cdef int64_t b1
    if n == 0:
        if word != NULL:
            zo_progress_store(word, tagbits | pg.base)
        return
    with nogil:
        # Blocks run one after another, each with all threads, so progress
        # grows from the front of the shard: the order backward frees buckets.
        while b0 < n:
            b1 = b0 + block if b0 + block < n else n
            _run_range(which, level, p, s1, s2, g, gk, o, ok, b0, b1, nt, h, s)
            if word != NULL:
                zo_progress_store(word, tagbits | (base + <uint64_t>b1))
            b0 = b1


cdef inline int64_t _thread_part(int64_t n, int nt, int64_t align) noexcept nogil:
    """Elements per thread of a parallel range of n: one contiguous part each, a
    multiple of align.  Fixed-size chunks split a progress block (1M elements, 16
    chunks of 64K) 2:1 among 14 threads, so the block took two chunks' time where
    1.14 would do: the 1.48B model's update ran at 0.6x of the kernel's speed on a
    16-core host (BENCHMARKS.md, the GPU run).  Equal parts keep every thread
    busy to the block's end, and each thread's prefetch streams as long as they
    can be."""
    cdef int64_t k = (n + nt - 1) // nt
    return ((k + align - 1) // align) * align


cdef void _run_range(Kernel which, int level, float *p, float *s1, float *s2, const void *g, int gk,
                     void *o, int ok, int64_t b0, int64_t b1, int nt, const zo_hparams *h,
                     const zo_state16 *s=NULL) noexcept nogil:
    cdef int64_t part
    cdef Py_ssize_t nparts
    cdef Py_ssize_t c
    cdef int64_t lo, hi
    if b1 - b0 < MIN_PARALLEL or nt <= 1 or not zo_openmp_enabled():
        _chunk(which, level, p, s1, s2, g, gk, o, ok, b0, b1, h, s)
        return
    # One part per thread (_thread_part), a multiple of 16 so only the last has a scalar
    # tail.  Elementwise, so any thread count (and any block size) gives bitwise
    # identical results.  The parallel region's closing barrier orders every
    # thread's stores before the progress store.
    part = _thread_part(b1 - b0, nt, 16)
    nparts = (b1 - b0 + part - 1) // part
    for c in prange(nparts, num_threads=nt, schedule="static"):
        lo = b0 + c * part
        hi = lo + part
        if hi > b1:
            hi = b1
        _chunk(which, level, p, s1, s2, g, gk, o, ok, lo, hi, h, s)


cdef inline void _chunk(Kernel which, int level, float *p, float *s1, float *s2, const void *g, int gk,
                        void *o, int ok, int64_t lo, int64_t hi, const zo_hparams *h,
                        const zo_state16 *s) noexcept nogil:
    if which == K_ADAM:
        zo_adam_chunk(level, p, s1, s2, g, gk, o, ok, lo, hi, h)
    elif which == K_ADAGRAD:
        zo_adagrad_chunk(level, p, s1, g, gk, o, ok, lo, hi, h)
    elif which == K_LION:
        zo_lion_chunk(level, p, s1, g, gk, o, ok, lo, hi, h)
    elif which == K_PROBE:
        zo_stream_chunk(level, p, s1, s2, <const unsigned short *>g, <unsigned short *>o, lo, hi)
    elif which == K_ADAM16:
        zo_adam16_chunk(level, p, g, gk, o, ok, lo, hi, h, s)
    elif which == K_LION16:
        zo_lion16_chunk(level, p, g, gk, o, ok, lo, hi, h, s)
    elif which == K_PROBE16:
        zo_stream16_chunk(level, <unsigned int *>p, s.rem, s.hi, s.m, s.v, <const unsigned short *>g,
                          <unsigned short *>o, lo, hi)
    elif which == K_SPLIT:
        zo_split_chunk(p, <unsigned short *>o, s.rem, lo, hi)
    elif which == K_JOIN:
        zo_join_chunk(s.hi, s.rem, p, lo, hi)
    else:
        zo_cast_chunk(p, <unsigned short *>o, ok, lo, hi)


# ---------------------------------------------------------------- int8 moments (_kernels_int8.h)

cdef _Buf _codes(obj, str name, bint writable, Py_ssize_t n):
    """A 1-D buffer of 8-bit codes (uint8) of length n."""
    cdef _Buf b = _get(obj, name, writable)
    if b.itemsize != 1 or b.fmt not in ("B", "b"):
        raise TypeError(f"{name} must hold 8-bit codes (uint8), got buffer format {b.fmt!r}")
    _check_len(b, name, n)
    return b


cdef _Buf _scales(obj, str name, bint writable, Py_ssize_t n):
    """The per-block scales of n elements: float32, ceil(n / QBLOCK) of them."""
    cdef _Buf b = _get(obj, name, writable)
    _check_f32(b, name)
    cdef Py_ssize_t want = (n + ZO_QBLOCK - 1) // ZO_QBLOCK
    if b.n != want:
        raise ValueError(f"{name} has {b.n} elements but {n} elements make {want} blocks of {ZO_QBLOCK}: "
                         f"pass one scale per block")
    return b


cdef class _Groups:
    """The groups of an int8 call (STEP.groups' ranges within it), as a C array the loop
    reads (freed with the object)."""
    cdef zo_seg8 *a
    cdef int n

    def __dealloc__(self):
        if self.a != NULL:
            free(self.a)


# the hyper-parameters a segment needs and may give, per optimizer of the int8 kernel
_SEG_KEYS = {"adam": ({"step", "lr"}, {"beta1", "beta2", "eps", "weight_decay"}),
             "lion": ({"lr"}, {"beta1", "beta2", "weight_decay"})}


cdef _Groups _group_array(groups, Py_ssize_t n, int lion, adamw, grad_scale, predict):
    """[(lo, hi, hparams or None), ...] tiling [0, n), validated and folded (Adam's
    hyper-parameters, or Lion's with lion)."""
    cdef _Groups sg = _Groups()
    cdef Py_ssize_t k
    cdef int64_t at = 0
    need, may = _SEG_KEYS["lion" if lion else "adam"]
    groups = list(groups)
    if not groups:
        raise ValueError("groups must cover the arrays: give at least one (lo, hi, hparams)")
    sg.a = <zo_seg8 *>malloc(len(groups) * sizeof(zo_seg8))
    if sg.a == NULL:
        raise MemoryError()
    sg.n = len(groups)
    for k, seg in enumerate(groups):
        if not isinstance(seg, tuple) or len(seg) != 3:
            raise TypeError(f"groups[{k}] must be a tuple (lo, hi, hparams or None), got {seg!r}")
        lo, hi, hp = seg
        if lo != at or not hi > lo:
            raise ValueError(f"groups must tile [0, {n}) in order: groups[{k}] is [{lo}, {hi}), expected to "
                             f"start at {at} and be non-empty")
        at = hi
        sg.a[k].lo = lo
        sg.a[k].hi = hi
        sg.a[k].keep = 1 if hp is None else 0
        if hp is None:
            sg.a[k].h.predict = 0.0
            continue
        if set(hp) - need - may or need - set(hp):
            raise ValueError(f"groups[{k}]'s hparams need {' and '.join(sorted(need))} (and may give "
                             f"{', '.join(sorted(may))}), got {sorted(hp)}")
        if lion:
            _lion_hparams(&sg.a[k].h, hp["lr"], hp.get("beta1", 0.9), hp.get("beta2", 0.99),
                          hp.get("weight_decay", 0.0), grad_scale)
        else:
            _adam_hparams(&sg.a[k].h, hp["step"], hp["lr"], hp.get("beta1", 0.9), hp.get("beta2", 0.999),
                          hp.get("eps", 1e-8), hp.get("weight_decay", 0.0), adamw, grad_scale, predict)
    if at != n:
        raise ValueError(f"groups cover [0, {at}) but the arrays have {n} elements")
    return sg


def adam_step_int8(param, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, grad, param_out, *,
                   master_hi=None, step=None, lr=None, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                   groups=None, adamw=True, grad_scale=1.0, num_threads=0, grad_dtype=None, out_dtype=None,
                   predict=0.0, rounding="stochastic", sr_key=0, index_base=0,
                   progress=None, progress_tag=0, progress_block=0, progress_base=0):
    """adam_step with block-wise 8-bit moments (state_dtype="int8", _kernels_int8.h
    draws the codes): the same fp32 arithmetic, m and v decoded from their codes and
    encoded back with each block's new scale.

    exp_avg (signed code), exp_avg_sq: uint8 codes; exp_avg_scale, exp_avg_sq_scale:
    float32, one per block of QBLOCK elements counted from element 0 (so a slice
    must start on a block).  param, master_hi, rounding, sr_key, index_base: as in
    adam_step_bf16.  step, lr, beta1, beta2, eps, weight_decay: one set for every
    element, or groups=[(lo, hi, dict(step=..., lr=..., ...) or None), ...]
    tiling [0, n): a set per run (param groups); None keeps the run (no gradient
    this step: master and moments stay, param_out gets the weights).  A block with
    kept and updated elements re-encodes the kept ones with its new scale.
    progress_block is rounded up to whole blocks.
    """
    cdef _Compact cp = _compact(param, grad, param_out, master_hi, grad_dtype, out_dtype, predict)
    cdef Py_ssize_t n = cp.n
    cdef _Buf bm = _codes(exp_avg, "exp_avg", True, n)
    cdef _Buf bv = _codes(exp_avg_sq, "exp_avg_sq", True, n)
    cdef _Buf bms = _scales(exp_avg_scale, "exp_avg_scale", True, n)
    cdef _Buf bvs = _scales(exp_avg_sq_scale, "exp_avg_sq_scale", True, n)
    if groups is None:
        if step is None or lr is None:
            raise TypeError("adam_step_int8 needs step and lr (or groups)")
        groups = [(0, n, dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay))] if n else []
    elif step is not None or lr is not None:
        raise TypeError("give step and lr, or groups with their own, not both")
    _step_int8(cp, bm, bv, bms, bvs, groups, 0, adamw, grad_scale, predict, rounding, sr_key, index_base,
               num_threads, progress, progress_tag, progress_block, progress_base)


def lion_step_int8(param, exp_avg, exp_avg_scale, grad, param_out, *, master_hi=None, lr=None, beta1=0.9,
                   beta2=0.99, weight_decay=0.0, groups=None, grad_scale=1.0, num_threads=0, grad_dtype=None,
                   out_dtype=None, rounding="stochastic", sr_key=0, index_base=0,
                   progress=None, progress_tag=0, progress_block=0, progress_base=0):
    """lion_step with a block-wise 8-bit moment (state_dtype="int8"): lion_step's fp32
    arithmetic, m decoded from its codes (adam_step_int8's m) and encoded back with
    each block's new scale.  lr, beta1, beta2, weight_decay: one set, or groups
    whose hparams give lr (and may give beta1, beta2, weight_decay); the rest as in
    adam_step_int8."""
    cdef _Compact cp = _compact(param, grad, param_out, master_hi, grad_dtype, out_dtype, 0.0)
    cdef Py_ssize_t n = cp.n
    cdef _Buf bm = _codes(exp_avg, "exp_avg", True, n)
    cdef _Buf bms = _scales(exp_avg_scale, "exp_avg_scale", True, n)
    if groups is None:
        if lr is None:
            raise TypeError("lion_step_int8 needs lr (or groups)")
        groups = [(0, n, dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay))] if n else []
    elif lr is not None:
        raise TypeError("give lr, or groups with their own, not both")
    _step_int8(cp, bm, None, bms, None, groups, 1, True, grad_scale, 0.0, rounding, sr_key, index_base,
               num_threads, progress, progress_tag, progress_block, progress_base)


cdef _step_int8(_Compact cp, _Buf bm, _Buf bv, _Buf bms, _Buf bvs, groups, int lion, adamw, grad_scale,
                predict, rounding, sr_key, index_base, num_threads, progress, progress_tag, progress_block,
                progress_base):
    """adam_step_int8's and lion_step_int8's common part, after their buffers are checked
    (bv, bvs None: Lion): the keywords validated, then the blocks run."""
    cdef Py_ssize_t n = cp.n
    _check_rounding(rounding, sr_key, index_base)
    cdef _Progress pg = _progress(progress, progress_tag, progress_block, n, progress_base)
    cdef int nt = _threads(num_threads)
    if n == 0:
        if pg.word != NULL:
            zo_progress_store(pg.word, pg.tagbits | pg.base)
        return
    cdef _Groups sg = _group_array(groups, n, lion, adamw, grad_scale, predict)
    cdef zo_state8 s
    s.m = <unsigned char *>bm.view.buf
    s.v = NULL if lion else <unsigned char *>bv.view.buf
    s.ms = <float *>bms.view.buf
    s.vs = NULL if lion else <float *>bvs.view.buf
    s.rem = <unsigned short *>cp.p.view.buf if cp.exact else NULL
    s.hi = <const unsigned short *>cp.bh.view.buf if cp.exact else NULL
    s.key = <unsigned int>sr_key
    s.index_base = <unsigned int>(index_base & 0xffffffff)
    s.rounding = _ROUNDINGS[rounding]
    s.lion = lion
    cdef float *p = NULL if cp.exact else <float *>cp.p.view.buf
    cdef const void *g = cp.g.view.buf
    cdef void *o = cp.o.view.buf
    cdef int gk = cp.gk
    cdef int ok = cp.ok
    cdef int level = _level
    cdef uint64_t *word = pg.word
    cdef uint64_t tagbits = pg.tagbits
    cdef uint64_t base = pg.base
    # whole blocks per progress step, so a block's scale is never split across two
    cdef int64_t block = ((pg.block + ZO_QBLOCK - 1) // ZO_QBLOCK) * ZO_QBLOCK if word != NULL else n
    cdef int64_t b0 = 0
    cdef int64_t b1
    with nogil:
        while b0 < n:
            b1 = b0 + block if b0 + block < n else n
            _run8_range(level, p, g, gk, o, ok, b0, b1, nt, sg.a, sg.n, &s)
            if word != NULL:
                zo_progress_store(word, tagbits | (base + <uint64_t>b1))
            b0 = b1


cdef void _run8_range(int level, float *p, const void *g, int gk, void *o, int ok, int64_t b0, int64_t b1,
                      int nt, const zo_seg8 *segs, int nseg, const zo_state8 *s) noexcept nogil:
    """_run_range for the int8 kernel: b0 starts a block and each thread's part is a
    multiple of QBLOCK, so every part holds whole blocks and threads never share one."""
    cdef int64_t part
    cdef Py_ssize_t nparts
    cdef Py_ssize_t c
    cdef int64_t lo, hi
    if b1 - b0 < MIN_PARALLEL or nt <= 1 or not zo_openmp_enabled():
        zo_opt8_chunk(level, p, g, gk, o, ok, b0, b1, segs, nseg, s)
        return
    part = _thread_part(b1 - b0, nt, ZO_QBLOCK)
    nparts = (b1 - b0 + part - 1) // part
    for c in prange(nparts, num_threads=nt, schedule="static"):
        lo = b0 + c * part
        hi = lo + part
        if hi > b1:
            hi = b1
        zo_opt8_chunk(level, p, g, gk, o, ok, lo, hi, segs, nseg, s)


_MOMENTS8 = {"exp_avg": 0, "exp_avg_sq": 1}


def quantize_int8(src, codes, scales, *, moment):
    """fp32 moments -> int8 codes and block scales, rounded to nearest (a checkpoint
    converted to state_dtype="int8" on load).  moment: "exp_avg" (signed code) or
    "exp_avg_sq".  src starts on a block."""
    if moment not in _MOMENTS8:
        raise ValueError(f"moment must be one of {sorted(_MOMENTS8)}, got {moment!r}")
    cdef _Buf bs = _get(src, "src", False)
    _check_f32(bs, "src")
    cdef _Buf bc = _codes(codes, "codes", True, bs.n)
    cdef _Buf bsc = _scales(scales, "scales", True, bs.n)
    cdef int which = _MOMENTS8[moment]
    with nogil:
        zo8_quantize_chunk(<const float *>bs.view.buf, <unsigned char *>bc.view.buf, <float *>bsc.view.buf,
                           which, 0, bs.n)


def dequantize_int8(codes, scales, dst, *, moment):
    """dst[:] = the fp32 moments that int8 codes and block scales hold (exact: what
    the update itself reads)."""
    if moment not in _MOMENTS8:
        raise ValueError(f"moment must be one of {sorted(_MOMENTS8)}, got {moment!r}")
    cdef _Buf bd = _get(dst, "dst", True)
    _check_f32(bd, "dst")
    cdef _Buf bc = _codes(codes, "codes", False, bd.n)
    cdef _Buf bsc = _scales(scales, "scales", False, bd.n)
    cdef int which = _MOMENTS8[moment]
    with nogil:
        zo8_dequantize_chunk(<const unsigned char *>bc.view.buf, <const float *>bsc.view.buf,
                             <float *>bd.view.buf, which, 0, bd.n)


def stream_probe_int8(param, exp_avg, exp_avg_sq, grad, param_out, *, master_hi=None, num_threads=0):
    """Bandwidth probe of adam_step_int8's access pattern (integer arithmetic on the
    same buffers): 14 B/element with the exact master, 16 with an fp32 one.
    Modifies its buffers."""
    cdef _Compact cp = _probe_buffers(param, grad, param_out, master_hi)
    cdef Py_ssize_t n = cp.n
    cdef _Buf bm = _codes(exp_avg, "exp_avg", True, n)
    cdef _Buf bv = _codes(exp_avg_sq, "exp_avg_sq", True, n)
    cdef unsigned int *p = NULL if cp.exact else <unsigned int *>cp.p.view.buf
    cdef unsigned short *rem = <unsigned short *>cp.p.view.buf if cp.exact else NULL
    cdef const unsigned short *hi16 = <const unsigned short *>cp.bh.view.buf if cp.exact else NULL
    cdef unsigned char *m = <unsigned char *>bm.view.buf
    cdef unsigned char *v = <unsigned char *>bv.view.buf
    cdef const unsigned short *g = <const unsigned short *>cp.g.view.buf
    cdef unsigned short *o = <unsigned short *>cp.o.view.buf
    cdef int nt = _threads(num_threads)
    cdef int level = _level
    cdef int64_t part
    cdef Py_ssize_t nparts
    cdef Py_ssize_t c
    cdef int64_t lo, hi
    if n < MIN_PARALLEL or nt <= 1 or not zo_openmp_enabled():
        with nogil:
            zo8_stream_chunk(level, p, rem, hi16, m, v, g, o, 0, n)
        return
    # split as the update it bounds is (_run8_range): one part per thread
    part = _thread_part(n, nt, ZO_QBLOCK)
    nparts = (n + part - 1) // part
    for c in prange(nparts, nogil=True, num_threads=nt, schedule="static"):
        lo = c * part
        hi = lo + part if lo + part < n else n
        zo8_stream_chunk(level, p, rem, hi16, m, v, g, o, lo, hi)
