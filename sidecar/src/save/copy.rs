//! The copy threads: a save's image cut into pieces of at most
//! [`COPY_PIECE_BYTES`] (one digest block each), claimed in runs by
//! [`config::COPY_THREADS`] threads (the caller's included; the helpers at
//! idle priority), and device regions' pieces copied in batches first.
//!
//! Invariants: every piece's destination is its own disjoint range of a
//! lease its caller holds; its source range was bounds-checked when the
//! save was planned, and its region is kept alive by the caller's
//! `Arc<Region>` for the whole copy ([`Pieces`]); a batch queued on a
//! device is waited for before its bytes are read or the lease is given back.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use ckpt_store::image::Layout;

use crate::config::{self, COPY_PIECE_BYTES};
use crate::memory::regions::{store_fence, Region};
use crate::memory::staging::Lease;
use crate::save::checksums::{fold_crcs, fold_sums, sum_of_staged};
use crate::save::plan::Source;
use crate::state::jobs::Sums;

/// A piece of one tensor, copied or checksummed by one thread.
pub(super) struct Piece {
    pub(super) tensor_idx: usize,
    /// The region the piece is copied from; null in a checksum pass.
    pub(super) region: *const Region,
    /// Where in the region (bounds checked in plan_save).
    pub(super) src_offset_bytes: u64,
    pub(super) dst: *mut u8,
    pub(super) len: usize,
    /// Already copied by its region's batch ([`copy_batches`]).
    pub(super) staged: bool,
}

// A copy piece is one digest block: a tensor's pieces start at its first
// byte and are at most one block long, so each piece's hash is a block's.
const _: () = assert!(COPY_PIECE_BYTES == ckpt_store::digest::DIGEST_BLOCK_BYTES);

impl Piece {
    /// [`Piece::copy`] that also returns the piece's digest (one block of
    /// `ckpt_store::digest`), hashed while its bytes are in cache.
    pub(super) fn copy_summed(&self, crc: bool) -> (u32, u128) {
        if self.staged {
            return sum_of_staged(self, crc);
        }
        // SAFETY: as in Piece::copy: a non-null `region` is alive for the
        // whole copy (Pieces' invariant).
        match unsafe { self.region.as_ref() } {
            // SAFETY: as in Piece::copy: dst..dst+len is this piece's own
            // part of the lease; the source range was bounds-checked.
            Some(r) => unsafe { r.copy_out_summed(self.src_offset_bytes, self.dst, self.len, crc) },
            None => unreachable!("a checksum piece is never copied"),
        }
    }

    /// Copies this piece out of its region into its part of the lease;
    /// with `crc`, returns the crc32c of the bytes.
    pub(super) fn copy(&self, crc: bool) -> u32 {
        if self.staged {
            // SAFETY: dst..dst+len is this piece's own part of the lease,
            // written by the completed batch copy.
            return if crc { crc32c::crc32c(unsafe { std::slice::from_raw_parts(self.dst, self.len) }) } else { 0 };
        }
        // SAFETY: a non-null `region` is kept alive by the caller's Arc for
        // the whole copy (Pieces' invariant).
        match unsafe { self.region.as_ref() } {
            // SAFETY: dst..dst+len is this piece's own part of the lease
            // (Pieces' invariant); the source range was bounds-checked when
            // the save was planned.
            Some(r) => unsafe { r.copy_out(self.src_offset_bytes, self.dst, self.len, crc) },
            None => unreachable!("a checksum piece is never copied"),
        }
    }
}

/// Raw pointers of the pieces, shared by the copy threads.
pub(super) struct Pieces(pub(super) Vec<Piece>);
// SAFETY: every piece's destination is a disjoint range of a lease the
// copying session holds exclusively; sources are regions kept alive by the
// Arc<Region>s in `sources` for the whole copy; each piece is taken by
// exactly one thread (atomic counter).
unsafe impl Sync for Pieces {}

/// Splits every tensor's range of the lease into pieces of at most
/// [`COPY_PIECE_BYTES`], so both threads share even one large tensor; with
/// `sources`, each piece also gets its region and offset there.
pub(super) fn pieces_of(layout: &Layout, sources: Option<&[Source]>, lease: &mut Lease) -> Pieces {
    assert!(lease.len_bytes() >= layout.staging_len, "lease smaller than the image");
    let base = lease.as_mut_ptr();
    let mut pieces = Vec::new();
    for i in 0..layout.specs.len() {
        let r = layout.tensor_range(i);
        let (region, src_offset_bytes) = match sources {
            Some(sources) => {
                let s = &sources[i];
                assert_eq!(r.len() as u64, s.len_bytes);
                let Some(region) = &s.region else { continue };
                (Arc::as_ptr(region), s.offset_bytes)
            }
            None => (std::ptr::null(), 0),
        };
        split_range(&mut pieces, i, region, src_offset_bytes, base.wrapping_add(r.start), r.len());
    }
    Pieces(pieces)
}

