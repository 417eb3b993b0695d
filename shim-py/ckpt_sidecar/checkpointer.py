"""Checkpointer: saves and loads nested state through the sidecar (via libckpt).

Save path: the state is flattened (_tree) into named tensors and a pickled
skeleton (blob "structure.pkl"); tensors that already lie contiguously in one
of this client's shared regions (see `share`) are described in place, all
others are copied into a pooled save region (one per save in flight,
reused once the sidecar has taken that save, so its pages stay warm); then
ckpt_save sends the request and `save` returns a SaveHandle at once. Save
regions are hand-over regions (ckpt_alloc_hand_over): a save that reads only
them (no share()'d tensor) is the sidecar's once sent, and commits even if
this process dies before the sidecar has copied it.
"""

import atexit
import bisect
import ctypes
import errno
import operator
import fcntl
import gc
import mmap
import numbers
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref

import numpy as np

from . import _alias
from . import _cuda
from . import _dirlock
from . import _native as N
from . import _trust
from . import dist
from ._tree import SKELETON_VERSION, Flattener, TensorRef, pickle_skeleton, quick_key, torch_module, unflatten
from ._units import count_arg, cpus_arg, path_arg, size_arg, step_arg, timeout_ms
from .errors import (
    Closed,
    ConnectFailed,
    Damaged,
    Disconnected,
    InvalidArgument,
    NotFound,
    SidecarError,
    Timeout,
    TooLarge,
)

ALIGN_BYTES = 64
STRUCTURE_BLOB = "structure.pkl"
RNG_BLOB = "rng.pkl"
PARTS_BLOB = "parts.pkl"  # read only: older multi-rank checkpoints' map of tensors saved in pieces
LOCK_NAME = ".ckpt-sidecar-py.lock"
SPAWN_TIMEOUT_S = 120.0  # the sidecar pre-faults its staging first (up to ~2 s per GiB)
POOL_REGIONS_MAX = 2  # save regions (busy or free), reused so their pages stay warm
PENDING_PRUNE_AT = 64  # handles remembered before the released or dropped ones are pruned
SAVE_PLANS_MAX = 8  # prepared save requests kept for states saved again (a trainer alternating a few states)
INCREMENTAL_MODES = (None, "digest", "trust-version")  # Checkpointer(incremental=...)
LOAD_REGION_MIN_BYTES = 1 << 20  # the first load region's size before the sidecar says what a checkpoint needs
LOAD_TRIES_MAX = 4  # packed loads asked again because the checkpoint needed a larger region
NOT_PLACED = (1 << 64) - 1  # ckpt_loaded_tensor_offset of a tensor not contiguous in the region

_live = weakref.WeakSet()

# The janitor: a shell (a few hundred KiB, nothing else) spawned beside a
# spawned sidecar. Its stdin is a pipe whose write end only this process and
# the sidecar hold; EOF comes when both have let go of it, however they ended
# (close(), SIGKILL, a crash). It then removes the private folders (socket,
# log, the hook's checkpoint folder) and, if this process is gone, the
# shared-memory segments the C shim names after its pid (a process killed
# with SIGKILL cannot unlink them; the C shim only sweeps them at the next
# process's first allocation). A zombie counts as gone; a live process
# (close() was called) keeps its segments.
JANITOR_SH = r"""
while read -r _; do :; done
p=$1; shift
rm -rf -- "$@"
s=
if [ -r "/proc/$p/stat" ]; then read -r s < "/proc/$p/stat"; s=${s##*") "}; s=${s%% *}; fi
case "$s" in ""|Z|X) rm -f /dev/shm/ckpt-"$p"-* ;; esac
"""
JANITOR_WAIT_S = 5.0  # close() waits this long for it (forked children may still hold the pipe)


class _Owned:
    """What a Checkpointer holds outside Python's heap: the native client, a
    spawned sidecar and its janitor, the directory lock, the private folder,
    the saves the sidecar has not taken yet, and the share()'d tensors.

    It holds no reference to its Checkpointer, so that one can be collected:
    `_release` runs exactly once, from close(), from a constructor that
    failed, or from the garbage collector (weakref.finalize) when the
    Checkpointer is gone without close()."""

    __slots__ = ("pid", "released", "client", "proc", "lock_fd", "tmpdir", "janitor", "life_w", "untaken", "shared")

    def __init__(self):
        self.pid = os.getpid()
        self.released = False
        self.client = self.proc = self.lock_fd = self.tmpdir = self.janitor = self.life_w = None
        self.untaken = set()  # ids of saves not yet taken by the sidecar (a close waits for them)
        self.shared = []  # restore callables of share()'d tensors


