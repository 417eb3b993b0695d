"""load_into's targets that no load can write as the checkpoint says: an
expanded tensor (a stride 0 over a dimension of several elements, or
strides under which elements may share bytes) and two targets that share
memory without being the very same view of it. Found before anything is
read, so that a refused load_into leaves the state as it was.

The same view twice (tied weights: one tensor under two names, or two
tensors of one address, shape, strides and dtype) is not refused: each name
writes the same bytes, as the checkpoint of a tied model holds them.
Device tensors (contiguous: load_into refuses strided ones) are compared by
their address ranges; host ones exactly (numpy's shares_memory), so views
that interleave without sharing a byte (columns of a fused weight) pass."""

import ctypes

import numpy as np


def _layout(ref, obj, torch):
    """(address, shape, byte strides, itemsize) of a host leaf, or None for
    one with no bytes."""
    if isinstance(obj, np.ndarray):
        if obj.size == 0:
            return None
        return obj.__array_interface__["data"][0], obj.shape, obj.strides, obj.itemsize
    if ref.kind == "torch":
        if obj.numel() == 0:
            return None
        es = obj.element_size()
        return obj.data_ptr(), tuple(obj.shape), tuple(s * es for s in obj.stride()), es
    return None


def _self_overlap(shape, strides, itemsize):
    """Why a leaf's elements may share bytes, or None when they cannot (the
    dimensions of several elements, by increasing stride, each step past the
    bytes all smaller ones span)."""
    dims = sorted((abs(st), n, i) for i, (n, st) in enumerate(zip(shape, strides)) if n > 1)
    extent = itemsize
    for st, n, i in dims:
        if st == 0:
            return f"an expanded view (stride 0 in dimension {i} of {n} elements): its elements share memory"
        if st < extent:
            return f"a view whose elements may share memory (strides {tuple(strides)} bytes, shape {tuple(shape)})"
        extent += st * (n - 1)
    return None


def _host_view(lo, hi, lay):
    """A numpy array over exactly the bytes of a host leaf spanning [lo, hi)
    (its elements as opaque items), for numpy's exact overlap test."""
    addr, shape, strides, itemsize = lay
    base = np.frombuffer((ctypes.c_ubyte * (hi - lo)).from_address(lo), np.uint8)
    return np.ndarray(shape, np.dtype((np.void, itemsize)), buffer=base, offset=addr - lo, strides=strides)


def _shares(a, b):
    """Whether host spans `a` and `b` (whose ranges meet) share a byte."""
    try:
        return np.shares_memory(_host_view(a[0], a[1], a[4]), _host_view(b[0], b[1], b[4]))
    except Exception:  # noqa: BLE001 - numpy's TooHardError: too costly to tell, so taken as shared
        return True


def aliasing_error(leaves, device_leaf, torch):
    """The reason (one line, naming the tensors) why load_into cannot write
    `leaves` ([(ref, obj)]), or None. device_leaf(ref, obj, torch): (address,
    nbytes, contiguous) of a device leaf, else None."""
    spans = []  # (lo, hi, name, identity of the view, host layout or None for device memory)
    for ref, obj in leaves:
        dev = device_leaf(ref, obj, torch)
        if dev is not None:
            if dev[1]:
                spans.append(
                    (dev[0], dev[0] + dev[1], ref.name, ("dev", dev[0], dev[1], ref.shape, str(ref.dtype)), None)
                )
            continue
        lay = _layout(ref, obj, torch)
        if lay is None:
            continue
        why = _self_overlap(*lay[1:])
        if why is not None:
            return f"tensor {ref.name!r} is {why}, which a load cannot write"
        addr, shape, strides, itemsize = lay
        lo = addr + sum(st * (n - 1) for n, st in zip(shape, strides) if st < 0)
        hi = addr + sum(st * (n - 1) for n, st in zip(shape, strides) if st > 0) + itemsize
        spans.append((lo, hi, ref.name, ("host",) + lay[:3] + (str(getattr(obj, "dtype", "")),), lay))
    spans.sort(key=lambda s: s[0])
    open_ = []  # spans whose range reaches past the current one's start
    for s in spans:
        open_ = [o for o in open_ if o[1] > s[0]]
        for o in open_:
            if o[3] == s[3]:
                continue  # the same view twice: tied weights
            if o[4] is None or s[4] is None or _shares(o, s):
                return (
                    f"tensors {o[2]!r} and {s[2]!r} overlap in memory (views of one storage, not the same view): "
                    "a load would write one over the other"
                )
        open_.append(s)
    return None
