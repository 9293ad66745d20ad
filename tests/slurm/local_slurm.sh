#!/usr/bin/env bash
# A throwaway SLURM cluster for tests (Debian's slurmctld, slurmd, munge), all state under DIR.
#   tests/slurm/local_slurm.sh installed        # exit 0 when the packages are there (installs nothing)
#   tests/slurm/local_slurm.sh install          # apt-get the packages if missing (root)
#   tests/slurm/local_slurm.sh start DIR        # one node (this machine); then: export SLURM_CONF=DIR/slurm.conf
#   tests/slurm/local_slurm.sh start-multi DIR N    # N nodes, each a host of its own (below)
#   tests/slurm/local_slurm.sh stop DIR         # either kind: every daemon, job, namespace and file it made
# Two fake GPUs per node are declared as gres over plain files (DIR/fakegpu0, DIR/fakegpu1).
#
# start-multi (root): every node is a network namespace with its own veth pair on a bridge, its own address
# (10.213.X.i/24) and its own hostname (a UTS namespace), which is its SLURM NodeName; its slurmd runs inside, so
# jobs on it live in that network and see that hostname; DIR/hosts, bind-mounted over /etc/hosts in the daemons'
# own mount namespaces (`ip netns exec` is not used: it remounts /sys, which hides the cgroup mounts slurmd needs),
# names every node and the controller. slurmctld and munged run in this machine's network (slurmctld under the
# controller's hostname, reached at 10.213.X.254); munge's socket is shared through DIR.
# DIR/cluster.env records the names and addresses (NODE_i, ADDR_i, NETNS_i) for the caller and for stop.
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
start-multi)
    dir=$(realpath -m "$2"); n=${3:-2}
    [ "$(id -u)" = 0 ] || { echo "not root: network namespaces need root"; exit 3; }
    command -v ip >/dev/null && command -v unshare >/dev/null || { echo "ip (iproute2) and unshare are needed"; exit 3; }
    mkdir -p "$dir/state"
    tag=$(head -c 3 /dev/urandom | od -An -tx1 | tr -d ' \n')
    # munge's socket and slurmd's spool (sockets named after the node and the job) need short paths (108 bytes at
    # most, whatever DIR is): a directory of their own under /tmp, removed by stop
    short=$(mktemp -d /tmp/dsl.XXXXXX)
    spool=$short/spool
    mkdir -p "$spool" "$short/munge"
    ln -s "$short/munge" "$dir/munge"
    ln -s "$spool" "$dir/spool"
    x=""
    for cand in $(seq 10 250); do
        ip -4 addr | grep -q " 10\.213\.$cand\." || { x=$cand; break; }
    done
    [ -n "$x" ] || { echo "no free 10.213.X.0/24 subnet"; exit 3; }
    net=10.213.$x; br=dsb$tag; ctl=dsc$tag
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
    touch "$dir/fakegpu0" "$dir/fakegpu1"
    { echo "TAG=$tag"; echo "NET=$net"; echo "BRIDGE=$br"; echo "CONTROLLER=$ctl"; echo "NODES=$n"
      echo "SHORT=$short"; } > "$dir/cluster.env"
    ip link add "$br" type bridge
    ip addr add "$net.254/24" dev "$br"
    ip link set "$br" up
    hosts=$(printf '127.0.0.1 localhost\n%s %s\n' "$net.254" "$ctl")
    for i in $(seq 1 "$n"); do hosts+=$(printf '\n%s %s' "$net.$i" "dn$tag-$i"); done
    printf '%s\n' "$hosts" > "$dir/hosts"
    : > "$dir/gres.conf"
    nodes=""
    for i in $(seq 1 "$n"); do
        node=dn$tag-$i; ns=dsn$tag$i
        { echo "NODE_$i=$node"; echo "ADDR_$i=$net.$i"; echo "NETNS_$i=$ns"; } >> "$dir/cluster.env"
        ip netns add "$ns"
        ip link add "dsv$tag$i" type veth peer name "dsp$tag$i"
        ip link set "dsp$tag$i" netns "$ns"
        ip link set "dsv$tag$i" master "$br"
        ip link set "dsv$tag$i" up
        ip netns exec "$ns" ip addr add "$net.$i/24" dev "dsp$tag$i"
        ip netns exec "$ns" ip link set "dsp$tag$i" up
        ip netns exec "$ns" ip link set lo up
        mkdir -p "$spool/$node"
        nodes+="NodeName=$node NodeAddr=$net.$i NodeHostname=$node"$'\n'
        echo "NodeName=$node Name=gpu File=$dir/fakegpu[0-1]" >> "$dir/gres.conf"
    done
    cat > "$dir/slurm.conf" <<CONF
ClusterName=dllmmulti
SlurmctldHost=$ctl($net.254)
AuthType=auth/munge
AuthInfo=socket=$short/munge/munge.socket.2
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
SlurmdSpoolDir=$spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
ReturnToService=2
NodeName=DEFAULT CPUs=$cpus RealMemory=$mem Gres=gpu:2 State=UNKNOWN
${nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    dd if=/dev/urandom of="$short/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$short/munge/munge.key"
    munged --force --key-file="$short/munge/munge.key" --socket="$short/munge/munge.socket.2" \
        --pid-file="$short/munge/munged.pid" --log-file="$short/munge/munged.log" --seed-file="$short/munge/seed"
    export SLURM_CONF=$dir/slurm.conf
    # a daemon as host $1: its own hostname and /etc/hosts (its children, the jobs, inherit both)
    as_host() { h=$1; shift; unshare --uts --mount sh -c "mount --bind $dir/hosts /etc/hosts && hostname $h && exec $*"; }
    as_host "$ctl" slurmctld -f "$dir/slurm.conf"
    for i in $(seq 1 "$n"); do
        nsenter --net="/run/netns/dsn$tag$i" sh -c "$(declare -f as_host); dir=$dir; as_host dn$tag-$i slurmd -f $dir/slurm.conf"
    done
    for _ in $(seq 1 120); do
        up=$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|mix|alloc)$' || true)
        [ "$up" = "$n" ] && exit 0
        sleep 0.5
    done
    echo "slurm did not come up:"; sinfo -N 2>&1 || true
    tail -20 "$dir/slurmctld.log" "$dir"/slurmd-*.log 2>/dev/null
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
    for pidf in "$dir"/slurmd*.pid "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        [ -f "$pidf" ] && kill "$(cat "$pidf")" 2>/dev/null || true
    done
    pkill -f -- "-f $dir/slurm.conf" 2>/dev/null || true
    for _ in $(seq 1 20); do pgrep -f -- "$dir/" >/dev/null || break; sleep 0.25; done
    pkill -9 -f -- "$dir/" 2>/dev/null || true
    if [ -f "$dir/cluster.env" ]; then          # start-multi: whatever still runs in a node, then the network
        # shellcheck disable=SC1091
        . "$dir/cluster.env"
        for i in $(seq 1 "$NODES"); do
            ns=dsn$TAG$i
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
            ip netns del "$ns" 2>/dev/null || true
            ip link del "dsv$TAG$i" 2>/dev/null || true
        done
        ip link del "$BRIDGE" 2>/dev/null || true
        pkill -9 -f -- "$SHORT/" 2>/dev/null || true
        case "$SHORT" in /tmp/dsl.*) rm -rf "$SHORT" ;; esac
        rm -f "$dir/cluster.env"
    fi
    ;;
esac
