#!/usr/bin/env bash
# Builds a fully static `shardscope` (x86_64-unknown-linux-musl) into dist/: one file that runs on any
# x86_64 Linux, with or without glibc (cluster login nodes, minimal containers). The CUDA build is
# separate (native-runner/scripts/build-cuda.sh): it needs the NVIDIA driver's shared libraries.
#
#   scripts/build-static.sh                 # release build -> dist/shardscope-x86_64-linux-musl
#   PROFILE=dev scripts/build-static.sh     # faster, unoptimised (what CI checks)
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=x86_64-unknown-linux-musl
PROFILE="${PROFILE:-release}"
rustup target list --installed | grep -qx "$TARGET" || rustup target add "$TARGET"
# musl's C runtime is linked in statically (Rust's self-contained crt objects). aws-lc-sys (TLS for
# remote inputs, through object_store/reqwest/rustls) compiles C for the target: with musl-gcc
# (Debian: musl-tools), installed here when missing and running as root.
if [ -z "${CC_x86_64_unknown_linux_musl:-}" ] && ! command -v musl-gcc >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq musl-tools
  else
    echo "build-static.sh needs musl-gcc (apt-get install musl-tools) or CC_x86_64_unknown_linux_musl" >&2
    exit 1
  fi
fi
export CC_x86_64_unknown_linux_musl="${CC_x86_64_unknown_linux_musl:-musl-gcc}"
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
  cargo build --profile "$PROFILE" --target "$TARGET" -p shardscope-runner --bin shardscope
dir=$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")
mkdir -p dist
out=dist/shardscope-x86_64-linux-musl
cp "target/$TARGET/$dir/shardscope" "$out.tmp"
mv "$out.tmp" "$out"
echo "$out"
