//! The ABI's calls about what the sidecar holds: the committed steps, its
//! status report as JSON, and a rollback to a committed step.

use std::ffi::{c_char, c_int};

use super::args::{client, out};
use super::errors::{guard, invalid};
use super::types::ckpt_client;
use crate::error::Error;

/// Lists committed steps, oldest first: stores their count in *n and the
/// first min(n, cap) of them in `steps`, and the latest step (-1 if none) in
/// *latest (may be NULL). With steps NULL and cap 0 it only counts;
/// otherwise CKPT_E_TRUNCATED when cap < n (the first cap are stored).
///
/// # Safety
/// `client` is a live client; `steps` writable for `cap` values; `n` writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_list(
    client: *mut ckpt_client,
    steps: *mut u64,
    cap: usize,
    n: *mut usize,
    latest: *mut i64,
) -> c_int {
    guard(|| {
        let n = out(n, "n")?;
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        let (all, last) = c.client.list()?;
        // SAFETY: `n` was checked non-NULL; writable by the caller's contract.
        unsafe { *n = all.len() };
        if !latest.is_null() {
            // SAFETY: `latest` is not NULL here; writable by the caller's contract.
            unsafe { *latest = last.map(|s| s as i64).unwrap_or(-1) };
        }
        if steps.is_null() && cap == 0 {
            return Ok(());
        }
        if steps.is_null() {
            return Err(invalid("steps is NULL but cap is not 0"));
        }
        let k = all.len().min(cap);
        // SAFETY: `steps` is not NULL here and writable for `cap` >= `k` values (the caller's contract);
        // `all` holds at least `k`.
        unsafe { std::ptr::copy_nonoverlapping(all.as_ptr(), steps, k) };
        if k < all.len() {
            return Err(Error::Truncated { len_bytes: all.len() as u64, cap_bytes: cap as u64 });
        }
        Ok(())
    })
}

/// The sidecar's status report (sessions, in-flight saves, staging use, last
/// figures) as one JSON object, NUL-terminated, in `buf`; its length without
/// the NUL in *len. With buf NULL and cap 0 it only stores the length;
/// CKPT_E_TRUNCATED when cap <= len.
///
/// # Safety
/// `client` is a live client; `buf` writable for `cap` bytes; `len` writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_status_json(
    client: *mut ckpt_client,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> c_int {
    guard(|| {
        let len = out(len, "len")?;
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        let report = c.client.status()?;
        let json =
            serde_json::to_string(&report).map_err(|e| Error::Protocol(format!("status report not encodable: {e}")))?;
        // SAFETY: `len` was checked non-NULL; writable by the caller's contract.
        unsafe { *len = json.len() };
        if buf.is_null() && cap == 0 {
            return Ok(());
        }
        if buf.is_null() || cap <= json.len() {
            return Err(Error::Truncated { len_bytes: json.len() as u64 + 1, cap_bytes: cap as u64 });
        }
        // SAFETY: `buf` is not NULL here and writable for `cap` > `json.len()` bytes (the caller's contract).
        unsafe {
            std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), json.len());
            *buf.add(json.len()) = 0;
        }
        Ok(())
    })
}

/// Makes the committed checkpoint `step` the newest again (after a loss
/// spike, or a resume from an older step): the sidecar moves `latest` to it
/// first, then un-commits every later step in every target directory,
/// crash-safely, after the saves this client sent before. Later steps can
/// then be saved anew; without a rollback, saving a committed step is
/// refused. `n_removed` (may be NULL) receives how many steps were
/// un-committed. CKPT_E_NOT_FOUND when `step` is not committed.
///
/// # Safety
/// `client` is a live client; `n_removed` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_rollback(client: *mut ckpt_client, step: u64, n_removed: *mut usize) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        let removed = c.client.rollback(step)?;
        if !n_removed.is_null() {
            // SAFETY: the caller's contract.
            unsafe { *n_removed = removed.len() };
        }
        Ok(())
    })
}
