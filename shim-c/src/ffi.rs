//! The C ABI (`include/ckpt.h` is generated from this file by cbindgen; the
//! test `tests/header.rs` fails when the checked-in header drifts).
//!
//! Conventions:
//! - every function returns an `int` status: `CKPT_OK` (0) or a negative
//!   `CKPT_E_*`; results come back through out-parameters;
//! - after a failure, `ckpt_last_error()` gives this thread's message;
//! - no panic crosses the ABI: every body runs under `catch_unwind`, and a
//!   caught panic is `CKPT_E_PANIC` with the panic's message;
//! - a `ckpt_client*` may be used from several threads at once, except that
//!   `ckpt_close` must be the last call on it.

#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use ckpt_wire::{ErrorCode, LoadSource};

use crate::client::{BlobRef, Client, LoadInfo, SaveHandle, SaveState, TensorRef, Wanted};
use crate::error::Error;

/// Success.
pub const CKPT_OK: c_int = 0;
/// A bad argument: NULL where a value is needed, invalid UTF-8, unknown enum value.
pub const CKPT_E_INVALID: c_int = -1;
/// No sidecar listens at the socket path.
pub const CKPT_E_CONNECT: c_int = -2;
/// The sidecar refused the handshake (uid, magic) or speaks another protocol version.
pub const CKPT_E_REFUSED: c_int = -3;
/// The sidecar went away (exited, killed); a later call reconnects when one is back.
pub const CKPT_E_DISCONNECTED: c_int = -4;
/// The timeout passed first.
pub const CKPT_E_TIMEOUT: c_int = -5;
/// Creating or mapping shared memory failed.
pub const CKPT_E_SHM: c_int = -6;
/// A tensor is not inside memory from `ckpt_alloc`, or the sidecar rejected a region.
pub const CKPT_E_REGION: c_int = -7;
/// No such checkpoint, tensor, blob, region or save id.
pub const CKPT_E_NOT_FOUND: c_int = -8;
/// The sidecar rejected the request (names, dtypes, sizes, overlaps, step already taken).
pub const CKPT_E_BAD_REQUEST: c_int = -9;
/// A checkpoint on disk is damaged (checksum mismatch).
pub const CKPT_E_DAMAGED: c_int = -10;
/// An I/O error in the sidecar (disk full, EIO, read-only file system).
pub const CKPT_E_IO: c_int = -11;
/// The checkpoint can never fit the sidecar's staging budget.
pub const CKPT_E_TOO_LARGE: c_int = -12;
/// The sidecar is shutting down.
pub const CKPT_E_SHUTTING_DOWN: c_int = -13;
/// The sidecar sent something this shim does not expect.
pub const CKPT_E_PROTOCOL: c_int = -14;
/// A caller's buffer is too small; the needed length was stored.
pub const CKPT_E_TRUNCATED: c_int = -15;
/// The client was closed, or belongs to the parent of this (forked) process.
pub const CKPT_E_CLOSED: c_int = -16;
/// A CUDA driver call failed, or there is no CUDA driver (ckpt_register_cuda, ckpt_save_on_stream).
pub const CKPT_E_CUDA: c_int = -17;
/// A bug inside libckpt (a caught panic); the message says where.
pub const CKPT_E_PANIC: c_int = -99;

/// Save state (ckpt_poll): the sidecar has not released the tensors yet.
pub const CKPT_PENDING: c_int = 0;
/// Save state, and what ckpt_wait can wait for: the tensors may change again.
pub const CKPT_RELEASED: c_int = 1;
/// Save state, and what ckpt_wait can wait for: the checkpoint is committed on disk.
pub const CKPT_DURABLE: c_int = 2;
/// Save state: the save failed; ckpt_wait on it returns the error.
pub const CKPT_FAILED: c_int = 3;
/// Save state, and what ckpt_wait can wait for: the checkpoint is committed
/// on the sidecar's drain target (`--drain URL`) too (protocol 13). ckpt_poll
/// says so only once a wait for it returned.
pub const CKPT_REPLICATED: c_int = 4;

/// Load source (ckpt_load): the sidecar still held the checkpoint in memory.
pub const CKPT_SOURCE_RAM: c_int = 1;
/// Load source (ckpt_load): the checkpoint was read (and verified) from disk.
pub const CKPT_SOURCE_DISK: c_int = 2;

/// A connection to the sidecar, its shared-memory regions and saves (opaque).
pub struct ckpt_client {
    pub(crate) client: Client,
    /// What the last successful ckpt_load returned, with C strings for it.
    last_load: Mutex<Option<LoadedC>>,
}

