#!/usr/bin/env bash
# The README's main job: set up (idempotent), then `ds-resilience demo`: train the example GPT on
# CPU with PP=2 x DP=2 under the agent, SIGKILL one worker mid-run, keep training (its micro-batches
# re-routed to its data-parallel peer), and compare with a fault-free run of the same steps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup_env.sh
export OMP_NUM_THREADS=1
# DeepSpeed's JIT ops (the config's "Adam" is FusedAdam, a JIT-built op on CPU; the shm comm op) are
# built beside this checkout's .venv: ~/.cache/torch_extensions is shared by every DeepSpeed install
# of the user, and two installs loading the same op name rebuild it in turn (about a minute each)
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
exec .venv/bin/ds-resilience demo "$@"
