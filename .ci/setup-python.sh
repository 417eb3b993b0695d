#!/usr/bin/env bash
# Creates (or repairs) the Python virtual environment at .venv with what
# tests/python needs: pytest, numpy, safetensors, crc32c.
# Fast when it is already there: nothing is installed if the imports work.
#
# Usage: bash .ci/setup-python.sh        (PYTHON=python3.12 to pick another interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
PACKAGES=(pytest numpy safetensors crc32c)

if "$VENV/bin/python" -c 'import safetensors, numpy, crc32c, pytest' 2>/dev/null; then
    exit 0
fi

# A missing or broken venv (e.g. copied from another machine) is made afresh.
if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
    echo "creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv --clear "$VENV"
fi
echo "installing ${PACKAGES[*]} into $VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PACKAGES[@]}"
"$VENV/bin/python" -c 'import safetensors, numpy, crc32c, pytest'
