#!/usr/bin/env bash
# Fuzzes the C ABI with libFuzzer: crates/eps-capi/tests/c/fuzz_capi.c drives
# libeps's exported calls with generated arguments (tests/c/hostile.h) against
# a job hosted in the process. libeps is built with libFuzzer's coverage
# counters (stable rustc codegen flags; with --target so that build scripts
# are left alone) in target/fuzz-capi, the driver with
# clang's -fsanitize=fuzzer,address,undefined. A failed check or a crash
# stops the run with the input that caused it (in target/fuzz-capi/).
# Usage: ci/fuzz-capi.sh [SECONDS]  (default 60). Installs clang when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
if ! command -v clang-14 >/dev/null || [ ! -e /usr/lib/llvm-14/lib/clang/14.0.6/lib/linux/libclang_rt.fuzzer-x86_64.a ]; then
    apt-get update -qq -o DPkg::Lock::Timeout=300
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends clang-14 libclang-rt-14-dev
fi
out=target/fuzz-capi
mkdir -p "$out/corpus"
RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares" \
    cargo build --quiet --locked -p eps-capi --lib --target-dir "$out/build" --target x86_64-unknown-linux-gnu
lib="$out/build/x86_64-unknown-linux-gnu/debug"
clang-14 -std=c11 -g -O1 -Wall -Werror -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
    -I include -I crates/eps-capi/tests/c crates/eps-capi/tests/c/fuzz_capi.c \
    -L "$lib" -leps -lpthread -lm -Wl,-rpath,"$PWD/$lib" -o "$out/fuzz_capi"
echo "==> fuzzing the C ABI for ${secs}s"
cd "$out"
ASAN_OPTIONS=detect_leaks=0 EPS_CONTROL= ./fuzz_capi -max_total_time="$secs" -max_len=2048 -len_control=0 -timeout=120 -rss_limit_mb=8192 -print_final_stats=1 corpus
