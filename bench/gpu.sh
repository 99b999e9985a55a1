#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU: the kernel tests against the CPU
# on the GPU (EPS_CUDA_REQUIRE=1: a missing GPU fails them), then `eps bench gpu`
# three times (the 8-way f32 sum and the fused Adam step against the
# device-to-device copy rate of the same run), and a table of the medians.
#
# Builds with cargo when it is there; on a machine without Rust it uses binaries
# built elsewhere: `bash bench/gpu.sh --build-only` puts them in target/gpu-check/
# (carry that folder to the GPU machine and run `EPS_GPU_PREBUILT=1 bash
# bench/gpu.sh` there), with the kernels' PTX built in (made
# here by NVRTC from ci/cuda-tools.sh when nvcc is absent), so that the GPU
# machine needs only its driver. Results also go to $OUT (or
# target/gpu-check/out) as gpu-bench.jsonl and kernels.log.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/gpu-check
out=${OUT:-$bin/out}
mkdir -p "$bin" "$out"

if command -v cargo >/dev/null && [ -z "${EPS_GPU_PREBUILT:-}" ]; then
    echo "==> building eps and the kernel tests (--features cuda, release)"
    if ! command -v nvcc >/dev/null && [ -z "${EPS_CUDA_PTX_DIR:-}" ]; then
        # No toolkit: PTX from NVRTC (NVIDIA's wheel), built into the binaries.
        eval "$(bash ci/cuda-tools.sh)"
        cargo build --release --locked --features cuda --bin eps
        target/release/eps bench gpu --emit-ptx "$bin/ptx"
        export EPS_CUDA_PTX_DIR=$PWD/$bin/ptx
    fi
    cargo build --release --locked --features cuda --bin eps
    cp target/release/eps "$bin/eps"
    t=$(cargo test --release --locked -p eps-cuda --test kernels --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"): print(m["executable"])' | tail -1)
    cp "$t" "$bin/kernels"
fi
[ "${1:-}" = --build-only ] && { ls -la "$bin"; exit 0; }
[ -x "$bin/eps" ] && [ -x "$bin/kernels" ] || { echo "no cargo and no binaries in $bin: run bash bench/gpu.sh --build-only elsewhere first" >&2; exit 1; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

echo "==> kernel tests on the GPU"
tests_ok=1
EPS_CUDA_REQUIRE=1 "$bin/kernels" --test-threads 1 --nocapture 2>&1 | tee "$out/kernels.log" || tests_ok=0

echo "==> eps bench gpu, 3 runs"
: >"$out/gpu-bench.jsonl"
for i in 1 2 3; do
    "$bin/eps" bench gpu --size "${EPS_GPU_BENCH_SIZE:-1GiB}" --reps 20 --json | tee /dev/stderr | tail -n 1 >>"$out/gpu-bench.jsonl"
done
python3 - "$out/gpu-bench.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
med = lambda k: statistics.median(r[k] for r in runs)
print(f"\n{runs[0]['device']}: medians of {len(runs)} runs, {runs[0]['elements']} f32 per buffer")
print(f"{'kernel':<14} {'GB/s':>10} {'x copy':>8}   (target >= 0.8)")
print(f"{'d2d copy':<14} {med('copy_gbytes_per_s'):>10.1} {1.0:>8.3}")
print(f"{'sum 8 x f32':<14} {med('sum8_gbytes_per_s'):>10.1} {med('sum8_ratio'):>8.3}")
print(f"{'adam (fused)':<14} {med('adam_gbytes_per_s'):>10.1} {med('adam_ratio'):>8.3}")
print(f"{'shard update':<14} {med('update_gbytes_per_s'):>10.1} {med('update_ratio'):>8.3}   (8 attached f32 contributions + adam + publish, GPUDirect's path)")
PY
if [ "$tests_ok" = 0 ]; then
    echo "KERNEL TESTS FAILED (see $out/kernels.log)" >&2
    exit 1
fi
