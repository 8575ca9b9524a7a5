#!/usr/bin/env bash
# One prepared run that checks and measures the CUDA path on a lent GPU, and always
# prints a table within 300 s (a lent H200 has 15 minutes in all, starts included, so
# this first run may be the only one):
#
#   bash scripts/gpu_check.sh            # results under $OUT when set
#   bash scripts/gpu_check.sh --dry-run  # the same steps on the CPU, tiny sizes (tests/test_scripts.py)
#   bash scripts/gpu_check.sh --big      # a second call: a model GPU-only cannot hold, trained with
#                                        # offload (gpu_bench.py --big); --big --dry-run on the CPU
#
# Without CUDA it exits 0 at once: "no CUDA device; skipped".  The GPU machine has
# no network: pyzmq is not in its image, so carry the wheel in .whl/ (docs/gpu.md);
# it is installed into /tmp/site.
# Budget: machine facts (s), build (<= 60 s, skipped when a carried build matches the
# sources), the cuda tests (<= 90 s: 30 s per test, 30 s per request), the CPU update
# alone at the server's thread count (<= 45 s; about 15 s on 16 cores), the measurements
# (<= 120 s, each variant in its own try/except, JSON after each), the summary table
# from the JSON (even if the measurements were killed).
# GPU_CHECK_BENCH_S overrides the measurements' bound (the dry-run test kills one mid-way).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DRY=""
BIG=""
for arg in "$@"; do
  [ "$arg" = "--dry-run" ] && DRY="--dry-run"
  [ "$arg" = "--big" ] && BIG="--big"
