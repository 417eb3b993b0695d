//! Several nodes (`--shared DIR`): this node's side of a commit that spans
//! the sidecars of every node, on the committer thread.
//!
//! Each rank's part is written into the step's temp folder in the shared
//! directory while the session still copies it (`Store::write_rank_part_fed`:
//! each chunk once its bytes are copied, as a whole save's `commit_fed`):
//! shards, blobs, its slice declarations, then, after the copy's
//! checksums, the marker. Its staging lease is then freed.
//! The rank waits here for the global commit. The sidecar serving rank 0 of a step
//! is that step's **coordinator**. At each look it lists the temp folder
//! and reads the markers new since the last look, each once
//! (`Store::read_new_markers`); when all are in, it commits
//! (`Store::commit_read_ranks`: no marker read again), answers its ranks,
//! and only then applies retention (`Store::retain_shared`). When the part
//! timeout passes first, it aborts the step and removes the temp folder.
//! Every other sidecar only watches the shared directory with two looks
//! and no listing (`nodes::ranks_outcome`): committed means Durable, and a
//! folder gone uncommitted means Failed, with the coordinator's abort record.
//! A step is looked at `PART_TICK_MIN_MS` after progress (a part written
//! here, a new marker seen), the wait doubling per look that finds nothing
//! new up to `PART_TICK_MS` (another sidecar: within `PART_TICK_BUSY_MS`
//! again while the temp folder changes, as markers come in, so that it sees
//! the commit soon after the last one): a short latency floor at a bounded cost, the
//! same on a network file system (no file-system notification is relied on).
//! Ranks tell their sidecar the rank and world size in SavePart.
//!
//! With peers (`--peers`), doorbells save the waits (`peer::bells`): a
//! part's marker, once written, is also sent to the coordinator of the
//! last step decided here, which takes it as if read from the file
//! (`Store::take_sent_marker`: checked the same way, of the same temp
//! folder), so that once every marker came in by message or from this
//! node's own parts it commits without listing or reading a marker; and
//! the coordinator, having decided, tells every peer, which looks at the
//! shared directory at once. A doorbell is never the outcome: Durable
//! still needs the index under its final name. One lost costs the look
//! it would have saved. Markers sent for a step before its rank 0's part
//! is here are kept (bounded: `PEER_EARLY_MARKER*`) until it is, or until
//! the step is decided.
//!
//! An incremental part (`--incremental on`) is compared with the newest
//! step committed in the shared directory: its stable shards whose tensors
//! are all unchanged are hard-linked from that step's files (in the shared
//! directory, or this node's own folder of it), `--full-every` counted per
//! rank; what it found changed feeds the history the next parts plan with.
//!
//! Invariants:
//! - Durable reaches a rank only once the step's index is under its final
//!   name in the shared directory.
//! - A waiting rank is answered exactly once, and its flight ends with
//!   the answer.
//! - Draining waits for the waiting ranks (no trainer has to be alive for
//!   the commit); aborting fails them, and a coordinator removes its steps'
//!   temp folders.
//! - A sidecar that is not the coordinator gives up after twice the part
//!   timeout, when no coordinator committed or aborted by then (it died).
//!   It removes only its own ranks' files.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_store::commit::{CommitError, Store};
use ckpt_store::image::{self, Layout, SliceDecl};
use ckpt_store::nodes::{self, MarkersRead, PartReport, RanksState, SentMarker, SentPart};
use ckpt_wire::{Blob, ErrorCode, LastFigures, Reply};
use tracing::{debug, info, warn};

use crate::commit::slices;
use crate::config;
use crate::memory::staging::Lease;
use crate::peer::Rang;
use crate::state::jobs::{copy_failure_or, error_code, Fill, FillEnd, Flight, Job, Part};
use crate::state::refusal::Refusal;
use crate::state::reply::Replies;
use crate::state::{DaemonState, Phase};

/// A rank whose part is on disk, waiting for the global commit.
struct Waiter {
    id: u64,
    rank: u32,
    replies: Arc<Replies>,
    copy_seconds: f64,
    /// An incremental part: how many of its shards were linked (`--full-every`'s count).
    linked_files: Option<usize>,
}

/// A part's bytes and what was checked of them, as they are written.
struct PartBytes<'a> {
    rank: u32,
    layout: &'a Layout,
    lease: &'a Lease,
    crcs: &'a [u32],
    digests: Option<&'a [u128]>,
    blobs: &'a [Blob],
    decls: &'a [SliceDecl],
    fill: Option<&'a Fill>,
}

