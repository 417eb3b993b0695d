"""Flattening a nested state into named arrays + a picklable skeleton, and back.

A leaf that is a numpy array (not object dtype), a strided torch tensor or
an object exposing `__cuda_array_interface__` (kind "cuda") becomes a
`TensorRef` in the skeleton and a named entry in the tensor list;
dicts (and OrderedDict), lists, tuples and namedtuples are walked; anything
else stays in the skeleton as is (pickled). Names are the path in the
structure joined with ".", made valid and unique for docs/format.md.
"""

import functools
import io
import operator
import pickle
import sys
from collections import OrderedDict

import numpy as np

from . import _native_key
from ._cuda import interface as cuda_interface

# The skeleton blob (structure.pkl) is the pickled (version, skeleton).
# Version 2: each tensor is a pickle persistent id, the state tuple of its
# TensorRef, so one pass of the unpickler rebuilds the state with the
# tensors in place (unpickle_skeleton). Version 1: TensorRef objects,
# replaced by a walk after the unpickle (still read).
SKELETON_VERSION = 2
SKELETON_VERSIONS_READ = (1, 2)
NAME_BYTES_MAX = 1024

# safetensors dtypes the sidecar stores (docs/format.md).
NP_TO_ST = {
    ("b", 1): "BOOL",
    ("i", 1): "I8",
    ("i", 2): "I16",
    ("i", 4): "I32",
    ("i", 8): "I64",
    ("u", 1): "U8",
    ("u", 2): "U16",
    ("u", 4): "U32",
    ("u", 8): "U64",
    ("f", 2): "F16",
    ("f", 4): "F32",
    ("f", 8): "F64",
}
TORCH_TO_ST = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


class TensorRef:
    """Where a tensor was in the structure. `kind` is "np" or "torch"; `dtype`
    is the numpy dtype or the torch dtype's name; `stored` the safetensors
    dtype it was saved as ("U8" with shape [nbytes] for dtypes safetensors
    lacks: complex, big-endian, datetime, ...)."""

    __slots__ = ("name", "kind", "dtype", "shape", "stored", "extra")

    def __init__(self, name, kind, dtype, shape, stored, extra=None):
        self.name, self.kind, self.dtype, self.shape, self.stored, self.extra = (
            name,
            kind,
            dtype,
            tuple(shape),
            stored,
            extra,
        )

    def __getstate__(self):
        return (self.name, self.kind, self.dtype, self.shape, self.stored, self.extra)

    def __setstate__(self, s):
        self.name, self.kind, self.dtype, self.shape, self.stored, self.extra = s


def torch_module():
    """torch if the process imported it (a torch tensor cannot exist otherwise)."""
    return sys.modules.get("torch")


def _is_namedtuple(x):
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


