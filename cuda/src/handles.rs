//! The driver handles held across calls (see the crate's doc): the
//! sidecar's imports of a trainer's allocations ([`Imported`]), its opened
//! events of the trainer ([`OpenedEvent`]), its own streams ([`Stream`]) and
//! their marks ([`LocalEvent`]), host memory page-locked for copies
//! ([`HostRegistration`]), and the trainer's word its streams wait on
//! ([`HostWord`]). Every use binds the device's context first.

use std::os::fd::{AsRawFd, OwnedFd};

use cudarc::driver::sys::{self, CUresult};

use crate::{bind, check, in_primary, CudaError, Result, FABRIC_HANDLE_BYTES, IPC_HANDLE_BYTES};

/// An allocation of another process (sidecar side): opened from its legacy
/// IPC handle, or imported from its VMM fd and mapped into an address range
/// of our own; closed (unmapped, released) when dropped.
pub struct Imported {
    ptr: u64,
    len_bytes: u64,
    device: i32,
    /// For a VMM import: the handle and the mapped (reserved) length.
    vmm: Option<(sys::CUmemGenericAllocationHandle, usize)>,
}

impl Imported {
    /// Opens `handle` on `device` and checks the allocation holds `len_bytes`.
    pub fn open(handle: &[u8], device: i32, len_bytes: u64) -> Result<Imported> {
        let reserved: [u8; IPC_HANDLE_BYTES] = handle.try_into().map_err(|_| {
            CudaError::Invalid(format!("an IPC memory handle has {IPC_HANDLE_BYTES} bytes, not {}", handle.len()))
        })?;
        bind(device)?;
        let h = sys::CUipcMemHandle { reserved: reserved.map(|b| b as std::ffi::c_char) };
        let mut ptr = 0u64;
        // SAFETY: valid out-pointer; the handle is plain bytes (a bad one is
        // an error code).
        unsafe {
            check(
                "cuIpcOpenMemHandle",
                sys::cuIpcOpenMemHandle_v2(&mut ptr, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32),
            )?
        };
        let imported = Imported { ptr, len_bytes, device, vmm: None };
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers; `ptr` was just mapped.
        unsafe { check("cuMemGetAddressRange", sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr))? };
        if (size as u64) < len_bytes {
            return Err(CudaError::Invalid(format!(
                "the CUDA allocation has {size} bytes, fewer than the {len_bytes} registered"
            )));
        }
        Ok(imported)
    }

    /// Imports the VMM allocation `fd` names (exported by [`export`]) on
    /// `device`, maps its first `len_bytes` (rounded up to the device's
    /// granularity) into a fresh address range and makes it readable and
    /// writable here. The fd may be closed afterwards: the import holds the
    /// allocation, which then outlives its exporter.
    pub fn import_fd(fd: &OwnedFd, device: i32, len_bytes: u64) -> Result<Imported> {
        let os_handle = fd.as_raw_fd() as isize as *mut std::ffi::c_void;
        // SAFETY: for POSIX_FD the os handle is the descriptor's value, open (borrowed).
        unsafe {
            Self::import_shareable(
                os_handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                device,
                len_bytes,
            )
        }
    }

    /// As [`Imported::import_fd`], for an allocation exported as a FABRIC
    /// handle ([`Export::Fabric`]).
    pub fn import_fabric(handle: &[u8], device: i32, len_bytes: u64) -> Result<Imported> {
        let data: [u8; FABRIC_HANDLE_BYTES] = handle.try_into().map_err(|_| {
            CudaError::Invalid(format!("a fabric handle has {FABRIC_HANDLE_BYTES} bytes, not {}", handle.len()))
        })?;
        let mut fabric = sys::CUmemFabricHandle_st { data };
        // SAFETY: for FABRIC the os handle points at a CUmemFabricHandle,
        // alive for the call.
        unsafe {
            Self::import_shareable(
                (&mut fabric as *mut sys::CUmemFabricHandle_st).cast(),
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
                device,
                len_bytes,
            )
        }
    }

    /// # Safety
    /// `os_handle` is what `cuMemImportFromShareableHandle` takes for `kind`.
    unsafe fn import_shareable(
        os_handle: *mut std::ffi::c_void,
        kind: sys::CUmemAllocationHandleType,
        device: i32,
        len_bytes: u64,
    ) -> Result<Imported> {
        bind(device)?;
        let location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device };
        // SAFETY: all-zero is a valid CUmemAllocationProp (see export_retained).
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = location;
        let mut granularity = 0usize;
        // SAFETY: valid pointers for the call.
        unsafe {
            check(
                "cuMemGetAllocationGranularity",
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                ),
            )?
        };
        let size = usize::try_from(len_bytes)
            .ok()
            .and_then(|l| l.checked_next_multiple_of(granularity.max(1)))
            .filter(|&s| s > 0)
            .ok_or_else(|| CudaError::Invalid(format!("a VMM region of {len_bytes} bytes cannot be mapped")))?;
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the caller's contract; the driver takes its own reference.
        unsafe {
            check("cuMemImportFromShareableHandle", sys::cuMemImportFromShareableHandle(&mut h, os_handle, kind))?
        };
        let mut ptr = 0u64;
        // SAFETY: valid out-pointer.
        if let Err(e) = unsafe { check("cuMemAddressReserve", sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0)) } {
            // SAFETY: `h` was imported above and is released once, here.
            unsafe { sys::cuMemRelease(h) };
            return Err(e);
        }
        // SAFETY: `ptr..ptr+size` was just reserved for us, `h` imported.
        if let Err(e) = unsafe { check("cuMemMap", sys::cuMemMap(ptr, size, 0, h, 0)) } {
            // SAFETY: nothing is mapped in the range; the range and the
            // handle are ours and given back once, here.
            unsafe {
                sys::cuMemAddressFree(ptr, size);
                sys::cuMemRelease(h);
            }
            return Err(CudaError::Invalid(format!(
                "the VMM allocation does not hold the {len_bytes} bytes registered: {e}"
            )));
        }
        // From here Drop unmaps, frees the range and releases the handle.
        let imported = Imported { ptr, len_bytes, device, vmm: Some((h, size)) };
        let access =
            sys::CUmemAccessDesc { location, flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
        // SAFETY: the range is mapped (above); one descriptor.
        unsafe { check("cuMemSetAccess", sys::cuMemSetAccess(ptr, size, &access, 1))? };
        Ok(imported)
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    /// Whether this is a VMM import (valid after its exporter died), not a
    /// legacy IPC one (undefined then).
    pub fn is_vmm(&self) -> bool {
        self.vmm.is_some()
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        if bind(self.device).is_err() {
            return;
        }
        match self.vmm {
            // SAFETY: mapped and reserved by import_fd, given back once; the
            // session's copies on it are synchronized before regions drop.
            Some((h, size)) => unsafe {
                sys::cuMemUnmap(self.ptr, size);
                sys::cuMemAddressFree(self.ptr, size);
                sys::cuMemRelease(h);
            },
            // SAFETY: `ptr` was opened by cuIpcOpenMemHandle and is closed once.
            None => unsafe {
                sys::cuIpcCloseMemHandle(self.ptr);
            },
        }
    }
}

