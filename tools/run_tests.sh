#!/usr/bin/env bash
# The whole test suite on a fresh Debian machine (no GPU): venv + installs, local services, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh test
# shellcheck disable=SC1091
. .venv/bin/activate
if [ -f tools/slurm_local_up.sh ]; then
  bash tools/slurm_local_up.sh   # a one-node Slurm cluster on localhost for the sbatch tests
fi
export WANDB_MODE="${WANDB_MODE:-offline}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
python -m pytest -q -p no:cacheprovider "$@" tests
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure for this project" >&2
  exit 1
fi
exit "$rc"
