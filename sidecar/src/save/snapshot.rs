//! The snapshot stage: check a Save against protocol.md, plan its file
//! image, lease staging for it, copy every tensor from the client's regions
//! into the image (on [`config::COPY_THREADS`] threads), release the
//! client, checksum the staged image (same threads; off the trainer's
//! stall), and hand it to the committer.
//!
//! Invariants:
//! - nothing is copied before every check passed; no descriptor reaches a
//!   copy unless its bytes lie inside a registered region (checked again,
//!   with overflow checks, when the source pointer is formed);
//! - a save is released only if its client is still connected when the
//!   copy ends; otherwise it is aborted, its staging freed, nothing written
//!   — unless the save was handed over (every tensor in a hand-over region,
//!   [`Region::hands_over`]): its bytes are final once sent, so it is
//!   copied and committed whether or not its client is still there;
//! - per session, saves reach the committer in the order they were received.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ckpt_wire::{Blob, ErrorCode, Reply, TensorDesc, TensorDescIn, Unchanged};
use tracing::{info, info_span, warn};

use crate::config::{self, COPY_BLOCK_BYTES, COPY_PIECE_BYTES};
use crate::memory::regions::{store_fence, BatchMark, Region};
use crate::memory::staging::{Lease, StagingError};
use crate::state::jobs::Flight;
use crate::state::jobs::{Fill, Job, Part, Sums, Work};
use crate::state::reply::Replies;
use crate::state::{DaemonState, Phase};
use ckpt_store::catalog;
use ckpt_store::format::{self, Dtype};
use ckpt_store::image::{self, Layout, LayoutOptions, TensorSpec};
use ckpt_store::progress::{Filler, Progress};

#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    BadRegion(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("the sidecar is shutting down; no new saves")]
    ShuttingDown,
    #[error("aborted: {0}")]
    Aborted(&'static str),
    #[error("step {step}: {dir}")]
    ReadOnly { step: u64, dir: ckpt_store::read_only::ReadOnlyDir },
}

impl SaveError {
    pub fn code(&self) -> ErrorCode {
        match self {
            SaveError::BadRequest(_) => ErrorCode::BadRequest,
            SaveError::BadRegion(_) => ErrorCode::BadRegion,
            SaveError::TooLarge(_) => ErrorCode::TooLarge,
            SaveError::ShuttingDown | SaveError::Aborted(_) => ErrorCode::ShuttingDown,
            SaveError::ReadOnly { .. } => ErrorCode::Io,
        }
    }
}

/// Where one tensor's bytes come from.
#[derive(Clone)]
pub struct Source {
    pub region: Option<Arc<Region>>,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

/// A tensor descriptor as the checks read it: owned (a Load) or borrowing
/// its frame (a Save, [`ckpt_wire::decode_save`]).
pub trait Desc {
    fn name(&self) -> &str;
    fn dtype(&self) -> &str;
    fn shape(&self) -> &[u64];
    fn region_id(&self) -> u32;
    fn offset_bytes(&self) -> u64;
    fn len_bytes(&self) -> u64;
}

impl Desc for TensorDesc {
    fn name(&self) -> &str {
        &self.name
    }
    fn dtype(&self) -> &str {
        &self.dtype
    }
    fn shape(&self) -> &[u64] {
        &self.shape
    }
    fn region_id(&self) -> u32 {
        self.region_id
    }
    fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }
    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
}

impl Desc for TensorDescIn<'_> {
    fn name(&self) -> &str {
        self.name
    }
    fn dtype(&self) -> &str {
        self.dtype
    }
    fn shape(&self) -> &[u64] {
        &self.shape
    }
    fn region_id(&self) -> u32 {
        self.region_id
    }
    fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }
    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
}

/// Parses a wire dtype and checks `len_bytes == size(dtype) × Π shape`.
pub fn check_desc_shape(d: &impl Desc) -> Result<Dtype, String> {
    let dtype = Dtype::parse(d.dtype()).map_err(|e| format!("tensor {:?}: {e}", d.name()))?;
    let want = format::tensor_len_bytes(dtype, d.shape())
        .ok_or_else(|| format!("tensor {:?}: shape {:?} of {} overflows", d.name(), d.shape(), d.dtype()))?;
    if want != d.len_bytes() {
        return Err(format!(
            "tensor {:?}: len_bytes {} but {} {:?} is {} bytes",
            d.name(),
            d.len_bytes(),
            d.dtype(),
            d.shape(),
            want
        ));
    }
    Ok(dtype)
}