struct LoadedC {
    info: LoadInfo,
    names: Vec<CString>,
    dtypes: Vec<CString>,
}

/// A tensor to save, or a place to load one into.
#[repr(C)]
pub struct ckpt_tensor {
    /// NUL-terminated UTF-8 name, unique within the checkpoint (e.g. "layers.0.weight").
    pub name: *const c_char,
    /// safetensors dtype: "F32", "BF16", "F16", "I64", "U8", ...
    pub dtype: *const c_char,
    /// `ndim` dimensions (may be NULL when ndim is 0).
    pub shape: *const u64,
    pub ndim: u32,
    /// Save: the tensor's bytes. Load: where to put them. Must lie inside memory from ckpt_alloc.
    pub data: *const c_void,
    /// Must equal the dtype's size times the product of the shape.
    pub len_bytes: u64,
}

/// One piece of a file for ckpt_save_file_pieces: `len_bytes` at `data`,
/// inside memory from ckpt_alloc or a CUDA allocation registered with
/// ckpt_register_cuda.
#[repr(C)]
pub struct ckpt_file_piece {
    pub data: *const c_void,
    pub len_bytes: u64,
}

/// ckpt_save_file_pieces: write the pieces as they are.
pub const CKPT_FILE_AS_IS: c_int = 0;
/// ckpt_save_file_pieces: the pieces make a torch.save zip archive written
/// under torch.serialization.skip_data() with its storages' bytes placed by
/// pieces; the sidecar computes the CRC-32s torch.save would have written.
pub const CKPT_FILE_TORCH_ZIP: c_int = 1;

/// A small named byte string saved beside the tensors (RNG state, data position, ...).
#[repr(C)]
pub struct ckpt_blob {
    /// NUL-terminated name (a plain file name: no '/', no "..").
    pub name: *const c_char,
    pub data: *const c_void,
    pub len_bytes: u64,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).expect("NULs replaced");
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn code_status(code: ErrorCode) -> c_int {
    match code {
        ErrorCode::BadRequest => CKPT_E_BAD_REQUEST,
        ErrorCode::BadRegion => CKPT_E_REGION,
        ErrorCode::NotFound => CKPT_E_NOT_FOUND,
        ErrorCode::Damaged => CKPT_E_DAMAGED,
        ErrorCode::Io => CKPT_E_IO,
        ErrorCode::ShuttingDown => CKPT_E_SHUTTING_DOWN,
        ErrorCode::TooLarge => CKPT_E_TOO_LARGE,
    }
}

/// The status code of an error (the C ABI's view of [`Error`]).
pub fn status_of(e: &Error) -> c_int {
    match e {
        Error::InvalidArgument(_) => CKPT_E_INVALID,
        Error::Connect { .. } => CKPT_E_CONNECT,
        Error::Refused { .. } | Error::Version { .. } | Error::Handshake { .. } => CKPT_E_REFUSED,
        Error::Disconnected { .. } => CKPT_E_DISCONNECTED,
        Error::Timeout { .. } => CKPT_E_TIMEOUT,
        Error::Region(crate::region::RegionError::BadLength { .. }) => CKPT_E_INVALID,
        Error::Region(_) => CKPT_E_SHM,
        Error::OutsideRegion { .. } => CKPT_E_REGION,
        Error::UnknownRegion { .. } | Error::UnknownSave { .. } | Error::NoSuchBlob { .. } => CKPT_E_NOT_FOUND,
        Error::SaveFailed { code, .. } | Error::Remote { code, .. } => code_status(*code),
        Error::Protocol(_) => CKPT_E_PROTOCOL,
        Error::Truncated { .. } => CKPT_E_TRUNCATED,
        Error::Closed | Error::Forked { .. } => CKPT_E_CLOSED,
        Error::Cuda(_) => CKPT_E_CUDA,
    }
}

/// Runs an ABI body: errors become status codes plus the thread's last
/// error, panics become CKPT_E_PANIC.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Error>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CKPT_OK,
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            status_of(&e)
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("internal error in libckpt (please report): {what}"));
            CKPT_E_PANIC
        }
    }
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

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
    // Sized once (a collect into Result grows it step by step: thousands of
    // tensors meant a dozen reallocations and copies per save).
    let mut out = Vec::with_capacity(ts.len());
    for (i, t) in ts.iter().enumerate() {
        // SAFETY: the caller's contract for each field.
        let name = unsafe { c_str(t.name, format_args!("tensors[{i}].name")) }?;
        let dtype = unsafe { c_str(t.dtype, format_args!("tensors[{i}].dtype ({name})")) }?;
        let shape = unsafe { slice(t.shape, t.ndim as usize, format_args!("tensors[{i}].shape ({name})")) }?;
        out.push(TensorRef { name, dtype, shape, ptr: t.data.cast(), len_bytes: t.len_bytes });
    }
    Ok(out)
}

