#!/usr/bin/env bash
# Runs the torch-driven interop tests (real gloo ranks spawned by tests/interop/ranks.py) N times in a
# row and stops at the first failure: the check that a rank aborting at teardown never fails a test.
# Run it while the machine is busy (a build, a benchmark) to reproduce the conditions of the flake.
#
#   SHARDSCOPE_PYTHON=~/.cache/shardscope/torch-venv/bin/python scripts/interop-loop.sh [N=10] [PKG:TEST ...]
#
# Default: every test binary that spawns gloo ranks. One line per test binary and round: exit status,
# seconds, 1-minute load average, the test summary.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-10}"
shift || true
tests=("$@")
if [ "${#tests[@]}" = 0 ]; then
  tests=(
    shardscope-tests:convert_interop shardscope-tests:convert_fsdp2_optim
    shardscope-tests:export_interop shardscope-tests:interop_ranks shardscope-tests:reshard_fsdp2
    shardscope-runner:reshard_cli shardscope-runner:fsdp1_view
  )
fi
for pt in "${tests[@]}"; do
  cargo test -q -p "${pt%%:*}" --no-run --test "${pt#*:}" || exit 2
done
for round in $(seq 1 "$rounds"); do
  for pt in "${tests[@]}"; do
    start=$(date +%s)
    out=$(cargo test -q -p "${pt%%:*}" --test "${pt#*:}" 2>&1); rc=$?
    echo "round $round ${pt#*:} rc=$rc $(( $(date +%s) - start ))s load=$(cut -d' ' -f1 /proc/loadavg) $(grep 'test result' <<<"$out" | tail -1)"
    if [ "$rc" != 0 ]; then
      echo "$out" | tail -40
      exit 1
    fi
  done
done
echo "all $rounds rounds passed"
