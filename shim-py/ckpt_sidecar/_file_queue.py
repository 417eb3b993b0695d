"""The files the hooks were asked to save (torch.save, safetensors'
save_file, Lightning's save_checkpoint): each is written and renamed into
place by the caller, before its save returns, and made durable afterwards
by one daemon thread of this process.

`files` is the one queue of this process. A save writes its file into an
unnamed file of the target's directory and renames it over the path
(_atomic_write.place): when the save returns, the path names the complete
new file for every reader, and nothing this package does later touches the
name again. The thread then fsyncs the file and its directory through the
descriptors kept; a file the script replaced or removed meanwhile (its
path no longer names it) is not synced and is no loss. A sync that failed
for a file still in place is raised by the next save or load of the path,
or at exit (EXIT_STATUS). The CUDA way (_hook) has the sidecar write the
file, and returns once the sidecar reports it durable.
The whole contract: docs/python.md, "The torch.save import hook".
"""

import atexit
import errno
import os
import queue
import sys
import threading

from . import _units
from ._atomic_write import Writeback, place, sweep_strays, sync_placed
from ._shm_file import ShmPool
from .errors import SidecarError


class _Files:
    """The files the hooks saved: placed by the caller, synced by one daemon
    thread in save order. Pending (not yet durable) paths are waitable."""

    def __init__(self):
        self._q = queue.Queue()
        self._mu = threading.Condition()
        self._pending = {}  # path -> count of its files not yet durable
        self.errors = {}  # path -> the last sync's exception
        self._thread = None
        self._ck = None
        self.pool = None
        self._no_sidecar = None  # why the sidecar is not used, once it failed to start
        self._spawner = None  # the thread starting a sidecar, while and after it does
        self._swept = set()  # directories whose stray temp files were looked for
        self._said = set()
        # Files the sidecar wrote (the CUDA way), this process wrote, and that
        # the script replaced or removed before their sync (not synced: no loss).
        self.counts = {"sidecar": 0, "in_process": 0, "superseded": 0}
        # Files that went the CUDA way (the sidecar copied their CUDA storages
        # and reported them durable), and that fell back to the host way.
        self.cuda = {"device": 0, "fell_back": 0}
        self._cuda_mode = None
        self._connect_tried = False

    def say_once(self, key, msg):
        if key not in self._said:
            self._said.add(key)
            print(f"ckpt_sidecar: {msg}", file=sys.stderr)

    def start_sidecar(self, nbytes):
        """The Checkpointer the CUDA way goes through, or None. The first
        time (a file of `nbytes` was just saved the host way, in a process
        that may hold CUDA tensors): a running sidecar is connected, or one
        is spawned on a thread of its own, for the files after this one."""
        if self._ck is not None or self._no_sidecar is not None or self._spawner is not None:
            return self._ck
        try:
            from .checkpointer import Checkpointer
            from .errors import ConnectFailed

            # Registered after the Checkpointer module's own atexit (which
            # closes it), so it runs first: files finish, then the sidecar stops.
            atexit.register(self._close)
            try:
                self._use(Checkpointer(spawn=False))
            except ConnectFailed:
                # Its unused checkpoint folder: $CKPT_SIDECAR_DIR, else one inside
                # the Checkpointer's private temp folder (removed with it, by its
                # janitor too when this process is killed).
                d = os.environ.get("CKPT_SIDECAR_DIR") or None
                staging = _units.env_size("CKPT_SIDECAR_STAGING", os.environ) or max(256 << 20, 2 * nbytes)
                self._spawner = threading.Thread(
                    target=self._spawn, args=(Checkpointer, d, staging), name="ckpt-sidecar-spawn", daemon=True
                )
                self._spawner.start()
        except Exception as e:  # noqa: BLE001 - any failure means: write here
            self._give_up(e)
        return self._ck

    def connect_running(self):
        """The Checkpointer of a sidecar already running, connected at the
        first file that goes the CUDA way (tried once); None otherwise:
        spawning one is left to the host way, which knows the file's size."""
        if self._ck is not None or self._no_sidecar is not None or self._spawner is not None or self._connect_tried:
            return self._ck
        self._connect_tried = True
        try:
            from .checkpointer import Checkpointer

            ck = Checkpointer(spawn=False)
        except Exception:  # noqa: BLE001 - none running (or unusable): the host way decides
            return None
        atexit.register(self._close)  # as start_sidecar does
        self._use(ck)
        return ck

    def _spawn(self, Checkpointer, d, staging):
        try:
            self._use(Checkpointer(dir=d, staging=staging, _private_dir=d is None))
        except Exception as e:  # noqa: BLE001 - as above
            self._give_up(e)

    def _use(self, ck):
        self.pool = ShmPool(ck)
        self._ck = ck

    def _give_up(self, e):
        self._no_sidecar = str(e)
        self.say_once("spawn", f"no sidecar for torch.save ({e}); this process writes the files itself")

    def wait_sidecar(self, timeout=None):
        """Until a sidecar being spawned answers (or failed to start); whether
        files now go to a sidecar."""
        if self._spawner is not None:
            self._spawner.join(timeout)
        return self._ck is not None

    def _close(self):
        # A sidecar still starting is waited for, so that it is stopped and
        # its folder removed here (it would create the folder again after).
        self.wait_sidecar()
        self.wait(None)
        if self._ck is not None:
            self._ck.close()

    def sweep_once(self, d):
        """The first time this process saves into directory `d`: the temp
        files dead processes left there are removed (sweep_strays)."""
        with self._mu:
            if d in self._swept:
                return
            self._swept.add(d)
        gone = sweep_strays(d)
        if gone:
            print(
                f"ckpt_sidecar: removed {len(gone)} temp file(s) that a killed process left in {d}: "
                f"{', '.join(sorted(gone))}",
                file=sys.stderr,
            )

    def write_here(self, path, fill, by_name=False):
        """Writes `path` in this process, now (`fill(fd, name)` writes the
        bytes: see _atomic_write.place): returns once the file is in place
        under its name, as plain torch.save leaves it; its fsync goes to the
        writer thread. Returns the file's size. A failure of the write is
        raised here, as plain torch.save raises it."""
        try:
            placed = place(path, fill, by_name)
        except OSError as e:
            if e.filename is None:  # os.write's: say which file
                raise OSError(e.errno, e.strerror, path) from e
            raise
        n = os.fstat(placed.fd).st_size
        with self._mu:
            self.counts["in_process"] += 1
            self._pending[path] = self._pending.get(path, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-sidecar-torch-save", daemon=True)
                self._thread.start()
            self._q.put((path, placed))
        return n

    def cuda_mode(self):
        """ "device" or "host" ($CKPT_SIDECAR_HOOK_CUDA, read once)."""
        if self._cuda_mode is None:
            self._cuda_mode, complaint = _units.hook_cuda_mode(os.environ)
            if complaint:
                self.say_once("cuda-env", complaint)
        return self._cuda_mode

    def send_pieces(self, ck, path, pieces, stream, torch_zip):
        """The CUDA way's request for `path` (see ck.save_file_pieces): True
        once the sidecar reports the file durable (it renamed it into place
        before that, and touches the name no more); False when it failed
        (said once; the caller, still inside torch.save, takes the host way,
        whose file replaces whatever the sidecar placed)."""
        try:
            handle = ck.save_file_pieces(path, pieces, stream, torch_zip)
            handle.wait_taken()
            handle.wait_durable()
        except SidecarError as e:
            self.say_once(
                ("cuda-refused", type(e)),
                f"the sidecar did not write torch.save to {path} from the "
                f"device ({e}); the original torch.save copies it to the host",
            )
            with self._mu:
                self.cuda["fell_back"] += 1
            return False
        with self._mu:
            self.cuda["device"] += 1
            self.counts["sidecar"] += 1
        return True

    def _run(self):
        while True:
            path, placed = self._q.get()
            try:
                if not sync_placed(placed, path):
                    self._count("superseded")
            except BaseException as e:  # the caller learns it at its next save / load of path, or at exit
                print(f"ckpt_sidecar: torch.save to {path} failed after it returned: {e}", file=sys.stderr)
                with self._mu:
                    self.errors[path] = e
            finally:
                with self._mu:
                    self._pending[path] -= 1
                    if not self._pending[path]:
                        del self._pending[path]
                    self._mu.notify_all()

    def _count(self, what):
        with self._mu:
            self.counts[what] += 1

    def wait(self, path=None, timeout=None):
        """Until `path`'s files (all files, with None) are durable; True if so."""
        with self._mu:
            return self._mu.wait_for(lambda: not (self._pending.get(path) if path else self._pending), timeout)

    def pending(self, path):
        with self._mu:
            return path in self._pending

    def take_error(self, path):
        """The failure of an earlier write of `path` that nobody was told of
        yet, as the OSError to raise (and forgotten: told once), or None."""
        with self._mu:
            err = self.errors.pop(path, None)
        return None if err is None else _later_error(path, err)

    def raise_error(self, path):
        """Raises the failure of an earlier write of `path` nobody was told of
        yet (take_error), if any."""
        err = self.take_error(path)
        if err is not None:
            raise err

    def settle(self, path):
        """What a read of `path` (torch.load, load_file, a Lightning load)
        does first: raise_error. It need not wait: the file is in place."""
        self.raise_error(path)

    def untold(self):
        """{path: exception} of failed writes nobody was told of."""
        with self._mu:
            return dict(self.errors)

    def counted(self):
        """{"sidecar", "in_process", "superseded"}: how the files were written so far."""
        with self._mu:
            return dict(self.counts)

    def cuda_counted(self):
        """{"device", "fell_back"}: how the CUDA way went so far."""
        with self._mu:
            return dict(self.cuda)


def _later_error(path, err):
    """The OSError a torch.save or torch.load of `path` raises for an earlier
    torch.save of it whose sync failed after it returned (an I/O error): the
    errno of the failure (so the OSError subclass it maps to), `path`, and
    the failure as __cause__."""
    code = getattr(err, "errno", None) or errno.EIO
    why = getattr(err, "strerror", None) or str(err) or type(err).__name__
    e = OSError(
        code, f"an earlier torch.save to this path failed after it returned, the file is not durable: {why}", path
    )
    e.__cause__ = err
    return e


files = _Files()


def save_host(orig_save, obj, path, *args, **kwargs):
    """The host way of a file: `orig_save` (the original torch.save)
    serialises `obj` straight into the unnamed file that is renamed over
    `path` (a _paths.target, checked writable) before this returns, the
    disk's writeback started as it goes (_atomic_write.Writeback); its
    fsync follows on the writer thread. Returns the file's size."""

    def fill(fd, _name):
        with Writeback(fd) as f:
            orig_save(obj, f, *args, **kwargs)

    return files.write_here(path, fill)


EXIT_STATUS = 1  # of a process that ends with a failed torch.save nobody was told of


def _at_exit():
    """Pending files are synced; then a failed sync that no torch.save or
    torch.load of its path reported is said on stderr, and the process exits
    with EXIT_STATUS (os._exit, after flushing stdout and stderr: exit
    handlers registered before this one, i.e. before the hook was installed
    at interpreter start, do not run then)."""
    files.wait(None)
    untold = files.untold()
    if not untold:
        return
    for path, err in untold.items():
        print(
            f"ckpt_sidecar: torch.save to {path} failed after it returned, and no later torch.save or "
            f"torch.load of it reported it: {err}; the file is not durable",
            file=sys.stderr,
        )
    print(
        f"ckpt_sidecar: exiting with status {EXIT_STATUS} ({len(untold)} torch.save file(s) not durable)",
        file=sys.stderr,
    )
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing more to say
            pass
    os._exit(EXIT_STATUS)


# Registered when the module is imported, at interpreter start through the
# .pth (install()), so it runs late at exit: after the handlers of what the
# program imported later (LIFO), among them the hook's own _Files._close and
# the Checkpointer's close.
atexit.register(_at_exit)
