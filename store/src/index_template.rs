//! A layout's index rendered once, with holes for what changes from one
//! save to the next: the step, the blobs and every checksum. A kept save
//! plan saves the same tensors again and again; filling the holes costs a
//! copy of the JSON and a number per tensor, where building and
//! serialising a thousand entries again cost about a millisecond on the
//! commit's critical path (the index waits for the copy's checksums).
//!
//! The bytes are exactly [`crate::format::Index::to_json_bytes`] of the sealed index
//! built at once ([`Layout::index`]); the tests compare the two.
//!
//! Invariant: the template is read from serde_json's pretty output of the
//! draft, whose layout of keys and indentation the format fixes (a key
//! `"crc32c"` can appear nowhere else: inside a JSON string its quotes are
//! escaped).

use crate::format;
use crate::image::{Blob, Layout};

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
}

#[derive(Debug)]
pub(crate) struct IndexTemplate {
    /// The directories the template names; another set gets its own.
    secondary_dirs: Vec<String>,
    /// The draft's JSON: step 0, no blobs, every checksum 0.
    json: Vec<u8>,
    /// In document order: the offset of the placeholder and what goes there.
    holes: Vec<(usize, Hole)>,
}

impl IndexTemplate {
    /// Renders `layout`'s index; `None` if the JSON is not laid out as this
    /// module expects (a bug: the caller then builds the index at once).
    pub(crate) fn new(layout: &Layout, secondary_dirs: Vec<String>) -> Option<IndexTemplate> {
        let draft = layout.index_draft(0, &[], secondary_dirs.clone());
        let json = draft.to_json_bytes();
        let ckpt = find(&json, b"\n  \"ckpt\": {\n", 0)?;
        let step = find(&json, b"\n    \"step\": 0,\n", ckpt)? + b"\n    \"step\": ".len();
        let blobs = find(&json, b"\n    \"blobs\": [],\n", ckpt)? + b"\n    \"blobs\": ".len();
        // Checksums in document order: files, tensors (by name), slices.
        let by_name: std::collections::HashMap<&str, usize> = layout.specs.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
        let owners = (0..layout.shards.len())
            .map(Hole::File)
            .chain(draft.ckpt.tensors.keys().map(|n| Hole::Tensor(by_name[n.as_str()])))
            .chain(draft.ckpt.slices.values().flat_map(|l| &l.slices).map(|s| Hole::Tensor(by_name[s.tensor.as_str()])));
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
        holes.sort_by_key(|&(at, _)| at);
        Some(IndexTemplate { secondary_dirs, json, holes })
    }

    pub(crate) fn names(&self, secondary_dirs: &[String]) -> bool {
        self.secondary_dirs == secondary_dirs
    }

    /// The sealed index's bytes, for the layout this template was made from.
    pub(crate) fn render(&self, layout: &Layout, step: u64, tensor_crcs: &[u32], blobs: &[Blob<'_>]) -> Vec<u8> {
        let file_crcs = layout.file_crcs(tensor_crcs);
        let mut out = Vec::with_capacity(self.json.len() + 12 * self.holes.len() + blobs.len() * 128);
        let mut from = 0;
        for &(at, hole) in &self.holes {
            out.extend_from_slice(&self.json[from..at]);
            from = at + 1;
            match hole {
                Hole::Step => out.extend_from_slice(step.to_string().as_bytes()),
                Hole::File(i) => out.extend_from_slice(file_crcs[i].to_string().as_bytes()),
                Hole::Tensor(i) => out.extend_from_slice(tensor_crcs[i].to_string().as_bytes()),
                Hole::Blobs => {
                    from = at + 2;
                    out.extend_from_slice(&nested_blobs(blobs));
                }
            }
        }
        out.extend_from_slice(&self.json[from..]);
        format::seal_json(&mut out);
        out
    }
}

/// `blobs` as the pretty JSON of the index holds them, two levels deep.
fn nested_blobs(blobs: &[Blob<'_>]) -> Vec<u8> {
    let list = serde_json::to_vec_pretty(&crate::image::index_blobs(blobs)).expect("blob entries serialise");
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
    use super::*;
    use crate::format::{Dtype, Index};
    use crate::image::{LayoutOptions, SliceDecl, TensorSpec};

    fn layout() -> Layout {
        let mut s: Vec<TensorSpec> = (0..40).map(|i| TensorSpec::new(format!("layer.{i}.w"), Dtype::F32, &[1 + i * 500])).collect();
        // Names holding the keys the template looks for, escaped in the JSON.
        s.push(TensorSpec::new("\"crc32c\": 0", Dtype::U8, &[2]));
        s.push(TensorSpec::new("    \"step\": 0,", Dtype::U8, &[2]));
        s.push(TensorSpec::new("step", Dtype::U8, &[3]));
        s.push(TensorSpec::new("blobs", Dtype::U8, &[0]));
        s.push(TensorSpec::new("w#elems[0:5]", Dtype::F32, &[5]));
        s.push(TensorSpec::new("w#elems[5:12]", Dtype::F32, &[7]));
        let mut l = Layout::plan(s, LayoutOptions { shard_bytes_max: 64 << 10, n_dirs: 2, ..Default::default() }).unwrap();
        let decl = |piece: &str, a, b| SliceDecl { piece: piece.into(), of: "w".into(), shape: vec![12], elems: [a, b] };
        l.set_slices(vec![decl("w#elems[5:12]", 5, 12), decl("w#elems[0:5]", 0, 5)]).unwrap();
        assert!(l.shards.len() > 2);
        l
    }

    #[test]
    fn the_template_renders_the_index_built_at_once() {
        let l = layout();
        let dirs = vec!["/second".to_string()];
        let t = IndexTemplate::new(&l, dirs.clone()).expect("the template reads");
        for (step, blobs) in [(0, vec![]), (7, vec![Blob { name: "rng", bytes: b"state" }]), (format::STEP_MAX, vec![Blob { name: "a", bytes: b"" }, Blob { name: "z", bytes: b"\n\"" }])] {
            let crcs: Vec<u32> = (0..l.specs.len() as u32).map(|i| 0x9e37_79b9u32.wrapping_mul(i.wrapping_add(step as u32) | 1)).collect();
            let whole = l.index(step, &crcs, &blobs, dirs.clone());
            let bytes = t.render(&l, step, &crcs, &blobs);
            assert_eq!(String::from_utf8(bytes.clone()).unwrap(), String::from_utf8(whole.to_json_bytes()).unwrap());
            assert_eq!(Index::from_json_bytes(&bytes).unwrap(), whole);
        }
    }

    #[test]
    fn a_template_without_slices_or_secondaries_renders_too() {
        let l = Layout::plan(vec![TensorSpec::new("a", Dtype::F16, &[3]), TensorSpec::new("b", Dtype::I64, &[0])], LayoutOptions::default()).unwrap();
        let t = IndexTemplate::new(&l, vec![]).unwrap();
        assert!(t.names(&[]) && !t.names(&["/x".into()]));
        let bytes = t.render(&l, 3, &[11, 22], &[]);
        assert_eq!(bytes, l.index(3, &[11, 22], &[], vec![]).to_json_bytes());
    }
}
