//! The ABI's integers: the status code every call returns (`CKPT_OK` or a
//! negative `CKPT_E_*`), the values of the save-state and load-source
//! enumerations, and the map from a client [`Error`] to its status code.
//!
//! Invariant: every [`Error`] variant and every sidecar [`ErrorCode`] maps
//! to exactly one status (the matches are exhaustive), and a value once in
//! the header never changes its meaning.

use std::ffi::c_int;

use ckpt_wire::ErrorCode;

use crate::error::Error;

/// Success.
pub const CKPT_OK: c_int = 0;
/// A bad argument: NULL where a value is needed, invalid UTF-8, unknown enum value.
pub const CKPT_E_INVALID: c_int = -1;
/// No sidecar listens at the socket path.
pub const CKPT_E_CONNECT: c_int = -2;
/// The sidecar refused the handshake (uid, magic) or speaks another protocol version.
pub const CKPT_E_REFUSED: c_int = -3;
/// The sidecar went away (exited, killed); a later call reconnects when one is back.
pub const CKPT_E_DISCONNECTED: c_int = -4;
/// The timeout passed first.
pub const CKPT_E_TIMEOUT: c_int = -5;
/// Creating or mapping shared memory failed.
pub const CKPT_E_SHM: c_int = -6;
/// A tensor is not inside memory from `ckpt_alloc`, or the sidecar rejected a region.
pub const CKPT_E_REGION: c_int = -7;
/// No such checkpoint, tensor, blob, region or save id.
pub const CKPT_E_NOT_FOUND: c_int = -8;
/// The sidecar rejected the request (names, dtypes, sizes, overlaps, step already taken).
pub const CKPT_E_BAD_REQUEST: c_int = -9;
/// A checkpoint on disk is damaged (checksum mismatch).
pub const CKPT_E_DAMAGED: c_int = -10;
/// An I/O error in the sidecar (disk full, EIO, read-only file system).
pub const CKPT_E_IO: c_int = -11;
/// The checkpoint can never fit the sidecar's staging budget.
pub const CKPT_E_TOO_LARGE: c_int = -12;
/// The sidecar is shutting down.
pub const CKPT_E_SHUTTING_DOWN: c_int = -13;
/// The sidecar sent something this shim does not expect.
pub const CKPT_E_PROTOCOL: c_int = -14;
/// A caller's buffer is too small; the needed length was stored.
pub const CKPT_E_TRUNCATED: c_int = -15;
/// The client was closed, or belongs to the parent of this (forked) process.
pub const CKPT_E_CLOSED: c_int = -16;
/// A CUDA driver call failed, or there is no CUDA driver (ckpt_register_cuda, ckpt_save_on_stream).
pub const CKPT_E_CUDA: c_int = -17;
/// A bug inside libckpt (a caught panic); the message says where.
pub const CKPT_E_PANIC: c_int = -99;

/// Save state (ckpt_poll): the sidecar has not released the tensors yet.
pub const CKPT_PENDING: c_int = 0;
/// Save state, and what ckpt_wait can wait for: the tensors may change again.
pub const CKPT_RELEASED: c_int = 1;
/// Save state, and what ckpt_wait can wait for: the checkpoint is committed on disk.
pub const CKPT_DURABLE: c_int = 2;
/// Save state: the save failed; ckpt_wait on it returns the error.
pub const CKPT_FAILED: c_int = 3;
/// Save state, and what ckpt_wait can wait for: the checkpoint is committed
/// on the sidecar's drain target (`--drain URL`) too (protocol 13). ckpt_poll
/// says so only once a wait for it returned.
pub const CKPT_REPLICATED: c_int = 4;

/// Load source (ckpt_load): the sidecar still held the checkpoint in memory.
pub const CKPT_SOURCE_RAM: c_int = 1;
/// Load source (ckpt_load): the checkpoint was read (and verified) from disk.
pub const CKPT_SOURCE_DISK: c_int = 2;
/// Load source (ckpt_load): the checkpoint was read (and verified) from the
/// sidecar's drain target (`--drain URL`; protocol 15).
pub const CKPT_SOURCE_DRAIN: c_int = 3;

fn code_status(code: ErrorCode) -> c_int {
    match code {
        ErrorCode::BadRequest => CKPT_E_BAD_REQUEST,
        ErrorCode::BadRegion => CKPT_E_REGION,
        ErrorCode::NotFound => CKPT_E_NOT_FOUND,
        ErrorCode::Damaged => CKPT_E_DAMAGED,
        ErrorCode::Io => CKPT_E_IO,
        ErrorCode::ShuttingDown => CKPT_E_SHUTTING_DOWN,
        ErrorCode::TooLarge => CKPT_E_TOO_LARGE,
    }
}

/// The status code of an error (the C ABI's view of [`Error`]).
pub fn status_of(e: &Error) -> c_int {
    match e {
        Error::InvalidArgument(_) => CKPT_E_INVALID,
        Error::Connect { .. } => CKPT_E_CONNECT,
        Error::Refused { .. } | Error::Version { .. } | Error::Handshake { .. } => CKPT_E_REFUSED,
        Error::Disconnected { .. } => CKPT_E_DISCONNECTED,
        Error::Timeout { .. } => CKPT_E_TIMEOUT,
        Error::Region(crate::region::RegionError::BadLength { .. }) => CKPT_E_INVALID,
        Error::Region(_) => CKPT_E_SHM,
        Error::OutsideRegion { .. } => CKPT_E_REGION,
        Error::UnknownRegion { .. } | Error::UnknownSave { .. } | Error::NoSuchBlob { .. } => CKPT_E_NOT_FOUND,
        Error::SaveFailed { code, .. } | Error::Remote { code, .. } => code_status(*code),
        Error::Protocol(_) => CKPT_E_PROTOCOL,
        Error::Truncated { .. } => CKPT_E_TRUNCATED,
        Error::Closed | Error::Forked { .. } => CKPT_E_CLOSED,
        Error::Cuda(_) => CKPT_E_CUDA,
    }
}
