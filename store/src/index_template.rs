//! A layout's index rendered once, with holes for what changes from one
//! save to the next: the step, the blobs and every checksum. A kept save
//! plan saves the same tensors again and again; filling the holes costs a
//! copy of the JSON and a number per tensor, where building and
//! serialising a thousand entries again cost about a millisecond on the
//! commit's critical path (the index waits for the copy's checksums).
//!
//! The bytes are exactly [`crate::format::Index::to_json_bytes`] of the sealed index
//! built at once (`Layout::index`); the tests (in image.rs) compare the two.
//!
//! Invariant: the template is read from serde_json's pretty output of the
//! draft, whose layout of keys and indentation the format fixes (a key
//! `"crc32c"` can appear nowhere else: inside a JSON string its quotes are
//! escaped).

use std::collections::{BTreeMap, HashMap};

use crate::format::{self, Index, IndexBlob, IndexNode};

/// What one hole of the template takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hole {
    Step,
    /// The `[]` of `blobs`.
    Blobs,
    /// The checksum of the layout's shard `i`.
    File(usize),
    /// The checksum of the layout's tensor `i` (also each slice of it).
    Tensor(usize),
    /// The digest of the layout's tensor `i` (32 hex digits, incremental saves).
    Digest(usize),
}

/// The draft's digest value: 32 zeros, replaced at render.
const DIGEST_ZEROS: &[u8] = b"00000000000000000000000000000000";

#[derive(Debug)]
pub(crate) struct IndexTemplate {
    /// The directories and holders the template names; another set gets
    /// its own.
    secondary_dirs: Vec<String>,
    nodes: BTreeMap<String, IndexNode>,
    /// The draft's JSON: step 0, no blobs, every checksum 0.
    json: Vec<u8>,
    /// In document order: the offset of the placeholder and what goes there.
    holes: Vec<(usize, Hole)>,
}

