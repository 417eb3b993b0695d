//! The CUDA kind of region: one device allocation of the client, opened from
//! its legacy IPC handle or imported from a VMM allocation's file descriptor
//! (passed with SCM_RIGHTS) and mapped ([`ckpt_cuda::Imported`]); closed
//! (unmapped, released) when the region is dropped (unregistered, or its
//! session ended: the client left or died). A VMM import stays valid after
//! the client died (the driver counts references); a legacy one does not.
//!
//! Devices are named by UUID: the client's ordinal of a device is its own
//! (`CUDA_VISIBLE_DEVICES` renumbers devices per process), so a region's
//! registration says the device's UUID and the session maps the client's
//! ordinal to the sidecar's device of that UUID ([`CudaSession::device`]),
//! refusing a UUID the sidecar does not see.
//!
//! Copies run on the session's own stream ([`CudaSession`]). The sidecar
//! never makes that stream wait on the trainer's work and never blocks in a
//! driver call on it: a `SaveAfterEvent` is fenced by polling the trainer's
//! event (`cuEventQuery`, [`CudaSession::fence`]) while watching the client,
//! and only once it completed are the save's device-to-host copies queued.
//! A wait on an event whose process died may never end (the driver leaves
//! it undefined), so a client that dies first only fails its save: nothing
//! queued on the stream depends on it, and every copy queued completes by
//! itself. Nothing the trainer's stream waits on is the sidecar's to
//! complete either (the trainer's client releases its own stream waits:
//! docs/protocol.md, CUDA). Staging is page-locked with `cuMemHostRegister`
//! (ordinary cached memory, never write-combined), once per staging buffer,
//! and unregistered before that buffer is freed ([`pin_staging`]).
//!
//! A failed driver call during a copy cannot stop it (copy_out returns no
//! error); it is remembered, and [`CudaMemory::check_intact`] refuses the
//! save afterwards, as a truncated shm segment is refused. Every path that
//! queued a copy waits for the stream before returning, also after an
//! error ([`Synced`]), so no copy writes into staging after its lease.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckpt_cuda::{HostRegistration, Imported, LocalEvent, OpenedEvent, Stream};
use tracing::{info, warn};

use super::RegionError;
use crate::config;
use crate::memory::staging::Staging;
use ckpt_store::mem::RawBuf;

/// What names a client's device allocation.
pub enum CudaSource<'a> {
    /// A legacy IPC handle (64 bytes).
    Ipc(&'a [u8]),
    /// A VMM allocation exported as a POSIX fd (closed once imported).
    Fd(OwnedFd),
    /// A VMM allocation exported as a FABRIC handle (64 bytes).
    Fabric(&'a [u8]),
}

/// The session's stream on one device.
pub struct SessionStream {
    stream: Stream,
}

/// Waits for a stream when dropped: built before a copy is queued, so every
/// way out of the function that queued it (an error too) waits for the
/// copy before the destination may be reused.
struct Synced<'a> {
    stream: &'a Stream,
    done: bool,
}

impl<'a> Synced<'a> {
    fn new(stream: &'a Stream) -> Self {
        Synced { stream, done: false }
    }

    /// Waits for the stream now, saying how it went.
    fn wait(mut self) -> ckpt_cuda::Result<()> {
        self.done = true;
        let r = self.stream.synchronize();
        if r.is_err() {
            // A failed wait is tried once more: the copy must be over.
            let _ = self.stream.synchronize();
        }
        r
    }
}

impl Drop for Synced<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.stream.synchronize();
        }
    }
}

/// How the sidecar holds a client's allocation.
enum Held {
    /// A VMM import: the driver counts its references, so holding it costs
    /// the client nothing (a chunk it unmaps stays ours until we let go).
    Vmm(Imported),
    /// A legacy IPC allocation: its handle only, between requests. The
    /// driver leaves `cuMemFree` of memory still open in an importer
    /// undefined, and in practice the memory then stays allocated (the
    /// trainer's OOM retry would fail for our import), and a new allocation
    /// at an address still open here is refused (`ALREADY_MAPPED`). So the
    /// import is opened by the first copy or load of a request that needs
    /// it and closed once that request is over ([`CudaMemory::close_import`]).
    /// `open`: the import and how long opening it took.
    Legacy {
        handle: [u8; ckpt_cuda::IPC_HANDLE_BYTES],
        device: i32,
        len_bytes: u64,
        open: Mutex<Option<(Imported, Duration)>>,
    },
}

