//! From tensor references to the wire's tensor list: each tensor located in
//! one of the client's regions (host shared memory or a CUDA allocation) at
//! an offset, and the encoded lists of the last saves kept to be sent again
//! (one per distinct list: a trainer alternating a few states finds each
//! one's list, whatever it saved in between).
//!
//! Invariants:
//! - a kept list is sent again only while everything it is a function of
//!   is unchanged (each tensor's name, dtype, shape, address and length,
//!   and the regions' ids, addresses and lengths), so it always holds what
//!   locating and encoding afresh would give;
//! - at most [`KEPT_LISTS_MAX`] lists of [`KEPT_LIST_TENSORS_MAX`] tensors
//!   in all are kept, the least recently sent dropped first.

use ckpt_wire::TensorDesc;

use super::types::TensorRef;
use super::Inner;
use crate::error::{Error, Result};

/// Encoded tensor lists kept per client (the sidecar keeps as many plans).
pub const KEPT_LISTS_MAX: usize = 8;
/// Tensors of all kept lists together (a list of more is not kept).
pub const KEPT_LIST_TENSORS_MAX: usize = 1 << 18;

/// The kept lists of a client, least recently sent first.
#[derive(Default)]
pub(super) struct KeptLists {
    lists: Vec<KeptList>,
}

impl KeptLists {
    /// The kept list of `tensors` with `inner`'s regions now, taken out
    /// (put back by [`KeptLists::keep`] once sent).
    pub(super) fn take(&mut self, inner: &Inner, tensors: &[TensorRef]) -> Option<KeptList> {
        let i = self.lists.iter().rposition(|k| k.is_of(inner, tensors))?;
        Some(self.lists.remove(i))
    }

    /// `k` kept as the most recently sent, the oldest dropped past the bounds.
    pub(super) fn keep(&mut self, k: KeptList) {
        if k.tensors.len() > KEPT_LIST_TENSORS_MAX {
            return;
        }
        self.lists.push(k);
        let mut kept: usize = self.lists.iter().map(|k| k.tensors.len()).sum();
        while self.lists.len() > KEPT_LISTS_MAX || kept > KEPT_LIST_TENSORS_MAX {
            kept -= self.lists.remove(0).tensors.len();
        }
    }
}

/// A save's encoded tensor list ([`ckpt_wire::encode_tensors`]) with what
/// it is a function of: each tensor's name, dtype, shape, address and
/// length, and the regions that place addresses (their ids, addresses and
/// lengths: [`locate`] reads nothing else). A save of the same tensors
/// while the regions are the same (a trainer saving one state again and
/// again) sends these bytes again: no locating, no encoding per tensor.
pub(super) struct KeptList {
    regions: Vec<(u32, usize, u64)>,
    cuda_regions: Vec<(u32, u64, u64)>,
    /// Names and dtypes end to end (a tensor's end where its entry says).
    text: String,
    /// Shapes end to end.
    dims: Vec<u64>,
    tensors: Vec<KeptTensor>,
    pub(super) encoded: Vec<u8>,
}

/// Where one tensor's name, dtype and shape end in the list's `text` and
/// `dims`, and its address and length.
struct KeptTensor {
    name_end: usize,
    dtype_end: usize,
    dims_end: usize,
    ptr: usize,
    len_bytes: u64,
}

impl KeptList {
    /// The list of `tensors` located in `inner`'s regions, encoded from the
    /// caller's borrowed names and shapes: no copy of them (a save of
    /// thousands of tensors costs a pass, not allocations).
    pub(super) fn encode(inner: &Inner, tensors: &[TensorRef]) -> Result<KeptList> {
        let mut descs = Vec::with_capacity(tensors.len());
        for t in tensors {
            let (region_id, offset_bytes) = locate(inner, t)?;
            descs.push(ckpt_wire::TensorDescRef {
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
                region_id,
                offset_bytes,
                len_bytes: t.len_bytes,
            });
        }
        Ok(KeptList::new(inner, tensors, ckpt_wire::encode_tensors(&descs)))
    }

    fn new(inner: &Inner, tensors: &[TensorRef], encoded: Vec<u8>) -> KeptList {
        let mut text = String::with_capacity(tensors.iter().map(|t| t.name.len() + t.dtype.len()).sum());
        let mut dims = Vec::with_capacity(tensors.iter().map(|t| t.shape.len()).sum());
        let kept = tensors
            .iter()
            .map(|t| {
                text.push_str(t.name);
                let name_end = text.len();
                text.push_str(t.dtype);
                dims.extend_from_slice(t.shape);
                KeptTensor {
                    name_end,
                    dtype_end: text.len(),
                    dims_end: dims.len(),
                    ptr: t.ptr as usize,
                    len_bytes: t.len_bytes,
                }
            })
            .collect();
        KeptList {
            regions: inner.regions.values().map(|r| (r.region_id(), r.as_ptr() as usize, r.len_bytes())).collect(),
            cuda_regions: inner.cuda_regions.values().map(|r| (r.region_id, r.base, r.len_bytes)).collect(),
            text,
            dims,
            tensors: kept,
            encoded,
        }
    }

