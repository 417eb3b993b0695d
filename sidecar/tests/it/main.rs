//! The sidecar's integration tests, one test binary (rust-analyzer's
//! `tests/it` layout: one link step, one place for what the modules share).
//! Each module drives the real `ckpt-sidecar` binary, found by
//! [`ckpt_test_support::sidecar_bin`], through its command line or its
//! socket; the harness (the daemon, a raw wire client, shared memory, the
//! command line) lives once in `ckpt-test-support`.
//!
//! Run one module with `cargo test --release -p ckpt-sidecar --test it nodes::`.

mod corruption;
mod crash;
mod daemon;
mod damage;
mod drain;
mod fallbacks;
mod incremental;
mod misuse;
mod nodes;
mod ranks;
mod read_only;
mod remote_cli;
mod tenants;
mod timeline;

/// The harness finds the binary cargo built for these tests.
#[test]
fn the_harness_runs_the_binary_cargo_built_for_these_tests() {
    assert_eq!(ckpt_test_support::sidecar_bin(), std::path::Path::new(env!("CARGO_BIN_EXE_ckpt-sidecar")));
}
