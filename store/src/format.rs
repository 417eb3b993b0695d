//! The on-disk format (see `docs/format.md`): names of folders and files,
//! the safetensors shard header, and the index that is the commit record.
//!
//! Invariants kept here:
//! - every name that reaches the file system went through [`validate_blob_name`]
//!   or is generated here (`step-…`, `rank-…`), so no path trick survives;
//! - a parsed header or index is bounds-checked before anyone uses an offset
//!   from it: data offsets are contiguous, inside the file, and match the dtype
//!   and shape.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::{self, DATA_ALIGN_BYTES, HEADER_BYTES_MAX};

pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";
pub const LATEST_FILE_NAME: &str = "latest";
pub const BLOBS_DIR_NAME: &str = "blobs";
pub const STEP_PREFIX: &str = "step-";
pub const TMP_PREFIX: &str = ".tmp-step-";
pub const DEL_PREFIX: &str = ".del-step-";
pub const LATEST_TMP_PREFIX: &str = ".latest.tmp-";
/// Scratch files of the O_DIRECT probe, when the file system lacks O_TMPFILE.
pub const PROBE_PREFIX: &str = ".ckpt-probe-";
/// A rollback in progress (the step it goes back to), in the primary;
/// recovery finishes what it names.
pub const ROLLBACK_FILE_NAME: &str = ".ckpt-rollback";
const STEP_DIGITS: usize = 12;
/// Largest step that fits the 12-digit folder name.
pub const STEP_MAX: u64 = 999_999_999_999;

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

/// Tensor names are free text for safetensors, but they end up as JSON keys
/// and in error messages: no NUL or other control characters, not empty, not
/// the reserved `__metadata__`, bounded length.
pub fn validate_tensor_name(name: &str) -> Result<(), FormatError> {
    let err = |why| Err(FormatError::TensorName { name: name.to_string(), why });
    if name.is_empty() {
        return err("empty");
    }
    if name.len() > config::TENSOR_NAME_BYTES_MAX {
        return err("longer than 1024 bytes");
    }
    if name.chars().any(char::is_control) {
        return err("contains a control character (NUL, newline, ...)");
    }
    if name == "__metadata__" {
        return err("reserved by safetensors");
    }
    Ok(())
}

/// Blob names become file names under `blobs/`: a strict alphabet, so that
/// `../`, absolute paths, NUL and hidden files are impossible.
pub fn validate_blob_name(name: &str) -> Result<(), FormatError> {
    let err = |why| Err(FormatError::BlobName { name: name.to_string(), why });
    if name.is_empty() {
        return err("empty");
    }
    if name.len() > config::BLOB_NAME_BYTES_MAX {
        return err("longer than 200 bytes");
    }
    if name.starts_with('.') {
        return err("starts with '.'");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-') {
        return err("only ASCII letters, digits, '.', '_' and '-' are allowed");
    }
    Ok(())
}

pub fn step_dir_name(step: u64) -> Result<String, FormatError> {
    if step > STEP_MAX {
        return Err(FormatError::StepTooLarge(step));
    }
    Ok(format!("{STEP_PREFIX}{step:0w$}", w = STEP_DIGITS))
}

/// Parses `step-000000000100` into 100; anything else is None.
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.len() != STEP_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

pub fn shard_file_name(rank: u32, world_size: u32, shard_idx: usize) -> String {
    format!("rank-{rank:05}-of-{world_size:05}-shard-{shard_idx:04}.safetensors")
}

/// The temp folder of a step that the sidecars of several nodes write
/// together into the shared directory (docs/format.md, "Several nodes"):
/// `.tmp-step-<12 digits>-ranks`. Its name is a function of the step alone,
/// so every node finds the same folder without speaking to the others.
pub fn ranks_tmp_name(step: u64) -> Result<String, FormatError> {
    let step_name = step_dir_name(step)?;
    Ok(format!("{TMP_PREFIX}{}{RANKS_TMP_SUFFIX}", &step_name[STEP_PREFIX.len()..]))
}

/// The step of a [`ranks_tmp_name`] folder.
pub fn parse_ranks_tmp_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(TMP_PREFIX)?.strip_suffix(RANKS_TMP_SUFFIX)?;
    parse_step_dir_name(&format!("{STEP_PREFIX}{digits}"))
}

pub const RANKS_TMP_SUFFIX: &str = "-ranks";

/// What follows a [`ranks_tmp_name`] in the name of its coordinator's
/// abort record (a file beside the folder: `nodes::abort_record_path`).
pub const RANKS_ABORT_SUFFIX: &str = ".aborted";

