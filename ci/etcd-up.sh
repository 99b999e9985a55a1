#!/usr/bin/env bash
# Starts an etcd for the tests (tests/ha.rs and the etcd store's unit tests)
# on 127.0.0.1, from Debian's etcd-server package (installed if missing),
# with a throwaway data directory. Prints, for the caller to eval:
#   export EPS_TEST_ETCD=127.0.0.1:PORT EPS_TEST_ETCD_PID=PID EPS_TEST_ETCD_DIR=DIR
# Stop it (and remove its directory) with: bash ci/etcd-up.sh --down PID DIR
# Exit 3 if etcd cannot be installed or does not start (tests then start
# their own, or skip saying so).
set -euo pipefail

if [ "${1:-}" = "--down" ]; then
    pid="${2:?--down PID DIR}"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    case "${3:-}" in /tmp/eps-ci-etcd.*) rm -rf "$3" ;; esac
    exit 0
fi

if ! command -v etcd >/dev/null; then
    echo "installing etcd-server" >&2
    if ! { apt-get update -qq -o DPkg::Lock::Timeout=300 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends etcd-server; } >&2; then
        echo "etcd-server could not be installed" >&2
        exit 3
    fi
fi

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
client="$(free_port)"
peer="$(free_port)"
dir="$(mktemp -d /tmp/eps-ci-etcd.XXXXXX)"
# Its own session, no inherited descriptors but its log: it outlives this script.
setsid etcd --name eps-ci --data-dir "$dir/data" \
    --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "eps-ci=http://127.0.0.1:$peer" >"$dir/etcd.log" 2>&1 </dev/null 9>&- &
pid=$!
for _ in $(seq 100); do
    if python3 -c 'import sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1], data=b"{}"), timeout=1)' \
        "http://127.0.0.1:$client/v3/maintenance/status" 2>/dev/null; then
        echo "etcd $(etcd --version | head -1 | awk '{print $3}') on 127.0.0.1:$client (pid $pid, log $dir/etcd.log)" >&2
        echo "export EPS_TEST_ETCD=127.0.0.1:$client EPS_TEST_ETCD_PID=$pid EPS_TEST_ETCD_DIR=$dir"
        exit 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
        break
    fi
    sleep 0.1
done
echo "etcd did not start:" >&2
tail -5 "$dir/etcd.log" >&2 || true
kill "$pid" 2>/dev/null || true
rm -rf "$dir"
exit 3
