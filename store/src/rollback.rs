//! Rollback: make an older committed checkpoint the head of the timeline
//! again, so a trainer that resumed from it (after a loss spike, or after
//! `latest` fell back past a damaged checkpoint) can save the later steps
//! anew, and a crash cannot resume from the abandoned branch.
//!
//! The protocol, in the primary directory, under the directory lock:
//! 1. the intent: `.ckpt-rollback` naming the target step, written
//!    atomically (temp, sync, rename, directory sync);
//! 2. `latest` moved to the target (atomically, as always);
//! 3. every later committed step un-committed as retention deletes: the
//!    primary's folder renamed to `.del-step-…` and the parent synced (from
//!    that instant the step is not committed), secondaries and the renamed
//!    folder then removed; newest first;
//! 4. the intent removed and the directory synced.
//!
//! A crash before the intent is durable leaves the old timeline untouched;
//! from then on, recovery ([`finish_interrupted`], run by every
//! `Store::open`) completes the rollback, so the next owner of the directory
//! sees the new timeline. At no point does `latest` name a step that is not
//! committed (the target is never touched), and no half-deleted step is
//! listed (un-committing is one rename).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::catalog;
use crate::format::{self, Index, BLOBS_DIR_NAME, ROLLBACK_FILE_NAME};
use crate::restore;
use crate::retention;

#[derive(Debug, thiserror::Error)]
pub enum RollbackError {
    #[error("cannot roll back to step {step}: it is not a committed checkpoint in {} (committed: {})", dir.display(), list(committed))]
    NotCommitted { step: u64, dir: PathBuf, committed: Vec<u64> },
    /// The target's index does not read: a trainer resumed from it could not
    /// load it. Its text says the cause once (no `source`: it is the message).
    #[error("cannot roll back to it: {0}; roll back to a step whose index reads (ckpt-sidecar verify DIR)")]
    Unreadable(String),
    /// A file or blob the target's index names is missing or of another
    /// length (a truncated shard): it would not load, and the later steps
    /// a rollback un-commits may be the only sound ones.
    #[error(
        "cannot roll back to step {step}: {what}; it would not load (ckpt-sidecar verify DIR finds the sound steps)"
    )]
    Incomplete { step: u64, what: String },
    /// The target's bytes do not match their checksums (or its skeleton
    /// names a tensor it lacks): read in full before anything is changed.
    #[error("cannot roll back to step {step}: it is damaged ({what}{}); the later steps a rollback un-commits may be the only sound ones (ckpt-sidecar verify DIR finds the sound steps)", if *n_more > 0 { format!("; {n_more} more problem(s)") } else { String::new() })]
    Damaged { step: u64, what: String, n_more: usize },
    /// The Store may not write there: its directory is no longer the one it
    /// locked (`CommitError::DirReplaced`), or it was opened read-only
    /// (`CommitError::ReadOnly`). Nothing is changed there.
    #[error("rollback to step {step}: {why}")]
    Refused { step: u64, why: String },
    #[error("rollback to step {step} in {}: {what}: {source}", dir.display())]
    Io { step: u64, dir: PathBuf, what: &'static str, source: io::Error },
}

fn list(steps: &[u64]) -> String {
    if steps.is_empty() {
        "none".into()
    } else {
        steps.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
    }
}

/// Rolls `dirs` (`dirs[0]` the primary) back to the committed `step`;
/// returns the later steps un-committed, newest first. The caller holds the
/// directory locks.
pub fn rollback(dirs: &[PathBuf], step: u64) -> Result<Vec<u64>, RollbackError> {
    let primary = &dirs[0];
    let io = |what: &'static str| move |source| RollbackError::Io { step, dir: primary.clone(), what, source };
    let committed = catalog::committed_steps(primary).map_err(io("list checkpoints"))?;
    if !committed.contains(&step) {
        return Err(RollbackError::NotCommitted { step, dir: primary.clone(), committed });
    }
    let index = restore::read_index(primary, step).map_err(|e| RollbackError::Unreadable(e.to_string()))?;
    if let Some(what) = missing_bytes(dirs, &index, step) {
        return Err(RollbackError::Incomplete { step, what });
    }
    // Every byte of the target read and checked before a later step goes:
    // a rollback to a step that does not load would un-commit sound ones.
    let opts =
        restore::ReadOptions { secondary_dirs: (dirs.len() > 1).then(|| dirs[1..].to_vec()), ..Default::default() };
    let report =
        restore::verify(primary, step, &opts, |_, _| {}).map_err(|e| RollbackError::Unreadable(e.to_string()))?;
    if let Some(p) = report.problems.first() {
        return Err(RollbackError::Damaged { step, what: p.to_string(), n_more: report.problems.len() - 1 });
    }
    catalog::write_step_file(primary, ROLLBACK_FILE_NAME, step).map_err(io("write the rollback intent"))?;
    complete(dirs, step).map_err(io("un-commit later steps"))
}