/// One rank's marker in a [`ranks_tmp_name`] folder: `rank-RRRRR.done`, an
/// index of that rank's files, tensors and blobs, written and synced after
/// them.
pub fn rank_marker_name(rank: u32) -> String {
    format!("rank-{rank:05}{RANK_MARKER_SUFFIX}")
}

/// The rank of a [`rank_marker_name`].
pub fn parse_rank_marker_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("rank-")?.strip_suffix(RANK_MARKER_SUFFIX)?;
    (digits.len() == 5 && digits.bytes().all(|b| b.is_ascii_digit())).then(|| digits.parse().ok()).flatten()
}

pub const RANK_MARKER_SUFFIX: &str = ".done";

/// A node's own folder of a step whose shards it holds on its local disks
/// (docs/format.md, "Node-local files"): `node-step-<12 digits>` in each of
/// the node's directories. Not a checkpoint by itself (no index): its files
/// count only through the shared directory's committed index, which names
/// the node holding each of them.
pub fn node_step_dir_name(step: u64) -> Result<String, FormatError> {
    Ok(format!("{NODE_STEP_PREFIX}{}", step_dir_name(step)?))
}

/// The step of a [`node_step_dir_name`] folder.
pub fn parse_node_step_dir_name(name: &str) -> Option<u64> {
    parse_step_dir_name(name.strip_prefix(NODE_STEP_PREFIX)?)
}

pub const NODE_STEP_PREFIX: &str = "node-";

/// A node id as the index records it (`--node-id`, default the host
/// name): 1 to 64 bytes of ASCII letters, digits, `.`, `_`, `-`, not
/// starting with `.` (it is shown in errors and logs, never a path).
pub fn validate_node_id(id: &str) -> Result<(), FormatError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(FormatError::Index(format!(
            "node id {id:?}: 1 to 64 of ASCII letters, digits, '.', '_', '-', not starting with '.'"
        )))
    }
}

/// Rank `rank`'s slice declarations beside its marker, `rank-RRRRR.slices.json`
/// (only when it declares some): JSON `{"slices": [{"piece", "of", "shape",
/// "elems"}]}`, written and synced before the marker.
pub fn rank_slices_name(rank: u32) -> String {
    format!("rank-{rank:05}.slices.json")
}

/// Whether `name` could have been produced by [`shard_file_name`].
pub fn is_shard_file_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("rank-").and_then(|r| r.strip_suffix(".safetensors")) else {
        return false;
    };
    let b = rest.as_bytes();
    // "00000-of-00001-shard-0000"
    b.len() == 25
        && b[..5].iter().all(u8::is_ascii_digit)
        && &rest[5..9] == "-of-"
        && b[9..14].iter().all(u8::is_ascii_digit)
        && &rest[14..21] == "-shard-"
        && b[21..].iter().all(u8::is_ascii_digit)
}

/// The rank that wrote a shard, from its name (`rank-RRRRR-of-...`).
pub fn rank_of_shard_file(name: &str) -> Option<u32> {
    if !is_shard_file_name(name) {
        return None;
    }
    name["rank-".len().."rank-".len() + 5].parse().ok()
}

/// One tensor in a safetensors header. `data_offsets` are relative to the
/// start of the data section, as the safetensors format defines them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data_offsets: (u64, u64),
}