struct StepWait {
    world_size: u32,
    waiters: Vec<Waiter>,
    /// This sidecar serves rank 0 of the step.
    coordinator: bool,
    /// When this sidecar's first part of the step (the coordinator: rank 0's)
    /// was written.
    since: Instant,
    /// The ranks whose markers were last seen in the temp folder (the
    /// coordinator's every look; another sidecar's only when it gives up).
    seen: BTreeSet<u32>,
    /// The coordinator: the markers read so far, each once.
    read: MarkersRead,
    bytes: u64,
    /// When the step is looked at next, and the wait before the look after:
    /// short after progress (a part written here, a new marker seen),
    /// doubling up to `PART_TICK_MS` while nothing changes.
    next_look: Instant,
    tick: Duration,
    /// Not the coordinator: the temp folder's modification time at the last
    /// look (it changes as markers come in).
    folder_modified: Option<std::time::SystemTime>,
    /// Not (yet) the coordinator: this node's parts' markers, taken into
    /// `read` if rank 0's part comes here.
    own: Vec<SentMarker>,
    /// The coordinator's Decided came (the look it caused says so).
    rung: bool,
    /// No shared file system: this node's parts, as sent (or not yet: no
    /// coordinator known), for the step's coordinator once it says it is.
    parts_sent: Vec<crate::peer::PartSent>,
    /// The coordinator, no shared file system: the files of other nodes'
    /// parts written into its temp folder and not yet synced (synced all
    /// at once before the commit: `nodes::sync_written`).
    unsynced: Vec<std::path::PathBuf>,
}

impl StepWait {
    /// Something changed: look again soon.
    fn progressed(&mut self) {
        self.tick = Duration::from_millis(config::PART_TICK_MIN_MS);
        self.next_look = Instant::now() + self.tick;
    }

    /// Another node's marker came in (the temp folder changed): look again
    /// within `PART_TICK_BUSY_MS`, which bounds the looks while markers
    /// keep arriving.
    fn busy(&mut self) {
        self.tick = Duration::from_millis(config::PART_TICK_BUSY_MS);
        self.next_look = Instant::now() + self.tick;
    }

    /// A look that found nothing new: wait longer before the next.
    fn idle(&mut self) {
        self.tick = (self.tick * 2).min(Duration::from_millis(config::PART_TICK_MS));
        self.next_look = Instant::now() + self.tick;
    }
}

pub struct Nodes {
    steps: BTreeMap<u64, StepWait>,
    timeout: Duration,
    /// Per rank served here: its parts committed since the last one that
    /// linked nothing (`--full-every`, counted per rank as one node's
    /// sidecar counts its saves: `crate::commit::full_every`).
    since_full: BTreeMap<u32, u32>,
    /// Markers sent by peers for steps not coordinated here (yet)
    /// (bounded: `PEER_EARLY_MARKER*`).
    early: BTreeMap<u64, Vec<Sent>>,
    /// Per rank served here: the newest committed step whose folder holds
    /// its marker (pruned once a newer step of the rank commits).
    markers_left: BTreeMap<u32, u64>,
}

/// A rank's marker that came by message: from a node sharing the temp
/// folder, or, with no shared file system, with the files of its part the
/// coordinator's folder needs.
enum Sent {
    Marker(SentMarker),
    Part(SentPart),
}

impl Sent {
    fn len_bytes(&self) -> usize {
        match self {
            Sent::Marker(m) => m.len_bytes(),
            Sent::Part(p) => p.len_bytes(),
        }
    }

    fn rank(&self) -> u32 {
        match self {
            Sent::Marker(m) => m.rank,
            Sent::Part(p) => p.rank,
        }
    }
}

fn answer_failed(state: &DaemonState, w: Waiter, step: u64, r: Refusal) {
    state.end(Flight::Part(step, w.rank));
    w.replies.send(&r.failed(w.id, step));
}

impl Nodes {
    pub fn new(timeout: Duration) -> Nodes {
        Nodes {
            steps: BTreeMap::new(),
            timeout,
            since_full: BTreeMap::new(),
            early: BTreeMap::new(),
            markers_left: BTreeMap::new(),
        }
    }

    /// Whether some rank waits for a step's outcome (the committer then
    /// looks at the shared directory every tick).
    pub fn has_waiting(&self) -> bool {
        !self.steps.is_empty()
    }

    /// The steps this sidecar coordinates now (for logs).
    pub fn coordinating(&self) -> Vec<u64> {
        self.steps.iter().filter(|(_, w)| w.coordinator).map(|(s, _)| *s).collect()
    }

