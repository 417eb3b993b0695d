//! Saves and file writes: the request sent (under a fresh
//! id filed in the save table first), then poll and wait on what the reply
//! thread files for it, and the wait for replication to the drain target.
//!
//! Invariant: a save is in the table before its request can be answered,
//! and leaves it again only if the request was never sent; its tensors
//! must not change until it is released (the caller's side of the bargain).

use std::time::{Duration, Instant};

use ckpt_wire::{FileFinish, FilePiece, Reply, Request};

use super::reply_thread::{is_final, SaveEntry};
use super::requests::unexpected;
use super::tensor_list::{describe, locate, KeptList};
use super::transport::send_encoded;
use super::types::{BlobRef, SaveHandle, SaveState, SaveStatus, TensorRef, Wanted};
use super::{Client, Inner};
use crate::error::{Error, Result};

impl Client {
    /// Asks for checkpoint `step` of these tensors and blobs. Returns at once;
    /// [`Client::wait`] or [`Client::poll`] tell when it is released / durable.
    /// The tensors must not change until it is released.
    pub fn save(&self, step: u64, tensors: &[TensorRef], blobs: &[BlobRef]) -> Result<SaveHandle> {
        self.save_unchanged(step, tensors, blobs, None)
    }

    /// [`Client::save`] with tensors the trainer proves unchanged since its
    /// own save of `unchanged.since_step` ([`ckpt_wire::Unchanged`]:
    /// bit `i` flags `tensors[i]`). The sidecar may take their bytes from
    /// that step instead of the regions, when it holds it as this
    /// connection saved it; else it copies them. A flag on a changed tensor
    /// makes the checkpoint hold its old bytes: flag only what is proven.
    pub fn save_unchanged(
        &self,
        step: u64,
        tensors: &[TensorRef],
        blobs: &[BlobRef],
        unchanged: Option<&ckpt_wire::Unchanged>,
    ) -> Result<SaveHandle> {
        if let Some(u) = unchanged {
            u.check(tensors.len()).map_err(Error::InvalidArgument)?;
        }
        let mut inner = self.lock_inner();
        self.refresh_cuda_locked(&mut inner, tensors)?;
        // The same tensors as a recent save, with the same regions: its
        // list again. Else encoded afresh, and kept for the next saves.
        let mut lists = std::mem::take(&mut inner.kept_lists);
        let found = lists.take(&inner, tensors);
        inner.kept_lists = lists;
        let kept = match found {
            Some(k) => k,
            None => KeptList::encode(&inner, tensors)?,
        };
        let blobs: Vec<ckpt_wire::BlobRef> =
            blobs.iter().map(|b| ckpt_wire::BlobRef { name: b.name, bytes: b.bytes }).collect();
        let lazy_release = inner.lazy_release;
        let part = match inner.rank {
            (_, 1) => None,
            (rank, world_size) => Some(ckpt_wire::RankOf { rank, world_size }),
        };
        let unchanged = unchanged
            .filter(|u| u.count() > 0)
            .map(|u| ckpt_wire::UnchangedRef { since_step: u.since_step, bits: &u.bits });
        let sent = self.submit_encoded(&mut inner, step, None, |id| {
            ckpt_wire::encode_save_with(id, step, part, &kept.encoded, &blobs, lazy_release, unchanged)
        });
        inner.kept_lists.keep(kept);
        sent
    }

    /// Asks the sidecar to write `len_bytes` at `ptr` (inside one of this
    /// client's regions) as the whole content of the file `path` (absolute,
    /// in an existing directory), atomically: temp file, sync, rename. Like
    /// a save: returns at once; the bytes must not change until released
    /// (wait with [`Wanted::Released`]); durable once renamed and synced.
    pub fn save_file(&self, path: &str, ptr: *const u8, len_bytes: u64) -> Result<SaveHandle> {
        let mut inner = self.lock_inner();
        let t = TensorRef { name: path, dtype: "U8", shape: &[], ptr, len_bytes };
        let d = describe(&inner, &[t])?.pop().expect("one descriptor for one ref");
        let path = path.to_string();
        self.submit(&mut inner, 0, Some(path.clone()), |id| Request::SaveFile {
            id,
            path,
            region_id: d.region_id,
            offset_bytes: d.offset_bytes,
            len_bytes: d.len_bytes,
        })
    }