/// Builds the first bytes of a shard: the 8-byte little-endian header length,
/// the JSON header, then spaces so that the data section starts at a multiple
/// of [`DATA_ALIGN_BYTES`]. Tensors must be given in file order with
/// contiguous offsets starting at 0.
pub fn encode_header(tensors: &[HeaderTensor]) -> Result<Vec<u8>, FormatError> {
    let mut json = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut expected_begin = 0u64;
    for t in tensors {
        assert_eq!(t.data_offsets.0, expected_begin, "tensors must be contiguous and in file order");
        expected_begin = t.data_offsets.1;
        json.push(',');
        json.push_str(&serde_json::to_string(&t.name).expect("a String always serialises"));
        json.push_str(":{\"dtype\":\"");
        json.push_str(t.dtype.as_str());
        json.push_str("\",\"shape\":");
        json.push_str(&serde_json::to_string(&t.shape).expect("a Vec<u64> always serialises"));
        json.push_str(&format!(",\"data_offsets\":[{},{}]}}", t.data_offsets.0, t.data_offsets.1));
    }
    json.push('}');
    let data_start = config::align_up(8 + json.len() as u64, DATA_ALIGN_BYTES) as usize;
    let header_len = data_start - 8;
    if header_len > HEADER_BYTES_MAX {
        return Err(FormatError::Header(format!(
            "header of {header_len} bytes is above the limit of {HEADER_BYTES_MAX}"
        )));
    }
    let mut out = Vec::with_capacity(data_start);
    out.extend_from_slice(&(header_len as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.resize(data_start, b' ');
    Ok(out)
}

/// A parsed and validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedHeader {
    /// Offset of the data section in the file (8 + header length).
    pub data_start: u64,
    /// Tensors in file order.
    pub tensors: Vec<HeaderTensor>,
}

/// Parses a safetensors header from the first bytes of a file whose total
/// length is `file_len_bytes`, with the checks the safetensors library makes:
/// contiguous offsets from 0, lengths that match dtype and shape, and a data
/// section that ends exactly at the end of the file.
pub fn decode_header(prefix: &[u8], file_len_bytes: u64) -> Result<ParsedHeader, FormatError> {
    let bad = |m: String| FormatError::Header(m);
    if prefix.len() < 8 {
        return Err(bad("shorter than 8 bytes".into()));
    }
    let header_len = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
    if header_len > HEADER_BYTES_MAX as u64 {
        return Err(bad(format!("header length {header_len} above the limit")));
    }
    let data_start = 8 + header_len;
    if data_start > file_len_bytes {
        return Err(bad(format!("header length {header_len} runs past the end of the file ({file_len_bytes} bytes)")));
    }
    let json = prefix.get(8..data_start as usize).ok_or_else(|| bad("header not fully read".into()))?;
    let value: serde_json::Value = serde_json::from_slice(json).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let obj = value.as_object().ok_or_else(|| bad("header is not a JSON object".into()))?;
    let mut tensors = Vec::with_capacity(obj.len());
    for (name, v) in obj {
        if name == "__metadata__" {
            continue;
        }
        validate_tensor_name(name)?;
        let t = v.as_object().ok_or_else(|| bad(format!("tensor {name:?} is not an object")))?;
        let dtype = Dtype::parse(
            t.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad(format!("tensor {name:?}: no dtype")))?,
        )?;
        let shape = t
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad(format!("tensor {name:?}: no shape")))?
            .iter()
            .map(|d| d.as_u64().ok_or_else(|| bad(format!("tensor {name:?}: bad dimension {d}"))))
            .collect::<Result<Vec<u64>, _>>()?;
        let offs = t
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad(format!("tensor {name:?}: no data_offsets")))?;
        let begin = offs[0].as_u64().ok_or_else(|| bad(format!("tensor {name:?}: bad offset")))?;
        let end = offs[1].as_u64().ok_or_else(|| bad(format!("tensor {name:?}: bad offset")))?;
        let len = tensor_len_bytes(dtype, &shape).ok_or_else(|| FormatError::ShapeOverflow {
            name: name.clone(),
            shape: shape.clone(),
            dtype,
        })?;
        if end < begin || end - begin != len {
            return Err(bad(format!(
                "tensor {name:?}: offsets [{begin},{end}] do not hold {len} bytes of {dtype} {shape:?}"
            )));
        }
        tensors.push(HeaderTensor { name: name.clone(), dtype, shape, data_offsets: (begin, end) });
    }
    tensors.sort_by_key(|t| t.data_offsets);
    let mut at = 0u64;
    for t in &tensors {
        if t.data_offsets.0 != at {
            return Err(bad(format!(
                "tensor {:?} starts at {} where {} was expected (holes or overlaps)",
                t.name, t.data_offsets.0, at
            )));
        }
        at = t.data_offsets.1;
    }
    if data_start + at != file_len_bytes {
        return Err(bad(format!("data section ends at {} but the file has {} bytes", data_start + at, file_len_bytes)));
    }
    Ok(ParsedHeader { data_start, tensors })
}

// ---------------------------------------------------------------- the index

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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexBlob {
    pub name: String,
    pub len_bytes: u64,
    pub crc32c: u32,
}