/// The library's version, e.g. "libckpt 0.1.0 (protocol 1)". Never NULL; static.
#[no_mangle]
pub extern "C" fn ckpt_version() -> *const c_char {
    concat!("libckpt ", env!("CARGO_PKG_VERSION"), " (protocol 1)\0").as_ptr().cast()
}

/// The wire protocol version this library speaks.
#[no_mangle]
pub extern "C" fn ckpt_protocol_version() -> u32 {
    ckpt_wire::PROTOCOL_VERSION
}

/// The message of the last failed call on this thread ("" if none). Never
/// NULL; valid until the next failing ckpt_ call on this thread.
#[no_mangle]
pub extern "C" fn ckpt_last_error() -> *const c_char {
    catch_unwind(|| LAST_ERROR.with(|e| e.borrow().as_ptr())).unwrap_or(c"".as_ptr())
}

/// Connects to the sidecar at `path`, or (path NULL) at $CKPT_SIDECAR_SOCKET,
/// else $XDG_RUNTIME_DIR/ckpt-sidecar/sidecar.sock, else
/// /tmp/ckpt-sidecar-<uid>/sidecar.sock. On success stores the client in *out.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `out` points to writable storage.
#[no_mangle]
pub unsafe extern "C" fn ckpt_connect(path: *const c_char, out: *mut *mut ckpt_client) -> c_int {
    guard(|| {
        let out = self::out(out, "out")?;
        // SAFETY: the caller's contract.
        let path = if path.is_null() { None } else { Some(unsafe { c_str(path, "path") }?) };
        let client = Client::connect(path.map(Path::new))?;
        let boxed = Box::new(ckpt_client { client, last_load: Mutex::new(None) });
        // SAFETY: `out` is non-NULL and writable by the caller's contract.
        unsafe { *out = Box::into_raw(boxed) };
        Ok(())
    })
}

/// Says goodbye to the sidecar and frees the client: saves already released
/// still commit, saves not released are aborted, regions are unmapped and
/// their shared memory removed. NULL is a no-op. The default client
/// (ckpt_default_client) lives as long as the process and cannot be closed.
///
/// # Safety
/// `client` is NULL or from ckpt_connect and not used after this call.
#[no_mangle]
pub unsafe extern "C" fn ckpt_close(client: *mut ckpt_client) -> c_int {
    guard(|| {
        if client.is_null() {
            return Ok(());
        }
        if std::ptr::eq(client, default_client_ptr()) {
            return Err(invalid("the default client lives as long as the process; it cannot be closed"));
        }
        // SAFETY: from Box::into_raw in ckpt_connect, and the caller gives up its use.
        let boxed = unsafe { Box::from_raw(client) };
        boxed.client.close();
        Ok(())
    })
}

/// Connects again if the sidecar went away (re-registering every region
/// under its old name, so tensor pointers stay valid). CKPT_OK if connected.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_reconnect(client: *mut ckpt_client) -> c_int {
    // SAFETY: the caller's contract.
    guard(|| unsafe { self::client(client) }?.client.reconnect())
}

/// Whether the connection is up: 1 yes, 0 no (the next call will try to reconnect).
///
/// # Safety
/// `client` is NULL or a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_connected(client: *const ckpt_client) -> c_int {
    // SAFETY: the caller's contract.
    catch_unwind(AssertUnwindSafe(|| unsafe { client.as_ref() }.is_some_and(|c| c.client.is_connected()) as c_int))
        .unwrap_or(0)
}

/// Limits how long ckpt_load, ckpt_list, ckpt_alloc, ckpt_free and
/// ckpt_status_json wait for the sidecar's answer (timeout_ms < 0: no limit,
/// the default). Saves are timed by ckpt_wait's own argument.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_set_timeout(client: *mut ckpt_client, timeout_ms: i64) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        c.client.set_request_timeout(u64::try_from(timeout_ms).ok().map(Duration::from_millis));
        Ok(())
    })
}

