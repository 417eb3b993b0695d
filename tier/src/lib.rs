//! ckpt-tier: the drain tier. A committed step's files uploaded to a
//! `file://` directory or an object store (`s3://bucket/prefix`), its index
//! last (the remote commit), then `latest`; listed and read back.
//!
//! The remote layout mirrors the local one (docs/format.md, "Drain target"):
//!
//! ```text
//! <prefix>/step-000000000003/<shard files, blobs/...>          uploaded first
//! <prefix>/step-000000000003/model.safetensors.index.json      uploaded last: the remote commit
//! <prefix>/latest                                              the newest replicated step
//! ```
//!
//! so a `file://R` target is an ordinary checkpoint directory. The API is
//! blocking: a small tokio runtime lives inside each [`Target`] (shared by
//! its clones); call it from plain threads, never from inside a runtime.

pub mod bench;
mod config;
mod error;
mod limiter;
mod target;

pub use config::*;
pub use error::TierError;
pub use limiter::TokenBucket;
pub use target::{
    fetch_ranges, local_files, remote_index_json, HeldBytes, LocalFile, Target, TargetOptions, UploadStats,
};