/// Appends the pieces of one range of `len` bytes (`region` null: no source).
fn split_range(
    pieces: &mut Vec<Piece>,
    tensor_idx: usize,
    region: *const Region,
    src_offset_bytes: u64,
    dst: *mut u8,
    len: usize,
) {
    let mut at = 0usize;
    while at < len {
        let n = (len - at).min(COPY_PIECE_BYTES);
        // The pointer stays inside its range: at + n ≤ len.
        pieces.push(Piece {
            tensor_idx,
            region,
            src_offset_bytes: src_offset_bytes + at as u64,
            dst: dst.wrapping_add(at),
            len: n,
            staged: false,
        });
        at += n;
    }
}

/// Copies the pieces of regions that copy in batches (device memory) one
/// batch per region, adjacent pieces merged into one copy of at most
/// [`config::DEVICE_COPY_BYTES_MAX`], and marks them staged; the rest are
/// left to the piece-by-piece copy.
fn copy_batches(pieces: &mut Pieces) {
    let n = pieces.0.len();
    copy_batches_in(pieces, 0..n)
}

/// [`copy_batches`] for the pieces `within` only.
fn copy_batches_in(pieces: &mut Pieces, within: std::ops::Range<usize>) {
    let queued = queue_batches_in(pieces, within);
    for region in queued {
        // SAFETY: the region is kept alive by the caller's Arc for the
        // whole copy (Pieces' invariant).
        unsafe { (*region).finish_batch() };
    }
}

/// Queues the batches of the pieces `within` (as [`copy_batches_in`]) and
/// marks those pieces staged, without waiting: the regions queued are
/// returned, and the caller must wait for them ([`Region::finish_batch`],
/// or [`Region::wait_mark`] on a mark taken after) before the staged bytes
/// are read or the lease is given back.
pub(super) fn queue_batches_in(pieces: &mut Pieces, within: std::ops::Range<usize>) -> Vec<*const Region> {
    /// A region, its merged ranges (source offset, destination, length), and its pieces' indices.
    type Batch = (*const Region, Vec<(u64, *mut u8, usize)>, Vec<usize>);
    let mut by_region: Vec<Batch> = Vec::new();
    for (k, p) in pieces.0.iter().enumerate().skip(within.start).take(within.len()) {
        if p.region.is_null() {
            continue;
        }
        let at = match by_region.iter().position(|(r, _, _)| *r == p.region) {
            Some(i) => i,
            None => {
                by_region.push((p.region, Vec::new(), Vec::new()));
                by_region.len() - 1
            }
        };
        let (_, ranges, ks) = &mut by_region[at];
        match ranges.last_mut() {
            Some((off, dst, len))
                if *off + *len as u64 == p.src_offset_bytes
                    && dst.wrapping_add(*len) == p.dst
                    && *len + p.len <= config::DEVICE_COPY_BYTES_MAX =>
            {
                *len += p.len
            }
            _ => ranges.push((p.src_offset_bytes, p.dst, p.len)),
        }
        ks.push(k);
    }
    // Every batch is queued before any is waited for: a CUDA save's copies
    // all sit on the stream when its done event is recorded (regions/cuda.rs).
    let mut queued = Vec::new();
    for (region, ranges, ks) in by_region {
        // SAFETY: the region is kept alive by the caller's Arc for the whole
        // copy; every range is made of pieces' own disjoint parts of the
        // lease and their bounds-checked sources (Pieces' invariant), and
        // none is touched before finish_batch below returned.
        if unsafe { (*region).queue_batch(&ranges) } {
            queued.push(region);
            for k in ks {
                pieces.0[k].staged = true;
            }
        }
    }
    queued
}

/// Runs of consecutive pieces of about [`COPY_PIECE_BYTES`], claimed by
/// the copy threads one at a time, so a thousand small tensors cost a few
/// claims (and stop checks), not one each: run `r` is pieces
/// `runs[r]..runs[r + 1]`.
pub(super) fn runs_of(pieces: &Pieces) -> Vec<usize> {
    let mut runs = Vec::with_capacity(pieces.0.len().min(1024) + 1);
    let mut acc = 0usize;
    runs.push(0usize);
    if pieces.0.is_empty() {
        return runs;
    }
    for (k, p) in pieces.0.iter().enumerate() {
        if acc > 0 && acc + p.len > COPY_PIECE_BYTES {
            runs.push(k);
            acc = 0;
        }
        acc += p.len.max(1);
    }
    runs.push(pieces.0.len());
    runs
}