/// on != 0: later saves ask for a lazy release. For a trainer that does not
/// block on CKPT_RELEASED right after ckpt_save (it computes meanwhile): the
/// sidecar then checksums each block while copying it, one pass over memory
/// fewer, so it disturbs the computation less, but Released comes later.
/// on == 0 (the default): Released as early as possible.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_set_lazy_release(client: *mut ckpt_client, on: c_int) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe { self::client(client) }?.client.set_lazy_release(on != 0);
        Ok(())
    })
}

/// This trainer is rank `rank` of `world_size` ranks (torch.distributed's
/// numbering). With world_size > 1, later ckpt_save calls send this rank's
/// part of a checkpoint every rank saves under the same step; the sidecar
/// commits it once every rank's part is there, and only then is any rank's
/// save durable. Files are named `rank-RRRRR-of-WWWWW-...`.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_set_rank(client: *mut ckpt_client, rank: u32, world_size: u32) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe { self::client(client) }?.client.set_rank(rank, world_size)?;
        Ok(())
    })
}

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

/// Asks the sidecar to checkpoint `n_tensors` tensors and `n_blobs` blobs as
/// step `step`, and returns at once with the save's id in *save_id. The
/// tensors must not change until the save is released (ckpt_wait with
/// CKPT_RELEASED); blobs are copied before this returns. Errors the sidecar
/// finds in the request come back from ckpt_wait / ckpt_poll.
///
/// # Safety
/// `client` is a live client; `tensors` / `blobs` point to that many valid
/// descriptors (or are NULL with a count of 0); `save_id` is writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_save(
    client: *mut ckpt_client,
    step: u64,
    tensors: *const ckpt_tensor,
    n_tensors: usize,
    blobs: *const ckpt_blob,
    n_blobs: usize,
    save_id: *mut u64,
) -> c_int {
    // SAFETY: the caller's contract, which is save_with's.
    unsafe { save_with(client, tensors, n_tensors, blobs, n_blobs, save_id, |c, ts, bs| c.save(step, ts, bs)) }
}

/// The body every save entry point shares (ckpt_save, ckpt_save_on_stream,
/// ckpt_save_flagged): decodes the client, the tensors and the blobs, asks
/// `send` to send the save, and stores its id in *save_id.
///
/// # Safety
/// As ckpt_save: `client` is a live client; `tensors` / `blobs` point to
/// that many valid descriptors (or are NULL with a count of 0); `save_id`
/// is writable.
pub(crate) unsafe fn save_with(
    client: *mut ckpt_client,
    tensors: *const ckpt_tensor,
    n_tensors: usize,
    blobs: *const ckpt_blob,
    n_blobs: usize,
    save_id: *mut u64,
    send: impl FnOnce(&Client, &[TensorRef<'_>], &[BlobRef<'_>]) -> Result<SaveHandle, Error>,
) -> c_int {
    guard(|| {
        let save_id = out(save_id, "save_id")?;
        // SAFETY (this block): the caller's contract for every pointer.
        let c = unsafe { self::client(client) }?;
        let ts = unsafe { tensor_refs(slice(tensors, n_tensors, "tensors")?) }?;
        let bs = unsafe { blob_refs(blobs, n_blobs) }?;
        let h = send(&c.client, &ts, &bs)?;
        unsafe { *save_id = h.id };
        Ok(())
    })
}

/// Tensor flag (ckpt_save_flagged): the tensor holds the very bytes it held
/// when this client's save of `since_step` copied them (protocol 13).
pub const CKPT_TENSOR_UNCHANGED: u32 = 1;

