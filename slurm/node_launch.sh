#!/bin/bash
# One srun task per node (started by slurm/trace_moe.sh): runs torchrun's agent, which spawns
# QRL_NPROC_PER_NODE workers of `python -m $QRL_TRAIN_MODULE --config CONFIG [overrides]` and joins the
# c10d rendezvous at QRL_RDZV_ENDPOINT. The agent exits non-zero when any worker fails.
set -euo pipefail
cd "$QRL_REPO"
if [[ -f .venv/bin/activate ]]; then
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi
CONFIG=$1; shift
exec python -m torch.distributed.run \
    --nnodes="$SLURM_JOB_NUM_NODES" \
    --nproc-per-node="$QRL_NPROC_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$QRL_RDZV_ENDPOINT" \
    --rdzv-id="$QRL_RDZV_ID" \
    --max-restarts=0 \
    -m "$QRL_TRAIN_MODULE" --config "$CONFIG" "$@"
