//! The commit protocol (the steps in [`super`]): a staged image written
//! into temp folders, synced, and renamed into place with the primary's
//! rename last, the commit point; then `latest` and retention. A commit that
//! fails before its commit point removes every temp folder (and any
//! secondary already renamed) before it returns.
//!
//! Invariant: only a commit that passed its commit point durably is
//! reported as committed; an abort is honoured before writing, after the
//! shards are synced, and just before the renames.

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::{info, info_span, warn};

use super::write::{write_blobs_and_index, write_dirs, DirWrite, Fill};
use super::{CommitError, CommitReport, IncrementalReport, Store};
use crate::catalog;
use crate::format::{self, TMP_PREFIX};
use crate::image::{self, Blob, Layout};
use crate::incremental::{Kept, Prev};
use crate::io as eio;
use crate::mem::BufAddr;
use crate::progress::Progress;
use crate::retention;

/// One checkpoint to commit: its image in `staging` as `layout` lays it
/// out, how that image is filled, and its blobs.
#[derive(Clone, Copy)]
struct Save<'a> {
    step: u64,
    layout: &'a Layout,
    staging: &'a dyn BufAddr,
    fill: Fill<'a>,
    blobs: &'a [Blob<'a>],
}

/// What the writers of one commit wrote.
struct Written {
    /// The slowest directory's write and sync times.
    write: Duration,
    sync: Duration,
    /// Shards linked from the previous step instead of written.
    linked: Vec<usize>,
    /// Bytes of blobs and index.
    small_bytes: u64,
}

