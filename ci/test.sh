#!/usr/bin/env bash
# The project's test command: installs what it needs on a fresh Debian 12 machine,
# then runs the format check, clippy with warnings denied, and every test.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

# Tools: the Rust toolchain is expected (rustup); rustfmt, clippy and nextest are
# added when missing.
if ! command -v cargo >/dev/null; then
    echo "cargo not found: install Rust (https://rustup.rs) first" >&2
    exit 1
fi
for comp in rustfmt clippy; do
    if ! cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
        step "installing $comp"
        rustup component add "$comp"
    fi
done
if ! cargo nextest --version >/dev/null 2>&1; then
    step "installing cargo-nextest"
    cargo install cargo-nextest --locked
fi

# The guide (docs/, an mdBook) is built and its links checked by tests/docs.rs:
# mdbook from crates.io, built once into a cache outside the clone.
MDBOOK_ROOT=/var/cache/eps-tools/mdbook
if [ ! -x "$MDBOOK_ROOT/bin/mdbook" ]; then
    step "installing mdbook (cached in $MDBOOK_ROOT)"
    CARGO_TARGET_DIR=/var/cache/eps-tools/mdbook-build cargo install mdbook --locked --version 0.5.4 --root "$MDBOOK_ROOT"
    rm -rf /var/cache/eps-tools/mdbook-build
fi

# `eps bench migrate --plot` (tested) draws its text with a TrueType font.
if [ ! -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] && command -v apt-get >/dev/null; then
    step "installing fonts-dejavu-core"
    apt-get update -qq -o DPkg::Lock::Timeout=300 && apt-get install -y -qq -o DPkg::Lock::Timeout=300 fonts-dejavu-core
fi

# The rdma provider (crates/eps-rdma) builds against libibverbs and librdmacm
# through rdma-sys, whose bindings need libclang; the tests compile the CUDA
# kernels for the CPU with g++ (crates/eps-cuda/src/host.rs).
missing=()
for p in libibverbs-dev librdmacm-dev libclang-dev pkg-config g++; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    step "installing ${missing[*]}"
    apt-get update -qq -o DPkg::Lock::Timeout=300 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "${missing[@]}"
fi

# The CUDA kernels are compiled (NVRTC) and assembled (ptxas) for sm_80 and sm_90
# even here, without a GPU: NVIDIA's pip wheels of both, cached.
step "CUDA compiler tools (NVRTC, ptxas)"
eval "$(bash ci/cuda-tools.sh)"
# ...and run on the CPU, thread by thread, against the CPU aggregator's bits.
export EPS_HOST_KERNELS_REQUIRE=1

step "format check"
cargo fmt --all --check

step "clippy (warnings denied)"
cargo clippy --workspace --all-targets --locked --features rdma,cuda -- -D warnings

step "doc tests"
cargo test --workspace --doc --locked

# The C ABI under libFuzzer: generated calls of every exported function
# against a job in the process (crates/eps-capi/tests/c/hostile.h).
step "fuzzing the C ABI (60 s)"
bash ci/fuzz-capi.sh 60 2>&1 | grep -v '^eps \|the control plane at .* dropped the connection\|reconnect' | tail -n 40

# The rdma provider on soft-RoCE, for real: here in a QEMU VM (this kernel has no
# RDMA support), directly on a kernel that has rdma_rxe.
step "rdma checks on soft-RoCE"
bash ci/softroce.sh

# The Python package over libeps (python/), PyTorch included: installed with
# pip into the cached environment (building libeps in release), checked in a
# fresh virtual environment too, then its tests, which drive the release eps.
step "the simulation: coverage over the CI seed budget, and every mutant caught"
cargo run --release --locked -q -p eps-sim -- --seeds 2000 --json
cargo test --release --locked -q -p eps-sim --features mutants --test mutants -- --nocapture

step "Python environment"
VENV="$(bash ci/python-env.sh)"
step "release build of eps (the Python tests and examples run it)"
cargo build --release --locked --bin eps
step "pip install ./python (builds libeps)"
"$VENV/bin/pip" install -q ./python
step "a fresh virtual environment: pip install ./python, import eps, eps.torch"
fresh="$(mktemp -d)"
python3 -m venv "$fresh/venv"
"$fresh/venv/bin/pip" install -q ./python
# torch comes from the cached environment (too large to fetch again).
"$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    > "$("$fresh/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/eps-test-torch.pth"
(cd "$fresh" && "$fresh/venv/bin/python" -c 'import eps, eps.torch; print("import eps, eps.torch: ok, libeps", eps.version())')
rm -rf "$fresh"
step "Python tests (pytest)"
EPS_BIN="$PWD/target/release/eps" "$VENV/bin/python" -m pytest -q -p no:cacheprovider --import-mode=importlib python/tests

# A Slurm cluster on this machine for tests/slurm.rs (two node names, one
# slurmd each), stopped at the end if this run started it. Where Slurm cannot
# start here (not root), those tests say so and skip.
cleanup=()
on_exit() { for c in "${cleanup[@]}"; do eval "$c" || true; done; }
trap on_exit EXIT
step "Slurm (slurmctld, slurmd, munge) for the Slurm launcher's tests"
if up="$(bash ci/slurm-up.sh)"; then
    eval "$up"
    if [ "${EPS_SLURM_STARTED:-}" = 1 ]; then
        cleanup+=("bash ci/slurm-up.sh --down")
    fi
else
    echo "Slurm did not start (see above): tests/slurm.rs skips"
fi

# etcd on 127.0.0.1 for the standby control planes' tests (tests/ha.rs),
# stopped at the end.
step "etcd for the etcd store's and standby control planes' tests"
if up="$(bash ci/etcd-up.sh)"; then
    eval "$up"
    cleanup+=("bash ci/etcd-up.sh --down $EPS_TEST_ETCD_PID $EPS_TEST_ETCD_DIR")
else
    echo "etcd did not start (see above): the etcd tests start their own or skip"
fi

# Last, so that its summary closes the run. The scheduler's live runs
# (tests/sched_live.rs) time real jobs with the release build.
step "tests"
# Tests whose environment cannot be made here note it in this file (under
# CI=true they fail instead); it is listed after the run.
export EPS_SKIP_LOG="$PWD/target/skipped-tests.txt"
rm -f "$EPS_SKIP_LOG"
status=0
EPS_BIN="$PWD/target/release/eps" cargo nextest run --workspace --locked --no-fail-fast || status=$?
if [ -s "$EPS_SKIP_LOG" ]; then
    printf '\n%s test(s) SKIPPED, their environment missing here (they are not passes):\n' "$(wc -l < "$EPS_SKIP_LOG")"
    sed 's/^/  /' "$EPS_SKIP_LOG"
fi
exit "$status"
