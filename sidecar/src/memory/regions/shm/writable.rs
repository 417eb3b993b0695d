//! The writable mapping of a host region ([`ShmMemory::map_writable`]):
//! a LoadPacked reads from disk straight into the client's segment
//! (O_DIRECT) through it. Made by the first such load into the region and
//! kept until the region goes (`ShmMemory`'s Drop unmaps it), so a reused
//! region costs no page faults per load. The segment stays the client's,
//! which may change or shrink it meanwhile: nothing forms a Rust reference
//! to it, and every access runs inside [`Writable::run`], armed against
//! SIGBUS as reads are (`sigbus.rs`), with writable zero pages over a
//! fault so the faulting store lands somewhere.

use std::os::fd::AsRawFd;

use super::sigbus::{arm, Armed};
use super::{os, RegionError, ShmMemory};

impl ShmMemory {
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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::super::{test_region, truncate_segment};
    use super::*;

    #[test]
    fn a_store_into_a_writable_mapping_of_a_truncated_segment_does_not_kill_the_process() {
        // The RAM path of a LoadPacked stores through the writable mapping:
        // read-only zero pages over a fault would turn the store's retry
        // into a SIGSEGV, so they are mapped writable. Checked in a child,
        // which would die.
        let len = 256 << 10;
        let (r, _name, fd) = test_region(len);
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
}