/// What closing a request's legacy imports cost ([`CudaMemory::close_import`]):
/// a real open can take hundreds of ms and a close can synchronize the
/// device, so the session logs it per request (and the GPU run reports it).
#[derive(Debug, Default, Clone, Copy)]
pub struct ImportTimes {
    /// Imports opened (and now closed) for the request.
    pub imports: u32,
    pub open_total: Duration,
    pub open_max: Duration,
    pub close_total: Duration,
    pub close_max: Duration,
}

impl ImportTimes {
    /// Both together (a request's regions, a span's pieces).
    pub fn and(self, o: ImportTimes) -> ImportTimes {
        ImportTimes {
            imports: self.imports + o.imports,
            open_total: self.open_total + o.open_total,
            open_max: self.open_max.max(o.open_max),
            close_total: self.close_total + o.close_total,
            close_max: self.close_max.max(o.close_max),
        }
    }
    /// One log line for a request that opened legacy imports (none: nothing).
    pub fn log(self) {
        if self.imports == 0 {
            return;
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        info!(
            imports = self.imports,
            open_ms = ms(self.open_total),
            open_max_ms = ms(self.open_max),
            close_ms = ms(self.close_total),
            close_max_ms = ms(self.close_max),
            "legacy CUDA imports of the last request opened and closed"
        );
    }
}

/// One device allocation of the client and the stream its copies run on.
pub struct CudaMemory {
    held: Held,
    stream: Arc<SessionStream>,
    /// The first driver error of a copy, if any (sticky: register again).
    failed: Mutex<Option<String>>,
}

impl CudaMemory {
    /// Opens the allocation `source` names on `device`; it must hold
    /// `len_bytes`. A passed fd is closed once imported (the import holds
    /// the allocation).
    /// A legacy handle is opened here once, to check it, and closed again:
    /// only its bytes are kept ([`Held::Legacy`]).
    pub fn open(
        source: CudaSource,
        device: i32,
        len_bytes: u64,
        stream: Arc<SessionStream>,
    ) -> Result<CudaMemory, RegionError> {
        let held = match source {
            CudaSource::Ipc(handle) => {
                drop(Imported::open(handle, device, len_bytes)?);
                let handle = handle.try_into().expect("Imported::open checked the handle's length");
                Held::Legacy { handle, device, len_bytes, open: Mutex::new(None) }
            }
            CudaSource::Fd(fd) => Held::Vmm(Imported::import_fd(&fd, device, len_bytes)?),
            CudaSource::Fabric(handle) => Held::Vmm(Imported::import_fabric(handle, device, len_bytes)?),
        };
        Ok(CudaMemory { held, stream, failed: Mutex::new(None) })
    }

    pub fn is_vmm(&self) -> bool {
        matches!(self.held, Held::Vmm(_))
    }

    /// The allocation's address here, opening a legacy import if it is not
    /// open (it then stays open until [`CudaMemory::close_import`]).
    fn ptr(&self) -> Result<u64, RegionError> {
        match &self.held {
            Held::Vmm(i) => Ok(i.ptr()),
            Held::Legacy { handle, device, len_bytes, open } => {
                let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
                if let Some((i, _)) = &*open {
                    return Ok(i.ptr());
                }
                let t0 = Instant::now();
                let i = Imported::open(handle, *device, *len_bytes)?;
                let ptr = i.ptr();
                *open = Some((i, t0.elapsed()));
                Ok(ptr)
            }
        }
    }

    /// Closes a legacy import opened for the request that just ended (no
    /// copy or load on it runs any more: the caller's contract, kept by the
    /// session, which calls it between requests). A VMM import stays.
    /// Returns what opening and closing it cost (nothing when none was open).
    pub fn close_import(&self) -> ImportTimes {
        let Held::Legacy { open, .. } = &self.held else { return ImportTimes::default() };
        let Some((import, open_time)) = open.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return ImportTimes::default();
        };
        let t0 = Instant::now();
        drop(import);
        let close_time = t0.elapsed();
        ImportTimes {
            imports: 1,
            open_total: open_time,
            open_max: open_time,
            close_total: close_time,
            close_max: close_time,
        }
    }

