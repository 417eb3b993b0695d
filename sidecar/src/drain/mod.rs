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
//!
//! This file keeps [`Drain`], its state and the thread's loop (what to
//! drain next, backoff, up/down); one step's upload is `uploads.rs`, the
//! drain of several nodes `node_drains.rs`, the WaitReplicated waiters
//! `waiters.rs`, and loads that read the target `remote_reads.rs` (the
//! step they read: `remote_source.rs`).

mod node_drains;
mod remote_reads;
pub mod remote_source;
#[cfg(test)]
mod tests;
mod uploads;
mod waiters;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ckpt_store::catalog;
use ckpt_tier::Target;
use ckpt_wire::DrainReport;
use tracing::{info, warn};

use crate::config;
use crate::memory::staging::Staging;
use uploads::Round;

pub use node_drains::NodesDrain;
pub use remote_source::{RemoteCkpt, RemoteFrom, RemoteStep, RemoteVerify};
pub use uploads::remote_plan;
use uploads::FileId;
pub use waiters::Answer;
use waiters::Waiter;

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
    /// Committed steps not yet handled (the backlog, and the one
    /// uploading), with when the drain heard of each: every one leaves it
    /// once, counted as replicated, skipped or deleted ([`State::handled`]).
    pending: BTreeMap<u64, Instant>,
    /// Steps deleted locally before they were drained (the newest few).
    deleted_undrained: BTreeSet<u64>,
    /// Steps passed over as damaged on this node (a local file that does
    /// not match its index, found by the upload's read-back), with why;
    /// the newest few.
    damaged: BTreeMap<u64, String>,
    /// Since start: how each committed step the drain saw ended.
    replicated_count: u64,
    skipped_count: u64,
    deleted_undrained_count: u64,
    /// Since start: uploads of a step that failed.
    upload_failures: u64,
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

/// How a committed step left the drain's pending set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handled {
    Replicated,
    /// A newer step was drained instead.
    Skipped,
    /// Retention (or a rollback) deleted it locally first.
    Deleted,
}

impl State {
    /// Counts `step` as handled `how`, once: it leaves the pending set.
    fn handled(&mut self, step: u64, how: Handled) {
        self.pending.remove(&step);
        match how {
            Handled::Replicated => {
                self.replicated.insert(step);
                self.replicated_count += 1;
            }
            Handled::Skipped => {
                self.skipped.insert(step);
                while self.skipped.len() > config::DRAIN_SKIPPED_SHOWN_MAX {
                    self.skipped.pop_first();
                }
                self.skipped_count += 1;
            }
            Handled::Deleted => {
                self.deleted_undrained.insert(step);
                while self.deleted_undrained.len() > config::DRAIN_SKIPPED_SHOWN_MAX {
                    self.deleted_undrained.pop_first();
                }
                self.deleted_undrained_count += 1;
            }
        }
    }

    /// Notes committed `step` as pending, unless it is handled already.
    fn note(&mut self, step: u64, every: u64) {
        if step % every == 0 && self.done_upto.is_none_or(|d| step > d) {
            self.pending.entry(step).or_insert_with(Instant::now);
        }
    }
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
    /// A held step was let go: local retention is due (the committer runs
    /// it, [`Drain::take_retention_due`]; the daemon exits after it).
    retention_due: std::sync::atomic::AtomicBool,
    /// The daemon's staging: a step still resident there right after its
    /// commit is uploaded from memory (`uploads::ResidentFiles`).
    staging: std::sync::OnceLock<Arc<Staging>>,
    /// Told of a local file whose bytes, read back for an upload, do not
    /// match its index: (step, file, what was found). Set once by the
    /// daemon (the damage record is a layer above).
    on_damage: std::sync::OnceLock<DamageSink>,
    on_uploaded: std::sync::OnceLock<UploadedSink>,
}

