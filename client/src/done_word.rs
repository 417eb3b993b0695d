//! The word a trainer's CUDA stream waits on for the sidecar's copy of a
//! save ([`crate::Client::stream_wait_copy`]), set only by this process.
//!
//! A stream of the trainer must never wait on anything only another process
//! can complete: the driver leaves an event undefined once the process that
//! last recorded it is gone, and a wait on it may never end, so a sidecar
//! killed mid-copy would freeze training. Instead each device save gets the
//! next value of a per-client sequence; the stream waits
//! (`cuStreamWaitValue32`, GEQ) until a word of page-locked host memory
//! reaches it, and the client's reader thread raises the word when the
//! save's copy is over: at Released, at the save's end (Durable, Failed),
//! and, for every save sent, when the connection to the sidecar is lost.
//! The page is registered for the process's life (never unregistered: a
//! stream may still read it when the client goes).

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU32, Ordering};

use ckpt_cuda::HostWord;

/// The page-locked word and its registration (see the module).
pub struct DoneWord {
    word: &'static AtomicU32,
    /// Never dropped: the registration stays (see the module).
    host: ManuallyDrop<HostWord>,
}

impl DoneWord {
    /// A fresh word (0) on a page of its own, registered for the streams
    /// of device `device` (and, the registration being portable, every
    /// other device's).
    pub fn new(device: i32) -> ckpt_cuda::Result<DoneWord> {
        // SAFETY: an anonymous private page, never unmapped (leaked for the
        // process's life: see the module); checked below.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if page == libc::MAP_FAILED {
            return Err(ckpt_cuda::CudaError::Invalid(format!(
                "mapping a page for the copy-done word: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: the page is mapped for the process's life and its first 4
        // bytes are only used as this AtomicU32 (aligned: a page start).
        let word: &'static AtomicU32 = unsafe { &*(page as *const AtomicU32) };
        // SAFETY: as above; the registration, if it fails, leaves the page
        // merely leaked.
        let host = unsafe { HostWord::new(page.cast(), 4096, device)? };
        Ok(DoneWord { word, host: ManuallyDrop::new(host) })
    }

    /// Queues on `stream` (device `device`) a wait until the word reaches `value`.
    pub fn wait_on(&self, stream: u64, device: i32, value: u32) -> ckpt_cuda::Result<()> {
        self.host.wait_geq(stream, device, value)
    }

    /// Raises the word to `value` unless it is already there or past it
    /// (compared as the stream does: `(i32)(word - value) >= 0`).
    pub fn release(&self, value: u32) {
        let mut now = self.word.load(Ordering::Acquire);
        while (value.wrapping_sub(now) as i32) > 0 {
            match self.word.compare_exchange_weak(now, value, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(seen) => now = seen,
            }
        }
    }
}
