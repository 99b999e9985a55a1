#!/usr/bin/env bash
# Measures the soft fabric against this machine's limits, in the same run:
#   - loopback TCP bandwidth: iperf3, one stream, 1 MiB writes;
#   - TCP ping-pong round trip: sockperf, 64 B messages, busy-polling client
#     (--nonblocked) and blocking server, round trip not halved (--full-rtt); and,
#     as a stricter reference, the same with the server busy-polling too (the
#     fabric's progress thread spins for a while after activity before it sleeps);
# then `eps bench fabric` 4 MiB WRITE bandwidth (depth 8) and 64 B WRITE latency
# (depth 1, full round trip). Runs are interleaved; prints each run, the medians,
# and the ratios, and as the last line one JSON object.
#
# Usage: bench/fabric_vs_limits.sh [RUNS]   (default 5; needs iperf3 and sockperf,
# which it installs from Debian's packages when missing)
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${1:-5}
SECS=${SECS:-3}

need=()
command -v iperf3 >/dev/null || need+=(iperf3)
command -v sockperf >/dev/null || need+=(sockperf)
command -v python3 >/dev/null || need+=(python3)
if [ ${#need[@]} -gt 0 ]; then
    echo "installing ${need[*]} ..." >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

cargo build --release --quiet --bin eps
EPS=target/release/eps

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
json_field() { python3 -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])[sys.argv[1]])' "$1"; }

iperf_gbytes() {
    local port; port=$(free_port)
    iperf3 -s -1 -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    iperf3 -c 127.0.0.1 -p "$port" -l 1M -t "$SECS" -J \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/8e9)'
    wait "$srv" 2>/dev/null || true
}

sockperf_rtt_us() {  # $1: extra server flags
    local port; port=$(free_port)
    # shellcheck disable=SC2086
    sockperf server --tcp -i 127.0.0.1 -p "$port" ${1:-} >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    sockperf ping-pong --tcp -i 127.0.0.1 -p "$port" -m 64 -t "$SECS" --mps=max --full-rtt --nonblocked 2>&1 \
        | sed -n 's/.*percentile 50.000 = *\([0-9.]*\).*/\1/p'
    kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null || true
}

declare -a TCP_BW TCP_RTT TCP_RTT_SPIN EPS_BW EPS_LAT
for i in $(seq 1 "$RUNS"); do
    TCP_BW+=("$(iperf_gbytes)")
    EPS_BW+=("$($EPS bench fabric --op write --size 4MiB --iters 1000 --depth 8 --json 2>/dev/null | json_field bw_gbytes_per_s)")
    TCP_RTT+=("$(sockperf_rtt_us)")
    TCP_RTT_SPIN+=("$(sockperf_rtt_us --nonblocked)")
    EPS_LAT+=("$($EPS bench fabric --op write --size 64 --iters 50000 --depth 1 --json 2>/dev/null | json_field lat_us_p50)")
    printf 'run %d: iperf3 %.3f GB/s | eps write 4MiB %.3f GB/s | sockperf rtt p50 %.2f us (both polling %.2f) | eps write 64B p50 %.2f us\n' \
        "$i" "${TCP_BW[-1]}" "${EPS_BW[-1]}" "${TCP_RTT[-1]}" "${TCP_RTT_SPIN[-1]}" "${EPS_LAT[-1]}"
done

python3 - "${TCP_BW[*]}" "${EPS_BW[*]}" "${TCP_RTT[*]}" "${EPS_LAT[*]}" "${TCP_RTT_SPIN[*]}" <<'EOF'
import json, statistics, sys
tcp_bw, eps_bw, tcp_rtt, eps_lat, tcp_rtt_spin = ([float(x) for x in a.split()] for a in sys.argv[1:6])
m = statistics.median
bw_ratio = m(eps_bw) / m(tcp_bw)
lat_ratio = m(eps_lat) / m(tcp_rtt)
print()
print(f"{'':34}{'median':>10}{'target':>14}")
print(f"{'iperf3 loopback (GB/s)':34}{m(tcp_bw):10.3f}")
print(f"{'eps write 4 MiB depth 8 (GB/s)':34}{m(eps_bw):10.3f}")
print(f"{'  ratio to iperf3':34}{bw_ratio:10.3f}{'>= 0.90':>14}  {'PASS' if bw_ratio >= 0.9 else 'MISS'}")
print(f"{'sockperf ping-pong rtt p50 (us)':34}{m(tcp_rtt):10.2f}")
print(f"{'eps write 64 B p50 (us)':34}{m(eps_lat):10.2f}")
print(f"{'  ratio to sockperf':34}{lat_ratio:10.3f}{'<= 1.25':>14}  {'PASS' if lat_ratio <= 1.25 else 'MISS'}")
print(f"{'sockperf, server polling too (us)':34}{m(tcp_rtt_spin):10.2f}   (stricter reference: both sides busy-poll)")
print(f"{'  ratio to that':34}{m(eps_lat) / m(tcp_rtt_spin):10.3f}")
print(json.dumps({"runs": len(tcp_bw), "iperf3_gbytes_per_s": m(tcp_bw), "write_4mib_gbytes_per_s": m(eps_bw),
                  "bw_ratio": round(bw_ratio, 4), "sockperf_rtt_us_p50": m(tcp_rtt), "write_64b_lat_us_p50": m(eps_lat),
                  "lat_ratio": round(lat_ratio, 4),
                  "sockperf_both_polling_rtt_us_p50": m(tcp_rtt_spin), "lat_ratio_both_polling": round(m(eps_lat) / m(tcp_rtt_spin), 4)}))
EOF