/// See [`Drain::on_damage`].
pub type DamageSink = Box<dyn Fn(u64, &str, &str) + Send + Sync>;
/// See [`Drain::on_uploaded`].
pub type UploadedSink = Box<dyn Fn(u64) + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// The tier's text names the URL (never a secret).
    #[error("--drain (the sidecar does not start): {source}")]
    Open { url: String, source: Box<ckpt_tier::TierError> },
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
        // only takes CPU no trainer or copy wants (what a drain costs a
        // loop that saves every step).
        let target = std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("ckpt-drain-open".into())
                .spawn_scoped(s, || {
                    crate::priority::idle_cpu_and_io();
                    Target::open(&opts.url, topts).map_err(Box::new)
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
            retention_due: Default::default(),
            staging: Default::default(),
            on_damage: Default::default(),
            on_uploaded: Default::default(),
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

    /// Where damage of a local step found by an upload's read-back is told.
    pub fn on_damage(&self, sink: DamageSink) {
        let _ = self.on_damage.set(sink);
    }

    /// Several nodes with no shared file system: where this node's upload
    /// mark of a step, written in its own shared directory, is also told
    /// (the peers carry it to the drain's coordinator).
    pub fn on_uploaded(&self, sink: UploadedSink) {
        let _ = self.on_uploaded.set(sink);
    }

    /// The steps local retention must keep (shared with the Store).
    pub fn hold(&self) -> Arc<Mutex<BTreeSet<u64>>> {
        self.hold.clone()
    }

    /// `step` no longer needs holding from local retention (replicated,
    /// or gone): retention, which kept it, is due.
    fn unhold(&self, step: u64) {
        if self.hold.lock().expect("hold lock").remove(&step) {
            self.retention_due.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Whether local retention is due since a held step was let go; the
    /// committer runs it then (a step held past `--keep` is deleted once
    /// the drain no longer needs it, not only at the next commit).
    pub fn take_retention_due(&self) -> bool {
        self.retention_due.swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    /// [`Drain::take_retention_due`] without taking it: a stopping daemon
    /// exits only after that retention ran.
    pub fn retention_due(&self) -> bool {
        self.retention_due.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn primary(&self) -> &Path {
        &self.dirs[0]
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("drain state lock")
    }

    /// The committer made `step` durable: drain it (or a newer one) soon.
    pub fn committed(&self, step: u64) {
        let mut st = self.lock();
        st.note(step, self.opts.every);
        st.wake = true;
        drop(st);
        self.cv.notify_all();
    }

    /// The folder steps are committed in (several nodes: the shared one).
    fn committed_in(&self) -> &Path {
        self.nodes.as_ref().map_or(self.primary(), |n| n.shared_dir.as_path())
    }

    /// Pending steps no longer committed locally, other than the one
    /// uploading (whose round says what became of it), are counted deleted
    /// before they were drained; those at or below `done_upto` that some
    /// round passed over (heard of before the target was learnt), handled.
    fn sweep(&self, st: &mut State) {
        let dir = self.committed_in();
        let steps: Vec<u64> = st.pending.keys().copied().filter(|&s| st.uploading != Some(s)).collect();
        for s in steps {
            if st.done_upto.is_some_and(|d| s <= d) {
                let how = if st.replicated.contains(&s) { Handled::Replicated } else { Handled::Skipped };
                st.handled(s, how);
            } else if !catalog::is_committed(dir, s) {
                info!(
                    step = s,
                    url = self.url(),
                    "drain: step deleted locally before it was drained (retention or rollback)"
                );
                st.handled(s, Handled::Deleted);
            }
        }
    }

    /// Starts the drain thread: clean the target's leftovers, learn what it
    /// holds, then drain forever.
    pub fn spawn(self: &Arc<Drain>) -> Result<(), DrainError> {
        let d = self.clone();
        std::thread::Builder::new()
            .name("ckpt-drain".into())
            .spawn(move || {
                crate::priority::idle_cpu_and_io();
                d.run()
            })
            .map(|_| ())
            .map_err(DrainError::Thread)
    }

    /// What the target holds, learnt once at start (retried while down).
    fn learn(&self) -> Result<(), Box<ckpt_tier::TierError>> {
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
                Round::Moved => backoff_ms = config::DRAIN_BACKOFF_MIN_MS,
                Round::Idle => {
                    backoff_ms = config::DRAIN_BACKOFF_MIN_MS;
                    self.pause(Duration::from_millis(config::DRAIN_POLL_MS));
                }
                Round::TargetFailed => {
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
        for &p in &pending {
            st.note(p, self.opts.every);
        }
        self.sweep(&mut st);
        let Some(&newest) = pending.last() else {
            self.answer(&mut st);
            return None;
        };
        let older = &pending[..pending.len() - 1];
        if !older.is_empty() {
            info!(url = self.url(), skipped = ?older, draining = newest, "drain behind: draining the newest committed step, skipping older ones");
            for &o in older {
                st.handled(o, Handled::Skipped);
            }
            st.done_upto = Some(older[older.len() - 1]);
            on_skip(&mut st, newest);
        }
        st.uploading = Some(newest);
        self.answer(&mut st);
        Some(newest)
    }

    /// Whether a stopping sidecar may exit as far as the drain goes: the
    /// newest committed step it will drain is replicated (or skipped), or
    /// the target is down (then what is not replicated stays local, and
    /// the next sidecar on these directories uploads it).
    pub fn settled(&self) -> bool {
        // Several nodes: the steps are committed in the shared directory.
        let newest = catalog::committed_steps(self.committed_in())
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

    /// For `status` (and the metrics): the backlog's bytes read from the
    /// local indexes after the state lock is let go.
    pub fn report(&self) -> DrainReport {
        let mut st = self.lock();
        self.sweep(&mut st);
        let now = Instant::now();
        let lag_seconds = st.pending.values().min().map_or(0.0, |&t| now.duration_since(t).as_secs_f64());
        let waiting: Vec<u64> = st.pending.keys().copied().collect();
        let mut r = DrainReport {
            url: self.url().to_string(),
            up: st.up,
            error: st.error.clone(),
            last_replicated: st.replicated.last().copied(),
            uploading: st.uploading,
            backlog: waiting.iter().copied().filter(|&s| st.uploading != Some(s)).collect(),
            skipped: st.skipped.iter().copied().collect(),
            bytes_per_s: st.bytes_per_s,
            every: self.opts.every,
            keep: self.opts.keep.map(|k| k as u64),
            replicated_count: st.replicated_count,
            skipped_count: st.skipped_count,
            deleted_undrained_count: st.deleted_undrained_count,
            deleted_undrained: st.deleted_undrained.iter().copied().collect(),
            backlog_bytes: 0,
            upload_failures: st.upload_failures,
            lag_seconds,
        };
        drop(st);
        r.backlog_bytes = waiting
            .iter()
            .filter_map(|&s| ckpt_store::restore::read_index(self.committed_in(), s).ok())
            .map(|i| i.ckpt.files.iter().map(|f| f.len_bytes).sum::<u64>())
            .sum();
        r
    }
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
