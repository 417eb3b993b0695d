//! Several nodes' drain of node-local steps (docs/format.md, "Node-local
//! files"), and what a node's peers are sent of a step: each node's upload
//! marks in the shared directory, the drain's coordinator, a step's index
//! flattened for the drain target, and a node's part of the index.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::catalog;
use crate::commit::write_small_file;
use crate::format::{self, Index};
use crate::index_template::Values;
use crate::kept_markers::KeptMarkers;
use crate::ranks;

/// The folder of `step`'s upload marks in the shared directory,
/// `.drain-step-<12 digits>` (docs/format.md, "Node-local files"): one file
/// `<node>.uploaded` per node whose files of the step are on the drain
/// target. The drain's coordinator (the node holding rank 0's files,
/// [`drain_coordinator`]) commits the remote step once every node of the
/// index has its mark, then removes the folder.
pub fn upload_marks_path(shared: &Path, step: u64) -> Result<PathBuf, format::FormatError> {
    let name = format::step_dir_name(step)?;
    Ok(shared.join(format!("{DRAIN_MARKS_PREFIX}{}", &name[format::STEP_PREFIX.len()..])))
}

pub const DRAIN_MARKS_PREFIX: &str = ".drain-step-";

/// Records that `node`'s files of `step` are uploaded (a file written under
/// a temp name, synced, renamed, the folder synced).
pub fn mark_uploaded(shared: &Path, step: u64, node: &str) -> io::Result<()> {
    format::validate_node_id(node).map_err(io::Error::other)?;
    let dir = upload_marks_path(shared, step).map_err(io::Error::other)?;
    match fs::create_dir(&dir) {
        Ok(()) => catalog::fsync_dir(shared)?,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let (scratch, mark) = (dir.join(format!(".{node}.uploaded.tmp")), dir.join(format!("{node}.uploaded")));
    write_small_file(&scratch, node.as_bytes())?;
    fs::rename(&scratch, &mark)?;
    catalog::fsync_dir(&dir)
}

/// The nodes whose upload marks of `step` are in the shared directory.
pub fn uploaded_nodes(shared: &Path, step: u64) -> io::Result<BTreeSet<String>> {
    let dir = upload_marks_path(shared, step).map_err(io::Error::other)?;
    let rd = match fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(BTreeSet::new()),
        Err(e) => return Err(e),
    };
    let mut out = BTreeSet::new();
    for e in rd {
        if let Some(n) =
            e?.file_name().to_str().and_then(|n| n.strip_suffix(".uploaded")).filter(|n| !n.starts_with('.'))
        {
            out.insert(n.to_string());
        }
    }
    Ok(out)
}

