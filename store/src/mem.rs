//! Page-aligned, pre-faulted memory for staging and reading.
//!
//! Fresh pages are expensive (on the VMs we run on, memory unused for ~2 s
//! goes back to the hypervisor and costs ~2.2 s/GiB to touch again), so the
//! engine allocates its buffers once, populated up front, and reuses them;
//! the data path never maps memory. See DESIGN.md, "Memory discipline".
//!
//! Two owners, two kinds of access:
//! - [`AlignedBuf`]: owned by one holder (a test, a bench, restore's own
//!   read buffers), like a `Box<[u8]>`: slices through `&self`/`&mut self`.
//! - [`RawBuf`]: memory several threads and the kernel write at once
//!   through raw pointers (the daemon's staging, carved into leases): only
//!   its address and length, never a slice, so safe code cannot form a
//!   reference to bytes someone else is writing. Whoever hands out parts
//!   of it (the daemon's `Lease`) forms the slices, under its own invariant.
//!
//! The store's writers read either through its address alone ([`BufAddr`]).

use std::io;
use std::ptr::NonNull;

use crate::config::{DIRECT_ALIGN_BYTES, HUGE_PAGE_BYTES};

/// madvise(2) advice (Linux 5.14); the libc crate does not name it everywhere.
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// An anonymous private mapping, populated at creation. Its address is
/// page-aligned, so every offset that is a multiple of
/// [`DIRECT_ALIGN_BYTES`] is a valid O_DIRECT buffer address.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its mapping exclusively, like a Box<[u8]>; shared
// access only hands out `&[u8]`, mutable access needs `&mut self`. Memory
// that others write through pointers while it is shared is a RawBuf.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Maps `len` bytes (rounded up to a whole page), pre-faulted and zeroed.
    /// `len == 0` still maps one page so the pointer is always valid.
    ///
    /// A buffer of at least [`HUGE_PAGE_BYTES`] starts at a multiple of it
    /// and is advised MADV_HUGEPAGE before it is populated, so it is backed
    /// by transparent huge pages where the kernel has them (THP "always" or
    /// "madvise"); otherwise it gets 4 KiB pages as before. Its resident size
    /// is still `len` rounded up to 4 KiB.
    pub fn new(len: usize) -> io::Result<AlignedBuf> {
        let map_len = crate::config::align_up(len.max(1) as u64, DIRECT_ALIGN_BYTES) as usize;
        if map_len < HUGE_PAGE_BYTES {
            return Self::map(map_len, libc::MAP_POPULATE).map(|ptr| AlignedBuf { ptr, len: map_len });
        }
        // Over-map by one huge page, then unmap the slack on both sides so
        // the buffer starts on a huge-page boundary.
        let raw_len = map_len + HUGE_PAGE_BYTES;
        let raw = Self::map(raw_len, 0)?.as_ptr();
        let head = raw.align_offset(HUGE_PAGE_BYTES);
        let tail = raw_len - head - map_len;
        // SAFETY: raw..raw+raw_len is our own fresh mapping; the two ranges
        // unmapped are page-aligned (head is a multiple of 4 KiB since raw
        // is page-aligned and HUGE_PAGE_BYTES is) and lie inside it, and
        // neither overlaps raw+head..raw+head+map_len, which we keep.
        unsafe {
            if head > 0 {
                libc::munmap(raw.cast(), head);
            }
            if tail > 0 {
                libc::munmap(raw.add(head + map_len).cast(), tail);
            }
        }
        let p = raw.wrapping_add(head);
        // SAFETY: p..p+map_len is the part of our mapping we kept; advice
        // and population change only its backing, never its contents (it is
        // fresh, zero-filled memory either way).
        unsafe {
            // Refusal (no THP in this kernel, or THP "never") only costs the speed-up.
            libc::madvise(p.cast(), map_len, libc::MADV_HUGEPAGE);
            if libc::madvise(p.cast(), map_len, MADV_POPULATE_WRITE) != 0 {
                // Kernels before 5.14: fault every page in by writing it.
                let mut at = 0;
                while at < map_len {
                    std::ptr::write_volatile(p.add(at), 0);
                    at += DIRECT_ALIGN_BYTES;
                }
            }
        }
        let ptr = NonNull::new(p).expect("inside a successful mapping");
        Ok(AlignedBuf { ptr, len: map_len })
    }

    /// An anonymous private read-write mapping of `len` bytes.
    fn map(len: usize, extra_flags: libc::c_int) -> io::Result<NonNull<u8>> {
        // Miri maps only plain anonymous private memory (zeroed: the same contents).
        let extra_flags = if cfg!(miri) { 0 } else { extra_flags };
        // SAFETY: an anonymous private mapping with no address hint touches no
        // existing memory; the result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(NonNull::new(p.cast::<u8>()).expect("mmap never returns NULL on success"))
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

/// Memory shared by threads and the kernel that write it through raw
/// pointers (the daemon's staging): an address and a length, nothing that
/// forms a reference to its bytes. It owns its mapping (unmapped on drop)
/// and is usually held in an `Arc` by everyone who may still touch it (the
/// staging allocator, the io_uring it is registered with, the CUDA
/// registration), so the address stays valid while any of them holds it.
///
/// Made from a filled [`AlignedBuf`] (`RawBuf::from`) or fresh
/// ([`RawBuf::new`]); there is no way back to the `AlignedBuf` and its
/// slices. Reading or writing through [`RawBuf::as_ptr`] is `unsafe`
/// and the caller's to justify (no one else writes the same bytes at the
/// same time).
///
/// ```
/// let b = ckpt_store::mem::RawBuf::new(4096).unwrap();
/// let (p, n) = (b.as_ptr(), b.len());
/// assert!(!p.is_null() && n == 4096);
/// ```
///
/// It has no slice, safe or not, and no way to borrow the buffer inside
/// (each block fails to compile with the error named):
///
/// ```compile_fail,E0599
/// let b = ckpt_store::mem::RawBuf::new(4096).unwrap();
/// let _: &[u8] = b.as_slice();
/// ```
///
/// ```compile_fail,E0608
/// let b = ckpt_store::mem::RawBuf::new(4096).unwrap();
/// let _: &[u8] = &b[..];
/// ```
///
/// ```compile_fail,E0599
/// let b = ckpt_store::mem::RawBuf::new(4096).unwrap();
/// let _: &[u8] = b.as_ref();
/// ```
///
/// ```compile_fail,E0616
/// let b = ckpt_store::mem::RawBuf::new(4096).unwrap();
/// let _: &ckpt_store::mem::AlignedBuf = &b.mem;
/// ```
pub struct RawBuf {
    /// Never lent out: its slice methods are not reachable from here.
    mem: AlignedBuf,
}

// RawBuf is Send and Sync through AlignedBuf; unlike AlignedBuf, its
// bytes are written through shared access, which is sound because every
// such access is a raw-pointer access in `unsafe` code: safe code gets no
// reference to them.

impl RawBuf {
    /// A fresh mapping, as [`AlignedBuf::new`].
    pub fn new(len: usize) -> io::Result<RawBuf> {
        AlignedBuf::new(len).map(RawBuf::from)
    }

    /// Tries to lock the pages in RAM, as [`AlignedBuf::try_lock`].
    pub fn try_lock(&self) -> bool {
        self.mem.try_lock()
    }

    pub fn len(&self) -> usize {
        self.mem.len
    }

    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }

    /// The start of the mapping, valid for `len()` bytes while `self` lives.
    /// Any access through it is the caller's `unsafe` to justify.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem.ptr.as_ptr()
    }
}

