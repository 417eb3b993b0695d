//! Host memory regions: POSIX shared-memory segments the shim created and
//! registered, which the sidecar reads tensors from (saves) and writes
//! them to (loads).
//!
//! Trust boundary: the name, length and every descriptor come from the
//! client. A segment is opened only under a plain `/name` (no path), must be
//! a regular object owned by the peer's uid and at least as large as claimed;
//! it is mapped **read-only**, and loads write with `pwrite` on the
//! descriptor, never through a mapping. Every access goes through
//! [`ShmMemory::copy_out`] or [`ShmMemory::write_at`], which check bounds with
//! overflow-checked arithmetic, so no read or write leaves the region.
//!
//! A client that shrinks its own segment (ftruncate) under a copy must not
//! kill the sidecar: reading a mapped page past the end of a shm object
//! raises SIGBUS. Every read of a region goes through [`ShmMemory::read`], which
//! names the region to this thread's fault handler for the duration; a fault
//! inside it maps zero pages over the rest of the region, marks the region
//! truncated and lets the copy run on (it reads zeros). The save then fails
//! with an error naming the segment ([`ShmMemory::check_intact`] after the copy),
//! and the region stays refused until it is registered again. A SIGBUS
//! anywhere else goes to the handler that was there before (Rust's stack
//! overflow check, or the default: the process dies). This is how Wayland
//! compositors survive clients that shrink their shm pools.

