#!/usr/bin/env bash
# A throwaway single-node SLURM cluster for tests (Debian's slurmctld, slurmd, munge), all state under DIR.
#   tests/slurm/local_slurm.sh installed        # exit 0 when the packages are there (installs nothing)
#   tests/slurm/local_slurm.sh install          # apt-get the packages if missing (root)
#   tests/slurm/local_slurm.sh start DIR        # then: export SLURM_CONF=DIR/slurm.conf
#   tests/slurm/local_slurm.sh stop DIR
# Two fake GPUs are declared as gres over plain files (DIR/fakegpu0, DIR/fakegpu1).
set -euo pipefail
cmd=$1
case "$cmd" in
installed)
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null
    ;;
install)
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null; then exit 0; fi
    [ "$(id -u)" = 0 ] || { echo "not root: cannot install slurm"; exit 3; }
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null 2>&1; } \
        || { echo "apt-get could not install slurmctld slurmd slurm-client munge"; exit 3; }
    ;;
start)
    dir=$(realpath -m "$2"); mkdir -p "$dir"/{state,spool,munge}
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
    touch "$dir/fakegpu0" "$dir/fakegpu1"
    cat > "$dir/slurm.conf" <<CONF
ClusterName=dllmtest
SlurmctldHost=$host
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket.2
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
ReturnToService=2
NodeName=$host CPUs=$cpus RealMemory=$mem Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    echo "NodeName=$host Name=gpu File=$dir/fakegpu[0-1]" > "$dir/gres.conf"
    cp /etc/munge/munge.key "$dir/munge/munge.key" 2>/dev/null \
        || dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket.2" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed"
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$dir/slurm.conf"
    slurmd -f "$dir/slurm.conf"
    for _ in $(seq 1 60); do
        if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then exit 0; fi
        sleep 0.5
    done
    echo "slurm did not come up:"; sinfo 2>&1 || true; tail -20 "$dir/slurmctld.log" "$dir/slurmd.log" 2>/dev/null
    exit 1
    ;;
stop)
    dir=$(realpath -m "$2")
    if [ -f "$dir/slurm.conf" ]; then          # cancel every job first, so no slurmstepd outlives the daemons
        export SLURM_CONF=$dir/slurm.conf
        jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
        [ -n "$jobs" ] && timeout 10 scancel $jobs 2>/dev/null || true
        for _ in $(seq 1 40); do [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.25; done
    fi
    for pidf in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        [ -f "$pidf" ] && kill "$(cat "$pidf")" 2>/dev/null || true
    done
    pkill -f -- "-f $dir/slurm.conf" 2>/dev/null || true
    for _ in $(seq 1 20); do pgrep -f -- "$dir/" >/dev/null || break; sleep 0.25; done
    pkill -9 -f -- "$dir/" 2>/dev/null || true
    ;;
esac
