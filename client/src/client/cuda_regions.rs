//! CUDA device memory as regions: allocations found by pointer, exported
//! once (legacy IPC handle, a VMM allocation's fd passed over the socket, or
//! a FABRIC handle), spans of VMM chunks mapped back to back, and the check
//! before each save or load that a registration still names the memory at
//! its address.
//!
//! Invariant: a registration never outlives the memory it was made for. An
//! allocation is known by its buffer id; when the driver says another one
//! now lies at a registered address, or a registered one is gone, the old
//! region is unregistered (the sidecar closes its import: a VMM import keeps
//! a freed chunk's memory alive) before a new one is registered.

use std::collections::BTreeMap;
use std::os::unix::io::AsRawFd;
use std::time::Duration;

use ckpt_wire::{Reply, Request};

use super::connection::Conn;
use super::requests::unexpected;
use super::types::{CudaKind, CudaRegion, TensorRef};
use super::{Client, Inner};
use crate::error::{Error, Result};

impl Client {
    /// Registers the CUDA allocation holding device address `ptr` (found
    /// with cuMemGetAddressRange) as a region, exported once: by its legacy
    /// IPC handle, or, for a VMM allocation, as a file descriptor passed over
    /// the socket (SCM_RIGHTS); an allocation already registered returns its
    /// region. A registration made for memory since freed (another
    /// allocation now at the address: its buffer id differs), and any other
    /// whose memory is gone, is unregistered first when a new allocation is
    /// registered, so the sidecar closes its import.
    /// Fails with [`Error::Cuda`] when there is no CUDA driver or `ptr` is
    /// not device memory.
    pub fn register_cuda(&self, ptr: u64) -> Result<CudaRegion> {
        self.register_cuda_range(ptr, 1)
    }

    /// As [`Client::register_cuda`] for the `len_bytes` at `ptr`, which may
    /// cross from one allocation into the next ones mapped right after it
    /// (VMM chunks in one reserved range: PyTorch's expandable segments):
    /// each allocation is registered once, and the run of them as one span
    /// region holding the whole range. A range that runs into unmapped
    /// memory is refused, saying where.
    pub fn register_cuda_range(&self, ptr: u64, len_bytes: u64) -> Result<CudaRegion> {
        self.check_owner()?;
        let mut inner = self.lock_inner();
        if inner.closed {
            return Err(Error::Closed);
        }
        self.register_range_locked(&mut inner, ptr, len_bytes.max(1))
    }

    fn register_range_locked(&self, inner: &mut Inner, ptr: u64, len_bytes: u64) -> Result<CudaRegion> {
        let allocs = ckpt_cuda::allocations_covering(ptr, len_bytes)?;
        let mut pieces = Vec::with_capacity(allocs.len());
        let mut vmm = true;
        for a in &allocs {
            let r = self.register_allocation_locked(inner, a)?;
            vmm &= r.is_vmm();
            pieces.push(r.region_id);
        }
        if let [one] = pieces[..] {
            return Ok(inner.cuda_regions[&one].clone());
        }
        if let Some(r) = inner.cuda_regions.values().find(|r| r.pieces() == pieces) {
            return Ok(r.clone());
        }
        let region_id = inner.fresh_region_id()?;
        let len_bytes = allocs.iter().map(|a| a.len_bytes).sum();
        let r = CudaRegion {
            region_id,
            base: allocs[0].base,
            len_bytes,
            device: allocs[0].device,
            buffer_id: 0,
            kind: CudaKind::Span { pieces, vmm },
        };
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(inner)?;
        self.register_cuda_on(conn, &r, timeout, None)?;
        inner.cuda_regions.insert(region_id, r.clone());
        Ok(r)
    }

