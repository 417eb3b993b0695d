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
pub use shm::{validate_shm_name, ShmMemory};

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
    #[error("shm segment {name:?} was truncated by its owner while the sidecar read it; register it again")]
    Truncated { name: String },
    #[error(transparent)]
    Cuda(#[from] ckpt_cuda::CudaError),
    #[error("CUDA region: {why}; register it again")]
    CudaCopy { why: String },
    #[error("bytes {offset_bytes}..{offset_bytes}+{len_bytes} lie outside region {region_id} of {region_bytes} bytes")]
    OutOfBounds { region_id: u32, offset_bytes: u64, len_bytes: u64, region_bytes: u64 },
}

/// Where a region's bytes live.
pub enum Memory {
    /// A host shared-memory segment.
    HostShm(ShmMemory),
    /// A CUDA device allocation of the client (legacy IPC).
    Cuda(CudaMemory),
}

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
    pub fn open_shm(region_id: u32, shm_name: &str, len_bytes: u64, peer_uid: u32, hand_over: bool) -> Result<Region, RegionError> {
        Ok(Region { region_id, len_bytes, hand_over, memory: Memory::HostShm(ShmMemory::open(shm_name, len_bytes, peer_uid)?) })
    }

    /// Opens the CUDA allocation `source` names on `device` (a legacy IPC
    /// handle, or a VMM allocation's fd); its copies run on `stream` (the
    /// session's).
    pub fn open_cuda(region_id: u32, source: CudaSource, device: i32, len_bytes: u64, stream: std::sync::Arc<SessionStream>) -> Result<Region, RegionError> {
        Ok(Region { region_id, len_bytes, hand_over: false, memory: Memory::Cuda(CudaMemory::open(source, device, len_bytes, stream)?) })
    }

    /// Whether the client hands this region's bytes over at each save: it
    /// writes it only to fill a save before sending it, never while a save
    /// of it is unreleased, so what a received save reads from it is final
    /// even if the client dies before Released. Only host shm: the mapping
    /// keeps its memory alive after the client died.
    pub fn hands_over(&self) -> bool {
        self.hand_over && matches!(self.memory, Memory::HostShm(_))
    }

    /// Whether this is CUDA memory shared by legacy IPC, whose bytes are
    /// undefined once the client that exported it died.
    pub fn is_legacy_cuda(&self) -> bool {
        matches!(&self.memory, Memory::Cuda(m) if !m.is_vmm())
    }

    /// Whether this is a CUDA VMM allocation (valid after its client died).
    pub fn is_vmm_cuda(&self) -> bool {
        matches!(&self.memory, Memory::Cuda(m) if m.is_vmm())
    }

    /// What kind of memory this is, for logs and status.
    pub fn kind(&self) -> &'static str {
        match &self.memory {
            Memory::HostShm(_) => "host-shm",
            Memory::Cuda(_) => "cuda",
        }
    }

    /// Whether [`Region::copy_batch`] copies for this kind (device memory),
    /// rather than leaving it to [`Region::copy_out`] piece by piece.
    pub fn copies_in_batches(&self) -> bool {
        matches!(self.memory, Memory::Cuda(_))
    }

    /// Checks that `len_bytes` at `offset_bytes` lie inside the region.
    pub fn contains(&self, offset_bytes: u64, len_bytes: u64) -> Result<(), RegionError> {
        match offset_bytes.checked_add(len_bytes) {
            Some(end) if end <= self.len_bytes => Ok(()),
            _ => Err(RegionError::OutOfBounds { region_id: self.region_id, offset_bytes, len_bytes, region_bytes: self.len_bytes }),
        }
    }

    /// Copies `len` bytes at `offset_bytes` into `dst` (staging); with
    /// `crc`, returns their crc32c, computed during the copy (else 0). A
    /// fault of the memory under the copy does not stop it: the bytes read
    /// are then wrong, and [`Region::check_intact`] says so afterwards.
    ///
    /// # Safety
    /// `dst..dst+len` is writable and no one else's for the call, and the
    /// range was checked with [`Region::contains`].
    pub unsafe fn copy_out(&self, offset_bytes: u64, dst: *mut u8, len: usize, crc: bool) -> u32 {
        assert!(self.contains(offset_bytes, len as u64).is_ok(), "copy_out outside the region (callers check bounds first)");
        match &self.memory {
            // SAFETY: the caller's contract; bounds asserted above.
            Memory::HostShm(m) => unsafe { m.copy_out(offset_bytes, dst, len, crc) },
            // SAFETY: as above.
            Memory::Cuda(m) => unsafe { m.copy_out(offset_bytes, dst, len, crc) },
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
                    assert!(self.contains(off, len as u64).is_ok(), "queue_batch outside the region (callers check bounds first)");
                }
                // SAFETY: the caller's contract; bounds asserted above.
                unsafe { m.queue_batch(ranges) };
                true
            }
        }
    }

    /// Waits until the batch [`Region::queue_batch`] queued has completed
    /// (a no-op for kinds that do not batch).
    pub fn finish_batch(&self) {
        if let Memory::Cuda(m) = &self.memory {
            m.finish_batch();
        }
    }

    /// Checks that the memory still holds every registered byte and that no
    /// copy found it changed under it: before a copy, and after it (the
    /// client may truncate during).
    pub fn check_intact(&self) -> Result<(), RegionError> {
        match &self.memory {
            Memory::HostShm(m) => m.check_intact(),
            Memory::Cuda(m) => m.check_intact(),
        }
    }

    /// Writes `bytes` at `offset_bytes` (loads), bounds-checked.
    pub fn write_at(&self, offset_bytes: u64, bytes: &[u8]) -> Result<(), RegionError> {
        self.contains(offset_bytes, bytes.len() as u64)?;
        match &self.memory {
            Memory::HostShm(m) => m.write_at(offset_bytes, bytes),
            Memory::Cuda(m) => m.write_at(offset_bytes, bytes),
        }
    }

    /// Removes what a client that died left behind of this region (a host
    /// segment's name; its bytes go once the last mapping does).
    pub fn remove_dead_owners_memory(&self) {
        match &self.memory {
            Memory::HostShm(m) => m.unlink(),
            // Device memory belongs to the driver: it is freed with its
            // owner's context; the import closes with the region.
            Memory::Cuda(_) => {}
        }
    }

    /// The host shm segment behind the region, if it is one (tests).
    pub fn as_shm(&self) -> Option<&ShmMemory> {
        match &self.memory {
            Memory::HostShm(m) => Some(m),
            Memory::Cuda(_) => None,
        }
    }
}

#[cfg(test)]
pub(crate) use shm::{test_segment, truncate_segment, unlink_segment};
