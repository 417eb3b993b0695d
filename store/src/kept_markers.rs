//! Several nodes: the coordinator's kept markers and merge. Ranks that save
//! the same structures every step (kept save plans) send markers that
//! differ from one step to the next only in the step, the blobs, the
//! checksums and the digests. Each rank's marker is parsed once and kept
//! with a template of its bytes ([`MarkerShape`]); a later marker laid out
//! the same is read by that template (every byte outside the holes
//! compared, the checksum checked) instead of parsed, and the step's index
//! is rendered from a template of the merged index ([`KeptMerge`]) instead
//! of merged and serialised again. At two ranks of 10k tensors that was
//! ~110 ms of the commit (two 4 MB markers parsed, 20k entries merged, 8 MB
//! serialised).
//!
//! Invariants: a kept shape is only ever used through a full comparison
//! of the bytes it was made from ([`IndexTemplate::read`]), so a marker
//! read by it says exactly what parsing it would; a kept merge renders the
//! bytes [`ranks::merge_indexes`] of the same markers serialises (tested
//! below). What is kept is bounded ([`config::KEPT_MARKERS_BYTES_MAX`]);
//! beyond it markers are parsed and merged as before.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex};

use crate::config;
use crate::format::{FormatError, Index, IndexBlob};
use crate::image::SliceDecl;
use crate::index_template::{draft_of, Filled, IndexTemplate, Values};
use crate::ranks;

/// A rank's marker as parsed once, with the template that reads the
/// markers laid out as it.
#[derive(Debug)]
pub(crate) struct MarkerShape {
    /// The marker as parsed (its values those of the step it came with):
    /// what does not change from one step to the next.
    index: Index,
    template: IndexTemplate,
}

impl MarkerShape {
    fn cost(&self) -> usize {
        cost_of(self.template.len_bytes())
    }
}

/// What the budget counts of a shape whose template is `len` bytes: the
/// template, the parsed entries about as much again, and the merge it
/// takes part in.
fn cost_of(len: usize) -> usize {
    3 * len
}

/// A rank's marker as the coordinator read it.
#[derive(Debug)]
pub(crate) enum MarkerIndex {
    /// Parsed (no shape kept for it: over the budget, or not laid out as
    /// a template expects).
    Parsed(Index),
    /// Read by its rank's shape: the shape's index with these values.
    Shaped(Arc<MarkerShape>, Values),
}

impl MarkerIndex {
    /// The marker's files, tensors and nodes (its values aside).
    pub(crate) fn shape(&self) -> &Index {
        match self {
            MarkerIndex::Parsed(ix) => ix,
            MarkerIndex::Shaped(s, _) => &s.index,
        }
    }

    /// The values read by its shape (None: parsed, the index holds them).
    pub(crate) fn values(&self) -> Option<&Values> {
        match self {
            MarkerIndex::Parsed(_) => None,
            MarkerIndex::Shaped(_, v) => Some(v),
        }
    }

    pub(crate) fn blobs(&self) -> &[IndexBlob] {
        match self {
            MarkerIndex::Parsed(ix) => &ix.ckpt.blobs,
            MarkerIndex::Shaped(_, v) => &v.blobs,
        }
    }

    /// The marker's index, as parsing its bytes makes it.
    pub(crate) fn into_index(self) -> Index {
        let (shape, v) = match self {
            MarkerIndex::Parsed(ix) => return ix,
            MarkerIndex::Shaped(s, v) => (s, v),
        };
        let mut ix = shape.index.clone();
        let c = &mut ix.ckpt;
        (c.step, c.index_crc32c) = (v.step, v.index_crc32c);
        c.blobs.clone_from(&v.blobs);
        c.files.iter_mut().zip(&v.file_crcs).for_each(|(f, &crc)| f.crc32c = crc);
        let mut crcs = BTreeMap::new();
        for (i, (name, t)) in c.tensors.iter_mut().enumerate() {
            v.set_tensor(i, t);
            crcs.insert(name.as_str(), t.crc32c);
        }
        for s in c.slices.values_mut().flat_map(|l| &mut l.slices) {
            s.crc32c = crcs.get(s.tensor.as_str()).copied().unwrap_or(s.crc32c);
        }
        ix
    }
}

