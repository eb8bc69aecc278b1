#!/usr/bin/env bash
# The README's main job: set up (idempotent), then train the example GPT on CPU with PP=2 x DP=2
# through ds_resilience's engine, first fault-free, then with worker 1:1 failed (simulated: left
# idle while its micro-batches are re-routed to worker 0:1). The two runs print the same losses.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup_env.sh
export OMP_NUM_THREADS=1
port=$(.venv/bin/python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
.venv/bin/deepspeed --num_gpus 4 --master_port "$port" examples/train_gpt.py \
    --deepspeed_config configs/gpt_cpu_pp2_dp2.json --steps 20 2>&1 | grep -E "^(ds_resilience|planner|step|done)"
port=$(.venv/bin/python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
.venv/bin/deepspeed --num_gpus 4 --master_port "$port" examples/train_gpt.py \
    --deepspeed_config configs/gpt_cpu_pp2_dp2_failed.json --steps 20 2>&1 | grep -E "^(ds_resilience|planner|step|done)"
