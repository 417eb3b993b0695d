//! The checks every read makes: each shard file checked from a stream of its
//! bytes in order ([`FileCheck`]: header against the index, each tensor's
//! crc32c, the file's), every blob against the index, the Python skeleton
//! against the tensors held; problems in slices named by their logical
//! tensor.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use super::{problem, Problem};
use crate::config;
use crate::format::{self, Index, BLOBS_DIR_NAME};
use crate::skeleton;

/// A problem found in a stored tensor that is a slice names the logical
/// tensor and says which slice: `FILE: tensor "w": slice elems [a, b) of
/// rank R (stored as "w#…"): checksum mismatch …`.
pub(crate) fn name_slices(index: &Index, problems: &mut [Problem]) {
    if index.ckpt.slices.is_empty() {
        return;
    }
    for p in problems {
        let Some((logical, s)) = p.tensor.as_deref().and_then(|t| index.slice_of(t)) else { continue };
        p.what = format!(
            "slice elems [{}, {}) of rank {} (stored as {:?}): {}",
            s.elems[0], s.elems[1], s.rank, s.tensor, p.what
        );
        p.tensor = Some(logical.to_string());
    }
}

/// A checkpoint whose Python skeleton names a tensor it does not hold does
/// not load (crate::skeleton): a problem of its `structure.pkl`.
pub(crate) fn check_skeleton(index: &Index, blobs: &BTreeMap<String, Vec<u8>>, problems: &mut Vec<Problem>) {
    let missing = skeleton::missing_from_index(index, blobs.get(skeleton::STRUCTURE_BLOB).map(Vec::as_slice));
    if !missing.is_empty() {
        let file = format!("{BLOBS_DIR_NAME}/{}", skeleton::STRUCTURE_BLOB);
        problems.push(problem(Some(&file), None, skeleton::describe_missing(&missing)));
    }
}

pub(super) fn read_blobs(step_dir: &Path, index: &Index, out: &mut BTreeMap<String, Vec<u8>>) -> Vec<Problem> {
    check_blobs(index, out, |name, _| fs::read(step_dir.join(BLOBS_DIR_NAME).join(name)).map_err(|e| e.to_string()))
}

/// Every blob of the step read by `read(name, len from the index)` and
/// checked against the index (length, crc32c) into `out`: the problems.
pub(crate) fn check_blobs(
    index: &Index,
    out: &mut BTreeMap<String, Vec<u8>>,
    mut read: impl FnMut(&str, usize) -> Result<Vec<u8>, String>,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    for b in &index.ckpt.blobs {
        let file = format!("{BLOBS_DIR_NAME}/{}", b.name);
        match read(&b.name, b.len_bytes as usize) {
            Err(e) => problems.push(problem(Some(&file), None, format!("cannot read: {e}"))),
            Ok(bytes) if bytes.len() as u64 != b.len_bytes => problems.push(problem(
                Some(&file),
                None,
                format!("{} bytes where the index says {}", bytes.len(), b.len_bytes),
            )),
            Ok(bytes) => {
                let crc = crc32c::crc32c(&bytes);
                if crc != b.crc32c {
                    problems.push(problem(
                        Some(&file),
                        None,
                        format!("checksum mismatch (index {:#010x}, file {crc:#010x})", b.crc32c),
                    ));
                } else {
                    out.insert(b.name.clone(), bytes);
                }
            }
        }
    }
    problems
}

/// Checks one file from a stream of its bytes in order: the header (kept
/// until whole), then each tensor's crc32c computed incrementally, and the
/// file's crc32c combined from them.
pub(crate) struct FileCheck<'a> {
    pub(super) file: &'a format::IndexFile,
    tensors: Vec<(&'a String, &'a format::IndexTensor)>,
    /// Bytes fed so far.
    pos: u64,
    header: Vec<u8>,
    data_start: Option<u64>,
    next: usize,
    tensor_crc: u32,
    file_crc: u32,
    failed: bool,
}

