//! SaveFile (protocol version 2): one file at a path the client names,
//! written atomically from staging. This is what the Python shim's
//! torch.save hook uses: the trainer's `torch.save(obj, path)` returns once
//! the bytes are in staging (Released), and the sidecar writes `path`.
//!
//! The session thread checks the request and copies the bytes into a
//! staging lease ([`run_save_file`]); the committer writes them
//! ([`write_atomic`]), in the order of the session's other saves:
//! 1. an unnamed file (`O_TMPFILE`) in the destination's directory, with
//!    O_DIRECT where the file system takes it, space reserved first;
//! 2. written through the committer's I/O engine, padding cut, fdatasync'd;
//! 3. linked under a temp name `.<name>.ckpt-tmp-<nonce>` and renamed over
//!    `path` (the commit point), then the directory fsync'd; Durable.
//!
//! Invariants: a crash before the rename leaves `path` as it was (old file
//! or none); the temp name exists only between link and rename (or, on a
//! file system without O_TMPFILE, for the whole write) and is removed on
//! any error; the sidecar only writes files for clients of its own uid
//! (it would otherwise create them with its own rights and ownership).

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_wire::{ErrorCode, Reply};
use tracing::{info, info_span, warn};

use crate::catalog;
use crate::commit::CommitError;
use crate::committer::{FileJob, Work};
use crate::config::{self, DIRECT_ALIGN_BYTES, STAGING_ALIGN_BYTES};
use crate::io::{self as eio, DriveError, FileIo, IoEngine, OpKind};
use crate::mem::AlignedBuf;
use crate::regions::Region;
use crate::snapshot;
use crate::staging::StagingError;
use crate::state::{Peer, Phase, Shared};

/// Longest path accepted (Linux PATH_MAX, terminating NUL included).
const PATH_BYTES_MAX: usize = 4095;
/// The temp name's marker, between the destination's name and a nonce.
pub const FILE_TMP_MARKER: &str = ".ckpt-tmp-";

/// Checks a SaveFile's path; returns it as a PathBuf, or the code and the
/// reason to refuse it.
pub fn check_path(path: &str, peer_uid: u32, our_uid: u32) -> Result<PathBuf, (ErrorCode, String)> {
    let bad = |why: &str| Err((ErrorCode::BadRequest, format!("SaveFile path {path:?}: {why}")));
    if peer_uid != our_uid {
        return Err((
            ErrorCode::BadRequest,
            format!("SaveFile is served only to clients of the sidecar's own uid ({our_uid}), not to uid {peer_uid}: the file would belong to the sidecar's user"),
        ));
    }
    if path.len() > PATH_BYTES_MAX {
        return bad(&format!("longer than {PATH_BYTES_MAX} bytes"));
    }
    if path.contains('\0') {
        return bad("contains a NUL byte");
    }
    let p = Path::new(path);
    if !p.is_absolute() {
        return bad("not absolute");
    }
    if path.ends_with('/') || !matches!(p.components().next_back(), Some(Component::Normal(_))) {
        return bad("does not end in a file name");
    }
    let dir = p.parent().expect("an absolute path with a file name has a parent");
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return bad(&format!("{} is not a directory", dir.display())),
        Err(e) => return Err((ErrorCode::Io, format!("SaveFile path {path:?}: directory {}: {e}", dir.display()))),
    }
    if fs::metadata(p).is_ok_and(|m| m.is_dir()) {
        return bad("is a directory");
    }
    let cdir = CString::new(dir.as_os_str().as_bytes()).expect("no NUL (checked)");
    // SAFETY: a valid NUL-terminated path; access only reads it.
    if unsafe { libc::access(cdir.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        let e = io::Error::last_os_error();
        return Err((ErrorCode::Io, format!("SaveFile path {path:?}: cannot write in {}: {e}", dir.display())));
    }
    Ok(p.to_path_buf())
}

