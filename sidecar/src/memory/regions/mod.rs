//! Client memory the sidecar reads tensors from (saves) and writes them to
//! (loads): one abstraction, [`Region`], whatever kind of memory is behind
//! it. Snapshot, load and SaveFile see only `Region`: its bounds check, a
//! copy out of it into staging ([`Region::copy_out`]), a check that it was
//! intact for the whole copy ([`Region::check_intact`]) and a write into it
//! ([`Region::write_at`]). A kind of memory is a variant of [`Memory`] and a
//! module of its own:
//! - [`shm`]: host POSIX shared-memory segments, mapped read-only, with the
//!   SIGBUS guard for segments truncated under a copy.
//! - [`cuda`]: a CUDA device allocation of the client opened from its legacy
//!   IPC handle, copied on the session's own stream after the trainer's
//!   event (see `docs/protocol.md`, CUDA).
//! - a CUDA span: CUDA regions of the session that the client mapped back
//!   to back (PyTorch's expandable segments), seen as one: every access is
//!   split at the pieces' boundaries and goes to the piece's own region.
//!
//! Each kind has its own registration in the session; snapshot, committer
//! and load see only `Region`.
//!
//! Trust boundary: the name, length and every descriptor come from the
//! client. Every access goes through `Region`, which checks bounds with
//! overflow-checked arithmetic before the kind sees an offset, so no read or
//! write leaves the region.

use std::io;

pub mod cuda;
pub mod shm;

pub use cuda::{CudaMemory, CudaSession, CudaSource, SessionStream};
pub use shm::{store_fence, validate_shm_name, ShmMemory};

