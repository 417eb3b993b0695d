"""The shared-memory regions of one client: the table of every region (sorted
by address: which region holds a tensor), the pool of save regions that saves
copy into (at most POOL_REGIONS_MAX, reused so their pages stay warm; a busy
one is free again once the sidecar took its save), and load regions.

A save region is a hand-over region (ckpt_alloc_hand_over): written only
before its save is sent and not again until the sidecar took it, so a save
that reads only such regions commits even if this process dies first.
"""

from __future__ import annotations

import bisect
import ctypes
import numbers
from typing import Any

import numpy as np

from . import _native as N
from . import _trust
from ._connection import SidecarConnection
from ._tree import Flattener
from ._units import count_arg, size_arg
from .errors import SidecarError

ALIGN_BYTES = 64
POOL_REGIONS_MAX = 2  # save regions (busy or free), reused so their pages stay warm
PENDING_PRUNE_AT = 64  # handles remembered before the released or dropped ones are pruned


def align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class LoadRegion:
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


class Region:
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


class RegionTable(SidecarConnection):
    """The regions of a Checkpointer's client (see the module doc)."""

    def _init_regions(self):
        """The empty table, pool and pending list of a new Checkpointer."""
        self._regions = []  # every region of this client, sorted by ptr
        self._regions_gen = 0  # bumped when a region comes or goes (a cached save plan is then stale)
        self._save_plans = []  # the last saves' prepared requests, newest last (see SavePlan)
        self._region_ptrs = []
        self._save_regions = []  # regions for copies at save (at most POOL_REGIONS_MAX)
        self._free = []  # those of them no save in flight uses
        self._load_region = None  # load_tensors' region (copies out of it)
        self._load_pool = []  # load()'s regions (LoadRegion), reused once their tensors are gone
        self._pending = []  # weakrefs of handles not yet known released
        self._pending_prune_at = PENDING_PRUNE_AT  # dead ones are dropped when it grows past this

    def _alloc(self, n, hand_over=False):
        """A new region of n bytes. hand_over: a save region (copies made at
        save, written only before its save is sent and not again until the
        sidecar took it), registered so (ckpt_alloc_hand_over): a save whose
        every tensor lies in such regions commits even if this process dies
        before the sidecar's Released."""
        ptr = ctypes.c_void_p()
        alloc = N.lib().ckpt_alloc_hand_over if hand_over else N.lib().ckpt_alloc
        N.check(alloc(self._client, max(n, 1), ctypes.byref(ptr)))
        r = Region(ptr.value, n)
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
                    r = self._alloc(max(align(n + n // 8), 1 << 20), hand_over=True)
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

    def reserve(self, state_or_bytes: Any, count: int = POOL_REGIONS_MAX) -> None:
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
                align(obj.nbytes if ref.kind == "np" else obj.numel() * obj.element_size()) for ref, obj in fl.leaves
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

    def _drop_load_region(self, r):
        """Frees a load region: the sidecar forgets it, its name goes and
        this process's mapping is unmapped once nothing holds it."""
        r.mm = None
        self._free_region(r.region)

    def _forget_unchanged(self):
        """incremental="trust-version": what earlier saves proved is forgotten
        (load_into writes some tensors without a version bump; a rollback
        un-commits the steps flags would name): the next save copies all."""
        if self._trust is not None:
            self._trust.forget()
            for r in self._save_regions:
                _trust.clear_slots(r)
