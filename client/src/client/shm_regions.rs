//! Host regions: POSIX shared memory this client creates, registers with
//! the sidecar under a fresh id, and unregisters before forgetting.
//!
//! Invariant: a region is in the client's table exactly while the sidecar
//! may know it, so a reconnect re-registers all of it and nothing else; its
//! mapping lives while any clone of its `Arc` does.

use std::sync::Arc;

use ckpt_wire::{Reply, Request};

use super::requests::unexpected;
use super::types::Region;
use super::Client;
use crate::error::{Error, Result};
use crate::region::ShmRegion;

impl Client {
    /// Creates a shared-memory region of `len_bytes` and registers it.
    pub fn alloc_region(&self, len_bytes: u64) -> Result<Region> {
        self.alloc_region_as(len_bytes, false)
    }

    /// As [`Client::alloc_region`], for memory the caller fills with copies
    /// made at save: it writes the region only to fill a save before
    /// sending it, and not again until that save is released. A save whose
    /// every tensor lies in such regions is then the sidecar's once
    /// [`Client::save`] returned: it commits even if this process dies
    /// before Released (docs/protocol.md, RegisterRegion).
    pub fn alloc_hand_over_region(&self, len_bytes: u64) -> Result<Region> {
        self.alloc_region_as(len_bytes, true)
    }

    fn alloc_region_as(&self, len_bytes: u64, hand_over: bool) -> Result<Region> {
        self.check_owner()?;
        let mut inner = self.lock_inner();
        if inner.closed {
            return Err(Error::Closed);
        }
        let region_id = inner.fresh_region_id()?;
        let region = Arc::new(ShmRegion::create(region_id, len_bytes)?.handing_over(hand_over));
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(&mut inner)?;
        self.register(conn, &region, timeout)?;
        inner.regions.insert(region_id, region.clone());
        Ok(region)
    }

    /// Unregisters a region and forgets it; its memory is unmapped and its
    /// name unlinked when the last `Region` clone is dropped. The sidecar
    /// answers only once no copy reads the region any more.
    pub fn free_region(&self, region: &Region) -> Result<()> {
        self.free_region_id(region.region_id())
    }

    /// As [`Client::free_region`], by the region's base address (the C ABI's `ckpt_free`).
    pub fn free_region_at(&self, ptr: *const u8) -> Result<()> {
        let id = {
            let inner = self.lock_inner();
            inner.regions.values().find(|r| std::ptr::eq(r.as_ptr(), ptr)).map(|r| r.region_id())
        };
        match id {
            Some(id) => self.free_region_id(id),
            None => Err(Error::UnknownRegion { ptr: ptr as usize }),
        }
    }

    fn free_region_id(&self, region_id: u32) -> Result<()> {
        // Before the lock: in a forked child it may be held by a thread of
        // the parent that does not exist here (held across a round trip).
        self.check_owner()?;
        let mut inner = self.lock_inner();
        let Some(region) = inner.regions.remove(&region_id) else {
            return Err(Error::UnknownRegion { ptr: 0 });
        };
        // The region is forgotten either way; if the sidecar is gone it has
        // nothing to unregister, and a later reconnect will not register it.
        let timeout = inner.request_timeout;
        let conn = match self.ensure_connected(&mut inner) {
            Ok(c) => c,
            Err(_) => return Ok(()),
        };
        let reply =
            self.call_on(conn, timeout, "UnregisterRegion", |id| Request::UnregisterRegion { id, region_id })?;
        drop(region);
        match reply {
            Reply::RegionUnregistered { .. } => Ok(()),
            other => Err(unexpected("UnregisterRegion", other)),
        }
    }

    /// Regions currently allocated.
    pub fn regions(&self) -> Vec<Region> {
        self.lock_inner().regions.values().cloned().collect()
    }
}
