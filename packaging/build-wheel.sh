#!/usr/bin/env bash
# Builds the ckpt-sidecar wheel that installs with no Rust toolchain: the
# Python package with the sidecar binary and libckpt.so inside
# (ckpt_sidecar/_native/), stripped of debug info, tagged
# py3-none-manylinux_2_<N>_<arch> (one wheel for every CPython >= 3.9: the
# package reaches its native code through ctypes, not the CPython ABI).
# Installing it puts a `ckpt-sidecar` command on the venv's PATH.
#
# Usage: bash packaging/build-wheel.sh [OUT_DIR]
#   OUT_DIR (or $OUT_DIR) defaults to target/wheels; the wheel's path is the
#   last line printed. PYTHON picks the Python that runs pip (default: .venv's,
#   else python3; it needs setuptools and wheel, or network for pip to get them).
#   CKPT_SIDECAR_SKIP_CARGO=1 packs what $CARGO_TARGET_DIR/release (target/release)
#   holds, with no cargo run (e.g. binaries built elsewhere).
#
# Why a platform tag set here and not auditwheel: what auditwheel repair
# checks and decides for these two files is checked here the same way, with
# no extra tool: every library they need is one the manylinux policy allows
# (glibc's libc/libm/libpthread/libdl/librt, libgcc_s, the loader), so there is
# nothing to graft, and the manylinux_2_N tag is the newest GLIBC_2.N symbol
# version they import. auditwheel would also need patchelf and a download.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-${OUT_DIR:-target/wheels}}
case $OUT in /*) ;; *) OUT=$ROOT/$OUT ;; esac
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
export PATH="$PATH:$HOME/.cargo/bin"
TARGET=${CARGO_TARGET_DIR:-target}
case $TARGET in /*) ;; *) TARGET=$ROOT/$TARGET ;; esac

if [ "${CKPT_SIDECAR_SKIP_CARGO:-}" = 1 ]; then
    echo "CKPT_SIDECAR_SKIP_CARGO=1: packing what $TARGET/release holds" >&2
else
    echo "building ckpt-shim and ckpt-sidecar (release)" >&2
    cargo build --release -p ckpt-shim -p ckpt-sidecar >&2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/target/release" "$work/dist"
for f in libckpt.so ckpt-sidecar; do
    cp "$TARGET/release/$f" "$work/target/release/$f"
    strip --strip-debug "$work/target/release/$f"
done

# The manylinux policy's libraries, and the glibc symbol versions used.
allowed='^(libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libgcc_s\.so\.1|ld-linux-x86-64\.so\.2|ld-linux-aarch64\.so\.1)$'
glibc_minor=0
for f in "$work"/target/release/*; do
    for lib in $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
        if ! [[ $lib =~ $allowed ]]; then
            echo "build-wheel: $(basename "$f") needs $lib, which no manylinux policy allows" >&2
            exit 1
        fi
    done
    m=$(objdump -T "$f" | grep -o 'GLIBC_2\.[0-9]*' | sed 's/GLIBC_2\.//' | sort -n | tail -1)
    [ "${m:-0}" -gt "$glibc_minor" ] && glibc_minor=$m
done
arch=$(uname -m)
plat="manylinux_2_${glibc_minor}_${arch}"
[ "$glibc_minor" -ge 17 ] || plat="manylinux_2_17_${arch}"

isolation=--no-build-isolation
"$PYTHON" -c 'import setuptools, wheel' 2>/dev/null || isolation=
echo "building the wheel with $PYTHON ($plat)" >&2
# setup.py copies the native files from $CARGO_TARGET_DIR/release: the stripped ones.
CKPT_SIDECAR_SKIP_CARGO=1 CARGO_TARGET_DIR="$work/target" \
    "$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps $isolation -w "$work/dist" ./shim-py >&2
built=$(ls "$work"/dist/*.whl)
"$PYTHON" -m wheel tags --remove --python-tag py3 --abi-tag none --platform-tag "$plat" "$built" >&2
mkdir -p "$OUT"
wheel=$(ls "$work"/dist/*-py3-none-"$plat".whl)
rm -f "$OUT/$(basename "$wheel")"
mv "$wheel" "$OUT/"
echo "$OUT/$(basename "$wheel")"
