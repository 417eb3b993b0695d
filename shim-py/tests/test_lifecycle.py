"""Sidecar death and reconnection, spawn mode, connection errors."""
import os
import signal
import time

import numpy as np
import pytest

import ckpt_sidecar as cs


def test_sidecar_gone_mid_training_then_back(sidecar):
    ck = cs.Checkpointer(socket=sidecar.socket, spawn=False)
    w = np.arange(1000, dtype=np.float32)
    ck.save(1, {"w": w}).wait_durable(30)
    sidecar.kill()
    # The trainer goes on; the next save says clearly what happened.
    w += 1
    with pytest.raises(cs.SidecarError) as e:
        h = ck.save(2, {"w": w})
        h.wait_released(30)
    assert isinstance(e.value, (cs.Disconnected, cs.ConnectFailed)), type(e.value)
    assert str(e.value)  # carries the shim's message
    w += 1
    with pytest.raises(cs.SidecarError):
        ck.save(3, {"w": w})
    # A sidecar is back on the same socket: the next save reconnects.
    sidecar.start()
    h = ck.save(4, {"w": w})
    h.wait_durable(30)
    assert ck.list() == [1, 4]
    assert np.array_equal(ck.load()["w"], w)
    ck.close()


def test_pending_save_fails_when_sidecar_dies(sidecar):
    ck = cs.Checkpointer(socket=sidecar.socket, spawn=False)
    h = ck.save(1, {"w": np.zeros(1 << 20)})
    h.wait_released(30)
    sidecar.kill()
    try:
        h.wait_durable(30)  # it may have committed before the kill
    except cs.SidecarError as e:
        assert isinstance(e, cs.Disconnected), type(e)
    ck.close()


def test_no_sidecar_and_no_spawn_is_connect_failed(no_default_sidecar):
    with pytest.raises(cs.ConnectFailed):
        cs.Checkpointer(spawn=False)


def test_spawn_mode(tmp_path, no_default_sidecar):
    d = tmp_path / "ck"
    ck = cs.Checkpointer(dir=d, staging="64MiB", keep=2)
    assert ck.spawned and os.path.exists(ck.socket)
    proc, tmpdir = ck._proc, os.path.dirname(ck.socket)
    for s in range(1, 5):
        ck.save(s, {"w": np.full(10, s), "s": s})
    ck.close()  # waits for releases; SIGTERM drains the rest
    assert proc.returncode == 0 and not os.path.exists(tmpdir)
    assert (d / "latest").read_text().strip() == "step-000000000004"
    # A new Checkpointer on the same directory spawns again and sees them (keep=2).
    with cs.Checkpointer(dir=d, staging="64MiB") as ck2:
        assert ck2.list() == [3, 4]
        assert ck2.load()["s"] == 4


def test_spawned_sidecar_restarts_after_death(tmp_path, no_default_sidecar):
    with cs.Checkpointer(dir=tmp_path / "ck", staging="64MiB") as ck:
        ck.save(1, {"w": np.ones(3)}).wait_durable(30)
        ck._proc.send_signal(signal.SIGKILL)
        ck._proc.wait()
        with pytest.warns(UserWarning, match="spawned sidecar exited"):
            h = ck.save(2, {"w": np.ones(3) * 2})
        h.wait_durable(30)
        assert ck.list() == [1, 2]


def test_handle_timeout(ck):
    h = ck.save(1, {"w": np.zeros(8)})
    h.wait_durable(30)
    assert h.done()
    h.wait_released(0)  # long since released: returns at once


def test_spawn_at_given_socket_and_fork_child_leaves_it(tmp_path, no_default_sidecar):
    sock = str(tmp_path / "s" / "sidecar.sock")
    ck = cs.Checkpointer(dir=tmp_path / "ck", socket=sock, staging="64MiB")
    assert ck.spawned and ck.socket == sock
    pid = os.fork()
    if pid == 0:  # the child's exit runs the atexit close: it must not stop the parent's sidecar
        try:
            from ckpt_sidecar import checkpointer

            checkpointer._close_all()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    with cs.Checkpointer(socket=sock, spawn=False) as other:  # a second client of the same sidecar
        ck.save(1, {"w": np.ones(2)}).wait_durable(30)
        assert other.list() == [1]
    ck.close()