impl IndexTemplate {
    /// Reads the holes of `draft` (an index with step 0, no blobs and
    /// every checksum 0) whose tensors are `names` (a layout's, in its
    /// order: a checksum is named by its index there); `None` if the JSON is
    /// not laid out as this module expects (a bug: the caller then builds
    /// the index at once).
    pub(crate) fn new<'a>(draft: &Index, names: impl Iterator<Item = &'a str>) -> Option<IndexTemplate> {
        let json = draft.to_json_bytes();
        let ckpt = find(&json, b"\n  \"ckpt\": {\n", 0)?;
        let step = find(&json, b"\n    \"step\": 0,\n", ckpt)? + b"\n    \"step\": ".len();
        let blobs = find(&json, b"\n    \"blobs\": [],\n", ckpt)? + b"\n    \"blobs\": ".len();
        // Checksums in document order: files, tensors (by name), slices.
        let by_name: HashMap<&str, usize> = names.enumerate().map(|(i, n)| (n, i)).collect();
        let c = &draft.ckpt;
        let owners = (0..c.files.len())
            .map(Hole::File)
            .chain(
                c.tensors
                    .keys()
                    .map(|n| by_name.get(n.as_str()).map(|&i| Hole::Tensor(i)))
                    .collect::<Option<Vec<_>>>()?,
            )
            .chain(
                c.slices
                    .values()
                    .flat_map(|l| &l.slices)
                    .map(|s| by_name.get(s.tensor.as_str()).map(|&i| Hole::Tensor(i)))
                    .collect::<Option<Vec<_>>>()?,
            );
        const CRC: &[u8] = b"\"crc32c\": 0";
        let mut holes = vec![(step, Hole::Step), (blobs, Hole::Blobs)];
        let mut at = ckpt;
        for owner in owners {
            at = find(&json, CRC, at)? + CRC.len();
            holes.push((at - 1, owner));
        }
        if find(&json, CRC, at).is_some() {
            return None;
        }
        // Digests (incremental layouts' drafts carry zeros): tensors by name.
        const DIGEST: &[u8] = b"\"xxh128\": \"00000000000000000000000000000000\"";
        let mut at = ckpt;
        for (n, t) in &c.tensors {
            if t.xxh128.is_none() {
                continue;
            }
            let i = *by_name.get(n.as_str())?;
            at = find(&json, DIGEST, at)? + DIGEST.len();
            holes.push((at - 1 - DIGEST_ZEROS.len(), Hole::Digest(i)));
        }
        if find(&json, DIGEST, at).is_some() {
            return None;
        }
        holes.sort_by_key(|&(at, _)| at);
        // The checksum field comes after the last hole, in the tail that
        // the last piece of a render holds ([`IndexTemplate::render_pieces`]).
        let last = holes.last().map_or(0, |&(at, _)| at);
        find(&json, format::ZEROED_CRC_FIELD, last)?;
        Some(IndexTemplate { secondary_dirs: c.secondary_dirs.clone(), nodes: c.nodes.clone(), json, holes })
    }

    pub(crate) fn names(&self, secondary_dirs: &[String], nodes: &BTreeMap<String, IndexNode>) -> bool {
        self.secondary_dirs == secondary_dirs && self.nodes == *nodes
    }

    /// Whether the template has holes for digests.
    pub(crate) fn has_digests(&self) -> bool {
        self.holes.iter().any(|(_, h)| matches!(h, Hole::Digest(_)))
    }

    /// The sealed index's bytes, given what fills the holes (checksums of
    /// the files and tensors in the layout's order, the tensors' digests
    /// when the template has holes for them, [`IndexTemplate::has_digests`],
    /// and the blobs' entries), handed to `out` in pieces of about
    /// `piece_bytes` as they are filled, the checksum being summed on the
    /// way: its field comes last, so every piece but the last is final
    /// before the last is filled. A writer can write (and start syncing)
    /// the first megabytes of a large index while the rest is filled.
    /// Returns the last piece, sealed (the whole index when no piece
    /// reached `piece_bytes`: nothing is copied twice).
    pub(crate) fn render_pieces(
        &self,
        f: &Filled<'_>,
        piece_bytes: usize,
        out: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<Vec<u8>> {
        let cap = piece_bytes.min(self.json.len() + 12 * self.holes.len() + f.blobs.len() * 128 + 64);
        let mut buf = Vec::with_capacity(cap + 4096);
        let mut crc = 0u32;
        let mut from = 0;
        for &(at, hole) in &self.holes {
            buf.extend_from_slice(&self.json[from..at]);
            from = at + 1;
            match hole {
                Hole::Step => push_decimal(&mut buf, f.step),
                Hole::File(i) => push_decimal(&mut buf, f.file_crcs[i].into()),
                Hole::Tensor(i) => push_decimal(&mut buf, f.tensor_crcs[i].into()),
                Hole::Digest(i) => {
                    from = at + DIGEST_ZEROS.len();
                    crate::digest::push_hex(&mut buf, f.digests[i]);
                }
                Hole::Blobs => {
                    from = at + 2;
                    buf.extend_from_slice(&nested_blobs(f.blobs));
                }
            }
            if buf.len() >= piece_bytes {
                crc = crc32c::crc32c_append(crc, &buf);
                out(&buf)?;
                buf.clear();
            }
        }
        // The tail holds the checksum field (checked by `new`).
        buf.extend_from_slice(&self.json[from..]);
        format::seal_json_after(crc, &mut buf);
        Ok(buf)
    }
}

/// What fills a template's holes ([`IndexTemplate::render_pieces`]).
pub(crate) struct Filled<'a> {
    pub step: u64,
    pub file_crcs: &'a [u32],
    pub tensor_crcs: &'a [u32],
    pub digests: &'a [u128],
    pub blobs: &'a [IndexBlob],
}

/// Appends `v` in decimal, as JSON writes it (one per tensor: no
/// formatter or allocation each).
fn push_decimal(out: &mut Vec<u8>, mut v: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// `blobs` as the pretty JSON of the index holds them, two levels deep.
fn nested_blobs(blobs: &[IndexBlob]) -> Vec<u8> {
    let list = serde_json::to_vec_pretty(blobs).expect("blob entries serialise");
    let mut out = Vec::with_capacity(list.len() + 64);
    for &b in &list {
        out.push(b);
        if b == b'\n' {
            out.extend_from_slice(b"    ");
        }
    }
    out
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|i| i + from)
}

#[cfg(test)]
mod tests {
    #[test]
    fn decimals_are_written_as_json_writes_them() {
        for v in [0u64, 7, 10, 99, 100, u32::MAX as u64, 1_000_000_000_000, u64::MAX] {
            let mut out = b"x".to_vec();
            super::push_decimal(&mut out, v);
            assert_eq!(out, format!("x{v}").into_bytes());
        }
    }
}
