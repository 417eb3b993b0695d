//! Writing a commit's files into its temp folders: each directory's
//! shards from staging through its engine (space reserved first, the
//! padding of the last O_DIRECT block cut, fdatasync'd), linked instead
//! from the previous step when unchanged (incremental); the blobs and the
//! index into the primary's, each synced.
//!
//! Invariant: staging is only read, and a fed image only below its ready
//! prefix ([`crate::io::drive_fed`]).

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tracing::warn;

use super::{CommitError, TargetDir};
use crate::catalog;
use crate::format::{BLOBS_DIR_NAME, INDEX_FILE_NAME};
use crate::image::{Blob, Layout};
use crate::io::{self as eio, DriveError, FileIo, OpKind};
use crate::mem::BufAddr;
use crate::progress::Progress;

/// One step's shards as every directory's writer reads them.
#[derive(Clone, Copy)]
pub(crate) struct DirWrite<'a> {
    pub(crate) step: u64,
    pub(crate) layout: &'a Layout,
    pub(crate) staging: &'a dyn BufAddr,
    pub(crate) fill: Fill<'a>,
    pub(crate) chunk_bytes: usize,
    pub(crate) prev: Option<&'a crate::incremental::Prev>,
    /// Per shard, the previous step's file it may be linked from (incremental).
    pub(crate) candidates: &'a [Option<PathBuf>],
}

/// What one directory's writer did: (write time, sync time, the shards linked).
pub(crate) type DirWritten = (Duration, Duration, Vec<usize>);

/// Writes every directory's shards into `folders[dir_idx]`, one named
/// thread per directory (`ckpt-write-N`), while `meanwhile` runs on this
/// thread; returns each directory's result, in order, and `meanwhile`'s.
pub(crate) fn write_dirs<R>(
    dirs: &mut [TargetDir],
    folders: &[PathBuf],
    w: DirWrite<'_>,
    meanwhile: impl FnOnce() -> R,
) -> (Vec<Result<DirWritten, CommitError>>, R) {
    assert_eq!(dirs.len(), folders.len(), "one folder per target directory");
    std::thread::scope(|s| {
        let handles: Vec<_> = dirs
            .iter_mut()
            .zip(folders)
            .enumerate()
            .map(|(dir_idx, (d, folder))| {
                std::thread::Builder::new()
                    .name(format!("ckpt-write-{dir_idx}"))
                    .spawn_scoped(s, move || write_dir(d, dir_idx as u32, folder, w))
                    .expect("spawning a writer thread")
            })
            .collect();
        let r = meanwhile();
        (handles.into_iter().map(|h| h.join().expect("writer thread panicked")).collect(), r)
    })
}

/// Writes the shards of directory `dir_idx` into `tmp` and syncs them, as
/// [`write_shards`] (all of them), except those with a link `candidates` (incremental):
/// these wait for the save's checksums and digests, then are linked from
/// the previous step when every tensor of theirs is unchanged, else
/// written. Returns (write time, sync time, the shards linked).
pub(crate) fn write_dir(
    d: &mut TargetDir,
    dir_idx: u32,
    tmp: &Path,
    w: DirWrite<'_>,
) -> Result<DirWritten, CommitError> {
    let DirWrite { step, layout, staging, fill, chunk_bytes, prev, candidates } = w;
    let deferred: Vec<usize> =
        (0..layout.shards.len()).filter(|&s| layout.shards[s].dir_idx == dir_idx && candidates[s].is_some()).collect();
    let (mut w, mut sy) = write_shards(d, step, dir_idx, tmp, layout, staging, fill.progress(), chunk_bytes, &|s| {
        candidates[s].is_none()
    })?;
    let Some(prev) = prev.filter(|_| !deferred.is_empty()) else { return Ok((w, sy, Vec::new())) };
    let t0 = Instant::now();
    // Waits for the copy's end (its checksums and digests).
    let crcs = fill.crcs(step)?;
    let digests = fill.digests();
    let mut linked = Vec::new();
    let mut rest = Vec::new();
    for s in deferred {
        let sh = &layout.shards[s];
        let same =
            digests.as_ref().is_some_and(|dg| sh.tensors.iter().all(|&i| prev.unchanged(layout, i, crcs[i], dg[i])));
        let from = candidates[s].as_ref().expect("deferred shards have a candidate");
        if same {
            match crate::incremental::link(from, &tmp.join(&sh.file_name)) {
                Ok(()) => {
                    linked.push(s);
                    continue;
                }
                Err(e) => warn!(from = %from.display(), "incremental: could not link ({e}); writing the shard"),
            }
        }
        rest.push(s);
    }
    let w0 = t0.elapsed();
    if !rest.is_empty() {
        // The copy ended: the whole image is final.
        let (w2, s2) = write_shards(d, step, dir_idx, tmp, layout, staging, None, chunk_bytes, &|s| rest.contains(&s))?;
        (w, sy) = (w + w0 + w2, sy + s2);
    } else {
        w += w0;
    }
    Ok((w, sy, linked))
}

