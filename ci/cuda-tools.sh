#!/usr/bin/env bash
# Fetches NVIDIA's NVRTC and ptxas (the pip wheels of the CUDA 12.9 toolkit: no GPU,
# driver or full toolkit needed) into $EPS_CUDA_TOOLS_CACHE (default
# /var/cache/eps-cuda-tools), so that the kernel test compiles kernels/ for sm_80
# and sm_90 and assembles the PTX on machines without a GPU.
#
# Prints the environment to use (`eval "$(bash ci/cuda-tools.sh)"`): the library
# path, EPS_PTXAS and EPS_NVRTC_REQUIRE=1. When the wheels cannot be fetched it says
# so on stderr and prints nothing: the test then reports that it skipped.
set -euo pipefail
CACHE=${EPS_CUDA_TOOLS_CACHE:-/var/cache/eps-cuda-tools}
VERSION=12.9.86
lib="$CACHE/$VERSION/nvidia/cuda_nvrtc/lib"
ptxas="$CACHE/$VERSION/nvidia/cuda_nvcc/bin/ptxas"
if [ ! -e "$lib/libnvrtc.so.12" ] || [ ! -x "$ptxas" ]; then
    echo "cuda-tools: fetching NVRTC and ptxas $VERSION (about 130 MB, cached in $CACHE)" >&2
    dl=$(mktemp -d)
    trap 'rm -rf "$dl"' EXIT
    if ! python3 -m pip download --quiet --no-deps --dest "$dl" \
        "nvidia-cuda-nvrtc-cu12==$VERSION" "nvidia-cuda-nvcc-cu12==$VERSION" >&2; then
        echo "cuda-tools: could not download the wheels (no pip or no network): the kernel compile check will skip" >&2
        exit 0
    fi
    mkdir -p "$CACHE/$VERSION"
    for w in "$dl"/*.whl; do
        python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$CACHE/$VERSION"
    done
    chmod +x "$ptxas"
fi
echo "export LD_LIBRARY_PATH=\"$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
echo "export EPS_PTXAS=\"$ptxas\""
echo "export EPS_NVRTC_REQUIRE=1"
