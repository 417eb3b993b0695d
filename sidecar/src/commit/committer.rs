//! The committer: one thread (`ckpt-commit`) that owns the [`Store`] and
//! commits checkpoint images from staging in the order it receives them
//! (a bounded queue), replying Durable or Failed to the session that saved
//! each one, and keeping the newest durable image resident in staging.
//!
//! Invariants: only this thread writes checkpoints; a job's staging lease is
//! held until its commit returned (then it becomes the resident image or is
//! freed); a failed commit leaves earlier checkpoints as they were (the
//! Store removes its temp folders) and the thread goes on with the next job.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use ckpt_wire::{Blob, ErrorCode, LastFigures, Reply};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use tracing::{info, warn};

use crate::commit::nodes::Nodes;
use crate::commit::rank_groups::{Expired, Offer, RankGroups};
use crate::commit::slices;
use crate::config;
use crate::memory::staging::{Lease, Resident};
use crate::save::checks::check_not_below_newest;
use crate::state::jobs::{copy_failure_or, FileJob, Fill, FillEnd, Flight, Job, RollbackJob, Work};
use crate::state::refusal::Refusal;
use crate::state::reply::Replies;
use crate::state::{DaemonState, Phase};
use ckpt_store::commit::{CommitError, CommitReport, Store};
use ckpt_store::image::{self, Layout};
use ckpt_store::ranks::Merged;
use ckpt_store::rollback::RollbackError;

pub fn spawn(mut store: Store, rx: Receiver<Work>, state: Arc<DaemonState>) -> JoinHandle<()> {
    store.set_abort_flag(state.aborting.clone());
    std::thread::Builder::new()
        .name("ckpt-commit".into())
        .spawn(move || {
            let mut groups = RankGroups::new(part_timeout());
            // The last group committed, for the next step of the same plans.
            let mut kept: Option<KeptGroup> = None;
            // Several nodes: parts go to the shared directory, not to `groups`.
            let mut nodes = store.shared_dir().is_some().then(|| Nodes::new(part_timeout()));
            loop {
                let tick = Instant::now() + std::time::Duration::from_millis(config::PART_TICK_MS);
                let deadline = groups.next_deadline().map_or(tick, |d| d.min(tick));
                let deadline = nodes.as_ref().and_then(Nodes::next_look).map_or(deadline, |d| d.min(deadline));
                // The peers' doorbells first: each is small work that may
                // end a wait (several nodes, `commit::nodes`).
                let never = crossbeam_channel::never();
                let inbox = state.peers.as_ref().map(|p| p.inbox());
                let bells = inbox.map_or(&never, |i| i.receiver());
                let work = crossbeam_channel::select_biased! {
                    recv(bells) -> rang => {
                        let rang = rang.expect("the inbox holds its own sender");
                        if let Some(i) = inbox {
                            i.took(&rang);
                        }
                        if let Some(n) = nodes.as_mut() {
                            n.rang(&mut store, &state, rang);
                        }
                        // Nothing more to take: the loop's looks and expiries follow.
                        Err(RecvTimeoutError::Timeout)
                    },
                    recv(rx) -> w => w.map_err(|_| RecvTimeoutError::Disconnected),
                    default(deadline.saturating_duration_since(Instant::now())) => Err(RecvTimeoutError::Timeout),
                };
                if matches!(work, Ok(Work::Checkpoint(_))) {
                    crate::state::test_panic::maybe_panic(crate::state::test_panic::At::Commit);
                }
                match work {
                    Ok(Work::Checkpoint(job)) if job.part.is_some() => match nodes.as_mut() {
                        Some(n) => n.offer(&mut store, &state, job),
                        None => gather(&mut store, &state, &mut groups, &mut kept, job),
                    },
                    Ok(Work::Checkpoint(job)) => commit_one(&mut store, &state, job),
                    Ok(Work::File(job)) => write_one(&mut store, &state, job),
                    Ok(Work::Rollback(job)) => rollback_one(&mut store, &state, job),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => {
                        if let Some(n) = nodes.as_mut() {
                            n.fail_all(&store, &state, "the sidecar stopped before the step was committed");
                        }
                        for job in groups.take_all() {
                            fail_part(&state, job, Refusal::new(ErrorCode::ShuttingDown, "the sidecar stopped before every rank's part arrived"));
                        }
                        break;
                    }
                }
                // A step the drain held past --keep is replicated (or gone).
                if state.drain.as_ref().is_some_and(|d| d.take_retention_due()) {
                    let deleted = store.retain();
                    if !deleted.is_empty() {
                        info!(?deleted, "retention (steps the drain held are replicated)");
                    }
                }
                // Draining, no new part is accepted: an incomplete group never completes.
                if state.is_aborting() || state.is_draining() {
                    for job in groups.take_all() {
                        let why = format!("step {}: the sidecar is shutting down before every rank's part arrived; the step is not committed", job.step);
                        warn!("rank {:?}: {why}", job.part.map(|p| p.rank));
                        fail_part(&state, job, Refusal::new(ErrorCode::ShuttingDown, why));
                    }
                }
                if let Some(n) = nodes.as_mut().filter(|n| n.has_waiting()) {
                    n.tick(&mut store, &state);
                }
                if let Some(n) = &nodes {
                    let now = n.coordinating();
                    let mut c = state.coordinating.lock().expect("coordinating lock");
                    if *c != now {
                        *c = now;
                    }
                }
                for Expired { step, world_size, missing, sent_earlier, parts } in groups.expire(Instant::now()) {
                    // A rank that resumed after the timeout is alone in a new
                    // attempt: the others did send, to the one given up.
                    let earlier = if sent_earlier.is_empty() {
                        String::new()
                    } else {
                        format!(" (rank(s) {sent_earlier:?} sent theirs to an earlier attempt of this step, given up at the part timeout: every rank must save the step again)")
                    };
                    let why = format!(
                        "step {step}: rank(s) {missing:?} of {world_size} sent no released part within {} s{earlier}; the step is not committed",
                        groups.timeout().as_secs_f64()
                    );
                    warn!("{why}");
                    for job in parts {
                        fail_part(&state, job, Refusal::new(ErrorCode::Io, why.clone()));
                    }
                }
            }
        })
        .expect("spawning the committer thread")
}

