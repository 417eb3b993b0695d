#!/usr/bin/env bash
# Builds the GPU check's bundle, for a machine with a GPU, Python and torch
# but no Rust toolchain and no network: everything tests/gpu/run.sh needs
# there, in target/gpu-bundle/ (ignored by git), at most 48 MiB:
#   ckpt-sidecar, libckpt.so          the daemon and the C shim (stripped)
#   ckpt_sidecar-*.whl                the Python package (bundles both too),
#                                     installable with pip --no-index --target
#   tests/gpu/{run.sh,preflight.py,gpu_suite.py,README.md}
#   shim-c/include/ckpt.h, shim-c/tests/c/cuda_trainer.c   (the C checks)
# Prints the bundle's path as its last line. Usage: bash tests/gpu/pack.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
PY="${PYTHON:-}"
[ -n "$PY" ] || for p in .venv/bin/python python3; do command -v "$p" >/dev/null 2>&1 && { PY=$p; break; }; done
PY=$(command -v "$PY")
case "$PY" in /*) ;; *) PY="$PWD/$PY" ;; esac
TARGET="${CARGO_TARGET_DIR:-$REPO/target}"
BUNDLE="$TARGET/gpu-bundle"
MAX_BYTES=$((48 << 20))

cargo build --release -p ckpt-shim -p ckpt-sidecar >&2
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/tests/gpu" "$BUNDLE/shim-c/include" "$BUNDLE/shim-c/tests/c"
for f in ckpt-sidecar libckpt.so; do
    cp "$TARGET/release/$f" "$BUNDLE/$f"
    strip --strip-debug "$BUNDLE/$f"
done
cp tests/gpu/run.sh tests/gpu/preflight.py tests/gpu/gpu_suite.py tests/gpu/README.md "$BUNDLE/tests/gpu/"
cp shim-c/include/ckpt.h "$BUNDLE/shim-c/include/"
cp shim-c/tests/c/cuda_trainer.c "$BUNDLE/shim-c/tests/c/"

# The Python package: the wheel users install (packaging/build-wheel.sh,
# stripped, py3-none-manylinux tagged: any CPython 3 on this platform, the
# GPU machine's 3.12 too), with the binaries just built (no second cargo run).
CKPT_SIDECAR_SKIP_CARGO=1 PYTHON="$PY" bash packaging/build-wheel.sh "$BUNDLE" >&2

bytes=$(du -sb "$BUNDLE" | cut -f1)
if [ "$bytes" -gt "$MAX_BYTES" ]; then
    echo "the bundle is $bytes bytes, above $MAX_BYTES" >&2
    exit 1
fi
echo "bundle: $bytes bytes: $(cd "$BUNDLE" && ls *.whl ckpt-sidecar libckpt.so | tr '\n' ' ')" >&2
echo "$BUNDLE"
