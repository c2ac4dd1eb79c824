#!/usr/bin/env bash
# Builds the device library (mooncake_cuda: src/device and src/kernels, sm_90
# machine code and PTX), its tests and the C++ example with nvcc, warnings as
# errors, no GPU and no torch needed, so that a broken kernel or a device
# library that needs torch never lands. The GPU machine builds and runs them
# for real (scripts/gpu_check.sh). Build tree: build-nvcc/.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v "${NVCC:-nvcc}" >/dev/null || { echo "error: ${NVCC:-nvcc} not found (CUDA toolkit needed)"; exit 1; }
# The core, the tests and the example at -O0: nothing heavy runs from this
# tree, and it halves their compile time. The kernels keep the GPU build's
# -O3, the device library's host side -O2 (CMakeLists.txt: its warnings).
cmake -S . -B build-nvcc -G Ninja -DMOONCAKE_BUILD_TORCH=OFF -DMOONCAKE_CUDA=ON \
  -DCMAKE_CXX_FLAGS_RELEASE="-O0 -DNDEBUG" \
  -DMOONCAKE_CUDA_WERROR=ON ${NVCC:+-DCMAKE_CUDA_COMPILER=$NVCC} >/dev/null
targets=(mooncake_cuda mooncake_device_example)
grep -q "^mooncake_device_tests:\|build mooncake_device_tests:" build-nvcc/build.ninja && targets+=(mooncake_device_tests)
cmake --build build-nvcc --target "${targets[@]}"
# The signalling microbenchmark (gpu_check's micro step builds it on the GPU machine).
"${NVCC:-nvcc}" -O3 -std=c++20 -arch=sm_90 -Werror=all-warnings -Xcompiler=-Wall,-Werror -I src \
  -c bench/micro/gpu_latency.cu -o build-nvcc/gpu_latency.o
echo "nvcc: built ${targets[*]} without torch ($(nvcc --version | tail -1))"
