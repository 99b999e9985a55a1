#!/usr/bin/env bash
# What a change costs on the data plane: builds `eps` at REV (in a worktree,
# into target/against) and as the tree is now (target/release), then runs the
# same benchmarks with each, interleaved, ROUNDS times, and prints each figure's
# median and the ratio now / REV (for times, below 1.00 is faster now).
# Usage: bash bench/against.sh REV [ROUNDS]   (default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: bash bench/against.sh REV [ROUNDS]}"
rounds="${2:-3}"
root="$PWD"
wt="$(mktemp -d)"
out="$(mktemp -d)"
trap 'git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1 || true; rm -rf "$out"' EXIT
echo "building eps at $rev (target/against) and as the tree is now (target/release)" >&2
git worktree add --detach "$wt" "$rev" >&2
(cd "$wt" && cargo build --release --locked --bin eps --target-dir "$root/target/against" >&2)
cargo build --release --locked --bin eps >&2
benches=(
    "pp4m-soft|pushpull --size 4MiB --iters 100 --transport soft|iter_ms_p50"
    "pp4m-shm|pushpull --size 4MiB --iters 100 --transport shm|iter_ms_p50"
    "pp64m-shm|pushpull --size 64MiB --iters 20 --transport shm|iter_ms_p50"
    "pp64m-2w|pushpull --size 64MiB --iters 20 --workers 2 --transport shm|iter_ms_p50"
    "sparse|sparse --rows 10M --keys 65536 --iters 10|pull_ms_p50"
)
for r in $(seq "$rounds"); do
    for v in now base; do
        bin=target/release/eps
        [ "$v" = base ] && bin=target/against/release/eps
        echo "round $r/$rounds: $v" >&2
        for b in "${benches[@]}"; do
            IFS='|' read -r name args key <<< "$b"
            # shellcheck disable=SC2086
            "$bin" bench $args --json | tail -n 1 >> "$out/$name-$v.json"
        done
    done
done
python3 - "$out" "$rev" "${benches[@]}" <<'PY'
import json, statistics, sys, os
d, rev = sys.argv[1], sys.argv[2]
for b in sys.argv[3:]:
    name, _, key = b.split("|")
    def med(v):
        rows = [json.loads(l) for l in open(os.path.join(d, f"{name}-{v}.json")) if l.strip()]
        return statistics.median(float(r[key]) for r in rows)
    now, base = med("now"), med("base")
    print(f"{name:10} {key}: now {now:.4g}, {rev} {base:.4g}, now/{rev} {now / base:.3f}")
PY
