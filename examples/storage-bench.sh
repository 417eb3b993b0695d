#!/usr/bin/env bash
# The main job until the daemon exists: build, then write a 2 GiB synthetic
# training state through the storage engine to a committed checkpoint, read it
# back with verification, and print the figures beside fio's for the same size
# in the same directory, measured just before (when fio is installed).
#
#   bash examples/storage-bench.sh [DIR] [SIZE]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-./ckpt-bench}
size=${2:-2GiB}

cargo build --release --quiet
bin=./target/release/ckpt-sidecar

fio_flag=()
if command -v fio >/dev/null; then
  fio_flag=(--compare-fio)
else
  echo "note: fio is not installed (apt-get install -y fio); printing our figures without the baseline" >&2
fi

"$bin" doctor "$dir" 2>/dev/null || { mkdir -p "$dir" && "$bin" doctor "$dir"; }
echo "== write $size"
"$bin" bench write --dir "$dir" --size "$size" "${fio_flag[@]}"
echo "== read latest back, verifying every tensor"
"$bin" bench read --dir "$dir" "${fio_flag[@]}"
echo "== verify"
"$bin" verify "$dir" --step "$("$bin" ls "$dir" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["latest"])')"
echo "== keep the newest 2 checkpoints"
"$bin" gc "$dir" --keep 2
"$bin" ls "$dir"