    /// One rank's part (released, or still being copied: `job.fill`):
    /// written into the shared directory with its marker, its lease freed;
    /// the rank then waits for the commit. A part whose copy fails is
    /// answered Failed here, with the copy's reason, its files removed.
    pub fn offer(&mut self, store: &mut Store, state: &DaemonState, job: Job) {
        let Job { id, step, layout, lease, crcs, digests, blobs, part, replies, span, copy_seconds, fill, .. } = job;
        let _enter = span.enter();
        let part = part.expect("only parts go to the nodes");
        let key = Flight::Part(step, part.rank);
        // Called with the lease dropped: a fed part's copy has ended then
        // (the lease's drop waits for it), and a copy that failed is
        // answered with its own reason (the session does not answer it).
        let fail = |r: Refusal| {
            let r = copy_failure_or(fill.as_ref(), r);
            state.end(key);
            replies.send(&r.failed(id, step));
        };
        let decls = match self.check_part(state, step, part, &layout, &blobs) {
            Ok(d) => d,
            Err(r) => {
                drop(lease);
                return fail(r);
            }
        };
        state.set_phase(key, Phase::Writing);
        let bytes = PartBytes {
            rank: part.rank,
            layout: &layout,
            lease: &lease,
            crcs: &crcs,
            digests: digests.as_deref(),
            blobs: &blobs,
            decls: &decls,
            fill: fill.as_deref(),
        };
        let (t0, r) = self.write_part(store, state, step, &bytes);
        let rep = match r {
            Ok(rep) => rep,
            Err(e) => {
                drop(lease);
                warn!(rank = part.rank, "writing this rank's part into the shared directory failed: {e}");
                return fail(Refusal::from(&e));
            }
        };
        let fill_end = fill.as_ref().map(|f| f.end());
        let copy_seconds = match &fill_end {
            Some(FillEnd::Copied { copy_seconds }) => *copy_seconds,
            _ => copy_seconds,
        };
        // The next parts' stable shards: this part's tensors that changed.
        let linked_files = rep.incremental.map(|inc| {
            state.merge_changed(layout.specs.iter().map(|s| s.name.as_str()), inc.changed);
            inc.linked_files
        });
        info!(rank = part.rank, world_size = part.world_size, bytes = rep.bytes, write_s = t0.elapsed().as_secs_f64(), marker = %rep.marker.display(), "rank's part written and marked; waiting for the commit");
        state.set_phase(key, Phase::WaitingForRanks);
        let waiter = Waiter { id, rank: part.rank, replies, copy_seconds, linked_files };
        let part_blobs: Vec<&Blob> = blobs.iter().filter(|b| !slices::is_declaration(b)).collect();
        self.wait_for_commit(store, state, step, (part.world_size, rep.bytes), (rep.sent, &part_blobs), waiter);
        // The peers: this part's files copied while its lease is here, so
        // they are sent from memory (once the copy that fed it has ended);
        // after the marker went to the coordinator, as the copy may need
        // fresh memory (10 MB: 50-80 ms of page faults here), and before
        // this step can commit here and its replication start.
        if let Some(p) = &state.peers {
            if fill_end.as_ref().is_none_or(|e| matches!(e, FillEnd::Copied { .. })) {
                p.stage_part(step, &layout, lease.as_slice());
            }
        }
        drop(lease);
        self.poll_step(store, state, step);
    }

    /// The checks of a part before it is written, in this order: its world
    /// size against the step's earlier ranks, a rank sent twice, shutting
    /// down, and its slice declarations; returns those declarations.
    fn check_part(
        &self,
        state: &DaemonState,
        step: u64,
        part: Part,
        layout: &Layout,
        blobs: &[Blob],
    ) -> Result<Vec<SliceDecl>, Refusal> {
        if let Some(w) = self.steps.get(&step) {
            if w.world_size != part.world_size {
                let why = format!(
                    "step {step}: rank {} says world size {}, but this node's earlier ranks said {}",
                    part.rank, part.world_size, w.world_size
                );
                warn!("{why}");
                return Err(Refusal::new(ErrorCode::BadRequest, why));
            }
            if w.waiters.iter().any(|x| x.rank == part.rank) {
                let why = format!("step {step}: rank {} sent its part twice", part.rank);
                warn!("{why}");
                return Err(Refusal::new(ErrorCode::BadRequest, why));
            }
        }
        if state.is_aborting() {
            let reason = format!("step {step}: aborted before writing; the sidecar is shutting down");
            return Err(Refusal::new(ErrorCode::ShuttingDown, reason));
        }
        // This rank's slice declarations, checked here as one sidecar checks
        // each part's (they name its own tensors); the coordinator checks
        // them across ranks when it merges the markers.
        slices::declared(part.rank, layout, blobs).map_err(|why| {
            let why = format!("step {step}: {why}");
            warn!("{why}");
            Refusal::new(ErrorCode::BadRequest, why)
        })
    }

