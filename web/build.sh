#!/usr/bin/env bash
# Builds the browser bundle: web/build.sh [OUT_DIR]   (default: dist/web)
# - wasm32 release build of shardscope-web
# - wasm-bindgen CLI at exactly the version Cargo.lock pins (installed if missing)
# - wasm-opt -Oz when a binaryen >= 116 is available ($WASM_OPT, web/node_modules, or PATH);
#   Debian's binaryen 108 silently breaks the module, so older ones are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist/web}

WB_VERSION=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
[ -n "$WB_VERSION" ] || { echo "error: wasm-bindgen not found in Cargo.lock" >&2; exit 2; }
if ! wasm-bindgen --version 2>/dev/null | grep -qx "wasm-bindgen $WB_VERSION"; then
  echo "installing wasm-bindgen-cli $WB_VERSION" >&2
  cargo install -q wasm-bindgen-cli --version "$WB_VERSION"
fi
rustup target list --installed 2>/dev/null | grep -q wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown

cargo build -q -p shardscope-web --target wasm32-unknown-unknown --profile wasm-release
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
WASM="$TARGET_DIR/wasm32-unknown-unknown/wasm-release/shardscope_web.wasm"

TMP="$OUT.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP"
wasm-bindgen --target web --no-typescript --out-dir "$TMP" "$WASM"

pick_wasm_opt() {
  for cand in "${WASM_OPT:-}" web/node_modules/.bin/wasm-opt "$(command -v wasm-opt || true)"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    ver=$("$cand" --version 2>/dev/null | grep -o '[0-9]\+' | head -1)
    if [ "${ver:-0}" -ge 116 ]; then echo "$cand"; return; fi
    echo "skipping $cand (binaryen ${ver:-?} < 116 is known to break the module)" >&2
  done
}
OPT=$(pick_wasm_opt)
if [ -n "$OPT" ]; then
  "$OPT" -Oz --enable-bulk-memory --enable-nontrapping-float-to-int --enable-sign-ext \
    --enable-mutable-globals --enable-reference-types --enable-multivalue \
    -o "$TMP/shardscope_web_bg.opt.wasm" "$TMP/shardscope_web_bg.wasm"
  mv "$TMP/shardscope_web_bg.opt.wasm" "$TMP/shardscope_web_bg.wasm"
else
  echo "note: no binaryen >= 116 wasm-opt found; bundle not optimized (optional: npm i --prefix web binaryen@132)" >&2
fi
cp web/index.html web/js/jspi.js "$TMP/"
rm -rf "$OUT"
mv "$TMP" "$OUT"
total=$(du -cb "$OUT"/* | tail -1 | cut -f1)
echo "web bundle in $OUT: $total bytes"
ls -l "$OUT" >&2
