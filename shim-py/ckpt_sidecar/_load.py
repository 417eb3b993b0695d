"""load() and load_tensors(): the sidecar reads a checkpoint (verified) into
a load region, and the tensors come back as views of it (packed, no copy)
or, for tensors stored in slices, copied out of a per-tensor region; then
the skeleton (_tree) puts the state back together.

A load region is reused by a later load only once every tensor of the last
load from it is gone (LoadRegion's lease): a loaded tensor is never
overwritten by the sidecar.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import pickle
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from . import _native as N
from . import dist
from ._blob_names import PARTS_BLOB, RNG_BLOB, STRUCTURE_BLOB
from ._regions import LoadRegion, RegionTable, align
from ._rng import restore_rng_state
from ._tree import (
    SKELETON_VERSIONS_READ,
    TORCH_TO_ST,
    TensorRef,
    torch_module,
    unflatten,
    unpickle_skeleton,
)
from ._units import step_arg
from .errors import NotFound, SidecarError

LOAD_REGION_MIN_BYTES = 1 << 20  # the first load region's size before the sidecar says what a checkpoint needs
LOAD_TRIES_MAX = 4  # packed loads asked again because the checkpoint needed a larger region
NOT_PLACED = (1 << 64) - 1  # ckpt_loaded_tensor_offset of a tensor not contiguous in the region


class Loading(RegionTable):
    """The load side of a Checkpointer (see the module doc)."""

    def load(self, step: int | str = "latest", map_location: Any = "cpu", restore_rng: bool = False) -> Any:
        """The state saved as `step` ("latest": the newest good one), verified by
        the sidecar; torch tensors where torch tensors were saved, numpy arrays
        where arrays were. A step is an int from 0 to 999999999999.
        map_location: a torch device for torch tensors (None: the device
        they were saved from). Whatever world size saved it, every
        rank gets the whole state (tensors split between ranks come back whole).

        CPU tensors and arrays are views of a shared-memory load region the
        sidecar read the checkpoint into (no copy): the region is reused by a
        later load only once every tensor of this load is gone, so they are
        never overwritten, and they stay valid after close() (LoadRegion)."""
        # A load of many tensors makes as many arrays, refs and containers,
        # all of them kept: collections during it find no garbage, and cost
        # more the more objects there are (10k tensors: 125-212 ms a load
        # with the collector running, 78-94 ms with it paused).
        paused = gc.isenabled()
        gc.disable()
        try:
            with self._mu:
                return self._load_whole(step, map_location, restore_rng)
        finally:
            if paused:
                gc.enable()

    def _load_whole(self, step, map_location, restore_rng):
        """load()'s body (the collector paused)."""
        packed = self._load_packed(step, map_location)
        if packed is None:
            # The per-tensor path asks again: for the step the first ask
            # found (not a newer one committed since), keeping what that
            # ask passed over to find it.
            found, fell_back = self.last_load_step, self.last_load_fell_back
            packed = self._load_tensors(found, None, map_location)
            self.last_load_fell_back = self.last_load_fell_back or fell_back
        got, values, skel, saved_world, parsed = packed
        rng_blob = self._loaded_rng(saved_world) if restore_rng else None
        if skel is None:
            result = values
        else:
            version, skeleton = parsed
            if version not in SKELETON_VERSIONS_READ:
                raise SidecarError(
                    f"checkpoint skeleton version {version}, this package reads {SKELETON_VERSIONS_READ}"
                )
            # The packed path's skeleton has its tensors in place already.
            result = skeleton if values is None else unflatten(skeleton, _leaves_of(values, got))
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
        region = self._alloc(max(align(need), LOAD_REGION_MIN_BYTES))
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
        return LoadRegion(region, mm)

    def _load_packed(self, step, map_location):
        """load() through ckpt_load_packed: the sidecar reads the checkpoint
        straight into a free load region (no copy on either side) and the
        tensors come back as views of it (see LoadRegion for their lifetime).
        None when the checkpoint needs the per-tensor path (tensors stored in
        slices or in pieces by several ranks); otherwise (step, values,
        structure blob, saved world size, the unpickled blob): without a
        structure blob, values is {name: array} and the last two None; with
        one, values is None and the blob is unpickled with its tensors made
        as the unpickler meets them (unpickle_skeleton)."""
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
        names, dtypes, nbytes, offs, shape_of = self._loaded_columns()
        if NOT_PLACED in offs or self._loaded_blob(PARTS_BLOB) is not None:
            return None
        skel = self._loaded_blob(STRUCTURE_BLOB)
        saved_world = self._saved_world_size()
        lease = (ctypes.c_ubyte * max(need.value, 1)).from_buffer(target.mm)
        target.lease = weakref.ref(lease)
        if skel is None:
            values = {
                name: _plain_array(lease, at, dt, shape_of(i), nb, view=True)
                for i, (name, dt, nb, at) in enumerate(zip(names, dtypes, nbytes, offs))
            }
            return got.value, values, None, saved_world, None
        # With a skeleton, a tensor is made when the unpickler meets it (no
        # table of refs is gathered first, no tensor the structure does not
        # name is made). The table lists the tensors in the order they were
        # saved within a dtype, so the unpickler mostly meets the one after
        # the last it found: that is tried first, the index (built at the
        # first miss) only where the order breaks.
        n = len(names)
        made = [None] * n  # a name met twice is one tensor
        index = None
        cursor = 0
        ndarray = np.ndarray

        def leaf(state):
            # state: a TensorRef's (name, kind, dtype, shape, stored, extra).
            nonlocal index, cursor
            name = state[0]
            i = cursor
            if i >= n or names[i] != name:
                if index is None:
                    index = dict(zip(names, range(n)))
                i = index.get(name)
                if i is None:
                    raise NotFound(f"tensor {name!r} of the structure is missing from checkpoint {got.value}", -8)
            cursor = i + 1
            v = made[i]
            if v is None:
                nb = nbytes[i]
                if state[1] == "np" and nb:
                    # _array_at inlined: the hot line of a load of many tensors.
                    v = ndarray(state[3], state[2], lease, offs[i])
                    if v.nbytes != nb:
                        _array_at(lease, offs[i], state[2], state[3], nb)  # raises, naming the sizes
                else:
                    v = _restore(TensorRef(*state), lease, offs[i], nb, map_location, view=True)
                made[i] = v
            return v

        return got.value, None, skel, saved_world, unpickle_skeleton(skel, leaf)

    def load_tensors(
        self, names: Iterable[str], step: int | str = "latest", map_location: Any = "cpu"
    ) -> dict[str, Any]:
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
        size that saved it, the blob unpickled or None); names None: every
        tensor."""
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
        for name, _dt, shape, nbytes in infos:
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
        total = sum(align(i[3]) for i in slots)
        if total and (self._load_region is None or self._load_region.len_bytes < total):
            if self._load_region is not None:
                self._free_region(self._load_region)
            self._load_region = self._alloc(align(total))
        region = self._load_region
        descs = (N.Tensor * max(len(infos), 1))()
        keep, offs, n, off = [], {}, 0, 0
        for name, _dt, _shape, nbytes in slots:
            offs[name] = off
            off += align(nbytes)
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
        parsed = unpickle_skeleton(skel) if skel is not None else None
        if parsed is not None and parsed[0] in SKELETON_VERSIONS_READ:
            collect_refs(parsed[1], refs)
        values = {}
        for name, dt, shape, nbytes in slots:
            if name in refs:
                values[name] = _restore(refs[name], region.buf, offs[name], nbytes, map_location)
            else:
                values[name] = _plain_array(region.buf, offs[name], dt, shape, nbytes)
        return got.value, values, skel, saved_world, parsed

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
        names = {N.SOURCE_RAM: "ram", N.SOURCE_DRAIN: "drain"}
        self.last_load_step, self.last_load_source = step, names.get(source, "disk")
        L = N.lib()
        n = ctypes.c_uint64()
        N.check(L.ckpt_loaded_fell_back(self._client, None, 0, ctypes.byref(n)))
        why = None
        if n.value:
            buf = ctypes.create_string_buffer(n.value)
            N.check(L.ckpt_loaded_fell_back(self._client, buf, n.value, ctypes.byref(n)))
            why = buf.raw[: n.value].decode(errors="replace")
            warnings.warn(
                f"loaded step {step}, not a newer checkpoint that does not load ({why})", RuntimeWarning, stacklevel=4
            )
        self.last_load_fell_back = why

    def _loaded_tensors(self):
        """[(name, dtype, shape list, len_bytes)] of the last load's tensors."""
        return self._loaded_table()[0]

    def _loaded_table(self):
        """(_loaded_tensors(), each tensor's offset in a packed load's region,
        NOT_PLACED where it was not placed there)."""
        names, dtypes, nbytes, offs, shape_of = self._loaded_columns()
        return [(nm, dt, shape_of(i), nb) for i, (nm, dt, nb) in enumerate(zip(names, dtypes, nbytes))], offs

    def _loaded_columns(self):
        """The last load's table as columns: (names, dtypes, len_bytes,
        offsets as _loaded_table gives them, shape_of(i) -> tensor i's shape
        list), from three native calls whatever the count (a call per
        tensor, or a string read each, cost microseconds per tensor at
        100k tensors)."""
        L = N.lib()
        n = ctypes.c_size_t()
        N.check(L.ckpt_loaded_tensor_count(self._client, ctypes.byref(n)))
        n = n.value
        arr = (N.LoadedTensorInfo * max(n, 1))()
        N.check(L.ckpt_loaded_tensors(self._client, 0, n, arr))
        if not n:
            return [], [], [], [], lambda i: []
        names_p, names_len = ctypes.c_char_p(), ctypes.c_size_t()
        dims_p, n_dims = ctypes.POINTER(ctypes.c_uint64)(), ctypes.c_size_t()
        N.check(
            L.ckpt_loaded_table(
                self._client, ctypes.byref(names_p), ctypes.byref(names_len), ctypes.byref(dims_p), ctypes.byref(n_dims)
            )
        )
        raw = ctypes.string_at(ctypes.cast(names_p, ctypes.c_void_p), names_len.value)
        names = raw[:-1].decode().split("\0")
        # Each distinct dtype is one string on the native side: read once.
        dtype_ptrs = N.field(arr, "dtype", np.uint64).tolist()
        text = {p: ctypes.string_at(p).decode() for p in set(dtype_ptrs)}
        dtypes = [text[p] for p in dtype_ptrs]
        nbytes, offs = N.field(arr, "len_bytes", np.uint64).tolist(), N.field(arr, "offset", np.uint64).tolist()
        ndims = N.field(arr, "ndim", np.uint32)
        dims = np.ctypeslib.as_array(dims_p, (n_dims.value,)).tolist() if n_dims.value else []
        starts = np.concatenate(([0], np.cumsum(ndims, dtype=np.int64))).tolist()
        if len(names) != n or starts[-1] != len(dims):
            raise SidecarError(f"the load's table is inconsistent: {len(names)} names, {len(dims)} dims, {n} tensors")

        def shape_of(i):
            return dims[starts[i] : starts[i + 1]]

        return names, dtypes, nbytes, offs, shape_of

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


