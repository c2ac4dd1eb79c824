#!/usr/bin/env bash
# The whole GPU-machine run (device tool): build against that machine's torch
# (CUDA), then doctor, the C++ tests when GoogleTest is there, the Python tests
# and a quick benchmark. Writes logs to $OUT (default /tmp/mooncake-gpu-out).
#   device run: bash scripts/gpu_check.sh
# GPU_STEPS picks steps (default all: "doctor cpp py elastic bench"; the build always
# runs, incrementally), so a run can be split over two device calls.
# PYTEST_PATHS: what the Python step runs (default tests/python); PYTEST_ARGS: more.
# BENCH_EP_ARGS: arguments of bench_ep.py (default --quick); BENCH_ELASTIC_ARGS of
# bench_elastic.py (default: none, the full run, about a minute).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mooncake-gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
STEPS=" ${GPU_STEPS:-doctor cpp py elastic bench} "
step() { echo "== $1"; }
wants() { [[ "$STEPS" == *" $1 "* ]]; }

step "machine"
{ nvidia-smi || true; nproc; "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'; } 2>&1 | tee "$OUT/machine.txt"

step "build"
# Build with the system g++, whose libstdc++ is the one torch loads: a
# toolchain that links its own libstdc++ statically (the image's CXX points at
# one) puts a second copy of the C++ runtime in the module, and iostreams then
# crash inside torch's process.
CXX_BIN=${MOONCAKE_CXX:-/usr/bin/g++}
echo "compiler: $CXX_BIN ($("$CXX_BIN" --version | head -1)); CXX in env: ${CXX:-unset}"
cmake -S . -B build-gpu -G Ninja -DPython3_EXECUTABLE="$(command -v "$PY")" \
  -DCMAKE_CXX_COMPILER="$CXX_BIN" \
  -DMOONCAKE_PYTHON_DIR="$PWD/python/mooncake" 2>&1 | tee "$OUT/build.log" >/dev/null
cmake --build build-gpu -j"$(nproc)" 2>&1 | tee -a "$OUT/build.log" | tail -3 || status=1

wants doctor && step "doctor" && { "$PY" -m mooncake doctor 2>&1 | tee "$OUT/doctor.txt" || status=1; }

if ! wants cpp; then
  :
elif [ -x build-gpu/mooncake_tests ]; then
  step "C++ tests"
  (cd build-gpu && ctest --output-on-failure -j8) 2>&1 | tee "$OUT/ctest.log" | tail -5 || status=1
else
  echo "GoogleTest not available here: C++ tests skipped" | tee "$OUT/ctest.log"
fi

wants py && step "Python tests" && { "$PY" -m pytest ${PYTEST_PATHS:-tests/python} -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -15 || status=1; }

# The elastic EP buffer with CUDA tensors (staged through host memory).
if wants elastic; then
  step "elastic EP, CUDA tensors"
  "$PY" examples/elastic_ep.py --device cuda 2>&1 | tee "$OUT/elastic_cuda.log" | tail -8 || status=1
fi

wants bench && step "benchmark"
if wants bench && [ -f bench/bench_pg.py ]; then
  "$PY" bench/bench_pg.py --quick --out-dir "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -40 || status=1
fi
if wants bench && [ -f bench/bench_recovery.py ]; then
  "$PY" bench/bench_recovery.py --quick --out-dir "$OUT/bench" 2>&1 | tee "$OUT/bench_recovery.log" | tail -30 || status=1
fi
if wants bench && [ -f bench/bench_ep.py ]; then
  "$PY" bench/bench_ep.py ${BENCH_EP_ARGS---quick} --out-dir "$OUT/bench" 2>&1 | tee "$OUT/bench_ep.log" | tail -30 || status=1
fi
if wants bench && [ -f bench/bench_elastic.py ]; then
  "$PY" bench/bench_elastic.py ${BENCH_ELASTIC_ARGS-} --out-dir "$OUT/bench" 2>&1 | tee "$OUT/bench_elastic.log" | tail -14 || status=1
fi
exit $status
