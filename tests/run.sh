#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: bash tests/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup_env.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
exec .venv/bin/python -m pytest -c tests/pytest.ini -q "$@"
