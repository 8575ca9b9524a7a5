"""The SIMD paths this CPU runs, and a fixture that runs a test on each."""
from __future__ import annotations

import pytest

from zero_offload.kernels import cpu_adam as ca

_ORDER = ["scalar", "avx2", "avx512"]
LEVELS = _ORDER[:_ORDER.index(ca.best_simd_level()) + 1]


@pytest.fixture(params=LEVELS)
def level(request):
    """The test runs once per SIMD path (restored afterwards)."""
    prev = ca.set_simd_level(request.param)
    yield request.param
    ca.set_simd_level(prev)
