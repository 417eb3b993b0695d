#!/usr/bin/env bash
# Creates (or repairs) the Python virtual environment the main job
# (examples/python/demo.sh) runs in, with only what it uses: torch (the default
# Linux wheel from PyPI, about 5 GB with its CUDA libraries; it runs on CPU
# too) and the package built from this tree, with what the package itself
# needs (numpy). What the tests need on top is .ci/setup-test-python.sh's.
# Fast when it is already there: pip runs only for an import that fails, and
# for the package, which is reinstalled so that it matches the tree.
#
# Usage: bash .ci/setup-python.sh [--no-package]
#   --no-package  leave the package out (.ci/test installs it after its own
#                 cargo build, so that cargo builds once)
#   PYTHON=python3.12 picks another interpreter; VENV=DIR another venv folder
#   (default .venv: the tests and the demo look there).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
export VENV="${VENV:-.venv}"

# A missing or broken venv (e.g. copied from another machine) is made afresh.
if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
    echo "creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv --clear "$VENV"
fi

# numpy: the package's one dependency (arrays over shared memory). torch: the
# demo's trainer; installed only when `import torch` fails, so a warm run never
# touches pip for it.
for module in numpy torch; do
    if ! "$VENV/bin/python" -c "import $module" 2>/dev/null; then
        echo "installing $module into $VENV"
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$module"
        "$VENV/bin/python" -c "import $module"
    fi
done

if [ "${1:-}" != --no-package ]; then
    bash .ci/install-package.sh
fi