/// Another process's interprocess event, opened from its handle.
pub struct OpenedEvent {
    event: sys::CUevent,
    device: i32,
}

// SAFETY: a driver handle; every use binds the context first.
unsafe impl Send for OpenedEvent {}
// SAFETY: as for Send: shared use goes through the driver, which is thread-safe once bound.
unsafe impl Sync for OpenedEvent {}

impl OpenedEvent {
    pub fn open(handle: &[u8], device: i32) -> Result<OpenedEvent> {
        let reserved: [u8; IPC_HANDLE_BYTES] = handle.try_into().map_err(|_| {
            CudaError::Invalid(format!("an IPC event handle has {IPC_HANDLE_BYTES} bytes, not {}", handle.len()))
        })?;
        bind(device)?;
        let h = sys::CUipcEventHandle { reserved: reserved.map(|b| b as std::ffi::c_char) };
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; a bad handle is an error code.
        unsafe { check("cuIpcOpenEventHandle", sys::cuIpcOpenEventHandle(&mut event, h))? };
        Ok(OpenedEvent { event, device })
    }
}

impl OpenedEvent {
    /// Whether the work queued before the event's latest record has
    /// completed (`cuEventQuery`): never blocks, so the caller can watch the
    /// event's owner while it waits (a wait on an event whose recorder died
    /// may never end).
    pub fn is_done(&self) -> Result<bool> {
        bind(self.device)?;
        // SAFETY: the event is alive (borrowed).
        match unsafe { sys::cuEventQuery(self.event) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| false),
        }
    }
}

