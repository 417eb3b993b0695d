//! The fed copy: a copy that feeds the committer's writer while it runs,
//! so a large image is on disk about when its copy ends. The writer
//! follows a [`Progress`] (run `r` done: the image is final up to run
//! `r + 1`'s start); a lazily released save checksums in the copy's pass,
//! the rest after the release ([`FedCopy::checksum`]).
//!
//! Invariants: the pieces lie in staging order, so the writer's final
//! prefix only grows; nothing queued on a device still writes into the
//! lease when [`FedCopy::copy`] returns, even when stopped early.

use std::sync::Arc;

use ckpt_store::image::Layout;
use ckpt_store::progress::Progress;

use crate::config;
use crate::memory::regions::{BatchMark, Region};
use crate::memory::staging::Lease;
use crate::save::checksums::{fold_crcs, fold_sums, stable_tensors, staged_sums};
use crate::save::copy::queue_batches_in;
use crate::save::pieces::sum_of_staged;
use crate::save::pieces::{copy_crc_run, pieces_of, run_runs, run_runs_with, runs_of, PerRun, Pieces};
use crate::save::plan::Source;
use crate::state::jobs::Sums;

/// A copy that feeds a writer while it runs (the large-copy pipeline): the
/// pieces in staging order, grouped in runs, and the [`Progress`] the
/// writer follows (run `r` done: the image is final up to run `r + 1`'s
/// start). Host regions copy run by run; a region that copies in batches
/// (CUDA) copies first and its runs then only checksum, so any region kind
/// feeds the same pipeline.
pub struct FedCopy {
    pieces: Pieces,
    runs: Vec<usize>,
    pub progress: Arc<Progress>,
    /// The windows the device copy ran in (0: no device memory), for the log.
    pub device_windows: usize,
    /// A lazily released incremental copy's sums per piece, whose digests
    /// are still missing for the tensors the copy took none of.
    pending: Option<Pending>,
}

/// A lazily released incremental copy's sums per piece, and per tensor
/// whether the copy took its digest: the others' pieces still lack theirs
/// ([`FedCopy::complete`]).
type Pending = (Vec<(u32, u128)>, Vec<bool>);

impl FedCopy {
    /// Writes the headers and plans the copy of every tensor into the lease
    /// (nothing copied yet). The pieces point into the lease's range, which
    /// stays allocated until the progress ends ([`Lease::filled_by`]).
    pub fn plan(layout: &Layout, sources: &[Source], lease: &mut Lease) -> FedCopy {
        layout.write_headers(lease.as_mut_slice());
        let mut pieces = pieces_of(layout, Some(sources), lease);
        // Staging order = file order: the writer's prefix grows from the start.
        pieces.0.sort_by_key(|p| p.dst as usize);
        let runs = runs_of(&pieces);
        let (base_ptr, base_off) = (lease.as_mut_ptr() as usize, lease.offset_bytes());
        let starts =
            runs[..runs.len() - 1].iter().map(|&k| base_off + (pieces.0[k].dst as usize - base_ptr) as u64).collect();
        let progress = Arc::new(Progress::new(starts, base_off + layout.staging_len));
        lease.filled_by(progress.clone());
        FedCopy { pieces, runs, progress, device_windows: 0, pending: None }
    }

