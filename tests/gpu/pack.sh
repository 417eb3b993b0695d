#!/usr/bin/env bash
# Builds the GPU check's bundle, for a machine with a GPU, Python and torch
# but no Rust toolchain and no network: everything tests/gpu/run.sh needs
# there, in target/gpu-bundle/ (ignored by git), at most 48 MiB:
#   ckpt-sidecar, libckpt.so          the daemon and the C shim (stripped)
#   ckpt_sidecar-*.whl                the Python package (bundles both too),
#                                     installable with pip --no-index --target
#   tests/gpu/{run.sh,gpu_suite.py,README.md}
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
mkdir -p "$BUNDLE/tests/gpu" "$BUNDLE/shim-c/include" "$BUNDLE/shim-c/tests/c" "$BUNDLE/wheel-tmp"
for f in ckpt-sidecar libckpt.so; do
    cp "$TARGET/release/$f" "$BUNDLE/$f"
    strip --strip-debug "$BUNDLE/$f"
done
cp tests/gpu/run.sh tests/gpu/gpu_suite.py tests/gpu/README.md "$BUNDLE/tests/gpu/"
cp shim-c/include/ckpt.h "$BUNDLE/shim-c/include/"
cp shim-c/tests/c/cuda_trainer.c "$BUNDLE/shim-c/tests/c/"

# ---- THE WHEEL STEP (one line; the lead switches it to packaging/build-wheel.sh, issue 22) ----
"$PY" -m pip wheel -q --no-deps --no-build-isolation ./shim-py -w "$BUNDLE/wheel-tmp" >&2
# ----

# The package loads its native files with ctypes (no extension module): any
# CPython 3 on this platform can install it (the GPU machine has 3.12).
# Their debug info is stripped too, to stay small.
whl=$(ls "$BUNDLE"/wheel-tmp/*.whl)
( cd "$BUNDLE/wheel-tmp" && "$PY" -m wheel unpack -d unpacked "$whl" >&2 \
  && for f in unpacked/*/ckpt_sidecar/_native/ckpt-sidecar unpacked/*/ckpt_sidecar/_native/libckpt.so; do strip --strip-debug "$f"; done \
  && mkdir -p repacked && "$PY" -m wheel pack -d repacked unpacked/* >&2 \
  && "$PY" -m wheel tags --python-tag py3 --abi-tag none --remove repacked/*.whl >&2 )
mv "$BUNDLE"/wheel-tmp/repacked/*.whl "$BUNDLE/"
rm -rf "$BUNDLE/wheel-tmp"

bytes=$(du -sb "$BUNDLE" | cut -f1)
if [ "$bytes" -gt "$MAX_BYTES" ]; then
    echo "the bundle is $bytes bytes, above $MAX_BYTES" >&2
    exit 1
fi
echo "bundle: $bytes bytes: $(cd "$BUNDLE" && ls *.whl ckpt-sidecar libckpt.so | tr '\n' ' ')" >&2
echo "$BUNDLE"
