//! Tensors a trainer proves unchanged (protocol 13, a Save's `unchanged`:
//! `incremental="trust-version"` in the Python shim): their bytes are taken
//! from the step the trainer names instead of from its memory, so they are
//! not copied out of the client's regions (on a GPU: no device-to-host
//! copy). Their source is the resident image (the newest committed whole
//! save, still in staging), with its checksums and digests; with
//! incremental layouts, a stable shard whose tensors are all unchanged is
//! then linked from the previous step by the commit as usual (its digests
//! match), so such a tensor is neither copied from the client nor written.
//! In the steady state (the layout repeats) it is not copied at all: the
//! resident image's lease becomes the save's ([`adopt`]).
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
//!   writer's ready prefix never covers bytes not yet there;
//! - an adopted lease ([`adopt`]) holds every taken tensor at the very
//!   range the new layout gives it, and no one else held the resident image
//!   (its only reference, under the staging lock), so nothing reads it while
//!   the copy overwrites the rest; the new image is as complete as a copied
//!   one, so whatever the commit decides (link, or write: `--full-every`, a
//!   failed link, another previous step) has its bytes.

use std::collections::HashMap;
use std::sync::Arc;

use ckpt_store::image::Layout;
use ckpt_wire::Unchanged;

use crate::memory::staging::{Lease, Resident, Staging};
use crate::state::reply::Replies;

/// The tensors of one save taken from a resident image.
pub struct Reuse {
    resident: Arc<Resident>,
    /// (tensor index in the new layout, index in the resident's layout).
    pairs: Vec<(usize, usize)>,
    pub bytes: u64,
}

/// The tensors of a save (planned as `layout`) whose flags `unchanged`
/// honours against the resident image; None when none can be taken.
pub fn find(
    staging: &Staging,
    replies: &Arc<Replies>,
    layout: &Layout,
    unchanged: Option<&Unchanged>,
) -> Option<Reuse> {
    let u = unchanged.filter(|u| u.count() > 0)?;
    let resident = staging.resident()?;
    let (pairs, bytes) = pairs_of(&resident, replies, layout, u)?;
    Some(Reuse { resident, pairs, bytes })
}

/// The (new index, resident index) pairs of the flagged tensors `resident`
/// holds as the flags require, and their bytes; None when there are none.
fn pairs_of(
    resident: &Resident,
    replies: &Arc<Replies>,
    layout: &Layout,
    u: &Unchanged,
) -> Option<(Vec<(usize, usize)>, u64)> {
    if resident.step != u.since_step || !std::sync::Weak::ptr_eq(&resident.origin, &replies.origin()) {
        return None;
    }
    let by_name: HashMap<&str, usize> =
        resident.layout.specs.iter().enumerate().map(|(j, s)| (s.name.as_str(), j)).collect();
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
    (!pairs.is_empty()).then_some((pairs, bytes))
}

/// The resident image's lease itself as the save's, when every tensor
/// taken from it already lies where `layout` puts it (same staging range:
/// in the steady state of a trusted run, whose layout repeats): the taken
/// bytes are then copied from nowhere, neither from the client nor from
/// the resident image, and the copy of the rest overwrites the other
/// tensors and the headers. Only when no one else holds the resident image
/// (a load serving its step keeps it) and its lease is large enough; the
/// resident image is gone from then on (a load of its step reads the
/// disk). None: nothing adopted, the resident image untouched.
pub fn adopt(
    staging: &Staging,
    replies: &Arc<Replies>,
    layout: &Layout,
    unchanged: Option<&Unchanged>,
) -> Option<(Lease, Taken)> {
    let u = unchanged.filter(|u| u.count() > 0)?;
    let (resident, (pairs, bytes)) = staging.take_resident_with(|r| {
        if r.lease.len_bytes() < layout.staging_len {
            return None;
        }
        let (pairs, bytes) = pairs_of(r, replies, layout, u)?;
        pairs.iter().all(|&(i, j)| layout.tensor_range(i) == r.layout.tensor_range(j)).then_some((pairs, bytes))
    })?;
    let lease = resident.lease.refill();
    let sums = pairs
        .iter()
        .map(|&(i, j)| {
            // As in Reuse::fill: the resident's digest, else hashed in place.
            let digest = layout.opts.incremental.then(|| match &resident.digests {
                Some(d) => d[j],
                None => ckpt_store::digest::tensor_digest(&lease.as_slice()[layout.tensor_range(i)]),
            });
            (i, resident.crcs[j], digest)
        })
        .collect();
    Some((lease, Taken { sums, bytes }))
}