def _leaves_of(values, got):
    """unflatten's leaf for tensors already made, {name: value}: NotFound
    for one the structure names that is not there."""

    def leaf(ref):
        v = values.get(ref.name)
        if v is None:
            raise NotFound(f"tensor {ref.name!r} of the structure is missing from checkpoint {got}", -8)
        return v

    return leaf


def collect_refs(skel, out):
    if isinstance(skel, TensorRef):
        out[skel.name] = skel
    elif isinstance(skel, dict):
        for v in skel.values():
            collect_refs(v, out)
    elif isinstance(skel, (list, tuple)):
        for v in skel:
            collect_refs(v, out)


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
ST_NAMES = {st: name for name, st in TORCH_TO_ST.items()}


def _plain_array(buf, off, dt, shape, nbytes, view=False):
    """A tensor of a checkpoint without our skeleton: a numpy array (BF16/F8 as
    raw uint16/uint8) over `buf` (a region's ctypes array, or a load's lease)
    at `off`; a copy unless `view`."""
    dtype = np.dtype(ST_TO_NP[dt])
    if nbytes == 0:
        return np.zeros(shape, dtype)
    a = _array_at(buf, off, dtype, shape, nbytes)
    return a if view else a.copy()


def _array_at(buf, off, dtype, shape, nbytes):
    """The array of `dtype` and `shape` over the `nbytes` at `off` of `buf`
    (it keeps `buf` alive): one constructor call, a third of what
    frombuffer + reshape cost; ValueError when the shape's bytes are not
    `nbytes`."""
    a = np.ndarray(shape, dtype, buf, off)
    if a.nbytes != nbytes:
        raise ValueError(f"a tensor of shape {tuple(shape)} and dtype {dtype} is {a.nbytes} bytes, not {nbytes}")
    return a


