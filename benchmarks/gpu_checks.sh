#!/usr/bin/env bash
# Every GPU check of this project in one run, for a lent GPU machine (CI has none):
#   bash benchmarks/gpu_checks.sh [OUT_DIR]
# 1. B + W against the fused backward on the GPU (benchmarks/bw_split.py);
# 2. the csrc copy kernel built in place for the visible GPU (setup.py build_ext);
# 3. every test marked gpu / multigpu (the multigpu ones skip with a reason below their GPU count);
# 4. the copy kernels' D2H staging throughput and interference (benchmarks/copy_kernel.py --quick);
# 5. with DEVICE_ENGINE=1, the engine against vanilla DeepSpeed on the machine's CPU cores, a core per
#    worker, the GPU hidden (benchmarks/engine.py --world 4 and --world 2): the fidelity figures
#    that a 2-core machine cannot give. It needs deepspeed, its pydantic and hjson, and ortools on
#    PYTHONPATH (carried as wheels to a lent machine: see docs/benchmarks/engine.md, "A core per worker").
# 6. the DeepSpeed engine on the one GPU (benchmarks/gpu_engine_check.py --device cuda): 4 ranks on cuda:0
#    (gloo stages the CUDA tensors), FusedAdam (JIT-built here: needs nvcc and ninja), bf16, in-memory
#    snapshots every step through the CUDA path (checked per rank) and replicated, rank 1 SIGKILLed
#    mid-backward; the survivors' fp32 masters must equal the fault-free run's. Prints a verdict line
#    (gpu_engine_check: PASS|FAIL), the op build, both runs' wall times and the recovery latencies.
#    Needs deepspeed importable (as step 5). Expected 2-3 min (most of it the FusedAdam JIT build; not yet
#    timed on a GPU), limit 300 s:
#    GPU_ENGINE_ONLY=1 runs it alone, as one device call (the other steps' limits add up to 630 s).
# Each step has its own time limit, so one hang cannot eat the others; logs and JSON go to OUT_DIR.
set -u -o pipefail
out=${1:-${OUT:-/tmp/gpu_checks}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
py=${PYTHON:-python3}
nvidia-smi -L 2>&1 | tee "$out/device.txt"
$py -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$out/device.txt"
rc=0
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"; local r=${PIPESTATUS[0]}
  echo "=== $name: rc=$r in $((SECONDS - t0))s"; [ "$r" = 0 ] || rc=1; }
engine_one_gpu() {
  if ! $py -c "import deepspeed" > /dev/null 2>&1; then
    echo "=== engine_one_gpu: deepspeed not importable (PYTHONPATH=${PYTHONPATH:-}): skipped"; rc=1; return; fi
  step engine_one_gpu 300 $py benchmarks/gpu_engine_check.py --device cuda --steps 12 --json "$out/engine_one_gpu.json"
}
if [ "${GPU_ENGINE_ONLY:-0}" = 1 ]; then engine_one_gpu; exit $rc; fi
step bw_split 120 $py benchmarks/bw_split.py --json "$out/bw_split.json"
arch=$($py -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
step build_ext 180 env DSR_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS=8 $py setup.py -q build_ext --inplace
step pytest_gpu 180 $py -m pytest -c tests/pytest.ini -q -p no:cacheprovider -rs -m "gpu or multigpu" \
  tests/dist/test_kernels.py tests/unit/test_accelerator.py tests/dist/test_multigpu.py
step copy_kernel 150 $py benchmarks/copy_kernel.py --quick --json "$out/copy_kernel.json"
if [ "${DEVICE_ENGINE:-0}" = 1 ]; then
  if ! $py -c "import deepspeed, ortools" > /dev/null 2>&1; then
    echo "=== engine: deepspeed or ortools not importable (PYTHONPATH=${PYTHONPATH:-}): skipped"; rc=1
  else
    step engine_world4 330 env CUDA_VISIBLE_DEVICES= $py benchmarks/engine.py --world 4 --json "$out/engine_world4.json"
    step engine_world2 120 env CUDA_VISIBLE_DEVICES= $py benchmarks/engine.py --world 2 --json "$out/engine_world2.json"
  fi
fi
engine_one_gpu
exit $rc
