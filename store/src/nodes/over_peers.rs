//! Several nodes with no shared file system (`--shared-over-peers`): each
//! node's "shared directory" is a folder of its own, and what the nodes
//! share travels over the peer channel instead (docs/format.md, "Several
//! nodes without a shared file system").
//!
//! - A rank's part is written on its node as with a shared directory (its
//!   shards into the node's own folders, its marker, blobs and slice
//!   declarations into the node's own temp folder of the step); what the
//!   coordinator needs of it, [`SentPart`], goes to the coordinator, which
//!   writes its blobs and declarations into its own temp folder of the step
//!   and takes its marker in memory ([`Store::take_sent_part`]); all the
//!   parts' files are synced together before the commit ([`sync_written`]),
//!   which is then the one a shared directory gets.
//! - The coordinator's committed step folder (its index and blobs:
//!   [`committed_files`]) goes to every peer, which installs it in its
//!   own folder ([`Store::install_committed`]): the same rename of the temp
//!   folder into `step-…`, then `latest`. So every node's folder holds the
//!   step's index before that node answers its ranks Durable, and a load on
//!   any node finds it where a shared directory would have it.
//!
//! Invariants:
//! - A step folder is installed only from an index that parses (its
//!   checksum too) and names its step, with every blob its index lists
//!   present and matching its length and checksum.
//! - Names sent by a peer are checked as blob names before a file is
//!   made: nothing is written outside the step's temp folder.
//! - A part sent to the coordinator leaves no marker file there (a marker
//!   file means a durable part; the sent one is durable on its node, and
//!   a coordinator that restarts has lost it with the step's other state).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::{abort_record_path, ranks_tmp_path, SentMarker};
use crate::catalog;
use crate::commit::{CommitError, Store};
use crate::format::{self, BLOBS_DIR_NAME, INDEX_FILE_NAME};

/// A step folder's files as they travel between nodes: (name, bytes), the
/// index under its own file name and each blob as `blobs/NAME`.
pub type StepFiles = Vec<(String, Vec<u8>)>;

/// What the coordinator needs of a rank's part written on another node:
/// the files a shared temp folder would hold of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentPart {
    pub rank: u32,
    /// The marker file's bytes.
    pub marker: Vec<u8>,
    /// Its slice declarations' file's bytes; empty when it has none.
    pub slices: Vec<u8>,
    /// Its blobs (slice declarations are not blobs), name and bytes.
    pub blobs: Vec<(String, Vec<u8>)>,
}

impl SentPart {
    /// The bytes it holds (what a bound on queued or kept parts counts).
    pub fn len_bytes(&self) -> usize {
        self.marker.len() + self.slices.len() + self.blobs.iter().map(|(n, b)| n.len() + b.len()).sum::<usize>()
    }
}

/// The name a committed step folder's blob travels under: `blobs/NAME` (the
/// index: its own file name).
fn blob_path_name(name: &str) -> String {
    format!("{BLOBS_DIR_NAME}/{name}")
}

/// Files synced at once, one thread each ([`sync_all`]).
const SYNC_THREADS_MAX: usize = 16;

/// Writes each `(path, bytes)`, replacing what was there (one already
/// holding those very bytes is left: it is synced all the same, as an
/// earlier try may have written it and failed before its sync); returns
/// the files, not synced ([`sync_all`]). The error names its file.
fn write_files(files: &[(PathBuf, &[u8])]) -> Result<Vec<(PathBuf, fs::File)>, (PathBuf, io::Error)> {
    let mut written = Vec::with_capacity(files.len());
    for (path, bytes) in files {
        let create = || fs::File::options().write(true).create_new(true).open(path);
        let open = || -> io::Result<fs::File> {
            // Mostly a new name: one call. Else the bytes compared first.
            let mut f = match create() {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    if fs::read(path).is_ok_and(|had| had == *bytes) {
                        return fs::File::open(path);
                    }
                    fs::remove_file(path)?;
                    create()?
                }
                r => r?,
            };
            io::Write::write_all(&mut f, bytes)?;
            Ok(f)
        };
        written.push((path.clone(), open().map_err(|e| (path.clone(), e))?));
    }
    Ok(written)
}

/// Syncs `files` (and folders: an fsync of a folder makes its entries
/// durable) together, each on a thread of its own: on a journalling file
/// system their syncs then share journal commits instead of queuing one
/// after another (a step of 8 ranks' blobs: 9 small files and 2 folders
/// in one round instead of 11).
fn sync_all(files: &[(PathBuf, fs::File)]) -> Result<(), (PathBuf, io::Error)> {
    for chunk in files.chunks(SYNC_THREADS_MAX) {
        let synced: Vec<_> = std::thread::scope(|sc| {
            let hs: Vec<_> =
                chunk.iter().map(|(p, f)| sc.spawn(move || f.sync_all().map_err(|e| (p.clone(), e)))).collect();
            hs.into_iter().map(|h| h.join().expect("a sync thread panicked")).collect()
        });
        synced.into_iter().collect::<Result<(), _>>()?;
    }
    Ok(())
}

