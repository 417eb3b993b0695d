//! What the sessions hand to the committer ([`Work`]): a copied checkpoint
//! ([`Job`]), a SaveFile's bytes ([`FileJob`]), each holding its staging
//! lease and the replies to answer, or a rollback ([`RollbackJob`]); and the key of the in-flight registry
//! ([`Flight`]).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use ckpt_store::commit::CommitError;
use ckpt_store::image::Layout;
use ckpt_store::progress::Progress;
use ckpt_wire::ErrorCode;

use crate::memory::staging::Lease;
use crate::state::refusal::Refusal;
use crate::state::reply::Replies;

/// What is in flight: a step checkpoint (at most one per step), or one
/// SaveFile (numbered; several may name the same path, the last wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Flight {
    Step(u64),
    File(u64),
    /// One rank's part of a step several ranks save (step, rank).
    Part(u64, u32),
}

impl Flight {
    /// The step of a checkpoint or part; None for a SaveFile.
    pub fn step(self) -> Option<u64> {
        match self {
            Flight::Step(s) | Flight::Part(s, _) => Some(s),
            Flight::File(_) => None,
        }
    }
}

/// Which part of a multi-rank checkpoint a Job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub rank: u32,
    pub world_size: u32,
}

/// What the committer does next, in the order the sessions queued it.
pub enum Work {
    Checkpoint(Job),
    File(FileJob),
    Rollback(RollbackJob),
}

/// A client's Rollback: run by the committer after the work queued before
/// it, so saves sent earlier commit first and are then rolled back too.
pub struct RollbackJob {
    pub id: u64,
    pub step: u64,
    pub replies: Arc<Replies>,
}

/// A SaveFile's bytes, copied, waiting to be written to `path`.
pub struct FileJob {
    pub id: u64,
    pub key: Flight,
    pub path: std::path::PathBuf,
    pub len_bytes: u64,
    /// The bytes at its start, zeroes after them.
    pub lease: Lease,
    pub replies: Arc<Replies>,
    pub span: tracing::Span,
    pub copy_seconds: f64,
    pub waited_seconds: f64,
    pub t_received: Instant,
}

/// A save's tensor checksums and, for an incremental layout
/// (`LayoutOptions::incremental`), digests (`ckpt_store::digest`), in the
/// layout's order.
pub struct Sums {
    pub crcs: Vec<u32>,
    pub digests: Option<Vec<u128>>,
}

/// A save whose image the session is still copying while the committer
/// writes it: the copy's [`Progress`], and how it ended (set before the
/// progress ends, so the committer reads it once `progress.outcome()` returned).
pub struct Fill {
    pub progress: Arc<Progress>,
    end: Mutex<Option<FillEnd>>,
}

/// How a fed copy ended.
#[derive(Clone)]
pub enum FillEnd {
    /// Released; the copy took this long.
    Copied { copy_seconds: f64 },
    /// Not released: the committer answers Failed with this (the session
    /// does not), once it removed what it wrote and ended the flight.
    Failed(Refusal),
}

impl Fill {
    pub fn new(progress: Arc<Progress>) -> Fill {
        Fill { progress, end: Mutex::new(None) }
    }

    /// The copy and its checksums (and digests, incremental) are done
    /// (after Released was sent).
    pub fn finish(&self, copy_seconds: f64, sums: Sums) {
        *self.end.lock().expect("fill lock") = Some(FillEnd::Copied { copy_seconds });
        match sums.digests {
            Some(d) => self.progress.finish_with_digests(sums.crcs, d),
            None => self.progress.finish(sums.crcs),
        }
    }

    /// The copy failed; nothing was released.
    pub fn fail(&self, r: Refusal) {
        let reason = r.reason.clone();
        *self.end.lock().expect("fill lock") = Some(FillEnd::Failed(r));
        self.progress.fail(reason);
    }

    /// Waits for the copy's end and says how it ended.
    pub fn end(&self) -> FillEnd {
        let _ = self.progress.outcome();
        self.end
            .lock()
            .expect("fill lock")
            .clone()
            .unwrap_or(FillEnd::Failed(Refusal::new(ErrorCode::Io, "the copy ended without finishing")))
    }
}

/// What a job that failed is answered with: a fed copy's own failure when
/// its copy failed (the session does not answer it), else `r`. Waits for
/// the copy's end (called with the lease dropped, it has ended).
pub fn copy_failure_or(fill: Option<&Arc<Fill>>, r: Refusal) -> Refusal {
    match fill.map(|f| f.end()) {
        Some(FillEnd::Failed(own)) => own,
        _ => r,
    }
}

/// A checkpoint waiting to be written: copied, or (with `fill`) still
/// being copied.
pub struct Job {
    pub id: u64,
    pub step: u64,
    /// Planned at base 0 (offsets relative to the lease).
    pub layout: Layout,
    pub lease: Lease,
    pub crcs: Vec<u32>,
    /// Each tensor's digest (an incremental layout's copy; with `fill`, the
    /// progress has them instead).
    pub digests: Option<Vec<u128>>,
    pub blobs: Vec<ckpt_wire::Blob>,
    /// Some: one rank's part; the committer waits for the others (coordinator).
    pub part: Option<Part>,
    pub replies: Arc<Replies>,
    /// The checkpoint's span (step, bytes), entered around its phases.
    pub span: tracing::Span,
    pub copy_seconds: f64,
    pub waited_seconds: f64,
    pub t_received: Instant,
    /// Some: the session is still copying into `lease` (`crcs` and
    /// `copy_seconds` come from it); the lease's drop waits for the copy.
    pub fill: Option<Arc<Fill>>,
}

impl Job {
    /// Its key in the in-flight registry.
    pub fn key(&self) -> Flight {
        match self.part {
            Some(p) => Flight::Part(self.step, p.rank),
            None => Flight::Step(self.step),
        }
    }
}

impl From<&CommitError> for Refusal {
    fn from(e: &CommitError) -> Refusal {
        Refusal::new(error_code(e), e.to_string())
    }
}

/// The wire's code for a commit that failed (the committer's and the
/// several-node path's replies).
pub fn error_code(e: &CommitError) -> ErrorCode {
    match e {
        CommitError::DiskFull { .. } | CommitError::Io { .. } => ErrorCode::Io,
        CommitError::AlreadyCommitted { .. } | CommitError::Format(_) => ErrorCode::BadRequest,
        CommitError::Aborted { .. } => ErrorCode::ShuttingDown,
        CommitError::Unfilled { .. } => ErrorCode::Io,
        CommitError::PartsDisagree { .. } => ErrorCode::BadRequest,
        CommitError::DirReplaced { .. } | CommitError::ReadOnly(_) => ErrorCode::Io,
    }
}