impl Reuse {
    /// Copies the taken tensors' bytes from the resident image into the
    /// lease (planned as `layout`, no filler yet). Returns which they are
    /// (the copy from the client must skip them: [`Taken::tensors`]) and
    /// their checksums ([`Taken::patch_crcs`]); the resident image is let go.
    pub fn fill(self, layout: &Layout, lease: &mut Lease) -> Taken {
        let from = self.resident.lease.as_slice();
        let to = lease.as_mut_slice();
        let mut sums = Vec::with_capacity(self.pairs.len());
        for &(i, j) in &self.pairs {
            let (dst, src) = (layout.tensor_range(i), self.resident.layout.tensor_range(j));
            to[dst.clone()].copy_from_slice(&from[src]);
            // An incremental layout needs the tensor's digest: the resident
            // image's when it has them, else hashed from the bytes just copied.
            let digest = layout.opts.incremental.then(|| match &self.resident.digests {
                Some(d) => d[j],
                None => ckpt_store::digest::tensor_digest(&to[dst]),
            });
            sums.push((i, self.resident.crcs[j], digest));
        }
        Taken { sums, bytes: self.bytes }
    }
}

/// What [`Reuse::fill`] took: the tensors' checksums (and digests, for an
/// incremental layout) and their bytes.
pub struct Taken {
    sums: Vec<(usize, u32, Option<u128>)>,
    pub bytes: u64,
}

