#!/usr/bin/env bash
# Builds the fuzz targets as libFuzzer binaries with the stable toolchain
# (the coverage flags cargo fuzz uses, without its nightly-only sanitizer
# options) and runs each for SECONDS over a copy of its seed corpus.
# `cargo fuzz run <target>` (nightly, with AddressSanitizer) works too.
#   bash fuzz/run.sh [SECONDS=10] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-10}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(wire_frame index shard_header)
triple=$(rustc -vV | sed -n 's/^host: //p')
# Its own build folder (other flags than the workspace's): fuzz/target, or
# fuzz/ under CARGO_TARGET_DIR when that is set (CI keeps it between runs).
if [ -n "${CARGO_TARGET_DIR:-}" ]; then export CARGO_TARGET_DIR=$CARGO_TARGET_DIR/fuzz; else export CARGO_TARGET_DIR=$PWD/target; fi
RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares" \
    cargo build --release --quiet --bins --target "$triple"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for t in "${targets[@]}"; do
    mkdir -p "$work/$t" artifacts/"$t"
    cp corpus/"$t"/* "$work/$t/"
    echo "== fuzz $t for ${secs}s"
    "$CARGO_TARGET_DIR/$triple/release/$t" -max_total_time="$secs" -rss_limit_mb=2048 \
        -artifact_prefix=artifacts/"$t"/ "$work/$t" 2>&1 | grep -E '^(Done|==[0-9]+==|thread .* panicked)' || true
    # libFuzzer exits non-zero and leaves a crash-* file on any finding.
    if ls artifacts/"$t"/crash-* artifacts/"$t"/oom-* artifacts/"$t"/timeout-* >/dev/null 2>&1; then
        echo "fuzz $t found a failing input: fuzz/artifacts/$t/" >&2
        exit 1
    fi
done