use std::cell::Cell;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
#[cfg(test)]
use std::os::unix::fs::FileExt;
use std::sync::atomic::{compiler_fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

use crate::config;

use super::RegionError;

/// Checks a shm_open name: one leading '/', no other '/', no NUL, not
/// "." or "..", at most NAME_MAX bytes.
pub fn validate_shm_name(name: &str) -> Result<(), RegionError> {
    let err = |why| Err(RegionError::BadName { name: name.to_string(), why });
    let Some(rest) = name.strip_prefix('/') else {
        return err("must start with '/'");
    };
    if rest.is_empty() {
        return err("empty");
    }
    if name.len() > config::SHM_NAME_BYTES_MAX {
        return err("longer than 255 bytes");
    }
    if rest.contains('/') {
        return err("must not contain '/' after the first character");
    }
    if rest.bytes().any(|b| b == 0 || b.is_ascii_control()) {
        return err("contains NUL or a control character");
    }
    if rest == "." || rest == ".." {
        return err("is '.' or '..'");
    }
    Ok(())
}

/// A registered shared-memory segment, mapped read-only.
pub struct ShmMemory {
    pub shm_name: String,
    /// What the client registered (≤ the segment's size at registration).
    pub len_bytes: u64,
    fd: OwnedFd,
    /// Start of the read-only mapping of `len_bytes`; null when empty.
    ptr: *const u8,
    /// Set by the fault handler when a read found the segment shrunk; the
    /// mapping's tail is zero pages from then on.
    truncated: AtomicBool,
    /// The writable mapping of [`ShmMemory::map_writable`] (its address; 0:
    /// none yet), made by the first LoadPacked into this region and kept,
    /// its page tables filled, until the region goes.
    rw: std::sync::Mutex<usize>,
}

// SAFETY: the mapping is read-only and owned by this ShmMemory until Drop;
// sharing `*const u8` to it across threads is like sharing a `&[u8]`. The
// client may change the bytes concurrently, which only changes what a copy
// sees (u8 has no invalid values); reads go through raw-pointer copies.
unsafe impl Send for ShmMemory {}
// SAFETY: as above; no interior mutability on our side.
unsafe impl Sync for ShmMemory {}

fn os(name: &str, what: &'static str) -> RegionError {
    RegionError::Os { name: name.to_string(), what, source: io::Error::last_os_error() }
}

impl ShmMemory {
    /// Opens, checks and maps the segment `shm_name` for a peer of `peer_uid`.
    pub fn open(shm_name: &str, len_bytes: u64, peer_uid: u32) -> Result<ShmMemory, RegionError> {
        validate_shm_name(shm_name)?;
        let c = CString::new(shm_name).expect("validated: no NUL");
        // O_RDWR: loads pwrite into the segment; the mapping stays PROT_READ.
        // SAFETY: c is a valid NUL-terminated string; the result is checked.
        let raw = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC, 0) };
        if raw < 0 {
            return Err(os(shm_name, "shm_open"));
        }
        // SAFETY: raw is a descriptor we just opened and own exclusively.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let st = fstat(fd.as_raw_fd()).map_err(|source| RegionError::Os {
            name: shm_name.to_string(),
            what: "fstat",
            source,
        })?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(RegionError::NotRegular { name: shm_name.to_string() });
        }
        if st.st_uid != peer_uid {
            return Err(RegionError::NotOwner { name: shm_name.to_string(), owner_uid: st.st_uid, peer_uid });
        }
        if (st.st_size as u64) < len_bytes {
            return Err(RegionError::TooSmall { name: shm_name.to_string(), size_bytes: st.st_size as u64, len_bytes });
        }
        let ptr = if len_bytes == 0 {
            std::ptr::null()
        } else {
            if usize::try_from(len_bytes).is_err() || len_bytes > isize::MAX as u64 {
                return Err(RegionError::TooSmall {
                    name: shm_name.to_string(),
                    size_bytes: st.st_size as u64,
                    len_bytes,
                });
            }
            // MAP_POPULATE fills the page tables now, at registration, so the
            // copy at save time runs at memcpy speed without page faults.
            // SAFETY: a new shared read-only mapping of an fd we own, no
            // address hint; checked against MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len_bytes as usize,
                    libc::PROT_READ,
                    libc::MAP_SHARED | libc::MAP_POPULATE,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(os(shm_name, "mmap"));
            }
            p as *const u8
        };
        install_fault_handler();
        Ok(ShmMemory {
            shm_name: shm_name.to_string(),
            len_bytes,
            fd,
            ptr,
            truncated: AtomicBool::new(false),
            rw: std::sync::Mutex::new(0),
        })
    }

    /// Runs `f`, which reads this region's mapping (through pointers from
    /// [`ShmMemory::src_ptr`]), with this thread's SIGBUS handler armed for the
    /// region: if the client truncated the segment, the read sees zeros
    /// instead of killing the sidecar, and [`ShmMemory::check_intact`] fails.
    pub fn read<R>(&self, f: impl FnOnce() -> R) -> R {
        arm(
            Armed {
                start: self.ptr as usize,
                len: self.len_bytes as usize,
                writable: false,
                truncated: &self.truncated,
            },
            f,
        )
    }

    /// A second mapping of the segment, writable, for a load that reads
    /// from disk straight into it (O_DIRECT). Made (MAP_POPULATE) by the
    /// first load into this region and kept for later ones, so a reused
    /// region costs no page faults and no unmapping per load; unmapped with
    /// the region. Every access through it runs inside [`Writable::run`].
    pub fn map_writable(&self) -> Result<Writable<'_>, RegionError> {
        if self.ptr.is_null() {
            return Ok(Writable { mem: self, ptr: std::ptr::null_mut(), len: 0 });
        }
        let mut rw = self.rw.lock().unwrap_or_else(|p| p.into_inner());
        if *rw == 0 {
            // SAFETY: a new shared mapping of an fd we own (opened O_RDWR), no
            // address hint, len_bytes checked at open; checked against MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    self.len_bytes as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_POPULATE,
                    self.fd.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(os(&self.shm_name, "mmap (writable)"));
            }
            *rw = p as usize;
        }
        Ok(Writable { mem: self, ptr: *rw as *mut u8, len: self.len_bytes as usize })
    }

    /// Whether a read found the segment shrunk under it.
    pub fn was_truncated(&self) -> bool {
        self.truncated.load(Ordering::Acquire)
    }

    /// The address of `offset_bytes`; `Region` checked that `len_bytes`
    /// from there lie inside the mapping. The caller reads at most
    /// `len_bytes` from it, while it holds the memory.
    fn src_ptr(&self, offset_bytes: u64, len_bytes: u64) -> *const u8 {
        debug_assert!(offset_bytes.checked_add(len_bytes).is_some_and(|e| e <= self.len_bytes));
        if len_bytes == 0 {
            return std::ptr::NonNull::dangling().as_ptr();
        }
        self.ptr.wrapping_add(offset_bytes as usize)
    }

    /// Copies `len` bytes at `offset_bytes` to `dst` with streaming stores,
    /// armed against a truncation ([`ShmMemory::read`]); with `crc`, returns
    /// the crc32c of the bytes staged (else 0), computed from the very
    /// values the copy loaded and stored ([`copy_streaming_crc`]), so it is
    /// that of what was staged even if the trainer writes the source
    /// meanwhile (a second read of the source could see other bytes). Other
    /// threads see the bytes only after this one's [`store_fence`].
    ///
    /// # Safety
    /// `offset_bytes..+len` lies inside the region (`Region` checked it);
    /// `dst..dst+len` is writable and nobody else's for the call.
    pub unsafe fn copy_out(&self, offset_bytes: u64, dst: *mut u8, len: usize, crc: bool) -> u32 {
        let src = self.src_ptr(offset_bytes, len as u64);
        self.read(|| {
            if !crc {
                // SAFETY: the caller's contract; the mapping lives as long as self.
                unsafe { copy_streaming(dst, src, len) };
                return 0;
            }
            // SAFETY: the caller's contract; the mapping lives as long as self.
            unsafe { copy_streaming_crc(dst, src, len) }
        })
    }

    /// [`ShmMemory::copy_out`] that also returns the XXH3-128 of the bytes
    /// (one digest block, `ckpt_store::digest`): block by block of
    /// [`config::COPY_BLOCK_BYTES`], each block copied (with its crc32c when
    /// `crc`), then hashed from the source while it is still in this
    /// core's cache, so the digest costs no second read from memory. The
    /// source may change under the hash (the client's memory): the digest
    /// may then not be the staged bytes', which only makes the tensor count
    /// as changed (a tensor is unchanged only if its crc of the staged
    /// bytes matches too: `ckpt_store::incremental`).
    ///
    /// # Safety
    /// As [`ShmMemory::copy_out`].
    pub unsafe fn copy_out_summed(&self, offset_bytes: u64, dst: *mut u8, len: usize, crc: bool) -> (u32, u128) {
        let src = self.src_ptr(offset_bytes, len as u64);
        self.read(|| {
            let mut c = 0u32;
            let mut h = ckpt_store::digest::BlockHasher::default();
            let mut at = 0usize;
            while at < len {
                let n = (len - at).min(config::COPY_BLOCK_BYTES);
                // SAFETY: the caller's contract (at + n ≤ len); the mapping
                // lives as long as self.
                unsafe {
                    if crc {
                        let b = copy_streaming_crc(dst.add(at), src.add(at), n);
                        c = if at == 0 { b } else { ckpt_store::crc::combine(c, b, n as u64) };
                    } else {
                        copy_streaming(dst.add(at), src.add(at), n);
                    }
                }
                // SAFETY: src..src+len lies in the mapping (the caller's
                // contract), read-only for us and armed against a truncation
                // (ShmMemory::read); another process may write it meanwhile,
                // which only changes the value hashed (see above).
                h.update(unsafe { std::slice::from_raw_parts(src.add(at), n) });
                at += n;
            }
            (c, h.finish())
        })
    }

    /// Re-checks that the segment still holds every registered byte (a
    /// shrunk segment would fault the copy) and that no read found it
    /// shrunk: before a copy, and after it (the client may truncate during).
    pub fn check_intact(&self) -> Result<(), RegionError> {
        let st = fstat(self.fd.as_raw_fd()).map_err(|source| RegionError::Os {
            name: self.shm_name.clone(),
            what: "fstat",
            source,
        })?;
        if self.was_truncated() {
            // A fault with the segment still long enough: a page of it could
            // not be backed (the tmpfs under /dev/shm, or the memory limit, is full).
            if (st.st_size as u64) >= self.len_bytes {
                return Err(RegionError::Unbacked { name: self.shm_name.clone(), len_bytes: self.len_bytes });
            }
            return Err(RegionError::Truncated { name: self.shm_name.clone() });
        }
        if (st.st_size as u64) < self.len_bytes {
            return Err(RegionError::TooSmall {
                name: self.shm_name.clone(),
                size_bytes: st.st_size as u64,
                len_bytes: self.len_bytes,
            });
        }
        Ok(())
    }

    /// Removes the segment's name (its owner died and cannot); a segment
    /// already gone is fine.
    pub fn unlink(&self) {
        let c = CString::new(self.shm_name.as_str()).expect("validated: no NUL");
        // SAFETY: a valid NUL-terminated name; failure leaves the name.
        if unsafe { libc::shm_unlink(c.as_ptr()) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOENT) {
                tracing::warn!(shm = %self.shm_name, "cannot remove a dead client's segment: {e}");
            }
        }
    }

    /// Writes `bytes` at `offset_bytes` with pwrite (loads); `Region`
    /// checked the bounds.
    pub fn write_at(&self, offset_bytes: u64, bytes: &[u8]) -> Result<(), RegionError> {
        let mut done = 0usize;
        while done < bytes.len() {
            let n = (bytes.len() - done).min(config::LOAD_PWRITE_BYTES_MAX);
            // SAFETY: bytes[done..done+n] is a live slice; the fd is ours.
            let r = unsafe {
                libc::pwrite(
                    self.fd.as_raw_fd(),
                    bytes.as_ptr().add(done).cast(),
                    n,
                    (offset_bytes + done as u64) as libc::off_t,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                if e.raw_os_error() == Some(libc::ENOSPC) {
                    // A hole of the segment the full tmpfs cannot back.
                    return Err(RegionError::Unbacked { name: self.shm_name.clone(), len_bytes: self.len_bytes });
                }
                return Err(RegionError::Os { name: self.shm_name.clone(), what: "pwrite", source: e });
            }
            if r == 0 {
                return Err(RegionError::Os {
                    name: self.shm_name.clone(),
                    what: "pwrite",
                    source: io::Error::from(io::ErrorKind::WriteZero),
                });
            }
            done += r as usize;
        }
        Ok(())
    }
}

