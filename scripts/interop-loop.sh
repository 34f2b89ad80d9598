#!/usr/bin/env bash
# Runs the torch-driven interop tests (real gloo ranks spawned by tests/interop/ranks.py) N times in a
# row and stops at the first failure: the check that a rank aborting at teardown never fails a test.
# Run it while the machine is busy (a build, a benchmark) to reproduce the conditions of the flake.
#
#   SHARDSCOPE_PYTHON=~/.cache/shardscope/torch-venv/bin/python scripts/interop-loop.sh [N=10]
#
# One line per test binary and round: exit status, seconds, 1-minute load average, the test summary.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-10}"
tests=(convert_interop convert_fsdp2_optim export_interop interop_ranks)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
cargo test -q -p shardscope-tests --no-run "${args[@]}" || exit 2
for round in $(seq 1 "$rounds"); do
  for t in "${tests[@]}"; do
    start=$(date +%s)
    out=$(cargo test -q -p shardscope-tests --test "$t" 2>&1); rc=$?
    echo "round $round $t rc=$rc $(( $(date +%s) - start ))s load=$(cut -d' ' -f1 /proc/loadavg) $(grep 'test result' <<<"$out" | tail -1)"
    if [ "$rc" != 0 ]; then
      echo "$out" | tail -40
      exit 1
    fi
  done
done
echo "all $rounds rounds passed"
