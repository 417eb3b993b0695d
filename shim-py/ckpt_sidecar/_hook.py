"""The torch.save import hook, active only with CKPT_SIDECAR=1.

ckpt_sidecar_hook.pth (installed into site-packages) calls install() at
interpreter start when the variable is "1"; otherwise it evaluates one
comparison and imports nothing. install() has torch.save and torch.load
replaced once torch is imported (_import_finder), safetensors' save_file
too (_hook_safetensors). This module holds the replacement (`patch`), the
CUDA way of a file (a skip_data pass whose CUDA storages the sidecar copies
from the device, no host copy) and the functions callers ask (flush,
counts, cuda_counts, wait_sidecar, durable). A host file is serialised
straight into an unnamed file of its directory and renamed over the path
before torch.save returns (_atomic_write), then synced by _file_queue's
thread; a CUDA-way file is written and placed by the sidecar before
torch.save returns. What the hook promises (which sidecar, ordering,
durability, errors, when the CUDA way is taken) is written down in
docs/python.md, "The torch.save import hook".
"""

from __future__ import annotations

import collections
import os
import pickle
import sys
from typing import Any

from ._file_queue import files as _files
from ._file_queue import save_host
from ._import_finder import mark_hooked, patch_when_imported
from ._paths import atomic_write_possible, is_path, target
from ._shm_file import PiecedFile
from .errors import SidecarError

ENV = "CKPT_SIDECAR"
_installed = False


def install() -> None:
    """Arrange that torch.save/torch.load go through the hook (now if torch is
    already imported, else when it is)."""
    global _installed
    if _installed:
        return
    _installed = True
    patch_when_imported("torch", patch)
    from . import _hook_safetensors  # safetensors.torch.save_file through the same path

    _hook_safetensors.install()


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


def _submit_cuda(torch, path, obj, orig_save, kwargs):
    """The CUDA way (see the module's doc): True once the sidecar reports
    the file durable (it copied the CUDA storages from the device, wrote
    the file and renamed it into place); False when the caller is to take
    the host way (nothing sent, or the sidecar failed: the host way's file
    replaces whatever it placed)."""
    if _files.cuda_mode() != "device" or not _cuda_possible(torch):
        return False
    if getattr(getattr(torch, "serialization", None), "skip_data", None) is None or not kwargs.get(
        "_use_new_zipfile_serialization", True
    ):
        return False
    if not _may_hold_cuda(obj, torch):
        return False  # no CUDA storage: the host way, without a skip_data pass first
    ck = _files.connect_running()
    if ck is None or _files.pool is None:
        return False  # no sidecar yet: the host way starts one and writes this file here
    try:
        f = PiecedFile(_files.pool, 1 << 20)
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
                _files.say_once(("cuda-layout", e.args[0]), f"torch.save to {path} takes the host way: {e}")
            return False
        except Exception as e:  # noqa: BLE001 - skip_data refuses some objects: the original then runs
            _files.say_once(
                ("cuda-skip", type(e)),
                f"torch.save to {path} takes the host way: torch.serialization.skip_data() refused it ({e})",
            )
            return False
        config = getattr(getattr(torch.utils, "serialization", None), "config", None)
        torch_zip = bool(getattr(getattr(config, "save", None), "compute_crc32", True))
        return _files.send_pieces(ck, path, pieces, stream, torch_zip)
    finally:
        f.release()  # the file is written (or the host way runs)


def flush(timeout: float | None = None) -> bool:
    """Wait until every file saved through the hook is durable (its fsync and
    its directory's done, or the script replaced or removed it); True if so."""
    return _files.wait(None, timeout)


def counts() -> dict[str, int]:
    """How many hooked files the sidecar wrote (the CUDA way), this process
    wrote, and were replaced or removed by the script before their sync."""
    return _files.counted()


def cuda_counts() -> dict[str, int]:
    """How many hooked torch.save files went the CUDA way (the sidecar copied
    their CUDA storages from the device and wrote them), and fell back to
    the host way because the sidecar refused or failed them."""
    return _files.cuda_counted()


def wait_sidecar(timeout: float | None = None) -> bool:
    """Until the sidecar spawned at the first torch.save of a process that may
    hold CUDA tensors answers (or failed to start); whether the CUDA way now
    has a sidecar."""
    return _files.wait_sidecar(timeout)


def durable(path: str | os.PathLike[str]) -> bool:
    """Whether no write of `path` is pending."""
    return not _files.pending(target(path))


def patch(torch: Any) -> None:
    """Replace torch.save / torch.load by the hook's (idempotent)."""
    if getattr(torch.save, "_ckpt_sidecar_hook", False):
        return
    orig_save, orig_load = torch.save, torch.load

    def save(obj, f, *args, **kwargs):
        if not is_path(f):
            return orig_save(obj, f, *args, **kwargs)
        if os.fsdecode(os.fspath(f)).endswith(os.sep):
            # Not a file name ("d.pt/"): the original refuses it, in its words.
            return orig_save(obj, f, *args, **kwargs)
        path = target(f)
        _files.raise_error(path)
        if not atomic_write_possible(path):
            # What cannot be written now fails now, as the original's own
            # error: the original does it (after this path's pending writes,
            # so that files still land in save order).
            _files.wait(path)
            return orig_save(obj, f, *args, **kwargs)
        _files.sweep_once(os.path.dirname(path))
        if not args and _submit_cuda(torch, path, obj, orig_save, kwargs):
            return
        n = save_host(orig_save, obj, path, *args, **kwargs)
        if _files.cuda_mode() == "device" and _cuda_possible(torch):
            _files.start_sidecar(n)  # for the CUDA way of the files after this one

    def load(f, *args, **kwargs):
        if is_path(f):
            _files.settle(target(f))  # an earlier sync's failure, if any
        return orig_load(f, *args, **kwargs)

    mark_hooked((save, orig_save), (load, orig_load))
    torch.save, torch.load = save, load
    torch._ckpt_sidecar_flush = flush