/// The writable mapping of a region ([`ShmMemory::map_writable`], owned by
/// the region): a load's destination. The region is the client's memory, which it may change or
/// shrink meanwhile: nothing forms a Rust reference to it outside
/// [`Writable::run`], whose fault handling is [`ShmMemory::read`]'s.
pub struct Writable<'a> {
    mem: &'a ShmMemory,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: only the address is shared; the memory behind it is reached
// through raw pointers (the kernel's O_DIRECT reads, the checks' copies) in
// `run`, armed per thread, as for the read-only mapping.
unsafe impl Sync for Writable<'_> {}

impl Writable<'_> {
    /// The address of the region's first byte in this mapping (null when empty).
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Runs `f`, which reads and writes this mapping, with this thread's
    /// SIGBUS handler armed for it: from the first fault on (a segment shrunk
    /// meanwhile, or a page the full tmpfs cannot back), the rest of the
    /// mapping is private zero pages, read as zeros and written to no avail,
    /// and the region is marked truncated ([`ShmMemory::check_intact`]
    /// fails). The kernel's own accesses (an O_DIRECT read into it) fail
    /// with EFAULT instead of a signal.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        arm(Armed { start: self.ptr as usize, len: self.len, writable: true, truncated: &self.mem.truncated }, f)
    }
}