impl Drop for OpenedEvent {
    fn drop(&mut self) {
        if bind(self.device).is_ok() {
            // SAFETY: opened by cuIpcOpenEventHandle, destroyed once.
            unsafe { sys::cuEventDestroy_v2(self.event) };
        }
    }
}

/// A stream of the sidecar's own (non-blocking: it never waits for the
/// legacy default stream).
pub struct Stream {
    stream: sys::CUstream,
    device: i32,
}

// SAFETY: a driver handle; the driver serialises work on a stream, and every
// use binds the context first.
unsafe impl Send for Stream {}
// SAFETY: as for Send: shared use goes through the driver, which is thread-safe once bound.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(device: i32) -> Result<Stream> {
        bind(device)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context current.
        unsafe {
            check(
                "cuStreamCreate",
                sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
            )?
        };
        Ok(Stream { stream, device })
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    /// Later work on this stream waits until `event` completes (as recorded
    /// when this is called: call it after the message naming it arrived).
    pub fn wait_event(&self, event: &OpenedEvent) -> Result<()> {
        bind(self.device)?;
        // SAFETY: both handles are alive (borrowed).
        unsafe { check("cuStreamWaitEvent", sys::cuStreamWaitEvent(self.stream, event.event, 0)) }
    }

    /// Records `event` (another process's, opened from its handle) on this
    /// stream: it completes once the work queued here before has.
    pub fn record(&self, event: &OpenedEvent) -> Result<()> {
        bind(self.device)?;
        // SAFETY: both handles are alive (borrowed).
        unsafe { check("cuEventRecord", sys::cuEventRecord(event.event, self.stream)) }
    }

    /// Records a fresh event of this process on the stream: it completes
    /// once the work queued here before has ([`LocalEvent::synchronize`]
    /// waits for that part of the stream's work only).
    pub fn mark(&self) -> Result<LocalEvent> {
        bind(self.device)?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context current (bind).
        unsafe {
            check("cuEventCreate", sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32))?
        };
        let e = LocalEvent { event, device: self.device };
        // SAFETY: both handles are alive.
        unsafe { check("cuEventRecord", sys::cuEventRecord(e.event, self.stream))? };
        Ok(e)
    }

    /// Queues a copy of `len` bytes at device address `src` to `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` is writable host memory that stays valid and untouched
    /// until [`Stream::synchronize`] returns; `src..src+len` lies in device
    /// memory open in this process.
    pub unsafe fn copy_dtoh_async(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        bind(self.device)?;
        // SAFETY: the caller's contract.
        unsafe { check("cuMemcpyDtoHAsync", sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.stream)) }
    }

    /// Queues a copy of `len` bytes at `src` to device address `dst`.
    ///
    /// # Safety
    /// `src..src+len` stays valid and unchanged until [`Stream::synchronize`]
    /// returns; `dst..dst+len` lies in device memory open in this process.
    pub unsafe fn copy_htod_async(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        bind(self.device)?;
        // SAFETY: the caller's contract.
        unsafe { check("cuMemcpyHtoDAsync", sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.stream)) }
    }

    /// Blocks until everything queued on this stream has completed.
    pub fn synchronize(&self) -> Result<()> {
        bind(self.device)?;
        // SAFETY: the stream is alive.
        unsafe { check("cuStreamSynchronize", sys::cuStreamSynchronize(self.stream)) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if bind(self.device).is_ok() {
            // SAFETY: ours, destroyed once; the driver finishes queued work first.
            unsafe { sys::cuStreamDestroy_v2(self.stream) };
        }
    }
}

/// An event of this process recorded on one of its streams ([`Stream::mark`]).
pub struct LocalEvent {
    event: sys::CUevent,
    device: i32,
}

