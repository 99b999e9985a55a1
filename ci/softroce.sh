#!/usr/bin/env bash
# Runs the `rdma` provider's checks on soft-RoCE (rdma_rxe), for real.
#
# On a kernel with rdma_rxe it sets up an rxe device on a veth pair here and runs
# the checks directly. On a kernel without RDMA support (this project's CI
# machines) it boots a Debian 12 VM under QEMU (TCG: an emulator, so figures from
# it are functional checks, never performance) with Debian's own kernel, which has
# rdma_rxe, and runs the same checks inside; results come back over the serial
# console (the terminal resets the console sends are stripped from its lines)
# and the exit status through QEMU's isa-debug-exit device.
#
# The checks are the executables built by `cargo test --no-run` for the targets
# named in CHECKS below plus `eps rdma devices`; each prints PASS or FAIL.
# The VM image is built once (debootstrap, about two minutes) and cached in
# $EPS_SOFTROCE_CACHE (default /var/cache/eps-softroce) outside the clone.
#
# Usage: bash ci/softroce.sh               build, boot, check; fails if any check fails
#        bash ci/softroce.sh --image-only  only build (or find) the cached VM image
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${EPS_SOFTROCE_CACHE:-/var/cache/eps-softroce}
IMAGE_VERSION=3
step() { printf '\n==> softroce: %s\n' "$*"; }
die() { echo "softroce: $*" >&2; exit 1; }

# --- what runs on the device -------------------------------------------------------
# `cargo test --no-run` targets whose executables run against rxe (each probes for a
# device; with EPS_RDMA_REQUIRE set, as here, a missing one fails).
CHECKS=(-p eps-rdma --test rxe)

apt_install() {
    command -v apt-get >/dev/null || die "apt-get not found: install $* by hand"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "$@" >/dev/null
}

need_build_deps() {
    local missing=()
    for p in libibverbs-dev librdmacm-dev libclang-dev pkg-config; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        step "installing ${missing[*]}"
        apt-get update -qq -o DPkg::Lock::Timeout=300
        apt_install "${missing[@]}"
    fi
}

# Builds the checks and prints their paths, one per line.
build_checks() {
    cargo build --locked --features rdma --bin eps >&2
    # libeps with the rdma transport, and the C example linked to it (found
    # next to it: rpath $ORIGIN).
    cargo build --locked -p eps-capi --features rdma >&2
    cc -std=c11 -O1 -I include examples/c/train.c -L target/debug -leps -lm -Wl,-rpath,'$ORIGIN' -o target/debug/train_c >&2
    echo "target/debug/eps"
    { cargo test --locked "${CHECKS[@]}" --no-run --message-format=json 2>/dev/null
      cargo test --locked --features rdma --test fabric_conformance --no-run --message-format=json 2>/dev/null; } |
        python3 -c 'import json,sys
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"])'
}