/// The part timeout (`CKPT_SIDECAR_PART_TIMEOUT_S`, else the default);
/// checked at the daemon's start ([`check_part_timeout`]), so an invalid
/// value never silently means the default.
pub fn part_timeout() -> std::time::Duration {
    check_part_timeout().unwrap_or(std::time::Duration::from_secs(config::PART_TIMEOUT_DEFAULT_S))
}

/// The part timeout the environment asks for, or why its value is refused.
pub fn check_part_timeout() -> Result<std::time::Duration, String> {
    let default = std::time::Duration::from_secs(config::PART_TIMEOUT_DEFAULT_S);
    // Unset or empty: the default.
    let Some(raw) = std::env::var_os(config::PART_TIMEOUT_ENV).filter(|v| !v.is_empty()) else { return Ok(default) };
    let text = raw.to_string_lossy();
    match text.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s <= config::PART_TIMEOUT_MAX_S as f64 => {
            Ok(std::time::Duration::from_secs_f64(s))
        }
        _ => Err(format!(
            "{}={text:?}: not a number of seconds above 0 and at most {} (unset: {} s)",
            config::PART_TIMEOUT_ENV,
            config::PART_TIMEOUT_MAX_S,
            config::PART_TIMEOUT_DEFAULT_S
        )),
    }
}

/// Frees one part's lease, ends its flight, then answers it Failed (so a
/// client that saves the step again at once does not find it in flight).
fn fail_part(state: &DaemonState, job: Job, r: Refusal) {
    let key = job.key();
    drop(job.lease);
    // A fed part whose copy failed: its own reason (its copy has ended, the lease is back).
    let r = copy_failure_or(job.fill.as_ref(), r);
    state.end(key);
    job.replies.send(&r.failed(job.id, job.step));
}

/// One rank's part: kept until its step's group is complete, then the
/// whole group is committed as one checkpoint.
fn gather(store: &mut Store, state: &DaemonState, groups: &mut RankGroups, kept: &mut Option<KeptGroup>, job: Job) {
    state.set_phase(job.key(), Phase::WaitingForRanks);
    match groups.offer(job) {
        Offer::Pending => {}
        Offer::Refused(job, why) => {
            warn!("{why}");
            fail_part(state, *job, Refusal::new(ErrorCode::BadRequest, why));
        }
        Offer::Complete(parts) => commit_group(store, state, kept, parts),
    }
}