/// As ckpt_save_on_stream (and, with no CUDA tensor, as ckpt_save), with a
/// flags word per tensor: `tensor_flags[i]` (NULL: none) may hold
/// CKPT_TENSOR_UNCHANGED, which promises that `tensors[i]` holds the very
/// bytes it held when this client's save of step `since_step` copied them.
/// The sidecar then may take them from that step instead of copying them
/// (on a GPU: no device-to-host copy), when it holds the step as this
/// connection saved it; otherwise it copies them as usual. A broken
/// promise is not detected: the checkpoint then holds the old bytes.
/// `since_step` < 0: no tensor is flagged. Unknown flag bits are refused
/// (CKPT_E_INVALID). ckpt_save and ckpt_save_on_stream are unchanged.
///
/// # Safety
/// As ckpt_save_on_stream; `tensor_flags` is NULL or holds `n_tensors`
/// words.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ckpt_save_flagged(
    client: *mut ckpt_client,
    step: u64,
    tensors: *const ckpt_tensor,
    n_tensors: usize,
    tensor_flags: *const u32,
    since_step: i64,
    blobs: *const ckpt_blob,
    n_blobs: usize,
    stream: *mut c_void,
    save_id: *mut u64,
) -> c_int {
    // SAFETY: the caller's contract (save_with's, and `tensor_flags` holds
    // n_tensors words when not NULL).
    unsafe {
        save_with(client, tensors, n_tensors, blobs, n_blobs, save_id, |c, ts, bs| {
            let flags: &[u32] =
                if tensor_flags.is_null() { &[] } else { slice(tensor_flags, n_tensors, "tensor_flags")? };
            if let Some((i, f)) = flags.iter().enumerate().find(|(_, &f)| f & !CKPT_TENSOR_UNCHANGED != 0) {
                return Err(invalid(format!(
                    "tensor_flags[{i}] = {f:#x}: unknown flag bits (known: CKPT_TENSOR_UNCHANGED = 1)"
                )));
            }
            let unchanged = u64::try_from(since_step).ok().map(|since_step| ckpt_wire::Unchanged {
                since_step,
                bits: ckpt_wire::Unchanged::bits_of(flags.iter().map(|&f| f & CKPT_TENSOR_UNCHANGED != 0)),
            });
            c.save_on_stream_unchanged(step, ts, bs, stream as u64, unchanged.as_ref())
        })
    }
}

/// Asks the sidecar to write `len_bytes` at `data` (inside memory from
/// ckpt_alloc) as the whole content of the file `path` (absolute, in an
/// existing directory), atomically: a temp file in that directory, synced,
/// renamed over `path`. Returns at once with the save's id in *save_id;
/// wait with ckpt_wait like a save: CKPT_RELEASED (the bytes may change),
/// CKPT_DURABLE (renamed and synced). The sidecar writes files only for
/// clients of its own uid.
///
/// # Safety
/// `client` is a live client; `path` a NUL-terminated string; `save_id`
/// writable. `data` is only compared with region addresses.
#[no_mangle]
pub unsafe extern "C" fn ckpt_save_file(
    client: *mut ckpt_client,
    path: *const c_char,
    data: *const c_void,
    len_bytes: u64,
    save_id: *mut u64,
) -> c_int {
    guard(|| {
        let save_id = out(save_id, "save_id")?;
        // SAFETY (this block): the caller's contract for every pointer.
        let c = unsafe { self::client(client) }?;
        let path = unsafe { c_str(path, "path") }?;
        let h = c.client.save_file(path, data.cast(), len_bytes)?;
        unsafe { *save_id = h.id };
        Ok(())
    })
}

/// As ckpt_save_file, for a file made of `n_pieces` pieces laid end to end
/// (protocol 9): each in memory from ckpt_alloc or in CUDA memory registered
/// with ckpt_register_cuda (one allocation) or ckpt_register_cuda_range (a
/// piece across VMM chunks mapped back to back). With CUDA pieces an interprocess
/// event is recorded on `stream` (a CUstream / cudaStream_t; NULL: the
/// legacy default stream) and sent along: the sidecar's own stream waits on
/// it, then copies the device pieces; the CPU never waits. The pieces may
/// change once the save is CKPT_RELEASED. `finish`: CKPT_FILE_AS_IS or
/// CKPT_FILE_TORCH_ZIP (the sidecar computes a torch.save archive's
/// CRC-32s; one that is not such an archive fails before release).
///
/// # Safety
/// `client` is a live client; `path` a NUL-terminated string; `pieces`
/// holds `n_pieces` entries (may be NULL when 0); `save_id` writable;
/// `stream` is NULL or a live stream of this process. Piece addresses are
/// only compared with region addresses.
#[no_mangle]
pub unsafe extern "C" fn ckpt_save_file_pieces(
    client: *mut ckpt_client,
    path: *const c_char,
    pieces: *const ckpt_file_piece,
    n_pieces: usize,
    stream: *mut c_void,
    finish: c_int,
    save_id: *mut u64,
) -> c_int {
    guard(|| {
        let save_id = out(save_id, "save_id")?;
        let finish = match finish {
            CKPT_FILE_AS_IS => ckpt_wire::FileFinish::AsIs,
            CKPT_FILE_TORCH_ZIP => ckpt_wire::FileFinish::TorchZip,
            other => {
                return Err(invalid(format!(
                    "finish {other} is neither CKPT_FILE_AS_IS (0) nor CKPT_FILE_TORCH_ZIP (1)"
                )))
            }
        };
        // SAFETY (this block): the caller's contract for every pointer.
        let c = unsafe { self::client(client) }?;
        let path = unsafe { c_str(path, "path") }?;
        let ps = unsafe { slice(pieces, n_pieces, "pieces") }?;
        let ps: Vec<(*const u8, u64)> = ps.iter().map(|p| (p.data.cast(), p.len_bytes)).collect();
        let h = c.client.save_file_pieces(path, &ps, stream as u64, finish)?;
        unsafe { *save_id = h.id };
        Ok(())
    })
}

