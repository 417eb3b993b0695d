//! Checkpoints written by several ranks (docs/format.md, "Ranks").
//!
//! Each rank's part of a step is a [`Layout`] planned with its rank and the
//! world size, so its shards are `rank-RRRRR-of-WWWWW-shard-SSSS`; [`merge`]
//! joins the parts of one step, every one already placed in the same staging
//! buffer, into the one image [`crate::commit::Store::commit`] writes and
//! commits as one checkpoint (one index, one commit point).
//!
//! Invariants: a merged layout holds exactly ranks `0..world_size`, each
//! once, all planned for the same directory count; tensor names are unique
//! across ranks (a replicated state's partition names every tensor or range
//! once); shard staging ranges of different parts never overlap (the caller
//! places each part in its own lease).

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;

use crate::config;
use crate::format::{self, FormatError, Index};
use crate::image::{self, Layout, SliceDecl};

/// Joins the parts (one per rank, in any order) of one checkpoint into one
/// layout whose shards keep their rank's file names and staging offsets.
pub fn merge(mut parts: Vec<Layout>) -> Result<Layout, FormatError> {
    let bad = |m: String| Err(FormatError::Index(m));
    if parts.is_empty() {
        return bad("no parts to merge".into());
    }
    parts.sort_by_key(|p| p.opts.rank);
    let world_size = parts[0].opts.world_size;
    let n_dirs = parts[0].opts.n_dirs;
    if parts.len() != world_size as usize {
        return bad(format!("{} parts for a world size of {world_size}", parts.len()));
    }
    for (r, p) in parts.iter().enumerate() {
        if p.opts.world_size != world_size || p.opts.n_dirs != n_dirs {
            return bad(format!(
                "rank {} was planned for world size {} and {} directories, rank 0 for {world_size} and {n_dirs}",
                p.opts.rank, p.opts.world_size, p.opts.n_dirs
            ));
        }
        if p.opts.rank != r as u32 {
            return bad(format!("rank {r} is missing (or sent twice)"));
        }
    }
    let mut names = HashSet::new();
    let mut out = Layout::empty(parts[0].opts);
    out.opts.rank = 0;
    for p in parts {
        for s in p.specs.iter() {
            if !names.insert(s.name.clone()) {
                return Err(FormatError::DuplicateTensor(s.name.clone()));
            }
        }
        let (n_specs, n_shards) = (out.specs.len(), out.shards.len());
        out.staging_len = out.staging_len.max(p.staging_len);
        std::sync::Arc::make_mut(&mut out.specs).extend(p.specs.iter().cloned());
        out.places.extend(p.places.into_iter().map(|mut pl| {
            pl.shard_idx += n_shards;
            pl
        }));
        out.shards.extend(p.shards.into_iter().map(|mut sh| {
            sh.tensors.iter_mut().for_each(|t| *t += n_specs);
            sh
        }));
    }
    Ok(out)
}

/// A merged layout kept with its parts' plans. Ranks that save the same
/// structures every step (kept save plans) make the same image again, only
/// in other leases of staging: [`Merged::placed`] moves each part's span
/// there, instead of merging the parts again and rendering the index again
/// (10k tensors per rank: tens of milliseconds per step).
#[derive(Debug)]
pub struct Merged {
    /// The parts as given (however placed), by rank: they keep the plans
    /// alive, so that [`Layout::same_plan`] cannot meet a reused address.
    plans: Vec<Layout>,
    decls: Vec<SliceDecl>,
    /// The parts each placed at 0, merged, their slices set.
    layout: Layout,
    /// Each part's shards, tensors and image length in `layout`, by rank.
    spans: Vec<(Range<usize>, Range<usize>, u64)>,
}