/// Commits every rank's part of one step as one checkpoint; Durable (or
/// Failed) goes to every rank's session. `kept` is the previous group:
/// its merge and its check are used again when the parts are the same
/// (replaced by this group otherwise).
fn commit_group(store: &mut Store, state: &DaemonState, kept: &mut Option<KeptGroup>, parts: Vec<Job>) {
    let step = parts[0].step;
    if state.is_aborting() {
        for job in parts {
            let reason = format!("step {step}: aborted before writing; the sidecar is shutting down");
            fail_part(state, job, Refusal::new(ErrorCode::ShuttingDown, reason));
        }
        return;
    }
    if let Err(e) = check_not_below_newest(state.primary(), step) {
        warn!(step, "not committed: {e}");
        let r = Refusal::from(e);
        for job in parts {
            fail_part(state, job, r.clone());
        }
        return;
    }
    for j in &parts {
        state.set_phase(j.key(), Phase::Writing);
    }
    let world_size = parts.len();
    let decls = match declared_slices(&parts) {
        Ok(d) => d,
        Err(why) => {
            warn!(step, "{why}");
            for job in parts {
                fail_part(state, job, Refusal::new(ErrorCode::BadRequest, format!("step {step}: {why}")));
            }
            return;
        }
    };
    let plans: Vec<&Layout> = parts.iter().map(|j| &j.layout).collect();
    let skeletons = Skeletons::of(&parts);
    let again = kept.take().filter(|k| k.merged.is_of(&plans, &decls) && k.skeletons == skeletons);
    if let Some(why) = again.is_none().then(|| disagreement(&parts, &decls)).flatten() {
        let e = CommitError::PartsDisagree { step, why };
        warn!(step, world_size, "{e}");
        for job in parts {
            fail_part(state, job, Refusal::from(&e));
        }
        return;
    }
    let mut crcs = Vec::new();
    // Incremental parts: every part's digests, in the merged order.
    let mut digests: Option<Vec<u128>> = parts.iter().all(|j| j.digests.is_some()).then(Vec::new);
    let mut blobs = Vec::new();
    for j in &parts {
        crcs.extend_from_slice(&j.crcs);
        if let (Some(d), Some(jd)) = (digests.as_mut(), j.digests.as_ref()) {
            d.extend_from_slice(jd);
        }
        blobs.extend(
            j.blobs
                .iter()
                .filter(|b| !slices::is_declaration(b))
                .map(|b| image::Blob { name: &b.name, bytes: &b.bytes }),
        );
    }
    let t0 = Instant::now();
    let bases: Vec<u64> = parts.iter().map(|j| j.lease.offset_bytes()).collect();
    let merged_again = again.is_some();
    let group = match again {
        Some(k) => Ok(k),
        None => Merged::new(plans.into_iter().cloned().collect(), decls)
            .map(|merged| KeptGroup { merged, skeletons: skeletons.owned() }),
    };
    let r = group.map_err(CommitError::from).and_then(|k| {
        let merged = kept.insert(k).merged.placed(&bases);
        let digests = digests.as_deref().filter(|_| merged.opts.incremental);
        if digests.is_some() {
            crate::commit::full_every::before_commit(store, state);
        }
        // Retention follows the answers (below).
        store.commit_unretained(step, &merged, parts[0].lease.staging_buf(), &crcs, digests, &blobs)
    });
    if r.is_ok() {
        crate::commit::full_every::after_commit(store, state);
    }
    drop(blobs);
    let persist_seconds = t0.elapsed().as_secs_f64();
    match r {
        Ok(rep) => {
            let gib_per_s = rep.bytes as f64 / persist_seconds.max(1e-9) / (1u64 << 30) as f64;
            info!(
                step,
                world_size,
                persist_s = persist_seconds,
                gib_per_s,
                merged_again,
                "durable (every rank's part)"
            );
            let copy_seconds = parts.iter().map(|j| j.copy_seconds).fold(0.0, f64::max);
            state.set_last(LastFigures {
                step,
                bytes: rep.bytes,
                copy_seconds,
                persist_seconds,
                persist_gib_per_s: gib_per_s,
            });
            let path = rep.path.display().to_string();
            let mut keys = Vec::with_capacity(parts.len());
            for job in parts {
                keys.push(job.key());
                drop(job.lease);
                job.replies.send(&Reply::Durable { id: job.id, step, path: path.clone(), persist_seconds });
            }
            if let Some(d) = &state.drain {
                d.committed(step);
            }
            // Deletions after Durable, as for one rank's step (answer_durable).
            retain_answered(store);
            for key in keys {
                state.end(key);
            }
        }
        Err(e) => {
            warn!(step, world_size, "commit of every rank's part failed: {e}");
            for job in parts {
                fail_part(state, job, Refusal::from(&e));
            }
        }
    }
}

