"""ctypes over libckpt (shim-c, include/ckpt.h): the one native client.

The library is the one bundled in ckpt_sidecar/_native/ by the build
(setup.py); $CKPT_SIDECAR_LIB overrides it (tests of a fresh build). Every
call goes through `check`, which turns a negative status into the matching
SidecarError subclass carrying ckpt_last_error(). ctypes releases the GIL
around each foreign call, so a wait does not block other Python threads.
"""

import ctypes
import os
from pathlib import Path

from .errors import error_for

NATIVE_DIR = Path(__file__).resolve().parent / "_native"

OK = 0
PENDING, RELEASED, DURABLE, FAILED, REPLICATED = 0, 1, 2, 3, 4
SOURCE_RAM, SOURCE_DISK, SOURCE_DRAIN = 1, 2, 3
E_TRUNCATED = -15


class Tensor(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_uint64)),
        ("ndim", ctypes.c_uint32),
        ("data", ctypes.c_void_p),
        ("len_bytes", ctypes.c_uint64),
    ]


class FilePiece(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("len_bytes", ctypes.c_uint64)]


FILE_AS_IS, FILE_TORCH_ZIP = 0, 1  # ckpt_save_file_pieces' finish
TENSOR_UNCHANGED = 1  # ckpt_save_flagged's per-tensor flag


class Blob(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("data", ctypes.c_void_p), ("len_bytes", ctypes.c_uint64)]


