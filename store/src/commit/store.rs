//! Opening a [`Store`]: target directories checked (made with
//! `opts.create`), canonicalised and told apart, each locked, probed for
//! its engine and recovered; or opened read-only, neither locked nor
//! recovered. Also the Store's settings, and the checks every write makes
//! first (directories unchanged, writable, not aborting).
//!
//! Invariant: a Store holds one exclusive lock per target directory for as
//! long as it writes there, and writes only while each path still names
//! the directory it locked.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use super::{CommitError, IncrementalReport};
use crate::catalog;
use crate::config;
use crate::incremental::{Kept, Prev};
use crate::io::{self as eio, EngineChoice, FaultPlan, FaultyEngine, IoEngine, IoPolicy};
use crate::lock::{DirLock, LockError};
use crate::mem::RawBuf;
use crate::read_only::{self, ReadOnly, ReadOnlyDir};
use crate::recovery::{self, RecoveryReport};
use crate::retention::Retention;
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
    /// The node-local sweep at open is left to the caller
    /// ([`Store::sweep_node_local`]): with no shared file system the shared
    /// directory is this node's own, and it first takes the newest step its
    /// peers committed, lest this node's files of it be swept as uncommitted.
    pub sweep_later: bool,
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
            sweep_later: false,
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
    pub(super) paths: Vec<PathBuf>,
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
    pub(super) read_only: Option<ReadOnlyDir>,
    /// Steps retention must keep whatever its policy says (the daemon's
    /// drain holds the newest step not yet replicated); locked while
    /// retention plans and deletes, so a step held before is never deleted.
    pub(crate) retention_hold: Option<Arc<std::sync::Mutex<std::collections::BTreeSet<u64>>>>,
    /// Incremental commits may link unchanged stable shards
    /// ([`Store::set_link_unchanged`]); false writes everything.
    pub(crate) link_unchanged: bool,
    /// What the last incremental commit found ([`Store::take_incremental`]).
    pub(super) incremental: Option<IncrementalReport>,
    /// The step this Store committed last, for its next incremental commit
    /// to compare with ([`Kept`]); taken by every commit, put back by one
    /// that succeeded with digests.
    pub(super) kept_prev: Option<Kept>,
    /// Per rank, its part of the step this Store last wrote into the
    /// shared directory, for its next part ([`Prev::newest_shared_or_kept`]).
    pub(crate) kept_parts: HashMap<u32, Prev>,
    /// As the coordinator of several nodes' steps: its ranks' markers and
    /// their merge, kept to read and render the next ones by template.
    pub(crate) kept_markers: crate::kept_markers::KeptMarkers,
    /// No shared file system: the committed indexes installed here, each
    /// read by the template of the one before (as `nodes::KeptIndex` reads).
    pub(crate) installed: crate::kept_markers::KeptMarkers,
}

impl Store {
    /// Creates missing directories (with `opts.create`), locks every one
    /// (a directory held by another process is refused, naming it), chooses
    /// the engine per directory, and runs recovery; or, read-only
    /// (`opts.read_only`, [`crate::read_only`]), neither locks nor recovers.
    pub fn open(opts: StoreOptions) -> Result<Store, StoreError> {
        let paths = resolve_dirs(&opts)?;
        let (locks, read_only) = lock_or_read_only(&paths, &opts)?;
        let ids = dir_ids(&paths)?;
        if let Some(ro) = &read_only {
            warn!(dir = %ro.dir.display(), why = %ro.why, "read-only: no directory lock, no recovery; loads are served, saves, rollback and gc refused");
        }
        let dirs = paths.iter().map(|p| open_target(p, &opts, read_only.is_some())).collect::<Result<Vec<_>, _>>()?;
        let shared = match &opts.shared {
            Some(d) => Some(open_shared(d, &paths, &opts, read_only.is_some())?),
            None => None,
        };
        let recovery = match read_only {
            // Recovery writes (removes leftovers, repairs `latest`); readers
            // skip temp folders and fall back past a `latest` that fails.
            Some(_) => RecoveryReport::default(),
            None => recover(&paths, shared.as_ref(), &opts)?,
        };
        Ok(Store {
            locks,
            dirs,
            paths,
            opts,
            recovery,
            abort: None,
            shared,
            ids,
            read_only,
            retention_hold: None,
            link_unchanged: true,
            incremental: None,
            kept_prev: None,
            kept_parts: HashMap::new(),
            kept_markers: Default::default(),
            installed: Default::default(),
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
        // Whatever it un-commits, the kept steps are no longer the newest.
        self.kept_prev = None;
        self.kept_parts.clear();
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
    pub fn register_staging(&mut self, buf: &Arc<RawBuf>) {
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
    /// this Store opened and locked: a directory removed and made again
    /// under a live sidecar would otherwise be written without its lock,
    /// beside a `gc` or a second sidecar that took the new one's.
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
}

/// The target directories, each checked (made with `opts.create`) and
/// canonicalised; the same directory twice is refused.
fn resolve_dirs(opts: &StoreOptions) -> Result<Vec<PathBuf>, StoreError> {
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
    Ok(paths)
}

/// (st_dev, st_ino) of each directory, as [`Store::check_dirs_unchanged`]
/// compares them later.
fn dir_ids(paths: &[PathBuf]) -> Result<Vec<(u64, u64)>, StoreError> {
    let mut ids = Vec::new();
    for p in paths {
        let m =
            fs::metadata(p).map_err(|e| StoreError::Io { path: p.clone(), what: "look up directory", source: e })?;
        ids.push((m.dev(), m.ino()));
    }
    Ok(ids)
}

/// A target directory with its engine: probed for writes, or (read-only)
/// for reads only, since the write probe leaves nothing but needs to write.
fn open_target(p: &Path, opts: &StoreOptions, read_only: bool) -> Result<TargetDir, StoreError> {
    let choice = if read_only {
        let mut c = eio::probe_for_read(p, opts.io)?.0;
        c.why.push("read-only: not probed for writes".into());
        c
    } else {
        eio::probe(p, opts.io)?
    };
    let mut engine = choice.open_engine().map_err(|e| StoreError::Io {
        path: p.to_path_buf(),
        what: "start I/O engine",
        source: e,
    })?;
    if let Some(plan) = &opts.faults {
        engine = Box::new(FaultyEngine::new(engine, plan.clone()));
    }
    info!(dir = %p.display(), engine = %choice.name(), why = %choice.why.join("; "), "target directory");
    Ok(TargetDir { path: p.to_path_buf(), choice, engine })
}

/// Recovery of every target directory, then of the shared one (stale
/// multi-rank temp folders; with node-local files, this node's step folders
/// no step keeps); what it did is logged.
fn recover(paths: &[PathBuf], shared: Option<&TargetDir>, opts: &StoreOptions) -> Result<RecoveryReport, StoreError> {
    let mut recovery =
        recovery::recover(paths).map_err(|e| StoreError::Io { path: paths[0].clone(), what: "recovery", source: e })?;
    if let Some(sh) = shared {
        let removed = recovery::recover_shared(&sh.path, opts.shared_stale_after).map_err(|e| StoreError::Io {
            path: sh.path.clone(),
            what: "recovery of the shared directory",
            source: e,
        })?;
        recovery.removed.extend(removed);
        if opts.node_local.is_some() && !opts.sweep_later {
            let removed = recovery::sweep_node_local(paths, &sh.path, &Default::default()).map_err(|e| {
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
    Ok(recovery)
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
