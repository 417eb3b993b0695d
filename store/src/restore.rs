//! Reading checkpoints back: load (every shard into memory, verified) and
//! verify (every byte checked, one shard in memory at a time).
//!
//! Invariants:
//! - nothing read is handed out before its checksum matched: a load either
//!   returns a checkpoint whose every tensor and blob matched the index, or
//!   an error naming each file and tensor that did not;
//! - only committed checkpoints are read; `latest` with a bad checkpoint
//!   falls back to the newest good one and says which it skipped and why.
//!
//! Files: `locate` (the steps to try, an index, the folder of each file),
//! `load` (the public loads and what they return), `read_step` (one step
//! read by a thread per folder), `read_dir` (one folder's files through one
//! engine), `check` (every byte checked as it streams by), `kept` (the
//! index of a too-small load, for its retry), `quick` (the
//! cheap checks of `ls`: files present, sizes), `verify`,
//! `fetched` (files fetched from a drain target).

mod check;
pub(crate) mod fetched;
mod kept;
mod load;
mod locate;
mod quick;
mod read_dir;
mod read_step;
mod verify;

use std::io;
use std::path::PathBuf;

pub(crate) use check::{check_blobs, check_skeleton, name_slices, FileCheck};
pub use fetched::{check_file_bytes, FetchFiles, FileBytesCheck};
pub use kept::{IndexStamp, KeptIndex};
pub use load::{
    load, load_into, load_into_raw, load_into_raw_with, load_into_with, Loaded, OwnMemory, Placed, ReadDest,
};
pub use locate::{held_elsewhere, load_len_bytes, own_files_missing, read_index};
pub use quick::{quick_check, QUICK_CHECKED, QUICK_NOT_CHECKED};
pub(crate) use read_step::{read_step_at, Origin};
pub use verify::{verify, Verifier, VerifyReport};

use crate::io::{self as eio, IoPolicy};

/// Why a file of a step could not be read from a source other than this
/// node's directories (a [`crate::source::StepSource`] or a [`crate::fetch::FetchFiles`]).
/// Every message names where the file was looked for (`at`: the source as
/// it names itself in errors, `drain target s3://bucket/prefix`) and the
/// object; it becomes the file's problem.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The source does not hold the file.
    #[error("{at}: {object} not found")]
    NotFound { at: String, object: String },

    /// A ranged read asked for bytes past the end of the file.
    #[error("{at}: {object}: read of {len_bytes} bytes at {offset} is past its end ({size_bytes} bytes)")]
    PastEnd { at: String, object: String, offset: u64, len_bytes: u64, size_bytes: u64 },

    /// The file is not of the length the index says; `size_bytes` is what
    /// the source holds, at least (a streamed read stops past the end it
    /// expected).
    #[error("{at}: {object} is {size_bytes} bytes (at least) where the index says {expected_bytes}")]
    WrongLength { at: String, object: String, expected_bytes: u64, size_bytes: u64 },

    /// Any other failure of the source (a request that failed after its
    /// retries, its own I/O, a name it refuses): its own error, which says
    /// where and what.
    #[error(transparent)]
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    Latest,
    Step(u64),
}

#[derive(Debug, Clone, Default)]
pub struct ReadOptions {
    pub io: IoPolicy,
    /// Secondary directories to use instead of those the index recorded.
    pub secondary_dirs: Option<Vec<PathBuf>>,
    /// The node reading (several nodes, node-local files: `--node-local`):
    /// files it holds are read from its own directories, a file another
    /// node holds is [`LoadError::OnAnotherNode`]. None: every node-held
    /// file is read where its node's directories were recorded (one
    /// machine, or tools that name no node).
    pub node: Option<ThisNode>,
    /// Read only the files holding these tensors (names as readers see
    /// them, `Index::logical`; a load of some tensors): those files are
    /// checked whole, every blob is read; a name the step lacks is
    /// ignored here (the caller finds it missing). None: every file.
    pub only_tensors: Option<std::collections::BTreeSet<String>>,
    /// Where the index a load parsed is kept for the next load of the
    /// same step ([`KeptIndex`]): a load that finds its memory too small
    /// keeps it here; the daemon keeps a placed load's too. None: not kept.
    pub kept_index: Option<std::sync::Arc<KeptIndex>>,
}

/// The node a reader runs on ([`ReadOptions::node`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThisNode {
    pub id: String,
    /// Its directories, in the order a node-held file's `dir_idx` names them.
    pub dirs: Vec<PathBuf>,
}

/// One thing wrong with a checkpoint, naming where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub file: Option<String>,
    pub tensor: Option<String>,
    pub what: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{file}: ")?;
        }
        if let Some(t) = &self.tensor {
            write!(f, "tensor {t:?}: ")?;
        }
        f.write_str(&self.what)
    }
}

pub(crate) fn problem(file: Option<&str>, tensor: Option<&str>, what: impl Into<String>) -> Problem {
    Problem { file: file.map(str::to_string), tensor: tensor.map(str::to_string), what: what.into() }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{dir}: no committed checkpoint")]
    NoCheckpoint { dir: PathBuf },
    #[error("{dir}: step {step} is not a committed checkpoint")]
    NotCommitted { dir: PathBuf, step: u64 },
    /// One line (it reaches a trainer's exception over the wire): the problems joined by "; ".
    #[error("{}: step {step} is damaged: {}", dir.display(), problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; "))]
    Damaged { dir: PathBuf, step: u64, problems: Vec<Problem> },
    #[error("{path}: {what}: {source}")]
    Io { path: PathBuf, what: &'static str, source: io::Error },
    #[error(transparent)]
    Probe(#[from] eio::ProbeError),
    #[error("step {step} needs {need_bytes} bytes of memory to load; {have_bytes} given")]
    BufferTooSmall { step: u64, need_bytes: u64, have_bytes: u64 },
    /// The memory read into failed under the load (a client's shared
    /// memory that shrank or could not be backed: a read into it got EFAULT,
    /// or the caller's check says so): an error of this load, never damage
    /// of the checkpoint, so `latest` does not fall back past the step.
    #[error("step {step} could not be read into its destination: {why}")]
    Destination { step: u64, why: String },
    /// A file the load needs is on another node's own disks (node-local
    /// files, docs/format.md): not damage, so `latest` does not fall back.
    #[error("step {step}: {file} is held by node {node:?} on its own disks ({dir}); this is node {this:?}, which cannot read it: restore on that node, give a drain target (--drain) that holds the step, or save in the shared layout (without --node-local)")]
    OnAnotherNode { step: u64, file: String, node: String, dir: String, this: String },
    /// `latest` with every committed step damaged (or unreadable): each
    /// step tried and why it failed, newest first; `shared` names the one
    /// damaged file they all share (incremental hard links), if so.
    #[error("{}: no committed step loads{}; tried {}", dir.display(), shared.as_ref().map_or(String::new(), |f| format!(" (they share one damaged file: {f})")), tried.iter().map(|(s, why)| format!("step {s}: {why}")).collect::<Vec<_>>().join("; "))]
    NoneLoads { dir: PathBuf, tried: Vec<(u64, String)>, shared: Option<String> },
}
