"""save() and save_file(): the state flattened (_tree) and planned (which
tensors go in place, which are copied into a save region and where), the
copies, then one native request; a SaveHandle comes back at once.

A plan is kept and reused while the state is the same (SAVE_PLANS_MAX of
them); with a world size above 1 each rank sends only its part (dist).
"""

from __future__ import annotations

import ctypes
import gc
import operator
import os
import pickle
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _cuda, _trust, dist
from . import _native as N
from ._blob_names import RNG_BLOB, STRUCTURE_BLOB
from ._handles import SaveHandle
from ._regions import PENDING_PRUNE_AT, RegionTable, align
from ._rng import capture_rng
from ._save_plan import SavePlan, lazy_view
from ._tree import SKELETON_VERSION, Flattener, pickle_skeleton, quick_key, torch_module
from ._units import step_arg
from .errors import InvalidArgument, SidecarError, TooLarge

Buffer = Any  # a bytes-like object (anything memoryview takes)

SAVE_PLANS_MAX = 8  # prepared save requests kept for states saved again (a trainer alternating a few states)


def _is_contiguous(obj):
    """Whether reshape(-1) of a leaf is a view of it (numpy or torch)."""
    if isinstance(obj, np.ndarray):
        return bool(obj.flags.c_contiguous)
    return bool(obj.is_contiguous())


class Saving(RegionTable):
    """The save side of a Checkpointer (see the module doc)."""

    def save(self, step: int, state: Any, rng: bool = False) -> SaveHandle:
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
            c, objs, key = self._kept_plan(state, None)
            if c is None:
                c, objs = self._prepare(state, key)
            blobs_py = [(STRUCTURE_BLOB, c.skeleton)]
            if rng:
                blobs_py.append((RNG_BLOB, pickle.dumps(capture_rng(), protocol=4)))
            return self._send(step, c, objs, blobs_py, t0)

    def _kept_plan(self, state, part):
        """(the kept plan for `state`, its objects now, None), or (None,
        None, the state's quick_key) when no kept plan matches. `part`:
        (rank, world size) of a part plan (_save_part), None for a whole
        save's."""
        # The key's thousands of small tuples are garbage right after the
        # match: with the collector paused they come and go without
        # counting towards a collection (one, with torch's objects
        # around, costs more than the whole save).
        paused = gc.isenabled()
        gc.disable()
        try:
            key = quick_key(state)
            if key is not None:
                for p in reversed(self._save_plans):
                    if (p.part[0] if p.part is not None else None) == part and p.matches(key, self._regions_gen):
                        leaves = key[1]
                        objs = leaves if part is None else [dist.select(leaves[j], cut) for j, cut in p.part[1]]
                        return p, objs, None  # the key freed here, while the collector is paused
            return None, None, key
        finally:
            if paused:
                gc.enable()

    def _save_part(self, step, state, rng, t0):
        """This rank's part of a replicated state (dist.rank_selection): the
        structure once (rank 0), the RNG state per rank, and the slices of
        tensors split between ranks declared by the rank holding each (the
        sidecar writes them into the index). The plan is kept and reused
        while the state is the same, as a whole save's."""
        part = (self.rank, self.world_size)
        c, objs, key = self._kept_plan(state, part)
        if c is None:
            c, objs = self._prepare_part(state, key, part)
        blobs_py = list(c.part[2])
        if rng:
            blobs_py.append((dist.rng_blob_name(self.rank), pickle.dumps(capture_rng(), protocol=4)))
        return self._send(step, c, objs, blobs_py, t0)

    def _prepare_part(self, state, key, part):
        """_save_part's request for `state`, built from scratch: kept for the
        next save when `key`, its quick_key, is not None and every piece of a
        split tensor is a view of it (a piece copied out of a non-contiguous
        tensor lies elsewhere at each save)."""
        fl = Flattener()
        skeleton = fl.walk(state)
        chosen, slices = dist.rank_selection(fl.leaves, *part)
        leaves = [(ref, dist.select(fl.leaves[j][1], cut)) for j, ref, cut in chosen]
        blobs_py = []
        if part[0] == 0:
            blobs_py.append((STRUCTURE_BLOB, pickle_skeleton(SKELETON_VERSION, skeleton)))
        if slices:
            blobs_py.append((dist.SLICES_BLOB, dist.slices_blob(slices)))
        plan, _direct, copy_bytes, streams = self._plan(leaves)
        c = SavePlan(plan, copy_bytes, None, streams)
        c.part = (part, [(j, cut) for j, _ref, cut in chosen], blobs_py)
        objs = [o for _, o in leaves]
        views = key is not None and all(cut is None or _is_contiguous(fl.leaves[j][1]) for j, _ref, cut in chosen)
        self._keep_plan(c, key, [o for _, o in fl.leaves], views)
        return c, objs

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
            c = SavePlan(plan, copy_bytes, None, streams)
            return self._send(step, c, [o for _, o in leaves], blobs_py, t0, stream)

    def _send(self, step, c, objs, blobs_py, t0, stream=None):
        """The copies into a save region, then the request (c: a SavePlan;
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
        c = SavePlan(plan, copy_bytes, pickle_skeleton(SKELETON_VERSION, skeleton), streams)
        objs = [o for _, o in fl.leaves]
        # A plan with device tensors in place is kept too (torch CUDA tensors);
        # libckpt checks at each save that each registered allocation is still
        # the one at its address (its buffer id) and registers anew one freed
        # and replaced (torch.cuda.empty_cache, then a new block there). Their
        # streams are asked again at each save (_send). Interface objects
        # have no quick key.
        self._keep_plan(c, key, objs)
        return c, objs

    def _keep_plan(self, c, key, leaves, keep=True):
        """Keeps plan `c` for the next saves of the state whose quick_key is
        `key` (None: not kept), when `leaves` (the state's leaves as the full
        walk found them) are the key's."""
        if keep and key is not None and len(key[1]) == len(leaves) and all(map(operator.is_, key[1], leaves)):
            c.remember(key, self._regions_gen)
            plans = [p for p in self._save_plans if p.gen == self._regions_gen and p.alive()]
            self._save_plans = (plans + [c])[-SAVE_PLANS_MAX:]

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

    def save_file(self, path: str | os.PathLike[str], data: Buffer) -> SaveHandle:
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
                if region is not None:  # n bytes, n > 0
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

    def save_file_at(self, path: str | os.PathLike[str], ptr: int | None, n: int) -> SaveHandle:
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

    def save_file_pieces(
        self,
        path: str | os.PathLike[str],
        pieces: Sequence[tuple[int, int, bool]],
        stream: int | None,
        torch_zip: bool,
    ) -> SaveHandle:
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
                    and not lazy_view(obj)
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
                copy_bytes += align(row[2])
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