class Flattener:
    def __init__(self):
        self.leaves = []  # (TensorRef, array or tensor)
        self.names = set()
        self.torch = torch_module()

    def _name(self, path):
        # An empty key (or a path of empty keys) is named like the root; a
        # collision then gets a suffix as any other.
        name = ".".join(path) or "tensor"
        if not name.isprintable():
            name = "".join(ch if ch.isprintable() or ch == " " else "_" for ch in name)
        if name == "__metadata__":
            name = "_" + name
        if len(name.encode()) > NAME_BYTES_MAX - 16:
            name = name.encode()[: NAME_BYTES_MAX - 16].decode("utf-8", "ignore")
        base, n = name, 1
        while name in self.names:
            n += 1
            name = f"{base}#{n}"
        self.names.add(name)
        return name

    def walk(self, obj, path=(), inside=None):
        """The skeleton of `obj`; `inside`: ids of the containers on the way
        here (a container met again inside itself cannot be saved)."""
        if inside is None:
            inside = set()
        if type(obj) in (dict, OrderedDict, list, tuple) or _is_namedtuple(obj):
            if id(obj) in inside:
                raise ValueError(
                    f"state{_where(path)} is a container it is itself inside of: "
                    "a self-referencing state cannot be saved"
                )
            inside = inside | {id(obj)}
        # An ndarray subclass may hold more than its bytes (a masked array's
        # mask, a matrix's type): pickled whole, as it pickles itself. A
        # memmap is its bytes.
        if type(obj) in (np.ndarray, np.memmap) and obj.dtype.kind != "O" and not obj.dtype.hasobject:
            key = (obj.dtype.kind, obj.dtype.itemsize)
            native = obj.dtype.byteorder in ("=", "|", "<") or obj.dtype.itemsize == 1
            stored = NP_TO_ST.get(key) if native else None
            ref = TensorRef(self._name(path), "np", obj.dtype, obj.shape, stored or "U8")
            self.leaves.append((ref, obj))
            return ref
        t = self.torch
        if (
            t is not None
            and isinstance(obj, t.Tensor)
            and obj.layout == t.strided
            and not obj.is_quantized
            and not obj.is_nested
            and obj.device.type != "meta"
        ):
            dname = str(obj.dtype).replace("torch.", "")
            extra = {
                "param": isinstance(obj, t.nn.Parameter),
                "requires_grad": obj.requires_grad,
                "device": str(obj.device),
            }
            ref = TensorRef(self._name(path), "torch", dname, obj.shape, TORCH_TO_ST.get(dname, "U8"), extra)
            self.leaves.append((ref, obj))
            return ref
        cai = cuda_interface(obj)
        if cai is not None:
            # Device memory of another library (CuPy, Numba, ...): saved from
            # the device (_cuda.py), loaded back as a numpy array.
            dt = np.dtype(cai["typestr"])
            native = dt.byteorder in ("=", "|", "<") or dt.itemsize == 1
            stored = NP_TO_ST.get((dt.kind, dt.itemsize)) if native else None
            ref = TensorRef(self._name(path), "cuda", dt, cai["shape"], stored or "U8")
            self.leaves.append((ref, obj))
            return ref
        if type(obj) in (dict, OrderedDict):
            return type(obj)((k, self.walk(v, path + (str(k),), inside)) for k, v in obj.items())
        if type(obj) is list:
            return [self.walk(v, path + (str(i),), inside) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self.walk(v, path + (str(i),), inside) for i, v in enumerate(obj))
        if _is_namedtuple(obj):
            return type(obj)(*(self.walk(v, path + (f,), inside) for f, v in zip(obj._fields, obj)))
        return obj


def _where(path):
    return "".join(f"[{p!r}]" for p in path)


def _unpicklable(skel, path=()):
    """The path of the first value in `skel` that pickle refuses, and its error."""
    if isinstance(skel, TensorRef):
        return None
    if type(skel) in (dict, OrderedDict):
        items = [(str(k), v) for k, v in skel.items()]
    elif type(skel) in (list, tuple):
        items = [(str(i), v) for i, v in enumerate(skel)]
    elif _is_namedtuple(skel):
        items = list(zip(skel._fields, skel))
    else:
        try:
            pickle.dumps(skel, protocol=4)
        except Exception as e:  # noqa: BLE001 - whatever pickle raises is the answer
            return path, e
        return None
    for k, v in items:
        found = _unpicklable(v, path + (k,))
        if found is not None:
            return found
    return None


class _SkeletonPickler(pickle.Pickler):
    """A skeleton's pickler: each TensorRef is a persistent id, its state."""

    def persistent_id(self, obj):
        return obj.__getstate__() if type(obj) is TensorRef else None


def pickle_skeleton(version, skel):
    """The pickled (version, skeleton), its TensorRefs persistent ids (version
    2); an error names where in the state the value pickle refuses lies."""
    try:
        out = io.BytesIO()
        _SkeletonPickler(out, protocol=4).dump((version, skel))
        return out.getvalue()
    except RecursionError:
        raise ValueError(
            "the state is nested too deeply (or refers to itself through an object) to be pickled"
        ) from None
    except Exception as e:  # noqa: BLE001
        found = _unpicklable(skel)
        if found is None:
            raise
        path, err = found
        raise TypeError(
            f"state{_where(path)}: {type(err).__name__}: {err} (only tensors, arrays and picklable values can be saved)"
        ) from e


class _NoKey(Exception):
    pass


# A NumPy 2 array's buffer cannot be rebound (`.data` is read-only), so the
# array object names its address; before 2 the address goes into the key.
_NP_FIXED_BUFFER = int(np.__version__.split(".")[0]) >= 2
_PLAIN = (int, float, complex, str, bytes, bool, type(None))