/// The coordinator's kept shapes (by rank) and merge: one per [`crate::commit::Store`].
#[derive(Debug)]
pub(crate) struct KeptMarkers {
    /// What the kept shapes may cost ([`cost_of`]).
    budget: usize,
    shapes: Mutex<Shapes>,
    merge: Mutex<Option<Arc<KeptMerge>>>,
    agreed: Mutex<Option<Agreed>>,
}

#[derive(Debug, Default)]
struct Shapes {
    by_rank: BTreeMap<u32, Arc<MarkerShape>>,
    cost: usize,
}

/// Markers last found to make one loadable state (the check walks every
/// name and parses the skeletons: 20-60 ms at two ranks of 10k tensors):
/// by rank, its shape, its skeleton blob and whether it names a parts
/// map; and the slice declarations. The check depends on nothing else.
/// The shapes are held, so that none is met again at a reused address.
#[derive(Debug)]
struct Agreed {
    ranks: Vec<AgreedRank>,
    decls: Vec<SliceDecl>,
}

/// A rank's shape, skeleton blob and whether it names a parts map.
type AgreedRank = (Arc<MarkerShape>, Option<Arc<Vec<u8>>>, bool);

impl PartialEq for Agreed {
    fn eq(&self, o: &Agreed) -> bool {
        self.decls == o.decls
            && self.ranks.len() == o.ranks.len()
            && self.ranks.iter().zip(&o.ranks).all(|(a, b)| Arc::ptr_eq(&a.0, &b.0) && a.1 == b.1 && a.2 == b.2)
    }
}

impl Default for KeptMarkers {
    fn default() -> KeptMarkers {
        KeptMarkers::with_budget(config::KEPT_MARKERS_BYTES_MAX)
    }
}

impl KeptMarkers {
    fn with_budget(budget: usize) -> KeptMarkers {
        KeptMarkers { budget, shapes: Mutex::default(), merge: Mutex::default(), agreed: Mutex::default() }
    }

    /// Rank `rank`'s marker `raw`: read by the rank's kept shape when laid
    /// out as it, else parsed (and kept, within the budget, with a
    /// template that reads these very bytes back).
    pub(crate) fn read(&self, rank: u32, raw: &[u8]) -> Result<MarkerIndex, FormatError> {
        let kept = lock(&self.shapes).by_rank.get(&rank).cloned();
        if let Some(shape) = kept {
            if let Some(v) = shape.template.read(raw).filter(acceptable) {
                return Ok(MarkerIndex::Shaped(shape, v));
            }
        }
        let index = Index::from_json_bytes(raw)?;
        // Over the budget (a template is no longer than the bytes it was
        // made from): not worth a template it could not keep.
        let fits = |shapes: &Shapes, cost: usize| {
            let old = shapes.by_rank.get(&rank).map_or(0, |s| s.cost());
            shapes.cost - old + cost <= self.budget
        };
        if !fits(&lock(&self.shapes), cost_of(raw.len())) {
            return Ok(MarkerIndex::Parsed(index));
        }
        let Some(template) = IndexTemplate::of_index(&index) else { return Ok(MarkerIndex::Parsed(index)) };
        let Some(values) = template.read(raw).filter(acceptable) else { return Ok(MarkerIndex::Parsed(index)) };
        let shape = Arc::new(MarkerShape { index, template });
        let mut shapes = lock(&self.shapes);
        if !fits(&shapes, shape.cost()) {
            drop(shapes);
            let index = Arc::try_unwrap(shape).expect("not shared yet").index;
            return Ok(MarkerIndex::Parsed(index));
        }
        let old = shapes.by_rank.get(&rank).map_or(0, |s| s.cost());
        shapes.cost = shapes.cost - old + shape.cost();
        shapes.by_rank.insert(rank, shape.clone());
        Ok(MarkerIndex::Shaped(shape, values))
    }