/// A group of parts committed, kept for the next step's: ranks that save
/// the same structures every step (kept save plans) send the same parts
/// in other leases, whose merge ([`Merged::placed`]) and check
/// ([`disagreement`]) need not be made again: at 10k tensors per rank
/// they cost tens of milliseconds per step (docs/performance.md).
struct KeptGroup {
    merged: Merged,
    /// The skeletons the parts were checked with, by rank.
    skeletons: Skeletons<'static>,
}

/// What [`disagreement`] reads of each part besides its tensors (its
/// plan's): the skeleton, and whether it has a parts map. By rank.
#[derive(PartialEq, Eq)]
struct Skeletons<'a>(Vec<(Option<std::borrow::Cow<'a, [u8]>>, bool)>);

impl<'a> Skeletons<'a> {
    fn of(parts: &'a [Job]) -> Skeletons<'a> {
        use ckpt_store::skeleton::{PARTS_BLOB, STRUCTURE_BLOB};
        let blob = |j: &'a Job, name: &str| j.blobs.iter().find(|b| b.name == name).map(|b| &b.bytes[..]);
        Skeletons(
            parts.iter().map(|j| (blob(j, STRUCTURE_BLOB).map(Into::into), blob(j, PARTS_BLOB).is_some())).collect(),
        )
    }

    fn owned(&self) -> Skeletons<'static> {
        Skeletons(self.0.iter().map(|(s, m)| (s.as_ref().map(|s| s.to_vec().into()), *m)).collect())
    }
}

/// Whether the parts make a step that does not load (ranks that saved
/// different states under one step): one line saying so.
fn disagreement(parts: &[Job], decls: &[image::SliceDecl]) -> Option<String> {
    use ckpt_store::skeleton::{self, RankPart};
    let ranks: Vec<RankPart<'_>> = parts
        .iter()
        .map(|j| RankPart {
            rank: j.part.map_or(0, |p| p.rank),
            tensors: j.layout.specs.iter().map(|s| s.name.as_str()).collect(),
            structure: j.blobs.iter().find(|b| b.name == skeleton::STRUCTURE_BLOB).map(|b| &b.bytes[..]),
            parts_map: j.blobs.iter().any(|b| b.name == skeleton::PARTS_BLOB),
        })
        .collect();
    let slices: Vec<(&str, &str)> = decls.iter().map(|d| (d.piece.as_str(), d.of.as_str())).collect();
    skeleton::parts_disagree(&ranks, &slices)
}

/// Every rank's slice declarations (the parts' `ckpt.slices.json` blobs).
fn declared_slices(parts: &[Job]) -> Result<Vec<image::SliceDecl>, String> {
    let mut out = Vec::new();
    for j in parts {
        out.extend(slices::declared(j.part.map_or(0, |p| p.rank), &j.layout, &j.blobs)?);
    }
    Ok(out)
}

