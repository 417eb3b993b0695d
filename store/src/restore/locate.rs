//! Where a read finds what it reads: the committed steps to try for a
//! [`Which`], the index of one (bounded, its step checked), the directories
//! it records, and the folder each file is read from (a node-held file's
//! node folder, or refused when another node holds it).
//!
//! Invariant: only committed steps a reader may see (`catalog::is_readable`:
//! none a pending rollback un-commits) are read.

use std::fs;
use std::path::{Path, PathBuf};

use super::{problem, LoadError, ReadOptions, Which};
use crate::catalog;
use crate::config::{self, DIRECT_ALIGN_BYTES};
use crate::format::{self, Index, INDEX_FILE_NAME};

/// The node holding a file this reader needs (`opts.only_tensors`' files,
/// or all) when that is not the reader's node (`opts.node`); None when
/// every such file is the reader's own or in the index's directories.
pub fn held_elsewhere(index: &Index, opts: &ReadOptions) -> Option<String> {
    let me = opts.node.as_ref()?;
    let only: Option<std::collections::BTreeSet<&str>> = opts.only_tensors.as_ref().map(|names| {
        names
            .iter()
            .filter_map(|n| index.logical_tensor(n))
            .flat_map(|t| t.slices.into_iter().map(|s| s.file))
            .collect()
    });
    index
        .ckpt
        .files
        .iter()
        .filter(|f| only.as_ref().is_none_or(|o| o.contains(f.name.as_str())))
        .find_map(|f| index.holder(&f.name).filter(|(id, _)| *id != me.id).map(|(id, _)| id.to_string()))
}

/// The files of `step` this reader's node holds (`opts.only_tensors`'
/// files, or all) that are not in its own directories (a replaced node on
/// emptied disks): a load fetches them (from a peer, or the drain target).
pub fn own_files_missing(index: &Index, step: u64, opts: &ReadOptions) -> Vec<String> {
    let Some(me) = opts.node.as_ref() else { return Vec::new() };
    let Ok(folder) = format::node_step_dir_name(step) else { return Vec::new() };
    let only: Option<std::collections::BTreeSet<&str>> = opts.only_tensors.as_ref().map(|names| {
        names
            .iter()
            .filter_map(|n| index.logical_tensor(n))
            .flat_map(|t| t.slices.into_iter().map(|s| s.file))
            .collect()
    });
    index
        .ckpt
        .files
        .iter()
        .filter(|f| only.as_ref().is_none_or(|o| o.contains(f.name.as_str())))
        .filter(|f| index.holder(&f.name).is_some_and(|(id, _)| id == me.id))
        .filter(|f| me.dirs.get(f.dir_idx as usize).is_none_or(|d| !d.join(&folder).join(&f.name).exists()))
        .map(|f| f.name.clone())
        .collect()
}

/// The folder file `fi` of `step` is read from: its node's `node-step-…`
/// folder for a node-held file (this node's own directories when the
/// reader names its node; refused when another node holds it), else the
/// step's folder in the directory its `dir_idx` names.
pub(super) fn file_folder(
    index: &Index,
    dirs: &[PathBuf],
    step: u64,
    fi: usize,
    opts: &ReadOptions,
) -> Result<PathBuf, LoadError> {
    let f = &index.ckpt.files[fi];
    let Some((node, entry)) = index.holder(&f.name) else {
        return Ok(catalog::step_path(&dirs[f.dir_idx as usize], step));
    };
    let name = format::node_step_dir_name(step).expect("a committed step's number is valid");
    let recorded = &entry.dirs[f.dir_idx as usize];
    match &opts.node {
        Some(me) if me.id == node => {
            Ok(me.dirs.get(f.dir_idx as usize).map_or_else(|| PathBuf::from(recorded), |d| d.clone()).join(name))
        }
        Some(me) => Err(LoadError::OnAnotherNode {
            step,
            file: f.name.clone(),
            node: node.to_string(),
            dir: recorded.clone(),
            this: me.id.clone(),
        }),
        None => Ok(PathBuf::from(recorded).join(name)),
    }
}

