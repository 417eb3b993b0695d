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
//!
//! The fault handler is `sigbus.rs`; the copy into staging (streaming
//! stores, the crc32c of the very bytes staged) is `streaming_copy.rs`; the
//! writable mapping a LoadPacked reads from disk into is `writable.rs`.

mod sigbus;
mod streaming_copy;
mod writable;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
#[cfg(test)]
use std::os::unix::fs::FileExt;
#[cfg(test)]
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::config;

use super::RegionError;
use sigbus::{arm, install_fault_handler, Armed};
pub use streaming_copy::TRIO_BYTES_MAX;
use streaming_copy::{copy_streaming, copy_streaming_crc, copy_streaming_crc3};
pub use streaming_copy::{copy_streaming_fenced, store_fence};
pub use writable::Writable;

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

    /// [`ShmMemory::copy_out`] with crc of three ranges of one length at
    /// once, side by side ([`copy_streaming_crc3`]): their crc32c, or None
    /// (nothing copied) when they do not suit it.
    ///
    /// # Safety
    /// As [`ShmMemory::copy_out`], for each range.
    pub unsafe fn copy_out3(&self, offsets: [u64; 3], dst: [*mut u8; 3], len: usize) -> Option<[u32; 3]> {
        let src = offsets.map(|o| self.src_ptr(o, len as u64));
        // SAFETY: the caller's contract; the mapping lives as long as self.
        self.read(|| unsafe { copy_streaming_crc3(dst, src, len) })
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
            // One block (most tensors of a many-tensor state) is hashed in
            // one call after its copy: a streaming hasher costs more to set
            // up than such a tensor to hash.
            let mut h = (len > config::COPY_BLOCK_BYTES).then(ckpt_store::digest::BlockHasher::default);
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
                if let Some(h) = h.as_mut() {
                    // SAFETY: src..src+len lies in the mapping (the caller's
                    // contract), read-only for us and armed against a truncation
                    // (ShmMemory::read); another process may write it meanwhile,
                    // which only changes the value hashed (see above).
                    h.update(unsafe { std::slice::from_raw_parts(src.add(at), n) });
                }
                at += n;
            }
            match h {
                Some(h) => (c, h.finish()),
                // SAFETY: as above, for the whole (single-block) range.
                None => (c, ckpt_store::digest::block_digest(unsafe { std::slice::from_raw_parts(src, len) })),
            }
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

/// For tests: byte i of a [`test_region`]'s segment.
#[cfg(test)]
pub(crate) fn test_pattern(i: usize) -> u8 {
    (i % 251) as u8 + 1
}

/// For tests: a region over a new segment of `len` bytes filled with
/// [`test_pattern`], opened for this process's uid and already unlinked;
/// with the segment's name and a read-write descriptor (for
/// [`truncate_segment`]).
#[cfg(test)]
pub(crate) fn test_region(len: usize) -> (ShmMemory, String, OwnedFd) {
    let (name, fd) = test_segment(len, test_pattern);
    // SAFETY: getuid has no preconditions.
    let r = ShmMemory::open(&name, len as u64, unsafe { libc::getuid() }).unwrap();
    unlink_segment(&name);
    (r, name, fd)
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
    use super::test_pattern as pattern;
    use super::*;

    /// Reads `len` bytes of the region's mapping at `offset` (armed).
    fn read_all(r: &ShmMemory, offset: u64, len: u64) -> Vec<u8> {
        let src = r.src_ptr(offset, len);
        let mut out = vec![0xAAu8; len as usize];
        // SAFETY: src..src+len is inside the live mapping (src_ptr checked).
        r.read(|| unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), len as usize) });
        out
    }

    #[test]
    fn a_summed_copy_gives_the_bytes_their_crc_and_their_block_digest_at_every_length() {
        // One block is hashed in one call, more are streamed: the same
        // crc32c and digest block either way, and the same bytes copied.
        let len = 1 << 20;
        let (r, _name, _fd) = test_region(len);
        let b = config::COPY_BLOCK_BYTES;
        for (offset, n) in [(0, 0), (3, 1), (0, 4096), (17, 4096 + 5), (0, b), (64, b + 1), (1, 3 * b + 7), (0, len)] {
            let want = read_all(&r, offset as u64, n as u64);
            for crc in [true, false] {
                let mut dst = vec![0u8; n];
                // SAFETY: offset + n lies in the segment; dst holds n bytes.
                let got = unsafe { r.copy_out_summed(offset as u64, dst.as_mut_ptr(), n, crc) };
                assert_eq!(dst, want, "{n} bytes at {offset}");
                let crc_want = if crc { crc32c::crc32c(&want) } else { 0 };
                assert_eq!(
                    got,
                    (crc_want, ckpt_store::digest::block_digest(&want)),
                    "{n} bytes at {offset}, crc {crc}"
                );
            }
        }
    }

    #[test]
    fn a_segment_truncated_under_a_read_reads_as_zeros_and_is_refused_from_then_on() {
        let len = 1 << 20;
        let (r, name, fd) = test_region(len);
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
        // SAFETY: getuid has no preconditions.
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