/// Runs one SaveFile for a session: checks, waits for staging, copies,
/// replies Released (or Failed), and queues the bytes for the committer.
#[allow(clippy::too_many_arguments)]
pub fn run_save_file(
    shared: &Shared,
    peer: &Arc<Peer>,
    regions: &HashMap<u32, Arc<Region>>,
    peer_uid: u32,
    id: u64,
    path: String,
    region_id: u32,
    offset_bytes: u64,
    len_bytes: u64,
) {
    let t_received = Instant::now();
    let fail = |code: ErrorCode, reason: String| {
        info!(path = %path, ?code, "save of a file refused: {reason}");
        peer.send(&Reply::Failed { id, step: 0, code, reason });
    };
    if shared.is_draining() || shared.is_aborting() {
        return fail(ErrorCode::ShuttingDown, "the sidecar is shutting down; no new saves".into());
    }
    let dest = match check_path(&path, peer_uid, shared.uid) {
        Ok(p) => p,
        Err((code, reason)) => return fail(code, reason),
    };
    // An empty file needs no region bytes (as an empty tensor needs none).
    let region = match regions.get(&region_id) {
        _ if len_bytes == 0 => None,
        Some(r) => Some(r.clone()),
        None => return fail(ErrorCode::BadRegion, format!("{path}: region {region_id} is not registered")),
    };
    if let Some(r) = &region {
        if let Err(e) = r.contains(offset_bytes, len_bytes).and_then(|()| r.check_size()) {
            return fail(ErrorCode::BadRegion, format!("{path}: {e}"));
        }
    }
    let lease_bytes = config::align_up(len_bytes, STAGING_ALIGN_BYTES).max(STAGING_ALIGN_BYTES as u64);
    if lease_bytes > shared.staging.budget_bytes() {
        let budget = shared.staging.budget_bytes();
        return fail(ErrorCode::TooLarge, format!("{path}: {len_bytes} bytes, more than the whole staging budget of {budget} bytes (raise --staging)"));
    }
    let key = shared.begin_file(&path, len_bytes);
    let span = info_span!("save_file", path = %path, bytes = len_bytes);
    let guard = span.enter();
    let give_up = || shared.stop_reason(peer, "the client disconnected before release");
    let (mut lease, waited) = match shared.staging.acquire(lease_bytes, &path, give_up) {
        Ok(x) => x,
        Err(e) => {
            shared.end(key);
            let code = if matches!(e, StagingError::GaveUp { .. }) { ErrorCode::ShuttingDown } else { ErrorCode::TooLarge };
            return fail(code, format!("{path}: {e}"));
        }
    };
    shared.set_phase(key, Phase::Copying);
    let t_copy = Instant::now();
    let copied = match &region {
        Some(r) => snapshot::copy_range_into(r, offset_bytes, len_bytes, &mut lease, &|| give_up().is_some()),
        None => true,
    };
    let copy_seconds = t_copy.elapsed().as_secs_f64();
    // Released only if the region still held its bytes (one its client
    // truncated during the copy was read as zeros) and the client is still
    // there to be told.
    let intact = region.as_ref().map_or(Ok(()), |r| r.check_size());
    drop(region);
    let refused = match intact {
        Err(e) => Some((ErrorCode::BadRegion, format!("{path}: {e}"))),
        Ok(()) => {
            let stopped = if copied { give_up() } else { Some(give_up().unwrap_or("stopped during the copy")) };
            stopped.map(|why| (ErrorCode::ShuttingDown, format!("{path}: aborted: {why}")))
        }
    };
    if let Some((code, reason)) = refused {
        drop(lease);
        shared.end(key);
        warn!(copy_s = copy_seconds, "aborted before release, nothing written: {reason}");
        return fail(code, reason);
    }
    let waited_seconds = waited.as_secs_f64();
    info!(copy_s = copy_seconds, waited_s = waited_seconds, "released");
    peer.send(&Reply::Released { id, step: 0, copy_seconds, waited_seconds });
    shared.set_phase(key, Phase::Queued);
    drop(guard);
    let job = FileJob { id, key, path: dest, len_bytes, lease, peer: peer.clone(), span, copy_seconds, waited_seconds, t_received };
    if let Err(e) = shared.commit_tx.send(Work::File(job)) {
        let Work::File(job) = e.into_inner() else { unreachable!("sent a file job") };
        shared.end(key);
        job.peer.send(&Reply::Failed { id, step: 0, code: ErrorCode::ShuttingDown, reason: "the committer has stopped".into() });
    }
}

/// Figures of one file write.
#[derive(Debug, Clone)]
pub struct FileReport {
    pub direct: bool,
    /// Creating the file, reserving space and writing.
    pub write: Duration,
    /// fdatasync, link, rename and the directory's fsync.
    pub sync: Duration,
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
                Err(e) if tmpfile && matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::ENOENT)) => break,
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
    let r = unsafe { libc::linkat(libc::AT_FDCWD, proc.as_ptr(), libc::AT_FDCWD, to_c.as_ptr(), libc::AT_SYMLINK_FOLLOW) };
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
    staging: &AlignedBuf,
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
    staging: &AlignedBuf,
    offset_bytes: u64,
    len_bytes: u64,
    chunk_bytes: usize,
    linked: &mut Option<PathBuf>,
    t0: Instant,
) -> Result<FileReport, CommitError> {
    let io_len = if tmp.direct { config::align_up(len_bytes, DIRECT_ALIGN_BYTES) } else { len_bytes };
    assert!(offset_bytes + io_len <= staging.len() as u64, "range outside staging");
    let f = &tmp.file;
    crate::commit::reserve(f, io_len).map_err(|e| CommitError::io(dir, format!("reserve {io_len} bytes for {}", dest.display()), e).needing(io_len))?;
    let fio = FileIo { fd: f.as_raw_fd(), ptr: staging.as_ptr().wrapping_add(offset_bytes as usize) as *mut u8, io_len, file_len: len_bytes, window_bytes: 0 };
    // SAFETY: `staging` is borrowed for the whole call and the range was
    // checked above; drive() reaps every request before it returns.
    unsafe { eio::drive(engine, OpKind::Write, std::slice::from_ref(&fio), chunk_bytes, |_, _| {}) }.map_err(|e| drive_error(dest, e))?;
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

    fn uid() -> u32 {
        // SAFETY: getuid has no preconditions.
        unsafe { libc::getuid() }
    }

    #[test]
    fn paths_are_checked() {
        let d = tempfile::tempdir().unwrap();
        let ok = d.path().join("a.pt");
        assert_eq!(check_path(ok.to_str().unwrap(), uid(), uid()).unwrap(), ok);
        for bad in ["rel/a.pt", "/", "/tmp/", "/tmp/..", "/tmp/a\0b"] {
            assert_eq!(check_path(bad, uid(), uid()).unwrap_err().0, ErrorCode::BadRequest, "{bad:?}");
        }
        let missing = d.path().join("no/such/a.pt");
        let (code, msg) = check_path(missing.to_str().unwrap(), uid(), uid()).unwrap_err();
        assert_eq!(code, ErrorCode::Io);
        assert!(msg.contains("No such file"), "{msg}");
        assert_eq!(check_path(d.path().to_str().unwrap(), uid(), uid()).unwrap_err().0, ErrorCode::BadRequest);
        let (_, msg) = check_path(ok.to_str().unwrap(), uid() + 1, uid()).unwrap_err();
        assert!(msg.contains("own uid"), "{msg}");
    }

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
