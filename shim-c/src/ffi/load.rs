//! The ABI's loads: tensors into the caller's places, or all of them packed
//! into one range; then what the last load found (its tensors, blobs,
//! offsets, and why it fell back), kept with C strings on the client.
//!
//! Invariant: the strings and shapes handed out stay valid until the next
//! successful load or the close of that client.

use std::ffi::{c_char, c_int, c_void, CString};

use ckpt_wire::LoadSource;

use super::args::{c_str, client, out, slice, tensor_refs};
use super::codes::{CKPT_SOURCE_DISK, CKPT_SOURCE_DRAIN, CKPT_SOURCE_RAM};
use super::errors::{guard, invalid};
use super::types::{ckpt_client, ckpt_loaded_tensor_info, ckpt_tensor};
use crate::client::LoadInfo;
use crate::error::Error;

/// What the last successful load returned, with its tensors' names, dtypes
/// and shapes laid out for C: every name NUL-terminated, back to back in one
/// buffer, every tensor's dimensions back to back in another (handed out
/// whole by ckpt_loaded_table, and one by one by ckpt_loaded_tensor), each
/// distinct dtype once.
pub(super) struct LoadedC {
    pub(super) info: LoadInfo,
    /// The names, each followed by a NUL (any NUL inside a name removed).
    names: Vec<u8>,
    /// Where tensor i's name starts in `names`.
    name_at: Vec<usize>,
    /// The distinct dtypes, and which one tensor i has.
    dtypes: Vec<CString>,
    dtype_of: Vec<u32>,
    /// Every tensor's dimensions; tensor i's start at `dims_at[i]`.
    dims: Vec<u64>,
    dims_at: Vec<usize>,
}

impl LoadedC {
    fn new(info: LoadInfo) -> LoadedC {
        let n = info.tensors.len();
        let mut names = Vec::with_capacity(info.tensors.iter().map(|t| t.name.len() + 1).sum());
        let mut name_at = Vec::with_capacity(n);
        let mut dtypes: Vec<CString> = Vec::new();
        let mut dtype_of = Vec::with_capacity(n);
        let mut dims = Vec::with_capacity(info.tensors.iter().map(|t| t.shape.len()).sum());
        let mut dims_at = Vec::with_capacity(n);
        for t in &info.tensors {
            name_at.push(names.len());
            names.extend(without_nul(&t.name));
            names.push(0);
            let d = dtypes.iter().position(|d| d.as_bytes().iter().copied().eq(without_nul(&t.dtype)));
            let d = d.unwrap_or_else(|| {
                dtypes.push(CString::new(without_nul(&t.dtype).collect::<Vec<u8>>()).expect("NULs removed"));
                dtypes.len() - 1
            });
            dtype_of.push(d as u32);
            dims_at.push(dims.len());
            dims.extend_from_slice(&t.shape);
        }
        LoadedC { info, names, name_at, dtypes, dtype_of, dims, dims_at }
    }

    /// Where tensor `idx` starts in a ckpt_load_packed's `data`, NOT_PLACED
    /// where it was not placed there (ckpt_loaded_tensor_offset).
    fn offset(&self, idx: usize) -> u64 {
        self.info.offsets.get(idx).copied().unwrap_or(ckpt_wire::NOT_PLACED)
    }

    /// Tensor `idx` described (ckpt_loaded_tensor, ckpt_loaded_tensors);
    /// CKPT_E_INVALID past the count. What it points at lives as long as
    /// this load.
    fn describe(&self, idx: usize) -> Result<ckpt_loaded_tensor_info, Error> {
        let t = self
            .info
            .tensors
            .get(idx)
            .ok_or_else(|| invalid(format!("idx {idx} is past the {} tensors", self.info.tensors.len())))?;
        Ok(ckpt_loaded_tensor_info {
            // In bounds: name_at and dims_at hold an entry per tensor, each
            // at most the length of its buffer.
            name: self.names[self.name_at[idx]..].as_ptr().cast(),
            dtype: self.dtypes[self.dtype_of[idx] as usize].as_ptr(),
            shape: self.dims[self.dims_at[idx]..].as_ptr(),
            ndim: t.shape.len() as u32,
            len_bytes: t.len_bytes,
            offset: self.offset(idx),
        })
    }
}

/// A string's bytes as C gets them: any NUL inside removed.
fn without_nul(s: &str) -> impl Iterator<Item = u8> + '_ {
    s.bytes().filter(|&b| b != 0)
}

