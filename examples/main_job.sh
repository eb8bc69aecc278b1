#!/usr/bin/env bash
# The README's main job: set up (idempotent), then plan and measure the reference schedule.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup_env.sh
.venv/bin/ds-resilience plan --dp 3 --pp 4 --microbatches 6 --schedule 1f1b
.venv/bin/ds-resilience plan --dp 3 --pp 4 --microbatches 6 --schedule decoupled --png out/reference_decoupled.png
