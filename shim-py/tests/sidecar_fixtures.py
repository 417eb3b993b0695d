"""The sidecar fixtures both Python test folders share (tests/python and
shim-py/tests, one pytest run): where the ckpt-sidecar binary is, running its
command line, and `Sidecar`, a real `serve` on a private socket with small
staging.

Each conftest.py imports the fixtures it offers from here. Two lookups of the
binary, as the two folders test two things: `built_sidecar_bin` is the
workspace's build ($CKPT_SIDECAR_BIN, or <repo>/target/release/ckpt-sidecar;
missing is an error, not a skip: a test run that checks nothing must not look
like a pass), `sidecar_bin` the one the installed package spawns (pip install
./shim-py bundles it; $CKPT_SIDECAR_BIN overrides it too)."""

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# What `Sidecar` gives `serve --staging`; a test may patch it (monkeypatch).
STAGING = "64MiB"


def sidecar_bin():
    """The binary the installed package spawns."""
    from ckpt_sidecar import _native

    return _native.sidecar_binary()


def built_sidecar_bin() -> Path:
    """The workspace's build of the binary; fails the test when there is none."""
    path = Path(
        os.environ.get("CKPT_SIDECAR_BIN")
        or REPO / "target" / "release" / "ckpt-sidecar"
    )
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"{path}: no ckpt-sidecar binary; run `cargo build --release` or set CKPT_SIDECAR_BIN"
        )
    return path


@pytest.fixture(name="sidecar_bin", scope="session")
def sidecar_bin_fixture() -> Path:
    """[`built_sidecar_bin`], once per run."""
    return built_sidecar_bin()


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
        p = subprocess.run(
            cmd,
            check=False,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if p.returncode != 0:
            pytest.fail(
                f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
            )
        return p.stdout

    return run


class Sidecar:
    """`ckpt-sidecar serve` on a private socket: `args`, more options;
    `name`, for several in one test (their own socket and log); `ckdir`, its
    --dir (default tmp_path/ckpt); `env`, added to this process's."""

    def __init__(self, tmp_path, args=(), name=None, ckdir=None, env=None):
        self.args = list(args)
        self.dir = tmp_path / "ckpt" if ckdir is None else Path(ckdir)
        self.socket = str(
            tmp_path / ("sock" if name is None else f"sock-{name}") / "sidecar.sock"
        )
        self.log = tmp_path / ("sidecar.log" if name is None else f"sidecar-{name}.log")
        self.env = dict(os.environ, **(env or {}))
        self.proc = None

    def command(self):
        return [
            sidecar_bin(),
            "serve",
            "--dir",
            str(self.dir),
            "--socket",
            self.socket,
            "--staging",
            STAGING,
            *self.args,
        ]

    def start(self):
        from ckpt_test_util import wait_until

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=log, env=self.env
            )
        # A deadline that only bounds a hang: the start waits on the socket.
        wait_until(
            lambda: self.proc.poll() is not None or self._listening(),
            60,
            "the sidecar listening",
        )
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
        out = subprocess.run(
            [sidecar_bin(), "status", "--socket", self.socket, "--json"],
            capture_output=True,
            text=True,
            check=True,
        )
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
    """A started [`Sidecar`], stopped after the test."""
    s = Sidecar(tmp_path).start()
    yield s
    s.stop()
