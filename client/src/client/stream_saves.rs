//! Saves fenced on the trainer's CUDA stream: an interprocess event
//! recorded on the stream goes with the save, so the sidecar's own stream
//! waits for the trainer's work before copying device to host, and the CPU
//! never waits; and the stream wait for that copy's end, on a word of this
//! process's memory ([`crate::done_word`]).
//!
//! Invariants: one save's device tensors lie on one device; a stream that
//! waits for a copy waits on the client's own word, raised by the reply
//! thread (Released, the save over, or the connection lost) or by the
//! watchdog once its deadline passed ([`super::stream_watch`]), never on
//! anything only the sidecar could complete; a guarded step never runs
//! unguarded: where the driver cannot queue the stream wait (a refusal,
//! stream memory operations unsupported, the stream capturing a CUDA graph)
//! the CPU waits for Released instead; and no save is fenced by an event
//! recorded on a capturing stream (it would never be recorded: refused).

use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::Duration;

use ckpt_wire::{Blob, Request, TensorDesc};

use super::reply_thread::is_final;
use super::tensor_list::describe;
use super::types::{BlobRef, SaveHandle, TensorRef, Wanted};
use super::{Client, Inner};
use crate::done_word::DoneWord;
use crate::error::{Error, Result};

impl Client {
    /// As [`Client::save`], for tensors some of which are CUDA device memory
    /// written by work queued on `stream` (a CUstream / cudaStream_t; 0: the
    /// legacy default stream): an interprocess event is recorded on
    /// `stream` and sent with the save, and the sidecar's own stream waits
    /// on it before copying. The CPU never waits. With no CUDA tensor this is
    /// a plain save.
    pub fn save_on_stream(
        &self,
        step: u64,
        tensors: &[TensorRef],
        blobs: &[BlobRef],
        stream: u64,
    ) -> Result<SaveHandle> {
        self.save_on_stream_unchanged(step, tensors, blobs, stream, None)
    }