impl Drop for ShmMemory {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: unmapping exactly the mapping made in open(); every
            // pointer handed out by src_ptr is used only while the memory
            // is held (callers keep an Arc<Region> across a copy).
            unsafe {
                libc::munmap(self.ptr as *mut libc::c_void, self.len_bytes as usize);
            }
        }
        let rw = *self.rw.get_mut().unwrap_or_else(|p| p.into_inner());
        if rw != 0 {
            // SAFETY: the writable mapping made by map_writable, of len_bytes;
            // every Writable borrows self, so none is alive here.
            unsafe { libc::munmap(rw as *mut libc::c_void, self.len_bytes as usize) };
        }
    }
}

/// Copies `len` bytes with non-temporal (streaming) stores: the staged
/// image bypasses the caches instead of evicting, line by line, what the
/// trainer computes with from the L3 both cores share, and its lines need
/// no read-for-ownership (a third less memory traffic than a plain copy,
/// which also reads every destination line before writing it). Nobody reads
/// the image soon enough for caching it to pay: the checksum pass starts
/// after the whole copy, and images are far larger than the L3. Ends
/// without a store fence: streaming stores are weakly ordered, so the
/// copying thread calls [`store_fence`] once its copies are done, before
/// any other thread may read them (a fence per copy waits for each 4 KiB
/// tensor's stores to drain: a third of a copy of a thousand of them).
///
/// SAFETY: as [`std::ptr::copy_nonoverlapping`]: `src..src+len` readable,
/// `dst..dst+len` writable, the two disjoint.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // Plain copy up to the first 16-byte aligned destination address.
    let head = dst.align_offset(16).min(len);
    std::ptr::copy_nonoverlapping(src, dst, head);
    let (mut d, mut s, mut n) = (dst.add(head), src.add(head), len - head);
    // SSE2 is part of x86-64: always there. 64 bytes (one line) per round.
    while n >= 64 {
        let a = _mm_loadu_si128(s.cast::<__m128i>());
        let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
        let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
        let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
        _mm_stream_si128(d.cast::<__m128i>(), a);
        _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
        _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
        _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
        d = d.add(64);
        s = s.add(64);
        n -= 64;
    }
    std::ptr::copy_nonoverlapping(s, d, n);
}

