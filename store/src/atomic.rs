//! Atomic single-file writes: one file at a path, written whole from an
//! aligned buffer through an I/O engine, or not at all.
//!
//! 1. an unnamed file (`O_TMPFILE`) in the destination's directory, with
//!    O_DIRECT where the file system takes it, space reserved first;
//! 2. written through the engine, padding cut, fdatasync'd;
//! 3. linked under a temp name `.<name>.ckpt-tmp-<nonce>` and renamed over
//!    the destination (the commit point), then the directory fsync'd.
//!
//! Invariants: a crash before the rename leaves the destination as it was
//! (old file or none); the temp name exists only between link and rename
//! (or, on a file system without O_TMPFILE, for the whole write) and is
//! removed on any error.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::catalog;
use crate::commit::{CommitError, Store};
use crate::config::{self, DIRECT_ALIGN_BYTES};
use crate::io::{self as eio, DriveError, FileIo, IoEngine, OpKind};
use crate::mem::BufAddr;

/// The temp name's marker, between the destination's name and a nonce.
pub const FILE_TMP_MARKER: &str = ".ckpt-tmp-";

/// Figures of one file write.
#[derive(Debug, Clone)]
pub struct FileReport {
    pub direct: bool,
    /// Creating the file, reserving space and writing.
    pub write: Duration,
    /// fdatasync, link, rename and the directory's fsync.
    pub sync: Duration,
}

impl Store {
    /// Writes one file at `dest` (outside the checkpoint directories)
    /// atomically from `len_bytes` of `staging` at `offset_bytes`, with the
    /// primary directory's engine; see [`write_atomic`].
    pub fn write_file(
        &mut self,
        dest: &Path,
        staging: &dyn BufAddr,
        offset_bytes: u64,
        len_bytes: u64,
    ) -> Result<FileReport, CommitError> {
        let (engine, chunk_bytes) = self.primary_engine(dest)?;
        write_atomic(engine, dest, staging, offset_bytes, len_bytes, chunk_bytes)
    }
}

/// The file being written: unnamed (`O_TMPFILE`), or named where the file
/// system has no O_TMPFILE.
struct TempFile {
    file: File,
    direct: bool,
    named: Option<PathBuf>,
}

fn temp_name(dest: &Path) -> PathBuf {
    let name = dest.file_name().expect("checked: ends in a file name");
    let mut t = std::ffi::OsString::from(".");
    t.push(name);
    t.push(format!("{FILE_TMP_MARKER}{:016x}", eio::nonce()));
    dest.with_file_name(t)
}

/// Opens the temp file in `dir`: O_TMPFILE where supported, O_DIRECT where
/// accepted (EINVAL means refused), falling back one step at a time.
fn open_temp(dest: &Path, dir: &Path) -> io::Result<TempFile> {
    for tmpfile in [true, false] {
        for direct in [true, false] {
            let mut o = OpenOptions::new();
            o.write(true).mode(0o644);
            let mut flags = if direct { libc::O_DIRECT } else { 0 };
            let named = if tmpfile {
                flags |= libc::O_TMPFILE;
                None
            } else {
                o.create_new(true);
                Some(temp_name(dest))
            };
            o.custom_flags(flags);
            match o.open(named.as_deref().unwrap_or(dir)) {
                Ok(file) => return Ok(TempFile { file, direct, named }),
                Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => continue,
                Err(e)
                    if tmpfile
                        && matches!(
                            e.raw_os_error(),
                            Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::ENOENT)
                        ) =>
                {
                    break
                }
                Err(e) => return Err(e),
            }
        }
    }
    Err(io::Error::other("no way to create a temp file"))
}