    /// Copies every piece, marking each run done as it ends; with `crc`,
    /// also returns each tensor's crc32c (computed during the copy). None
    /// when stopped early. Does not end the progress: the caller does,
    /// after its checks ([`FedCopy::checksum`], `Fill`). `fed`: the
    /// committer writes while this copies (an image handed over before its
    /// copy, [`config::FED_EARLY_BYTES_MIN`]).
    pub fn copy(
        &mut self,
        layout: &Layout,
        crc: bool,
        fed: bool,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> Option<Option<Sums>> {
        if crc && layout.opts.incremental && fed {
            // The digests of the stable shards' tensors in the copy's pass:
            // the committer writes while this copies, and their links wait
            // for them. A volatile tensor's digest only serves the next
            // save, so it is taken after the release ([`FedCopy::complete`]),
            // off the trainer's stall.
            let stable = stable_tensors(layout);
            let sums = self.copy_with(stop, &|ps, a, b, out| {
                if ps.0[a..b].iter().any(|p| stable[p.tensor_idx]) {
                    out.extend((a..b).map(|k| {
                        let p = &ps.0[k];
                        (k, if stable[p.tensor_idx] { p.copy_summed(true) } else { (p.copy(true), 0) })
                    }))
                } else {
                    let mut crcs = Vec::with_capacity(b - a);
                    copy_crc_run(ps, a, b, &mut crcs);
                    out.extend(crcs.into_iter().map(|(k, c)| (k, (c, 0))));
                }
            })?;
            let crcs: Vec<u32> = sums.iter().map(|s| s.0).collect();
            let out = Sums { crcs: fold_crcs(layout, &self.pieces, &crcs), digests: None };
            self.pending = Some((sums, stable));
            return Some(Some(out));
        }
        if !crc {
            self.copy_with(stop, &|ps, a, b, out| out.extend((a..b).map(|k| (k, ps.0[k].copy(false)))))?;
            return Some(None);
        }
        let crcs = self.copy_with(stop, &copy_crc_run)?;
        if layout.opts.incremental {
            // An image written after its copy: every digest after the
            // release, a digest costing about what the checksummed copy of
            // its bytes does ([`FedCopy::complete`]).
            self.pending = Some((crcs.iter().map(|&c| (c, 0)).collect(), vec![false; layout.specs.len()]));
        }
        Some(Some(Sums { crcs: fold_crcs(layout, &self.pieces, &crcs), digests: None }))
    }

    /// The copy of [`FedCopy::copy`], `per_run` per run (copy, and what it
    /// sums: [`run_runs_with`]).
    fn copy_with<T: Copy + Default + Send>(
        &mut self,
        stop: &(dyn Fn() -> bool + Sync),
        per_run: &PerRun<'_, T>,
    ) -> Option<Vec<T>> {
        let progress = &self.progress;
        let batched = self.pieces.0.iter().any(|p| {
            // SAFETY: a non-null region is kept alive by the caller's Arcs (Pieces' invariant).
            unsafe { p.region.as_ref() }.is_some_and(Region::copies_in_batches)
        });
        if !batched {
            return run_runs_with(&self.pieces, &self.runs, stop, per_run, &|r| progress.done(r));
        }
        // Device regions, in windows of runs (config::device_window_bytes):
        // every window's copies are queued at once, each followed by a mark
        // (the trainer's event was waited for before: regions/cuda.rs); then window by
        // window, its marks are waited for and its runs checksummed and
        // marked done, so the disk writes window k while window k + 1 is
        // still coming off the device.
        let window = config::device_window_bytes();
        let mut windows = Vec::new();
        let mut r0 = 0;
        while r0 + 1 < self.runs.len() {
            let mut r1 = r0 + 1;
            let mut bytes = 0usize;
            while r1 < self.runs.len() {
                bytes += self.pieces.0[self.runs[r1 - 1]..self.runs[r1]].iter().map(|p| p.len).sum::<usize>();
                if bytes >= window {
                    break;
                }
                r1 += 1;
            }
            let r1 = r1.min(self.runs.len() - 1);
            windows.push((r0, r1));
            r0 = r1;
        }
        let mut marks: Vec<Vec<(*const Region, BatchMark)>> = Vec::with_capacity(windows.len());
        for &(r0, r1) in &windows {
            let queued = queue_batches_in(&mut self.pieces, self.runs[r0]..self.runs[r1]);
            marks.push(
                queued
                    .iter()
                    // SAFETY: a queued region is alive for the whole copy (Pieces' invariant).
                    .map(|&r| (r, unsafe { (*r).mark_batch() }))
                    .collect(),
            );
        }
        self.device_windows = windows.len();
        // Waits for the marks of windows `from..`: nothing queued may still
        // write into the lease when this returns, even when stopped early.
        let wait_from = |marks: &[Vec<(*const Region, BatchMark)>], from: usize| {
            for (r, m) in marks[from..].iter().flatten() {
                // SAFETY: alive for the whole copy.
                unsafe { (**r).wait_mark(m) };
            }
        };
        let mut piece_crcs = vec![T::default(); self.pieces.0.len()];
        for (w, &(r0, r1)) in windows.iter().enumerate() {
            wait_from(&marks[w..=w], 0);
            let (k0, k1) = (self.runs[r0], self.runs[r1]);
            // The window's runs, renumbered from 0 for run_runs.
            let runs: Vec<usize> = self.runs[r0..=r1].to_vec();
            let Some(got) = run_runs_with(&self.pieces, &runs, stop, per_run, &|r| progress.done(r0 + r)) else {
                wait_from(&marks, w + 1);
                return None;
            };
            piece_crcs[k0..k1].copy_from_slice(&got[k0..k1]);
        }
        Some(piece_crcs)
    }

    /// The sums of a copy made with its checksums, completed after the
    /// release: a lazily released incremental copy's tensors whose digests
    /// the copy did not take get them from the staged bytes (on the copy
    /// threads); any other copy's sums are returned as they are.
    pub fn complete(&mut self, layout: &Layout, sums: Sums) -> Sums {
        let Some((mut pending, taken)) = self.pending.take() else { return sums };
        let rest = run_runs(
            &self.pieces,
            &self.runs,
            &|| false,
            &|p| if taken[p.tensor_idx] { 0 } else { sum_of_staged(p, false).1 },
            &|_| {},
        )
        .expect("a digest pass is never stopped");
        for ((p, s), d) in self.pieces.0.iter().zip(&mut pending).zip(rest) {
            if !taken[p.tensor_idx] {
                s.1 = d;
            }
        }
        let out = fold_sums(layout, &self.pieces, &pending);
        debug_assert_eq!(out.crcs, sums.crcs);
        out
    }

    /// The tensor checksums (and digests, incremental) from the staged
    /// bytes (after a copy without them).
    pub fn checksum(&self, layout: &Layout) -> Sums {
        staged_sums(layout, &self.pieces, Some(&self.runs))
    }
}