/// [`copy_streaming`] that also returns the crc32c of the bytes, computed
/// from the registers each 8 bytes were loaded into and stored from: the
/// checksum of exactly what was staged, whatever the source does meanwhile,
/// in the same single pass over memory. Blocks of `3 * CRC_LANE_BYTES` are
/// done as three lanes side by side (three independent crc32 chains, the
/// instruction's latency hidden), then joined with `crc::combine_op`.
/// Without SSE4.2: copied through a small bounce buffer, checksummed there.
///
/// SAFETY: as [`copy_streaming`].
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming_crc(dst: *mut u8, src: *const u8, len: usize) -> u32 {
    if std::arch::is_x86_feature_detected!("sse4.2") && std::arch::is_x86_feature_detected!("sse4.1") {
        // SAFETY: the CPU has SSE4.1 and 4.2 (checked); the caller's contract.
        unsafe { copy_streaming_crc_sse42(dst, src, len) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { copy_bounced_crc(dst, src, len) }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_streaming_crc(dst: *mut u8, src: *const u8, len: usize) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { copy_bounced_crc(dst, src, len) }
}

use config::COPY_CRC_LANE_BYTES as CRC_LANE_BYTES;

/// SAFETY: as [`copy_streaming`], and the CPU has SSE4.1 and SSE4.2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2,sse4.1")]
unsafe fn copy_streaming_crc_sse42(dst: *mut u8, src: *const u8, len: usize) -> u32 {
    use std::arch::x86_64::{
        __m128i, _mm_crc32_u64, _mm_crc32_u8, _mm_cvtsi128_si64, _mm_extract_epi64, _mm_loadu_si128, _mm_stream_si128,
        _mm_stream_si64,
    };
    // Raw (uninverted) crc state, as the instruction keeps it.
    let mut state: u32 = !0;
    // Byte stores up to a 16-byte aligned destination.
    let head = dst.align_offset(16).min(len);
    for i in 0..head {
        let b = src.add(i).read_volatile();
        dst.add(i).write(b);
        state = _mm_crc32_u8(state, b);
    }
    let (d, s, mut n) = (dst.add(head), src.add(head), len - head);
    let mut at = 0usize;
    let block = 3 * CRC_LANE_BYTES;
    if n >= block {
        let op = ckpt_store::crc::shift_op(CRC_LANE_BYTES as u64);
        while n >= block {
            let (mut a, mut b, mut c) = (!0u32 as u64, !0u32 as u64, !0u32 as u64);
            let (sa, sb, sc) = (s.add(at), s.add(at + CRC_LANE_BYTES), s.add(at + 2 * CRC_LANE_BYTES));
            let (da, db, dc) = (d.add(at), d.add(at + CRC_LANE_BYTES), d.add(at + 2 * CRC_LANE_BYTES));
            let mut i = 0;
            while i < CRC_LANE_BYTES {
                // Each 16 bytes loaded once into a register, stored from it
                // (streaming) and checksummed from it: what is checksummed
                // is what is staged. `loaded_once`: else LLVM folds the
                // crc's loads into `crc32 reg, [src]`, a second read of
                // memory the client may be writing.
                let x = loaded_once(_mm_loadu_si128(sa.add(i).cast::<__m128i>()));
                let y = loaded_once(_mm_loadu_si128(sb.add(i).cast::<__m128i>()));
                let z = loaded_once(_mm_loadu_si128(sc.add(i).cast::<__m128i>()));
                _mm_stream_si128(da.add(i).cast::<__m128i>(), x);
                _mm_stream_si128(db.add(i).cast::<__m128i>(), y);
                _mm_stream_si128(dc.add(i).cast::<__m128i>(), z);
                a = _mm_crc32_u64(a, _mm_cvtsi128_si64(x) as u64);
                b = _mm_crc32_u64(b, _mm_cvtsi128_si64(y) as u64);
                c = _mm_crc32_u64(c, _mm_cvtsi128_si64(z) as u64);
                a = _mm_crc32_u64(a, _mm_extract_epi64::<1>(x) as u64);
                b = _mm_crc32_u64(b, _mm_extract_epi64::<1>(y) as u64);
                c = _mm_crc32_u64(c, _mm_extract_epi64::<1>(z) as u64);
                i += 16;
            }
            // Join: crc(prefix ‖ A ‖ B ‖ C), as standard (inverted) crcs.
            let mut crc = !state;
            for lane in [a as u32, b as u32, c as u32] {
                crc = ckpt_store::crc::combine_op(crc, !lane, op);
            }
            state = !crc;
            at += block;
            n -= block;
        }
    }
    while n >= 8 {
        let x = loaded_once_u64(s.add(at).cast::<u64>().read_unaligned());
        state = _mm_crc32_u64(state as u64, x) as u32;
        _mm_stream_si64(d.add(at).cast::<i64>(), x as i64);
        at += 8;
        n -= 8;
    }
    while n > 0 {
        let x = s.add(at).read_volatile();
        d.add(at).write(x);
        state = _mm_crc32_u8(state, x);
        at += 1;
        n -= 1;
    }
    !state
}

/// `x`, which the compiler must from now on take as an opaque register
/// value: every later use reads that register, never the memory `x` was
/// loaded from. The source of a copy is a client's memory, which another
/// process may write at any moment; without this, LLVM (which assumes the
/// memory unchanged) reads it a second time for the checksum (`crc32 reg,
/// [src]`), and a byte the client changes in between is checksummed other
/// than it is staged: a committed checkpoint that does not verify.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn loaded_once(mut x: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m128i {
    // SAFETY: an empty asm that passes the register through unchanged; it
    // touches no memory, stack or flags. Not `pure`: the compiler may then
    // neither drop it nor run it again on a second load of the source.
    unsafe { std::arch::asm!("/* {0} */", inout(xmm_reg) x, options(nomem, nostack, preserves_flags)) };
    x
}

/// [`loaded_once`] for 8 bytes in a general register.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn loaded_once_u64(mut x: u64) -> u64 {
    // SAFETY: as in loaded_once.
    unsafe { std::arch::asm!("/* {0} */", inout(reg) x, options(nomem, nostack, preserves_flags)) };
    x
}

/// The fallback of [`copy_streaming_crc`]: each block copied into a bounce
/// buffer on this thread's stack, checksummed there, streamed on from there.
///
/// SAFETY: as [`copy_streaming`].
#[allow(dead_code)]
unsafe fn copy_bounced_crc(dst: *mut u8, src: *const u8, len: usize) -> u32 {
    const BOUNCE_BYTES: usize = config::COPY_BOUNCE_BYTES;
    let mut bounce = [0u8; BOUNCE_BYTES];
    let mut c = 0u32;
    let mut at = 0;
    while at < len {
        let n = (len - at).min(BOUNCE_BYTES);
        // SAFETY: the caller's contract; the bounce buffer is this frame's,
        // n ≤ its size, disjoint from both.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), bounce.as_mut_ptr(), n) };
        c = crc32c::crc32c_append(c, &bounce[..n]);
        // SAFETY: as above.
        unsafe { copy_streaming(dst.add(at), bounce.as_ptr(), n) };
        at += n;
    }
    c
}

/// Makes this thread's streaming stores ([`ShmMemory::copy_out`]) globally
/// visible: called by a copying thread once a run of copies is done, before
/// it says so to another thread (the disk writer, or the thread that joins
/// it and replies Released).
#[cfg(target_arch = "x86_64")]
pub fn store_fence() {
    // SAFETY: sfence has no preconditions (SSE, part of x86-64).
    unsafe { std::arch::x86_64::_mm_sfence() }
}

