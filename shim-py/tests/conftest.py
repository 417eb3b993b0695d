"""Fixtures: a real ckpt-sidecar (`serve`) on a private socket, small staging
(sidecar_fixtures.py, shared with tests/python), and clients of it.

Tests use the installed package (pip install ./shim-py, as .ci/setup-python.sh
does) and its bundled binary."""

import pytest

# Re-exported: the tests import these from conftest.
from sidecar_fixtures import STAGING, Sidecar, sidecar, sidecar_bin

__all__ = ["STAGING", "Sidecar", "sidecar", "sidecar_bin"]


@pytest.fixture
def ck(sidecar):
    import ckpt_sidecar as cs

    c = cs.Checkpointer(socket=sidecar.socket, spawn=False)
    yield c
    c.close()


@pytest.fixture
def no_default_sidecar(tmp_path, monkeypatch):
    """$CKPT_SIDECAR_SOCKET names a path where nothing listens."""
    monkeypatch.setenv("CKPT_SIDECAR_SOCKET", str(tmp_path / "nobody" / "sidecar.sock"))


@pytest.fixture
def private_tmp(monkeypatch):
    """A private, short (socket paths live there) $TMPDIR for this process and
    its children; removed afterwards."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="ck")
    monkeypatch.setenv("TMPDIR", d)
    monkeypatch.setattr(tempfile, "tempdir", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)
