#!/usr/bin/env bash
# Creates (or repairs) the Python virtual environment at .venv with what
# tests/python needs: pytest, numpy, safetensors, crc32c, matplotlib (bench
# compare's --plot, smoke-tested), and torch (the
# default Linux wheel from PyPI, about 5 GB with its CUDA libraries; it runs
# on CPU too).
# Fast when it is already there: nothing is installed if the imports work.
#
# Usage: bash .ci/setup-python.sh        (PYTHON=python3.12 to pick another interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
PACKAGES=(pytest numpy safetensors crc32c matplotlib)

# torch (tests/python/test_torch_*.py, examples/python): installed only when
# `import torch` fails, so a warm run never touches pip for it.
install_torch() {
    if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        echo "installing torch into $VENV"
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch
        "$VENV/bin/python" -c 'import torch'
    fi
}

# The package itself (shim-py/tests, examples/python): reinstalled on every run
# so it always matches the tree; its build runs cargo (fast when warm) and
# bundles libckpt.so and ckpt-sidecar. --no-deps: numpy is installed above.
install_shim() {
    echo "installing ./shim-py into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall ./shim-py
    "$VENV/bin/python" -c 'import ckpt_sidecar; ckpt_sidecar.native_version()'
}

if "$VENV/bin/python" -c 'import safetensors, numpy, crc32c, pytest, matplotlib' 2>/dev/null; then
    install_torch
    install_shim
    exit 0
fi

# A missing or broken venv (e.g. copied from another machine) is made afresh.
if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
    echo "creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv --clear "$VENV"
fi
echo "installing ${PACKAGES[*]} into $VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PACKAGES[@]}"
"$VENV/bin/python" -c 'import safetensors, numpy, crc32c, pytest, matplotlib'
install_torch
install_shim
