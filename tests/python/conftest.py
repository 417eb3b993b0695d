"""Shared fixtures for the Python tests: where the ckpt-sidecar binary is, and
how to run it.

The binary comes from CKPT_SIDECAR_BIN, or <repo>/target/release/ckpt-sidecar
(build it with `cargo build --release`). A missing binary is an error, not a
skip: a test run that checks nothing must not look like a pass.
"""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def sidecar_bin() -> Path:
    path = Path(os.environ.get("CKPT_SIDECAR_BIN") or REPO / "target" / "release" / "ckpt-sidecar")
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"{path}: no ckpt-sidecar binary; run `cargo build --release` or set CKPT_SIDECAR_BIN")
    return path


@pytest.fixture(scope="session")
def run_sidecar(sidecar_bin):
    """run_sidecar(*args, env={...}) -> stdout; fails the test on a non-zero exit."""

    def run(*args, env=None, timeout=300):
        full_env = dict(os.environ)
        # Tests choose the engine explicitly; an outer setting must not leak in.
        for k in ("CKPT_SIDECAR_URING", "CKPT_SIDECAR_DIRECT"):
            full_env.pop(k, None)
        full_env.update(env or {})
        cmd = [str(sidecar_bin), *map(str, args)]
        p = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
        return p.stdout

    return run

