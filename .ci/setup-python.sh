#!/usr/bin/env bash
# Creates (or repairs) the Python virtual environment at .venv with what
# tests/python needs: pytest, numpy, safetensors, crc32c, matplotlib (bench
# compare's --plot, smoke-tested), moto (tests/s3/serve.sh), lightning (shim-py/tests/test_lightning.py,
# after torch), and torch (the
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

# lightning (ckpt_sidecar.lightning's test: a real Trainer on CPU), after torch
# so that pip keeps the venv's torch: about 45 s and 25 MB (lightning,
# pytorch_lightning, lightning_fabric, torchmetrics, aiohttp). Pinned, so a new
# release cannot change CI.
LIGHTNING_VERSION=2.6.6
install_lightning() {
    if ! "$VENV/bin/python" -c 'import lightning' 2>/dev/null; then
        echo "installing lightning $LIGHTNING_VERSION into $VENV"
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check "lightning==$LIGHTNING_VERSION"
        "$VENV/bin/python" -c 'import lightning, torch'
    fi
}

# moto (tests/s3/serve.sh: the S3-compatible server of the drain tier's
# tests, ckpt-tier's and the sidecar's): its S3 part and the standalone
# server's flask. Pinned, so a new release cannot change CI; serve.sh
# installs the same if it is missing.
MOTO_VERSION=5.2.5
install_moto() {
    if ! "$VENV/bin/python" -c 'import moto, flask, flask_cors' 2>/dev/null; then
        echo "installing moto $MOTO_VERSION into $VENV"
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check "moto[s3]==$MOTO_VERSION" flask flask-cors
        "$VENV/bin/python" -c 'import moto, flask, flask_cors'
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

# DeepSpeed (bench compare's deepspeed_fastpersist, its FastPersist writer over
# a JIT-built async_io op and libaio): optional, left out with
# CKPT_CI_DEEPSPEED=0. Its PyPI release is a source distribution, built against
# the venv's torch (no build isolation: that would fetch another torch); a
# pinned version, so a new release cannot change CI. Then its ops are built
# once (JIT, cached in ~/.cache/torch_extensions: about 15 CPU-minutes the
# first time, seconds after) so the tests only load them. Nothing here fails
# the setup: what failed is printed, and bench compare and its test skip
# DeepSpeed saying why.
DEEPSPEED_VERSION=0.19.8
install_deepspeed() {
    if [ "${CKPT_CI_DEEPSPEED:-1}" = 0 ]; then
        echo "deepspeed: left out (CKPT_CI_DEEPSPEED=0)"
        return 0
    fi
    if ! "$VENV/bin/python" -c 'import deepspeed' 2>/dev/null; then
        echo "installing deepspeed $DEEPSPEED_VERSION into $VENV (optional)"
        if ! { "$VENV/bin/python" -m pip install -q --disable-pip-version-check setuptools wheel ninja &&
               "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
                   "deepspeed==$DEEPSPEED_VERSION"; }; then
            echo "deepspeed: not installed (pip failed above); bench compare will skip it"
            return 0
        fi
    fi
    echo "deepspeed: building or loading its ops (minutes the first time)"
    "$VENV/bin/python" -c 'from ckpt_sidecar.bench_compare import deepspeed_unavailable as u
why = u()
print("deepspeed: " + ("skipped by bench compare: " + why if why else "FastPersist writer ready"))' ||
        echo "deepspeed: the op check failed (above); bench compare will skip it"
}

if "$VENV/bin/python" -c 'import safetensors, numpy, crc32c, pytest, matplotlib' 2>/dev/null; then
    install_torch
    install_lightning
    install_moto
    install_shim
    install_deepspeed
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
install_lightning
install_moto
install_shim
install_deepspeed