fn commit_one(store: &mut Store, state: &DaemonState, job: Job) {
    let Job {
        id,
        step,
        layout,
        lease,
        crcs,
        digests,
        blobs,
        part: _,
        replies,
        span,
        copy_seconds,
        waited_seconds,
        t_received,
        fill,
    } = job;
    let _enter = span.enter();
    // A fed job whose copy failed is answered with the copy's reason, once
    // its lease is back (the lease's drop waits for the copy's end).
    let failed = |lease, r: Refusal| {
        drop(lease);
        let r = copy_failure_or(fill.as_ref(), r);
        replies.send(&r.failed(id, step));
        state.end(Flight::Step(step));
    };
    if state.is_aborting() {
        warn!("aborted before writing (the sidecar is aborting)");
        let reason = format!("step {step}: aborted before writing; the sidecar is shutting down");
        return failed(lease, Refusal::new(ErrorCode::ShuttingDown, reason));
    }
    // A newer step committed while this one was copied or queued.
    if let Err(e) = check_not_below_newest(state.primary(), step) {
        warn!("not committed: {e}");
        return failed(lease, Refusal::from(e));
    }
    state.set_phase(Flight::Step(step), Phase::Writing);
    let bytes = StepBytes {
        layout: &layout,
        lease: &lease,
        crcs: &crcs,
        digests: digests.as_deref(),
        blobs: &blobs,
        fill: fill.as_deref(),
    };
    let (t0, persist_seconds, r) = persist(store, state, step, &bytes);
    let queued = (t0 - t_received).as_secs_f64() - waited_seconds - if fill.is_some() { 0.0 } else { copy_seconds };
    let (copy_seconds, crcs, digests) = fed_figures(fill.as_deref(), &r, copy_seconds, crcs, digests);
    match r {
        Ok(rep) => {
            let seconds = StepSeconds { waited: waited_seconds, copy: copy_seconds, queued, persist: persist_seconds };
            let resident = Resident { step, layout, crcs, digests, blobs, lease, origin: replies.origin() };
            answer_durable(store, state, id, &rep, &seconds, resident, &replies);
        }
        Err(e) => {
            warn!(persist_s = persist_seconds, "commit failed: {e}");
            failed(lease, Refusal::from(&e));
        }
    }
}

/// A step's image in staging, as the committer writes it.
struct StepBytes<'a> {
    layout: &'a Layout,
    lease: &'a Lease,
    crcs: &'a [u32],
    digests: Option<&'a [u128]>,
    blobs: &'a [Blob],
    fill: Option<&'a Fill>,
}

/// Writes and commits a step (the `--full-every` bookkeeping around an
/// incremental one); returns when the write began, the seconds it took to
/// make the step durable, and the store's report.
fn persist(
    store: &mut Store,
    state: &DaemonState,
    step: u64,
    b: &StepBytes<'_>,
) -> (Instant, f64, Result<CommitReport, CommitError>) {
    let mut placed = b.layout.clone();
    placed.rebase(b.lease.offset_bytes());
    let blob_refs: Vec<image::Blob> = b.blobs.iter().map(|b| image::Blob { name: &b.name, bytes: &b.bytes }).collect();
    let t0 = Instant::now();
    if placed.opts.incremental {
        crate::commit::full_every::before_commit(store, state);
    }
    // Retention follows the answer (answer_durable).
    let r = match b.fill {
        None => store.commit_unretained(step, &placed, b.lease.staging_buf(), b.crcs, b.digests, &blob_refs),
        Some(f) => store.commit_fed(step, &placed, b.lease.staging_buf(), &f.progress, &blob_refs),
    };
    if r.is_ok() {
        crate::commit::full_every::after_commit(store, state);
    }
    (t0, t0.elapsed().as_secs_f64(), r)
}

/// A fed job's copy figures and checksums, from its fill once the commit
/// succeeded: its copy ended before the commit point. Otherwise the job's own.
fn fed_figures(
    fill: Option<&Fill>,
    r: &Result<CommitReport, CommitError>,
    copy_seconds: f64,
    crcs: Vec<u32>,
    digests: Option<Vec<u128>>,
) -> (f64, Vec<u32>, Option<Vec<u128>>) {
    match (fill, r) {
        (Some(f), Ok(_)) => match (f.end(), f.progress.outcome()) {
            (FillEnd::Copied { copy_seconds }, Ok(crcs)) => (copy_seconds, crcs, f.progress.digests()),
            _ => unreachable!("a fed commit succeeds only after its copy finished"),
        },
        _ => (copy_seconds, crcs, digests),
    }
}

/// The phases of a durable step, in seconds, for its log line.
struct StepSeconds {
    waited: f64,
    copy: f64,
    queued: f64,
    persist: f64,
}

