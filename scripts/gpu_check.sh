#!/usr/bin/env bash
# The whole GPU-machine run (device tool): build against that machine's torch
# (CUDA), then doctor, the C++ tests, the Python tests and a quick benchmark.
# Writes logs to $OUT (default /tmp/mooncake-gpu-out).
#   device run: bash scripts/gpu_check.sh
# That machine has no GoogleTest and no package registry: carry its sources
# (`cp -r /usr/src/googletest/googletest .gtest` here, after `make deps`; the
# device call names .gtest in carry), and the C++ tests are built from them.
# GPU_STEPS picks steps (the build always runs, incrementally), so a run can be split over
# device calls; "tests" stands for the test steps, "benches" for the benchmark steps:
#   tests   (the default, make gpu-check): doctor cpp device py elastic pgcuda epdev epelastic
#           ephtdev chaos, about 22 minutes on one H200 (the Python step 4 files at a time);
#           on an H100 (11b192d), to split it over device calls of at most 10 minutes: a cold
#           build 144 s, doctor + cpp 13, device 94, epdev 220, ephtdev 104, py 280, elastic
#           17, pgcuda 208, epelastic 264, chaos 50 (e.g. "doctor cpp device ephtdev epdev",
#           then "py elastic pgcuda", then "epelastic chaos"); a cold build of the module alone
#           (GPU_BUILD=module) 76 s on c08b030, 115 s on 853277e (the mapped all_reduce in
#           every reduction's kernel: 35-54 s a type file), each target's in $OUT/build_times.txt;
#   benches (make gpu-bench): bench pgbench epelasticbench epprof ebprof epbench epfail epht.
#   smoke:   (not in the default) the code built but not yet run on a GPU, a few minutes: see below;
#   compare: (not in the default) an older commit against this tree, side by side: a
#            checkout of it in .baseline/ (carried: `git worktree add .baseline REV`, or
#            `git archive REV | tar -x -C .baseline`) is built as this tree is, then the EP
#            device benchmark (world 1, and COMPARE_EP_WORLDS under MPS) and the CUDA
#            backend's (COMPARE_PG_WORLDS (2) under MPS; COMPARE_PG_OPS, COMPARE_PG_SIZES)
#            run for old and new in turn, COMPARE_ROUNDS times
#            (COMPARE_BENCHES picks among "ep1 ep pg eb"; eb, the ElasticBuffer's benchmark
#            at COMPARE_EB_WORLDS (1,2) under MPS with COMPARE_EB_ARGS, only when named),
#            so that both meet the same machine; JSON under $OUT/compare/{old,new}N-{ep1,ep,pg,eb}/.
#   device:  the device library without torch (build-gpu-core: no torch on its include
#            path): tests/cpp/device (1-3 processes on the GPU) and the C++ example (3
#            processes, a rank killed), without MPS as every kill test here (MPS reports a
#            killed client's fault to all); a test that skips fails the step.
#   pgcuda:  the "mooncake" backend on CUDA tensors: tests/python/test_cuda_backend.py, the
#            collective matrix and a rank-kill run on CUDA tensors (1-4 processes on the
#            GPU), compute-sanitizer over a 2-process round and a mapped all_reduce round
#            (PG_SANITIZE_TOOLS); the
#            multi_gpu tests (ranks on different GPUs) only with 2 GPUs visible to torch,
#            else deselected, which the summary says;
#   pgbench: bench/bench_pg_cuda.py (against gloo and NCCL; again under MPS);
#   epdev:   the EP device path: tests/python/test_ep_device.py and the engine pattern
#            (test_engine_pattern.py, CUDA tensors) at 1, 2, 4 processes on the GPU, under
#            MPS when it starts, then compute-sanitizer
#            (EP_SANITIZE_TOOLS, default "memcheck racecheck") over a world-1 round;
#   epelastic: the elastic EP buffer on the device path: tests/python/test_ep_elastic_device.py
#            (growth and the connection contract under MPS, kills and replacements without
#            it; 1-4 processes on the GPU), then compute-sanitizer (EP_ELASTIC_SANITIZE_TOOLS,
#            default "memcheck racecheck") over a short contract timeline with masked slots;
#   ephtdev: the ElasticBuffer's device path: tests/python/test_elastic_buffer_device.py (every
#            argument combination at 1, 2, 4 processes under MPS, against the routing model and
#            the portable path; the kill-and-replace test without MPS), then compute-sanitizer
#            (EPHT_SANITIZE_TOOLS, default "memcheck racecheck") over a 2-process round
#            (tests/python/support/ht_device_round.py), again with MOONCAKE_EP_HT_ONE_COPY=1
#            unless EPHT_ONE_COPY_SANITIZE=0;
#   chaos:   the chaos soak, tests/python/test_gpu_chaos.py on CUDA tensors: 4 processes on
#            the GPU, CHAOS_CYCLES (40) random kills, stops past the hang limit and slow
#            ranks, every one replaced, EP (Buffer and elastic, BF16 and FP8) and the
#            collectives checked after every join; without MPS (it kills ranks inside their
#            kernels), the launch bounded by CHAOS_BUDGET_S (300); CHAOS_WORLDS ("4"): "8"
#            or "4 8" runs the world-8 soak (8 processes; e.g. CHAOS_CYCLES=20) as well;
#   epelasticbench: bench_ep_device.py at 2 processes with a process group's buffer and
#            with an elastic one of capacity 8 (MPS); then bench_elastic.py --device cuda
#            (BENCH_ELASTIC_CUDA_ARGS, default --quick): staging, activating and replacing a
#            slot on the device path, 4 processes under MPS;
#   epprof:  bench/profile_ep_device.py: host time per layer and each kernel's time;
#   ebprof:  bench/profile_elastic_buffer.py: the same for the ElasticBuffer's device path at
#            world 1 (T=512 and 4096), with the Python functions its host time goes to, then
#            at 2 processes under MPS (whole calls), and again with each grid size in
#            EBPROF_SMS (num_sms; none by default); EBPROF_W2_TOKENS: the 2-process run's
#            tokens (512,4096); EBPROF_NO_MPS=1: that run again without MPS;
#   mapceil: (not in the default) bench/mapped_ceiling.py: a large all_reduce's candidate
#            algorithms' data movement alone (torch's kernels, peers' tensors mapped), under
#            MPS at MAPCEIL_WORLDS (2,4), MAPCEIL_MIB (64) MiB;
#   mapprof: (not in the default) bench/profile_mapped.py: where a large eager all_reduce's
#            time goes (host, kernels, a call's timeline) on the plane and the mapped path,
#            under MPS at MAPPROF_WORLDS (2,4), MAPPROF_MIB (64) MiB;
#   epncu:   (not in the default) Nsight Compute sections over a few EP kernel launches;
#   killsoak: (not in the default) the GPU kill tests run again and again, without MPS, to
#            measure how often a rare timing fails: KILLSOAK_RUNS (10) runs of each of
#            KILLSOAK_TESTS (the elastic buffer's, the ElasticBuffer's and the CUDA backend's
#            kill tests), within KILLSOAK_BUDGET_S (420) seconds in all; counts in
#            $OUT/killsoak.txt, every failed run's output in $OUT/killsoak_failures.log;
#   micro:   (not in the default) bench/micro/gpu_latency.cu: what the kernels' signalling
#            primitives cost on this GPU (host-mapped reads, system-scope loads, stores and
#            fences, __nanosleep, a ping-pong between two kernels); $OUT/gpu_latency.txt;
#   epbench: upstream Mooncake's EP kernels (its wheel from .whl/, when carried) and
#            bench/bench_ep_device.py at world 1, then at 2, 4 and 8 processes under
#            MPS (EP_WORLDS) and 2 without it (EP_WORLDS_NO_MPS);
#   epfail:  bench/bench_ep_failover.py at EPFAIL_WORLDS (4) processes: kills between EP
#            steps and between replays of a captured all_reduce, SIGSTOPs and a busy rank
#            under MPS, then kills inside a dispatch and
#            inside a 64 MiB all_reduce without it (MPS fails every client when a process
#            dies inside a kernel); EPFAIL_KILLS (3) kills per mode, world and timeout,
#            EPFAIL_STOPS (1), EPFAIL_HEALTHY_STEPS (60), EPFAIL_ARGS: more arguments
#            (both halves; e.g. --timeouts-us 10000000), EPFAIL_LOGS=1: each process's
#            output with the heartbeat's debug lines in $OUT/bench/epfail_logs; each half ends itself after
#            EPFAIL_TIME_S (150) seconds; EPFAIL_HALVES ("between inside"): which halves run; JSON under $OUT/bench/epfail_mps/ and $OUT/bench/epfail/;
#   epht:    the high-throughput ElasticBuffer: upstream's at world 1 (its wheel from .whl/, when
#            carried; UPSTREAM_EB_DEADLINE_S, 300) and bench/bench_elastic_buffer.py --quick at
#            EB_WORLDS (1,2,4) processes under MPS, T=512/1024/4096, BF16 and FP8, against the
#            copy floor and the Buffer, each world bounded to EB_LAUNCH_S (100), all to 330 s;
#            JSON in $OUT/bench/elastic_buffer*.json. EB_ONE_COPY ("" : the default): values of
#            MOONCAKE_EP_HT_ONE_COPY to run in turn (e.g. "0 1", side by side), each into
#            $OUT/bench/onecopy<v>/ (upstream's run once). EB_ARGS: more of the bench's arguments
#            (e.g. "--tokens 4096 --no-buffer").
# GPU_DEADLINE_S: steps not begun by then are not run (see wants); GPU_BUILD=module: the build
# makes the Python module alone (see the build step).
# PYTEST_PATHS: what the Python step runs (default tests/python bench/tests, less the tests the
# GPU steps run: the CUDA backend's, the EP device path's, the elastic device tests); PYTEST_ARGS: more
# arguments, but no -k: a selection goes in PYTEST_K, which each step ANDs with its own.
# The GPU steps run with MOONCAKE_NO_SKIP=1: a test that skips there fails (nothing tested);
# without a GPU visible to torch, or with a build without CUDA, every GPU step fails unrun.
# The run ends with a summary of what each step ran ($OUT/summary.txt).
# BENCH_PG_CUDA_ARGS / BENCH_PG_CUDA_MPS_ARGS: arguments of bench_pg_cuda.py without and
# with MPS (default: world 1, every backend and op; under MPS worlds 2 and 4 without NCCL).
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
GPU_TESTS="doctor cpp device py elastic pgcuda epdev epelastic ephtdev chaos"
GPU_BENCHES="bench pgbench epelasticbench epprof ebprof epbench epfail epht"
STEPS=" ${GPU_STEPS:-tests} "
STEPS=${STEPS/ tests / $GPU_TESTS }
STEPS=" ${STEPS/ benches / $GPU_BENCHES } "
GTEST_ARGS=()
[ -f .gtest/CMakeLists.txt ] && GTEST_ARGS=(-DMOONCAKE_GTEST_SOURCE="$PWD/.gtest")
step() { echo "== $1 (${SECONDS}s into the run)"; }
case " ${PYTEST_ARGS:-} " in
  *" -k "* | *" -k="* | *" -k"[!\ ]*)
    echo "error: PYTEST_ARGS has a -k, which would replace the steps' own selections: use PYTEST_K"
    exit 2 ;;
