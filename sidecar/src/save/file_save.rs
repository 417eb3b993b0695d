//! SaveFile (protocol version 2): one file at a path the client names,
//! written atomically from staging. This is what the Python shim's
//! torch.save hook uses: the trainer's `torch.save(obj, path)` returns once
//! the bytes are in staging (Released), and the sidecar writes `path`.
//! SaveFilePieces (version 9) is the same for a file made of several pieces,
//! host or device memory (the hook's CUDA way: a skip_data skeleton in shm,
//! the storages copied from the device after the trainer's event), whose
//! torch.save CRC-32s the sidecar computes ([`crate::save::torch_zip`]).
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
use std::fs::{self};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ckpt_wire::{ErrorCode, FileFinish, FilePiece, Reply};
use tracing::{info, info_span, warn};

use crate::config::{self, STAGING_ALIGN_BYTES};
use crate::memory::regions::Region;
use crate::memory::staging::{Lease, StagingError};
use crate::save::copy;
use crate::save::torch_zip::{self, TorchZip};
use crate::state::jobs::{FileJob, Work};
use crate::state::refusal::Refusal;
use crate::state::reply::Replies;
use crate::state::{DaemonState, Phase};

/// Longest path accepted (Linux PATH_MAX, terminating NUL included).
const PATH_BYTES_MAX: usize = 4095;