def _release(own):
    """close() of everything in `own` (see _Owned): pending saves taken,
    shared tensors back in private memory, the client closed, a spawned
    sidecar stopped (it commits what it took), the lock, the folder and the
    janitor released. Every step runs even if an earlier one raised; the
    first error is raised at the end. Once only: later calls do nothing.

    (Not weakref.finalize's __call__ for close(): once finalize's own exit
    handler has run, which can be before ours, it no longer calls anything.)"""
    if own.released:
        return
    own.released = True
    if os.getpid() != own.pid:
        # A forked child: the client, the sidecar and the lock are the parent's
        # (closing our copies of the pipes would not end the sidecar anyway).
        own.client = own.proc = own.janitor = own.tmpdir = own.lock_fd = own.life_w = None
        own.shared = []
        return
    errors = []

    def step(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - finish releasing first
            errors.append(e)

    client, own.client = own.client, None
    if client is not None:
        for sid in sorted(own.untaken):
            # Taken (or failed): the sidecar then commits it even without us.
            step(N.lib().ckpt_wait, client, sid, N.RELEASED, -1)
        own.untaken.clear()
    shared, own.shared = own.shared, []
    for restore in shared:  # while the regions are still mapped
        step(restore)
    if client is not None:
        step(N.lib().ckpt_close, client)
    proc, own.proc = own.proc, None
    if proc is not None:
        step(_stop_sidecar, proc)
    if own.lock_fd is not None:
        step(os.close, own.lock_fd)
        own.lock_fd = None
    if own.life_w is not None:
        step(os.close, own.life_w)  # the janitor's EOF once the sidecar is gone too
        own.life_w = None
    janitor, own.janitor = own.janitor, None
    if janitor is not None:
        try:
            janitor.wait(JANITOR_WAIT_S)
        except subprocess.TimeoutExpired:
            pass  # a forked child still holds the pipe: the janitor finishes after it
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    if own.tmpdir is not None:
        shutil.rmtree(own.tmpdir, ignore_errors=True)
        own.tmpdir = None
    if errors:
        raise errors[0]


def _stop_sidecar(proc):
    # EOF on its child's stdin: launch's child exits, launch commits what it
    # took and exits; wait for that.
    try:
        proc.stdin.close()
    finally:
        if proc.poll() is None:
            try:
                proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise


def _owned(name):
    return property(lambda self: getattr(self._own, name), lambda self, v: setattr(self._own, name, v))


def _align(n):
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class _LoadRegion:
    """A region that load() reads checkpoints into, and this process's own
    mapping of it (shm_open + mmap): loaded tensors are views of that
    mapping, which stays valid as long as any of them lives, even after
    close() unmapped the client's mapping and removed the name.

    Lifetime: each load takes a lease (a ctypes array over the mapping that
    every view of that load keeps alive); the region is reused by a later
    load only once the lease is gone, i.e. no tensor of that load is alive.
    Until then later loads go to other regions: a loaded tensor is never
    overwritten by the sidecar."""

    __slots__ = ("region", "mm", "lease")

    def __init__(self, region, mm):
        self.region, self.mm, self.lease = region, mm, None

    def free(self):
        return self.lease is None or self.lease() is None


class _Region:
    """Memory from ckpt_alloc: address, length, and a ctypes array over it (a
    writable buffer numpy and torch can view)."""

    __slots__ = ("ptr", "len_bytes", "buf", "busy", "filled", "__weakref__")

    def __init__(self, ptr, len_bytes):
        self.ptr, self.len_bytes = ptr, len_bytes
        self.buf = (ctypes.c_ubyte * max(len_bytes, 1)).from_address(ptr)
        self.busy = None  # the SaveHandle whose copy reads it
        # incremental="trust-version": (plan, {leaf index: stamp}) of the
        # tensors a plan copied here and their stamps then (_trust); None: unknown.
        self.filled = None


def _current_stream():
    """torch's current CUDA stream handle when torch has CUDA initialized, else None."""
    torch = torch_module()
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_stream().cuda_stream
    return None


class SaveHandle:
    """One save in flight.

    Two moments matter and can differ:
    - *released* (wait_released, released): the trainer may change its tensors
      again, and the checkpoint commits even if this process dies from then
      on. For a save whose tensors were all copied into shared memory by
      save() itself (no share()'d tensor), that is when save() returns: the
      copy is the snapshot, and its save region is handed over to the sidecar
      (docs/protocol.md, RegisterRegion `hand_over`), which finishes its own
      copy and commits even if this process is killed right after save().
      When some tensors were sent in place (share()), it is when the sidecar
      has copied them; such a save not yet taken is aborted when the process
      dies (those tensors may be changing).
    - *taken* (wait_taken, taken): the sidecar holds its own copy of every
      tensor (its Released reply); the save's region may then be reused.
    `stall_seconds`: time the trainer was blocked by this save (inside save()
    plus inside wait_released())."""

    def __init__(self, ck, step, save_id, region, stall_s, inplace):
        self._ck, self.step, self.id, self._region = ck, step, save_id, region
        self.stall_seconds = stall_s
        self.copied_bytes = 0
        self.inplace = inplace
        self._taken = False
        self.cuda_stream = None  # the stream a device-only save was fenced on (wait_copy_on_stream)

    def _mark_taken(self):
        self._taken = True
        self._ck._own.untaken.discard(self.id)
        if self._region is not None:
            self._ck._give_back(self._region)
            self._region = None

    def state(self):
        """ "pending" (not taken), "released" (taken), "durable", "replicated" (once
        wait_replicated returned) or "failed", without blocking."""
        st = ctypes.c_int()
        N.check(N.lib().ckpt_poll(self._ck._live_client(), self.id, ctypes.byref(st)))
        if st.value != N.PENDING:
            self._mark_taken()
        return {
            N.PENDING: "pending",
            N.RELEASED: "released",
            N.DURABLE: "durable",
            N.FAILED: "failed",
            N.REPLICATED: "replicated",
        }[st.value]

    def wait_released(self, timeout=None):
        """Block until the trainer may change the saved tensors again, and the
        checkpoint commits even if this process dies (see the class doc: at
        once for a save copied at save()); raises the save's failure if it
        is already known."""
        if not self.inplace or self._taken:
            if self.state() == "failed":
                self._wait(N.RELEASED, 0)
            return self
        t0 = time.perf_counter()
        try:
            self.wait_taken(timeout)
        finally:
            self.stall_seconds += time.perf_counter() - t0
        return self

    def wait_copy_on_stream(self, stream=None, timeout=None):
        """Make CUDA `stream` (a handle; None: the stream this save was fenced
        on) wait until the sidecar has copied this save's device tensors,
        without the CPU waiting for the copy: work queued on it afterwards
        (the optimizer step) runs after the copy. The CPU waits only until
        the sidecar has queued the copy (a message away). A save with host
        tensors in place, or none on a device, is waited for on the CPU
        (wait_released). Returns True when a stream wait was queued."""
        if self.cuda_stream is None or self._taken:
            self.wait_released(timeout)
            return False
        on = ctypes.c_int()
        stream = self.cuda_stream if stream is None else int(stream)
        t0 = time.perf_counter()
        try:
            N.check(
                N.lib().ckpt_stream_wait_copy(
                    self._ck._live_client(), self.id, stream, timeout_ms(timeout), ctypes.byref(on)
                )
            )
        except Timeout:
            raise
        except SidecarError:
            self._mark_taken()
            raise
        finally:
            self.stall_seconds += time.perf_counter() - t0
        return bool(on.value)

    def wait_taken(self, timeout=None):
        """Block until the sidecar holds its own copy (its Released reply)."""
        return self._wait(N.RELEASED, timeout)

    def wait_durable(self, timeout=None):
        """Block until the checkpoint is committed on disk; raises its failure."""
        return self._wait(N.DURABLE, timeout)

    def wait_replicated(self, timeout=None):
        """Block until the checkpoint is *replicated*: durable, then committed on
        the sidecar's drain target (`--drain URL`: its files, then its remote
        index). Raises Timeout when `timeout` (seconds) passes (the upload
        goes on), the save's failure, or NotFound at once, saying why, when
        the sidecar has no drain target or its drain skipped this step (a
        newer one was drained instead, or --drain-every leaves it out)."""
        return self._answered(lambda client: N.lib().ckpt_wait_replicated(client, self.id, timeout_ms(timeout)))

    def _wait(self, what, timeout):
        return self._answered(lambda client: N.lib().ckpt_wait(client, self.id, what, timeout_ms(timeout)))

    def _answered(self, wait):
        """Runs `wait(client)`, a native wait for this save. Any answer but a
        timeout (success or the save's failure) means the sidecar is done
        with our memory for this save."""
        try:
            N.check(wait(self._ck._live_client()))
        except Timeout:
            raise
        except SidecarError:
            self._mark_taken()
            raise
        self._mark_taken()
        return self

    def released(self):
        """Whether the trainer may change the saved tensors (without blocking)."""
        return not self.inplace or self.taken()

    def taken(self):
        return self._taken or self.state() != "pending"

    def done(self):
        """True once the save is durable or failed (wait_durable returns or raises at once)."""
        return self.state() in ("durable", "replicated", "failed")

    def figures(self):
        """{"copy_s", "waited_s", "persist_s"} as the sidecar reported them (None: not yet known)."""
        vals = [ctypes.c_double() for _ in range(3)]
        N.check(N.lib().ckpt_save_figures(self._ck._live_client(), self.id, *(ctypes.byref(v) for v in vals)))
        return {k: (v.value if v.value >= 0 else None) for k, v in zip(("copy_s", "waited_s", "persist_s"), vals)}

    def __repr__(self):
        return f"<SaveHandle step={self.step} id={self.id}>"


class _SavePlan:
    """A save's prepared request: the descriptor array (ckpt_tensor_t[n], with
    the strings and shape arrays it points to), the pickled skeleton, and the
    tensors copied into a save region at each save (their offsets there).
    Kept by the Checkpointer for the next save of the same state."""

    __slots__ = (
        "n",
        "descs",
        "keep",
        "skeleton",
        "copy_bytes",
        "tensor_bytes",
        "inplace",
        "copies",
        "data_view",
        "sig",
        "refs",
        "gen",
        "streams",
        "host_inplace",
        "dev",
        "dead",
        "blobs",
        "leaf_refs",
        "trust_names",
        "__weakref__",
    )

    def __init__(self, plan, copy_bytes, skeleton, streams=()):
        self.n = len(plan)
        self.descs = (N.Tensor * max(self.n, 1))()
        self.keep = []
        self.copies = []  # (descriptor = leaf index, nbytes, offset in the save region, ref, src address or None)
        self.copy_bytes, self.skeleton = copy_bytes, skeleton
        self.streams = list(streams)  # the CUDA stream device tensors in place were written on (at most one)
        self.tensor_bytes = sum(r[2] for r in plan)
        self.leaf_refs = [r[0] for r in plan]
        self.trust_names = None  # _trust.names_of
        self.inplace = False
        self.host_inplace = False  # a host tensor sent in place (the sidecar copies it after the device ones)
        self.dev = []  # (index, ref) of the device tensors sent in place: their streams are asked at each save
        for i, (ref, obj, nbytes, shape, where) in enumerate(plan):
            name, dt = ref.name.encode(), ref.stored.encode()
            shp = (ctypes.c_uint64 * max(len(shape), 1))(*shape)
            self.keep += [name, dt, shp]
            if isinstance(where, int):
                ptr = where
                self.inplace = self.inplace or bool(nbytes)
                if not nbytes:
                    pass
                elif ref.kind == "cuda" or (ref.kind == "torch" and obj.is_cuda):
                    self.dev.append((i, ref))
                else:
                    self.host_inplace = True
            else:
                ptr = 0  # set at each save: the save region may differ
                self.copies.append((i, nbytes, where[1], ref, _flat_address(ref, obj, nbytes)))
            self.descs[i] = N.Tensor(name, dt, shp, len(shape), ptr, nbytes)
        # The descriptors' data fields, as one uint64 array (updated in bulk).
        self.data_view = (
            np.ndarray(
                (self.n,),
                dtype=np.uint64,
                buffer=self.descs,
                offset=N.Tensor.data.offset,
                strides=(ctypes.sizeof(N.Tensor),),
            )
            if self.n
            else None
        )
        self.sig = self.refs = self.gen = None
        self.dead = False
        self.blobs = None  # (the blobs' names and data, their ckpt_blob_t array) of the last save

    def blob_array(self, blobs_py):
        """The ckpt_blob_t array of [(name, bytes)]: the last one again when
        the same names and byte objects come (the structure blob alone, at
        every save of an unchanged state), which the array keeps alive."""
        last = self.blobs
        if (
            last is not None
            and len(last[0]) == len(blobs_py)
            and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(last[0], blobs_py))
        ):
            return last[1]
        keep = []
        arr = (N.Blob * max(len(blobs_py), 1))()
        for i, (bn, data) in enumerate(blobs_py):
            keep += [bn.encode(), data]
            arr[i] = N.Blob(keep[-2], ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p), len(data))
        arr._keep = keep
        self.blobs = (list(blobs_py), arr)
        return arr

    def remember(self, key, gen):
        self.sig, self.gen = key[0], gen
        # The numpy arrays' ids are in sig: they name the same arrays while
        # these live. The first to die marks the plan dead (its callback), so
        # a save checks one flag, not a reference per array.
        me = weakref.ref(self)

        def died(_ref):
            p = me()
            if p is not None:
                p.dead = True

        self.refs = [weakref.ref(o, died) for o in key[1] if type(o) is np.ndarray]

    def alive(self):
        return not self.dead

    def matches(self, key, gen):
        """Whether `key` (quick_key of the state now) is the state this plan was
        made for: same region set, same structure and plain values, tensors at
        the same addresses with the same shapes, and the same numpy arrays
        (alive: their ids are then theirs)."""
        return gen == self.gen and key[0] == self.sig and self.alive()

    def copy_in(self, ck, objs, region, stamps=None):
        """Copies the tensors not sent in place (objs: the state's leaves, in
        plan order) into `region` and points their descriptors there. With
        `stamps` (incremental="trust-version": each leaf's _trust.stamp now),
        a tensor whose slot in `region` was filled by this plan from the same
        stamp is not copied again (its bytes are there), and the region
        remembers what it holds. Returns the bytes copied."""
        memmove, base = ctypes.memmove, region.ptr
        view = self.data_view
        had = region.filled[1] if region.filled is not None and region.filled[0] is self else None
        region.filled = None  # unknown while copying (an exception leaves it so)
        now = {}
        copied = 0
        for i, nbytes, off, ref, src in self.copies:
            dst = base + off
            view[i] = dst
            if not nbytes:
                continue
            if stamps is not None and stamps[i] is not None:
                if had is not None and _trust.same(had.get(i), stamps[i], objs[i]):
                    now[i] = stamps[i]
                    continue
                now[i] = stamps[i]
            copied += nbytes
            if src is not None:
                memmove(dst, src, nbytes)
            else:
                ck._copy_in(ref, objs[i], nbytes, region, off)
        if stamps is not None:
            region.filled = (self, now)
        return copied


def _flat_address(ref, obj, nbytes):
    """The address of `obj`'s bytes when they are exactly what is stored (C
    contiguous, on the CPU, saved as their own dtype or as raw bytes): a
    memmove copies them. None otherwise (a strided copy through numpy/torch)."""
    if not nbytes:
        return 0
    if ref.kind == "np":
        return obj.__array_interface__["data"][0] if obj.flags.c_contiguous else None
    if ref.kind == "cuda":
        return None  # device memory: copied by _copy_in through the driver
    return obj.data_ptr() if obj.device.type == "cpu" and obj.is_contiguous() and not _lazy_view(obj) else None


def _lazy_view(t):
    """A torch tensor whose memory holds other values than it has: a lazy
    conjugate (`z.conj()`) or negative view; its bytes must be resolved by a
    copy, never taken as they lie."""
    return t.is_conj() or t.is_neg()


