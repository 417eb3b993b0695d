//! A Save's plan: every check that needs no shared state, then the file
//! image's layout (at base 0) and where each tensor's bytes come from
//! ([`Source`]); and the [`Planner`] that a session's cache of plans
//! (`crate::save::plan_cache`) puts in front of [`plan_save`].
//!
//! Invariant: a [`Source`] with a region names a range that lies inside
//! that region (checked here, before any copy).

use std::collections::HashMap;
use std::sync::Arc;

use ckpt_store::format;
use ckpt_store::image::{Layout, LayoutOptions, TensorSpec};
use ckpt_wire::{Blob, TensorDescIn};

use crate::config;
use crate::memory::regions::Region;
use crate::save::checks::{check_blobs, check_desc_shape, check_no_overlap, Desc};
use crate::save::error::SaveError;

/// Where one tensor's bytes come from.
#[derive(Clone)]
pub struct Source {
    pub region: Option<Arc<Region>>,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

/// The client regions of a save's sources, one per tensor copied from a
/// client (those taken from the resident image have none).
pub fn regions_of(sources: &[Source]) -> impl Iterator<Item = &Arc<Region>> {
    sources.iter().filter_map(|s| s.region.as_ref())
}

/// Every check of protocol.md's Save section that needs no shared state;
/// returns the planned image (at base 0) and each spec's source.
///
/// `changed`: with `opts.incremental`, the tensors that changed at the
/// previous save (the rest go into stable shards, `Layout::plan_with`).
pub fn plan_save(
    tensors: &[impl Desc],
    blobs: &[Blob],
    regions: &HashMap<u32, Arc<Region>>,
    opts: LayoutOptions,
    changed: Option<&std::collections::HashSet<String>>,
) -> Result<(Layout, Vec<Source>), SaveError> {
    if tensors.len() > config::TENSORS_PER_REQUEST_MAX {
        return Err(SaveError::BadRequest(format!(
            "{} tensors; at most {} per save",
            tensors.len(),
            config::TENSORS_PER_REQUEST_MAX
        )));
    }
    check_blobs(blobs)?;
    let mut specs = Vec::with_capacity(tensors.len());
    let mut sources = Vec::with_capacity(tensors.len());
    for d in tensors {
        format::validate_tensor_name(d.name()).map_err(|e| SaveError::BadRequest(e.to_string()))?;
        let dtype = check_desc_shape(d).map_err(SaveError::BadRequest)?;
        let region = if d.len_bytes() == 0 {
            None
        } else {
            let r = regions.get(&d.region_id()).ok_or_else(|| {
                SaveError::BadRegion(format!("tensor {:?}: region {} is not registered", d.name(), d.region_id()))
            })?;
            r.contains(d.offset_bytes(), d.len_bytes())
                .map_err(|e| SaveError::BadRegion(format!("tensor {:?}: {e}", d.name())))?;
            Some(r.clone())
        };
        specs.push(TensorSpec { name: d.name().to_string(), dtype, shape: d.shape().to_vec() });
        sources.push(Source { region, offset_bytes: d.offset_bytes(), len_bytes: d.len_bytes() });
    }
    check_no_overlap(tensors).map_err(SaveError::BadRequest)?;
    let layout = Layout::plan_with(specs, opts, changed).map_err(|e| SaveError::BadRequest(e.to_string()))?;
    Ok((layout, sources))
}

#[derive(Clone, Copy)]
pub enum SaveTensors<'a> {
    /// Decoded, with the bytes of their encoded list when the frame was
    /// read in parts ([`ckpt_wire::SaveHead::rest`]).
    Decoded { tensors: &'a [TensorDescIn<'a>], encoded: Option<&'a [u8]> },
    /// Not decoded: the encoded list of a kept plan, found byte for byte in
    /// the frame (`save_plan::SavePlans::kept_list`).
    Kept(&'a [u8]),
}

/// What plans a save's image and sources: [`plan_save`] itself, or a
/// session's cache of earlier plans (`save_plan::SavePlans`, which uses
/// this module, hence the trait rather than the type here).
pub trait Planner {
    /// `changed` is [`plan_save`]'s; `opts.history_gen` names it, so a
    /// plan kept under another history is not reused.
    fn plan(
        &mut self,
        tensors: SaveTensors<'_>,
        blobs: &[Blob],
        regions: &HashMap<u32, Arc<Region>>,
        opts: LayoutOptions,
        changed: Option<&std::collections::HashSet<String>>,
    ) -> Result<(Layout, Vec<Source>), SaveError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_wire::TensorDesc;

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
    fn unregistered_regions_and_bad_names_are_refused() {
        let regions = HashMap::new();
        assert!(matches!(
            plan_save(&[d("a", 7, 0, 4)], &[], &regions, Default::default(), None),
            Err(SaveError::BadRegion(_))
        ));
        assert!(matches!(
            plan_save(&[d("a\0", 7, 0, 0)], &[], &regions, Default::default(), None),
            Err(SaveError::BadRequest(_))
        ));
        let blob = Blob { name: "../x".into(), bytes: vec![1] };
        assert!(matches!(
            plan_save(&[] as &[TensorDesc], &[blob], &regions, Default::default(), None),
            Err(SaveError::BadRequest(_))
        ));
        // Zero-element tensors need no region.
        let (l, _) = plan_save(&[d("e", 9, 0, 0)], &[], &regions, Default::default(), None).unwrap();
        assert_eq!(l.specs.len(), 1);
    }
}
