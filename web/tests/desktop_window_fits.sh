#!/usr/bin/env bash
# The desktop viewer's window fills the screen it opens on, whatever its size (issue 38): started
# under Xvfb on screens smaller and larger than its 1400x860 default, with no window manager (the
# viewer then sizes the window itself), its window must fit the screen and cover at least 95% of
# each side. Usage: web/tests/desktop_window_fits.sh [VIEWER_BINARY]
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-}
if [ -z "$BIN" ]; then
  cargo build -q -p shardscope-viewer --bin shardscope-viewer
  BIN="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/shardscope-viewer"
fi
check() { # WIDTH HEIGHT
  local w=$1 h=$2 n=97
  while [ -e "/tmp/.X$n-lock" ]; do n=$((n + 1)); done
  local display=":$n" log
  log=$(mktemp)
  Xvfb "$display" -screen 0 "${w}x${h}x24" -nolisten tcp >/dev/null 2>&1 &
  local xvfb=$! app=""
  trap 'kill $app $xvfb 2>/dev/null || true' RETURN
  for _ in $(seq 1 50); do DISPLAY="$display" xwininfo -root >/dev/null 2>&1 && break; sleep 0.2; done
  DISPLAY="$display" LIBGL_ALWAYS_SOFTWARE=1 "$BIN" >"$log" 2>&1 &
  app=$!
  local got="" gw=0 gh=0
  # The window appears at its default size, then is resized once the viewer knows the monitor.
  for _ in $(seq 1 60); do
    sleep 0.5
    kill -0 "$app" 2>/dev/null || { cat "$log" >&2; echo "error: the viewer exited" >&2; return 1; }
    got=$(DISPLAY="$display" xwininfo -name shardscope 2>/dev/null | awk '/Width:/ {w=$2} /Height:/ {h=$2} END {print w, h}') || got=""
    read -r gw gh <<<"${got:-0 0}"
    if [ "${gw:-0}" -le "$w" ] && [ "${gh:-0}" -le "$h" ] && [ $((gw * 100)) -ge $((w * 95)) ] && [ $((gh * 100)) -ge $((h * 95)) ]; then
      echo "screen ${w}x${h}: window ${gw}x${gh}: fits and fills it"
      return 0
    fi
  done
  echo "error: screen ${w}x${h}: the window is ${gw}x${gh} (it must fit the screen and cover 95% of it)" >&2
  cat "$log" >&2
  return 1
}
check 1100 700
check 1920 1080
