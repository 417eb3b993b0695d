"""A checkpoint directory on a read-only file system:
a sidecar serves loads from it (no directory lock, no recovery) and refuses
saves and rollback with one error naming the directory.

Read-only for root too (CI runs as root, for whom `chmod -w` changes
nothing): a read-only bind mount of the directory in a private mount
namespace (`unshare -m`, or `unshare -rm` as another user)."""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

import ckpt_sidecar as cs
from ckpt_sidecar import _native

CHILD = """
    import errno, os, socket, subprocess, sys, time
    import numpy as np
    import ckpt_sidecar as cs

    d, sock, binary, log = sys.argv[1:5]
    want = np.arange(1000, dtype=np.float32) * 5
    before = sorted(os.listdir(d))
    try:
        open(os.path.join(d, "probe"), "w")
        raise SystemExit("the directory is writable: the mount did not take")
    except OSError as e:
        assert e.errno == errno.EROFS, e

    def listening():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(sock)
            return True
        except OSError:
            return False
        finally:
            s.close()

    # (a) `serve --dir D` starts on the read-only directory and serves loads.
    with open(log, "ab") as f:
        proc = subprocess.Popen([binary, "serve", "--dir", d, "--socket", sock, "--staging", "64MiB"], stdout=f, stderr=f)
    deadline = time.monotonic() + 60  # bounds a hang; the wait is on the socket
    while not listening():
        assert proc.poll() is None, "serve exited: " + open(log).read()
        assert time.monotonic() < deadline, "serve did not listen: " + open(log).read()
        time.sleep(0.02)
    ck = cs.Checkpointer(socket=sock, spawn=False)
    got = ck.load("latest")
    assert ck.last_load_step == 5 and got["step"] == 5 and np.array_equal(got["w"], want), got
    assert ck.list() == [3, 5], ck.list()
    print("served: loaded step 5 equal", flush=True)
    # (b) A save is refused, naming the directory; so is a rollback.
    try:
        ck.save(9, {"w": want, "step": 9}).wait_durable(30)
        raise SystemExit("a save into the read-only directory did not fail")
    except cs.IOFailed as e:
        print("save refused:", e, flush=True)
    try:
        ck.rollback(3)
        raise SystemExit("a rollback in the read-only directory did not fail")
    except cs.SidecarError as e:
        print("rollback refused:", e, flush=True)
    assert ck.load("latest")["step"] == 5
    ck.close()
    proc.terminate()
    assert proc.wait(60) == 0, open(log).read()
    # (c) A spawned sidecar (Checkpointer(dir=D)) loads it too.
    ck = cs.Checkpointer(dir=d, staging="64MiB")
    got = ck.load("latest")
    assert ck.last_load_step == 5 and np.array_equal(got["w"], want)
    ck.close()
    print("spawned: loaded step 5 equal", flush=True)
    assert sorted(os.listdir(d)) == before, (before, sorted(os.listdir(d)))
"""


def _read_only_bind(d, cmd, env):
    """Runs `cmd` with `d` bind-mounted read-only over itself in a private
    mount namespace; None when unshare is missing or refused here."""
    if not shutil.which("unshare"):
        return None
    mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    for flags in (["-m"], ["-rm"]):
        probe = subprocess.run(["unshare", *flags, "sh", "-c", mount, str(d), "true"], capture_output=True, text=True)
        if probe.returncode == 0:
            return subprocess.run(["unshare", *flags, "sh", "-c", mount, str(d), *cmd], env=env,
                                  capture_output=True, text=True, timeout=300)
    return None


def test_a_read_only_checkpoint_directory_is_served_for_loads_and_refuses_saves(tmp_path, sidecar):
    # Steps 3 and 5 saved while the directory is writable; a temp folder
    # left by a killed save stays (recovery would remove it: it must not).
    ck = cs.Checkpointer(socket=sidecar.socket, spawn=False)
    for s in (3, 5):
        ck.save(s, {"w": np.arange(1000, dtype=np.float32) * s, "step": s}).wait_durable(30)
    ck.close()
    sidecar.stop()
    d = sidecar.dir
    named = os.path.realpath(d)  # as the sidecar names it
    (d / ".tmp-step-000000000007-deadbeef").mkdir()
    tmpdir = tempfile.mkdtemp(prefix="ck")  # short: the spawned sidecar's socket lives there
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR") or k == "CKPT_SIDECAR_BIN"}
        env.update(TMPDIR=tmpdir, CKPT_SIDECAR_SOCKET=str(tmp_path / "nobody.sock"))
        log = tmp_path / "ro-sidecar.log"
        cmd = [sys.executable, "-c", textwrap.dedent(CHILD), str(d), str(tmp_path / "ro.sock"), _native.sidecar_binary(), str(log)]
        r = _read_only_bind(d, cmd, env)
        if r is None:
            pytest.skip("cannot bind-mount a directory read-only here (unshare -m and unshare -rm refused)")
        out = r.stdout + r.stderr + (log.read_text() if log.exists() else "")
        assert r.returncode == 0, f"exit {r.returncode}\n{out}"
        assert "served: loaded step 5 equal" in r.stdout, out
        refused = [line for line in r.stdout.splitlines() if line.startswith("save refused:")]
        assert refused and f"{named} is read-only" in refused[0] and "saves, rollback and gc are refused" in refused[0], out
        assert any(line.startswith("rollback refused:") and f"{named} is read-only" in line for line in r.stdout.splitlines()), out
        assert "spawned: loaded step 5 equal" in r.stdout, out
        # Logged once at start; the temp folder was left alone.
        assert log.read_text().count("read-only: no directory lock") == 1, log.read_text()
        assert (d / ".tmp-step-000000000007-deadbeef").is_dir()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