# Torch dtypes (by name) as the numpy dtype of the bytes they are stored
# as: the same dtype where numpy has it, else unsigned integers of its size.
_TORCH_AS_NP = {name: np.dtype(ST_TO_NP[st]) for name, st in TORCH_TO_ST.items()}


def _restore(ref, buf, off, nbytes, map_location, view=False):
    """Leaf `ref` of the skeleton from the `nbytes` at `off` of `buf`: a copy,
    or with `view` an array/tensor over `buf` itself (it keeps `buf` alive)."""
    # A "cuda" leaf (a __cuda_array_interface__ object) comes back as a numpy array.
    if ref.kind in ("np", "cuda"):
        if nbytes == 0:
            return np.zeros(ref.shape, ref.dtype)
        # Stored as raw bytes ("U8") or as itself, the array is its bytes.
        a = _array_at(buf, off, ref.dtype, ref.shape, nbytes)
        return a if view else a.copy()
    torch = torch_module()
    if torch is None:
        import torch  # noqa: F811  (the checkpoint holds torch tensors)
    dtype = getattr(torch, ref.dtype)
    if nbytes == 0:
        t = torch.empty(ref.shape, dtype=dtype)
    elif view and not off % max(dtype.itemsize, 1) and ref.dtype in _TORCH_AS_NP:
        # A numpy array of the same bytes handed to torch: a quarter of what
        # frombuffer + view + reshape cost (1.1 against 4.6 us a tensor).
        t = torch.from_numpy(_array_at(buf, off, _TORCH_AS_NP[ref.dtype], ref.shape, nbytes))
        if t.dtype != dtype:
            t = t.view(dtype)  # the bits of a dtype numpy lacks (bfloat16, float8)
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
