"""The .pth import hook: inert without CKPT_SIDECAR=1; with it, torch.save
writes each file into an unnamed file of its directory, renamed over the
path before it returns, and synced afterwards (a process that may hold CUDA
tensors also starts a sidecar, for the CUDA way: test_hook_cuda_fake). A fake `torch` (pickle-based save/load) tests the
mechanics without torch; a real-torch test runs when torch is installed."""
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

FAKE_TORCH = '''
import pickle
def save(obj, f, *a, **k):
    if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
        with open(f, "wb") as fh:
            pickle.dump(obj, fh)
    else:
        pickle.dump(obj, f)
def load(f, *a, **k):
    with open(f, "rb") as fh:
        return pickle.load(fh)
'''


def _run(code, env_extra, tmp_path, fake=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    # No sidecar at this socket unless a test starts one: the hook spawns its own.
    env["CKPT_SIDECAR_SOCKET"] = str(tmp_path / "no-sidecar.sock")
    env.update(env_extra)
    if fake:
        (tmp_path / "fake" / "torch").mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / "torch" / "__init__.py").write_text(FAKE_TORCH)
        env["PYTHONPATH"] = str(tmp_path / "fake")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_pth_is_installed():
    import site

    dirs = site.getsitepackages() + [site.getusersitepackages()]
    assert any(os.path.exists(os.path.join(d, "ckpt_sidecar_hook.pth")) for d in dirs), dirs


def test_hook_inert_without_env(tmp_path):
    code = """
        import sys
        assert not any(k.startswith("ckpt_sidecar") for k in sys.modules), "package imported at start"
        assert not any(type(f).__name__ == "PatchingFinder" for f in sys.meta_path)
        import torch
        assert not hasattr(torch.save, "_ckpt_sidecar_hook")
        print("inert")
    """
    for env in ({}, {"CKPT_SIDECAR": "0"}, {"CKPT_SIDECAR": ""}):
        r = _run(code, env, tmp_path)
        assert r.returncode == 0 and r.stdout.strip() == "inert", (env, r.stderr)


def test_hook_active_with_env(tmp_path, private_tmp):
    code = """
        import sys
        import torch
        from ckpt_sidecar import _hook
        assert torch.save._ckpt_sidecar_hook and torch.load._ckpt_sidecar_hook
        obj = {"a": list(range(1000)), "b": "x"}
        torch.save(obj, "out.pt")   # in place now
        obj["a"].append(1)          # the snapshot was taken inside torch.save
        assert not _hook.wait_sidecar(60)   # no CUDA here: no sidecar is started
        assert torch.load("out.pt") == {"a": list(range(1000)), "b": "x"}
        for i in range(5):          # the same path again and again: the last wins
            torch.save({"i": i}, "again.pt")
        assert torch.load("again.pt") == {"i": 4}
        try:
            torch.save(obj, "no/such/dir/x.pt")
            raise SystemExit("no error for a missing directory")
        except FileNotFoundError:
            pass
        # Serialised straight into the file, in many writes.
        big = {"blob": bytes(range(256)) * 20000, "n": list(range(100000))}
        torch.save(big, "big.pt")
        assert torch.load("big.pt") == big
        # A torch.save that fails while serialising leaves no file.
        for _ in range(3):
            try:
                torch.save({"f": lambda: 0}, "bad.pt")
                raise SystemExit("a lambda pickled")
            except Exception as e:  # pickle.PicklingError, or AttributeError on older Pythons
                assert "pickle" in str(e).lower() or "lambda" in str(e), e
        torch.save({"after": "failures"}, "after.pt")
        assert torch.load("after.pt") == {"after": "failures"}
        torch.save({"n": 2}, "late.pt")   # its sync still pending at exit: done before exit
        print(_hook.counts())
    """
    r = _run(code, {"CKPT_SIDECAR": "1", "TMPDIR": private_tmp}, tmp_path)
    assert r.returncode == 0, r.stderr
    import ast
    import pickle

    counts = ast.literal_eval(r.stdout.strip())
    # Every file by this process, in place when its torch.save returned.
    assert counts["in_process"] == 9 and counts["sidecar"] == 0, (counts, r.stderr)
    assert "ckpt_sidecar:" not in r.stderr, r.stderr
    assert pickle.loads((tmp_path / "out.pt").read_bytes())["b"] == "x"
    assert pickle.loads((tmp_path / "again.pt").read_bytes()) == {"i": 4}
    assert pickle.loads((tmp_path / "late.pt").read_bytes()) == {"n": 2}
    assert pickle.loads((tmp_path / "big.pt").read_bytes())["n"][-1] == 99999
    assert not (tmp_path / "bad.pt").exists()
    assert not [p for p in os.listdir(tmp_path) if "ckpt-tmp" in p]
    # No sidecar was spawned: nothing in the private folder.
    assert os.listdir(private_tmp) == [], os.listdir(private_tmp)


