"""SidecarError and one subclass per CKPT_E_* status of the C shim (include/ckpt.h)."""

from __future__ import annotations


class SidecarError(Exception):
    """A failure of the sidecar or of the native shim.

    `code` is the CKPT_E_* status (negative int), `message` the text of
    ckpt_last_error() (the sidecar's or the shim's own words).
    """

    code: int | None = None

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class InvalidArgument(SidecarError, ValueError):
    code = -1


class ConnectFailed(SidecarError, ConnectionError):
    """No sidecar listens at the socket path."""

    code = -2


class Refused(SidecarError):
    code = -3


class Disconnected(SidecarError, ConnectionError):
    """The sidecar went away; a later call reconnects once one is back."""

    code = -4


SidecarGone = Disconnected


class Timeout(SidecarError, TimeoutError):
    code = -5


class ShmError(SidecarError):
    code = -6


class RegionError(SidecarError):
    code = -7


class NotFound(SidecarError, LookupError):
    code = -8


class BadRequest(SidecarError):
    code = -9


class Damaged(SidecarError):
    code = -10


class IOFailed(SidecarError):
    """Disk full, EIO, read-only file system: that checkpoint failed."""

    code = -11


class TooLarge(SidecarError):
    code = -12


class ShuttingDown(SidecarError):
    code = -13


class ProtocolError(SidecarError):
    code = -14


class Truncated(SidecarError):
    code = -15


class Closed(SidecarError):
    code = -16


class CudaError(SidecarError):
    """A CUDA driver call of the trainer's side failed, or there is no CUDA driver."""

    code = -17


class Panic(SidecarError):
    code = -99


BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        ConnectFailed,
        Refused,
        Disconnected,
        Timeout,
        ShmError,
        RegionError,
        NotFound,
        BadRequest,
        Damaged,
        IOFailed,
        TooLarge,
        ShuttingDown,
        ProtocolError,
        CudaError,
        Truncated,
        Closed,
        Panic,
    )
}


def error_for(code: int, message: str | None) -> SidecarError:
    """The exception for status `code` (SidecarError itself for an unknown code)."""
    cls = BY_CODE.get(code, SidecarError)
    return cls(message or f"ckpt status {code}", code)
