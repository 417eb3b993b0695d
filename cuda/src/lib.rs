//! The one place for CUDA, used by both sides (the trainer's client and the
//! sidecar): the driver API through cudarc's dynamic loading, so every build
//! runs where there is no CUDA at all.
//!
//! - [`probe`]: the driver, looked for once per process (cudarc's
//!   `is_culib_present`, then `cuInit`); every other call here goes through
//!   it, so a missing driver is an [`CudaError::NoDriver`] refusal, never a
//!   panic (cudarc panics when a call finds no library) and never a hang.
//! - trainer side: [`allocation_of`] (the allocation that holds a device
//!   pointer), [`export`] (how it is shared: its legacy IPC handle, or for a
//!   VMM allocation a POSIX file descriptor), [`IpcEvent`] (an interprocess
//!   event recorded on the trainer's stream at each save);
//! - sidecar side: [`Imported`] (an allocation opened from its IPC handle or
//!   imported from its fd and mapped, closed on drop), [`OpenedEvent`],
//!   [`Stream`] (the sidecar's own stream: waits
//!   on events, copies device⇄host), [`HostRegistration`] (page-locks host
//!   memory the copies use).
//!
//! Every handle is a plain driver handle; the driver API is thread-safe, and
//! each call first makes the device's primary context current on the calling
//! thread ([`bind`]), so any thread may use any handle. Trainer-side calls
//! put back the thread's own current context afterwards.

use std::ffi::CStr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};

mod handles;
pub use handles::{HostRegistration, HostWord, Imported, LocalEvent, OpenedEvent, Stream};

/// Bytes of a legacy IPC memory or event handle.
pub const IPC_HANDLE_BYTES: usize = 64;

#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// No libcuda on the library search path.
    #[error("no CUDA driver (libcuda.so.1 is not on the library search path)")]
    NoDriver,
    /// The library is there but unusable (cuInit failed, no device).
    #[error("CUDA driver unusable: {0}")]
    Unusable(String),
    /// A driver call failed.
    #[error("{call}: {text} ({code})")]
    Call { call: &'static str, code: i32, text: String },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInfo {
    /// As cuDriverGetVersion says: 1000 × major + 10 × minor.
    pub driver_version: i32,
    pub devices: Vec<DeviceInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: i32,
    pub name: String,
    pub total_bytes: u64,
    /// The device's UUID (`cuDeviceGetUuid_v2`): the same device has the
    /// same UUID in every process, whatever its ordinal there
    /// (`CUDA_VISIBLE_DEVICES` renumbers devices per process).
    pub uuid: [u8; UUID_BYTES],
    /// `CU_DEVICE_ATTRIBUTE_COMPUTE_MODE`: 0 default, 2 prohibited, 3
    /// exclusive-process (a second process's context is refused).
    pub compute_mode: i32,
    /// A MIG instance: `uuid` (`cuDeviceGetUuid_v2`) is the instance's,
    /// which differs from its GPU's (the legacy `cuDeviceGetUuid`), and is
    /// named `MIG-…` ([`uuid_text`]). Legacy IPC is not supported there.
    pub mig: bool,
}

/// Bytes of a device UUID.
pub const UUID_BYTES: usize = 16;

/// A device UUID as the driver names it (nvidia-smi, `CUDA_VISIBLE_DEVICES`):
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, or `MIG-…` for a MIG
/// instance this process's probe found ([`DeviceInfo::mig`]; a UUID the
/// probe did not see, or a process that never probed, says `GPU-`).
pub fn uuid_text(uuid: &[u8]) -> String {
    let mig = PROBE
        .get()
        .and_then(|p| p.as_ref().ok())
        .is_some_and(|i| i.devices.iter().any(|d| d.mig && d.uuid[..] == *uuid));
    uuid_text_as(uuid, if mig { "MIG" } else { "GPU" })
}

