//! The CUDA kind of region: one device allocation of the client, opened from
//! its legacy IPC handle or imported from a VMM allocation's file descriptor
//! (passed with SCM_RIGHTS) and mapped ([`ckpt_cuda::Imported`]); closed
//! (unmapped, released) when the region is dropped (unregistered, or its
//! session ended: the client left or died). A VMM import stays valid after
//! the client died (the driver counts references); a legacy one does not.
//!
//! Copies run on the session's own stream ([`CudaSession`]): a
//! `SaveAfterEvent` makes that stream wait on the trainer's event first
//! ([`CudaSession::fence`], called after the message arrived), so every
//! device-to-host copy queued after it sees the bytes as of the trainer's
//! record; the trainer's CPU never waits. With a done event, the save's
//! copies are all queued first ([`CudaMemory::queue_batch`]), then the first
//! [`CudaMemory::finish_batch`] records the trainer's done event behind them
//! and says so (`CopyQueued`) before waiting for them: a trainer stream that
//! waits on that event runs its next step after the copy, with no CPU wait.
//! Staging is page-locked once with `cuMemHostRegister` (ordinary cached
//! memory, never write-combined).
//!
//! A failed driver call during a copy cannot stop it (copy_out returns no
//! error); it is remembered, and [`CudaMemory::check_intact`] refuses the
//! save afterwards, as a truncated shm segment is refused.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, OnceLock};

use ckpt_cuda::{HostRegistration, Imported, LocalEvent, OpenedEvent, Stream};
use tracing::{info, warn};

use super::RegionError;
use crate::config;
use crate::staging::Staging;

/// What names a client's device allocation.
pub enum CudaSource<'a> {
    /// A legacy IPC handle (64 bytes).
    Ipc(&'a [u8]),
    /// A VMM allocation exported as a POSIX fd (closed once imported).
    Fd(OwnedFd),
}

/// The session's stream on one device, and what to do once the current
/// save's copies are all queued on it (record the trainer's done event, tell
/// the trainer).
pub struct SessionStream {
    stream: Stream,
    after_queued: Mutex<Option<AfterQueued>>,
}

struct AfterQueued {
    event: Arc<OpenedEvent>,
    notify: Box<dyn FnOnce() + Send>,
}

impl SessionStream {
    /// Records the pending done event (if any) behind everything queued so
    /// far and runs its notification; a failed record is only logged (the
    /// trainer then learns of the copy by Released).
    fn fire_after_queued(&self) {
        let pending = self.after_queued.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(AfterQueued { event, notify }) = pending {
            match self.stream.record(&event) {
                Ok(()) => notify(),
                Err(e) => warn!("cannot record the trainer's done event after the copy: {e}"),
            }
        }
    }
}

/// One imported device allocation and the stream its copies run on.
pub struct CudaMemory {
    imported: Imported,
    stream: Arc<SessionStream>,
    /// The first driver error of a copy, if any (sticky: register again).
    failed: Mutex<Option<String>>,
}

impl CudaMemory {
    /// Opens the allocation `source` names on `device`; it must hold
    /// `len_bytes`. A passed fd is closed once imported (the import holds
    /// the allocation).
    pub fn open(source: CudaSource, device: i32, len_bytes: u64, stream: Arc<SessionStream>) -> Result<CudaMemory, RegionError> {
        let imported = match source {
            CudaSource::Ipc(handle) => Imported::open(handle, device, len_bytes)?,
            CudaSource::Fd(fd) => Imported::import_fd(&fd, device, len_bytes)?,
        };
        Ok(CudaMemory { imported, stream, failed: Mutex::new(None) })
    }

    pub fn is_vmm(&self) -> bool {
        self.imported.is_vmm()
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
        let src = self.imported.ptr() + offset_bytes;
        let s = &self.stream.stream;
        // SAFETY: dst is the caller's for the call, and the synchronize below
        // returns only once the copy into it is done; src..src+len lies in
        // the imported allocation (bounds checked by Region, the allocation
        // holds len_bytes: checked at open).
        let done = unsafe { s.copy_dtoh_async(dst, src, len) }.and_then(|()| s.synchronize());
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
        for &(offset_bytes, dst, len) in ranges {
            // SAFETY: the caller's contract; finish_batch returns only once
            // every queued copy is done (also after an error).
            if let Err(e) = unsafe { self.stream.stream.copy_dtoh_async(dst, self.imported.ptr() + offset_bytes, len) } {
                self.fail(format!("device-to-host copy failed: {e}"));
                return;
            }
        }
    }

    /// Once every batch of the save is queued: records the trainer's done
    /// event behind them (the first call of a save; see the module), then
    /// waits until the stream's copies have completed.
    pub fn finish_batch(&self) {
        self.stream.fire_after_queued();
        if let Err(e) = self.stream.stream.synchronize() {
            let _ = self.stream.stream.synchronize();
            self.fail(format!("device-to-host copy failed: {e}"));
        }
    }

