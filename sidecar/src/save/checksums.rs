//! The checksums of a staged image: each tensor's crc32c (and, with an
//! incremental layout, its digest, `ckpt_store::digest`), computed per
//! piece on the copy threads and folded into one per tensor.
//!
//! Invariant: a piece is summed only from staged bytes that no one writes
//! while it is summed (the copy of it has ended; the lease is held by the
//! caller, or by the committer with the copy's filler still running).

use ckpt_store::image::Layout;

use crate::config::COPY_BLOCK_BYTES;
use crate::memory::staging::Lease;
use crate::save::pieces::{pieces_of, run_runs, runs_of, sum_of_staged, Piece, Pieces};
use crate::state::jobs::Sums;

/// The tensor checksums of the image copied into the lease, computed from
/// the staged bytes themselves (no one writes them after the copy), on
/// [`config::COPY_THREADS`] threads.
/// With an incremental layout, each tensor's digest too, in the same
/// pass (each block hashed right after its checksum, while in cache).
pub fn checksum(layout: &Layout, lease: &mut Lease) -> Sums {
    let pieces = pieces_of(layout, None, lease);
    staged_sums(layout, &pieces, None)
}

/// The digests (an incremental layout's) of the image copied into the
/// lease, from the staged bytes: for a copy that took only the checksums
/// ([`crate::save::copy::copy_and_checksum_into`]).
pub fn digests(layout: &Layout, lease: &mut Lease) -> Vec<u128> {
    let pieces = pieces_of(layout, None, lease);
    let sums = run_runs(&pieces, &runs_of(&pieces), &|| false, &|p| (0, sum_of_staged(p, false).1), &|_| {})
        .expect("a digest pass is never stopped");
    fold_sums(layout, &pieces, &sums).digests.expect("folded with digests")
}

/// The checksums (and digests, incremental) of staged pieces, by run
/// (`runs`) or by the default runs.
pub(super) fn staged_sums(layout: &Layout, pieces: &Pieces, runs: Option<&[usize]>) -> Sums {
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

/// Folds the pieces' crcs into each tensor's crc (a tensor's pieces are
/// consecutive and in order: tensor order, or staging order).
pub(super) fn fold_crcs(layout: &Layout, pieces: &Pieces, piece_crcs: &[u32]) -> Vec<u32> {
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
pub(super) fn stable_tensors(layout: &Layout) -> Vec<bool> {
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
pub(super) fn fold_sums(layout: &Layout, pieces: &Pieces, sums: &[(u32, u128)]) -> Sums {
    let crcs: Vec<u32> = sums.iter().map(|s| s.0).collect();
    let crcs = fold_crcs(layout, pieces, &crcs);
    // A tensor's pieces are consecutive (as fold_crcs relies on): each run
    // of them is combined from the slice, with no list per tensor.
    let mut digests = vec![ckpt_store::digest::combine([]); layout.specs.len()];
    let ps = &pieces.0[..sums.len().min(pieces.0.len())];
    let mut at = 0;
    while at < ps.len() {
        let t = ps[at].tensor_idx;
        let end = at + ps[at..].iter().take_while(|p| p.tensor_idx == t).count();
        digests[t] = ckpt_store::digest::combine(sums[at..end].iter().map(|s| s.1));
        at = end;
    }
    Sums { crcs, digests: Some(digests) }
}