impl ckpt_client {
    /// `f` of the last successful load; CKPT_E_NOT_FOUND ("no load yet")
    /// before any.
    fn with_last_load<R>(&self, f: impl FnOnce(&LoadedC) -> Result<R, Error>) -> Result<R, Error> {
        let last = self.last_load.lock().unwrap_or_else(|p| p.into_inner());
        f(last.as_ref().ok_or_else(|| Error::NoSuchBlob { name: "(no load yet)".into() })?)
    }
}

/// Loads checkpoint `step` (-1: the latest good one) into the places the
/// `n_tensors` descriptors name (`data` = destination inside memory from
/// ckpt_alloc; name, dtype, shape and len_bytes must match the checkpoint).
/// With n_tensors 0 it only reports what the checkpoint holds. Stores the
/// step loaded in *out_step and CKPT_SOURCE_RAM / _DISK / _DRAIN in
/// *out_source (either may be NULL). Blobs and the full tensor list are then
/// available through ckpt_loaded_blob / ckpt_loaded_tensor.
///
/// # Safety
/// `client` is a live client; `tensors` points to `n_tensors` valid
/// descriptors (or NULL with 0); non-NULL out-pointers are writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_load(
    client: *mut ckpt_client,
    step: i64,
    tensors: *const ckpt_tensor,
    n_tensors: usize,
    out_step: *mut u64,
    out_source: *mut c_int,
) -> c_int {
    guard(|| {
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        let step = load_step(step)?;
        // SAFETY: `tensors` holds `n_tensors` valid descriptors, or is NULL with 0 (the caller's contract).
        let ts = unsafe { tensor_refs(slice(tensors, n_tensors, "tensors")?) }?;
        let info = c.client.load(step, &ts)?;
        // SAFETY: non-NULL out-pointers are writable (the caller's contract).
        unsafe { c.loaded(info, out_step, out_source) };
        Ok(())
    })
}

/// A load's step argument: -1 for the latest good checkpoint, else a step.
fn load_step(step: i64) -> Result<Option<u64>, Error> {
    match step {
        -1 => Ok(None),
        s if s >= 0 => Ok(Some(s as u64)),
        s => Err(invalid(format!("step {s}: expected a step >= 0 or -1 for the latest"))),
    }
}

impl ckpt_client {
    /// Records a load that succeeded (what ckpt_loaded_* report) and stores
    /// its step and source in the out-pointers that are not NULL.
    ///
    /// # Safety
    /// Non-NULL out-pointers are writable.
    unsafe fn loaded(&self, info: LoadInfo, out_step: *mut u64, out_source: *mut c_int) {
        if !out_step.is_null() {
            // SAFETY: writable by the contract.
            unsafe { *out_step = info.step };
        }
        if !out_source.is_null() {
            let source = match info.source {
                LoadSource::Ram => CKPT_SOURCE_RAM,
                LoadSource::Disk => CKPT_SOURCE_DISK,
                LoadSource::Drain => CKPT_SOURCE_DRAIN,
            };
            // SAFETY: writable by the contract.
            unsafe { *out_source = source };
        }
        *self.last_load.lock().unwrap_or_else(|p| p.into_inner()) = Some(LoadedC::new(info));
    }
}

/// Loads every tensor of checkpoint `step` (-1: the latest good one) into the
/// `len_bytes` at `data` (inside memory from ckpt_alloc, 4096-byte aligned),
/// verified, laid out as the sidecar chooses: ckpt_loaded_tensor_offset says
/// where each tensor starts. From disk the sidecar reads straight into that
/// memory (no copy). Stores the bytes the checkpoint needs in
/// *out_need_bytes; when that is above `len_bytes` nothing was written and
/// the tensor list only says what the checkpoint holds (call again with
/// more). *out_step and *out_source as for ckpt_load; any out-pointer may be
/// NULL. The memory is the caller's again when this returns.
///
/// # Safety
/// `client` is a live client; `data` is memory from ckpt_alloc valid for
/// `len_bytes`; non-NULL out-pointers are writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_load_packed(
    client: *mut ckpt_client,
    step: i64,
    data: *mut c_void,
    len_bytes: u64,
    out_step: *mut u64,
    out_source: *mut c_int,
    out_need_bytes: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        let step = load_step(step)?;
        let info = c.client.load_packed(step, data.cast::<u8>(), len_bytes)?;
        if !out_need_bytes.is_null() {
            // SAFETY: `out_need_bytes` is not NULL here; writable by the caller's contract.
            unsafe { *out_need_bytes = info.need_bytes };
        }
        // SAFETY: non-NULL out-pointers are writable (the caller's contract).
        unsafe { c.loaded(info, out_step, out_source) };
        Ok(())
    })
}