/// Why committed `step` would not load, found without reading its data (its
/// index, then a stat per file and blob), or None. For a command about to
/// give up other steps for it (rollback, gc).
pub fn would_not_load(dirs: &[PathBuf], step: u64) -> Option<String> {
    match restore::read_index(&dirs[0], step) {
        Err(e) => Some(e.to_string()),
        Ok(index) => missing_bytes(dirs, &index, step),
    }
}

/// The first file or blob of `step` that is missing or not the length its
/// index says (a stat each, no data read), as "path: what".
fn missing_bytes(dirs: &[PathBuf], index: &Index, step: u64) -> Option<String> {
    let check = |path: PathBuf, len: u64| match fs::metadata(&path) {
        Err(e) => Some(format!("{}: {e}", path.display())),
        Ok(m) if m.len() != len => Some(format!("{}: {} bytes where the index says {len}", path.display(), m.len())),
        Ok(_) => None,
    };
    let secondaries = &index.ckpt.secondary_dirs;
    for f in &index.ckpt.files {
        let i = f.dir_idx as usize;
        let dir = match dirs.get(i) {
            Some(d) => d.clone(),
            None => PathBuf::from(secondaries.get(i.wrapping_sub(1))?),
        };
        if let Some(what) = check(catalog::step_path(&dir, step).join(&f.name), f.len_bytes) {
            return Some(what);
        }
    }
    let blobs = catalog::step_path(&dirs[0], step).join(BLOBS_DIR_NAME);
    index.ckpt.blobs.iter().find_map(|b| check(blobs.join(&b.name), b.len_bytes))
}

/// Steps 2–4 of the protocol, for `rollback` and for recovery.
fn complete(dirs: &[PathBuf], step: u64) -> io::Result<Vec<u64>> {
    let primary = &dirs[0];
    catalog::write_latest(primary, step)?;
    let mut later: Vec<u64> = catalog::committed_steps(primary)?.into_iter().filter(|&s| s > step).collect();
    later.reverse();
    for &s in &later {
        retention::delete(dirs, s)?;
    }
    fs::remove_file(primary.join(ROLLBACK_FILE_NAME))?;
    catalog::fsync_dir(primary)?;
    Ok(later)
}

/// The step an interrupted rollback was going to, if the intent is there.
pub fn pending(primary: &Path) -> io::Result<Option<String>> {
    match fs::read_to_string(primary.join(ROLLBACK_FILE_NAME)) {
        Ok(s) => Ok(Some(s.trim().to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// What recovery found of an interrupted rollback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Interrupted {
    /// Finished: `latest` is `step`, `removed` were un-committed now.
    Finished { step: u64, removed: Vec<u64> },
    /// The intent named no committed step; it was removed (the warning).
    Dropped(String),
}

/// Recovery's part: finishes a rollback a crash interrupted (None when there
/// was none).
pub fn finish_interrupted(dirs: &[PathBuf]) -> io::Result<Option<Interrupted>> {
    let primary = &dirs[0];
    let Some(raw) = pending(primary)? else { return Ok(None) };
    match format::parse_step_dir_name(&raw).filter(|&s| catalog::is_committed(primary, s)) {
        Some(step) => Ok(Some(Interrupted::Finished { step, removed: complete(dirs, step)? })),
        None => {
            fs::remove_file(primary.join(ROLLBACK_FILE_NAME))?;
            catalog::fsync_dir(primary)?;
            Ok(Some(Interrupted::Dropped(format!(
                "{} named {raw:?}, not a committed checkpoint; removed",
                primary.join(ROLLBACK_FILE_NAME).display()
            ))))
        }
    }
}