/// Runs `f` on every piece on [`config::COPY_THREADS`] threads (the
/// caller's included), returning its result per piece; stops early (None)
/// when `stop`, asked by the caller's thread between pieces, says so.
fn run_pieces<T: Copy + Default + Send>(
    pieces: &Pieces,
    stop: &(dyn Fn() -> bool + Sync),
    f: &(dyn Fn(&Piece) -> T + Sync),
) -> Option<Vec<T>> {
    run_runs(pieces, &runs_of(pieces), stop, f, &|_| {})
}

/// [`run_pieces`] over the given runs, calling `run_done(r)` as each run
/// ends (in whatever order the threads end them).
pub(super) fn run_runs<T: Copy + Default + Send>(
    pieces: &Pieces,
    runs: &[usize],
    stop: &(dyn Fn() -> bool + Sync),
    f: &(dyn Fn(&Piece) -> T + Sync),
    run_done: &(dyn Fn(usize) + Sync),
) -> Option<Vec<T>> {
    let next = AtomicUsize::new(0);
    let stopped = AtomicBool::new(false);
    let work = |checker: bool| -> Vec<(usize, T)> {
        let mut out = Vec::new();
        loop {
            if stopped.load(Ordering::Relaxed) {
                return out;
            }
            if checker && stop() {
                stopped.store(true, Ordering::Relaxed);
                return out;
            }
            let r = next.fetch_add(1, Ordering::Relaxed);
            let (Some(&a), Some(&b)) = (runs.get(r), runs.get(r + 1)) else { return out };
            out.extend((a..b).map(|k| (k, f(&pieces.0[k]))));
            // The run's copies visible to other threads (the writer, once
            // told; the caller, after the join): one fence per run, not per
            // piece (Region::copy_out).
            store_fence();
            run_done(r);
        }
    };
    let mut results = vec![T::default(); pieces.0.len()];
    std::thread::scope(|s| {
        // No helper for a single run: spawning one costs more than it copies.
        let helpers: Vec<_> = (1..config::COPY_THREADS.min(runs.len().saturating_sub(1)))
            .map(|i| {
                std::thread::Builder::new()
                    .name(format!("ckpt-copy-{i}"))
                    .spawn_scoped(s, || {
                        idle_priority();
                        work(false)
                    })
                    .expect("spawning a copy thread")
            })
            .collect();
        for (k, c) in work(true) {
            results[k] = c;
        }
        for h in helpers {
            for (k, c) in h.join().expect("copy thread panicked") {
                results[k] = c;
            }
        }
    });
    (!stopped.load(Ordering::Relaxed)).then_some(results)
}

/// Puts the calling thread in the SCHED_IDLE class: it runs only on a core
/// nothing else wants. The helper copy threads use it so that a trainer
/// blocked waiting for Released lends them its core, while a trainer that
/// computes (tensors resident in shared memory, or the checksum pass after
/// the release) is never slowed by them. Refusal only costs that courtesy.
fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: changes only the calling thread's scheduling policy (pid 0);
    // `param` is a valid sched_param for SCHED_IDLE.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
}

/// Copies every tensor into the lease (headers written first); false when
/// stopped early because `stop` said so. Only the copy: the trainer waits
/// for it, so the checksums come after the release ([`checksum`]).
pub fn copy_into(layout: &Layout, sources: &[Source], lease: &mut Lease, stop: &(dyn Fn() -> bool + Sync)) -> bool {
    layout.write_headers(lease.as_mut_slice());
    let mut pieces = pieces_of(layout, Some(sources), lease);
    copy_batches(&mut pieces);
    copy_pieces(&pieces, stop)
}

/// Copies as [`copy_into`] and returns each tensor's crc32c, computed from
/// each source block right after it is copied, while it is still in this
/// core's cache: one pass over memory instead of a copy pass and a checksum
/// pass, for a save whose trainer does not wait for Released (lazy
/// release); the copy takes longer. None when stopped early.
/// With an incremental layout, each tensor's digest too, hashed in the
/// same pass ([`Region::copy_out_summed`]).
pub fn copy_and_checksum_into(
    layout: &Layout,
    sources: &[Source],
    lease: &mut Lease,
    stop: &(dyn Fn() -> bool + Sync),
) -> Option<Sums> {
    layout.write_headers(lease.as_mut_slice());
    let mut pieces = pieces_of(layout, Some(sources), lease);
    copy_batches(&mut pieces);
    if layout.opts.incremental {
        let sums = run_pieces(&pieces, stop, &|p| p.copy_summed(true))?;
        return Some(fold_sums(layout, &pieces, &sums));
    }
    let piece_crcs = run_pieces(&pieces, stop, &|p| p.copy(true))?;
    Some(Sums { crcs: fold_crcs(layout, &pieces, &piece_crcs), digests: None })
}