/// Where tensor `idx` of the last successful ckpt_load_packed starts, in
/// bytes from its `data`; UINT64_MAX for a tensor stored in slices by
/// several ranks (not contiguous there: load it with ckpt_load) and after a
/// ckpt_load_packed that wrote nothing or a plain ckpt_load.
///
/// # Safety
/// `client` is a live client; `offset` writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_loaded_tensor_offset(client: *mut ckpt_client, idx: usize, offset: *mut u64) -> c_int {
    guard(|| {
        let offset = out(offset, "offset")?;
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        c.with_last_load(|l| {
            if idx >= l.info.tensors.len() {
                return Err(invalid(format!("idx {idx} is past the {} tensors", l.info.tensors.len())));
            }
            // SAFETY: writable by the contract.
            unsafe { *offset = l.offset(idx) };
            Ok(())
        })
    })
}

/// Copies blob `name` of the last successful ckpt_load into `buf` (capacity
/// `cap_bytes`) and stores its length in *len_bytes. With buf NULL and
/// cap_bytes 0 it only stores the length. CKPT_E_TRUNCATED (length stored,
/// nothing copied) when it does not fit; CKPT_E_NOT_FOUND when there is no
/// such blob or no load yet.
///
/// # Safety
/// `client` is a live client; `name` a C string; `buf` writable for
/// `cap_bytes`; `len_bytes` writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_loaded_blob(
    client: *mut ckpt_client,
    name: *const c_char,
    buf: *mut c_void,
    cap_bytes: u64,
    len_bytes: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        // SAFETY: `name` is NULL or a NUL-terminated string (the caller's contract).
        let name = unsafe { c_str(name, "name") }?;
        let len_out = out(len_bytes, "len_bytes")?;
        let last = c.last_load.lock().unwrap_or_else(|p| p.into_inner());
        let blob = last
            .as_ref()
            .and_then(|l| l.info.blobs.iter().find(|b| b.name == name))
            .ok_or_else(|| Error::NoSuchBlob { name: name.to_string() })?;
        // SAFETY: `buf` is writable for `cap_bytes` bytes or NULL, and `len_out` was
        // checked non-NULL and is writable (the caller's contract).
        unsafe { copy_out(&blob.bytes, buf, cap_bytes, len_out) }
    })
}

/// Copies `bytes` into `buf` (capacity `cap_bytes`) and stores their length
/// in *len_out: ckpt_loaded_blob's and ckpt_loaded_fell_back's contract.
///
/// # Safety
/// `buf` writable for `cap_bytes` (or NULL); `len_out` writable.
unsafe fn copy_out(bytes: &[u8], buf: *mut c_void, cap_bytes: u64, len_out: *mut u64) -> Result<(), Error> {
    let len = bytes.len() as u64;
    // SAFETY: writable by the contract.
    unsafe { *len_out = len };
    if buf.is_null() && cap_bytes == 0 {
        return Ok(());
    }
    if cap_bytes < len || buf.is_null() {
        return Err(Error::Truncated { len_bytes: len, cap_bytes });
    }
    // SAFETY: buf holds at least len bytes by the check and the contract.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len()) };
    Ok(())
}

/// Why the last successful ckpt_load or ckpt_load_packed of "latest" did not
/// load a newer checkpoint (each newer step that would not load, "step N:
/// reason", joined by "; "), copied into `buf` as ckpt_loaded_blob copies a
/// blob; a length of 0 when it loaded the newest. CKPT_E_NOT_FOUND when
/// there was no load yet.
///
/// # Safety
/// `client` is a live client; `buf` writable for `cap_bytes`; `len_bytes`
/// writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_loaded_fell_back(
    client: *mut ckpt_client,
    buf: *mut c_void,
    cap_bytes: u64,
    len_bytes: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        let len_out = out(len_bytes, "len_bytes")?;
        let text = c.with_last_load(|l| Ok(l.info.fell_back.join("; ")))?;
        // SAFETY: `buf` is writable for `cap_bytes` bytes or NULL, and `len_out` was
        // checked non-NULL and is writable (the caller's contract).
        unsafe { copy_out(text.as_bytes(), buf, cap_bytes, len_out) }
    })
}