/// Blocks until save `save_id` is CKPT_RELEASED, CKPT_DURABLE or
/// CKPT_REPLICATED (as `what` says; see ckpt_wait_replicated), or
/// `timeout_ms` passes (< 0: no limit). CKPT_OK when reached; the
/// save's error when it failed (e.g. CKPT_E_IO, CKPT_E_DISCONNECTED);
/// CKPT_E_TIMEOUT when the time ran out (the save goes on).
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_wait(client: *mut ckpt_client, save_id: u64, what: c_int, timeout_ms: i64) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        let wanted = match what {
            CKPT_RELEASED => Wanted::Released,
            CKPT_DURABLE => Wanted::Durable,
            CKPT_REPLICATED => return c.client.wait_replicated(save_id, timeout).map(|_| ()),
            _ => {
                return Err(invalid(format!(
                    "what is {what}; expected CKPT_RELEASED (1), CKPT_DURABLE (2) or CKPT_REPLICATED (4)"
                )))
            }
        };
        c.client.wait(save_id, wanted, timeout).map(|_| ())
    })
}

/// Blocks until checkpoint save `save_id` is CKPT_REPLICATED: durable, then
/// committed on the sidecar's drain target (`--drain URL`: its files, then
/// its remote index), or `timeout_ms` passes (< 0: no limit;
/// CKPT_E_TIMEOUT, the replication goes on). CKPT_E_NOT_FOUND at once when
/// the sidecar has no drain target, or its drain skipped the step (a newer
/// one was drained instead, or --drain-every leaves it out), with the
/// reason in ckpt_last_error(); CKPT_E_INVALID for a ckpt_save_file.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_wait_replicated(client: *mut ckpt_client, save_id: u64, timeout_ms: i64) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        c.client.wait_replicated(save_id, u64::try_from(timeout_ms).ok().map(Duration::from_millis)).map(|_| ())
    })
}

/// Stores the save's state in *state (CKPT_PENDING, CKPT_RELEASED,
/// CKPT_DURABLE, CKPT_REPLICATED once a wait for it returned, or
/// CKPT_FAILED) without blocking. For CKPT_FAILED the
/// reason is also in ckpt_last_error() (the call itself returns CKPT_OK).
///
/// # Safety
/// `client` is a live client; `state` is writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_poll(client: *mut ckpt_client, save_id: u64, state: *mut c_int) -> c_int {
    guard(|| {
        let state = out(state, "state")?;
        // SAFETY: the caller's contract.
        let s = unsafe { self::client(client) }?.client.poll(save_id)?;
        let v = match s.state {
            SaveState::Pending => CKPT_PENDING,
            SaveState::Released => CKPT_RELEASED,
            SaveState::Durable if s.replicated_to.is_some() => CKPT_REPLICATED,
            SaveState::Durable => CKPT_DURABLE,
            SaveState::Failed => {
                set_last_error(s.error.as_deref().unwrap_or("save failed"));
                CKPT_FAILED
            }
        };
        // SAFETY: non-NULL, writable by the caller's contract.
        unsafe { *state = v };
        Ok(())
    })
}

/// The save's figures as far as known, in seconds (-1 when not yet known):
/// copy (snapshot into staging), waited (for staging space before the copy),
/// persist (write and commit). Any out-pointer may be NULL.
///
/// # Safety
/// `client` is a live client; non-NULL out-pointers are writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_save_figures(
    client: *mut ckpt_client,
    save_id: u64,
    copy_seconds: *mut f64,
    waited_seconds: *mut f64,
    persist_seconds: *mut f64,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { self::client(client) }?.client.poll(save_id)?;
        for (p, v) in
            [(copy_seconds, s.copy_seconds), (waited_seconds, s.waited_seconds), (persist_seconds, s.persist_seconds)]
        {
            if !p.is_null() {
                // SAFETY: non-NULL out-pointers are writable by the contract.
                unsafe { *p = v.unwrap_or(-1.0) };
            }
        }
        Ok(())
    })
}