    /// [`Client::save_on_stream`] with tensors proven unchanged, as
    /// [`Client::save_unchanged`]: on a GPU the sidecar then skips their
    /// device-to-host copy.
    pub fn save_on_stream_unchanged(
        &self,
        step: u64,
        tensors: &[TensorRef],
        blobs: &[BlobRef],
        stream: u64,
        unchanged: Option<&ckpt_wire::Unchanged>,
    ) -> Result<SaveHandle> {
        if let Some(u) = unchanged {
            u.check(tensors.len()).map_err(Error::InvalidArgument)?;
        }
        let unchanged = unchanged.filter(|u| u.count() > 0).cloned();
        let mut inner = self.lock_inner();
        self.refresh_cuda_locked(&mut inner, tensors)?;
        let descs = describe(&inner, tensors)?;
        let blobs: Vec<Blob> =
            blobs.iter().map(|b| Blob { name: b.name.to_string(), bytes: b.bytes.to_vec() }).collect();
        let lazy_release = inner.lazy_release;
        let devices = devices_of(&inner, &descs);
        let (rank, world_size) = inner.rank;
        if devices.is_empty() && unchanged.is_some() {
            // No device tensor: a plain save, its tensor list kept for the next.
            drop(inner);
            let blobs: Vec<BlobRef> = blobs.iter().map(|b| BlobRef { name: &b.name, bytes: &b.bytes }).collect();
            return self.save_unchanged(step, tensors, &blobs, unchanged.as_ref());
        }
        let device = match devices[..] {
            [] if world_size == 1 => {
                return self.submit(&mut inner, step, None, |id| Request::Save {
                    id,
                    step,
                    tensors: descs,
                    blobs,
                    lazy_release,
                    unchanged,
                });
            }
            [] => {
                return self.submit(&mut inner, step, None, |id| Request::SavePart {
                    id,
                    step,
                    rank,
                    world_size,
                    tensors: descs,
                    blobs,
                    lazy_release,
                    unchanged,
                });
            }
            [d] => d,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "the CUDA tensors of one save lie on {} devices ({devices:?}); \
                     save each device's tensors from its own client",
                    devices.len()
                )))
            }
        };
        let event = inner.record_event(device, stream)?;
        let h = self.submit(&mut inner, step, None, |id| Request::SaveAfterEvent {
            id,
            step,
            tensors: descs,
            blobs,
            lazy_release,
            device,
            event,
            rank,
            world_size,
            unchanged,
        })?;
        self.await_device_copy(&mut inner, h.id, device);
        Ok(h)
    }

    /// Gives device save `save_id` the copy-done word's next value, so a
    /// stream can wait for its copy; the word is made at the first device
    /// save (a refusal only makes waits the CPU's).
    fn await_device_copy(&self, inner: &mut Inner, save_id: u64, device: i32) {
        inner.done_seq = inner.done_seq.wrapping_add(1);
        let value = inner.done_seq;
        let mut st = self.lock_state();
        if st.done_word.is_none() {
            st.done_word = DoneWord::new(device).map(Arc::new).ok();
        }
        st.done_sent = value;
        match st.saves.get_mut(&save_id) {
            Some(e) if !is_final(e.status.state) && !e.status.released => {
                e.cuda_device = Some((device, value));
                e.event_pending = true;
            }
            // Over already (a reply came first): nothing will wait on it.
            _ => {
                if let Some(w) = &st.done_word {
                    w.release(value);
                }
            }
        }
    }

    /// Makes the trainer's `stream` (a CUstream; 0: the legacy default
    /// stream) wait until the sidecar's device-to-host copy of save
    /// `save_id` is over, without the CPU waiting: the lazy wait before an
    /// optimizer step. The stream waits on a word of this process's memory
    /// that the client itself sets when the copy is over (Released), the
    /// save ended, or the sidecar is gone ([`crate::done_word`]): never on
    /// anything only the sidecar could complete, so a sidecar that dies
    /// mid-copy cannot freeze the stream. Returns true when such a stream
    /// wait was queued, false when none was needed (the save is released,
    /// failed, or has no device tensors: a host save's release is waited
    /// for on the CPU, as [`Client::wait`] does, and so is a device save's
    /// where the driver refused the word, refused the stream wait, or
    /// `stream` is capturing a CUDA graph: never no wait at all). A stream
    /// wait still waiting past the client's deadline
    /// ([`Client::set_stream_wait_deadline`]) fails the save and goes on.
    pub fn stream_wait_copy(&self, save_id: u64, stream: u64, timeout: Option<Duration>) -> Result<bool> {
        self.check_owner()?;
        let (device, value, word) = {
            let st = self.lock_state();
            let e = st.saves.get(&save_id).ok_or(Error::UnknownSave { save_id })?;
            if e.status.released || is_final(e.status.state) {
                return Ok(false);
            }
            match (e.cuda_device, &st.done_word) {
                (Some((device, value)), Some(w)) => (device, value, w.clone()),
                _ => {
                    drop(st);
                    self.wait(save_id, Wanted::Released, timeout)?;
                    return Ok(false);
                }
            }
        };
        // Raised already if the copy ended meanwhile: the wait then passes at once.
        let why_cpu = match ckpt_cuda::is_capturing(stream, device) {
            Ok(false) => match word.wait_on(stream, device, value) {
                Ok(()) => {
                    let mut st = self.lock_state();
                    super::stream_watch::arm(&self.shared, &mut st, save_id);
                    return Ok(true);
                }
                Err(e) => format!("the driver refused the stream wait ({e})"),
            },
            Ok(true) => "the stream is capturing a CUDA graph (a captured wait would replay with a stale value)".into(),
            Err(e) => format!("the driver cannot say whether the stream captures a CUDA graph ({e})"),
        };
        self.say_cpu_wait(&why_cpu);
        self.wait(save_id, Wanted::Released, timeout)?;
        Ok(false)
    }

    /// How long a trainer's stream may wait on a save's copy
    /// ([`Client::stream_wait_copy`]) before the sidecar counts as stuck:
    /// the save then fails saying so, the connection is dropped and the
    /// stream goes on. None: for ever (a stopped sidecar then holds the
    /// stream). Default: [`super::STREAM_WAIT_DEADLINE_ENV`] in milliseconds
    /// (0: none), else [`super::STREAM_WAIT_DEADLINE_DEFAULT`]. Applies to
    /// stream waits queued later.
    pub fn set_stream_wait_deadline(&self, deadline: Option<Duration>) {
        self.lock_state().stream_wait_deadline = deadline;
    }

    /// Says on stderr, once per client, that guarded steps wait on the CPU.
    fn say_cpu_wait(&self, why: &str) {
        let mut st = self.lock_state();
        if !std::mem::replace(&mut st.cpu_wait_said, true) {
            eprintln!(
                "libckpt: the trainer's CUDA stream cannot wait on the sidecar's copy: {why}; \
                 guarded steps wait for Released on the CPU instead"
            );
        }
    }
}

impl Inner {
    /// Records this client's interprocess event of `device` (made at its
    /// first use) on `stream`, and returns its handle for the sidecar.
    /// Refused when `stream` is capturing a CUDA graph: the record would
    /// only join the graph, never happen, and the sidecar's poll of the
    /// event would say done before the trainer's work ran.
    pub(super) fn record_event(&mut self, device: i32, stream: u64) -> Result<Vec<u8>> {
        if ckpt_cuda::is_capturing(stream, device)? {
            return Err(Error::InvalidArgument(format!(
                "the save's CUDA stream {stream:#x} is capturing a CUDA graph: an event recorded there only joins the \
                 graph, so the sidecar could copy before the trainer's work ran; save outside the capture"
            )));
        }
        let event = match self.cuda_events.entry(device) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(ckpt_cuda::IpcEvent::new(device)?),
        };
        event.record(stream)?;
        Ok(event.handle().to_vec())
    }
}

/// The devices of the CUDA regions `descs` lie in, sorted, each once.
fn devices_of(inner: &Inner, descs: &[TensorDesc]) -> Vec<i32> {
    let mut devices: Vec<i32> =
        descs.iter().filter_map(|d| inner.cuda_regions.get(&d.region_id)).map(|r| r.device).collect();
    devices.sort_unstable();
    devices.dedup();
    devices
}
