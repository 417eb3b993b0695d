"""The torch.save import hook, active only with CKPT_SIDECAR=1.

ckpt_sidecar_hook.pth (installed into site-packages) calls install() at
interpreter start when the variable is "1"; otherwise it evaluates one
comparison and imports nothing. install() puts a finder first on
sys.meta_path that waits for `import torch`, lets the real loader run, and
then replaces torch.save and torch.load:

- torch.save(obj, path) (the host way) serialises with the original
  torch.save straight into shared memory (a pool of reused regions; the very first file, before
  any sidecar is known, goes through private memory, as does a file for
  which /dev/shm has no room, said once on stderr), hands the bytes to the
  sidecar (protocol SaveFile: copied into its staging) and returns once the
  sidecar holds them (Released). The pool's regions are hand-over regions
  (protocol.md), so once sent the file is written even if this process
  dies, before Released too. The sidecar writes `path` atomically: an
  unnamed temp file in the same directory, synced, renamed over `path`, the
  directory synced. The file is an ordinary torch.save file; its records are
  named `archive/...`, as torch.save names them for a file object (given a
  path, torch names them after the file; torch.load reads both). File
  objects (not paths: a str or an os.PathLike) go to the original
  torch.save, as do paths that name no file ("dir/").
- Errors: torch.save first checks that the file can be written: path
  resolved (symbolic links followed, as the original does), a regular file
  or nothing there, writable if it exists, and a file can be created in its
  directory (an O_TMPFILE probe). Where not (missing or non-directory
  parent, a directory at the path, no permission, read-only file system,
  /proc, /sys, a device or FIFO at the path), the original torch.save runs
  instead and raises its own exception (or, for a device or a file in a
  directory it cannot create files in, writes it as it always does). A
  write this process does inside torch.save raises its OSError there. A
  write that fails after torch.save returned (at the sidecar, or the
  fsync here; disk full) is said on stderr
  at once; the next torch.save or torch.load of that path raises it (an
  OSError with its errno, told once); a process that never asked exits
  with status 1 after saying it (see _at_exit).
- The sidecar is the one at $CKPT_SIDECAR_SOCKET (or the default socket) if
  one runs, else one spawned for this process at the first torch.save, with
  staging $CKPT_SIDECAR_STAGING (default: twice the first file, at least
  256 MiB) and its (unused) checkpoint folder in $CKPT_SIDECAR_DIR or inside
  the Checkpointer's private temp folder. It is spawned in the background: its staging is
  pre-faulted before it answers (seconds per GiB on a VM), which the first
  torch.save does not wait for; files saved until it answers are written
  by this process inside torch.save, as below.
- Nothing is lost when the sidecar cannot do it: if it is not answering
  yet, cannot be started or reached, or refuses a file (e.g. larger than its
  staging), this process writes the file inside torch.save, which returns
  once the file is in place under its name, as the original torch.save
  leaves it (a kill of the process from then on loses nothing): the bytes
  go into an unnamed file of the directory (O_TMPFILE; a temp file
  .NAME.ckpt-tmp-PID-HEX where the file system has none), linked under
  such a temp name and renamed over the path; a failure of that write is
  raised by torch.save. Its fsync and the directory's follow on a
  background thread. If the sidecar dies after it took a file but before
  the file is durable, that thread writes the file the same way from the
  bytes the hook keeps until then (its shared-memory region stays busy
  until the file is durable), and says so on stderr once. A save
  superseded by a newer torch.save of the same path is not rewritten.
  Files of one path land in the order they were saved: a file to be
  written here waits until every older file of its path is in place (or
  given up), and a file whose path still has a write running here is
  written here too, after it. Temp files that a killed process left (its
  pid dead, and no lock on the file, which a writer holds) are removed by
  the first torch.save of a later process into that directory
  (sweep_strays), saying so on stderr.
- CUDA tensors (the CUDA way; $CKPT_SIDECAR_HOOK_CUDA, default "device"):
  when the object holds CUDA storages (only looked for once CUDA is
  initialised in this process, first by a walk of its plain containers and
  tensors, _may_hold_cuda: an object found to hold none goes the host way
  with no further pass; one that holds a CUDA storage or an object the walk
  does not know, a module say, goes on), torch.save runs under
  torch.serialization.skip_data() into shared memory: the file's skeleton,
  with a hole where each storage's bytes go (torch's own persistent_id,
  wrapped through pickle_module, says which storage fills which hole; the
  pickle bytes are the same). CPU storages are copied into their holes; each
  CUDA storage is sent in place, the allocations it lies in registered once
  each (libckpt's range call: a storage across VMM chunks mapped back to
  back, as PyTorch's expandable segments map them, is one span region),
  behind an interprocess event recorded on the device's current stream (the
  one the original torch.save copies on): protocol SaveFilePieces. The
  sidecar's own stream waits on the event, copies the storages into its
  page-locked staging, computes the CRC-32s skip_data left out, and writes
  the very bytes the original torch.save writes into a file object. The
  trainer makes no host copy: torch.save returns at Released, once the
  sidecar's device copy is done (the caller may then change the tensors).
  Durability: before Released, a refusal (e.g. larger than the sidecar's
  staging) or a lost sidecar makes the original torch.save run as above
  (host copy, nothing lost). After Released this process holds no copy of
  the CUDA storages, so a sidecar that dies before the file is durable loses
  it: said on stderr at once, raised by the next torch.save or torch.load of
  the path, and a process that never asked exits with status 1 (as a failed
  write, above). CKPT_SIDECAR_HOOK_CUDA=host keeps the host way for every
  object (the original torch.save copies CUDA tensors to the host in the
  trainer; the file is written here if the sidecar dies). The host way is
  also taken when torch lacks skip_data or refuses it for the object, with
  _use_new_zipfile_serialization=False or positional extra arguments, when
  the CUDA storages lie on several devices or streams, before any sidecar
  answers (the first file of a spawned one), or while a write of the same
  path is pending here. Files of a path whose CRC-32s torch is told not to
  compute (torch.utils.serialization.config.save.compute_crc32) are left
  without them, as torch leaves them.
- torch.load(path) of a path whose write is still pending waits for it.
- At exit, pending writes are finished before the interpreter goes (and a
  sidecar still being spawned is waited for, then stopped); then the exit
  status check above.
"""