/// How many tensors the checkpoint of the last successful ckpt_load holds
/// (all of them, not only those loaded).
///
/// # Safety
/// `client` is a live client; `n` writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_loaded_tensor_count(client: *mut ckpt_client, n: *mut usize) -> c_int {
    guard(|| {
        let n = out(n, "n")?;
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        let count = c.with_last_load(|l| Ok(l.info.tensors.len()))?;
        // SAFETY: writable by the contract.
        unsafe { *n = count };
        Ok(())
    })
}

/// Describes tensors `first` .. `first + n` of the last successful ckpt_load
/// or ckpt_load_packed in `out[0]` .. `out[n - 1]`, as n calls of
/// ckpt_loaded_tensor and ckpt_loaded_tensor_offset would, in one call (a
/// checkpoint of many tensors costs a call, not two per tensor).
/// CKPT_E_INVALID when `first + n` is past ckpt_loaded_tensor_count;
/// CKPT_E_NOT_FOUND before any load.
///
/// # Safety
/// `client` is a live client; `out` is writable for `n` entries (may be
/// NULL when n is 0).
#[no_mangle]
pub unsafe extern "C" fn ckpt_loaded_tensors(
    client: *mut ckpt_client,
    first: usize,
    n: usize,
    out: *mut ckpt_loaded_tensor_info,
) -> c_int {
    guard(|| {
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        c.with_last_load(|l| {
            let count = l.info.tensors.len();
            let end = first
                .checked_add(n)
                .filter(|&e| e <= count)
                .ok_or_else(|| invalid(format!("tensors {first} .. {first} + {n} are past the {count} tensors")))?;
            if n == 0 {
                return Ok(());
            }
            let out = self::out(out, "out")?;
            for (k, i) in (first..end).enumerate() {
                // SAFETY: `out` holds n writable entries (the caller's contract), k < n;
                // what the entry points at lives in `last_load` until the next load or the close.
                unsafe { out.add(k).write(l.describe(i)?) };
            }
            Ok(())
        })
    })
}

/// Every name and every shape of the last successful ckpt_load or
/// ckpt_load_packed, each in one piece, so a caller with many tensors reads
/// them with a few copies rather than a call per tensor: *names points at
/// the names in ckpt_loaded_tensor order, each followed by a NUL
/// (*names_len bytes in all, the NULs counted); *dims at all their
/// dimensions, tensor after tensor (*n_dims in all; ckpt_loaded_tensors
/// gives each tensor's ndim). The pointers ckpt_loaded_tensor(s) give for a
/// name or shape point into these. They stay valid until the next load or
/// ckpt_close on this client. Any out-pointer may be NULL; CKPT_E_NOT_FOUND
/// before any load.
///
/// # Safety
/// `client` is a live client; non-NULL out-pointers are writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_loaded_table(
    client: *mut ckpt_client,
    names: *mut *const c_char,
    names_len: *mut usize,
    dims: *mut *const u64,
    n_dims: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        c.with_last_load(|l| {
            // SAFETY: only non-NULL out-pointers are written, each writable (the caller's
            // contract); what they point at lives in `last_load` until the next load or the close.
            unsafe {
                if !names.is_null() {
                    *names = l.names.as_ptr().cast();
                }
                if !names_len.is_null() {
                    *names_len = l.names.len();
                }
                if !dims.is_null() {
                    *dims = l.dims.as_ptr();
                }
                if !n_dims.is_null() {
                    *n_dims = l.dims.len();
                }
            }
            Ok(())
        })
    })
}

/// Describes tensor `idx` (< ckpt_loaded_tensor_count) of the last successful
/// ckpt_load. The strings and shape stay valid until the next ckpt_load or
/// ckpt_close on this client. Any out-pointer may be NULL.
///
/// # Safety
/// `client` is a live client; non-NULL out-pointers are writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_loaded_tensor(
    client: *mut ckpt_client,
    idx: usize,
    name: *mut *const c_char,
    dtype: *mut *const c_char,
    shape: *mut *const u64,
    ndim: *mut u32,
    len_bytes: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        let t = c.with_last_load(|l| l.describe(idx))?;
        // SAFETY: only non-NULL out-pointers are written, each writable (the caller's contract);
        // what they point at lives in `last_load` until the next load or the close.
        unsafe {
            if !name.is_null() {
                *name = t.name;
            }
            if !dtype.is_null() {
                *dtype = t.dtype;
            }
            if !shape.is_null() {
                *shape = t.shape;
            }
            if !ndim.is_null() {
                *ndim = t.ndim;
            }
            if !len_bytes.is_null() {
                *len_bytes = t.len_bytes;
            }
        }
        Ok(())
    })
}
