//! ckpt-sidecar: a checkpoint sidecar for deep-learning training.
//!
//! This crate is the storage engine and the `ckpt-sidecar` binary. The path
//! of a checkpoint through it: a [`image::Layout`] places tensors into
//! safetensors shards laid out in staging memory ([`mem::AlignedBuf`]); the
//! [`commit::Store`] writes them with an [`io`] engine per target directory
//! and commits atomically; [`restore`] reads and verifies them back;
//! [`recovery`] and [`retention`] keep the directories clean. See
//! ARCHITECTURE.md for the map and docs/format.md for the format.

pub mod bench;
pub mod catalog;
pub mod commit;
pub mod config;
pub mod format;
pub mod image;
pub mod io;
pub mod mem;
pub mod recovery;
pub mod restore;
pub mod retention;
pub mod synthetic;