    /// Whether these markers (by rank, with their skeleton blobs) and
    /// declarations make one loadable state: `check`'s answer (None: they
    /// do), asked only when they are not those last found to.
    pub(crate) fn unless_agreed(
        &self,
        parts: &[(u32, MarkerIndex)],
        structures: &[(u32, Arc<Vec<u8>>)],
        decls: &[SliceDecl],
        check: impl FnOnce() -> Option<String>,
    ) -> Option<String> {
        let key = Agreed::of(parts, structures, decls);
        if key.is_some() && *lock(&self.agreed) == key {
            return None;
        }
        let why = check();
        if why.is_none() {
            *lock(&self.agreed) = key;
        }
        why
    }

    /// The ranks of a world of `world_size` only (another world's are
    /// not read again soon).
    pub(crate) fn keep_world(&self, world_size: u32) {
        let mut shapes = lock(&self.shapes);
        let gone: usize = shapes.by_rank.range(world_size..).map(|(_, s)| s.cost()).sum();
        shapes.by_rank.retain(|&r, _| r < world_size);
        shapes.cost -= gone;
    }

    /// The merged index of these markers (by rank, each read by its
    /// shape) with these declarations, ready to render; None when they
    /// cannot be rendered so (a marker that was parsed, a merge whose
    /// template cannot be made): the caller merges them. Errors are those
    /// [`ranks::merge_indexes`] gives the same markers.
    pub(crate) fn merged(
        &self,
        parts: &[(u32, MarkerIndex)],
        decls: &[SliceDecl],
    ) -> Result<Option<Merged>, FormatError> {
        let mut shapes = Vec::with_capacity(parts.len());
        let mut values = Vec::with_capacity(parts.len());
        for (r, (rank, m)) in parts.iter().enumerate() {
            let MarkerIndex::Shaped(s, v) = m else { return Ok(None) };
            if *rank != r as u32 {
                return Ok(None);
            }
            shapes.push(s.clone());
            values.push(v);
        }
        let kept = lock(&self.merge).clone().filter(|k| k.is_of(&shapes, decls));
        let merge = match kept {
            Some(k) => k,
            None => match KeptMerge::new(shapes, decls)? {
                Some(k) => {
                    let k = Arc::new(k);
                    *lock(&self.merge) = Some(k.clone());
                    k
                }
                None => return Ok(None),
            },
        };
        Merged::of(merge, &values).map(Some)
    }
}

