"""Which paths a hook takes over: what torch.save and torch.load take as a
path (`is_path`), the file it names (`target`: absolute, symbolic links
resolved), and whether an atomic write of it can work where the original
writer would write (`atomic_write_possible`); where not, the original runs
and raises, or writes, as it always does."""

import errno
import os
import stat


def is_path(f):
    """What torch.save and torch.load take as a path (a str or an
    os.PathLike; bytes they refuse, and so does the original here)."""
    return isinstance(f, (str, os.PathLike))


def target(f):
    """The file a path names: absolute, symbolic links resolved (the original
    torch.save writes through a link; an atomic rename over the link itself
    would replace it)."""
    return os.path.realpath(os.path.abspath(os.fsdecode(os.fspath(f))))


def _tmpfile_probe(d):
    """Whether a file can be created in directory `d` (an unnamed O_TMPFILE
    one, gone at close; a named one, removed at once, where the file system
    lacks O_TMPFILE)."""
    flag = getattr(os, "O_TMPFILE", 0)
    if flag:
        try:
            os.close(os.open(d, flag | os.O_WRONLY | os.O_CLOEXEC, 0o600))
            return True
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                return False
    probe = os.path.join(d, f".ckpt-probe-{os.getpid()}-{os.urandom(6).hex()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except OSError:
        return False
    try:
        os.unlink(probe)
    except OSError:
        pass
    return True


def atomic_write_possible(path):
    """Whether the hook's write of `path` (a new file in its directory, renamed
    over it) can work and matches what the original torch.save would do. Not
    so (the original then runs, and raises what it raises, or writes where an
    atomic write cannot): a directory or a missing parent, a directory or
    file system where no file can be created (permission, read-only, /proc,
    /sys), an existing file the original could not open for writing, and
    anything but a regular file at `path` (a device, a FIFO: the original
    writes into it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError:  # ENOTDIR, EACCES, ELOOP, ...
        return False
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            return False
        eff = os.access in os.supports_effective_ids
        if not os.access(path, os.W_OK, effective_ids=eff):  # permission, read-only, ETXTBSY
            return False
    return _tmpfile_probe(os.path.dirname(path))
