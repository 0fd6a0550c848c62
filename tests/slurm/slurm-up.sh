#!/usr/bin/env bash
# A real single-machine Slurm cluster for the integration tests: munge, MariaDB + slurmdbd (so sacct
# works, as on real clusters), slurmctld, and SLURM_CI_NODES slurmd daemons with fake GPUs.
#
# Idempotent: installs only missing Debian packages, rewrites /etc/slurm/*.conf and restarts the Slurm
# daemons only when the generated configuration changed, and leaves a running cluster alone otherwise.
# Needs root and no systemd. Everything it starts is recorded under $SLURM_CI_STATE so that
# slurm-down.sh stops exactly those processes by PID.
#
# It is shaped like the clusters a user meets, strict where they are:
# - no default partition and no usable default account: a job names both (-p debug -A ci) or is refused at
#   submission (root's default account, `root`, may use no partition);
# - a partition `busy` of the last node only, for tests that fill it and watch a job wait;
# - compute nodes with no network: every task's HTTP(S) goes to a closed proxy (TaskProlog), except to the
#   cluster's own hosts, so a job that downloads anything fails as it would on an offline node.
#
# Knobs: SLURM_CI_STATE (state, spool, logs, pid files; default /var/tmp/memupdate-slurm),
# SLURM_CI_NODES (2), SLURM_CI_CPUS (8 per node) and SLURM_CI_MEM_MB (16000 per node), over-declared
# so rules keep their real requests,
# SLURM_CI_GPUS (fake GPUs per node, 2), SLURM_CI_PARTITION ("debug": all nodes), SLURM_CI_BUSY_PARTITION
# ("busy": the last node), SLURM_CI_ACCOUNT ("ci": the one account the partitions allow),
# SLURM_CI_BASEPORT (17000).
set -euo pipefail

STATE=${SLURM_CI_STATE:-/var/tmp/memupdate-slurm}
NODES=${SLURM_CI_NODES:-2}
CPUS=${SLURM_CI_CPUS:-8}
MEM=${SLURM_CI_MEM_MB:-16000}
GPUS=${SLURM_CI_GPUS:-2}
PARTITION=${SLURM_CI_PARTITION:-debug}
BUSY_PARTITION=${SLURM_CI_BUSY_PARTITION:-busy}
ACCOUNT=${SLURM_CI_ACCOUNT:-ci}
BASEPORT=${SLURM_CI_BASEPORT:-17000}
DB_PASS=memupdate-ci

log() { echo "[slurm-up] $*" >&2; }

if [[ $(id -u) != 0 ]]; then
    echo "slurm-up.sh needs root (it installs Debian packages and runs the Slurm daemons)" >&2
    exit 2
fi

# --- packages -------------------------------------------------------------------------------------
packages=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$STATE"/{ctld,spool,run,log,fakegpu,markers}
chown -R slurm:slurm "$STATE"

# No network on the compute nodes: slurmstepd runs this before every task (batch scripts and srun steps alike)
# and exports what it prints. Port 9 (discard) on loopback has no listener: a download fails at once. The
# cluster's own hosts stay reachable (servers, Ray): loopback, this host's name and addresses.
own_hosts="localhost,127.0.0.1,$(hostname)"
for addr in $(hostname -I 2>/dev/null); do own_hosts+=",$addr"; done
prolog=$(mktemp)
cat >"$prolog" <<PROLOG
#!/bin/sh
for name in http_proxy https_proxy HTTP_PROXY HTTPS_PROXY grpc_proxy; do echo "export \$name=http://127.0.0.1:9"; done
for name in no_proxy NO_PROXY no_grpc_proxy; do echo "export \$name=$own_hosts"; done
PROLOG

# A process recorded in a pid file that is running (not a zombie: PID 1 here does not reap daemons)
# and is the program we expect.
running() { # pidfile comm
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ -r /proc/$pid/status ]] || return 1
    grep -q '^State:.*Z' "/proc/$pid/status" && return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2"* ]]
}

# --- munge ----------------------------------------------------------------------------------------
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    install -d -o munge -g munge /run/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$STATE/markers/munged"
    # munged writes its pid file under /run/munge.
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# --- MariaDB + slurmdbd ---------------------------------------------------------------------------
if ! mysqladmin ping >/dev/null 2>&1; then
    /etc/init.d/mariadb start >/dev/null
    touch "$STATE/markers/mariadb"
fi
mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
          CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
          GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"

# --- configuration --------------------------------------------------------------------------------
node_names=()
for i in $(seq 1 "$NODES"); do node_names+=("n$i"); done
gres_line=""
((GPUS > 0)) && gres_line="Gres=gpu:$GPUS"

