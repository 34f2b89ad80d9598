#!/usr/bin/env bash
# Starts the desktop viewer under Xvfb on the bundled example and takes a screenshot.
#   web/tests/desktop_screenshot.sh [OUT_PNG] [VIEWER_BINARY]
# Defaults: docs/img/desktop.png, target/debug/shardscope-viewer (built if missing).
# Fails if the window never appears or the screenshot is blank.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-docs/img/desktop.png}
BIN=${2:-}
if [ -z "$BIN" ]; then
  cargo build -q -p shardscope-viewer --bin shardscope-viewer
  BIN="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/shardscope-viewer"
fi
mkdir -p "$(dirname "$OUT")"
# A free display number (stale locks from killed servers are skipped).
n=97
while [ -e "/tmp/.X$n-lock" ]; do n=$((n + 1)); done
DISPLAY_NUM=${DISPLAY_NUM:-:$n}
Xvfb "$DISPLAY_NUM" -screen 0 1400x860x24 -nolisten tcp >/dev/null 2>&1 &
XVFB=$!
APP=""
cleanup() { [ -z "$APP" ] || kill "$APP" 2>/dev/null || true; kill "$XVFB" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 1 50); do
  DISPLAY="$DISPLAY_NUM" xwininfo -root >/dev/null 2>&1 && break
  sleep 0.2
done
# The glow backend renders through Mesa's software GL (llvmpipe) under Xvfb.
DISPLAY="$DISPLAY_NUM" LIBGL_ALWAYS_SOFTWARE=1 "$BIN" "${@:3}" >/tmp/shardscope-viewer-xvfb.log 2>&1 &
APP=$!
for _ in $(seq 1 60); do
  if DISPLAY="$DISPLAY_NUM" xwininfo -root -tree 2>/dev/null | grep -q '"shardscope"'; then break; fi
  kill -0 "$APP" 2>/dev/null || { cat /tmp/shardscope-viewer-xvfb.log >&2; echo "error: the viewer exited" >&2; exit 1; }
  sleep 0.5
done
# The first frames can take a while on a loaded machine (debug build, software GL): retry.
colours=0
# A capture that fails (the window being mapped) is taken again, never the end of the script.
shot() { DISPLAY="$DISPLAY_NUM" import -window root "$OUT" 2>>/tmp/shardscope-viewer-xvfb.log &&
  convert "$OUT" -format '%k' info:; }
for _ in $(seq 1 30); do
  sleep 2
  colours=$(shot) || colours=0
  [ "$colours" -ge 50 ] && break
done
# Park the pointer in a corner so no tooltip covers the panels, then take the final one.
if command -v xdotool >/dev/null; then DISPLAY="$DISPLAY_NUM" xdotool mousemove 1395 855 || true; fi
for _ in 1 2 3; do
  sleep 2
  colours=$(shot) || colours=0
  [ "$colours" -ge 50 ] && break
done
echo "desktop screenshot: $OUT ($colours colours)"
if [ "$colours" -lt 50 ]; then echo "error: the screenshot looks blank" >&2; cat /tmp/shardscope-viewer-xvfb.log >&2; exit 1; fi
