"""A save's prepared request (`SavePlan`): the descriptor array handed to
ckpt_save, the pickled skeleton, and where each tensor not sent in place is
copied in a save region. The Checkpointer keeps the plans of its last saves
and reuses one while the state it is given is the same (_tree.quick_key)."""

import ctypes
import weakref

import numpy as np

from . import _native as N
from . import _trust


class SavePlan:
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
        "part",
        "__weakref__",
    )

    def __init__(self, plan, copy_bytes, skeleton, streams=()):
        self.n = len(plan)
        self.descs = (N.Tensor * max(self.n, 1))()
        self.copies = []  # (descriptor = leaf index, nbytes, offset in the save region, ref, src address or None)
        self.copy_bytes, self.skeleton = copy_bytes, skeleton
        self.streams = list(streams)  # the CUDA stream device tensors in place were written on (at most one)
        self.tensor_bytes = sum(r[2] for r in plan)
        self.leaf_refs = [r[0] for r in plan]
        self.trust_names = None  # _trust.names_of
        # A rank's part (_save_part): ((rank, world size), [(leaf index, cut)]
        # choosing its leaves from the state's, its blobs but the RNG's).
        self.part = None
        self.inplace = False
        self.host_inplace = False  # a host tensor sent in place (the sidecar copies it after the device ones)
        self.dev = []  # (index, ref) of the device tensors sent in place: their streams are asked at each save
        ptrs = [0] * self.n
        for i, (ref, obj, nbytes, _shape, where) in enumerate(plan):
            if isinstance(where, int):
                ptrs[i] = where
                self.inplace = self.inplace or bool(nbytes)
                if not nbytes:
                    pass
                elif ref.kind == "cuda" or (ref.kind == "torch" and obj.is_cuda):
                    self.dev.append((i, ref))
                else:
                    self.host_inplace = True
            else:
                # ptrs[i] stays 0: set at each save (the save region may differ)
                self.copies.append((i, nbytes, where[1], ref, _flat_address(ref, obj, nbytes)))
        self.keep = _pack_descs(self.descs, plan, ptrs)
        # The descriptors' data fields, as one uint64 array (updated in bulk).
        self.data_view = N.field(self.descs, "data", np.uint64) if self.n else None
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


def _pack_descs(descs, plan, ptrs):
    """Fills the ckpt_tensor_t array `descs` from `plan` ([(ref, obj, nbytes,
    shape, where)]) and `ptrs` (each tensor's address), with every name and
    dtype in one NUL-separated buffer and every shape in one uint64 array,
    in descriptor order: the native side's pass over them then reads memory
    in sequence, not a scattered object per string (at 10k tensors the
    cache misses were most of ckpt_save). Returns what the descriptors point
    into, to be kept alive with them."""
    n = len(plan)
    if not n:
        return []
    names = [ref.name.encode() for ref, *_ in plan]
    dtype_at = {}  # a dtype's offset in the text: each stored once
    for ref, *_ in plan:
        dtype_at.setdefault(ref.stored, None)
    text = bytearray(b"\0".join(names))
    text.append(0)
    for dt in dtype_at:
        dtype_at[dt] = len(text)
        text += dt.encode() + b"\0"
    ndims = np.fromiter((len(r[3]) for r in plan), dtype=np.uint64, count=n)
    # One spare slot at the end: a 0-d tensor's shape points at it (never NULL).
    dims = (ctypes.c_uint64 * (int(ndims.sum()) + 1))()
    flat = np.ndarray((len(dims),), dtype=np.uint64, buffer=dims)
    flat[:-1] = np.fromiter((d for r in plan for d in r[3]), dtype=np.uint64, count=len(dims) - 1)
    buf = (ctypes.c_char * len(text)).from_buffer(text)
    base = ctypes.addressof(buf)
    lens = np.fromiter(map(len, names), dtype=np.uint64, count=n)
    name_at = np.zeros(n, dtype=np.uint64)
    np.cumsum(lens[:-1] + 1, out=name_at[1:])
    dim_at = np.zeros(n, dtype=np.uint64)
    np.cumsum(ndims[:-1], out=dim_at[1:])
    dim_at[ndims == 0] = len(dims) - 1
    N.field(descs, "name", np.uint64)[:] = base + name_at
    N.field(descs, "dtype", np.uint64)[:] = np.fromiter(
        (base + dtype_at[r[0].stored] for r in plan), dtype=np.uint64, count=n
    )
    N.field(descs, "shape", np.uint64)[:] = ctypes.addressof(dims) + 8 * dim_at
    N.field(descs, "ndim", np.uint32)[:] = ndims
    N.field(descs, "data", np.uint64)[:] = ptrs
    N.field(descs, "len_bytes", np.uint64)[:] = [r[2] for r in plan]
    return [text, buf, dims]


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
    return obj.data_ptr() if obj.device.type == "cpu" and obj.is_contiguous() and not lazy_view(obj) else None


def lazy_view(t):
    """A torch tensor whose memory holds other values than it has: a lazy
    conjugate (`z.conj()`) or negative view; its bytes must be resolved by a
    copy, never taken as they lie."""
    return t.is_conj() or t.is_neg()