/// Seals an index's canonical JSON whose `index_crc32c` is 0: sets it to
/// the checksum of those bytes, and returns it. The field is the last one,
/// so the sealed JSON differs from the zeroed one only in that number.
pub(crate) fn seal_json(v: &mut Vec<u8>) -> u32 {
    const ZEROED: &[u8] = b"\"index_crc32c\": 0";
    let crc = crc32c::crc32c(v);
    // The last occurrence: a tensor name holding the same text comes earlier.
    let at = v.windows(ZEROED.len()).rposition(|w| w == ZEROED).expect("the index JSON ends with its checksum field")
        + ZEROED.len()
        - 1;
    v.splice(at..at + 1, crc.to_string().into_bytes());
    crc
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

    pub fn validate(&self) -> Result<(), FormatError> {
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
        let n_dirs = 1 + c.secondary_dirs.len() as u32;
        // A node-held file's dir_idx names one of its node's directories.
        let mut held: BTreeMap<&str, (&str, u32)> = BTreeMap::new();
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
        let mut blob_names = std::collections::BTreeSet::new();
        for b in &c.blobs {
            validate_blob_name(&b.name)?;
            if !blob_names.insert(&b.name) {
                return bad(format!("blob {:?} listed twice", b.name));
            }
        }
        Ok(())
    }

    /// The node holding file `name` on its own disks, if a node does
    /// ([`CkptSection::nodes`]): its id and entry.
    pub fn holder(&self, name: &str) -> Option<(&str, &IndexNode)> {
        self.ckpt.nodes.iter().find(|(_, n)| n.files.iter().any(|f| f == name)).map(|(id, n)| (id.as_str(), n))
    }

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

    /// Tensors of one file, in file order. Zero-byte tensors share their
    /// offset with a neighbour, so ties sort by end, then name (the same
    /// order the reader puts a parsed header in before comparing).
    pub fn tensors_of<'a>(&'a self, file: &'a str) -> impl Iterator<Item = (&'a String, &'a IndexTensor)> + 'a {
        let mut v: Vec<_> = self.ckpt.tensors.iter().filter(|(_, t)| t.file == file).collect();
        v.sort_by(|a, b| (a.1.data_offsets, a.0).cmp(&(b.1.data_offsets, b.0)));
        v.into_iter()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_round_trip_and_reject_others() {
        assert_eq!(step_dir_name(100).unwrap(), "step-000000000100");
        assert_eq!(parse_step_dir_name("step-000000000100"), Some(100));
        assert_eq!(parse_step_dir_name("step-100"), None);
        assert_eq!(parse_step_dir_name("step-00000000010a"), None);
        assert_eq!(parse_step_dir_name(".tmp-step-000000000100-ab"), None);
        assert!(step_dir_name(STEP_MAX + 1).is_err());
    }

    #[test]
    fn blob_names_refuse_path_tricks() {
        for bad in ["", "..", "../x", "/etc/passwd", "a/b", "a\0b", ".hidden", "a b"] {
            assert!(validate_blob_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["rng", "loader-state.pkl", "config_v2.json"] {
            validate_blob_name(good).unwrap();
        }
    }

    #[test]
    fn tensor_names_refuse_control_characters() {
        assert!(validate_tensor_name("a\0b").is_err());
        assert!(validate_tensor_name("a\nb").is_err());
        assert!(validate_tensor_name("").is_err());
        assert!(validate_tensor_name("__metadata__").is_err());
        validate_tensor_name("model.layers.0.weight").unwrap();
    }

    #[test]
    fn header_round_trips_and_is_aligned() {
        let tensors = vec![
            HeaderTensor { name: "a".into(), dtype: Dtype::F32, shape: vec![2, 3], data_offsets: (0, 24) },
            HeaderTensor { name: "b\"q".into(), dtype: Dtype::U8, shape: vec![5], data_offsets: (24, 29) },
        ];
        let h = encode_header(&tensors).unwrap();
        assert_eq!(h.len() % DATA_ALIGN_BYTES, 0);
        let parsed = decode_header(&h, h.len() as u64 + 29).unwrap();
        assert_eq!(parsed.data_start, h.len() as u64);
        assert_eq!(parsed.tensors, tensors);
        // A file one byte too long has a hole at the end: refused.
        assert!(decode_header(&h, h.len() as u64 + 30).is_err());
    }

    #[test]
    fn header_refuses_overlaps_and_bad_lengths() {
        let json = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        let mut f = (json.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(json);
        assert!(decode_header(&f, f.len() as u64 + 12).is_err());
        let json = br#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        let mut f = (json.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(json);
        assert!(decode_header(&f, f.len() as u64 + 8).is_err());
        let mut f = (u64::MAX).to_le_bytes().to_vec();
        f.extend_from_slice(b"{}");
        assert!(decode_header(&f, 10).is_err());
    }

    #[test]
    fn shard_names_are_recognised() {
        let n = shard_file_name(3, 8, 12);
        assert_eq!(n, "rank-00003-of-00008-shard-0012.safetensors");
        assert!(is_shard_file_name(&n));
        assert!(!is_shard_file_name("../rank-00003-of-00008-shard-0012.safetensors"));
        assert!(!is_shard_file_name("rank-0003-of-00008-shard-0012.safetensors"));
    }
}