class LoadedTensorInfo(ctypes.Structure):
    """ckpt_loaded_tensor_info: one tensor of the last load (ckpt_loaded_tensors)."""

    _fields_ = [
        ("name", ctypes.c_void_p),
        ("dtype", ctypes.c_void_p),
        ("shape", ctypes.c_void_p),
        ("ndim", ctypes.c_uint32),
        ("len_bytes", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
    ]


def field(arr, name, dtype):
    """Field `name` of every entry of the ctypes structure array `arr`, as a
    numpy array over it (writes land in the entries): a pass over thousands
    of entries at C speed, not a Python step each."""
    import numpy as np

    kind = arr._type_
    return np.ndarray(
        (len(arr),), dtype=dtype, buffer=arr, offset=getattr(kind, name).offset, strides=(ctypes.sizeof(kind),)
    )


_lib = None


def library_path():
    env = os.environ.get("CKPT_SIDECAR_LIB")
    if env:
        return Path(env)
    return NATIVE_DIR / "libckpt.so"


def sidecar_binary():
    """The ckpt-sidecar binary to spawn: $CKPT_SIDECAR_BIN (a fresh build; it
    overrides, as $CKPT_SIDECAR_LIB does for the library), else the bundled
    one, else PATH."""
    import shutil

    env = os.environ.get("CKPT_SIDECAR_BIN")
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(f"$CKPT_SIDECAR_BIN is {env!r}, which is not a file")
        return env
    bundled = NATIVE_DIR / "ckpt-sidecar"
    if bundled.exists():
        return str(bundled)
    found = shutil.which("ckpt-sidecar")
    if found:
        return found
    raise FileNotFoundError(
        "no ckpt-sidecar binary: no $CKPT_SIDECAR_BIN, not bundled (pip install ./shim-py), none on PATH"
    )


def lib():
    global _lib
    if _lib is not None:
        return _lib
    path = library_path()
    preloaded = None if os.environ.get("CKPT_SIDECAR_LIB") else _preloaded()
    if preloaded is not None:
        # `ckpt-sidecar launch --preload` put libckpt into this process already:
        # use that copy rather than load a second one with its own state.
        path = preloaded
    elif not path.exists():
        raise ImportError(
            f"{path} missing: install the package with `pip install ./shim-py` "
            "(it builds the native shim), or set CKPT_SIDECAR_LIB"
        )
    L = path if isinstance(path, ctypes.CDLL) else ctypes.CDLL(str(path))
    for name, (args, res) in _signatures().items():
        fn = getattr(L, name)
        fn.argtypes = args
        fn.restype = res
    _lib = L
    return L


def _signatures():
    """libckpt's functions: {name: (argument types, result type)} (include/ckpt.h)."""
    c = ctypes
    P = c.c_void_p
    return {
        "ckpt_version": ([], c.c_char_p),
        "ckpt_protocol_version": ([], c.c_uint32),
        "ckpt_last_error": ([], c.c_char_p),
        "ckpt_connect": ([c.c_char_p, c.POINTER(P)], c.c_int),
        "ckpt_close": ([P], c.c_int),
        "ckpt_reconnect": ([P], c.c_int),
        "ckpt_connected": ([P], c.c_int),
        "ckpt_set_timeout": ([P, c.c_int64], c.c_int),
        "ckpt_set_lazy_release": ([P, c.c_int], c.c_int),
        "ckpt_set_rank": ([P, c.c_uint32, c.c_uint32], c.c_int),
        "ckpt_alloc": ([P, c.c_uint64, c.POINTER(P)], c.c_int),
        "ckpt_alloc_hand_over": ([P, c.c_uint64, c.POINTER(P)], c.c_int),
        "ckpt_free": ([P, P], c.c_int),
        "ckpt_save": (
            [P, c.c_uint64, c.POINTER(Tensor), c.c_size_t, c.POINTER(Blob), c.c_size_t, c.POINTER(c.c_uint64)],
            c.c_int,
        ),
        "ckpt_save_file": ([P, c.c_char_p, P, c.c_uint64, c.POINTER(c.c_uint64)], c.c_int),
        "ckpt_save_file_pieces": (
            [P, c.c_char_p, c.POINTER(FilePiece), c.c_size_t, P, c.c_int, c.POINTER(c.c_uint64)],
            c.c_int,
        ),
        "ckpt_wait": ([P, c.c_uint64, c.c_int, c.c_int64], c.c_int),
        "ckpt_wait_replicated": ([P, c.c_uint64, c.c_int64], c.c_int),
        "ckpt_wait_peers": ([P, c.c_uint64, c.c_int64], c.c_int),
        "ckpt_poll": ([P, c.c_uint64, c.POINTER(c.c_int)], c.c_int),
        "ckpt_save_figures": (
            [P, c.c_uint64, c.POINTER(c.c_double), c.POINTER(c.c_double), c.POINTER(c.c_double)],
            c.c_int,
        ),
        "ckpt_load": (
            [P, c.c_int64, c.POINTER(Tensor), c.c_size_t, c.POINTER(c.c_uint64), c.POINTER(c.c_int)],
            c.c_int,
        ),
        "ckpt_load_packed": (
            [P, c.c_int64, P, c.c_uint64, c.POINTER(c.c_uint64), c.POINTER(c.c_int), c.POINTER(c.c_uint64)],
            c.c_int,
        ),
        "ckpt_loaded_tensor_offset": ([P, c.c_size_t, c.POINTER(c.c_uint64)], c.c_int),
        "ckpt_region_name": ([P, P, c.c_char_p, c.c_size_t, c.POINTER(c.c_size_t)], c.c_int),
        "ckpt_loaded_blob": ([P, c.c_char_p, P, c.c_uint64, c.POINTER(c.c_uint64)], c.c_int),
        "ckpt_loaded_fell_back": ([P, P, c.c_uint64, c.POINTER(c.c_uint64)], c.c_int),
        "ckpt_loaded_tensor_count": ([P, c.POINTER(c.c_size_t)], c.c_int),
        "ckpt_loaded_tensors": ([P, c.c_size_t, c.c_size_t, c.POINTER(LoadedTensorInfo)], c.c_int),
        "ckpt_loaded_table": (
            [P, c.POINTER(c.c_char_p), c.POINTER(c.c_size_t), c.POINTER(c.POINTER(c.c_uint64)), c.POINTER(c.c_size_t)],
            c.c_int,
        ),
        "ckpt_loaded_tensor": (
            [
                P,
                c.c_size_t,
                c.POINTER(c.c_char_p),
                c.POINTER(c.c_char_p),
                c.POINTER(c.POINTER(c.c_uint64)),
                c.POINTER(c.c_uint32),
                c.POINTER(c.c_uint64),
            ],
            c.c_int,
        ),
        "ckpt_list": ([P, c.POINTER(c.c_uint64), c.c_size_t, c.POINTER(c.c_size_t), c.POINTER(c.c_int64)], c.c_int),
        "ckpt_status_json": ([P, c.c_char_p, c.c_size_t, c.POINTER(c.c_size_t)], c.c_int),
        "ckpt_rollback": ([P, c.c_uint64, c.POINTER(c.c_size_t)], c.c_int),
        "ckpt_preempted": ([], c.c_int),
        "ckpt_install_sigterm_handler": ([], c.c_int),
        "ckpt_cuda_probe": ([], c.c_int),
        "ckpt_register_cuda": ([P, P, c.POINTER(c.c_uint32)], c.c_int),
        "ckpt_register_cuda_range": ([P, P, c.c_uint64, c.POINTER(c.c_uint32)], c.c_int),
        "ckpt_unregister_cuda": ([P, P], c.c_int),
        "ckpt_save_flagged": (
            [
                P,
                c.c_uint64,
                c.POINTER(Tensor),
                c.c_size_t,
                c.POINTER(c.c_uint32),
                c.c_int64,
                c.POINTER(Blob),
                c.c_size_t,
                P,
                c.POINTER(c.c_uint64),
            ],
            c.c_int,
        ),
        "ckpt_save_on_stream": (
            [P, c.c_uint64, c.POINTER(Tensor), c.c_size_t, c.POINTER(Blob), c.c_size_t, P, c.POINTER(c.c_uint64)],
            c.c_int,
        ),
        "ckpt_stream_wait_copy": ([P, c.c_uint64, P, c.c_int64, c.POINTER(c.c_int)], c.c_int),
    }


def _preloaded():
    """The process's global symbols when they include libckpt (LD_PRELOAD), else None."""
    if "libckpt" not in os.environ.get("LD_PRELOAD", ""):
        return None
    try:
        g = ctypes.CDLL(None)
        g.ckpt_protocol_version  # noqa: B018 (AttributeError when absent)
        return g
    except (AttributeError, OSError):
        return None


def last_error():
    msg = lib().ckpt_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(status):
    """Raise the SidecarError subclass for a negative status; return it otherwise."""
    if status < 0:
        raise error_for(status, last_error())
    return status


def version():
    return lib().ckpt_version().decode()