/// `uuid` written with `prefix` (`GPU` or `MIG`), dashed as nvidia-smi does.
fn uuid_text_as(uuid: &[u8], prefix: &str) -> String {
    let h: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    if h.len() != 2 * UUID_BYTES {
        return format!("{prefix}-{h}");
    }
    format!("{prefix}-{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// The ordinal, in this process, of the device whose UUID is `uuid`; None
/// when this process does not see it.
pub fn ordinal_of_uuid(uuid: &[u8]) -> Result<Option<i32>> {
    Ok(probe()?.devices.iter().find(|d| d.uuid[..] == *uuid).map(|d| d.ordinal))
}

/// The UUID of this process's device `ordinal`.
pub fn uuid_of(ordinal: i32) -> Result<[u8; UUID_BYTES]> {
    let info = probe()?;
    info.devices.iter().find(|d| d.ordinal == ordinal).map(|d| d.uuid).ok_or_else(|| {
        CudaError::Invalid(format!("CUDA device {ordinal} does not exist ({} devices)", info.devices.len()))
    })
}

/// Free and total device memory of device `ordinal` (`cuMemGetInfo_v2`, in
/// its primary context: creating it costs device memory the first time).
pub fn memory_info(ordinal: i32) -> Result<(u64, u64)> {
    in_primary(ordinal, || {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the context is current (in_primary).
        unsafe { check("cuMemGetInfo", sys::cuMemGetInfo_v2(&mut free, &mut total))? };
        Ok((free as u64, total as u64))
    })
}

fn check(call: &'static str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or
    // leaves it null); the library is loaded (we only get here after a call).
    let text = unsafe {
        if sys::cuGetErrorString(r, &mut p) == CUresult::CUDA_SUCCESS && !p.is_null() {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        } else {
            format!("{r:?}")
        }
    };
    Err(CudaError::Call { call, code: r as i32, text })
}

/// Finds the driver and its devices, once per process; later calls return
/// the same answer.
pub fn probe() -> Result<&'static DriverInfo> {
    PROBE.get_or_init(probe_once).as_ref().map_err(Clone::clone)
}

/// What [`probe`] found, once it ran.
static PROBE: OnceLock<Result<DriverInfo>> = OnceLock::new();

fn probe_once() -> Result<DriverInfo> {
    // SAFETY: only tries to dlopen the library names cudarc knows.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    // SAFETY: plain driver calls with valid out-pointers; the library is
    // present (checked above), so cudarc's loader does not panic.
    unsafe {
        check("cuInit", sys::cuInit(0)).map_err(|e| CudaError::Unusable(e.to_string()))?;
        let mut driver_version = 0;
        check("cuDriverGetVersion", sys::cuDriverGetVersion(&mut driver_version))?;
        let mut n = 0;
        check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut n))?;
        if n == 0 {
            return Err(CudaError::Unusable("the driver sees no CUDA device".into()));
        }
        let mut devices = Vec::new();
        for ordinal in 0..n {
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal))?;
            let mut buf = [0 as std::ffi::c_char; 256];
            check("cuDeviceGetName", sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev))?;
            let name = CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
            let mut total = 0usize;
            check("cuDeviceTotalMem", sys::cuDeviceTotalMem_v2(&mut total, dev))?;
            let mut uuid = sys::CUuuid_st { bytes: [0; UUID_BYTES] };
            check("cuDeviceGetUuid_v2", sys::cuDeviceGetUuid_v2(&mut uuid, dev))?;
            // The legacy call names a MIG instance's GPU: another UUID.
            let mut gpu = sys::CUuuid_st { bytes: [0; UUID_BYTES] };
            let mig = sys::cuDeviceGetUuid(&mut gpu, dev) == CUresult::CUDA_SUCCESS && gpu.bytes != uuid.bytes;
            let mut compute_mode = 0;
            // A driver that cannot say leaves the default mode (0).
            let _ = sys::cuDeviceGetAttribute(
                &mut compute_mode,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE,
                dev,
            );
            devices.push(DeviceInfo {
                ordinal,
                name,
                total_bytes: total as u64,
                uuid: uuid.bytes.map(|c| c as u8),
                compute_mode,
                mig,
            });
        }
        Ok(DriverInfo { driver_version, devices })
    }
}

