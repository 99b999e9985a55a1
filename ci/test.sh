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

# `eps bench migrate --plot` (tested) draws its text with a TrueType font.
if [ ! -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] && command -v apt-get >/dev/null; then
    step "installing fonts-dejavu-core"
    apt-get update -qq && apt-get install -y -qq fonts-dejavu-core
fi

step "format check"
cargo fmt --all --check

step "clippy (warnings denied)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "doc tests"
cargo test --workspace --doc --locked

# Last, so that its summary closes the run.
step "tests"
cargo nextest run --workspace --locked --no-fail-fast
