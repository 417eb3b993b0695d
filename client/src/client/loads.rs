//! Loads: tensors of a checkpoint into the places the caller names, or all
//! of them packed into one range of a host region (read straight from disk
//! into it).

use ckpt_wire::{Reply, Request};

use super::requests::unexpected;
use super::tensor_list::describe;
use super::types::{LoadInfo, TensorRef};
use super::Client;
use crate::error::{Error, Result};

impl Client {
    /// Loads the named tensors of `step` (None: latest) into the places the
    /// refs point at (inside this client's regions). With no refs, only
    /// tells what the checkpoint holds.
    pub fn load(&self, step: Option<u64>, tensors: &[TensorRef]) -> Result<LoadInfo> {
        let mut inner = self.lock_inner();
        self.refresh_cuda_locked(&mut inner, tensors)?;
        let descs = describe(&inner, tensors)?;
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(&mut inner)?;
        let gen = conn.gen;
        let id = self.send_request(conn, |id| Request::Load { id, step, tensors: descs })?;
        drop(inner);
        match self.await_reply(id, gen, "the sidecar to load", timeout)? {
            Reply::Loaded { step, source, tensors, blobs, fell_back, .. } => {
                Ok(LoadInfo { step, source, tensors, blobs, fell_back, offsets: Vec::new(), need_bytes: 0 })
            }
            other => Err(unexpected("Load", other)),
        }
    }

    /// Loads every tensor of `step` (None: latest) into the `len_bytes` at
    /// `ptr` (inside one of this client's host regions, block-aligned), laid
    /// out as the sidecar chooses (`LoadInfo::offsets`): from disk it reads
    /// straight into that memory, verified. When the checkpoint needs more
    /// than `len_bytes` (`LoadInfo::need_bytes`) nothing is written and
    /// `tensors` only says what it holds: call again with more.
    pub fn load_packed(&self, step: Option<u64>, ptr: *const u8, len_bytes: u64) -> Result<LoadInfo> {
        let mut inner = self.lock_inner();
        let (region_id, offset_bytes) = inner
            .regions
            .values()
            .find_map(|r| r.offset_of(ptr as usize, len_bytes).map(|off| (r.region_id(), off)))
            .ok_or_else(|| Error::OutsideRegion { name: "(load range)".into(), ptr: ptr as usize, len_bytes })?;
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(&mut inner)?;
        let gen = conn.gen;
        let id = self.send_request(conn, |id| Request::LoadPacked { id, step, region_id, offset_bytes, len_bytes })?;
        drop(inner);
        match self.await_reply(id, gen, "the sidecar to load", timeout)? {
            Reply::Placed { step, source, tensors, offsets, need_bytes, blobs, fell_back, .. } => {
                Ok(LoadInfo { step, source, tensors, blobs, fell_back, offsets, need_bytes })
            }
            other => Err(unexpected("LoadPacked", other)),
        }
    }
}
