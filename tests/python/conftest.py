"""Fixtures of the Python tests: where the ckpt-sidecar binary is, and how to
run it; defined once, in shim-py/tests/sidecar_fixtures.py, for both test
folders.

The binary comes from CKPT_SIDECAR_BIN, or <repo>/target/release/ckpt-sidecar
(build it with `cargo build --release`). A missing binary is an error, not a
skip: a test run that checks nothing must not look like a pass.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "shim-py" / "tests"))

# After the path is set: the shared fixtures live beside shim-py's tests.
from sidecar_fixtures import run_sidecar, sidecar_bin_fixture  # noqa: E402

__all__ = ["REPO", "run_sidecar", "sidecar_bin_fixture"]
