//! The drain tier (`--drain URL`): a thread (`ckpt-drain`) that uploads
//! each step committed in the local directories to a shared file system or
//! an object store (`ckpt_tier::Target`), after it is Durable: its files
//! (read from every target directory, checked against the local index's
//! checksums), then its index, the remote commit point (phase
//! **Replicated**), then the remote `latest`.
//!
//! Behaviour:
//! - Falling behind: of the committed steps not yet drained, only the
//!   newest is uploaded; the older ones are skipped (said in `status` and
//!   the log). `--drain-every K` drains multiples of K only.
//! - Target down or slow: local checkpoints go on (the committer never
//!   waits for this thread); an upload that fails is retried with a
//!   doubling backoff, and the log says so once per change of state
//!   (down, then up again). Nothing is claimed Replicated before the
//!   remote index is written; a step half uploaded by a killed sidecar is
//!   never visible remotely (no index) and is uploaded again by the next
//!   one, which first removes such leftovers (`Target::clean_incomplete`).
//! - Retention: `--drain-keep N` deletes the oldest remote steps beyond N
//!   (never the newest); the local step that is the newest not yet
//!   replicated is held from local retention ([`Drain::hold`]).
//! - Restore: [`Drain::remote_source`] says whether a load must read the
//!   drain target (the step is not local, or the target has a newer one
//!   than `latest`), and makes that step readable (`crate::drain::remote_source`):
//!   a `file://` target is an ordinary checkpoint directory, read in
//!   place; an object store's step is streamed into the load's memory
//!   with every checksum checked as a local load checks it, and no local
//!   copy.
//!
//! Invariants: the thread never holds the state lock across a request to
//! the target; waiters are bounded ([`config::DRAIN_WAITERS_MAX`]) and
//! answered exactly once (Replicated, or an error naming why not).

pub mod remote_source;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ckpt_store::catalog;
use ckpt_store::format::{self, Index, BLOBS_DIR_NAME, INDEX_FILE_NAME};
use ckpt_tier::{LocalFile, Target};
use ckpt_wire::{DrainReport, ErrorCode, Reply};
use tracing::{info, warn};

use crate::config;
pub use crate::drain::remote_source::{RemoteCkpt, RemoteFrom, RemoteStep};
use crate::memory::staging::{Lent, Staging};

/// What `--drain*` asked for.
#[derive(Debug, Clone)]
pub struct DrainOptions {
    pub url: String,
    /// Drain multiples of this only (1: every step).
    pub every: u64,
    /// Keep this many remote steps (None: all).
    pub keep: Option<usize>,
    /// Upload bandwidth limit (None: unlimited).
    pub bandwidth_bytes_per_s: Option<u64>,
}

/// Where the drain answers a client that waits for a step to be replicated
/// (a session's reply side, `crate::state::reply::Replies`): the drain knows
/// no sessions, only this.
pub trait Answer: Send + Sync {
    /// Sends one reply; false if it could not be sent.
    fn send(&self, reply: &Reply) -> bool;
    /// Whether the client has gone: its wait is dropped unanswered.
    fn is_gone(&self) -> bool;
}

/// One client waiting for a step to be replicated.
struct Waiter {
    replies: Arc<dyn Answer>,
    id: u64,
    step: u64,
}

#[derive(Default)]
struct State {
    up: bool,
    /// Why the target counts as down.
    error: String,
    /// Steps known to be committed remotely.
    replicated: BTreeSet<u64>,
    /// The newest step handled (replicated or skipped): older steps are
    /// never drained again.
    done_upto: Option<u64>,
    /// Skipped steps (the newest few).
    skipped: BTreeSet<u64>,
    uploading: Option<u64>,
    backlog: Vec<u64>,
    bytes_per_s: f64,
    waiters: Vec<Waiter>,
    /// Set by [`Drain::committed`]: look again now.
    wake: bool,
    /// Several nodes: steps whose files this node uploaded (and marked).
    mine_uploaded: BTreeSet<u64>,
    /// Several nodes: the step whose remote commit this node last said it waits for.
    waiting_said: Option<u64>,
    /// The files of the step this sidecar last replicated, by name, as
    /// they were on this node: a file of a later step that is the same
    /// one (an incremental save's hard link) is copied on the target
    /// from that step instead of uploaded again.
    last_files: Option<(u64, HashMap<String, FileId>)>,
    /// Since start: bytes uploaded, and bytes copied on the target instead.
    uploaded_bytes: u64,
    copied_bytes: u64,
    /// Of the bytes uploaded, those taken from staging memory (not read back from disk).
    from_memory_bytes: u64,
}

/// A local file's identity: the same inode (an incremental save links an
/// unchanged shard of the previous step), not modified since, with the
/// same length and checksum in both indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    mtime_ns: i128,
    len: u64,
    crc32c: u32,
}

impl FileId {
    fn of(f: &LocalFile) -> Option<FileId> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&f.local_path).ok()?;
        Some(FileId {
            dev: m.dev(),
            ino: m.ino(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            len: f.len,
            crc32c: f.crc32c,
        })
    }
}

/// What one step's drain moved: uploaded, or copied on the target.
#[derive(Debug, Clone, Copy)]
struct Moved {
    stats: ckpt_tier::UploadStats,
    copied_bytes: u64,
    copied_files: usize,
    /// Of the bytes uploaded, those taken from staging memory.
    from_memory_bytes: u64,
}

/// Several nodes with node-local files (`--shared` and a drain): the
/// committed steps are in the shared directory; each node uploads the
/// files it holds and marks them uploaded there; the drain's coordinator
/// (`ckpt_store::nodes::drain_coordinator`: the node holding rank 0's files)
/// uploads the blobs and commits the remote step once every node's mark is in.
#[derive(Debug, Clone)]
pub struct NodesDrain {
    pub shared_dir: PathBuf,
    pub me: ckpt_store::restore::ThisNode,
}

/// The drain: shared by the drain thread, the committer (which wakes it)
/// and the sessions (WaitReplicated, loads).
pub struct Drain {
    target: Target,
    opts: DrainOptions,
    /// The local target directories, the primary first.
    dirs: Vec<PathBuf>,
    state: Mutex<State>,
    cv: Condvar,
    /// Steps local retention must not delete (the newest not yet replicated).
    hold: Arc<Mutex<BTreeSet<u64>>>,
    /// Several nodes ([`NodesDrain`]).
    nodes: Option<NodesDrain>,
    /// The daemon's staging: a step still resident there right after its
    /// commit is uploaded from memory ([`ResidentFiles`]).
    staging: std::sync::OnceLock<Arc<Staging>>,
}

