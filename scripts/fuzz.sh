#!/usr/bin/env bash
# Runs every libFuzzer target in BUILD_DIR for SECONDS each, all at once,
# starting from tests/fuzz/corpus/<target> (never modified: new inputs go to
# BUILD_DIR/corpus/<target>). Fails when any target finds a crash, a leak, a
# sanitizer report or a broken check; the input is kept in
# BUILD_DIR/artifacts/ and its path printed. To add what a long run found to
# the repo's corpus: <target> -merge=1 tests/fuzz/corpus/<target> BUILD_DIR/corpus/<target>
set -uo pipefail
build=${1:?usage: fuzz.sh BUILD_DIR SECONDS}
seconds=${2:?usage: fuzz.sh BUILD_DIR SECONDS}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$build/artifacts"
# Symbolized stack traces when clang's symbolizer is there.
for s in /usr/lib/llvm-19/bin/llvm-symbolizer "$(command -v llvm-symbolizer)"; do
  [ -x "$s" ] && export ASAN_SYMBOLIZER_PATH=$s && break
done
pids=()
names=()
for bin in "$build"/*_fuzz; do
  name=$(basename "$bin")
  seeds="$root/tests/fuzz/corpus/$name"
  work="$build/corpus/$name"
  mkdir -p "$work"
  [ -d "$seeds" ] || { echo "fuzz: no corpus at $seeds"; exit 1; }
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$bin" "$work" "$seeds" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$build/artifacts/$name-" >"$build/$name.log" 2>&1 &
  pids+=($!)
  names+=("$name")
done
[ ${#pids[@]} -gt 0 ] || { echo "fuzz: no targets in $build"; exit 1; }
status=0
for i in "${!pids[@]}"; do
  name=${names[$i]}
  if wait "${pids[$i]}"; then
    runs=$(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$build/$name.log" | grep -o '[0-9]*$')
    cov=$(grep -o 'cov: [0-9]*' "$build/$name.log" | tail -1)
    echo "fuzz: $name ok: ${runs:-?} inputs in ${seconds} s, $cov, corpus $(ls "$build/corpus/$name" | wc -l) new + $(ls "$root/tests/fuzz/corpus/$name" | wc -l) seeds"
  else
    status=1
    echo "fuzz: $name FAILED; the end of its log ($build/$name.log):"
    tail -40 "$build/$name.log"
  fi
done
exit $status
