//! Where cargo put the workspace's binaries, found from the running test
//! binary: an integration test runs from `target/<profile>/deps/`, and
//! `cargo build` puts `ckpt-sidecar` in `target/<profile>/`. Only a test of
//! the ckpt-sidecar crate itself may name it with `env!("CARGO_BIN_EXE_…")`;
//! this works from every crate's tests, and ckpt-sidecar's checks that both
//! agree.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// `target/<profile>`: the folder above the running test binary's `deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary is in target/<profile>/deps");
    deps.parent().expect("deps/ is in target/<profile>").to_path_buf()
}

/// `target/<profile>/ckpt-sidecar`, whether it is built or not (a test of
/// ckpt-sidecar always has it: cargo builds a crate's binaries before its
/// integration tests).
pub fn sidecar_bin() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| profile_dir().join("ckpt-sidecar"))
}

/// [`sidecar_bin`] when it is built, else None after printing `skipped: …`
/// (the tests of another crate run without it when only that crate is built).
pub fn sidecar_bin_if_built() -> Option<&'static Path> {
    let p = sidecar_bin();
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: {} not built (cargo build --release first)", p.display());
        None
    }
}