    /// Whether this is the list of `tensors` with `inner`'s regions now.
    pub(super) fn is_of(&self, inner: &Inner, tensors: &[TensorRef]) -> bool {
        if self.tensors.len() != tensors.len()
            || self.regions.len() != inner.regions.len()
            || self.cuda_regions.len() != inner.cuda_regions.len()
            || !inner
                .regions
                .values()
                .zip(&self.regions)
                .all(|(r, &k)| (r.region_id(), r.as_ptr() as usize, r.len_bytes()) == k)
            || !inner
                .cuda_regions
                .values()
                .zip(&self.cuda_regions)
                .all(|(r, &k)| (r.region_id, r.base, r.len_bytes) == k)
        {
            return false;
        }
        let (mut at, mut d0) = (0, 0);
        for (k, t) in self.tensors.iter().zip(tensors) {
            if k.ptr != t.ptr as usize
                || k.len_bytes != t.len_bytes
                || self.text[at..k.name_end] != *t.name
                || self.text[k.name_end..k.dtype_end] != *t.dtype
                || self.dims[d0..k.dims_end] != *t.shape
            {
                return false;
            }
            (at, d0) = (k.dtype_end, k.dims_end);
        }
        true
    }
}

/// Turns tensor refs into descriptors: the region each lies in (host shm or
/// a CUDA allocation) and its offset.
pub(super) fn describe(inner: &Inner, tensors: &[TensorRef]) -> Result<Vec<TensorDesc>> {
    tensors
        .iter()
        .map(|t| {
            let (region_id, offset_bytes) = locate(inner, t)?;
            Ok(TensorDesc {
                name: t.name.to_string(),
                dtype: t.dtype.to_string(),
                shape: t.shape.to_vec(),
                region_id,
                offset_bytes,
                len_bytes: t.len_bytes,
            })
        })
        .collect()
}

/// The region a tensor ref lies in (host shm or a CUDA allocation) and its offset there.
pub(super) fn locate(inner: &Inner, t: &TensorRef) -> Result<(u32, u64)> {
    let regions = &inner.regions;
    let ptr = t.ptr as usize;
    let found =
        regions.values().find_map(|r| r.offset_of(ptr, t.len_bytes).map(|off| (r.region_id(), off))).or_else(|| {
            inner.cuda_regions.values().find_map(|r| r.offset_of(ptr as u64, t.len_bytes).map(|off| (r.region_id, off)))
        });
    match found {
        Some(f) => Ok(f),
        // A zero-byte tensor needs no region bytes: any region at offset 0.
        None if t.len_bytes == 0 => Ok((regions.keys().next().copied().unwrap_or(0), 0)),
        None => Err(Error::OutsideRegion { name: t.name.to_string(), ptr, len_bytes: t.len_bytes }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inner() -> Inner {
        Inner {
            conn: None,
            regions: Default::default(),
            cuda_regions: Default::default(),
            cuda_events: Default::default(),
            done_seq: 0,
            next_region_id: 1,
            closed: false,
            request_timeout: None,
            lazy_release: false,
            rank: (0, 1),
            kept_lists: KeptLists::default(),
        }
    }

    fn t<'a>(name: &'a str, shape: &'a [u64], ptr: usize) -> TensorRef<'a> {
        TensorRef { name, dtype: "U8", shape, ptr: ptr as *const u8, len_bytes: shape.iter().product() }
    }

    #[test]
    fn each_of_a_few_alternating_lists_is_found_again_and_any_change_misses() {
        let inner = inner();
        let mut kept = KeptLists::default();
        let a = [t("a0", &[8], 0x1000), t("a1", &[8], 0x1008)];
        let b = [t("b", &[16], 0x2000)];
        kept.keep(KeptList::new(&inner, &a, vec![1]));
        kept.keep(KeptList::new(&inner, &b, vec![2]));
        for _ in 0..3 {
            for (ts, enc) in [(&a[..], 1u8), (&b[..], 2)] {
                let k = kept.take(&inner, ts).expect("kept though the other list was sent in between");
                assert_eq!(k.encoded, [enc]);
                kept.keep(k);
            }
        }
        // Any field of a tensor changed: not found (encoded afresh).
        for other in [
            [t("a0", &[8], 0x1000), t("a2", &[8], 0x1008)],
            [t("a0", &[8], 0x1000), t("a1", &[8], 0x1010)],
            [t("a0", &[8], 0x1000), t("a1", &[2, 4], 0x1008)],
            [t("a0", &[8], 0x1000), TensorRef { dtype: "I8", ..t("a1", &[8], 0x1008) }],
        ] {
            assert!(kept.take(&inner, &other).is_none());
        }
        assert!(kept.take(&inner, &a[..1]).is_none());
        // Bounded: the least recently sent go first.
        let names: Vec<String> = (0..KEPT_LISTS_MAX).map(|i| format!("n{i}")).collect();
        for n in &names {
            kept.keep(KeptList::new(&inner, &[t(n, &[1], 0x3000)], vec![]));
        }
        assert_eq!(kept.lists.len(), KEPT_LISTS_MAX);
        assert!(kept.take(&inner, &a).is_none() && kept.take(&inner, &b).is_none());
    }
}
