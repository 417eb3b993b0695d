//! The index a load parsed, kept for the next load of the same step
//! ([`KeptIndex`]): the retry of a load that found its memory too small,
//! or another rank's load of the same step. At 100k tensors an index is
//! ~40 MB of JSON and a parse of it ~0.25 s, which the first load of every
//! resumed process paid three times (the read, the too-small answer's
//! listing, the retry's read), and every rank of a resumed node once.
//!
//! Invariant: a kept index is handed out only for the same directory and
//! step while the index file is the one parsed (its length, modification
//! time and inode unchanged); the reader still looks at the step's damage
//! mark and readability as a parse would.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::catalog;
use crate::format::{Index, INDEX_FILE_NAME};

/// One slot, shared by whoever holds the [`super::ReadOptions`] (the
/// daemon: every session's loads); a retry from another session, for
/// another step, simply parses.
#[derive(Debug, Default)]
pub struct KeptIndex {
    slot: Mutex<Option<Kept>>,
}

#[derive(Debug)]
struct Kept {
    primary: PathBuf,
    step: u64,
    stamp: IndexStamp,
    index: Index,
}

/// An index file's (length, modification time in ns, inode), taken just
/// before it is parsed: a file changed after the stamp (even while it was
/// parsed) no longer matches it, so the index kept under it is not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexStamp(u64, i128, u64);

impl IndexStamp {
    pub(crate) fn of(primary: &Path, step: u64) -> Option<IndexStamp> {
        let m = std::fs::metadata(catalog::step_path(primary, step).join(INDEX_FILE_NAME)).ok()?;
        Some(IndexStamp(m.len(), m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128, m.ino()))
    }
}

impl KeptIndex {
    /// Keeps `index`, parsed from `primary`'s step `step` after `stamp` was
    /// taken of its file ([`super::Placed::index_stamp`]), in place of what was kept.
    pub fn keep(&self, primary: &Path, step: u64, stamp: IndexStamp, index: Index) {
        let kept = Kept { primary: primary.to_path_buf(), step, stamp, index };
        let old = self.slot.lock().expect("kept index lock").replace(kept);
        drop(old);
    }

    /// The kept index of `primary`'s step `step` and its stamp, taken out,
    /// when its file is unchanged since.
    pub(crate) fn take(&self, primary: &Path, step: u64) -> Option<(Index, IndexStamp)> {
        let mut g = self.slot.lock().expect("kept index lock");
        let k = g.as_ref()?;
        if k.primary != primary || k.step != step {
            return None;
        }
        let fresh = IndexStamp::of(primary, step) == Some(k.stamp);
        let k = g.take().expect("checked above");
        fresh.then_some((k.index, k.stamp))
    }

    /// `f` of the kept index of `primary`'s step `step` (left kept), when
    /// its file is unchanged since.
    pub fn with<R>(&self, primary: &Path, step: u64, f: impl FnOnce(&Index) -> R) -> Option<R> {
        let g = self.slot.lock().expect("kept index lock");
        let k = g.as_ref().filter(|k| k.primary == primary && k.step == step)?;
        (IndexStamp::of(primary, step) == Some(k.stamp)).then(|| f(&k.index))
    }
}
