"""A save whose tensors were all copied at save() is handed over to the
sidecar when save() returns (its save region is a hand-over region,
docs/protocol.md): it commits even if the trainer is SIGKILLed before the
sidecar has copied it. A save of share()'d tensors (memory the trainer keeps
using) is still aborted when the trainer dies before the sidecar's Released.

The window is made certain, not likely: the sidecar is stopped (SIGSTOP,
every thread seen stopped) while the trainer saves and is killed, and only
then let go on (SIGCONT), so it finds the save with its client already gone."""
import os
import signal
import subprocess
import sys

import numpy as np

import ckpt_sidecar as cs
from ckpt_test_util import wait_until

N = 4 << 20  # float32 elements: 16 MiB, copied by the trainer at save()


def _stop(pid):
    os.kill(pid, signal.SIGSTOP)

    def stopped():
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    state = f.read().rsplit(") ", 1)[1][:1]
            except (OSError, IndexError):
                continue  # a thread that just ended
            if state not in "Tt":
                return False
        return True

    wait_until(stopped, 30, f"every thread of the sidecar {pid} stopped")


def _trainer(make, shared):
    """A trainer (Checkpointer `make`) that saves step 1 and waits for it to
    be durable, says "ready <sidecar pid>", waits for a line on stdin, changes
    its state, saves step 2 and kills itself (SIGKILL) as soon as save()
    returned. `shared`: its tensor lies in a share()'d region (sent in place)
    rather than being copied at save()."""
    code = f"""
import os, sys, numpy as np, ckpt_sidecar as cs
ck = cs.Checkpointer({make})
state = {{"w": np.arange({N}, dtype=np.float32), "b": np.full(1000, 7, dtype=np.int64), "note": "handed over"}}
if {shared}:
    ck.share(state)  # its arrays replaced by ones in a shared region
ck.save(1, state).wait_durable(60)
print("ready", ck._proc.pid if ck._proc else 0, flush=True)
sys.stdin.readline()
state["w"] += 1
state["note"] = "step 2"
h = ck.save(2, state)
assert h.released() == (not {shared}), h.released()
os.kill(os.getpid(), 9)
"""
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _kill_while_stopped(p, sidecar_pid):
    """Lets trainer `p` save step 2 and die while the sidecar is stopped."""
    try:
        line = p.stdout.readline().split()
        assert line and line[0] == "ready", p.communicate(timeout=60)
        _stop(sidecar_pid)
        try:
            p.stdin.write("go\n")
            p.stdin.flush()
            _, err = p.communicate(timeout=120)
        finally:
            os.kill(sidecar_pid, signal.SIGCONT)
        assert p.returncode == -9, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _assert_step_2(ck):
    got = ck.load(2)
    assert got["note"] == "step 2"
    np.testing.assert_array_equal(got["w"], np.arange(N, dtype=np.float32) + 1)
    np.testing.assert_array_equal(got["b"], np.full(1000, 7, dtype=np.int64))


def test_copied_at_save_commits_though_the_trainer_died_before_the_sidecar_copied_it(sidecar):
    p = _trainer(f"socket={sidecar.socket!r}, spawn=False", False)
    _kill_while_stopped(p, sidecar.proc.pid)
    with cs.Checkpointer(socket=sidecar.socket, spawn=False) as ck:
        wait_until(lambda: ck.list() == [1, 2], 60, f"step 2 committed: {sidecar.log.read_text()}")
        _assert_step_2(ck)
        assert ck.status()["in_flight"] == []
    log = sidecar.log.read_text()
    # The sidecar found the client gone before it released the save.
    assert "it handed this save over" in log, log
    assert "aborted before release" not in log, log


def test_shared_tensors_are_still_aborted_when_the_trainer_dies_before_release(sidecar):
    p = _trainer(f"socket={sidecar.socket!r}, spawn=False", True)
    _kill_while_stopped(p, sidecar.proc.pid)
    wait_until(lambda: "aborted before release" in sidecar.log.read_text(), 60, "step 2 aborted")
    with cs.Checkpointer(socket=sidecar.socket, spawn=False) as ck:
        wait_until(lambda: ck.status()["in_flight"] == [], 60, "nothing in flight")
        assert ck.list() == [1], sidecar.log.read_text()
    assert "it handed this save over" not in sidecar.log.read_text()


def test_spawned_sidecar_commits_the_handed_over_save_of_a_killed_trainer_then_exits(tmp_path, no_default_sidecar):
    """Spawn mode: the trainer's death also ends the sidecar (launch drains);
    the save it had handed over, still unread on the socket when the sidecar
    starts draining, commits before the sidecar exits."""
    d, log = tmp_path / "ck", tmp_path / "spawned.log"
    p = _trainer(f"dir={str(d)!r}, staging='64MiB', log={str(log)!r}", False)
    pid = None
    try:
        line = p.stdout.readline().split()
        assert line and line[0] == "ready", p.communicate(timeout=60)
        pid = int(line[1])
        _stop(pid)
        try:
            p.stdin.write("go\n")
            p.stdin.flush()
            _, err = p.communicate(timeout=120)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert p.returncode == -9, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

    def exited():
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(") ", 1)[1][:1] in "ZX"
        except OSError:
            return True

    wait_until(exited, 60, f"the orphaned sidecar exits: {log.read_text()}")
    text = log.read_text()
    assert "it handed this save over" in text, text
    with cs.Checkpointer(dir=d, staging="64MiB") as ck:
        assert ck.list() == [1, 2], text
        _assert_step_2(ck)
