//! Which stored tensors of an image are pieces of which logical tensors
//! (several ranks' parts of one tensor): the declarations, checked as a
//! reader checks the index, and the index's `slices` section built from them.
//!
//! Invariant: a layout holds only declarations that passed
//! [`checked_slices`], so rendering its index cannot fail on them.

use std::collections::BTreeMap;

use super::Layout;
use crate::format::{self, FormatError, IndexSlice, IndexSliced, IndexTensor};

/// A stored tensor of a layout that is elements `elems` (row-major) of the
/// logical tensor `of`, whose whole shape is `shape`. (Serialized as a
/// rank's declarations beside its marker, docs/format.md "Several nodes".)
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SliceDecl {
    pub piece: String,
    pub of: String,
    pub shape: Vec<u64>,
    pub elems: [u64; 2],
}
impl Layout {
    /// Declares which tensors are pieces of which logical tensors, checked
    /// as a reader will check the index: every piece a 1-D tensor of this
    /// layout of the logical dtype, the pieces of each logical tensor
    /// covering it exactly once, no logical name a stored one.
    pub fn set_slices(&mut self, decls: Vec<SliceDecl>) -> Result<(), FormatError> {
        let zeros = vec![0; self.specs.len()];
        checked_slices(&self.index_tensors(&zeros), &decls)?;
        self.slices = decls;
        self.index_template = Default::default();
        Ok(())
    }

    /// The declarations [`Layout::set_slices`] accepted.
    pub fn slices(&self) -> &[SliceDecl] {
        &self.slices
    }
}

/// The `slices` section of an index whose stored tensors are `tensors`,
/// from declarations of any ranks (pieces in element order), checked as a
/// reader checks it ([`format::validate_slices`]). One sidecar's commit of
/// every rank's part ([`Layout::set_slices`]) and the coordinator's commit
/// of several nodes' markers ([`crate::ranks::merge_indexes`]) both check
/// declarations here.
pub fn checked_slices(
    tensors: &BTreeMap<String, IndexTensor>,
    decls: &[SliceDecl],
) -> Result<BTreeMap<String, IndexSliced>, FormatError> {
    let slices = slices_section(tensors, decls)?;
    format::validate_slices(tensors, &slices)?;
    Ok(slices)
}

/// The `slices` section from the declarations, unchecked beyond what
/// building it needs (every piece a stored tensor, one shape per name).
pub(super) fn slices_section(
    tensors: &BTreeMap<String, IndexTensor>,
    decls: &[SliceDecl],
) -> Result<BTreeMap<String, IndexSliced>, FormatError> {
    let mut out: BTreeMap<String, IndexSliced> = BTreeMap::new();
    for d in decls {
        let t = tensors.get(&d.piece).ok_or_else(|| {
            FormatError::Index(format!("slice {:?} of {:?}: no such tensor in the checkpoint", d.piece, d.of))
        })?;
        let rank = format::rank_of_shard_file(&t.file).ok_or_else(|| {
            FormatError::Index(format!("slice {:?} of {:?}: file {:?} names no rank", d.piece, d.of, t.file))
        })?;
        let e = out.entry(d.of.clone()).or_insert_with(|| IndexSliced {
            dtype: t.dtype,
            shape: d.shape.clone(),
            slices: Vec::new(),
        });
        if e.shape != d.shape {
            return Err(FormatError::Index(format!(
                "sliced tensor {:?}: slices give shapes {:?} and {:?}",
                d.of, e.shape, d.shape
            )));
        }
        e.slices.push(IndexSlice {
            tensor: d.piece.clone(),
            rank,
            file: t.file.clone(),
            elems: d.elems,
            data_offsets: t.data_offsets,
            crc32c: t.crc32c,
        });
    }
    for e in out.values_mut() {
        e.slices.sort_by_key(|p| p.elems);
    }
    Ok(out)
}
