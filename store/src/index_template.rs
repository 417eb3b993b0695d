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
    /// How many files and named tensors the holes name.
    n_files: usize,
    n_tensors: usize,
    /// Where the checksum field (`"index_crc32c": 0`) begins.
    crc_field: usize,
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
        let n_tensors = by_name.len();
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
        let crc_field = find(&json, format::ZEROED_CRC_FIELD, last)?;
        Some(IndexTemplate {
            secondary_dirs: c.secondary_dirs.clone(),
            nodes: c.nodes.clone(),
            json,
            holes,
            n_files: c.files.len(),
            n_tensors,
            crc_field,
        })
    }

    /// The template of an index read back (a rank's marker, whose own
    /// holes are its step, blobs, checksums and digests): its tensors named
    /// in their order in the index.
    pub(crate) fn of_index(index: &Index) -> Option<IndexTemplate> {
        IndexTemplate::new(&draft_of(index), index.ckpt.tensors.keys().map(String::as_str))
    }

    /// The bytes of this template's JSON, the placeholders' included.
    pub(crate) fn len_bytes(&self) -> usize {
        self.json.len()
    }

    /// What fills the holes of `bytes`, a sealed index laid out exactly as
    /// this template (every byte outside the holes the same) whose checksum
    /// matches; None when it is not one (another layout, a value written
    /// otherwise than JSON writes it, a damaged byte): the caller parses
    /// it. A pass over the bytes, where parsing them builds every entry.
    pub(crate) fn read(&self, bytes: &[u8]) -> Option<Values> {
        let mut v = Values {
            step: 0,
            file_crcs: vec![0; self.n_files],
            tensor_crcs: vec![0; self.n_tensors],
            digests: vec![0; self.n_tensors],
            blobs: Vec::new(),
            index_crc32c: 0,
        };
        // A tensor's checksum comes again in each slice of it.
        let mut read_once = vec![false; self.n_tensors];
        let (mut from, mut pos) = (0, 0);
        for (k, &(at, hole)) in self.holes.iter().enumerate() {
            let lit = &self.json[from..at];
            if bytes.get(pos..pos + lit.len())? != lit {
                return None;
            }
            pos += lit.len();
            from = at + 1;
            match hole {
                Hole::Step => v.step = read_decimal(bytes, &mut pos)?,
                Hole::File(i) => v.file_crcs[i] = u32::try_from(read_decimal(bytes, &mut pos)?).ok()?,
                Hole::Tensor(i) => {
                    let crc = u32::try_from(read_decimal(bytes, &mut pos)?).ok()?;
                    if std::mem::replace(&mut read_once[i], true) && v.tensor_crcs[i] != crc {
                        return None;
                    }
                    v.tensor_crcs[i] = crc;
                }
                Hole::Digest(i) => {
                    let hex = bytes.get(pos..pos + DIGEST_ZEROS.len())?;
                    v.digests[i] = crate::digest::parse_hex(std::str::from_utf8(hex).ok()?)?;
                    pos += DIGEST_ZEROS.len();
                    from = at + DIGEST_ZEROS.len();
                }
                Hole::Blobs => {
                    // The list ends where the text after it begins: the
                    // next key of the section (`,`, a newline, four spaces
                    // and a quote), up to the next hole or the checksum's
                    // number. Nothing inside the list holds that: its lines
                    // are indented by six or eight, and a name's newline is
                    // escaped.
                    from = at + 2;
                    let crc_number = self.crc_field + format::ZEROED_CRC_FIELD.len() - 1;
                    let next = &self.json[from..self.holes.get(k + 1).map_or(crc_number, |h| h.0)];
                    if !next.starts_with(b",\n    \"") {
                        return None;
                    }
                    let end = find(bytes, next, pos)?;
                    let list = &bytes[pos..end];
                    v.blobs = serde_json::from_slice(list).ok()?;
                    if nested_blobs(&v.blobs) != list {
                        return None;
                    }
                    pos = end;
                }
            }
        }
        // The tail: the checksum field's number, then the same bytes.
        let tail = &self.json[from..];
        let zero = self.crc_field + format::ZEROED_CRC_FIELD.len() - 1 - from;
        if bytes.get(pos..pos + zero)? != &tail[..zero] {
            return None;
        }
        let mut end = pos + zero;
        v.index_crc32c = u32::try_from(read_decimal(bytes, &mut end)?).ok()?;
        if bytes[end..] != tail[zero + 1..] {
            return None;
        }
        let head = crc32c::crc32c_append(crc32c::crc32c(&bytes[..pos + zero]), b"0");
        (crc32c::crc32c_append(head, &bytes[end..]) == v.index_crc32c).then_some(v)
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

/// What an index laid out as a template holds in its holes
/// ([`IndexTemplate::read`]), by the template's files and tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Values {
    pub step: u64,
    pub file_crcs: Vec<u32>,
    pub tensor_crcs: Vec<u32>,
    /// 0 for a tensor without one.
    pub digests: Vec<u128>,
    pub blobs: Vec<IndexBlob>,
    pub index_crc32c: u32,
}

impl Values {
    /// Tensor `i`'s entry (the template's `i`-th name) with the values
    /// read: its checksum, and its digest where it has one.
    pub(crate) fn set_tensor(&self, i: usize, t: &mut format::IndexTensor) {
        t.crc32c = self.tensor_crcs[i];
        if t.xxh128.is_some() {
            t.xxh128 = Some(crate::digest::to_hex(self.digests[i]));
        }
    }
}

/// The draft of an index ([`IndexTemplate::new`]'s input): step 0, no
/// blobs, every checksum 0, every digest zeros, not sealed.
pub(crate) fn draft_of(index: &Index) -> Index {
    let mut d = index.clone();
    let c = &mut d.ckpt;
    (c.step, c.index_crc32c) = (0, 0);
    c.blobs.clear();
    c.files.iter_mut().for_each(|f| f.crc32c = 0);
    for t in c.tensors.values_mut() {
        t.crc32c = 0;
        if t.xxh128.is_some() {
            t.xxh128 = Some(crate::digest::to_hex(0));
        }
    }
    c.slices.values_mut().flat_map(|l| &mut l.slices).for_each(|s| s.crc32c = 0);
    d
}

/// Reads a number as JSON writes it (no sign, no leading zero) at `*pos`,
/// moving past it.
fn read_decimal(bytes: &[u8], pos: &mut usize) -> Option<u64> {
    let digits = bytes.get(*pos..)?.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 20 || (digits > 1 && bytes[*pos] == b'0') {
        return None;
    }
    let mut v = 0u64;
    for &b in &bytes[*pos..*pos + digits] {
        v = v.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    *pos += digits;
    Some(v)
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