esac
# sel OWN: the -k arguments of a step whose own selection is OWN ("" for none), with PYTEST_K.
sel() {
  if [ -n "$1" ] && [ -n "${PYTEST_K:-}" ]; then printf '%s\n' -k "($1) and ($PYTEST_K)"
  elif [ -n "$1" ]; then printf '%s\n' -k "$1"
  elif [ -n "${PYTEST_K:-}" ]; then printf '%s\n' -k "$PYTEST_K"
  fi
}
# pyt SECONDS ARGS...: pytest under a time limit; where PYTEST_K narrows a step's tests to
# none (pytest's exit 5), the step ran nothing by request, which is not a failure.
pyt() {
  local limit=$1 rc
  shift
  timeout "$limit" "$PY" -m pytest "$@"
  rc=$?
  if [ "$rc" = 5 ] && [ -n "${PYTEST_K:-}" ]; then
    echo "(PYTEST_K selected none of these tests)"
    return 0
  fi
  return "$rc"
}
mapfile -t SEL_ALL < <(sel "")
mapfile -t SEL_CUDA < <(sel "cuda")
mapfile -t SEL_KILLS < <(sel "kills")
mapfile -t SEL_NOT_KILLS < <(sel "not kills")
# The Python step runs the suite minus what the GPU steps run (pgcuda, epdev, epelastic, ephtdev,
# chaos).
PY_OWN="not test_collective_cuda and not test_kill_world4_cuda and not (test_engine_pattern and cuda) and not (test_gpu_chaos and cuda)"
mapfile -t SEL_PY < <(sel "$PY_OWN")
PY_IGNORE=(--ignore=tests/python/test_cuda_backend.py --ignore=tests/python/test_ep_device.py
  --ignore=tests/python/test_ep_elastic_device.py --ignore=tests/python/test_elastic_buffer_device.py)