/// Copies `ranges` (region, offset, length) end to end to the start of the
/// lease (a SaveFile's bytes: one range, or a SaveFilePieces' pieces) and
/// zeroes the rest of the lease, so a write of whole blocks carries no stale
/// bytes; device regions' ranges go in one batch per region (after the
/// fence the session set); false when stopped early.
pub fn copy_ranges_into(ranges: &[(&Region, u64, u64)], lease: &mut Lease, stop: &(dyn Fn() -> bool + Sync)) -> bool {
    let total: u64 = ranges.iter().map(|&(_, _, len)| len).sum();
    assert!(lease.len_bytes() >= total, "lease smaller than the ranges");
    lease.as_mut_slice()[total as usize..].fill(0);
    let base = lease.as_mut_ptr();
    let mut pieces = Vec::new();
    let mut at = 0usize;
    for &(region, offset_bytes, len_bytes) in ranges {
        region.contains(offset_bytes, len_bytes).expect("bounds checked before the copy");
        // The pointer stays inside the lease: at + len ≤ total ≤ its length.
        split_range(&mut pieces, 0, region as *const Region, offset_bytes, base.wrapping_add(at), len_bytes as usize);
        at += len_bytes as usize;
    }
    let mut pieces = Pieces(pieces);
    copy_batches(&mut pieces);
    copy_pieces(&pieces, stop)
}

fn copy_pieces(pieces: &Pieces, stop: &(dyn Fn() -> bool + Sync)) -> bool {
    run_pieces(pieces, stop, &|p| p.copy(false)).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    use ckpt_wire::TensorDesc;

    use crate::save::checks::check_sizes;
    use crate::save::error::SaveError;
    use crate::save::plan::plan_save;

    fn d(name: &str, region_id: u32, off: u64, len: u64) -> TensorDesc {
        TensorDesc {
            name: name.into(),
            dtype: "U8".into(),
            shape: vec![len],
            region_id,
            offset_bytes: off,
            len_bytes: len,
        }
    }

    #[test]
    fn a_region_truncated_before_or_during_a_copy_fails_the_save_instead_of_the_sidecar() {
        use crate::memory::regions::{test_segment, truncate_segment, unlink_segment};
        // Two tensors of 4 MiB, so both copy threads read the segment.
        let len = 8usize << 20;
        let (name, fd) = test_segment(len, |i| (i % 13) as u8 + 1);
        // SAFETY: getuid has no preconditions.
        let region = Arc::new(Region::open_shm(1, &name, len as u64, unsafe { libc::getuid() }, false).unwrap());
        unlink_segment(&name);
        let regions = HashMap::from([(1, region.clone())]);
        let tensors = [d("a", 1, 0, 4 << 20), d("b", 1, 4 << 20, 4 << 20)];
        let (layout, sources) = plan_save(&tensors, &[], &regions, Default::default(), None).unwrap();
        let staging = crate::memory::staging::Staging::new(layout.staging_len).unwrap();
        check_sizes(&sources).unwrap();
        // Truncated after the checks (as a client may, during the copy): the
        // copy runs to its end on zero pages and the save is refused.
        truncate_segment(&fd, 1 << 20);
        for lazy in [false, true] {
            let (mut lease, _) = staging.acquire(layout.staging_len, "t", || None).unwrap();
            let copied = if lazy {
                copy_and_checksum_into(&layout, &sources, &mut lease, &|| false).is_some()
            } else {
                copy_into(&layout, &sources, &mut lease, &|| false)
            };
            assert!(copied);
            let e = check_sizes(&sources).unwrap_err();
            assert!(matches!(e, SaveError::BadRegion(_)) && e.to_string().contains("truncated"), "{e}");
            let r = layout.tensor_range(0);
            assert!(lease.as_slice()[r.start + (1 << 20)..r.end].iter().all(|&b| b == 0));
        }
        // A SaveFile's copy of one range is armed too (a fresh segment: the
        // first one's tail is zero pages by now).
        let (name, fd) = test_segment(len, |_| 9);
        // SAFETY: as above.
        let region = Region::open_shm(2, &name, len as u64, unsafe { libc::getuid() }, false).unwrap();
        unlink_segment(&name);
        truncate_segment(&fd, 1 << 20);
        let (mut lease, _) = staging.acquire(len as u64, "f", || None).unwrap();
        assert!(copy_ranges_into(&[(&region, 0, len as u64)], &mut lease, &|| false));
        assert!(
            lease.as_slice()[..1 << 20].iter().all(|&b| b == 9)
                && lease.as_slice()[1 << 20..len].iter().all(|&b| b == 0)
        );
        assert!(region.as_shm().unwrap().was_truncated() && region.check_intact().is_err());
    }
}