    fn fail(&self, what: String) {
        let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            warn!("CUDA region: {what}");
            *f = Some(what);
        }
    }

    /// Copies device bytes at `offset_bytes` into `dst` on the session's
    /// stream (after any event it waits on) and waits for that copy.
    ///
    /// # Safety
    /// `dst..dst+len` is writable and no one else's for the call; the range
    /// lies inside the region (checked by [`super::Region::copy_out`]).
    pub unsafe fn copy_out(&self, offset_bytes: u64, dst: *mut u8, len: usize, crc: bool) -> u32 {
        let src = match self.ptr() {
            Ok(p) => p + offset_bytes,
            Err(e) => {
                self.fail(format!("opening the allocation failed: {e}"));
                return 0;
            }
        };
        let synced = Synced::new(&self.stream.stream);
        // SAFETY: dst is the caller's for the call, and `synced` waits for
        // the stream before this returns, whatever happens; src..src+len
        // lies in the imported allocation (bounds checked by Region, the
        // allocation holds len_bytes: checked at open).
        let queued = unsafe { self.stream.stream.copy_dtoh_async(dst, src, len) };
        let done = queued.and(synced.wait());
        if let Err(e) = done {
            self.fail(format!("device-to-host copy failed: {e}"));
            return 0;
        }
        if !crc {
            return 0;
        }
        // SAFETY: dst..dst+len was just written by the completed copy and is
        // the caller's for the call.
        crc32c::crc32c(unsafe { std::slice::from_raw_parts(dst, len) })
    }

    /// Queues a copy of every range on the session's stream (after any
    /// event it waits on); [`CudaMemory::finish_batch`] waits for them.
    ///
    /// # Safety
    /// As [`CudaMemory::copy_out`], for every range, until `finish_batch`
    /// has returned.
    pub unsafe fn queue_batch(&self, ranges: &[(u64, *mut u8, usize)]) {
        let base = match self.ptr() {
            Ok(p) => p,
            Err(e) => return self.fail(format!("opening the allocation failed: {e}")),
        };
        for &(offset_bytes, dst, len) in ranges {
            // SAFETY: the caller's contract; finish_batch returns only once
            // every queued copy is done (also after an error).
            if let Err(e) = unsafe { self.stream.stream.copy_dtoh_async(dst, base + offset_bytes, len) } {
                self.fail(format!("device-to-host copy failed: {e}"));
                return;
            }
        }
    }

    /// Waits until the stream's queued copies have completed.
    pub fn finish_batch(&self) {
        if let Err(e) = Synced::new(&self.stream.stream).wait() {
            self.fail(format!("device-to-host copy failed: {e}"));
        }
    }

    /// A mark behind the copies queued so far on the session's stream
    /// (None when the driver refused one: [`CudaMemory::wait_mark`] then
    /// waits for the whole stream).
    pub fn mark(&self) -> Option<LocalEvent> {
        self.stream
            .stream
            .mark()
            .map_err(|e| warn!("cannot mark the device copies (waiting for the whole stream instead): {e}"))
            .ok()
    }

    /// Waits until the copies queued before `mark` have completed.
    pub fn wait_mark(&self, mark: Option<&LocalEvent>) {
        let done = match mark {
            Some(e) => e.synchronize(),
            None => self.stream.stream.synchronize(),
        };
        if let Err(e) = done {
            let _ = self.stream.stream.synchronize();
            self.fail(format!("device-to-host copy failed: {e}"));
        }
    }

    pub fn check_intact(&self) -> Result<(), RegionError> {
        match &*self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(why) => Err(RegionError::CudaCopy { why: why.clone() }),
            None => Ok(()),
        }
    }

    /// Writes `bytes` at `offset_bytes` (a load): host-to-device on the
    /// session's stream, synchronized before returning (the Loaded reply
    /// follows, so the trainer's later work sees the bytes).
    pub fn write_at(&self, offset_bytes: u64, bytes: &[u8]) -> Result<(), RegionError> {
        let dst = self.ptr()? + offset_bytes;
        let synced = Synced::new(&self.stream.stream);
        // SAFETY: `bytes` is borrowed until `synced` waited for the stream
        // (below, or on its drop); the range lies in the allocation (bounds
        // checked by Region::write_at).
        let queued = unsafe { self.stream.stream.copy_htod_async(dst, bytes.as_ptr(), bytes.len()) };
        queued.and(synced.wait()).map_err(RegionError::from)
    }

    pub fn device(&self) -> i32 {
        match &self.held {
            Held::Vmm(i) => i.device(),
            Held::Legacy { device, .. } => *device,
        }
    }
}

/// A session's CUDA state: the client's devices (its ordinal → the
/// sidecar's, by UUID), its own stream per device, and the trainer's
/// interprocess events it opened (kept while the session lives).
#[derive(Default)]
pub struct CudaSession {
    devices: HashMap<i32, i32>,
    streams: HashMap<i32, Arc<SessionStream>>,
    events: HashMap<(i32, Vec<u8>), Arc<OpenedEvent>>,
}