impl Taken {
    /// The indexes of the tensors taken.
    pub fn tensors(&self) -> impl Iterator<Item = usize> + '_ {
        self.sums.iter().map(|&(i, _, _)| i)
    }

    /// Puts the taken tensors' checksums and digests into a save's (whose
    /// copy left them out, so its entries for them are those of no bytes).
    pub fn patch(&self, crcs: &mut [u32], digests: Option<&mut [u128]>) {
        for &(i, c, _) in &self.sums {
            crcs[i] = c;
        }
        if let Some(d) = digests {
            for &(i, _, digest) in &self.sums {
                d[i] = digest.expect("an incremental layout's taken tensors carry their digests");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_store::format::Dtype;
    use ckpt_store::image::{LayoutOptions, TensorSpec};
    use std::os::unix::net::UnixStream;

    fn layout(specs: &[(&str, Dtype, u64)]) -> Layout {
        let specs =
            specs.iter().map(|&(n, d, len)| TensorSpec { name: n.into(), dtype: d, shape: vec![len] }).collect();
        Layout::plan(specs, LayoutOptions::default()).unwrap()
    }

    fn idx(l: &Layout, name: &str) -> usize {
        l.specs.iter().position(|s| s.name == name).unwrap()
    }

    #[test]
    fn flags_are_honoured_only_against_the_named_step_this_session_saved_and_the_same_tensors() {
        let staging = Staging::new(4 << 20).unwrap();
        let (a, _a) = UnixStream::pair().unwrap();
        let (b, _b) = UnixStream::pair().unwrap();
        let (me, other) = (Arc::new(Replies::new(a)), Arc::new(Replies::new(b)));
        let old = layout(&[("w", Dtype::U8, 4096), ("b", Dtype::U8, 4096)]);
        let (mut lease, _) = staging.acquire(old.staging_len, "old", || None).unwrap();
        lease.as_mut_slice()[old.tensor_range(idx(&old, "w"))].fill(7);
        let mut crcs = vec![0u32; 2];
        crcs[idx(&old, "w")] = 11;
        crcs[idx(&old, "b")] = 22;
        staging.offer_resident(Resident {
            step: 5,
            layout: old.clone(),
            crcs,
            digests: None,
            blobs: vec![],
            lease,
            origin: me.origin(),
        });

        let new = layout(&[("b", Dtype::U8, 4096), ("w", Dtype::U8, 4096), ("n", Dtype::U8, 4096)]);
        let flags = |since_step, f: [bool; 3]| Unchanged { since_step, bits: Unchanged::bits_of(f) };
        // Another session, another step, nothing flagged: nothing taken.
        assert!(find(&staging, &other, &new, Some(&flags(5, [true; 3]))).is_none());
        assert!(find(&staging, &me, &new, Some(&flags(4, [true; 3]))).is_none());
        assert!(find(&staging, &me, &new, Some(&flags(5, [false; 3]))).is_none());
        assert!(find(&staging, &me, &new, None).is_none());
        // A name the step lacks, or another shape or dtype: that tensor is copied.
        let reshaped = layout(&[("b", Dtype::U8, 4096), ("w", Dtype::U8, 2048), ("n", Dtype::U8, 4096)]);
        assert_eq!(find(&staging, &me, &reshaped, Some(&flags(5, [true; 3]))).unwrap().bytes, 4096);
        let retyped = layout(&[("b", Dtype::I8, 4096), ("w", Dtype::U8, 4096), ("n", Dtype::U8, 4096)]);
        assert_eq!(find(&staging, &me, &retyped, Some(&flags(5, [true; 3]))).unwrap().bytes, 4096);
        // Flagged w (index 1 of the new list) and n: w taken, bytes and checksum.
        let reuse = find(&staging, &me, &new, Some(&flags(5, [false, true, true]))).unwrap();
        assert_eq!(reuse.bytes, 4096);
        let (mut lease, _) = staging.acquire(new.staging_len, "new", || None).unwrap();
        let taken = reuse.fill(&new, &mut lease);
        assert_eq!(taken.tensors().collect::<Vec<_>>(), vec![idx(&new, "w")]);
        assert!(lease.as_slice()[new.tensor_range(idx(&new, "w"))].iter().all(|&x| x == 7));
        let mut crcs = vec![0u32; 3];
        taken.patch(&mut crcs, None);
        assert_eq!(crcs[idx(&new, "w")], 11);
        assert_eq!(crcs[idx(&new, "b")], 0);
    }

    #[test]
    fn a_resident_image_laid_out_as_the_save_is_adopted_in_place_only_when_no_one_else_holds_it() {
        let staging = Staging::new(4 << 20).unwrap();
        let (a, _a) = UnixStream::pair().unwrap();
        let me = Arc::new(Replies::new(a));
        let old = layout(&[("w", Dtype::U8, 4096), ("b", Dtype::U8, 4096)]);
        let (mut lease, _) = staging.acquire(old.staging_len, "old", || None).unwrap();
        lease.as_mut_slice()[old.tensor_range(idx(&old, "w"))].fill(7);
        let at = lease.offset_bytes();
        let mut crcs = vec![0u32; 2];
        crcs[idx(&old, "w")] = 11;
        crcs[idx(&old, "b")] = 22;
        staging.offer_resident(Resident {
            step: 5,
            layout: old.clone(),
            crcs,
            digests: None,
            blobs: vec![],
            lease,
            origin: me.origin(),
        });
        let flags = |f: [bool; 2]| Unchanged { since_step: 5, bits: Unchanged::bits_of(f) };
        let w_flag = if idx(&old, "w") == 0 { [true, false] } else { [false, true] };
        // Another layout (w elsewhere): not adopted, the resident stays.
        let moved = layout(&[("w", Dtype::U8, 4096), ("a", Dtype::U8, 4096), ("b", Dtype::U8, 4096)]);
        if moved.tensor_range(idx(&moved, "w")) != old.tensor_range(idx(&old, "w")) {
            let f = Unchanged { since_step: 5, bits: Unchanged::bits_of((0..3).map(|i| i == idx(&moved, "w"))) };
            assert!(adopt(&staging, &me, &moved, Some(&f)).is_none());
            assert_eq!(staging.resident_step(), Some(5));
        }
        // A load holding the resident image: not adopted.
        let held = staging.resident().unwrap();
        assert!(adopt(&staging, &me, &old, Some(&flags(w_flag))).is_none());
        drop(held);
        // The same layout: the resident's lease becomes the save's, w's bytes
        // and checksum in place, and the resident image is gone.
        let (mut lease, taken) = adopt(&staging, &me, &old, Some(&flags(w_flag))).unwrap();
        assert_eq!(staging.resident_step(), None);
        assert_eq!((lease.offset_bytes(), taken.bytes), (at, 4096));
        assert!(lease.as_mut_slice()[old.tensor_range(idx(&old, "w"))].iter().all(|&x| x == 7));
        let mut crcs = vec![0u32; 2];
        taken.patch(&mut crcs, None);
        assert_eq!(crcs[idx(&old, "w")], 11);
        assert_eq!(crcs[idx(&old, "b")], 0);
    }
}