# A container whose values are all arrays (or all plain torch tensors) is
# described in bulk: a few C-level passes (map) over its values instead of a
# Python step per value. Tagged, so a bulk entry never equals per-value ones.
_BULK_NP, _BULK_TORCH, _BULK_NP_NATIVE = object(), object(), object()
# One attribute per pass: a getter of several builds a tuple per value, slower.
_SHAPE, _STRIDES, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("strides"), operator.attrgetter("dtype")
_DEVICE, _GRAD = operator.attrgetter("device"), operator.attrgetter("requires_grad")
_LAYOUT, _QUANTIZED = operator.attrgetter("layout"), operator.attrgetter("is_quantized")


def quick_key(state):
    """(sig, leaves) for `state`, or None when it holds something only the
    full walk (Flattener) handles. `leaves` are the tensor objects in the
    Flattener's order; `sig` a list equal to another state's sig iff both
    have the same containers with the same keys, the same plain values
    (int, float, str, bytes, bool, None, by type and value), and tensors
    with the same address, shape, strides, dtype, device and kind at each
    place: then the Flattener would produce the same names, skeleton and
    plan. A torch tensor is described by its address (`data_ptr`, cheap), so
    a fresh view of the same memory (model.state_dict() makes new ones at
    each call) matches; a numpy array by its id (its address costs µs to
    ask), which names the same array only while it lives: the caller keeps
    weak references to `leaves` that are arrays and checks them. One pass,
    no per-tensor objects but a small tuple: the cost of a cached save. A
    container whose values are all arrays (or all torch tensors) costs a few
    C-level passes over them (`_bulk`), not a Python step per value."""
    sig, leaves = [], []
    torch = torch_module()
    tensor = torch.Tensor if torch is not None else None
    strided = torch.strided if torch is not None else None
    ndarray, plain = np.ndarray, _PLAIN
    add, leaf = sig.append, leaves.append

    def walk(o):
        tp = type(o)
        if tp is dict or tp is OrderedDict or tp is list or tp is tuple:
            if tp is dict or tp is OrderedDict:
                add((tp, tuple(o)))
                o = list(o.values())
            else:
                add((tp, len(o)))
            if len(o) > 1 and _bulk(o, sig, leaves, torch):
                return
            for v in o:
                # The common leaf inline (a call per tensor is most of the cost).
                if type(v) is ndarray and not v.dtype.hasobject and _NP_FIXED_BUFFER:
                    leaf(v)
                    add((id(v), v.shape, v.strides, v.dtype))
                else:
                    walk(v)
        elif tp is ndarray:
            if o.dtype.hasobject:
                raise _NoKey
            leaf(o)
            add(
                (id(o), o.shape, o.strides, o.dtype)
                if _NP_FIXED_BUFFER
                else (id(o), o.shape, o.strides, o.dtype, o.__array_interface__["data"][0])
            )
        elif tensor is not None and isinstance(o, tensor):
            # A lazy conjugate or negative view shares its base's key but not its values.
            if o.layout is not strided or o.is_quantized or o.device.type == "meta" or o.is_conj() or o.is_neg():
                raise _NoKey
            leaf(o)
            add((tp, o.data_ptr(), o.shape, o.stride(), o.dtype, o.device, o.requires_grad))
        elif tp in plain:
            add((tp, o))
        else:
            raise _NoKey  # namedtuples, subclasses, other objects: the full walk

    try:
        walk(state)
    except (_NoKey, RecursionError):
        return None
    except RuntimeError:  # a tensor without sizes or strides (nested): the full walk decides
        return None
    finally:
        # `walk` refers to itself (its closure holds it, to recurse): a
        # cycle through the closure's cells, which hold `sig`. Broken here,
        # so the key's thousands of tuples are freed when the caller drops
        # it; otherwise every save leaves them to the cycle collector, whose
        # collections then land inside later saves (0.4 ms each for a
        # 1000-tensor state, every other save).
        walk = None  # noqa: F841
    return sig, leaves


@functools.lru_cache(maxsize=1)
def _quantized_dtypes(torch):
    """torch's quantized dtypes (those of this build)."""
    return frozenset(
        getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)
    )