class Checkpointer:
    """A connection to a sidecar (spawned for this process if none runs).

    dir: checkpoint directory for a spawned sidecar (default "ckpt"). A running
        sidecar keeps its own (ck.dir then names it; a warning when `dir` differs).
        With no sidecar at `socket`, one that `ckpt-sidecar serve` runs for `dir`
        (its directory lock file names its socket) is connected to instead of
        spawning one (which could not take the directory); a directory held by
        another trainer's spawned sidecar is waited for, then named.
    socket: socket path (default: $CKPT_SIDECAR_SOCKET, else the shim's default path).
    spawn: start `ckpt-sidecar serve` for this process when none is reachable: at
        `socket` if given, else at a private path (ck.socket).
    keep, staging: passed to the spawned sidecar (--keep N, --staging SIZE; SIZE an
        int of bytes or a string like "512MiB").
    cpus: CPUs the spawned sidecar's threads run on (--cpus: "1", "2-7" or a list of
        ints); keeps them off a single-threaded trainer's core on a small machine.
    preemption: turn SIGTERM (a scheduler's notice before it kills the job) into
        `preempted()` returning True, instead of ending the process; see preempted().
    incremental: None or "digest" (the default: the sidecar copies every tensor
        and decides what changed itself), or "trust-version" (opt-in): a torch
        tensor that is the same object over the same storage with the same
        `_version` as at this Checkpointer's previous save of the same state is
        sent flagged unchanged, and neither the trainer nor the sidecar copies
        it again (on a GPU: no device-to-host copy). A write that torch's
        version counter does not see (through `.data`, a numpy or DLPack view,
        a raw pointer, a kernel outside torch) is then MISSED: the checkpoint
        keeps the old bytes. See docs/python.md, "Incremental saves".

    Ranks: the rank and world size come from torch.distributed when it is
    initialised, else from RANK / WORLD_SIZE (ck.rank, ck.world_size). With a
    world size above 1, save() takes the state as replicated (every rank holds
    it alike, as under DDP) and each rank sends only its part (dist.partition:
    balanced in bytes); every rank must save the same step, and the sidecar
    commits it once every rank's part is there (then each handle is durable).
    load() gives every rank the whole state, whatever world size wrote it.
    Every rank of a node must reach the same sidecar (`ckpt-sidecar launch --
    torchrun ...`, or CKPT_SIDECAR_SOCKET naming one per node).

    A constructor that raises has released everything it took (lock, folder,
    sidecar); a Checkpointer collected without close() is closed by the
    garbage collector.
    """

    _client = _owned("client")
    _proc = _owned("proc")
    _tmpdir = _owned("tmpdir")
    _lock_fd = _owned("lock_fd")

    def __init__(
        self,
        dir=None,
        socket=None,
        spawn=True,
        keep=None,
        staging=None,
        log=None,
        cpus=None,
        preemption=False,
        incremental=None,
        _private_dir=False,
    ):
        self._own = _Owned()
        # close() and collection both end in _release(own) (once); at exit,
        # _close_all closes what is still open (in atexit order: after the
        # hook's files).
        self._finalizer = weakref.finalize(self, _release, self._own)
        self._finalizer.atexit = False
        # _private_dir (the torch.save hook's): the checkpoint folder goes inside
        # the private temp folder, removed with it.
        self._private_dir = _private_dir
        # Every argument is checked before anything is taken or created, with
        # the command line's meaning (sizes: ckpt_sidecar._units).
        self.dir = os.path.abspath(path_arg("dir", dir) if dir is not None else "ckpt")
        if os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise NotADirectoryError(errno.ENOTDIR, "Checkpointer(dir=...) is not a directory", self.dir)
        keep = None if keep is None else count_arg("keep", keep)
        staging = None if staging is None else size_arg("staging", staging)
        log = None if log is None else os.path.abspath(path_arg("log", log))
        if log is not None and os.path.isdir(log):
            raise IsADirectoryError(errno.EISDIR, "Checkpointer(log=...) is a directory, not a file", log)
        self._keep, self._staging, self._log = keep, staging, log
        self._cpus = None if cpus is None else cpus_arg(cpus)
        if incremental not in INCREMENTAL_MODES:
            raise InvalidArgument(
                f"incremental={incremental!r}: one of {', '.join(map(repr, INCREMENTAL_MODES))}", InvalidArgument.code
            )
        # "trust-version": torch version counters prove tensors unchanged (_trust).
        self._trust = _trust.Tracker() if incremental == "trust-version" else None
        self._regions = []  # every region of this client, sorted by ptr
        self._regions_gen = 0  # bumped when a region comes or goes (a cached save plan is then stale)
        self._save_plans = []  # the last saves' prepared requests, newest last (see _SavePlan)
        self._region_ptrs = []
        self._save_regions = []  # regions for copies at save (at most POOL_REGIONS_MAX)
        self._free = []  # those of them no save in flight uses
        self._load_region = None  # load_tensors' region (copies out of it)
        self._load_pool = []  # load()'s regions (_LoadRegion), reused once their tensors are gone
        self._pending = []  # weakrefs of handles not yet known released
        self._pending_prune_at = PENDING_PRUNE_AT  # dead ones are dropped when it grows past this
        self._last = None
        self._budget = None  # the sidecar's staging budget, once asked (see _check_fits)
        self._mu = threading.RLock()
        self.socket = path_arg("socket", socket) if socket is not None else None
        self._socket_arg = self.socket is not None  # spawn there, not at a private path
        try:
            try:
                self._client = self._connect(self.socket)
                joined = True
            except ConnectFailed as e:
                if not spawn:
                    raise
                ranks = dist.rank_info()
                if ranks.world_size > 1 and not _private_dir:
                    # A sidecar per rank cannot commit one checkpoint of all ranks.
                    raise ConnectFailed(
                        f"rank {ranks.rank} of {ranks.world_size}: no sidecar reachable ({e}); run the job as "
                        f"`ckpt-sidecar launch --dir DIR -- torchrun ...` (one sidecar per node), or start "
                        f"`ckpt-sidecar serve` per node and set CKPT_SIDECAR_SOCKET",
                        ConnectFailed.code,
                    ) from e
                joined = not self._socket_arg and not _private_dir and self._join_serving()
                if not joined:
                    self._spawn()
            if joined:
                self._check_dir(dir)
                given = [
                    f"{k}={v!r}"
                    for k, v in (("keep", keep), ("staging", staging), ("cpus", cpus), ("log", log))
                    if v is not None
                ]
                if given:
                    # They are the options of a sidecar this Checkpointer starts.
                    warnings.warn(
                        f"{', '.join(given)}: ignored, the sidecar at {self.socket or '(default socket)'} "
                        "was already running (they apply to one this Checkpointer spawns)"
                    )
            self.rank, self.world_size, self.local_rank = dist.rank_info()
            if self.world_size > 1:
                N.check(N.lib().ckpt_set_rank(self._client, self.rank, self.world_size))
            if preemption:
                # The C shim's handler (the one preload mode installs): the first
                # SIGTERM only sets the flag ckpt_preempted() reads; a second one
                # gets the previous disposition (by default: the process ends).
                N.check(N.lib().ckpt_install_sigterm_handler())
        except BaseException as e:
            # Nothing stays taken: no lock, no folder, no sidecar, no client.
            self._finalizer.detach()
            try:
                _release(self._own)
            except BaseException as e2:  # noqa: BLE001 - the constructor's error is the one to raise
                warnings.warn(f"releasing a Checkpointer whose constructor failed ({e}): {e2}")
            raise
        _live.add(self)

    def _join_serving(self):
        """Connects to the sidecar `ckpt-sidecar serve` runs for this
        directory, when its lock file names one that answers (a sidecar
        serves one directory: a second one could not take it); True if so."""
        h = _dirlock.holder(self.dir)
        if h is None or h["role"] != "serve" or not h["socket"]:
            return False
        try:
            self._client = self._connect(h["socket"])
        except (ConnectFailed, Disconnected):
            return False  # its holder is gone (the file outlives a killed one): spawn as usual
        self.socket = h["socket"]
        return True

    def _check_dir(self, asked):
        """A running sidecar writes where it was told: say so when that is not `dir`."""
        try:
            st = self.status()
        except SidecarError:
            return
        # Several nodes: the ranks' checkpoints are in the shared directory.
        dirs = [st["shared_dir"]] if st.get("shared_dir") else (st.get("dirs") or [])
        if dirs:
            if asked is not None and os.path.realpath(dirs[0]) != os.path.realpath(self.dir):
                warnings.warn(
                    f"the sidecar at {self.socket or '(default socket)'} writes to {dirs[0]}, "
                    f"not {self.dir}: checkpoints go there"
                )
            self.dir = dirs[0]

    # ---- connection and the spawned sidecar ----

    @staticmethod
    def _connect(path):
        out = ctypes.c_void_p()
        N.check(N.lib().ckpt_connect(path.encode() if path else None, ctypes.byref(out)))
        # A Python trainer never blocks on the sidecar's Released right after
        # save(): copied tensors are released at once, shared ones only at the
        # guarded optimizer step, after forward and backward. So the sidecar
        # may checksum while it copies (one pass over memory fewer).
        try:
            N.check(N.lib().ckpt_set_lazy_release(out, 1))
        except BaseException:
            N.lib().ckpt_close(out)
            raise
        return out

    def _spawn(self):
        if self._private_dir:
            self._make_tmpdir()
            self.dir = os.path.join(self._tmpdir, "ckpt")
        # Another open Checkpointer of this process holds the lock below: waiting
        # for it (as for a draining sidecar) would wait out the whole deadline.
        for other in list(_live):
            if (
                other._proc is not None
                and other._client is not None
                and other._own.pid == os.getpid()
                and os.path.realpath(other.dir) == os.path.realpath(self.dir)
            ):
                raise SidecarError(
                    f"{self.dir} is in use by another Checkpointer of this process, which spawned "
                    "its sidecar; use that one, or close() it first"
                )
        os.makedirs(self.dir, exist_ok=True)
        # One sidecar per directory: the lock is inherited by the sidecar and held
        # until it exits, so a restarted trainer waits for a draining one. A
        # directory where no file can be made (read-only) gets no lock file
        # here: its sidecar serves loads only, without a lock (nothing writes).
        try:
            self._lock_fd = os.open(os.path.join(self.dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
        deadline = time.monotonic() + 120
        while self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                    h = _dirlock.holder(self.dir)
                    who = f": {_dirlock.describe(h)}" if h is not None else ""
                    raise SidecarError(f"{self.dir} is in use by another spawned sidecar{who} ({e})") from e
                time.sleep(0.05)
        if self._tmpdir is None:
            self._make_tmpdir()
        if not self._socket_arg:
            # Private: only this process (and its children, through ck.socket) use it.
            self.socket = os.path.join(self._tmpdir, "sidecar.sock")
        self._start_proc()

    def _make_tmpdir(self):
        """The private folder (socket, log), and the janitor that removes it
        once this process and the sidecar are both gone (see JANITOR_SH)."""
        own = self._own
        own.tmpdir = tempfile.mkdtemp(prefix="ckpt-sidecar-py-")
        r, w = os.pipe()  # both close-on-exec: only the janitor and the sidecar get an end
        try:
            own.janitor = subprocess.Popen(
                ["/bin/sh", "-c", JANITOR_SH, "ckpt-sidecar-janitor", str(os.getpid()), own.tmpdir],
                stdin=r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:
            os.close(w)
            warnings.warn(f"no janitor for {own.tmpdir} ({e}): if this process is killed, the folder stays behind")
        else:
            own.life_w = w
        finally:
            os.close(r)

    def _start_proc(self):
        # `launch` with a child that waits for EOF on a pipe this process holds:
        # when this process ends, however it ends (SIGKILL too), the pipe closes,
        # the child exits, and launch commits the saves it had taken (and those
        # handed over: copied at save() and sent), then exits
        # (freeing the directory lock). close() closes the pipe the same way.
        # (Not PR_SET_PDEATHSIG: with a multi-threaded parent it can fire once per
        # exiting thread, and a second SIGTERM makes the sidecar abort.)
        cmd = [N.sidecar_binary(), "launch", "--dir", self.dir, "--socket", self.socket]
        if self._keep is not None:
            cmd += ["--keep", str(int(self._keep))]
        if self._staging is not None:
            cmd += ["--staging", str(self._staging)]
        if self._cpus is not None:
            cmd += ["--cpus", self._cpus]
        # The child ignores SIGTERM/SIGINT/SIGHUP (ignored dispositions survive
        # exec): launch forwards those to it, so a signal sent to every process
        # of the job (a scheduler's preemption notice) leaves the sidecar
        # serving the trainer's last save; only the pipe's end stops it.
        cmd += ["--", "/bin/sh", "-c", 'trap "" TERM INT HUP; exec cat']
        self.log_path = self._log or os.path.join(self._tmpdir, "sidecar.log")
        # The sidecar holds the lock and the janitor's pipe until it exits.
        keep = tuple(fd for fd in (self._lock_fd, self._own.life_w) if fd is not None)
        with open(self.log_path, "ab") as logf:
            self._log_from = logf.tell()  # a log= file may hold earlier runs
            # Own session: a Ctrl-C at the terminal reaches the trainer, which then stops it in order.
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=logf, stderr=logf, pass_fds=keep, start_new_session=True
            )
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while True:
            if self._proc.poll() is not None:
                raise SidecarError(f"spawned sidecar exited with {self._proc.returncode}: {self._log_tail()}")
            if os.path.exists(self.socket):
                try:
                    client = self._connect(self.socket)
                    break
                except (ConnectFailed, Disconnected):
                    pass
            if time.monotonic() > deadline:
                self._proc.kill()
                self._proc.wait()
                raise SidecarError(f"spawned sidecar did not listen within {SPAWN_TIMEOUT_S} s: {self._log_tail()}")
            time.sleep(0.02)
        if self._client is None:
            self._client = client
        else:
            # Respawned: the old client reconnects (regions keep their addresses).
            N.lib().ckpt_close(client)
            N.check(N.lib().ckpt_reconnect(self._client))

    def _log_tail(self):
        """Why the spawned sidecar stopped, in one line: its error line (the
        command line's `error: ...`), not the log lines before it; else the
        log's last line."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_from)
                lines = [ln.strip() for ln in f.read()[-8000:].decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        errors = [ln[len("error: ") :] for ln in lines if ln.startswith("error: ")]
        return errors[-1] if errors else (lines[-1] if lines else "(its log is empty)")

    def _live_client(self):
        """The client, when this process may speak on it: Closed after
        close(), and in a forked child (its handles' calls too)."""
        if self._client is None:
            raise Closed("the Checkpointer is closed", -16)
        if os.getpid() != self._own.pid:
            # A forked child shares the parent's connection and regions: it
            # must not speak on them, nor start a sidecar of its own.
            raise Closed(
                f"this Checkpointer belongs to process {self._own.pid}; a forked child "
                "cannot use it (make a new Checkpointer in the child)",
                -16,
            )
        return self._client

    def _ensure(self):
        self._live_client()
        if self._proc is not None and self._proc.poll() is not None:
            warnings.warn(f"the spawned sidecar exited ({self._proc.returncode}); starting a new one")
            self._proc.stdin.close()  # ends the old launch's child, if it outlived launch
            self._start_proc()

    @property
    def spawned(self):
        """True when this Checkpointer started its own sidecar."""
        return self._proc is not None

    # ---- regions ----

    def _alloc(self, n, hand_over=False):
        """A new region of n bytes. hand_over: a save region (copies made at
        save, written only before its save is sent and not again until the
        sidecar took it), registered so (ckpt_alloc_hand_over): a save whose
        every tensor lies in such regions commits even if this process dies
        before the sidecar's Released."""
        ptr = ctypes.c_void_p()
        alloc = N.lib().ckpt_alloc_hand_over if hand_over else N.lib().ckpt_alloc
        N.check(alloc(self._client, max(n, 1), ctypes.byref(ptr)))
        r = _Region(ptr.value, n)
        self._regions_gen += 1
        i = bisect.bisect(self._region_ptrs, r.ptr)
        self._region_ptrs.insert(i, r.ptr)
        self._regions.insert(i, r)
        return r

    def _free_region(self, r):
        i = self._regions.index(r)
        self._regions_gen += 1
        del self._regions[i], self._region_ptrs[i]
        N.check(N.lib().ckpt_free(self._client, ctypes.c_void_p(r.ptr)))

    def _region_of(self, ptr, n):
        i = bisect.bisect(self._region_ptrs, ptr) - 1
        if i >= 0:
            r = self._regions[i]
            if r.ptr <= ptr and ptr + n <= r.ptr + r.len_bytes:
                return r
        return None

    def _take(self, n):
        """A save region of at least n bytes that no save in flight uses. At most
        POOL_REGIONS_MAX exist (busy or free; reused, so their pages stay warm);
        when all are busy, wait until the sidecar has taken the oldest save."""
        with self._mu:
            while True:
                self._poll_pending()
                fits = [r for r in self._free if r.len_bytes >= n]
                if fits:
                    r = min(fits, key=lambda r: r.len_bytes)
                    self._free.remove(r)
                    return r
                busy = [r for r in self._save_regions if r.busy is not None]
                if len(busy) < POOL_REGIONS_MAX:
                    while self._free and len(busy) + len(self._free) >= POOL_REGIONS_MAX:
                        self._drop_save_region(self._free.pop(0))
                    r = self._alloc(max(_align(n + n // 8), 1 << 20), hand_over=True)
                    self._save_regions.append(r)
                    return r
                oldest = min(busy, key=lambda r: r.busy.id).busy
                try:
                    oldest.wait_taken()
                except SidecarError:
                    pass

    def _drop_save_region(self, r):
        self._save_regions.remove(r)
        self._free_region(r)

    def _give_back(self, r):
        with self._mu:
            r.busy = None
            if r in self._save_regions and r not in self._free:
                self._free.append(r)

    def _poll_pending(self):
        keep = []
        for ref in self._pending:
            h = ref()
            if h is None or h._taken:
                continue
            try:
                h.state()
            except SidecarError:
                h._mark_taken()
            if not h._taken:
                keep.append(ref)
        self._pending = keep

    def reserve(self, state_or_bytes, count=POOL_REGIONS_MAX):
        """Allocate and pre-fault `count` save regions big enough for `state_or_bytes`
        (a state like save's, or a byte count: an int or a size like "1GiB"), so the
        first saves do not pay for fresh pages (about 2 s per GiB on VMs that
        return freed memory)."""
        count = count_arg("count", count)
        if isinstance(state_or_bytes, (numbers.Integral, str)):
            n = size_arg("state_or_bytes", state_or_bytes)
        else:
            fl = Flattener()
            fl.walk(state_or_bytes)
            n = sum(
                _align(obj.nbytes if ref.kind == "np" else obj.numel() * obj.element_size()) for ref, obj in fl.leaves
            )
        with self._mu:
            self._ensure()
            got = []
            for _ in range(min(count, POOL_REGIONS_MAX)):
                r = self._take(n)
                _trust.clear_slots(r)
                pages = np.frombuffer(r.buf, dtype=np.uint8, count=r.len_bytes)
                pages[::4096] = 0  # touch every page
                got.append(r)
            for r in got:
                self._give_back(r)

    # ---- save ----

    def save(self, step, state, rng=False):
        """Checkpoint `state` as `step` (an int from 0 to 999999999999); returns a
        SaveHandle once the request is sent. When no tensor of `state` was
        share()'d, every tensor is copied here, and the save is released (and
        handed over) when this returns: it commits even if the process is
        killed right after (see SaveHandle).

        The request prepared for a state (descriptors, the pickled skeleton,
        which tensors go in place and where the others are copied) is kept and
        reused while the next state is the same: tensors at the same addresses
        with the same shapes, strides and dtypes (torch; a fresh state_dict()
        matches), the same numpy arrays, the same containers and keys, and
        equal plain values (see `_tree.quick_key`).
        Then a save costs a walk of the state, the copies, and one native call."""
        t0 = time.perf_counter()
        step = step_arg(step)
        with self._mu:
            self._ensure()
            if self.world_size > 1:
                return self._save_part(step, state, rng, t0)
            # The key's thousands of small tuples are garbage right after the
            # match: with the collector paused they come and go without
            # counting towards a collection (one, with torch's objects
            # around, costs more than the whole save).
            paused = gc.isenabled()
            gc.disable()
            try:
                key = quick_key(state)
                c = None
                if key is not None:
                    for p in reversed(self._save_plans):
                        if p.matches(key, self._regions_gen):
                            c, objs = p, key[1]
                            key = None  # freed here, while the collector is paused
                            break
            finally:
                if paused:
                    gc.enable()
            if c is None:
                c, objs = self._prepare(state, key)
            blobs_py = [(STRUCTURE_BLOB, c.skeleton)]
            if rng:
                blobs_py.append((RNG_BLOB, pickle.dumps(capture_rng(), protocol=4)))
            return self._send(step, c, objs, blobs_py, t0)

    def _save_part(self, step, state, rng, t0):
        """This rank's part of a replicated state (dist.rank_leaves): the
        structure once (rank 0), the RNG state per rank, and the slices of
        tensors split between ranks declared by the rank holding each (the
        sidecar writes them into the index)."""
        fl = Flattener()
        skeleton = fl.walk(state)
        leaves, slices = dist.rank_leaves(fl.leaves, self.rank, self.world_size)
        blobs_py = []
        if self.rank == 0:
            blobs_py.append((STRUCTURE_BLOB, pickle_skeleton(SKELETON_VERSION, skeleton)))
        if slices:
            blobs_py.append((dist.SLICES_BLOB, dist.slices_blob(slices)))
        if rng:
            blobs_py.append((dist.rng_blob_name(self.rank), pickle.dumps(capture_rng(), protocol=4)))
        return self._save_leaves(step, leaves, blobs_py, t0)

    def _save_leaves(self, step, leaves, blobs_py, t0, stream=None):
        """Sends [(TensorRef, tensor)] and [(blob name, bytes)] as `step` (this
        rank's part when the world size is above 1), with no plan kept for
        later saves; returns the SaveHandle. `stream`: the CUDA stream (a
        handle) torch CUDA tensors in place are fenced on, for a caller on
        another thread than the one that wrote them (dcp.async_save's
        background thread); None: this thread's current stream."""
        with self._mu:
            self._ensure()
            plan, _direct, copy_bytes, streams = self._plan(leaves)
            c = _SavePlan(plan, copy_bytes, None, streams)
            return self._send(step, c, [o for _, o in leaves], blobs_py, t0, stream)

    def _send(self, step, c, objs, blobs_py, t0, stream=None):
        """The copies into a save region, then the request (c: a _SavePlan;
        `stream`: as _save_leaves)."""
        with self._mu:
            self._check_fits(step, c.tensor_bytes)
            region = self._take(c.copy_bytes) if c.copy_bytes else None
            try:
                stamps = flags = None
                if self._trust is not None:
                    self._trust.settle(self._client)
                    base = self._trust.base(c)
                    stamps = _trust.stamps_of(objs, c, base[3] if base is not None else None)
                    flags = self._trust.flags(c, objs, stamps)
                copied = c.copy_in(self, objs, region, stamps) if region is not None else 0
                blobs = c.blob_array(blobs_py)
                sid = ctypes.c_uint64()
                # Device tensors in place: fenced by an event on their stream (as of now: a kept plan asks again).
                streams = _cuda.streams_now(c.dev, objs, torch_module(), stream) if c.dev else []
                if len(streams) > 1:
                    raise InvalidArgument(
                        f"the device tensors of one save were written on {len(streams)} CUDA streams "
                        f"({streams}); synchronize them onto one stream first"
                    )
                if flags is not None:
                    since, arr = flags
                    N.check(
                        N.lib().ckpt_save_flagged(
                            self._client,
                            int(step),
                            c.descs,
                            c.n,
                            arr,
                            since,
                            blobs,
                            len(blobs_py),
                            streams[0] if streams else None,
                            ctypes.byref(sid),
                        )
                    )
                elif streams:
                    N.check(
                        N.lib().ckpt_save_on_stream(
                            self._client, int(step), c.descs, c.n, blobs, len(blobs_py), streams[0], ctypes.byref(sid)
                        )
                    )
                else:
                    N.check(
                        N.lib().ckpt_save(
                            self._client, int(step), c.descs, c.n, blobs, len(blobs_py), ctypes.byref(sid)
                        )
                    )
                self._own.untaken.add(sid.value)
                if stamps is not None:
                    self._trust.sent(sid.value, c, int(step), stamps)
            except BaseException:
                if region is not None:
                    self._give_back(region)
                raise
            h = SaveHandle(self, int(step), sid.value, region, 0.0, inplace=c.inplace)
            # Only device tensors in place: the next step can wait on the copy on its stream.
            h.cuda_stream = streams[0] if streams and not c.host_inplace else None
            h.copied_bytes = copied
            if region is not None:
                region.busy = h
            self._pending.append(weakref.ref(h))
            if len(self._pending) > self._pending_prune_at:
                # Only saves that copy poll these; a trainer whose tensors are
                # all shared would otherwise keep one per save, for good.
                self._pending = [r for r in self._pending if (live := r()) is not None and not live._taken]
                self._pending_prune_at = max(PENDING_PRUNE_AT, 2 * len(self._pending))
            self._last = h
            h.stall_seconds = time.perf_counter() - t0
            return h

    def _prepare(self, state, key):
        """The request for `state`, built from scratch (kept for the next save
        when `key`, its quick_key, is not None)."""
        fl = Flattener()
        skeleton = fl.walk(state)
        plan, _direct, copy_bytes, streams = self._plan(fl.leaves)
        c = _SavePlan(plan, copy_bytes, pickle_skeleton(SKELETON_VERSION, skeleton), streams)
        objs = [o for _, o in fl.leaves]
        # A plan with device tensors in place is kept too (torch CUDA tensors);
        # libckpt checks at each save that each registered allocation is still
        # the one at its address (its buffer id) and registers anew one freed
        # and replaced (torch.cuda.empty_cache, then a new block there). Their
        # streams are asked again at each save (_send). Interface objects
        # have no quick key.
        if key is not None and len(key[1]) == len(objs) and all(map(operator.is_, key[1], objs)):
            c.remember(key, self._regions_gen)
            plans = [p for p in self._save_plans if p.gen == self._regions_gen and p.alive()]
            self._save_plans = (plans + [c])[-SAVE_PLANS_MAX:]
        return c, objs

    def _check_fits(self, step, tensor_bytes):
        """A save whose tensors alone exceed the sidecar's whole staging budget
        is refused here, before anything is copied (the sidecar would refuse it
        after the copy). The budget is asked once, and again before a refusal
        (a restarted sidecar may have another)."""
        if self._budget is None or tensor_bytes > self._budget:
            try:
                self._budget = int(self.status()["staging_bytes"])
            except (SidecarError, KeyError, TypeError, ValueError):
                return  # the sidecar decides
        if tensor_bytes > self._budget:
            raise TooLarge(
                f"save of step {step}: its tensors need {tensor_bytes} bytes, more than the sidecar's "
                f"whole staging budget of {self._budget} bytes (raise staging=, or the sidecar's "
                "--staging); nothing was copied",
                TooLarge.code,
            )

    def save_file(self, path, data):
        """Have the sidecar write `data` (bytes-like) as the whole file `path`,
        atomically: an unnamed temp file in its directory, synced, renamed over
        `path`. The bytes are copied into shared memory here, so `data` may
        change as soon as this returns; the SaveHandle (step None) is taken once
        the sidecar holds its own copy and durable once the file is renamed and
        synced. The sidecar writes files only for clients of its own uid."""
        t0 = time.perf_counter()
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        n = src.nbytes
        with self._mu:
            self._ensure()
            region = self._take(n) if n else None
            _trust.clear_slots(region)
            try:
                if n:
                    ctypes.memmove(region.ptr, src.ctypes.data, n)
                h = self.save_file_at(path, region.ptr if region is not None else None, n)
            except BaseException:
                if region is not None:
                    self._give_back(region)
                raise
            h._region = region
            h.copied_bytes = n
            if region is not None:
                region.busy = h
            h.stall_seconds = time.perf_counter() - t0
            return h

    def save_file_at(self, path, ptr, n):
        """save_file of `n` bytes already in this client's shared memory at
        address `ptr` (a region from this Checkpointer); nothing is copied here,
        and the bytes must not change until the handle is taken."""
        t0 = time.perf_counter()
        path = os.path.abspath(os.fsdecode(os.fspath(path)))
        with self._mu:
            self._ensure()
            sid = ctypes.c_uint64()
            N.check(N.lib().ckpt_save_file(self._client, path.encode(), ptr, n, ctypes.byref(sid)))
            self._own.untaken.add(sid.value)
            h = SaveHandle(self, None, sid.value, None, time.perf_counter() - t0, inplace=False)
            self._pending.append(weakref.ref(h))
            return h

    def save_file_pieces(self, path, pieces, stream, torch_zip):
        """save_file of a file made of `pieces` [(address, nbytes)] laid end to
        end, each in this client's shared memory or in CUDA device memory (the
        allocations it lies in registered here, once each: a piece across VMM
        chunks mapped back to back, as PyTorch's expandable segments map
        them, is registered as one span); device pieces are fenced by an
        event recorded now on CUDA `stream` (a handle), the sidecar copying
        them on its own stream. With `torch_zip` the pieces are a torch.save
        archive written under skip_data, whose CRC-32s the sidecar computes.
        Nothing is copied here; the pieces must not change until the handle
        is taken. CudaError when a device piece's allocation cannot be
        registered (no driver, not device memory)."""
        t0 = time.perf_counter()
        path = os.path.abspath(os.fsdecode(os.fspath(path)))
        with self._mu:
            self._ensure()
            for addr, n, device in pieces:
                if device and n:
                    rid = ctypes.c_uint32()
                    N.check(N.lib().ckpt_register_cuda_range(self._client, addr, n, ctypes.byref(rid)))
            arr = (N.FilePiece * len(pieces))(*[N.FilePiece(addr, n) for addr, n, _ in pieces])
            finish = N.FILE_TORCH_ZIP if torch_zip else N.FILE_AS_IS
            sid = ctypes.c_uint64()
            N.check(
                N.lib().ckpt_save_file_pieces(
                    self._client, path.encode(), arr, len(pieces), stream or None, finish, ctypes.byref(sid)
                )
            )
            self._own.untaken.add(sid.value)
            h = SaveHandle(self, None, sid.value, None, time.perf_counter() - t0, inplace=False)
            self._pending.append(weakref.ref(h))
            return h

    def _plan(self, leaves):
        """Per leaf: (ref, obj, nbytes, shape, where): where is an address (the
        tensor already lies in a region: sent in place) or ("copy", offset)."""
        torch = torch_module()
        rows, direct, streams = [], [], []
        for ref, obj in leaves:
            dev = _cuda.device_leaf(ref, obj, torch)
            if dev is not None:
                # Device memory: described in place in its registered
                # allocation (no copy by the trainer), else copied to the host.
                addr, nbytes, contiguous, stream = dev
                inplace = contiguous and nbytes > 0 and self._register_cuda(ref, addr, nbytes)
                if inplace and stream not in streams:
                    streams.append(stream)
            elif ref.kind == "np":
                nbytes = obj.nbytes
                inplace = (
                    obj.flags.c_contiguous
                    and ref.stored != "U8"
                    or (ref.stored == "U8" and obj.dtype == np.uint8 and obj.flags.c_contiguous)
                )
                addr = obj.__array_interface__["data"][0] if nbytes else 0
            else:
                nbytes = obj.numel() * obj.element_size()
                inplace = (
                    obj.device.type == "cpu"
                    and obj.is_contiguous()
                    and (ref.stored != "U8" or obj.dtype == torch.uint8)
                    and not _lazy_view(obj)
                )
                addr = obj.data_ptr() if nbytes else 0
            is_u8 = obj.dtype == np.uint8 if ref.kind == "np" else ref.dtype == "uint8"
            # A dtype safetensors lacks travels as its raw bytes (U8, [nbytes]).
            shape = list(ref.shape) if ref.stored != "U8" or is_u8 else [nbytes]
            if nbytes == 0:
                rows.append([ref, obj, 0, shape, 0])
                continue
            if inplace and (dev is not None or self._region_of(addr, nbytes) is not None):
                direct.append((addr, addr + nbytes, len(rows)))
            rows.append([ref, obj, nbytes, shape, None])
        # Tensors sent in place must not overlap (views of one storage): the later ones are copied.
        direct.sort()
        end = 0
        for a, b, i in direct:
            if a >= end:
                rows[i][4] = a
                end = b
        copy_bytes = 0
        for row in rows:
            if row[4] is None:
                row[4] = ("copy", copy_bytes)
                copy_bytes += _align(row[2])
        if len(streams) > 1:
            raise InvalidArgument(
                f"the device tensors of one save were written on {len(streams)} CUDA streams "
                f"({streams}); synchronize them onto one stream first"
            )
        return [tuple(r) for r in rows], direct, copy_bytes, streams

    def _register_cuda(self, ref, addr, nbytes):
        """Registers the CUDA allocations holding the `nbytes` at `addr` with the
        sidecar (once per allocation: libckpt keeps them, by identity, so memory
        freed and allocated again at the address is registered anew; a range
        across VMM chunks mapped back to back, as PyTorch's expandable
        segments are, is one span); False when a torch tensor must take the
        host path instead (a warning says why, once)."""
        rid = ctypes.c_uint32()
        st = N.lib().ckpt_register_cuda_range(self._client, addr, nbytes, ctypes.byref(rid))
        if st == 0:
            return True
        err = N.error_for(st, N.last_error())
        if ref.kind == "cuda":
            raise err
        if not getattr(self, "_cuda_warned", False):
            self._cuda_warned = True
            warnings.warn(f"CUDA tensors are copied to the host by the trainer: {err}")
        return False

    def _copy_in(self, ref, obj, nbytes, region, off):
        """Copy one tensor's bytes into `region` at `off`; returns the address."""
        if ref.kind == "cuda":
            addr, nbytes, contiguous, stream = _cuda.device_leaf(ref, obj, None)
            if not contiguous:
                raise InvalidArgument(
                    f"tensor {ref.name!r}: a strided __cuda_array_interface__ object (make it contiguous first)"
                )
            _cuda.copy_to_host(obj, region.ptr + off, nbytes, stream)
        elif ref.kind == "np":
            if ref.stored != "U8" or obj.dtype == np.uint8:
                dst = np.frombuffer(region.buf, dtype=obj.dtype, count=obj.size, offset=off).reshape(obj.shape)
                np.copyto(dst, obj, casting="no")
            else:
                raw = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
                np.frombuffer(region.buf, dtype=np.uint8, count=nbytes, offset=off)[...] = raw
        else:
            torch = torch_module()
            src = obj.detach()
            dst = torch.frombuffer(region.buf, dtype=torch.uint8, count=nbytes, offset=off)
            if ref.stored != "U8" or src.dtype == torch.uint8:
                dst.view(src.dtype).view(src.shape).copy_(src)
            else:
                dst.copy_(src.resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8))
        return region.ptr + off

    # ---- load ----

    def load(self, step="latest", map_location="cpu", restore_rng=False):
        """The state saved as `step` ("latest": the newest good one), verified by
        the sidecar; torch tensors where torch tensors were saved, numpy arrays
        where arrays were. A step is an int from 0 to 999999999999. map_location: a torch device for torch tensors (None:
        the device they were saved from). Whatever world size saved it, every
        rank gets the whole state (tensors split between ranks come back whole).

        CPU tensors and arrays are views of a shared-memory load region the
        sidecar read the checkpoint into (no copy): the region is reused by a
        later load only once every tensor of this load is gone, so they are
        never overwritten, and they stay valid after close() (_LoadRegion)."""
        with self._mu:
            packed = self._load_packed(step, map_location)
            if packed is None:
                got, values, skel, saved_world = self._load_tensors(step, None, map_location)
            else:
                got, values, skel, saved_world = packed
            rng_blob = self._loaded_rng(saved_world) if restore_rng else None
            if skel is None:
                result = values
            else:
                version, skeleton = pickle.loads(skel)
                if version != SKELETON_VERSION:
                    raise SidecarError(f"checkpoint skeleton version {version}, this package reads {SKELETON_VERSION}")
                refs = {}
                _collect_refs(skeleton, refs)
                for name in refs:
                    if name not in values:
                        raise NotFound(f"tensor {name!r} of the structure is missing from checkpoint {got}", -8)
                result = unflatten(skeleton, values)
            if rng_blob is not None:
                restore_rng_state(pickle.loads(rng_blob))
            elif restore_rng:
                warnings.warn(f"checkpoint {got} holds no RNG state (save it with rng=True)")
            return result

    def _load_target(self, need):
        """A load region of at least `need` bytes whose last load's tensors are
        all gone: the smallest such, else a new one (free ones too small are
        dropped first)."""
        free = [r for r in self._load_pool if r.free()]
        fits = [r for r in free if r.region.len_bytes >= need]
        if fits:
            return min(fits, key=lambda r: r.region.len_bytes)
        for r in free:
            self._load_pool.remove(r)
            self._drop_load_region(r)
        r = self._new_load_region(need)
        self._load_pool.append(r)
        return r

    def _new_load_region(self, need):
        """A new load region of at least `need` bytes, mapped by this process."""
        region = self._alloc(max(_align(need), LOAD_REGION_MIN_BYTES))
        try:
            L = N.lib()
            n = ctypes.c_size_t()
            N.check(L.ckpt_region_name(self._client, ctypes.c_void_p(region.ptr), None, 0, ctypes.byref(n)))
            name = ctypes.create_string_buffer(n.value + 1)
            N.check(L.ckpt_region_name(self._client, ctypes.c_void_p(region.ptr), name, n.value + 1, ctypes.byref(n)))
            fd = os.open("/dev/shm/" + name.value.decode().lstrip("/"), os.O_RDWR | os.O_CLOEXEC)
            try:
                # MAP_POPULATE: the pages are faulted in here, once per region,
                # not by every load (a reused region's pages stay mapped).
                mm = mmap.mmap(
                    fd,
                    region.len_bytes,
                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                )
            finally:
                os.close(fd)
        except BaseException:
            self._free_region(region)
            raise
        return _LoadRegion(region, mm)

    def _load_packed(self, step, map_location):
        """load() through ckpt_load_packed: the sidecar reads the checkpoint
        straight into a free load region (no copy on either side) and the
        tensors come back as views of it (see _LoadRegion for their lifetime).
        None when the checkpoint needs the per-tensor path (tensors stored in
        slices or in pieces by several ranks); (step, values, structure blob,
        saved world size) otherwise."""
        L = N.lib()
        self._ensure()
        want = step_arg(step, latest_ok=True)
        want = -1 if want is None else want
        got, src, need = ctypes.c_uint64(), ctypes.c_int(), ctypes.c_uint64()
        need.value = max((r.region.len_bytes for r in self._load_pool if r.free()), default=1)
        for _ in range(LOAD_TRIES_MAX):
            target = self._load_target(need.value)
            N.check(
                L.ckpt_load_packed(
                    self._client,
                    want,
                    ctypes.c_void_p(target.region.ptr),
                    target.region.len_bytes,
                    ctypes.byref(got),
                    ctypes.byref(src),
                    ctypes.byref(need),
                )
            )
            if need.value <= target.region.len_bytes:
                break
        else:
            raise SidecarError(f"checkpoint {got.value} kept needing a larger region ({need.value} bytes); try again")
        self._note_load(got.value, src.value)
        infos = self._loaded_tensors()
        offs, off = [], ctypes.c_uint64()
        for i in range(len(infos)):
            N.check(L.ckpt_loaded_tensor_offset(self._client, i, ctypes.byref(off)))
            offs.append(off.value)
        if NOT_PLACED in offs or self._loaded_blob(PARTS_BLOB) is not None:
            return None
        skel = self._loaded_blob(STRUCTURE_BLOB)
        saved_world = self._saved_world_size()
        refs = {}
        if skel is not None:
            version, skeleton = pickle.loads(skel)
            if version == SKELETON_VERSION:
                _collect_refs(skeleton, refs)
        lease = (ctypes.c_ubyte * max(need.value, 1)).from_buffer(target.mm)
        target.lease = weakref.ref(lease)
        values = {}
        for (name, dt, shape, nbytes), at in zip(infos, offs):
            if name in refs:
                values[name] = _restore(refs[name], lease, at, nbytes, map_location, view=True)
            else:
                values[name] = _plain_array(lease, at, dt, shape, nbytes, view=True)
        return got.value, values, skel, saved_world

    def load_tensors(self, names, step="latest", map_location="cpu"):
        """Only the named tensors of `step` (their paths, as `save` names
        them: "model.embed.weight"), verified by the sidecar: {name: tensor},
        each whole whatever world size saved it. An unknown name raises
        NotFound naming it."""
        if isinstance(names, (str, bytes)):
            raise TypeError(f"names={names!r}: give a list of tensor names, e.g. [{names!r}]")
        names = list(names)
        with self._mu:
            return self._load_tensors(step, names, map_location)[1]

    def _load_tensors(self, step, names, map_location):
        """(step loaded, {name: value}, the structure blob or None, the world
        size that saved it); names None: every tensor."""
        L = N.lib()
        self._ensure()
        want = step_arg(step, latest_ok=True)
        want = -1 if want is None else want
        got, src = ctypes.c_uint64(), ctypes.c_int()
        N.check(L.ckpt_load(self._client, want, None, 0, ctypes.byref(got), ctypes.byref(src)))
        self._note_load(got.value, src.value)
        infos = self._loaded_tensors()
        skel = self._loaded_blob(STRUCTURE_BLOB)
        # The sidecar lists and loads tensors stored in slices whole. Only
        # checkpoints written before the index described slices list the
        # pieces, with the map in the blob parts.pkl.
        parts = self._loaded_blob(PARTS_BLOB)
        parts = pickle.loads(parts) if parts is not None else {"world_size": None, "split": {}}
        saved_world = parts["world_size"] or self._saved_world_size()
        # Old checkpoints' pieces are put back together in place: each piece
        # is loaded at its offset in one slot.
        piece_at = {pn: (g, a) for g, sp in parts["split"].items() for pn, a, b in sp["pieces"]}
        slots = [i for i in infos if i[0] not in piece_at]
        piece_isz = {}
        for name, dt, shape, nbytes in infos:
            if name in piece_at and nbytes:
                piece_isz[piece_at[name][0]] = nbytes // shape[0]
        for g, sp in parts["split"].items():
            n_elems = max((b for _, _, b in sp["pieces"]), default=0)
            slots.append((g, sp["dtype"], sp["shape"], n_elems * piece_isz.get(g, 0)))
        if names is not None:
            have = {i[0] for i in slots}
            missing = [n for n in names if n not in have]
            if missing:
                raise NotFound(f"tensor(s) {missing} not in checkpoint {got.value}", -8)
            keep_names = set(names)
            slots = [i for i in slots if i[0] in keep_names]
            infos = [i for i in infos if (piece_at[i[0]][0] if i[0] in piece_at else i[0]) in keep_names]
        total = sum(_align(i[3]) for i in slots)
        if total and (self._load_region is None or self._load_region.len_bytes < total):
            if self._load_region is not None:
                self._free_region(self._load_region)
            self._load_region = self._alloc(_align(total))
        region = self._load_region
        descs = (N.Tensor * max(len(infos), 1))()
        keep, offs, n, off = [], {}, 0, 0
        for name, dt, shape, nbytes in slots:
            offs[name] = off
            off += _align(nbytes)
        for name, dt, shape, nbytes in infos:
            if nbytes == 0:
                continue
            at = (
                offs[name]
                if name not in piece_at
                else offs[piece_at[name][0]] + piece_at[name][1] * piece_isz[piece_at[name][0]]
            )
            bn, bd = name.encode(), dt.encode()
            shp = (ctypes.c_uint64 * max(len(shape), 1))(*shape)
            keep += [bn, bd, shp]
            descs[n] = N.Tensor(bn, bd, shp, len(shape), region.ptr + at, nbytes)
            n += 1
        if n:
            N.check(L.ckpt_load(self._client, got.value, descs, n, None, None))
        refs = {}
        if skel is not None:
            version, skeleton = pickle.loads(skel)
            if version == SKELETON_VERSION:
                _collect_refs(skeleton, refs)
        values = {}
        for name, dt, shape, nbytes in slots:
            if name in refs:
                values[name] = _restore(refs[name], region.buf, offs[name], nbytes, map_location)
            else:
                values[name] = _plain_array(region.buf, offs[name], dt, shape, nbytes)
        return got.value, values, skel, saved_world

    def load_into(self, state, step="latest", strict=True):
        """Restore checkpoint `step` ("latest": the newest good one) into the
        tensors and arrays `state` already holds, in place, and return the
        step loaded (a `LoadedInto`, an int that also says what was missing).

        `state` is what `save()` takes: dicts (nested), lists and tuples of
        torch CPU tensors, numpy arrays and CUDA tensors / objects with
        `__cuda_array_interface__`, each matched by the name `save()` gives it
        ("model.embed.weight"). Every tensor keeps its identity (same object,
        same memory: a model's parameters and an optimizer's state stay
        bound); non-contiguous ones are written through their strides. Other
        leaves (ints, strings, ...) are left alone.

        Nothing of `state` is written unless all of this holds; else
        `InvalidArgument` says in one line which tensor differs and how:
        every tensor of both has the same dtype and shape (and the same real
        dtype where the checkpoint's structure records one); with `strict`
        (default), the checkpoint holds exactly the tensors of `state`
        (`strict=False` loads the ones both have, as torch's
        `load_state_dict(strict=False)`; the result's `missing_keys` are the
        state's tensors the checkpoint lacks, `unexpected_keys` the
        checkpoint's that the state lacks); a numpy array is writable; no
        tensor is an expanded view (stride 0: its elements share memory) and
        no two share memory unless they are the very same view (tied
        weights, written with each name's bytes in turn).

        Host tensors: the sidecar reads the checkpoint into a load region,
        verifying every checksum (a damaged `latest` falls back to the newest
        good checkpoint, as load() does), and only then are the bytes copied
        into `state`: a damaged checkpoint never leaves it half overwritten.
        The region is one a finished load() left free if one is large
        enough, else a new one freed before this returns: no second copy of
        the state outlives the call. Tensors lying contiguous in this
        client's shared memory (after share()) are written by the sidecar
        itself when the index alone checks every tensor: one Load request,
        the checkpoint verified whole in the sidecar's staging before any
        write, the other host tensors through a bounce region sized for them
        alone. Device tensors (contiguous; a strided one is refused) are
        written by the sidecar straight into their GPU memory (host-to-device
        on its own stream, finished before this returns). Nothing may write
        the tensors of `state` meanwhile, nor while a save of them is not yet
        released. See docs/python.md, "Loading into the trainer's
        tensors"."""
        L = N.lib()
        with self._mu:
            self._ensure()
            want = step_arg(step, latest_ok=True)
            want = -1 if want is None else want
            # The sidecar writes shared and device tensors in place, no version bump.
            self._forget_unchanged()
            torch = torch_module()
            fl = Flattener()
            fl.walk(state)
            # direct: (address, nbytes, ref, is device memory) of the leaves
            # the sidecar writes itself: device tensors, and host ones lying
            # contiguous in this client's regions (after share()).
            mine, direct = {}, []
            for ref, obj in fl.leaves:
                dev = _cuda.device_leaf(ref, obj, torch)
                if dev is not None:
                    if not dev[2]:
                        raise InvalidArgument(
                            f"load_into: tensor {ref.name!r} is a non-contiguous CUDA tensor "
                            "(the sidecar writes device memory as one range); nothing was loaded"
                        )
                    direct.append((dev[0], dev[1], ref, True))
                elif ref.kind == "torch" and obj.device.type != "cpu":
                    raise InvalidArgument(
                        f"load_into: tensor {ref.name!r} is on device {obj.device}, which this "
                        "package cannot write; nothing was loaded"
                    )
                elif ref.kind == "np" and not obj.flags.writeable:
                    raise InvalidArgument(f"load_into: array {ref.name!r} is read-only; nothing was loaded")
                elif _leaf_nbytes(ref, obj) and (obj.flags.c_contiguous if ref.kind == "np" else obj.is_contiguous()):
                    addr = obj.__array_interface__["data"][0] if ref.kind == "np" else obj.data_ptr()
                    if self._region_of(addr, _leaf_nbytes(ref, obj)) is not None:
                        direct.append((addr, _leaf_nbytes(ref, obj), ref, False))
                mine[ref.name] = (ref, obj)
            why = _alias.aliasing_error(fl.leaves, _cuda.device_leaf, torch)
            if why is not None:
                raise InvalidArgument(f"load_into: {why}; nothing was loaded")
            # The sidecar refuses overlapping destinations (views of one
            # storage, tied weights): host leaves after the first are copied.
            direct.sort(key=lambda d: d[:2])
            kept, end = [], 0
            for d in direct:
                if d[3] or d[0] >= end:
                    kept.append(d)
                    end = max(end, d[0] + d[1]) if not d[3] else end
            direct = kept
            by_sidecar = {d[2].name for d in direct}
            host = [n for n in mine if n not in by_sidecar]
            # Some host tensors in shared memory, and every tensor checked by
            # the index alone (no dtype safetensors lacks, whose real dtype
            # only the structure blob says): one Load request writes them all,
            # the rest into a small bounce region (the sidecar verifies the
            # whole checkpoint before it writes anything). Else the packed way.
            one_request = any(not d[3] for d in direct) and all(_index_checkable(r) for r, _ in mine.values())
            target, lease, srcs, bounce = None, None, {}, None
            try:
                if one_request:
                    got, infos, _, target, _ = self._load_into_region(want, mine, strict, 0)
                    missing, unexpected = _match_state(mine, infos, {}, got, strict)
                    if target not in self._load_pool:
                        self._drop_load_region(target)
                    target = None
                    have = {i[0]: k for k, i in enumerate(infos)}
                    spare = [n for n in host if n in have and infos[have[n]][3]]
                    at, total = {}, 0
                    for n in spare:
                        at[n] = total
                        total += _align(infos[have[n]][3])
                    bounce = self._alloc(total) if total else None
                    try:
                        # The step found above, explicitly: `latest` may have moved meanwhile.
                        self._load_described(
                            got,
                            infos,
                            direct + [(bounce.ptr + at[n], infos[have[n]][3], mine[n][0], False) for n in spare],
                        )
                        srcs = {n: np.frombuffer(bounce.buf, np.uint8, infos[have[n]][3], at[n]) for n in spare}
                    except Damaged:
                        if want != -1:
                            raise
                        one_request = False  # the packed way falls back past a damaged latest
                if not one_request:
                    # Host tensors in shared memory are copied too (the
                    # checkpoint is read once, into the load region).
                    direct = [d for d in direct if d[3]]
                    host = [n for n in mine if n not in {d[2].name for d in direct}]
                    # A first guess at the region the checkpoint needs: the host
                    # tensors' bytes plus room for shard headers; a wrong guess
                    # costs one more request (the reply says what it needs).
                    guess = sum(_leaf_nbytes(*mine[n]) for n in host)
                    guess += (guess >> 30) * 8192 + 256 * len(mine) + (64 << 10) if host else 0
                    got, infos, offs, target, lease = self._load_into_region(want, mine, strict, guess)
                    skel = self._loaded_blob(STRUCTURE_BLOB) if offs is not None else None
                    refs = {}
                    if skel is not None:
                        version, skeleton = pickle.loads(skel)
                        if version == SKELETON_VERSION:
                            _collect_refs(skeleton, refs)
                    missing, unexpected = _match_state(mine, infos, refs, got, strict)
                    have = {i[0]: k for k, i in enumerate(infos)}
                    if host and (NOT_PLACED in offs or self._loaded_blob(PARTS_BLOB) is not None):
                        # Tensors stored in slices by several ranks (or an older
                        # checkpoint's pieces) are put together by the per-tensor
                        # path, into its own region, before anything is copied.
                        names = [n for n in host if n in have]
                        for name, v in self._load_tensors(got, names, "cpu")[1].items():
                            srcs[name] = _raw_bytes(v)
                    else:
                        for name in host:
                            if name in have:
                                i = have[name]
                                nbytes = infos[i][3]
                                srcs[name] = np.frombuffer(lease, np.uint8, nbytes, offs[i]) if nbytes else None
                    if direct:
                        self._load_described(got, infos, direct)
                for name, src in srcs.items():
                    if src is not None:
                        _copy_into(*mine[name], src)
            finally:
                # The views of the region go first: a pool region is then
                # free again, a new one unmapped as its mapping is dropped.
                srcs = lease = None
                if target is not None and target not in self._load_pool:
                    self._drop_load_region(target)
                if bounce is not None:
                    self._free_region(bounce)
            self.last_load_step = got
            return LoadedInto(got, self.last_load_source, missing, unexpected)

    def _load_described(self, step, infos, places):
        """One Load of `step` that the sidecar writes itself: `places` are
        (address, nbytes, ref, is device memory), each tensor named by
        ref.name and described as the checkpoint's `infos` list it (the
        sidecar checks every one, and the whole checkpoint's checksums,
        before writing any)."""
        L = N.lib()
        have = {i[0]: i for i in infos}
        descs, keep, n = (N.Tensor * max(len(places), 1))(), [], 0
        for addr, nbytes, ref, on_device in places:
            if ref.name not in have or nbytes == 0:
                continue
            if on_device:
                rid = ctypes.c_uint32()
                N.check(L.ckpt_register_cuda_range(self._client, addr, nbytes, ctypes.byref(rid)))
            _, dt, shape, _ = have[ref.name]
            bn, bd = ref.name.encode(), dt.encode()
            shp = (ctypes.c_uint64 * max(len(shape), 1))(*shape)
            keep += [bn, bd, shp]
            descs[n] = N.Tensor(bn, bd, shp, len(shape), addr, nbytes)
            n += 1
        if n:
            N.check(L.ckpt_load(self._client, step, descs, n, None, None))

    def _load_into_region(self, want, mine, strict, guess_bytes):
        """load_into's packed load: (step, tensor list, offsets, region,
        lease), the checkpoint read and verified into a free pool region or a
        new one not in the pool (the caller frees it). The state is matched
        against the checkpoint's index as soon as the sidecar names it (before
        any read when the first region, `guess_bytes` at least, was too small).
        With guess_bytes 0 (no host tensors) only the list is asked for
        (offsets None)."""
        L = N.lib()
        got, src, need = ctypes.c_uint64(), ctypes.c_int(), ctypes.c_uint64()
        need.value = max(guess_bytes, 1)
        host = guess_bytes > 0
        target = None
        try:
            for _ in range(LOAD_TRIES_MAX):
                # Without host tensors to copy, a small new region: the reply
                # lists the tensors and nothing is read (unless it is tiny).
                free = [r for r in self._load_pool if host and r.free() and r.region.len_bytes >= need.value]
                if target is None or target.region.len_bytes < need.value:
                    if target is not None and target not in self._load_pool:
                        self._drop_load_region(target)
                    target = min(free, key=lambda r: r.region.len_bytes) if free else self._new_load_region(need.value)
                N.check(
                    L.ckpt_load_packed(
                        self._client,
                        want,
                        ctypes.c_void_p(target.region.ptr),
                        target.region.len_bytes,
                        ctypes.byref(got),
                        ctypes.byref(src),
                        ctypes.byref(need),
                    )
                )
                self._note_load(got.value, src.value)
                infos = self._loaded_tensors()
                if need.value <= target.region.len_bytes:
                    break
                _match_state(mine, infos, {}, got.value, strict)
                if not host:
                    return got.value, infos, None, target, None
            else:
                raise SidecarError(
                    f"checkpoint {got.value} kept needing a larger region ({need.value} bytes); try again"
                )
            offs, off = [], ctypes.c_uint64()
            for i in range(len(infos)):
                N.check(L.ckpt_loaded_tensor_offset(self._client, i, ctypes.byref(off)))
                offs.append(off.value)
            lease = (ctypes.c_ubyte * max(need.value, 1)).from_buffer(target.mm)
            return got.value, infos, offs, target, lease
        except BaseException:
            if target is not None and target not in self._load_pool:
                self._drop_load_region(target)
            raise

    def _drop_load_region(self, r):
        """Frees a load region: the sidecar forgets it, its name goes and
        this process's mapping is unmapped once nothing holds it."""
        r.mm = None
        self._free_region(r.region)

    def _saved_world_size(self):
        """The world size that saved the loaded checkpoint, as its per-rank
        RNG blobs tell (1 when there are none)."""
        n = 0
        while self._loaded_blob(dist.rng_blob_name(n)) is not None:
            n += 1
        return max(n, 1)

    def _loaded_rng(self, saved_world_size):
        """The RNG blob for this rank: its own when the world size is the one
        that saved; a single-rank checkpoint's otherwise."""
        if saved_world_size > 1:
            if saved_world_size != self.world_size:
                warnings.warn(
                    f"checkpoint written by {saved_world_size} ranks, loaded by {self.world_size}: "
                    f"rank {self.rank} gets rank {self.rank % saved_world_size}'s RNG state"
                )
            return self._loaded_blob(dist.rng_blob_name(self.rank % saved_world_size))
        return self._loaded_blob(RNG_BLOB)

    def _note_load(self, step, source):
        """Records a load that succeeded (`last_load_step`, `last_load_source`,
        `last_load_fell_back`) and, where "latest" passed over newer steps
        that do not load, says so in a RuntimeWarning: the run resumes from
        an older step than its newest checkpoint."""
        self.last_load_step, self.last_load_source = step, ("ram" if source == N.SOURCE_RAM else "disk")
        L = N.lib()
        n = ctypes.c_uint64()
        N.check(L.ckpt_loaded_fell_back(self._client, None, 0, ctypes.byref(n)))
        why = ""
        if n.value:
            buf = ctypes.create_string_buffer(n.value)
            N.check(L.ckpt_loaded_fell_back(self._client, buf, n.value, ctypes.byref(n)))
            why = buf.raw[: n.value].decode(errors="replace")
            warnings.warn(
                f"loaded step {step}, not a newer checkpoint that does not load ({why})", RuntimeWarning, stacklevel=4
            )
        self.last_load_fell_back = why

    def _loaded_tensors(self):
        L = N.lib()
        n = ctypes.c_size_t()
        N.check(L.ckpt_loaded_tensor_count(self._client, ctypes.byref(n)))
        out = []
        for i in range(n.value):
            name, dt, shp = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.POINTER(ctypes.c_uint64)()
            nd, nb = ctypes.c_uint32(), ctypes.c_uint64()
            N.check(
                L.ckpt_loaded_tensor(
                    self._client,
                    i,
                    ctypes.byref(name),
                    ctypes.byref(dt),
                    ctypes.byref(shp),
                    ctypes.byref(nd),
                    ctypes.byref(nb),
                )
            )
            out.append((name.value.decode(), dt.value.decode(), [shp[k] for k in range(nd.value)], nb.value))
        return out

    def _loaded_blob(self, name):
        L = N.lib()
        n = ctypes.c_uint64()
        st = L.ckpt_loaded_blob(self._client, name.encode(), None, 0, ctypes.byref(n))
        if st == NotFound.code:
            return None
        N.check(st)
        buf = ctypes.create_string_buffer(max(n.value, 1))
        N.check(L.ckpt_loaded_blob(self._client, name.encode(), buf, n.value, ctypes.byref(n)))
        return buf.raw[: n.value]

    # ---- share ----

    def share(self, obj):
        """Move the tensors of `obj` (a torch Module's parameters and buffers, or the
        torch tensors / numpy arrays in a dict or list, recursively, replaced in place)
        into shared memory for good: a later save sends them in place and copies
        nothing in the trainer. Returns obj. close() moves them back to private memory."""
        torch = torch_module()
        slots = []  # (tensor or array, setter)
        seen = set()
        if torch is not None and isinstance(obj, torch.nn.Module):
            for mod in obj.modules():
                for k, p in mod._parameters.items():
                    if p is not None and id(p) not in seen:
                        seen.add(id(p))
                        slots.append((p.data, (lambda p: lambda t: setattr(p, "data", t))(p)))
                for k, b in mod._buffers.items():
                    if b is not None:
                        slots.append((b, (lambda m, k: lambda t: m._buffers.__setitem__(k, t))(mod, k)))
        else:
            _collect_slots(obj, slots, torch)
        rows, total = [], 0
        for t, setter in slots:
            if isinstance(t, np.ndarray):
                nbytes, addr = t.nbytes, t.__array_interface__["data"][0]
            elif t.device.type != "cpu" or t.layout != torch.strided:
                continue
            else:
                nbytes, addr = t.numel() * t.element_size(), t.data_ptr()
            if nbytes == 0 or self._region_of(addr, nbytes) is not None:
                continue
            rows.append((t, setter, nbytes, total))
            total += _align(nbytes)
        if not rows:
            return obj
        with self._mu:
            self._ensure()
            region = self._alloc(total)
        for t, setter, nbytes, off in rows:
            if isinstance(t, np.ndarray):
                dst = np.frombuffer(region.buf, dtype=t.dtype, count=t.size, offset=off).reshape(t.shape)
                np.copyto(dst, t)
                restore = (lambda setter, dst: lambda: setter(dst.copy()))(setter, dst)
            else:
                dst = torch.frombuffer(region.buf, dtype=torch.uint8, count=nbytes, offset=off)
                dst = dst.view(t.dtype).view(t.shape)
                with torch.no_grad():
                    dst.copy_(t)
                restore = (lambda setter, dst: lambda: setter(dst.clone()))(setter, dst)
            setter(dst)
            self._own.shared.append(restore)
        return obj

    # ---- guard, list, status, close ----

    def guard(self, optimizer):
        """Before each optimizer.step(), make it wait until the last save is
        released. For a save of device tensors only, that is a wait on the GPU:
        the current CUDA stream (torch's, else the stream the save was fenced
        on) waits on an event the sidecar records after its copy, and the CPU
        goes on (the lazy wait); a save with host tensors waits on the CPU.
        A failed save only warns here (training goes on; wait_durable raises it).
        Returns the hook's RemovableHandle."""

        done = [None]  # the id of the last save waited for: once per save
        # A weak reference: the optimizer's hook must not keep the Checkpointer
        # alive (a collected one is closed; the hook then does nothing).
        ref = weakref.ref(self)

        def hook(opt, args, kwargs):
            ck = ref()
            h = ck._last if ck is not None else None
            if h is not None and h.id != done[0]:
                done[0] = h.id
                try:
                    if h.cuda_stream is not None:
                        h.wait_copy_on_stream(_current_stream())
                    else:
                        h.wait_released()
                except SidecarError as e:
                    warnings.warn(f"checkpoint of step {h.step} failed: {e}")
            return None

        return optimizer.register_step_pre_hook(hook)

    def wait_released(self, timeout=None):
        """Wait until the trainer may change the tensors of the last save (no-op without one)."""
        self._live_client()
        if self._last is not None:
            self._last.wait_released(timeout)

    def list(self):
        """Committed steps, oldest first."""
        steps, _ = self._list()
        return steps

    def latest(self):
        """The newest committed step, or None."""
        return self._list()[1]

    def _list(self):
        L = N.lib()
        with self._mu:
            self._ensure()
            n, latest = ctypes.c_size_t(), ctypes.c_int64()
            N.check(L.ckpt_list(self._client, None, 0, ctypes.byref(n), ctypes.byref(latest)))
            while True:
                cap = n.value + 16
                arr = (ctypes.c_uint64 * cap)()
                st = L.ckpt_list(self._client, arr, cap, ctypes.byref(n), ctypes.byref(latest))
                if st != N.E_TRUNCATED:
                    N.check(st)
                    break
            return [arr[i] for i in range(n.value)], (None if latest.value < 0 else latest.value)

    def rollback(self, step):
        """Make the committed checkpoint `step` the newest again, for a run
        that resumed from it (after a loss spike, or when `latest` fell back
        past a damaged checkpoint): the sidecar moves `latest` to `step`,
        then un-commits every later step, crash-safely, after the saves this
        Checkpointer sent before. Later steps can then be saved anew (without
        a rollback, saving a committed step raises). Returns how many steps
        were un-committed; raises NotFound when `step` is not committed."""
        L = N.lib()
        with self._mu:
            self._ensure()
            self._forget_unchanged()
            n = ctypes.c_size_t()
            N.check(L.ckpt_rollback(self._client, step_arg(step), ctypes.byref(n)))
            return n.value

    def _forget_unchanged(self):
        """incremental="trust-version": what earlier saves proved is forgotten
        (load_into writes some tensors without a version bump; a rollback
        un-commits the steps flags would name): the next save copies all."""
        if self._trust is not None:
            self._trust.forget()
            for r in self._save_regions:
                _trust.clear_slots(r)

    def status(self):
        """The sidecar's status report (dict)."""
        import json

        L = N.lib()
        with self._mu:
            self._ensure()
            n = ctypes.c_size_t()
            N.check(L.ckpt_status_json(self._client, None, 0, ctypes.byref(n)))
            buf = ctypes.create_string_buffer(n.value + 1)
            N.check(L.ckpt_status_json(self._client, buf, n.value + 1, ctypes.byref(n)))
            return json.loads(buf.value.decode())

    def connected(self):
        return self._client is not None and bool(N.lib().ckpt_connected(self._client))

    def close(self):
        """Wait until pending saves are taken, move share()'d tensors back to
        private memory, say goodbye, and stop a spawned sidecar (its pipe closed:
        it commits what it took, then exits; close() waits for that). Idempotent.
        (In a forked child it only forgets: all of it is the parent's.)"""
        with self._mu:
            self._finalizer.detach()
            try:
                _release(self._own)
            finally:
                self._regions, self._region_ptrs, self._free, self._save_regions = [], [], [], []
                self._load_region = None
                self._load_pool = []  # the mappings live on in the tensors that use them
        _live.discard(self)

    def preempted(self):
        """True once SIGTERM arrived, for a Checkpointer made with
        preemption=True (the C shim's flag, ckpt_preempted(): one per process):
        save a last checkpoint and exit."""
        return bool(N.lib().ckpt_preempted())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LoadedInto(int):
    """What load_into() did: the step loaded (this int itself, also `step`),
    `source` ("ram" or "disk") and, named as torch's load_state_dict names
    them, `missing_keys` (tensors of the state the checkpoint lacks) and
    `unexpected_keys` (tensors of the checkpoint the state lacks); both are
    empty unless strict=False."""

    def __new__(cls, step, source, missing_keys, unexpected_keys):
        self = super().__new__(cls, step)
        self.step, self.source = step, source
        self.missing_keys, self.unexpected_keys = missing_keys, unexpected_keys
        return self

    def __repr__(self):
        return (
            f"LoadedInto(step={self.step}, source={self.source!r}, missing_keys={self.missing_keys}, "
            f"unexpected_keys={self.unexpected_keys})"
        )


def _dtype_name(dt):
    """A dtype as a user reads it: numpy and torch dtypes of the same values
    have the same name ("float32"); a non-native numpy one its code (">f4")."""
    if isinstance(dt, np.dtype):
        return dt.name if dt.isnative or dt.itemsize == 1 else dt.str
    return str(dt).replace("torch.", "")


def _leaf_nbytes(ref, obj):
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if ref.kind == "torch":
        return obj.numel() * obj.element_size()
    return int(np.prod(ref.shape, dtype=np.int64)) * np.dtype(ref.dtype).itemsize


def _index_checkable(ref):
    """Whether the checkpoint's index alone says a leaf's dtype: not one
    safetensors lacks (stored as U8 bytes, the real dtype in the skeleton)."""
    return ref.stored != "U8" or _dtype_name(ref.dtype) == "uint8"


def _stored_shape(ref, obj):
    """The shape save() gives leaf `obj` in the checkpoint's index ([nbytes]
    for a dtype safetensors lacks, stored as U8)."""
    if ref.stored != "U8" or _dtype_name(ref.dtype) == "uint8":
        return [int(d) for d in ref.shape]
    return [_leaf_nbytes(ref, obj)]


def _names(names, most=8):
    shown = ", ".join(repr(n) for n in names[:most])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > most else ''}]"


def _match_state(mine, infos, refs, step, strict):
    """load_into's check of the state's leaves `mine` ({name: (ref, obj)})
    against checkpoint `step`'s tensors `infos` (and the skeleton's `refs`,
    when known): (missing_keys, unexpected_keys), or InvalidArgument naming
    the first tensor that differs (or, with `strict`, the names either
    lacks)."""
    have = {name: (dt, shape) for name, dt, shape, _ in infos}
    for name, (ref, obj) in mine.items():
        if name not in have:
            continue
        dt, shape = have[name]
        r = refs.get(name)
        if r is not None:
            ck = f"{_dtype_name(r.dtype)} {list(r.shape)}"
        elif dt == "U8" and _dtype_name(ref.dtype) != "uint8":
            ck = f"{shape[0] if shape else 0} raw bytes (a dtype safetensors lacks)"
        else:
            ck = f"{ST_NAMES.get(dt, dt)} {list(shape)}"
        st = f"{_dtype_name(ref.dtype)} {list(ref.shape)}"
        if (
            ref.stored != dt
            or _stored_shape(ref, obj) != list(shape)
            or r is not None
            and (_dtype_name(r.dtype) != _dtype_name(ref.dtype) or tuple(r.shape) != tuple(ref.shape))
        ):
            if ck == st:  # the same to the eye: say how each is stored
                ck, st = f"{ck} stored as {dt} {list(shape)}", f"{st} stored as {ref.stored} {_stored_shape(ref, obj)}"
            raise InvalidArgument(
                f"load_into: tensor {name!r} is {ck} in checkpoint {step} but {st} in the state; nothing was loaded"
            )
    missing = sorted(n for n in mine if n not in have)
    unexpected = sorted(n for n in have if n not in mine)
    if strict and (missing or unexpected):
        said = ([f"lacks {len(missing)} tensor(s) of the state {_names(missing)}"] if missing else []) + (
            [f"holds {len(unexpected)} tensor(s) the state lacks {_names(unexpected)}"] if unexpected else []
        )
        raise InvalidArgument(
            f"load_into: checkpoint {step} {' and '.join(said)}; nothing was loaded "
            "(strict=False loads the tensors both hold)"
        )
    return missing, unexpected


def _raw_bytes(v):
    """A loaded array/tensor's bytes in C order, as a uint8 numpy array (None when empty)."""
    if isinstance(v, np.ndarray):
        return np.ascontiguousarray(v).reshape(-1).view(np.uint8) if v.nbytes else None
    if v.numel() == 0:
        return None
    torch = torch_module()
    return v.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _copy_into(ref, obj, src):
    """Copies checkpoint bytes `src` (a uint8 numpy array in C order, checked
    to be the leaf's size) into leaf `obj` in place, through its strides."""
    if ref.kind == "np":
        np.copyto(obj, src.view(obj.dtype).reshape(obj.shape), casting="no")
        return
    torch = torch_module()
    raw = torch.from_numpy(src)
    if raw.data_ptr() % obj.element_size():
        raw = raw.clone()  # not aligned to the element size: torch cannot view it
    # copy_ through a detached alias: autograd's version counter moves as for
    # any in-place write, and a Parameter's requires_grad does not refuse it.
    obj.detach().copy_(raw.view(obj.dtype).view(obj.shape))


def _collect_slots(obj, slots, torch):
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if isinstance(v, np.ndarray) and not v.dtype.hasobject:
            slots.append((v, (lambda o, k: lambda t: o.__setitem__(k, t))(obj, k)))
        elif torch is not None and isinstance(v, torch.Tensor):
            slots.append((v.detach(), (lambda o, k: lambda t: o.__setitem__(k, t))(obj, k)))
        elif isinstance(v, (dict, list)):
            _collect_slots(v, slots, torch)


def _collect_refs(skel, out):
    if isinstance(skel, TensorRef):
        out[skel.name] = skel
    elif isinstance(skel, dict):
        for v in skel.values():
            _collect_refs(v, out)
    elif isinstance(skel, (list, tuple)):
        for v in skel:
            _collect_refs(v, out)


ST_TO_NP = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "U16": np.uint16,
    "F16": np.float16,
    "I32": np.int32,
    "U32": np.uint32,
    "F32": np.float32,
    "F64": np.float64,
    "I64": np.int64,
    "U64": np.uint64,
    "BF16": np.uint16,
    "F8_E4M3": np.uint8,
    "F8_E5M2": np.uint8,
}


# Index dtypes by the names numpy and torch give them (load_into's messages).
ST_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def _plain_array(buf, off, dt, shape, nbytes, view=False):
    """A tensor of a checkpoint without our skeleton: a numpy array (BF16/F8 as
    raw uint16/uint8) over `buf` (a region's ctypes array, or a load's lease)
    at `off`; a copy unless `view`."""
    dtype = np.dtype(ST_TO_NP[dt])
    if nbytes == 0:
        return np.zeros(shape, dtype)
    a = np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=off).reshape(shape)
    return a if view else a.copy()


def _restore(ref, buf, off, nbytes, map_location, view=False):
    """Leaf `ref` of the skeleton from the `nbytes` at `off` of `buf`: a copy,
    or with `view` an array/tensor over `buf` itself (it keeps `buf` alive)."""
    # A "cuda" leaf (a __cuda_array_interface__ object) comes back as a numpy array.
    if ref.kind in ("np", "cuda"):
        dtype = ref.dtype
        if nbytes == 0:
            return np.zeros(ref.shape, dtype)
        if ref.stored == "U8" and dtype != np.uint8:
            raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=off)
            return (raw if view else raw.copy()).view(dtype).reshape(ref.shape)
        a = np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=off).reshape(ref.shape)
        return a if view else a.copy()
    torch = torch_module()
    if torch is None:
        import torch  # noqa: F811  (the checkpoint holds torch tensors)
    dtype = getattr(torch, ref.dtype)
    if nbytes == 0:
        t = torch.empty(ref.shape, dtype=dtype)
    else:
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=off)
        if not view or off % max(dtype.itemsize, 1):
            raw = raw.clone()  # a copy asked for, or bytes not aligned to the element size
        t = raw.view(dtype).reshape(ref.shape)
    extra = ref.extra or {}
    dev = extra.get("device", "cpu") if map_location is None else map_location
    if str(dev) != "cpu":
        t = t.to(dev)
    if extra.get("param"):
        t = torch.nn.Parameter(t, requires_grad=extra.get("requires_grad", True))
    elif extra.get("requires_grad"):
        t.requires_grad_(True)
    return t


def capture_rng():
    """RNG states: Python random, numpy's global RandomState, torch CPU and each CUDA device."""
    st = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = torch_module()
    if torch is not None:
        st["torch"] = torch.get_rng_state()
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                st["cuda"] = torch.cuda.get_rng_state_all()
        except Exception:
            pass
    return st


def restore_rng_state(st):
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "torch" in st:
        import torch

        torch.set_rng_state(st["torch"])
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda"])


@atexit.register
def _close_all():
    for ck in list(_live):
        try:
            ck.close()
        except Exception as e:  # at exit: say it, never raise
            print(f"ckpt_sidecar: close at exit: {e}", file=sys.stderr)
