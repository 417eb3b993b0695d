"""Helpers of the lifecycle tests: locks, descriptors, processes, waiting."""

import os
import time


def lock_is_free(ckdir):
    """Whether nobody holds the spawn lock of `ckdir` (this process neither)."""
    import fcntl

    fd = os.open(
        os.path.join(ckdir, ".ckpt-sidecar-py.lock"),
        os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
        0o600,
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def open_fds_to(path):
    """This process's descriptors open on `path`."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                out.append(int(fd))
        except OSError:
            pass
    return out


def gone(pid):
    """The process exited (or is a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def wait_until(cond, timeout, what):
    """Polls `cond` until true; fails after `timeout` seconds saying `what`
    (a string, or a callable giving it at the time of the failure)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not within {timeout:.1f} s: {what() if callable(what) else what}"
            )
        time.sleep(0.02)


def run_sigkilled_trainer(code, tmp_path, env_extra):
    """Runs `code` (which prints its pid, its sidecar's pid and its janitor's,
    then SIGKILLs itself) with a private $TMPDIR; returns (tmpdir, pids,
    the time it was seen dead)."""
    import subprocess
    import sys
    import tempfile

    tmpdir = tempfile.mkdtemp(prefix="ck")  # short: socket paths live there
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    env.update(
        TMPDIR=tmpdir, CKPT_SIDECAR_SOCKET=str(tmp_path / "nobody.sock"), **env_extra
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    dead = time.monotonic()
    assert r.returncode == -9, r.stdout + r.stderr
    return tmpdir, [int(x) for x in r.stdout.split()[:3]], dead


def assert_nothing_left(tmpdir, pids, dead, bar_s=10.0):
    """The bar: within `bar_s` of the trainer's death its sidecar has drained
    and exited, its private $TMPDIR is empty, no shm segment of its pid is
    left, and the janitor is gone too."""
    trainer, sidecar, janitor = pids

    def segs():
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"ckpt-{trainer}-")]

    def left():
        return bar_s - (time.monotonic() - dead)

    try:
        wait_until(lambda: gone(sidecar), left(), "the sidecar exits")
        wait_until(
            lambda: os.listdir(tmpdir) == [],
            left(),
            lambda: f"{tmpdir} is empty: {os.listdir(tmpdir)}",
        )
        wait_until(
            lambda: segs() == [],
            left(),
            lambda: f"the trainer's shm segments are removed: {segs()}",
        )
        wait_until(lambda: gone(janitor), left(), "the janitor exits")
    finally:
        import shutil

        shutil.rmtree(tmpdir, ignore_errors=True)


# A trainer script's fake-CUDA start, said once: the fake driver loaded, this
# process's primary context current, a stream. cuInit reads this process's
# copy delay (FAKE_CUDA_COPY_DELAY_US, as the test set it); the delay set after
# it is the one the sidecar the script spawns inherits.
FAKE_CUDA_CONTEXT = """\
def fake_cuda_context(sidecar_copy_delay_us):
    cu = ctypes.CDLL("libcuda.so.1")
    def ok(r, what):
        if r != 0:
            raise SystemExit(f"{what}: CUDA error {r}")
    ok(cu.cuInit(0), "cuInit")
    os.environ["FAKE_CUDA_COPY_DELAY_US"] = str(sidecar_copy_delay_us)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    stream = ctypes.c_void_p()
    ok(cu.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    return cu, ok, dev, ctx, stream
class DeviceArray:
    # What CuPy or Numba would hand over: device memory by address.
    def __init__(self, ptr, shape, typestr, stream=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": None, "version": 3, "stream": stream}
def sidecar_stat(stats, key):
    # The fake's counter `key` of the spawned sidecar (the only other process
    # writing into the stats folder FAKE_CUDA_STATS_DIR), or None.
    for f in os.listdir(stats):
        if f != str(os.getpid()) and not f.endswith(".tmp"):
            for line in open(os.path.join(stats, f)):
                k, v = line.split()
                if k == key:
                    return int(v)
    return None
"""


def fake_cuda_script(text):
    """A trainer script (indented source, dedented here) whose line
    `{FAKE_CUDA_CONTEXT}` becomes the definitions of fake_cuda_context,
    DeviceArray and sidecar_stat."""
    import textwrap

    return textwrap.dedent(text).replace("{FAKE_CUDA_CONTEXT}\n", FAKE_CUDA_CONTEXT)


def largest_shard(step_dir):
    """The largest shard file of a committed step's folder."""
    return max(step_dir.glob("*.safetensors"), key=lambda p: p.stat().st_size)
