"""The files the hooks were asked to save (torch.save, safetensors'
save_file, Lightning's save_checkpoint), handed to the sidecar or written by
this process, in save order per path.

`files` is the one queue of this process. One daemon thread takes its files
in the order they were saved: for one the sidecar took, it waits until the
sidecar reports it durable (or failed: then it writes the file itself, from
the bytes kept until then); a file the sidecar did not take is written here
before its save returns, and the thread does its fsync. A file superseded by
a newer save of its path is not rewritten; a failure after a save returned
is raised by the next save or load of the path, or at exit (EXIT_STATUS).
The whole contract: docs/python.md, "The torch.save import hook".
"""

import atexit
import errno
import io
import os
import queue
import sys
import threading

from . import _units
from ._atomic_write import Placed, place, sweep_strays, sync_placed, write_atomic
from ._shm_file import ShmFile, ShmPool
from .errors import SidecarError

DEVICE = object()  # a file sent the CUDA way: this process holds no bytes of it


class _Files:
    """The files torch.save asked for: handed to the sidecar, or written here.

    One daemon thread takes the files in the order they were saved: for one
    the sidecar took, it waits until the sidecar reports it durable (or
    failed: then it writes the file itself); for one the sidecar did not
    take, it writes it. Pending paths are waitable."""

    def __init__(self):
        self._q = queue.Queue()
        self._mu = threading.Condition()
        self._pending = {}  # path -> count of writes not yet durable
        self._latest = {}  # path -> sequence number of its newest save
        self._seq = 0
        self.errors = {}  # path -> the last write's exception
        self._thread = None
        self._ck = None
        self.pool = None
        self._sizes = {}  # path -> size of its last file (the next one's size hint)
        self._no_sidecar = None  # why the sidecar is not used, once it failed to start
        self._spawner = None  # the thread starting a sidecar, while and after it does
        self._here = {}  # path -> writes of it this process has to do (waiting or running)
        self._unplaced = {}  # path -> sequence numbers of its files not yet in place (nor given up)
        self._swept = set()  # directories whose stray temp files were looked for
        self._said = set()
        # Files written by the sidecar, by this process, and not rewritten (superseded).
        self.counts = {"sidecar": 0, "in_process": 0, "superseded": 0}
        # Files that went the CUDA way (taken: the sidecar copied their CUDA
        # storages), fell back before Released, were lost after it.
        self.cuda = {"device": 0, "fell_back": 0, "lost": 0}
        self._cuda_mode = None
        self._connect_tried = False

    def say_once(self, key, msg):
        if key not in self._said:
            self._said.add(key)
            print(f"ckpt_sidecar: {msg}", file=sys.stderr)

    def _checkpointer(self, nbytes):
        """The Checkpointer files go through now, or None (this file is then
        written here). At the first file: a running sidecar is connected, or
        one is spawned on a thread of its own (see the module's doc)."""
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
        atexit.register(self._close)  # as _checkpointer does
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

    def open(self, path):
        """A ShmFile to serialise `path`'s next file into, once a sidecar is
        in use (None before the first file, or without a sidecar: the caller
        serialises into memory and submits the bytes)."""
        if self.pool is None:
            return None
        hint = self._sizes.get(path) or max(self._sizes.values(), default=0)
        try:
            return ShmFile(self.pool, hint)
        except SidecarError as e:
            self.say_no_shm(e)
            return None

    def say_no_shm(self, e):
        self.say_once(("alloc", type(e)), f"no shared memory for torch.save ({e}); serialising in private memory")

    def submit(self, path, data):
        """Hands `data` for `path` to the sidecar and returns once it holds it,
        or, when this process is to write it, once the file is in place under
        its name (its fsync follows on the writer thread). `data` is
        bytes-like, or the ShmFile it was serialised into (no copy then)."""
        shm = isinstance(data, ShmFile)
        n = data.len_bytes if shm else len(data)
        self._sizes[path] = n
        ck = self._checkpointer(n)
        # Newest first: an older file of this path that the sidecar gives
        # back from now on is superseded, never written over this one.
        seq = self._begin(path)
        with self._mu:
            # Behind a write of this path here: here too, after it.
            here = ck is None or self._here.get(path, 0) > 0
        handle = None
        if not here and not shm and self.pool is not None:
            # Serialised in private memory (no sidecar yet when it began):
            # into a region of the pool, which the next files reuse.
            try:
                f = ShmFile(self.pool, n)
                f.write(data)
                data, shm = f, True
            except SidecarError:
                pass
        if not here:
            try:
                handle = ck.save_file_at(path, data.region.ptr, n) if shm else ck.save_file(path, data)
                handle.wait_taken()
            except SidecarError as e:
                self.say_once(
                    ("refused", type(e)),
                    f"the sidecar did not take torch.save to {path} ({e}); writing it in this process",
                )
                handle = None
        if handle is None:
            self._write_here(path, seq, data)
        else:
            self._enqueue(path, seq, data, handle)

    def _write_here(self, path, seq, data):
        """Writes `path`'s file `seq` in this process, now: returns once it is
        in place under its name (as plain torch.save leaves it), after every
        older file of the path (at the sidecar, or being written here) is in
        place or given up; its fsync goes to the writer thread. A failure of
        the write is raised here, as plain torch.save raises it."""
        with self._mu:
            self._here[path] = self._here.get(path, 0) + 1
        fd = None
        try:
            with self._mu:
                self._mu.wait_for(lambda: min(self._unplaced[path]) == seq)
                superseded = self._latest[path] != seq  # a newer file of the path was saved meanwhile
            if superseded:
                self._count("superseded")
            else:
                fd = place(path, data.view() if isinstance(data, ShmFile) else data)
                self._count("in_process")
        except BaseException as e:
            self._finish_here(path, seq, data, done=True)
            if isinstance(e, OSError) and e.filename is None:  # os.write's: say which file
                raise OSError(e.errno, e.strerror, path) from e
            raise
        self._finish_here(path, seq, data, done=fd is None)
        if fd is not None:
            self._enqueue(path, seq, Placed(fd), None)

    def _finish_here(self, path, seq, data, done):
        """`path`'s file `seq` is in place here (or not written): its bytes are
        no longer needed, and a newer file of the path may go on; `done`: no
        fsync follows (the file is no longer pending)."""
        if isinstance(data, ShmFile):
            data.release()
        with self._mu:
            self._here[path] -= 1
            if not self._here[path]:
                del self._here[path]
            self._placed(path, seq)
            if done:
                self._done(path)
            self._mu.notify_all()

    def cuda_mode(self):
        """ "device" or "host" ($CKPT_SIDECAR_HOOK_CUDA, read once)."""
        if self._cuda_mode is None:
            self._cuda_mode, complaint = _units.hook_cuda_mode(os.environ)
            if complaint:
                self.say_once("cuda-env", complaint)
        return self._cuda_mode

    def writing_here(self, path):
        """Whether a write of `path` is waiting or running in this process
        (a newer file of the path is then written here too, after it)."""
        with self._mu:
            return bool(self._here.get(path))

    def send_pieces(self, ck, path, pieces, stream, torch_zip):
        """The CUDA way's request for `path` (see ck.save_file_pieces): the
        file's sequence number and its handle once the sidecar holds it
        (Released); None when the sidecar refused before Released (said
        once; nothing was lost: the caller takes the host way)."""
        seq = self._begin(path)
        try:
            handle = ck.save_file_pieces(path, pieces, stream, torch_zip)
            handle.wait_taken()
        except SidecarError as e:
            self.say_once(
                ("cuda-refused", type(e)),
                f"the sidecar did not take torch.save to {path} from the "
                f"device ({e}); the original torch.save copies it to the host",
            )
            with self._mu:
                self.cuda["fell_back"] += 1
                self._placed(path, seq)
                self._done(path)
                self._mu.notify_all()
            return None
        return seq, handle

    def queue_device(self, path, seq, handle, len_bytes):
        """File `seq` of `path`, sent the CUDA way and held by the sidecar:
        the writer thread waits until it is durable (this process holds
        none of its bytes)."""
        self._sizes[path] = len_bytes
        with self._mu:
            self.cuda["device"] += 1
        self._enqueue(path, seq, DEVICE, handle)

    def _begin(self, path):
        """A new file of `path` is pending; its sequence number (the newest:
        an older file of the path the sidecar gives back from now on is
        superseded, never written over this one)."""
        with self._mu:
            self._seq += 1
            seq = self._latest[path] = self._seq
            self._pending[path] = self._pending.get(path, 0) + 1
            self._unplaced.setdefault(path, set()).add(seq)
            return seq

    def _placed(self, path, seq):
        """(Under _mu.) `path`'s file `seq` is in place, or will never be."""
        left = self._unplaced[path]
        left.discard(seq)
        if not left:
            del self._unplaced[path]

    def _done(self, path):
        """(Under _mu.) One file of `path` is no longer pending."""
        self._pending[path] -= 1
        if not self._pending[path]:
            del self._pending[path]

    def _enqueue(self, path, seq, data, handle):
        """To the writer thread: wait for `handle` (None: write `data` here)."""
        with self._mu:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-sidecar-torch-save", daemon=True)
                self._thread.start()
            self._q.put((path, seq, data, handle))

    def _run(self):
        while True:
            path, seq, data, handle = self._q.get()
            if isinstance(data, Placed):  # written here, in place: its fsync
                try:
                    sync_placed(data.fd, path)
                except BaseException as e:  # as below
                    print(f"ckpt_sidecar: torch.save to {path} failed after it returned: {e}", file=sys.stderr)
                    with self._mu:
                        self.errors[path] = e
                finally:
                    with self._mu:
                        self._done(path)
                        self._mu.notify_all()
                continue
            here = False
            try:
                try:
                    handle.wait_durable()
                    self._count("sidecar")
                    continue
                except SidecarError as e:
                    if data is DEVICE:
                        with self._mu:
                            superseded = self._latest[path] != seq
                        if superseded:
                            self._count("superseded")
                            continue
                        with self._mu:
                            self.cuda["lost"] += 1
                        raise OSError(
                            getattr(e, "errno", None) or errno.EIO,
                            f"the sidecar did not finish it after it held its CUDA tensors ({e}); "
                            "this process kept no host copy (CKPT_SIDECAR_HOOK_CUDA=host keeps one)",
                        ) from e
                    self.say_once(
                        ("lost", type(e)), f"the sidecar did not finish {path} ({e}); writing it in this process"
                    )
                with self._mu:
                    superseded = self._latest[path] != seq
                    if not superseded:  # a newer file of the path now waits for this write
                        self._here[path] = self._here.get(path, 0) + 1
                        here = True
                if superseded:
                    self._count("superseded")
                else:
                    write_atomic(path, data.view() if isinstance(data, ShmFile) else data)
                    self._count("in_process")
            except BaseException as e:  # the caller learns it at its next torch.save / torch.load of path, or at exit
                print(f"ckpt_sidecar: torch.save to {path} failed after it returned: {e}", file=sys.stderr)
                with self._mu:
                    self.errors[path] = e
            finally:
                if isinstance(data, ShmFile):
                    data.release()
                with self._mu:
                    if here:
                        self._here[path] -= 1
                        if not self._here[path]:
                            del self._here[path]
                    self._placed(path, seq)
                    self._done(path)
                    self._mu.notify_all()

    def _count(self, what):
        with self._mu:
            self.counts[what] += 1

    def wait(self, path=None, timeout=None):
        """Until `path`'s writes (all writes, with None) are on disk; True if so."""
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
        """Waits for `path`'s pending write, then raise_error: what a read of
        `path` (torch.load, load_file, a Lightning load) does first."""
        self.wait(path)
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
        """{"device", "fell_back", "lost"}: how the CUDA way went so far."""
        with self._mu:
            return dict(self.cuda)


