//! The snapshot stage's flow, one Save from its request to the committer:
//! admit it and plan its file image ([`plan`](crate::save::plan), with the
//! checks of [`checks`](crate::save::checks)), put it in flight, lease
//! staging for it, copy every tensor from the client's regions into the
//! image ([`copy`](crate::save::copy), or fed to the writer as it is
//! copied: [`fed`](crate::save::fed)), release the client, checksum the
//! staged image ([`checksums`](crate::save::checksums); off the trainer's
//! stall), and hand it to the committer. Its log events keep this module's
//! target, which tests read.
//!
//! Invariants:
//! - nothing is copied before every check passed; no descriptor reaches a
//!   copy unless its bytes lie inside a registered region (checked again,
//!   with overflow checks, when the source pointer is formed);
//! - a save is released only if its client is still connected when the
//!   copy ends; otherwise it is aborted, its staging freed, nothing written
//!   — unless the save was handed over (every tensor in a hand-over region,
//!   [`Region::hands_over`]): its bytes are final once sent, so it is
//!   copied and committed whether or not its client is still there;
//! - per session, saves reach the committer in the order they were received.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_wire::{Blob, ErrorCode, Reply, Unchanged};
use tracing::{info, info_span, warn};

use crate::config;
use crate::memory::regions::Region;
use crate::memory::staging::{Lease, StagingError};
use crate::save::checks::{check_not_below_newest, check_sizes};
use crate::save::copy::{copy_and_checksum_into, copy_into};
use crate::save::error::SaveError;
use crate::save::fed::FedCopy;
use crate::save::plan::{regions_of, Planner, SaveTensors, Source};
use crate::save::trusted_unchanged::{self, Taken};
use crate::state::jobs::{Fill, Flight, Job, Part, Work};
use crate::state::refusal::Refusal;
use crate::state::reply::Replies;
use crate::state::{DaemonState, Phase};
use ckpt_store::catalog;
use ckpt_store::format;
use ckpt_store::image::{Layout, LayoutOptions};
use ckpt_store::progress::Filler;

/// Why a save of legacy-IPC CUDA memory is aborted when its client goes
/// before release: the bytes are undefined once the exporter died (a VMM
/// allocation's are not), so a partial copy is never committed.
pub const CLIENT_GONE_LEGACY_CUDA: &str =
    "the client disconnected before release, and its CUDA memory is shared by legacy IPC, undefined once the exporting process is gone (VMM allocations are not): the partial snapshot is not committed";

/// One Save (or SavePart, SaveAfterEvent) as its session read it.
pub struct SaveRequest<'a> {
    pub id: u64,
    pub step: u64,
    pub tensors: SaveTensors<'a>,
    pub blobs: Vec<Blob>,
    pub lazy_release: bool,
    /// A rank's part of a multi-rank step; None: a whole save.
    pub part: Option<Part>,
    pub unchanged: Option<Unchanged>,
}

/// What names a save from its admission on.
#[derive(Clone, Copy)]
struct Head {
    id: u64,
    step: u64,
    part: Option<Part>,
    /// Its entry in the in-flight registry.
    key: Flight,
    t_received: Instant,
}

/// A save in flight with its staging leased: what its copy needs.
struct Leased {
    head: Head,
    layout: Layout,
    sources: Vec<Source>,
    lease: Lease,
    waited: Duration,
    blobs: Vec<Blob>,
    lazy_release: bool,
    span: tracing::Span,
    plan_seconds: f64,
    /// Why the save stops if its client goes (None: handed over, it does not).
    gone: Option<&'static str>,
    /// The tensors taken from the resident image, not copied from the client.
    taken: Option<Taken>,
}

