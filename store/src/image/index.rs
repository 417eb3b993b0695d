//! The commit record of an image: the index built from a layout and its
//! checksums (and digests), or rendered once with holes for its numbers
//! ([`IndexTemplate`]) and filled per save.
//!
//! Invariant: the rendered bytes equal the index built at once, byte for
//! byte; a rendering that does not fit (other directories, digests or not)
//! is not used.

use std::collections::BTreeMap;

use super::{index_blobs, slices::slices_section, Blob, Layout};
use crate::config;
use crate::format::{CkptSection, Index, IndexFile, IndexMetadata, IndexNode, IndexTensor};
use crate::index_template::{Filled, IndexTemplate};

/// Where an index's files are held: the directories beyond the primary,
/// and the nodes holding them (empty but for a node-local rank's marker).
pub(crate) struct Held<'a> {
    pub secondary_dirs: Vec<String>,
    pub nodes: &'a BTreeMap<String, IndexNode>,
}

impl Layout {
    pub(super) fn index_tensors(&self, tensor_crcs: &[u32]) -> BTreeMap<String, IndexTensor> {
        let mut tensors = BTreeMap::new();
        for (i, s) in self.specs.iter().enumerate() {
            let p = &self.places[i];
            let file = self.shards[p.shard_idx].file_name.clone();
            tensors.insert(
                s.name.clone(),
                IndexTensor {
                    file,
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                    data_offsets: [p.data_offsets.0, p.data_offsets.1],
                    crc32c: tensor_crcs[i],
                    xxh128: None,
                },
            );
        }
        tensors
    }