// SAFETY: a driver handle; every use binds the context first.
unsafe impl Send for LocalEvent {}
// SAFETY: as for Send: shared use goes through the driver, which is thread-safe once bound.
unsafe impl Sync for LocalEvent {}

impl LocalEvent {
    /// Blocks until the work queued before the record has completed.
    pub fn synchronize(&self) -> Result<()> {
        bind(self.device)?;
        // SAFETY: the event is ours and alive.
        unsafe { check("cuEventSynchronize", sys::cuEventSynchronize(self.event)) }
    }
}

impl Drop for LocalEvent {
    fn drop(&mut self) {
        if bind(self.device).is_ok() {
            // SAFETY: created by Stream::mark, destroyed once.
            unsafe { sys::cuEventDestroy_v2(self.event) };
        }
    }
}

/// Host memory page-locked for the device's copies (cuMemHostRegister:
/// ordinary cached memory, never write-combined); unregistered on drop.
pub struct HostRegistration {
    ptr: usize,
    device: i32,
}

impl HostRegistration {
    /// # Safety
    /// `ptr..ptr+len` is mapped host memory that outlives the registration.
    pub unsafe fn new(ptr: *mut u8, len: usize, device: i32) -> Result<HostRegistration> {
        bind(device)?;
        // SAFETY: the caller's contract.
        unsafe { Self::register(ptr, len, device, sys::CU_MEMHOSTREGISTER_PORTABLE) }
    }

    /// # Safety
    /// As [`HostRegistration::new`]; a context of `device` is current.
    unsafe fn register(ptr: *mut u8, len: usize, device: i32, flags: u32) -> Result<HostRegistration> {
        // SAFETY: the caller's contract.
        unsafe { check("cuMemHostRegister", sys::cuMemHostRegister_v2(ptr.cast(), len, flags))? };
        Ok(HostRegistration { ptr: ptr as usize, device })
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // In the device's primary context, then the thread's own back (a
        // trainer thread's context is the trainer's).
        // SAFETY: registered by `register`, unregistered once.
        let _ = in_primary(self.device, || unsafe {
            check("cuMemHostUnregister", sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void))
        });
    }
}

/// A 32-bit word of host memory the device's streams can wait on (trainer
/// side): page-locked and mapped for the device (`cuMemHostRegister` with
/// `DEVICEMAP | PORTABLE`), so `cuStreamWaitValue32` on it holds a stream
/// until the word reaches a value that the host (any process mapping the
/// same page) writes. Unregistered on drop.
pub struct HostWord {
    ptr: usize,
    _registration: HostRegistration,
}

impl HostWord {
    /// Registers the `len` bytes at `page` (page-aligned, holding the word
    /// at its start) for device `device`'s streams.
    ///
    /// # Safety
    /// `page..page+len` is mapped host memory that outlives the `HostWord`,
    /// and its first 4 bytes are only accessed atomically.
    pub unsafe fn new(page: *mut u8, len: usize, device: i32) -> Result<HostWord> {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller's contract.
        let registration = in_primary(device, || unsafe { HostRegistration::register(page, len, device, flags) })?;
        Ok(HostWord { ptr: page as usize, _registration: registration })
    }

    /// Makes later work on `stream` (a CUstream of device `device`; 0: the
    /// legacy default stream) wait until the word is at least `value`
    /// (compared as `(i32)(word - value) >= 0`, so it may wrap). The CPU
    /// does not wait.
    pub fn wait_geq(&self, stream: u64, device: i32, value: u32) -> Result<()> {
        in_primary(device, || {
            let mut dptr: sys::CUdeviceptr = 0;
            // SAFETY: the word's page is registered with DEVICEMAP (new);
            // valid out-pointer; an invalid stream is an error code.
            unsafe {
                check(
                    "cuMemHostGetDevicePointer",
                    sys::cuMemHostGetDevicePointer_v2(&mut dptr, self.ptr as *mut std::ffi::c_void, 0),
                )?;
                check(
                    "cuStreamWaitValue32",
                    sys::cuStreamWaitValue32_v2(
                        stream as sys::CUstream,
                        dptr,
                        value,
                        sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                    ),
                )
            }
        })
    }
}