/// Loads checkpoint `step` (-1: the latest good one) into the places the
/// `n_tensors` descriptors name (`data` = destination inside memory from
/// ckpt_alloc; name, dtype, shape and len_bytes must match the checkpoint).
/// With n_tensors 0 it only reports what the checkpoint holds. Stores the
/// step loaded in *out_step and CKPT_SOURCE_RAM / CKPT_SOURCE_DISK in
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
        // SAFETY (this block): the caller's contract for every pointer.
        let c = unsafe { self::client(client) }?;
        let step = load_step(step)?;
        let ts = unsafe { tensor_refs(slice(tensors, n_tensors, "tensors")?) }?;
        let info = c.client.load(step, &ts)?;
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
            };
            // SAFETY: writable by the contract.
            unsafe { *out_source = source };
        }
        let cstring = |s: &str| CString::new(s.replace('\0', "")).expect("NULs removed");
        let names = info.tensors.iter().map(|t| cstring(&t.name)).collect();
        let dtypes = info.tensors.iter().map(|t| cstring(&t.dtype)).collect();
        *self.last_load.lock().unwrap_or_else(|p| p.into_inner()) = Some(LoadedC { info, names, dtypes });
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
        // SAFETY (this block): the caller's contract for every pointer.
        let c = unsafe { self::client(client) }?;
        let step = load_step(step)?;
        let info = c.client.load_packed(step, data.cast::<u8>(), len_bytes)?;
        if !out_need_bytes.is_null() {
            unsafe { *out_need_bytes = info.need_bytes };
        }
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
        let last = c.last_load.lock().unwrap_or_else(|p| p.into_inner());
        let l = last.as_ref().ok_or_else(|| Error::NoSuchBlob { name: "(no load yet)".into() })?;
        if idx >= l.info.tensors.len() {
            return Err(invalid(format!("idx {idx} is past the {} tensors", l.info.tensors.len())));
        }
        // SAFETY: writable by the contract.
        unsafe { *offset = l.info.offsets.get(idx).copied().unwrap_or(ckpt_wire::NOT_PLACED) };
        Ok(())
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
        // SAFETY (this block): the caller's contract for every pointer.
        let c = unsafe { self::client(client) }?;
        let name = unsafe { c_str(name, "name") }?;
        let len_out = out(len_bytes, "len_bytes")?;
        let last = c.last_load.lock().unwrap_or_else(|p| p.into_inner());
        let blob = last
            .as_ref()
            .and_then(|l| l.info.blobs.iter().find(|b| b.name == name))
            .ok_or_else(|| Error::NoSuchBlob { name: name.to_string() })?;
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
        // SAFETY (this block): the caller's contract for every pointer.
        let c = unsafe { self::client(client) }?;
        let len_out = out(len_bytes, "len_bytes")?;
        let last = c.last_load.lock().unwrap_or_else(|p| p.into_inner());
        let text = last
            .as_ref()
            .map(|l| l.info.fell_back.join("; "))
            .ok_or_else(|| Error::NoSuchBlob { name: "(no load yet)".into() })?;
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
        let last = c.last_load.lock().unwrap_or_else(|p| p.into_inner());
        let count = last
            .as_ref()
            .map(|l| l.info.tensors.len())
            .ok_or_else(|| Error::NoSuchBlob { name: "(no load yet)".into() })?;
        // SAFETY: writable by the contract.
        unsafe { *n = count };
        Ok(())
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
        // SAFETY (this block): the caller's contract for every pointer.
        let c = unsafe { self::client(client) }?;
        let last = c.last_load.lock().unwrap_or_else(|p| p.into_inner());
        let l = last.as_ref().ok_or_else(|| Error::NoSuchBlob { name: "(no load yet)".into() })?;
        let t = l
            .info
            .tensors
            .get(idx)
            .ok_or_else(|| invalid(format!("idx {idx} is past the {} tensors", l.info.tensors.len())))?;
        unsafe {
            if !name.is_null() {
                *name = l.names[idx].as_ptr();
            }
            if !dtype.is_null() {
                *dtype = l.dtypes[idx].as_ptr();
            }
            if !shape.is_null() {
                *shape = t.shape.as_ptr();
            }
            if !ndim.is_null() {
                *ndim = t.shape.len() as u32;
            }
            if !len_bytes.is_null() {
                *len_bytes = t.len_bytes;
            }
        }
        Ok(())
    })
}

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
        // SAFETY (this block): the caller's contract for every pointer.
        let c = unsafe { self::client(client) }?;
        let (all, last) = c.client.list()?;
        unsafe { *n = all.len() };
        if !latest.is_null() {
            unsafe { *latest = last.map(|s| s as i64).unwrap_or(-1) };
        }
        if steps.is_null() && cap == 0 {
            return Ok(());
        }
        if steps.is_null() {
            return Err(invalid("steps is NULL but cap is not 0"));
        }
        let k = all.len().min(cap);
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
        // SAFETY (this block): the caller's contract for every pointer.
        let c = unsafe { self::client(client) }?;
        let report = c.client.status()?;
        let json =
            serde_json::to_string(&report).map_err(|e| Error::Protocol(format!("status report not encodable: {e}")))?;
        unsafe { *len = json.len() };
        if buf.is_null() && cap == 0 {
            return Ok(());
        }
        if buf.is_null() || cap <= json.len() {
            return Err(Error::Truncated { len_bytes: json.len() as u64 + 1, cap_bytes: cap as u64 });
        }
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