/// Runs one Save for a session: checks, waits for staging, copies, replies
/// Released (or Failed), and queues the image for the committer.
pub fn run_save(
    state: &DaemonState,
    replies: &Arc<Replies>,
    regions: &HashMap<u32, Arc<Region>>,
    plans: &mut dyn Planner,
    req: SaveRequest<'_>,
) {
    let t_received = Instant::now();
    crate::save::helpers::warm();
    let SaveRequest { id, step, tensors, blobs, lazy_release, part, unchanged } = req;
    // Several nodes (--shared): a save without a rank (one process, no
    // WORLD_SIZE) is rank 0 of a world of 1, committed in the shared
    // directory as every step there is. As a whole save it went into --dir
    // alone, where load("latest"), which reads the shared directory, did not
    // find it, and its peers never held it.
    let part = part.or_else(|| state.shared_dir.is_some().then_some(Part { rank: 0, world_size: 1 }));
    let key = match part {
        Some(p) => Flight::Part(step, p.rank),
        None => Flight::Step(step),
    };
    let head = Head { id, step, part, key, t_received };
    let planned = admit(state, replies, step, part)
        .and_then(|opts| plan(state, regions, plans, tensors, &blobs, opts, unchanged.as_ref()));
    let (layout, mut sources) = match planned {
        Ok(x) => x,
        Err(e) => return refuse(replies, head, e),
    };
    let plan_seconds = t_received.elapsed().as_secs_f64();
    // Handed over: every byte it reads lies in a hand-over region (or it
    // reads none), so what it copies is final once sent, and the save is
    // the sidecar's even if its client goes before Released.
    let handed_over = sources.iter().all(|s| s.region.as_ref().is_none_or(|r| r.hands_over()));
    if let Err(e) = begin_flight(state, replies, head, &layout, &sources, handed_over) {
        return refuse(replies, head, e);
    }
    let span = info_span!("save", step, bytes = layout.file_bytes(), tensors = layout.specs.len());
    let guard = span.enter();
    let gone = if handed_over {
        None
    } else if sources.iter().any(|s| s.region.as_ref().is_some_and(|r| r.is_legacy_cuda())) {
        Some(CLIENT_GONE_LEGACY_CUDA)
    } else {
        Some("the client disconnected before release")
    };
    let (lease, waited, taken) =
        match take_staging(state, replies, head, &layout, &mut sources, unchanged.as_ref(), gone) {
            Ok(x) => x,
            Err(e) => return refuse(replies, head, e),
        };
    drop(guard);
    let save = Leased { head, layout, sources, lease, waited, blobs, lazy_release, span, plan_seconds, gone, taken };
    // Pipelined: whole saves, and a rank's part of several nodes (written
    // on its own into the shared directory). A part of one node's group
    // waits for the other ranks' parts first, so it copies, then queues.
    if part.is_none() || state.shared_dir.is_some() {
        run_fed_save(state, replies, save)
    } else {
        run_staged_save(state, replies, save)
    }
}

/// Answers Failed for a save refused or aborted before its job reached
/// the committer.
fn refuse(replies: &Replies, head: Head, e: SaveError) {
    let step = head.step;
    let r = Refusal::from(e);
    info!(step, code = ?r.code, "save refused: {}", r.reason);
    replies.send(&r.failed(head.id, step));
}

/// The checks before a save is planned; returns the options its layout is
/// planned with (a part's rank and world size among them).
fn admit(state: &DaemonState, replies: &Replies, step: u64, part: Option<Part>) -> Result<LayoutOptions, SaveError> {
    // Draining: no new saves; but a handed-over save that a client sent
    // before it went is served (checked once planned, begin_flight).
    if state.is_aborting() || (state.is_draining() && !replies.is_gone()) {
        return Err(SaveError::ShuttingDown);
    }
    if let Some(dir) = &state.read_only {
        // Before anything is planned or copied.
        return Err(SaveError::ReadOnly { step, dir: dir.clone() });
    }
    if step > format::STEP_MAX {
        return Err(SaveError::BadRequest(format!("step {step} is above the largest step {}", format::STEP_MAX)));
    }
    let mut opts = state.layout_opts;
    if let Some(p) = part {
        if p.world_size == 0 || p.rank >= p.world_size {
            return Err(SaveError::BadRequest(format!(
                "rank {} of world size {}: need 0 <= rank < world_size",
                p.rank, p.world_size
            )));
        }
        (opts.rank, opts.world_size) = (p.rank, p.world_size);
        if state.shared_dir.is_some() && state.read_opts.node.is_none() {
            // Several nodes: every part goes into the one shared directory
            // (node-local: into this node's own directories, striped).
            opts.n_dirs = 1;
        }
    }
    Ok(opts)
}

/// Plans the save's image and sources (under the incremental history now,
/// a kept plan where one fits) and checks its unchanged flags against it.
fn plan(
    state: &DaemonState,
    regions: &HashMap<u32, Arc<Region>>,
    plans: &mut dyn Planner,
    tensors: SaveTensors<'_>,
    blobs: &[Blob],
    mut opts: LayoutOptions,
    unchanged: Option<&Unchanged>,
) -> Result<(Layout, Vec<Source>), SaveError> {
    let history = if opts.incremental { state.history() } else { Default::default() };
    opts.history_gen = history.generation;
    let (layout, sources) = plans.plan(tensors, blobs, regions, opts, history.changed.as_deref())?;
    if let Some(u) = unchanged {
        u.check(layout.specs.len()).map_err(SaveError::BadRequest)?;
    }
    Ok((layout, sources))
}

