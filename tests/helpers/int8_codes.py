"""The int8 state's codes decoded by float64 arithmetic, apart from the kernel: the
reference the tests hold cython_ext's dequantize_int8 and checkpoints against.

m: sign | e (4 bits) | f (3 bits), |m| = scale * (e ? 2^(e-15) (1 + f/8) : 2^-14 f/8)
v:        e (5 bits) | f (3 bits),  v  = scale * (e ? 2^(e-31) (1 + f/8) : 2^-30 f/8)
"""
import numpy as np

QBLOCK = 256
FORMATS = {"exp_avg": (4, 15), "exp_avg_sq": (5, 31)}  # exponent bits, the exponent of 2^0


def unit(codes: np.ndarray, moment: str) -> np.ndarray:
    """|value| / scale of each code, in float64."""
    ebits, top = FORMATS[moment]
    c = codes.astype(np.int64) & ((1 << (ebits + 3)) - 1)
    e, f = c >> 3, (c & 7).astype(np.float64)
    return np.where(e > 0, np.exp2(e - top) * (1 + f / 8), np.exp2(1 - top) * f / 8)


def decode_f64(codes: np.ndarray, scales: np.ndarray, moment: str) -> np.ndarray:
    """The moments that codes and their blocks' scales hold, in float64."""
    scale = np.repeat(scales.astype(np.float64), QBLOCK)[:codes.size]
    x = scale * unit(codes, moment)
    return np.where(codes & 0x80, -x, x) if moment == "exp_avg" else x


def code_step(u, moment: str) -> np.ndarray:
    """The step from one code to the next at u = |x| / scale (subnormal below the
    smallest normal binade, 2^-14 for m and 2^-30 for v)."""
    ebits, top = FORMATS[moment]
    tiny = 2.0 ** (1 - top)
    u = np.asarray(u, np.float64)
    return np.where(u < tiny, tiny / 8, np.exp2(np.floor(np.log2(np.maximum(u, tiny))) - 3))
