# The two commands: `make demo` and `make test`. Everything else is set up on
# the way: a .venv with torch 2.13 (CPU) and the test tools, GoogleTest, and
# an incremental CMake build of the core and the torch extension.
SHELL := /bin/bash
PY_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BUILD := build
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: all demo test test-cpp test-py test-asan cuda-compile fuzz fuzz-ci fuzz-build fuzz-deps build bench stress gpu-check gpu-bench doctor lint format clean deps

all: build

# The bytecode must be there: Python writes none of its own where
# PYTHONDONTWRITEBYTECODE is set (as on our and CI's machines) and would compile
# torch again in every process (without it the Python tests took 1.6x as long).
# pip compiles on one core, half its time; compileall on every core (100 -> 77 s
# here). Its status is not looked at (a few files in the packages do not
# compile; pip skips those too), but torch's bytecode must be there.
$(VENV)/.ready: requirements-dev.txt
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null
	$(PY) -m pip install -q --no-compile torch==$(TORCH_VERSION)
	$(PY) -m pip install -q --no-compile -r requirements-dev.txt
	$(PY) -m compileall -q -j0 $(VENV)/lib >/dev/null 2>&1 || true
	@ls $(VENV)/lib/python3*/site-packages/torch/__pycache__/__init__.*.pyc >/dev/null 2>&1 || \
	  { echo "error: compileall left torch without bytecode"; exit 1; }
	touch $@

# GoogleTest for the C++ tests, and UCX for the ucx transport (Debian
# packages; needs root, as CI has). Without UCX the build leaves that
# transport out, and `python -m mooncake doctor` says so.
deps:
	@if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then \
	  echo "installing libgtest-dev"; \
	  (apt-get update -qq && apt-get install -y -qq libgtest-dev) >/dev/null || \
	  echo "warning: could not install libgtest-dev; C++ tests will be skipped"; \
	fi
	@if ! pkg-config --exists ucx 2>/dev/null; then \
	  echo "installing libucx-dev"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends libucx-dev pkgconf) \
	    >/dev/null || echo "warning: could not install libucx-dev; the ucx transport is left out"; \
	fi

# The device library (CUDA) is built in $(BUILD) only where a GPU can run it
# or torch has CUDA (whose binding needs it). Elsewhere `make cuda-compile`
# builds it with nvcc (warnings as errors) in its own tree and `make test` runs
# its host-side tests there: compiling the kernels twice took a few minutes of
# a CI run.
TORCH_CUDA = $(shell $(PY) -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null)
BUILD_CUDA ?= $(if $(shell nvidia-smi -L 2>/dev/null)$(TORCH_CUDA),AUTO,OFF)

# The C++ test files at -O0, as in test-asan: optimising them was over a
# quarter of this build's time, and the tests spend theirs in the core.
$(BUILD)/build.ninja: CMakeLists.txt $(VENV)/.ready | deps
	cmake -S . -B $(BUILD) -G Ninja -DPython3_EXECUTABLE=$(abspath $(PY)) \
	  -DMOONCAKE_CUDA=$(BUILD_CUDA) -DMOONCAKE_TEST_COMPILE_OPTIONS=-O0 >/dev/null

build: $(BUILD)/build.ninja
	cmake --build $(BUILD)
	@$(PY) -c "import site,os; open(os.path.join(site.getsitepackages()[0],'mooncake-dev.pth'),'w').write(os.path.abspath('python')+'\n')"

test: build test-cpp test-py

# The device library's tests run here too (build/mooncake_device_tests where
# this tree has CUDA, else build-nvcc's, built by cuda-compile where nvcc is
# found): those that need a GPU skip without one (make gpu-check runs them on
# one, and fails on any skip); the others check host-side logic.
test-cpp: build
	@if [ -x $(BUILD)/mooncake_tests ]; then cd $(BUILD) && ctest --output-on-failure -j2; \
	else echo "C++ tests not built (GoogleTest missing)"; exit 1; fi
	@if [ -x $(BUILD)/mooncake_device_tests ]; then $(BUILD)/mooncake_device_tests --gtest_brief=1; \
	elif command -v nvcc >/dev/null; then $(MAKE) --no-print-directory cuda-compile && \
	  build-nvcc/mooncake_device_tests --gtest_brief=1; \
	else echo "device library tests not built (no CUDA toolkit)"; fi

