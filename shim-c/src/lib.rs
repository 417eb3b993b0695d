//! libckpt: the trainer's side of the sidecar (docs/protocol.md).
//!
//! - [`client`]: the safe Rust client (crate `ckpt-client`, re-exported):
//!   connect, allocate shared-memory regions, save (asynchronous: released,
//!   then durable), wait/poll, load, list, status, reconnect after a sidecar
//!   restart.
//! - [`ffi`]: the C ABI over it, one file per area (`include/ckpt.h`, prefix
//!   `ckpt_`, integer status codes, `ckpt_last_error()`, no panic crosses it).
//! - [`preload`]: what happens when the library is loaded with
//!   `CKPT_SIDECAR_PRELOAD=1` (connect from the environment, SIGTERM becomes
//!   the preemption flag).
//! - [`region`]: POSIX shared-memory segments (`ckpt-client`'s).
//!
//! The preload constructor exists in this crate only, so only libckpt runs
//! it; Rust programs that need the client link `ckpt-client` instead.
//!
//! The messages and framing are the `ckpt-wire` crate's; nothing here
//! re-implements them.

pub use ckpt_client::{client, error, region};

pub mod ffi;
pub mod preload;
pub mod sigterm;

pub use client::{
    default_socket_path, BlobRef, Client, LoadInfo, Region, SaveHandle, SaveState, SaveStatus, ServerInfo, TensorRef,
    Wanted,
};
pub use error::{Error, Result};
pub use region::ShmRegion;