done
if [ -z "$DRY" ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA device; skipped"
  exit 0
fi
T0=$SECONDS
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
echo "== machine"
# one file for the machine's facts: a lent machine returns at most 8 files from $OUT
{ [ -z "$DRY" ] && nvidia-smi 2>&1 | head -20
  df -h /dev/shm; free -g
  lscpu 2>/dev/null | grep -E "^Model name|^CPU\(s\)|^NUMA node\(s\)|^L3"; } | tee "$OUT/machine.txt"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# zero_offload without installing it (that machine has no network): a tree of links
# over the repository's folders, mapped as pyproject.toml maps them for pip
SHIM=$(mktemp -d)
mkdir -p "$SHIM/zero_offload"
for f in "$PWD"/runtime/*; do ln -s "$f" "$SHIM/zero_offload/"; done
ln -s "$PWD/optimizer_server" "$SHIM/zero_offload/server"
ln -s "$PWD/cython_ext" "$SHIM/zero_offload/kernels"
export PYTHONPATH=$SHIM:$PWD:${PYTHONPATH:-}
# The lent machine is a VM whose RAM grows as it is used: MemTotal starts far below
# its size, so the server's MemAvailable check would refuse the 1.5B model's shard.
export ZERO_OFFLOAD_MAX_RAM_FRACTION=0
# a hung request fails in 30 s, not the default 300 (which would eat the whole budget)
export ZERO_OFFLOAD_REQUEST_TIMEOUT_S=${ZERO_OFFLOAD_REQUEST_TIMEOUT_S:-30}
export ZERO_OFFLOAD_TEST_TIMEOUT_S=${ZERO_OFFLOAD_TEST_TIMEOUT_S:-30}
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
echo "== build"
# skip it when the built extension imports and was built from these very sources
SRC_HASH=$(cat cython_ext/cpu_adam.pyx cython_ext/*.h setup.py | sha256sum | cut -c1-16)
if "$PY" -c "from zero_offload.kernels import cpu_adam" 2>/dev/null && [ "$(cat cython_ext/.build-hash 2>/dev/null)" = "$SRC_HASH" ]; then
  echo "a carried build matches the sources: not rebuilt"
else
  if ! timeout 120 "$PY" setup.py build_ext --inplace -j "$(nproc)" >"$OUT/build.log" 2>&1; then
    tail -30 "$OUT/build.log"; exit 1
  fi
  echo "$SRC_HASH" > cython_ext/.build-hash
fi
"$PY" -c "from zero_offload.kernels import cpu_adam as c; print('simd', c.simd_level(), 'openmp', c.openmp_enabled())"
if [ -n "$BIG" ]; then
  echo "== the model GPU-only cannot hold ($((SECONDS - T0)) s so far)"
  LEFT=$(( 290 - (SECONDS - T0) ))
  timeout -k 10 "$(( LEFT < 60 ? 60 : LEFT ))" "$PY" scripts/gpu_bench.py --big $DRY --out "$OUT" 2>&1 \
    | tee "$OUT/gpu_big.log" | tail -8
  big_rc=${PIPESTATUS[0]}
  echo "big rc=$big_rc ($((SECONDS - T0)) s); results in $OUT/gpu_big.json"
  exit $big_rc
fi
echo "== cuda tests ($((SECONDS - T0)) s so far)"
# --timeout-method=thread: a hang inside C (NCCL, a stream sync) still ends with every thread's stack
timeout 100 "$PY" -m pytest -o addopts="" -v --durations=0 --timeout-method=thread -m cuda tests/test_cuda.py -p no:cacheprovider \
  2>&1 | tee "$OUT/cuda_tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error|slowest|[0-9]s (call|setup)" | tail -60
tests_rc=${PIPESTATUS[0]}
echo "== the CPU update at the server's threads ($((SECONDS - T0)) s so far)"
# the fp32-state update in the engine's progress blocks vs one call, at the thread count
# gpu_bench gives the server: what its "server update" per step should come near
NT=$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))
NCPU=256M; [ -n "$DRY" ] && NCPU=2M
timeout 45 "$PY" scripts/bench_adam.py --progress --sizes $NCPU --threads "$NT" --reps 5 --no-write 2>&1 \
  | tee "$OUT/cpu_update.txt" | tail -3
echo "== measurements ($((SECONDS - T0)) s so far)"
# size the 1.5B run (4 B/param of shared segment, 16 of host RAM) to what /dev/shm has
SIZE=""
SHM_GIB=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
if [ -z "$DRY" ] && [ "${SHM_GIB:-0}" -lt 12 ]; then
  SIZE="--layers 12"; echo "/dev/shm has ${SHM_GIB} GiB free: a 12-layer model instead of 48"
fi
LEFT=$(( 285 - (SECONDS - T0) ))
BENCH_S=${GPU_CHECK_BENCH_S:-$(( LEFT < 30 ? 30 : LEFT ))}
INJECT=""
[ -n "$DRY" ] && INJECT="--inject-failure"
# the dry-run test of the kill path: a variant that hangs, so the bound stops the bench mid-way
[ -n "$DRY" ] && [ -n "${GPU_CHECK_INJECT_HANG:-}" ] && INJECT="$INJECT --inject-hang"
# SIGTERM at the bound: the bench prints the table of what finished; KILL 10 s later
timeout -k 10 "$BENCH_S" "$PY" scripts/gpu_bench.py $DRY $INJECT $SIZE --out "$OUT" \
  --deadline-s $(( BENCH_S > 40 ? BENCH_S - 30 : BENCH_S / 2 )) 2>&1 | tee "$OUT/gpu_bench.log" | grep -v "^|" | tail -25
bench_rc=${PIPESTATUS[0]}
echo "== summary ($((SECONDS - T0)) s)"
if [ -f "$OUT/gpu_results.json" ]; then
  "$PY" scripts/gpu_bench.py --summary "$OUT/gpu_results.json"
else
  echo "the measurements wrote no results (see $OUT/gpu_bench.log)"
fi
echo "cuda tests rc=$tests_rc, bench rc=$bench_rc; full results in $OUT"
exit $(( tests_rc != 0 || bench_rc != 0 ))