    /// A mark behind the copies queued so far on the session's stream
    /// (None when the driver refused one: [`CudaMemory::wait_mark`] then
    /// waits for the whole stream).
    pub fn mark(&self) -> Option<LocalEvent> {
        self.stream.stream.mark().map_err(|e| warn!("cannot mark the device copies (waiting for the whole stream instead): {e}")).ok()
    }

    /// Every batch of the save is queued: records the trainer's done event
    /// behind them (once per save; see the module).
    pub fn all_queued(&self) {
        self.stream.fire_after_queued();
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
        let dst = self.imported.ptr() + offset_bytes;
        let s = &self.stream.stream;
        // SAFETY: `bytes` is borrowed until after the synchronize; the range
        // lies in the allocation (bounds checked by Region::write_at).
        unsafe { s.copy_htod_async(dst, bytes.as_ptr(), bytes.len()) }.and_then(|()| s.synchronize()).map_err(RegionError::from)
    }

    pub fn device(&self) -> i32 {
        self.imported.device()
    }
}

/// A session's CUDA state: its own stream per device, and the trainer's
/// interprocess events it opened (kept while the session lives).
#[derive(Default)]
pub struct CudaSession {
    streams: HashMap<i32, Arc<SessionStream>>,
    events: HashMap<(i32, Vec<u8>), Arc<OpenedEvent>>,
}

impl CudaSession {
    /// The session's stream on `device`, created at first use; the first
    /// one in the daemon also page-locks staging.
    pub fn stream(&mut self, device: i32, staging: &Staging) -> Result<Arc<SessionStream>, RegionError> {
        if let Some(s) = self.streams.get(&device) {
            return Ok(s.clone());
        }
        let s = Arc::new(SessionStream { stream: Stream::new(device)?, after_queued: Mutex::new(None) });
        pin_staging(staging, device);
        self.streams.insert(device, s.clone());
        Ok(s)
    }

    /// Makes the session's stream on `device` wait on the trainer's event
    /// (its IPC handle), as recorded now: call after the Save arrived.
    pub fn fence(&mut self, device: i32, event: &[u8]) -> Result<(), RegionError> {
        let stream = self.stream_of(device)?;
        let event = self.event(device, event)?;
        stream.stream.wait_event(&event)?;
        Ok(())
    }

    /// For the save about to run: once its copies are queued on `device`'s
    /// stream, record the trainer's `done_event` behind them and call
    /// `notify`. Cleared by [`CudaSession::end_save`] if the save never got
    /// that far.
    pub fn after_queued(&mut self, device: i32, done_event: &[u8], notify: Box<dyn FnOnce() + Send>) -> Result<(), RegionError> {
        let stream = self.stream_of(device)?;
        let event = self.event(device, done_event)?;
        *stream.after_queued.lock().unwrap_or_else(|p| p.into_inner()) = Some(AfterQueued { event, notify });
        Ok(())
    }

    /// The save is over: drops a done event it did not record (refused
    /// before its copy).
    pub fn end_save(&mut self, device: i32) {
        if let Some(s) = self.streams.get(&device) {
            s.after_queued.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
    }

    fn stream_of(&self, device: i32) -> Result<Arc<SessionStream>, RegionError> {
        self.streams
            .get(&device)
            .cloned()
            .ok_or_else(|| RegionError::Cuda(ckpt_cuda::CudaError::Invalid(format!("no CUDA region is registered on device {device}"))))
    }

    /// The trainer's event `handle`, opened once per session.
    fn event(&mut self, device: i32, handle: &[u8]) -> Result<Arc<OpenedEvent>, RegionError> {
        let key = (device, handle.to_vec());
        if let Some(e) = self.events.get(&key) {
            return Ok(e.clone());
        }
        if self.events.len() >= config::CUDA_EVENTS_PER_SESSION_MAX {
            self.events.clear();
        }
        let e = Arc::new(OpenedEvent::open(handle, device)?);
        self.events.insert(key, e.clone());
        Ok(e)
    }
}

/// Page-locks the whole staging buffer once for the daemon's life (the
/// device's copies then run at full DMA speed). A refusal only costs speed.
fn pin_staging(staging: &Staging, device: i32) {
    static PINNED: OnceLock<Option<HostRegistration>> = OnceLock::new();
    PINNED.get_or_init(|| {
        let buf = staging.buf();
        // SAFETY: the staging buffer is allocated once and lives as long as
        // the daemon (Shared holds it), so longer than this registration,
        // which is never dropped.
        match unsafe { HostRegistration::new(buf.as_ptr().cast_mut(), buf.len(), device) } {
            Ok(r) => {
                info!(bytes = buf.len(), "staging page-locked for CUDA copies");
                Some(r)
            }
            Err(e) => {
                warn!("staging could not be page-locked for CUDA copies (they run slower): {e}");
                None
            }
        }
    });
}