/// How often [`CudaSession::fence`] checks its event at first, and at most.
const FENCE_POLL_MIN: Duration = Duration::from_micros(20);
const FENCE_POLL_MAX: Duration = Duration::from_millis(2);

impl CudaSession {
    /// The sidecar's ordinal of the client's device `client_device`, whose
    /// UUID is `uuid` (as a registration says it), remembered for the
    /// session's later messages naming that ordinal. Refused, naming the
    /// UUID, when the sidecar does not see that device, or when the client
    /// named another UUID for the same ordinal before.
    pub fn device(&mut self, client_device: i32, uuid: &[u8]) -> Result<i32, RegionError> {
        let invalid = |m: String| RegionError::Cuda(ckpt_cuda::CudaError::Invalid(m));
        if uuid.len() != ckpt_cuda::UUID_BYTES {
            return Err(invalid(format!("a CUDA device UUID has {} bytes, not {}", ckpt_cuda::UUID_BYTES, uuid.len())));
        }
        let Some(ours) = ckpt_cuda::ordinal_of_uuid(uuid)? else {
            let seen: Vec<String> = ckpt_cuda::probe()?.devices.iter().map(|d| ckpt_cuda::uuid_text(&d.uuid)).collect();
            return Err(invalid(format!(
                "the client's CUDA device {client_device} ({}) is not visible to the sidecar (it sees {}): start the sidecar with that device visible (CUDA_VISIBLE_DEVICES)",
                ckpt_cuda::uuid_text(uuid),
                seen.join(", ")
            )));
        };
        match self.devices.insert(client_device, ours) {
            Some(before) if before != ours => {
                self.devices.insert(client_device, before);
                Err(invalid(format!(
                    "the client's CUDA device {client_device} was registered before as another device than {}",
                    ckpt_cuda::uuid_text(uuid)
                )))
            }
            _ => Ok(ours),
        }
    }

    /// The sidecar's ordinal of the client's device `client_device`, as a
    /// registration named it.
    fn ours(&self, client_device: i32) -> Result<i32, RegionError> {
        self.devices.get(&client_device).copied().ok_or_else(|| {
            RegionError::Cuda(ckpt_cuda::CudaError::Invalid(format!(
                "no CUDA region is registered on the client's device {client_device}"
            )))
        })
    }

    /// The session's stream on the sidecar's device `device`, created at
    /// first use; staging is page-locked then if it is not yet.
    pub fn stream(&mut self, device: i32, staging: &Staging) -> Result<Arc<SessionStream>, RegionError> {
        if let Some(s) = self.streams.get(&device) {
            return Ok(s.clone());
        }
        let s = Arc::new(SessionStream { stream: Stream::new(device)? });
        pin_staging(staging, device);
        self.streams.insert(device, s.clone());
        Ok(s)
    }

    /// Waits, on this thread, until the trainer's event (its IPC handle, on
    /// the client's device `client_device`) as recorded now has completed:
    /// call after the Save arrived, before any copy of it is queued. Polls
    /// the event (`cuEventQuery`), never blocking in the driver, and gives
    /// up with an error once `gone` says the client is gone (its event may
    /// then never complete). The client is checked before every query:
    /// querying an imported event after its exporter died is undefined.
    pub fn fence(&mut self, client_device: i32, event: &[u8], gone: &dyn Fn() -> bool) -> Result<(), RegionError> {
        let device = self.ours(client_device)?;
        let event = self.event(device, event, gone)?;
        let mut pause = FENCE_POLL_MIN;
        let t0 = Instant::now();
        let went_away = |t0: Instant| {
            RegionError::Cuda(ckpt_cuda::CudaError::Invalid(format!(
                "the client went away {:.3} s into the wait for its CUDA event (the work before it may never complete): nothing of this save was copied",
                t0.elapsed().as_secs_f64()
            )))
        };
        loop {
            if gone() {
                return Err(went_away(t0));
            }
            match event.is_done() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                // The client died between the check and the query.
                Err(_) if gone() => return Err(went_away(t0)),
                Err(e) => return Err(e.into()),
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(FENCE_POLL_MAX);
        }
    }

    /// The trainer's event `handle`, opened once per session ([`open_event`]).
    fn event(&mut self, device: i32, handle: &[u8], gone: &dyn Fn() -> bool) -> Result<Arc<OpenedEvent>, RegionError> {
        let key = (device, handle.to_vec());
        if let Some(e) = self.events.get(&key) {
            return Ok(e.clone());
        }
        if self.events.len() >= config::CUDA_EVENTS_PER_SESSION_MAX {
            self.events.clear();
        }
        let e = Arc::new(open_event(handle, device, gone)?);
        self.events.insert(key, e.clone());
        Ok(e)
    }
}

