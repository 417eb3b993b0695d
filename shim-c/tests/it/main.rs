//! The shim's integration tests, one test binary (rust-analyzer's
//! `tests/it` layout): the Rust client and the C ABI against a fake sidecar
//! ([`common`]), and against the real `ckpt-sidecar` binary; the kill
//! tests; the checked-in C header. What the modules share about the build
//! (where cargo put libckpt, the C compiler) is in [`support`]. The CUDA
//! path with the fake driver is a binary of its own, `tests/cuda_fake`.
//!
//! Run one module with `cargo test --release -p ckpt-shim --test it kill::`.

mod c_abi;
mod client;
mod common;
mod header;
mod kill;
mod real_sidecar;
mod support;
