#!/usr/bin/env bash
# One prepared run that checks and measures the CUDA path on a lent GPU (at most ~420 s:
# the cuda tests within 150 s, the measurements within 240 s, so a second try fits in 15 minutes).
#
#   bash scripts/gpu_check.sh            # results under $OUT when set
#   bash scripts/gpu_check.sh --dry-run  # the same steps on the CPU, tiny sizes (tests/test_scripts.py)
#
# Without CUDA it exits 0 at once: "no CUDA device; skipped".  The GPU machine has
# no network: if pyzmq / msgpack / Cython are missing there, carry wheels in .whl/
# (see README, "Checking the CUDA path"); they are installed into /tmp/site.
# Steps: build the extension in place, run the tests marked `cuda`, run
# scripts/gpu_bench.py (bandwidth, model-state memory, step time, capacity),
# print a compact table last.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=""
[ "${1:-}" = "--dry-run" ] && DRY="--dry-run"
if [ -z "$DRY" ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA device; skipped"
  exit 0
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# what the run has to work with (the lent VM's RAM starts small and grows as it is used)
df -h /dev/shm | tee "$OUT/shm.txt"
free -g | tee "$OUT/free.txt"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
# The lent machine is a VM whose RAM grows as it is used: MemTotal starts far below
# its 128 GiB, so the server's MemAvailable check would refuse the 1.5B model's shard.
export ZERO_OFFLOAD_MAX_RAM_FRACTION=0
HOST_GIB=${HOST_GIB:-128}
# fail in seconds, not after the build, when a dependency did not travel
if ! "$PY" -c "import zmq, msgpack, Cython, pytest, pytest_timeout" 2>"$OUT/imports.log"; then
  echo "missing Python packages there: $(tail -1 "$OUT/imports.log")"
  echo "pyzmq is not in the H200 image and this repository carries no wheels: copy them into .whl/ here"
  echo "(git-excluded), name .whl in the run's carry, e.g. for Python 3.12:"
  echo "  echo /.whl/ >> .git/info/exclude"
  echo "  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\"
  echo "    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl pyzmq"
  exit 1
fi
[ -z "$DRY" ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== build"
if ! "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"; exit 1
fi
"$PY" -c "from cython_ext import cpu_adam as c; print('simd', c.simd_level(), 'openmp', c.openmp_enabled())"
echo "== cuda tests"
timeout 150 "$PY" -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tee "$OUT/cuda_tests.log" | tail -15
tests_rc=${PIPESTATUS[0]}
echo "== measurements"
# size the 1.5B run (4 B/param of shared segment, 16 of host RAM) to what /dev/shm has
SIZE=""
SHM_GIB=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
if [ -z "$DRY" ] && [ "${SHM_GIB:-0}" -lt 12 ]; then
  SIZE="--layers 12"; echo "/dev/shm has ${SHM_GIB} GiB free: a 12-layer model instead of 48"
fi
timeout 240 "$PY" scripts/gpu_bench.py $DRY $SIZE --out "$OUT" --host-gib "$HOST_GIB" 2>&1 | tee "$OUT/gpu_bench.log" | tail -25
bench_rc=${PIPESTATUS[0]}
echo "cuda tests rc=$tests_rc, bench rc=$bench_rc; full results in $OUT"
exit $(( tests_rc != 0 || bench_rc != 0 ))
