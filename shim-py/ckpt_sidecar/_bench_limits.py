"""The machine's limits bench compare sets its figures beside: fio's
sequential O_DIRECT write and read, one memcpy; and the page-cache and
fsync helpers its methods share."""

import ctypes
import json
import os
import shutil
import subprocess
import time

from ._bench_state import log


def drop_cache(path):
    """Drops `path`'s pages (a file, or every file under a folder) from the page cache."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_path(path, is_dir=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if is_dir else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fio(dirpath, size_bytes, rw):
    """Sequential O_DIRECT write or read of size_bytes in dirpath: the best of two
    configurations, in seconds; None (and why, on stderr) when fio is missing or fails."""
    if shutil.which("fio") is None:
        log("fio is not installed: no disk limits (apt-get install -y fio)")
        return None
    f = os.path.join(dirpath, f".bench-compare-fio.{os.getpid()}")
    size_bytes = max(4096, size_bytes // 4096 * 4096)

    def bs(n):
        return f"--bs={max(4096, min(n, size_bytes) // 4096 * 4096)}"

    best = None
    try:
        if rw == "read":
            subprocess.run(
                [
                    "fio",
                    "--name=prep",
                    f"--filename={f}",
                    "--rw=write",
                    bs(4 << 20),
                    f"--size={size_bytes}",
                    "--direct=1",
                    "--ioengine=io_uring",
                    "--iodepth=16",
                ],
                check=True,
                capture_output=True,
            )
        for opts in ([bs(4 << 20), "--iodepth=16"], [bs(1 << 20), "--iodepth=64"]):
            out = subprocess.run(
                [
                    "fio",
                    "--name=limit",
                    f"--filename={f}",
                    f"--rw={rw}",
                    f"--size={size_bytes}",
                    "--direct=1",
                    "--ioengine=io_uring",
                    "--end_fsync=1",
                    "--output-format=json",
                ]
                + opts,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            bw = json.loads(out[out.index("{") :])["jobs"][0][rw]["bw_bytes"]
            if bw and (best is None or bw > best):
                best = bw
    except (subprocess.CalledProcessError, ValueError, KeyError) as e:
        detail = getattr(e, "stderr", None) or getattr(e, "stdout", None) or ""
        log(f"fio {rw} failed in {dirpath}: {e} {str(detail).strip()[-300:]}")
    finally:
        if os.path.exists(f):
            os.unlink(f)
    return size_bytes / best if best else None


def memcpy_s(state, dst):
    t0 = time.perf_counter()
    for k, t in state.items():
        ctypes.memmove(dst[k].data_ptr(), t.data_ptr(), t.numel() * t.element_size())
    return time.perf_counter() - t0
