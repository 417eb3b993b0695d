#!/usr/bin/env bash
# The C example end to end: builds the sidecar and libckpt, runs the trainer
# under `ckpt-sidecar launch`, crashes it on purpose (SIGKILL right after a
# checkpoint was released), resumes it from `latest` with every byte verified,
# and verifies the committed checkpoints on disk.
# Usage: examples/c/demo.sh [DIR]   (default: a fresh temp dir, kept; its path is printed)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${CARGO_TARGET_DIR:-$root/target}/release/ckpt-sidecar"
dir="${1:-$(mktemp -d /tmp/ckpt-demo-XXXXXX)}"
(cd "$root" && cargo build --release --quiet)
SKIP_CARGO=1 "$here/build.sh" "$here/trainer" >/dev/null
export CKPT_SIDECAR_LOG="${CKPT_SIDECAR_LOG:-warn}"
launch() { "$bin" launch --staging 256MiB --dir "$dir" -- "$here/trainer" --width 16384 "$@"; }

echo "== 1. train steps 1..30, a checkpoint every step ($dir)"
launch --steps 30 --quiet
echo "== 2. resume, then crash on purpose right after step 45 is released"
launch --steps 60 --resume --crash-at 45 --quiet && { echo "expected a crash" >&2; exit 1; } || true
echo "== 3. resume from latest (step 45 must have committed), verified, train to 60 (stall and persist per checkpoint)"
launch --steps 60 --resume
echo "== 4. verify every committed checkpoint on disk"
"$bin" verify "$dir" | tail -3