    /// Writes a part into the step's temp folder in the shared directory;
    /// returns when the write began (for its log line) and its report.
    fn write_part(
        &self,
        store: &mut Store,
        state: &DaemonState,
        step: u64,
        p: &PartBytes<'_>,
    ) -> (Instant, Result<PartReport, CommitError>) {
        let mut placed = p.layout.clone();
        placed.rebase(p.lease.offset_bytes());
        // Slice declarations are not stored as blobs (protocol.md, "Slices"):
        // they travel beside the rank's marker into the step's index.
        let blob_refs: Vec<image::Blob> = p
            .blobs
            .iter()
            .filter(|b| !slices::is_declaration(b))
            .map(|b| image::Blob { name: &b.name, bytes: &b.bytes })
            .collect();
        let t0 = Instant::now();
        // A fed part (still being copied) is written as it is copied; its
        // marker waits for the copy's checksums.
        // Incremental: whether its unchanged stable shards may be linked
        // (`--full-every`, counted per rank).
        store.set_link_unchanged(self.may_link(state, p.rank));
        let buf = p.lease.staging_buf();
        let r = match (p.fill, p.digests) {
            (None, Some(d)) if placed.opts.incremental => {
                store.write_rank_part_with_digests(step, &placed, buf, p.crcs, d, &blob_refs, p.decls)
            }
            (None, _) => store.write_rank_part(step, &placed, buf, p.crcs, &blob_refs, p.decls),
            (Some(f), _) => store.write_rank_part_fed(step, &placed, buf, &f.progress, &blob_refs, p.decls),
        };
        (t0, r)
    }

    /// Puts a written part's rank among the step's waiters; the sidecar
    /// serving rank 0 becomes the step's coordinator, its clock starting now.
    /// The part's marker is taken from its report, not read again: by the
    /// coordinator at once; else kept for the case rank 0 comes here, and
    /// sent to the last coordinator known (no shared file system: with its
    /// `blobs`, and kept to go to the coordinator that says it is one, when
    /// none is known or another one is).
    fn wait_for_commit(
        &mut self,
        store: &Store,
        state: &DaemonState,
        step: u64,
        (world_size, bytes): (u32, u64),
        (sent, blobs): (SentMarker, &[&Blob]),
        waiter: Waiter,
    ) {
        let timeout = self.timeout;
        let w = self.steps.entry(step).or_insert_with(|| StepWait {
            world_size,
            waiters: Vec::new(),
            coordinator: false,
            since: Instant::now(),
            seen: BTreeSet::new(),
            read: MarkersRead::default(),
            bytes: 0,
            next_look: Instant::now(),
            tick: Duration::ZERO,
            folder_modified: None,
            own: Vec::new(),
            rung: false,
            parts_sent: Vec::new(),
            unsynced: Vec::new(),
        });
        w.progressed();
        w.bytes += bytes;
        w.seen.insert(waiter.rank);
        if waiter.rank == 0 {
            w.coordinator = true;
            w.since = Instant::now();
            info!(
                step,
                world_size,
                timeout_s = timeout.as_secs_f64(),
                "coordinator of this step (this sidecar serves rank 0): commits when every rank's marker is in the shared directory"
            );
            if let Some(p) = &state.peers {
                p.coordinating(step);
            }
        }
        w.waiters.push(waiter);
        if w.coordinator {
            let mut sents: Vec<Sent> = std::mem::take(&mut w.own).into_iter().map(Sent::Marker).collect();
            sents.push(Sent::Marker(sent));
            sents.extend(self.early.remove(&step).unwrap_or_default());
            take_markers(store, step, w, sents);
        } else {
            if let Some(sent) = state.peers.as_ref().and_then(|p| p.marked(step, world_size, &sent, blobs)) {
                w.parts_sent.push(sent);
            }
            w.own.push(sent);
        }
    }

    /// A peer's doorbell: a marker for the coordinator (taken, and the step
    /// committed if it was the last; kept if rank 0's part is not here
    /// yet), or a step decided (looked at now).
    pub fn rang(&mut self, store: &mut Store, state: &DaemonState, rang: Rang) {
        match rang {
            Rang::Marked { from, step, world_size, sent } => {
                self.sent(store, state, (&from, step, world_size), Sent::Marker(sent))
            }
            Rang::Part { from, step, world_size, part } => {
                self.sent(store, state, (&from, step, world_size), Sent::Part(part))
            }
            Rang::Decided { step } => self.rung_decided(store, state, step),
            Rang::Committed { step, files } => {
                // No shared file system: this node's folder gets the step
                // (its ranks are Durable once it is there); then, off their
                // path as the coordinator's, its own retention, and the
                // sweep of what retention un-committed (the look that
                // answered them swept already).
                let (coordinated, waited) = match self.steps.get(&step) {
                    Some(w) => (w.coordinator, true),
                    None => (false, false),
                };
                match store.install_committed(step, &files) {
                    Ok(_) => {
                        self.rung_decided(store, state, step);
                        if coordinated {
                            return;
                        }
                        let deleted = store.retain_shared(step);
                        if !deleted.is_empty() {
                            info!(?deleted, "retention (this node's shared directory)");
                        }
                        if !deleted.is_empty() || !waited {
                            self.sweep(store);
                        }
                    }
                    Err(e) => self.fail_step(state, step, &format!("step {step}: committed by the coordinator, but this node could not install its index ({e}); the step does not count as durable here")),
                }
            }
            Rang::Coordinating { step, to } => {
                // No shared file system: this node's parts of the step go
                // there (if they went elsewhere, or nowhere yet).
                let (Some(p), Some(w)) = (&state.peers, self.steps.get_mut(&step)) else { return };
                if !w.coordinator {
                    for sent in &mut w.parts_sent {
                        p.part_to(sent, &to);
                    }
                }
            }
            Rang::Aborted { step, reason } => {
                // No shared file system: the coordinator's reason, as the
                // abort record it would have left in a shared directory.
                if let Err(e) = store.abort_ranks(step, &reason) {
                    warn!(step, "could not remove this node's temp folder of an aborted step ({e})");
                }
                self.rung_decided(store, state, step);
            }
        }
    }

