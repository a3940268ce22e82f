#!/usr/bin/env bash
# Create or reuse the virtual environment at .venv and install megatron-qrl with what a job needs.
# Usage: bash tools/bootstrap.sh [main|test]     (idempotent: a stamp skips work already done)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-main}"
PY="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

STAMP=".venv/.qrl-bootstrap-$MODE"
WANT="$(cat setup.py tools/bootstrap.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q --upgrade pip
# torch 2.13.0: a CPU build lies on the CI/dev machines' disk; elsewhere pip picks the platform's wheel.
python -m pip install -q "torch==2.13.0" "numpy<2.5" "packaging>=24.2"
# megatron-core 0.19.2 ships a cp311 wheel but declares Requires-Python >= 3.12; its own dependencies
# (torch, numpy, packaging) are installed above, so it goes in without resolving (docs/megatron.md).
if ! python -c "import megatron.core" 2>/dev/null; then
  if python -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
    python -m pip install -q "megatron-core==0.19.2"
  else
    python -m pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
  fi
fi
if [ "$MODE" = "test" ]; then
  python -m pip install -q -e ".[test]"
else
  python -m pip install -q -e ".[monitor]"
fi
echo "$WANT" > "$STAMP"
