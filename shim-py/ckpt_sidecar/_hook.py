"""The torch.save import hook, active only with CKPT_SIDECAR=1.

ckpt_sidecar_hook.pth (installed into site-packages) calls install() at
interpreter start when the variable is "1"; otherwise it evaluates one
comparison and imports nothing. install() puts a finder first on
sys.meta_path that waits for `import torch`, lets the real loader run, and
then replaces torch.save and torch.load:

- torch.save(obj, path) serialises with the original torch.save into memory
  (that is the snapshot: the caller may change obj as soon as it returns),
  then a background writer thread writes `path` atomically: a temp file in
  the same directory, fsync, rename, fsync of the directory. The file is an
  ordinary torch.save file. File objects (not paths) go to the original.
- torch.load(path) of a path whose write is still pending waits for it.
- At exit, pending writes are finished before the interpreter goes.

LIMITATION: the write is done by this process's thread, not by the sidecar:
the wire protocol (docs/protocol.md) can only commit step checkpoints into
the sidecar's directory, not write one file at a caller's path. A trainer
killed before the write finishes leaves the previous file (or none), never a
torn one. The protocol extension that would move it into the sidecar is
described in shim-py/README.md.
"""
import atexit
import importlib.abc
import io
import os
import queue
import sys
import threading

ENV = "CKPT_SIDECAR"
_installed = False


class _LoaderWrapper(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        patch(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _TorchFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of whoever finds `torch`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderWrapper(spec.loader)
                return spec
        return None


def install():
    """Arrange that torch.save/torch.load go through the hook (now if torch is
    already imported, else when it is)."""
    global _installed
    if _installed:
        return
    _installed = True
    if "torch" in sys.modules:
        patch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _TorchFinder())


class _Writer:
    """One daemon thread writes queued files in order; pending paths are waitable."""

    def __init__(self):
        self._q = queue.Queue()
        self._mu = threading.Condition()
        self._pending = {}  # path -> count of queued writes
        self.errors = {}     # path -> the last write's exception
        self._thread = None

    def submit(self, path, data):
        with self._mu:
            self._pending[path] = self._pending.get(path, 0) + 1
            self.errors.pop(path, None)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-sidecar-torch-save", daemon=True)
                self._thread.start()
        self._q.put((path, data))

    def _run(self):
        while True:
            path, data = self._q.get()
            try:
                write_atomic(path, data)
            except BaseException as e:  # the caller learns it at torch.load / flush
                print(f"ckpt_sidecar: torch.save to {path} failed: {e}", file=sys.stderr)
                with self._mu:
                    self.errors[path] = e
            finally:
                with self._mu:
                    self._pending[path] -= 1
                    if not self._pending[path]:
                        del self._pending[path]
                    self._mu.notify_all()

    def wait(self, path=None, timeout=None):
        """Until `path`'s writes (all writes, with None) are on disk; True if so."""
        with self._mu:
            return self._mu.wait_for(lambda: not (self._pending.get(path) if path else self._pending), timeout)

    def pending(self, path):
        with self._mu:
            return path in self._pending


_writer = _Writer()


def write_atomic(path, data):
    d = os.path.dirname(path) or "."
    tmp = os.path.join(d, f".{os.path.basename(path)}.ckpt-tmp-{os.getpid()}-{os.urandom(8).hex()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flush(timeout=None):
    """Wait until every torch.save through the hook is durable; True if so."""
    return _writer.wait(None, timeout)


def durable(path):
    """Whether no write of `path` is pending."""
    return not _writer.pending(os.path.abspath(os.fspath(path)))


def _is_path(f):
    return isinstance(f, (str, bytes, os.PathLike))


def patch(torch):
    """Replace torch.save / torch.load by the hook's (idempotent)."""
    if getattr(torch.save, "_ckpt_sidecar_hook", False):
        return
    orig_save, orig_load = torch.save, torch.load

    def save(obj, f, *args, **kwargs):
        if not _is_path(f):
            return orig_save(obj, f, *args, **kwargs)
        path = os.path.abspath(os.fsdecode(os.fspath(f)))
        buf = io.BytesIO()
        orig_save(obj, buf, *args, **kwargs)
        _writer.submit(path, buf.getbuffer())
        return None

    def load(f, *args, **kwargs):
        if _is_path(f):
            path = os.path.abspath(os.fsdecode(os.fspath(f)))
            _writer.wait(path)
            err = _writer.errors.get(path)
            if err is not None:
                raise OSError(f"torch.save to {path} through ckpt_sidecar failed: {err}") from err
        return orig_load(f, *args, **kwargs)

    for fn, orig in ((save, orig_save), (load, orig_load)):
        fn._ckpt_sidecar_hook = True
        fn.__wrapped__ = orig
        fn.__doc__ = orig.__doc__
        fn.__name__ = orig.__name__
    torch.save, torch.load = save, load
    torch._ckpt_sidecar_flush = flush


atexit.register(flush)
