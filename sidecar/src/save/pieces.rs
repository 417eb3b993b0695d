//! The work division of a copy or checksum pass: a save's image cut into
//! pieces of at most [`COPY_PIECE_BYTES`] (one digest block each), grouped
//! in runs that [`config::COPY_THREADS`] threads claim one at a time (the
//! caller's and the kept helpers at idle priority: [`crate::save::helpers`]).
//!
//! Invariants: every piece's destination is its own disjoint range of a
//! lease its caller holds; its source range was bounds-checked when the
//! save was planned, and its region is kept alive by the caller's
//! `Arc<Region>` for the whole pass ([`Pieces`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ckpt_store::image::Layout;

use crate::config::{self, COPY_PIECE_BYTES};
use crate::memory::regions::shm::TRIO_BYTES_MAX;
use crate::memory::regions::{store_fence, Region};
use crate::memory::staging::Lease;
use crate::save::helpers::lend;
use crate::save::plan::Source;

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

/// Copies pieces `a..b` of `pieces` with their crc32c ([`Piece::copy`]
/// with crc) into `out` as (piece, crc): three small pieces of one length
/// and region at a time side by side, where they suit it
/// ([`Region::copy_out3`]: a thousand tensors of a few KiB copy at about
/// the speed of one large one).
pub(super) fn copy_crc_run(pieces: &Pieces, a: usize, b: usize, out: &mut Vec<(usize, u32)>) {
    let mut k = a;
    while k < b {
        if let Some(crcs) = pieces.0.get(k..(k + 3).min(b)).and_then(copy_trio) {
            out.extend((k..k + 3).zip(crcs));
            k += 3;
        } else {
            out.push((k, pieces.0[k].copy(true)));
            k += 1;
        }
    }
}

/// Three pieces copied side by side with their crc32c, or None (nothing
/// copied) when they are not three unstaged pieces of one length (at most
/// [`TRIO_BYTES_MAX`]) in one region, or the region does not suit it.
fn copy_trio(ps: &[Piece]) -> Option<[u32; 3]> {
    let [x, y, z] = ps else { return None };
    let alike = |p: &Piece| !p.staged && p.region == x.region && p.len == x.len;
    if x.region.is_null() || x.len > TRIO_BYTES_MAX || !alike(x) || !alike(y) || !alike(z) {
        return None;
    }
    // SAFETY: each piece's destination is its own part of the lease and
    // its source range was bounds-checked; the region is alive for the
    // whole copy (Pieces' invariant).
    unsafe { (*x.region).copy_out3([x, y, z].map(|p| p.src_offset_bytes), [x, y, z].map(|p| p.dst), x.len) }
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
pub(super) fn split_range(
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

/// The crc32c (with `crc`) and digest of a piece's staged bytes, in one
/// pass (block by block: checksummed, then hashed while in cache).
pub(super) fn sum_of_staged(p: &Piece, crc: bool) -> (u32, u128) {
    // SAFETY: dst..dst+len is this piece's own part of the lease, copied
    // before and not written while summed (as crc_of_staged).
    crate::memory::regions::sum_of(unsafe { std::slice::from_raw_parts(p.dst, p.len) }, crc)
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
pub(super) fn run_pieces<T: Copy + Default + Send>(
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
    run_runs_with(pieces, runs, stop, &|ps, a, b, out| out.extend((a..b).map(|k| (k, f(&ps.0[k])))), run_done)
}

/// The work of one run, given whole: `per_run(pieces, a, b, out)` does
/// pieces `a..b` and pushes (piece, result) for each ([`run_runs_with`]).
pub(super) type PerRun<'a, T> = dyn Fn(&Pieces, usize, usize, &mut Vec<(usize, T)>) + Sync + 'a;

/// [`run_runs`] with the work of a run given whole ([`PerRun`]).
pub(super) fn run_runs_with<T: Copy + Default + Send>(
    pieces: &Pieces,
    runs: &[usize],
    stop: &(dyn Fn() -> bool + Sync),
    per_run: &PerRun<'_, T>,
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
            per_run(pieces, a, b, &mut out);
            // The run's copies visible to other threads (the writer, once
            // told; the caller, after the join): one fence per run, not per
            // piece (Region::copy_out).
            store_fence();
            run_done(r);
        }
    };
    // No helper for a single run: it would only wait for the caller's.
    let helpers = config::COPY_THREADS.min(runs.len().saturating_sub(1)).saturating_sub(1);
    let theirs: Mutex<Vec<(usize, T)>> = Mutex::new(Vec::new());
    let help = || {
        let got = work(false);
        theirs.lock().unwrap_or_else(|e| e.into_inner()).extend(got);
    };
    let mine = lend(helpers, &help, || work(true));
    let mut results = vec![T::default(); pieces.0.len()];
    for (k, c) in mine.into_iter().chain(theirs.into_inner().unwrap_or_else(|e| e.into_inner())) {
        results[k] = c;
    }
    (!stopped.load(Ordering::Relaxed)).then_some(results)
}
