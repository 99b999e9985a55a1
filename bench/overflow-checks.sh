#!/usr/bin/env bash
# What `overflow-checks = true` in [profile.release] costs: builds `eps` with
# and without it (the latter in target/nocheck), then runs `eps bench agg` and
# `eps bench pushpull` with each, interleaved, ROUNDS times, and prints the
# median of each figure and the ratio checked / unchecked (1.00: no cost).
# Usage: bash bench/overflow-checks.sh [ROUNDS]   (default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
echo "building eps with overflow checks (target/release) and without (target/nocheck)" >&2
cargo build --release --locked --bin eps >&2
CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=false cargo build --release --locked --bin eps --target-dir target/nocheck >&2
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for r in $(seq "$rounds"); do
    for v in checked nocheck; do
        bin=target/release/eps
        [ "$v" = nocheck ] && bin=target/nocheck/release/eps
        echo "round $r/$rounds: $v" >&2
        "$bin" bench agg --json | tail -n 1 >> "$out/agg-$v.json"
        "$bin" bench pushpull --size 4MiB --iters 200 --json | tail -n 1 >> "$out/pp4m-$v.json"
        "$bin" bench pushpull --size 4KiB --iters 500 --json | tail -n 1 >> "$out/pp4k-$v.json"
    done
done
python3 - "$out" <<'PY'
import json, statistics, sys, os
d = sys.argv[1]
def med(name, key):
    rows = [json.loads(l) for l in open(os.path.join(d, name)) if l.strip()]
    return statistics.median(float(r[key]) for r in rows)
for bench, key, unit, better in [("agg", "gbytes_per_s", "GB/s", "higher"),
                                 ("pp4m", "iter_ms_p50", "ms", "lower"),
                                 ("pp4k", "iter_ms_p50", "ms", "lower")]:
    c, n = med(f"{bench}-checked.json", key), med(f"{bench}-nocheck.json", key)
    print(f"{bench:5} {key}: checked {c:.4g} {unit}, unchecked {n:.4g} {unit}, checked/unchecked {c / n:.3f} ({better} is better)")
PY