/// Makes the primary context of device `ordinal` current on this thread
/// (retained once per device for the process's life).
pub fn bind(ordinal: i32) -> Result<()> {
    let info = probe()?;
    if ordinal < 0 || ordinal as usize >= info.devices.len() {
        return Err(CudaError::Invalid(format!(
            "CUDA device {ordinal} does not exist ({} devices)",
            info.devices.len()
        )));
    }
    static CTX: OnceLock<Vec<std::sync::Mutex<usize>>> = OnceLock::new();
    let slots = CTX.get_or_init(|| (0..info.devices.len()).map(|_| std::sync::Mutex::new(0)).collect());
    let mut slot = slots[ordinal as usize].lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: driver calls with valid out-pointers after a successful probe;
    // the context is retained for the process's life (never released), so
    // the stored handle stays valid.
    unsafe {
        if *slot == 0 {
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal))?;
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            check("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
            *slot = ctx as usize;
        }
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(*slot as sys::CUcontext))
    }
}

/// Runs `f` with device `ordinal`'s primary context current, then puts back
/// whatever context the calling thread had: the trainer-side calls run on
/// the trainer's threads, whose current context is theirs, not ours.
fn in_primary<T>(ordinal: i32, f: impl FnOnce() -> Result<T>) -> Result<T> {
    probe()?;
    let mut before: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver is loaded (probe).
    unsafe { check("cuCtxGetCurrent", sys::cuCtxGetCurrent(&mut before))? };
    bind(ordinal)?;
    let out = f();
    // SAFETY: `before` is the context this thread had (or null: none).
    unsafe { sys::cuCtxSetCurrent(before) };
    out
}

/// One device allocation: where it starts, how long it is, which device,
/// and which allocation it is (`CU_POINTER_ATTRIBUTE_BUFFER_ID`: unique per
/// allocation for the process's life, never reused after a free; 0 when the
/// driver does not say). A freed allocation and a new one at the same
/// address differ in `buffer_id`, so a cached export is never taken for
/// the new memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    pub base: u64,
    pub len_bytes: u64,
    pub device: i32,
    pub buffer_id: u64,
}

/// The buffer id of the allocation holding device pointer `ptr` (see
/// [`Allocation::buffer_id`]): one driver call, the cheap check that a
/// cached registration still names the memory at `ptr`.
pub fn buffer_id(ptr: u64) -> Result<u64> {
    probe()?;
    let mut id: u64 = 0;
    // SAFETY: BUFFER_ID writes one unsigned long long into `id`; an unknown
    // pointer is an error code, not a fault.
    unsafe {
        check(
            "cuPointerGetAttribute(BUFFER_ID)",
            sys::cuPointerGetAttribute(
                (&mut id as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                ptr,
            ),
        )?;
    }
    Ok(id)
}

/// Whether device pointer `ptr` is backed by memory: false for a reserved
/// but unmapped VMM address (`CU_POINTER_ATTRIBUTE_MAPPED`); true when the
/// driver does not say (older drivers), the other checks then decide.
fn is_mapped(ptr: u64) -> bool {
    let mut mapped: i32 = 1;
    // SAFETY: MAPPED writes one int (a bool) into `mapped`.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut mapped as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MAPPED,
            ptr,
        )
    };
    r != CUresult::CUDA_SUCCESS || mapped != 0
}

/// Whether device pointer `ptr` lies in memory of a stream-ordered pool
/// (`cuMemAllocAsync`, `cudaMallocAsync`): `CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`
/// names its pool. False when the driver does not say.
fn from_memory_pool(ptr: u64) -> bool {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: MEMPOOL_HANDLE writes one pointer into `pool`; an unknown
    // pointer is an error code.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut pool as *mut sys::CUmemoryPool).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            ptr,
        )
    };
    r == CUresult::CUDA_SUCCESS && !pool.is_null()
}

