"""The save key of a list of numpy arrays, read natively (libckpt's
ckpt_py_arrays_key, include/ckpt.h): each array's data pointer, shape,
strides and dtype object in one pass over the list, instead of Python
attribute reads that make a new tuple each (`_tree._bulk`: five passes of
about 0.05 us per array each, most of a cached save of many arrays).

The function reads CPython's list and numpy's array structs as laid out in
their public headers. It is used only once it has read sample arrays
exactly as their attributes describe them (`_self_check`), and is called
through ctypes.PyDLL: the GIL is held, so no array changes under it.
Anything else (no library, another layout, a subclass in the list) makes
`arrays_key` return None and the caller keys the list in Python.
"""

import ctypes
import sys
import threading

import numpy as np

from . import _native as N

_fn = None  # the function once checked, False when unusable
_local = threading.local()  # each thread's output buffer
_HEADER = object.__basicsize__  # sizeof(PyObject): longer on a free-threaded build


def arrays_key(vals):
    """bytes equal for two lists of numpy arrays iff their arrays lie at the
    same addresses with the same shapes, strides and dtype objects, in the
    same order; None when not available or not every item is exactly a
    numpy.ndarray. `vals`: a list."""
    global _fn
    if _fn is None:
        _fn = _load()
    if _fn is False:
        return None
    try:
        return _call(_fn, vals)
    except ctypes.ArgumentError:
        # An argument ctypes could not convert: at the recursion limit (a
        # self-referencing state) it wraps the RecursionError. The caller's
        # own walk then meets the same limit and gives up on the key.
        return None


def _call(fn, vals):
    buf = getattr(_local, "buf", None)
    cap = len(buf) if buf is not None else 0
    n = ctypes.c_size_t()
    rc = fn(vals, _HEADER, np.ndarray, buf, cap, ctypes.byref(n))
    if rc == N.E_TRUNCATED:
        buf = _local.buf = (ctypes.c_uint64 * max(n.value, 2 * cap))()
        rc = fn(vals, _HEADER, np.ndarray, buf, len(buf), ctypes.byref(n))
    if rc != N.OK:
        return None
    return ctypes.string_at(buf, 8 * n.value) if n.value else b""


def _load():
    """The checked function, or False (also without a GIL: another thread
    could then reshape an array while it is read)."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return False
    try:
        lib = ctypes.PyDLL(N.lib()._name)
        fn = lib.ckpt_py_arrays_key
    except (OSError, AttributeError, ImportError):
        return False
    fn.argtypes = [
        ctypes.py_object,
        ctypes.c_size_t,
        ctypes.py_object,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_size_t),
    ]
    fn.restype = ctypes.c_int
    return fn if _self_check(fn) else False


def expected_key(vals):
    """What the key of `vals` must hold, from the arrays' attributes."""
    words = []
    for a in vals:
        words += [a.__array_interface__["data"][0], a.ndim, *a.shape]
        words += [s % (1 << 64) for s in a.strides]
        words.append(id(a.dtype))
    return np.array(words, dtype=np.uint64).tobytes()


class _Sub(np.ndarray):
    """A subclass: not keyed natively (quick_key's walk decides about it)."""


def _self_check(fn):
    """Whether `fn` reads sample arrays (views, reversed, 0-d, empty,
    transposed, several dtypes) as their attributes describe them, and
    refuses a list holding something else."""
    base = np.arange(60, dtype=np.float32).reshape(3, 20)
    samples = [
        base[:, ::3],
        np.arange(7, dtype=np.int16)[::-1],
        np.zeros((), dtype=np.float64),
        np.zeros((2, 0, 4), dtype=np.uint8),
        base.T,
        np.ones(5, dtype=np.complex64),
    ]
    try:
        ok = _call(fn, samples) == expected_key(samples)
        refused = _call(fn, [base, 1]) is None and _call(fn, [base, base.view(_Sub)]) is None
    except (OSError, ValueError, TypeError, ctypes.ArgumentError):
        return False
    return ok and refused