    /// The commit record for this image.
    pub fn index(&self, step: u64, tensor_crcs: &[u32], blobs: &[Blob<'_>], secondary_dirs: Vec<String>) -> Index {
        self.index_with(step, tensor_crcs, None, blobs, secondary_dirs)
    }

    /// [`Layout::index`] with each tensor's digest (`xxh128`, format
    /// version 3), in the layout's order.
    pub fn index_with(
        &self,
        step: u64,
        tensor_crcs: &[u32],
        digests: Option<&[u128]>,
        blobs: &[Blob<'_>],
        secondary_dirs: Vec<String>,
    ) -> Index {
        let mut index = self.index_draft(step, blobs, secondary_dirs);
        if let Some(d) = digests {
            assert_eq!(d.len(), self.specs.len());
            for (s, &d) in self.specs.iter().zip(d) {
                index.ckpt.tensors.get_mut(&s.name).expect("the draft lists every tensor").xxh128 =
                    Some(crate::digest::to_hex(d));
            }
        } else {
            index.ckpt.tensors.values_mut().for_each(|t| t.xxh128 = None);
        }
        index.ckpt.format_version = config::format_version_for(!index.ckpt.slices.is_empty(), digests.is_some());
        let c = &mut index.ckpt;
        for (f, crc) in c.files.iter_mut().zip(self.file_crcs(tensor_crcs)) {
            f.crc32c = crc;
        }
        for (s, &crc) in self.specs.iter().zip(tensor_crcs) {
            c.tensors.get_mut(&s.name).expect("the draft lists every tensor").crc32c = crc;
        }
        for piece in c.slices.values_mut().flat_map(|l| l.slices.iter_mut()) {
            piece.crc32c = c.tensors[&piece.tensor].crc32c;
        }
        index.seal();
        index
    }

    /// The commit record's bytes ([`Layout::index`] as written), from the
    /// layout's rendered index ([`Layout::prepare_index`]), which its
    /// clones share: a kept save plan renders it once.
    pub fn index_json(
        &self,
        step: u64,
        tensor_crcs: &[u32],
        blobs: &[Blob<'_>],
        secondary_dirs: Vec<String>,
    ) -> Vec<u8> {
        self.index_json_with(step, tensor_crcs, None, blobs, secondary_dirs, &BTreeMap::new())
    }

    /// [`Layout::index_json`] with digests ([`Layout::index_with`]), whose
    /// rendered index has holes for them, and a `nodes` section when
    /// `nodes` is not empty (a rank's marker on a node's own disks:
    /// docs/format.md, "Node-local files"), rendered from the template
    /// like the rest: at 10k tensors, parsing the index and serialising it
    /// again to add the section cost tens of milliseconds of every step.
    pub fn index_json_with(
        &self,
        step: u64,
        tensor_crcs: &[u32],
        digests: Option<&[u128]>,
        blobs: &[Blob<'_>],
        secondary_dirs: Vec<String>,
        nodes: &BTreeMap<String, IndexNode>,
    ) -> Vec<u8> {
        let at = Held { secondary_dirs, nodes };
        // No piece reaches usize::MAX bytes: the whole index is the last.
        let mut out = Vec::new();
        let last = self
            .index_pieces(step, tensor_crcs, digests, blobs, at, usize::MAX, &mut |piece| {
                out.extend_from_slice(piece);
                Ok(())
            })
            .expect("appending to a Vec does not fail");
        if out.is_empty() {
            return last;
        }
        out.extend_from_slice(&last);
        out
    }

    /// [`Layout::index_json_with`] handed to `out` in pieces of about
    /// `piece_bytes` as the rendered index is filled (the checksum field
    /// in the last: [`IndexTemplate::render_pieces`]), the last returned
    /// (the whole index when it is built at once).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn index_pieces(
        &self,
        step: u64,
        tensor_crcs: &[u32],
        digests: Option<&[u128]>,
        blobs: &[Blob<'_>],
        at: Held<'_>,
        piece_bytes: usize,
        out: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<Vec<u8>> {
        match self.template(&at).filter(|t| t.has_digests() == digests.is_some()) {
            Some(t) => {
                let filled = Filled {
                    step,
                    file_crcs: &self.file_crcs(tensor_crcs),
                    tensor_crcs,
                    digests: digests.unwrap_or(&[]),
                    blobs: &index_blobs(blobs),
                };
                t.render_pieces(&filled, piece_bytes, out)
            }
            None => {
                let mut index = self.index_with(step, tensor_crcs, digests, blobs, at.secondary_dirs);
                if at.nodes.is_empty() {
                    return Ok(index.to_json_bytes());
                }
                index.ckpt.nodes = at.nodes.clone();
                Ok(index.sealed_json_bytes())
            }
        }
    }

    /// Renders the index with holes for its numbers, unless done already:
    /// a commit calls it while the image is still copied, so that only
    /// the numbers wait for the copy's checksums.
    pub fn prepare_index(&self, secondary_dirs: &[String]) {
        self.template(&Held { secondary_dirs: secondary_dirs.to_vec(), nodes: &BTreeMap::new() });
    }

    /// [`Layout::prepare_index`] of an index with a `nodes` section
    /// ([`Layout::index_json_with`]).
    pub fn prepare_index_held(&self, secondary_dirs: &[String], nodes: &BTreeMap<String, IndexNode>) {
        self.template(&Held { secondary_dirs: secondary_dirs.to_vec(), nodes });
    }

    fn template(&self, at: &Held<'_>) -> Option<&IndexTemplate> {
        let t = self.index_template.get_or_init(|| {
            let mut draft = self.index_draft(0, &[], at.secondary_dirs.clone());
            draft.ckpt.nodes = at.nodes.clone();
            IndexTemplate::new(&draft, self.specs.iter().map(|s| s.name.as_str()))
        });
        // Other directories or holders (never, for one store) are not worth keeping.
        t.as_ref().filter(|t| t.names(&at.secondary_dirs, at.nodes))
    }

    #[cfg(test)]
    fn template_for(&self, secondary_dirs: &[String]) -> Option<&IndexTemplate> {
        self.template(&Held { secondary_dirs: secondary_dirs.to_vec(), nodes: &BTreeMap::new() })
    }

    /// The index with step `step`, these blobs and every checksum 0.
    pub(crate) fn index_draft(&self, step: u64, blobs: &[Blob<'_>], secondary_dirs: Vec<String>) -> Index {
        let files = self
            .shards
            .iter()
            .map(|sh| IndexFile { name: sh.file_name.clone(), dir_idx: sh.dir_idx, len_bytes: sh.file_len, crc32c: 0 })
            .collect();
        let mut tensors = self.index_tensors(&vec![0; self.specs.len()]);
        if self.opts.incremental {
            // Zeros: the rendered index's holes (index_template).
            tensors.values_mut().for_each(|t| t.xxh128 = Some(crate::digest::to_hex(0)));
        }
        let weight_map = tensors.iter().map(|(n, t)| (n.clone(), t.file.clone())).collect();
        // Checked by set_slices: building them again cannot fail.
        let slices = slices_section(&tensors, &self.slices).expect("slices were checked when set");
        let format_version = config::format_version_for(!slices.is_empty(), self.opts.incremental);
        Index {
            metadata: IndexMetadata { total_size: self.tensor_bytes() },
            weight_map,
            ckpt: CkptSection {
                format_version,
                step,
                world_size: self.opts.world_size,
                secondary_dirs,
                files,
                tensors,
                blobs: index_blobs(blobs),
                slices,
                nodes: BTreeMap::new(),
                index_crc32c: 0,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use std::collections::BTreeMap;

    use super::Held;
    use crate::config;
    use crate::format::{self, Dtype, Index, IndexNode};
    use crate::image::*;

    fn many_kinds_of_names() -> Layout {
        let mut s: Vec<TensorSpec> =
            (0..40).map(|i| TensorSpec::new(format!("layer.{i}.w"), Dtype::F32, &[1 + i * 500])).collect();
        // Names holding the keys the index template looks for, escaped in the JSON.
        s.push(TensorSpec::new("\"crc32c\": 0", Dtype::U8, &[2]));
        s.push(TensorSpec::new("    \"step\": 0,", Dtype::U8, &[2]));
        s.push(TensorSpec::new("step", Dtype::U8, &[3]));
        s.push(TensorSpec::new("blobs", Dtype::U8, &[0]));
        s.push(TensorSpec::new("w#elems[0:5]", Dtype::F32, &[5]));
        s.push(TensorSpec::new("w#elems[5:12]", Dtype::F32, &[7]));
        let mut l =
            Layout::plan(s, LayoutOptions { shard_bytes_max: 64 << 10, n_dirs: 2, ..Default::default() }).unwrap();
        let decl =
            |piece: &str, a, b| SliceDecl { piece: piece.into(), of: "w".into(), shape: vec![12], elems: [a, b] };
        l.set_slices(vec![decl("w#elems[5:12]", 5, 12), decl("w#elems[0:5]", 0, 5)]).unwrap();
        assert!(l.shards.len() > 2);
        l
    }

    #[test]
    fn the_rendered_index_is_the_index_built_at_once() {
        let l = many_kinds_of_names();
        let dirs = vec!["/second".to_string()];
        l.prepare_index(&dirs);
        assert!(l.template_for(&dirs).is_some(), "the template reads");
        for (step, blobs) in [
            (0, vec![]),
            (7, vec![Blob { name: "rng", bytes: b"state" }]),
            (format::STEP_MAX, vec![Blob { name: "a", bytes: b"" }, Blob { name: "z", bytes: b"\n\"" }]),
        ] {
            let crcs: Vec<u32> = (0..l.specs.len() as u32)
                .map(|i| 0x9e37_79b9u32.wrapping_mul(i.wrapping_add(step as u32) | 1))
                .collect();
            let whole = l.index(step, &crcs, &blobs, dirs.clone());
            // A clone (as the committer's rebased copy) shares the rendering.
            let bytes = l.clone().index_json(step, &crcs, &blobs, dirs.clone());
            assert_eq!(String::from_utf8(bytes.clone()).unwrap(), String::from_utf8(whole.to_json_bytes()).unwrap());
            assert_eq!(Index::from_json_bytes(&bytes).unwrap(), whole);
        }
        // Other directories than rendered: built at once, still right.
        assert!(l.template_for(&[]).is_none());
        assert_eq!(
            l.index_json(3, &vec![5; l.specs.len()], &[], vec![]),
            l.index(3, &vec![5; l.specs.len()], &[], vec![]).to_json_bytes()
        );
    }

    #[test]
    fn an_incremental_layouts_rendered_index_with_digests_is_the_index_built_at_once() {
        let specs: Vec<TensorSpec> =
            (0..12).map(|i| TensorSpec::new(format!("t{i}"), Dtype::F32, &[1 + (i % 3) * (300 << 10)])).collect();
        let changed: HashSet<String> = ["t1".to_string(), "t5".to_string()].into();
        let l = Layout::plan_with(
            specs,
            LayoutOptions { incremental: true, n_dirs: 2, ..Default::default() },
            Some(&changed),
        )
        .unwrap();
        let dirs = vec!["/second".to_string()];
        let crcs: Vec<u32> = (0..12).map(|i| i * 7 + 1).collect();
        let digests: Vec<u128> =
            (0..12u128).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c834) ^ 5).collect();
        let whole = l.index_with(9, &crcs, Some(&digests), &[Blob { name: "rng", bytes: b"x" }], dirs.clone());
        let bytes = l.index_json_with(
            9,
            &crcs,
            Some(&digests),
            &[Blob { name: "rng", bytes: b"x" }],
            dirs.clone(),
            &BTreeMap::new(),
        );
        assert_eq!(String::from_utf8(bytes.clone()).unwrap(), String::from_utf8(whole.to_json_bytes()).unwrap());
        // Handed out in small pieces (as the commit writes a large index):
        // the same bytes, every piece but the last at least that long, the
        // checksum field in the last.
        for piece_bytes in [1, 100, 1000, bytes.len() / 2] {
            let mut pieces: Vec<Vec<u8>> = Vec::new();
            let blobs = [Blob { name: "rng", bytes: b"x" }];
            let last = l
                .index_pieces(
                    9,
                    &crcs,
                    Some(&digests),
                    &blobs,
                    Held { secondary_dirs: dirs.clone(), nodes: &BTreeMap::new() },
                    piece_bytes,
                    &mut |p| {
                        pieces.push(p.to_vec());
                        Ok(())
                    },
                )
                .unwrap();
            assert!(!pieces.is_empty(), "pieces of {piece_bytes}: none before the last");
            assert!(pieces.iter().all(|p| p.len() >= piece_bytes));
            assert!(String::from_utf8_lossy(&last).contains("\"index_crc32c\": "));
            pieces.push(last);
            assert_eq!(pieces.concat(), bytes, "pieces of {piece_bytes}");
        }
        let read = Index::from_json_bytes(&bytes).unwrap();
        assert_eq!(read.ckpt.format_version, config::FORMAT_VERSION_DIGESTS);
        assert_eq!(read.ckpt.tensors["t3"].xxh128.as_deref().and_then(crate::digest::parse_hex), Some(digests[3]));
        // Without digests: version 1, no xxh128 (built at once).
        let plain = Index::from_json_bytes(&l.index_json(9, &crcs, &[], dirs)).unwrap();
        assert_eq!(plain.ckpt.format_version, config::FORMAT_VERSION_OLDEST);
        assert!(plain.ckpt.tensors.values().all(|t| t.xxh128.is_none()));
        // Changed tensors in volatile shards first; each stable one of 1 MiB or more alone.
        let volatile: Vec<&ShardPlan> = l.shards.iter().filter(|s| !s.stable).collect();
        assert!(l.shards.iter().position(|s| s.stable).unwrap() >= volatile.len());
        let vnames: HashSet<&str> =
            volatile.iter().flat_map(|s| s.tensors.iter().map(|&i| l.specs[i].name.as_str())).collect();
        assert_eq!(vnames, ["t1", "t5"].into());
        for sh in l.shards.iter().filter(|s| s.stable) {
            let big = sh.tensors.iter().any(|&i| l.tensor_range(i).len() as u64 >= config::STABLE_OWN_SHARD_BYTES_MIN);
            assert!(!big || sh.tensors.len() == 1);
        }
    }

    #[test]
    fn a_node_local_markers_rendered_index_is_the_index_built_at_once_with_its_nodes_section() {
        let l = many_kinds_of_names();
        let files = l.shards.iter().map(|sh| sh.file_name.clone()).collect();
        let held: BTreeMap<String, IndexNode> =
            [("node-a".to_string(), IndexNode { dirs: vec!["/a/0".into(), "/a/\"1\"".into()], files })].into();
        l.prepare_index_held(&[], &held);
        let crcs: Vec<u32> = (0..l.specs.len() as u32).map(|i| i.wrapping_mul(0x0101_0101) ^ 77).collect();
        let blobs = [Blob { name: "rng", bytes: b"x" }];
        let mut whole = l.index(4, &crcs, &blobs, vec![]);
        whole.ckpt.nodes = held.clone();
        let bytes = l.index_json_with(4, &crcs, None, &blobs, vec![], &held);
        assert_eq!(String::from_utf8(bytes.clone()).unwrap(), String::from_utf8(whole.sealed_json_bytes()).unwrap());
        assert_eq!(Index::from_json_bytes(&bytes).unwrap().ckpt.nodes, held);
        // Rendered, not built at once; another holder is built at once, still right.
        assert!(l.template(&Held { secondary_dirs: vec![], nodes: &held }).is_some());
        let other: BTreeMap<String, IndexNode> =
            [("node-b".to_string(), IndexNode { dirs: vec!["/b".into(), "/b2".into()], files: vec![] })].into();
        assert!(l.template(&Held { secondary_dirs: vec![], nodes: &other }).is_none());
        let mut whole_b = l.index(4, &crcs, &blobs, vec![]);
        whole_b.ckpt.nodes = other.clone();
        assert_eq!(l.index_json_with(4, &crcs, None, &blobs, vec![], &other), whole_b.sealed_json_bytes());
    }

    #[test]
    fn an_index_without_slices_or_secondaries_renders_too() {
        let l = Layout::plan(
            vec![TensorSpec::new("a", Dtype::F16, &[3]), TensorSpec::new("b", Dtype::I64, &[0])],
            LayoutOptions::default(),
        )
        .unwrap();
        assert_eq!(l.index_json(3, &[11, 22], &[], vec![]), l.index(3, &[11, 22], &[], vec![]).to_json_bytes());
        assert!(l.template_for(&[]).is_some());
    }

    #[test]
    fn zero_byte_tensors_sharing_an_offset_keep_file_order() {
        // Sorting by start offset alone can put an empty tensor sharing its
        // offset with the next one second, and then the reader calls a good
        // shard's header wrong.
        let specs = vec![TensorSpec::new("b.empty", Dtype::F32, &[0]), TensorSpec::new("a", Dtype::F32, &[4])];
        let l = Layout::plan(specs, LayoutOptions::default()).unwrap();
        let idx = l.index(1, &[0, 0], &[], vec![]);
        let names: Vec<&str> = idx.tensors_of(&l.shards[0].file_name).map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["b.empty", "a"]);
    }
}
