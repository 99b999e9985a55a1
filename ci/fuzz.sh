#!/usr/bin/env bash
# Fuzzes every decoder that reads network bytes (fuzz/fuzz_targets/) with libFuzzer.
# Usage: ci/fuzz.sh [SECONDS]  (default 60). Installs cargo-fuzz when missing. Runs on
# the stable toolchain by letting it accept the sanitizer flags (RUSTC_BOOTSTRAP=1).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
for target in $(RUSTC_BOOTSTRAP=1 cargo fuzz list); do
    echo "==> fuzzing $target for ${secs}s"
    RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" -- -max_total_time="$secs"
done