/// Gives an unnamed file the name `to` (via /proc/self/fd, which needs no
/// privilege; AT_EMPTY_PATH as a fallback where /proc is missing).
fn link_unnamed(f: &File, to: &Path) -> io::Result<()> {
    let to_c = CString::new(to.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let proc = CString::new(format!("/proc/self/fd/{}", f.as_raw_fd())).expect("no NUL");
    // SAFETY: valid NUL-terminated paths; AT_FDCWD as the directories.
    let r =
        unsafe { libc::linkat(libc::AT_FDCWD, proc.as_ptr(), libc::AT_FDCWD, to_c.as_ptr(), libc::AT_SYMLINK_FOLLOW) };
    if r == 0 {
        return Ok(());
    }
    let first = io::Error::last_os_error();
    // SAFETY: an open fd and an empty path with AT_EMPTY_PATH.
    let r = unsafe { libc::linkat(f.as_raw_fd(), c"".as_ptr(), libc::AT_FDCWD, to_c.as_ptr(), libc::AT_EMPTY_PATH) };
    if r == 0 {
        Ok(())
    } else {
        Err(first)
    }
}

/// Writes `len_bytes` of `staging` at `offset_bytes` as the whole content of
/// `dest`, atomically (module comment). The range must be followed by zeroed
/// bytes up to the next block (the lease guarantees it) for O_DIRECT.
pub fn write_atomic(
    engine: &mut dyn IoEngine,
    dest: &Path,
    staging: &dyn BufAddr,
    offset_bytes: u64,
    len_bytes: u64,
    chunk_bytes: usize,
) -> Result<FileReport, CommitError> {
    let t0 = Instant::now();
    let dir = dest.parent().expect("checked: absolute with a file name");
    let tmp = open_temp(dest, dir).map_err(|e| CommitError::io(dir, "create temp file", e))?;
    let mut linked: Option<PathBuf> = tmp.named.clone();
    let r = write_temp(engine, dest, dir, &tmp, staging, offset_bytes, len_bytes, chunk_bytes, &mut linked, t0);
    if r.is_err() {
        if let Some(p) = &linked {
            if let Err(e) = fs::remove_file(p) {
                warn!(path = %p.display(), "could not remove a temp file after a failed write: {e}");
            }
        }
    }
    r
}

#[allow(clippy::too_many_arguments)]
fn write_temp(
    engine: &mut dyn IoEngine,
    dest: &Path,
    dir: &Path,
    tmp: &TempFile,
    staging: &dyn BufAddr,
    offset_bytes: u64,
    len_bytes: u64,
    chunk_bytes: usize,
    linked: &mut Option<PathBuf>,
    t0: Instant,
) -> Result<FileReport, CommitError> {
    let io_len = if tmp.direct { config::align_up(len_bytes, DIRECT_ALIGN_BYTES) } else { len_bytes };
    assert!(offset_bytes + io_len <= staging.len_bytes() as u64, "range outside staging");
    let f = &tmp.file;
    crate::commit::reserve(f, io_len).map_err(|e| {
        CommitError::io(dir, format!("reserve {io_len} bytes for {}", dest.display()), e).needing(io_len)
    })?;
    let fio = FileIo {
        fd: f.as_raw_fd(),
        ptr: staging.as_ptr().wrapping_add(offset_bytes as usize) as *mut u8,
        io_len,
        file_len: len_bytes,
        window_bytes: 0,
    };
    // SAFETY: `staging` is live memory while borrowed (BufAddr's contract),
    // borrowed for the whole call, and the range was checked above against
    // its length; drive() reaps every request before it returns.
    unsafe { eio::drive(engine, OpKind::Write, std::slice::from_ref(&fio), chunk_bytes, |_, _| {}) }
        .map_err(|e| drive_error(dest, e))?;
    if io_len != len_bytes {
        f.set_len(len_bytes).map_err(|e| CommitError::io(dir, format!("truncate padding of {}", dest.display()), e))?;
    }
    let t_sync = Instant::now();
    eio::sync_all(engine, &[f.as_raw_fd()]).map_err(|e| drive_error(dest, e))?;
    if tmp.named.is_none() {
        let name = temp_name(dest);
        link_unnamed(f, &name).map_err(|e| CommitError::io(dir, format!("link temp file as {}", name.display()), e))?;
        *linked = Some(name);
    }
    let from = linked.as_ref().expect("named or linked by now");
    fs::rename(from, dest).map_err(|e| CommitError::io(dir, format!("rename temp file over {}", dest.display()), e))?;
    *linked = None;
    catalog::fsync_dir(dir).map_err(|e| CommitError::io(dir, "sync directory after rename", e))?;
    Ok(FileReport { direct: tmp.direct, write: t_sync - t0, sync: t_sync.elapsed() })
}

fn drive_error(dest: &Path, e: DriveError) -> CommitError {
    let (what, source) = match e {
        DriveError::Io { what, offset_bytes, source, .. } => (format!("{what} at offset {offset_bytes}"), source),
        DriveError::Engine(source) => ("I/O engine".to_string(), source),
        other => ("write".to_string(), io::Error::other(other.to_string())),
    };
    CommitError::io(dest.parent().unwrap_or(dest), format!("{} (temp file of {})", what, dest.display()), source)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::AlignedBuf;

    fn write_with(engine: &mut dyn IoEngine, dest: &Path, bytes: &[u8]) -> FileReport {
        let mut buf = AlignedBuf::new(config::align_up(bytes.len() as u64, 4096).max(4096) as usize).unwrap();
        buf.as_mut_slice()[..bytes.len()].copy_from_slice(bytes);
        write_atomic(engine, dest, &buf, 0, bytes.len() as u64, 1 << 20).unwrap()
    }

    #[test]
    fn files_replace_atomically_and_leave_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("model.pt");
        for (name, mut engine) in crate::io::tests::engines() {
            for len in [0usize, 1, 4095, 4096, 4097, 3 << 20] {
                let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
                write_with(engine.as_mut(), &dest, &bytes);
                assert_eq!(fs::read(&dest).unwrap(), bytes, "{name}, len {len}");
                let names: Vec<_> = fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
                assert_eq!(names, vec![std::ffi::OsString::from("model.pt")], "{name}, len {len}");
            }
        }
    }

    #[test]
    fn a_failed_write_keeps_the_old_file() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("model.pt");
        fs::write(&dest, b"old").unwrap();
        let plan = crate::io::FaultPlan { fail_write_n: Some((2, libc::EIO)), short_writes: false };
        let mut engine = crate::io::FaultyEngine::new(Box::new(crate::io::PoolEngine::new(2, 4)), plan);
        let buf = AlignedBuf::new(1 << 20).unwrap();
        let e = write_atomic(&mut engine, &dest, &buf, 0, 1 << 20, 64 << 10).unwrap_err();
        assert!(e.to_string().contains("model.pt"), "{e}");
        assert_eq!(fs::read(&dest).unwrap(), b"old");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }
}