    /// A marker (or, with no shared file system, a part) sent by node
    /// `from` for `step`: taken when this sidecar coordinates the step (the
    /// step committed if it was the last), else kept until it does.
    fn sent(&mut self, store: &mut Store, state: &DaemonState, (from, step, world_size): (&str, u64, u32), sent: Sent) {
        let Some(w) = self.steps.get_mut(&step).filter(|w| w.coordinator) else {
            return self.keep_early(step, sent);
        };
        if w.world_size != world_size {
            warn!(step, node = %from, world_size, "peers: a marker sent for another world size than this step's {}; the file is read instead", w.world_size);
            return;
        }
        if !take_markers(store, step, w, vec![sent]) {
            // Not taken (another attempt's folder, no birth
            // times here, refused): the file is read soon.
            w.progressed();
        } else if w.read.has_all(world_size) {
            self.coordinate(store, state, step);
        }
    }

    /// The coordinator decided `step`: this node looks at once.
    fn rung_decided(&mut self, store: &mut Store, state: &DaemonState, step: u64) {
        self.forget_early(step);
        if let Some(w) = self.steps.get_mut(&step).filter(|w| !w.coordinator) {
            w.rung = true;
            self.watch(store, state, step);
        }
    }

    /// This node's ranks of `step` (not coordinated here) fail now, for `why`.
    fn fail_step(&mut self, state: &DaemonState, step: u64, why: &str) {
        warn!("{why}");
        self.forget_early(step);
        if self.steps.get(&step).is_none_or(|w| w.coordinator) {
            return;
        }
        let w = self.steps.remove(&step).expect("looked up");
        for x in w.waiters {
            answer_failed(state, x, step, Refusal::new(ErrorCode::Io, why.to_string()));
        }
    }

    /// A marker sent for a step this sidecar does not coordinate (yet):
    /// kept within `PEER_EARLY_MARKERS_BYTES_MAX`, for the newest
    /// `PEER_EARLY_MARKER_STEPS_MAX` steps; else dropped (its file stays).
    fn keep_early(&mut self, step: u64, sent: Sent) {
        let kept_bytes: usize = self.early.values().flatten().map(Sent::len_bytes).sum();
        if kept_bytes + sent.len_bytes() > config::PEER_EARLY_MARKERS_BYTES_MAX {
            warn!(
                step,
                rank = sent.rank(),
                "peers: a marker came before this step's rank 0 part and the ones kept are at their bound; dropped"
            );
            return;
        }
        debug!(step, rank = sent.rank(), "peers: a marker came before this step's rank 0 part; kept for it");
        self.early.entry(step).or_default().push(sent);
        while self.early.len() > config::PEER_EARLY_MARKER_STEPS_MAX {
            self.early.pop_first();
        }
    }

    /// `step` is decided: markers kept for it, or older ones, are dropped.
    fn forget_early(&mut self, step: u64) {
        self.early.retain(|s, _| *s > step);
    }

    /// Whether rank `rank`'s next part may link unchanged shards: not when
    /// it is the `--full-every`-th of its parts since the last committed
    /// one that linked nothing.
    fn may_link(&self, state: &DaemonState, rank: u32) -> bool {
        let k = state.full_every.load(std::sync::atomic::Ordering::Relaxed);
        let since = self.since_full.get(&rank).copied().unwrap_or(0);
        let link = k == 0 || since + 1 < k;
        if !link {
            info!(rank, full_every = k, "incremental: this rank's part is written in full (--full-every)");
        }
        link
    }

    /// A step committed: each of its ranks' counts toward `--full-every`
    /// (a part that linked nothing restarts it).
    fn count_committed(&mut self, w: &StepWait) {
        for x in &w.waiters {
            let Some(n) = x.linked_files else { continue };
            let c = self.since_full.entry(x.rank).or_insert(0);
            *c = if n == 0 { 0 } else { *c + 1 };
        }
    }

