#!/usr/bin/env bash
# Installs what the tests need on a fresh Debian/Ubuntu machine (as root) or a
# developer's one; fast and silent when everything is already there.
#   - apt: fio (benchmark baseline), e2fsprogs (mkfs.ext4 for file-system
#     tests), iproute2 (ip netns, tc, ss: the peers' two-host test), and
#     python3 + python3-venv if missing; skipped when present.
#   - a Python venv at .venv: torch and the package (.ci/setup-python.sh, all
#     the demo needs), then the test tools (.ci/setup-test-python.sh).
#   - opt-in, with CKPT_CI_DEEPSPEED=1: libaio-dev and DeepSpeed
#     (.ci/setup-deepspeed.sh, for bench compare; a long JIT build).
# Rust (cargo, rust-version in Cargo.toml or newer) must already be installed.
#
# Usage: bash .ci/setup.sh [--no-package]   (--no-package: as setup-python.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- system packages: install only what is missing, apt-get update once.
need=()
command -v fio >/dev/null || need+=(fio)
command -v mkfs.ext4 >/dev/null || [ -x /sbin/mkfs.ext4 ] || need+=(e2fsprogs)
{ command -v ip && command -v tc && command -v ss; } >/dev/null || need+=(iproute2)
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

# ---- Python environment for the tests.
echo "== .venv"
bash .ci/setup-test-python.sh "$@"
# DeepSpeed's op check imports the package: without it (--no-package),
# .ci/test runs this after installing it.
if [ "${CKPT_CI_DEEPSPEED:-0}" = 1 ] && [ "${1:-}" != --no-package ]; then
    bash .ci/setup-deepspeed.sh
fi
