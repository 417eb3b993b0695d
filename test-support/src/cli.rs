//! The sidecar's command line, run once to the end: `ckpt-sidecar ARGS`
//! with its exit code and what it printed. `CKPT_SIDECAR_LOG` is removed so
//! a developer's log level never changes what a test reads.

use std::ffi::OsStr;
use std::process::Command;

/// What one run of `ckpt-sidecar ARGS` said.
#[derive(Debug)]
pub struct CliRun {
    /// The exit code (a run ended by a signal fails the test instead).
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl CliRun {
    /// The exit code and stdout followed by stderr: for checks that do not
    /// care which stream a line went to.
    pub fn joined(self) -> (i32, String) {
        (self.code, self.stdout + &self.stderr)
    }
}

/// Runs [`crate::bin::sidecar_bin`] with `args` and waits for it.
pub fn cli<S: AsRef<OsStr>>(args: &[S]) -> CliRun {
    let o = Command::new(crate::bin::sidecar_bin())
        .args(args)
        .env_remove("CKPT_SIDECAR_LOG")
        .output()
        .expect("run ckpt-sidecar");
    let code = o.status.code().unwrap_or_else(|| panic!("ckpt-sidecar killed by a signal: {:?}", o.status));
    CliRun {
        code,
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}
