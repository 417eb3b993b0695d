//! The daemon's side of incremental checkpoints (`--incremental`, docs/
//! format.md "Incremental checkpoints"): before each commit, whether it may
//! link unchanged stable shards (`--full-every`); after it, the history
//! the next saves plan their stable shards with ([`Shared::set_changed`]).
//! The digests are taken by the copy (`snapshot`), the comparison and the
//! links made by the store (`ckpt_store::incremental`).
//!
//! Invariant: only the committer thread calls these (it owns the Store and
//! the count of saves since the last full one).

use std::sync::atomic::Ordering;

use ckpt_store::commit::Store;
use tracing::info;

use crate::state::DaemonState;

/// Tells the store whether the next commit may link: not when it is the
/// `--full-every`-th save since the last one that linked nothing.
pub fn before_commit(store: &mut Store, state: &DaemonState) {
    let k = state.full_every.load(Ordering::Relaxed);
    let since = state.saves_since_full.load(Ordering::Relaxed);
    let link = k == 0 || since + 1 < k;
    if !link {
        info!(full_every = k, "incremental: this save is written in full (--full-every)");
    }
    store.set_link_unchanged(link);
}

/// After a successful commit: the tensors it found changed become the
/// history, and a save that linked nothing restarts the `--full-every` count.
pub fn after_commit(store: &mut Store, state: &DaemonState) {
    let Some(rep) = store.take_incremental() else { return };
    crate::state::metrics::record_incremental(rep.linked_files == 0, rep.linked_bytes);
    state.set_changed(rep.changed);
    if rep.linked_files == 0 {
        state.saves_since_full.store(0, Ordering::Relaxed);
    } else {
        state.saves_since_full.fetch_add(1, Ordering::Relaxed);
    }
}