    /// A step committed (by this sidecar or another): its ranks count
    /// towards `--full-every` and are answered Durable, then each one's
    /// marker in the folder of the step committed before it goes
    /// (`nodes::prune_rank_marker`), off the commit path.
    fn committed(&mut self, store: &Store, state: &DaemonState, w: StepWait, step: u64, path: &str, persist_s: f64) {
        self.count_committed(&w);
        let ranks: Vec<u32> = w.waiters.iter().map(|x| x.rank).collect();
        durable(state, w, step, path, persist_s);
        let Some(dir) = store.shared_dir() else { return };
        for rank in ranks {
            let prev = self.markers_left.get(&rank).copied();
            if prev.is_some_and(|p| p >= step) {
                continue;
            }
            self.markers_left.insert(rank, step);
            if let Some(prev) = prev {
                if let Err(e) = nodes::prune_rank_marker(dir, prev, rank) {
                    debug!(step = prev, rank, "the rank's marker stays until retention ({e})");
                }
            }
        }
    }

    /// When the next waiting step is due for a look (the committer's wait
    /// ends then at the latest).
    pub fn next_look(&self) -> Option<Instant> {
        self.steps.values().map(|w| w.next_look).min()
    }

    /// Looks at every waiting step that is due in the shared directory (all
    /// of them while shutting down).
    pub fn tick(&mut self, store: &mut Store, state: &DaemonState) {
        let now = Instant::now();
        let all = state.is_aborting();
        let steps: Vec<u64> = self.steps.iter().filter(|(_, w)| all || w.next_look <= now).map(|(s, _)| *s).collect();
        for step in steps {
            self.poll_step(store, state, step);
        }
    }

    fn poll_step(&mut self, store: &mut Store, state: &DaemonState, step: u64) {
        let Some(w) = self.steps.get(&step) else { return };
        if w.coordinator {
            self.coordinate(store, state, step);
        } else {
            self.watch(store, state, step);
        }
    }

    /// A step was decided (and removed from `steps`): before its ranks are
    /// answered, this node's node-local folders of steps aborted, or
    /// un-committed by the coordinator's retention, go
    /// (`ckpt_store::nodes::sweep_node_local`); a no-op without `--node-local`.
    fn sweep(&self, store: &Store) {
        let waiting: BTreeSet<u64> = self.steps.keys().copied().collect();
        store.sweep_node_local(&waiting);
    }

    /// The coordinator: commit when every marker is in, abort when the
    /// timeout passed first.
    fn coordinate(&mut self, store: &mut Store, state: &DaemonState, step: u64) {
        let w = self.steps.get_mut(&step).expect("polled");
        let world_size = w.world_size;
        let before = w.read.ranks().len();
        // Every marker in (sent, or this node's own): no listing.
        let complete = w.read.has_all(world_size);
        // With peers, a marker's message usually comes soon after its file:
        // a listing leaves the files it finds first for a later look (not
        // where no message can be taken: a file system without birth times).
        let looked = if complete {
            Ok(Ok(Vec::new()))
        } else if state.peers.is_some() && w.read.takes_sent() {
            store.read_new_markers_deferred(
                step,
                world_size,
                &mut w.read,
                Duration::from_millis(config::PEER_MARKER_DEFER_MS),
            )
        } else {
            store.read_new_markers(step, world_size, &mut w.read)
        };
        let looked = match looked {
            Ok(r) => r,
            Err(e) => {
                warn!(step, "cannot read the shared directory ({e}); trying again");
                w.idle();
                return;
            }
        };
        let missing = match &looked {
            Ok(m) => m.clone(),
            Err(_) => Vec::new(),
        };
        w.seen = w.read.ranks();
        if w.read.has_deferred() {
            // The files left are read when due, if their messages are late.
            w.tick = Duration::from_millis(config::PEER_MARKER_DEFER_MS);
            w.next_look = Instant::now() + w.tick;
        } else if w.seen.len() > before {
            w.progressed();
        } else {
            w.idle();
        }
        if missing.is_empty() {
            let mut w = self.steps.remove(&step).expect("polled");
            let t0 = Instant::now();
            let read = std::mem::take(&mut w.read);
            let markers_sent = read.n_sent();
            // Other nodes' parts' files written here (no shared file
            // system): synced together before the index names them.
            let synced = nodes::sync_written(&std::mem::take(&mut w.unsynced));
            match looked.and(synced).and_then(|_| store.commit_read_ranks(step, world_size, read)) {
                Ok(rep) => {
                    // The peers look now (a doorbell, never waited for).
                    self.decided(state, step, None);
                    let persist_seconds = w.since.elapsed().as_secs_f64();
                    info!(
                        step,
                        world_size,
                        markers_sent,
                        commit_s = t0.elapsed().as_secs_f64(),
                        "durable (every node's ranks; this sidecar coordinated)"
                    );
                    let copy_seconds = w.waiters.iter().map(|x| x.copy_seconds).fold(0.0, f64::max);
                    let gib_per_s = w.bytes as f64 / persist_seconds.max(1e-9) / (1u64 << 30) as f64;
                    state.set_last(LastFigures {
                        step,
                        bytes: w.bytes,
                        copy_seconds,
                        persist_seconds,
                        persist_gib_per_s: gib_per_s,
                    });
                    self.committed(store, state, w, step, &rep.path.display().to_string(), persist_seconds);
                    // Off the commit path: its ranks are answered (a crash
                    // before this leaves it to the next commit).
                    let t_retain = Instant::now();
                    let deleted = store.retain_shared(step);
                    if !deleted.is_empty() {
                        info!(?deleted, retain_s = t_retain.elapsed().as_secs_f64(), "retention (shared directory)");
                    }
                    self.sweep(store);
                }
                Err(e) => {
                    let why = match &e {
                        // Its own line already names the step and says nothing was committed.
                        CommitError::PartsDisagree { .. } => e.to_string(),
                        _ => format!("step {step}: the coordinator's commit failed: {e}; the step is not committed"),
                    };
                    warn!("{why}");
                    let committed = matches!(e, CommitError::AlreadyCommitted { .. });
                    if !committed {
                        self.abort_folder(store, step, &why);
                    }
                    self.decided(state, step, (!committed).then_some(why.as_str()));
                    self.sweep(store);
                    for x in w.waiters {
                        answer_failed(state, x, step, Refusal::new(error_code(&e), why.clone()));
                    }
                }
            }
            return;
        }
        if state.is_aborting() || w.since.elapsed() >= self.timeout {
            let w = self.steps.remove(&step).expect("polled");
            let why = if state.is_aborting() {
                format!("step {step}: the coordinator (rank 0's sidecar) is shutting down before rank(s) {missing:?} of {world_size} wrote their markers; the step is not committed")
            } else {
                format!(
                    "step {step}: rank(s) {missing:?} of {world_size} wrote no marker in the shared directory within {} s; the coordinator (rank 0's sidecar) aborted the step",
                    self.timeout.as_secs_f64()
                )
            };
            warn!("{why}");
            self.abort_folder(store, step, &why);
            self.decided(state, step, Some(&why));
            self.sweep(store);
            let code = if state.is_aborting() { ErrorCode::ShuttingDown } else { ErrorCode::Io };
            for x in w.waiters {
                answer_failed(state, x, step, Refusal::new(code, why.clone()));
            }
        }
    }