/// Checks that no two non-empty descriptors overlap within one region.
pub fn check_no_overlap(tensors: &[impl Desc]) -> Result<(), String> {
    let mut spans: Vec<(u32, u64, u64, usize)> = tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| t.len_bytes() > 0)
        .map(|(i, t)| (t.region_id(), t.offset_bytes(), t.offset_bytes().saturating_add(t.len_bytes()), i))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if a.0 == b.0 && b.1 < a.2 {
            return Err(format!(
                "tensors {:?} and {:?} overlap in region {}",
                tensors[a.3].name(),
                tensors[b.3].name(),
                a.0
            ));
        }
    }
    Ok(())
}

/// The checks of a Save's blobs (count, names, sizes).
pub fn check_blobs(blobs: &[Blob]) -> Result<(), SaveError> {
    if blobs.len() > config::BLOBS_PER_SAVE_MAX {
        return Err(SaveError::BadRequest(format!(
            "{} blobs; at most {} per save",
            blobs.len(),
            config::BLOBS_PER_SAVE_MAX
        )));
    }
    let blob_refs: Vec<image::Blob> = blobs.iter().map(|b| image::Blob { name: &b.name, bytes: &b.bytes }).collect();
    image::validate_blobs(&blob_refs).map_err(|e| SaveError::BadRequest(e.to_string()))
}

/// Every check of protocol.md's Save section that needs no shared state;
/// returns the planned image (at base 0) and each spec's source.
///
/// `changed`: with `opts.incremental`, the tensors that changed at the
/// previous save (the rest go into stable shards, `Layout::plan_with`).
pub fn plan_save(
    tensors: &[impl Desc],
    blobs: &[Blob],
    regions: &HashMap<u32, Arc<Region>>,
    opts: LayoutOptions,
    changed: Option<&std::collections::HashSet<String>>,
) -> Result<(Layout, Vec<Source>), SaveError> {
    if tensors.len() > config::TENSORS_PER_REQUEST_MAX {
        return Err(SaveError::BadRequest(format!(
            "{} tensors; at most {} per save",
            tensors.len(),
            config::TENSORS_PER_REQUEST_MAX
        )));
    }
    check_blobs(blobs)?;
    let mut specs = Vec::with_capacity(tensors.len());
    let mut sources = Vec::with_capacity(tensors.len());
    for d in tensors {
        format::validate_tensor_name(d.name()).map_err(|e| SaveError::BadRequest(e.to_string()))?;
        let dtype = check_desc_shape(d).map_err(SaveError::BadRequest)?;
        let region = if d.len_bytes() == 0 {
            None
        } else {
            let r = regions.get(&d.region_id()).ok_or_else(|| {
                SaveError::BadRegion(format!("tensor {:?}: region {} is not registered", d.name(), d.region_id()))
            })?;
            r.contains(d.offset_bytes(), d.len_bytes())
                .map_err(|e| SaveError::BadRegion(format!("tensor {:?}: {e}", d.name())))?;
            Some(r.clone())
        };
        specs.push(TensorSpec { name: d.name().to_string(), dtype, shape: d.shape().to_vec() });
        sources.push(Source { region, offset_bytes: d.offset_bytes(), len_bytes: d.len_bytes() });
    }
    check_no_overlap(tensors).map_err(SaveError::BadRequest)?;
    let layout = Layout::plan_with(specs, opts, changed).map_err(|e| SaveError::BadRequest(e.to_string()))?;
    Ok((layout, sources))
}

/// A piece of one tensor, copied or checksummed by one thread.
struct Piece {
    tensor_idx: usize,
    /// The region the piece is copied from; null in a checksum pass.
    region: *const Region,
    /// Where in the region (bounds checked in plan_save).
    src_offset_bytes: u64,
    dst: *mut u8,
    len: usize,
    /// Already copied by its region's batch ([`copy_batches`]).
    staged: bool,
}

// A copy piece is one digest block: a tensor's pieces start at its first
// byte and are at most one block long, so each piece's hash is a block's.
const _: () = assert!(COPY_PIECE_BYTES == ckpt_store::digest::DIGEST_BLOCK_BYTES);

impl Piece {
    /// [`Piece::copy`] that also returns the piece's digest (one block of
    /// `ckpt_store::digest`), hashed while its bytes are in cache.
    fn copy_summed(&self, crc: bool) -> (u32, u128) {
        if self.staged {
            return sum_of_staged(self, crc);
        }
        // SAFETY: as in Piece::copy.
        match unsafe { self.region.as_ref() } {
            Some(r) => unsafe { r.copy_out_summed(self.src_offset_bytes, self.dst, self.len, crc) },
            None => unreachable!("a checksum piece is never copied"),
        }
    }

