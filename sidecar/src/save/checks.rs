//! A Save's checks that read only the request and its regions: each
//! descriptor's dtype and length agree, no two descriptors overlap in a
//! region, the blobs are few and well named, and (after the copy) every
//! source region still holds its registered bytes. The same descriptor
//! checks serve a Load ([`Desc`] reads either kind of descriptor).

use std::path::Path;
use std::sync::Arc;

use ckpt_store::format::{self, Dtype};
use ckpt_store::{catalog, image};
use ckpt_wire::{Blob, TensorDesc, TensorDescIn};

use crate::config;
use crate::memory::regions::Region;
use crate::save::error::SaveError;

/// A tensor descriptor as the checks read it: owned (a Load) or borrowing
/// its frame (a Save, [`ckpt_wire::decode_save`]).
pub trait Desc {
    fn name(&self) -> &str;
    fn dtype(&self) -> &str;
    fn shape(&self) -> &[u64];
    fn region_id(&self) -> u32;
    fn offset_bytes(&self) -> u64;
    fn len_bytes(&self) -> u64;
}

impl Desc for TensorDesc {
    fn name(&self) -> &str {
        &self.name
    }
    fn dtype(&self) -> &str {
        &self.dtype
    }
    fn shape(&self) -> &[u64] {
        &self.shape
    }
    fn region_id(&self) -> u32 {
        self.region_id
    }
    fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }
    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
}

impl Desc for TensorDescIn<'_> {
    fn name(&self) -> &str {
        self.name
    }
    fn dtype(&self) -> &str {
        self.dtype
    }
    fn shape(&self) -> &[u64] {
        &self.shape
    }
    fn region_id(&self) -> u32 {
        self.region_id
    }
    fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }
    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
}

/// Parses a wire dtype and checks `len_bytes == size(dtype) × Π shape`.
pub fn check_desc_shape(d: &impl Desc) -> Result<Dtype, String> {
    let dtype = Dtype::parse(d.dtype()).map_err(|e| format!("tensor {:?}: {e}", d.name()))?;
    let want = format::tensor_len_bytes(dtype, d.shape())
        .ok_or_else(|| format!("tensor {:?}: shape {:?} of {} overflows", d.name(), d.shape(), d.dtype()))?;
    if want != d.len_bytes() {
        return Err(format!(
            "tensor {:?}: len_bytes {} but {} {:?} is {} bytes",
            d.name(),
            d.len_bytes(),
            d.dtype(),
            d.shape(),
            want
        ));
    }
    Ok(dtype)
}

/// Checks that no two non-empty descriptors overlap within one region.
pub fn check_no_overlap(tensors: &[impl Desc]) -> Result<(), String> {
    let mut spans: Vec<(u32, u64, u64, usize)> = tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| t.len_bytes() > 0)
        .map(|(i, t)| (t.region_id(), t.offset_bytes(), t.offset_bytes().saturating_add(t.len_bytes()), i))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if a.0 == b.0 && b.1 < a.2 {
            return Err(format!(
                "tensors {:?} and {:?} overlap in region {}",
                tensors[a.3].name(),
                tensors[b.3].name(),
                a.0
            ));
        }
    }
    Ok(())
}

/// The checks of a Save's blobs (count, names, sizes).
pub fn check_blobs(blobs: &[Blob]) -> Result<(), SaveError> {
    if blobs.len() > config::BLOBS_PER_SAVE_MAX {
        return Err(SaveError::BadRequest(format!(
            "{} blobs; at most {} per save",
            blobs.len(),
            config::BLOBS_PER_SAVE_MAX
        )));
    }
    let blob_refs: Vec<image::Blob> = blobs.iter().map(|b| image::Blob { name: &b.name, bytes: &b.bytes }).collect();
    image::validate_blobs(&blob_refs).map_err(|e| SaveError::BadRequest(e.to_string()))
}

/// Checks that `step` is not below the newest step readers see committed
/// in `dir` (the primary, or the shared directory for a part of several
/// nodes): such a step would be durable, then deleted by retention at once
/// and never `latest`. Checked before anything is copied, and again at the
/// commit (a newer step may have committed meanwhile).
pub fn check_not_below_newest(dir: &Path, step: u64) -> Result<(), SaveError> {
    // Newest first: usually the first folder looked at is committed.
    let newest = catalog::step_dirs(dir)
        .unwrap_or_default()
        .into_iter()
        .rev()
        .filter(|&s| s > step)
        .find(|&s| catalog::is_readable(dir, s));
    match newest {
        Some(newest) => Err(SaveError::BelowNewest { step, newest, dir: dir.to_path_buf() }),
        None => Ok(()),
    }
}

/// Checks that every source region (one per tensor copied from a client:
/// [`crate::save::plan::regions_of`]) still holds its registered bytes and
/// was not found changed under the copy ([`Region::check_intact`]).
pub fn check_sizes<'a>(sources: impl IntoIterator<Item = &'a Arc<Region>>) -> Result<(), SaveError> {
    // Once per region (one fstat each), not once per tensor: a thousand
    // tensors usually lie in one or two regions.
    let mut regions: Vec<&Arc<Region>> = sources.into_iter().collect();
    regions.sort_unstable_by_key(|r| Arc::as_ptr(r));
    regions.dedup_by(|a, b| Arc::ptr_eq(a, b));
    regions.into_iter().try_for_each(|r| r.check_intact()).map_err(|e| SaveError::BadRegion(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(name: &str, region_id: u32, off: u64, len: u64) -> TensorDesc {
        TensorDesc {
            name: name.into(),
            dtype: "U8".into(),
            shape: vec![len],
            region_id,
            offset_bytes: off,
            len_bytes: len,
        }
    }

    #[test]
    fn overlaps_are_found_per_region() {
        check_no_overlap(&[d("a", 1, 0, 10), d("b", 1, 10, 10), d("c", 2, 0, 10)]).unwrap();
        assert!(check_no_overlap(&[d("a", 1, 0, 10), d("b", 1, 9, 10)]).is_err());
        // Empty tensors overlap nothing.
        check_no_overlap(&[d("a", 1, 0, 10), d("b", 1, 5, 0)]).unwrap();
    }

    #[test]
    fn shape_and_length_must_agree() {
        let mut t = d("a", 1, 0, 10);
        check_desc_shape(&t).unwrap();
        t.len_bytes = 11;
        assert!(check_desc_shape(&t).is_err());
        t.dtype = "F33".into();
        assert!(check_desc_shape(&t).is_err());
        let t = TensorDesc {
            name: "x".into(),
            dtype: "F64".into(),
            shape: vec![u64::MAX, 2],
            region_id: 1,
            offset_bytes: 0,
            len_bytes: 0,
        };
        assert!(check_desc_shape(&t).is_err());
    }
}