def test_under_launch_preload_uses_the_preloaded_library(tmp_path):
    """`ckpt-sidecar launch --preload -- python ...`: the package uses the libckpt
    already in the process and reaches the launching sidecar by $CKPT_SIDECAR_SOCKET."""
    import subprocess
    import sys

    from ckpt_sidecar import _native

    code = ("import ckpt_sidecar as cs, numpy as np\n"
            "from ckpt_sidecar import _native as N\n"
            "import ctypes\n"
            "assert not isinstance(N.lib(), type(None)) and N.lib()._name is None, N.lib()._name\n"
            "ck = cs.Checkpointer(spawn=False)\n"
            "ck.save(1, {'w': np.arange(3)}).wait_durable(30)\n"
            "print(ck.load(1)['w'].tolist())\n")
    r = subprocess.run([_native.sidecar_binary(), "launch", "--dir", str(tmp_path / "ck"), "--staging", "64MiB",
                        "--preload", "--", sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[0, 1, 2]"


def test_trainer_sigkilled_spawned_sidecar_commits_taken_save_and_exits(tmp_path, no_default_sidecar):
    import subprocess
    import sys

    d = tmp_path / "ck"
    code = f"""
import os, sys, numpy as np, ckpt_sidecar as cs
ck = cs.Checkpointer(dir={str(d)!r}, staging="64MiB", log={str(tmp_path / "first.log")!r})
ck.save(1, {{"w": np.arange(1 << 20, dtype=np.float32)}}).wait_taken(30)
print(ck._proc.pid, flush=True)
os.kill(os.getpid(), 9)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    sidecar_pid = int(r.stdout.split()[0])
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{sidecar_pid}") and "zombie" not in _proc_state(sidecar_pid):
        assert time.monotonic() < deadline, "the orphaned sidecar did not exit"
        time.sleep(0.05)
    # The taken save committed; a new trainer spawns its own sidecar on the directory.
    with cs.Checkpointer(dir=d, staging="64MiB") as ck:
        assert ck.list() == [1], (tmp_path / "first.log").read_text()
        assert ck.load(1)["w"][-1] == (1 << 20) - 1


def _proc_state(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read()
    except OSError:
        return "zombie"


def test_running_sidecar_with_another_dir_warns(sidecar, tmp_path):
    with pytest.warns(UserWarning, match="checkpoints go there"):
        ck = cs.Checkpointer(dir=tmp_path / "elsewhere", socket=sidecar.socket, spawn=False)
    assert ck.dir == str(sidecar.dir)
    ck.close()


def test_spawn_with_cpus_pins_the_sidecar(tmp_path, no_default_sidecar):
    last = max(os.sched_getaffinity(0))
    ck = cs.Checkpointer(dir=tmp_path / "ck", staging="16MiB", cpus=[last])
    try:
        tids = os.listdir(f"/proc/{ck._proc.pid}/task")
        assert len(tids) >= 3, tids
        for tid in tids:
            assert os.sched_getaffinity(int(tid)) == {last}, tid
        # launch's command (the `cat` that ends with this process) keeps the CPUs it had.
        pid = ck._proc.pid
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
        assert [os.sched_getaffinity(int(c)) for c in children] == [os.sched_getaffinity(0)], children
        ck.save(1, {"w": np.arange(10.0)}).wait_durable()
    finally:
        ck.close()


# ---- nothing leaks: a failed constructor, a collected Checkpointer, a killed trainer ----

from ckpt_test_util import assert_nothing_left, lock_is_free, open_fds_to, run_sigkilled_trainer, wait_until  # noqa: E402


def _our_segments():
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"ckpt-{os.getpid()}-")}


def test_failed_spawn_releases_everything(tmp_path, no_default_sidecar, private_tmp):
    d = tmp_path / "ck"
    with pytest.raises(cs.SidecarError, match="exited"):
        # A size Python takes (a bad one, "lots", is refused before any
        # spawn now: test_misuse.py) but the sidecar cannot allocate: it exits.
        cs.Checkpointer(dir=d, staging="64PiB")
    # No lock held, no descriptor on it, no private folder left.
    assert lock_is_free(d)
    assert open_fds_to(d / ".ckpt-sidecar-py.lock") == []
    assert os.listdir(private_tmp) == []
    # The next Checkpointer on the directory spawns at once (it used to wait 120 s).
    with cs.Checkpointer(dir=d, staging="16MiB") as ck:
        ck.save(1, {"w": np.arange(4)}).wait_durable(60)
        assert ck.list() == [1]


def test_collected_checkpointer_is_closed(tmp_path, no_default_sidecar, private_tmp):
    import gc

    class Optimizer:  # what guard() needs of a torch optimizer
        def register_step_pre_hook(self, hook):
            self.hook = hook

    d = tmp_path / "ck"
    before = _our_segments()
    opt = Optimizer()
    shared = {"w": np.arange(1 << 16, dtype=np.float32)}
    ck = cs.Checkpointer(dir=d, staging="16MiB")
    proc = ck._proc
    ck.guard(opt)                # the optimizer's hook must not keep it alive
    ck.share(shared)             # shared["w"] now lives in the client's shared memory
    ck.save(1, {"shared": shared, "copied": np.ones(1000)})  # not waited for
    assert _our_segments() - before
    del ck
    gc.collect()
    # Closed as close() would: the save taken and committed, the sidecar
    # stopped, the shared array back in private memory, nothing left.
    assert proc.poll() == 0
    assert shared["w"].flags.owndata and shared["w"][-1] == (1 << 16) - 1
    assert _our_segments() == before
    assert lock_is_free(d)
    assert open_fds_to(d / ".ckpt-sidecar-py.lock") == []
    assert os.listdir(private_tmp) == []
    opt.hook(opt, (), {})        # a hook whose Checkpointer is gone does nothing
    with cs.Checkpointer(dir=d, staging="16MiB") as ck2:
        assert ck2.list() == [1]
        assert ck2.load(1)["shared"]["w"][-1] == (1 << 16) - 1


def test_collected_checkpointer_without_cycles_is_closed_at_once(tmp_path, no_default_sidecar, private_tmp):
    d = tmp_path / "ck"
    ck = cs.Checkpointer(dir=d, staging="16MiB")
    proc = ck._proc
    del ck                       # no save, no cycle: reference counting alone
    assert proc.poll() == 0 and lock_is_free(d) and os.listdir(private_tmp) == []


def test_closing_one_checkpointer_keeps_the_live_process_segments_of_another(tmp_path, sidecar, private_tmp):
    # The janitor of a closed spawned sidecar removes shm segments of its
    # trainer's pid only if that process is gone: here it lives on, with a
    # second Checkpointer's regions.
    other = cs.Checkpointer(socket=sidecar.socket, spawn=False)
    w = {"w": np.arange(1 << 16, dtype=np.float32)}
    other.share(w)
    other.save(1, w).wait_durable(60)
    mine = _our_segments()
    spawned = cs.Checkpointer(dir=tmp_path / "ck", staging="16MiB")
    spawned.save(1, {"x": np.ones(10)}).wait_durable(60)
    janitor = spawned._own.janitor
    spawned.close()
    assert janitor.poll() is not None and os.listdir(private_tmp) == []
    assert mine <= _our_segments()
    w["w"] += 1   # still mapped, still shared
    other.save(2, w).wait_durable(60)
    assert other.load(2)["w"][0] == 1
    other.close()


def test_sigkilled_trainer_leaves_nothing_behind(tmp_path, no_default_sidecar):
    code = f"""
import os, numpy as np, ckpt_sidecar as cs
ck = cs.Checkpointer(dir={str(tmp_path / "ck")!r}, staging="16MiB")
w = {{"w": np.arange(1 << 16, dtype=np.float32)}}
ck.share(w)
ck.save(1, w).wait_taken(60)
ck.save(2, {{"copied": np.ones(1 << 16)}}).wait_taken(60)
assert [n for n in os.listdir("/dev/shm") if n.startswith(f"ckpt-{{os.getpid()}}-")]
print(os.getpid(), ck._proc.pid, ck._own.janitor.pid, flush=True)
os.kill(os.getpid(), 9)
"""
    tmpdir, pids, dead = run_sigkilled_trainer(code, tmp_path, {})
    assert_nothing_left(tmpdir, pids, dead)
    with cs.Checkpointer(dir=tmp_path / "ck", staging="16MiB") as ck:  # and the taken saves committed
        assert ck.list() == [1, 2]


# ---- preemption: SIGTERM becomes ck.preempted() ----

def _trainer_waiting_for_sigterm(make, preemption, also_sidecar=False):
    """A trainer (Checkpointer `make`) waits for SIGTERM, then saves step 7
    and exits 0; the test sends it SIGTERM (and its spawned sidecar too,
    with also_sidecar, as a scheduler that signals every process of a job)."""
    import subprocess
    import sys

    code = f"""
import sys, time, numpy as np, ckpt_sidecar as cs
ck = cs.Checkpointer({make}, preemption={preemption})
assert not ck.preempted()
print("ready", ck._proc.pid if ck._proc else 0, flush=True)
deadline = time.monotonic() + 60
while not ck.preempted():
    if time.monotonic() > deadline:
        sys.exit("no SIGTERM seen within 60 s")
    time.sleep(0.01)
ck.save(7, {{"w": np.arange(10)}}).wait_durable(60)   # the last checkpoint, after the notice
ck.close()
print("saved after SIGTERM", flush=True)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        assert line and line[0] == "ready", p.communicate(timeout=60)
        if also_sidecar:
            os.kill(int(line[1]), signal.SIGTERM)
        p.send_signal(signal.SIGTERM)   # from outside, as a scheduler does
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out, err


def test_preemption_sigterm_sets_preempted_and_the_trainer_saves_then_exits_0(sidecar):
    rc, out, err = _trainer_waiting_for_sigterm(f"socket={sidecar.socket!r}, spawn=False", True)
    assert rc == 0, out + err
    assert "saved after SIGTERM" in out
    with cs.Checkpointer(socket=sidecar.socket, spawn=False) as ck:
        assert ck.latest() == 7


def test_without_preemption_sigterm_ends_the_process(sidecar):
    rc, out, err = _trainer_waiting_for_sigterm(f"socket={sidecar.socket!r}, spawn=False", False)
    assert rc == -signal.SIGTERM, (rc, out, err)
    with cs.Checkpointer(socket=sidecar.socket, spawn=False) as ck:
        assert ck.latest() is None


def test_preemption_sigterm_to_the_whole_job_spawned_sidecar_serves_the_last_save(tmp_path, no_default_sidecar):
    # SIGTERM to the trainer and to its spawned sidecar: the sidecar stays
    # (no restart), takes the last save, and exits once the trainer is done.
    d = tmp_path / "ck"
    rc, out, err = _trainer_waiting_for_sigterm(f"dir={str(d)!r}, staging='16MiB'", True, also_sidecar=True)
    assert rc == 0, out + err
    assert "saved after SIGTERM" in out and "starting a new one" not in err, out + err
    with cs.Checkpointer(dir=d, staging="16MiB") as ck:
        assert ck.list() == [7]


def test_a_served_sidecar_removes_the_segments_of_a_client_killed_with_sigkill(sidecar, tmp_path):
    """No spawn, no janitor: a long-lived `serve` outlives many trainers, and
    each one SIGKILLed would otherwise leave its regions in /dev/shm."""
    import signal
    import subprocess
    import sys

    code = f"""
import os, numpy as np, ckpt_sidecar as cs
ck = cs.Checkpointer(socket={sidecar.socket!r}, spawn=False)
w = ck.share(np.arange(1 << 16, dtype=np.float32))
ck.save(1, {{"w": w, "b": np.ones(100)}}).wait_durable(60)
print(os.getpid(), flush=True)
import time; time.sleep(600)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())

        def segs():
            return [n for n in os.listdir("/dev/shm") if n.startswith(f"ckpt-{pid}-")]

        assert segs(), "the client made no shm segments"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    wait_until(lambda: segs() == [], 10, lambda: f"the dead client's segments are removed: {segs()}")
    # The sidecar serves on, and what was saved is there.
    with cs.Checkpointer(socket=sidecar.socket, spawn=False) as ck:
        assert ck.list() == [1]



def test_checkpointer_on_a_directory_a_serve_sidecar_holds_connects_to_it(sidecar, no_default_sidecar, tmp_path):
    # Checkpointer(dir=D) while `ckpt-sidecar serve --dir D` runs at
    # another socket spawned a sidecar that could not take D. The serving
    # sidecar's lock file names its socket: the Checkpointer connects there.
    w = np.arange(1000, dtype=np.float32)
    with pytest.warns(UserWarning, match="staging=.*ignored, the sidecar at .* was already running"):
        ck = cs.Checkpointer(dir=str(sidecar.dir), staging="64MiB")
    try:
        assert not ck.spawned and ck.socket == sidecar.socket
        assert os.path.realpath(ck.dir) == os.path.realpath(sidecar.dir)
        ck.save(1, {"w": w}).wait_durable(30)
        assert np.array_equal(ck.load(1)["w"], w)
    finally:
        ck.close()
    assert (sidecar.dir / "step-000000000001").is_dir()
    # A lock file its killed holder left (the socket answers no more): a
    # sidecar is spawned as before.
    sidecar.kill()
    ck = cs.Checkpointer(dir=str(sidecar.dir), staging="64MiB")
    try:
        assert ck.spawned and ck.list() == [1]
    finally:
        ck.close()