/// Checks a SaveFile's path; returns it as a PathBuf, or why it is refused.
pub fn check_path(path: &str, peer_uid: u32, our_uid: u32) -> Result<PathBuf, Refusal> {
    let bad = |why: &str| Err(Refusal::new(ErrorCode::BadRequest, format!("SaveFile path {path:?}: {why}")));
    if peer_uid != our_uid {
        return Err(Refusal::new(
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
        Err(e) => {
            return Err(Refusal::new(
                ErrorCode::Io,
                format!("SaveFile path {path:?}: directory {}: {e}", dir.display()),
            ))
        }
    }
    // Only a regular file (or nothing) is replaced: a rename over a symbolic
    // link, a FIFO or a device (say /dev/null, for a sidecar run as root)
    // would replace the special file itself, not write where it leads.
    if let Ok(m) = fs::symlink_metadata(p) {
        let t = m.file_type();
        if t.is_dir() {
            return bad("is a directory");
        }
        if t.is_symlink() {
            return bad("is a symbolic link; give the path it points to (only a regular file is replaced)");
        }
        if !t.is_file() {
            return bad(&format!("is a {}, not a regular file (only a regular file is replaced)", special_kind(&t)));
        }
    }
    let cdir = CString::new(dir.as_os_str().as_bytes()).expect("no NUL (checked)");
    // SAFETY: a valid NUL-terminated path; access only reads it.
    if unsafe { libc::access(cdir.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        let e = io::Error::last_os_error();
        return Err(Refusal::new(
            ErrorCode::Io,
            format!("SaveFile path {path:?}: cannot write in {}: {e}", dir.display()),
        ));
    }
    Ok(p.to_path_buf())
}

fn special_kind(t: &fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_char_device() {
        "character device"
    } else {
        "special file"
    }
}

/// A SaveFile (one piece) or SaveFilePieces, as the session hands it over.
pub struct FileRequest {
    pub id: u64,
    pub path: String,
    /// The file's content, laid end to end.
    pub pieces: Vec<FilePiece>,
    pub finish: FileFinish,
}

/// Runs one SaveFile for a session: checks, waits for staging, copies
/// every piece (a CUDA region's on the session's stream, after the fence the
/// session made it wait on), completes a torch.save archive's CRC-32 fields
/// ([`torch_zip`], after Released), replies Released (or Failed), and queues
/// the bytes for the committer.
pub fn run_save_file(
    state: &DaemonState,
    replies: &Arc<Replies>,
    regions: &HashMap<u32, Arc<Region>>,
    peer_uid: u32,
    req: FileRequest,
) {
    let FileRequest { id, path, pieces, finish } = req;
    let t_received = Instant::now();
    let fail = |r: Refusal| refuse(replies, id, &path, r);
    let Admitted { dest, sources, len_bytes, lease_bytes, handed_over } =
        match admit(state, replies, regions, peer_uid, &path, &pieces) {
            Ok(a) => a,
            Err(r) => return fail(r),
        };
    let key = state.begin_file(&path, len_bytes);
    replies.started(id, t_received, len_bytes);
    let span = info_span!("save_file", path = %path, bytes = len_bytes, pieces = sources.len());
    let guard = span.enter();
    let give_up = || state.stop_reason(replies, (!handed_over).then_some("the client disconnected before release"));
    let (mut lease, waited) = match state.staging.acquire(lease_bytes, &path, give_up) {
        Ok(x) => x,
        Err(e) => {
            state.end(key);
            return fail(staging_refusal(&path, &e));
        }
    };
    state.set_phase(key, Phase::Copying);
    let (copy_seconds, checked) = copy_and_check(&path, sources, &mut lease, len_bytes, finish, &give_up);
    let zip = match checked {
        Ok(zip) => zip,
        Err(r) => {
            drop(lease);
            state.end(key);
            warn!(copy_s = copy_seconds, "aborted before release, nothing written: {}", r.reason);
            return fail(r);
        }
    };
    let waited_seconds = waited.as_secs_f64();
    release(replies, id, handed_over, copy_seconds, waited_seconds);
    if let Some(z) = zip {
        fill_torch_crcs(&mut lease, len_bytes, &z);
    }
    state.set_phase(key, Phase::Queued);
    drop(guard);
    let job = FileJob {
        id,
        key,
        path: dest,
        len_bytes,
        lease,
        replies: replies.clone(),
        span,
        copy_seconds,
        waited_seconds,
        t_received,
    };
    queue_file_job(state, job);
}

/// Logs why a SaveFile is refused and tells the client.
fn refuse(replies: &Replies, id: u64, path: &str, r: Refusal) {
    info!(path = %path, code = ?r.code, "save of a file refused: {}", r.reason);
    replies.send(&r.failed(id, 0));
}

/// A SaveFile that passed the checks made before staging is asked for.
struct Admitted {
    dest: PathBuf,
    sources: Vec<FileSource>,
    len_bytes: u64,
    lease_bytes: u64,
    /// Every source region hands its bytes over at save (or there are none).
    handed_over: bool,
}

/// The checks before any staging is leased, in this order: shutting down,
/// the path, the pieces against the regions, the staging budget, and (while
/// draining) whether the bytes were handed over.
fn admit(
    state: &DaemonState,
    replies: &Replies,
    regions: &HashMap<u32, Arc<Region>>,
    peer_uid: u32,
    path: &str,
    pieces: &[FilePiece],
) -> Result<Admitted, Refusal> {
    // Draining: no new saves, but one a client sent before it went is
    // served when its region was handed over (checked below).
    if state.is_aborting() || (state.is_draining() && !replies.is_gone()) {
        return Err(Refusal::new(ErrorCode::ShuttingDown, "the sidecar is shutting down; no new saves"));
    }
    let dest = check_path(path, peer_uid, state.uid)?;
    let (sources, len_bytes) = sources_of(path, pieces, regions)?;
    let lease_bytes = config::align_up(len_bytes, STAGING_ALIGN_BYTES).max(STAGING_ALIGN_BYTES as u64);
    if lease_bytes > state.staging.budget_bytes() {
        let budget = state.staging.budget_bytes();
        return Err(Refusal::new(
            ErrorCode::TooLarge,
            format!(
                "{path}: {len_bytes} bytes, more than the whole staging budget of {budget} bytes (raise --staging)"
            ),
        ));
    }
    // Bytes all in hand-over regions (or none) are the sidecar's once sent:
    // the client's departure does not stop their copy (protocol.md).
    let handed_over = sources.iter().all(|(r, _, _)| r.hands_over());
    if state.is_draining() && !handed_over {
        return Err(Refusal::new(ErrorCode::ShuttingDown, "the sidecar is shutting down; no new saves"));
    }
    Ok(Admitted { dest, sources, len_bytes, lease_bytes, handed_over })
}

/// The refusal for a lease staging did not grant: a stop while waiting is
/// a shutdown, anything else a file too large.
fn staging_refusal(path: &str, e: &StagingError) -> Refusal {
    let code = if matches!(e, StagingError::GaveUp { .. }) { ErrorCode::ShuttingDown } else { ErrorCode::TooLarge };
    Refusal::new(code, format!("{path}: {e}"))
}

/// Copies the pieces into the lease and checks that the bytes may be
/// released; returns the copy's seconds and the parsed torch.save archive
/// (for [`FileFinish::TorchZip`]), or why the save is refused. The sources
/// are dropped before the archive is parsed.
fn copy_and_check(
    path: &str,
    sources: Vec<FileSource>,
    lease: &mut Lease,
    len_bytes: u64,
    finish: FileFinish,
    give_up: &(dyn Fn() -> Option<&'static str> + Sync),
) -> (f64, Result<Option<TorchZip>, Refusal>) {
    let t_copy = Instant::now();
    let ranges: Vec<(&Region, u64, u64)> = sources.iter().map(|(r, off, len)| (&**r, *off, *len)).collect();
    let copied = copy::copy_ranges_into(&ranges, lease, &|| give_up().is_some());
    let copy_seconds = t_copy.elapsed().as_secs_f64();
    // Released only if every region still held its bytes (one its client
    // truncated during the copy was read as zeros; a failed device copy),
    // the client is still there to be told, and a torch.save archive is one.
    let intact = sources.iter().try_for_each(|(r, _, _)| r.check_intact());
    drop(ranges);
    drop(sources);
    let refused = match intact {
        Err(e) => Some(Refusal::new(ErrorCode::BadRegion, format!("{path}: {e}"))),
        Ok(()) => {
            let stopped = if copied { give_up() } else { Some(give_up().unwrap_or("stopped during the copy")) };
            stopped.map(|why| Refusal::new(ErrorCode::ShuttingDown, format!("{path}: aborted: {why}")))
        }
    };
    let checked = match (refused, finish) {
        (Some(r), _) => Err(r),
        (None, FileFinish::TorchZip) => match torch_zip::parse(&lease.as_mut_slice()[..len_bytes as usize]) {
            Ok(z) => Ok(Some(z)),
            Err(e) => Err(Refusal::new(ErrorCode::BadRequest, format!("{path}: {e}"))),
        },
        (None, _) => Ok(None),
    };
    (copy_seconds, checked)
}

/// Logs the release and tells the client its bytes are in staging.
fn release(replies: &Replies, id: u64, handed_over: bool, copy_seconds: f64, waited_seconds: f64) {
    if handed_over && replies.is_gone() {
        info!("the client is gone, but it handed these bytes over at save: committing them");
    }
    info!(copy_s = copy_seconds, waited_s = waited_seconds, "released");
    replies.send(&Reply::Released { id, step: 0, copy_seconds, waited_seconds });
}

/// Completes a torch.save archive's CRC-32 fields in staging. Off the
/// trainer's stall: it only waited for Released.
fn fill_torch_crcs(lease: &mut Lease, len_bytes: u64, zip: &TorchZip) {
    let t_crc = Instant::now();
    torch_zip::fill(&mut lease.as_mut_slice()[..len_bytes as usize], zip);
    info!(crc_s = t_crc.elapsed().as_secs_f64(), "torch.save archive CRC-32s computed");
}

/// Hands the file to the committer; a committer already stopped fails it.
fn queue_file_job(state: &DaemonState, job: FileJob) {
    let (id, key) = (job.id, job.key);
    if let Err(e) = state.commit_tx.send(Work::File(job)) {
        let Work::File(job) = e.into_inner() else { unreachable!("sent a file job") };
        state.end(key);
        job.replies.send(&Refusal::new(ErrorCode::ShuttingDown, "the committer has stopped").failed(id, 0));
    }
}

/// Where a piece of a SaveFile's bytes comes from: (region, offset, length).
type FileSource = (Arc<Region>, u64, u64);

/// A SaveFile's pieces checked against the session's regions: each
/// non-empty piece's (region, offset, length) in file order (an empty piece
/// needs no region, as an empty tensor needs none), and their total length.
fn sources_of(
    path: &str,
    pieces: &[FilePiece],
    regions: &HashMap<u32, Arc<Region>>,
) -> Result<(Vec<FileSource>, u64), Refusal> {
    let mut sources = Vec::with_capacity(pieces.len());
    let mut len_bytes = 0u64;
    for (i, p) in pieces.iter().enumerate() {
        if p.len_bytes == 0 {
            continue;
        }
        let Some(r) = regions.get(&p.region_id) else {
            let reason = format!("{path}: piece {i}: region {} is not registered", p.region_id);
            return Err(Refusal::new(ErrorCode::BadRegion, reason));
        };
        if let Err(e) = r.contains(p.offset_bytes, p.len_bytes).and_then(|()| r.check_intact()) {
            return Err(Refusal::new(ErrorCode::BadRegion, format!("{path}: piece {i}: {e}")));
        }
        len_bytes = len_bytes.checked_add(p.len_bytes).ok_or_else(|| {
            Refusal::new(ErrorCode::BadRequest, format!("{path}: its pieces add up to more than 2^64 bytes"))
        })?;
        sources.push((r.clone(), p.offset_bytes, p.len_bytes));
    }
    Ok((sources, len_bytes))
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
            assert_eq!(check_path(bad, uid(), uid()).unwrap_err().code, ErrorCode::BadRequest, "{bad:?}");
        }
        let missing = d.path().join("no/such/a.pt");
        let Refusal { code, reason: msg } = check_path(missing.to_str().unwrap(), uid(), uid()).unwrap_err();
        assert_eq!(code, ErrorCode::Io);
        assert!(msg.contains("No such file"), "{msg}");
        assert_eq!(check_path(d.path().to_str().unwrap(), uid(), uid()).unwrap_err().code, ErrorCode::BadRequest);
        let msg = check_path(ok.to_str().unwrap(), uid() + 1, uid()).unwrap_err().reason;
        assert!(msg.contains("own uid"), "{msg}");
    }

    #[test]
    fn only_a_regular_file_is_replaced() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("a.pt");
        fs::write(&file, b"old").unwrap();
        assert_eq!(check_path(file.to_str().unwrap(), uid(), uid()).unwrap(), file);
        let link = d.path().join("link.pt");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let dangling = d.path().join("dangling.pt");
        std::os::unix::fs::symlink(d.path().join("nowhere"), &dangling).unwrap();
        let fifo = d.path().join("fifo.pt");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for (p, what) in [
            (&link, "symbolic link"),
            (&dangling, "symbolic link"),
            (&fifo, "FIFO"),
            (&PathBuf::from("/dev/null"), "character device"),
        ] {
            let Refusal { code, reason: msg } = check_path(p.to_str().unwrap(), uid(), uid()).unwrap_err();
            assert_eq!(code, ErrorCode::BadRequest, "{msg}");
            assert!(msg.contains(what) && msg.contains(p.to_str().unwrap()), "{msg}");
        }
        // Nothing was touched.
        assert_eq!(fs::read(&file).unwrap(), b"old");
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    }
}