def _bulk(vals, sig, leaves, torch):
    """Describes `vals` (a container's values) in bulk when all are numpy
    arrays (NumPy 2: the id names the buffer) or all plain torch tensors;
    False (nothing added) otherwise. Raises _NoKey for what the per-value
    walk would refuse too. Arrays are keyed natively where libckpt can
    (_native_key: one pass for the addresses, shapes, strides and dtype
    objects), their dtypes asked here (an object dtype has no key, and the
    sig holds the dtype objects, so a dtype address in the native key
    names the same dtype while the sig lives)."""
    if type(vals[0]) is np.ndarray:
        k = _native_key.arrays_key(vals if type(vals) is list else list(vals))
        if k is not None:
            dtypes = frozenset(map(_DTYPE, vals))
            if any(d.hasobject for d in dtypes):
                raise _NoKey
            sig.append((_BULK_NP_NATIVE, k, dtypes))
            leaves.extend(vals)
            return True
    types = set(map(type, vals))
    if len(types) != 1:
        return False
    tp = types.pop()
    if tp is np.ndarray and _NP_FIXED_BUFFER:
        dtypes = tuple(map(_DTYPE, vals))
        if any(d.hasobject for d in set(dtypes)):
            raise _NoKey
        sig.append((_BULK_NP, tuple(map(id, vals)), tuple(map(_SHAPE, vals)), tuple(map(_STRIDES, vals)), dtypes))
    elif torch is not None and tp is torch.Tensor:
        devices = tuple(map(_DEVICE, vals))
        dtypes = tuple(map(_DTYPE, vals))
        kinds, on = set(dtypes), set(devices)
        t = torch.Tensor
        # A quantized tensor has a quantized dtype, and a lazy conjugate a
        # complex one: asked per tensor only when such a dtype is there (each
        # pass costs about 0.1 us per tensor; the common state has neither).
        if (
            set(map(_LAYOUT, vals)) != {torch.strided}
            or (not kinds.isdisjoint(_quantized_dtypes(torch)) and any(map(_QUANTIZED, vals)))
            or any(d.type == "meta" for d in on)
            or (any(d.is_complex for d in kinds) and any(map(t.is_conj, vals)))
            or any(map(t.is_neg, vals))
        ):
            raise _NoKey
        sig.append(
            (
                _BULK_TORCH,
                tuple(map(t.data_ptr, vals)),
                tuple(map(_SHAPE, vals)),
                tuple(map(t.stride, vals)),
                dtypes,
                # Each call makes a new device object, compared by value:
                # one compare, not one per tensor, when all are on one device.
                on.pop() if len(on) == 1 else devices,
                tuple(map(_GRAD, vals)),
            )
        )
    else:
        return False
    leaves.extend(vals)
    return True


def unpickle_skeleton(blob, leaf=None):
    """(version, skeleton) of a skeleton blob, each tensor in it
    leaf(state), `state` its TensorRef's (name, kind, dtype, shape, stored,
    extra): made by the unpickler as it meets each (version 2), or by a walk
    after it (version 1). leaf None: the TensorRef itself."""
    u = pickle.Unpickler(io.BytesIO(blob))
    u.persistent_load = _ref_of if leaf is None else leaf
    version, skel = u.load()
    if leaf is not None and version == 1:
        skel = unflatten(skel, lambda ref: leaf(ref.__getstate__()))
    return version, skel


def _ref_of(state):
    return TensorRef(*state)


def unflatten(skel, leaf):
    """`skel` with every TensorRef replaced by leaf(ref). Containers of the
    walk's kinds are rebuilt as new ones; a leaf is asked inside its
    container's comprehension (no call of this function per tensor: a
    skeleton of 100k tensors is walked at a fraction of a microsecond each)."""
    t = type(skel)
    if t is TensorRef:
        return leaf(skel)
    if t is dict:
        return {k: leaf(v) if type(v) is TensorRef else unflatten(v, leaf) for k, v in skel.items()}
    if t is list:
        return [leaf(v) if type(v) is TensorRef else unflatten(v, leaf) for v in skel]
    if t is tuple:
        return tuple([leaf(v) if type(v) is TensorRef else unflatten(v, leaf) for v in skel])
    if t is OrderedDict:
        return OrderedDict((k, unflatten(v, leaf)) for k, v in skel.items())
    if _is_namedtuple(skel):
        return t(*(unflatten(v, leaf) for v in skel))
    return skel
