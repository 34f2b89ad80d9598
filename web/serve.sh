#!/usr/bin/env bash
# Serves the built bundle on 127.0.0.1: web/serve.sh [PORT] [DIR]   (defaults: 8080, dist/web)
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-8080}
DIR=${2:-dist/web}
[ -f "$DIR/index.html" ] || { echo "error: $DIR/index.html missing; run web/build.sh first" >&2; exit 2; }
echo "serving $DIR on http://127.0.0.1:$PORT/" >&2
exec python3 web/tests/serve.py "$PORT" "$DIR"