/// Elsewhere copies are plain stores, ordered by the atomics and joins
/// that hand them over.
#[cfg(not(target_arch = "x86_64"))]
pub fn store_fence() {}

/// Elsewhere: a plain copy.
///
/// SAFETY: as [`std::ptr::copy_nonoverlapping`].
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    std::ptr::copy_nonoverlapping(src, dst, len)
}

/// The region a thread is reading, as its SIGBUS handler needs it.
#[derive(Clone, Copy)]
struct Armed {
    start: usize,
    len: usize,
    /// A writable mapping ([`Writable`]): the pages mapped over a fault are
    /// writable too, so the store that faulted runs again and lands in
    /// them (read-only ones would turn it into a SIGSEGV: death).
    writable: bool,
    truncated: *const AtomicBool,
}

/// Runs `f` with this thread's SIGBUS handler armed for `armed`, and puts
/// back what was armed before when `f` returns or unwinds (a drop guard: a
/// panic inside must not leave the handler pointing at a region that may be
/// unmapped next).
fn arm<R>(armed: Armed, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Armed>);
    impl Drop for Restore {
        fn drop(&mut self) {
            compiler_fence(Ordering::SeqCst);
            ARMED.with(|a| a.set(self.0));
        }
    }
    let _restore = Restore(ARMED.with(|a| a.replace(Some(armed))));
    // The handler runs on this thread, between any two instructions:
    // keep the compiler from moving the accesses out of the armed span.
    compiler_fence(Ordering::SeqCst);
    f()
}

thread_local! {
    /// Const-initialised and without a destructor, so reading it is a plain
    /// TLS load: safe inside a signal handler.
    static ARMED: Cell<Option<Armed>> = const { Cell::new(None) };
}

/// The SIGBUS action found at install time, run for faults not ours.
static mut PREVIOUS: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::uninit();
static PAGE_BYTES: AtomicUsize = AtomicUsize::new(4096);

fn install_fault_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            PAGE_BYTES.store(page as usize, Ordering::Relaxed);
        }
        // SAFETY: a zeroed sigaction is valid; the handler has the
        // SA_SIGINFO signature; PREVIOUS is written here only, once, before
        // the handler that reads it is installed (same sigaction call fills
        // it first).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            let previous = std::ptr::addr_of_mut!(PREVIOUS).cast::<libc::sigaction>();
            libc::sigaction(libc::SIGBUS, std::ptr::null(), previous);
            if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
                tracing::warn!("cannot install the SIGBUS handler: {}; a client that truncates its shm during a copy will kill the sidecar", io::Error::last_os_error());
            }
        }
    });
}

/// SIGBUS: if this thread is reading a region and the fault lies in it, map
/// zero pages from the faulting page to the region's end (the faulting load
/// then re-runs and reads zeros; in a writable mapping they are writable,
/// and the faulting store lands in them, lost) and mark the region
/// truncated. Otherwise
/// put the previous action back and return: the fault repeats and is that
/// action's (Rust's guard-page check, or death by SIGBUS).
/// Only async-signal-safe calls: a TLS load, mmap, sigaction, an atomic store.
extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    if let Some(a) = ARMED.with(|a| a.get()) {
        if addr >= a.start && addr - a.start < a.len {
            let page = PAGE_BYTES.load(Ordering::Relaxed);
            let from = addr & !(page - 1);
            let end = (a.start + a.len).div_ceil(page) * page;
            let prot = if a.writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
            // SAFETY: [from, end) lies inside the region's own mapping (mmap
            // rounds it up to whole pages; the read-only one, or the writable
            // one of a Writable), which the armed thread holds alive;
            // replacing it with private zero pages changes only what our
            // accesses of it see and where our stores land (nowhere the
            // client sees). Checked against MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    from as *mut libc::c_void,
                    end - from,
                    prot,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                // SAFETY: `truncated` points into the ShmMemory that `read`
                // borrows for as long as ARMED names it.
                unsafe { (*a.truncated).store(true, Ordering::Release) };
                return;
            }
        }
    }
    // SAFETY: PREVIOUS was filled before this handler was installed.
    unsafe {
        libc::sigaction(libc::SIGBUS, std::ptr::addr_of!(PREVIOUS).cast::<libc::sigaction>(), std::ptr::null_mut())
    };
}

fn fstat(fd: i32) -> io::Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: st is a valid out-pointer for one struct stat; fd is open.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstat succeeded and filled the struct.
    Ok(unsafe { st.assume_init() })
}

/// For tests: a new shm segment of `len` bytes, byte i being `fill(i)`; its
/// name (for [`ShmMemory::open`], then [`unlink_segment`]) and a read-write
/// descriptor (for [`truncate_segment`]).
#[cfg(test)]
pub(crate) fn test_segment(len: usize, fill: impl Fn(usize) -> u8) -> (String, OwnedFd) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let name = format!("/ckpt-unit-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
    let c = CString::new(name.clone()).unwrap();
    // SAFETY: plain libc calls with checked results.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600) };
    assert!(fd >= 0, "shm_open: {}", io::Error::last_os_error());
    // SAFETY: fd was just opened and is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let bytes: Vec<u8> = (0..len).map(fill).collect();
    std::fs::File::from(fd.try_clone().unwrap()).write_all_at(&bytes, 0).unwrap();
    (name, fd)
}