/// Writes the shards of directory `dir_idx` that `which` says (`&|_| true`:
/// all) into `tmp` and syncs them; returns (write time, sync time).
#[allow(clippy::too_many_arguments)]
fn write_shards(
    d: &mut TargetDir,
    step: u64,
    dir_idx: u32,
    tmp: &Path,
    layout: &Layout,
    staging: &dyn BufAddr,
    progress: Option<&Progress>,
    chunk_bytes: usize,
    which: &(dyn Fn(usize) -> bool + Sync),
) -> Result<(Duration, Duration), CommitError> {
    let t0 = Instant::now();
    let direct = d.choice.direct;
    let shards: Vec<usize> =
        (0..layout.shards.len()).filter(|&s| layout.shards[s].dir_idx == dir_idx && which(s)).collect();
    let mut files: Vec<File> = Vec::with_capacity(shards.len());
    let mut ios = Vec::with_capacity(shards.len());
    let mut starts = Vec::with_capacity(shards.len());
    for &s in &shards {
        let sh = &layout.shards[s];
        let path = tmp.join(&sh.file_name);
        let f = eio::open_for_write(&path, direct).map_err(|e| CommitError::io(&path, "create shard", e))?;
        let io_len = if direct { sh.io_len } else { sh.file_len };
        reserve(&f, io_len)
            .map_err(|e| CommitError::io(tmp, format!("reserve space for {}", sh.file_name), e).needing(io_len))?;
        let range = layout.shard_range(s);
        starts.push(range.start as u64);
        ios.push(FileIo {
            fd: f.as_raw_fd(),
            // Writes only read this memory; the engine API takes *mut for both directions.
            ptr: staging.as_ptr().wrapping_add(range.start) as *mut u8,
            io_len,
            file_len: sh.file_len,
            window_bytes: 0,
        });
        files.push(f);
    }
    // SAFETY: every range lies inside `staging` (the caller asserted
    // staging_len ≤ its length), which is live memory while borrowed
    // (BufAddr's contract) and borrowed for this whole function, so every
    // range stays valid until the driver returns, which reaps every request
    // first; no reference to these bytes is formed here (only the kernel
    // reads them), and a fed image's filler writes nothing below its ready
    // prefix (the caller's contract, commit_fed).
    let r = unsafe {
        match progress {
            None => eio::drive(d.engine.as_mut(), OpKind::Write, &ios, chunk_bytes, |_, _| {}),
            Some(p) => eio::drive_fed(d.engine.as_mut(), &ios, chunk_bytes, &starts, p),
        }
    };
    r.map_err(|e| match e {
        DriveError::Source(why) => CommitError::Unfilled { step, why },
        e => drive_error(tmp, layout, &shards, e),
    })?;
    for (f, &s) in files.iter().zip(&shards) {
        let sh = &layout.shards[s];
        if direct && sh.io_len != sh.file_len {
            // The last block was written whole; cut the zero padding so the
            // file ends at its last tensor byte (safetensors allows no holes).
            f.set_len(sh.file_len).map_err(|e| CommitError::io(&tmp.join(&sh.file_name), "truncate padding", e))?;
        }
    }
    let t_sync = Instant::now();
    let fds: Vec<_> = files.iter().map(|f| f.as_raw_fd()).collect();
    eio::sync_all(d.engine.as_mut(), &fds).map_err(|e| drive_error(tmp, layout, &shards, e))?;
    Ok((t_sync - t0, t_sync.elapsed()))
}

