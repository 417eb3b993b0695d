"""Fixtures: a real ckpt-sidecar (`serve`) on a private socket, small staging.

Tests use the installed package (pip install ./shim-py, as .ci/setup-python.sh
does) and its bundled binary."""
import os
import socket
import subprocess
import time

import pytest

STAGING = "64MiB"


def sidecar_bin():
    from ckpt_sidecar import _native

    return _native.sidecar_binary()


class Sidecar:
    def __init__(self, tmp_path, args=()):
        self.args = list(args)
        self.dir = tmp_path / "ckpt"
        self.socket = str(tmp_path / "sock" / "sidecar.sock")
        self.log = tmp_path / "sidecar.log"
        self.proc = None

    def start(self):
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sidecar_bin(), "serve", "--dir", str(self.dir), "--socket", self.socket,
                                          "--staging", STAGING, *self.args], stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while not self._listening():
            assert self.proc.poll() is None, f"sidecar exited: {self.log.read_text()}"
            assert time.monotonic() < deadline, "sidecar did not listen"
            time.sleep(0.02)
        return self

    def _listening(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        # a killed sidecar leaves its socket file behind; a new one replaces it

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture
def sidecar(tmp_path):
    s = Sidecar(tmp_path).start()
    yield s
    s.stop()


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

