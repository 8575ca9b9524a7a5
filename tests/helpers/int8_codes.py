"""The int8 state's codes in float64 arithmetic, apart from the kernel: the reference
the tests hold cython_ext's dequantize_int8 and checkpoints against.

m: sign | e (4 bits) | f (3 bits), |m| = scale * (e ? 2^(e-15) (1 + f/8) : 2^-14 f/8)
v:        e (5 bits) | f (3 bits),  v  = scale * (e ? 2^(e-31) (1 + f/8) : 2^-30 f/8)

and the power-law codes of format-1 checkpoints (legacy_*): m = scale (q/127)^4 with a
sign bit, v = scale (q/255)^8.
"""
import numpy as np

from tests.helpers.state_files import QBLOCK
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


POWER_LAWS = {"exp_avg": (4, 127), "exp_avg_sq": (8, 255)}  # exponent, largest q


def legacy_encode(x: np.ndarray, moment: str) -> tuple[np.ndarray, np.ndarray]:
    """fp32 moments -> (power-law codes, block scales), nearest in value space."""
    n = x.size
    nb = (n + QBLOCK - 1) // QBLOCK
    ax = np.abs(x.astype(np.float64)) if moment == "exp_avg" else x.astype(np.float64)
    scales = np.pad(ax, (0, nb * QBLOCK - n)).reshape(nb, QBLOCK).max(1).astype(np.float32)
    k, top = POWER_LAWS[moment]
    s = np.repeat(scales.astype(np.float64), QBLOCK)[:n]
    u = np.where(s > 0, ax / np.where(s > 0, s, 1), 0)
    q0 = np.minimum(np.floor(top * u ** (1 / k)), top - 1)
    lo, hi = (q0 / top) ** k, ((q0 + 1) / top) ** k
    q = (q0 + (u - lo > hi - u)).astype(np.uint8)
    if moment == "exp_avg":
        q |= np.where(x < 0, 0x80, 0).astype(np.uint8)
    return q, scales


def legacy_decode_f64(codes: np.ndarray, scales: np.ndarray, moment: str) -> np.ndarray:
    """The moments that power-law codes and their blocks' scales hold, in float64."""
    k, top = POWER_LAWS[moment]
    t = (codes & (0x7f if moment == "exp_avg" else 0xff)).astype(np.float64) / top
    x = np.repeat(scales.astype(np.float64), QBLOCK)[:codes.size] * t ** k
    return np.where(codes & 0x80, -x, x) if moment == "exp_avg" else x
