#!/usr/bin/env bash
# Opt-in: DeepSpeed, for bench compare's deepspeed_fastpersist (its
# FastPersist writer over a JIT-built async_io op and libaio) and
# shim-py/tests/test_deepspeed.py. Default CI leaves it out: the op's first
# build takes about 28 minutes on a 2-core machine. Run by .ci/test-deepspeed,
# or by .ci/setup.sh with CKPT_CI_DEEPSPEED=1; without it those tests skip
# saying why.
#   - apt: libaio-dev (async_io's library), as root.
#   - DeepSpeed's PyPI release, a source distribution, built against the
#     venv's torch (no build isolation: that would fetch another torch);
#     pinned, so a new release cannot change CI.
#   - its ops built once (JIT, cached in ~/.cache/torch_extensions: minutes
#     the first time, seconds after), so the tests only load them.
# Nothing here fails: what failed is printed, and bench compare and its test
# skip DeepSpeed saying why.
#
# Usage: bash .ci/setup-deepspeed.sh     (after .ci/setup-python.sh; VENV=DIR as there)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
DEEPSPEED_VERSION=0.19.8

if ! dpkg -s libaio-dev >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "== apt-get install libaio-dev"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends libaio-dev ||
            { apt-get update -q && apt-get install -y -q --no-install-recommends libaio-dev; } ||
            echo "libaio-dev: not installed; bench compare will skip DeepSpeed"
    else
        echo "libaio-dev: missing and not root; bench compare will skip DeepSpeed"
    fi
fi

if ! "$VENV/bin/python" -c 'import deepspeed' 2>/dev/null; then
    echo "installing deepspeed $DEEPSPEED_VERSION into $VENV"
    if ! { "$VENV/bin/python" -m pip install -q --disable-pip-version-check setuptools wheel ninja &&
           "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
               "deepspeed==$DEEPSPEED_VERSION"; }; then
        echo "deepspeed: not installed (pip failed above); bench compare will skip it"
        exit 0
    fi
fi
echo "deepspeed: building or loading its ops (minutes the first time)"
"$VENV/bin/python" -c 'from ckpt_sidecar.bench_compare import deepspeed_unavailable as u
why = u()
print("deepspeed: " + ("skipped by bench compare: " + why if why else "FastPersist writer ready"))' ||
    echo "deepspeed: the op check failed (above); bench compare will skip it"
