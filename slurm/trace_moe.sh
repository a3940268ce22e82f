#!/bin/bash
# FP4 RL post-training of an MoE model (TRACE + AIS + AQN + R3) on a Slurm cluster.
#
#   sbatch slurm/trace_moe.sh [CONFIG] [section.field=value ...]          # from the repository root
#   sbatch --nodes=1 --gpus-per-node=0 slurm/trace_moe.sh configs/tiny_cpu.yaml   # CPU, gloo
#
# One srun task per node runs torchrun (slurm/node_launch.sh); the torchrun agents meet in a c10d
# rendezvous hosted on the job's first node. 180 s before the time limit Slurm sends USR1 to this script,
# which requeues the job; the next start passes run.resume=true and continues from the latest checkpoint
# in run.output_dir. Node failure and preemption (PreemptMode=REQUEUE) requeue through --requeue.
# Environment variables are documented in docs/slurm.md.
#
#SBATCH --job-name=trace-moe
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --open-mode=append
#SBATCH --output=slurm/logs/%x-%j.out

set -euo pipefail

say() { echo "trace_moe[$(date +%H:%M:%S)]: $*"; }
die() { echo "trace_moe: error: $*" >&2; exit 2; }

[[ -n ${SLURM_JOB_ID:-} ]] || die "run me with sbatch (sbatch slurm/trace_moe.sh CONFIG ...), not bash"

# --- repository and Python: sbatch runs a spooled copy of this file, so locate the repo by submit dir --------
REPO=${QRL_REPO:-$SLURM_SUBMIT_DIR}
[[ -f $REPO/slurm/node_launch.sh ]] || die "'$REPO' is not the megatron-qrl repository: submit from the \
repository root or set QRL_REPO=/path/to/megatron-qrl"
cd "$REPO"
if [[ -f .venv/bin/activate ]]; then
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi
export QRL_REPO=$REPO

# --- config and overrides: the first argument is the config unless it is an override (has '=') -------------
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [[ ${QRL_DEVICE:-} != cpu ]]; then
    export QRL_DEVICE=cuda
else
    export QRL_DEVICE=cpu
fi
if [[ $# -gt 0 && $1 != *=* ]]; then
    CONFIG=$1; shift
elif [[ $QRL_DEVICE == cpu ]]; then
    CONFIG=${QRL_CONFIG:-configs/tiny_cpu.yaml}
else
    CONFIG=${QRL_CONFIG:-configs/qwen3_30b_a3b.yaml}
fi
if [[ ! -f $CONFIG ]]; then
    shopt -s nullglob
    available=(configs/*.yaml)
    die "config '$CONFIG' not found in $REPO; available: ${available[*]:-none}"
fi
# Ours first, so the user's overrides (applied in order) win; run.resume=true makes a requeued job continue.
OVERRIDES=(run.resume=true)
[[ -n ${QRL_OUTPUT_DIR:-} ]] && OVERRIDES+=("run.output_dir=$QRL_OUTPUT_DIR")
OVERRIDES+=("$@")

# --- processes and rendezvous -----------------------------------------------------------------------------
if [[ $QRL_DEVICE == cuda ]]; then
    export QRL_DIST_BACKEND=${QRL_DIST_BACKEND:-nccl}
    export QRL_NPROC_PER_NODE=${QRL_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L | wc -l)}}
else
    export QRL_DIST_BACKEND=${QRL_DIST_BACKEND:-gloo}
    export QRL_NPROC_PER_NODE=${QRL_NPROC_PER_NODE:-1}
fi
CPUS_ON_NODE=${SLURM_CPUS_ON_NODE:-$(nproc)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPUS_ON_NODE / QRL_NPROC_PER_NODE > 0 ? CPUS_ON_NODE / QRL_NPROC_PER_NODE : 1 ))}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
RESTART=${SLURM_RESTART_COUNT:-0}
# A fresh port and rendezvous id per attempt: a requeued job may land on a head node where the old
# store's socket is still in TIME_WAIT.
export QRL_RDZV_ENDPOINT=${QRL_HEAD_ADDR:-$HEAD_NODE}:${QRL_RDZV_PORT:-$(( 15000 + (SLURM_JOB_ID * 13 + RESTART) % 20000 ))}
export QRL_RDZV_ID=$SLURM_JOB_ID-$RESTART
export QRL_TRAIN_MODULE=${QRL_TRAIN_MODULE:-megatron_qrl.launch.train}

# --- NCCL (GPU runs; harmless on CPU). Each can be overridden from the submitting shell ---------------------
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}                       # NVLink SHARP/multicast off (docs/slurm.md)
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}                        # tolerate transient IB link flaps
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a dead peer aborts, not hangs
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}   # Megatron TP/SP comm-compute overlap

# --- W&B: offline (synced later with `wandb sync`) unless a key or mode is given -----------------------------
if [[ -z ${WANDB_MODE:-} && -z ${WANDB_API_KEY:-} ]]; then export WANDB_MODE=offline; fi
export WANDB__SERVICE_WAIT=${WANDB__SERVICE_WAIT:-300}              # slow shared filesystems at startup
export WANDB_RUN_GROUP=${WANDB_RUN_GROUP:-slurm-$SLURM_JOB_ID}

# --- requeue on the time-limit warning (USR1) ----------------------------------------------------------------
REQUEUED=0
requeue() {
    local max=${QRL_MAX_REQUEUES:-50}
    if (( RESTART >= max )); then
        say "USR1: restart $RESTART reached QRL_MAX_REQUEUES=$max; not requeueing"
        return
    fi
    say "USR1: requeueing job $SLURM_JOB_ID (restart $RESTART); the next start resumes from the latest checkpoint"
    if scontrol requeue "$SLURM_JOB_ID"; then
        REQUEUED=1
    else
        say "error: scontrol requeue failed (does the cluster allow requeue? JobRequeue, --requeue)"
    fi
}
trap requeue USR1

say "job $SLURM_JOB_ID restart $RESTART: $SLURM_JOB_NUM_NODES node(s) x $QRL_NPROC_PER_NODE proc ($QRL_DEVICE," \
    "$QRL_DIST_BACKEND), rendezvous $QRL_RDZV_ENDPOINT, module $QRL_TRAIN_MODULE"
say "config $CONFIG overrides: ${OVERRIDES[*]}"

# srun runs in the background: bash delivers a trapped signal only between commands, and `wait` is one.
srun --ntasks-per-node=1 --cpus-per-task="$CPUS_ON_NODE" --kill-on-bad-exit=1 \
    "$REPO/slurm/node_launch.sh" "$CONFIG" "${OVERRIDES[@]}" &
SRUN_PID=$!
STATUS=0
while kill -0 "$SRUN_PID" 2>/dev/null; do
    wait "$SRUN_PID" && STATUS=0 || STATUS=$?
done
if (( REQUEUED )); then
    say "waiting for Slurm to requeue the job"
    sleep 60  # scontrol requeue ends this script; never report an exit status for a requeued attempt
fi
say "training exited with status $STATUS"
exit "$STATUS"