    /// This sidecar, the coordinator, decided `step` (the index is under its
    /// final name, or the folder gone with its abort record, `aborted`):
    /// its peers are told, and markers kept for it dropped.
    fn decided(&mut self, state: &DaemonState, step: u64, aborted: Option<&str>) {
        self.forget_early(step);
        if let Some(p) = &state.peers {
            p.decided(step, aborted);
        }
    }

    /// Removes the step's temp folder, leaving `why` as its abort record
    /// for the other nodes' ranks.
    fn abort_folder(&self, store: &Store, step: u64, why: &str) {
        match store.abort_ranks(step, why) {
            Ok(true) => info!(step, "removed the step's multi-rank temp folder"),
            Ok(false) => {}
            Err(e) => warn!(
                step,
                "could not remove the step's multi-rank temp folder ({e}); a sidecar's start removes it once stale"
            ),
        }
    }

    /// Not the coordinator: Durable once the step is committed; Failed when
    /// its folder is gone uncommitted, or when nobody decided in time.
    fn watch(&mut self, store: &mut Store, state: &DaemonState, step: u64) {
        let dir = store.shared_dir().expect("nodes run with a shared directory").to_path_buf();
        // Two looks, no listing: the waiting costs the same whatever the rank count.
        let (ranks, modified) = match nodes::ranks_outcome(&dir, step) {
            Ok(s) => s,
            Err(e) => {
                warn!(step, "cannot read the shared directory ({e}); trying again");
                self.steps.get_mut(&step).expect("polled").idle();
                return;
            }
        };
        let w = self.steps.get_mut(&step).expect("polled");
        match ranks {
            RanksState::Committed => {
                let w = self.steps.remove(&step).expect("polled");
                let path = ckpt_store::catalog::step_path(&dir, step).display().to_string();
                let persist_seconds = w.since.elapsed().as_secs_f64();
                info!(step, doorbell = w.rung, "durable (committed by the coordinator, rank 0's sidecar)");
                self.forget_early(step);
                self.sweep(store);
                self.committed(store, state, w, step, &path, persist_seconds);
            }
            RanksState::Gone => {
                let w = self.steps.remove(&step).expect("polled");
                // The coordinator's own reason, with the ranks missing when it
                // aborted (its abort record, written before it removed the folder).
                let why = if let Some(why) = nodes::abort_reason(&dir, step) {
                    why
                } else {
                    let mine: Vec<u32> = w.waiters.iter().map(|x| x.rank).collect();
                    format!("step {step}: the step's folder is gone uncommitted, with no abort record (the coordinator, rank 0's sidecar, or a start's recovery removed it; their logs say why); this node's rank(s) {mine:?} of {} had written their markers; the step is not committed", w.world_size)
                };
                warn!("{why}");
                self.forget_early(step);
                self.sweep(store);
                for x in w.waiters {
                    answer_failed(state, x, step, Refusal::new(ErrorCode::Io, why.clone()));
                }
            }
            RanksState::InFlight(_) => {
                let limit = self.timeout * 2;
                let over = state.peers.as_ref().filter(|p| p.over_peers());
                if let Some(p) = over.filter(|_| !state.is_aborting() && w.since.elapsed() >= limit) {
                    // No shared file system: the coordinator's Committed may
                    // have been lost; asked for the step before giving up.
                    if p.take_committed(store, step) {
                        info!(step, "the coordinator's Committed never came; the step was asked of it and installed");
                        return self.watch(store, state, step);
                    }
                }
                let w = self.steps.get_mut(&step).expect("polled");
                if state.is_aborting() || w.since.elapsed() >= limit {
                    let mut w = self.steps.remove(&step).expect("polled");
                    // The one listing of the wait: which ranks to name.
                    if let Ok(RanksState::InFlight(seen)) = nodes::ranks_state(&dir, step) {
                        w.seen.extend(seen);
                    }
                    let missing: Vec<u32> = (0..w.world_size).filter(|r| !w.seen.contains(r)).collect();
                    let why = if state.is_aborting() {
                        format!("step {step}: this sidecar is shutting down before the coordinator committed; rank(s) {missing:?} of {} had written no marker", w.world_size)
                    } else {
                        format!(
                            "step {step}: no commit nor abort by the coordinator (rank 0's sidecar) within {} s; rank(s) {missing:?} of {} wrote no marker; the step is not committed",
                            limit.as_secs_f64(),
                            w.world_size
                        )
                    };
                    warn!("{why}");
                    let ranks: Vec<u32> = w.waiters.iter().map(|x| x.rank).collect();
                    if let Err(e) = store.withdraw_ranks(step, &ranks) {
                        warn!(step, "could not remove this node's ranks' files ({e})");
                    }
                    let code = if state.is_aborting() { ErrorCode::ShuttingDown } else { ErrorCode::Io };
                    for x in w.waiters {
                        answer_failed(state, x, step, Refusal::new(code, why.clone()));
                    }
                } else if modified.is_some() && modified != w.folder_modified {
                    w.folder_modified = modified;
                    w.busy();
                } else {
                    w.idle();
                }
            }
        }
    }

