//! ckpt-sidecar: the checkpoint sidecar daemon (docs/protocol.md, server
//! side), over the storage engine `ckpt-store`.
//!
//! [`server`] (socket, handshake), [`session`] (one thread per client),
//! [`regions`] (client memory the sidecar maps: host shm and CUDA device
//! allocations), [`cuda_probe`] (what the CUDA driver probe found),
//! [`snapshot`] (check and copy a save into [`staging`]), [`committer`]
//! (writes and commits in order), [`load`] (restores into client memory),
//! [`state`] (what the threads share), [`fd_socket`] (the session's socket
//! keeping descriptors passed with SCM_RIGHTS), [`jobs`] (what goes to the
//! committer), [`peer`] (replies to one client), [`file_save`] (one file at
//! a client's path, for the torch.save hook), [`incremental`] (links and
//! history of incremental checkpoints) and [`daemon`] (serve, launch,
//! signals). See ARCHITECTURE.md for the map.

pub mod committer;
pub mod config;
pub mod cuda_probe;
pub mod coordinator;
pub mod daemon;
pub mod drain;
pub mod fd_socket;
pub mod faults;
pub mod file_save;
pub mod incremental;
pub mod jobs;
pub mod load;
pub mod metrics;
pub mod nodes;
pub mod peer;
pub mod regions;
pub mod remote_step;
pub mod save_plan;
pub mod server;
pub mod session;
pub mod slices;
pub mod snapshot;
pub mod staging;
pub mod state;
pub mod torch_zip;
pub mod unchanged;
