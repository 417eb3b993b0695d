//! Logical tensors stored in pieces (several ranks' parts of one tensor):
//! the index's `slices` section, the reader's view of every tensor as
//! slices of stored ones, and the checks that tie the slices to the stored
//! tensors they repeat.
//!
//! Invariant: slices that passed [`validate_slices`] cover their logical
//! tensor's elements exactly once, in order, each a distinct 1-D stored
//! tensor whose file, offsets and checksum they repeat.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{rank_of_shard_file, tensor_len_bytes, validate_tensor_name, Dtype, FormatError, Index, IndexTensor};

/// A logical tensor stored as element ranges of its row-major flattening,
/// each range a 1-D tensor of `tensors` (format version 2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexSliced {
    pub dtype: Dtype,
    /// The whole tensor's shape.
    pub shape: Vec<u64>,
    /// In element order, covering `[0, elements)` exactly once.
    pub slices: Vec<IndexSlice>,
}

/// One piece of a logical tensor. `file`, `data_offsets` and `crc32c`
/// repeat the stored tensor's entry, so a reader of this section alone
/// finds every byte; the reader checks that they agree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexSlice {
    /// The stored tensor (a key of `tensors`) holding these elements.
    pub tensor: String,
    /// The rank that wrote it (the `RRRRR` of its file's name).
    pub rank: u32,
    pub file: String,
    /// Elements `[start, stop)` of the logical tensor, row-major.
    pub elems: [u64; 2],
    /// Relative to the file's data section, as in the safetensors header.
    pub data_offsets: [u64; 2],
    pub crc32c: u32,
}

/// One tensor as a reader sees it: a whole stored tensor (one slice) or a
/// logical tensor put together from its slices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalTensor<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [u64],
    pub slices: Vec<SliceView<'a>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceView<'a> {
    /// The stored tensor's name (the logical name for a whole tensor).
    pub tensor: &'a str,
    pub file: &'a str,
    pub elems: [u64; 2],
    pub data_offsets: [u64; 2],
    pub crc32c: u32,
}

impl LogicalTensor<'_> {
    pub fn len_bytes(&self) -> u64 {
        self.slices.iter().map(|s| s.data_offsets[1] - s.data_offsets[0]).sum()
    }

    /// Stored in more than one piece.
    pub fn is_sliced(&self) -> bool {
        self.slices.len() != 1 || self.slices[0].tensor != self.name
    }
}

impl Index {
    /// Every tensor as a reader sees it, by name: each logical tensor with
    /// its slices, and each stored tensor that is no slice as one whole
    /// slice.
    pub fn logical(&self) -> Vec<LogicalTensor<'_>> {
        let c = &self.ckpt;
        let pieces: std::collections::HashSet<&str> =
            c.slices.values().flat_map(|s| s.slices.iter().map(|p| p.tensor.as_str())).collect();
        let mut out: Vec<LogicalTensor<'_>> =
            c.tensors.keys().filter(|n| !pieces.contains(n.as_str())).filter_map(|n| self.logical_tensor(n)).collect();
        out.extend(c.slices.keys().filter_map(|n| self.logical_tensor(n)));
        out.sort_by(|a, b| a.name.cmp(b.name));
        out
    }

    /// One tensor by name: a logical tensor (its slices) or a stored one.
    pub fn logical_tensor<'a>(&'a self, name: &str) -> Option<LogicalTensor<'a>> {
        let c = &self.ckpt;
        if let Some((name, s)) = c.slices.get_key_value(name) {
            let slices = s
                .slices
                .iter()
                .map(|p| SliceView {
                    tensor: &p.tensor,
                    file: &p.file,
                    elems: p.elems,
                    data_offsets: p.data_offsets,
                    crc32c: p.crc32c,
                })
                .collect();
            return Some(LogicalTensor { name, dtype: s.dtype, shape: &s.shape, slices });
        }
        let (name, t) = c.tensors.get_key_value(name)?;
        let n_elems = t.shape.iter().product();
        let whole = SliceView {
            tensor: name,
            file: &t.file,
            elems: [0, n_elems],
            data_offsets: t.data_offsets,
            crc32c: t.crc32c,
        };
        Some(LogicalTensor { name, dtype: t.dtype, shape: &t.shape, slices: vec![whole] })
    }

    /// The logical tensor a stored tensor is a slice of, and its elements.
    pub fn slice_of(&self, stored: &str) -> Option<(&str, &IndexSlice)> {
        self.ckpt.slices.iter().find_map(|(n, s)| s.slices.iter().find(|p| p.tensor == stored).map(|p| (n.as_str(), p)))
    }
}

/// Checks the slices against the stored tensors: every logical name valid
/// and no stored tensor's; every slice a distinct 1-D stored tensor of the
/// logical dtype whose length, file, offsets and checksum the slice repeats
/// exactly; slices in order, covering the logical tensor's elements once.
pub fn validate_slices(
    tensors: &BTreeMap<String, IndexTensor>,
    slices: &BTreeMap<String, IndexSliced>,
) -> Result<(), FormatError> {
    let bad = |m: String| Err(FormatError::Index(m));
    let mut used = std::collections::HashSet::new();
    for (name, s) in slices {
        validate_tensor_name(name)?;
        if tensors.contains_key(name) {
            return bad(format!("sliced tensor {name:?} is also a stored tensor"));
        }
        let n_elems = tensor_len_bytes(s.dtype, &s.shape).ok_or_else(|| FormatError::ShapeOverflow {
            name: name.clone(),
            shape: s.shape.clone(),
            dtype: s.dtype,
        })? / s.dtype.size_bytes();
        if s.slices.is_empty() {
            return bad(format!("sliced tensor {name:?} has no slices"));
        }
        let mut at = 0u64;
        for p in &s.slices {
            let what = format!("sliced tensor {name:?}, slice {:?}", p.tensor);
            let Some(t) = tensors.get(&p.tensor) else {
                return bad(format!("{what}: no such stored tensor"));
            };
            if !used.insert(p.tensor.as_str()) {
                return bad(format!("{what}: the stored tensor is a slice twice"));
            }
            let [a, b] = p.elems;
            if a != at || b < a || b > n_elems {
                return bad(format!("{what}: elements [{a},{b}) where [{at},…) of {n_elems} was expected (gap, overlap or past the end)"));
            }
            at = b;
            if t.dtype != s.dtype || t.shape != [b - a] {
                return bad(format!("{what}: stored as {} {:?}, expected {} [{}]", t.dtype, t.shape, s.dtype, b - a));
            }
            if t.file != p.file || t.data_offsets != p.data_offsets || t.crc32c != p.crc32c {
                return bad(format!("{what}: file, offsets or checksum differ from the stored tensor's"));
            }
            if rank_of_shard_file(&p.file) != Some(p.rank) {
                return bad(format!("{what}: rank {} but file {:?}", p.rank, p.file));
            }
        }
        if at != n_elems {
            return bad(format!("sliced tensor {name:?}: slices cover {at} of {n_elems} elements"));
        }
    }
    Ok(())
}
