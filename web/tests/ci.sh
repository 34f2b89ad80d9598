#!/usr/bin/env bash
# Viewer checks that need more than `cargo test`: builds the web bundle, runs the real-browser
# test in headless Chromium (nginx serves presigned-style URLs; the page is compared with the
# `shardscope` CLI, built if missing), takes the desktop screenshot under Xvfb and checks the
# bundle size.
# Installs what it needs (apt, npm, cargo install) idempotently. Called by .ci/run.
#   web/tests/ci.sh [ARTIFACT_DIR]   (screenshots go there; default: target/viewer-ci)
set -euo pipefail
cd "$(dirname "$0")/../.."
ART=${1:-target/viewer-ci}
mkdir -p "$ART"
step() { printf '\n==> %s\n' "$*"; }

step "system packages (Xvfb, Mesa software GL, ImageMagick, Chromium)"
need=()
command -v Xvfb >/dev/null || need+=(xvfb)
command -v xwininfo >/dev/null || need+=(x11-utils)
command -v xdotool >/dev/null || need+=(xdotool)
command -v import >/dev/null || need+=(imagemagick)
command -v chromium >/dev/null || need+=(chromium)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx)
[ -e /usr/lib/x86_64-linux-gnu/dri/swrast_dri.so ] || need+=(libgl1-mesa-dri)
ldconfig -p | grep -q libEGL.so.1 || need+=(libegl1)
ldconfig -p | grep -q libxkbcommon-x11.so.0 || need+=(libxkbcommon-x11-0)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

step "playwright-core (drives the system Chromium; never downloads a browser)"
[ -d web/tests/node_modules/playwright-core ] || npm install --prefix web/tests --no-audit --no-fund --silent

step "web bundle (wasm32 release + wasm-bindgen CLI pinned to Cargo.lock)"
web/build.sh "$ART/web"
size=$(du -cb "$ART"/web/* | tail -1 | cut -f1)
# 9 MiB: 8 MiB until the browser compare and torch_checkpointing's value items (November 2026) took
# the bundle to 8.41 MB without wasm-opt (docs/viewer.md, "Web bundle"); a guard against accidental
# growth (a new dependency, a debug build), not a page-load target (2.7 MB gzipped).
limit=$((9 * 1024 * 1024))
echo "bundle size: $size bytes (limit $limit)"
[ "$size" -lt "$limit" ] || { echo "error: web bundle over 9 MiB" >&2; exit 1; }

step "the shardscope CLI (the browser test compares the page with inspect --json)"
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
export SHARDSCOPE_BIN=${SHARDSCOPE_BIN:-$TARGET_DIR/debug/shardscope}
[ -x "$SHARDSCOPE_BIN" ] || cargo build -q -p shardscope-runner --bin shardscope
echo "$SHARDSCOPE_BIN"

# The manifest check runs torch's generator (viewer/tests/fixtures/torch_manifest.py) with
# $SHARDSCOPE_PYTHON (.ci/run sets it; default ~/.cache/shardscope/torch-venv/bin/python).
step "browser test (headless Chromium; nginx for presigned and per-rank URLs)"
node web/tests/browser_test.mjs "$ART/web" "$ART"

step "desktop screenshot under Xvfb"
web/tests/desktop_screenshot.sh "$ART/desktop.png" "" --select embed.weight

step "desktop window fills the screen it opens on (Xvfb screens of 1100x700 and 1920x1080)"
web/tests/desktop_window_fits.sh "$TARGET_DIR/debug/shardscope-viewer"

echo
echo "viewer CI: all checks passed (screenshots in $ART)"
