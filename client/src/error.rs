//! The client's errors: one variant per way a call can fail, each with text
//! a trainer's operator can act on. The C ABI maps each to a `CKPT_E_*`
//! status code (`ckpt_shim::ffi::status_of`) and its Display text to `ckpt_last_error()`.

use std::path::PathBuf;

use ckpt_wire::ErrorCode;

use crate::region::RegionError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("no sidecar at {path}: {source} (is `ckpt-sidecar serve` or `launch` running, and is CKPT_SIDECAR_SOCKET right?)")]
    Connect { path: PathBuf, source: std::io::Error },
    #[error("the sidecar at {path} refused this client: {reason}")]
    Refused { path: PathBuf, reason: String },
    #[error("the sidecar at {path} speaks protocol version {theirs}, this shim speaks {ours}: use matching versions")]
    Version { path: PathBuf, ours: u32, theirs: u32 },
    #[error("handshake with the sidecar at {path} failed: {detail}")]
    Handshake { path: PathBuf, detail: String },
    #[error("sidecar gone: {reason}")]
    Disconnected { reason: String },
    #[error("timed out after {timeout_ms} ms waiting for {what}")]
    Timeout { what: String, timeout_ms: u64 },
    #[error(transparent)]
    Region(#[from] RegionError),
    #[error("tensor {name:?}: {len_bytes} bytes at address {ptr:#x} are not inside one region allocated by this client (use ckpt_alloc / alloc_region memory)")]
    OutsideRegion { name: String, ptr: usize, len_bytes: u64 },
    #[error("no region of this client at address {ptr:#x}")]
    UnknownRegion { ptr: usize },
    #[error("save {save_id} is unknown to this client (never issued, or forgotten: only the newest finished saves are remembered)")]
    UnknownSave { save_id: u64 },
    /// `what`: "step N", or "file PATH" for a save_file.
    #[error("save of {what} failed ({code:?}): {reason}")]
    SaveFailed { what: String, code: ErrorCode, reason: String },
    #[error("the sidecar answered {code:?}: {message}")]
    Remote { code: ErrorCode, message: String },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("no blob named {name:?} in the last load")]
    NoSuchBlob { name: String },
    #[error("buffer of {cap_bytes} bytes is too small for {len_bytes} bytes")]
    Truncated { len_bytes: u64, cap_bytes: u64 },
    /// A CUDA driver call of the trainer's side failed, or there is no driver.
    #[error("CUDA: {0}")]
    Cuda(#[from] ckpt_cuda::CudaError),
    #[error("the client is closed")]
    Closed,
    #[error(
        "this client was connected by process {owner_pid}, not this one (a fork): connect a new client in the child"
    )]
    Forked { owner_pid: u32 },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
