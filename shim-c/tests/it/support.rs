//! Helpers the shim's tests share: where cargo put the library, the C
//! compiler, and process output for assertion messages.

use std::path::PathBuf;
use std::process::{Command, Output};

/// target/<profile>/deps: where `cargo test` builds libckpt.so for this test
/// binary (it is copied up to target/<profile> only by `cargo build`, so the
/// one there may be stale).
pub fn lib_dir() -> PathBuf {
    std::env::current_exe().unwrap().parent().unwrap().to_path_buf()
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
