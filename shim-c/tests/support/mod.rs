//! Helpers the shim's tests share: where cargo put the binaries and the
//! library, the C compiler, and process output for assertion messages.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// target/<profile>: where `cargo build` puts the ckpt-sidecar binary.
pub fn profile_dir() -> PathBuf {
    std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().to_path_buf()
}

/// target/<profile>/deps: where `cargo test` builds libckpt.so for this test
/// binary (it is copied up to target/<profile> only by `cargo build`, so the
/// one there may be stale).
pub fn lib_dir() -> PathBuf {
    std::env::current_exe().unwrap().parent().unwrap().to_path_buf()
}

/// The real sidecar binary, or None (the test prints `skipped:`) when it is not built.
pub fn sidecar_bin() -> Option<PathBuf> {
    let p = profile_dir().join("ckpt-sidecar");
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: {} not built (cargo build --release first)", p.display());
        None
    }
}

/// The C compiler ($CC or cc), or None (the test prints `skipped:`).
pub fn cc() -> Option<String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&cc).arg("--version").output() {
        Ok(o) if o.status.success() => Some(cc),
        _ => {
            eprintln!("skipped: no C compiler ({cc})");
            None
        }
    }
}

/// A process's status and output, for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