/// Logs a durable step, keeps it resident, replies Durable, then applies
/// retention; the flight ends last (a draining daemon exits once it has).
fn answer_durable(
    store: &mut Store,
    state: &DaemonState,
    id: u64,
    rep: &CommitReport,
    s: &StepSeconds,
    resident: Resident,
    replies: &Replies,
) {
    let step = resident.step;
    let gib_per_s = rep.bytes as f64 / s.persist.max(1e-9) / (1u64 << 30) as f64;
    info!(
        waited_s = s.waited,
        copy_s = s.copy,
        queued_s = s.queued.max(0.0),
        write_s = rep.write.as_secs_f64(),
        sync_s = rep.sync.as_secs_f64(),
        commit_s = rep.commit.as_secs_f64(),
        persist_s = s.persist,
        gib_per_s,
        "durable"
    );
    let last = LastFigures {
        step,
        bytes: rep.bytes,
        copy_seconds: s.copy,
        persist_seconds: s.persist,
        persist_gib_per_s: gib_per_s,
    };
    state.set_last(last);
    // Resident first: a Load sent the moment Durable arrives is served from RAM.
    state.staging.offer_resident(resident);
    let persist_seconds = s.persist;
    replies.send(&Reply::Durable { id, step, path: rep.path.display().to_string(), persist_seconds });
    if let Some(d) = &state.drain {
        d.committed(step);
    }
    // Deletions after Durable: nobody waits for them, but the flight
    // ends after them (a draining daemon exits once they are done).
    retain_answered(store);
    state.end(Flight::Step(step));
}

/// Retention once a step's waiters are answered (`Store::
/// commit_unretained` left it out of the commit), logged when it deleted.
fn retain_answered(store: &mut Store) {
    let t_retain = Instant::now();
    let deleted = store.retain();
    if !deleted.is_empty() {
        info!(?deleted, retain_s = t_retain.elapsed().as_secs_f64(), "retention");
    }
}

impl From<&RollbackError> for Refusal {
    fn from(e: &RollbackError) -> Refusal {
        let code = match e {
            RollbackError::NotCommitted { .. } => ErrorCode::NotFound,
            RollbackError::Unreadable(_) | RollbackError::Incomplete { .. } | RollbackError::Damaged { .. } => {
                ErrorCode::Damaged
            }
            RollbackError::Io { .. } | RollbackError::Refused { .. } => ErrorCode::Io,
        };
        Refusal::new(code, e.to_string())
    }
}

/// Rolls the store back; a resident image of a rolled-back step is dropped
/// first, so no Load serves it from RAM afterwards.
fn rollback_one(store: &mut Store, state: &DaemonState, job: RollbackJob) {
    let RollbackJob { id, step, replies } = job;
    if state.is_aborting() {
        let reason = format!("rollback to step {step}: not done, the sidecar is shutting down");
        replies.send(&Refusal::new(ErrorCode::ShuttingDown, reason).error(id));
        return;
    }
    state.staging.drop_resident_after(step);
    match store.rollback(step) {
        Ok(removed) => {
            info!(step, ?removed, "rolled back");
            replies.send(&Reply::RolledBack { id, step, removed });
        }
        Err(e) => {
            warn!(step, "rollback failed: {e}");
            replies.send(&Refusal::from(&e).error(id));
        }
    }
}

fn write_one(store: &mut Store, state: &DaemonState, job: FileJob) {
    let FileJob { id, key, path, len_bytes, lease, replies, span, copy_seconds, waited_seconds, t_received } = job;
    let _enter = span.enter();
    state.set_phase(key, Phase::Writing);
    let queued_s = t_received.elapsed().as_secs_f64() - copy_seconds - waited_seconds;
    let t0 = Instant::now();
    let r = store.write_file(&path, lease.staging_buf(), lease.offset_bytes(), len_bytes);
    let persist_seconds = t0.elapsed().as_secs_f64();
    drop(lease);
    match r {
        Ok(rep) => {
            info!(
                copy_s = copy_seconds,
                queued_s = queued_s.max(0.0),
                write_s = rep.write.as_secs_f64(),
                sync_s = rep.sync.as_secs_f64(),
                direct = rep.direct,
                "file durable"
            );
            replies.send(&Reply::Durable { id, step: 0, path: path.display().to_string(), persist_seconds });
        }
        Err(e) => {
            warn!(persist_s = persist_seconds, "file write failed: {e}");
            replies.send(&Refusal::from(&e).failed(id, 0));
        }
    }
    state.end(key);
}
