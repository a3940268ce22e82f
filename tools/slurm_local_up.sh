#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine (as root, no systemd), so sbatch/srun/scontrol work
# for tests and for trying slurm/trace_moe.sh at toy scale. Idempotent: a second run only checks health.
#
#   sudo tools/slurm_local_up.sh          # install (apt) if needed, write config, start daemons, wait idle
#   tools/slurm_local_down.sh [--purge]    # stop them again
#
# Env: QRL_SLURM_UP_TIMEOUT (s, default 60) how long to wait for the node to become idle;
#      QRL_SLURM_FORCE=1 overwrite an /etc/slurm/slurm.conf that this script did not write.
# Job completion records (state, exit code) go to /var/log/slurm/jobcomp.log (jobcomp/filetxt) because
# sacct needs slurmdbd + a database, which a throwaway cluster does not have.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARKER="# managed by megatron-qrl tools/slurm_local_up.sh"
LOG_DIR=/var/log/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
JOBCOMP_LOG=$LOG_DIR/jobcomp.log
TIMEOUT=${QRL_SLURM_UP_TIMEOUT:-60}

die() { echo "slurm_local_up: error: $*" >&2; exit 1; }
say() { echo "slurm_local_up: $*"; }

[[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts munged/slurmctld/slurmd)"

install_packages() {
    local missing=()
    for bin in munged slurmctld slurmd sbatch scontrol sinfo; do
        command -v "$bin" >/dev/null || missing+=("$bin")
    done
    [[ ${#missing[@]} -eq 0 ]] && return
    say "installing slurm-wlm and munge (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null || die "apt-get update failed"
    apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
        || die "apt-get install slurm-wlm munge failed"
}

# munged authenticates every Slurm RPC; it must run before slurmctld/slurmd.
start_munge() {
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating /etc/munge/munge.key"
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return
    fi
    rm -f /run/munge/munge.socket.2 /run/munge/munged.pid
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid \
        || die "munged failed to start; see /var/log/munge/munged.log"
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.1
    done
    die "munged started but 'munge -n | unmunge' still fails; see /var/log/munge/munged.log"
}

# slurm.conf describes this one machine as the controller and the only compute node.
render_conf() {
    local host node_line
    host=$(hostname -s)
    # slurmd -C prints the hardware exactly as slurmd will detect it, so the node never drains for
    # "low memory/CPUs"; keep only the NodeName line.
    node_line=$(slurmd -C 2>/dev/null | grep '^NodeName=' | head -n1)
    [[ -n $node_line ]] || die "'slurmd -C' did not print a NodeName line"
    cat <<EOF
$MARKER
ClusterName=qrl-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
SwitchType=switch/none
# Containers (and gVisor) have no usable cgroups: track processes through /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$JOBCOMP_LOG
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=60
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=5
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
    local new
    new=$(render_conf)
    if [[ -f $CONF ]] && ! grep -qF "$MARKER" "$CONF" && [[ ${QRL_SLURM_FORCE:-0} != 1 ]]; then
        die "$CONF exists and was not written by this script; set QRL_SLURM_FORCE=1 to replace it"
    fi
    if [[ -f $CONF ]] && [[ "$(cat "$CONF")" == "$new" ]]; then
        return 1  # unchanged
    fi
    install -d -m 0755 "$CONF_DIR"
    printf '%s\n' "$new" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
    say "wrote $CONF"
    return 0
}

start_slurm() {
    install -d -m 0755 "$LOG_DIR" "$STATE_DIR" "$SPOOL_DIR"
    touch "$JOBCOMP_LOG"
    if ! pid_alive /run/slurmctld.pid; then
        say "starting slurmctld"
        /usr/sbin/slurmctld || die "slurmctld failed to start; see $LOG_DIR/slurmctld.log"
    fi
    if ! pid_alive /run/slurmd.pid; then
        say "starting slurmd"
        /usr/sbin/slurmd || die "slurmd failed to start; see $LOG_DIR/slurmd.log"
    fi
}

wait_idle() {
    local host state deadline resumed=0
    host=$(hostname -s)
    deadline=$((SECONDS + TIMEOUT))
    while ((SECONDS < deadline)); do
        state=$(sinfo -h -N -n "$host" -o '%t' 2>/dev/null | head -n1 || true)
        case $state in
            idle|mix|alloc|comp) say "node $host is $state"; return 0 ;;
            down*|drain*|drng*|fail*)
                # A previous run may have left the node down in the saved state; bring it back once.
                if ((resumed == 0)); then
                    scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true
                    resumed=1
                fi ;;
        esac
        sleep 0.5
    done
    echo "--- sinfo:" >&2; sinfo -N -l >&2 || true
    echo "--- tail $LOG_DIR/slurmctld.log:" >&2; tail -n 20 "$LOG_DIR/slurmctld.log" >&2 || true
    echo "--- tail $LOG_DIR/slurmd.log:" >&2; tail -n 20 "$LOG_DIR/slurmd.log" >&2 || true
    die "node $host not idle after ${TIMEOUT}s (last state: '${state:-none}'); logs above"
}

install_packages
if write_conf && { pid_alive /run/slurmctld.pid || pid_alive /run/slurmd.pid; }; then
    say "config changed: restarting the daemons"
    "$(dirname "$0")/slurm_local_down.sh"
fi
start_munge
start_slurm
wait_idle
