//! The store: target directories with their I/O engines, and the commit
//! protocol that turns a staged image into a committed checkpoint.
//!
//! Commit protocol, per checkpoint:
//! 1. `.tmp-step-…-<nonce>/` in every target directory;
//! 2. every shard written from staging (one thread and one engine per
//!    directory, in parallel), space reserved first, fdatasync'd;
//! 3. blobs written and synced, the index written and synced last;
//! 4. every temp folder synced, then renamed to `step-…` — secondaries first,
//!    the primary (holding the index) last: **the primary's rename is the
//!    commit point** — and each parent synced;
//! 5. `latest` replaced atomically; retention applied.
//!
//! Invariants: only this module, recovery and retention rename or sync
//! directories; a failed commit removes its temp folders (and any secondary
//! already renamed) before it returns, so it leaves nothing behind but what
//! was there before.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, info_span, warn};

use crate::catalog;
use crate::config;
use crate::format::{self, FormatError, BLOBS_DIR_NAME, INDEX_FILE_NAME, TMP_PREFIX};
use crate::image::{self, Blob, Layout};
use crate::io::{self as eio, DriveError, EngineChoice, FaultPlan, FaultyEngine, FileIo, IoEngine, IoPolicy, OpKind};
use crate::lock::{DirLock, LockError};
use crate::mem::{BufAddr, SharedBuf};
use crate::progress::Progress;
use crate::read_only::{self, ReadOnly, ReadOnlyDir};
use crate::recovery::{self, RecoveryReport};
use crate::retention::{self, Retention};
use crate::rollback::{self, RollbackError};

#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Target directories; the first is the primary (holds index and `latest`).
    pub dirs: Vec<PathBuf>,
    pub io: IoPolicy,
    pub chunk_bytes: usize,
    pub retention: Option<Retention>,
    /// Test hook: faults injected into every directory's engine.
    pub faults: Option<FaultPlan>,
    /// Create missing directories (`serve`, `launch`, `bench write`); else a
    /// missing one is an error naming it (`gc`, `rollback`).
    pub create: bool,
    /// What the process holding the directory locks does (`serve`, `gc`,
    /// ...) and where a daemon serves, written into each lock file so a
    /// second process can name the holder ([`crate::lock`]).
    pub lock_role: String,
    pub lock_socket: Option<PathBuf>,
    /// The directory the sidecars of several nodes share (the checkpoint
    /// root of their multi-rank steps, [`crate::nodes`]): not locked (every
    /// node's sidecar opens it), probed for its own engine; at open, its
    /// multi-rank temp folders untouched for `shared_stale_after` are removed.
    pub shared: Option<PathBuf>,
    pub shared_stale_after: Duration,
    /// Several nodes, node-local files (`--node-local`, needs `shared`):
    /// this node's id. A rank's shards then go into this node's own
    /// directories (`node-step-…` folders), only blobs and markers into
    /// the shared directory ([`crate::nodes`]).
    pub node_local: Option<String>,
    /// Whether a directory that cannot be written is opened read-only
    /// (no lock, no recovery, writes refused: [`crate::read_only`]).
    pub read_only: ReadOnly,
}