fn drive_error(tmp: &Path, layout: &Layout, shards: &[usize], e: DriveError) -> CommitError {
    let file_idx = match &e {
        DriveError::Io { file_idx, .. }
        | DriveError::ShortWrite { file_idx, .. }
        | DriveError::ShortRead { file_idx, .. } => Some(*file_idx),
        DriveError::Engine(_) | DriveError::Source(_) => None,
    };
    let path = file_idx.map_or_else(|| tmp.to_path_buf(), |i| tmp.join(&layout.shards[shards[i]].file_name));
    // The message says where; the source says what the kernel said.
    let (what, source) = match e {
        DriveError::Io { what, offset_bytes, source, .. } => (format!("{what} at offset {offset_bytes}"), source),
        DriveError::Engine(source) => ("I/O engine".to_string(), source),
        other => ("write".to_string(), io::Error::other(other.to_string())),
    };
    CommitError::io(&path, what, source)
}

/// Writes the blobs and then the index into the primary's temp folder and
/// syncs them (files and the blobs folder); a fed image's checksums are
/// waited for first. Returns the bytes written.
/// `prev_blobs`: the blobs folder of the committed step an incremental
/// commit compares with; a blob holding the very bytes of its namesake
/// there is linked, not written ([`link_if_same`]).
pub(super) fn write_blobs_and_index(
    step: u64,
    layout: &Layout,
    fill: Fill<'_>,
    blobs: &[Blob<'_>],
    primary_tmp: &Path,
    paths: &[PathBuf],
    prev_blobs: Option<&Path>,
) -> Result<u64, CommitError> {
    let mut bytes = 0;
    if !blobs.is_empty() {
        let bdir = primary_tmp.join(BLOBS_DIR_NAME);
        fs::create_dir(&bdir).map_err(|e| CommitError::io(&bdir, "create blobs folder", e))?;
        for b in blobs {
            let p = bdir.join(b.name);
            if prev_blobs.is_some_and(|d| link_if_same(&d.join(b.name), &p, b.bytes)) {
                continue;
            }
            write_small_file(&p, b.bytes).map_err(|e| {
                CommitError::io(&p, format!("write blob {:?}", b.name), e).needing(b.bytes.len() as u64)
            })?;
            bytes += b.bytes.len() as u64;
        }
        catalog::fsync_dir(&bdir).map_err(|e| CommitError::io(&bdir, "sync blobs folder", e))?;
    }
    let secondary_dirs: Vec<String> = paths[1..].iter().map(|p| p.display().to_string()).collect();
    // Rendered while a fed image is still copied; only its numbers wait.
    layout.prepare_index(&secondary_dirs);
    let crcs = fill.crcs(step)?;
    let digests = fill.digests().filter(|_| layout.opts.incremental);
    let ipath = primary_tmp.join(INDEX_FILE_NAME);
    let len = write_index(&ipath, |out| {
        let at = crate::image::Held { secondary_dirs, nodes: &Default::default() };
        layout.index_pieces(step, &crcs, digests.as_deref(), blobs, at, INDEX_PIECE_BYTES, out)
    })
    .map_err(|e| CommitError::io(&ipath, "write index", e))?;
    Ok(bytes + len)
}

/// How much of a rendered index is written at a time ([`write_index`]).
pub(crate) const INDEX_PIECE_BYTES: usize = 1 << 20;

/// Writes the index at `path` (a new file) from the pieces `render` hands
/// out and the last one it returns, and syncs it. Each piece's writeback
/// is started as soon as it is written (`sync_file_range`, a hint: the
/// final `fdatasync` is what makes it durable), so the disk takes the
/// first megabytes of a large index while the rest is still filled: at
/// 20k tensors (8 MB) filling took 2.5 ms and the sync after it 5-6 ms,
/// one after the other. Returns the index's length.
pub(crate) fn write_index(
    path: &Path,
    render: impl FnOnce(&mut dyn FnMut(&[u8]) -> io::Result<()>) -> io::Result<Vec<u8>>,
) -> io::Result<u64> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let mut f = File::options().write(true).create_new(true).open(path)?;
    let mut at = 0u64;
    let last = render(&mut |piece| {
        f.write_all(piece)?;
        // SAFETY: a plain system call on an open descriptor; its failure
        // (a file system without it) changes nothing: the sync follows.
        unsafe {
            libc::sync_file_range(f.as_raw_fd(), at as i64, piece.len() as i64, libc::SYNC_FILE_RANGE_WRITE);
        }
        at += piece.len() as u64;
        Ok(())
    })?;
    f.write_all(&last)?;
    f.sync_data()?;
    Ok(at + last.len() as u64)
}