#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// The tier's text names the URL (never a secret).
    #[error("--drain (the sidecar does not start): {source}")]
    Open { url: String, source: ckpt_tier::TierError },
    #[error("starting the drain thread: {0}")]
    Thread(std::io::Error),
}

impl Drain {
    /// Opens the target (one authenticated request: a wrong credential or an
    /// unreachable endpoint fails here, naming the URL).
    pub fn open(opts: DrainOptions, dirs: Vec<PathBuf>) -> Result<Arc<Drain>, DrainError> {
        Drain::open_nodes(opts, dirs, None)
    }

    /// [`Drain::open`] for a node of several ([`NodesDrain`]).
    pub fn open_nodes(
        opts: DrainOptions,
        dirs: Vec<PathBuf>,
        nodes: Option<NodesDrain>,
    ) -> Result<Arc<Drain>, DrainError> {
        let topts =
            ckpt_tier::TargetOptions { bandwidth_bytes_per_s: opts.bandwidth_bytes_per_s, ..Default::default() };
        // Opened on a SCHED_IDLE thread: the target's runtime threads
        // (uploads: reads, checksums, sends) inherit the class, so the drain
        // only takes CPU no trainer or copy wants (the every-step loop's
        // overhead with a drain, issue 20).
        let target = std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("ckpt-drain-open".into())
                .spawn_scoped(s, || {
                    idle_priority();
                    Target::open(&opts.url, topts)
                })
                .map_err(DrainError::Thread)?
                .join()
                .expect("opening the drain target panicked")
                .map_err(|source| DrainError::Open { url: opts.url.clone(), source })
        })?;
        Ok(Arc::new(Drain {
            target,
            opts,
            dirs,
            state: Mutex::new(State { up: true, ..State::default() }),
            cv: Condvar::new(),
            hold: Arc::new(Mutex::new(BTreeSet::new())),
            nodes,
            staging: Default::default(),
        }))
    }

    pub fn url(&self) -> &str {
        self.target.url()
    }

    /// Uploads read a step's files from `staging` while its image is
    /// resident there (and lent), from disk otherwise.
    pub fn use_staging(&self, staging: Arc<Staging>) {
        let _ = self.staging.set(staging);
    }

    /// The steps local retention must keep (shared with the Store).
    pub fn hold(&self) -> Arc<Mutex<BTreeSet<u64>>> {
        self.hold.clone()
    }

    fn primary(&self) -> &Path {
        &self.dirs[0]
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("drain state lock")
    }

    /// The committer made `step` durable: drain it (or a newer one) soon.
    pub fn committed(&self, _step: u64) {
        self.lock().wake = true;
        self.cv.notify_all();
    }

    /// Starts the drain thread: clean the target's leftovers, learn what it
    /// holds, then drain forever.
    pub fn spawn(self: &Arc<Drain>) -> Result<(), DrainError> {
        let d = self.clone();
        std::thread::Builder::new()
            .name("ckpt-drain".into())
            .spawn(move || {
                idle_priority();
                d.run()
            })
            .map(|_| ())
            .map_err(DrainError::Thread)
    }

    /// What the target holds, learnt once at start (retried while down).
    fn learn(&self) -> Result<(), ckpt_tier::TierError> {
        // Several nodes: another node may be uploading a step this one does
        // not see committed remotely yet; its files are not leftovers.
        let removed = if self.nodes.is_some() { 0 } else { self.target.clean_incomplete()? };
        if removed > 0 {
            info!(
                url = self.url(),
                removed, "drain: removed half-uploaded steps and unfinished multipart uploads a previous sidecar left"
            );
        }
        let steps = self.target.steps()?;
        let latest = self.target.latest()?;
        let mut st = self.lock();
        st.replicated.extend(steps.iter().copied());
        st.done_upto = st.done_upto.max(latest).max(steps.last().copied());
        info!(url = self.url(), remote_steps = ?steps, remote_latest = ?latest, "drain: target holds these steps");
        Ok(())
    }

    fn run(self: Arc<Drain>) {
        let mut backoff_ms = config::DRAIN_BACKOFF_MIN_MS;
        let mut learnt = false;
        loop {
            if !learnt {
                match self.learn() {
                    Ok(()) => {
                        learnt = true;
                        self.set_up(true, String::new());
                    }
                    Err(e) => {
                        self.set_up(false, e.to_string());
                        self.pause(Duration::from_millis(backoff_ms));
                        backoff_ms = (backoff_ms * 2).min(config::DRAIN_BACKOFF_MAX_MS);
                        continue;
                    }
                }
            }
            let round = match &self.nodes {
                None => self.drain_once(),
                Some(n) => self.drain_once_nodes(n),
            };
            match round {
                Ok(true) => backoff_ms = config::DRAIN_BACKOFF_MIN_MS,
                Ok(false) => {
                    backoff_ms = config::DRAIN_BACKOFF_MIN_MS;
                    self.pause(Duration::from_millis(config::DRAIN_POLL_MS));
                }
                Err(()) => {
                    self.pause(Duration::from_millis(backoff_ms));
                    backoff_ms = (backoff_ms * 2).min(config::DRAIN_BACKOFF_MAX_MS);
                }
            }
        }
    }

    /// Waits until woken (a new durable step) or `d` passed; answers waiters.
    fn pause(&self, d: Duration) {
        let deadline = Instant::now() + d;
        let mut st = self.lock();
        loop {
            self.answer(&mut st);
            if st.wake {
                st.wake = false;
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            // Woken early to answer new waiters too.
            st = self
                .cv
                .wait_timeout(st, (deadline - now).min(Duration::from_millis(config::DRAIN_POLL_MS)))
                .expect("drain state lock")
                .0;
        }
    }

    fn set_up(&self, up: bool, error: String) {
        self.mark_up(&mut self.lock(), up, error);
    }

    /// [`Drain::set_up`] under the lock the caller holds: a replication
    /// marks the target up before its waiters are answered, so a client
    /// told Replicated never then reads the drain "down" in status.
    fn mark_up(&self, st: &mut State, up: bool, error: String) {
        if st.up != up {
            if up {
                info!(url = self.url(), "drain target reachable again; draining");
            } else {
                warn!(
                    url = self.url(),
                    "drain target down ({error}); local checkpoints go on, the drain retries with backoff"
                );
            }
        }
        st.up = up;
        st.error = error;
    }

    /// The step to drain next among `committed`: the newest not yet drained
    /// (multiples of `--drain-every` only), marked as uploading; the older
    /// ones are skipped, said once, and `on_skip(state, newest)` runs when
    /// some were. None (waiters answered): nothing to drain.
    fn next_step(&self, committed: &[u64], on_skip: impl FnOnce(&mut State, u64)) -> Option<u64> {
        let mut st = self.lock();
        let pending: Vec<u64> = committed
            .iter()
            .copied()
            .filter(|&s| st.done_upto.is_none_or(|d| s > d) && s % self.opts.every == 0)
            .collect();
        st.backlog = pending.clone();
        let Some(&newest) = pending.last() else {
            self.answer(&mut st);
            return None;
        };
        let older = &pending[..pending.len() - 1];
        if !older.is_empty() {
            info!(url = self.url(), skipped = ?older, draining = newest, "drain behind: draining the newest committed step, skipping older ones");
            st.skipped.extend(older.iter().copied());
            while st.skipped.len() > config::DRAIN_SKIPPED_SHOWN_MAX {
                st.skipped.pop_first();
            }
            st.done_upto = Some(older[older.len() - 1]);
            on_skip(&mut st, newest);
        }
        st.uploading = Some(newest);
        self.answer(&mut st);
        Some(newest)
    }

    /// One round: the steps to drain now. Ok(true): a step was uploaded (look
    /// again at once); Ok(false): nothing to do; Err: the target failed.
    fn drain_once(&self) -> Result<bool, ()> {
        let committed = catalog::committed_steps(self.primary()).unwrap_or_default();
        let Some(newest) = self.next_step(&committed, |_, _| {}) else { return Ok(false) };
        // Held from local retention from now until it is replicated (or a
        // newer one replaces it as the newest not replicated).
        {
            let mut h = self.hold.lock().expect("hold lock");
            h.clear();
            h.insert(newest);
        }
        let outcome =
            if catalog::is_committed(self.primary(), newest) { self.upload(newest) } else { Err(Upload::Gone) };
        let mut st = self.lock();
        st.uploading = None;
        match outcome {
            Ok(Moved { stats, copied_bytes, copied_files, from_memory_bytes }) => {
                let bps = stats.bytes as f64 / stats.seconds.max(1e-9);
                info!(step = newest, url = self.url(), bytes = stats.bytes, files = stats.files, from_memory_bytes, copied_bytes, copied_files, seconds = stats.seconds, bytes_per_s = bps, "replicated (from memory: bytes taken from staging, not read back from disk; copied: unchanged files the target holds already)");
                st.uploaded_bytes += stats.bytes;
                st.copied_bytes += copied_bytes;
                st.replicated.insert(newest);
                st.done_upto = Some(newest);
                st.bytes_per_s = bps;
                st.backlog.retain(|&s| s > newest);
                self.hold.lock().expect("hold lock").remove(&newest);
                self.mark_up(&mut st, true, String::new());
                self.answer(&mut st);
                drop(st);
                self.retain_remote();
                Ok(true)
            }
            Err(Upload::Gone) => {
                info!(
                    step = newest,
                    "drain: step deleted locally before it was drained (retention or rollback); skipped"
                );
                st.skipped.insert(newest);
                st.done_upto = Some(newest);
                self.hold.lock().expect("hold lock").remove(&newest);
                self.answer(&mut st);
                Ok(true)
            }
            Err(Upload::Failed(e)) => {
                drop(st);
                // Deleted under the upload: not the target's fault.
                if !catalog::is_committed(self.primary(), newest) {
                    let mut st = self.lock();
                    st.skipped.insert(newest);
                    st.done_upto = Some(newest);
                    self.answer(&mut st);
                    return Ok(true);
                }
                self.set_up(false, format!("step {newest}: {e}"));
                Err(())
            }
        }
    }

    /// [`Drain::drain_once`] for a node of several: the newest step
    /// committed in the shared directory not yet drained; Ok(false) also
    /// while it waits for the other nodes' uploads or the remote commit.
    fn drain_once_nodes(&self, n: &NodesDrain) -> Result<bool, ()> {
        let committed = catalog::committed_steps(&n.shared_dir).unwrap_or_default();
        let Some(newest) = self.next_step(&committed, |st, newest| st.mine_uploaded.retain(|&s| s >= newest)) else {
            return Ok(false);
        };
        // Held from the coordinator's retention in the shared directory
        // until replicated (or a newer one is the newest not replicated).
        {
            let mut h = self.hold.lock().expect("hold lock");
            h.clear();
            h.insert(newest);
        }
        let outcome = self.upload_nodes(n, newest);
        if !matches!(outcome, Ok(None) | Err(Upload::Failed(_))) {
            self.hold.lock().expect("hold lock").remove(&newest);
        }
        let mut st = self.lock();
        match outcome {
            Ok(Some(stats)) => {
                st.uploading = None;
                let bps = stats.bytes as f64 / stats.seconds.max(1e-9);
                info!(
                    step = newest,
                    url = self.url(),
                    bytes = stats.bytes,
                    files = stats.files,
                    seconds = stats.seconds,
                    "replicated (every node's files; the remote index is written)"
                );
                st.replicated.insert(newest);
                st.done_upto = Some(newest);
                st.bytes_per_s = bps;
                st.backlog.retain(|&s| s > newest);
                st.mine_uploaded.remove(&newest);
                self.mark_up(&mut st, true, String::new());
                self.answer(&mut st);
                drop(st);
                self.retain_remote();
                Ok(true)
            }
            Ok(None) => {
                if st.waiting_said != Some(newest) {
                    st.waiting_said = Some(newest);
                    info!(
                        step = newest,
                        url = self.url(),
                        "this node's files are uploaded; waiting for the other nodes' uploads and the remote commit"
                    );
                }
                self.answer(&mut st);
                Ok(false)
            }
            Err(Upload::Gone) => {
                st.uploading = None;
                info!(step = newest, "drain: step deleted before it was drained (retention or rollback); skipped");
                st.skipped.insert(newest);
                st.done_upto = Some(newest);
                self.answer(&mut st);
                Ok(true)
            }
            Err(Upload::Failed(e)) => {
                st.uploading = None;
                drop(st);
                self.set_up(false, format!("step {newest}: {e}"));
                Err(())
            }
        }
    }

    /// This node's part of draining `step` (several nodes): its files
    /// uploaded and marked; the coordinator then, once every node's mark is
    /// in, the blobs and the remote index. Some(stats) once the step is
    /// committed remotely; None while waiting for others.
    fn upload_nodes(&self, n: &NodesDrain, step: u64) -> Result<Option<ckpt_tier::UploadStats>, Upload> {
        use ckpt_store::nodes as cn;
        let index_bytes =
            std::fs::read(catalog::step_path(&n.shared_dir, step).join(INDEX_FILE_NAME)).map_err(|_| Upload::Gone)?;
        let index = Index::from_json_bytes(&index_bytes)
            .map_err(|e| Upload::Failed(format!("index of step {step} in {}: {e}", n.shared_dir.display())))?;
        let failed = |e: ckpt_tier::TierError| Upload::Failed(e.to_string());
        let done = ckpt_tier::UploadStats { bytes: 0, files: 0, seconds: 0.0 };
        if self.target.steps().map_err(failed)?.contains(&step) {
            return Ok(Some(done));
        }
        let mut stats = done;
        if !self.lock().mine_uploaded.contains(&step) {
            let mine = node_files(&index, &n.me, step).map_err(Upload::Failed)?;
            if !mine.is_empty() {
                stats = self.target.upload_files(step, &mine).map_err(failed)?;
            }
            if index.ckpt.nodes.contains_key(&n.me.id) {
                cn::mark_uploaded(&n.shared_dir, step, &n.me.id).map_err(|e| {
                    Upload::Failed(format!("upload mark of step {step} in {}: {e}", n.shared_dir.display()))
                })?;
            }
            self.lock().mine_uploaded.insert(step);
        }
        if cn::drain_coordinator(&index) != Some(n.me.id.as_str()) {
            return Ok(None);
        }
        let marked = cn::uploaded_nodes(&n.shared_dir, step)
            .map_err(|e| Upload::Failed(format!("upload marks of step {step}: {e}")))?;
        if index.ckpt.nodes.keys().any(|id| !marked.contains(id)) {
            return Ok(None);
        }
        let step_name = format::step_dir_name(step).map_err(|e| Upload::Failed(e.to_string()))?;
        let blobs: Vec<LocalFile> = index
            .ckpt
            .blobs
            .iter()
            .map(|b| {
                let name = format!("{BLOBS_DIR_NAME}/{}", b.name);
                LocalFile {
                    local_path: n.shared_dir.join(&step_name).join(&name),
                    name,
                    len: b.len_bytes,
                    crc32c: b.crc32c,
                }
            })
            .collect();
        if !blobs.is_empty() {
            let b = self.target.upload_files(step, &blobs).map_err(failed)?;
            stats = ckpt_tier::UploadStats {
                bytes: stats.bytes + b.bytes,
                files: stats.files + b.files,
                seconds: stats.seconds + b.seconds,
            };
        }
        self.target.commit_step(step, &cn::flattened_index(index).to_json_bytes()).map_err(failed)?;
        if let Err(e) = cn::remove_upload_marks(&n.shared_dir, step) {
            warn!(step, "could not remove the upload marks of step {step} ({e})");
        }
        Ok(Some(stats))
    }

    /// Uploads `step`: a file that is the same local file (inode, mtime,
    /// length, crc32c) as the same-named file of the step this sidecar last
    /// replicated, which the target still holds, is copied there on the
    /// target instead ([`Target::copy_file`]; uploaded if the copy fails);
    /// the rest uploaded; the index last (the remote commit).
    fn upload(&self, step: u64) -> Result<Moved, Upload> {
        let t0 = Instant::now();
        let index_bytes =
            std::fs::read(catalog::step_path(self.primary(), step).join(INDEX_FILE_NAME)).map_err(|_| Upload::Gone)?;
        let index = Index::from_json_bytes(&index_bytes)
            .map_err(|e| Upload::Failed(format!("local index of step {step}: {e}")))?;
        let (files, remote_index) = remote_plan(&self.dirs, step, index).map_err(Upload::Failed)?;
        let ids: HashMap<String, FileId> =
            files.iter().filter_map(|f| Some((f.name.clone(), FileId::of(f)?))).collect();
        let prev = {
            let st = self.lock();
            st.last_files.clone().filter(|(s, _)| *s != step && st.replicated.contains(s))
        };
        let (mut copied_bytes, mut copied_files) = (0, 0);
        let mut to_upload = Vec::with_capacity(files.len());
        for f in files {
            let same = prev
                .as_ref()
                .filter(|(_, by_name)| ids.get(&f.name).is_some_and(|id| by_name.get(&f.name) == Some(id)));
            match same {
                Some((from, _)) => match self.target.copy_file(*from, step, &f.name) {
                    Ok(()) => {
                        copied_bytes += f.len;
                        copied_files += 1;
                    }
                    Err(e) => {
                        warn!(
                            step,
                            from = *from,
                            file = f.name,
                            "drain: copying an unchanged file on the target failed ({e}); uploading it"
                        );
                        to_upload.push(f);
                    }
                },
                None => to_upload.push(f),
            }
        }
        // From staging while the step's image is resident there (lent: a
        // save takes it back whenever it needs it), else from disk.
        let lent = self.staging.get().and_then(|s| Some((s, s.lend_resident(step)?)));
        let held = lent.as_ref().and_then(|(_, l)| ResidentFiles::new(l.clone(), &to_upload));
        let up = match held {
            Some(h) => self.target.upload_files_held(step, &to_upload, Arc::new(h)),
            None => self.target.upload_files(step, &to_upload).map(|s| (s, 0)),
        };
        if let Some((s, l)) = &lent {
            s.end_lend(l);
        }
        let (mut stats, from_memory_bytes) = up.map_err(|e| Upload::Failed(e.to_string()))?;
        self.target.commit_step(step, &remote_index).map_err(|e| Upload::Failed(e.to_string()))?;
        stats.seconds = t0.elapsed().as_secs_f64();
        let mut st = self.lock();
        st.last_files = Some((step, ids));
        st.from_memory_bytes += from_memory_bytes;
        drop(st);
        Ok(Moved { stats, copied_bytes, copied_files, from_memory_bytes })
    }

    /// `--drain-keep N`: the oldest remote steps beyond N deleted (index
    /// first); the remote latest is never one of them.
    fn retain_remote(&self) {
        let Some(keep) = self.opts.keep else { return };
        let steps = match self.target.steps() {
            Ok(s) => s,
            Err(e) => {
                warn!(url = self.url(), "drain retention: listing failed ({e}); retried after the next upload");
                return;
            }
        };
        let latest = self.target.latest().ok().flatten();
        let doomed: Vec<u64> =
            steps[..steps.len().saturating_sub(keep)].iter().copied().filter(|&s| Some(s) != latest).collect();
        for s in doomed {
            match self.target.delete_step(s) {
                Ok(()) => {
                    info!(step = s, url = self.url(), "drain retention: remote step deleted");
                    self.lock().replicated.remove(&s);
                }
                Err(e) => warn!(step = s, url = self.url(), "drain retention: delete failed ({e})"),
            }
        }
    }

    /// Answers every waiter whose step is replicated, skipped or never to
    /// be drained; drops those whose client is gone.
    fn answer(&self, st: &mut State) {
        let url = self.url().to_string();
        let uploading = st.uploading;
        let done_upto = st.done_upto;
        let replicated = &st.replicated;
        let skipped = &st.skipped;
        st.waiters.retain(|w| {
            if w.replies.is_gone() {
                return false;
            }
            let reply = if replicated.contains(&w.step) {
                Some(Reply::Replicated { id: w.id, step: w.step, url: url.clone() })
            } else if skipped.contains(&w.step) || (done_upto.is_some_and(|d| w.step <= d) && uploading != Some(w.step)) {
                Some(Reply::Error { id: w.id, code: ErrorCode::NotFound, message: format!("step {}: skipped by the drain to {url} (a newer step was drained instead, or it was deleted first); it is not replicated", w.step) })
            } else {
                None
            };
            match reply {
                Some(r) => {
                    w.replies.send(&r);
                    false
                }
                None => true,
            }
        });
    }

    /// A WaitReplicated: answered now, or when the step is replicated (or skipped).
    pub fn wait(&self, replies: Arc<dyn Answer>, id: u64, step: u64, committed_locally: bool) {
        let mut st = self.lock();
        if st.replicated.contains(&step) {
            replies.send(&Reply::Replicated { id, step, url: self.url().to_string() });
            return;
        }
        let refuse = |why: String| {
            replies.send(&Reply::Error {
                id,
                code: ErrorCode::NotFound,
                message: format!("step {step}: {why}; it will not be replicated to {}", self.url()),
            })
        };
        if step % self.opts.every != 0 {
            refuse(format!("--drain-every {} drains multiples of {} only", self.opts.every, self.opts.every));
            return;
        }
        if !committed_locally && st.uploading != Some(step) {
            refuse("not committed in this sidecar's directories".into());
            return;
        }
        if st.waiters.len() >= config::DRAIN_WAITERS_MAX {
            replies.send(&Reply::Error {
                id,
                code: ErrorCode::BadRequest,
                message: format!("more than {} waits for replication at once", config::DRAIN_WAITERS_MAX),
            });
            return;
        }
        st.waiters.push(Waiter { replies, id, step });
        self.answer(&mut st);
        drop(st);
        self.cv.notify_all();
    }

    /// Whether a stopping sidecar may exit as far as the drain goes: the
    /// newest committed step it will drain is replicated (or skipped), or
    /// the target is down (then what is not replicated stays local, and
    /// the next sidecar on these directories uploads it).
    pub fn settled(&self) -> bool {
        // Several nodes: the steps are committed in the shared directory.
        let committed_in = self.nodes.as_ref().map_or(self.primary(), |n| n.shared_dir.as_path());
        let newest = catalog::committed_steps(committed_in)
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s % self.opts.every == 0)
            .last();
        let st = self.lock();
        if !st.up {
            return true;
        }
        st.uploading.is_none() && newest.is_none_or(|n| st.done_upto.is_some_and(|d| d >= n))
    }

    /// For `status`.
    pub fn report(&self) -> DrainReport {
        let st = self.lock();
        DrainReport {
            url: self.url().to_string(),
            up: st.up,
            error: st.error.clone(),
            last_replicated: st.replicated.last().copied(),
            uploading: st.uploading,
            backlog: st.backlog.clone(),
            skipped: st.skipped.iter().copied().collect(),
            bytes_per_s: st.bytes_per_s,
            every: self.opts.every,
            keep: self.opts.keep.map(|k| k as u64),
        }
    }

    /// Remote steps (for List and `latest`); None when the target does not
    /// answer, or is known to be down (a load of `latest` then reads the
    /// local directories at once, without waiting for the target's retries).
    pub fn remote_steps(&self) -> Option<Vec<u64>> {
        if !self.lock().up {
            return None;
        }
        match self.target.steps() {
            Ok(s) => Some(s),
            Err(e) => {
                warn!(url = self.url(), "listing the drain target failed ({e}); loads use the local directories");
                None
            }
        }
    }

    /// Whether a load of `step` (None: latest) must read the drain target:
    /// the step is not committed locally, or (latest) the target holds a
    /// newer one. Then the step, made readable as a checkpoint directory;
    /// a remote step whose index is damaged is passed over (latest: the
    /// previous remote step is tried, and `fell_back` says so).
    pub fn remote_source(
        &self,
        step: Option<u64>,
        local_latest: Option<u64>,
    ) -> Result<Option<RemoteCkpt>, (ErrorCode, String)> {
        match step {
            Some(s) => {
                if catalog::is_readable(self.primary(), s) {
                    return Ok(None);
                }
                self.fetch(s).map(Some).map_err(|e| match e {
                    Fetch::Missing => (
                        ErrorCode::NotFound,
                        format!("step {s} is committed neither locally nor on the drain target {}", self.url()),
                    ),
                    Fetch::Damaged(why) => (ErrorCode::Damaged, why),
                    Fetch::Io(why) => (ErrorCode::Io, why),
                })
            }
            None => {
                let Some(remote) = self.remote_steps() else { return Ok(None) };
                let mut fell_back = Vec::new();
                for &s in remote.iter().rev().filter(|&&s| local_latest.is_none_or(|l| s > l)) {
                    match self.fetch(s) {
                        Ok(mut r) => {
                            r.fell_back = fell_back;
                            return Ok(Some(r));
                        }
                        Err(Fetch::Missing) => {}
                        Err(Fetch::Damaged(why) | Fetch::Io(why)) => {
                            warn!(
                                step = s,
                                url = self.url(),
                                "remote step unreadable, falling back to the previous replicated step: {why}"
                            );
                            fell_back.push(why);
                        }
                    }
                }
                if !fell_back.is_empty() {
                    warn!(?fell_back, "no newer remote step readable; loading the local latest");
                }
                Ok(None)
            }
        }
    }

    /// Remote step `step`, made readable as a checkpoint directory (a load
    /// whose local copy of it is damaged reads this one).
    pub fn remote_copy(&self, step: u64) -> Result<RemoteCkpt, (ErrorCode, String)> {
        self.fetch(step).map_err(|e| match e {
            Fetch::Missing => (ErrorCode::NotFound, format!("step {step} is not on the drain target {}", self.url())),
            Fetch::Damaged(why) => (ErrorCode::Damaged, why),
            Fetch::Io(why) => (ErrorCode::Io, why),
        })
    }

    /// Makes remote step `step` readable for a load: a `file://` target's
    /// directory, read in place; an object store's step, streamed into the
    /// load's memory (its index fetched and parsed here; every file's
    /// bytes are checked by the load as they arrive).
    fn fetch(&self, step: u64) -> Result<RemoteCkpt, Fetch> {
        let url = self.url();
        let index_bytes = self.target.get_index(step).map_err(|e| match e {
            ckpt_tier::TierError::NotFound { .. } => Fetch::Missing,
            e => Fetch::Io(e.to_string()),
        })?;
        let index = Index::from_json_bytes(&index_bytes)
            .map_err(|e| Fetch::Damaged(format!("step {step} on {url}: remote index damaged: {e}")))?;
        // A file:// target is a checkpoint directory: read in place.
        if let Some(root) = url.strip_prefix("file://") {
            return Ok(RemoteCkpt { step, from: RemoteFrom::Dir(PathBuf::from(root)), fell_back: Vec::new() });
        }
        let n_files = index.ckpt.files.len();
        Ok(RemoteCkpt {
            step,
            from: RemoteFrom::Stream(RemoteStep::new(self.target.clone(), step, index_bytes, index, n_files)),
            fell_back: Vec::new(),
        })
    }

    /// The files of step `step` on the target, for a load that reads this
    /// node's own files locally and fetches `n_files` others (several
    /// nodes): the step must be committed there.
    pub fn remote_files(&self, step: u64, n_files: usize) -> Result<RemoteStep, (ErrorCode, String)> {
        let index_bytes = self.target.get_index(step).map_err(|e| match e {
            ckpt_tier::TierError::NotFound { .. } => {
                (ErrorCode::NotFound, format!("step {step} is not on the drain target {}", self.url()))
            }
            e => (ErrorCode::Io, e.to_string()),
        })?;
        let index = Index::from_json_bytes(&index_bytes)
            .map_err(|e| (ErrorCode::Damaged, format!("step {step} on {}: remote index damaged: {e}", self.url())))?;
        Ok(RemoteStep::new(self.target.clone(), step, index_bytes, index, n_files))
    }
}

