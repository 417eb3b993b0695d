//! The on-disk format (see `docs/format.md`): names of folders and files
//! (`names`), the safetensors shard header (`header`), and the index
//! that is the commit record (`index`, with its logical view of sliced
//! tensors in `slices`). This module holds what they share: the element
//! types and the one error type of the format.
//!
//! Invariants kept here:
//! - every name that reaches the file system went through [`validate_blob_name`]
//!   or is generated here (`step-…`, `rank-…`), so no path trick survives;
//! - a parsed header or index is bounds-checked before anyone uses an offset
//!   from it: data offsets are contiguous, inside the file, and match the dtype
//!   and shape.

use serde::{Deserialize, Serialize};

mod header;
mod index;
mod names;
mod slices;

pub use header::{decode_header, encode_header, HeaderTensor, ParsedHeader};
pub(crate) use index::{seal_json_after, validate_blobs, ZEROED_CRC_FIELD};
pub use index::{CkptSection, Index, IndexBlob, IndexFile, IndexMetadata, IndexNode, IndexTensor};
pub use names::*;
pub use slices::{validate_slices, IndexSlice, IndexSliced, LogicalTensor, SliceView};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("invalid tensor name {name:?}: {why}")]
    TensorName { name: String, why: &'static str },
    #[error("invalid blob name {name:?}: {why}")]
    BlobName { name: String, why: &'static str },
    #[error("unknown dtype {0:?}")]
    Dtype(String),
    #[error("tensor {name:?}: shape {shape:?} of {dtype} overflows")]
    ShapeOverflow { name: String, shape: Vec<u64>, dtype: Dtype },
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("duplicate blob name {0:?}")]
    DuplicateBlob(String),
    #[error("step {0} is above the largest step {STEP_MAX}")]
    StepTooLarge(u64),
    #[error("safetensors header: {0}")]
    Header(String),
    #[error("index: {0}")]
    Index(String),
}

/// Element types, spelled as safetensors spells them.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
pub enum Dtype {
    BOOL,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl Dtype {
    pub const ALL: [Dtype; 15] = [
        Dtype::BOOL,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    pub fn size_bytes(self) -> u64 {
        match self {
            Dtype::BOOL | Dtype::U8 | Dtype::I8 | Dtype::F8_E5M2 | Dtype::F8_E4M3 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    pub fn parse(s: &str) -> Result<Dtype, FormatError> {
        Dtype::ALL.into_iter().find(|d| d.as_str() == s).ok_or_else(|| FormatError::Dtype(s.to_string()))
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Bytes of a tensor of `dtype` and `shape`, or None on overflow.
pub fn tensor_len_bytes(dtype: Dtype, shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(dtype.size_bytes(), |acc, &d| acc.checked_mul(d))
}
