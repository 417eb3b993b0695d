"""Files this process writes itself, atomically: the bytes in an unnamed file
of the directory (O_TMPFILE; a named temp file .NAME.ckpt-tmp-PID-HEX where
the file system has none), flock'ed while it exists, linked under a temp name
and renamed over the path (`place`), then synced (`sync_placed`). Temp files
a killed process left are removed by `sweep_strays` (no live pid, no lock)."""

import ctypes
import errno
import fcntl
import os
import re
import stat

WRITEBACK_STEP_BYTES = 64 << 20  # how much a Writeback file writes before it starts the disk on it
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h
_sync_file_range = None  # libc's, looked up once (False: none here)


class Placed:
    """A file this process wrote and renamed into place: its open descriptor
    and its directory's, for the writer thread's fsyncs (sync_placed), and
    the (device, inode) it has, to tell whether `path` still names it."""

    __slots__ = ("fd", "dir_fd", "ident")

    def __init__(self, fd, dir_fd, ident):
        self.fd, self.dir_fd, self.ident = fd, dir_fd, ident

    def close(self):
        for fd in (self.fd, self.dir_fd):
            try:
                os.close(fd)
            except OSError:
                pass


TMP_MARKER = ".ckpt-tmp-"  # the hook's temp names: .NAME.ckpt-tmp-PID-HEX
_TMP_NAME = re.compile(r"\.(.+)\.ckpt-tmp-([0-9]+)-([0-9a-f]{16})")


def _temp_name(path):
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}{TMP_MARKER}{os.getpid()}-{os.urandom(8).hex()}")


def _write_all(fd, data):
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def _writeback_fn():
    global _sync_file_range
    if _sync_file_range is None:
        try:
            f = ctypes.CDLL(None, use_errno=True).sync_file_range
            f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sync_file_range = f
        except (OSError, AttributeError):
            _sync_file_range = False
    return _sync_file_range


class Writeback:
    """The file object a hooked torch.save writes into: a buffered file over
    `fd` (whole writes: torch's writer ignores short ones) that starts the
    disk's writeback of every WRITEBACK_STEP_BYTES as soon as they are
    written (sync_file_range WRITE: it queues the pages, it does not wait
    for them), so the fsync after the return finds little left to write:
    durable comes about when the return does, not one more pass later."""

    def __init__(self, fd):
        self._fd = fd
        self._f = os.fdopen(fd, "wb", closefd=False)
        self._kick = _writeback_fn()
        self._written = self._started = 0

    def write(self, b):
        view = memoryview(b).cast("B")
        n = len(view)
        for at in range(0, n, WRITEBACK_STEP_BYTES):
            self._f.write(view[at : at + WRITEBACK_STEP_BYTES])
            self._written += min(WRITEBACK_STEP_BYTES, n - at)
            if self._kick and self._written - self._started >= WRITEBACK_STEP_BYTES:
                self._f.flush()
                self._kick(self._fd, self._started, self._written - self._started, _SYNC_FILE_RANGE_WRITE)
                self._started = self._written
        return n

    def flush(self):
        self._f.flush()

    def close(self):
        self._f.close()  # the descriptor stays open (closefd=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def writing_bytes(data):
    """A `fill` for place that writes `data` (bytes-like) into the file."""

    def fill(fd, _name):
        _write_all(fd, data)

    return fill


def place(path, fill, by_name=False):
    """Writes the file `path` now, as plain torch.save leaves it when it
    returns (in the page cache, under its name), atomically (the path names
    the old file or the new one, whole): `fill(fd, name)` writes the bytes,
    into the descriptor `fd` or the file `name` names (the same file), of
    an unnamed file of the directory (O_TMPFILE; a named temp file
    .NAME.ckpt-tmp-PID-HEX where the file system has none), which is then
    linked under a temp name and renamed over `path`. The temp file is
    flock'ed while it exists, so that sweep_strays (of any process, in any
    pid namespace) knows it is not a dead process's. Returns the Placed
    file, not yet synced (sync_placed): nothing later touches the name
    `path` again. A failure removes the temp file and raises. `by_name`:
    always a named temp file, for a `fill` that writes only by name and may
    replace the file under that name (safetensors' own temp and rename)."""
    d = os.path.dirname(path) or "."
    fd = named = dfd = None
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        flag = getattr(os, "O_TMPFILE", 0)
        if flag and not by_name:
            try:
                fd = os.open(d, flag | os.O_RDWR | os.O_CLOEXEC, 0o666)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
        if fd is None:
            named = _temp_name(path)
            fd = os.open(named, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        fill(fd, named or f"/proc/self/fd/{fd}")
        if by_name:
            # The file under the name now (`fill` may have replaced ours),
            # locked as ours was, is the one renamed into place and synced.
            new = os.open(named, os.O_RDONLY | os.O_CLOEXEC)
            os.close(fd)
            fd = new
            fcntl.flock(fd, fcntl.LOCK_EX)
        if named is None:
            tmp = _temp_name(path)
            # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N: no privilege
            # needed (os.link calls linkat, not link, given a dir fd).
            os.link(f"/proc/self/fd/{fd}", os.path.basename(tmp), dst_dir_fd=dfd, follow_symlinks=True)
            named = tmp
        st = os.fstat(fd)
        os.replace(named, path)
    except BaseException:
        if named is not None and fd is not None:
            try:
                os.unlink(named)
            except OSError:
                pass
        for f in (fd, dfd):
            if f is not None:
                os.close(f)
        raise
    return Placed(fd, dfd, (st.st_dev, st.st_ino))


def names_it(path, placed):
    """Whether `path` still names the file `place` put there (not replaced,
    renamed away, or removed with its directory since)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == placed.ident


def sync_placed(placed, path):
    """Makes a file `place` put at `path` durable: its fsync, then its
    directory's (both through the descriptors kept: the names may have
    changed since), then both closed. Returns False when there was nothing
    to make durable: the script replaced or removed the file (or its
    directory) since; a failure then is no loss either, so none is raised."""
    try:
        if not names_it(path, placed):
            return False
        try:
            os.fsync(placed.fd)
            os.fsync(placed.dir_fd)
        except OSError:
            if not names_it(path, placed):
                return False
            raise
        return True
    finally:
        placed.close()


def write_atomic(path, data):
    """`path` written with `data` and durable (place, then sync_placed)."""
    sync_placed(place(path, writing_bytes(data)), path)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError) as e:
        return isinstance(e, PermissionError)  # someone else's; a number no pid can be: dead
    return True


def sweep_strays(d):
    """Removes from directory `d` the temp files (.NAME.ckpt-tmp-PID-HEX) of
    a torch.save through the hook that a dead process left behind (killed
    between creating and renaming it): ours (our uid), of a pid that is not
    alive here, and not flock'ed by anyone (a process of another pid
    namespace holds its lock while the file exists). Returns their names."""
    try:
        names = os.listdir(d)
    except OSError:
        return []
    gone = []
    for name in names:
        m = _TMP_NAME.fullmatch(name)
        if m is None:
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        p = os.path.join(d, name)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its writer is alive
            try:
                if os.stat(p, follow_symlinks=False).st_ino != st.st_ino:
                    continue  # renamed away and replaced meanwhile
                os.unlink(p)
                gone.append(name)
            except OSError:
                pass
        finally:
            os.close(fd)
    return gone