/// The checks a planned save passes before it is in flight (the daemon
/// drains, the image fits staging, the step is neither committed nor in
/// flight); then registers it in flight, tells the client it started, and
/// checks its regions (ending the flight if one lost its bytes).
fn begin_flight(
    state: &DaemonState,
    replies: &Replies,
    head: Head,
    layout: &Layout,
    sources: &[Source],
    handed_over: bool,
) -> Result<(), SaveError> {
    let Head { step, part, key, .. } = head;
    if state.is_draining() && !handed_over {
        return Err(SaveError::ShuttingDown);
    }
    let image_bytes = layout.staging_len;
    if image_bytes > state.staging.budget_bytes() {
        return Err(SaveError::TooLarge(format!(
            "step {step}: the file image needs {image_bytes} bytes, more than the whole staging budget of {} bytes (raise --staging)",
            state.staging.budget_bytes()
        )));
    }
    // A part of several nodes is committed in the shared directory.
    let commit_dir = if part.is_some() { state.read_dir() } else { state.primary() };
    if catalog::is_committed(commit_dir, step) {
        return Err(SaveError::BadRequest(format!(
            "step {step} is already committed in {}; to save it again, roll back to an earlier step first (rollback in the shim, or ckpt-sidecar rollback DIR --to STEP)",
            commit_dir.display()
        )));
    }
    check_not_below_newest(commit_dir, step)?;
    if !state.begin_step(key, layout.file_bytes()) {
        let what = part.map_or(String::new(), |p| format!(" (rank {} of {})", p.rank, p.world_size));
        return Err(SaveError::BadRequest(format!("step {step}{what} is already in flight")));
    }
    replies.started(head.id, head.t_received, layout.file_bytes());
    check_sizes(regions_of(sources)).inspect_err(|_| state.end(key))
}

/// Staging for the image, and the tensors taken from the resident image
/// rather than the client: the resident image's own lease when they lie
/// where this layout puts them, else a fresh lease (waiting for room;
/// ending the flight when it gives up). Returns the lease, the time waited
/// for it, and what was taken.
fn take_staging(
    state: &DaemonState,
    replies: &Arc<Replies>,
    head: Head,
    layout: &Layout,
    sources: &mut [Source],
    unchanged: Option<&Unchanged>,
    gone: Option<&'static str>,
) -> Result<(Lease, Duration, Option<Taken>), SaveError> {
    let Head { step, part, key, .. } = head;
    let give_up = || state.stop_reason(replies, gone);
    // Tensors the client proves unchanged since a step this session saved
    // are taken from its resident image rather than the client (whole
    // saves: parts are never resident). In place, when they already lie
    // where this layout puts them: the resident image's lease becomes this
    // save's, and their bytes are copied from nowhere.
    let adopted =
        part.is_none().then(|| trusted_unchanged::adopt(&state.staging, replies, layout, unchanged)).flatten();
    let (mut lease, waited, adopted) = match adopted {
        Some((lease, taken)) => (lease, Duration::ZERO, Some(taken)),
        None => match state.staging.acquire(layout.staging_len, &format!("step {step}"), give_up) {
            Ok((lease, waited)) => (lease, waited, None),
            Err(StagingError::GaveUp { why }) => {
                state.end(key);
                warn!("aborted while waiting for staging: {why}");
                return Err(SaveError::Aborted(why));
            }
            Err(e) => {
                state.end(key);
                return Err(SaveError::TooLarge(e.to_string()));
            }
        },
    };
    state.set_phase(key, Phase::Copying);
    // Else copied from the resident image into the lease just taken.
    let in_place = adopted.is_some();
    let taken = adopted.or_else(|| {
        part.is_none()
            .then(|| trusted_unchanged::find(&state.staging, replies, layout, unchanged))
            .flatten()
            .map(|reuse| reuse.fill(layout, &mut lease))
    });
    if let Some(taken) = &taken {
        for i in taken.tensors() {
            sources[i].region = None;
        }
        state.unchanged_taken_bytes.fetch_add(taken.bytes, Ordering::Relaxed);
        if in_place {
            state.unchanged_in_place_bytes.fetch_add(taken.bytes, Ordering::Relaxed);
        }
        info!(
            taken_bytes = taken.bytes,
            in_place, "tensors flagged unchanged taken from the resident image, not copied from the client"
        );
    }
    Ok((lease, waited, taken))
}