/// The files of an upload that a lent staging image holds: a shard of the
/// image's layout with the same name and length as the committed file, at
/// its offset in the lease (block-aligned, padded to the block: the
/// `file://` path writes from it with O_DIRECT, no copy). Blobs are read
/// from disk (small).
struct ResidentFiles {
    lent: Arc<Lent>,
    /// Per file of the call: (offset in the lease, bytes there: `io_len`).
    places: Vec<Option<(u64, u64)>>,
}

impl ResidentFiles {
    /// None when the image holds none of the files.
    fn new(lent: Arc<Lent>, files: &[LocalFile]) -> Option<ResidentFiles> {
        let places: Vec<Option<(u64, u64)>> = lent.with(|r| {
            files
                .iter()
                .map(|f| {
                    r.layout
                        .shards
                        .iter()
                        .find(|s| s.file_name == f.name && s.file_len == f.len)
                        .map(|s| (s.staging_offset, s.io_len))
                })
                .map(|p| p.filter(|&(off, io_len)| off + io_len <= r.lease.len_bytes()))
                .collect()
        })?;
        places.iter().any(Option::is_some).then_some(ResidentFiles { lent, places })
    }
}

impl ckpt_tier::HeldBytes for ResidentFiles {
    fn with_part(&self, file_idx: usize, offset: u64, len: usize, f: &mut dyn FnMut(&[u8])) -> bool {
        let Some(&Some((start, io_len))) = self.places.get(file_idx) else { return false };
        let end =
            (offset + len as u64).div_ceil(ckpt_tier::DIRECT_BLOCK_BYTES as u64) * ckpt_tier::DIRECT_BLOCK_BYTES as u64;
        if offset + len as u64 > io_len {
            return false;
        }
        self.lent
            .with(|r| f(&r.lease.as_slice()[(start + offset) as usize..(start + end.min(io_len)) as usize]))
            .is_some()
    }
}