# sanitize SCRIPT LOG_STEM TOOL...: the script under each compute-sanitizer tool, its
# log in $OUT/LOG_STEM_TOOL.log; any error fails the run.
sanitize() {
  local script=$1 stem=$2 tool rc
  shift 2
  for tool in "$@"; do
    timeout "${SANITIZE_TIMEOUT_S:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$PY" "$script" \
      >"$OUT/${stem}_$tool.log" 2>&1
    rc=$?
    echo "$tool: exit $rc ($(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|$(basename "$script" .py)" \
      "$OUT/${stem}_$tool.log" | tail -2 | tr '\n' ' '))"
    # A rank (a child process) reports its own summary; its errors fail the run too.
    if grep -qE "(ERROR|RACECHECK) SUMMARY: [1-9]" "$OUT/${stem}_$tool.log"; then
      echo "$tool: errors reported (${stem}_$tool.log)"; rc=9
    fi
    [ $rc = 0 ] || status=1
  done
}
# GPU_DEADLINE_S: a step not begun by then (seconds into the run) is not run, and the
# summary says so, so that a call cut short by its own time limit still ends with one
# (a step already begun runs on: set it below the limit by the longest step's time).
wants() {
  [[ "$STEPS" == *" $1 "* ]] || return 1
  if [ -n "${GPU_DEADLINE_S:-}" ] && [ "$SECONDS" -ge "$GPU_DEADLINE_S" ]; then
    if [[ " ${LATE:-} " != *" $1 "* ]]; then  # (said once per step)
      LATE+=" $1"
      echo "== $1: not run, past GPU_DEADLINE_S (${GPU_DEADLINE_S} s)"
      NOT_RUN_TESTS+="$1: not run, past GPU_DEADLINE_S"$'\n'
      status=1
    fi
    return 1
  fi
}
# csv_count LIST: how many comma-separated items LIST has (launches to bound).
csv_count() { echo "$1" | tr ',' ' ' | wc -w; }
# run_upstream TITLE LOG_STEM TAIL SCRIPT ARGS...: SCRIPT with upstream Mooncake's package
# (its wheel from .whl/, installed once into /tmp/upstream-site; its own PYTHONPATH, as both
# packages are named mooncake), its log in $OUT/LOG_STEM.log; without the wheel, says so.
run_upstream() {
  local title=$1 stem=$2 lines=$3
  shift 3
  if ! ls .whl/mooncake_transfer_engine_cuda13-*.whl >/dev/null 2>&1; then
    echo "no upstream wheel in .whl/: its column is skipped"
    return
  fi
  step "$title"
  [ -d /tmp/upstream-site/mooncake ] || "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/upstream-site .whl/mooncake_transfer_engine_cuda13-*.whl 2>&1 | tail -2
  env PYTHONPATH=/tmp/upstream-site CXX=/usr/bin/g++ "$PY" "$@" 2>&1 | tee "$OUT/$stem.log" | tail -"$lines"
}

# Several processes on one GPU run their kernels side by side only under MPS
# (without it they time-slice: correct, milliseconds per round trip).
MPS_ON=0
start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mooncake-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mooncake-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d 2>&1; then MPS_ON=1; echo "MPS started"; else echo "MPS did not start: running without it"; fi
}
stop_mps() {
  if [ "$MPS_ON" = 1 ]; then echo quit | nvidia-cuda-mps-control; MPS_ON=0; sleep 1; echo "MPS stopped"; fi
}
trap stop_mps EXIT

