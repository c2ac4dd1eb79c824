#!/usr/bin/env bash
# Compiles the CUDA half with nvcc, no GPU needed, so that a broken kernel
# never lands: every .cu under src/ (sm_90 machine code and PTX) and the CUDA
# runtime's host code (transport/cuda_ipc.cc). The GPU machine builds and runs
# them for real (scripts/gpu_check.sh). Objects go to build-nvcc/.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "error: $NVCC not found (CUDA toolkit needed)"; exit 1; }
out=build-nvcc
mkdir -p "$out"
flags=(-std=c++20 -O3 -Isrc -Xcompiler -Wall -Werror all-warnings
       -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90)
n=0
while IFS= read -r f; do
  "$NVCC" "${flags[@]}" -c "$f" -o "$out/$(basename "$f").o"
  n=$((n + 1))
done < <(find src -name '*.cu' | sort)
# Host code through nvcc too: it knows where the toolkit's headers are.
"$NVCC" -std=c++20 -O2 -Isrc -Xcompiler -Wall,-Wextra,-Werror -x cu \
  -c src/transport/cuda_ipc.cc -o "$out/cuda_ipc.o"
echo "nvcc: compiled $n CUDA files and the cuda_ipc transport ($("$NVCC" --version | tail -1))"
