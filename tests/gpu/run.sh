#!/usr/bin/env bash
# The CUDA path on a real GPU, in one call: builds the workspace, runs the GPU
# suite (torch CUDA tensors through Checkpointer and the torch.save hook,
# SIGKILL after Released still commits, restore to device memory bit-exact
# through the C shim, VMM allocations passed as file descriptors, the next
# step's write kept out of the snapshot by a stream wait, whether a stream
# wait ends when the sidecar dies) and the GPU benchmark (device-to-host snapshot
# bandwidth beside a plain pinned cudaMemcpy of the same size in the same
# run, the trainer's CPU time inside save for a 4 GiB state, a training
# step's slowdown while the sidecar copies), each asserted (tests/gpu/README.md).
# Results: stdout, and $OUT/gpu-results.json when OUT is set (written after
# every check). Bounded to 8 minutes on one H200.
#
# First, before anything else, the preflight (tests/gpu/preflight.py, at most
# 60 s, two processes, no torch): what this machine's driver really does of
# IPC handles, IPC events, VMM fd export, host registration with a stream
# wait on it, and a 1 GiB registration, in $OUT/gpu-preflight.json; the
# suite skips, saying why, what it found missing (a sandbox's GPU proxy may
# not pass those calls through) instead of failing on it.
#
# Inside the bundle of tests/gpu/pack.sh (a GPU machine with Python and torch
# only) it uses the bundle; from a checkout holding target/gpu-bundle (a
# device session's carried copy) that bundle, never cargo (no network
# there); else cargo's build.
#
# Without a CUDA driver (or with only the test-only fake one) it prints
# `skipped: no CUDA driver` and exits 0, counting nothing as passed.
#
# Usage: bash tests/gpu/run.sh        (PYTHON=... to choose the interpreter with torch)
set -euo pipefail
cd "$(dirname "$0")/../.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for p in .venv/bin/python /work/main/.venv/bin/python python3; do
        if command -v "$p" >/dev/null 2>&1; then PY="$p"; break; fi
    done
fi

# The preflight, first: its findings are on disk before anything else runs.
PREFLIGHT_DIR="${OUT:-$(mktemp -d)}"
mkdir -p "$PREFLIGHT_DIR"
export CKPT_GPU_PREFLIGHT="$PREFLIGHT_DIR/gpu-preflight.json"
if [ -z "$PY" ]; then
    printf '{"skip_all": "no Python interpreter for the preflight", "probes": {}}\n' >"$CKPT_GPU_PREFLIGHT"
else
    echo "== preflight (60 s at most)"
    OUT="$PREFLIGHT_DIR" timeout --signal=KILL 60 "$PY" tests/gpu/preflight.py >/dev/null 2>&1 ||
        echo "the preflight ended early (status $?): see $CKPT_GPU_PREFLIGHT" >&2
    [ -f "$CKPT_GPU_PREFLIGHT" ] ||
        printf '{"skip_all": "the preflight wrote nothing", "probes": {}}\n' >"$CKPT_GPU_PREFLIGHT"
fi

# A real driver: libcuda.so.1 loads, cuInit succeeds, a device is there, and
# it is not the fake (target/*/fake-cuda on LD_LIBRARY_PATH).
probe='
import ctypes, sys
try:
    cu = ctypes.CDLL("libcuda.so.1")
except OSError:
    sys.exit(1)
n = ctypes.c_int(0)
if cu.cuInit(0) != 0 or cu.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value == 0:
    sys.exit(1)
name = ctypes.create_string_buffer(256)
cu.cuDeviceGetName(name, 256, 0)
sys.exit(1 if b"fake" in name.value else 0)
'
if [ -z "$PY" ] || ! "$PY" -c "$probe" 2>/dev/null; then
    echo "skipped: no CUDA driver"
    exit 0
fi

if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
# The native files and the Python package: the bundle tests/gpu/pack.sh made
# when run.sh runs inside it; else built here when cargo is there; else the
# bundle in target/gpu-bundle of this checkout.
is_bundle() { [ -x "$1/ckpt-sidecar" ] && [ -f "$1/libckpt.so" ] && ls "$1"/*.whl >/dev/null 2>&1; }
BUNDLE=""
carried="${CARGO_TARGET_DIR:-$PWD/target}/gpu-bundle"
if is_bundle "$PWD"; then
    BUNDLE=$PWD
elif is_bundle "$carried"; then
    BUNDLE=$carried
elif ! command -v cargo >/dev/null; then
    echo "no cargo and no bundle: run bash tests/gpu/pack.sh where Rust is, and copy its folder here" >&2
    exit 2
fi
if [ -z "$BUNDLE" ]; then
    echo "== cargo build --release --workspace"
    cargo build --release --workspace
    TARGET="${CARGO_TARGET_DIR:-$PWD/target}/release"
    export CKPT_SIDECAR_BIN="$TARGET/ckpt-sidecar" CKPT_SIDECAR_LIB="$TARGET/libckpt.so"
    export PYTHONPATH="$PWD/shim-py${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "== the bundle in $BUNDLE"
    PKG=$(mktemp -d)
    trap 'rm -rf "$PKG"' EXIT
    "$PY" -m pip install -q --no-index --no-deps --target "$PKG" "$BUNDLE"/*.whl
    export CKPT_SIDECAR_BIN="$BUNDLE/ckpt-sidecar" CKPT_SIDECAR_LIB="$BUNDLE/libckpt.so"
    export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "== GPU suite and benchmark (8 minutes at most)"
timeout --signal=TERM --kill-after=20 480 "$PY" tests/gpu/gpu_suite.py