    /// Has the sidecar write `pieces` (address, length), laid end to end, as
    /// the whole file `path`: each lies in one of this client's shm regions
    /// or registered CUDA memory ([`Client::register_cuda`]; a piece across
    /// VMM chunks: [`Client::register_cuda_range`]). With CUDA
    /// pieces, an interprocess event is recorded on `stream` (a CUstream of
    /// this process; 0: the legacy default stream) and sent with the request:
    /// the sidecar's stream waits on it before copying, the CPU never waits.
    /// `finish` says what the sidecar completes before writing
    /// ([`FileFinish::TorchZip`]: a torch.save skip_data archive's CRC-32s).
    /// Replies as [`Client::save_file`].
    pub fn save_file_pieces(
        &self,
        path: &str,
        pieces: &[(*const u8, u64)],
        stream: u64,
        finish: FileFinish,
    ) -> Result<SaveHandle> {
        let mut inner = self.lock_inner();
        let (out, devices) = locate_pieces(&inner, path, pieces)?;
        let (device, event) = match devices[..] {
            [] => (0, Vec::new()),
            [d] => (d, inner.record_event(d, stream)?),
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "the CUDA pieces of file {path} lie on {} devices ({devices:?}); \
                     one file's device pieces must share one device",
                    devices.len()
                )))
            }
        };
        let path = path.to_string();
        let with_event = !event.is_empty();
        let h = self.submit(&mut inner, 0, Some(path.clone()), |id| Request::SaveFilePieces {
            id,
            path,
            pieces: out,
            device,
            event,
            finish,
        })?;
        if with_event {
            if let Some(e) =
                self.lock_state().saves.get_mut(&h.id).filter(|e| !is_final(e.status.state) && !e.status.released)
            {
                e.event_pending = true;
            }
        }
        Ok(h)
    }

    /// Files a save under a fresh id and sends the request `make` builds.
    pub(super) fn submit(
        &self,
        inner: &mut Inner,
        step: u64,
        file: Option<String>,
        make: impl FnOnce(u64) -> Request,
    ) -> Result<SaveHandle> {
        self.submit_encoded(inner, step, file, |id| ckpt_wire::encode(&make(id)))
    }

    /// [`Client::submit`] of a request already encoded as a frame by `make`.
    fn submit_encoded(
        &self,
        inner: &mut Inner,
        step: u64,
        file: Option<String>,
        make: impl FnOnce(u64) -> Vec<u8>,
    ) -> Result<SaveHandle> {
        let conn = self.ensure_connected(inner)?;
        let id = {
            let mut st = self.lock_state();
            let id = st.next_id;
            st.next_id += 1;
            let status = SaveStatus {
                step,
                file,
                state: SaveState::Pending,
                released: false,
                copy_seconds: None,
                waited_seconds: None,
                path: None,
                persist_seconds: None,
                error: None,
                replicated_to: None,
            };
            st.saves.insert(id, SaveEntry { status, code: None, cuda_device: None, event_pending: false });
            id
        };
        if let Err(e) = send_encoded(&conn.stream, &make(id)) {
            let mut st = self.lock_state();
            st.saves.remove(&id);
            return Err(e);
        }
        Ok(SaveHandle { id, step })
    }

    /// The state of a save, without blocking.
    pub fn poll(&self, save_id: u64) -> Result<SaveStatus> {
        self.check_owner()?;
        let st = self.lock_state();
        st.saves.get(&save_id).map(|e| e.status.clone()).ok_or(Error::UnknownSave { save_id })
    }

    /// Blocks until the save is released or durable (as `wanted` says), it
    /// fails, or `timeout` passes (None: no limit). A failed save is an error
    /// naming why; waiting for Released on a save that was released and then
    /// lost its connection succeeds (the tensors may change).
    pub fn wait(&self, save_id: u64, wanted: Wanted, timeout: Option<Duration>) -> Result<SaveStatus> {
        self.check_owner()?;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = self.lock_state();
        loop {
            let e = st.saves.get(&save_id).ok_or(Error::UnknownSave { save_id })?;
            let s = &e.status;
            let done = match (wanted, s.state) {
                (_, SaveState::Durable) => true,
                (Wanted::Released, SaveState::Released) => true,
                (Wanted::Released, SaveState::Failed) if s.released => true,
                (_, SaveState::Failed) => {
                    let reason = s.error.clone().unwrap_or_default();
                    return Err(match e.code {
                        Some(code) => Error::SaveFailed { what: s.what(), code, reason },
                        None => Error::Disconnected { reason },
                    });
                }
                _ => false,
            };
            if done {
                return Ok(s.clone());
            }
            let what = s.what();
            st = self.wait_changed(st, deadline).map_err(|()| Error::Timeout {
                what: format!(
                    "save of {what} to be {}",
                    if wanted == Wanted::Released { "released" } else { "durable" }
                ),
                timeout_ms: timeout.map(|t| t.as_millis() as u64).unwrap_or(0),
            })?;
        }
    }

    /// Blocks until checkpoint save `save_id` is **Replicated**: durable,
    /// then committed on the sidecar's drain target (`--drain URL`, its
    /// remote index written), or `timeout` passes (None: no limit;
    /// [`Error::Timeout`], the replication goes on). A sidecar without a
    /// drain target, or a step its drain skipped (a newer one was drained
    /// instead, `--drain-every`), answers at once with
    /// [`Error::Remote`] (NotFound) saying why: never a hang.
    pub fn wait_replicated(&self, save_id: u64, timeout: Option<Duration>) -> Result<SaveStatus> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let s = self.wait(save_id, Wanted::Durable, timeout)?;
        if let Some(f) = &s.file {
            return Err(Error::InvalidArgument(format!(
                "save {save_id} wrote the file {f}; only checkpoints are replicated"
            )));
        }
        if s.replicated_to.is_some() {
            return Ok(s);
        }
        let step = s.step;
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        self.check_owner()?;
        let mut inner = self.lock_inner();
        let conn = self.ensure_connected(&mut inner)?;
        let gen = conn.gen;
        let id = self.send_request(conn, |id| Request::WaitReplicated { id, step })?;
        drop(inner);
        match self.await_reply(id, gen, &format!("step {step} to be replicated"), left)? {
            Reply::Replicated { url, .. } => {
                let mut st = self.lock_state();
                let mut s = s;
                s.replicated_to = Some(url.clone());
                if let Some(e) = st.saves.get_mut(&save_id) {
                    e.status.replicated_to = Some(url);
                }
                Ok(s)
            }
            other => Err(unexpected("WaitReplicated", other)),
        }
    }

    /// Blocks until this node's files of checkpoint save `save_id` are
    /// **held by peers**: durable, then checked and held in the memory of
    /// `--peer-replicas` other nodes' sidecars (`--peers`); returns their
    /// node ids (empty when this node holds no file of the step). Or
    /// `timeout` passes (None: no limit; [`Error::Timeout`], the
    /// replication goes on). A sidecar without peers answers at once with
    /// [`Error::Remote`] (NotFound); a failed replication with
    /// [`Error::Remote`] (Io) saying which peer and why: never a hang.
    pub fn wait_peers(&self, save_id: u64, timeout: Option<Duration>) -> Result<Vec<String>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let s = self.wait(save_id, Wanted::Durable, timeout)?;
        if let Some(f) = &s.file {
            return Err(Error::InvalidArgument(format!(
                "save {save_id} wrote the file {f}; only checkpoints are held by peers"
            )));
        }
        let step = s.step;
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        self.check_owner()?;
        let mut inner = self.lock_inner();
        let conn = self.ensure_connected(&mut inner)?;
        let gen = conn.gen;
        let id = self.send_request(conn, |id| Request::WaitPeers { id, step })?;
        drop(inner);
        match self.await_reply(id, gen, &format!("step {step} to be held by peers"), left)? {
            Reply::HeldByPeers { peers, .. } => Ok(peers),
            other => Err(unexpected("WaitPeers", other)),
        }
    }
}

/// Each piece of a file in the region it lies in, and the devices of those
/// in CUDA memory (in order of first appearance; empty pieces count for none).
fn locate_pieces(inner: &Inner, path: &str, pieces: &[(*const u8, u64)]) -> Result<(Vec<FilePiece>, Vec<i32>)> {
    let mut out = Vec::with_capacity(pieces.len());
    let mut devices: Vec<i32> = Vec::new();
    for (i, &(ptr, len_bytes)) in pieces.iter().enumerate() {
        let name = format!("{path} piece {i}");
        let (region_id, offset_bytes) =
            locate(inner, &TensorRef { name: &name, dtype: "U8", shape: &[], ptr, len_bytes })?;
        if len_bytes > 0 {
            if let Some(r) = inner.cuda_regions.get(&region_id) {
                if !devices.contains(&r.device) {
                    devices.push(r.device);
                }
            }
        }
        out.push(FilePiece { region_id, offset_bytes, len_bytes });
    }
    Ok((out, devices))
}
