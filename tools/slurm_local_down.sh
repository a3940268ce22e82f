#!/usr/bin/env bash
# Stop the one-node Slurm cluster started by tools/slurm_local_up.sh (slurmd, slurmctld, munged), by the
# process ids in their pid files (never by name: other daemons on the machine are left alone). --purge also deletes the saved controller state and the job logs,
# so the next start has no jobs left over.
set -euo pipefail

say() { echo "slurm_local_down: $*"; }
[[ $(id -u) -eq 0 ]] || { echo "slurm_local_down: error: must run as root" >&2; exit 1; }

stop_pidfile() {
    local name=$1 pidfile=$2 pid
    [[ -s $pidfile ]] || return 0
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        say "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

stop_pidfile slurmd /run/slurmd.pid
stop_pidfile slurmctld /run/slurmctld.pid
stop_pidfile munged /run/munge/munged.pid
if [[ ${1:-} == --purge ]]; then
    say "purging /var/spool/slurmctld /var/spool/slurmd /var/log/slurm"
    rm -rf /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
fi
