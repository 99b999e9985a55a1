#!/usr/bin/env bash
# Starts a small Slurm cluster on this machine for the Slurm launcher's tests,
# or by hand: munge, slurmctld and slurmd from the distribution's packages
# (installed when missing), run in the foreground under setsid with a generated
# slurm.conf in a state directory. Idempotent: a cluster this script started
# that still answers is kept.
#
#   bash ci/slurm-up.sh [--down] [DIR]     (DIR default: /tmp/eps-slurm)
#
# Prints `export SLURM_CONF=DIR/slurm.conf` on stdout (eval it; with
# `export EPS_SLURM_STARTED=1` when this call started it) and writes it to
# DIR/env. Concurrent calls wait for each other (a lock beside DIR). Two node names on this host (n1, n2: one slurmd each) when the
# build allows several slurmd per host, else one (n1) with oversubscription.
# Exits 3, saying why on stderr, where Slurm cannot start here (not root, no
# packages); tests then skip.
set -euo pipefail

down=0
if [ "${1:-}" = "--down" ]; then down=1; shift; fi
DIR="${1:-/tmp/eps-slurm}"
CONF="$DIR/slurm.conf"
log() { printf 'slurm-up: %s\n' "$*" >&2; }
# One call at a time (tests call it from parallel processes).
exec 9>"$DIR.lock"
flock 9
cannot() { log "cannot start Slurm here: $*"; exit 3; }

# Only processes this script started, by the pids it recorded.
stop_all() {
    for f in "$DIR"/*.pid; do
        [ -e "$f" ] || continue
        pid="$(cat "$f" 2>/dev/null || true)"
        [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
        rm -f "$f"
    done
}

if [ "$down" = 1 ]; then
    stop_all
    log "stopped the cluster in $DIR"
    exit 0
fi

answers() {
    [ -e "$CONF" ] || return 1
    SLURM_CONF="$CONF" timeout 10 sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'
}

if answers; then
    echo "export SLURM_CONF=$CONF"
    exit 0
fi

[ "$(id -u)" = 0 ] || cannot "slurmd must run as root (this is uid $(id -u))"

missing=()
for p in slurmd slurmctld slurm-client munge; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || cannot "no apt-get to install ${missing[*]}"
    log "installing ${missing[*]}"
    apt-get update -qq -o DPkg::Lock::Timeout=300 >&2 || cannot "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 \
        --no-install-recommends "${missing[@]}" >&2 || cannot "apt-get install ${missing[*]} failed"
fi

stop_all
mkdir -p "$DIR/state" "$DIR/spool"
host="$(hostname -s)"

# munge: the key comes with the package; a daemon of our own unless one answers.
if ! (munge -n 2>/dev/null | unmunge >/dev/null 2>&1); then
    [ -e /etc/munge/munge.key ] || { mungekey -c >&2 2>/dev/null || cannot "no munge key"; chown munge:munge /etc/munge/munge.key; }
    install -d -o munge -g munge -m 0755 /run/munge /var/log/munge /var/lib/munge
    # It forks into the background; its pid file is our record of it.
    runuser -u munge -- munged >>"$DIR/munged.out" 2>&1 < /dev/null 9>&- || cannot "munged did not start (see $DIR/munged.out)"
    for _ in $(seq 50); do (munge -n 2>/dev/null | unmunge >/dev/null 2>&1) && break; sleep 0.1; done
    cp /run/munge/munged.pid "$DIR/munged.pid" 2>/dev/null || true
    (munge -n | unmunge >/dev/null 2>&1) || cannot "munged does not answer"
fi

# Each node name offers 8 CPUs whatever this host has (config_overrides): the
# tests' jobs run a step per role with a CPU each, more roles than cores.
cpus="${EPS_SLURM_CPUS:-8}"
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 4 ))
write_conf() { # $1: node lines, $2: node list
    cat > "$CONF" <<CONF
ClusterName=eps
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort=46817
SlurmdPort=46818
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pidfile
SlurmdPidFile=$DIR/slurmd-%n.pidfile
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
KillWait=5
InactiveLimit=0
SlurmdParameters=config_overrides
$1
PartitionName=debug Nodes=$2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
}

start_daemons() { # node names...
    setsid slurmctld -D -f "$CONF" >>"$DIR/slurmctld.out" 2>&1 < /dev/null 9>&- &
    echo $! > "$DIR/slurmctld.pid"
    for n in "$@"; do
        mkdir -p "$DIR/spool/$n"
        setsid slurmd -D -f "$CONF" -N "$n" >>"$DIR/slurmd-$n.out" 2>&1 < /dev/null 9>&- &
        echo $! > "$DIR/slurmd-$n.pid"
    done
    for _ in $(seq 100); do
        idle="$(SLURM_CONF="$CONF" sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle' || true)"
        [ "$idle" = "$#" ] && return 0
        sleep 0.2
    done
    return 1
}

# Two node names on this host need a build with several slurmd per host.
write_conf "NodeName=n1 NodeHostname=$host Port=46818 CPUs=$cpus RealMemory=$mem
NodeName=n2 NodeHostname=$host Port=46819 CPUs=$cpus RealMemory=$mem" "n1,n2"
if start_daemons n1 n2; then
    nodes="n1,n2"
else
    log "two node names on one host did not come up (see $DIR/*.log); one node instead"
    stop_all
    rm -rf "$DIR/state"/*
    write_conf "NodeName=n1 NodeHostname=$host CPUs=$cpus RealMemory=$mem" "n1"
    start_daemons n1 || { stop_all; cannot "slurmctld/slurmd did not come up (see $DIR/*.log)"; }
    nodes="n1"
fi
log "Slurm up: nodes $nodes ($cpus CPUs each), SLURM_CONF=$CONF"
echo "export SLURM_CONF=$CONF" > "$DIR/env"
echo "export SLURM_CONF=$CONF"
echo "export EPS_SLURM_STARTED=1"