impl Agreed {
    /// The key of markers all read by their shapes (else None: they are
    /// checked every time).
    fn of(parts: &[(u32, MarkerIndex)], structures: &[(u32, Arc<Vec<u8>>)], decls: &[SliceDecl]) -> Option<Agreed> {
        let ranks = parts
            .iter()
            .map(|(rank, m)| match m {
                MarkerIndex::Shaped(s, v) => Some((
                    s.clone(),
                    structures.iter().find(|(r, _)| r == rank).map(|(_, b)| b.clone()),
                    v.blobs.iter().any(|b| b.name == crate::skeleton::PARTS_BLOB),
                )),
                MarkerIndex::Parsed(_) => None,
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Agreed { ranks, decls: decls.to_vec() })
    }
}

/// Values a marker read by its template may hold without the checks of a
/// parse ([`Index::validate`]): those that depend on them are made again.
fn acceptable(v: &Values) -> bool {
    v.step <= crate::format::STEP_MAX && crate::format::validate_blobs(&v.blobs).is_ok()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The merged index of one set of shapes (by rank) and declarations, as a
/// template whose tensors are the ranks' in rank order, each rank's in its
/// marker's order.
#[derive(Debug)]
pub(crate) struct KeptMerge {
    shapes: Vec<Arc<MarkerShape>>,
    decls: Vec<SliceDecl>,
    template: IndexTemplate,
}

impl KeptMerge {
    /// The merge of the shapes' drafts ([`ranks::merge_indexes`]: what it
    /// refuses is refused); None if its template cannot be made.
    fn new(shapes: Vec<Arc<MarkerShape>>, decls: &[SliceDecl]) -> Result<Option<KeptMerge>, FormatError> {
        let drafts = shapes.iter().enumerate().map(|(r, s)| (r as u32, draft_of(&s.index))).collect();
        let mut merged = ranks::merge_indexes(drafts, decls)?;
        merged.ckpt.index_crc32c = 0;
        let names = shapes.iter().flat_map(|s| s.index.ckpt.tensors.keys().map(String::as_str));
        let Some(template) = IndexTemplate::new(&merged, names) else { return Ok(None) };
        Ok(Some(KeptMerge { shapes, decls: decls.to_vec(), template }))
    }

    fn is_of(&self, shapes: &[Arc<MarkerShape>], decls: &[SliceDecl]) -> bool {
        self.shapes.len() == shapes.len()
            && self.shapes.iter().zip(shapes).all(|(a, b)| Arc::ptr_eq(a, b))
            && self.decls == decls
    }
}

/// A step's merged index ready to render: a kept merge and its values.
#[derive(Debug)]
pub(crate) struct Merged {
    merge: Arc<KeptMerge>,
    step: u64,
    file_crcs: Vec<u32>,
    tensor_crcs: Vec<u32>,
    digests: Vec<u128>,
    blobs: Vec<IndexBlob>,
}

impl Merged {
    /// The values of markers (by rank) joined, checked as
    /// [`ranks::merge_indexes`] checks what changes with them: one step,
    /// each blob named once.
    fn of(merge: Arc<KeptMerge>, values: &[&Values]) -> Result<Merged, FormatError> {
        let step = values[0].step;
        if let Some((rank, v)) = values.iter().enumerate().find(|(_, v)| v.step != step) {
            let ws = values.len();
            return Err(FormatError::Index(format!(
                "rank {rank}'s marker is of step {} and world size {ws}, rank 0's of step {step} and {ws}",
                v.step
            )));
        }
        let mut blobs: Vec<IndexBlob> = values.iter().flat_map(|v| v.blobs.iter().cloned()).collect();
        blobs.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = blobs.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(FormatError::DuplicateBlob(w[0].name.clone()));
        }
        let cat = |f: fn(&Values) -> &[u32]| values.iter().flat_map(|v| f(v).iter().copied()).collect::<Vec<u32>>();
        Ok(Merged {
            merge,
            step,
            file_crcs: cat(|v| &v.file_crcs),
            tensor_crcs: cat(|v| &v.tensor_crcs),
            digests: values.iter().flat_map(|v| v.digests.iter().copied()).collect(),
            blobs,
        })
    }

    /// The sealed index handed to `out` in pieces of about `piece_bytes`
    /// ([`IndexTemplate::render_pieces`]), the last returned.
    pub(crate) fn render(
        &self,
        piece_bytes: usize,
        out: &mut dyn FnMut(&[u8]) -> io::Result<()>,
    ) -> io::Result<Vec<u8>> {
        let filled = Filled {
            step: self.step,
            file_crcs: &self.file_crcs,
            tensor_crcs: &self.tensor_crcs,
            digests: &self.digests,
            blobs: &self.blobs,
        };
        self.merge.template.render_pieces(&filled, piece_bytes, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Dtype, IndexNode};
    use crate::image::{Blob, Layout, LayoutOptions, TensorSpec};

    /// Rank `rank`'s part of a world of two: `n` tensors of 16 KiB over
    /// several 64 KiB shards.
    fn plan(rank: u32, n: usize) -> Layout {
        let specs = (0..n).map(|i| TensorSpec::new(format!("r{rank}.t{i:03}"), Dtype::F32, &[4096])).collect();
        let opts = LayoutOptions { rank, world_size: 2, shard_bytes_max: 64 << 10, ..Default::default() };
        Layout::plan(specs, opts).unwrap()
    }

    /// Rank `rank`'s marker of `step` as its node's sidecar renders it
    /// (node-local files, digests, a blob per rank and step).
    fn marker(l: &Layout, step: u64, seed: u32, blobs: &[Blob<'_>]) -> Vec<u8> {
        marker_held(l, step, seed, blobs, true)
    }

    /// [`marker`], its files node-local or in the shared directory.
    fn marker_held(l: &Layout, step: u64, seed: u32, blobs: &[Blob<'_>], node_local: bool) -> Vec<u8> {
        let n = l.specs.len();
        let crcs: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect();
        let digests: Vec<u128> = crcs.iter().map(|&c| (u128::from(c) << 64) | u128::from(seed)).collect();
        let files = l.shards.iter().map(|s| s.file_name.clone()).collect();
        let id = format!("node-{}", l.opts.rank);
        let mut nodes = BTreeMap::from([(id.clone(), IndexNode { dirs: vec![format!("/local/{id}")], files })]);
        if !node_local {
            nodes.clear();
        }
        l.index_json_with(step, &crcs, Some(&digests), blobs, vec![], &nodes)
    }

    fn rendered(m: &Merged, piece_bytes: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let last = m
            .render(piece_bytes, &mut |p| {
                assert!(p.len() >= piece_bytes, "every piece but the last is at least that long");
                out.extend_from_slice(p);
                Ok(())
            })
            .unwrap();
        out.extend_from_slice(&last);
        out
    }

    #[test]
    fn a_marker_read_by_its_shape_is_the_marker_parsed() {
        let kept = KeptMarkers::default();
        let l = plan(1, 40);
        assert!(l.shards.len() > 3, "several files");
        let first = marker(&l, 7, 1, &[]);
        let MarkerIndex::Shaped(shape, _) = kept.read(1, &first).unwrap() else { panic!("kept at its first parse") };
        let rng = [Blob { name: "rng.1", bytes: b"r8" }];
        for (step, seed, blobs) in [(8u64, 2u32, &rng[..]), (9, 3, &[]), (1_000_000, 4, &rng[..])] {
            let raw = marker(&l, step, seed, blobs);
            let got = kept.read(1, &raw).unwrap();
            assert!(matches!(&got, MarkerIndex::Shaped(s, _) if Arc::ptr_eq(s, &shape)), "read by its shape");
            assert_eq!(got.blobs().len(), blobs.len());
            assert_eq!(got.into_index(), Index::from_json_bytes(&raw).unwrap(), "step {step}");
        }
        // Files in the shared directory (no nodes section: the blobs are
        // the section's last key before the checksum).
        let shared = KeptMarkers::default();
        let skel = [Blob { name: "structure.pkl", bytes: b"s" }, Blob { name: "rng.1", bytes: b"r" }];
        let first = marker_held(&l, 7, 1, &skel, false);
        let MarkerIndex::Shaped(s1, _) = shared.read(1, &first).unwrap() else { panic!("kept") };
        for (step, blobs) in [(8u64, &skel[..]), (9, &[]), (10, &skel[..1])] {
            let raw = marker_held(&l, step, step as u32, blobs, false);
            let got = shared.read(1, &raw).unwrap();
            assert!(matches!(&got, MarkerIndex::Shaped(s, _) if Arc::ptr_eq(s, &s1)), "step {step}: read by its shape");
            assert_eq!(got.into_index(), Index::from_json_bytes(&raw).unwrap(), "step {step}");
        }
        // A damaged number: the checksum no longer matches, and the parse says so.
        let mut bad = marker(&l, 10, 5, &[]);
        let at = bad.windows(9).position(|w| w == b"\"step\": 1").unwrap() + 8;
        bad[at] = b'2';
        assert!(kept.read(1, &bad).is_err());
        // Another layout (one tensor more) is parsed and becomes the rank's shape.
        let other = marker(&plan(1, 41), 11, 6, &[]);
        let MarkerIndex::Shaped(s2, _) = kept.read(1, &other).unwrap() else { panic!("kept") };
        assert!(!Arc::ptr_eq(&s2, &shape));
        assert_eq!(kept.read(1, &other).unwrap().into_index(), Index::from_json_bytes(&other).unwrap());
        // A marker that is not laid out canonically (same index, compact JSON) is parsed.
        let ix = Index::from_json_bytes(&other).unwrap();
        let compact = serde_json::to_vec(&ix).unwrap();
        assert!(matches!(kept.read(1, &compact).unwrap(), MarkerIndex::Parsed(p) if p == ix));
    }

    #[test]
    fn a_kept_merge_renders_what_merging_the_markers_serialises() {
        let kept = KeptMarkers::default();
        let (a, b) = (plan(0, 30), plan(1, 20));
        let mut first = None;
        for step in 1..=3u64 {
            let rng = format!("rng.{step}");
            let blobs = [Blob { name: &rng, bytes: b"x" }];
            let raws = [marker(&a, step, step as u32, &blobs), marker(&b, step, 100 + step as u32, &[])];
            let parts: Vec<(u32, MarkerIndex)> =
                raws.iter().enumerate().map(|(r, raw)| (r as u32, kept.read(r as u32, raw).unwrap())).collect();
            let m = kept.merged(&parts, &[]).unwrap().expect("every marker read by its shape");
            // Kept from the first step on: the same merge every step.
            let merge = first.get_or_insert_with(|| m.merge.clone());
            assert!(Arc::ptr_eq(merge, &m.merge), "step {step}");
            let want = ranks::merge_indexes(
                raws.iter().enumerate().map(|(r, raw)| (r as u32, Index::from_json_bytes(raw).unwrap())).collect(),
                &[],
            )
            .unwrap()
            .to_json_bytes();
            for piece in [usize::MAX, 1000, 64] {
                assert_eq!(rendered(&m, piece), want, "step {step}, pieces of {piece}");
            }
            assert_eq!(Index::from_json_bytes(&want).unwrap().ckpt.nodes.len(), 2);
        }
        // A blob named by two ranks, and markers of two steps, are refused as a merge refuses them.
        let blobs = [Blob { name: "same", bytes: b"x" }];
        let parts = [marker(&a, 4, 1, &blobs), marker(&b, 4, 2, &blobs)]
            .iter()
            .enumerate()
            .map(|(r, raw)| (r as u32, kept.read(r as u32, raw).unwrap()))
            .collect::<Vec<_>>();
        assert!(matches!(kept.merged(&parts, &[]), Err(FormatError::DuplicateBlob(n)) if n == "same"));
        let parts = [marker(&a, 4, 1, &[]), marker(&b, 5, 2, &[])]
            .iter()
            .enumerate()
            .map(|(r, raw)| (r as u32, kept.read(r as u32, raw).unwrap()))
            .collect::<Vec<_>>();
        assert!(kept.merged(&parts, &[]).unwrap_err().to_string().contains("step 5"));
        // A parsed marker among them: the caller merges.
        let ix = Index::from_json_bytes(&marker(&b, 4, 2, &[])).unwrap();
        let parts = vec![(0, kept.read(0, &marker(&a, 4, 1, &[])).unwrap()), (1, MarkerIndex::Parsed(ix))];
        assert!(kept.merged(&parts, &[]).unwrap().is_none());
    }

    #[test]
    fn a_kept_merge_with_slice_declarations_renders_their_checksums() {
        // w is F32 [2, 4096]: its first row on rank 0, its second on rank 1.
        let piece = |rank: u32, e: [u64; 2]| {
            let name = format!("w#elems[{}:{}]", e[0], e[1]);
            let specs = vec![TensorSpec::new(name.as_str(), Dtype::F32, &[4096])];
            let opts = LayoutOptions { rank, world_size: 2, ..Default::default() };
            let decl = SliceDecl { piece: name, of: "w".into(), shape: vec![2, 4096], elems: e };
            (Layout::plan(specs, opts).unwrap(), decl)
        };
        let ((a, da), (b, db)) = (piece(0, [0, 4096]), piece(1, [4096, 8192]));
        let decls = [db, da];
        let kept = KeptMarkers::default();
        for step in 1..=2u64 {
            let raws = [marker(&a, step, step as u32, &[]), marker(&b, step, 9 * step as u32, &[])];
            let parts: Vec<_> =
                raws.iter().enumerate().map(|(r, raw)| (r as u32, kept.read(r as u32, raw).unwrap())).collect();
            let m = kept.merged(&parts, &decls).unwrap().unwrap();
            let parsed =
                raws.iter().enumerate().map(|(r, raw)| (r as u32, Index::from_json_bytes(raw).unwrap())).collect();
            let want = ranks::merge_indexes(parsed, &decls).unwrap();
            assert_eq!(want.logical_tensor("w").unwrap().slices.len(), 2);
            assert_eq!(rendered(&m, usize::MAX), want.to_json_bytes(), "step {step}");
        }
    }

    #[test]
    fn the_same_markers_are_checked_for_agreement_once() {
        let kept = KeptMarkers::default();
        let (a, b) = (plan(0, 5), plan(1, 5));
        let read = |step: u64| {
            vec![
                (0, kept.read(0, &marker(&a, step, 1, &[])).unwrap()),
                (1, kept.read(1, &marker(&b, step, 2, &[])).unwrap()),
            ]
        };
        let skel = |b: &[u8]| vec![(0, Arc::new(b.to_vec()))];
        let asked = std::cell::Cell::new(0);
        let check = |why: Option<&str>| {
            asked.set(asked.get() + 1);
            why.map(str::to_string)
        };
        // Refused: asked again next time.
        assert!(kept.unless_agreed(&read(1), &skel(b"s"), &[], || check(Some("no"))).is_some());
        assert!(kept.unless_agreed(&read(2), &skel(b"s"), &[], || check(None)).is_none());
        assert!(kept.unless_agreed(&read(3), &skel(b"s"), &[], || check(Some("asked"))).is_none());
        assert_eq!(asked.get(), 2, "the same shapes and skeleton: not asked again");
        // Another skeleton, another layout, a parsed marker: asked.
        assert!(kept.unless_agreed(&read(4), &skel(b"t"), &[], || check(Some("skeleton"))).is_some());
        let other = vec![(0, kept.read(0, &marker(&plan(0, 6), 5, 1, &[])).unwrap()), read(5).pop().unwrap()];
        assert!(kept.unless_agreed(&other, &skel(b"s"), &[], || check(Some("layout"))).is_some());
        let parsed = vec![(0, MarkerIndex::Parsed(Index::from_json_bytes(&marker(&a, 6, 1, &[])).unwrap()))];
        assert!(kept.unless_agreed(&parsed, &[], &[], || check(None)).is_none());
        assert!(kept.unless_agreed(&parsed, &[], &[], || check(Some("parsed"))).is_some());
        assert_eq!(asked.get(), 6);
    }

    #[test]
    fn markers_beyond_the_budget_are_parsed_and_merged_as_before() {
        let (a, b) = (plan(0, 30), plan(1, 30));
        let (ra, rb) = (marker(&a, 1, 1, &[]), marker(&b, 1, 2, &[]));
        // Room for one rank's shape only.
        let kept = KeptMarkers::with_budget(cost_of(ra.len().max(rb.len())) + 100);
        let parts = vec![(0, kept.read(0, &ra).unwrap()), (1, kept.read(1, &rb).unwrap())];
        assert!(matches!(parts[0].1, MarkerIndex::Shaped(..)));
        assert!(matches!(parts[1].1, MarkerIndex::Parsed(_)), "over the budget");
        assert!(lock(&kept.shapes).cost <= kept.budget);
        assert!(kept.merged(&parts, &[]).unwrap().is_none(), "the caller merges");
        let want = ranks::merge_indexes(
            vec![(0, Index::from_json_bytes(&ra).unwrap()), (1, Index::from_json_bytes(&rb).unwrap())],
            &[],
        )
        .unwrap();
        let got = ranks::merge_indexes(parts.into_iter().map(|(r, m)| (r, m.into_index())).collect(), &[]).unwrap();
        assert_eq!(got.to_json_bytes(), want.to_json_bytes());
        // Rank 1's next marker is parsed again; rank 0's still read by its shape.
        assert!(matches!(kept.read(1, &marker(&b, 2, 3, &[])).unwrap(), MarkerIndex::Parsed(_)));
        assert!(matches!(kept.read(0, &marker(&a, 2, 3, &[])).unwrap(), MarkerIndex::Shaped(..)));
    }

    #[test]
    fn shapes_of_ranks_beyond_the_world_are_let_go() {
        let kept = KeptMarkers::default();
        let (a, b) = (plan(0, 5), plan(1, 5));
        kept.read(0, &marker(&a, 1, 1, &[])).unwrap();
        kept.read(1, &marker(&b, 1, 1, &[])).unwrap();
        let cost = lock(&kept.shapes).cost;
        kept.keep_world(1);
        let shapes = lock(&kept.shapes);
        assert_eq!(shapes.by_rank.keys().copied().collect::<Vec<_>>(), vec![0]);
        assert_eq!(shapes.cost, shapes.by_rank[&0].cost());
        assert!(shapes.cost < cost);
    }
}
