//! ckpt-client: the trainer's side of the sidecar (docs/protocol.md) as a
//! safe Rust API.
//!
//! - [`client`]: connect, allocate shared-memory regions, save (asynchronous:
//!   released, then durable), wait/poll, load, list, status, reconnect after
//!   a sidecar restart.
//! - [`region`]: POSIX shared-memory segments.
//! - [`done_word`]: the page-locked word a trainer's stream waits on for a
//!   device save's copy.
//! - [`error`]: the client's [`Error`].
//!
//! `unsafe` lives in `region`, `done_word` and the client's socket writes
//! (descriptor passing) and fork handler, each behind a safe API.
//!
//! This crate runs nothing at load time. libckpt (crate `ckpt-shim`) is the
//! C ABI over it and alone holds the preload constructor, so a Rust program
//! that links this crate (a benchmark, a tool) never acts as a preloaded
//! trainer. The messages and framing are the `ckpt-wire` crate's.

pub mod client;
pub mod done_word;
pub mod error;
pub mod region;

pub use client::{
    default_socket_path, BlobRef, Client, CudaRegion, LoadInfo, Region, SaveHandle, SaveState, SaveStatus, ServerInfo,
    TensorRef, Wanted,
};
pub use error::{Error, Result};
pub use region::ShmRegion;
