//! ckpt-sidecar: the checkpoint sidecar daemon (docs/protocol.md, server
//! side), over the storage engine `ckpt-store`. The folders are the stages
//! of a checkpoint, lowest layer first (ARCHITECTURE.md has the map, and
//! `.ci/import-cycles.py` keeps every folder from reaching a later one):
//!
//! - [`config`]: every limit of the daemon (and the engine's, re-exported).
//! - [`memory`]: the one staging buffer, and the client memory the daemon
//!   maps (host shm and CUDA device allocations).
//! - [`reply`]: the sending side of one client's session.
//! - [`state`]: what the daemon's threads share.
//! - [`save`]: a Save checked, planned and copied into staging; files at a
//!   client's path for the torch.save hook.
//! - [`commit`]: the committer thread: writes, ranks, nodes, incremental.
//! - [`drain`]: uploads of durable steps to the drain tier, and loads of
//!   steps it holds.
//! - [`load`]: restores into client memory.
//! - [`scrub`]: the background re-verification of committed steps.
//! - [`daemon`]: serve, launch, the socket, sessions, signals, metrics.

pub mod commit;
pub mod config;
pub mod daemon;
pub mod drain;
pub mod load;
pub mod memory;
pub mod peer;
pub mod priority;
pub mod save;
pub mod scrub;
pub mod state;