#[cfg(test)]
pub(crate) fn unlink_segment(name: &str) {
    let c = CString::new(name).unwrap();
    // SAFETY: a NUL-terminated name; failure only leaves a segment behind.
    unsafe { libc::shm_unlink(c.as_ptr()) };
}

#[cfg(test)]
pub(crate) fn truncate_segment(fd: &OwnedFd, len: u64) {
    // SAFETY: our own descriptor.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) }, 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(i: usize) -> u8 {
        (i % 251) as u8 + 1
    }

    /// Reads `len` bytes of the region's mapping at `offset` (armed).
    fn read_all(r: &ShmMemory, offset: u64, len: u64) -> Vec<u8> {
        let src = r.src_ptr(offset, len);
        let mut out = vec![0xAAu8; len as usize];
        // SAFETY: src..src+len is inside the live mapping (src_ptr checked).
        r.read(|| unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), len as usize) });
        out
    }

    #[test]
    fn streaming_copy_matches_a_plain_copy_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for src_off in [0usize, 1, 15, 16, 33] {
            for dst_off in [0usize, 1, 8, 17, 64] {
                for len in [0usize, 1, 15, 16, 63, 64, 65, 127, 1000, 4096 + 7] {
                    let mut dst = vec![0xAAu8; 4096 + 200];
                    // SAFETY: both ranges lie inside their vectors, which are distinct.
                    unsafe { copy_streaming(dst.as_mut_ptr().add(dst_off), src.as_ptr().add(src_off), len) };
                    assert_eq!(
                        &dst[dst_off..dst_off + len],
                        &src[src_off..src_off + len],
                        "src+{src_off} dst+{dst_off} len {len}"
                    );
                    assert!(
                        dst[..dst_off].iter().chain(&dst[dst_off + len..]).all(|&x| x == 0xAA),
                        "wrote outside: src+{src_off} dst+{dst_off} len {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_checksummed_copy_stages_the_bytes_and_their_crc_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..200_000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        for src_off in [0usize, 1, 7, 8, 13] {
            for dst_off in [0usize, 1, 5, 8, 64] {
                for len in [
                    0usize,
                    1,
                    7,
                    8,
                    9,
                    63,
                    4096,
                    3 * CRC_LANE_BYTES - 1,
                    3 * CRC_LANE_BYTES,
                    3 * CRC_LANE_BYTES + 9,
                    150_001,
                ] {
                    let mut dst = vec![0xAAu8; 160_000];
                    // SAFETY: both ranges lie inside their vectors, which are distinct.
                    let c =
                        unsafe { copy_streaming_crc(dst.as_mut_ptr().add(dst_off), src.as_ptr().add(src_off), len) };
                    store_fence();
                    let want = &src[src_off..src_off + len];
                    assert_eq!(&dst[dst_off..dst_off + len], want, "src+{src_off} dst+{dst_off} len {len}");
                    assert_eq!(c, crc32c::crc32c(want), "src+{src_off} dst+{dst_off} len {len}");
                    assert!(dst[..dst_off].iter().chain(&dst[dst_off + len..]).all(|&x| x == 0xAA));
                    // SAFETY: as above.
                    let b = unsafe { copy_bounced_crc(dst.as_mut_ptr().add(dst_off), src.as_ptr().add(src_off), len) };
                    assert_eq!(b, c);
                }
            }
        }
    }

    #[test]
    fn the_checksummed_copy_checksums_the_bytes_it_staged_while_its_source_changes() {
        // Regression: the crc was taken with a second read of the source
        // (LLVM folded the loads into `crc32 reg, [src]`), so a source
        // written meanwhile (a client's memory) was staged one way and
        // checksummed another: a Durable step that did not load. Another
        // thread writes the source all along here (atomically; the copy
        // reads it as it reads a client's memory, which another process
        // writes): whatever mix a copy stages, its crc is that mix's.
        use std::sync::atomic::AtomicU64;
        let len = 3 * CRC_LANE_BYTES + 40;
        let src: Vec<AtomicU64> = (0..len / 8 + 1).map(|i| AtomicU64::new(i as u64)).collect();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for w in &src {
                        w.store(k, Ordering::Relaxed);
                        k = k.wrapping_add(1);
                    }
                }
            });
            let mut dst = vec![0u8; len];
            let mut bad = 0;
            for _ in 0..20_000 {
                // SAFETY: src holds at least len bytes, dst exactly len; distinct.
                let c = unsafe { copy_streaming_crc(dst.as_mut_ptr(), src.as_ptr().cast::<u8>(), len) };
                store_fence();
                if c != crc32c::crc32c(&dst) {
                    bad += 1;
                }
            }
            stop.store(true, Ordering::Relaxed);
            assert_eq!(bad, 0, "copies of 20000 whose crc is not that of the bytes they staged");
        });
    }

    #[test]
    fn a_segment_truncated_under_a_read_reads_as_zeros_and_is_refused_from_then_on() {
        let len = 1 << 20;
        let (name, fd) = test_segment(len, pattern);
        // SAFETY: getuid has no preconditions.
        let r = ShmMemory::open(&name, len as u64, unsafe { libc::getuid() }).unwrap();
        unlink_segment(&name);
        assert_eq!(read_all(&r, 0, len as u64), (0..len).map(pattern).collect::<Vec<_>>());
        r.check_intact().unwrap();
        // The owner shrinks it to 3 pages and a bit; the mapping still spans 1 MiB.
        let kept = 3 * 4096 + 100;
        truncate_segment(&fd, kept as u64);
        let got = read_all(&r, 0, len as u64);
        // What lies in the pages still backed is read as it is (the partial
        // last page reads zeros past the new end, as the kernel gives them).
        assert_eq!(&got[..kept], &(0..kept).map(pattern).collect::<Vec<_>>()[..]);
        assert!(got[4 * 4096..].iter().all(|&b| b == 0));
        assert!(r.was_truncated());
        let e = r.check_intact().unwrap_err();
        assert!(matches!(e, RegionError::Truncated { .. }) && e.to_string().contains(&name), "{e}");
        // Growing it back does not make the region usable again: the
        // mapping's tail is no longer the segment.
        truncate_segment(&fd, len as u64);
        assert!(r.check_intact().is_err());
    }

    #[test]
    fn a_fault_outside_an_armed_read_still_kills_the_process() {
        let len = 64 << 10;
        let (name, fd) = test_segment(len, pattern);
        // SAFETY: getuid has no preconditions.
        let r = ShmMemory::open(&name, len as u64, unsafe { libc::getuid() }).unwrap();
        let (other_name, _other_fd) = test_segment(4096, pattern);
        let other = ShmMemory::open(&other_name, 4096, unsafe { libc::getuid() }).unwrap();
        unlink_segment(&name);
        unlink_segment(&other_name);
        truncate_segment(&fd, 0);
        let src = r.src_ptr(0, len as u64);
        for armed_for_other in [false, true] {
            // SAFETY: the child only reads memory and exits; fork in a
            // threaded test process is fine for that.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: a read of the (truncated) mapping: it faults.
                let read = || unsafe { std::ptr::read_volatile(src.add(8192)) };
                let _ = if armed_for_other { other.read(read) } else { read() };
                // SAFETY: leaving the child without running the test harness.
                unsafe { libc::_exit(0) };
            }
            let mut status = 0;
            // SAFETY: waiting for our own child.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(
                libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS,
                "armed for another region: {armed_for_other}, status {status:#x}"
            );
        }
        assert!(!r.was_truncated() && !other.was_truncated());
    }

    #[test]
    fn a_store_into_a_writable_mapping_of_a_truncated_segment_does_not_kill_the_process() {
        // The RAM path of a LoadPacked stores through the writable mapping:
        // read-only zero pages over a fault turned the store's retry into a
        // SIGSEGV (issue 23, defect 1). Checked in a child, which would die.
        let len = 256 << 10;
        let (name, fd) = test_segment(len, pattern);
        // SAFETY: getuid has no preconditions.
        let r = ShmMemory::open(&name, len as u64, unsafe { libc::getuid() }).unwrap();
        unlink_segment(&name);
        let w = r.map_writable().unwrap();
        let dst = w.ptr();
        let src = vec![7u8; len];
        truncate_segment(&fd, 8192 + 100);
        // SAFETY: the child only writes its copy of the mapping and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: dst..dst+len is the writable mapping of the region, src is ours.
            w.run(|| unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, len) });
            let code =
                if r.was_truncated() && matches!(r.check_intact(), Err(RegionError::Truncated { .. })) { 0 } else { 3 };
            // SAFETY: leaving the child without running the test harness.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child died or saw no truncation: status {status:#x}"
        );
        // In this process too: the bytes still backed hold what was stored.
        // SAFETY: as in the child.
        w.run(|| unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, len) });
        assert!(r.check_intact().is_err());
        let mut head = vec![0u8; 8192];
        std::fs::File::from(fd.try_clone().unwrap()).read_exact_at(&mut head, 0).unwrap();
        assert!(head.iter().all(|&b| b == 7));
    }

    #[test]
    fn the_armed_region_is_put_back_when_the_armed_closure_panics() {
        let (name, _fd) = test_segment(4096, pattern);
        // SAFETY: getuid has no preconditions.
        let r = ShmMemory::open(&name, 4096, unsafe { libc::getuid() }).unwrap();
        unlink_segment(&name);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.read(|| panic!("inside"))));
        assert!(caught.is_err());
        assert!(ARMED.with(|a| a.get()).is_none(), "the handler still names the region after the panic");
    }

    #[test]
    fn shm_names_with_path_tricks_are_refused() {
        for bad in
            ["", "/", "x", "/a/b", "/../etc/passwd", "/..", "/.", "/a\0b", "/a\nb", &format!("/{}", "x".repeat(255))]
        {
            assert!(validate_shm_name(bad).is_err(), "{bad:?}");
        }
        for good in ["/ckpt-1-0-0123456789abcdef", "/a", "/.hidden"] {
            validate_shm_name(good).unwrap();
        }
    }
}
