"""A nearly full /dev/shm every shared-memory segment
the client creates is backed by reserved pages before first use, so a save
that does not fit is a Python exception naming /dev/shm and the size, raised
before anything is copied, never a SIGBUS in the trainer. Run in a private
/dev/shm (a 64 MiB tmpfs mounted in a mount namespace of its own)."""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

CODE = """
    import numpy as np
    import ckpt_sidecar as cs

    with open("/dev/shm/taken", "wb") as f:      # 40 MiB of the 64 MiB taken
        f.write(b"\\1" * (40 << 20))
    ck = cs.Checkpointer(dir={dir!r}, staging="64MiB")
    try:
        ck.save(1, {{"w": np.ones((32 << 20) // 4, np.float32)}})
        raise SystemExit("a 32 MiB save into a full /dev/shm did not raise")
    except cs.SidecarError as e:
        print("raised:", type(e).__name__, e, flush=True)
    small = {{"w": np.arange((8 << 20) // 4, dtype=np.float32)}}
    ck.save(2, small).wait_durable(60)
    back = ck.load(2)
    assert np.array_equal(back["w"], small["w"]), "the 8 MiB save loads different"
    print("8 MiB saved and loaded equal", flush=True)
    del back
    ck.close()
"""


def _private_dev_shm(cmd, env, cwd):
    """Runs `cmd` with a private 64 MiB tmpfs on /dev/shm (unshare -m as
    root, as CI runs; a user namespace otherwise); None when neither works."""
    if not shutil.which("unshare"):
        return None
    mount = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    for flags in (["-m"], ["-rm"]):
        probe = subprocess.run(["unshare", *flags, "sh", "-c", mount, "sh", "true"], capture_output=True, text=True)
        if probe.returncode == 0:
            return subprocess.run(["unshare", *flags, "sh", "-c", mount, "sh", *cmd], env=env, cwd=cwd,
                                  capture_output=True, text=True, timeout=300)
    return None


def test_a_nearly_full_dev_shm_is_an_error_naming_it_not_a_sigbus(tmp_path):
    tmpdir = tempfile.mkdtemp(prefix="ck")  # short: the spawned sidecar's socket lives there
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
        env.update(TMPDIR=tmpdir, CKPT_SIDECAR_SOCKET=str(tmp_path / "nobody.sock"))
        code = textwrap.dedent(CODE).format(dir=str(tmp_path / "ckpt"))
        r = _private_dev_shm([sys.executable, "-c", code], env, tmp_path)
        if r is None:
            pytest.skip("cannot mount a private tmpfs on /dev/shm here (unshare -m and unshare -rm refused)")
        assert r.returncode == 0, f"exit {r.returncode} (-7: SIGBUS)\n{r.stdout}\n{r.stderr}"
        raised = [line for line in r.stdout.splitlines() if line.startswith("raised:")]
        assert raised and "/dev/shm" in raised[0] and "MiB" in raised[0], r.stdout + r.stderr
        assert raised[0].startswith("raised: ShmError "), raised
        assert "8 MiB saved and loaded equal" in r.stdout, r.stdout + r.stderr
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
