"""Helpers shared by the tests: seeded random numbers, references, models, workers.

    seeded_rng()     a NumPy Generator seeded from the running test's id (logged)
    reference        plain-PyTorch references the engine is tested against
    models           the small models and batches the engine tests train
    simd             the SIMD paths this CPU runs, and a fixture over them
    state_files      the server's checkpointed arrays, each in its dtype
    dist_worker      a training worker for the multi-rank tests (run under the launcher)
    fault_worker     a training worker for the crash tests
"""
from __future__ import annotations

import os
import zlib

import numpy as np

SEED_ENV = "ZO_TEST_SEED"  # set it to draw other numbers (CI leaves it unset: the same ones every run)


def seed_for_test() -> int:
    """A seed fixed per test (its pytest id), mixed with $ZO_TEST_SEED; printed, so a
    failing test's output names the numbers it drew."""
    node = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    seed = zlib.crc32(node.encode()) ^ int(os.environ.get(SEED_ENV, "0"))
    print(f"seed {seed} for {node or '?'} (reproduce: {SEED_ENV}={os.environ.get(SEED_ENV, '0')})")
    return seed


def seeded_rng() -> np.random.Generator:
    return np.random.default_rng(seed_for_test())
