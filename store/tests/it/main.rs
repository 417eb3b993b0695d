//! The store's integration tests, one test binary (rust-analyzer's
//! `tests/it` layout): the format pinned by golden files, injected faults
//! during a commit, reading back edge-shaped checkpoints, sliced tensors,
//! incremental commits comparing with the right step, several nodes' parts
//! and their coordinator's commit.
//!
//! Run one module with `cargo test --release -p ckpt-store --test it faults::`.

mod faults;
mod golden;
mod incremental;
mod nodes;
mod restore;
mod slices;