impl From<AlignedBuf> for RawBuf {
    fn from(mem: AlignedBuf) -> RawBuf {
        RawBuf { mem }
    }
}

impl std::fmt::Debug for RawBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RawBuf({:p}, {} bytes)", self.mem.ptr, self.mem.len)
    }
}

/// Memory that the store's writers read through its address alone (the
/// kernel reads it for them): an owned [`AlignedBuf`] or shared staging
/// ([`RawBuf`]). `Store::commit`, `commit_fed`, `write_file` and
/// `write_rank_part*` take `&dyn BufAddr`, so handing them shared staging
/// forms no reference to its bytes.
///
/// # Safety
/// `as_ptr()..as_ptr() + len_bytes()` is one live mapping, readable, with
/// the same address and length for as long as `self` is borrowed.
pub unsafe trait BufAddr: Sync {
    fn as_ptr(&self) -> *const u8;
    fn len_bytes(&self) -> usize;
}

// SAFETY: the mapping made in new(), unmapped only on drop, so it lives as
// long as any borrow of self; ptr and len never change.
unsafe impl BufAddr for AlignedBuf {
    fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    fn len_bytes(&self) -> usize {
        self.len
    }
}

// SAFETY: as for AlignedBuf: it owns one.
unsafe impl BufAddr for RawBuf {
    fn as_ptr(&self) -> *const u8 {
        self.mem.ptr.as_ptr()
    }

    fn len_bytes(&self) -> usize {
        self.mem.len
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

    #[test]
    fn large_buffers_start_on_a_huge_page_and_keep_their_length() {
        let len = 2 * HUGE_PAGE_BYTES + 12_345;
        let mut b = AlignedBuf::new(len).unwrap();
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        assert_eq!(b.len(), crate::config::align_up(len as u64, DIRECT_ALIGN_BYTES) as usize);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        let n = b.len();
        b.as_mut_slice()[0] = 1;
        b.as_mut_slice()[n - 1] = 2;
        assert_eq!((b.as_slice()[0], b.as_slice()[n - 1]), (1, 2));
    }
}