import atexit
import collections
import ctypes
import errno
import fcntl
import importlib.abc
import io
import os
import pickle
import queue
import re
import stat
import sys
import threading

from . import _units
from .errors import SidecarError

ENV = "CKPT_SIDECAR"
_installed = False


class _LoaderWrapper(importlib.abc.Loader):
    """Loads a module as its own loader does, then patches it."""

    def __init__(self, inner, patch):
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of whoever finds module `name`,
    so that `patch(module)` runs once the module is imported (torch here,
    safetensors.torch in _hook_safetensors)."""

    def __init__(self, name, patch):
        self._name = name
        self._patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self._name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderWrapper(spec.loader, self._patch)
                return spec
        return None


def mark_hooked(*pairs):
    """Each (hook, original) pair: the hook marked as ours (patch is then
    idempotent), wrapping the original, under its name and doc."""
    for fn, orig in pairs:
        fn._ckpt_sidecar_hook = True
        fn.__wrapped__ = orig
        fn.__doc__ = orig.__doc__
        fn.__name__ = orig.__name__


def patch_when_imported(name, patch):
    """`patch(module)` now if module `name` is imported already, else when it is."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, PatchingFinder(name, patch))


def install():
    """Arrange that torch.save/torch.load go through the hook (now if torch is
    already imported, else when it is)."""
    global _installed
    if _installed:
        return
    _installed = True
    patch_when_imported("torch", patch)
    from . import _hook_safetensors  # safetensors.torch.save_file through the same path

    _hook_safetensors.install()


