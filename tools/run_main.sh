#!/usr/bin/env bash
# The main job on a fresh Debian machine (no GPU): venv + installs, then the tiny MoE RL run on CPU.
# Extra arguments are config overrides, e.g. `bash tools/run_main.sh run.total_steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh main
# shellcheck disable=SC1091
. .venv/bin/activate
export WANDB_MODE="${WANDB_MODE:-$([ -n "${WANDB_API_KEY:-}" ] && echo online || echo offline)}"
exec qrl train --config configs/tiny_cpu.yaml "$@"