/// The allocation that holds device pointer `ptr` (trainer side).
pub fn allocation_of(ptr: u64) -> Result<Allocation> {
    probe()?;
    let mut device: i32 = 0;
    // SAFETY: cuPointerGetAttribute writes one int for DEVICE_ORDINAL into
    // `device`; an unknown pointer is an error code, not a fault.
    unsafe {
        check(
            "cuPointerGetAttribute(DEVICE_ORDINAL)",
            sys::cuPointerGetAttribute(
                (&mut device as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            ),
        )
        .map_err(|e| CudaError::Invalid(format!("pointer {ptr:#x} is not CUDA device memory: {e}")))?;
    }
    if !is_mapped(ptr) {
        return Err(CudaError::Invalid(format!(
            "device address {ptr:#x} is reserved but not mapped to any allocation"
        )));
    }
    in_primary(device, || {
        let (mut base, mut len) = (0u64, 0usize);
        // SAFETY: valid out-pointers; the context is current (in_primary).
        unsafe { check("cuMemGetAddressRange", sys::cuMemGetAddressRange_v2(&mut base, &mut len, ptr))? };
        // A driver that cannot say (0) leaves base and length as the identity.
        let buffer_id = buffer_id(base).unwrap_or(0);
        Ok(Allocation { base, len_bytes: len as u64, device, buffer_id })
    })
}

/// The allocations that hold the `len_bytes` at device pointer `ptr`, in
/// address order: the one holding `ptr`, then, while the range runs past
/// its end, the allocation mapped right there (VMM chunks mapped back to
/// back in one reserved range, as PyTorch's expandable segments do:
/// cuMemGetAddressRange answers for the chunk, not the reservation).
/// Refused, naming the address, when the range runs into memory with no
/// allocation mapped, so nothing outside an allocation is ever described.
pub fn allocations_covering(ptr: u64, len_bytes: u64) -> Result<Vec<Allocation>> {
    let first = allocation_of(ptr)?;
    let end = ptr
        .checked_add(len_bytes)
        .ok_or_else(|| CudaError::Invalid(format!("device range {ptr:#x} + {len_bytes} bytes overflows")))?;
    let mut out = vec![first];
    loop {
        let last = out[out.len() - 1];
        let at = last.base + last.len_bytes;
        if at >= end {
            return Ok(out);
        }
        let why = match allocation_of(at) {
            Ok(next) if next.base == at && next.device == first.device => {
                out.push(next);
                continue;
            }
            Ok(next) if next.base != at => {
                format!("the address there lies in an allocation starting at {:#x}", next.base)
            }
            Ok(next) => format!("the allocation there is on device {}, not {}", next.device, first.device),
            Err(e) => e.to_string(),
        };
        return Err(CudaError::Invalid(format!(
            "device range {ptr:#x} + {len_bytes} bytes is not all mapped memory: the allocation at {:#x} ends at {at:#x} and no allocation starts there ({why})",
            last.base
        )));
    }
}

/// Whether the trainer's `stream` (a CUstream of device `device`; 0: the
/// legacy default stream) is capturing a CUDA graph (`cuStreamIsCapturing`:
/// active, or invalidated but not yet ended). Work queued on it then only
/// joins the graph: an event recorded there is never recorded (a real
/// record needs `cudaEventRecordExternal`), and a stream wait replays with
/// the value of its capture. A driver that cannot say (an error, e.g. the
/// legacy stream while another stream captures in global mode) is an error.
pub fn is_capturing(stream: u64, device: i32) -> Result<bool> {
    in_primary(device, || {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a valid out-pointer; an invalid stream is an error code.
        unsafe { check("cuStreamIsCapturing", sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status))? };
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    })
}

/// The legacy IPC handle of the allocation starting at `base` (trainer side).
pub fn ipc_mem_handle(a: &Allocation) -> Result<[u8; IPC_HANDLE_BYTES]> {
    in_primary(a.device, || {
        let mut h = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
        // SAFETY: valid out-pointer; `base` is an allocation's start (allocation_of).
        unsafe { check("cuIpcGetMemHandle", sys::cuIpcGetMemHandle(&mut h, a.base))? };
        Ok(h.reserved.map(|c| c as u8))
    })
}