#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("shm name {name:?}: {why}")]
    BadName { name: String, why: &'static str },
    #[error("shm segment {name:?}: {what}: {source}")]
    Os { name: String, what: &'static str, source: io::Error },
    #[error("shm segment {name:?} belongs to uid {owner_uid}, not to the client's uid {peer_uid}")]
    NotOwner { name: String, owner_uid: u32, peer_uid: u32 },
    #[error("shm segment {name:?} is not a regular shared-memory object")]
    NotRegular { name: String },
    #[error("shm segment {name:?} has {size_bytes} bytes, fewer than the {len_bytes} registered")]
    TooSmall { name: String, size_bytes: u64, len_bytes: u64 },
    #[error("shm segment {name:?} was truncated by its owner while the sidecar read or wrote it; register it again")]
    Truncated { name: String },
    #[error("shm segment {name:?} ({len_bytes} bytes): a page of it could not be backed while the sidecar read or wrote it (is /dev/shm full?); register it again")]
    Unbacked { name: String, len_bytes: u64 },
    #[error(transparent)]
    Cuda(#[from] ckpt_cuda::CudaError),
    #[error("CUDA region: {why}; register it again")]
    CudaCopy { why: String },
    #[error("CUDA span: {0}")]
    Span(String),
    #[error("bytes {offset_bytes}..{offset_bytes}+{len_bytes} lie outside region {region_id} of {region_bytes} bytes")]
    OutOfBounds { region_id: u32, offset_bytes: u64, len_bytes: u64, region_bytes: u64 },
}

/// Where a region's bytes live.
pub enum Memory {
    /// A host shared-memory segment.
    HostShm(ShmMemory),
    /// A CUDA device allocation of the client (legacy IPC or VMM).
    Cuda(CudaMemory),
    /// CUDA regions mapped back to back by the client: (offset of each in
    /// this region, the piece). Holds the pieces' imports open.
    CudaSpan(Vec<(u64, std::sync::Arc<Region>)>),
}

/// A point in a region's queued copies ([`Region::mark_batch`]).
pub struct BatchMark(Option<ckpt_cuda::LocalEvent>);

/// A region a client registered: its id, its length, and its memory.
pub struct Region {
    pub region_id: u32,
    /// What the client registered (≤ the memory's size at registration).
    pub len_bytes: u64,
    /// Registered as a hand-over region (host shm only; protocol.md).
    hand_over: bool,
    memory: Memory,
}

impl Region {
    /// Opens, checks and maps the host shm segment `shm_name` for a peer of
    /// `peer_uid`; `hand_over`: the client registered it as a hand-over
    /// region ([`Region::hands_over`]).
    pub fn open_shm(
        region_id: u32,
        shm_name: &str,
        len_bytes: u64,
        peer_uid: u32,
        hand_over: bool,
    ) -> Result<Region, RegionError> {
        Ok(Region {
            region_id,
            len_bytes,
            hand_over,
            memory: Memory::HostShm(ShmMemory::open(shm_name, len_bytes, peer_uid)?),
        })
    }

    /// Opens the CUDA allocation `source` names on `device` (a legacy IPC
    /// handle, or a VMM allocation's fd); its copies run on `stream` (the
    /// session's).
    pub fn open_cuda(
        region_id: u32,
        source: CudaSource,
        device: i32,
        len_bytes: u64,
        stream: std::sync::Arc<SessionStream>,
    ) -> Result<Region, RegionError> {
        Ok(Region {
            region_id,
            len_bytes,
            hand_over: false,
            memory: Memory::Cuda(CudaMemory::open(source, device, len_bytes, stream)?),
        })
    }

    /// Whether the client hands this region's bytes over at each save: it
    /// writes it only to fill a save before sending it, never while a save
    /// of it is unreleased, so what a received save reads from it is final
    /// even if the client dies before Released. Only host shm: the mapping
    /// keeps its memory alive after the client died.
    pub fn hands_over(&self) -> bool {
        self.hand_over && matches!(self.memory, Memory::HostShm(_))
    }

    /// Region `region_id` made of the CUDA regions `pieces`, which the
    /// client mapped back to back in this order (it alone can see that);
    /// each must be a single CUDA allocation, all on one device.
    pub fn open_cuda_span(region_id: u32, pieces: Vec<std::sync::Arc<Region>>) -> Result<Region, RegionError> {
        let mut device = None;
        let mut at = 0u64;
        let mut parts = Vec::with_capacity(pieces.len());
        if pieces.len() < 2 {
            return Err(RegionError::Span(format!("a span needs at least two pieces, not {}", pieces.len())));
        }
        for p in pieces {
            let Memory::Cuda(m) = &p.memory else {
                return Err(RegionError::Span(format!(
                    "piece region {} is {} memory, not one CUDA allocation",
                    p.region_id,
                    p.kind()
                )));
            };
            if *device.get_or_insert(m.device()) != m.device() {
                return Err(RegionError::Span(format!(
                    "piece region {} lies on CUDA device {}, the span's first piece on {}",
                    p.region_id,
                    m.device(),
                    device.unwrap_or(0)
                )));
            }
            let next =
                at.checked_add(p.len_bytes).ok_or_else(|| RegionError::Span("the pieces' lengths overflow".into()))?;
            parts.push((at, p));
            at = next;
        }
        Ok(Region { region_id, len_bytes: at, hand_over: false, memory: Memory::CudaSpan(parts) })
    }

    /// Whether this is CUDA memory shared by legacy IPC, whose bytes are
    /// undefined once the client that exported it died.
    pub fn is_legacy_cuda(&self) -> bool {
        match &self.memory {
            Memory::Cuda(m) => !m.is_vmm(),
            Memory::CudaSpan(ps) => ps.iter().any(|(_, p)| p.is_legacy_cuda()),
            Memory::HostShm(_) => false,
        }
    }

    /// Whether this is a CUDA VMM allocation (valid after its client died).
    pub fn is_vmm_cuda(&self) -> bool {
        match &self.memory {
            Memory::Cuda(m) => m.is_vmm(),
            Memory::CudaSpan(ps) => ps.iter().all(|(_, p)| p.is_vmm_cuda()),
            Memory::HostShm(_) => false,
        }
    }

    /// What kind of memory this is, for logs and status.
    pub fn kind(&self) -> &'static str {
        match &self.memory {
            Memory::HostShm(_) => "host-shm",
            Memory::Cuda(_) => "cuda",
            Memory::CudaSpan(_) => "cuda-span",
        }
    }

    /// Whether [`Region::copy_batch`] copies for this kind (device memory),
    /// rather than leaving it to [`Region::copy_out`] piece by piece.
    pub fn copies_in_batches(&self) -> bool {
        matches!(self.memory, Memory::Cuda(_) | Memory::CudaSpan(_))
    }

    /// A span's pieces that `len` bytes at `offset_bytes` touch, in order:
    /// (piece, offset in the piece, offset in the range, length). The range
    /// lies in the span (callers check), so the parts cover it exactly.
    fn span_parts(
        pieces: &[(u64, std::sync::Arc<Region>)],
        offset_bytes: u64,
        len: u64,
    ) -> impl Iterator<Item = (&Region, u64, u64, u64)> {
        let end = offset_bytes + len;
        pieces.iter().filter_map(move |(at, p)| {
            let (lo, hi) = (offset_bytes.max(*at), end.min(at + p.len_bytes));
            (lo < hi).then(|| (&**p, lo - at, lo - offset_bytes, hi - lo))
        })
    }

    /// Checks that `len_bytes` at `offset_bytes` lie inside the region.
    pub fn contains(&self, offset_bytes: u64, len_bytes: u64) -> Result<(), RegionError> {
        match offset_bytes.checked_add(len_bytes) {
            Some(end) if end <= self.len_bytes => Ok(()),
            _ => Err(RegionError::OutOfBounds {
                region_id: self.region_id,
                offset_bytes,
                len_bytes,
                region_bytes: self.len_bytes,
            }),
        }
    }

    /// Copies `len` bytes at `offset_bytes` into `dst` (staging); with
    /// `crc`, returns their crc32c, computed during the copy (else 0). A
    /// fault of the memory under the copy does not stop it: the bytes read
    /// are then wrong, and [`Region::check_intact`] says so afterwards.
    /// The bytes may be written with streaming stores: the copying thread
    /// calls [`store_fence`] before another thread may read them.
    ///
    /// # Safety
    /// `dst..dst+len` is writable and no one else's for the call, and the
    /// range was checked with [`Region::contains`].
    pub unsafe fn copy_out(&self, offset_bytes: u64, dst: *mut u8, len: usize, crc: bool) -> u32 {
        assert!(
            self.contains(offset_bytes, len as u64).is_ok(),
            "copy_out outside the region (callers check bounds first)"
        );
        match &self.memory {
            // SAFETY: the caller's contract; bounds asserted above.
            Memory::HostShm(m) => unsafe { m.copy_out(offset_bytes, dst, len, crc) },
            // SAFETY: as above.
            Memory::Cuda(m) => unsafe { m.copy_out(offset_bytes, dst, len, crc) },
            Memory::CudaSpan(ps) => {
                for (p, at, d, n) in Self::span_parts(ps, offset_bytes, len as u64) {
                    // SAFETY: dst..dst+len is the caller's; each part is a
                    // disjoint sub-range of it and lies in its piece
                    // (span_parts clips to the piece's bounds).
                    unsafe { p.copy_out(at, dst.add(d as usize), n as usize, false) };
                }
                if !crc {
                    return 0;
                }
                // SAFETY: dst..dst+len was just written (the pieces' copies
                // are synchronous) and is the caller's for the call.
                crc32c::crc32c(unsafe { std::slice::from_raw_parts(dst, len) })
            }
        }
    }

    /// [`Region::copy_out`] with crc of three ranges of one length at once
    /// (host memory: [`ShmMemory::copy_out3`]); None, nothing copied, where
    /// they do not suit it or the memory is a device's.
    ///
    /// # Safety
    /// As [`Region::copy_out`], for each range.
    pub unsafe fn copy_out3(&self, offsets: [u64; 3], dst: [*mut u8; 3], len: usize) -> Option<[u32; 3]> {
        assert!(
            offsets.iter().all(|&o| self.contains(o, len as u64).is_ok()),
            "copy_out outside the region (callers check bounds first)"
        );
        match &self.memory {
            // SAFETY: the caller's contract; bounds asserted above.
            Memory::HostShm(m) => unsafe { m.copy_out3(offsets, dst, len) },
            Memory::Cuda(_) | Memory::CudaSpan(_) => None,
        }
    }

    /// [`Region::copy_out`] that also returns the bytes' XXH3-128 (one
    /// block of `ckpt_store::digest`): host memory hashes each block of the
    /// source right after copying it, while in cache
    /// ([`ShmMemory::copy_out_summed`]); device memory from the staged bytes.
    ///
    /// # Safety
    /// As [`Region::copy_out`].
    pub unsafe fn copy_out_summed(&self, offset_bytes: u64, dst: *mut u8, len: usize, crc: bool) -> (u32, u128) {
        assert!(
            self.contains(offset_bytes, len as u64).is_ok(),
            "copy_out outside the region (callers check bounds first)"
        );
        match &self.memory {
            // SAFETY: the caller's contract; bounds asserted above.
            Memory::HostShm(m) => unsafe { m.copy_out_summed(offset_bytes, dst, len, crc) },
            _ => {
                // SAFETY: the caller's contract.
                unsafe { self.copy_out(offset_bytes, dst, len, false) };
                // SAFETY: dst..dst+len was just written (device copies here
                // are synchronous) and is the caller's for the call.
                sum_of(unsafe { std::slice::from_raw_parts(dst, len) }, crc)
            }
        }
    }

    /// Queues copies of many ranges `(offset_bytes, dst, len)` in one batch
    /// where the kind gains from it (CUDA: on the session's stream); returns
    /// false, copying nothing, for a kind that copies piece by piece (host
    /// shm: [`Region::copy_out`]). Once every region's batch of a save is
    /// queued, [`Region::finish_batch`] on each waits for them. Failures
    /// show in [`Region::check_intact`], as for `copy_out`.
    ///
    /// # Safety
    /// Each `dst..dst+len` is writable and no one else's until
    /// `finish_batch` returned, and each range was checked with
    /// [`Region::contains`].
    pub unsafe fn queue_batch(&self, ranges: &[(u64, *mut u8, usize)]) -> bool {
        match &self.memory {
            Memory::HostShm(_) => false,
            Memory::Cuda(m) => {
                for &(off, _, len) in ranges {
                    assert!(
                        self.contains(off, len as u64).is_ok(),
                        "queue_batch outside the region (callers check bounds first)"
                    );
                }
                // SAFETY: the caller's contract; bounds asserted above.
                unsafe { m.queue_batch(ranges) };
                true
            }
            Memory::CudaSpan(ps) => {
                let mut per_piece: Vec<Vec<(u64, *mut u8, usize)>> = vec![Vec::new(); ps.len()];
                for &(off, dst, len) in ranges {
                    assert!(
                        self.contains(off, len as u64).is_ok(),
                        "queue_batch outside the region (callers check bounds first)"
                    );
                    for (p, at, d, n) in Self::span_parts(ps, off, len as u64) {
                        let k =
                            ps.iter().position(|(_, q)| std::ptr::eq(&**q, p)).expect("a part of one of the pieces");
                        per_piece[k].push((at, dst.wrapping_add(d as usize), n as usize));
                    }
                }
                for ((_, p), rs) in ps.iter().zip(&per_piece) {
                    // SAFETY: the caller's contract: each part is a disjoint
                    // sub-range of a caller's range, inside its piece.
                    if !rs.is_empty() && !unsafe { p.queue_batch(rs) } {
                        unreachable!("a span's pieces are CUDA allocations, which copy in batches");
                    }
                }
                true
            }
        }
    }

    /// Waits until the batch [`Region::queue_batch`] queued has completed
    /// (a no-op for kinds that do not batch).
    pub fn finish_batch(&self) {
        match &self.memory {
            Memory::Cuda(m) => m.finish_batch(),
            // The pieces share the session's stream: the first waits for all.
            Memory::CudaSpan(ps) => ps.iter().for_each(|(_, p)| p.finish_batch()),
            Memory::HostShm(_) => {}
        }
    }

    /// A point in the copies this region queued so far ([`Region::queue_batch`]):
    /// [`Region::wait_mark`] waits for those only. A kind that does not
    /// batch has nothing to mark.
    pub fn mark_batch(&self) -> BatchMark {
        match &self.memory {
            Memory::Cuda(m) => BatchMark(m.mark()),
            // The pieces share the session's stream: a mark on one marks all.
            Memory::CudaSpan(ps) => ps[0].1.mark_batch(),
            Memory::HostShm(_) => BatchMark(None),
        }
    }

    /// Waits until the copies queued before `mark` have completed (all the
    /// stream's, when the mark could not be taken); a failure shows in
    /// [`Region::check_intact`], as for the copies.
    pub fn wait_mark(&self, mark: &BatchMark) {
        match &self.memory {
            Memory::Cuda(m) => m.wait_mark(mark.0.as_ref()),
            Memory::CudaSpan(ps) => ps[0].1.wait_mark(mark),
            Memory::HostShm(_) => {}
        }
    }

    /// Checks that the memory still holds every registered byte and that no
    /// copy found it changed under it: before a copy, and after it (the
    /// client may truncate during).
    pub fn check_intact(&self) -> Result<(), RegionError> {
        match &self.memory {
            Memory::HostShm(m) => m.check_intact(),
            Memory::Cuda(m) => m.check_intact(),
            Memory::CudaSpan(ps) => ps.iter().try_for_each(|(_, p)| p.check_intact()),
        }
    }

    /// Writes `bytes` at `offset_bytes` (loads), bounds-checked.
    pub fn write_at(&self, offset_bytes: u64, bytes: &[u8]) -> Result<(), RegionError> {
        self.contains(offset_bytes, bytes.len() as u64)?;
        match &self.memory {
            Memory::HostShm(m) => m.write_at(offset_bytes, bytes),
            Memory::Cuda(m) => m.write_at(offset_bytes, bytes),
            Memory::CudaSpan(ps) => Self::span_parts(ps, offset_bytes, bytes.len() as u64)
                .try_for_each(|(p, at, d, n)| p.write_at(at, &bytes[d as usize..(d + n) as usize])),
        }
    }

    /// Closes what this region opened for the request that just ended (a
    /// legacy CUDA import: regions/cuda.rs); nothing may still copy from or
    /// into it.
    /// Returns what opening and closing them cost.
    pub fn close_imports(&self) -> cuda::ImportTimes {
        match &self.memory {
            Memory::Cuda(m) => m.close_import(),
            Memory::CudaSpan(ps) => ps.iter().fold(cuda::ImportTimes::default(), |t, (_, p)| t.and(p.close_imports())),
            Memory::HostShm(_) => cuda::ImportTimes::default(),
        }
    }

    /// Removes what a client that died left behind of this region (a host
    /// segment's name; its bytes go once the last mapping does).
    pub fn remove_dead_owners_memory(&self) {
        match &self.memory {
            Memory::HostShm(m) => m.unlink(),
            // Device memory belongs to the driver: it is freed with its
            // owner's context; the import closes with the region.
            Memory::Cuda(_) | Memory::CudaSpan(_) => {}
        }
    }

    /// The host shm segment behind the region, if it is one (tests).
    pub fn as_shm(&self) -> Option<&ShmMemory> {
        match &self.memory {
            Memory::HostShm(m) => Some(m),
            Memory::Cuda(_) | Memory::CudaSpan(_) => None,
        }
    }
}

#[cfg(test)]
pub(crate) use shm::{test_segment, truncate_segment, unlink_segment};

/// The crc32c (when `crc`; else 0) and the XXH3-128 of `bytes` (one digest
/// block), in one pass: each chunk is checksummed, then hashed while it is
/// in the first-level cache (`ckpt_store::digest::crc_and_digest`).
pub fn sum_of(bytes: &[u8], crc: bool) -> (u32, u128) {
    ckpt_store::digest::crc_and_digest(bytes, crc)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A span's accesses are split at its pieces' bounds, exactly covering
    /// the range, each part inside its piece; a span of host memory is
    /// refused (only CUDA allocations can be pieces).
    #[test]
    fn a_span_splits_every_range_at_its_pieces_bounds() {
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        let lens = [4096usize, 8192, 4096];
        let mut names = Vec::new();
        let pieces: Vec<Arc<Region>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let (name, _fd) = test_segment(n, |_| 0);
                let r = Region::open_shm(i as u32 + 1, &name, n as u64, uid, false).unwrap();
                names.push(name);
                Arc::new(r)
            })
            .collect();
        let at = [0u64, 4096, 12288];
        let ps: Vec<(u64, Arc<Region>)> = at.iter().copied().zip(pieces.iter().cloned()).collect();
        let parts: Vec<(u32, u64, u64, u64)> =
            Region::span_parts(&ps, 2048, 12288).map(|(p, off, d, n)| (p.region_id, off, d, n)).collect();
        assert_eq!(parts, [(1, 2048, 0, 2048), (2, 0, 2048, 8192), (3, 0, 10240, 2048)]);
        // Inside one piece: one part; at a bound: the next piece only.
        assert_eq!(
            Region::span_parts(&ps, 5000, 100).map(|(p, off, d, n)| (p.region_id, off, d, n)).collect::<Vec<_>>(),
            [(2, 904, 0, 100)]
        );
        assert_eq!(
            Region::span_parts(&ps, 12288, 4096).map(|(p, off, d, n)| (p.region_id, off, d, n)).collect::<Vec<_>>(),
            [(3, 0, 0, 4096)]
        );
        let e = Region::open_cuda_span(9, pieces.clone()).err().expect("host pieces refused").to_string();
        assert!(e.contains("piece region 1 is host-shm memory, not one CUDA allocation"), "{e}");
        let e = Region::open_cuda_span(9, pieces[..1].to_vec()).err().expect("one piece refused").to_string();
        assert!(e.contains("at least two pieces"), "{e}");
        for n in names {
            unlink_segment(&n);
        }
    }
}