/// Puts the calling thread (and the threads it starts later) in the
/// SCHED_IDLE class: it runs only on a core nothing else wants; and in the
/// idle I/O class: where the disk's scheduler honours classes (mq-deadline,
/// bfq), the drain's reads and writes go after the committer's, so a drain
/// target on the same disk as `--dir` does not slow the next save's writes
/// (the every-step loop with a drain, issue 20). mq-deadline still serves
/// an idle request within its aging time (`prio_aging_expire`, 10 s), so
/// the drain is never starved for good.
fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: changes only the calling thread's scheduling policy (pid 0);
    // `param` is a valid sched_param for SCHED_IDLE.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    const IOPRIO_WHO_PROCESS: libc::c_long = 1;
    const IOPRIO_CLASS_IDLE: libc::c_long = 3;
    const IOPRIO_CLASS_SHIFT: libc::c_long = 13;
    // SAFETY: sets the I/O priority of the calling thread only (who =
    // process, id 0 = the caller); no memory is passed. A kernel without
    // it returns an error, which leaves the default class: nothing to do.
    unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            0 as libc::c_long,
            IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT,
        )
    };
}

enum Upload {
    /// The step is no longer committed locally.
    Gone,
    Failed(String),
}

enum Fetch {
    Missing,
    Damaged(String),
    Io(String),
}