/// How an allocation is shared with the sidecar (trainer side, [`export`]).
#[derive(Debug)]
pub enum Export {
    /// cudaMalloc / cuMemAlloc memory (PyTorch's caching allocator too): a
    /// legacy IPC handle. Undefined once the exporting process is gone.
    Legacy([u8; IPC_HANDLE_BYTES]),
    /// A VMM allocation (cuMemCreate + cuMemMap) created exportable as a
    /// POSIX file descriptor: a fresh fd naming it, for SCM_RIGHTS. The
    /// driver reference-counts it, so an importer keeps the bytes after the
    /// exporter died.
    Vmm(OwnedFd),
    /// A VMM allocation created with only `CU_MEM_HANDLE_TYPE_FABRIC` among
    /// its handle types (PyTorch's expandable segments where an IMEX
    /// channel exists): its 64-byte fabric handle.
    Fabric([u8; FABRIC_HANDLE_BYTES]),
}

/// Bytes of a `CU_MEM_HANDLE_TYPE_FABRIC` handle.
pub const FABRIC_HANDLE_BYTES: usize = 64;

/// How the allocation `a` is shared: legacy IPC when the driver says it is
/// capable of it, else (a VMM mapping) its physical allocation exported as a
/// POSIX fd. Fails saying why for a VMM allocation created without
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` in its requested handle types.
pub fn export(a: &Allocation) -> Result<Export> {
    let mut legacy: i32 = 1;
    // SAFETY: IS_LEGACY_CUDA_IPC_CAPABLE writes one int into `legacy`; an
    // unknown pointer is an error code.
    let asked = unsafe {
        check(
            "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)",
            sys::cuPointerGetAttribute(
                (&mut legacy as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                a.base,
            ),
        )
    };
    if asked.is_err() || legacy != 0 {
        return ipc_mem_handle(a).map(Export::Legacy);
    }
    in_primary(a.device, || {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer; `base` is only looked up by the driver.
        unsafe { check("cuMemRetainAllocationHandle", sys::cuMemRetainAllocationHandle(&mut h, a.base as *mut std::ffi::c_void)) }.map_err(|e| {
            if from_memory_pool(a.base) {
                CudaError::Invalid(format!(
                    "the CUDA allocation at {:#x} comes from a stream-ordered memory pool (cudaMallocAsync; PyTorch's PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), which cannot be shared with the sidecar (not legacy-IPC capable): use PyTorch's default allocator (expandable_segments:True works too)",
                    a.base
                ))
            } else {
                CudaError::Invalid(format!("the CUDA allocation at {:#x} is neither legacy-IPC capable nor a VMM allocation: {e}", a.base))
            }
        })?;
        let out = export_retained(a, h);
        // SAFETY: `h` was retained above and is released once; the mapping
        // keeps the allocation alive for the trainer.
        unsafe { sys::cuMemRelease(h) };
        out
    })
}

fn export_retained(a: &Allocation, h: sys::CUmemGenericAllocationHandle) -> Result<Export> {
    const POSIX_FD: sys::CUmemAllocationHandleType =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    const FABRIC: sys::CUmemAllocationHandleType = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
    // SAFETY: an all-zero CUmemAllocationProp is a valid value of the C
    // struct (enums at 0, null pointer); the driver overwrites it.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer, a retained handle.
    unsafe {
        check("cuMemGetAllocationPropertiesFromHandle", sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, h))?
    };
    if prop.requestedHandleTypes.0 & POSIX_FD.0 == 0 && prop.requestedHandleTypes.0 & FABRIC.0 != 0 {
        let mut fabric = sys::CUmemFabricHandle_st { data: [0; FABRIC_HANDLE_BYTES] };
        // SAFETY: for FABRIC the driver writes one CUmemFabricHandle.
        unsafe {
            check(
                "cuMemExportToShareableHandle(FABRIC)",
                sys::cuMemExportToShareableHandle((&mut fabric as *mut sys::CUmemFabricHandle_st).cast(), h, FABRIC, 0),
            )?
        };
        return Ok(Export::Fabric(fabric.data));
    }
    if prop.requestedHandleTypes.0 & POSIX_FD.0 == 0 {
        return Err(CudaError::Invalid(format!(
            "the VMM allocation at {:#x} was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR or CU_MEM_HANDLE_TYPE_FABRIC in its requestedHandleTypes, so it cannot be shared with the sidecar",
            a.base
        )));
    }
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: for POSIX_FD the driver writes one int (a new descriptor).
    unsafe {
        check(
            "cuMemExportToShareableHandle",
            sys::cuMemExportToShareableHandle((&mut fd as *mut std::ffi::c_int).cast(), h, POSIX_FD, 0),
        )?
    };
    if fd < 0 {
        return Err(CudaError::Invalid("cuMemExportToShareableHandle gave no file descriptor".into()));
    }
    // SAFETY: the driver just made `fd` for us; nothing else owns it.
    Ok(Export::Vmm(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// An interprocess event of the trainer, recorded on its stream at each
/// save; the sidecar's stream waits on it (trainer side).
pub struct IpcEvent {
    event: sys::CUevent,
    device: i32,
    handle: [u8; IPC_HANDLE_BYTES],
}

// SAFETY: a CUevent is a driver handle, usable from any thread once the
// context is current (every method binds it).
unsafe impl Send for IpcEvent {}
// SAFETY: as for Send: shared use goes through the driver, which is thread-safe once bound.
unsafe impl Sync for IpcEvent {}

impl IpcEvent {
    pub fn new(device: i32) -> Result<IpcEvent> {
        let flags =
            sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32 | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        in_primary(device, || {
            let mut event: sys::CUevent = std::ptr::null_mut();
            // SAFETY: valid out-pointers; context current (in_primary).
            unsafe {
                check("cuEventCreate", sys::cuEventCreate(&mut event, flags))?;
                let mut h = sys::CUipcEventHandle { reserved: [0; IPC_HANDLE_BYTES] };
                if let Err(e) = check("cuIpcGetEventHandle", sys::cuIpcGetEventHandle(&mut h, event)) {
                    sys::cuEventDestroy_v2(event);
                    return Err(e);
                }
                Ok(IpcEvent { event, device, handle: h.reserved.map(|c| c as u8) })
            }
        })
    }

    pub fn handle(&self) -> [u8; IPC_HANDLE_BYTES] {
        self.handle
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    /// Makes later work on the trainer's `stream` wait until this event's
    /// latest record (as of now: possibly another process's, through its
    /// IPC handle) has completed. The CPU does not wait.
    pub fn wait_on(&self, stream: u64) -> Result<()> {
        // SAFETY: the event is ours and alive; the stream is the caller's
        // (an invalid one is an error code).
        in_primary(self.device, || unsafe {
            check("cuStreamWaitEvent", sys::cuStreamWaitEvent(stream as sys::CUstream, self.event, 0))
        })
    }

    /// Records the event on `stream` (a CUstream / cudaStream_t; 0: the
    /// legacy default stream). The CPU does not wait.
    pub fn record(&self, stream: u64) -> Result<()> {
        // SAFETY: the event is ours and alive; the stream is the caller's
        // (an invalid one is an error code).
        in_primary(self.device, || unsafe {
            check("cuEventRecord", sys::cuEventRecord(self.event, stream as sys::CUstream))
        })
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        // SAFETY: the event is ours and destroyed once.
        let _ = in_primary(self.device, || unsafe { check("cuEventDestroy", sys::cuEventDestroy_v2(self.event)) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver every call is a clear refusal; with one (a GPU
    /// machine, or the fake on the search path) the probe lists a device.
    #[test]
    fn the_probe_either_refuses_clearly_or_lists_devices() {
        let Err(e) = probe() else {
            assert!(!probe().unwrap().devices.is_empty());
            return;
        };
        assert!(e.to_string().contains("no CUDA driver"), "{e}");
        assert!(allocation_of(0x1000).unwrap_err().to_string().contains("no CUDA driver"));
        assert!(Stream::new(0).is_err());
        assert!(Imported::open(&[0; 64], 0, 8).is_err());
    }
}
