#!/usr/bin/env bash
# Runs the torch-driven interop tests (real gloo ranks spawned by tests/interop/ranks.py) N times in a
# row and stops at the first failure: the check that a rank aborting at teardown never fails a test.
# Run it while the machine is busy (a build, a benchmark) to reproduce the conditions of the flake.
#
#   SHARDSCOPE_PYTHON=~/.cache/shardscope/torch-venv/bin/python scripts/interop-loop.sh [N=10] [MODULE ...]
#
# MODULE: a module of the runner's one integration-test binary (native-runner/tests/it). Default: every
# module that spawns gloo ranks. One line per module and round: exit status, seconds, 1-minute load
# average, the test summary.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-10}"
shift || true
tests=("$@")
if [ "${#tests[@]}" = 0 ]; then
  tests=(convert_interop convert_fsdp2_optim export_interop interop_ranks reshard_fsdp2 reshard_cli fsdp1_view)
fi
cargo test -q -p shardscope-runner --no-run --test it || exit 2
for round in $(seq 1 "$rounds"); do
  for m in "${tests[@]}"; do
    start=$(date +%s)
    out=$(cargo test -q -p shardscope-runner --test it -- "$m::" 2>&1); rc=$?
    echo "round $round $m rc=$rc $(( $(date +%s) - start ))s load=$(cut -d' ' -f1 /proc/loadavg) $(grep 'test result' <<<"$out" | tail -1)"
    if [ "$rc" != 0 ]; then
      echo "$out" | tail -40
      exit 1
    fi
  done
done
echo "all $rounds rounds passed"
