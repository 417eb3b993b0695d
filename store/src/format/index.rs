//! `model.safetensors.index.json`, the commit record: its types, its
//! canonical JSON and own checksum, and the validation a reader runs before
//! trusting any name or offset in it.
//!
//! Invariants: the JSON bytes are a pure function of the checkpoint
//! (BTreeMaps, one serialisation); an index from [`Index::from_json_bytes`]
//! matches its own checksum and passed [`Index::validate`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{
    is_shard_file_name, tensor_len_bytes, validate_blob_name, validate_node_id, validate_slices, validate_tensor_name,
    Dtype, FormatError, IndexSliced, STEP_MAX,
};
use crate::config;

/// `model.safetensors.index.json`: Hugging Face's shape (`metadata`,
/// `weight_map`) plus our `ckpt` section. Maps are BTreeMaps so that the
/// bytes are a pure function of the checkpoint (golden files).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Index {
    pub metadata: IndexMetadata,
    pub weight_map: BTreeMap<String, String>,
    pub ckpt: CkptSection,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexMetadata {
    /// Sum of tensor bytes, as Hugging Face writes it.
    pub total_size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CkptSection {
    pub format_version: u32,
    pub step: u64,
    pub world_size: u32,
    /// Target directories beyond the primary (absolute paths at write time),
    /// in the order `dir_idx` 1, 2, ... refers to them.
    pub secondary_dirs: Vec<String>,
    pub files: Vec<IndexFile>,
    pub tensors: BTreeMap<String, IndexTensor>,
    pub blobs: Vec<IndexBlob>,
    /// Logical tensors stored in pieces (several ranks' parts of one
    /// tensor), by logical name; absent when there are none (format
    /// version 1). Each piece is also an ordinary tensor of `tensors`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub slices: BTreeMap<String, IndexSliced>,
    /// Node-local files (several nodes, `--node-local`): by node id, the
    /// node's directories and the files it holds there, in its
    /// `node-step-…` folders (docs/format.md, "Node-local files"); the
    /// `dir_idx` of such a file is an index into that node's `dirs`.
    /// Absent when every file is in the index's own directories.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub nodes: BTreeMap<String, IndexNode>,
    /// crc32c of this index's canonical JSON with this field set to 0, so a
    /// flipped byte in the commit record itself is caught too.
    pub index_crc32c: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexFile {
    pub name: String,
    /// 0 = the primary directory (the one holding the index).
    pub dir_idx: u32,
    pub len_bytes: u64,
    /// crc32c of the whole file.
    pub crc32c: u32,
}

/// One node's files of a step ([`CkptSection::nodes`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexNode {
    /// The node's directories (absolute paths at write time, its `--dir`
    /// first, then its `--secondary`s), each holding a `node-step-…` folder.
    pub dirs: Vec<String>,
    /// Names of the files of `files` this node holds.
    pub files: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexTensor {
    pub file: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Relative to the shard's data section, as in the safetensors header.
    pub data_offsets: [u64; 2],
    pub crc32c: u32,
    /// The tensor's digest ([`crate::digest`]: XXH3-128 over 1 MiB blocks),
    /// 32 lowercase hex digits; written by incremental saves (format
    /// version 3), absent otherwise. It decides "unchanged since the last
    /// committed step"; integrity stays `crc32c`'s job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xxh128: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexBlob {
    pub name: String,
    pub len_bytes: u64,
    pub crc32c: u32,
}

/// Node-held files by name ([`CkptSection::nodes`]): the node's id and how
/// many directories it has.
type HeldFiles<'a> = BTreeMap<&'a str, (&'a str, u32)>;

/// The checksum field of an index not yet sealed ([`seal_json`]).
pub(crate) const ZEROED_CRC_FIELD: &[u8] = b"\"index_crc32c\": 0";

/// Seals an index's canonical JSON whose `index_crc32c` is 0: sets it to
/// the checksum of those bytes, and returns it. The field is the last one,
/// so the sealed JSON differs from the zeroed one only in that number.
pub(crate) fn seal_json(v: &mut Vec<u8>) -> u32 {
    seal_json_after(0, v)
}

/// [`seal_json`] of the index whose bytes are those summed in `crc_before`
/// (crc32c, as `crc32c_append` continues it) followed by `tail`, which
/// holds the zeroed checksum field: seals `tail` in place.
pub(crate) fn seal_json_after(crc_before: u32, tail: &mut Vec<u8>) -> u32 {
    let crc = crc32c::crc32c_append(crc_before, tail);
    // The last occurrence: a tensor name holding the same text comes earlier.
    let at = tail
        .windows(ZEROED_CRC_FIELD.len())
        .rposition(|w| w == ZEROED_CRC_FIELD)
        .expect("the index JSON ends with its checksum field")
        + ZEROED_CRC_FIELD.len()
        - 1;
    tail.splice(at..at + 1, crc.to_string().into_bytes());
    crc
}

/// crc32c of `bytes` with the number of their last `"index_crc32c": N`
/// field read as 0 ([`seal_json`]'s input when they are a sealed canonical
/// index); None without such a field.
fn sealed_crc32c(bytes: &[u8]) -> Option<u32> {
    const FIELD: &[u8] = b"\"index_crc32c\": ";
    let start = bytes.windows(FIELD.len()).rposition(|w| w == FIELD)? + FIELD.len();
    let end = start + bytes[start..].iter().take_while(|b| b.is_ascii_digit()).count();
    let head = crc32c::crc32c_append(crc32c::crc32c(&bytes[..start]), b"0");
    Some(crc32c::crc32c_append(head, &bytes[end..]))
}

/// An index's blobs: each a valid name, listed once.
pub(crate) fn validate_blobs(blobs: &[IndexBlob]) -> Result<(), FormatError> {
    let mut names = std::collections::BTreeSet::new();
    for b in blobs {
        validate_blob_name(&b.name)?;
        if !names.insert(&b.name) {
            return Err(FormatError::Index(format!("blob {:?} listed twice", b.name)));
        }
    }
    Ok(())
}

impl Index {
    pub fn to_json_bytes(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).expect("the index always serialises");
        v.push(b'\n');
        v
    }

    /// crc32c of the canonical JSON with `index_crc32c` zeroed.
    pub fn content_crc32c(&self) -> u32 {
        let mut c = self.clone();
        c.ckpt.index_crc32c = 0;
        crc32c::crc32c(&c.to_json_bytes())
    }

    /// Sets `index_crc32c`; the writer calls it last.
    pub fn seal(&mut self) {
        self.sealed_json_bytes();
    }

    /// Seals the index and returns its bytes, serialising it once.
    pub fn sealed_json_bytes(&mut self) -> Vec<u8> {
        self.ckpt.index_crc32c = 0;
        let mut v = self.to_json_bytes();
        self.ckpt.index_crc32c = seal_json(&mut v);
        v
    }

    /// Parses and validates an index: its own checksum matches, every name is
    /// valid, every tensor points at a listed file with consistent offsets,
    /// every file at a known directory.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Index, FormatError> {
        let index: Index = serde_json::from_slice(bytes).map_err(|e| FormatError::Index(e.to_string()))?;
        // The bytes as sealed (what our writer wrote: canonical) match
        // without serialising the index again, a pass as long as the parse
        // for an index of many tensors; any other bytes are checked as
        // their canonical form.
        if sealed_crc32c(bytes) == Some(index.ckpt.index_crc32c) {
            index.validate()?;
            return Ok(index);
        }
        let crc = index.content_crc32c();
        if crc != index.ckpt.index_crc32c {
            return Err(FormatError::Index(format!(
                "index checksum mismatch (recorded {:#010x}, content {crc:#010x})",
                index.ckpt.index_crc32c
            )));
        }
        index.validate()?;
        Ok(index)
    }

    /// Checks what [`Index::from_json_bytes`] promises beyond the JSON's
    /// shape, in this order: the format version and what it allows, the
    /// nodes and files, the tensors, then the totals, slices and blobs.
    pub fn validate(&self) -> Result<(), FormatError> {
        let bad = |m: String| Err(FormatError::Index(m));
        let c = &self.ckpt;
        self.validate_version()?;
        let (files, held) = self.validate_files()?;
        let total = self.validate_tensors(&files)?;
        if let Some(f) = held.keys().next() {
            return bad(format!("a node holds file {f:?}, which the index does not list"));
        }
        if self.weight_map.len() != c.tensors.len() {
            return bad("weight_map lists tensors the ckpt section does not".into());
        }
        if total != self.metadata.total_size {
            return bad(format!("total_size {} but tensors hold {}", self.metadata.total_size, total));
        }
        validate_slices(&c.tensors, &c.slices)?;
        validate_blobs(&c.blobs)
    }

    /// The format version is one this build reads, and allows the
    /// sections present (slices, digests); the step fits its folder name.
    fn validate_version(&self) -> Result<(), FormatError> {
        let bad = |m: String| Err(FormatError::Index(m));
        let c = &self.ckpt;
        if !(config::FORMAT_VERSION_OLDEST..=config::FORMAT_VERSION).contains(&c.format_version) {
            return bad(format!(
                "format version {} is not supported (this build reads {} to {})",
                c.format_version,
                config::FORMAT_VERSION_OLDEST,
                config::FORMAT_VERSION
            ));
        }
        if !c.slices.is_empty() && c.format_version < 2 {
            return bad(format!("format version {} has no slices, but the index lists some", c.format_version));
        }
        for (name, t) in &c.tensors {
            match &t.xxh128 {
                None => {}
                Some(_) if c.format_version < 3 => {
                    return bad(format!(
                        "format version {} has no digests, but tensor {name:?} has one",
                        c.format_version
                    ))
                }
                Some(d) if crate::digest::parse_hex(d).is_none() => {
                    return bad(format!("tensor {name:?}: xxh128 {d:?} is not 32 lowercase hex digits"))
                }
                Some(_) => {}
            }
        }
        if c.step > STEP_MAX {
            return bad(format!("step {} too large", c.step));
        }
        Ok(())
    }

    /// The nodes and the files: valid names of this world, each in a
    /// directory that exists (its node's, for a node-held file), listed
    /// once. Returns the files by name and the node-held names no file
    /// claimed (the caller refuses them after the tensors).
    fn validate_files(&self) -> Result<(BTreeMap<&str, &IndexFile>, HeldFiles<'_>), FormatError> {
        let bad = |m: String| Err(FormatError::Index(m));
        let c = &self.ckpt;
        let n_dirs = 1 + c.secondary_dirs.len() as u32;
        // A node-held file's dir_idx names one of its node's directories.
        let mut held: HeldFiles<'_> = BTreeMap::new();
        for (id, n) in &c.nodes {
            validate_node_id(id)?;
            if n.dirs.is_empty() {
                return bad(format!("node {id:?} lists no directory"));
            }
            for f in &n.files {
                if held.insert(f.as_str(), (id.as_str(), n.dirs.len() as u32)).is_some() {
                    return bad(format!("file {f:?} held by two nodes"));
                }
            }
        }
        let mut files = BTreeMap::new();
        for f in &c.files {
            if !is_shard_file_name(&f.name) {
                return bad(format!("file name {:?} is not a shard name", f.name));
            }
            let of = &f.name["rank-00000-of-".len().."rank-00000-of-00000".len()];
            if of.parse::<u32>().ok() != Some(c.world_size) {
                return bad(format!(
                    "file {:?} was written by a world of {of}, the index says {}",
                    f.name, c.world_size
                ));
            }
            match held.remove(f.name.as_str()) {
                Some((node, n)) if f.dir_idx >= n => {
                    return bad(format!("file {:?} names directory {} of node {node:?}'s {n}", f.name, f.dir_idx))
                }
                Some(_) => {}
                None if f.dir_idx >= n_dirs => {
                    return bad(format!("file {:?} names directory {} of {}", f.name, f.dir_idx, n_dirs))
                }
                None => {}
            }
            if files.insert(f.name.as_str(), f).is_some() {
                return bad(format!("file {:?} listed twice", f.name));
            }
        }
        Ok((files, held))
    }

    /// Every tensor: a valid name in a listed file, offsets that fit its
    /// dtype and shape inside the file, the same file in `weight_map`.
    /// Returns the tensors' bytes.
    fn validate_tensors(&self, files: &BTreeMap<&str, &IndexFile>) -> Result<u64, FormatError> {
        let bad = |m: String| Err(FormatError::Index(m));
        let c = &self.ckpt;
        let mut total = 0u64;
        for (name, t) in &c.tensors {
            validate_tensor_name(name)?;
            let Some(f) = files.get(t.file.as_str()) else {
                return bad(format!("tensor {name:?} names unknown file {:?}", t.file));
            };
            let len = tensor_len_bytes(t.dtype, &t.shape).ok_or_else(|| FormatError::ShapeOverflow {
                name: name.clone(),
                shape: t.shape.clone(),
                dtype: t.dtype,
            })?;
            let [b, e] = t.data_offsets;
            if e < b || e - b != len || e > f.len_bytes {
                return bad(format!("tensor {name:?}: offsets [{b},{e}] do not fit {len} bytes in file {:?}", t.file));
            }
            if self.weight_map.get(name) != Some(&t.file) {
                return bad(format!("tensor {name:?}: weight_map disagrees with the ckpt section"));
            }
            total += len;
        }
        Ok(total)
    }

    /// The node holding file `name` on its own disks, if a node does
    /// ([`CkptSection::nodes`]): its id and entry.
    pub fn holder(&self, name: &str) -> Option<(&str, &IndexNode)> {
        self.ckpt.nodes.iter().find(|(_, n)| n.files.iter().any(|f| f == name)).map(|(id, n)| (id.as_str(), n))
    }

    /// Tensors of one file, in file order. Zero-byte tensors share their
    /// offset with a neighbour, so ties sort by end, then name (the same
    /// order the reader puts a parsed header in before comparing).
    pub fn tensors_of<'a>(&'a self, file: &'a str) -> impl Iterator<Item = (&'a String, &'a IndexTensor)> + 'a {
        let mut v: Vec<_> = self.ckpt.tensors.iter().filter(|(_, t)| t.file == file).collect();
        v.sort_by(|a, b| (a.1.data_offsets, a.0).cmp(&(b.1.data_offsets, b.0)));
        v.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::{Layout, TensorSpec};

    fn sealed() -> Index {
        // A tensor name holding the checksum field's text comes before the field itself.
        let specs = ["w", "\"index_crc32c\": 17", "z"]
            .map(|n| TensorSpec { name: n.into(), dtype: Dtype::F32, shape: vec![4] })
            .to_vec();
        Layout::plan(specs, Default::default()).unwrap().index(7, &[1, 2, 3], &[], vec![])
    }

    #[test]
    fn an_index_reads_back_as_sealed_or_in_another_spelling_and_a_changed_byte_is_refused() {
        let i = sealed();
        let bytes = i.to_json_bytes();
        assert_eq!(sealed_crc32c(&bytes), Some(i.ckpt.index_crc32c));
        assert_eq!(Index::from_json_bytes(&bytes).unwrap(), i);
        // Not as our writer spells it: checked as its canonical form.
        let compact = serde_json::to_vec(&i).unwrap();
        assert_ne!(sealed_crc32c(&compact), Some(i.ckpt.index_crc32c));
        assert_eq!(Index::from_json_bytes(&compact).unwrap(), i);
        let text = String::from_utf8(bytes).unwrap();
        let recorded = format!("\"index_crc32c\": {}", i.ckpt.index_crc32c);
        for changed in [
            text.replacen("\"step\": 7", "\"step\": 8", 1),
            text.replacen("\"crc32c\": 2", "\"crc32c\": 3", 1),
            text.replacen(&recorded, &format!("\"index_crc32c\": {}", i.ckpt.index_crc32c ^ 1), 1),
            text.replacen(&recorded, "\"index_crc32c\": 0", 1),
        ] {
            assert_ne!(changed, text);
            let e = Index::from_json_bytes(changed.as_bytes()).unwrap_err().to_string();
            assert!(e.contains("checksum mismatch"), "{e}");
        }
    }
}
