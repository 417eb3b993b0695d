#!/usr/bin/env bash
# Installs what the tests need on a fresh Debian/Ubuntu machine (as root) or a
# developer's one; fast and silent when everything is already there.
#   - apt: fio (benchmark baseline), e2fsprogs (mkfs.ext4 for file-system
#     tests), and python3 + python3-venv if missing; skipped when present.
#   - optional: libaio-dev (DeepSpeed's async_io op, for bench compare).
#   - a Python venv at .venv with pytest, numpy, safetensors, crc32c, torch,
#     and, optionally, DeepSpeed.
# Rust (cargo, rust-version in Cargo.toml or newer) must already be installed.
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- system packages: install only what is missing, apt-get update once.
need=()
command -v fio >/dev/null || need+=(fio)
command -v mkfs.ext4 >/dev/null || [ -x /sbin/mkfs.ext4 ] || need+=(e2fsprogs)
command -v python3 >/dev/null || need+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "error: missing ${need[*]}; run as root or install them first" >&2
        exit 1
    fi
    echo "== apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${need[@]}"
fi

# ---- optional: libaio-dev, for DeepSpeed's async_io op (bench compare's
# deepspeed_fastpersist; CKPT_CI_DEEPSPEED=0 leaves DeepSpeed out). Never fails
# the setup: without it bench compare skips DeepSpeed saying why.
if [ "${CKPT_CI_DEEPSPEED:-1}" != 0 ] && ! dpkg -s libaio-dev >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "== apt-get install libaio-dev (optional)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends libaio-dev ||
            { apt-get update -q && apt-get install -y -q --no-install-recommends libaio-dev; } ||
            echo "libaio-dev: not installed; bench compare will skip DeepSpeed"
    else
        echo "libaio-dev: missing and not root; bench compare will skip DeepSpeed"
    fi
fi

# ---- Python environment for tests/python.
echo "== .venv"
bash .ci/setup-python.sh