    /// The region of allocation `a`: the one registered for it, else a new
    /// one, after unregistering every registration whose memory is gone:
    /// one `a` replaced, and any other freed since (one driver call each,
    /// only when a new allocation is registered), so the sidecar closes
    /// their imports (a VMM import keeps the freed chunk's memory alive)
    /// now rather than when this client leaves.
    fn register_allocation_locked(&self, inner: &mut Inner, a: &ckpt_cuda::Allocation) -> Result<CudaRegion> {
        if let Some(r) = inner.cuda_regions.values().find(|r| {
            r.pieces().is_empty() && r.base == a.base && r.len_bytes == a.len_bytes && r.buffer_id == a.buffer_id
        }) {
            return Ok(r.clone());
        }
        // Two live allocations never overlap: one registered over `a` was
        // freed since (the address was reused).
        let all = &inner.cuda_regions;
        let stale: Vec<u32> = all
            .values()
            .filter(|r| r.pieces().is_empty() && (r.overlaps(a) || !still_there(all, r)))
            .map(|r| r.region_id)
            .collect();
        self.drop_cuda_regions_locked(inner, &stale)?;
        let (kind, fd) = match ckpt_cuda::export(a)? {
            ckpt_cuda::Export::Legacy(h) => (CudaKind::Legacy(h), None),
            ckpt_cuda::Export::Vmm(fd) => (CudaKind::Vmm, Some(fd)),
            ckpt_cuda::Export::Fabric(h) => (CudaKind::Fabric(h), None),
        };
        let region_id = inner.fresh_region_id()?;
        let r = CudaRegion {
            region_id,
            base: a.base,
            len_bytes: a.len_bytes,
            device: a.device,
            buffer_id: a.buffer_id,
            kind,
        };
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(inner)?;
        self.register_cuda_on(conn, &r, timeout, fd)?;
        inner.cuda_regions.insert(region_id, r.clone());
        Ok(r)
    }

    /// Forgets the CUDA regions `ids` and the spans made of any of them,
    /// and has the sidecar close them (spans first).
    fn drop_cuda_regions_locked(&self, inner: &mut Inner, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut gone: Vec<u32> = inner
            .cuda_regions
            .values()
            .filter(|r| r.pieces().iter().any(|p| ids.contains(p)))
            .map(|r| r.region_id)
            .collect();
        gone.extend_from_slice(ids);
        for id in &gone {
            inner.cuda_regions.remove(id);
        }
        let timeout = inner.request_timeout;
        // Not connected: the sidecar closed them with the session.
        let Ok(conn) = self.ensure_connected(inner) else { return Ok(()) };
        for region_id in gone {
            match self.call_on(conn, timeout, "UnregisterRegion", |id| Request::UnregisterRegion { id, region_id })? {
                // An Error: the sidecar no longer had it (nothing to close).
                Reply::RegionUnregistered { .. } | Reply::Error { .. } => {}
                other => return Err(unexpected("UnregisterRegion", other)),
            }
        }
        Ok(())
    }

    /// Before a save or load: every CUDA region its device tensors lie in
    /// must still name the memory at its address (one driver call per
    /// allocation: its buffer id), and a tensor that crosses the end of a
    /// registered allocation is registered as a span. A region whose memory
    /// was freed (another allocation now at the address) is replaced:
    /// unregistered, the new allocation exported and registered.
    pub(super) fn refresh_cuda_locked(&self, inner: &mut Inner, tensors: &[TensorRef]) -> Result<()> {
        if inner.cuda_regions.is_empty() {
            return Ok(());
        }
        let mut checked: Vec<(u32, bool)> = Vec::new();
        let mut redo: Vec<(u64, u64)> = Vec::new();
        for t in tensors {
            let (ptr, len) = (t.ptr as u64, t.len_bytes);
            if len == 0 || inner.regions.values().any(|r| r.offset_of(ptr as usize, len).is_some()) {
                continue;
            }
            let fresh = match inner.cuda_regions.values().find(|r| r.offset_of(ptr, len).is_some()) {
                Some(r) => match checked.iter().find(|(id, _)| *id == r.region_id) {
                    Some(&(_, ok)) => ok,
                    None => {
                        let ok = still_there(&inner.cuda_regions, r);
                        checked.push((r.region_id, ok));
                        ok
                    }
                },
                // Starts in a registered allocation and runs past its end.
                None => !inner.cuda_regions.values().any(|r| r.offset_of(ptr, 0).is_some()),
            };
            if !fresh {
                redo.push((ptr, len));
            }
        }
        for (ptr, len) in redo {
            self.register_range_locked(inner, ptr, len)?;
        }
        Ok(())
    }

    /// Unregisters the CUDA region holding device address `ptr` (the
    /// sidecar closes its import); the memory itself stays the trainer's.
    pub fn unregister_cuda(&self, ptr: u64) -> Result<()> {
        let id = {
            let inner = self.lock_inner();
            inner
                .cuda_regions
                .values()
                .find(|r| r.pieces().is_empty() && r.offset_of(ptr, 0).is_some())
                .map(|r| r.region_id)
        };
        let Some(region_id) = id else { return Err(Error::UnknownRegion { ptr: ptr as usize }) };
        let mut inner = self.lock_inner();
        let pieces = inner.cuda_regions.get(&region_id).map(|r| r.pieces().to_vec()).unwrap_or_default();
        // A span goes with its pieces; a piece with the spans made of it.
        let ids = if pieces.is_empty() { vec![region_id] } else { pieces };
        self.drop_cuda_regions_locked(&mut inner, &ids)
    }