impl Store {
    /// Writes and commits a checkpoint whose image sits in `staging` as
    /// `layout` describes, with the given tensor checksums, then applies
    /// retention.
    pub fn commit(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        tensor_crcs: &[u32],
        blobs: &[Blob<'_>],
    ) -> Result<CommitReport, CommitError> {
        self.commit_then_retain(step, layout, staging, tensor_crcs, None, blobs)
    }

    /// [`Store::commit`] or, with `digests`, [`Store::commit_with_digests`],
    /// without retention: the caller applies it ([`Store::retain`]) once it
    /// has answered whoever waits for the commit, as after
    /// [`Store::commit_fed`]. Deleting an old step is work in proportion to
    /// its files (unlinking a large index takes milliseconds) that no
    /// waiter needs done.
    pub fn commit_unretained(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        tensor_crcs: &[u32],
        digests: Option<&[u128]>,
        blobs: &[Blob<'_>],
    ) -> Result<CommitReport, CommitError> {
        let fill = match digests {
            Some(d) => Fill::Summed(tensor_crcs, d),
            None => Fill::Done(tensor_crcs),
        };
        self.commit_filled(step, layout, staging, fill, blobs)
    }

    fn commit_then_retain(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        tensor_crcs: &[u32],
        digests: Option<&[u128]>,
        blobs: &[Blob<'_>],
    ) -> Result<CommitReport, CommitError> {
        let t0 = Instant::now();
        let mut report = self.commit_unretained(step, layout, staging, tensor_crcs, digests, blobs)?;
        report.deleted_by_retention = self.retain();
        report.total = t0.elapsed();
        Ok(report)
    }

    /// Writes and commits a checkpoint whose image is still being filled
    /// into `staging` ([`Progress`]): each chunk is written as soon as it is
    /// filled, and the index (with the filler's checksums) once it ended. A
    /// filler that fails stops the commit before its commit point
    /// ([`CommitError::Unfilled`]). Retention is left to the caller
    /// ([`Store::retain`]), so whoever waits for the commit need not wait
    /// for deletions too. The caller keeps `staging` untouched below the
    /// ready prefix, and must not free the image before the filler ended
    /// (even when this returns an error first). Memory written by a filler
    /// while shared belongs in a [`RawBuf`] (no slices), not an
    /// [`crate::mem::AlignedBuf`] (whose `&self` gives them out).
    pub fn commit_fed(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        progress: &Progress,
        blobs: &[Blob<'_>],
    ) -> Result<CommitReport, CommitError> {
        self.commit_filled(step, layout, staging, Fill::Fed(progress), blobs)
    }

    /// [`Store::commit`] of an incremental image (`LayoutOptions::
    /// incremental`) with each tensor's digest: the index records them,
    /// and unchanged stable shards are linked ([`crate::incremental`]).
    pub fn commit_with_digests(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        tensor_crcs: &[u32],
        digests: &[u128],
        blobs: &[Blob<'_>],
    ) -> Result<CommitReport, CommitError> {
        self.commit_then_retain(step, layout, staging, tensor_crcs, Some(digests), blobs)
    }

    /// Applies the retention policy, if any; returns the steps deleted. A
    /// failure is logged: the newest checkpoint is committed either way.
    pub fn retain(&mut self) -> Vec<u64> {
        let Some(policy) = self.opts.retention.filter(|_| self.read_only.is_none()) else { return Vec::new() };
        let held = self.retention_hold.as_ref().map(|h| h.lock().unwrap_or_else(|p| p.into_inner()));
        let applied = retention::plan(&self.paths, policy).and_then(|doomed| {
            let doomed: Vec<u64> =
                doomed.into_iter().filter(|s| !held.as_ref().is_some_and(|h| h.contains(s))).collect();
            for &step in &doomed {
                retention::delete(&self.paths, step)?;
            }
            Ok(doomed)
        });
        drop(held);
        match applied {
            Ok(deleted) => deleted,
            Err(e) => {
                warn!("retention failed ({e}); the new checkpoint is committed");
                Vec::new()
            }
        }
    }

    fn commit_filled(
        &mut self,
        step: u64,
        layout: &Layout,
        staging: &dyn BufAddr,
        fill: Fill<'_>,
        blobs: &[Blob<'_>],
    ) -> Result<CommitReport, CommitError> {
        let t0 = Instant::now();
        let save = Save { step, layout, staging, fill, blobs };
        let step_name = format::step_dir_name(step)?;
        image::validate_blobs(blobs)?;
        assert_eq!(layout.opts.n_dirs, self.dirs.len(), "layout planned for another directory count");
        assert!(staging.len_bytes() as u64 >= layout.staging_len, "staging smaller than the layout");
        let span = info_span!("checkpoint", step, bytes = layout.file_bytes());
        let _enter = span.enter();
        self.check_dirs_unchanged()?;
        let primary = self.paths[0].clone();
        if catalog::is_committed(&primary, step) {
            return Err(CommitError::AlreadyCommitted { step, dir: primary });
        }
        let tmp_name = format!("{TMP_PREFIX}{}-{:016x}", &step_name[format::STEP_PREFIX.len()..], eio::nonce());
        let tmps: Vec<PathBuf> = self.paths.iter().map(|d| d.join(&tmp_name)).collect();
        let mut renamed: Vec<PathBuf> = Vec::new();
        let result = self.commit_inner(save, &tmps, &mut renamed, t0);
        if result.is_err() {
            remove_failed(&self.paths, &tmps, &renamed);
        }
        let mut report = result?;
        report.total = t0.elapsed();
        info!(
            write_s = report.write.as_secs_f64(),
            sync_s = report.sync.as_secs_f64(),
            commit_s = report.commit.as_secs_f64(),
            total_s = report.total.as_secs_f64(),
            "committed"
        );
        Ok(report)
    }

    /// Steps 1 to 4 of the protocol and `latest`, for `save` into the temp folders `tmps`;
    /// a secondary renamed into place is put in `renamed`, for
    /// [`remove_failed`] to take back if the commit fails after all.
    fn commit_inner(
        &mut self,
        save: Save<'_>,
        tmps: &[PathBuf],
        renamed: &mut Vec<PathBuf>,
        t0: Instant,
    ) -> Result<CommitReport, CommitError> {
        let Save { step, layout, fill, .. } = save;
        self.check_abort(step)?;
        for t in tmps {
            fs::create_dir(t).map_err(|e| CommitError::io(t, "create temp folder", e))?;
        }
        // Incremental: the step compared with, and the shards that may be
        // linked from it (decided once the save's digests are in).
        self.incremental = None;
        let kept = self.kept_prev.take();
        let (prev, prev_kept) =
            if layout.opts.incremental { Prev::newest_or_kept(&self.paths, kept) } else { (None, false) };
        let candidates: Vec<Option<PathBuf>> = (0..layout.shards.len())
            .map(|s| prev.as_ref().filter(|_| self.link_unchanged).and_then(|p| p.candidate(layout, s)))
            .collect();
        let written = self.write_all(save, tmps, prev.as_ref(), &candidates)?;
        let t_commit = Instant::now();
        let linked_bytes: u64 = written.linked.iter().map(|&s| layout.shards[s].file_len).sum();
        let bytes = layout.file_bytes() - linked_bytes + written.small_bytes;
        let sums = match fill.digests() {
            Some(d) if layout.opts.incremental => Some((fill.crcs(step)?, d)),
            _ => None,
        };
        let incremental = sums.as_ref().map(|(crcs, d)| IncrementalReport {
            prev_step: prev.as_ref().map(|p| p.step),
            linked_files: written.linked.len(),
            linked_bytes,
            changed: prev.as_ref().map(|p| p.changed(layout, crcs, d)),
            prev_kept,
        });
        if let Some(r) = &incremental {
            info!(prev_step = ?r.prev_step, linked_files = r.linked_files, linked_bytes = r.linked_bytes, changed = ?r.changed.as_ref().map(|c| c.len()), "incremental");
        }
        self.publish(step, tmps, renamed)?;
        self.incremental = incremental;
        if let Some((crcs, d)) = &sums {
            // What this step's index records, for the next commit to compare with.
            let step_dirs: Vec<PathBuf> = self.paths.iter().map(|p| catalog::step_path(p, step)).collect();
            let kept = Prev::of_layout(step, layout, crcs, d, |sh| {
                Some(step_dirs.get(sh.dir_idx as usize)?.join(&sh.file_name))
            });
            self.kept_prev = Kept::committed(kept, &step_dirs[0].join(format::INDEX_FILE_NAME));
        }
        let primary = &self.paths[0];
        let update_latest = match catalog::latest_step(primary) {
            Ok(Some(l)) => l <= step,
            _ => true,
        };
        if update_latest {
            if let Err(e) = catalog::write_latest(primary, step) {
                warn!("checkpoint committed but `latest` not updated ({e}); recovery repairs it at the next start");
            }
        }
        Ok(CommitReport {
            step,
            path: catalog::step_path(primary, step),
            bytes,
            write: written.write,
            sync: written.sync,
            commit: t_commit.elapsed(),
            total: t0.elapsed(),
            deleted_by_retention: Vec::new(),
        })
    }

    /// Steps 2 and 3: the shards, one thread per directory, each with its own
    /// engine. Meanwhile this thread writes and syncs the blobs and the index
    /// (once a fed image's checksums are in), so their syncs share the
    /// shards' journal commits instead of following them one by one.
    fn write_all(
        &mut self,
        save: Save<'_>,
        tmps: &[PathBuf],
        prev: Option<&Prev>,
        candidates: &[Option<PathBuf>],
    ) -> Result<Written, CommitError> {
        let Save { step, layout, staging, fill, blobs } = save;
        let chunk_bytes = self.opts.chunk_bytes;
        let paths = &self.paths;
        // Blobs, like shards, are linked from the step compared with when unchanged.
        let prev_blobs = prev
            .filter(|_| self.link_unchanged)
            .map(|p| catalog::step_path(&paths[0], p.step).join(format::BLOBS_DIR_NAME));
        let w = DirWrite { step, layout, staging, fill, chunk_bytes, prev, candidates };
        let (results, small) = write_dirs(&mut self.dirs, tmps, w, || {
            write_blobs_and_index(step, layout, fill, blobs, &tmps[0], paths, prev_blobs.as_deref())
        });
        let mut written = Written { write: Duration::ZERO, sync: Duration::ZERO, linked: Vec::new(), small_bytes: 0 };
        for r in results {
            let (w, s, l) = r?;
            written.write = written.write.max(w);
            written.sync = written.sync.max(s);
            written.linked.extend(l);
        }
        written.small_bytes = small?;
        Ok(written)
    }

    /// Step 4: every temp folder synced, then renamed into place, the
    /// secondaries first and the primary last (the commit point), each
    /// parent synced after its rename.
    fn publish(&self, step: u64, tmps: &[PathBuf], renamed: &mut Vec<PathBuf>) -> Result<(), CommitError> {
        self.check_abort(step)?;
        for t in tmps {
            catalog::fsync_dir(t).map_err(|e| CommitError::io(t, "sync temp folder", e))?;
        }
        self.check_abort(step)?;
        // Secondaries first; the primary's rename is the commit point.
        for (i, t) in tmps.iter().enumerate().skip(1).chain(std::iter::once((0, &tmps[0]))) {
            let dest = catalog::step_path(&self.paths[i], step);
            fs::rename(t, &dest).map_err(|e| CommitError::io(&dest, "rename temp folder into place", e))?;
            if i != 0 {
                renamed.push(dest.clone());
            }
            catalog::fsync_dir(&self.paths[i]).map_err(|e| {
                if i == 0 {
                    // Renamed but the rename may not be durable: still not
                    // reported as committed; recovery settles it either way.
                    renamed.push(dest.clone());
                }
                CommitError::io(&self.paths[i], "sync directory after rename", e)
            })?;
        }
        renamed.clear();
        Ok(())
    }
}

/// Takes back a failed commit: its temp folders and any secondary already
/// renamed into place are removed (what cannot be is left to recovery), and
/// each directory synced.
fn remove_failed(paths: &[PathBuf], tmps: &[PathBuf], renamed: &[PathBuf]) {
    for p in tmps.iter().chain(renamed) {
        if let Err(e) = catalog::remove_tree(p) {
            warn!(path = %p.display(), "could not remove after a failed commit ({e}); recovery will");
        }
    }
    for d in paths {
        let _ = catalog::fsync_dir(d);
    }
}
