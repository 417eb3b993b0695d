"""Fixtures: a real ckpt-sidecar (`serve`) on a private socket, small staging.

Tests use the installed package (pip install ./shim-py, as .ci/setup-python.sh
does) and its bundled binary."""
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

STAGING = "64MiB"


def sidecar_bin():
    from ckpt_sidecar import _native

    return _native.sidecar_binary()


class Sidecar:
    """`ckpt-sidecar serve` on a private socket: `args`, more options;
    `name`, for several in one test (their own socket and log); `ckdir`, its
    --dir (default tmp_path/ckpt); `env`, added to this process's."""

    def __init__(self, tmp_path, args=(), name=None, ckdir=None, env=None):
        self.args = list(args)
        self.dir = tmp_path / "ckpt" if ckdir is None else Path(ckdir)
        self.socket = str(tmp_path / ("sock" if name is None else f"sock-{name}") / "sidecar.sock")
        self.log = tmp_path / ("sidecar.log" if name is None else f"sidecar-{name}.log")
        self.env = dict(os.environ, **(env or {}))
        self.proc = None

    def command(self):
        return [sidecar_bin(), "serve", "--dir", str(self.dir), "--socket", self.socket, "--staging", STAGING, *self.args]

    def start(self):
        from ckpt_test_util import wait_until

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log, env=self.env)
        # A deadline that only bounds a hang: the start waits on the socket.
        wait_until(lambda: self.proc.poll() is not None or self._listening(), 60, "the sidecar listening")
        assert self.proc.poll() is None, f"sidecar exited: {self.log.read_text()}"
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

    def status(self):
        """`ckpt-sidecar status --json` of this sidecar."""
        out = subprocess.run([sidecar_bin(), "status", "--socket", self.socket, "--json"], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

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