step "machine"
{ nvidia-smi || true; nproc; "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'; } 2>&1 | tee "$OUT/machine.txt"

step "build"
# Build with the system g++, whose libstdc++ is the one torch loads: a
# toolchain that links its own libstdc++ statically (the image's CXX points at
# one) puts a second copy of the C++ runtime in the module, and iostreams then
# crash inside torch's process.
CXX_BIN=${MOONCAKE_CXX:-/usr/bin/g++}
echo "compiler: $CXX_BIN ($("$CXX_BIN" --version | head -1)); CXX in env: ${CXX:-unset}"
# nvcc compiles host code with its host compiler, which defaults to $CXX: the same one.
export CXX="$CXX_BIN" CUDAHOSTCXX="$CXX_BIN"
if [ -f build-gpu/CMakeCache.txt ] && ! grep -q "CMAKE_CUDA_HOST_COMPILER:.*=$CXX_BIN\$" build-gpu/CMakeCache.txt; then
  rm -rf build-gpu  # configured with another host compiler (cached; cannot change in place)
fi
cmake -S . -B build-gpu -G Ninja -DPython3_EXECUTABLE="$(command -v "$PY")" \
  -DCMAKE_CXX_COMPILER="$CXX_BIN" -DCMAKE_CUDA_HOST_COMPILER="$CXX_BIN" "${GTEST_ARGS[@]}" \
  -DMOONCAKE_PYTHON_DIR="$PWD/python/mooncake" 2>&1 | tee "$OUT/build.log" >/dev/null || status=1
# GPU_BUILD=module: the Python module alone (for steps that run no C++ test binary:
# py, pgcuda, epdev, ephtdev, epht, epfail, chaos and the like), a shorter cold build.
BUILD_TARGET=()
[ "${GPU_BUILD:-all}" = module ] && BUILD_TARGET=(--target mooncake_module)
cmake --build build-gpu -j"$(nproc)" "${BUILD_TARGET[@]}" 2>&1 | tee -a "$OUT/build.log" | tail -3 || status=1
# Where a cold build's minutes go (a device call's budget): each target's compile time,
# the slowest first (ninja's log: start and end in ms, then the output; it appends, so
# after an incremental build the list mixes that build's lines with the cold one's).
[ -f build-gpu/.ninja_log ] && awk -F'\t' 'NR > 1 { printf "%7.1f s  %s\n", ($2 - $1) / 1000, $4 }' \
  build-gpu/.ninja_log | sort -rn | head -25 > "$OUT/build_times.txt"
# A second C++ runtime inside the module crashes in iostreams: say so plainly.
so=$(ls python/mooncake/_pg_torch*.so 2>/dev/null | head -1)
if [ -n "$so" ] && nm -C --defined-only "$so" 2>/dev/null | grep -q "std::basic_ostream<char, std::char_traits<char> >::_M_insert"; then
  echo "error: $so carries its own libstdc++ (a static C++ runtime was linked in)"; status=1
fi

# Everything after this tests the GPU: a machine whose torch sees none, or a build without
# CUDA, would otherwise pass on skips. Without them every GPU step fails, unrun, saying why.
GPU_WHY=$("$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/machine.txt" | tail -1
import torch
from mooncake.pg import _ext
gpu, cuda, ep = torch.cuda.is_available(), bool(_ext.build_info()["cuda"]), hasattr(_ext, "EpDevice")
print(f"GPU visible: {gpu}; CUDA build: {cuda}; EP device path: {ep}")
missing = [w for w, ok in (("no GPU visible to torch", gpu), ("a build without CUDA", cuda),
                           ("no EP device path in the build", ep)) if not ok]
print("; ".join(missing) or "ok")
PYEOF
)
echo "GPU check: $GPU_WHY"
[ "$GPU_WHY" = ok ] || status=1
# gpu_wants STEP: whether to run GPU step STEP; a wanted step fails here when the GPU check did.
gpu_wants() {
  wants "$1" || return 1
  [ "$GPU_WHY" = ok ] && return 0
  echo "== $1: FAILED, not run: $GPU_WHY"
  NOT_RUN+=" $1"
  status=1
  return 1
}

# smoke: (not in the default) a few minutes over what was built but never run on a GPU, so a
# session learns first whether the long steps are worth their time: the device-driven
# collectives eager and captured, the ElasticBuffer device path at 1 and 2 processes, the
# EP fencing canaries. Each part bounded; a skip fails, as in the other GPU steps.
if gpu_wants smoke; then
  step "smoke: device-driven collectives (eager, graph capture and replay)"
  # Worlds 1 and 2 only (the pgcuda step runs world 4 and the plane launches).
  mapfile -t SEL_SMOKE < <(sel "(direct_matches_host or graph_replay or graph_capture) and not multi_gpu and not plane and not w4")
  MOONCAKE_NO_SKIP=1 pyt 300 tests/python/test_cuda_backend.py "${SEL_SMOKE[@]}" -q -x \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest_smoke_direct.log" | tail -8 || status=1
  step "smoke: ElasticBuffer device path, 1 and 2 processes"
  # Deadlines of 20 s: a hang comes back as a masked peer and the kernels' report, well
  # inside the bound (a killed process says nothing). --wrap: rings that wrap round.
  for w in 1 2; do
    timeout 150 "$PY" tests/python/support/ht_device_round.py $w 20 --wrap 2>&1 \
      | tee "$OUT/smoke_ht_w$w.log" | tail -4 || status=1
  done
  step "smoke: EP fencing canaries"
  mapfile -t SEL_SMOKE < <(sel "fenced")
  MOONCAKE_NO_SKIP=1 pyt 300 tests/python/test_ep_device.py tests/python/test_ep_elastic_device.py \
    "${SEL_SMOKE[@]}" -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_smoke_fence.log" | tail -8 || status=1
fi

wants doctor && step "doctor" && { "$PY" -m mooncake doctor 2>&1 | tee "$OUT/doctor.txt" || status=1; }

if ! wants cpp; then
  :
elif [ -x build-gpu/mooncake_tests ]; then
  step "C++ tests"
  # Without ucx (the GPU image has none) its hostile-input tests are replaced by one that
  # skips to say so: left out here, and named in the summary, so that no test skips.
  CTEST_EXCLUDE=()
  if build-gpu/mooncake_tests --gtest_list_tests 2>/dev/null | grep -q "NotInThisBuild"; then
    CTEST_EXCLUDE=(-E '^HostileUcx\.NotInThisBuild$')
    NOT_RUN_TESTS+="cpp: the ucx transport's tests not built: no ucx on this machine"$'\n'
  fi
  (cd build-gpu && ctest --output-on-failure -j8 "${CTEST_EXCLUDE[@]}") 2>&1 | tee "$OUT/ctest.log" | tail -5 || status=1
else
  echo "error: GoogleTest not available here (carry .gtest/): C++ tests not run" | tee "$OUT/ctest.log"
  status=1
fi

# The device library as a C++ user builds it: no torch anywhere on the include path.
if gpu_wants device; then
  step "device library without torch"
  cmake -S . -B build-gpu-core -G Ninja -DMOONCAKE_BUILD_TORCH=OFF -DMOONCAKE_CUDA=ON \
    -DCMAKE_CXX_COMPILER="$CXX_BIN" -DCMAKE_CUDA_HOST_COMPILER="$CXX_BIN" "${GTEST_ARGS[@]}" \
    >"$OUT/build_core.log" 2>&1 || status=1
  cmake --build build-gpu-core -j"$(nproc)" --target mooncake_device_example mooncake_device_tests \
    >>"$OUT/build_core.log" 2>&1 || { status=1; tail -20 "$OUT/build_core.log"; }
  timeout 400 build-gpu-core/mooncake_device_tests 2>&1 | tee "$OUT/device_tests.log" | tail -6 || status=1
  grep -q "^\[  PASSED  \]" "$OUT/device_tests.log" || status=1
  if grep -q "^\[  SKIPPED \]" "$OUT/device_tests.log"; then echo "error: device tests skipped"; status=1; fi
  timeout 120 build-gpu-core/mooncake_device_example 3 2>&1 | tee "$OUT/device_example.log" | tail -4 || status=1
fi

# The Python step runs its files PY_JOBS at a time (default: a quarter of the cores, at most 4;
# 1 runs the suite as one pytest, as make test does): on the GPU machine's 16 cores that
# takes the step from about 5 minutes to under 2. Largest files first, so the tail is short;
# each file's output lands in pytest.log in turn, with its own count line for the summary.
# Files that check this machine's /dev/shm for leaks (PY_SERIAL) run alone, after the others.
PY_SERIAL="tests/python/test_groups.py tests/python/test_fault_tolerance.py"
py_files() {
  local p
  for p in ${PYTEST_PATHS:-tests/python bench/tests}; do
    if [ -d "$p" ]; then find "$p" -maxdepth 1 -name 'test_*.py'; else echo "$p"; fi
  done | grep -vxF -f <(printf '%s\n' "${PY_IGNORE[@]#--ignore=}") | xargs ls -S
}
py_file() {  # FILE: one file's run, its log beside the others, its status in a .rc file
  local log="$OUT/py/$(echo "$1" | tr / _).log"
  "$PY" -m pytest "$1" "${SEL_PY[@]}" -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} >"$log" 2>&1
  local rc=$?
  [ $rc = 5 ] && rc=0  # no tests selected in this file (the selection left none)
  echo $rc >"$log.rc"
}
PY_JOBS=${PY_JOBS:-$(( $(nproc) / 4 > 4 ? 4 : ($(nproc) / 4 < 1 ? 1 : $(nproc) / 4) ))}
if wants py; then
  step "Python tests ($PY_JOBS at a time)"
  # Two tests need what a GPU machine may lack (a git checkout; network namespaces). They
  # would skip, which reads as tested; here they are deselected and the summary says so
  # (make test runs them in CI).
  if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    PY_OWN+=" and not test_no_tracked_file_refers_outside_the_repository"
    NOT_RUN_TESTS+="py: test_no_tracked_file_refers_outside_the_repository not run (deselected): not a git checkout"$'\n'
  fi
  why=$("$PY" -c 'import sys; sys.path.insert(0, "tools"); import hosts; print(hosts.reason())' 2>&1 | tail -1)
  if [ -n "$why" ]; then
    PY_OWN+=" and not test_across_hosts"
    NOT_RUN_TESTS+="py: test_across_hosts not run (deselected): $why"$'\n'
  fi
  mapfile -t SEL_PY < <(sel "$PY_OWN")
  printf '%s' "${NOT_RUN_TESTS:-}"
  if [ "$PY_JOBS" -le 1 ]; then
    "$PY" -m pytest ${PYTEST_PATHS:-tests/python bench/tests} "${PY_IGNORE[@]}" "${SEL_PY[@]}" -q -rs \
      -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -15 || status=1
  else
    rm -rf "$OUT/py" && mkdir -p "$OUT/py"
    export -f py_file && export PY OUT PYTEST_ARGS && export SEL_PY_K="${SEL_PY[1]:-}"
    py_files | grep -vxF -f <(printf '%s\n' $PY_SERIAL) \
      | xargs -P "$PY_JOBS" -I{} bash -c 'SEL_PY=(); [ -n "$SEL_PY_K" ] && SEL_PY=(-k "$SEL_PY_K"); py_file "$1"' _ {}
    for f in $(py_files | grep -xF -f <(printf '%s\n' $PY_SERIAL)); do py_file "$f"; done
    : >"$OUT/pytest.log"
    for log in "$OUT"/py/*.log; do
      { echo "--- $(basename "$log" .log)"; cat "$log"; } >>"$OUT/pytest.log"
      rc=$(cat "$log.rc" 2>/dev/null || echo 1)
      if [ "$rc" != 0 ]; then echo "FAILED: $(basename "$log" .log) (exit $rc)"; tail -20 "$log"; status=1; fi
    done
    n=$(ls "$OUT"/py/*.log | wc -l)
    echo "$n files: $(grep -hoE '[0-9]+ (passed|failed|skipped|error)' "$OUT"/py/*.log \
      | awk '{n[$2]+=$1} END {for (k in n) printf "%d %s ", n[k], k}')"
    grep -qE '^[0-9]+ passed' "$OUT/pytest.log" || { echo "error: the Python step ran no test"; status=1; }
  fi
fi

# The elastic EP buffer with CUDA tensors (staged through host memory).
if gpu_wants elastic; then
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
if gpu_wants pgcuda; then
  step "CUDA backend: tests"
  # The multi_gpu tests need 2 GPUs; with fewer they would skip, which fails here.
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -1)
  [[ "$gpus" =~ ^[0-9]+$ ]] || gpus=0
  SEL_PGCUDA=("${SEL_CUDA[@]}") pgcuda_s=1200  # their two launches take time of their own
  if [ "$gpus" -lt 2 ]; then
    pgcuda_s=900
    mapfile -t SEL_PGCUDA < <(sel "cuda and not multi_gpu")
    note="pgcuda: multi_gpu tests not run (deselected): torch sees $gpus GPU(s), they need 2"
    echo "$note"
    NOT_RUN_TESTS+="$note"$'\n'
  fi
  MOONCAKE_NO_SKIP=1 pyt $pgcuda_s tests/python/test_cuda_backend.py tests/python/test_collectives.py \
    tests/python/test_fault_tolerance.py "${SEL_PGCUDA[@]}" -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest_cuda.log" | tail -15 || status=1
  step "CUDA backend: compute-sanitizer"
  sanitize tests/python/support/cuda_backend_round.py sanitizer_pg ${PG_SANITIZE_TOOLS-memcheck racecheck}
  # The mapped all_reduce's kernel (off by default, so not in the round above).
  sanitize tests/python/support/mapped_round.py sanitizer_mapped ${PG_SANITIZE_TOOLS-memcheck racecheck}
fi

if gpu_wants pgbench; then
  step "CUDA backend: benchmark (no MPS, then MPS at 2 and 4 processes)"
  mkdir -p "$OUT/bench/mps"
  # Each launch bounded, and the JSON and table written after each: a step cut short
  # keeps what it measured. Without MPS world 1 only (NCCL's column: it refuses two
  # ranks on one GPU); processes share the GPU under MPS.
  timeout 240 "$PY" bench/bench_pg_cuda.py ${BENCH_PG_CUDA_ARGS:---worlds 1 --launch-timeout 100} \
    --out-dir "$OUT/bench" 2>&1 | tee "$OUT/bench_pg_cuda.log" | tail -30 || status=1
  start_mps
  timeout 300 "$PY" bench/bench_pg_cuda.py \
    ${BENCH_PG_CUDA_MPS_ARGS:---worlds 2,4 --backends mooncake,staged,gloo --launch-timeout 100} \
    --out-dir "$OUT/bench/mps" 2>&1 | tee "$OUT/bench_pg_cuda_mps.log" | tail -40 || status=1
  stop_mps
fi

if gpu_wants epdev; then
  step "EP device path: tests (MPS)"
  start_mps
  MOONCAKE_NO_SKIP=1 pyt 400 tests/python/test_ep_device.py "${SEL_ALL[@]}" -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest_ep_device.log" | tail -15 || status=1
  step "EP as engines drive it, CUDA tensors (MPS)"
  MOONCAKE_NO_SKIP=1 pyt 400 tests/python/test_engine_pattern.py "${SEL_CUDA[@]}" -q -p no:cacheprovider \
    ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_engine.log" | tail -15 || status=1
  stop_mps
  step "EP device path: compute-sanitizer"
  sanitize tests/python/support/ep_device_ranks.py sanitizer ${EP_SANITIZE_TOOLS-memcheck racecheck}
fi

if gpu_wants epelastic; then
  step "elastic EP buffer, device path: tests (growth and contract under MPS, kills without)"
  # Under MPS a process killed while its kernel runs makes the server report a fatal
  # error to every client on the GPU (MPS shares fatal errors among a GPU's clients):
  # the kill test runs without it (docs/failures.md).
  start_mps
  MOONCAKE_NO_SKIP=1 pyt 900 tests/python/test_ep_elastic_device.py "${SEL_NOT_KILLS[@]}" -q \
    -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_ep_elastic_device.log" | tail -8 \
    || status=1
  stop_mps
  MOONCAKE_NO_SKIP=1 pyt 400 tests/python/test_ep_elastic_device.py "${SEL_KILLS[@]}" -q \
    -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee -a "$OUT/pytest_ep_elastic_device.log" | tail -8 \
    || status=1
  step "elastic EP buffer, device path: compute-sanitizer"
  sanitize tests/python/support/elastic_device_round.py sanitizer_elastic \
    ${EP_ELASTIC_SANITIZE_TOOLS-memcheck racecheck}
fi
if gpu_wants ephtdev; then
  step "ElasticBuffer device path: tests (rounds under MPS, the kill test without it)"
  # As epelastic: MPS reports a killed client's fault to every client on the GPU.
  start_mps
  MOONCAKE_NO_SKIP=1 pyt 1200 tests/python/test_elastic_buffer_device.py "${SEL_NOT_KILLS[@]}" -q \
    -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_elastic_buffer_device.log" | tail -15 || status=1
  stop_mps
  MOONCAKE_NO_SKIP=1 pyt 700 tests/python/test_elastic_buffer_device.py "${SEL_KILLS[@]}" -q \
    -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee -a "$OUT/pytest_elastic_buffer_device.log" | tail -8 || status=1
  step "ElasticBuffer device path: compute-sanitizer"
  sanitize tests/python/support/ht_device_round.py sanitizer_ht ${EPHT_SANITIZE_TOOLS-memcheck racecheck}
  # Again with one copy (offers, answers, reads of a peer's x in place); EPHT_ONE_COPY_SANITIZE=0: not.
  if [ "${EPHT_ONE_COPY_SANITIZE:-1}" != 0 ]; then
    export MOONCAKE_EP_HT_ONE_COPY=1
    sanitize tests/python/support/ht_device_round.py sanitizer_ht_onecopy \
      ${EPHT_SANITIZE_TOOLS-memcheck racecheck}
    unset MOONCAKE_EP_HT_ONE_COPY
  fi
fi
if gpu_wants chaos; then
  step "chaos soak on the GPU: kills, stops, slow ranks, replacements (no MPS: it kills inside kernels)"
  stop_mps
  # CHAOS_WORLDS: 4 (the default), 8 (the world-8 soak, a stress test elsewhere) or "4 8".
  chaos_w=" ${CHAOS_WORLDS:-4} " chaos_k="cuda and not world8"
  [[ $chaos_w == *" 8 "* ]] && chaos_k="cuda and world8"
  [[ $chaos_w == *" 8 "* && $chaos_w == *" 4 "* ]] && chaos_k="cuda"
  mapfile -t SEL_CHAOS < <(sel "$chaos_k")
  chaos_n=$(wc -w <<< "${CHAOS_WORLDS:-4}")
  MOONCAKE_STRESS=1 MOONCAKE_NO_SKIP=1 MOONCAKE_CHAOS_CYCLES=${CHAOS_CYCLES:-40} \
    MOONCAKE_CHAOS_BUDGET_S=${CHAOS_BUDGET_S:-300} \
    timeout $(( chaos_n * ${CHAOS_BUDGET_S:-300} + 60 )) "$PY" -m pytest tests/python/test_gpu_chaos.py "${SEL_CHAOS[@]}" -q -s \
    -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_chaos.log" | tail -25 || status=1
fi

if gpu_wants epelasticbench; then
  start_mps
  step "elastic EP buffer, device path: against a process group's buffer (2 processes, MPS)"
  mkdir -p "$OUT/bench"
  for cap in 0 8; do  # in a folder of their own: epbench writes ep_device.json too
    timeout 300 "$PY" bench/bench_ep_device.py --worlds 2 --experts 256 --quick --elastic $cap --launch-timeout 240 \
      --out-dir "$OUT/bench/elastic" 2>&1 | tee -a "$OUT/bench_ep_elastic.log" | tail -8 || status=1
  done
  step "elastic EP buffer, device path: stage, activate, replace (bench_elastic.py, MPS)"
  timeout 300 "$PY" bench/bench_elastic.py --device cuda ${BENCH_ELASTIC_CUDA_ARGS:---quick} \
    --out-dir "$OUT/bench" 2>&1 | tee "$OUT/bench_elastic_cuda.log" | tail -14 || status=1
  stop_mps
fi

if gpu_wants epprof; then
  step "EP device path: profile"
  mkdir -p "$OUT/bench"
  timeout 300 "$PY" bench/profile_ep_device.py --out "$OUT/bench/ep_profile.json" 2>&1 | tee "$OUT/ep_profile.log" | tail -60 || status=1
fi

# mapceil: (not in the default) bench/mapped_ceiling.py under MPS at MAPCEIL_WORLDS (2,4),
# 64 MiB: the data movement alone of the large all_reduce's candidate algorithms.
if wants mapceil; then
  step "large all_reduce: the candidates' data movement"
  mkdir -p "$OUT/bench"
  start_mps
  for w in $(echo "${MAPCEIL_WORLDS:-2,4}" | tr , ' '); do
    timeout 200 "$PY" bench/mapped_ceiling.py --world "$w" --mib "${MAPCEIL_MIB:-64}" \
      --out "$OUT/bench/mapceil_w$w.json" 2>&1 | tee "$OUT/mapceil_w$w.log" | tail -8 || status=1
  done
  stop_mps
fi

# mapprof: (not in the default) bench/profile_mapped.py under MPS: the plane and the mapped
# all_reduce split into host time, kernel time and one call's timeline.
if wants mapprof; then
  step "large all_reduce: where its time goes"
  mkdir -p "$OUT/bench"
  start_mps
  for w in $(echo "${MAPPROF_WORLDS:-2,4}" | tr , ' '); do
    timeout 200 "$PY" bench/profile_mapped.py --world "$w" --mib "${MAPPROF_MIB:-64}" \
      ${MAPPROF_ARGS:-} --out "$OUT/bench/mapprof_w$w.json" 2>&1 | tee "$OUT/mapprof_w$w.log" |
      tail -60 || status=1
  done
  stop_mps
fi

if gpu_wants ebprof; then
  step "ElasticBuffer device path: profile"
  mkdir -p "$OUT/bench"
  timeout 300 "$PY" bench/profile_elastic_buffer.py --out "$OUT/bench/eb_profile.json" 2>&1 |
    tee "$OUT/eb_profile.log" | tail -80 || status=1
  W2_TOKENS=${EBPROF_W2_TOKENS:-512,4096}
  start_mps
  timeout 300 "$PY" bench/profile_elastic_buffer.py --world 2 --tokens "$W2_TOKENS" \
    --out "$OUT/bench/eb_profile_w2.json" >"$OUT/eb_profile_w2.log" 2>&1 || status=1
  # EBPROF_SMS: more grid sizes for the 2-process run (e.g. "60 48 16"), one JSON each:
  # whether two processes' grids that fill the GPU between them are what slows it.
  for n in ${EBPROF_SMS:-}; do
    timeout 200 "$PY" bench/profile_elastic_buffer.py --world 2 --tokens 512 --num-sms "$n" \
      --out "$OUT/bench/eb_profile_w2_sms$n.json" >"$OUT/eb_profile_w2_sms$n.log" 2>&1 || status=1
  done
  stop_mps
  # EBPROF_NO_MPS=1: the 2-process run again without MPS (kernels time-sliced), against
  # which the MPS figures say whether the two processes' kernels ran side by side.
  if [ "${EBPROF_NO_MPS:-0}" = 1 ]; then
    timeout 300 "$PY" bench/profile_elastic_buffer.py --world 2 --tokens "$W2_TOKENS" \
      --out "$OUT/bench/eb_profile_w2_nomps.json" >"$OUT/eb_profile_w2_nomps.log" 2>&1 || status=1
  fi
fi

if gpu_wants micro; then
  step "signalling primitives: latency (bench/micro/gpu_latency.cu)"
  if nvcc -O3 -std=c++20 -arch=native -I src bench/micro/gpu_latency.cu -o "$OUT/gpu_latency.bin" \
    >"$OUT/gpu_latency_build.log" 2>&1; then
    timeout 120 "$OUT/gpu_latency.bin" 2>&1 | tee "$OUT/gpu_latency.txt" || status=1
    rm -f "$OUT/gpu_latency.bin"
  else
    cat "$OUT/gpu_latency_build.log"; status=1
  fi
fi

# Not in the default steps: Nsight Compute over a few warm dispatch and combine
# launches (T=128, H=7168, E=256: FP8 first), for tuning the kernels.
if gpu_wants epncu; then
  step "EP device path: Nsight Compute"
  if command -v ncu >/dev/null; then
    timeout 300 ncu --kernel-name regex:"dispatch_kernel|combine_kernel" --launch-skip ${NCU_SKIP:-40} \
      --launch-count ${NCU_COUNT:-4} --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
      "$PY" bench/profile_ep_device.py >"$OUT/ncu.txt" 2>&1
    echo "ncu: exit $? ($(grep -c 'Section: ' "$OUT/ncu.txt") sections in ncu.txt)"
  else
    echo "ncu not found: skipped"
  fi
fi

if gpu_wants compare; then
  if [ ! -f .baseline/CMakeLists.txt ]; then
    echo "compare: no checkout of the older commit in .baseline/"; status=1
  else
    step "compare: build the baseline ($(cat .baseline/REV 2>/dev/null || echo '?'))"
    (cd .baseline && cmake -S . -B build-gpu -G Ninja -DPython3_EXECUTABLE="$(command -v "$PY")" \
      -DCMAKE_CXX_COMPILER="$CXX_BIN" -DCMAKE_CUDA_HOST_COMPILER="$CXX_BIN" -DMOONCAKE_BUILD_TESTS=OFF \
      -DMOONCAKE_PYTHON_DIR="$PWD/python/mooncake" >/dev/null &&
      # The module alone where this tree's is alone (GPU_BUILD=module) and the older
      # commit names that target (9475732 on), else everything.
      BASE_TARGET=() &&
      if [ ${#BUILD_TARGET[@]} -gt 0 ] && cmake --build build-gpu --target help | grep -q '^mooncake_module:'; then
        BASE_TARGET=("${BUILD_TARGET[@]}")
      fi &&
      cmake --build build-gpu -j"$(nproc)" "${BASE_TARGET[@]}") \
      >"$OUT/build_baseline.log" 2>&1 || { status=1; tail -20 "$OUT/build_baseline.log"; }
    # One benchmark for one tree: its own scripts and package.
    compare_run() {  # TREE TAG ARGS...
      local tree=$1 tag=$2
      shift 2
      mkdir -p "$OUT/compare/$tag"
      (cd "$tree" && PYTHONPATH="$PWD/python" timeout 300 "$PY" "$@" --out-dir "$OUT/compare/$tag") \
        >"$OUT/compare/$tag.log" 2>&1 || { echo "compare: $tag $* failed"; status=1; }
    }
    COMPARE=${COMPARE_BENCHES:-ep1 ep pg}
    for round in $(seq 1 "${COMPARE_ROUNDS:-2}"); do
      for pair in ".baseline old" ". new"; do
        set -- $pair
        step "compare: $2, round $round"
        if [[ " $COMPARE " == *" ep1 "* ]]; then
          compare_run "$1" "$2$round-ep1" bench/bench_ep_device.py --worlds 1 --experts 256 --quick
        fi
        start_mps
        if [[ " $COMPARE " == *" ep "* ]]; then
          compare_run "$1" "$2$round-ep" bench/bench_ep_device.py --worlds "${COMPARE_EP_WORLDS:-4}" \
            --experts 256 --quick
        fi
        if [[ " $COMPARE " == *" eb "* ]]; then
          compare_run "$1" "$2$round-eb" bench/bench_elastic_buffer.py --device cuda --quick \
            --worlds "${COMPARE_EB_WORLDS:-1,2}" --launch-timeout 100 \
            ${COMPARE_EB_ARGS:---tokens 4096 --no-buffer --fp8 0}
        fi
        if [[ " $COMPARE " == *" pg "* ]]; then
          compare_run "$1" "$2$round-pg" bench/bench_pg_cuda.py --worlds "${COMPARE_PG_WORLDS:-2}" \
            --backends mooncake ${COMPARE_PG_SIZES:+--sizes "$COMPARE_PG_SIZES"} \
            --ops "${COMPARE_PG_OPS:-all_reduce,all_gather_into_tensor,reduce_scatter_tensor,all_to_all_single}"
        fi
        stop_mps
      done
    done
  fi
fi

if gpu_wants epbench; then
  mkdir -p "$OUT/bench"
  UP_JSON="$OUT/bench/ep_upstream.json"
  run_upstream "EP: upstream Mooncake's kernels (world 1)" bench_ep_upstream 12 bench/bench_ep_upstream.py \
    --deadline-s ${UPSTREAM_DEADLINE_S:-240} ${BENCH_UPSTREAM_ARGS:-} --out "$UP_JSON"
  step "EP device path: benchmark, world 1"
  # Each run's JSON under its own name (ep_device.json is removed first: a run that
  # wrote none leaves none, rather than an older run's under the new name).
  rm -f "$OUT/bench/ep_device.json"
  # Each world's launch bounded (EP_LAUNCH_S, 300), and each run as a whole: a hang costs
  # that world, not the step (the JSON is written after each world).
  EPL=${EP_LAUNCH_S:-300}
  timeout $(( EPL + 60 )) "$PY" bench/bench_ep_device.py ${BENCH_EP_DEVICE_ARGS:-} --worlds 1 \
    --upstream "$UP_JSON" --launch-timeout "$EPL" --out-dir "$OUT/bench" 2>&1 \
    | tee "$OUT/bench_ep_device.log" | tail -12 || status=1
  mv "$OUT/bench/ep_device.json" "$OUT/bench/ep_device_w1.json" 2>/dev/null
  if [ -n "${EP_WORLDS-2,4,8}" ]; then
    step "EP device path: benchmark, ${EP_WORLDS-2,4,8} processes (MPS)"
    start_mps
    n=$(csv_count "${EP_WORLDS-2,4,8}")
    timeout $(( n * EPL + 60 )) "$PY" bench/bench_ep_device.py ${BENCH_EP_DEVICE_ARGS:-} \
      --worlds "${EP_WORLDS-2,4,8}" --launch-timeout "$EPL" --out-dir "$OUT/bench" 2>&1 \
      | tee -a "$OUT/bench_ep_device.log" | tail -40 || status=1
    mv "$OUT/bench/ep_device.json" "$OUT/bench/ep_device_mps.json" 2>/dev/null
    stop_mps
  fi
  # Without MPS the processes' kernels take turns on the GPU: a short run, to
  # show the cost (EP_WORLDS_NO_MPS="" skips it).
  if [ -n "${EP_WORLDS_NO_MPS-2}" ]; then
    step "EP device path: benchmark, ${EP_WORLDS_NO_MPS-2} processes (no MPS)"
    n=$(csv_count "${EP_WORLDS_NO_MPS-2}")
    timeout $(( n * EPL + 60 )) "$PY" bench/bench_ep_device.py --experts 256 --iters 30 --warmup 3 \
      --worlds "${EP_WORLDS_NO_MPS-2}" --launch-timeout "$EPL" --out-dir "$OUT/bench" 2>&1 \
      | tee -a "$OUT/bench_ep_device.log" | tail -12 || status=1
    mv "$OUT/bench/ep_device.json" "$OUT/bench/ep_device_no_mps.json" 2>/dev/null
  fi
fi
if gpu_wants epfail; then
  mkdir -p "$OUT/bench/epfail_mps" "$OUT/bench/epfail"
  EPFAIL_S=${EPFAIL_TIME_S:-150}  # each half's bound; the bench ends itself at it, with stacks
  # World 4 by default (EPFAIL_WORLDS=4,8 adds 8): each half's launches past its time
  # limit are not run, which the JSON says.
  EPFAIL=(--device cuda --worlds "${EPFAIL_WORLDS:-4}" --kills "${EPFAIL_KILLS:-3}" --time-limit "$EPFAIL_S")
  # EPFAIL_LOGS=1: every process's output under $OUT/bench/epfail_logs, with the
  # heartbeat's debug lines (how each death was noticed, and when).
  EPFAIL_LOG_MPS=() EPFAIL_LOG=() EPFAIL_ENV=()
  if [ -n "${EPFAIL_LOGS:-}" ]; then
    mkdir -p "$OUT/bench/epfail_logs/mps" "$OUT/bench/epfail_logs/nomps"
    EPFAIL_LOG_MPS=(--log-dir "$OUT/bench/epfail_logs/mps") EPFAIL_LOG=(--log-dir "$OUT/bench/epfail_logs/nomps")
    EPFAIL_ENV=(MOONCAKE_LOG_LEVEL=debug)
  fi
  # EPFAIL_HALVES: which halves run (default both).
  HALVES=" ${EPFAIL_HALVES:-between inside} "
  if [[ $HALVES == *" between "* ]]; then
    step "EP failover: kills between steps and between graph replays, stops, a busy rank (MPS)"
    start_mps
    env "${EPFAIL_ENV[@]}" timeout $(( EPFAIL_S + 30 )) "$PY" bench/bench_ep_failover.py "${EPFAIL[@]}" --kill --modes between --graph --stop \
      --stops "${EPFAIL_STOPS:-1}" --healthy --healthy-steps "${EPFAIL_HEALTHY_STEPS:-60}" ${EPFAIL_ARGS:-} \
      "${EPFAIL_LOG_MPS[@]}" --out-dir "$OUT/bench/epfail_mps" 2>&1 | tee "$OUT/bench_ep_failover.log" | tail -30 || status=1
    stop_mps
  fi
  if [[ $HALVES == *" inside "* ]]; then
    # Without MPS: a process killed inside its kernel would make MPS fail every client.
    step "EP failover: kills inside a dispatch and inside a 64 MiB all_reduce (no MPS)"
    env "${EPFAIL_ENV[@]}" timeout $(( EPFAIL_S + 30 )) "$PY" bench/bench_ep_failover.py "${EPFAIL[@]}" --kill --modes inside --allreduce \
      ${EPFAIL_ARGS:-} "${EPFAIL_LOG[@]}" --out-dir "$OUT/bench/epfail" 2>&1 | tee -a "$OUT/bench_ep_failover.log" | tail -20 \
      || status=1
  fi
fi

if gpu_wants epht; then
  mkdir -p "$OUT/bench"
  UP_EB_JSON="$OUT/bench/elastic_buffer_upstream.json"
  run_upstream "ElasticBuffer: upstream's (world 1)" bench_elastic_buffer_upstream 10 \
    bench/bench_ep_upstream_elastic.py --quick --deadline-s "${UPSTREAM_EB_DEADLINE_S:-300}" \
    --out "$UP_EB_JSON"
  step "ElasticBuffer: benchmark, ${EB_WORLDS:-1,2,4} processes (MPS)"
  start_mps
  for one_copy in ${EB_ONE_COPY:-default}; do
    eb_out="$OUT/bench" eb_env=()
    if [ "$one_copy" != default ]; then
      eb_out="$OUT/bench/onecopy$one_copy" eb_env=(MOONCAKE_EP_HT_ONE_COPY="$one_copy")
      mkdir -p "$eb_out"
    fi
    # Each world bounded below the whole (results are written after each world).
    env "${eb_env[@]}" timeout 330 "$PY" bench/bench_elastic_buffer.py --device cuda --quick \
      --worlds "${EB_WORLDS:-1,2,4}" --launch-timeout "${EB_LAUNCH_S:-100}" --upstream "$UP_EB_JSON" \
      --out-dir "$eb_out" ${EB_ARGS:-} 2>&1 | tee -a "$OUT/bench_elastic_buffer.log" | tail -70 || status=1
  done
  stop_mps
fi

if gpu_wants killsoak; then
  step "kill soak: the GPU kill tests, ${KILLSOAK_RUNS:-10} runs each (no MPS: a kill inside a kernel)"
  soak_end=$((SECONDS + ${KILLSOAK_BUDGET_S:-420}))
  for t in ${KILLSOAK_TESTS:-tests/python/test_ep_elastic_device.py::test_kills_and_replacements_on_the_device \
      tests/python/test_elastic_buffer_device.py::test_kills_rank_mid_dispatch_then_replacement \
      tests/python/test_fault_tolerance.py::test_kill_world4_cuda}; do
    passed=0 failed=0
    for _ in $(seq "${KILLSOAK_RUNS:-10}"); do
      [ "$SECONDS" -lt "$soak_end" ] || break
      if MOONCAKE_NO_SKIP=1 pyt 150 "$t" -q -p no:cacheprovider \
          > "$OUT/killsoak_run.log" 2>&1; then
        passed=$((passed + 1))
      else
        failed=$((failed + 1))
        { echo "=== $t"; cat "$OUT/killsoak_run.log"; } >> "$OUT/killsoak_failures.log"
      fi
    done
    # A test that never ran (the budget spent first) fails the step as a failure does.
    echo "killsoak: $t: $passed passed, $failed failed" | tee -a "$OUT/killsoak.txt"
    [ "$failed" = 0 ] && [ "$passed" -gt 0 ] || status=1
  done
  rm -f "$OUT/killsoak_run.log"
fi

step "summary: what each step ran"
# One line per test run (its log, then pytest's or GoogleTest's count), so that a step that
# ran nothing, or skipped, shows here; written to $OUT/summary.txt too.
{
  for log in "$OUT"/pytest*.log "$OUT"/device_tests.log "$OUT"/ctest.log; do
    [ -f "$log" ] || continue
    grep -hE '^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error)|no tests ran|tests passed|\(Skipped\)$|^SKIPPED|^\[  (PASSED|FAILED|SKIPPED) +\]' "$log" \
      | sed "s|^|$(basename "$log"): |"
  done
  [ -f "$OUT/killsoak.txt" ] && cat "$OUT/killsoak.txt"
  [ -z "${NOT_RUN:-}" ] || echo "not run (GPU check: $GPU_WHY):$NOT_RUN"
  printf '%s' "${NOT_RUN_TESTS:-}"
  echo "gpu-check: $([ "$status" = 0 ] && echo passed || echo FAILED) (steps:${STEPS% })"
} | tee "$OUT/summary.txt"
exit $status
