#!/usr/bin/env bash
# Set up (idempotent) and run the tests.
#   bash tests/run.sh                              the whole suite (CI): unit and dist on three
#                                                  workers, then live on two workers (a test file
#                                                  per worker: live jobs spend much of their time
#                                                  in paced steps and detection waits)
#   bash tests/run.sh -m "not dist and not live"   the contributor's loop (one process per test)
#   bash tests/run.sh [pytest args]                anything else, as pytest takes it
set -uo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup_env.sh || exit 1
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# DeepSpeed's JIT ops (FusedAdam, the shm comm op) built once per checkout's venv and shared by every
# test: ~/.cache/torch_extensions is shared by every DeepSpeed install (they rebuild in turn, and a
# build killed mid-way leaves a lock that hangs the next job); benchmarks/gpu_engine_check.py and
# examples/main_job.sh use the same place
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
# built before any test runs (about 60 s the first time, 3 s after): a test that kills a worker then
# never kills a build, and a lock a killed worker left is removed (tests/tools/build_ops.py)
.venv/bin/python tests/tools/build_ops.py 2>&1 | grep "^build_ops\|ds_resilience\|Error" || exit 1
PYTEST=(.venv/bin/python -m pytest -c tests/pytest.ini -q)
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
reports=$(mktemp -d)
t0=$SECONDS
# --no-loadscope-reorder: files go to the workers longest first, as conftest.py orders them from
# tests/durations.json (xdist's default hands out the files with the most tests first, which left a
# long file of few tests to start last). Three workers on two cores: the dist tier's jobs spend most of their time starting processes and
# waiting on each other (the whole suite used a quarter of the machine's CPU time on two workers)
"${PYTEST[@]}" -n 3 --dist loadfile --no-loadscope-reorder -m "not live" --junitxml="$reports/unit_dist.xml"
first=$?
echo "unit and dist tiers: exit $first in $((SECONDS - t0)) s"
t1=$SECONDS
"${PYTEST[@]}" -n 2 --dist loadfile --no-loadscope-reorder -m "live and not alone" --junitxml="$reports/live.xml"
second=$?
# the tests marked alone (conftest.ALONE): their recovery fails under a second job's load
"${PYTEST[@]}" -m "live and alone" --junitxml="$reports/live_alone.xml" || second=1
echo "live tier: exit $second in $((SECONDS - t1)) s"
.venv/bin/python tests/tools/junit_total.py "$reports"/*.xml
echo "whole suite: $((SECONDS - t0)) s"
mkdir -p .test-reports && cp "$reports"/*.xml .test-reports/ && rm -rf "$reports"  # for tests/tools/durations.py
[ "$first" = 0 ] && [ "$second" = 0 ]
