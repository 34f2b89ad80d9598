#!/usr/bin/env bash
# Builds `shardscope` with the `cuda` feature on a machine without a GPU (or with one).
#
# The CUDA toolkit comes from PyPI wheels in a venv (no system CUDA needed); `libcuda` (the driver),
# which no wheel ships, is replaced at link time by a stub generated from the symbols cudarc needs. The
# resulting binary needs the real driver and libnccl.so.2 at run time (a GPU machine has both; NCCL
# comes from the nvidia-nccl-cu13 wheel, whose lib folder this script prints).
#
#   native-runner/scripts/build-cuda.sh            # release build into target/cuda/release/shardscope
#   CUDA_VENV=/path/venv native-runner/scripts/build-cuda.sh
#   MODE=check native-runner/scripts/build-cuda.sh # compile-check only: clippy -D warnings, all targets
#                                                  # (no NCCL wheel, no libcuda stub, no linking)
#
# Most of the `cuda` backend runs without a GPU in the default tests: the gather engine and the candle
# device (feature `candle`) on candle's CPU device. Only the NCCL collective and the launch need this.
#
# Takes about 6-10 minutes cold on 2 cores (candle's CUDA kernels are compiled by nvcc).
# Not part of the default CI run.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${CUDA_VENV:-$HOME/.cache/shardscope-cuda/venv}"
COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
PROFILE="${PROFILE:-release}"
MODE="${MODE:-build}"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# candle's kernels are embedded as PTX, which the driver compiles at run time: a driver older than
# the nvcc that wrote the PTX refuses it (CUDA_ERROR_UNSUPPORTED_PTX_VERSION). Build with the
# toolkit of the oldest driver the binary must run on (`nvidia-smi` shows its CUDA version);
# 13.0 is driver 580's.
TOOLKIT_VERSION="${CUDA_TOOLKIT_VERSION:-13.0.2}"
TOOLKIT="cuda-toolkit[nvcc,crt,nvvm,curand,cudart,cublas,nvrtc,cccl]==$TOOLKIT_VERSION"
found="$("$VENV/bin/pip" show cuda-toolkit 2>/dev/null | sed -n 's/^Version: //p' || true)"
if [ -n "$found" ] && [ "$found" != "$TOOLKIT_VERSION" ]; then
  echo "$VENV holds cuda-toolkit $found, not $TOOLKIT_VERSION: name another CUDA_VENV" >&2
  exit 2
fi
if [ "$MODE" = check ]; then
  if ! "$VENV/bin/python" -c 'import nvidia.cu13' 2>/dev/null; then
    "$VENV/bin/pip" install -q --disable-pip-version-check "$TOOLKIT"
  fi
elif ! "$VENV/bin/python" -c 'import nvidia.cu13, nvidia.nccl' 2>/dev/null; then
  "$VENV/bin/pip" install -q --disable-pip-version-check "$TOOLKIT" nvidia-nccl-cu13
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
CU="$SITE/nvidia/cu13"
NCCL_LIB="$SITE/nvidia/nccl/lib"

# Unversioned links the linker looks for.
for lib in cublas cublasLt cudart nvrtc curand; do
  real="$(ls "$CU/lib/lib$lib.so."* 2>/dev/null | sort | head -n1 || true)"
  [ -n "$real" ] && [ ! -e "$CU/lib/lib$lib.so" ] && ln -s "$(basename "$real")" "$CU/lib/lib$lib.so"
done
export PATH="$CU/bin:$PATH" CUDA_HOME="$CU" CUDA_PATH="$CU" CUDA_COMPUTE_CAP="$COMPUTE_CAP"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda}"
unset RUST_BACKTRACE
if [ "$MODE" = check ]; then
  # candle-kernels' build script still runs nvcc; nothing is linked.
  cargo clippy -p shardscope-runner --features cuda --all-targets -- -D warnings
  echo "the cuda feature compiles (clippy -D warnings, all targets)"
  exit 0
fi
real="$(ls "$NCCL_LIB"/libnccl.so.* | sort | head -n1)"
[ -e "$NCCL_LIB/libnccl.so" ] || ln -s "$(basename "$real")" "$NCCL_LIB/libnccl.so"
export LIBRARY_PATH="$CU/lib/stubs:$CU/lib:$NCCL_LIB${LIBRARY_PATH:+:$LIBRARY_PATH}"
export RUSTFLAGS="${RUSTFLAGS:-} -L $CU/lib/stubs -L $CU/lib -L $NCCL_LIB"
unset RUST_BACKTRACE

build() { cargo build --profile "$PROFILE" -p shardscope-runner --features cuda --bin shardscope; }

if [ ! -e "$CU/lib/stubs/libcuda.so" ]; then
  # First build: compile everything; the final link fails without libcuda. Then generate the stub
  # from the cu* symbols cudarc leaves undefined, and link again.
  build || true
  mkdir -p "$CU/lib/stubs"
  rlibs=$(ls "$CARGO_TARGET_DIR/$PROFILE/deps/"libcudarc-*.rlib)
  stub_c="$(mktemp --suffix=.c)"
  nm -u --format=just-symbols $rlibs 2>/dev/null | grep -E '^cu[A-Z]' | sort -u \
    | sed 's/.*/void &(void) {}/' > "$stub_c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CU/lib/stubs/libcuda.so" "$stub_c"
  rm -f "$stub_c"
fi
build
echo "built $CARGO_TARGET_DIR/$PROFILE/shardscope (needs the NVIDIA driver and $NCCL_LIB on LD_LIBRARY_PATH at run time)"
