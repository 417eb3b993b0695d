//! ckpt-client: the trainer's side of the sidecar (docs/protocol.md) as a
//! safe Rust API.
//!
//! - [`client`]: connect, allocate shared-memory regions, save (asynchronous:
//!   released, then durable), wait/poll, load, list, status, reconnect after
//!   a sidecar restart.
//! - [`region`]: POSIX shared-memory segments (the only `unsafe`).
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