/// Bytes of memory a load of `index` needs.
pub fn load_len_bytes(index: &Index) -> u64 {
    index.ckpt.files.iter().map(|f| config::align_up(f.len_bytes, DIRECT_ALIGN_BYTES)).sum()
}

/// The index of committed `step`; a step marked damaged
/// ([`catalog::DAMAGED_MARK_NAME`]) is Damaged with the mark's reason, so
/// loads of `latest` pass over it without reading it.
pub fn read_index(primary: &Path, step: u64) -> Result<Index, LoadError> {
    if let Some(why) = catalog::damage_mark(primary, step) {
        return Err(LoadError::Damaged { dir: primary.to_path_buf(), step, problems: vec![mark_problem(&why)] });
    }
    read_index_unmarked(primary, step)
}

/// What a step's damage mark says, as a problem of the step.
pub(super) fn mark_problem(why: &str) -> super::Problem {
    problem(
        Some(catalog::DAMAGED_MARK_NAME),
        None,
        format!("marked damaged: {why} (remove the mark once repaired to read the step again)"),
    )
}

/// [`read_index`] whether the step is marked damaged or not (verify reads
/// every byte of a marked step too).
pub(super) fn read_index_unmarked(primary: &Path, step: u64) -> Result<Index, LoadError> {
    // A step a pending rollback un-commits is not read (one timeline).
    if !catalog::is_readable(primary, step) {
        return Err(LoadError::NotCommitted { dir: primary.to_path_buf(), step });
    }
    let p = catalog::step_path(primary, step).join(INDEX_FILE_NAME);
    let damaged = |what: String| LoadError::Damaged {
        dir: primary.to_path_buf(),
        step,
        problems: vec![problem(Some(INDEX_FILE_NAME), None, what)],
    };
    let len = fs::metadata(&p).map_err(|e| LoadError::Io { path: p.clone(), what: "stat index", source: e })?.len();
    if len > config::INDEX_BYTES_MAX {
        return Err(damaged(format!("index of {len} bytes is above the limit")));
    }
    let bytes = fs::read(&p).map_err(|e| LoadError::Io { path: p.clone(), what: "read index", source: e })?;
    let index = Index::from_json_bytes(&bytes).map_err(|e| damaged(e.to_string()))?;
    if index.ckpt.step != step {
        return Err(damaged(format!("index says step {} in folder of step {step}", index.ckpt.step)));
    }
    Ok(index)
}

pub(super) fn dir_paths(primary: &Path, index: &Index, opts: &ReadOptions) -> Vec<PathBuf> {
    let mut v = vec![primary.to_path_buf()];
    match &opts.secondary_dirs {
        Some(s) => v.extend(s.iter().cloned()),
        None => v.extend(index.ckpt.secondary_dirs.iter().map(PathBuf::from)),
    }
    v
}

/// Steps to try, in order, for `which`.
pub(super) fn candidates(primary: &Path, which: Which) -> Result<Vec<u64>, LoadError> {
    match which {
        Which::Step(s) => Ok(vec![s]),
        Which::Latest => {
            let mut c = catalog::readable_steps(primary).map_err(|e| LoadError::Io {
                path: primary.to_path_buf(),
                what: "list",
                source: e,
            })?;
            // `latest` first if it names a committed one, then newest down.
            if let Some(l) = catalog::latest_step(primary).ok().flatten() {
                c.retain(|&s| s <= l);
            }
            c.reverse();
            if c.is_empty() {
                return Err(LoadError::NoCheckpoint { dir: primary.to_path_buf() });
            }
            Ok(c)
        }
    }
}

/// Whether a failed candidate lets `latest` fall back to an older one: a
/// damaged or unreadable checkpoint does; a failed destination
/// ([`LoadError::Destination`]) does not (the step may be sound).
pub(super) fn falls_back(which: Which, e: &LoadError) -> bool {
    which == Which::Latest && matches!(e, LoadError::Damaged { .. } | LoadError::Io { .. })
}
