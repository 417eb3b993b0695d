//! Tensors a trainer proves unchanged (protocol 13, a Save's `unchanged`:
//! `incremental="trust-version"` in the Python shim): their bytes are taken
//! from the step the trainer names instead of from its memory, so they are
//! not copied out of the client's regions (on a GPU: no device-to-host
//! copy). Today's source is the resident image (the newest committed
//! whole save, still in staging); a step whose stable shards are linked
//! from the previous one (issue 21's incremental core) takes them from
//! there too.
//!
//! Invariants:
//! - a flag is honoured only against the very image the client names: the
//!   resident image is step `since_step`, and this session (the same
//!   connection, [`Resident::origin`]) saved it; a tensor is taken only if
//!   that image holds one of the same name, dtype and shape. Otherwise the
//!   tensor is copied from the client as usual (correctness first: a flag
//!   never makes a step lose a tensor);
//! - the flag's truth is the client's promise (docs/python.md: which
//!   writes escape torch's version counter); the sidecar cannot check it
//!   without the copy it saves;
//! - the resident image is looked up only after the save's lease was
//!   taken (a lease that evicts it must not wait on our own reference), and
//!   its bytes are copied before the copy of the rest starts, so the
//!   writer's ready prefix never covers bytes not yet there.

use std::collections::HashMap;
use std::sync::Arc;

use ckpt_store::image::Layout;
use ckpt_wire::Unchanged;

use crate::peer::Peer;
use crate::staging::{Lease, Resident, Staging};

/// The tensors of one save taken from a resident image.
pub struct Reuse {
    resident: Arc<Resident>,
    /// (tensor index in the new layout, index in the resident's layout).
    pairs: Vec<(usize, usize)>,
    pub bytes: u64,
}

/// The tensors of a save (planned as `layout`) whose flags `unchanged`
/// honours against the resident image; None when none can be taken.
pub fn find(staging: &Staging, peer: &Arc<Peer>, layout: &Layout, unchanged: Option<&Unchanged>) -> Option<Reuse> {
    let u = unchanged.filter(|u| u.count() > 0)?;
    let resident = staging.resident()?;
    if resident.step != u.since_step || !std::sync::Weak::ptr_eq(&resident.origin, &Arc::downgrade(peer)) {
        return None;
    }
    let by_name: HashMap<&str, usize> = resident.layout.specs.iter().enumerate().map(|(j, s)| (s.name.as_str(), j)).collect();
    let mut pairs = Vec::new();
    let mut bytes = 0u64;
    for (i, spec) in layout.specs.iter().enumerate() {
        if !u.is_set(i) {
            continue;
        }
        let Some(&j) = by_name.get(spec.name.as_str()) else { continue };
        let old = &resident.layout.specs[j];
        if old.dtype != spec.dtype || old.shape != spec.shape {
            continue;
        }
        let len = layout.tensor_range(i).len();
        if len == 0 || resident.layout.tensor_range(j).len() != len {
            continue;
        }
        pairs.push((i, j));
        bytes += len as u64;
    }
    (!pairs.is_empty()).then_some(Reuse { resident, pairs, bytes })
}

impl Reuse {
    /// Copies the taken tensors' bytes from the resident image into the
    /// lease (planned as `layout`, no filler yet). Returns which they are
    /// (the copy from the client must skip them: [`Taken::tensors`]) and
    /// their checksums ([`Taken::patch_crcs`]); the resident image is let go.
    pub fn fill(self, layout: &Layout, lease: &mut Lease) -> Taken {
        let from = self.resident.lease.as_slice();
        let to = lease.as_mut_slice();
        let mut crcs = Vec::with_capacity(self.pairs.len());
        for &(i, j) in &self.pairs {
            to[layout.tensor_range(i)].copy_from_slice(&from[self.resident.layout.tensor_range(j)]);
            crcs.push((i, self.resident.crcs[j]));
        }
        Taken { crcs, bytes: self.bytes }
    }
}

/// What [`Reuse::fill`] took: the tensors' checksums and their bytes.
pub struct Taken {
    crcs: Vec<(usize, u32)>,
    pub bytes: u64,
}

impl Taken {
    /// The indexes of the tensors taken.
    pub fn tensors(&self) -> impl Iterator<Item = usize> + '_ {
        self.crcs.iter().map(|&(i, _)| i)
    }

    /// Puts the taken tensors' checksums into a save's (whose copy left
    /// them out).
    pub fn patch_crcs(&self, crcs: &mut [u32]) {
        for &(i, c) in &self.crcs {
            crcs[i] = c;
        }
    }
}