    /// Copies this piece out of its region into its part of the lease;
    /// with `crc`, returns the crc32c of the bytes.
    fn copy(&self, crc: bool) -> u32 {
        if self.staged {
            // SAFETY: dst..dst+len is this piece's own part of the lease,
            // written by the completed batch copy.
            return if crc { crc32c::crc32c(unsafe { std::slice::from_raw_parts(self.dst, self.len) }) } else { 0 };
        }
        // SAFETY: a non-null `region` is kept alive by the caller's Arc for
        // the whole copy; dst..dst+len is this piece's own part of the lease
        // (Pieces' invariant); the source range was bounds-checked when the
        // save was planned.
        match unsafe { self.region.as_ref() } {
            Some(r) => unsafe { r.copy_out(self.src_offset_bytes, self.dst, self.len, crc) },
            None => unreachable!("a checksum piece is never copied"),
        }
    }
}

/// Raw pointers of the pieces, shared by the copy threads.
struct Pieces(Vec<Piece>);
// SAFETY: every piece's destination is a disjoint range of a lease the
// copying session holds exclusively; sources are regions kept alive by the
// Arc<Region>s in `sources` for the whole copy; each piece is taken by
// exactly one thread (atomic counter).
unsafe impl Sync for Pieces {}

/// Splits every tensor's range of the lease into pieces of at most
/// [`COPY_PIECE_BYTES`], so both threads share even one large tensor; with
/// `sources`, each piece also gets its region and offset there.
fn pieces_of(layout: &Layout, sources: Option<&[Source]>, lease: &mut Lease) -> Pieces {
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
fn queue_batches_in(pieces: &mut Pieces, within: std::ops::Range<usize>) -> Vec<*const Region> {
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
fn runs_of(pieces: &Pieces) -> Vec<usize> {
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
fn run_runs<T: Copy + Default + Send>(
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

/// The tensor checksums of the image copied into the lease, computed from
/// the staged bytes themselves (no one writes them after the copy), on
/// [`config::COPY_THREADS`] threads.
/// With an incremental layout, each tensor's digest too, in the same
/// pass (each block hashed right after its checksum, while in cache).
pub fn checksum(layout: &Layout, lease: &mut Lease) -> Sums {
    let pieces = pieces_of(layout, None, lease);
    staged_sums(layout, &pieces, None)
}

/// The checksums (and digests, incremental) of staged pieces, by run
/// (`runs`) or by the default runs.
fn staged_sums(layout: &Layout, pieces: &Pieces, runs: Option<&[usize]>) -> Sums {
    let default_runs;
    let runs = match runs {
        Some(r) => r,
        None => {
            default_runs = runs_of(pieces);
            &default_runs
        }
    };
    if layout.opts.incremental {
        let sums = run_runs(pieces, runs, &|| false, &|p| sum_of_staged(p, true), &|_| {})
            .expect("a checksum pass is never stopped");
        return fold_sums(layout, pieces, &sums);
    }
    let piece_crcs =
        run_runs(pieces, runs, &|| false, &crc_of_staged, &|_| {}).expect("a checksum pass is never stopped");
    Sums { crcs: fold_crcs(layout, pieces, &piece_crcs), digests: None }
}

/// The crc32c (with `crc`) and digest of a piece's staged bytes, in one
/// pass (block by block: checksummed, then hashed while in cache).
fn sum_of_staged(p: &Piece, crc: bool) -> (u32, u128) {
    // SAFETY: dst..dst+len is this piece's own part of the lease, copied
    // before and not written while summed (as crc_of_staged).
    crate::memory::regions::sum_of(unsafe { std::slice::from_raw_parts(p.dst, p.len) }, crc)
}

/// The crc32c of a piece's staged bytes, block by block.
fn crc_of_staged(p: &Piece) -> u32 {
    let mut crc = 0u32;
    let mut at = 0;
    while at < p.len {
        let n = (p.len - at).min(COPY_BLOCK_BYTES);
        // SAFETY: dst..dst+len is this piece's own part of the lease,
        // copied before and not written while checksummed (Pieces'
        // invariant; the lease is held by the caller, or by the committer
        // with the copy's filler still running: FedCopy).
        let block = unsafe { std::slice::from_raw_parts(p.dst.add(at), n) };
        crc = crc32c::crc32c_append(crc, block);
        at += n;
    }
    crc
}

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
    /// A lazily released incremental copy's sums per piece, whose pieces
    /// of volatile tensors still lack their digests ([`FedCopy::complete`]).
    pending: Option<Vec<(u32, u128)>>,
}

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
    /// after its checks ([`FedCopy::checksum`], `Fill`).
    pub fn copy(&mut self, layout: &Layout, crc: bool, stop: &(dyn Fn() -> bool + Sync)) -> Option<Option<Sums>> {
        if crc && layout.opts.incremental {
            // Digests in the copy's pass only for tensors of stable shards
            // (their links wait for them); a volatile tensor's digest only
            // serves the next save, so it is taken after the release
            // ([`FedCopy::complete`]), off the trainer's stall.
            let stable = stable_tensors(layout);
            let sums = self.copy_with(layout, stop, &|p| {
                if stable[p.tensor_idx] {
                    p.copy_summed(true)
                } else {
                    (p.copy(true), 0)
                }
            })?;
            let crcs: Vec<u32> = sums.iter().map(|s| s.0).collect();
            let out = Sums { crcs: fold_crcs(layout, &self.pieces, &crcs), digests: None };
            self.pending = Some(sums);
            return Some(Some(out));
        }
        let crcs = self.copy_with(layout, stop, &|p| p.copy(crc))?;
        Some(crc.then(|| Sums { crcs: fold_crcs(layout, &self.pieces, &crcs), digests: None }))
    }

    /// The copy of [`FedCopy::copy`], `f` per piece (copy, and what it sums).
    fn copy_with<T: Copy + Default + Send>(
        &mut self,
        _layout: &Layout,
        stop: &(dyn Fn() -> bool + Sync),
        f: &(dyn Fn(&Piece) -> T + Sync),
    ) -> Option<Vec<T>> {
        let progress = &self.progress;
        let batched = self.pieces.0.iter().any(|p| {
            // SAFETY: a non-null region is kept alive by the caller's Arcs (Pieces' invariant).
            unsafe { p.region.as_ref() }.is_some_and(Region::copies_in_batches)
        });
        if !batched {
            return run_runs(&self.pieces, &self.runs, stop, f, &|r| progress.done(r));
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
            // SAFETY (this closure): a queued region is alive for the whole copy (Pieces' invariant).
            marks.push(queued.iter().map(|&r| (r, unsafe { (*r).mark_batch() })).collect());
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
            let Some(got) = run_runs(&self.pieces, &runs, stop, f, &|r| progress.done(r0 + r)) else {
                wait_from(&marks, w + 1);
                return None;
            };
            piece_crcs[k0..k1].copy_from_slice(&got[k0..k1]);
        }
        Some(piece_crcs)
    }

    /// The sums of a copy made with its checksums, completed after the
    /// release: a lazily released incremental copy's volatile tensors get
    /// their digests from the staged bytes (on the copy threads); any other
    /// copy's sums are returned as they are.
    pub fn complete(&mut self, layout: &Layout, sums: Sums) -> Sums {
        let Some(mut pending) = self.pending.take() else { return sums };
        let stable = stable_tensors(layout);
        let rest = run_runs(
            &self.pieces,
            &self.runs,
            &|| false,
            &|p| if stable[p.tensor_idx] { 0 } else { sum_of_staged(p, false).1 },
            &|_| {},
        )
        .expect("a digest pass is never stopped");
        for ((p, s), d) in self.pieces.0.iter().zip(&mut pending).zip(rest) {
            if !stable[p.tensor_idx] {
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

/// Folds the pieces' crcs into each tensor's crc (a tensor's pieces are
/// consecutive and in order: tensor order, or staging order).
fn fold_crcs(layout: &Layout, pieces: &Pieces, piece_crcs: &[u32]) -> Vec<u32> {
    let mut crcs = vec![0u32; layout.specs.len()];
    let mut prev = usize::MAX;
    for (p, &c) in pieces.0.iter().zip(piece_crcs) {
        // Pieces come in tensor order: a tensor's first piece is its crc so far.
        crcs[p.tensor_idx] =
            if p.tensor_idx == prev { ckpt_store::crc::combine(crcs[p.tensor_idx], c, p.len as u64) } else { c };
        prev = p.tensor_idx;
    }
    crcs
}

/// Whether each tensor of `layout` lies in a stable shard.
fn stable_tensors(layout: &Layout) -> Vec<bool> {
    let mut v = vec![false; layout.specs.len()];
    for sh in layout.shards.iter().filter(|s| s.stable) {
        for &i in &sh.tensors {
            v[i] = true;
        }
    }
    v
}

/// [`fold_crcs`] for checksums and digests: each tensor's digest combines
/// its pieces' (one digest block each, in order); a tensor with no piece
/// (empty) has the digest of no blocks.
fn fold_sums(layout: &Layout, pieces: &Pieces, sums: &[(u32, u128)]) -> Sums {
    let crcs: Vec<u32> = sums.iter().map(|s| s.0).collect();
    let crcs = fold_crcs(layout, pieces, &crcs);
    let mut blocks: Vec<Vec<u128>> = vec![Vec::new(); layout.specs.len()];
    for (p, s) in pieces.0.iter().zip(sums) {
        blocks[p.tensor_idx].push(s.1);
    }
    let digests = blocks.into_iter().map(ckpt_store::digest::combine).collect();
    Sums { crcs, digests: Some(digests) }
}

/// Checks that every source region still holds its registered bytes and
/// was not found changed under the copy ([`Region::check_intact`]).
fn check_sizes(sources: &[Source]) -> Result<(), SaveError> {
    // Once per region (one fstat each), not once per tensor: a thousand
    // tensors usually lie in one or two regions.
    let mut regions: Vec<&Arc<Region>> = sources.iter().filter_map(|s| s.region.as_ref()).collect();
    regions.sort_unstable_by_key(|r| Arc::as_ptr(r));
    regions.dedup_by(|a, b| Arc::ptr_eq(a, b));
    regions.into_iter().try_for_each(|r| r.check_intact()).map_err(|e| SaveError::BadRegion(e.to_string()))
}

/// Why a save of legacy-IPC CUDA memory is aborted when its client goes
/// before release: the bytes are undefined once the exporter died (a VMM
/// allocation's are not), so a partial copy is never committed.
pub const CLIENT_GONE_LEGACY_CUDA: &str =
    "the client disconnected before release, and its CUDA memory is shared by legacy IPC, undefined once the exporting process is gone (VMM allocations are not): the partial snapshot is not committed";

/// A Save's tensors as its session read them.
#[derive(Clone, Copy)]
pub enum SaveTensors<'a> {
    /// Decoded, with the bytes of their encoded list when the frame was
    /// read in parts ([`ckpt_wire::SaveHead::rest`]).
    Decoded { tensors: &'a [TensorDescIn<'a>], encoded: Option<&'a [u8]> },
    /// Not decoded: the encoded list of a kept plan, found byte for byte in
    /// the frame (`save_plan::SavePlans::kept_list`).
    Kept(&'a [u8]),
}

/// What plans a save's image and sources: [`plan_save`] itself, or a
/// session's cache of earlier plans (`save_plan::SavePlans`, which uses
/// this module, hence the trait rather than the type here).
pub trait Planner {
    /// `changed` is [`plan_save`]'s; `opts.history_gen` names it, so a
    /// plan kept under another history is not reused.
    fn plan(
        &mut self,
        tensors: SaveTensors<'_>,
        blobs: &[Blob],
        regions: &HashMap<u32, Arc<Region>>,
        opts: LayoutOptions,
        changed: Option<&std::collections::HashSet<String>>,
    ) -> Result<(Layout, Vec<Source>), SaveError>;
}

/// Runs one Save for a session: checks, waits for staging, copies, replies
/// Released (or Failed), and queues the image for the committer.
#[allow(clippy::too_many_arguments)]
pub fn run_save(
    state: &DaemonState,
    replies: &Arc<Replies>,
    regions: &HashMap<u32, Arc<Region>>,
    plans: &mut dyn Planner,
    id: u64,
    step: u64,
    tensors: SaveTensors<'_>,
    blobs: Vec<Blob>,
    lazy_release: bool,
    part: Option<Part>,
    unchanged: Option<Unchanged>,
) {
    let t_received = Instant::now();
    let key = match part {
        Some(p) => Flight::Part(step, p.rank),
        None => Flight::Step(step),
    };
    let fail = |e: SaveError| {
        info!(step, code = ?e.code(), "save refused: {e}");
        replies.send(&Reply::Failed { id, step, code: e.code(), reason: e.to_string() });
    };
    // Draining: no new saves; but a handed-over save that a client sent
    // before it went is served (checked once planned, below).
    if state.is_aborting() || (state.is_draining() && !replies.is_gone()) {
        return fail(SaveError::ShuttingDown);
    }
    if let Some(dir) = &state.read_only {
        // Before anything is planned or copied.
        return fail(SaveError::ReadOnly { step, dir: dir.clone() });
    }
    if step > format::STEP_MAX {
        return fail(SaveError::BadRequest(format!("step {step} is above the largest step {}", format::STEP_MAX)));
    }
    let mut opts = state.layout_opts;
    if let Some(p) = part {
        if p.world_size == 0 || p.rank >= p.world_size {
            return fail(SaveError::BadRequest(format!(
                "rank {} of world size {}: need 0 <= rank < world_size",
                p.rank, p.world_size
            )));
        }
        (opts.rank, opts.world_size) = (p.rank, p.world_size);
        if state.shared_dir.is_some() && state.read_opts.node.is_none() {
            // Several nodes: every part goes into the one shared directory
            // (node-local: into this node's own directories, striped).
            opts.n_dirs = 1;
        }
    }
    let history = if opts.incremental { state.history() } else { Default::default() };
    opts.history_gen = history.generation;
    let (layout, mut sources) = match plans.plan(tensors, &blobs, regions, opts, history.changed.as_deref()) {
        Ok(x) => x,
        Err(e) => return fail(e),
    };
    if let Some(u) = &unchanged {
        if let Err(e) = u.check(layout.specs.len()) {
            return fail(SaveError::BadRequest(e));
        }
    }
    let plan_seconds = t_received.elapsed().as_secs_f64();
    // Handed over: every byte it reads lies in a hand-over region (or it
    // reads none), so what it copies is final once sent, and the save is
    // the sidecar's even if its client goes before Released.
    let handed_over = sources.iter().all(|s| s.region.as_ref().is_none_or(|r| r.hands_over()));
    if state.is_draining() && !handed_over {
        return fail(SaveError::ShuttingDown);
    }
    let image_bytes = layout.staging_len;
    if image_bytes > state.staging.budget_bytes() {
        return fail(SaveError::TooLarge(format!(
            "step {step}: the file image needs {image_bytes} bytes, more than the whole staging budget of {} bytes (raise --staging)",
            state.staging.budget_bytes()
        )));
    }
    // A part of several nodes is committed in the shared directory.
    let commit_dir = if part.is_some() { state.read_dir() } else { state.primary() };
    if catalog::is_committed(commit_dir, step) {
        return fail(SaveError::BadRequest(format!(
            "step {step} is already committed in {}; to save it again, roll back to an earlier step first (rollback in the shim, or ckpt-sidecar rollback DIR --to STEP)",
            commit_dir.display()
        )));
    }
    if !state.begin_step(key, layout.file_bytes()) {
        let what = part.map_or(String::new(), |p| format!(" (rank {} of {})", p.rank, p.world_size));
        return fail(SaveError::BadRequest(format!("step {step}{what} is already in flight")));
    }
    replies.started(id, t_received, layout.file_bytes());
    if let Err(e) = check_sizes(&sources) {
        state.end(key);
        return fail(e);
    }
    let span = info_span!("save", step, bytes = layout.file_bytes(), tensors = layout.specs.len());
    let guard = span.enter();
    let gone = if handed_over {
        None
    } else if sources.iter().any(|s| s.region.as_ref().is_some_and(|r| r.is_legacy_cuda())) {
        Some(CLIENT_GONE_LEGACY_CUDA)
    } else {
        Some("the client disconnected before release")
    };
    let give_up = || state.stop_reason(replies, gone);
    // Tensors the client proves unchanged since a step this session saved
    // are taken from its resident image rather than the client (whole
    // saves: parts are never resident). In place, when they already lie
    // where this layout puts them: the resident image's lease becomes this
    // save's, and their bytes are copied from nowhere.
    let adopted = part
        .is_none()
        .then(|| crate::save::trusted_unchanged::adopt(&state.staging, replies, &layout, unchanged.as_ref()))
        .flatten();
    let (mut lease, waited, adopted) = match adopted {
        Some((lease, taken)) => (lease, std::time::Duration::ZERO, Some(taken)),
        None => match state.staging.acquire(image_bytes, &format!("step {step}"), give_up) {
            Ok((lease, waited)) => (lease, waited, None),
            Err(StagingError::GaveUp { why }) => {
                state.end(key);
                warn!("aborted while waiting for staging: {why}");
                return fail(SaveError::Aborted(why));
            }
            Err(e) => {
                state.end(key);
                return fail(SaveError::TooLarge(e.to_string()));
            }
        },
    };
    state.set_phase(key, Phase::Copying);
    // Else copied from the resident image into the lease just taken.
    let in_place = adopted.is_some();
    let taken = adopted.or_else(|| {
        part.is_none()
            .then(|| crate::save::trusted_unchanged::find(&state.staging, replies, &layout, unchanged.as_ref()))
            .flatten()
            .map(|reuse| reuse.fill(&layout, &mut lease))
    });
    if let Some(taken) = &taken {
        for i in taken.tensors() {
            sources[i].region = None;
        }
        state.unchanged_taken_bytes.fetch_add(taken.bytes, Ordering::Relaxed);
        if in_place {
            state.unchanged_in_place_bytes.fetch_add(taken.bytes, Ordering::Relaxed);
        }
        info!(
            taken_bytes = taken.bytes,
            in_place, "tensors flagged unchanged taken from the resident image, not copied from the client"
        );
    }
    // Pipelined: whole saves, and a rank's part of several nodes (written
    // on its own into the shared directory). A part of one node's group
    // waits for the other ranks' parts first, so it copies, then queues.
    if part.is_none() || state.shared_dir.is_some() {
        drop(guard);
        return run_fed_save(
            state,
            replies,
            id,
            step,
            part,
            layout,
            sources,
            lease,
            waited,
            blobs,
            lazy_release,
            span,
            t_received,
            gone,
            taken,
        );
    }
    let t_copy = Instant::now();
    let stop = || give_up().is_some();
    // Lazy release: checksums during the copy. Else: the copy alone, and the
    // checksums after the release, off the trainer's stall.
    let copied = if lazy_release {
        copy_and_checksum_into(&layout, &sources, &mut lease, &stop).map(Some)
    } else {
        copy_into(&layout, &sources, &mut lease, &stop).then_some(None)
    };
    let copy_seconds = t_copy.elapsed().as_secs_f64();
    // Released only if every region still held its bytes (one its client
    // truncated during the copy was read as zeros) and the client is still
    // there to be told.
    let intact = check_sizes(&sources);
    drop(sources);
    debug_assert!(taken.is_none(), "parts take nothing from the resident image");
    let crcs = match (intact, copied, give_up()) {
        (Ok(()), Some(crcs), None) => crcs,
        (intact, _, why) => {
            let e = intact.err().unwrap_or(SaveError::Aborted(why.unwrap_or("stopped during the copy")));
            drop(lease);
            state.end(key);
            warn!(copy_s = copy_seconds, "aborted before release, nothing written: {e}");
            return fail(e);
        }
    };
    let waited_seconds = waited.as_secs_f64();
    log_if_handed_over_by_gone(replies, gone);
    info!(
        plan_s = plan_seconds,
        copy_s = copy_seconds,
        waited_s = waited_seconds,
        received_s = t_received.elapsed().as_secs_f64(),
        lazy_release,
        gib_per_s = layout.tensor_bytes() as f64 / copy_seconds.max(1e-9) / (1u64 << 30) as f64,
        "released"
    );
    replies.send(&Reply::Released { id, step, copy_seconds, waited_seconds });
    let crcs = crcs.unwrap_or_else(|| {
        // From the staged bytes, which only this lease's holder touches now.
        let t_crc = Instant::now();
        let crcs = checksum(&layout, &mut lease);
        info!(crc_s = t_crc.elapsed().as_secs_f64(), "checksummed");
        crcs
    });
    state.set_phase(key, Phase::Queued);
    drop(guard);
    let job = Job {
        id,
        step,
        layout,
        lease,
        crcs: crcs.crcs,
        digests: crcs.digests,
        blobs,
        part,
        replies: replies.clone(),
        span,
        copy_seconds,
        waited_seconds,
        t_received,
        fill: None,
    };
    if let Err(e) = state.commit_tx.send(Work::Checkpoint(job)) {
        // The committer is gone only if the daemon is tearing down.
        let Work::Checkpoint(job) = e.into_inner() else { unreachable!("sent a checkpoint job") };
        state.end(key);
        job.replies.send(&Reply::Failed {
            id,
            step,
            code: ErrorCode::ShuttingDown,
            reason: "the committer has stopped".into(),
        });
    }
}

/// Says so when a handed-over save (`gone` None: its client's departure
/// does not stop it) is released to a client already gone: it commits all
/// the same (protocol.md, "Release of handed-over saves").
fn log_if_handed_over_by_gone(replies: &Replies, gone: Option<&'static str>) {
    if gone.is_none() && replies.is_gone() {
        info!("the client is gone, but it handed this save over (every tensor copied at save into a hand-over region): committing it");
    }
}

/// The rest of a whole save, or of a rank's part of several nodes,
/// pipelined: the job goes to the
/// committer before the copy, which then writes each chunk of the image as
/// soon as it is copied ([`FedCopy`], `Store::commit_fed`), so the time to
/// durable is about the disk's alone, not the copy's plus the disk's.
/// Released and Durable mean what they always did: Released once every
/// byte is copied and checked intact (the committer waits for the copy's
/// checksums before its index, and its commit point comes after them);
/// a failed copy makes the committer remove what it wrote and answer
/// Failed (the session does not), so exactly one of Released/Failed comes
/// first and nothing of a failed save is committed.
#[allow(clippy::too_many_arguments)]
fn run_fed_save(
    state: &DaemonState,
    replies: &Arc<Replies>,
    id: u64,
    step: u64,
    part: Option<Part>,
    layout: Layout,
    sources: Vec<Source>,
    mut lease: Lease,
    waited: std::time::Duration,
    blobs: Vec<Blob>,
    lazy_release: bool,
    span: tracing::Span,
    t_received: Instant,
    gone: Option<&'static str>,
    taken: Option<crate::save::trusted_unchanged::Taken>,
) {
    let key = match part {
        Some(p) => Flight::Part(step, p.rank),
        None => Flight::Step(step),
    };
    let guard = span.enter();
    let mut fed = FedCopy::plan(&layout, &sources, &mut lease);
    let fill = Arc::new(Fill::new(fed.progress.clone()));
    // A panic before the copy's end fails it: the committer never waits forever.
    let progress = fed.progress.clone();
    let _filler = Filler(&progress);
    let waited_seconds = waited.as_secs_f64();
    let job = Job {
        id,
        step,
        layout: layout.clone(),
        lease,
        crcs: Vec::new(),
        digests: None,
        blobs,
        part,
        replies: replies.clone(),
        span: span.clone(),
        copy_seconds: 0.0,
        waited_seconds,
        t_received,
        fill: Some(fill.clone()),
    };
    // To the committer: false (the save answered Failed here) when it is gone.
    let hand_over = |job: Job| -> bool {
        let Err(e) = state.commit_tx.send(Work::Checkpoint(job)) else { return true };
        // The committer is gone only if the daemon is tearing down.
        progress.fail("the committer has stopped".into());
        // The lease's drop waits for the copy: none is running now.
        drop(e);
        state.end(key);
        replies.send(&Reply::Failed {
            id,
            step,
            code: ErrorCode::ShuttingDown,
            reason: "the committer has stopped".into(),
        });
        false
    };
    // Small images are handed over after the copy (config::FED_EARLY_BYTES_MIN).
    let mut unsent = Some(job);
    if layout.staging_len >= config::FED_EARLY_BYTES_MIN && !hand_over(unsent.take().expect("not sent yet")) {
        return;
    }
    let give_up = || state.stop_reason(replies, gone);
    let t_copy = Instant::now();
    let stop = || give_up().is_some();
    let copied = fed.copy(&layout, lazy_release, &stop);
    let copy_seconds = t_copy.elapsed().as_secs_f64();
    let intact = check_sizes(&sources);
    drop(sources);
    let crcs = match (intact, copied, give_up()) {
        (Ok(()), Some(crcs), None) => crcs,
        (intact, _, why) => {
            let e = intact.err().unwrap_or(SaveError::Aborted(why.unwrap_or("stopped during the copy")));
            warn!(copy_s = copy_seconds, "aborted before release, nothing committed: {e}");
            info!(step, code = ?e.code(), "save refused: {e}");
            // The committer removes what it wrote, ends the flight, answers Failed.
            fill.fail(e.code(), e.to_string());
            if let Some(job) = unsent {
                hand_over(job);
            }
            return;
        }
    };
    log_if_handed_over_by_gone(replies, gone);
    info!(
        copy_s = copy_seconds,
        waited_s = waited_seconds,
        received_s = t_received.elapsed().as_secs_f64(),
        lazy_release,
        gib_per_s = layout.tensor_bytes() as f64 / copy_seconds.max(1e-9) / (1u64 << 30) as f64,
        device_windows = fed.device_windows,
        "released"
    );
    // Released before the copy's end is told to the committer: Durable
    // (which waits for it) always comes after.
    replies.send(&Reply::Released { id, step, copy_seconds, waited_seconds });
    if let Some(job) = unsent {
        if !hand_over(job) {
            return;
        }
    }
    let mut crcs = match crcs {
        Some(sums) => fed.complete(&layout, sums),
        None => {
            let t_crc = Instant::now();
            let crcs = fed.checksum(&layout);
            info!(crc_s = t_crc.elapsed().as_secs_f64(), "checksummed");
            crcs
        }
    };
    if let Some(t) = &taken {
        // Not copied, so not checksummed: their step's checksums and digests.
        t.patch(&mut crcs.crcs, crcs.digests.as_deref_mut());
    }
    drop(guard);
    fill.finish(copy_seconds, crcs);
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn overlaps_are_found_per_region() {
        check_no_overlap(&[d("a", 1, 0, 10), d("b", 1, 10, 10), d("c", 2, 0, 10)]).unwrap();
        assert!(check_no_overlap(&[d("a", 1, 0, 10), d("b", 1, 9, 10)]).is_err());
        // Empty tensors overlap nothing.
        check_no_overlap(&[d("a", 1, 0, 10), d("b", 1, 5, 0)]).unwrap();
    }

    #[test]
    fn shape_and_length_must_agree() {
        let mut t = d("a", 1, 0, 10);
        check_desc_shape(&t).unwrap();
        t.len_bytes = 11;
        assert!(check_desc_shape(&t).is_err());
        t.dtype = "F33".into();
        assert!(check_desc_shape(&t).is_err());
        let t = TensorDesc {
            name: "x".into(),
            dtype: "F64".into(),
            shape: vec![u64::MAX, 2],
            region_id: 1,
            offset_bytes: 0,
            len_bytes: 0,
        };
        assert!(check_desc_shape(&t).is_err());
    }

    #[test]
    fn unregistered_regions_and_bad_names_are_refused() {
        let regions = HashMap::new();
        assert!(matches!(
            plan_save(&[d("a", 7, 0, 4)], &[], &regions, Default::default(), None),
            Err(SaveError::BadRegion(_))
        ));
        assert!(matches!(
            plan_save(&[d("a\0", 7, 0, 0)], &[], &regions, Default::default(), None),
            Err(SaveError::BadRequest(_))
        ));
        let blob = Blob { name: "../x".into(), bytes: vec![1] };
        assert!(matches!(
            plan_save(&[] as &[TensorDesc], &[blob], &regions, Default::default(), None),
            Err(SaveError::BadRequest(_))
        ));
        // Zero-element tensors need no region.
        let (l, _) = plan_save(&[d("e", 9, 0, 0)], &[], &regions, Default::default(), None).unwrap();
        assert_eq!(l.specs.len(), 1);
    }
}
