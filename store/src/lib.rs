//! ckpt-store: the storage engine of ckpt-sidecar.
//!
//! Everything from staging memory to a committed, verifiable checkpoint on
//! disk, and nothing above it: this crate knows no socket, session, client
//! or region, and depends on neither `ckpt-wire` nor `ckpt-shim`. The path of
//! a checkpoint through it: a [`image::Layout`] places tensors into
//! safetensors shards laid out in staging memory ([`mem::AlignedBuf`], or a
//! [`mem::RawBuf`] shared with copy threads: the store takes its address); the
//! [`commit::Store`] writes them with an [`io`] engine per target directory
//! and commits atomically; [`restore`] reads and verifies them back;
//! [`recovery`] and [`retention`] keep the directories clean; [`rollback`]
//! makes an older checkpoint the head of the timeline again; [`atomic`]
//! writes one file at a path atomically (the torch.save hook's files);
//! [`lock`] makes one process the owner of a directory, and [`read_only`]
//! serves a directory that cannot be written without it. See ARCHITECTURE.md
//! for the map and docs/format.md for the format.

pub mod atomic;
pub mod bench;
pub mod catalog;
pub mod commit;
pub mod config;
pub mod crc;
pub mod digest;
pub mod fetch;
pub mod format;
pub mod image;
pub mod incremental;
mod index_template;
pub mod io;
mod kept_markers;
pub mod lock;
pub mod mem;
pub mod nodes;
pub mod progress;
pub mod ranks;
pub mod read_only;
pub mod recovery;
pub mod restore;
pub mod retention;
pub mod rollback;
pub mod skeleton;
pub mod source;
pub mod synthetic;
pub mod units;
