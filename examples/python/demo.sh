#!/usr/bin/env bash
# The Python example end to end: trains a small transformer on CPU for 60
# steps without interruption; trains it again, SIGKILLed right after step
# 35's checkpoint was released; resumes from `latest`; and checks that the
# final weights and AdamW state are bit-identical (torch.equal on every
# tensor) to the uninterrupted run's. Each run prints the trainer's stall per
# checkpoint beside torch.save's time (with and without fsync) for the same
# state. Each run spawns its own sidecar (ckpt_sidecar.Checkpointer).
#
# Uses the repo venv (.venv) with torch and shim-py, making it first if needed
# (.ci/setup-python.sh: torch and the package, nothing the tests alone need).
# Usage: examples/python/demo.sh [DIR]   (default: a fresh temp dir, kept; its path is printed)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
dir="${1:-$(mktemp -d /tmp/ckpt-py-demo-XXXXXX)}"
mkdir -p "$dir"
if ! "$py" -c 'import ckpt_sidecar, torch' 2>/dev/null; then
    if [ -n "${PYTHON:-}" ]; then
        echo "error: $py cannot import ckpt_sidecar and torch" >&2
        exit 1
    fi
    # A fresh machine: make the repo venv (numpy, torch, the package built
    # from this tree) first.
    echo "== setting up $root/.venv (first run only: builds the package, downloads torch)"
    bash "$root/.ci/setup-python.sh"
fi
export CKPT_SIDECAR_LOG="${CKPT_SIDECAR_LOG:-warn}"
# A socket of our own per run: never a sidecar someone else started.
unset CKPT_SIDECAR_SOCKET CKPT_SIDECAR
model=(--steps 60 --every 5 --d-model 256 --layers 4 --heads 4 --seq 32 --batch 8)
train() { "$py" "$here/train.py" "${model[@]}" "$@"; }

echo "== 1. uninterrupted: steps 1..60, a checkpoint every 5 steps (tensors copied into shared memory at save)"
train --dir "$dir/uninterrupted" --out "$dir/uninterrupted.pt"
echo
echo "== 2. the same run, parameters and AdamW state in shared memory for good (ck.share);"
echo "      SIGKILLed right after the sidecar released step 35's checkpoint (it holds its own copy)"
rc=0
# (stderr to a file: bash's own "Killed" notice would land in the output)
{ train --dir "$dir/crashed" --share --kill-at 35 --quiet; } 2>"$dir/crashed.stderr" || rc=$?
if [ "$rc" -ne 137 ]; then
    cat "$dir/crashed.stderr" >&2
    echo "expected a SIGKILL (exit 137), got $rc" >&2
    exit 1
fi
echo "   (exit $rc: killed)"
echo
echo "== 3. resume from latest (step 35 committed although its trainer died), train to 60"
train --dir "$dir/crashed" --share --resume --out "$dir/resumed.pt"
echo
echo "== 4. compare the final parameters and optimizer state"
"$py" "$here/compare.py" "$dir/uninterrupted.pt" "$dir/resumed.pt"
echo "(checkpoints and outputs in $dir)"