/// Links `from` (a committed step's blob) as `to` when it holds exactly
/// `bytes` (a state's skeleton, the same at every save of the same
/// structure: 0.5 MB at 10k tensors, written and synced at every step
/// otherwise). Linked first, then the linked file compared, so what is
/// compared is what the new step names. Its bytes are durable already
/// (synced by the commit that wrote them); the new name becomes durable
/// with the blobs folder's sync. False, with nothing left at `to`, when
/// it differs or cannot be linked: the caller writes it.
pub(crate) fn link_if_same(from: &Path, to: &Path, bytes: &[u8]) -> bool {
    if fs::metadata(from).map_or(true, |m| m.len() != bytes.len() as u64) || fs::hard_link(from, to).is_err() {
        return false;
    }
    if fs::read(to).is_ok_and(|b| b == bytes) {
        return true;
    }
    // Removed, so the write that follows creates it anew (a failure to
    // remove makes that write fail: the commit then fails, nothing lost).
    let _ = fs::remove_file(to);
    false
}

/// Where a commit's image comes from: already in staging with its
/// checksums, or still being filled.
#[derive(Clone, Copy)]
pub(crate) enum Fill<'a> {
    Done(&'a [u32]),
    /// Done, with each tensor's digest (incremental).
    Summed(&'a [u32], &'a [u128]),
    Fed(&'a Progress),
}

impl<'a> Fill<'a> {
    pub(crate) fn progress(self) -> Option<&'a Progress> {
        match self {
            Fill::Done(_) | Fill::Summed(..) => None,
            Fill::Fed(p) => Some(p),
        }
    }

    /// The tensors' checksums: at hand, or the filler's once it ended.
    pub(crate) fn crcs(self, step: u64) -> Result<std::borrow::Cow<'a, [u32]>, CommitError> {
        match self {
            Fill::Done(c) | Fill::Summed(c, _) => Ok(c.into()),
            Fill::Fed(p) => p.outcome().map(Into::into).map_err(|why| CommitError::Unfilled { step, why }),
        }
    }

    /// The tensors' digests, if the filler computed them (waits for a fed
    /// image's end).
    pub(crate) fn digests(self) -> Option<std::borrow::Cow<'a, [u128]>> {
        match self {
            Fill::Done(_) => None,
            Fill::Summed(_, d) => Some(d.into()),
            Fill::Fed(p) => p.digests().map(Into::into),
        }
    }
}

/// Reserves `len` bytes so the writes are overwrites of allocated space, and
/// a full disk is found before any data moves. File systems without
/// fallocate just go on.
pub(crate) fn reserve(f: &File, len: u64) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: plain syscall on an fd we own.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len as libc::off_t) };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => Ok(()),
        _ => Err(e),
    }
}

/// Creates, writes and fdatasyncs a small file (blobs, the index).
pub(crate) fn write_small_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut f = File::options().write(true).create_new(true).open(path)?;
    f.write_all(bytes)?;
    f.sync_data()
}
