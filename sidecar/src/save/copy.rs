//! The copies of a save: its pieces ([`crate::save::pieces`]) copied out
//! of the client's regions by the copy threads, device regions' pieces in
//! batches first; with a lazy release, each piece checksummed as it is
//! copied.
//!
//! Invariant: a batch queued on a device is waited for before its bytes
//! are read or the lease is given back.

use ckpt_store::image::Layout;

use crate::config;
use crate::memory::regions::Region;
use crate::memory::staging::Lease;
use crate::save::checksums::fold_crcs;
use crate::save::pieces::{copy_crc_run, run_pieces, run_runs_with, runs_of, split_range};
use crate::save::pieces::{pieces_of, Pieces};
use crate::save::plan::Source;
use crate::state::jobs::Sums;

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
/// release); the copy takes longer. None when stopped early. An
/// incremental layout's digests are not taken (`digests` None): they cost
/// about what the checksummed copy does, and the trainer need not wait for
/// them ([`crate::save::checksums::digests`] after the release).
pub fn copy_and_checksum_into(
    layout: &Layout,
    sources: &[Source],
    lease: &mut Lease,
    stop: &(dyn Fn() -> bool + Sync),
) -> Option<Sums> {
    layout.write_headers(lease.as_mut_slice());
    let mut pieces = pieces_of(layout, Some(sources), lease);
    copy_batches(&mut pieces);
    let piece_crcs = run_runs_with(&pieces, &runs_of(&pieces), stop, &copy_crc_run, &|_| {})?;
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
    use std::sync::Arc;

    use ckpt_wire::TensorDesc;

    use crate::save::checks::check_sizes;
    use crate::save::error::SaveError;
    use crate::save::plan::{plan_save, regions_of};

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
        check_sizes(regions_of(&sources)).unwrap();
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
            let e = check_sizes(regions_of(&sources)).unwrap_err();
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
