//! The caller's arguments made Rust values: C strings, the client pointer,
//! out-pointers, arrays, and the tensor and blob descriptors of a save or
//! load, each checked for NULL and UTF-8 with an error naming the argument.
//!
//! Every function here is only as sound as the caller's side of the header's
//! contract (pointers valid for what they describe); each says which part.

use std::ffi::{c_char, CStr};

use super::errors::invalid;
use super::types::{ckpt_blob, ckpt_client, ckpt_tensor};
use crate::client::{BlobRef, TensorRef};
use crate::error::Error;

/// `what` names the argument in an error (formatted only then: a save
/// checks thousands of names).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for `'a`.
pub(crate) unsafe fn c_str<'a>(p: *const c_char, what: impl std::fmt::Display) -> Result<&'a str, Error> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| invalid(format!("{what} is not valid UTF-8")))
}

/// # Safety
/// `p` is NULL or points to a live `ckpt_client` (from ckpt_connect or ckpt_default_client).
pub(crate) unsafe fn client<'a>(p: *const ckpt_client) -> Result<&'a ckpt_client, Error> {
    // SAFETY: the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| invalid("client is NULL"))
}

pub(crate) fn out<T>(p: *mut T, what: &str) -> Result<*mut T, Error> {
    if p.is_null() {
        Err(invalid(format!("{what} is NULL")))
    } else {
        Ok(p)
    }
}

/// # Safety
/// `p` is NULL (with n == 0) or points to `n` live values.
pub(crate) unsafe fn slice<'a, T>(p: *const T, n: usize, what: impl std::fmt::Display) -> Result<&'a [T], Error> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL but its count is {n}")));
    }
    // SAFETY: the caller's contract: `n` live values at `p`.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// # Safety
/// Each descriptor's pointers are valid as ckpt_tensor documents.
pub(crate) unsafe fn tensor_refs<'a>(ts: &'a [ckpt_tensor]) -> Result<Vec<TensorRef<'a>>, Error> {
    // Sized once: a collect into Result would grow it step by step, a dozen
    // reallocations and copies for thousands of tensors.
    let mut out = Vec::with_capacity(ts.len());
    for (i, t) in ts.iter().enumerate() {
        // SAFETY: each descriptor's `name` is NULL or a NUL-terminated string (the caller's contract).
        let name = unsafe { c_str(t.name, format_args!("tensors[{i}].name")) }?;
        // SAFETY: each descriptor's `dtype` is NULL or a NUL-terminated string (the caller's contract).
        let dtype = unsafe { c_str(t.dtype, format_args!("tensors[{i}].dtype ({name})")) }?;
        // SAFETY: each descriptor's `shape` holds `ndim` values, or is NULL with 0 (the caller's contract).
        let shape = unsafe { slice(t.shape, t.ndim as usize, format_args!("tensors[{i}].shape ({name})")) }?;
        out.push(TensorRef { name, dtype, shape, ptr: t.data.cast(), len_bytes: t.len_bytes });
    }
    Ok(out)
}

/// The blobs of a save, borrowed from the caller's array.
///
/// # Safety
/// `blobs` is NULL with `n_blobs` 0, or points to `n_blobs` valid entries
/// whose names and data outlive the returned references.
pub(crate) unsafe fn blob_refs<'a>(blobs: *const ckpt_blob, n_blobs: usize) -> Result<Vec<BlobRef<'a>>, Error> {
    // SAFETY: `blobs` holds `n_blobs` entries, or is NULL with 0 (the caller's contract).
    let bs = unsafe { slice(blobs, n_blobs, "blobs") }?;
    bs.iter()
        .enumerate()
        .map(|(i, b)| {
            // SAFETY: each entry's `name` is NULL or a NUL-terminated string (the caller's contract).
            let name = unsafe { c_str(b.name, format_args!("blobs[{i}].name")) }?;
            let (data, len_bytes) = (b.data.cast::<u8>(), b.len_bytes as usize);
            // SAFETY: each entry's `data` holds `len_bytes` bytes, or is NULL with 0 (the caller's contract).
            let bytes = unsafe { slice(data, len_bytes, format!("blobs[{i}].data ({name})")) }?;
            Ok(BlobRef { name, bytes })
        })
        .collect()
}
