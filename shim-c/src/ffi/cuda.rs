//! The ABI's CUDA calls: device memory registered by pointer, saves fenced
//! by an interprocess event recorded on the trainer's stream, and the
//! stream wait for a save's copy. Same conventions as the rest of
//! [`crate::ffi`] (status codes, last error, catch_unwind).

use std::ffi::{c_int, c_void};

use super::args::{client, out};
use super::errors::guard;
use super::save::save_with;
use super::types::{ckpt_blob, ckpt_client, ckpt_tensor};
use crate::error::Error;

/// CKPT_OK if a CUDA driver with at least one device is there, else
/// CKPT_E_CUDA with the reason in ckpt_last_error() ("no CUDA driver ...").
/// The driver is probed once per process.
#[no_mangle]
pub extern "C" fn ckpt_cuda_probe() -> c_int {
    guard(|| ckpt_cuda::probe().map(|_| ()).map_err(Error::Cuda))
}

/// Registers the CUDA allocation holding device address `ptr` (any address
/// inside a cudaMalloc / cuMemAlloc block, or a PyTorch caching-allocator
/// block) as a region of this client, exported once by its legacy IPC
/// handle; its region id goes to *region_id. Registering an address of an
/// allocation already registered returns the same region. The allocation
/// is known by its identity (CU_POINTER_ATTRIBUTE_BUFFER_ID), not only its
/// address: when it was freed and another one now lies there, the old
/// registration is dropped (the sidecar closes it) and the new allocation
/// registered, here or at the next save that names the address; any other
/// registration whose memory is gone is dropped too when a new allocation is
/// registered. Tensors inside
/// the allocation are then passed to ckpt_save_on_stream / ckpt_load by
/// their device address. Fails with CKPT_E_CUDA when there is no driver or
/// `ptr` is not device memory.
///
/// # Safety
/// `client` is a live client; `region_id` is writable. `ptr` is only
/// passed to the driver, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn ckpt_register_cuda(
    client: *mut ckpt_client,
    ptr: *const c_void,
    region_id: *mut u32,
) -> c_int {
    guard(|| {
        let region_id = out(region_id, "region_id")?;
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        let r = c.client.register_cuda(ptr as u64)?;
        // SAFETY: checked non-NULL; writable by the caller's contract.
        unsafe { *region_id = r.region_id };
        Ok(())
    })
}

/// As ckpt_register_cuda, for the `len_bytes` at device address `ptr`,
/// which may cross from one allocation into the next ones mapped right
/// after it (VMM chunks of one reserved address range, as PyTorch's
/// expandable segments map them): each allocation is exported and
/// registered once, and the run of them as one region (a span) whose id
/// goes to *region_id. A range that runs into unmapped memory fails with
/// CKPT_E_CUDA, naming the address. (ckpt_save_on_stream registers such a
/// span by itself for a tensor that starts in a registered allocation.)
///
/// # Safety
/// `client` is a live client; `region_id` is writable. `ptr` is only
/// passed to the driver, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn ckpt_register_cuda_range(
    client: *mut ckpt_client,
    ptr: *const c_void,
    len_bytes: u64,
    region_id: *mut u32,
) -> c_int {
    guard(|| {
        let region_id = out(region_id, "region_id")?;
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        let r = c.client.register_cuda_range(ptr as u64, len_bytes)?;
        // SAFETY: checked non-NULL; writable by the caller's contract.
        unsafe { *region_id = r.region_id };
        Ok(())
    })
}

/// Unregisters the CUDA region holding device address `ptr`: the sidecar
/// closes its handle on the allocation (the memory stays the trainer's).
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_unregister_cuda(client: *mut ckpt_client, ptr: *const c_void) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        c.client.unregister_cuda(ptr as u64)
    })
}

/// As ckpt_save, for tensors some of which are CUDA device memory
/// (registered with ckpt_register_cuda) written by work queued on `stream`
/// (a CUstream / cudaStream_t; NULL: the legacy default stream). An
/// interprocess event is recorded on `stream` and sent with the save; the
/// sidecar's own stream waits on it, then copies device to host. The CPU
/// never waits: the tensors may change once the save is released
/// (ckpt_wait with CKPT_RELEASED), or, on the GPU, by work queued after the
/// release is known. With no CUDA tensor this is ckpt_save. Refused
/// (CKPT_E_INVALID) when `stream` is capturing a CUDA graph: an event
/// recorded there would only join the graph, never be recorded.
///
/// # Safety
/// As ckpt_save; `stream` is NULL or a live stream of this process.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ckpt_save_on_stream(
    client: *mut ckpt_client,
    step: u64,
    tensors: *const ckpt_tensor,
    n_tensors: usize,
    blobs: *const ckpt_blob,
    n_blobs: usize,
    stream: *mut c_void,
    save_id: *mut u64,
) -> c_int {
    // SAFETY: the caller's contract, which is save_with's.
    unsafe {
        save_with(client, tensors, n_tensors, blobs, n_blobs, save_id, |c, ts, bs| {
            c.save_on_stream(step, ts, bs, stream as u64)
        })
    }
}

/// Makes `stream` (a CUstream / cudaStream_t of this process; NULL: the
/// legacy default stream) wait until the sidecar's device-to-host copy of
/// save `save_id` (from ckpt_save_on_stream) is done, without the CPU
/// waiting for the copy: call it before the work that overwrites the saved
/// tensors (the optimizer step). The CPU waits only until the sidecar has
/// queued the copy (a message away) or the save is released or over, at
/// most `timeout_ms` (< 0: no limit); then, if the copy may still run, the
/// stream waits on an event the sidecar recorded behind it. For a save with
/// no CUDA tensor this waits for CKPT_RELEASED on the CPU, as ckpt_wait;
/// so it does where the stream cannot wait (the driver refuses
/// cuStreamWaitValue32, or `stream` is capturing a CUDA graph): never no
/// wait. A stream wait still waiting after CKPT_SIDECAR_STREAM_WAIT_DEADLINE_MS
/// (default 300000; 0: never) counts the sidecar as stuck: the connection is
/// dropped, the save fails saying why, and the stream goes on.
/// *on_stream (may be NULL) is set to 1 when a stream wait was queued, 0
/// when none was needed or the CPU waited. Errors as ckpt_wait's.
///
/// # Safety
/// `client` is a live client; `stream` is NULL or a live stream of this
/// process; `on_stream` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ckpt_stream_wait_copy(
    client: *mut ckpt_client,
    save_id: u64,
    stream: *mut c_void,
    timeout_ms: i64,
    on_stream: *mut c_int,
) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        let queued = c.client.stream_wait_copy(
            save_id,
            stream as u64,
            u64::try_from(timeout_ms).ok().map(std::time::Duration::from_millis),
        )?;
        if !on_stream.is_null() {
            // SAFETY: non-NULL, writable by the caller's contract.
            unsafe { *on_stream = c_int::from(queued) };
        }
        Ok(())
    })
}