# The script every environment runs: a device, then each check.
write_run_script() {
    cat >"$1" <<'EOF'
#!/bin/sh
# Runs inside the VM (or on a host with rdma_rxe): $1 = directory of the checks.
dir=$1
fails=0
check() { name=$1; shift; if "$@" >"/tmp/$name.log" 2>&1; then echo "PASS $name"; grep -hE '^(rdma|test result|accuracy|\{)' "/tmp/$name.log" | sed 's/^/    /'; else echo "FAIL $name"; fails=$((fails + 1)); sed 's/^/    /' "/tmp/$name.log" | tail -n 60; fi; }
modprobe rdma_rxe || { echo "FAIL modprobe rdma_rxe"; exit 1; }
# /dev/udmabuf: host pages as a dmabuf, for the dmabuf registration test.
modprobe udmabuf 2>/dev/null || true
ip link add veth0 type veth peer name veth1
ip addr add 10.77.0.1/24 dev veth0
ip addr add 10.77.0.2/24 dev veth1
ip link set veth0 up
ip link set veth1 up
ip link set lo up
rdma link add rxe0 type rxe netdev veth0 || { echo "FAIL rdma link add"; exit 1; }
sleep 1
check ibv_devices ibv_devices
check eps_rdma_devices "$dir/eps" rdma devices
sed '/^rdma/d; s/^/    /' /tmp/eps_rdma_devices.log
check eps_rdma_devices_json sh -c "\"$dir/eps\" rdma devices --json | grep -q '\"name\":\"rxe0\"'"
# The fabric benchmark over rdma (figures under TCG are an emulator's, not
# performance): each operation between two processes on the device.
for op in write read send; do
    check "eps_bench_fabric_rdma_$op" "$dir/eps" bench fabric --transport rdma --op "$op" --size 64KiB --iters 200 --depth 4 --json
done
# Named choices, `auto`, and a device that does not exist (the error lists rxe0).
check eps_bench_fabric_rdma_named "$dir/eps" bench fabric --transport rdma --rdma-device rxe0 --rdma-port 1 --gid-index 1 --size 4KiB --iters 50
check eps_bench_fabric_auto_is_rdma sh -c '"$0" bench fabric --transport auto --size 4KiB --iters 50 --json | grep -q "\"transport\":\"rdma\""' "$dir/eps"
check eps_rdma_unknown_device sh -c 'out=$("$0" bench fabric --transport rdma --rdma-device nosuch 2>&1); test $? -ne 0 && echo "$out" | grep -q rxe0' "$dir/eps"
# A local training cluster over rdma (2 workers, servers scaled 2 -> 3 -> 1 while
# it trains: splits and migrations over rxe) must end with the parameters of the
# same job on the soft transport, bit for bit (BSP is deterministic).
cat >/tmp/tiny.toml <<'SPEC'
[job]
name = "rxe-train"
workers = 2
servers = 2
steps = 30
batch = 32
shard_bytes = 65536

[model]
preset = "synthetic"
buckets = 16384
SPEC
# train TRANSPORT [AGGREGATOR]: its JSON line in /tmp/train_TRANSPORT[AGGREGATOR].json.
train() {
    out="/tmp/train_$1$2"
    timeout 300 "$dir/eps" train --spec /tmp/tiny.toml --scale-plan 10:servers=3,20:servers=1 --progress-every 10 --json --transport "$1" \
        ${2:+--aggregator "$2"} >"$out.out" &&
        tail -n 1 "$out.out" >"$out.json" && grep -q "\"transport\":\"$1\"" "$out.json"
}
# same RUN: RUN's checksum is the soft run's.
same() {
    a=$(grep -o '"params_checksum":"[0-9a-f]*"' /tmp/train_soft.json); b=$(grep -o '"params_checksum":"[0-9a-f]*"' "/tmp/train_$1.json")
    test -n "$a" && test "$a" = "$b" && echo "$1 train: $b $(grep -o '"migrations":[0-9]*,"splits":[0-9]*' "/tmp/train_$1.json")"
}
check eps_train_soft train soft
check eps_train_rdma train rdma
check eps_train_rdma_equals_soft same rdma
# The direct path (landing slots and published copies used in place by the
# device, as with GPUDirect RDMA; here the host device) over rdma: the same bits.
check eps_train_rdma_direct train rdma host-direct
check eps_train_rdma_direct_equals_soft same rdmahost-direct
# ASP (pulls are RDMA READs) with the servers scaled, and BSP with a worker joining
# and one leaving: they must finish (their results depend on timing).
check eps_train_rdma_asp timeout 300 "$dir/eps" train --spec /tmp/tiny.toml --consistency asp --scale-plan 10:servers=3,20:servers=1 --transport rdma
check eps_train_rdma_workers timeout 300 "$dir/eps" train --spec /tmp/tiny.toml --scale-plan 10:workers=3,20:workers=2 --transport rdma
# Sparse tables over rdma: the click-through job (rows pulled and pushed by key,
# WRITTEN by the servers into the workers' row buffers) ends with the soft
# transport's dense parameters and table rows, bit for bit.
ctr() {
    timeout 300 "$dir/eps" train --model ctr --steps 60 --batch 64 --progress-every 30 --json --transport "$1" >"/tmp/ctr_$1.out" &&
        tail -n 1 "/tmp/ctr_$1.out" | grep -o '"params_checksum":"[0-9a-f]*"\|"transport":"[a-z]*"\|"sparse_checksum":"[0-9a-f]*"' >"/tmp/ctr_$1.sums" &&
        grep -q "\"transport\":\"$1\"" "/tmp/ctr_$1.sums"
}
ctr_same() {
    grep -v transport /tmp/ctr_soft.sums >/tmp/ctr_a && grep -v transport /tmp/ctr_rdma.sums >/tmp/ctr_b &&
        test "$(wc -l </tmp/ctr_a)" -eq 2 && cmp -s /tmp/ctr_a /tmp/ctr_b && echo "rdma ctr equals soft: $(tr '\n' ' ' </tmp/ctr_b)"
}
check eps_train_ctr_soft ctr soft
check eps_train_ctr_rdma ctr rdma
check eps_train_ctr_rdma_equals_soft ctr_same
# Buckets moving over rdma (the target READs the source's rows): servers
# scaled 2 -> 3 -> 1 while it trains, and it ends as the soft run did.
ctr_scaled() {
    timeout 300 "$dir/eps" train --model ctr --steps 60 --batch 64 --progress-every 30 --json --transport rdma \
        --scale-plan 15:servers=3,35:servers=1 >/tmp/ctr_scaled.out &&
        tail -n 1 /tmp/ctr_scaled.out | grep -q '"bucket_moves":2' &&
        tail -n 1 /tmp/ctr_scaled.out | grep -o '"params_checksum":"[0-9a-f]*"\|"sparse_checksum":"[0-9a-f]*"' >/tmp/ctr_c &&
        cmp -s /tmp/ctr_a /tmp/ctr_c && echo "rdma ctr scaled 2 -> 3 -> 1 equals soft: $(tr '\n' ' ' </tmp/ctr_c)"
}
check eps_train_ctr_rdma_scaled_equals_soft ctr_scaled
# libeps over rdma: the C example, two processes against `eps up`, both on rxe.
libeps_c() {
    # Bounded: a hang fails this check with every process's log instead of
    # holding the VM until its limit.
    # (Created first: the loop below may read it before the background job's
    # redirection has run.)
    : >/tmp/up.env
    timeout 240 "$dir/eps" up --workers 2 --servers 2 --steps 40 --lr 0.05 --transport rdma >/tmp/up.env 2>/tmp/up.err &
    up=$!
    i=0
    while [ "$(wc -l </tmp/up.env)" -lt 2 ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
    # shellcheck disable=SC2046
    export $(cat /tmp/up.env)
    EPS_TRANSPORT=rdma timeout 180 "$dir/train_c" >/tmp/c0.out 2>/tmp/c0.err &
    a=$!
    EPS_TRANSPORT=rdma timeout 180 "$dir/train_c" >/tmp/c1.out 2>/tmp/c1.err &
    b=$!
    ok=0
    wait $a || ok=1
    wait $b || ok=1
    wait $up || ok=1
    cat /tmp/c0.err /tmp/c1.err
    [ $ok -eq 0 ] || { echo "eps up:"; cat /tmp/up.err; }
    test $ok -eq 0 && grep -q "rdma transport" /tmp/c0.err && grep -q "rdma transport" /tmp/c1.err && cat /tmp/c0.out /tmp/c1.out | grep -h "^accuracy="
}
check libeps_c_example_rdma libeps_c
# Conformance cases the rdma provider does not pass here, skipped and listed:
# invalid_request_errors: its first part (a message over the responder's limit)
# passes, but rxe answers a SEND longer than the posted receive with a remote
# operation error, where the suite (and the InfiniBand spec) expect remote invalid
# request.
GAPS="rdma::invalid_request_errors"
for t in "$dir"/checks/*; do
    [ -x "$t" ] || continue
    filter=""
    case "$(basename "$t")" in
        fabric_conformance*)
            # Only the rdma cases (the soft ones run on the host).
            filter="rdma::"
            for g in $GAPS; do filter="$filter --skip $g"; done
            [ -z "$GAPS" ] || echo "NOT YET (skipped): $GAPS" ;;
    esac
    # shellcheck disable=SC2086
    check "$(basename "$t" | sed 's/-[0-9a-f]*$//')" timeout 300 env EPS_RDMA_REQUIRE=1 EPS_RDMA_ADDR=10.77.0.1 EPS_CONFORMANCE_ADDR=10.77.0.1:0 "$t" --test-threads 1 --nocapture $filter
done
echo "SOFTROCE FAILURES $fails"
exit "$fails"
EOF
    chmod +x "$1"
}

# --- a kernel with rdma_rxe: run here ----------------------------------------------
if [ "${1:-}" != --image-only ] && modprobe rdma_rxe >/dev/null 2>&1; then
    need_build_deps
    step "this kernel has rdma_rxe: running the checks here"
    mapfile -t built < <(build_checks)
    work=$(mktemp -d)
    mkdir -p "$work/checks"
    cp "${built[0]}" "$work/eps"
    cp target/debug/libeps.so target/debug/train_c "$work/"
    for b in "${built[@]:1}"; do cp "$b" "$work/checks/"; done
    write_run_script "$work/run.sh"
    exec sh "$work/run.sh" "$work"
fi

# --- no rdma_rxe here: a VM ---------------------------------------------------------
step "this kernel has no RDMA support: checking in a QEMU VM with Debian's kernel"
need_build_deps
if ! command -v qemu-system-x86_64 >/dev/null; then
    step "installing qemu-system-x86 (from bookworm-backports, like the machine's qemu-utils)"
    uris=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$uris" ] || uris=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    [ -n "$uris" ] || die "cannot tell the Debian mirror from the apt sources"
    if ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
        printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
            "$uris" >/etc/apt/sources.list.d/eps-backports.sources
    fi
    apt-get update -qq -o DPkg::Lock::Timeout=300
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 -t bookworm-backports --no-install-recommends qemu-system-x86 >/dev/null
fi
for t in debootstrap mkfs.ext4; do
    command -v "$t" >/dev/null || { step "installing $t"; apt-get update -qq -o DPkg::Lock::Timeout=300; apt_install debootstrap e2fsprogs; }
done

mkdir -p "$CACHE"
img="$CACHE/rootfs-v$IMAGE_VERSION.img"
if [ ! -s "$img" ] || [ ! -s "$CACHE/vmlinuz" ] || [ ! -s "$CACHE/initrd.img" ]; then
    step "building the VM image (cached in $CACHE)"
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$mirror" ] || mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list)
    root=$(mktemp -d "$CACHE/root.XXXX")
    debootstrap --variant=minbase \
        --include=linux-image-amd64,initramfs-tools,kmod,udev,rdma-core,ibverbs-providers,ibverbs-utils,perftest,rdmacm-utils,iproute2,procps,libibverbs1,librdmacm1 \
        bookworm "$root" "$mirror" >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log"; rm -rf "$root"; die "debootstrap failed"; }
    kver=$(ls "$root/lib/modules" | head -1)
    chroot "$root" depmod -a "$kver"
    # The init: mount, run the payload's script from the second drive, report.
    cat >"$root/eps-init.sh" <<'EOF'
#!/bin/sh
# (The initramfs may have mounted these already.)
[ -e /proc/self ] || mount -t proc proc /proc
[ -e /sys/class ] || mount -t sysfs sys /sys
[ -e /dev/null ] || mount -t devtmpfs dev /dev
mkdir -p /payload /tmp
mount -t ext4 /dev/vdb /payload || echo "FAIL mount payload"
sh /payload/run.sh /payload
code=$?
echo "SOFTROCE EXIT $code"
# isa-debug-exit: QEMU exits with (code << 1) | 1.
printf "\\$(printf '%03o' "$code")" | dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null
echo o >/proc/sysrq-trigger
EOF
    chmod +x "$root/eps-init.sh"
    cp "$root/boot/vmlinuz-$kver" "$CACHE/vmlinuz.new"
    cp "$root/boot/initrd.img-$kver" "$CACHE/initrd.img.new"
    rm -rf "$root/boot" "$root/usr/share/doc" "$root/usr/share/man" "$root/usr/share/locale" "$root/var/cache/apt" "$root/lib/firmware"
    size=$(( $(du -sm "$root" | cut -f1) + 256 ))
    mkfs.ext4 -q -F -L eps-root -d "$root" "$img.new" "${size}M"
    rm -rf "$root"
    mv "$CACHE/vmlinuz.new" "$CACHE/vmlinuz"
    mv "$CACHE/initrd.img.new" "$CACHE/initrd.img"
    mv "$img.new" "$img"
fi

if [ "${1:-}" = --image-only ]; then
    echo "softroce: the VM image is in $CACHE"
    exit 0
fi

step "building the checks"
mapfile -t built < <(build_checks)
[ ${#built[@]} -ge 1 ] || die "nothing was built"
payload=$(mktemp -d)
trap 'rm -rf "$payload"' EXIT
mkdir -p "$payload/dir/checks"
cp "${built[0]}" "$payload/dir/eps"
cp target/debug/libeps.so target/debug/train_c "$payload/dir/"
for b in "${built[@]:1}"; do cp "$b" "$payload/dir/checks/"; done
write_run_script "$payload/dir/run.sh"
size=$(( $(du -sm "$payload/dir" | cut -f1) + 32 ))
mkfs.ext4 -q -F -d "$payload/dir" "$payload/payload.img" "${size}M"

step "booting the VM (TCG; about a minute)"
start=$(date +%s)
set +e
timeout 900 qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp 2 -m 2048 \
    -kernel "$CACHE/vmlinuz" -initrd "$CACHE/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 quiet init=/eps-init.sh panic=-1" \
    -drive "file=$img,if=virtio,format=raw,snapshot=on" \
    -drive "file=$payload/payload.img,if=virtio,format=raw" \
    -device isa-debug-exit,iobase=0xf4,iosize=0x04 \
    -nographic -no-reboot -nic none </dev/null | tee "$payload/console.log" |
    sed -u -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' -e 's/\x1bc//g' -e 's/\r$//' | grep -E '^(PASS|FAIL|NOT YET|    |SOFTROCE)'
status=${PIPESTATUS[0]}
set -e
echo "softroce: the VM ran $(( $(date +%s) - start )) s"
if [ "$status" -eq 124 ]; then
    tail -40 "$payload/console.log"
    die "the VM did not finish within 15 minutes"
fi
fails=$(( (status - 1) / 2 ))
if [ $(( status % 2 )) -ne 1 ] || ! grep -q '^SOFTROCE EXIT' "$payload/console.log"; then
    tail -40 "$payload/console.log"
    die "the VM did not report (qemu exit status $status)"
fi
[ "$fails" -eq 0 ] || die "$fails soft-RoCE checks failed"
echo "softroce: every check passed"