# The C++ tests (core only: no torch, no CUDA) built with AddressSanitizer and
# UndefinedBehaviorSanitizer: any report fails the run. The ucx variants of
# the transport tests are left out here: under ASan's timing, Debian's UCX
# 1.13 has aborted on assertions inside its own wireup (ucp_request.c:684 in
# ucp_worker_destroy; wireup_ep pending_count), not in our code. They run in
# the release build (make test-cpp), and hostile_ucx_test runs here. So do
# the two longest tests (a thousand-rank agreement, every truncation of a
# record: 60 and 54 s here, half of this run's test time), whose code runs
# here in shorter tests and, for the records, under the fuzzer (fuzz-ci).
ASAN_BUILD := build-asan
SANITIZE := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
test-asan: | deps
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DMOONCAKE_BUILD_TORCH=OFF -DMOONCAKE_CUDA=OFF \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
	  -DCMAKE_CXX_FLAGS="$(SANITIZE)" -DCMAKE_EXE_LINKER_FLAGS="$(SANITIZE)" \
	  -DMOONCAKE_TEST_COMPILE_OPTIONS=-O0 >/dev/null
	cmake --build $(ASAN_BUILD)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1 \
	  UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j2 \
	  -E '/ucx$$|AgreementAtScale.ThousandRanks|ViewRecord.EveryTruncation' $(ASAN_CTEST_ARGS)

# The CUDA half compiled with nvcc (no GPU needed), as CI does; the GPU machine
# builds and runs it for real (make gpu-check).
cuda-compile:
	bash scripts/cuda_compile.sh

# libFuzzer targets (tests/fuzz/*_fuzz.cc) over the tcp frame decoder and the
# store's records, built with clang + ASan + UBSan. `make fuzz` runs each for
# FUZZ_SECONDS (all at once, one per core), starting from the corpus in
# tests/fuzz/corpus; `make fuzz-ci` is the bounded run CI does.
FUZZ_BUILD := build-fuzz
FUZZ_CXX ?= clang++-19
FUZZ_SECONDS ?= 600
FUZZ_FLAGS := -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
fuzz-deps:
	@if ! command -v $(FUZZ_CXX) >/dev/null; then \
	  echo "installing clang-19 (for libFuzzer)"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends clang-19 libclang-rt-19-dev) >/dev/null || \
	  { echo "error: could not install clang-19; make fuzz needs it"; exit 1; }; \
	fi

fuzz-build: fuzz-deps
	cmake -S . -B $(FUZZ_BUILD) -G Ninja -DCMAKE_CXX_COMPILER=$(FUZZ_CXX) -DMOONCAKE_BUILD_TORCH=OFF \
	  -DMOONCAKE_CUDA=OFF -DMOONCAKE_BUILD_TESTS=OFF -DMOONCAKE_BUILD_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DCMAKE_CXX_FLAGS="$(FUZZ_FLAGS)" >/dev/null
	cmake --build $(FUZZ_BUILD) --target mooncake_fuzz

fuzz: fuzz-build
	bash scripts/fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

fuzz-ci: fuzz-build
	bash scripts/fuzz.sh $(FUZZ_BUILD) 30

test-py: build
	$(PY) -m pytest tests/python bench/tests -q $(PYTEST_ARGS)

demo: build
	$(PY) -m mooncake demo
	$(PY) examples/moe_layer.py
	$(PY) examples/elastic_ep.py

bench: build
	$(BUILD)/mooncake_reduce_bench
	$(BUILD)/mooncake_latency_bench
	$(PY) bench/bench_pg.py
	$(PY) bench/bench_p2p.py
	$(PY) bench/bench_recovery.py
	$(PY) bench/bench_hosts.py
	$(PY) bench/bench_ep.py
	$(PY) bench/bench_elastic.py
	$(PY) bench/bench_ep_device.py --if-gpu
	$(PY) bench/bench_pg_cuda.py --if-gpu
	$(PY) bench/bench_ep_failover.py --if-gpu
	$(PY) bench/bench_elastic_buffer.py --if-gpu

stress: build
	MOONCAKE_STRESS=1 $(PY) -m pytest tests/python -q -m stress $(PYTEST_ARGS)

doctor: build
	$(PY) -m mooncake doctor

# On the GPU machine (see scripts/gpu_check.sh): build + every GPU test; build + benchmarks.
gpu-check:
	bash scripts/gpu_check.sh

gpu-bench:
	GPU_STEPS=benches bash scripts/gpu_check.sh

CXX_SOURCES = $(shell find src tests/cpp tests/fuzz bench/micro -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh')

lint: $(VENV)/.ready
	$(VENV)/bin/ruff check python tests bench examples tools
	$(VENV)/bin/ruff format --check python tests bench examples tools
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)

format: $(VENV)/.ready
	$(VENV)/bin/ruff format python tests bench examples tools
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

clean:
	rm -rf $(BUILD) build-nvcc python/mooncake/_pg_torch*.so
