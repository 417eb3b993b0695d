//! The store: target directories with their I/O engines, and the commit
//! protocol that turns a staged image into a committed checkpoint.
//!
//! Commit protocol, per checkpoint:
//! 1. `.tmp-step-…-<nonce>/` in every target directory;
//! 2. every shard written from staging (one thread and one engine per
//!    directory, in parallel), space reserved first, fdatasync'd;
//! 3. blobs written and synced, the index written and synced last;
//! 4. every temp folder synced, then renamed to `step-…` — secondaries first,
//!    the primary (holding the index) last: **the primary's rename is the
//!    commit point** — and each parent synced;
//! 5. `latest` replaced atomically; retention applied.
//!
//! Invariants: only this module, recovery and retention rename or sync
//! directories; a failed commit removes its temp folders (and any secondary
//! already renamed) before it returns, so it leaves nothing behind but what
//! was there before.
//!
//! Files: `store` (opening a Store: directories checked, locked, probed,
//! recovered; its settings and checks), `protocol` (the steps above, and
//! the removal of a failed commit's folders), `write` (shards, blobs and the
//! index written into the temp folders).

mod protocol;
mod store;
mod write;

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use store::{Store, StoreError, StoreOptions, TargetDir};
pub(crate) use write::{
    link_if_same, reserve, write_dir, write_dirs, write_index, write_small_file, DirWrite, Fill, INDEX_PIECE_BYTES,
};

use crate::format::{FormatError, TMP_PREFIX};
use crate::read_only::ReadOnlyDir;

#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("disk full in {}: {what}{}: {source}", dir.display(), needed_bytes.map_or(String::new(), |n| format!(" needs {n} bytes")))]
    DiskFull { dir: PathBuf, what: String, needed_bytes: Option<u64>, source: io::Error },
    #[error("{path}: {what}: {source}")]
    Io { path: PathBuf, what: String, source: io::Error },
    #[error("step {step} is already committed in {dir}; to save it again, roll back first (ckpt-sidecar rollback {dir} --to STEP, or rollback(STEP) in the shim), or save another step")]
    AlreadyCommitted { step: u64, dir: PathBuf },
    #[error("invalid checkpoint: {0}")]
    Format(#[from] FormatError),
    #[error("step {step}: aborted before the commit point (shutting down); nothing was committed")]
    Aborted { step: u64 },
    #[error("step {step}: its image was never complete ({why}); nothing was committed")]
    Unfilled { step: u64, why: String },
    /// Several ranks' parts that would commit a step no reader can load
    /// (crate::skeleton::parts_disagree).
    #[error("step {step}: {why}; nothing was committed")]
    PartsDisagree { step: u64, why: String },
    /// The path of a target directory no longer names the directory this
    /// Store opened and locked (removed, or removed and made again).
    #[error("{}: the checkpoint directory was {what} after this process opened it, so its one-owner lock is not on the directory there now; saves are refused until the sidecar is restarted", dir.display())]
    DirReplaced { dir: PathBuf, what: &'static str },
    /// The Store was opened read-only ([`crate::read_only`]).
    #[error("{0}")]
    ReadOnly(ReadOnlyDir),
}

impl CommitError {
    pub(crate) fn io(path: &Path, what: impl Into<String>, source: io::Error) -> CommitError {
        if source.raw_os_error() == Some(libc::ENOSPC) || source.raw_os_error() == Some(libc::EDQUOT) {
            // Name the target directory, not the temp folder already removed
            // by the time anyone reads this.
            let dir = path
                .ancestors()
                .find(|a| a.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(TMP_PREFIX)))
                .and_then(Path::parent)
                .unwrap_or(path);
            return CommitError::DiskFull { dir: dir.to_path_buf(), what: what.into(), needed_bytes: None, source };
        }
        CommitError::Io { path: path.to_path_buf(), what: what.into(), source }
    }

    /// Says how many bytes the failed step needed, if the disk was full.
    pub(crate) fn needing(self, n: u64) -> CommitError {
        match self {
            CommitError::DiskFull { dir, what, source, .. } => {
                CommitError::DiskFull { dir, what, needed_bytes: Some(n), source }
            }
            other => other,
        }
    }
}

/// Figures of one commit.
#[derive(Debug, Clone)]
pub struct CommitReport {
    pub step: u64,
    pub path: PathBuf,
    /// Shard, blob and index bytes written.
    pub bytes: u64,
    /// Creating files, reserving space and writing the shards.
    pub write: Duration,
    /// fdatasync of the shards.
    pub sync: Duration,
    /// Blobs, index, renames, directory syncs and `latest`.
    pub commit: Duration,
    pub total: Duration,
    pub deleted_by_retention: Vec<u64>,
}

/// What an incremental commit (a layout planned with
/// `LayoutOptions::incremental`, digests given) found and did.
#[derive(Debug, Clone, Default)]
pub struct IncrementalReport {
    /// The committed step it compared with; None: there was none.
    pub prev_step: Option<u64>,
    /// Shards linked from `prev_step` instead of written, and their bytes.
    pub linked_files: usize,
    pub linked_bytes: u64,
    /// Tensors that changed since `prev_step` (or are new); None when there
    /// was nothing to compare with.
    pub changed: Option<std::collections::HashSet<String>>,
    /// Whether `prev_step` was compared with as kept in memory from the
    /// commit that wrote it, rather than its index read back from disk
    /// ([`crate::incremental::Kept`]).
    pub prev_kept: bool,
}