def test_a_script_that_exits_right_after_its_only_save_leaves_the_file_and_nothing_else(tmp_path):
    # The sidecar is still being spawned when the script ends: the file is
    # written here, the sidecar is stopped, and its private folder removed.
    private_tmp = tempfile.mkdtemp(prefix="hk")  # short: socket paths live here
    try:
        code = """
            import torch
            torch.save({"only": list(range(100))}, "only.pt")
        """
        r = _run(code, {"CKPT_SIDECAR": "1", "TMPDIR": private_tmp}, tmp_path)
        assert r.returncode == 0, r.stderr
        import pickle

        assert pickle.loads((tmp_path / "only.pt").read_bytes()) == {"only": list(range(100))}
        assert os.listdir(private_tmp) == [], os.listdir(private_tmp)
    finally:
        import shutil

        shutil.rmtree(private_tmp, ignore_errors=True)


def test_hook_host_files_are_placed_here_even_with_a_running_sidecar(tmp_path, sidecar):
    # A sidecar writing a host file after torch.save returned could undo the
    # script's later operations on the path: host files never go to it.
    code = """
        import torch
        from ckpt_sidecar import _hook
        torch.save({"k": "v" * 100000}, "f.pt")
        assert torch.load("f.pt") == {"k": "v" * 100000}
        print(_hook.counts())
    """
    r = _run(code, {"CKPT_SIDECAR": "1", "CKPT_SIDECAR_SOCKET": sidecar.socket}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "'sidecar': 0" in r.stdout and "'in_process': 1" in r.stdout, r.stdout + r.stderr
    assert "file durable" not in sidecar.log.read_text(), sidecar.log.read_text()


def test_hook_with_real_torch(tmp_path):
    torch = pytest.importorskip("torch", reason="torch not installed: the real-torch hook test needs it")
    code = """
        import torch
        assert torch.save._ckpt_sidecar_hook
        sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "h": torch.ones(2, dtype=torch.bfloat16), "step": 3}
        torch.save(sd, "model.pt")
        back = torch.load("model.pt")
        assert torch.equal(back["w"], sd["w"]) and back["step"] == 3
    """
    r = _run(code, {"CKPT_SIDECAR": "1"}, tmp_path, fake=False)
    assert r.returncode == 0, r.stderr
    back = torch.load(tmp_path / "model.pt")  # this process: no hook
    assert torch.equal(back["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert back["h"].dtype == torch.bfloat16


REPRO_19 = """
import os, signal, torch
torch.save({'w': torch.zeros(1000)}, '{dir}/a.pt')
torch.save({'w': torch.ones(1000)}, '{dir}/b.pt')
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_hook_first_files_survive_a_sigkill_right_after_torch_save(tmp_path):
    # The reproduction (5 runs): the files of the first
    # torch.save calls, written here while the spawned sidecar starts (or
    # by the sidecar, once it answers), are there after a SIGKILL, whole,
    # and no temp file is left.
    torch = pytest.importorskip("torch", reason="torch not installed: the reproduction needs it")
    from ckpt_test_util import wait_until

    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    for run in range(5):
        d = tmp_path / f"x{run}"
        d.mkdir()
        private = tempfile.mkdtemp(prefix="ck")  # the spawned sidecar's folder: short, socket paths live there
        try:
            e = dict(env, CKPT_SIDECAR="1", CKPT_SIDECAR_SOCKET=str(tmp_path / "nobody.sock"), TMPDIR=private)
            r = subprocess.run([sys.executable, "-c", REPRO_19.replace("{dir}", str(d))], env=e,
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == -9, r.stderr
            # A file the sidecar took is written by it after the kill: wait
            # for it to finish and exit (its private folder then removed).
            wait_until(lambda: os.listdir(private) == [], 120, lambda: f"the sidecar's folder empties: {os.listdir(private)}")
            assert sorted(os.listdir(d)) == ["a.pt", "b.pt"], (run, os.listdir(d), r.stderr)
            assert torch.equal(torch.load(d / "a.pt")["w"], torch.zeros(1000)), run
            assert torch.equal(torch.load(d / "b.pt")["w"], torch.ones(1000)), run
        finally:
            import shutil

            shutil.rmtree(private, ignore_errors=True)


def test_hook_removes_temp_files_a_killed_process_left_and_no_others(tmp_path):
    # A process killed inside its write leaves .NAME.ckpt-tmp-PID-HEX: the
    # next hook that saves into the folder removes it, if its pid is dead
    # and nobody holds its lock (a live writer of another pid namespace
    # does); a live pid's, a locked one and other names stay.
    import fcntl

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stray = f".a.pt.ckpt-tmp-{dead.pid}-{'0' * 15}1"
    huge = f".b.pt.ckpt-tmp-{10 ** 12}-{'0' * 15}2"            # no pid can be that: dead
    live = f".a.pt.ckpt-tmp-{os.getpid()}-{'0' * 15}3"
    locked = f".a.pt.ckpt-tmp-{10 ** 12}-{'0' * 15}4"
    sidecars = ".a.pt.ckpt-tmp-00000000000000ab"              # the sidecar's own temp names: not the hook's
    for n in (stray, huge, live, locked, sidecars, "keep.pt"):
        (tmp_path / n).write_bytes(b"x")
    fd = os.open(tmp_path / locked, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        code = """
            import torch
            torch.save({"k": 1}, "a.pt")
        """
        r = _run(code, {"CKPT_SIDECAR": "1"}, tmp_path)
        assert r.returncode == 0, r.stderr
    finally:
        os.close(fd)
    left = sorted(n for n in os.listdir(tmp_path) if "ckpt-tmp" in n)
    assert left == sorted([live, locked, sidecars]), left
    assert "removed 2 temp file(s) that a killed process left" in r.stderr, r.stderr


def test_sigkilled_trainer_with_hook_leaves_nothing_behind(tmp_path, private_tmp):
    # SIGKILLed right after torch.save returned: the file is whole under its
    # name, and nothing else is left (no temp file, no shm segment, nothing
    # in the private $TMPDIR: a CPU-only process starts no sidecar).
    code = """
import os, torch
torch.save({"big": bytes(range(256)) * 4096}, "big.pt")
print(os.getpid(), flush=True)
os.kill(os.getpid(), 9)
"""
    r = _run(code, {"CKPT_SIDECAR": "1", "TMPDIR": private_tmp}, tmp_path)
    assert r.returncode == -9, r.stderr
    import pickle

    assert pickle.loads((tmp_path / "big.pt").read_bytes()) == {"big": bytes(range(256)) * 4096}
    assert not [n for n in os.listdir(tmp_path) if "ckpt-tmp" in n], os.listdir(tmp_path)
    pid = r.stdout.strip()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ckpt-{pid}-")]
    assert os.listdir(private_tmp) == [], os.listdir(private_tmp)


# ---- errors: raised at call time as the original's, or later, or at exit ----

def test_hook_raises_at_call_time_what_plain_torch_save_raises(tmp_path):
    pytest.importorskip("torch", reason="torch not installed: comparing with plain torch.save needs it")
    (tmp_path / "a_dir.pt").mkdir()
    (tmp_path / "a_file").write_text("x")
    code = """
        import os, torch
        from ckpt_sidecar import _hook
        plain = torch.save.__wrapped__
        x = {"w": torch.arange(10.0)}
        cases = [("/proc/sys/x.pt", {}),                  # no file can be created there
                 ("/sys/x.pt", {}),                       # permission denied (root too)
                 ("a_dir.pt", {}),                        # a directory at the path
                 ("no/such/dir/x.pt", {}),                # missing parent
                 ("a_file/x.pt", {}),                     # parent is a file
                 ("x.pt/", {}),                           # no file name (the hook wrote x.pt)
                 (b"x.pt", {}),                           # bytes are no path to torch (the hook wrote it)
                 ("a_dir.pt", {"_use_new_zipfile_serialization": False})]  # the legacy writer's OSError
        for path, kw in cases:
            got = want = None
            try:
                torch.save(x, path, **kw)
            except Exception as e:
                got = (type(e), str(e))
            try:
                plain(x, path, **kw)
            except Exception as e:
                want = (type(e), str(e))
            assert want is not None, f"plain torch.save to {path} did not fail"
            assert got == want, (path, kw, got, want)
            print("ok", path, want[0].__name__)
        assert _hook.counts() == {"sidecar": 0, "in_process": 0, "superseded": 0}, _hook.counts()
        assert sorted(os.listdir(".")) == ["a_dir.pt", "a_file"], os.listdir(".")   # no file, no temp
        assert os.listdir("a_dir.pt") == []
    """
    r = _run(code, {"CKPT_SIDECAR": "1"}, tmp_path, fake=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok ") == 8, r.stdout
    assert "ckpt_sidecar:" not in r.stderr, r.stderr   # nothing deferred, nothing said


def test_hook_a_script_whose_only_save_fails_exits_non_zero(tmp_path):
    # The error is raised from torch.save itself.
    pytest.importorskip("torch", reason="torch not installed: the real-torch hook test needs it")
    (tmp_path / "only.py").write_text('import torch\ntorch.save(torch.ones(3), "/proc/sys/x.pt")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    env.update(CKPT_SIDECAR="1", CKPT_SIDECAR_SOCKET=str(tmp_path / "no-sidecar.sock"))
    r = subprocess.run([sys.executable, "only.py"], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    assert 'line 2, in <module>\n    torch.save(torch.ones(3), "/proc/sys/x.pt")' in r.stderr, r.stderr
    assert r.stderr.rstrip().splitlines()[-1].startswith("RuntimeError: "), r.stderr
    plain = subprocess.run([sys.executable, "only.py"], env={k: v for k, v in env.items() if k != "CKPT_SIDECAR"},
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1
    assert plain.stderr.rstrip().splitlines()[-1] == r.stderr.rstrip().splitlines()[-1]


def test_hook_non_regular_paths_and_symlinks_are_written_as_the_original_does(tmp_path):
    # A FIFO at the path: the original writes into it (an atomic rename would
    # replace it by a file). A symbolic link: its target is written, the link stays.
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "target.pt").write_bytes(b"old")
    os.symlink("target.pt", tmp_path / "link.pt")
    code = """
        import os, pickle, stat, threading, torch
        from ckpt_sidecar import _hook
        got = []
        reader = threading.Thread(target=lambda: got.append(open("fifo", "rb").read()))
        reader.start()
        torch.save({"through": "fifo"}, "fifo")
        reader.join(60)
        assert pickle.loads(got[0]) == {"through": "fifo"}
        assert stat.S_ISFIFO(os.lstat("fifo").st_mode)
        torch.save({"through": "link"}, "link.pt")
        assert torch.load("link.pt") == {"through": "link"}
        _hook.flush()
        print(_hook.counts())
    """
    r = _run(code, {"CKPT_SIDECAR": "1"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert os.path.islink(tmp_path / "link.pt") and os.readlink(tmp_path / "link.pt") == "target.pt"
    import pickle

    assert pickle.loads((tmp_path / "target.pt").read_bytes()) == {"through": "link"}
    assert "'in_process': 1" in r.stdout, r.stdout   # the link's file, by the hook (the fifo by the original)


def _in_mount_ns(tmp_path, mount_opts, code, fake=True, extra_env=None):
    """Runs `code` in a user + mount namespace where `tmp_path/mnt` is a fresh
    tmpfs mounted with `mount_opts` (a read-only file system, a full one)."""
    import shutil

    if not shutil.which("unshare"):
        pytest.skip("no unshare(1): cannot mount a file system for this test")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o {mount_opts} tmpfs {tmp_path}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    (tmp_path / "mnt").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    env.update(CKPT_SIDECAR="1", CKPT_SIDECAR_SOCKET=str(tmp_path / "no-sidecar.sock"), **(extra_env or {}))
    if fake:
        (tmp_path / "fake" / "torch").mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / "torch" / "__init__.py").write_text(FAKE_TORCH)
        env["PYTHONPATH"] = str(tmp_path / "fake")
    return subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o "$1" tmpfs "$2" && shift 2 && exec "$@"',
                           "sh", mount_opts, str(tmp_path / "mnt"), sys.executable, "-c", textwrap.dedent(code)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_hook_read_only_file_system_raises_at_call_time_as_the_original(tmp_path):
    pytest.importorskip("torch", reason="torch not installed: comparing with plain torch.save needs it")
    code = """
        import torch
        errs = []
        for save in (torch.save, torch.save.__wrapped__):
            try:
                save({"w": torch.ones(4)}, "mnt/x.pt")
                errs.append(None)
            except Exception as e:
                errs.append((type(e), str(e)))
        assert errs[0] == errs[1] and errs[0] is not None, errs
        assert "Read-only file system" in errs[0][1], errs
        print("same:", errs[0][0].__name__)
    """
    r = _in_mount_ns(tmp_path, "ro,size=1m", code, fake=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "same: RuntimeError" in r.stdout, r.stdout


def test_hook_disk_full_raises_at_call_time_and_leaves_the_old_file(tmp_path):
    # 4 MiB into a 1 MiB file system: torch.save raises ENOSPC itself, as
    # the original does, and the path keeps its old file (no temp file).
    code = """
        import errno, os, torch
        big = {"blob": bytes(4 << 20)}
        torch.save({"small": 1}, "mnt/a.pt")
        for _ in range(2):
            try:
                torch.save(big, "mnt/a.pt")
                raise SystemExit("a save into a full disk did not raise")
            except OSError as e:
                assert e.errno == errno.ENOSPC and e.filename.endswith("mnt/a.pt"), e
                print("save raised:", e)
        assert os.listdir("mnt") == ["a.pt"], os.listdir("mnt")
        assert torch.load("mnt/a.pt") == {"small": 1}
        torch.save({"small": 2}, "mnt/a.pt")
        assert torch.load("mnt/a.pt") == {"small": 2}
        print("ok")
    """
    r = _in_mount_ns(tmp_path, "size=1m", code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("save raised: [Errno 28]") == 2, r.stdout
    assert r.stdout.rstrip().endswith("ok"), r.stdout


def test_hook_a_sync_failure_after_return_is_raised_next_or_exits_non_zero(tmp_path):
    # The file's fsync fails (EIO) after torch.save returned, the file still
    # in place: the next torch.load of the path raises it; one nobody asked
    # about makes the process exit 1, said on stderr.
    code = """
        import errno, os, torch
        from ckpt_sidecar import _atomic_write, _hook
        def eio(fd):
            raise OSError(errno.EIO, "Input/output error")
        _atomic_write.os.fsync = eio   # every fsync of this process: only the hook makes any
        torch.save({"n": 1}, "a.pt")
        _hook.flush()
        try:
            torch.load("a.pt")
            raise SystemExit("the load did not raise")
        except OSError as e:
            assert e.errno == errno.EIO and "not durable" in str(e), e
            print("load raised", flush=True)
        torch.save({"n": 2}, "b.pt")
        print("returned", flush=True)
    """
    r = _run(code, {"CKPT_SIDECAR": "1"}, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "load raised" in r.stdout and "returned" in r.stdout, r.stdout + r.stderr
    assert "no later torch.save or torch.load of it reported it" in r.stderr and "b.pt" in r.stderr, r.stderr
    assert "exiting with status 1" in r.stderr, r.stderr