/// 1 once SIGTERM arrived (the trainer should checkpoint and exit), else 0.
/// Only a handler installed by preload mode or ckpt_install_sigterm_handler
/// sets it.
#[no_mangle]
pub extern "C" fn ckpt_preempted() -> c_int {
    crate::sigterm::preempted() as c_int
}

/// Installs the SIGTERM handler that sets the preemption flag (preload mode
/// does this at load). The first SIGTERM only sets the flag (and calls a
/// previously installed handler function, if any); a second one gets the
/// previous disposition (by default: the process terminates). Idempotent.
#[no_mangle]
pub extern "C" fn ckpt_install_sigterm_handler() -> c_int {
    guard(|| {
        crate::sigterm::install_sigterm_handler()
            .map_err(|e| Error::InvalidArgument(format!("sigaction(SIGTERM) failed: {e}")))
    })
}

/// The client connected at load time in preload mode (CKPT_SIDECAR_PRELOAD=1),
/// or NULL, with the reason in ckpt_last_error() (not in preload mode, or the
/// connection failed). It lives as long as the process.
#[no_mangle]
pub extern "C" fn ckpt_default_client() -> *mut ckpt_client {
    catch_unwind(|| {
        let p = default_client_ptr();
        if p.is_null() {
            set_last_error(&default_client_error());
        }
        p
    })
    .unwrap_or(std::ptr::null_mut())
}

/// Makes the default client (preload mode). Not part of the C ABI.
/// The blobs of a save, borrowed from the caller's array.
///
/// # Safety
/// `blobs` is NULL with `n_blobs` 0, or points to `n_blobs` valid entries
/// whose names and data outlive the returned references.
pub(crate) unsafe fn blob_refs<'a>(blobs: *const ckpt_blob, n_blobs: usize) -> Result<Vec<BlobRef<'a>>, Error> {
    // SAFETY (this block): the caller's contract.
    let bs = unsafe { slice(blobs, n_blobs, "blobs") }?;
    bs.iter()
        .enumerate()
        .map(|(i, b)| {
            let name = unsafe { c_str(b.name, format_args!("blobs[{i}].name")) }?;
            let bytes =
                unsafe { slice(b.data.cast::<u8>(), b.len_bytes as usize, format!("blobs[{i}].data ({name})")) }?;
            Ok(BlobRef { name, bytes })
        })
        .collect()
}

/// The default client (preload mode's connection), set once at load.
static DEFAULT_CLIENT: AtomicPtr<ckpt_client> = AtomicPtr::new(std::ptr::null_mut());
static DEFAULT_ERROR: Mutex<Option<String>> = Mutex::new(None);

pub(crate) fn default_client_ptr() -> *mut ckpt_client {
    DEFAULT_CLIENT.load(Ordering::Acquire)
}

pub(crate) fn set_default_client(p: *mut ckpt_client) {
    DEFAULT_CLIENT.store(p, Ordering::Release);
}

pub(crate) fn set_default_client_error(msg: String) {
    *DEFAULT_ERROR.lock().unwrap_or_else(|p| p.into_inner()) = Some(msg);
}

fn default_client_error() -> String {
    DEFAULT_ERROR
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_else(|| "no default client: preload mode did not run".to_string())
}

pub(crate) fn new_boxed_client(client: Client) -> *mut ckpt_client {
    Box::into_raw(Box::new(ckpt_client { client, last_load: Mutex::new(None) }))
}

/// # Safety
/// `p` is a live client pointer.
pub(crate) unsafe fn close_client_in_place(p: *mut ckpt_client) {
    // SAFETY: the caller's contract.
    if let Some(c) = unsafe { p.as_ref() } {
        c.client.close();
    }
}
