"""What a hooked save leaves the file system the moment it returns, as real
readers see it (os.path.getsize, open, shutil.copy, safe_open, another
process), and that nothing the hook does later undoes a later operation of
the script (a write, an unlink, a rename, an rmtree) or reports it as a
loss. Each test runs a script with CKPT_SIDECAR=1 and real torch; before
the file was placed ahead of the return, each of them failed."""
import errno
import os
import subprocess
import sys
import textwrap
import threading

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: the hook's reader tests need it")


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    env["CKPT_SIDECAR"] = "1"
    env["CKPT_SIDECAR_SOCKET"] = str(tmp_path / "no-sidecar.sock")  # a spawned sidecar, where the hook wants one
    return env


def _run(tmp_path, code):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_env(tmp_path), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


PRELUDE = """
    import io, os, shutil, torch
    from ckpt_sidecar import _hook
    def plain_bytes(obj):
        b = io.BytesIO()
        torch.save.__wrapped__(obj, b)
        return b.getvalue()
    os.makedirs("x", exist_ok=True)
    p = "x/a.pt"
    torch.save({"w": torch.zeros(1 << 20)}, p)
    _hook.wait_sidecar(60)   # a sidecar, where the hook starts one, is up now
"""


def test_every_reader_sees_the_new_file_the_moment_torch_save_returns(tmp_path):
    r = _run(tmp_path, PRELUDE + """
    new = {"w": torch.ones(6 << 20)}
    want = plain_bytes(new)
    torch.save(new, p)
    assert os.path.getsize(p) == len(want), (os.path.getsize(p), len(want))
    assert open(p, "rb").read() == want
    shutil.copy(p, "x/copy.pt")
    assert torch.equal(torch.load.__wrapped__("x/copy.pt")["w"], new["w"])
    torch.save({"n": 1}, "x/fresh.pt")
    assert os.path.exists("x/fresh.pt")
    print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_a_write_of_the_script_after_torch_save_is_never_undone(tmp_path):
    # The reproduction, with flush (every pending sync done) for its sleeps.
    r = _run(tmp_path, PRELUDE + """
    torch.save({"w": torch.ones(6 << 20)}, p)
    open(p, "wb").write(b"newer by script")
    assert _hook.flush(120)
    print(open(p, "rb").read()[:15])
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "b'newer by script'", r.stdout + r.stderr


def test_a_remove_or_rename_right_after_torch_save_holds(tmp_path):
    r = _run(tmp_path, PRELUDE + """
    torch.save({"w": torch.ones(4 << 20)}, p)
    os.remove(p)                    # raises nothing: the file is there
    torch.save({"w": torch.ones(4 << 20)}, "x/b.pt")
    os.rename("x/b.pt", "x/q.pt")
    assert _hook.flush(120)
    print(sorted(os.listdir("x")))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['q.pt']", r.stdout + r.stderr


def test_an_rmtree_of_a_saved_folder_is_no_loss(tmp_path):
    # HF Trainer's save_total_limit removes old checkpoint folders so.
    r = _run(tmp_path, PRELUDE + """
    os.makedirs("checkpoint-5")
    torch.save({"w": torch.ones(4 << 20)}, "checkpoint-5/model.pt")
    torch.save({"w": torch.ones(4 << 20)}, "checkpoint-5/optim.pt")
    shutil.rmtree("checkpoint-5")
    """)
    assert r.returncode == 0, r.stderr
    assert "lost" not in r.stderr and "failed" not in r.stderr, r.stderr
    assert not (tmp_path / "checkpoint-5").exists()


def test_safe_open_right_after_save_file_sees_its_metadata_and_tensors(tmp_path):
    r = _run(tmp_path, PRELUDE + """
    import safetensors.torch as st
    from safetensors import safe_open
    t = {"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    m = {"format": "pt", "step": "7"}
    st.save_file({"old": torch.zeros(2)}, "x/m.safetensors")
    st.save_file(t, "x/m.safetensors", metadata=m)
    assert os.path.getsize("x/m.safetensors") == len(st.save(t, metadata=m))
    with safe_open("x/m.safetensors", "pt") as f:
        assert f.metadata() == m, f.metadata()
        assert sorted(f.keys()) == ["a", "b"] and all(torch.equal(f.get_tensor(k), t[k]) for k in t)
    assert [n for n in os.listdir("x") if "tmp" in n] == [], os.listdir("x")
    print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


SAVER = """
import json, os, sys, torch
from ckpt_sidecar import _hook
torch.save({"i": -1}, "ckpt/model.pt")
_hook.wait_sidecar(60)   # a sidecar, where the hook starts one, is up now
for i in range(int(sys.argv[1])):
    torch.save({"i": i, "w": torch.full((4 << 20,), float(i))}, "ckpt/model.pt")
    with open("ckpt/trainer_state.json", "w") as f:      # as the HF Trainer writes it: plain open()
        json.dump({"i": i}, f)
    print(f"returned {i}", flush=True)
    sys.stdin.readline()                                 # the test has looked
"""


def test_another_process_never_sees_an_old_or_partial_file_after_the_return(tmp_path):
    # The script says when torch.save returned and waits; the test (another
    # process) then reads the folder: the weights are the ones just saved.
    # A poller reads the folder all the while: every model.pt it opens is
    # whole (it loads).
    (tmp_path / "ckpt").mkdir()
    n = 12
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(n)], env=_env(tmp_path), cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop, seen, torn = threading.Event(), [], []

    def poll():
        while not stop.is_set():
            try:
                with open(tmp_path / "ckpt" / "model.pt", "rb") as f:
                    seen.append(torch.load(f)["i"])
            except FileNotFoundError:
                pass
            except Exception as e:  # noqa: BLE001 - a torn file
                torn.append(repr(e))

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for i in range(n):
            line = proc.stdout.readline()
            assert line.strip() == f"returned {i}", (line, proc.stderr.read() if not line else "")
            assert os.path.getsize(tmp_path / "ckpt" / "model.pt") > (16 << 20), i
            state = torch.load(tmp_path / "ckpt" / "model.pt")
            assert state["i"] == i and torch.equal(state["w"], torch.full((4 << 20,), float(i))), (i, state["i"])
            proc.stdin.write("\n")
            proc.stdin.flush()
        proc.stdin.close()
        assert proc.wait(120) == 0, proc.stderr.read()
    finally:
        stop.set()
        poller.join(60)
        proc.kill()
        proc.wait()
    assert torn == [], torn[:3]
    assert seen == sorted(seen), "the poller saw an older file after a newer one"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["model.pt", "trainer_state.json"]


KILLED = """
import os, sys, torch
for i in range(1000):
    torch.save({"i": i, "w": torch.full((1 << 20,), float(i))}, "k/model.pt")
    print(i, flush=True)
"""


def test_a_trainer_killed_at_any_moment_leaves_a_whole_file_and_no_temp(tmp_path):
    (tmp_path / "k").mkdir()
    for after in (0, 3, 7):
        proc = subprocess.Popen([sys.executable, "-c", KILLED], env=_env(tmp_path), cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(after + 1):
                last = int(proc.stdout.readline())
        finally:
            proc.kill()
            proc.wait()
        state = torch.load(tmp_path / "k" / "model.pt")
        assert state["i"] >= last and torch.equal(state["w"], torch.full((1 << 20,), float(state["i"])))
        assert os.listdir(tmp_path / "k") == ["model.pt"], os.listdir(tmp_path / "k")


# ---- the sync after the return: unit tests of the queue ----

def _held_fsync(monkeypatch, fail_with=None):
    """os.fsync as _atomic_write sees it, held until the event is set, then
    failing with `fail_with` (an errno) or doing the real fsync."""
    from ckpt_sidecar import _atomic_write

    go, real = threading.Event(), os.fsync

    def fsync(fd):
        go.wait(60)
        if fail_with:
            raise OSError(fail_with, os.strerror(fail_with))
        real(fd)

    monkeypatch.setattr(_atomic_write.os, "fsync", fsync)
    return go


def test_a_sync_that_fails_for_a_file_the_script_removed_is_no_loss(tmp_path, monkeypatch):
    from ckpt_sidecar import _file_queue
    from ckpt_sidecar._atomic_write import writing_bytes

    files = _file_queue._Files()
    go = _held_fsync(monkeypatch, errno.EIO)
    d = tmp_path / "checkpoint-5"
    d.mkdir()
    files.write_here(str(d / "a.pt"), writing_bytes(b"a" * 1000))
    files.write_here(str(tmp_path / "b.pt"), writing_bytes(b"b"))
    files.write_here(str(tmp_path / "b.pt"), writing_bytes(b"B"))   # replaces the one before
    import shutil

    shutil.rmtree(d)
    go.set()
    assert files.wait(None, 60)
    # a.pt removed, the first b.pt replaced: no loss; the second b.pt's sync failed: it is.
    assert list(files.untold()) == [str(tmp_path / "b.pt")], files.untold()
    assert files.counts == {"sidecar": 0, "in_process": 3, "superseded": 2}
    with pytest.raises(OSError) as e:
        files.raise_error(str(tmp_path / "b.pt"))
    assert e.value.errno == errno.EIO and "not durable" in str(e.value)


def test_files_are_in_place_before_their_sync(tmp_path, monkeypatch):
    from ckpt_sidecar import _file_queue
    from ckpt_sidecar._atomic_write import writing_bytes

    files = _file_queue._Files()
    # The sync thread held before it looks at the path, so that every file
    # is placed first: the first a.pt is then replaced before its turn.
    go, real = threading.Event(), _file_queue.sync_placed

    def held(placed, path):
        go.wait(60)
        return real(placed, path)

    monkeypatch.setattr(_file_queue, "sync_placed", held)
    for name, data in (("a.pt", b"a" * 1000), ("b.pt", b"b" * 100000), ("a.pt", b"A")):
        files.write_here(str(tmp_path / name), writing_bytes(data))
        assert (tmp_path / name).read_bytes() == data, name
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt"]   # no temp file
    assert files.pending(str(tmp_path / "a.pt"))              # its sync is still to come
    go.set()
    assert files.wait(None, 30)
    assert files.counts == {"sidecar": 0, "in_process": 3, "superseded": 1}
    assert (tmp_path / "a.pt").read_bytes() == b"A"


def test_the_writeback_file_writes_every_byte_and_starts_the_disk_as_it_goes(tmp_path, monkeypatch):
    from ckpt_sidecar import _atomic_write

    monkeypatch.setattr(_atomic_write, "WRITEBACK_STEP_BYTES", 1000)
    started = []
    monkeypatch.setattr(_atomic_write, "_sync_file_range", lambda fd, at, n, how: started.append((at, n)))
    data = os.urandom(5500)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        with _atomic_write.Writeback(fd) as f:
            assert f.write(data[:10]) == 10
            assert f.write(memoryview(data)[10:3010]) == 3000      # across three steps
            f.write(data[3010:])
        assert os.pread(fd, 10000, 0) == data
    finally:
        os.close(fd)
    assert started and all(n >= 1000 for _, n in started), started
    assert [at for at, _ in started] == sorted(at for at, _ in started) and started[-1][0] + started[-1][1] <= 5500