/// Removes `step`'s upload marks (after its remote commit, or when the
/// drain gave the step up).
pub fn remove_upload_marks(shared: &Path, step: u64) -> io::Result<()> {
    let dir = upload_marks_path(shared, step).map_err(io::Error::other)?;
    match catalog::remove_tree(&dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The node whose drain commits a node-local step remotely: the holder of
/// rank 0's first file, else (rank 0 wrote none) the first node id.
pub fn drain_coordinator(index: &Index) -> Option<&str> {
    let rank0 = index.ckpt.files.iter().find(|f| ranks::rank_of_file(&f.name) == Some(0));
    rank0
        .and_then(|f| index.holder(&f.name))
        .map(|(id, _)| id)
        .or_else(|| index.ckpt.nodes.keys().next().map(String::as_str))
}

/// The part of a step's index that node `node` holds: its files, their
/// tensors and its `nodes` entry (no blobs, no slices: they name other
/// nodes' tensors), sealed. What a peer checks a replica of the node's
/// files against: it grows with the node's tensors, not the job's (the
/// whole index of two ranks of 10k tensors is 8 MB, parsed in ~20 ms by
/// each peer at every step). None when the index names no such node.
pub fn node_part(index: &Index, node: &str) -> Option<Index> {
    node_part_of(index, None, node)
}

/// [`node_part`] of an index read by template: `shape` with `values` in
/// its holes (its tensors by their order in it), or as it is.
fn node_part_of(shape: &Index, values: Option<&Values>, node: &str) -> Option<Index> {
    let held = shape.ckpt.nodes.get(node)?;
    let names: BTreeSet<&str> = held.files.iter().map(String::as_str).collect();
    let c = &shape.ckpt;
    let mut tensors = BTreeMap::new();
    for (i, (n, t)) in c.tensors.iter().enumerate() {
        if !names.contains(t.file.as_str()) {
            continue;
        }
        let mut t = t.clone();
        if let Some(v) = values {
            v.set_tensor(i, &mut t);
        }
        tensors.insert(n.clone(), t);
    }
    let mut files = Vec::new();
    for (i, f) in c.files.iter().enumerate() {
        if names.contains(f.name.as_str()) {
            let crc32c = values.map_or(f.crc32c, |v| v.file_crcs[i]);
            files.push(format::IndexFile { crc32c, ..f.clone() });
        }
    }
    let mut part = Index {
        metadata: format::IndexMetadata {
            total_size: tensors.values().map(|t: &format::IndexTensor| t.data_offsets[1] - t.data_offsets[0]).sum(),
        },
        weight_map: tensors.iter().map(|(n, t)| (n.clone(), t.file.clone())).collect(),
        ckpt: format::CkptSection {
            format_version: c.format_version,
            step: values.map_or(c.step, |v| v.step),
            world_size: c.world_size,
            secondary_dirs: c.secondary_dirs.clone(),
            files,
            tensors,
            blobs: Vec::new(),
            slices: BTreeMap::new(),
            nodes: [(node.to_string(), held.clone())].into(),
            index_crc32c: 0,
        },
    };
    part.seal();
    Some(part)
}

/// A node's reads of each step's committed index (its replication finds
/// its own files there, [`node_part`]): read by the template of the last
/// one when laid out the same (the layouts of kept plans are: an 8 MB
/// index is read in ~2 ms, parsed in ~20), else parsed.
#[derive(Debug, Default)]
pub struct KeptIndex(KeptMarkers);

impl KeptIndex {
    /// [`node_part`] of the index whose bytes are `raw` (checked as
    /// [`Index::from_json_bytes`] checks them).
    pub fn node_part(&self, raw: &[u8], node: &str) -> Result<Option<Index>, format::FormatError> {
        let m = self.0.read(0, raw)?;
        Ok(node_part_of(m.shape(), m.values(), node))
    }
}

/// A step's index as a one-directory checkpoint holds it (the drain
/// target's): every file in the step's own folder (`dir_idx` 0), no
/// secondary directories, no node-held files; sealed again.
pub fn flattened_index(mut index: Index) -> Index {
    index.ckpt.files.iter_mut().for_each(|f| f.dir_idx = 0);
    index.ckpt.secondary_dirs.clear();
    index.ckpt.nodes.clear();
    index.seal();
    index
}

#[cfg(test)]
mod drain_tests {
    use super::*;

    #[test]
    fn a_nodes_part_of_the_index_holds_its_files_and_tensors_only() {
        use crate::format::{Dtype, IndexNode};
        use crate::image::{Layout, LayoutOptions, TensorSpec};
        let marker = |rank: u32, step: u64| {
            let specs = (0..5).map(|i| TensorSpec::new(format!("r{rank}.t{i}"), Dtype::F32, &[4096])).collect();
            let opts = LayoutOptions { rank, world_size: 2, shard_bytes_max: 64 << 10, ..Default::default() };
            let l = Layout::plan(specs, opts).unwrap();
            let files = l.shards.iter().map(|s| s.file_name.clone()).collect();
            let nodes = [(format!("n{rank}"), IndexNode { dirs: vec![format!("/local/n{rank}")], files })].into();
            let crcs: Vec<u32> = (0..5).map(|i| 100 * rank + i + 1000 * step as u32).collect();
            let digests: Vec<u128> = crcs.iter().map(|&c| u128::from(c) << 70).collect();
            let raw = l.index_json_with(step, &crcs, Some(&digests), &[], vec![], &nodes);
            (rank, Index::from_json_bytes(&raw).unwrap())
        };
        let whole_of = |step: u64| ranks::merge_indexes(vec![marker(0, step), marker(1, step)], &[]).unwrap();
        let whole = whole_of(3);
        let part = node_part(&whole, "n1").unwrap();
        // Valid and sealed: it reads back as any index does.
        assert_eq!(Index::from_json_bytes(&part.to_json_bytes()).unwrap(), part);
        assert_eq!(part.ckpt.nodes.keys().collect::<Vec<_>>(), ["n1"]);
        let want: Vec<_> = whole.ckpt.files.iter().filter(|f| f.name.starts_with("rank-00001")).collect();
        assert_eq!(part.ckpt.files.iter().collect::<Vec<_>>(), want);
        assert_eq!(part.ckpt.tensors.len(), 5);
        for (name, t) in &part.ckpt.tensors {
            assert!(name.starts_with("r1."), "{name}");
            assert_eq!(&whole.ckpt.tensors[name], t);
        }
        assert_eq!(part.metadata.total_size * 2, whole.metadata.total_size);
        assert!(node_part(&whole, "n9").is_none());
        // Read again and again by a node's replication: the same parts,
        // the later indexes read by the template of the first.
        let kept = KeptIndex::default();
        for step in 3..=5 {
            let raw = whole_of(step).to_json_bytes();
            let want = node_part(&Index::from_json_bytes(&raw).unwrap(), "n1").unwrap();
            assert_eq!(kept.node_part(&raw, "n1").unwrap().unwrap(), want, "step {step}");
            assert_eq!(want.ckpt.step, step);
            assert!(matches!(kept.0.read(0, &raw).unwrap(), crate::kept_markers::MarkerIndex::Shaped(..)));
        }
        let mut bad = whole_of(6).to_json_bytes();
        let at = bad.len() / 2;
        bad[at] ^= 1;
        assert!(kept.node_part(&bad, "n1").is_err(), "a damaged index is refused as a parse refuses it");
    }

    #[test]
    fn upload_marks_are_per_node_and_go_with_their_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        assert!(uploaded_nodes(d, 3).unwrap().is_empty());
        mark_uploaded(d, 3, "node-a").unwrap();
        mark_uploaded(d, 3, "node-b").unwrap();
        mark_uploaded(d, 3, "node-a").unwrap();
        assert_eq!(uploaded_nodes(d, 3).unwrap().into_iter().collect::<Vec<_>>(), ["node-a", "node-b"]);
        assert!(uploaded_nodes(d, 4).unwrap().is_empty());
        assert!(mark_uploaded(d, 3, "../x").is_err());
        remove_upload_marks(d, 3).unwrap();
        remove_upload_marks(d, 3).unwrap();
        assert!(uploaded_nodes(d, 3).unwrap().is_empty());
    }
}
