#!/usr/bin/env bash
# Builds the C example trainer against shim-c/include/ckpt.h and
# target/release/libckpt.so (found at run time through an rpath).
# Usage: examples/c/build.sh [OUT]   (default: examples/c/trainer)
# Env: CC (default cc), CARGO_TARGET_DIR, CKPT_LIBDIR (the folder holding
# libckpt.so, default $CARGO_TARGET_DIR/release), SKIP_CARGO=1 (already built).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
libdir="${CKPT_LIBDIR:-${CARGO_TARGET_DIR:-$root/target}/release}"
out="${1:-$here/trainer}"
if [ "${SKIP_CARGO:-0}" != 1 ]; then
    (cd "$root" && cargo build --release -p ckpt-shim)
fi
"${CC:-cc}" -O2 -g -std=c99 -Wall -Wextra -pedantic -Werror \
    -I"$root/shim-c/include" -o "$out" "$here/trainer.c" \
    -L"$libdir" -lckpt -Wl,-rpath,"$libdir"
echo "built $out"
