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

from __future__ import annotations

import atexit
import builtins
import ctypes
import errno
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from . import _native as N
from . import _trust, dist
from ._connection import live
from ._handles import LoadedInto, SaveHandle
from ._load_into import LoadingInto
from ._owned import Owned, release
from ._regions import align
from ._rng import capture_rng, restore_rng_state
from ._save import Saving
from ._tree import torch_module
from ._units import count_arg, cpus_arg, path_arg, size_arg, step_arg
from .errors import InvalidArgument, SidecarError

__all__ = ["Checkpointer", "LoadedInto", "SaveHandle", "capture_rng", "restore_rng_state"]

_T = TypeVar("_T")

INCREMENTAL_MODES = (None, "digest", "trust-version")  # Checkpointer(incremental=...)


def _current_stream():
    """torch's current CUDA stream handle when torch has CUDA initialized, else None."""
    torch = torch_module()
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_stream().cuda_stream
    return None


class Checkpointer(Saving, LoadingInto):
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

    def __init__(
        self,
        dir: str | os.PathLike[str] | None = None,
        socket: str | os.PathLike[str] | None = None,
        spawn: bool = True,
        keep: int | None = None,
        staging: int | str | None = None,
        log: str | os.PathLike[str] | None = None,
        cpus: str | int | Sequence[int] | None = None,
        preemption: bool = False,
        incremental: str | None = None,
        _private_dir: bool = False,
    ) -> None:
        self._own = Owned()
        # close() and collection both end in release(own) (once); at exit,
        # _close_all closes what is still open (in atexit order: after the
        # hook's files).
        self._finalizer = weakref.finalize(self, release, self._own)
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
        self._init_regions()
        self._last = None
        self._budget = None  # the sidecar's staging budget, once asked (see _check_fits)
        self._mu = threading.RLock()
        self.socket = path_arg("socket", socket) if socket is not None else None
        self._socket_arg = self.socket is not None  # spawn there, not at a private path
        try:
            options = {"keep": keep, "staging": staging, "cpus": cpus, "log": log}
            self._open(dir, spawn, {k: v for k, v in options.items() if v is not None})
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
                release(self._own)
            except BaseException as e2:  # noqa: BLE001 - the constructor's error is the one to raise
                warnings.warn(f"releasing a Checkpointer whose constructor failed ({e}): {e2}")
            raise
        live.add(self)

    def share(self, obj: _T) -> _T:
        """Move the tensors of `obj` (a torch Module's parameters and buffers, or the
        torch tensors / numpy arrays in a dict or list, recursively, replaced in place)
        into shared memory for good: a later save sends them in place and copies
        nothing in the trainer. Returns obj. close() moves them back to private memory."""
        torch = torch_module()
        slots = []  # (tensor or array, setter)
        seen = set()
        if torch is not None and isinstance(obj, torch.nn.Module):
            for mod in obj.modules():
                for p in mod._parameters.values():
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
            total += align(nbytes)
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

    def guard(self, optimizer: Any) -> Any:
        """Before each optimizer.step(), make it wait until the last save is
        released. For a save of device tensors only, that is a wait on the GPU:
        the current CUDA stream (torch's, else the stream the save was fenced
        on) waits on an event the sidecar records after its copy, and the CPU
        goes on (the lazy wait); a save with host tensors waits on the CPU.
        Where the stream cannot wait (the driver refuses the stream wait, or
        the stream captures a CUDA graph) the CPU waits for Released instead:
        a guarded step never runs while the sidecar may still copy.
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
                    if h.cuda_stream is not None:
                        # Never no wait: unless the save is over (this then
                        # raises at once), the step waits on the CPU.
                        try:
                            h._wait(N.RELEASED, None)
                        except SidecarError:
                            pass
                    warnings.warn(f"checkpoint of step {h.step} failed: {e}")
            return None

        return optimizer.register_step_pre_hook(hook)

    def wait_released(self, timeout: float | None = None) -> None:
        """Wait until the trainer may change the tensors of the last save (no-op without one)."""
        self._live_client()
        if self._last is not None:
            self._last.wait_released(timeout)

    def list(self) -> builtins.list[int]:
        """Committed steps, oldest first."""
        steps, _ = self._list()
        return steps

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        return self._list()[1]

    def _list(self) -> tuple[builtins.list[int], int | None]:
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

    def rollback(self, step: int) -> int:
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

    def connected(self) -> bool:
        return self._client is not None and bool(N.lib().ckpt_connected(self._client))

    def close(self) -> None:
        """Wait until pending saves are taken, move share()'d tensors back to
        private memory, say goodbye, and stop a spawned sidecar (its pipe closed:
        it commits what it took, then exits; close() waits for that). Idempotent.
        (In a forked child it only forgets: all of it is the parent's.)"""
        with self._mu:
            self._finalizer.detach()
            try:
                release(self._own)
            finally:
                self._regions, self._region_ptrs, self._free, self._save_regions = [], [], [], []
                self._load_region = None
                self._load_pool = []  # the mappings live on in the tensors that use them
        live.discard(self)

    def preempted(self) -> bool:
        """True once SIGTERM arrived, for a Checkpointer made with
        preemption=True (the C shim's flag, ckpt_preempted(): one per process):
        save a last checkpoint and exit."""
        return bool(N.lib().ckpt_preempted())

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _collect_slots(obj, slots, torch):
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if isinstance(v, np.ndarray) and not v.dtype.hasobject:
            slots.append((v, (lambda o, k: lambda t: o.__setitem__(k, t))(obj, k)))
        elif torch is not None and isinstance(v, torch.Tensor):
            slots.append((v.detach(), (lambda o, k: lambda t: o.__setitem__(k, t))(obj, k)))
        elif isinstance(v, (dict, list)):
            _collect_slots(v, slots, torch)


@atexit.register
def _close_all():
    for ck in list(live):
        try:
            ck.close()
        except Exception as e:  # at exit: say it, never raise
            print(f"ckpt_sidecar: close at exit: {e}", file=sys.stderr)