/// Files of `paths` and the folders they are in, synced together
/// ([`sync_all`]): what a coordinator wrote of the parts sent to it
/// ([`Store::take_sent_part`]), before the commit that names them.
pub fn sync_written(paths: &[PathBuf]) -> Result<(), CommitError> {
    let mut open = Vec::with_capacity(paths.len() + 2);
    let mut dirs: Vec<&Path> = paths.iter().filter_map(|p| p.parent()).collect();
    dirs.sort();
    dirs.dedup();
    for p in paths.iter().map(PathBuf::as_path).chain(dirs) {
        let f = fs::File::open(p).map_err(|e| CommitError::io(p, "open to sync", e))?;
        open.push((p.to_path_buf(), f));
    }
    sync_all(&open).map_err(|(p, e)| CommitError::io(&p, "sync a sent part's file", e))
}

/// Makes `dir` if missing (its parent synced when made).
fn make_dir(dir: &Path) -> io::Result<()> {
    match fs::create_dir(dir) {
        Ok(()) => catalog::fsync_dir(dir.parent().expect("a folder in a folder")),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// The files of committed `step` every node's own folder needs: its index
/// (under its file name) and its blobs (`blobs/NAME`), read from the step's folder
/// in `shared`.
pub fn committed_files(shared: &Path, step: u64) -> io::Result<StepFiles> {
    let dir = catalog::step_path(shared, step);
    let mut files = vec![(INDEX_FILE_NAME.to_string(), fs::read(dir.join(INDEX_FILE_NAME))?)];
    match fs::read_dir(dir.join(BLOBS_DIR_NAME)) {
        Ok(entries) => {
            for e in entries {
                let e = e?;
                let Some(name) = e.file_name().to_str().map(str::to_string) else { continue };
                if format::validate_blob_name(&name).is_ok() && e.file_type()?.is_file() {
                    files.push((blob_path_name(&name), fs::read(e.path())?));
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(files)
}

impl Store {
    /// The coordinator takes a part written on another node: its blobs and
    /// slice declarations written into this sidecar's temp folder of
    /// `step`, **not synced** (returned: [`sync_written`] syncs them all at
    /// once before the commit), and its marker taken in memory as one sent
    /// by a node sharing the folder ([`Store::take_sent_marker`]). No
    /// marker file is written here: a marker file means a durable part,
    /// and a coordinator that restarts has lost the parts it held (their
    /// step is sent again, or aborted). Ok((false, _)) as that; a name that
    /// is not a blob's is refused.
    pub fn take_sent_part(
        &self,
        step: u64,
        world_size: u32,
        part: SentPart,
        read: &mut super::MarkersRead,
    ) -> Result<(bool, Vec<PathBuf>), CommitError> {
        if part.rank >= world_size || read.has(part.rank) {
            return Ok((false, Vec::new()));
        }
        self.check_writable()?;
        let tmp = ranks_tmp_path(self.shared_or_panic(), step)?;
        let io = |p: &Path, what: &str, e| CommitError::io(p, what.to_string(), e);
        make_dir(&tmp).map_err(|e| io(&tmp, "create the multi-rank temp folder", e))?;
        let bdir = tmp.join(BLOBS_DIR_NAME);
        if !part.blobs.is_empty() {
            make_dir(&bdir).map_err(|e| io(&bdir, "create blobs folder", e))?;
        }
        let mut files = Vec::with_capacity(part.blobs.len() + 1);
        for (name, bytes) in &part.blobs {
            format::validate_blob_name(name)?;
            files.push((bdir.join(name), &bytes[..]));
        }
        if !part.slices.is_empty() {
            files.push((tmp.join(format::rank_slices_name(part.rank)), &part.slices[..]));
        }
        let written = write_files(&files).map_err(|(p, e)| io(&p, "write a sent part's file", e))?;
        let folder = super::FolderId::of(&tmp).map_err(|e| io(&tmp, "stat the multi-rank temp folder", e))?;
        let sent = SentMarker { rank: part.rank, folder, marker: part.marker, slices: part.slices };
        let taken = self.take_sent_marker(step, world_size, sent, read)?;
        Ok((taken, written.into_iter().map(|(p, _)| p).collect()))
    }

    /// Installs committed `step` sent by its coordinator into this node's
    /// own folder: its index and blobs written and synced into the step's
    /// temp folder (this node's parts' markers stay beside them, as in the
    /// coordinator's), the folder renamed to `step-…`, `latest` moved when
    /// it is the newest. Ok(false) when the step is committed here already.
    /// Refused: an index that does not parse or names another step, a blob
    /// the index lists missing, a name that is neither.
    pub fn install_committed(&self, step: u64, files: &[(String, Vec<u8>)]) -> Result<bool, CommitError> {
        self.check_writable()?;
        let shared = self.shared_or_panic().to_path_buf();
        if catalog::is_committed(&shared, step) {
            return Ok(false);
        }
        let bad = |why: String| CommitError::Format(format::FormatError::Index(format!("step {step} sent: {why}")));
        let Some((_, raw)) = files.iter().find(|(n, _)| n == INDEX_FILE_NAME) else {
            return Err(bad("no index".into()));
        };
        // Read by the template of the index installed before (an 8 MB
        // index: ~2 ms, against ~20 parsed), checked as a parse checks it.
        let read = self.installed.read(0, raw)?;
        let (indexed, index_blobs) = (read.values().map_or(read.shape().ckpt.step, |v| v.step), read.blobs());
        if indexed != step {
            return Err(bad(format!("its index is of step {indexed}")));
        }
        let mut blobs = Vec::new();
        for (name, bytes) in files.iter().filter(|(n, _)| n != INDEX_FILE_NAME) {
            let Some(b) = name.strip_prefix(&format!("{BLOBS_DIR_NAME}/")) else {
                return Err(bad(format!("{name:?} is neither its index nor a blob")));
            };
            format::validate_blob_name(b)?;
            blobs.push((b, bytes));
        }
        for want in index_blobs {
            match blobs.iter().find(|(n, _)| *n == want.name) {
                None => return Err(bad(format!("its blob {:?} is missing", want.name))),
                Some((_, b)) if b.len() as u64 != want.len_bytes || crc32c::crc32c(b) != want.crc32c => {
                    return Err(bad(format!("its blob {:?} does not match its index", want.name)))
                }
                Some(_) => {}
            }
        }
        let tmp = ranks_tmp_path(&shared, step)?;
        let io = |p: &Path, what: &str, e| CommitError::io(p, what.to_string(), e);
        make_dir(&tmp).map_err(|e| io(&tmp, "create the multi-rank temp folder", e))?;
        let bdir = tmp.join(BLOBS_DIR_NAME);
        if !blobs.is_empty() {
            make_dir(&bdir).map_err(|e| io(&bdir, "create blobs folder", e))?;
        }
        // Written, then synced in one round with their folders.
        let mut paths: Vec<(PathBuf, &[u8])> = blobs.iter().map(|(n, b)| (bdir.join(n), &b[..])).collect();
        paths.push((tmp.join(INDEX_FILE_NAME), &raw[..]));
        let mut written = write_files(&paths).map_err(|(p, e)| io(&p, "write a committed step's file", e))?;
        for d in std::iter::once(&tmp).chain((!blobs.is_empty()).then_some(&bdir)) {
            written.push((d.clone(), fs::File::open(d).map_err(|e| io(d, "open to sync", e))?));
        }
        sync_all(&written).map_err(|(p, e)| io(&p, "sync a committed step's file", e))?;
        self.check_abort(step)?;
        self.publish_step(&shared, step, &tmp)?;
        tracing::info!(step, files = files.len(), "installed (committed by the coordinator; no shared file system)");
        Ok(true)
    }

    /// The commit point of a multi-rank step whose temp folder `tmp` holds
    /// its index: renamed to `step-…`, the directory synced, an earlier
    /// attempt's abort record removed, `latest` moved when it is the newest.
    pub(super) fn publish_step(&self, shared: &Path, step: u64, tmp: &Path) -> Result<std::path::PathBuf, CommitError> {
        let dest = catalog::step_path(shared, step);
        fs::rename(tmp, &dest).map_err(|e| CommitError::io(&dest, "rename temp folder into place", e))?;
        catalog::fsync_dir(shared).map_err(|e| CommitError::io(shared, "sync directory after rename", e))?;
        // An earlier attempt's abort record: this attempt committed.
        if let Ok(p) = abort_record_path(shared, step) {
            let _ = fs::remove_file(p);
        }
        if catalog::latest_step(shared).ok().flatten().is_none_or(|l| l <= step) {
            if let Err(e) = catalog::write_latest(shared, step) {
                tracing::warn!("step {step} committed but `latest` not updated ({e}); the next commit moves it");
            }
        }
        Ok(dest)
    }
}
