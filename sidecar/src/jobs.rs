//! What the sessions hand to the committer ([`Work`]): a copied checkpoint
//! ([`Job`]), a SaveFile's bytes ([`FileJob`]), each holding its staging
//! lease and the peer to answer, or a rollback ([`RollbackJob`]); and the key of the in-flight registry
//! ([`Flight`]).

use std::sync::Arc;
use std::time::Instant;

use ckpt_store::image::Layout;

use crate::peer::Peer;
use crate::staging::Lease;

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
    pub peer: Arc<Peer>,
}

/// A SaveFile's bytes, copied, waiting to be written to `path`.
pub struct FileJob {
    pub id: u64,
    pub key: Flight,
    pub path: std::path::PathBuf,
    pub len_bytes: u64,
    /// The bytes at its start, zeroes after them.
    pub lease: Lease,
    pub peer: Arc<Peer>,
    pub span: tracing::Span,
    pub copy_seconds: f64,
    pub waited_seconds: f64,
    pub t_received: Instant,
}

/// A copied checkpoint waiting to be written.
pub struct Job {
    pub id: u64,
    pub step: u64,
    /// Planned at base 0 (offsets relative to the lease).
    pub layout: Layout,
    pub lease: Lease,
    pub crcs: Vec<u32>,
    pub blobs: Vec<ckpt_wire::Blob>,
    /// Some: one rank's part; the committer waits for the others (coordinator).
    pub part: Option<Part>,
    pub peer: Arc<Peer>,
    /// The checkpoint's span (step, bytes), entered around its phases.
    pub span: tracing::Span,
    pub copy_seconds: f64,
    pub waited_seconds: f64,
    pub t_received: Instant,
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