def _later_error(path, err):
    """The OSError a torch.save or torch.load of `path` raises for an earlier
    torch.save of it that failed after it returned (e.g. disk full): the
    errno of the failure (so the OSError subclass it maps to), `path`, and
    the failure as __cause__."""
    code = getattr(err, "errno", None) or errno.EIO
    why = getattr(err, "strerror", None) or str(err) or type(err).__name__
    e = OSError(
        code, f"an earlier torch.save to this path failed after it returned, the file was not written: {why}", path
    )
    e.__cause__ = err
    return e


files = _Files()


def save_host(orig_save, obj, path, *args, **kwargs):
    """The host way of a file: `orig_save` (the original torch.save)
    serialises `obj` into a shared-memory region of the pool (or, before a
    sidecar answers or with /dev/shm full, into private memory), and the
    bytes go to files.submit for `path` (a _paths.target, checked writable)."""
    out = files.open(path)
    if out is None:
        out = io.BytesIO()
        orig_save(obj, out, *args, **kwargs)
        files.submit(path, out.getbuffer())
        return
    try:
        orig_save(obj, out, *args, **kwargs)
    except BaseException:
        out.release()
        if out.no_room is None:
            raise
        # No shared memory for a file this large (/dev/shm full): in
        # private memory, as the first file (nothing is lost).
        files.say_no_shm(out.no_room)
        out = io.BytesIO()
        orig_save(obj, out, *args, **kwargs)
        files.submit(path, out.getbuffer())
        return
    files.submit(path, out)


EXIT_STATUS = 1  # of a process that ends with a failed torch.save nobody was told of


def _at_exit():
    """Pending files finish; then a failed write that no torch.save or
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
            f"torch.load of it reported it: {err}; the file was not written",
            file=sys.stderr,
        )
    print(f"ckpt_sidecar: exiting with status {EXIT_STATUS} ({len(untold)} torch.save file(s) lost)", file=sys.stderr)
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
