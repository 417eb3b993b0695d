//! Retention: keep the newest N committed checkpoints (and optionally every
//! K-th step), delete the rest crash-safely.
//!
//! Invariant: a deletion first renames the primary's `step-…` folder to
//! `.del-step-…-<nonce>` and syncs the parent, so from that instant the
//! checkpoint is not committed; only then are its files removed. A crash at
//! any point leaves either a whole committed checkpoint or leftovers that
//! recovery removes. The checkpoint `latest` names is never deleted.

use std::fs;
use std::io;
use std::path::PathBuf;

use crate::catalog;
use crate::format::{self, DEL_PREFIX};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Newest committed checkpoints to keep; at least 1.
    pub keep_last: usize,
    /// Also keep every step that is a multiple of this.
    pub keep_every: Option<u64>,
}

impl Retention {
    /// Which of `committed` (ascending) to delete.
    pub fn doomed(&self, committed: &[u64]) -> Vec<u64> {
        assert!(self.keep_last >= 1, "retention must keep at least one checkpoint");
        let n = committed.len();
        committed[..n.saturating_sub(self.keep_last)]
            .iter()
            .copied()
            .filter(|&s| !self.keep_every.is_some_and(|k| k > 0 && s % k == 0))
            .collect()
    }
}

/// Applies `policy` to the checkpoints in `dirs` (`dirs[0]` the primary);
/// returns the steps deleted.
pub fn apply(dirs: &[PathBuf], policy: Retention) -> io::Result<Vec<u64>> {
    let doomed = plan(dirs, policy)?;
    for &step in &doomed {
        delete(dirs, step)?;
    }
    Ok(doomed)
}

/// The steps `apply` would delete now (never the one `latest` names).
pub fn plan(dirs: &[PathBuf], policy: Retention) -> io::Result<Vec<u64>> {
    let primary = &dirs[0];
    let committed = catalog::committed_steps(primary)?;
    let latest = catalog::latest_step(primary)?;
    Ok(policy.doomed(&committed).into_iter().filter(|&s| Some(s) != latest).collect())
}

/// Deletes one committed checkpoint crash-safely (see the module comment).
pub fn delete(dirs: &[PathBuf], step: u64) -> io::Result<()> {
    let primary = &dirs[0];
    let from = catalog::step_path(primary, step);
    let graveyard = primary.join(format!(
        "{DEL_PREFIX}{}-{:016x}",
        &format::step_dir_name(step).expect("validated step")[format::STEP_PREFIX.len()..],
        crate::io::nonce()
    ));
    fs::rename(&from, &graveyard)?;
    catalog::fsync_dir(primary)?;
    for dir in &dirs[1..] {
        catalog::remove_tree(&catalog::step_path(dir, step))?;
    }
    catalog::remove_tree(&graveyard)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_newest_and_every_kth() {
        let r = Retention { keep_last: 2, keep_every: Some(100) };
        assert_eq!(r.doomed(&[50, 100, 150, 200, 250, 300]), vec![50, 150]);
        let r = Retention { keep_last: 3, keep_every: None };
        assert_eq!(r.doomed(&[1, 2]), Vec::<u64>::new());
        assert_eq!(r.doomed(&[1, 2, 3, 4]), vec![1]);
    }
}
