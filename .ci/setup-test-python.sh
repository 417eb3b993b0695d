#!/usr/bin/env bash
# Adds to the demo's venv (.ci/setup-python.sh: torch, numpy, the package)
# what the tests and the lint steps need; each is installed only when its
# import fails, so a warm run never touches pip. Pinned where a new release
# could change CI:
#   - pytest, pytest-xdist (.ci/test runs two test files at a time),
#     safetensors (the official reader our shards must satisfy),
#     crc32c, matplotlib (bench compare's --plot, smoke-tested), wheel
#     (packaging/build-wheel.sh retags the wheel: shim-py/tests/test_wheel.py);
#   - lightning (shim-py/tests/test_lightning.py: a real Trainer on CPU), after
#     torch so that pip keeps the venv's torch: about 45 s and 25 MB;
#   - moto's S3 part and its standalone server's flask (tests/s3/serve.sh: the
#     S3-compatible server of the drain tier's tests; serve.sh installs the
#     same version if it is missing);
#   - ruff and mypy (.ci/test's lint steps).
# DeepSpeed is not here: it is opt-in (.ci/setup-deepspeed.sh).
#
# Usage: bash .ci/setup-test-python.sh [--no-package]   (VENV=DIR, PYTHON=...: as setup-python.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

export VENV="${VENV:-.venv}"
LIGHTNING_VERSION=2.6.6
MOTO_VERSION=5.2.5
RUFF_VERSION=0.17.5
MYPY_VERSION=2.4.1
XDIST_VERSION=3.8.0

bash .ci/setup-python.sh "$@"

pip_install() {
    echo "installing $* into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"
}

# install IMPORTS PIP-ARGS...: pip-installs PIP-ARGS unless IMPORTS all import.
install() {
    local imports=$1
    shift
    if ! "$VENV/bin/python" -c "import $imports" 2>/dev/null; then
        pip_install "$@"
        "$VENV/bin/python" -c "import $imports"
    fi
}

install "pytest, safetensors, crc32c, matplotlib, wheel" pytest safetensors crc32c matplotlib wheel
install "xdist" "pytest-xdist==$XDIST_VERSION"
install "lightning, torch" "lightning==$LIGHTNING_VERSION"
install "moto, flask, flask_cors" "moto[s3]==$MOTO_VERSION" flask flask-cors
# Version checks, not imports: a venv with another ruff or mypy gets the pinned one.
"$VENV/bin/python" -m ruff --version 2>/dev/null | grep -qx "ruff $RUFF_VERSION" || pip_install "ruff==$RUFF_VERSION"
"$VENV/bin/python" -m mypy --version 2>/dev/null | grep -q "^mypy $MYPY_VERSION\b" || pip_install "mypy==$MYPY_VERSION"
