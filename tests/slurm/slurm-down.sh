#!/usr/bin/env bash
# Stop the cluster slurm-up.sh started: cancel its jobs, stop each slurmd, slurmctld and slurmdbd by its
# pid file (TERM, then KILL after 15 s), remove its slurm.conf, and stop MariaDB and munged only if
# slurm-up.sh started them.
# `--purge` also removes $SLURM_CI_STATE. Safe to run when nothing is running.
set -uo pipefail

STATE=${SLURM_CI_STATE:-/var/tmp/memupdate-slurm}

log() { echo "[slurm-down] $*" >&2; }

alive() { # pid comm
    [[ -r /proc/$1/status ]] || return 1
    grep -q '^State:.*Z' "/proc/$1/status" && return 1
    [[ $(cat "/proc/$1/comm" 2>/dev/null) == "$2"* ]]
}

stop() { # pidfile comm
    [[ -s $1 ]] || return 0
    local pid
    pid=$(<"$1")
    if alive "$pid" "$2"; then
        kill "$pid" 2>/dev/null
        for _ in $(seq 150); do alive "$pid" "$2" || break; sleep 0.1; done
        if alive "$pid" "$2"; then
            log "$2 ($pid) ignored TERM; killing it"
            kill -9 "$pid" 2>/dev/null
        fi
        log "stopped $2 ($pid)"
    fi
    rm -f "$1"
}

if [[ -d $STATE/run ]]; then
    if [[ -s $STATE/run/slurmctld.pid ]] && alive "$(<"$STATE/run/slurmctld.pid")" slurmctld; then
        # Every job of this private cluster; a job left running would keep its processes alive.
        jobs=$(squeue -h -o %i 2>/dev/null)
        [[ -n $jobs ]] && scancel $jobs && log "cancelled jobs: $(echo $jobs)"
    fi
    for pidfile in "$STATE"/run/slurmd-*.pid; do
        [[ -e $pidfile ]] && stop "$pidfile" slurmd
    done
    stop "$STATE/run/slurmctld.pid" slurmctld
    stop "$STATE/run/slurmdbd.pid" slurmdbd
fi

# Our slurm.conf goes with the daemons (slurm-up.sh writes it anew). Left in place, it names a controller
# that is gone, and every Slurm client call waits ~9 s for it: `scontrol show config`, which the Snakemake
# Slurm plugin runs at import, so every snakemake start on this machine, local profile included.
if grep -qx 'ClusterName=memupdate-ci' /etc/slurm/slurm.conf 2>/dev/null; then
    rm -f /etc/slurm/slurm.conf
    log "removed /etc/slurm/slurm.conf (memupdate-ci)"
fi

if [[ -e $STATE/markers/mariadb ]]; then
    /etc/init.d/mariadb stop >/dev/null 2>&1 && log "stopped mariadb"
    rm -f "$STATE/markers/mariadb"
fi
if [[ -e $STATE/markers/munged ]]; then
    pidfile=/run/munge/munged.pid
    [[ -s $pidfile ]] && stop "$pidfile" munged
    rm -f "$STATE/markers/munged"
fi

if [[ ${1:-} == --purge ]]; then
    rm -rf "$STATE"
    log "removed $STATE"
fi
exit 0
