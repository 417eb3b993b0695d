//! Opening files for the engines, with O_DIRECT or buffered, and the random
//! part of temp names.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Want;

/// Opens for reading with O_DIRECT as `want` says; with `Auto`, a file
/// system that refuses O_DIRECT (EINVAL) gets a buffered open instead.
/// Returns the file and whether it is direct.
pub fn open_for_read_with(path: &Path, want: Want) -> io::Result<(File, bool)> {
    if want == Want::Off {
        return Ok((open_for_read(path, false)?, false));
    }
    match open_for_read(path, true) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) && want == Want::Auto => {
            Ok((open_for_read(path, false)?, false))
        }
        Err(e) => Err(e),
    }
}

/// Creates a new file (never truncates one that exists).
pub fn open_for_write(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.write(true).create_new(true).mode(0o644);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

pub fn open_for_read(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// A random 64-bit value for temp names (getrandom; the pid and clock if it fails).
pub fn nonce() -> u64 {
    let mut v = 0u64;
    // SAFETY: writes at most 8 bytes into v.
    let n = unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, 0) };
    if n != 8 {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        v = t ^ ((std::process::id() as u64) << 32) ^ COUNTER.fetch_add(1, Ordering::Relaxed);
    }
    v
}