impl<'a> FileCheck<'a> {
    pub(crate) fn new(
        file: &'a format::IndexFile,
        tensors: Vec<(&'a String, &'a format::IndexTensor)>,
    ) -> FileCheck<'a> {
        FileCheck {
            file,
            tensors,
            pos: 0,
            header: Vec::new(),
            data_start: None,
            next: 0,
            tensor_crc: 0,
            file_crc: 0,
            failed: false,
        }
    }

    fn fail(&mut self, problems: &mut Vec<Problem>, what: String) {
        problems.push(problem(Some(&self.file.name), None, what));
        self.failed = true;
    }

    pub(crate) fn feed(&mut self, mut bytes: &[u8], problems: &mut Vec<Problem>) {
        let f = self.file;
        while !bytes.is_empty() && !self.failed {
            let Some(ds) = self.data_start else {
                // Header: 8 length bytes, then that many bytes of JSON.
                let want = if self.header.len() < 8 {
                    8
                } else {
                    let hlen = u64::from_le_bytes(self.header[..8].try_into().expect("8 bytes"));
                    if hlen > config::HEADER_BYTES_MAX as u64 || 8 + hlen > f.len_bytes {
                        let e = format::decode_header(&self.header, f.len_bytes)
                            .err()
                            .map_or_else(|| "bad header length".to_string(), |e| e.to_string());
                        return self.fail(problems, e);
                    }
                    8 + hlen as usize
                };
                let take = (want - self.header.len()).min(bytes.len());
                self.header.extend_from_slice(&bytes[..take]);
                self.pos += take as u64;
                bytes = &bytes[take..];
                let whole = self.header.len() >= 8
                    && self.header.len() as u64
                        == 8 + u64::from_le_bytes(self.header[..8].try_into().expect("8 bytes"));
                if whole {
                    self.parse_header(problems);
                }
                continue;
            };
            self.finish_tensors_ending_at_pos(problems);
            let Some(&(_, t)) = self.tensors.get(self.next) else {
                return self.fail(problems, "bytes after the last tensor".to_string());
            };
            let end = ds + t.data_offsets[1];
            let take = ((end - self.pos) as usize).min(bytes.len());
            self.tensor_crc = crc32c::crc32c_append(self.tensor_crc, &bytes[..take]);
            self.pos += take as u64;
            bytes = &bytes[take..];
            self.finish_tensors_ending_at_pos(problems);
        }
    }

    fn parse_header(&mut self, problems: &mut Vec<Problem>) {
        match format::decode_header(&self.header, self.file.len_bytes) {
            Err(e) => self.fail(problems, e.to_string()),
            Ok(h) => {
                let listed: Vec<_> = self
                    .tensors
                    .iter()
                    .map(|(n, t)| (n.as_str(), t.dtype, t.shape.as_slice(), t.data_offsets))
                    .collect();
                let mut found: Vec<_> = h
                    .tensors
                    .iter()
                    .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), [t.data_offsets.0, t.data_offsets.1]))
                    .collect();
                // File order, ties (zero-byte tensors) by name: as tensors_of.
                found.sort_by(|a, b| (a.3, a.0).cmp(&(b.3, b.0)));
                if listed != found {
                    return self.fail(problems, "safetensors header disagrees with the index".to_string());
                }
                self.data_start = Some(h.data_start);
                self.file_crc = crc32c::crc32c(&self.header);
                self.header = Vec::new();
                // Zero-byte tensors right after the header end here: a file
                // holding only those has no byte after it to close them.
                self.finish_tensors_ending_at_pos(problems);
            }
        }
    }

    /// Closes every tensor whose last byte has been fed (empty ones included).
    fn finish_tensors_ending_at_pos(&mut self, problems: &mut Vec<Problem>) {
        let ds = self.data_start.expect("header parsed");
        while let Some(&(name, t)) = self.tensors.get(self.next) {
            if ds + t.data_offsets[1] > self.pos {
                return;
            }
            if self.tensor_crc != t.crc32c {
                problems.push(problem(
                    Some(&self.file.name),
                    Some(name),
                    format!("checksum mismatch (index {:#010x}, data {:#010x})", t.crc32c, self.tensor_crc),
                ));
            }
            self.file_crc = crate::crc::combine(self.file_crc, self.tensor_crc, t.data_offsets[1] - t.data_offsets[0]);
            self.tensor_crc = 0;
            self.next += 1;
        }
    }

    /// Where the file's data section starts, once its header was parsed.
    pub(crate) fn data_start(&self) -> Option<u64> {
        self.data_start
    }

    pub(crate) fn finish(&self, problems: &mut Vec<Problem>) {
        let f = self.file;
        if self.failed || problems.iter().any(|p| p.file.as_deref() == Some(&f.name)) {
            return;
        }
        if self.pos != f.len_bytes || self.next != self.tensors.len() {
            problems.push(problem(Some(&f.name), None, format!("only {} of {} bytes checked", self.pos, f.len_bytes)));
        } else if self.file_crc != f.crc32c {
            problems.push(problem(
                Some(&f.name),
                None,
                format!("file checksum mismatch (index {:#010x}, file {:#010x})", f.crc32c, self.file_crc),
            ));
        }
    }
}
