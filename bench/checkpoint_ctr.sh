#!/usr/bin/env bash
# The step-time cost of checkpoints during `eps train --model ctr`: the
# built-in click-through job (dense MLP, embedding rows in a sparse table)
# run alternately without and with --checkpoint-every N (default 100), RUNS
# times each (default 7); prints the median samples/s of each and their
# ratio. Usage: bench/checkpoint_ctr.sh [N] [RUNS] (EPS_BIN: the eps binary).
set -euo pipefail
every=${1:-100}
runs=${2:-7}
eps=${EPS_BIN:-target/release/eps}
dir=$(mktemp -d /tmp/eps-ckpt-bench.XXXXXX)
trap 'rm -rf "$dir"' EXIT
speed() { "$eps" train --model ctr --json --progress-every 1000000 "$@" 2>/dev/null | tail -1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["samples_per_s"])'; }
plain=(); saved=()
for _ in $(seq "$runs"); do
  plain+=("$(speed)")
  rm -rf "$dir/ck"
  saved+=("$(speed --checkpoint-every "$every" --checkpoint-dir "$dir/ck")")
done
python3 - "$every" "${plain[*]}" "${saved[*]}" <<'PY'
import statistics, sys
every, plain, saved = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
p, s = statistics.median(plain), statistics.median(saved)
print(f"eps train --model ctr: {p:,.0f} samples/s without checkpoints, {s:,.0f} with one every {every} steps (medians of {len(plain)} runs each)")
print(f"ratio {s / p:.3f}")
PY