impl StoreOptions {
    pub fn new(dirs: Vec<PathBuf>) -> StoreOptions {
        StoreOptions {
            dirs,
            io: IoPolicy::default(),
            chunk_bytes: config::CHUNK_BYTES_DEFAULT,
            retention: None,
            faults: None,
            create: true,
            lock_role: "store".into(),
            lock_socket: None,
            shared: None,
            shared_stale_after: Duration::from_secs(config::SHARED_STALE_AFTER_DEFAULT_S),
            node_local: None,
            read_only: ReadOnly::Never,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {what}: {source}")]
    Io { path: PathBuf, what: &'static str, source: io::Error },
    #[error(transparent)]
    Probe(#[from] eio::ProbeError),
    #[error("the same directory is given twice: {0}")]
    DuplicateDir(PathBuf),
    #[error("no target directory given")]
    NoDirs,
    #[error("no such directory: {}", .0.display())]
    NoSuchDir(PathBuf),
    #[error("{} is not a directory", .0.display())]
    NotADir(PathBuf),
    #[error(transparent)]
    Locked(#[from] LockError),
    /// A directory this opener must write (`gc`, `rollback`) cannot be.
    #[error("{}: the checkpoint directory is read-only ({source}); {role} writes there and cannot run (`ckpt-sidecar serve` serves loads from it read-only)", dir.display())]
    ReadOnly { dir: PathBuf, role: String, source: io::Error },
    #[error("shared directory {} does not exist: it must be the one directory every node sees (create it there; a missing one is often a shared file system not mounted on this node)", .0.display())]
    NoSharedDir(PathBuf),
}

/// A target directory exists and is a directory; with `create`, a missing
/// one is made (parents too).
fn check_dir(d: &Path, create: bool) -> Result<(), StoreError> {
    match catalog::check_dir(d) {
        Ok(()) => Ok(()),
        Err(catalog::DirError::NoSuchDir(_)) if create => fs::create_dir_all(d).map_err(|e| StoreError::Io {
            path: d.to_path_buf(),
            what: "create directory",
            source: e,
        }),
        Err(catalog::DirError::NoSuchDir(p)) => Err(StoreError::NoSuchDir(p)),
        Err(catalog::DirError::NotADir(p)) => Err(StoreError::NotADir(p)),
        Err(catalog::DirError::Io { path, source }) => Err(StoreError::Io { path, what: "look up directory", source }),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("disk full in {}: {what}{}: {source}", dir.display(), needed_bytes.map_or(String::new(), |n| format!(" needs {n} bytes")))]
    DiskFull { dir: PathBuf, what: String, needed_bytes: Option<u64>, source: io::Error },
    #[error("{path}: {what}: {source}")]
    Io { path: PathBuf, what: String, source: io::Error },
    #[error("step {step} is already committed in {dir}; to save it again, roll back first (ckpt-sidecar rollback {dir} --to STEP, or rollback(STEP) in the shim), or save another step")]
    AlreadyCommitted { step: u64, dir: PathBuf },
    #[error("invalid checkpoint: {0}")]
    Format(#[from] FormatError),
    #[error("step {step}: aborted before the commit point (shutting down); nothing was committed")]
    Aborted { step: u64 },
    #[error("step {step}: its image was never complete ({why}); nothing was committed")]
    Unfilled { step: u64, why: String },
    /// Several ranks' parts that would commit a step no reader can load
    /// (crate::skeleton::parts_disagree).
    #[error("step {step}: {why}; nothing was committed")]
    PartsDisagree { step: u64, why: String },
    /// The path of a target directory no longer names the directory this
    /// Store opened and locked (removed, or removed and made again).
    #[error("{}: the checkpoint directory was {what} after this process opened it, so its one-owner lock is not on the directory there now; saves are refused until the sidecar is restarted", dir.display())]
    DirReplaced { dir: PathBuf, what: &'static str },
    /// The Store was opened read-only ([`crate::read_only`]).
    #[error("{0}")]
    ReadOnly(ReadOnlyDir),
}

impl CommitError {
    pub(crate) fn io(path: &Path, what: impl Into<String>, source: io::Error) -> CommitError {
        if source.raw_os_error() == Some(libc::ENOSPC) || source.raw_os_error() == Some(libc::EDQUOT) {
            // Name the target directory, not the temp folder already removed
            // by the time anyone reads this.
            let dir = path
                .ancestors()
                .find(|a| a.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(TMP_PREFIX)))
                .and_then(Path::parent)
                .unwrap_or(path);
            return CommitError::DiskFull { dir: dir.to_path_buf(), what: what.into(), needed_bytes: None, source };
        }
        CommitError::Io { path: path.to_path_buf(), what: what.into(), source }
    }

    /// Says how many bytes the failed step needed, if the disk was full.
    pub(crate) fn needing(self, n: u64) -> CommitError {
        match self {
            CommitError::DiskFull { dir, what, source, .. } => {
                CommitError::DiskFull { dir, what, needed_bytes: Some(n), source }
            }
            other => other,
        }
    }
}

/// Figures of one commit.
#[derive(Debug, Clone)]
pub struct CommitReport {
    pub step: u64,
    pub path: PathBuf,
    /// Shard, blob and index bytes written.
    pub bytes: u64,
    /// Creating files, reserving space and writing the shards.
    pub write: Duration,
    /// fdatasync of the shards.
    pub sync: Duration,
    /// Blobs, index, renames, directory syncs and `latest`.
    pub commit: Duration,
    pub total: Duration,
    pub deleted_by_retention: Vec<u64>,
}

pub struct TargetDir {
    pub path: PathBuf,
    pub choice: EngineChoice,
    pub(crate) engine: Box<dyn IoEngine>,
}

pub struct Store {
    /// One exclusive lock per directory, held as long as the Store (or by
    /// whoever took them with [`Store::take_locks`]).
    locks: Vec<DirLock>,
    pub(crate) dirs: Vec<TargetDir>,
    paths: Vec<PathBuf>,
    pub(crate) opts: StoreOptions,
    recovery: RecoveryReport,
    /// Set from outside (the daemon's second signal): a commit in progress
    /// stops at its next check and removes its temp folders.
    abort: Option<Arc<AtomicBool>>,
    /// The directory shared with other nodes' sidecars, if any ([`crate::nodes`]).
    pub(crate) shared: Option<TargetDir>,
    /// (st_dev, st_ino) of each of `paths` when they were locked: a commit
    /// first checks that each path still names that directory.
    ids: Vec<(u64, u64)>,
    /// Opened read-only: no locks, no recovery, every write refused.
    read_only: Option<ReadOnlyDir>,
    /// Steps retention must keep whatever its policy says (the daemon's
    /// drain holds the newest step not yet replicated); locked while
    /// retention plans and deletes, so a step held before is never deleted.
    pub(crate) retention_hold: Option<Arc<std::sync::Mutex<std::collections::BTreeSet<u64>>>>,
    /// Incremental commits may link unchanged stable shards
    /// ([`Store::set_link_unchanged`]); false writes everything.
    pub(crate) link_unchanged: bool,
    /// What the last incremental commit found ([`Store::take_incremental`]).
    incremental: Option<IncrementalReport>,
}

/// What an incremental commit (a layout planned with
/// `LayoutOptions::incremental`, digests given) found and did.
#[derive(Debug, Clone, Default)]
pub struct IncrementalReport {
    /// The committed step it compared with; None: there was none.
    pub prev_step: Option<u64>,
    /// Shards linked from `prev_step` instead of written, and their bytes.
    pub linked_files: usize,
    pub linked_bytes: u64,
    /// Tensors that changed since `prev_step` (or are new); None when there
    /// was nothing to compare with.
    pub changed: Option<std::collections::HashSet<String>>,
}

impl Store {
    /// Creates missing directories (with `opts.create`), locks every one
    /// (a directory held by another process is refused, naming it), chooses
    /// the engine per directory, and runs recovery; or, read-only
    /// (`opts.read_only`, [`crate::read_only`]), neither locks nor recovers.
    pub fn open(opts: StoreOptions) -> Result<Store, StoreError> {
        if opts.dirs.is_empty() {
            return Err(StoreError::NoDirs);
        }
        let mut paths: Vec<PathBuf> = Vec::new();
        for d in &opts.dirs {
            check_dir(d, opts.create)?;
            let p = fs::canonicalize(d).map_err(|e| StoreError::Io {
                path: d.clone(),
                what: "resolve directory",
                source: e,
            })?;
            if paths.contains(&p) {
                return Err(StoreError::DuplicateDir(p));
            }
            paths.push(p);
        }
        let (locks, read_only) = lock_or_read_only(&paths, &opts)?;
        let mut ids = Vec::new();
        for p in &paths {
            let m = fs::metadata(p).map_err(|e| StoreError::Io {
                path: p.clone(),
                what: "look up directory",
                source: e,
            })?;
            ids.push((m.dev(), m.ino()));
        }
        if let Some(ro) = &read_only {
            warn!(dir = %ro.dir.display(), why = %ro.why, "read-only: no directory lock, no recovery; loads are served, saves, rollback and gc refused");
        }
        let mut dirs = Vec::new();
        for p in &paths {
            // The write probe leaves nothing, but needs to write.
            let choice = match read_only {
                Some(_) => {
                    let mut c = eio::probe_for_read(p, opts.io)?.0;
                    c.why.push("read-only: not probed for writes".into());
                    c
                }
                None => eio::probe(p, opts.io)?,
            };
            let mut engine = choice.open_engine().map_err(|e| StoreError::Io {
                path: p.clone(),
                what: "start I/O engine",
                source: e,
            })?;
            if let Some(plan) = &opts.faults {
                engine = Box::new(FaultyEngine::new(engine, plan.clone()));
            }
            info!(dir = %p.display(), engine = %choice.name(), why = %choice.why.join("; "), "target directory");
            dirs.push(TargetDir { path: p.clone(), choice, engine });
        }
        let shared = match &opts.shared {
            Some(d) => Some(open_shared(d, &paths, &opts, read_only.is_some())?),
            None => None,
        };
        if read_only.is_some() {
            // Recovery writes (removes leftovers, repairs `latest`); readers
            // skip temp folders and fall back past a `latest` that fails.
            return Ok(Store {
                locks,
                dirs,
                paths,
                opts,
                recovery: RecoveryReport::default(),
                abort: None,
                shared,
                ids,
                read_only,
                retention_hold: None,
                link_unchanged: true,
                incremental: None,
            });
        }
        let mut recovery = recovery::recover(&paths).map_err(|e| StoreError::Io {
            path: paths[0].clone(),
            what: "recovery",
            source: e,
        })?;
        if let Some(sh) = &shared {
            let removed = recovery::recover_shared(&sh.path, opts.shared_stale_after).map_err(|e| StoreError::Io {
                path: sh.path.clone(),
                what: "recovery of the shared directory",
                source: e,
            })?;
            recovery.removed.extend(removed);
            if opts.node_local.is_some() {
                let removed = recovery::sweep_node_local(&paths, &sh.path, &Default::default()).map_err(|e| {
                    StoreError::Io { path: paths[0].clone(), what: "recovery of node-local step folders", source: e }
                })?;
                recovery.removed.extend(removed);
            }
        }
        for p in &recovery.removed {
            info!(path = %p.display(), "recovery removed");
        }
        if let Some((before, after)) = &recovery.latest_repaired {
            warn!(?before, ?after, "recovery repaired latest");
        }
        for w in &recovery.warnings {
            warn!("{w}");
        }
        Ok(Store {
            locks,
            dirs,
            paths,
            opts,
            recovery,
            abort: None,
            shared,
            ids,
            read_only: None,
            retention_hold: None,
            link_unchanged: true,
            incremental: None,
        })
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Whether later incremental commits may link unchanged stable shards
    /// of the newest committed step (true at open); false writes the next
    /// ones in full (`--full-every`).
    pub fn set_link_unchanged(&mut self, link: bool) {
        self.link_unchanged = link;
    }

    /// What the last successful incremental commit found (taken: None
    /// until the next one).
    pub fn take_incremental(&mut self) -> Option<IncrementalReport> {
        self.incremental.take()
    }

    /// Hands the directory locks to the caller, who must outlive every use
    /// of this Store (a daemon whose committer thread owns the Store, but
    /// whose main thread decides when the process ends, releases them last).
    pub fn take_locks(&mut self) -> Vec<DirLock> {
        std::mem::take(&mut self.locks)
    }

    /// Rolls the timeline back to the committed checkpoint `step`
    /// ([`crate::rollback`]); returns the later steps un-committed. The
    /// resident image of a caller that keeps one must be dropped if it is
    /// one of them.
    pub fn rollback(&mut self, step: u64) -> Result<Vec<u64>, RollbackError> {
        self.check_dirs_unchanged().map_err(|e| RollbackError::Refused { step, why: e.to_string() })?;
        rollback::rollback(&self.paths, step)
    }

    pub fn primary(&self) -> &Path {
        &self.paths[0]
    }

    pub fn targets(&self) -> &[TargetDir] {
        &self.dirs
    }

    /// Opened read-only, and why ([`crate::read_only`]).
    pub fn read_only(&self) -> Option<&ReadOnlyDir> {
        self.read_only.as_ref()
    }

    pub fn recovery(&self) -> &RecoveryReport {
        &self.recovery
    }

    /// `engine` of every directory, joined (the figure benches print).
    pub fn engine_names(&self) -> String {
        let mut names: Vec<String> = self.dirs.iter().map(|d| d.choice.name()).collect();
        names.dedup();
        names.join(",")
    }

    /// Registers staging memory with every engine so writes from it skip page
    /// pinning. Refusal (e.g. RLIMIT_MEMLOCK) only costs speed and is logged.
    pub fn register_staging(&mut self, buf: &Arc<SharedBuf>) {
        for d in self.dirs.iter_mut().chain(self.shared.as_mut()) {
            if let Err(e) = d.engine.register(buf.clone()) {
                warn!(dir = %d.path.display(), "staging memory not registered with io_uring ({e}); writes go unregistered");
            }
        }
    }

    /// Makes every later commit check `flag` before it writes, after the
    /// shards are synced, and just before the commit point; when set, the
    /// commit fails with [`CommitError::Aborted`] and leaves nothing behind.
    pub fn set_abort_flag(&mut self, flag: Arc<AtomicBool>) {
        self.abort = Some(flag);
    }

    /// Makes retention keep every step in `hold` (checked under its lock).
    pub fn set_retention_hold(&mut self, hold: Arc<std::sync::Mutex<std::collections::BTreeSet<u64>>>) {
        self.retention_hold = Some(hold);
    }

    /// Whether every target directory's path still names the directory
    /// this Store opened and locked (issue 19: a directory removed and made
    /// again under a live sidecar would otherwise be written without its
    /// lock, beside a `gc` or a second sidecar that took the new one's).
    /// A read-only Store refuses here too (commit and rollback check this first).
    pub fn check_dirs_unchanged(&self) -> Result<(), CommitError> {
        self.check_writable()?;
        for (p, &(dev, ino)) in self.paths.iter().zip(&self.ids) {
            match fs::metadata(p) {
                Ok(m) if (m.dev(), m.ino()) == (dev, ino) => {}
                Ok(_) => return Err(CommitError::DirReplaced { dir: p.clone(), what: "removed and made again" }),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(CommitError::DirReplaced { dir: p.clone(), what: "removed" })
                }
                Err(e) => return Err(CommitError::io(p, "look up directory", e)),
            }
        }
        Ok(())
    }

    /// Refuses in a Store opened read-only ([`crate::read_only`]): checked
    /// first by every write into the checkpoint directories (commits,
    /// rollback, a rank's part and its commit; retention is skipped).
    pub(crate) fn check_writable(&self) -> Result<(), CommitError> {
        match &self.read_only {
            Some(ro) => Err(CommitError::ReadOnly(ro.clone())),
            None => Ok(()),
        }
    }

    pub(crate) fn check_abort(&self, step: u64) -> Result<(), CommitError> {
        match &self.abort {
            Some(f) if f.load(Ordering::SeqCst) => Err(CommitError::Aborted { step }),
            _ => Ok(()),
        }
    }

    /// The primary directory's engine and the request size, for
    /// [`crate::atomic`]'s `Store::write_file`; an error if the store is
    /// aborting.
    pub(crate) fn primary_engine(&mut self, dest: &Path) -> Result<(&mut dyn IoEngine, usize), CommitError> {
        if self.abort.as_ref().is_some_and(|f| f.load(Ordering::SeqCst)) {
            return Err(CommitError::Io {
                path: dest.to_path_buf(),
                what: "aborted before writing (shutting down)".into(),
                source: io::Error::from(io::ErrorKind::Interrupted),
            });
        }
        Ok((self.dirs[0].engine.as_mut(), self.opts.chunk_bytes))
    }

    /// Writes and commits a checkpoint whose image sits in `staging` as
    /// `layout` describes, with the given tensor checksums, then applies
    /// retention.
    pub fn commit(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        tensor_crcs: &[u32],
        blobs: &[Blob<'_>],
    ) -> Result<CommitReport, CommitError> {
        let t0 = Instant::now();
        let mut report = self.commit_filled(step, layout, staging, Fill::Done(tensor_crcs), blobs)?;
        report.deleted_by_retention = self.retain();
        report.total = t0.elapsed();
        Ok(report)
    }

    /// Writes and commits a checkpoint whose image is still being filled
    /// into `staging` ([`Progress`]): each chunk is written as soon as it is
    /// filled, and the index (with the filler's checksums) once it ended. A
    /// filler that fails stops the commit before its commit point
    /// ([`CommitError::Unfilled`]). Retention is left to the caller
    /// ([`Store::retain`]), so whoever waits for the commit need not wait
    /// for deletions too. The caller keeps `staging` untouched below the
    /// ready prefix, and must not free the image before the filler ended
    /// (even when this returns an error first). Memory written by a filler
    /// while shared belongs in a [`SharedBuf`] (no slices), not an
    /// [`crate::mem::AlignedBuf`] (whose `&self` gives them out).
    pub fn commit_fed(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        progress: &Progress,
        blobs: &[Blob<'_>],
    ) -> Result<CommitReport, CommitError> {
        self.commit_filled(step, layout, staging, Fill::Fed(progress), blobs)
    }

    /// [`Store::commit`] of an incremental image (`LayoutOptions::
    /// incremental`) with each tensor's digest: the index records them,
    /// and unchanged stable shards are linked ([`crate::incremental`]).
    pub fn commit_with_digests(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        tensor_crcs: &[u32],
        digests: &[u128],
        blobs: &[Blob<'_>],
    ) -> Result<CommitReport, CommitError> {
        let t0 = Instant::now();
        let mut report = self.commit_filled(step, layout, staging, Fill::Summed(tensor_crcs, digests), blobs)?;
        report.deleted_by_retention = self.retain();
        report.total = t0.elapsed();
        Ok(report)
    }

    /// Applies the retention policy, if any; returns the steps deleted. A
    /// failure is logged: the newest checkpoint is committed either way.
    pub fn retain(&mut self) -> Vec<u64> {
        let Some(policy) = self.opts.retention.filter(|_| self.read_only.is_none()) else { return Vec::new() };
        let held = self.retention_hold.as_ref().map(|h| h.lock().unwrap_or_else(|p| p.into_inner()));
        let applied = retention::plan(&self.paths, policy).and_then(|doomed| {
            let doomed: Vec<u64> =
                doomed.into_iter().filter(|s| !held.as_ref().is_some_and(|h| h.contains(s))).collect();
            for &step in &doomed {
                retention::delete(&self.paths, step)?;
            }
            Ok(doomed)
        });
        drop(held);
        match applied {
            Ok(deleted) => deleted,
            Err(e) => {
                warn!("retention failed ({e}); the new checkpoint is committed");
                Vec::new()
            }
        }
    }

    fn commit_filled(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        fill: Fill<'_>,
        blobs: &[Blob<'_>],
    ) -> Result<CommitReport, CommitError> {
        let t0 = Instant::now();
        let step_name = format::step_dir_name(step)?;
        image::validate_blobs(blobs)?;
        assert_eq!(layout.opts.n_dirs, self.dirs.len(), "layout planned for another directory count");
        assert!(staging.len_bytes() as u64 >= layout.staging_len, "staging smaller than the layout");
        let span = info_span!("checkpoint", step, bytes = layout.file_bytes());
        let _enter = span.enter();
        self.check_dirs_unchanged()?;
        let primary = self.paths[0].clone();
        if catalog::is_committed(&primary, step) {
            return Err(CommitError::AlreadyCommitted { step, dir: primary });
        }
        let tmp_name = format!("{TMP_PREFIX}{}-{:016x}", &step_name[format::STEP_PREFIX.len()..], eio::nonce());
        let tmps: Vec<PathBuf> = self.paths.iter().map(|d| d.join(&tmp_name)).collect();
        let mut renamed: Vec<PathBuf> = Vec::new();
        let result = self.commit_inner(step, layout, staging, fill, blobs, &tmps, &mut renamed, t0);
        if result.is_err() {
            for p in tmps.iter().chain(&renamed) {
                if let Err(e) = catalog::remove_tree(p) {
                    warn!(path = %p.display(), "could not remove after a failed commit ({e}); recovery will");
                }
            }
            for d in &self.paths {
                let _ = catalog::fsync_dir(d);
            }
        }
        let mut report = result?;
        report.total = t0.elapsed();
        info!(
            write_s = report.write.as_secs_f64(),
            sync_s = report.sync.as_secs_f64(),
            commit_s = report.commit.as_secs_f64(),
            total_s = report.total.as_secs_f64(),
            "committed"
        );
        Ok(report)
    }

    #[allow(clippy::too_many_arguments)]
    fn commit_inner(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        fill: Fill<'_>,
        blobs: &[Blob<'_>],
        tmps: &[PathBuf],
        renamed: &mut Vec<PathBuf>,
        t0: Instant,
    ) -> Result<CommitReport, CommitError> {
        self.check_abort(step)?;
        for t in tmps {
            fs::create_dir(t).map_err(|e| CommitError::io(t, "create temp folder", e))?;
        }
        // Incremental: the step compared with, and the shards that may be
        // linked from it (decided once the save's digests are in).
        self.incremental = None;
        let prev = if layout.opts.incremental { crate::incremental::Prev::newest(&self.paths) } else { None };
        let candidates: Vec<Option<PathBuf>> = (0..layout.shards.len())
            .map(|s| prev.as_ref().filter(|_| self.link_unchanged).and_then(|p| p.candidate(layout, s)))
            .collect();
        let (prev_ref, candidates) = (prev.as_ref(), &candidates);
        // Shards: one thread per directory, each with its own engine. Meanwhile
        // this thread writes and syncs the blobs and the index (once a fed
        // image's checksums are in), so their syncs share the shards'
        // journal commits instead of following them one by one.
        let chunk_bytes = self.opts.chunk_bytes;
        let paths = &self.paths;
        let (results, small) = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .dirs
                .iter_mut()
                .enumerate()
                .map(|(dir_idx, d)| {
                    let tmp = &tmps[dir_idx];
                    std::thread::Builder::new()
                        .name(format!("ckpt-write-{dir_idx}"))
                        .spawn_scoped(s, move || {
                            write_dir(
                                d,
                                step,
                                dir_idx as u32,
                                tmp,
                                layout,
                                staging,
                                fill,
                                chunk_bytes,
                                prev_ref,
                                candidates,
                            )
                        })
                        .expect("spawning a writer thread")
                })
                .collect();
            let small = write_blobs_and_index(step, layout, fill, blobs, &tmps[0], paths);
            let results: Vec<Result<(Duration, Duration, Vec<usize>), CommitError>> =
                handles.into_iter().map(|h| h.join().expect("writer thread panicked")).collect();
            (results, small)
        });
        let (mut write, mut sync) = (Duration::ZERO, Duration::ZERO);
        let mut linked = Vec::new();
        for r in results {
            let (w, s, l) = r?;
            write = write.max(w);
            sync = sync.max(s);
            linked.extend(l);
        }
        let t_commit = Instant::now();
        let small_bytes = small?;
        let linked_bytes: u64 = linked.iter().map(|&s| layout.shards[s].file_len).sum();
        let bytes = layout.file_bytes() - linked_bytes + small_bytes;
        let incremental = match fill.digests() {
            Some(d) if layout.opts.incremental => {
                let crcs = fill.crcs(step)?;
                Some(IncrementalReport {
                    prev_step: prev.as_ref().map(|p| p.step),
                    linked_files: linked.len(),
                    linked_bytes,
                    changed: prev.as_ref().map(|p| p.changed(layout, &crcs, &d)),
                })
            }
            _ => None,
        };
        if let Some(r) = &incremental {
            info!(prev_step = ?r.prev_step, linked_files = r.linked_files, linked_bytes = r.linked_bytes, changed = ?r.changed.as_ref().map(|c| c.len()), "incremental");
        }
        self.check_abort(step)?;
        for t in tmps {
            catalog::fsync_dir(t).map_err(|e| CommitError::io(t, "sync temp folder", e))?;
        }
        self.check_abort(step)?;
        // Secondaries first; the primary's rename is the commit point.
        for (i, t) in tmps.iter().enumerate().skip(1).chain(std::iter::once((0, &tmps[0]))) {
            let dest = catalog::step_path(&self.paths[i], step);
            fs::rename(t, &dest).map_err(|e| CommitError::io(&dest, "rename temp folder into place", e))?;
            if i != 0 {
                renamed.push(dest.clone());
            }
            catalog::fsync_dir(&self.paths[i]).map_err(|e| {
                if i == 0 {
                    // Renamed but the rename may not be durable: still not
                    // reported as committed; recovery settles it either way.
                    renamed.push(dest.clone());
                }
                CommitError::io(&self.paths[i], "sync directory after rename", e)
            })?;
        }
        renamed.clear();
        self.incremental = incremental;
        let primary = &self.paths[0];
        let update_latest = match catalog::latest_step(primary) {
            Ok(Some(l)) => l <= step,
            _ => true,
        };
        if update_latest {
            if let Err(e) = catalog::write_latest(primary, step) {
                warn!("checkpoint committed but `latest` not updated ({e}); recovery repairs it at the next start");
            }
        }
        Ok(CommitReport {
            step,
            path: catalog::step_path(primary, step),
            bytes,
            write,
            sync,
            commit: t_commit.elapsed(),
            total: t0.elapsed(),
            deleted_by_retention: Vec::new(),
        })
    }
}

/// The shared directory of several nodes: it must exist (made here, a
/// missing mount would have each node commit into a local folder of its own
/// and wait for the others' parts forever), never one of the node's own
/// directories, probed for its engine (no lock: every node's sidecar opens it).
fn open_shared(d: &Path, paths: &[PathBuf], opts: &StoreOptions, read_only: bool) -> Result<TargetDir, StoreError> {
    check_dir(d, false).map_err(|e| match e {
        StoreError::NoSuchDir(p) => StoreError::NoSharedDir(p),
        e => e,
    })?;
    let p = fs::canonicalize(d).map_err(|e| StoreError::Io {
        path: d.to_path_buf(),
        what: "resolve directory",
        source: e,
    })?;
    if paths.contains(&p) {
        return Err(StoreError::DuplicateDir(p));
    }
    let choice = if read_only { eio::probe_for_read(&p, opts.io)?.0 } else { eio::probe(&p, opts.io)? };
    let mut engine =
        choice.open_engine().map_err(|e| StoreError::Io { path: p.clone(), what: "start I/O engine", source: e })?;
    if let Some(plan) = &opts.faults {
        engine = Box::new(FaultyEngine::new(engine, plan.clone()));
    }
    info!(dir = %p.display(), engine = %choice.name(), why = %choice.why.join("; "), "shared directory (several nodes)");
    Ok(TargetDir { path: p, choice, engine })
}

/// Locks every directory, or, as `opts.read_only` says, none: with
/// `Always`, or with `Auto` when a lock file cannot be opened for writing
/// (the locks already taken are dropped: a read-only Store holds none).
fn lock_or_read_only(
    paths: &[PathBuf],
    opts: &StoreOptions,
) -> Result<(Vec<DirLock>, Option<ReadOnlyDir>), StoreError> {
    if opts.read_only == ReadOnly::Always {
        return Ok((Vec::new(), Some(ReadOnlyDir { dir: paths[0].clone(), why: "--read-only".into() })));
    }
    let mut locks = Vec::new();
    for p in paths {
        match DirLock::acquire(p, &opts.lock_role, opts.lock_socket.as_deref()) {
            Ok(l) => locks.push(l),
            Err(LockError::Io { source, .. }) if read_only::is_read_only_error(&source) => {
                if opts.read_only == ReadOnly::Auto {
                    return Ok((Vec::new(), Some(ReadOnlyDir { dir: p.clone(), why: source.to_string() })));
                }
                return Err(StoreError::ReadOnly { dir: p.clone(), role: opts.lock_role.clone(), source });
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok((locks, None))
}

/// Writes the shards of directory `dir_idx` into `tmp` and syncs them, as
/// [`write_shards`] (all of them), except those with a link `candidates` (incremental):
/// these wait for the save's checksums and digests, then are linked from
/// the previous step when every tensor of theirs is unchanged, else
/// written. Returns (write time, sync time, the shards linked).
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_dir(
    d: &mut TargetDir,
    step: u64,
    dir_idx: u32,
    tmp: &Path,
    layout: &Layout,
    staging: &dyn BufAddr,
    fill: Fill<'_>,
    chunk_bytes: usize,
    prev: Option<&crate::incremental::Prev>,
    candidates: &[Option<PathBuf>],
) -> Result<(Duration, Duration, Vec<usize>), CommitError> {
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
pub(crate) fn write_shards(
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
fn write_blobs_and_index(
    step: u64,
    layout: &Layout,
    fill: Fill<'_>,
    blobs: &[Blob<'_>],
    primary_tmp: &Path,
    paths: &[PathBuf],
) -> Result<u64, CommitError> {
    let mut bytes = 0;
    if !blobs.is_empty() {
        let bdir = primary_tmp.join(BLOBS_DIR_NAME);
        fs::create_dir(&bdir).map_err(|e| CommitError::io(&bdir, "create blobs folder", e))?;
        for b in blobs {
            let p = bdir.join(b.name);
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
    let index = layout.index_json_with(step, &crcs, digests.as_deref(), blobs, secondary_dirs);
    let ipath = primary_tmp.join(INDEX_FILE_NAME);
    write_small_file(&ipath, &index).map_err(|e| CommitError::io(&ipath, "write index", e))?;
    Ok(bytes + index.len() as u64)
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