/// The files of a committed local step as the target takes them (shards
/// from every directory, blobs), and the index the target gets: the same,
/// with every file in the one step folder (no secondary directories), so
/// the remote step is an ordinary one-directory checkpoint.
pub fn remote_plan(dirs: &[PathBuf], step: u64, mut index: Index) -> Result<(Vec<LocalFile>, Vec<u8>), String> {
    let step_name = format::step_dir_name(step).map_err(|e| e.to_string())?;
    let mut files = Vec::with_capacity(index.ckpt.files.len() + index.ckpt.blobs.len());
    for f in &mut index.ckpt.files {
        let dir = dirs
            .get(f.dir_idx as usize)
            .ok_or_else(|| format!("step {step}: file {} is in directory #{} of {}", f.name, f.dir_idx, dirs.len()))?;
        files.push(LocalFile {
            local_path: dir.join(&step_name).join(&f.name),
            name: f.name.clone(),
            len: f.len_bytes,
            crc32c: f.crc32c,
        });
        f.dir_idx = 0;
    }
    for b in &index.ckpt.blobs {
        let name = format!("{BLOBS_DIR_NAME}/{}", b.name);
        files.push(LocalFile {
            local_path: dirs[0].join(&step_name).join(&name),
            name,
            len: b.len_bytes,
            crc32c: b.crc32c,
        });
    }
    index.ckpt.secondary_dirs.clear();
    Ok((files, index.sealed_json_bytes()))
}

