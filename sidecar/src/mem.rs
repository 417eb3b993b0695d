//! Page-aligned, pre-faulted memory for staging and reading.
//!
//! Fresh pages are expensive (on the VMs we run on, memory unused for ~2 s
//! goes back to the hypervisor and costs ~2.2 s/GiB to touch again), so the
//! engine allocates its buffers once, populated up front, and reuses them;
//! the data path never maps memory. See DESIGN.md, "Memory discipline".

use std::io;
use std::ptr::NonNull;

use crate::config::DIRECT_ALIGN_BYTES;

/// An anonymous private mapping, populated at creation. Its address is
/// page-aligned, so every offset that is a multiple of
/// [`DIRECT_ALIGN_BYTES`] is a valid O_DIRECT buffer address.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its mapping exclusively, like a Box<[u8]>; shared
// access only hands out `&[u8]`, mutable access needs `&mut self`.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Maps `len` bytes (rounded up to a whole page), pre-faulted with
    /// MAP_POPULATE and zeroed. `len == 0` still maps one page so the pointer
    /// is always valid.
    pub fn new(len: usize) -> io::Result<AlignedBuf> {
        let map_len = crate::config::align_up(len.max(1) as u64, DIRECT_ALIGN_BYTES) as usize;
        // SAFETY: an anonymous private mapping with no address hint touches no
        // existing memory; the result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).expect("mmap never returns NULL on success");
        Ok(AlignedBuf { ptr, len: map_len })
    }

    /// Tries to lock the pages in RAM (no swap-out); returns whether it did.
    /// Refusal (RLIMIT_MEMLOCK) is normal for unprivileged users and harmless.
    pub fn try_lock(&self) -> bool {
        // SAFETY: the range is exactly our own live mapping.
        unsafe { libc::mlock(self.ptr.as_ptr().cast(), self.len) == 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is our live mapping, initialised (zero-filled
        // by the kernel); the borrow of self keeps it alive.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in new(); no borrow of it
        // can outlive self.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({:p}, {} bytes)", self.ptr, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_writable() {
        let mut b = AlignedBuf::new(10_000).unwrap();
        assert_eq!(b.as_ptr() as usize % DIRECT_ALIGN_BYTES, 0);
        assert_eq!(b.len(), 12_288);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 7;
        assert_eq!(b.as_slice()[9_999], 7);
    }
}