    /// CUDA regions currently registered.
    pub fn cuda_regions(&self) -> Vec<CudaRegion> {
        self.lock_inner().cuda_regions.values().cloned().collect()
    }

    /// Registers `r` on `conn`; a VMM region's fd is `fd` (exported by
    /// the caller) or exported again now (a reconnect), and closed once sent.
    pub(super) fn register_cuda_on(
        &self,
        conn: &Conn,
        r: &CudaRegion,
        timeout: Option<Duration>,
        fd: Option<std::os::fd::OwnedFd>,
    ) -> Result<()> {
        let (region_id, device, len_bytes) = (r.region_id, r.device, r.len_bytes);
        let reply = match &r.kind {
            CudaKind::Legacy(h) => {
                let ipc_handle = h.to_vec();
                let device_uuid = ckpt_cuda::uuid_of(device)?.to_vec();
                self.call_on(conn, timeout, "RegisterCudaRegion", |id| Request::RegisterCudaRegion {
                    id,
                    region_id,
                    device,
                    device_uuid,
                    ipc_handle,
                    len_bytes,
                })?
            }
            CudaKind::Vmm => {
                let fd = match fd {
                    Some(fd) => fd,
                    None => export_vmm_again(r)?,
                };
                let device_uuid = ckpt_cuda::uuid_of(device)?.to_vec();
                let id = self.send_request_with_fd(conn, fd.as_raw_fd(), |id| Request::RegisterCudaVmmRegion {
                    id,
                    region_id,
                    device,
                    device_uuid,
                    fabric_handle: Vec::new(),
                    len_bytes,
                })?;
                drop(fd);
                self.await_reply(id, conn.gen, "the sidecar to answer RegisterCudaVmmRegion", timeout)?
            }
            CudaKind::Fabric(h) => {
                let (device_uuid, fabric_handle) = (ckpt_cuda::uuid_of(device)?.to_vec(), h.to_vec());
                self.call_on(conn, timeout, "RegisterCudaVmmRegion", |id| Request::RegisterCudaVmmRegion {
                    id,
                    region_id,
                    device,
                    device_uuid,
                    fabric_handle,
                    len_bytes,
                })?
            }
            CudaKind::Span { pieces, .. } => {
                let pieces = pieces.clone();
                self.call_on(conn, timeout, "RegisterCudaSpan", |id| Request::RegisterCudaSpan {
                    id,
                    region_id,
                    pieces,
                })?
            }
        };
        match reply {
            Reply::RegionRegistered { region_id: got, .. } if got == region_id => Ok(()),
            other => Err(unexpected("RegisterCudaRegion", other)),
        }
    }
}

/// Whether CUDA region `r` (of `all`) still names the memory at its
/// address: the allocation there has the buffer id it was registered with
/// (each piece's, for a span); with no id from the driver, the same base
/// and length.
fn still_there(all: &BTreeMap<u32, CudaRegion>, r: &CudaRegion) -> bool {
    if !r.pieces().is_empty() {
        return r.pieces().iter().all(|p| all.get(p).is_some_and(|p| still_there(all, p)));
    }
    match r.buffer_id {
        0 => ckpt_cuda::allocation_of(r.base).is_ok_and(|a| a.base == r.base && a.len_bytes == r.len_bytes),
        id => ckpt_cuda::buffer_id(r.base).is_ok_and(|now| now == id),
    }
}

/// VMM region `r`'s allocation exported as an fd again (a reconnect: the
/// fd of its first registration was closed once sent).
fn export_vmm_again(r: &CudaRegion) -> Result<std::os::fd::OwnedFd> {
    let a = ckpt_cuda::Allocation { base: r.base, len_bytes: r.len_bytes, device: r.device, buffer_id: r.buffer_id };
    match ckpt_cuda::export(&a)? {
        ckpt_cuda::Export::Vmm(fd) => Ok(fd),
        ckpt_cuda::Export::Legacy(_) | ckpt_cuda::Export::Fabric(_) => Err(Error::InvalidArgument(format!(
            "CUDA region {} at {:#x} is no longer a VMM allocation exportable as an fd",
            r.region_id, r.base
        ))),
    }
}