/// The rest of a rank's part of one node's group: copied whole into its
/// lease, released, checksummed (during the copy with lazy release, else
/// after the release, off the trainer's stall), then queued for the
/// committer, which waits for the other ranks' parts.
fn run_staged_save(state: &DaemonState, replies: &Arc<Replies>, save: Leased) {
    let Leased { head, layout, sources, mut lease, waited, blobs, lazy_release, span, plan_seconds, gone, taken } =
        save;
    let Head { id, step, part, key, t_received } = head;
    let guard = span.enter();
    let give_up = || state.stop_reason(replies, gone);
    let t_copy = Instant::now();
    let stop = || give_up().is_some();
    // Lazy release: checksums during the copy. Else: the copy alone, and the
    // checksums after the release, off the trainer's stall.
    let copied = if lazy_release {
        copy_and_checksum_into(&layout, &sources, &mut lease, &stop).map(Some)
    } else {
        copy_into(&layout, &sources, &mut lease, &stop).then_some(None)
    };
    let copy_seconds = t_copy.elapsed().as_secs_f64();
    // Released only if every region still held its bytes (one its client
    // truncated during the copy was read as zeros) and the client is still
    // there to be told.
    let intact = check_sizes(regions_of(&sources));
    drop(sources);
    debug_assert!(taken.is_none(), "parts take nothing from the resident image");
    let crcs = match (intact, copied, give_up()) {
        (Ok(()), Some(crcs), None) => crcs,
        (intact, _, why) => {
            let e = intact.err().unwrap_or(SaveError::Aborted(why.unwrap_or("stopped during the copy")));
            drop(lease);
            state.end(key);
            warn!(copy_s = copy_seconds, "aborted before release, nothing written: {e}");
            return refuse(replies, head, e);
        }
    };
    let waited_seconds = waited.as_secs_f64();
    log_if_handed_over_by_gone(replies, gone);
    info!(
        plan_s = plan_seconds,
        copy_s = copy_seconds,
        waited_s = waited_seconds,
        received_s = t_received.elapsed().as_secs_f64(),
        lazy_release,
        gib_per_s = gib_per_s(&layout, copy_seconds),
        "released"
    );
    replies.send(&Reply::Released { id, step, copy_seconds, waited_seconds });
    // From the staged bytes, which only this lease's holder touches now.
    let crcs = match crcs {
        Some(mut sums) => {
            if layout.opts.incremental && sums.digests.is_none() {
                sums.digests = Some(crate::save::checksums::digests(&layout, &mut lease));
            }
            sums
        }
        None => {
            let t_crc = Instant::now();
            let crcs = crate::save::checksums::checksum(&layout, &mut lease);
            info!(crc_s = t_crc.elapsed().as_secs_f64(), "checksummed");
            crcs
        }
    };
    state.set_phase(key, Phase::Queued);
    drop(guard);
    let job = Job {
        id,
        step,
        layout,
        lease,
        crcs: crcs.crcs,
        digests: crcs.digests,
        blobs,
        part,
        replies: replies.clone(),
        span,
        copy_seconds,
        waited_seconds,
        t_received,
        fill: None,
    };
    if let Err(e) = state.commit_tx.send(Work::Checkpoint(job)) {
        // The committer is gone only if the daemon is tearing down.
        let Work::Checkpoint(job) = e.into_inner() else { unreachable!("sent a checkpoint job") };
        state.end(key);
        job.replies.send(&committer_stopped(id, step));
    }
}

/// The Failed of a save whose job could not reach the committer.
fn committer_stopped(id: u64, step: u64) -> Reply {
    Refusal::new(ErrorCode::ShuttingDown, "the committer has stopped").failed(id, step)
}

/// The copy's rate, for the log.
fn gib_per_s(layout: &Layout, copy_seconds: f64) -> f64 {
    layout.tensor_bytes() as f64 / copy_seconds.max(1e-9) / (1u64 << 30) as f64
}

/// Says so when a handed-over save (`gone` None: its client's departure
/// does not stop it) is released to a client already gone: it commits all
/// the same (protocol.md, "Release of handed-over saves").
fn log_if_handed_over_by_gone(replies: &Replies, gone: Option<&'static str>) {
    if gone.is_none() && replies.is_gone() {
        info!("the client is gone, but it handed this save over (every tensor copied at save into a hand-over region): committing it");
    }
}