impl Merged {
    /// Merges the parts of one step ([`merge`]) and sets their slice
    /// declarations ([`Layout::set_slices`]).
    pub fn new(mut parts: Vec<Layout>, decls: Vec<SliceDecl>) -> Result<Merged, FormatError> {
        parts.sort_by_key(|p| p.opts.rank);
        let mut spans = Vec::with_capacity(parts.len());
        let (mut shards, mut places) = (0, 0);
        let at_zero: Vec<Layout> = parts
            .iter()
            .map(|p| {
                let mut z = p.clone();
                z.rebase(0);
                spans.push((shards..shards + z.shards.len(), places..places + z.places.len(), z.staging_len));
                (shards, places) = (shards + z.shards.len(), places + z.places.len());
                z
            })
            .collect();
        let mut layout = merge(at_zero)?;
        layout.set_slices(decls.clone())?;
        Ok(Merged { plans: parts, decls, layout, spans })
    }

    /// Whether these parts (by rank) and declarations make this merge.
    pub fn is_of(&self, parts: &[&Layout], decls: &[SliceDecl]) -> bool {
        parts.len() == self.plans.len()
            && parts.iter().zip(&self.plans).all(|(a, b)| a.same_plan(b))
            && decls == self.decls.as_slice()
    }

    /// The merged layout with each part (by rank) at its base in staging,
    /// as [`merge`] of the parts placed there would make it; its clones
    /// share the rendered index.
    pub fn placed(&self, bases: &[u64]) -> Layout {
        assert_eq!(bases.len(), self.spans.len(), "one base per part");
        let mut out = self.layout.clone();
        out.staging_len = 0;
        for (&base, (shards, places, len)) in bases.iter().zip(&self.spans) {
            assert_eq!(base % config::DIRECT_ALIGN_BYTES as u64, 0, "image base must be block-aligned");
            out.shards[shards.clone()].iter_mut().for_each(|s| s.staging_offset += base);
            out.places[places.clone()].iter_mut().for_each(|p| p.staging_offset += base);
            out.staging_len = out.staging_len.max(base + len);
        }
        out
    }
}

/// Joins the markers of every rank of one step, each an index of that
/// rank's files, tensors and blobs written by its own node's sidecar, into
/// the step's index (several nodes: the coordinator's commit). Every marker
/// must name the same step and world size and only files of its own rank;
/// ranks `0..world_size` each exactly once; names unique across ranks.
/// `decls` are every rank's slice declarations (each rank's checked by its
/// own node's sidecar to name its own tensors); checked across ranks here
/// as one sidecar checks them ([`image::checked_slices`]), they become the
/// index's `slices`.
pub fn merge_indexes(mut parts: Vec<(u32, Index)>, decls: &[SliceDecl]) -> Result<Index, FormatError> {
    let bad = |m: String| Err(FormatError::Index(m));
    if parts.is_empty() {
        return bad("no rank markers to merge".into());
    }
    parts.sort_by_key(|(r, _)| *r);
    let (step, world_size) = (parts[0].1.ckpt.step, parts[0].1.ckpt.world_size);
    if parts.len() != world_size as usize {
        return bad(format!("{} rank markers for a world size of {world_size}", parts.len()));
    }
    let mut out = parts[0].1.clone();
    out.weight_map.clear();
    out.metadata.total_size = 0;
    out.ckpt.secondary_dirs.clear();
    out.ckpt.files.clear();
    out.ckpt.tensors.clear();
    out.ckpt.blobs.clear();
    out.ckpt.nodes.clear();
    for (r, (rank, ix)) in parts.into_iter().enumerate() {
        if rank != r as u32 {
            return bad(format!("rank {r}'s marker is missing (or sent twice)"));
        }
        if ix.ckpt.step != step || ix.ckpt.world_size != world_size {
            return bad(format!(
                "rank {rank}'s marker is of step {} and world size {}, rank 0's of step {step} and {world_size}",
                ix.ckpt.step, ix.ckpt.world_size
            ));
        }
        if !ix.ckpt.secondary_dirs.is_empty() {
            return bad(format!("rank {rank}'s marker names other directories"));
        }
        for f in ix.ckpt.files {
            if rank_of_file(&f.name) != Some(rank) {
                return bad(format!("rank {rank}'s marker lists file {:?} of another rank", f.name));
            }
            out.ckpt.files.push(f);
        }
        for (name, t) in ix.ckpt.tensors {
            if out.ckpt.tensors.contains_key(&name) {
                return Err(FormatError::DuplicateTensor(name));
            }
            out.weight_map.insert(name.clone(), t.file.clone());
            out.ckpt.tensors.insert(name, t);
        }
        out.metadata.total_size += ix.metadata.total_size;
        // Node-local files: every rank of a node names the same directories.
        for (id, n) in ix.ckpt.nodes {
            match out.ckpt.nodes.entry(id) {
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(n);
                }
                std::collections::btree_map::Entry::Occupied(mut o) => {
                    if o.get().dirs != n.dirs {
                        return bad(format!(
                            "rank {rank}'s marker says node {:?} holds its files in {:?}, an earlier rank's in {:?}",
                            o.key(),
                            n.dirs,
                            o.get().dirs
                        ));
                    }
                    o.get_mut().files.extend(n.files);
                }
            }
        }
        for b in ix.ckpt.blobs {
            if out.ckpt.blobs.iter().any(|o| o.name == b.name) {
                return Err(FormatError::DuplicateBlob(b.name));
            }
            out.ckpt.blobs.push(b);
        }
    }
    out.ckpt.blobs.sort_by(|a, b| a.name.cmp(&b.name));
    out.ckpt.nodes.values_mut().for_each(|n| n.files.sort());
    out.ckpt.slices = image::checked_slices(&out.ckpt.tensors, decls)?;
    out.ckpt.format_version =
        config::format_version_for(!out.ckpt.slices.is_empty(), out.ckpt.tensors.values().any(|t| t.xxh128.is_some()));
    out.validate()?;
    out.seal();
    Ok(out)
}