    /// The committer's queue closed: every waiting rank is failed.
    pub fn fail_all(&mut self, store: &Store, state: &DaemonState, why: &str) {
        for (step, w) in std::mem::take(&mut self.steps) {
            let why = format!("step {step}: {why}");
            if w.coordinator {
                let why = format!("{why} (the coordinator, rank 0's sidecar, stopped)");
                self.abort_folder(store, step, &why);
                self.decided(state, step, Some(&why));
            }
            for x in w.waiters {
                answer_failed(state, x, step, Refusal::new(ErrorCode::ShuttingDown, why.clone()));
            }
        }
    }
}

fn durable(state: &DaemonState, w: StepWait, step: u64, path: &str, persist_seconds: f64) {
    // The drain (node-local files): this node uploads its files of the step.
    if let Some(d) = &state.drain {
        d.committed(step);
    }
    // The peers: this node's files of the step go to them (never waited for).
    if let Some(p) = &state.peers {
        p.committed(step);
    }
    for x in w.waiters {
        state.end(Flight::Part(step, x.rank));
        x.replies.send(&Reply::Durable { id: x.id, step, path: path.to_string(), persist_seconds });
    }
}

/// Markers of `step` taken into the coordinator's `read` without reading
/// their files (a refused one, which does not make a step, is left for
/// the file's read, which fails the step saying why); whether each was
/// taken or in already.
fn take_markers(store: &Store, step: u64, w: &mut StepWait, sents: Vec<Sent>) -> bool {
    let mut all = true;
    for m in sents {
        let rank = m.rank();
        let had = w.read.has(rank);
        let taken = match m {
            Sent::Marker(m) => store.take_sent_marker(step, w.world_size, m, &mut w.read),
            Sent::Part(p) => store.take_sent_part(step, w.world_size, p, &mut w.read).map(|(taken, written)| {
                w.unsynced.extend(written);
                taken
            }),
        };
        match taken {
            Ok(taken) => all &= taken || had,
            Err(e) => {
                warn!(step, rank, "a marker sent by message is refused ({e}); its file is read instead");
                all = false;
            }
        }
    }
    all
}
