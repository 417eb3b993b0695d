#!/usr/bin/env bash
# Reinstalls the package (./shim-py) into the venv, so that it always matches
# the tree: its build runs cargo (fast when warm) and bundles libckpt.so and
# ckpt-sidecar. CKPT_SIDECAR_SKIP_CARGO=1 bundles what target/release already
# holds instead (.ci/test sets it after its own workspace build, so that the
# package carries the binary the tests run, built once). --no-deps: numpy is
# installed by .ci/setup-python.sh.
#
# Usage: bash .ci/install-package.sh      (VENV=DIR: another venv than .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
echo "installing ./shim-py into $VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall ./shim-py
"$VENV/bin/python" -c 'import ckpt_sidecar; ckpt_sidecar.native_version()'