/// The rank that wrote a shard, from its name (`rank-RRRRR-of-...`).
pub fn rank_of_file(name: &str) -> Option<u32> {
    format::rank_of_shard_file(name)
}

/// Bytes of shard files per rank (every rank of the world size listed,
/// those with no file at 0).
pub fn bytes_per_rank(index: &Index) -> BTreeMap<u32, u64> {
    let mut out: BTreeMap<u32, u64> = (0..index.ckpt.world_size).map(|r| (r, 0)).collect();
    for f in &index.ckpt.files {
        if let Some(r) = rank_of_file(&f.name) {
            *out.entry(r).or_default() += f.len_bytes;
        }
    }
    out
}

/// One line for people: "world size 2; rank 0: 6.4 MiB, rank 1: 6.5 MiB
/// (spread 2.0 %)", the spread being max/min − 1 of the ranks' bytes.
pub fn describe(index: &Index) -> String {
    let per = bytes_per_rank(index);
    let list: Vec<String> = per.iter().map(|(r, b)| format!("rank {r}: {}", crate::units::human_bytes(*b))).collect();
    let (lo, hi) = (per.values().copied().min().unwrap_or(0), per.values().copied().max().unwrap_or(0));
    let spread = if lo == 0 { "-".to_string() } else { format!("{:.1} %", (hi as f64 / lo as f64 - 1.0) * 100.0) };
    format!("world size {}; {} (spread {spread})", index.ckpt.world_size, list.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Dtype;
    use crate::image::{LayoutOptions, TensorSpec};

    fn part(rank: u32, world_size: u32, names: &[&str]) -> Layout {
        let specs = names.iter().map(|n| TensorSpec::new(*n, Dtype::F32, &[1000])).collect();
        Layout::plan(specs, LayoutOptions { rank, world_size, ..Default::default() }).unwrap()
    }

    #[test]
    fn parts_merge_into_one_image_with_every_rank_named() {
        let mut a = part(0, 2, &["a", "b"]);
        let mut b = part(1, 2, &["c"]);
        a.rebase(0);
        b.rebase(a.staging_len);
        let m = merge(vec![b.clone(), a.clone()]).unwrap();
        assert_eq!(m.specs.len(), 3);
        assert_eq!(m.shards.len(), a.shards.len() + b.shards.len());
        assert!(m.shards[0].file_name.starts_with("rank-00000-of-00002"));
        assert!(m.shards.last().unwrap().file_name.starts_with("rank-00001-of-00002"));
        assert_eq!(m.staging_len, b.staging_len);
        // Every tensor keeps its staging place and finds its shard.
        let c = m.specs.iter().position(|s| s.name == "c").unwrap();
        assert_eq!(m.places[c].staging_offset, b.places[0].staging_offset);
        assert!(m.shards[m.places[c].shard_idx].tensors.contains(&c));
        let idx = m.index(1, &[1, 2, 3], &[], vec![]);
        assert_eq!(idx.ckpt.world_size, 2);
        let per = bytes_per_rank(&idx);
        assert_eq!(per.len(), 2);
        assert!(per[&0] > per[&1] && per[&1] > 0);
        let line = describe(&idx);
        assert!(
            line.starts_with("world size 2; rank 0: ") && line.contains("rank 1: ") && line.contains("spread"),
            "{line}"
        );
    }

    #[test]
    fn a_kept_merge_placed_elsewhere_is_the_merge_of_the_parts_placed_there() {
        let (a, b) = (part(0, 2, &["a", "b"]), part(1, 2, &["c"]));
        let kept = Merged::new(vec![b.clone(), a.clone()], vec![]).unwrap();
        assert!(kept.is_of(&[&a, &b], &[]));
        for (base_a, base_b) in [(0, a.staging_len), (1 << 20, 0), (8192, 1 << 21)] {
            let (mut pa, mut pb) = (a.clone(), b.clone());
            pa.rebase(base_a);
            pb.rebase(base_b);
            let want = merge(vec![pa, pb]).unwrap();
            let got = kept.placed(&[base_a, base_b]);
            assert_eq!(got.staging_len, want.staging_len);
            let offsets = |l: &Layout| {
                let s: Vec<u64> = l.shards.iter().map(|s| s.staging_offset).collect();
                (s, l.places.iter().map(|p| (p.shard_idx, p.staging_offset)).collect::<Vec<_>>())
            };
            assert_eq!(offsets(&got), offsets(&want), "bases {base_a}, {base_b}");
            assert_eq!(
                got.index_json(3, &[1, 2, 3], &[], vec![]),
                want.index(3, &[1, 2, 3], &[], vec![]).to_json_bytes()
            );
        }
        // Another plan of the same names, other declarations, another order: not this merge.
        let a2 = part(0, 2, &["a", "b"]);
        assert!(!kept.is_of(&[&a2, &b], &[]));
        assert!(!kept.is_of(&[&b, &a], &[]));
        let decl = SliceDecl { piece: "c".into(), of: "w".into(), shape: vec![1000], elems: [0, 1000] };
        assert!(!kept.is_of(&[&a, &b], &[decl]));
    }

    #[test]
    fn missing_duplicate_and_mismatched_parts_are_refused() {
        assert!(merge(vec![part(0, 2, &["a"])]).is_err());
        assert!(merge(vec![part(0, 2, &["a"]), part(0, 2, &["b"])]).is_err());
        assert!(merge(vec![part(0, 2, &["a"]), part(1, 3, &["b"])]).is_err());
        assert!(matches!(merge(vec![part(0, 2, &["a"]), part(1, 2, &["a"])]), Err(FormatError::DuplicateTensor(_))));
    }

    #[test]
    fn rank_markers_merge_into_the_index_of_one_commit() {
        let (a, b) = (part(0, 2, &["a", "b"]), part(1, 2, &["c"]));
        let blob = [crate::image::Blob { name: "rng.1", bytes: b"r" }];
        let ia = a.index(7, &[1, 2], &[], vec![]);
        let ib = b.index(7, &[3], &blob, vec![]);
        let m = merge_indexes(vec![(1, ib.clone()), (0, ia.clone())], &[]).unwrap();
        assert_eq!(m.ckpt.world_size, 2);
        assert_eq!(m.ckpt.tensors.len(), 3);
        assert_eq!(m.ckpt.files.len(), ia.ckpt.files.len() + ib.ckpt.files.len());
        assert_eq!(m.metadata.total_size, 12_000);
        assert_eq!(m.ckpt.blobs.len(), 1);
        // What the coordinator writes reads back as any index does.
        assert_eq!(Index::from_json_bytes(&m.to_json_bytes()).unwrap(), m);
        // The same whole as one sidecar's merge of the layouts.
        let (mut la, mut lb) = (a.clone(), b.clone());
        la.rebase(0);
        lb.rebase(la.staging_len);
        let whole = merge(vec![la, lb]).unwrap().index(7, &[1, 2, 3], &blob, vec![]);
        assert_eq!(m, whole);
        // A missing rank, a rank twice, another step, a duplicate tensor.
        assert!(merge_indexes(vec![(0, ia.clone())], &[]).is_err());
        assert!(merge_indexes(vec![(0, ia.clone()), (0, ia.clone())], &[]).is_err());
        assert!(merge_indexes(vec![(0, ia.clone()), (1, b.index(8, &[3], &[], vec![]))], &[]).is_err());
        assert!(merge_indexes(vec![(0, ia.clone()), (1, ia.clone())], &[]).is_err());
        assert!(matches!(
            merge_indexes(vec![(0, ia), (1, part(1, 2, &["a"]).index(7, &[3], &[], vec![]))], &[]),
            Err(FormatError::DuplicateTensor(_))
        ));
    }

    #[test]
    fn markers_with_slice_declarations_merge_into_the_same_slices_as_one_sidecars() {
        // w is F32 [4, 500]: elements [0, 1000) on rank 0, [1000, 2000) on rank 1.
        let (a, b) = (part(0, 2, &["w#elems[0:1000]"]), part(1, 2, &["w#elems[1000:2000]", "c"]));
        let decl =
            |piece: &str, e: [u64; 2]| SliceDecl { piece: piece.into(), of: "w".into(), shape: vec![4, 500], elems: e };
        let decls = [decl("w#elems[1000:2000]", [1000, 2000]), decl("w#elems[0:1000]", [0, 1000])];
        let (ia, ib) = (a.index(7, &[1], &[], vec![]), b.index(7, &[2, 3], &[], vec![]));
        let m = merge_indexes(vec![(0, ia.clone()), (1, ib.clone())], &decls).unwrap();
        assert_eq!(m.ckpt.format_version, config::FORMAT_VERSION_SLICES);
        let w = m.logical_tensor("w").unwrap();
        assert_eq!((w.shape, w.slices.len()), (&[4u64, 500][..], 2));
        assert_eq!(Index::from_json_bytes(&m.to_json_bytes()).unwrap(), m);
        // The same index as one sidecar's merge of the layouts with the same declarations.
        let (mut la, mut lb) = (a, b);
        la.rebase(0);
        lb.rebase(la.staging_len);
        let mut whole = merge(vec![la, lb]).unwrap();
        whole.set_slices(decls.to_vec()).unwrap();
        assert_eq!(m, whole.index(7, &[1, 2, 3], &[], vec![]));
        // A gap between the ranks' slices is refused as one sidecar refuses it.
        let gap = [decl("w#elems[0:1000]", [0, 1000]), decl("w#elems[1000:2000]", [1200, 2000])];
        let e = merge_indexes(vec![(0, ia), (1, ib)], &gap).unwrap_err().to_string();
        assert!(e.contains("sliced tensor \"w\""), "{e}");
    }

    #[test]
    fn ranks_are_read_from_shard_names() {
        assert_eq!(rank_of_file(&format::shard_file_name(3, 4, 1)), Some(3));
        assert_eq!(rank_of_file("x.safetensors"), None);
    }
}
