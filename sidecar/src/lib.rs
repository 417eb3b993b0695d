//! ckpt-sidecar: a checkpoint sidecar for deep-learning training.
//!
//! This crate is the storage engine and the `ckpt-sidecar` binary. The path
//! of a checkpoint through it: a [`image::Layout`] places tensors into
//! safetensors shards laid out in staging memory ([`mem::AlignedBuf`]); the
//! [`commit::Store`] writes them with an [`io`] engine per target directory
//! and commits atomically; [`restore`] reads and verifies them back;
//! [`recovery`] and [`retention`] keep the directories clean. See
//! ARCHITECTURE.md for the map and docs/format.md for the format.
//!
//! The daemon (docs/protocol.md, server side): [`server`] (socket,
//! handshake), [`session`] (one thread per client), [`regions`] (client shm),
//! [`snapshot`] (check and copy a save into [`staging`]), [`committer`]
//! (writes and commits in order), [`load`] (restores into client memory),
//! [`state`] (what they share), [`file_save`] (one file at a client's path,
//! for the torch.save hook) and [`daemon`] (serve, launch, signals).

pub mod bench;
pub mod bench_stall;
pub mod catalog;
pub mod commit;
pub mod committer;
pub mod config;
pub mod daemon;
pub mod file_save;
pub mod format;
pub mod image;
pub mod io;
pub mod load;
pub mod mem;
pub mod recovery;
pub mod regions;
pub mod restore;
pub mod retention;
pub mod server;
pub mod session;
pub mod snapshot;
pub mod staging;
pub mod state;
pub mod synthetic;
