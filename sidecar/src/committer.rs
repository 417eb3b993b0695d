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

use ckpt_wire::{ErrorCode, LastFigures, Reply};
use crossbeam_channel::Receiver;
use tracing::{info, warn};

use ckpt_store::commit::{CommitError, Store};
use ckpt_store::rollback::RollbackError;
use ckpt_store::image::{self};
use crate::staging::Resident;
use crate::jobs::{FileJob, Flight, Job, RollbackJob, Work};
use crate::state::{Phase, Shared};

fn error_code(e: &CommitError) -> ErrorCode {
    match e {
        CommitError::DiskFull { .. } | CommitError::Io { .. } => ErrorCode::Io,
        CommitError::AlreadyCommitted { .. } | CommitError::Format(_) => ErrorCode::BadRequest,
        CommitError::Aborted { .. } => ErrorCode::ShuttingDown,
    }
}

pub fn spawn(mut store: Store, rx: Receiver<Work>, shared: Arc<Shared>) -> JoinHandle<()> {
    store.set_abort_flag(shared.aborting.clone());
    std::thread::Builder::new()
        .name("ckpt-commit".into())
        .spawn(move || {
            for work in rx {
                match work {
                    Work::Checkpoint(job) => commit_one(&mut store, &shared, job),
                    Work::File(job) => write_one(&mut store, &shared, job),
                    Work::Rollback(job) => rollback_one(&mut store, &shared, job),
                }
            }
        })
        .expect("spawning the committer thread")
}

fn commit_one(store: &mut Store, shared: &Shared, job: Job) {
    let Job { id, step, layout, lease, crcs, blobs, peer, span, copy_seconds, waited_seconds, t_received } = job;
    let _enter = span.enter();
    if shared.is_aborting() {
        warn!("aborted before writing (the sidecar is aborting)");
        peer.send(&Reply::Failed { id, step, code: ErrorCode::ShuttingDown, reason: format!("step {step}: aborted before writing; the sidecar is shutting down") });
        drop(lease);
        shared.end(Flight::Step(step));
        return;
    }
    shared.set_phase(Flight::Step(step), Phase::Writing);
    let queued_s = t_received.elapsed().as_secs_f64() - copy_seconds - waited_seconds;
    let mut placed = layout.clone();
    placed.rebase(lease.offset_bytes());
    let blob_refs: Vec<image::Blob> = blobs.iter().map(|b| image::Blob { name: &b.name, bytes: &b.bytes }).collect();
    let t0 = Instant::now();
    let r = store.commit(step, &placed, lease.staging_buf(), &crcs, &blob_refs);
    let persist_seconds = t0.elapsed().as_secs_f64();
    match r {
        Ok(rep) => {
            let gib_per_s = rep.bytes as f64 / persist_seconds.max(1e-9) / (1u64 << 30) as f64;
            info!(
                waited_s = waited_seconds,
                copy_s = copy_seconds,
                queued_s = queued_s.max(0.0),
                write_s = rep.write.as_secs_f64(),
                sync_s = rep.sync.as_secs_f64(),
                commit_s = rep.commit.as_secs_f64(),
                persist_s = persist_seconds,
                gib_per_s,
                "durable"
            );
            shared.set_last(LastFigures { step, bytes: rep.bytes, copy_seconds, persist_seconds, persist_gib_per_s: gib_per_s });
            // Resident first: a Load sent the moment Durable arrives is served from RAM.
            shared.staging.offer_resident(Resident { step, layout, crcs, blobs, lease });
            peer.send(&Reply::Durable { id, step, path: rep.path.display().to_string(), persist_seconds });
        }
        Err(e) => {
            warn!(persist_s = persist_seconds, "commit failed: {e}");
            peer.send(&Reply::Failed { id, step, code: error_code(&e), reason: e.to_string() });
            drop(lease);
        }
    }
    shared.end(Flight::Step(step));
}

/// Rolls the store back; a resident image of a rolled-back step is dropped
/// first, so no Load serves it from RAM afterwards.
fn rollback_one(store: &mut Store, shared: &Shared, job: RollbackJob) {
    let RollbackJob { id, step, peer } = job;
    if shared.is_aborting() {
        peer.send(&Reply::Error { id, code: ErrorCode::ShuttingDown, message: format!("rollback to step {step}: not done, the sidecar is shutting down") });
        return;
    }
    shared.staging.drop_resident_after(step);
    match store.rollback(step) {
        Ok(removed) => {
            info!(step, ?removed, "rolled back");
            peer.send(&Reply::RolledBack { id, step, removed });
        }
        Err(e) => {
            warn!(step, "rollback failed: {e}");
            let code = match e {
                RollbackError::NotCommitted { .. } => ErrorCode::NotFound,
                RollbackError::Io { .. } => ErrorCode::Io,
            };
            peer.send(&Reply::Error { id, code, message: e.to_string() });
        }
    }
}

fn write_one(store: &mut Store, shared: &Shared, job: FileJob) {
    let FileJob { id, key, path, len_bytes, lease, peer, span, copy_seconds, waited_seconds, t_received } = job;
    let _enter = span.enter();
    shared.set_phase(key, Phase::Writing);
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
            peer.send(&Reply::Durable { id, step: 0, path: path.display().to_string(), persist_seconds });
        }
        Err(e) => {
            warn!(persist_s = persist_seconds, "file write failed: {e}");
            peer.send(&Reply::Failed { id, step: 0, code: error_code(&e), reason: e.to_string() });
        }
    }
    shared.end(key);
}
