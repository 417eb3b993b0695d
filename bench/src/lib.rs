//! ckpt-bench: benchmarks that drive a real sidecar process through the real
//! client, as a trainer would. They live apart from the daemon so that the
//! `ckpt-sidecar` binary links no client code; `ckpt-sidecar bench stall`
//! runs the `ckpt-bench` binary installed beside it.

pub mod incremental;
pub mod stall;
