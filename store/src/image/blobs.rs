//! The small opaque byte blobs saved beside the tensors (`blobs/<name>`):
//! their names and sizes checked, and their entries in the index.

use std::collections::HashSet;

use crate::config;
use crate::format::{self, FormatError, IndexBlob};

/// A small opaque byte blob saved beside the tensors (`blobs/<name>`).
#[derive(Debug, Clone, Copy)]
pub struct Blob<'a> {
    pub name: &'a str,
    pub bytes: &'a [u8],
}

pub fn validate_blobs(blobs: &[Blob<'_>]) -> Result<(), FormatError> {
    let mut seen = HashSet::new();
    for b in blobs {
        format::validate_blob_name(b.name)?;
        if b.bytes.len() > config::BLOB_BYTES_MAX {
            return Err(FormatError::BlobName { name: b.name.to_string(), why: "blob larger than 256 MiB" });
        }
        if !seen.insert(b.name) {
            return Err(FormatError::DuplicateBlob(b.name.to_string()));
        }
    }
    Ok(())
}
/// The index's entries of `blobs`.
pub(crate) fn index_blobs(blobs: &[Blob<'_>]) -> Vec<IndexBlob> {
    blobs
        .iter()
        .map(|b| IndexBlob {
            name: b.name.to_string(),
            len_bytes: b.bytes.len() as u64,
            crc32c: crc32c::crc32c(b.bytes),
        })
        .collect()
}
