//! The ABI's shared-memory calls: allocate a region (plain or hand-over),
//! name its segment, free it.

use std::ffi::{c_char, c_int, c_void};

use super::args::{client, out};
use super::errors::guard;
use super::types::ckpt_client;
use crate::error::Error;

/// Allocates `len_bytes` of shared memory the sidecar can read (a region),
/// page-aligned and zeroed, and stores its address in *ptr. Tensors given to
/// ckpt_save and ckpt_load must live in such memory.
///
/// # Safety
/// `client` is a live client; `ptr` points to writable storage.
#[no_mangle]
pub unsafe extern "C" fn ckpt_alloc(client: *mut ckpt_client, len_bytes: u64, ptr: *mut *mut c_void) -> c_int {
    // SAFETY: the caller's contract is alloc_into's.
    unsafe { alloc_into(client, len_bytes, ptr, false) }
}

/// ckpt_alloc and ckpt_alloc_hand_over: a region, its address into *ptr.
///
/// # Safety
/// `client` is a live client; `ptr` points to writable storage.
unsafe fn alloc_into(client: *mut ckpt_client, len_bytes: u64, ptr: *mut *mut c_void, hand_over: bool) -> c_int {
    guard(|| {
        let ptr = out(ptr, "ptr")?;
        // SAFETY: the caller's contract.
        let c = &unsafe { self::client(client) }?.client;
        let region = if hand_over { c.alloc_hand_over_region(len_bytes) } else { c.alloc_region(len_bytes) }?;
        // SAFETY: `ptr` is non-NULL and writable by the caller's contract.
        unsafe { *ptr = region.as_ptr().cast() };
        Ok(())
    })
}

/// As ckpt_alloc, for memory that holds copies made at save (a hand-over
/// region): the caller writes it only to fill a save before ckpt_save, and
/// not again until that save is released (ckpt_wait with CKPT_RELEASED).
/// A save whose every tensor lies in such memory is the sidecar's once
/// ckpt_save returned: it commits even if this process dies before its
/// release. Saves that read ckpt_alloc memory (tensors the trainer keeps
/// using) are aborted when the process dies before their release.
///
/// # Safety
/// `client` is a live client; `ptr` points to writable storage.
#[no_mangle]
pub unsafe extern "C" fn ckpt_alloc_hand_over(
    client: *mut ckpt_client,
    len_bytes: u64,
    ptr: *mut *mut c_void,
) -> c_int {
    // SAFETY: the caller's contract is alloc_into's.
    unsafe { alloc_into(client, len_bytes, ptr, true) }
}

/// Copies the name of the shared-memory segment behind memory from
/// ckpt_alloc (`ptr` is the address it returned; e.g. "/ckpt-123-4-…", for
/// shm_open) into `buf` with its NUL, and its length (without the NUL) into
/// *len. A second mapping of that segment (shm_open + mmap MAP_SHARED) sees
/// the same bytes and outlives ckpt_free/ckpt_close, which unlink the name:
/// how the Python package keeps loaded tensors valid after its client is
/// closed. CKPT_E_TRUNCATED (length stored) when `cap` is too small.
///
/// # Safety
/// `client` is a live client; `buf` writable for `cap` bytes (or NULL with
/// cap 0); `len` writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_region_name(
    client: *mut ckpt_client,
    ptr: *mut c_void,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard(|| {
        let len = out(len, "len")?;
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        let region = c
            .client
            .regions()
            .into_iter()
            .find(|r| std::ptr::eq(r.as_ptr(), ptr.cast::<u8>()))
            .ok_or(Error::UnknownRegion { ptr: ptr as usize })?;
        let name = region.shm_name().as_bytes();
        // SAFETY: writable by the contract.
        unsafe { *len = name.len() };
        if buf.is_null() && cap == 0 {
            return Ok(());
        }
        if buf.is_null() || cap < name.len() + 1 {
            return Err(Error::Truncated { len_bytes: name.len() as u64 + 1, cap_bytes: cap as u64 });
        }
        // SAFETY: buf is writable for cap ≥ len + 1 bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(name.as_ptr(), buf.cast::<u8>(), name.len());
            *buf.add(name.len()) = 0;
        }
        Ok(())
    })
}

/// Frees memory from ckpt_alloc or ckpt_alloc_hand_over (`ptr` is the address it returned): the
/// sidecar stops using it (after any copy from it ends), it is unmapped and
/// its shared memory removed.
///
/// # Safety
/// `client` is a live client; nothing uses the memory afterwards.
#[no_mangle]
pub unsafe extern "C" fn ckpt_free(client: *mut ckpt_client, ptr: *mut c_void) -> c_int {
    // SAFETY: the caller's contract.
    guard(|| unsafe { self::client(client) }?.client.free_region_at(ptr.cast()))
}