class _Pool:
    """Shared-memory regions torch.save serialises into, so the bytes reach the
    sidecar with no copy in between; reused (their pages stay warm). A region
    is busy from its torch.save until its file is durable (the fallback write
    reads it); with MAX busy, the next torch.save waits for the oldest."""

    MAX = 2

    def __init__(self, ck):
        self._ck = ck
        self._free = []
        self._count = 0
        self._cv = threading.Condition()

    def _alloc(self, n):
        # A hand-over region: written only to fill a file before it is sent,
        # never again until that file is durable, so the sidecar writes the
        # file even if this process dies before Released (protocol.md).
        with self._ck._mu:  # the Checkpointer's region table
            return self._ck._alloc(max(n + n // 8, 1 << 20), hand_over=True)

    def _drop(self, r):
        with self._ck._mu:
            self._ck._free_region(r)

    def take(self, n):
        with self._cv:
            while True:
                fits = [r for r in self._free if r.len_bytes >= n]
                if fits:
                    r = min(fits, key=lambda r: r.len_bytes)
                    self._free.remove(r)
                    return r
                if self._free:  # too small: replace the smallest by a larger one
                    self._drop(self._free.pop(self._free.index(min(self._free, key=lambda r: r.len_bytes))))
                    self._count -= 1
                if self._count < self.MAX:
                    r = self._alloc(n)
                    self._count += 1
                    return r
                self._cv.wait()

    def give(self, r):
        with self._cv:
            self._free.append(r)
            self._cv.notify_all()

    def grow(self, r, used, n):
        """A region of at least n bytes holding the `used` first bytes of r (dropped)."""
        new = self._alloc(max(n, 2 * r.len_bytes))
        ctypes.memmove(new.ptr, r.ptr, used)
        self._drop(r)
        return new


class _ShmFile:
    """The file-like object torch.save writes into: a region of the pool,
    grown (moved to a larger one) when the bytes outgrow it."""

    def __init__(self, pool, size_hint):
        import numpy  # loaded by the Checkpointer already; not at interpreter start

        self._frombuffer, self._u8 = numpy.frombuffer, numpy.uint8
        self._pool = pool
        self.region = pool.take(size_hint)
        self.len_bytes = 0
        self.no_room = None  # the SidecarError of a region this file outgrew and could not get

    def write(self, b):
        src = self._frombuffer(memoryview(b).cast("B"), dtype=self._u8)
        n = src.nbytes
        if self.len_bytes + n > self.region.len_bytes:
            try:
                self.region = self._pool.grow(self.region, self.len_bytes, self.len_bytes + n)
            except SidecarError as e:  # /dev/shm full: the caller serialises in private memory
                self.no_room = e
                raise
        if n:
            ctypes.memmove(self.region.ptr + self.len_bytes, src.ctypes.data, n)
        self.len_bytes += n
        return n

    def flush(self):
        pass

    def view(self):
        """The bytes written (for this process's own write of the file)."""
        return memoryview((ctypes.c_char * self.len_bytes).from_address(self.region.ptr)).cast("B")

    def release(self):
        if self.region is not None:
            self._pool.give(self.region)
            self.region = None


class _PiecedFile(_ShmFile):
    """What torch.save writes under skip_data, in a region of the pool: the
    bytes it writes (the archive's skeleton), packed, and the holes it seeks
    over (one per storage with bytes, in storage-key order), so each file
    byte is either here or in a storage."""

    def __init__(self, pool, size_hint):
        super().__init__(pool, size_hint)
        self.pos = 0  # the file's length so far
        self.runs = []  # (file offset, region offset, length) of bytes held here
        self.holes = []  # (file offset, length) left for a storage's bytes

    def write(self, b):
        at = self.len_bytes
        n = super().write(b)
        if n:
            if (
                self.runs
                and self.runs[-1][0] + self.runs[-1][2] == self.pos
                and self.runs[-1][1] + self.runs[-1][2] == at
            ):
                f, r, m = self.runs[-1]
                self.runs[-1] = (f, r, m + n)
            else:
                self.runs.append((self.pos, at, n))
            self.pos += n
        return n

    def seek(self, offset, whence=io.SEEK_SET):
        # skip_data's only seek: past a storage's bytes (see torch's
        # write_record_metadata); anything else is not this layout.
        if whence != io.SEEK_CUR or offset < 0:
            raise io.UnsupportedOperation(f"seek({offset}, {whence}) while torch.save wrote under skip_data")
        if offset:
            self.holes.append((self.pos, offset))
            self.pos += offset
        return self.pos

    def tell(self):
        return self.pos

    def fill(self, file_offset, ptr, n):
        """Host bytes for the hole at `file_offset` (a CPU storage's)."""
        at = self.len_bytes
        _ShmFile.write(self, (ctypes.c_ubyte * n).from_address(ptr))
        self.runs.append((file_offset, at, n))


def _device_storage(storage, torch):
    """(device address, nbytes, device index, stream handle) of an untyped
    storage in CUDA memory, else None: the one place the hook asks where a
    storage's bytes are (tests substitute it). The stream is the device's
    current stream, the one the original torch.save copies on."""
    dev = storage.device
    if dev.type != "cuda":
        return None
    return storage.data_ptr(), storage.nbytes(), dev.index, torch.cuda.current_stream(dev).cuda_stream


def _cuda_possible(torch):
    """Whether this process may hold CUDA storages at all: none before CUDA
    is initialised (a cheap check; tests substitute it)."""
    cuda = getattr(torch, "cuda", None)
    return cuda is not None and cuda.is_initialized()


def _host_tensor(t):
    """Whether a torch.Tensor's bytes are in host memory: the one question the
    pre-scan asks of a tensor (tests substitute it, as _device_storage)."""
    return t.is_cpu


_leaves = None  # types holding no storage, and pickled as themselves


def _may_hold_cuda(obj, torch):
    """False when pickling `obj` certainly reaches no storage outside host
    memory, so torch.save of it takes the host way with no skip_data pass;
    True when it holds one, or holds an object whose pickling is not known
    here (a module, a dataclass, a tensor subclass or one with attributes:
    the skip_data pass then decides). Walks the plain containers torch.save
    meets in state dicts (dict, OrderedDict with its attributes such as a
    state dict's _metadata, list, tuple, set), exact torch.Tensor /
    Parameter (which pickle their storage and, when they have any, their
    attributes), scalars, strings, torch dtypes/devices/sizes and numpy
    arrays of plain dtypes; each container once."""
    global _leaves
    if _leaves is None:
        _leaves = frozenset(
            (
                str,
                bytes,
                bytearray,
                int,
                float,
                complex,
                bool,
                type(None),
                torch.dtype,
                torch.device,
                torch.Size,
                torch.layout,
                torch.memory_format,
            )
        )
    leaves = _leaves
    tensors = (torch.Tensor, torch.nn.Parameter)
    mappings = (dict, collections.OrderedDict)
    sequences = (list, tuple, set, frozenset)
    np = sys.modules.get("numpy")  # loaded with torch; not imported here
    seen = set()
    stack = [obj]
    pop, push = stack.pop, stack.extend
    while stack:
        o = pop()
        t = type(o)
        if t in leaves:
            continue
        if t in tensors:
            # Python state (attributes) is pickled with the tensor, as torch's
            # Tensor.__reduce_ex__ finds it (without making a __dict__).
            getstate = getattr(o, "__getstate__", None)
            if not _host_tensor(o) or (getstate() if getstate is not None else o.__dict__):
                return True
            continue
        if t in mappings or t in sequences:
            if id(o) in seen:
                continue
            seen.add(id(o))
            if t in sequences:
                push(o)
            else:
                push(o.keys())
                push(o.values())
                if t is not dict and o.__dict__:  # an OrderedDict's attributes are pickled too
                    push(o.__dict__.values())
            continue
        if np is not None and (t is np.ndarray or isinstance(o, np.generic)) and not o.dtype.hasobject:
            continue
        return True
    return False


class _KeyedPickle:
    """A pickle module for torch.save that records which storage torch gave
    which key (torch's own persistent_id, wrapped: same Pickler, same bytes),
    so each hole of a skip_data archive is matched with its storage."""

    def __init__(self, inner):
        self._inner = inner
        self.storages = {}  # key -> the storage object torch pickled (untyped or typed)
        seen = self.storages

        class Pickler(inner.Pickler):
            def __init__(self, *args, **kwargs):
                theirs = getattr(self, "persistent_id", None)  # torch's, from its subclass
                if theirs is not None:

                    def persistent_id(obj):
                        pid = theirs(obj)
                        if type(pid) is tuple and len(pid) == 5 and pid[0] == "storage":
                            seen.setdefault(pid[2], obj)
                        return pid

                    self.persistent_id = persistent_id
                super().__init__(*args, **kwargs)

        self.Pickler = Pickler

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _NotDevice(Exception):
    """This object does not go the CUDA way (a reason for stderr, or none)."""


def _pieces(f, storages, torch):
    """[(address, nbytes, on_device)] covering the skip_data file `f` from its
    first byte to its last, device index and stream; CPU storages' bytes are
    copied into `f`'s region. _NotDevice when no storage is in CUDA memory,
    or the layout is not the one expected."""
    untyped = [getattr(s, "_untyped_storage", s) for s in storages.values()]
    with_bytes = [u for u in untyped if u.nbytes()]
    if len(with_bytes) != len(f.holes) or any(u.nbytes() != n for u, (_, n) in zip(with_bytes, f.holes)):
        raise _NotDevice(f"torch.save left {len(f.holes)} holes for {len(with_bytes)} storages")
    where = [_device_storage(u, torch) for u in with_bytes]
    found = {(d[2], d[3]) for d in where if d is not None}
    if not found:
        raise _NotDevice(None)  # before copying any CPU storage: the host way copies them anyway
    if len(found) > 1:
        raise _NotDevice(f"its CUDA storages are on {len(found)} devices or streams")
    device = []
    for u, d, (at, n) in zip(with_bytes, where, f.holes):
        if d is None:
            f.fill(at, u.data_ptr(), n)
        else:
            device.append((at, d[0], n))
    base = f.region.ptr
    out = sorted([(at, base + r, n, False) for at, r, n in f.runs] + [(at, p, n, True) for at, p, n in device])
    end = 0
    for at, _, n, _ in out:
        if at != end:
            raise _NotDevice(f"the pieces do not tile the file (a gap or overlap at byte {at})")
        end += n
    if end != f.pos:
        raise _NotDevice(f"the pieces end at byte {end}, the file at {f.pos}")
    dev, stream = found.pop()
    return [(p, n, on_dev) for _, p, n, on_dev in out], dev, stream


_DEVICE = object()  # a file sent the CUDA way: this process holds no bytes of it


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

    def _say_once(self, key, msg):
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

    def _connect_running(self):
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
        self.pool = _Pool(ck)
        self._ck = ck

    def _give_up(self, e):
        self._no_sidecar = str(e)
        self._say_once("spawn", f"no sidecar for torch.save ({e}); this process writes the files itself")

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
        """A _ShmFile to serialise `path`'s next file into, once a sidecar is
        in use (None before the first file, or without a sidecar: the caller
        serialises into memory and submits the bytes)."""
        if self.pool is None:
            return None
        hint = self._sizes.get(path) or max(self._sizes.values(), default=0)
        try:
            return _ShmFile(self.pool, hint)
        except SidecarError as e:
            self.say_no_shm(e)
            return None

    def say_no_shm(self, e):
        self._say_once(("alloc", type(e)), f"no shared memory for torch.save ({e}); serialising in private memory")

    def submit(self, path, data):
        """Hands `data` for `path` to the sidecar and returns once it holds it,
        or, when this process is to write it, once the file is in place under
        its name (its fsync follows on the writer thread). `data` is
        bytes-like, or the _ShmFile it was serialised into (no copy then)."""
        shm = isinstance(data, _ShmFile)
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
                f = _ShmFile(self.pool, n)
                f.write(data)
                data, shm = f, True
            except SidecarError:
                pass
        if not here:
            try:
                handle = ck.save_file_at(path, data.region.ptr, n) if shm else ck.save_file(path, data)
                handle.wait_taken()
            except SidecarError as e:
                self._say_once(
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
                fd = place(path, data.view() if isinstance(data, _ShmFile) else data)
                self._count("in_process")
        except BaseException as e:
            self._finish_here(path, seq, data, done=True)
            if isinstance(e, OSError) and e.filename is None:  # os.write's: say which file
                raise OSError(e.errno, e.strerror, path) from e
            raise
        self._finish_here(path, seq, data, done=fd is None)
        if fd is not None:
            self._enqueue(path, seq, _Placed(fd), None)

    def _finish_here(self, path, seq, data, done):
        """`path`'s file `seq` is in place here (or not written): its bytes are
        no longer needed, and a newer file of the path may go on; `done`: no
        fsync follows (the file is no longer pending)."""
        if isinstance(data, _ShmFile):
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
                self._say_once("cuda-env", complaint)
        return self._cuda_mode

    def submit_cuda(self, torch, path, obj, orig_save, kwargs):
        """The CUDA way (see the module's doc): True once the sidecar holds
        the file (Released: it copied the CUDA storages from the device);
        False when the caller is to take the host way (nothing sent, or the
        sidecar refused before Released: nothing lost)."""
        if self.cuda_mode() != "device" or not _cuda_possible(torch):
            return False
        if getattr(getattr(torch, "serialization", None), "skip_data", None) is None or not kwargs.get(
            "_use_new_zipfile_serialization", True
        ):
            return False
        if not _may_hold_cuda(obj, torch):
            return False  # no CUDA storage: the host way, without a skip_data pass first
        ck = self._connect_running()
        if ck is None or self.pool is None:
            return False  # no sidecar yet: the host way starts one and writes this file here
        with self._mu:
            if self._here.get(path):
                return False  # files of a path land in order: behind a write here, here too
        try:
            f = _PiecedFile(self.pool, 1 << 20)
        except SidecarError:
            return False
        try:
            keyed = _KeyedPickle(kwargs.get("pickle_module") or pickle)
            try:
                with torch.serialization.skip_data():
                    orig_save(obj, f, **dict(kwargs, pickle_module=keyed))
                pieces, _, stream = _pieces(f, keyed.storages, torch)
            except _NotDevice as e:
                if e.args[0]:
                    self._say_once(("cuda-layout", e.args[0]), f"torch.save to {path} takes the host way: {e}")
                return False
            except Exception as e:  # noqa: BLE001 - skip_data refuses some objects: the original then runs
                self._say_once(
                    ("cuda-skip", type(e)),
                    f"torch.save to {path} takes the host way: torch.serialization.skip_data() refused it ({e})",
                )
                return False
            config = getattr(getattr(torch.utils, "serialization", None), "config", None)
            torch_zip = bool(getattr(getattr(config, "save", None), "compute_crc32", True))
            seq = self._begin(path)
            try:
                handle = ck.save_file_pieces(path, pieces, stream, torch_zip)
                handle.wait_taken()
            except SidecarError as e:
                self._say_once(
                    ("cuda-refused", type(e)),
                    f"the sidecar did not take torch.save to {path} from the "
                    f"device ({e}); the original torch.save copies it to the host",
                )
                with self._mu:
                    self.cuda["fell_back"] += 1
                    self._placed(path, seq)
                    self._done(path)
                    self._mu.notify_all()
                return False
        finally:
            f.release()  # the sidecar holds its copy (or the host way runs)
        self._sizes[path] = f.pos
        with self._mu:
            self.cuda["device"] += 1
        self._enqueue(path, seq, _DEVICE, handle)
        return True

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
            if isinstance(data, _Placed):  # written here, in place: its fsync
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
                    if data is _DEVICE:
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
                    self._say_once(
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
                    write_atomic(path, data.view() if isinstance(data, _ShmFile) else data)
                    self._count("in_process")
            except BaseException as e:  # the caller learns it at its next torch.save / torch.load of path, or at exit
                print(f"ckpt_sidecar: torch.save to {path} failed after it returned: {e}", file=sys.stderr)
                with self._mu:
                    self.errors[path] = e
            finally:
                if isinstance(data, _ShmFile):
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


_files = _Files()


class _Placed:
    """A file this process wrote and renamed into place: its open descriptor,
    for the writer thread's fsync (sync_placed)."""

    __slots__ = ("fd",)

    def __init__(self, fd):
        self.fd = fd


TMP_MARKER = ".ckpt-tmp-"  # the hook's temp names: .NAME.ckpt-tmp-PID-HEX
_TMP_NAME = re.compile(r"\.(.+)\.ckpt-tmp-([0-9]+)-([0-9a-f]{16})")


def _temp_name(path):
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}{TMP_MARKER}{os.getpid()}-{os.urandom(8).hex()}")


def _write_all(fd, data):
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def place(path, data):
    """Writes `data` as the file `path`, now: as plain torch.save leaves it
    when it returns (in the page cache, under its name), atomically (the
    path names the old file or the new one, whole). The bytes go into an
    unnamed file of the directory (O_TMPFILE; a named temp file
    .NAME.ckpt-tmp-PID-HEX where the file system has none), linked under a
    temp name and renamed over `path`. The temp file is flock'ed while it
    exists, so that sweep_strays (of any process, in any pid namespace)
    knows it is not a dead process's. Returns the file's descriptor, not yet
    synced: sync_placed. A failure removes the temp file and raises."""
    d = os.path.dirname(path) or "."
    fd = named = None
    try:
        flag = getattr(os, "O_TMPFILE", 0)
        if flag:
            try:
                fd = os.open(d, flag | os.O_WRONLY | os.O_CLOEXEC, 0o666)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
        if fd is None:
            named = _temp_name(path)
            fd = os.open(named, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _write_all(fd, data)
        if named is None:
            tmp = _temp_name(path)
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N: no privilege
                # needed (os.link calls linkat, not link, given a dir fd).
                os.link(f"/proc/self/fd/{fd}", os.path.basename(tmp), dst_dir_fd=dfd, follow_symlinks=True)
            finally:
                os.close(dfd)
            named = tmp
        os.replace(named, path)
    except BaseException:
        if named is not None and fd is not None:
            try:
                os.unlink(named)
            except OSError:
                pass
        if fd is not None:
            os.close(fd)
        raise
    return fd


def sync_placed(fd, path):
    """Makes a file `place` put at `path` durable: its fsync (then closed),
    then its directory's."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_atomic(path, data):
    """`path` written with `data` and durable (place, then sync_placed)."""
    sync_placed(place(path, data), path)


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


def save_host(orig_save, obj, path, *args, **kwargs):
    """The host way of a file: `orig_save` (the original torch.save)
    serialises `obj` into a shared-memory region of the pool (or, before a
    sidecar answers or with /dev/shm full, into private memory), and the
    bytes go to _files.submit for `path` (a _target, checked writable)."""
    out = _files.open(path)
    if out is None:
        out = io.BytesIO()
        orig_save(obj, out, *args, **kwargs)
        _files.submit(path, out.getbuffer())
        return
    try:
        orig_save(obj, out, *args, **kwargs)
    except BaseException:
        out.release()
        if out.no_room is None:
            raise
        # No shared memory for a file this large (/dev/shm full): in
        # private memory, as the first file (nothing is lost).
        _files.say_no_shm(out.no_room)
        out = io.BytesIO()
        orig_save(obj, out, *args, **kwargs)
        _files.submit(path, out.getbuffer())
        return
    _files.submit(path, out)


def flush(timeout=None):
    """Wait until every torch.save through the hook is durable; True if so."""
    return _files.wait(None, timeout)


def counts():
    """How many hooked torch.save files the sidecar wrote, this process wrote
    (the sidecar could not), and were superseded before either did."""
    with _files._mu:
        return dict(_files.counts)


def cuda_counts():
    """How many hooked torch.save files went the CUDA way (the sidecar copied
    their CUDA storages from the device), fell back to the host way because
    the sidecar refused before Released, and were lost after Released."""
    with _files._mu:
        return dict(_files.cuda)


def wait_sidecar(timeout=None):
    """Until the sidecar spawned at the first torch.save answers (or failed to
    start); whether files now go through a sidecar."""
    return _files.wait_sidecar(timeout)


def durable(path):
    """Whether no write of `path` is pending."""
    return not _files.pending(_target(path))


def _is_path(f):
    """What torch.save and torch.load take as a path (a str or an
    os.PathLike; bytes they refuse, and so does the original here)."""
    return isinstance(f, (str, os.PathLike))


def _target(f):
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


def _atomic_write_possible(path):
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


def patch(torch):
    """Replace torch.save / torch.load by the hook's (idempotent)."""
    if getattr(torch.save, "_ckpt_sidecar_hook", False):
        return
    orig_save, orig_load = torch.save, torch.load

    def save(obj, f, *args, **kwargs):
        if not _is_path(f):
            return orig_save(obj, f, *args, **kwargs)
        if os.fsdecode(os.fspath(f)).endswith(os.sep):
            # Not a file name ("d.pt/"): the original refuses it, in its words.
            return orig_save(obj, f, *args, **kwargs)
        path = _target(f)
        _files.raise_error(path)
        if not _atomic_write_possible(path):
            # What cannot be written now fails now, as the original's own
            # error: the original does it (after this path's pending writes,
            # so that files still land in save order).
            _files.wait(path)
            return orig_save(obj, f, *args, **kwargs)
        _files.sweep_once(os.path.dirname(path))
        if not args and _files.submit_cuda(torch, path, obj, orig_save, kwargs):
            return
        save_host(orig_save, obj, path, *args, **kwargs)

    def load(f, *args, **kwargs):
        if _is_path(f):
            _files.settle(_target(f))
        return orig_load(f, *args, **kwargs)

    mark_hooked((save, orig_save), (load, orig_load))
    torch.save, torch.load = save, load
    torch._ckpt_sidecar_flush = flush


EXIT_STATUS = 1  # of a process that ends with a failed torch.save nobody was told of


def _at_exit():
    """Pending files finish; then a failed write that no torch.save or
    torch.load of its path reported is said on stderr, and the process exits
    with EXIT_STATUS (os._exit, after flushing stdout and stderr: exit
    handlers registered before this one, i.e. before the hook was installed
    at interpreter start, do not run then)."""
    flush()
    untold = _files.untold()
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
