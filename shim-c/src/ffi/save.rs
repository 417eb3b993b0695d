//! The ABI's saves: checkpoints (plain, or with a flags word per tensor),
//! file writes (one range, or pieces), and the save's state afterwards:
//! wait, wait for replication, poll, figures.

use std::ffi::{c_char, c_int, c_void};
use std::time::Duration;

use super::args::{blob_refs, c_str, client, out, slice, tensor_refs};
use super::codes::{CKPT_DURABLE, CKPT_FAILED, CKPT_PENDING, CKPT_RELEASED, CKPT_REPLICATED};
use super::errors::{guard, invalid, set_last_error};
use super::types::{ckpt_blob, ckpt_client, ckpt_file_piece, ckpt_tensor, CKPT_FILE_AS_IS, CKPT_FILE_TORCH_ZIP};
use crate::client::{BlobRef, Client, SaveHandle, SaveState, TensorRef, Wanted};
use crate::error::Error;

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
pub(super) unsafe fn save_with(
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
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        // SAFETY: `tensors` holds `n_tensors` valid descriptors, or is NULL with 0 (the caller's contract).
        let ts = unsafe { tensor_refs(slice(tensors, n_tensors, "tensors")?) }?;
        // SAFETY: `blobs` holds `n_blobs` valid descriptors, or is NULL with 0 (the caller's contract).
        let bs = unsafe { blob_refs(blobs, n_blobs) }?;
        let h = send(&c.client, &ts, &bs)?;
        // SAFETY: `save_id` was checked non-NULL; writable by the caller's contract.
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
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        // SAFETY: `path` is NULL or a NUL-terminated string (the caller's contract).
        let path = unsafe { c_str(path, "path") }?;
        let h = c.client.save_file(path, data.cast(), len_bytes)?;
        // SAFETY: `save_id` was checked non-NULL; writable by the caller's contract.
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
        // SAFETY: `client` is NULL or a live client (the caller's contract).
        let c = unsafe { self::client(client) }?;
        // SAFETY: `path` is NULL or a NUL-terminated string (the caller's contract).
        let path = unsafe { c_str(path, "path") }?;
        // SAFETY: `pieces` holds `n_pieces` entries, or is NULL with 0 (the caller's contract).
        let ps = unsafe { slice(pieces, n_pieces, "pieces") }?;
        let ps: Vec<(*const u8, u64)> = ps.iter().map(|p| (p.data.cast(), p.len_bytes)).collect();
        let h = c.client.save_file_pieces(path, &ps, stream as u64, finish)?;
        // SAFETY: `save_id` was checked non-NULL; writable by the caller's contract.
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

/// Blocks until this node's files of checkpoint save `save_id` are held by
/// peers: durable, then checked and held in the memory of --peer-replicas
/// other nodes' sidecars (--peers), or `timeout_ms` passes (< 0: no limit;
/// CKPT_E_TIMEOUT, the replication goes on). CKPT_E_NOT_FOUND at once when
/// the sidecar has no peers, or when the step was skipped (more than
/// --peer-keep newer steps waited to be sent: the message names them);
/// CKPT_E_IO when the replication failed, with
/// the reason (which peer, why) in ckpt_last_error(); CKPT_E_INVALID for a
/// ckpt_save_file. Training never waits for it unless it calls this.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_wait_peers(client: *mut ckpt_client, save_id: u64, timeout_ms: i64) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        c.client.wait_peers(save_id, u64::try_from(timeout_ms).ok().map(Duration::from_millis)).map(|_| ())
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