/// Opens the trainer's event `handle` on `device` on a thread of its own,
/// watched from the calling (session) thread: an open that hangs in the
/// driver (seen on a busy GPU) then fails only the save that needed it,
/// once the client is gone or [`config::CUDA_EVENT_OPEN_TIMEOUT_MS`] passed,
/// and is left to finish on its thread (the event it may still open is
/// destroyed there), never holding the session or any other.
fn open_event(handle: &[u8], device: i32, gone: &dyn Fn() -> bool) -> Result<OpenedEvent, RegionError> {
    use std::sync::mpsc::{sync_channel, RecvTimeoutError};
    let invalid = |m: String| RegionError::Cuda(ckpt_cuda::CudaError::Invalid(m));
    let (tx, rx) = sync_channel(1);
    let handle = handle.to_vec();
    std::thread::Builder::new()
        .name("ckpt-cuda-event-open".into())
        .spawn(move || {
            let _ = tx.send(OpenedEvent::open(&handle, device));
        })
        .map_err(|e| invalid(format!("cannot start the thread that opens the trainer's CUDA event: {e}")))?;
    let t0 = Instant::now();
    let timeout = Duration::from_millis(config::CUDA_EVENT_OPEN_TIMEOUT_MS);
    loop {
        match rx.recv_timeout(Duration::from_millis(config::CUDA_EVENT_OPEN_POLL_MS)) {
            Ok(opened) => return opened.map_err(RegionError::from),
            Err(RecvTimeoutError::Disconnected) => {
                return Err(invalid("the thread opening the trainer's CUDA event ended without an answer".into()))
            }
            Err(RecvTimeoutError::Timeout) if gone() => {
                return Err(invalid(format!(
                    "the client went away {:.3} s into opening its CUDA event (cuIpcOpenEventHandle still runs on its own thread): nothing of this save was copied",
                    t0.elapsed().as_secs_f64()
                )))
            }
            Err(RecvTimeoutError::Timeout) if t0.elapsed() >= timeout => {
                warn!(timeout_ms = config::CUDA_EVENT_OPEN_TIMEOUT_MS, "opening a trainer's CUDA event hangs in the driver");
                return Err(invalid(format!(
                    "opening the trainer's CUDA event (cuIpcOpenEventHandle) took more than {} ms: the driver may be stuck; this save is refused (the open goes on on its own thread)",
                    config::CUDA_EVENT_OPEN_TIMEOUT_MS
                )));
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
}

/// The staging buffer page-locked for CUDA copies: the registration goes
/// (unregistered) before the buffer it holds may be freed.
struct Pinned {
    /// None: the driver refused (copies then run slower, from pageable memory).
    _registration: Option<HostRegistration>,
    /// Keeps the registered pages mapped while registered (dropped after
    /// `registration`: fields drop in order).
    buf: Arc<RawBuf>,
}

/// Page-locks the staging buffer for the device's copies (they then run at
/// full DMA speed), once per buffer: a daemon has one for its life. Another
/// buffer (a second `Staging` in one process: tests, benches) replaces the
/// registration: the old one is unregistered first, while its buffer is
/// still mapped, so no registration ever outlives the pages it pinned, and a
/// later buffer at the same address is registered anew, never DMA'd into
/// through stale pinned pages. A refusal only costs speed.
fn pin_staging(staging: &Staging, device: i32) {
    static PINNED: Mutex<Option<Pinned>> = Mutex::new(None);
    let mut pinned = PINNED.lock().unwrap_or_else(|p| p.into_inner());
    let buf = staging.buf();
    if pinned.as_ref().is_some_and(|p| Arc::ptr_eq(&p.buf, buf)) {
        return;
    }
    // Unregistered (then its buffer released) before the new one registers.
    *pinned = None;
    // SAFETY: `Pinned` keeps an Arc of the buffer for as long as the
    // registration lives and drops the registration first.
    let registration = match unsafe { HostRegistration::new(buf.as_ptr(), buf.len(), device) } {
        Ok(r) => {
            info!(bytes = buf.len(), "staging page-locked for CUDA copies");
            Some(r)
        }
        Err(e) => {
            warn!("staging could not be page-locked for CUDA copies (they run slower): {e}");
            None
        }
    };
    *pinned = Some(Pinned { _registration: registration, buf: buf.clone() });
}
