"""ckpt_sidecar: checkpoints through the ckpt-sidecar daemon.

    import ckpt_sidecar as cs
    ck = cs.Checkpointer(dir="ckpt")          # connects, or spawns a private sidecar
    h = ck.save(step, state)                  # returns once sent; tensors copied into shm
    ck.guard(optimizer)                       # optimizer.step() waits for the release
    state = ck.load("latest")

See docs/python.md. The native client is libckpt (shim-c), bundled.
Importing this package is cheap (numpy and the native library load on first use).
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from .errors import (
    BadRequest,
    Closed,
    ConnectFailed,
    CudaError,
    Damaged,
    Disconnected,
    InvalidArgument,
    IOFailed,
    NotFound,
    Panic,
    ProtocolError,
    Refused,
    RegionError,
    ShmError,
    ShuttingDown,
    SidecarError,
    SidecarGone,
    Timeout,
    TooLarge,
    Truncated,
)

if _TYPE_CHECKING:  # what __getattr__ imports on first use, for type checkers and editors
    from .checkpointer import Checkpointer, LoadedInto, SaveHandle, capture_rng, restore_rng_state

__version__ = "0.1.0"

__all__ = [
    "BadRequest",
    "Checkpointer",
    "Closed",
    "ConnectFailed",
    "CudaError",
    "Damaged",
    "Disconnected",
    "IOFailed",
    "InvalidArgument",
    "LoadedInto",
    "NotFound",
    "Panic",
    "ProtocolError",
    "Refused",
    "RegionError",
    "SaveHandle",
    "ShmError",
    "ShuttingDown",
    "SidecarError",
    "SidecarGone",
    "Timeout",
    "TooLarge",
    "Truncated",
    "capture_rng",
    "native_version",
    "restore_rng_state",
]

_LAZY = {
    "Checkpointer": "checkpointer",
    "SaveHandle": "checkpointer",
    "LoadedInto": "checkpointer",
    "capture_rng": "checkpointer",
    "restore_rng_state": "checkpointer",
}


def __getattr__(name: str) -> _Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckpt_sidecar' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def native_version() -> str:
    """libckpt's version string."""
    from . import _native

    return _native.version()