conf=$(mktemp)
{
    cat <<EOF
ClusterName=memupdate-ci
SlurmctldHost=localhost
SlurmUser=slurm
AuthType=auth/munge
# Credentials live 30 s, not 120: a requeued job waits out one lifetime before it runs again (the old attempt's
# credential is revoked meanwhile), and the rehearsal requeues a server.
AuthInfo=cred_expire=30
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
DefMemPerCPU=256
ReturnToService=2
MinJobAge=600
KillWait=5
MailProg=/bin/true
# Refuse at submission what a partition will never run (an account it does not allow), as most sites do.
EnforcePartLimits=ALL
TaskProlog=/etc/slurm/task-prolog.sh
SlurmctldPort=$((BASEPORT - 183))
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
GresTypes=gpu
EOF
    for i in $(seq 1 "$NODES"); do
        echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((BASEPORT + i)) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN $gres_line"
    done
    echo "PartitionName=$PARTITION Nodes=ALL Default=NO AllowAccounts=$ACCOUNT MaxTime=INFINITE State=UP"
    echo "PartitionName=$BUSY_PARTITION Nodes=n$NODES Default=NO AllowAccounts=$ACCOUNT MaxTime=INFINITE State=UP"
} >"$conf"

gres=$(mktemp)
echo "AutoDetect=off" >"$gres"
if ((GPUS > 0)); then
    g=0
    for i in $(seq 1 "$NODES"); do
        first=$g
        for _ in $(seq 1 "$GPUS"); do
            ln -sfn /dev/null "$STATE/fakegpu/gpu$g"
            g=$((g + 1))
        done
        echo "NodeName=n$i Name=gpu File=$STATE/fakegpu/gpu[$first-$((g - 1))]"
    done >>"$gres"
fi

dbd=$(mktemp)
cat >"$dbd" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=$((BASEPORT - 181))
SlurmUser=slurm
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
echo "AccountingStoragePort=$((BASEPORT - 181))" >>"$conf"

changed=0
install_conf() { # generated target mode owner
    if ! cmp -s "$1" "$2"; then
        install -m "$3" -o "$4" -g "$4" "$1" "$2"
        changed=1
    fi
    rm -f "$1"
}
mkdir -p /etc/slurm
install_conf "$conf" /etc/slurm/slurm.conf 644 root
install_conf "$gres" /etc/slurm/gres.conf 644 root
install_conf "$dbd" /etc/slurm/slurmdbd.conf 600 slurm
install_conf "$prolog" /etc/slurm/task-prolog.sh 755 root

stop_pidfile() { # pidfile comm
    if running "$1" "$2"; then
        local pid
        pid=$(<"$1")
        kill "$pid"
        for _ in $(seq 150); do running "$1" "$2" || return 0; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
}
if ((changed)); then
    log "configuration changed: (re)starting the Slurm daemons"
    for n in "${node_names[@]}"; do stop_pidfile "$STATE/run/slurmd-$n.pid" slurmd; done
    stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
    stop_pidfile "$STATE/run/slurmdbd.pid" slurmdbd
fi

# --- daemons --------------------------------------------------------------------------------------
running "$STATE/run/slurmdbd.pid" slurmdbd || slurmdbd
for _ in $(seq 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.1; done
running "$STATE/run/slurmctld.pid" slurmctld || slurmctld
for n in "${node_names[@]}"; do
    mkdir -p "$STATE/spool/$n"
    running "$STATE/run/slurmd-$n.pid" slurmd || slurmd -N "$n"
done

# Nodes left down or drained by an earlier run come back; then wait until every node takes jobs.
for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
scontrol update NodeName="$(IFS=,; echo "${node_names[*]}")" State=RESUME >/dev/null 2>&1 || true
for _ in $(seq 300); do
    states=$(sinfo -h -N -o "%t" | sort -u | tr '\n' ' ')
    [[ $states =~ ^((idle|alloc|mix)[[:space:]])+$ ]] && break
    sleep 0.2
done
[[ $states =~ ^((idle|alloc|mix)[[:space:]])+$ ]] || { log "nodes are not up: $states"; sinfo -N; exit 1; }

# The account jobs must name, with root as a user of it (root's default account stays `root`, which no
# partition allows).
sacctmgr -i add account "$ACCOUNT" Description=ci >/dev/null 2>&1 || true
sacctmgr -i add user root Account="$ACCOUNT" >/dev/null 2>&1 || true

if [[ -z $(squeue -h -o %i) ]]; then
    timeout 60 srun -p "$PARTITION" -A "$ACCOUNT" -N "$NODES" true
fi
log "cluster memupdate-ci up: ${#node_names[@]} nodes, $GPUS fake GPUs each, state in $STATE"