/// This node's files of a node-local step (`ckpt.nodes`), read from its own
/// directories' `node-step-…` folders.
fn node_files(index: &Index, me: &ckpt_store::restore::ThisNode, step: u64) -> Result<Vec<LocalFile>, String> {
    let folder = format::node_step_dir_name(step).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for f in &index.ckpt.files {
        if index.holder(&f.name).map(|(id, _)| id) != Some(me.id.as_str()) {
            continue;
        }
        let dir = me.dirs.get(f.dir_idx as usize).ok_or_else(|| {
            format!("step {step}: file {} is in directory #{} of this node's {}", f.name, f.dir_idx, me.dirs.len())
        })?;
        out.push(LocalFile {
            local_path: dir.join(&folder).join(&f.name),
            name: f.name.clone(),
            len: f.len_bytes,
            crc32c: f.crc32c,
        });
    }
    Ok(out)
}

/// Removes fetched-step folders an older sidecar (one that copied a remote
/// step into the primary before loading it) left there.
pub fn remove_stale_fetches(primary: &Path) {
    let Ok(rd) = std::fs::read_dir(primary) else { return };
    for e in rd.flatten() {
        if e.file_name().to_string_lossy().starts_with(config::HYDRATE_PREFIX) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_store::commit::{Store, StoreOptions};
    use ckpt_store::image::{Blob, Layout, LayoutOptions};
    use ckpt_store::mem::AlignedBuf;
    use ckpt_store::restore::{self, ReadOptions, Which};
    use ckpt_store::synthetic;

    /// Regression: the local index names secondary directories (absolute
    /// paths of this node) and files in them (`dir_idx` 1); uploaded as is,
    /// a reader of the remote step would look for those files on this
    /// node's disks. The remote step must be a one-directory checkpoint.
    #[test]
    fn a_step_striped_over_two_dirs_drains_as_a_one_directory_checkpoint_that_loads() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = vec![tmp.path().join("a"), tmp.path().join("b")];
        let mut store = Store::open(StoreOptions::new(dirs.clone())).unwrap();
        let layout = Layout::plan(
            synthetic::transformer_specs(4 << 20),
            LayoutOptions { n_dirs: 2, shard_bytes_max: 1 << 20, ..Default::default() },
        )
        .unwrap();
        let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
        let crcs = synthetic::stage(&layout, staging.as_mut_slice(), 3);
        store.commit(7, &layout, &staging, &crcs, &[Blob { name: "rng", bytes: b"seed" }]).unwrap();
        drop(store);
        let dirs: Vec<PathBuf> = dirs.iter().map(|d| d.canonicalize().unwrap()).collect();
        let index =
            Index::from_json_bytes(&std::fs::read(catalog::step_path(&dirs[0], 7).join(INDEX_FILE_NAME)).unwrap())
                .unwrap();
        assert!(index.ckpt.files.iter().any(|f| f.dir_idx == 1), "the test needs files on the secondary");
        let (files, remote_index) = remote_plan(&dirs, 7, index).unwrap();
        let remote = tmp.path().join("remote");
        let step_dir = catalog::step_path(&remote, 7);
        for f in &files {
            let bytes = std::fs::read(&f.local_path).unwrap();
            assert_eq!((bytes.len() as u64, crc32c::crc32c(&bytes)), (f.len, f.crc32c), "{}", f.name);
            let to = step_dir.join(&f.name);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::write(to, bytes).unwrap();
        }
        assert!(files.iter().any(|f| f.name == "blobs/rng"));
        std::fs::write(step_dir.join(INDEX_FILE_NAME), &remote_index).unwrap();
        let parsed = Index::from_json_bytes(&remote_index).unwrap();
        assert!(parsed.ckpt.secondary_dirs.is_empty() && parsed.ckpt.files.iter().all(|f| f.dir_idx == 0));
        let loaded = restore::load(&remote, Which::Step(7), &ReadOptions::default(), None).unwrap();
        assert_eq!(loaded.blobs["rng"], b"seed");
    }

    /// Issue 21 point 5: an incremental run of 3 steps (a frozen tensor in
    /// its own stable shard, hard-linked locally, and a changing one),
    /// drained. Before this, every step's frozen shard was uploaded again;
    /// now it is uploaded once and copied on the target after. Every
    /// remote step loads bit-equal, and after `--drain-keep 1` deleted the
    /// older steps the newest still does.
    fn incremental_drain_uploads_unchanged_shard_once(url: &str) {
        use ckpt_store::format::Dtype;
        use ckpt_store::image::TensorSpec;
        use std::collections::HashSet;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("local");
        let mut store = Store::open(StoreOptions::new(vec![dir.clone()])).unwrap();
        let dir = dir.canonicalize().unwrap();
        let specs =
            vec![TensorSpec::new("frozen", Dtype::F32, &[1 << 19]), TensorSpec::new("moving", Dtype::F32, &[1 << 12])];
        let changed: HashSet<String> = ["moving".to_string()].into();
        let layout =
            Layout::plan_with(specs, LayoutOptions { incremental: true, ..Default::default() }, Some(&changed))
                .unwrap();
        let frozen_shard = layout.shards[layout.places[0].shard_idx].clone();
        assert!(
            frozen_shard.stable && frozen_shard.tensors == vec![0],
            "the test needs the frozen tensor alone in a stable shard"
        );
        let opts = DrainOptions { url: url.to_string(), every: 1, keep: None, bandwidth_bytes_per_s: None };
        let drain = Drain::open(opts.clone(), vec![dir.clone()]).unwrap();
        let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
        let mut expected = Vec::new();
        for step in 1..=3u64 {
            let st = staging.as_mut_slice();
            layout.write_headers(st);
            synthetic::fill(&mut st[layout.tensor_range(0)], 42);
            synthetic::fill(&mut st[layout.tensor_range(1)], step);
            let crcs = layout.tensor_crcs(st);
            let digests: Vec<u128> =
                (0..2).map(|i| ckpt_store::digest::tensor_digest(&st[layout.tensor_range(i)])).collect();
            expected.push((st[layout.tensor_range(0)].to_vec(), st[layout.tensor_range(1)].to_vec()));
            store.commit_with_digests(step, &layout, &staging, &crcs, &digests, &[]).unwrap();
            if step > 1 {
                assert_eq!(
                    store.take_incremental().unwrap().linked_files,
                    1,
                    "step {step}: the frozen shard is linked locally"
                );
            }
            assert_eq!(drain.drain_once(), Ok(true), "step {step}");
        }
        let frozen_len = frozen_shard.file_len;
        let st = drain.lock();
        assert_eq!(st.replicated.iter().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(st.copied_bytes, 2 * frozen_len, "steps 2 and 3 copy the frozen shard on the target");
        let total: u64 = layout.shards.iter().map(|s| s.file_len).sum();
        assert_eq!(st.uploaded_bytes, 3 * total - 2 * frozen_len, "the frozen shard is uploaded once");
        drop(st);
        if let Some(root) = url.strip_prefix("file://") {
            use std::os::unix::fs::MetadataExt;
            // The copies are hard links within the target: one inode.
            let inos: Vec<u64> = (1..=3)
                .map(|s| {
                    std::fs::metadata(catalog::step_path(Path::new(root), s).join(&frozen_shard.file_name))
                        .unwrap()
                        .ino()
                })
                .collect();
            assert!(inos[0] == inos[1] && inos[1] == inos[2], "{inos:?}");
        }
        let check = |d: &Drain, step: u64| {
            let r = d.remote_copy(step).unwrap_or_else(|e| panic!("step {step}: {e:?}"));
            let loaded = match &r.from {
                RemoteFrom::Dir(dir) => restore::load(dir, Which::Step(step), &ReadOptions::default(), None).unwrap(),
                RemoteFrom::Stream(rs) => ckpt_store::fetch::load_remote(&rs.index_bytes, step, rs).unwrap(),
            };
            let (frozen, moving) = &expected[step as usize - 1];
            assert!(
                loaded.tensor("frozen").unwrap() == &frozen[..] && loaded.tensor("moving").unwrap() == &moving[..],
                "step {step} differs"
            );
        };
        for step in 1..=3 {
            check(&drain, step);
        }
        let keep1 = Drain::open(DrainOptions { keep: Some(1), ..opts }, vec![dir.clone()]).unwrap();
        keep1.retain_remote();
        assert_eq!(keep1.target.steps().unwrap(), vec![3]);
        check(&keep1, 3);
    }

    #[test]
    fn incremental_drain_to_file_target_uploads_unchanged_shard_once() {
        let remote = tempfile::tempdir().unwrap();
        incremental_drain_uploads_unchanged_shard_once(&format!("file://{}", remote.path().display()));
    }

    #[test]
    fn incremental_drain_to_s3_uploads_unchanged_shard_once() {
        let server = ckpt_test_support::s3::S3Server::shared();
        incremental_drain_uploads_unchanged_shard_once(&server.url("incremental-drain"));
    }

    /// A step committed from a staging lease and resident there, as the
    /// committer leaves it; `flip` flips a byte of the first shard's image
    /// in staging after the commit (the disk holds the committed bytes).
    fn resident_step(dir: &Path, staging: &Arc<crate::memory::staging::Staging>, step: u64, flip: bool) -> Layout {
        let mut store = Store::open(StoreOptions::new(vec![dir.to_path_buf()])).unwrap();
        store.register_staging(staging.buf());
        let layout = Layout::plan(
            synthetic::transformer_specs(12 << 20),
            LayoutOptions { shard_bytes_max: 4 << 20, ..Default::default() },
        )
        .unwrap();
        let (mut lease, _) = staging.acquire(layout.staging_len, "test", || Some("must not wait")).unwrap();
        let crcs = synthetic::stage(&layout, lease.as_mut_slice(), step);
        let mut placed = layout.clone();
        placed.rebase(lease.offset_bytes());
        store.commit(step, &placed, lease.staging_buf(), &crcs, &[Blob { name: "rng", bytes: b"seed" }]).unwrap();
        if flip {
            let at = layout.shards[0].staging_offset as usize + 100;
            lease.as_mut_slice()[at] ^= 0x08;
        }
        let blobs = vec![ckpt_wire::Blob { name: "rng".into(), bytes: b"seed".to_vec() }];
        staging.offer_resident(crate::memory::staging::Resident {
            step,
            layout: layout.clone(),
            crcs,
            digests: None,
            blobs,
            lease,
            origin: std::sync::Weak::<()>::new(),
        });
        layout
    }

    fn assert_remote_equals_local(remote: &Path, local: &Path, step: u64) {
        let (r, l) = (catalog::step_path(remote, step), catalog::step_path(local, step));
        let index = Index::from_json_bytes(&std::fs::read(l.join(INDEX_FILE_NAME)).unwrap()).unwrap();
        for f in &index.ckpt.files {
            assert!(
                std::fs::read(r.join(&f.name)).unwrap() == std::fs::read(l.join(&f.name)).unwrap(),
                "{} differs",
                f.name
            );
        }
        restore::verify(remote, step, &ReadOptions::default(), |_, _| {}).unwrap();
    }

    /// A step committed into `TMP/local` and left resident in a staging
    /// (its first shard's image flipped if `flip`), and a drain to
    /// `file://TMP/remote` lent that staging.
    fn drain_of_resident_step(
        step: u64,
        flip: bool,
    ) -> (tempfile::TempDir, Arc<crate::memory::staging::Staging>, Layout, Arc<Drain>) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("local");
        let staging = crate::memory::staging::Staging::new(32 << 20).unwrap();
        let layout = resident_step(&dir, &staging, step, flip);
        let dir = dir.canonicalize().unwrap();
        let remote = tmp.path().join("remote");
        let drain = Drain::open(
            DrainOptions {
                url: format!("file://{}", remote.display()),
                every: 1,
                keep: None,
                bandwidth_bytes_per_s: None,
            },
            vec![dir],
        )
        .unwrap();
        drain.use_staging(staging.clone());
        (tmp, staging, layout, drain)
    }

    /// Issue 20 (drain throughput): a step still resident in staging right
    /// after its commit is uploaded from there, not read back from disk;
    /// the remote files equal the committed ones.
    #[test]
    fn a_resident_step_drains_from_staging_memory() {
        let (tmp, staging, layout, drain) = drain_of_resident_step(4, false);
        let (dir, remote) = (tmp.path().join("local").canonicalize().unwrap(), tmp.path().join("remote"));
        assert_eq!(drain.drain_once(), Ok(true));
        let shards: u64 = layout.shards.iter().map(|s| s.file_len).sum();
        let st = drain.lock();
        assert_eq!(st.replicated.iter().copied().collect::<Vec<_>>(), vec![4]);
        assert_eq!(st.from_memory_bytes, shards, "every shard from staging (the blob from disk)");
        drop(st);
        assert_remote_equals_local(&remote, &dir, 4);
        assert_eq!(staging.resident_step(), Some(4), "the loan ended; the image stays resident");
    }

    /// The crc32c is checked on the bytes taken from staging too: an image
    /// that differs from the committed file (a flipped byte) is not
    /// uploaded; that file is read from disk instead, and the remote step
    /// is the committed one.
    #[test]
    fn a_resident_image_that_differs_from_its_files_drains_from_disk() {
        let (tmp, _staging, layout, drain) = drain_of_resident_step(6, true);
        let (dir, remote) = (tmp.path().join("local").canonicalize().unwrap(), tmp.path().join("remote"));
        assert_eq!(drain.drain_once(), Ok(true));
        let shards: u64 = layout.shards.iter().map(|s| s.file_len).sum();
        assert_eq!(drain.lock().from_memory_bytes, shards - layout.shards[0].file_len, "the differing shard from disk");
        assert_remote_equals_local(&remote, &dir, 6);
    }
}