/// The rest of a whole save, or of a rank's part of several nodes,
/// pipelined: the job goes to the
/// committer before the copy, which then writes each chunk of the image as
/// soon as it is copied ([`FedCopy`], `Store::commit_fed`), so the time to
/// durable is about the disk's alone, not the copy's plus the disk's.
/// Released and Durable mean what they always did: Released once every
/// byte is copied and checked intact (the committer waits for the copy's
/// checksums before its index, and its commit point comes after them);
/// a failed copy makes the committer remove what it wrote and answer
/// Failed (the session does not), so exactly one of Released/Failed comes
/// first and nothing of a failed save is committed.
fn run_fed_save(state: &DaemonState, replies: &Arc<Replies>, save: Leased) {
    let Leased { head, layout, sources, mut lease, waited, blobs, lazy_release, span, gone, taken, .. } = save;
    let Head { id, step, part, key, t_received } = head;
    let guard = span.enter();
    let mut fed = FedCopy::plan(&layout, &sources, &mut lease);
    let fill = Arc::new(Fill::new(fed.progress.clone()));
    // A panic before the copy's end fails it: the committer never waits forever.
    let progress = fed.progress.clone();
    let _filler = Filler(&progress);
    let waited_seconds = waited.as_secs_f64();
    let job = Job {
        id,
        step,
        layout: layout.clone(),
        lease,
        crcs: Vec::new(),
        digests: None,
        blobs,
        part,
        replies: replies.clone(),
        span: span.clone(),
        copy_seconds: 0.0,
        waited_seconds,
        t_received,
        fill: Some(fill.clone()),
    };
    // To the committer: false (the save answered Failed here) when it is gone.
    let hand_over = |job: Job| -> bool {
        let Err(e) = state.commit_tx.send(Work::Checkpoint(job)) else { return true };
        // The committer is gone only if the daemon is tearing down.
        progress.fail("the committer has stopped".into());
        // The lease's drop waits for the copy: none is running now.
        drop(e);
        state.end(key);
        replies.send(&committer_stopped(id, step));
        false
    };
    // Small images are handed over after the copy (config::FED_EARLY_BYTES_MIN).
    let mut unsent = Some(job);
    let fed_early = layout.staging_len >= config::FED_EARLY_BYTES_MIN;
    if fed_early && !hand_over(unsent.take().expect("not sent yet")) {
        return;
    }
    let give_up = || state.stop_reason(replies, gone);
    let t_copy = Instant::now();
    let stop = || give_up().is_some();
    let copied = fed.copy(&layout, lazy_release, fed_early, &stop);
    let copy_seconds = t_copy.elapsed().as_secs_f64();
    let intact = check_sizes(regions_of(&sources));
    drop(sources);
    let crcs = match (intact, copied, give_up()) {
        (Ok(()), Some(crcs), None) => crcs,
        (intact, _, why) => {
            let e = intact.err().unwrap_or(SaveError::Aborted(why.unwrap_or("stopped during the copy")));
            warn!(copy_s = copy_seconds, "aborted before release, nothing committed: {e}");
            let r = Refusal::from(e);
            info!(step, code = ?r.code, "save refused: {}", r.reason);
            // The committer removes what it wrote, ends the flight, answers Failed.
            fill.fail(r);
            if let Some(job) = unsent {
                hand_over(job);
            }
            return;
        }
    };
    // Released before the copy's end is told to the committer: Durable
    // (which waits for it) always comes after. Logged after it is sent:
    // the trainer waits for the reply, not for the log line.
    let received_s = t_received.elapsed().as_secs_f64();
    log_if_handed_over_by_gone(replies, gone);
    replies.send(&Reply::Released { id, step, copy_seconds, waited_seconds });
    info!(
        copy_s = copy_seconds,
        waited_s = waited_seconds,
        received_s,
        lazy_release,
        gib_per_s = gib_per_s(&layout, copy_seconds),
        device_windows = fed.device_windows,
        "released"
    );
    if let Some(job) = unsent {
        if !hand_over(job) {
            return;
        }
    }
    let mut crcs = match crcs {
        Some(sums) => fed.complete(&layout, sums),
        None => {
            let t_crc = Instant::now();
            let crcs = fed.checksum(&layout);
            info!(crc_s = t_crc.elapsed().as_secs_f64(), "checksummed");
            crcs
        }
    };
    if let Some(t) = &taken {
        // Not copied, so not checksummed: their step's checksums and digests.
        t.patch(&mut crcs.crcs, crcs.digests.as_deref_mut());
    }
    drop(guard);
    fill.finish(copy_seconds, crcs);
}
