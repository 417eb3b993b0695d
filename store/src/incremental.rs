//! Incremental checkpoints (docs/format.md, "Incremental checkpoints"): a
//! stable shard whose every tensor is unchanged since the newest committed
//! step is not written; that step's file is hard-linked into the new step's
//! temp folder instead (same directory, so the same file system), so every
//! step folder stays a complete safetensors checkpoint and retention stays
//! unlinking.
//!
//! Invariants:
//! - a tensor is unchanged only if the newest readable committed step
//!   ([`catalog::readable_steps`]: never a step a pending rollback
//!   un-commits) has a tensor of that name with the same dtype, shape,
//!   crc32c and digest (`xxh128`); an index without digests changes all;
//! - a file is linked only if it holds exactly the shard's tensors at the
//!   shard's offsets (so the same header bytes), in the same directory
//!   index, with the shard's length: the linked file is byte for byte the
//!   file the shard would have written, and the index lists it unchanged;
//! - a link that fails (the file gone, EMLINK, EXDEV) writes the shard
//!   instead: linking only ever saves work.

use std::collections::{HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};

use tracing::{debug, warn};

use crate::catalog;
use crate::format::{Index, INDEX_FILE_NAME};
use crate::image::Layout;

/// The newest committed step an incremental commit compares with.
pub struct Prev {
    pub step: u64,
    pub index: Index,
    /// Where each of its files that this store may link from lies (file
    /// name → path): in one node's store, every file, in the step's folder
    /// of the directory its `dir_idx` names; in a rank's part of several
    /// nodes, only those on the same file system as the part's shards
    /// ([`Prev::newest_shared`]).
    linkable: HashMap<String, PathBuf>,
    /// Tensor name → (dtype, shape, crc32c, digest).
    by_name: HashMap<String, usize>,
    /// File name → how many tensors it holds (counted once: a step of many
    /// small tensors has many stable shards, each asked about).
    held: HashMap<String, usize>,
}

impl Prev {
    /// The newest readable committed step of the store whose directories
    /// are `paths` (primary first), with its index; None when there is
    /// none, its index does not read, or it was written for other
    /// directories than these (then nothing can be linked).
    pub fn newest(paths: &[PathBuf]) -> Option<Prev> {
        let step = *catalog::readable_steps(&paths[0]).ok()?.last()?;
        let dir = catalog::step_path(&paths[0], step);
        let bytes = std::fs::read(dir.join(INDEX_FILE_NAME)).ok()?;
        let index = match Index::from_json_bytes(&bytes) {
            Ok(i) => i,
            Err(e) => {
                warn!(step, "incremental: the newest step's index does not read ({e}); everything is written");
                return None;
            }
        };
        let secondaries: Vec<String> = paths[1..].iter().map(|p| p.display().to_string()).collect();
        if index.ckpt.secondary_dirs != secondaries {
            debug!(step, "incremental: the newest step was written to other directories; nothing linked");
            return None;
        }
        let step_dirs: Vec<PathBuf> = paths.iter().map(|p| catalog::step_path(p, step)).collect();
        let linkable = index
            .ckpt
            .files
            .iter()
            .filter_map(|f| Some((f.name.clone(), step_dirs.get(f.dir_idx as usize)?.join(&f.name))))
            .collect();
        Some(Prev::with(step, index, linkable))
    }

    /// For one rank's part of several nodes (docs/format.md, "Several
    /// nodes"): the newest readable committed step of the shared directory
    /// `shared`, whose files the part's shards may be linked to. In the
    /// shared layout (`node` None) those are the files in its step folder
    /// there (the part's temp folder is in the same directory); with
    /// node-local files (`node`: this node's id and its directories, as
    /// `ckpt.nodes` records them), only the files this node holds in the
    /// same directories (a link stays within one of the node's own
    /// directories, `node-step-N` to `node-step-M`). None when there is no
    /// such step or its index does not read.
    pub fn newest_shared(shared: &Path, node: Option<(&str, &[PathBuf])>) -> Option<Prev> {
        let step = *catalog::readable_steps(shared).ok()?.last()?;
        let index = match crate::restore::read_index(shared, step) {
            Ok(i) => i,
            Err(e) => {
                warn!(step, "incremental: the newest step's index in the shared directory does not read ({e}); everything is written");
                return None;
            }
        };
        let mut linkable = HashMap::new();
        for f in &index.ckpt.files {
            let path = match (index.holder(&f.name), node) {
                (None, None) => catalog::step_path(shared, step).join(&f.name),
                (Some((holder, entry)), Some((id, dirs)))
                    if holder == id
                        && entry.dirs.len() == dirs.len()
                        && entry.dirs.iter().zip(dirs).all(|(a, b)| Path::new(a) == b) =>
                {
                    let Ok(folder) = crate::format::node_step_dir_name(step) else { continue };
                    let Some(d) = dirs.get(f.dir_idx as usize) else { continue };
                    d.join(folder).join(&f.name)
                }
                // Another node's disk, or another layout: never linked.
                _ => continue,
            };
            linkable.insert(f.name.clone(), path);
        }
        Some(Prev::with(step, index, linkable))
    }

    fn with(step: u64, index: Index, linkable: HashMap<String, PathBuf>) -> Prev {
        let by_name = index.ckpt.tensors.keys().enumerate().map(|(i, n)| (n.clone(), i)).collect();
        let mut held: HashMap<String, usize> = HashMap::new();
        for t in index.ckpt.tensors.values() {
            match held.get_mut(&t.file) {
                Some(n) => *n += 1,
                None => {
                    held.insert(t.file.clone(), 1);
                }
            }
        }
        Prev { step, index, linkable, by_name, held }
    }

    /// Whether layout tensor `i` (crc `crc`, digest `digest`) is unchanged
    /// since this step.
    pub fn unchanged(&self, layout: &Layout, i: usize, crc: u32, digest: u128) -> bool {
        let s = &layout.specs[i];
        let Some(t) = self.index.ckpt.tensors.get(&s.name) else { return false };
        t.dtype == s.dtype
            && t.shape == s.shape
            && t.crc32c == crc
            && t.xxh128.as_deref().and_then(crate::digest::parse_hex) == Some(digest)
    }

    /// The names of `layout`'s tensors that changed since this step (or
    /// are new), from the save's checksums and digests.
    pub fn changed(&self, layout: &Layout, crcs: &[u32], digests: &[u128]) -> HashSet<String> {
        (0..layout.specs.len())
            .filter(|&i| !self.unchanged(layout, i, crcs[i], digests[i]))
            .map(|i| layout.specs[i].name.clone())
            .collect()
    }

    /// The file of this step that shard `s` of `layout` could be linked
    /// to (before the save's digests are known): a stable shard whose
    /// tensors that file holds exactly, at the same offsets, in the same
    /// directory, of the same length.
    pub fn candidate(&self, layout: &Layout, s: usize) -> Option<PathBuf> {
        let sh = &layout.shards[s];
        if !sh.stable || sh.tensors.is_empty() {
            return None;
        }
        let first = &layout.specs[sh.tensors[0]].name;
        self.by_name.get(first)?;
        let file = &self.index.ckpt.tensors[first].file;
        let f = self.index.ckpt.files.iter().find(|f| &f.name == file)?;
        if f.dir_idx != sh.dir_idx || f.len_bytes != sh.file_len {
            return None;
        }
        if self.held.get(file) != Some(&sh.tensors.len()) {
            return None;
        }
        for &i in &sh.tensors {
            let s = &layout.specs[i];
            let t = self.index.ckpt.tensors.get(&s.name)?;
            let p = &layout.places[i];
            if &t.file != file
                || t.dtype != s.dtype
                || t.shape != s.shape
                || t.data_offsets != [p.data_offsets.0, p.data_offsets.1]
                || t.xxh128.is_none()
            {
                return None;
            }
        }
        self.linkable.get(file).cloned()
    }
}

/// Links `from` (a committed step's file) as `to` (in a temp folder of the
/// same directory). The new name becomes durable with the temp folder's
/// sync (the commit rule); the file's bytes are already durable.
pub fn link(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::hard_link(from, to)?;
    kill_after_links_for_tests();
    Ok(())
}

/// Crash tests: `CKPT_STORE_TEST_KILL_AFTER_LINKS=N` kills this process
/// with SIGKILL right after its N-th link (a sidecar killed while it links
/// a step's shards). Unset (always, outside tests), nothing happens; the
/// variable is read once.
pub const TEST_KILL_AFTER_LINKS_ENV: &str = "CKPT_STORE_TEST_KILL_AFTER_LINKS";

fn kill_after_links_for_tests() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static AFTER: OnceLock<Option<u64>> = OnceLock::new();
    static LINKS: AtomicU64 = AtomicU64::new(0);
    let Some(n) = *AFTER.get_or_init(|| std::env::var(TEST_KILL_AFTER_LINKS_ENV).ok().and_then(|v| v.parse().ok()))
    else {
        return;
    };
    if LINKS.fetch_add(1, Ordering::SeqCst) + 1 == n {
        // SAFETY: raising a signal on this process has no preconditions.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}

/// The (device, inode) of `file` of committed step `step` of `primary`
/// (its directory as the step's index names it; a node-held file in its
/// node's recorded directory), or None.
pub fn file_inode(primary: &Path, step: u64, file: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let index = crate::restore::read_index(primary, step).ok()?;
    let f = index.ckpt.files.iter().find(|f| f.name == file)?;
    let folder = match index.holder(file) {
        // A node-local file (several nodes): in its node's `node-step-…` folder.
        Some((_, entry)) => {
            PathBuf::from(entry.dirs.get(f.dir_idx as usize)?).join(crate::format::node_step_dir_name(step).ok()?)
        }
        None if f.dir_idx == 0 => catalog::step_path(primary, step),
        None => catalog::step_path(Path::new(index.ckpt.secondary_dirs.get(f.dir_idx as usize - 1)?), step),
    };
    let m = std::fs::metadata(folder.join(file)).ok()?;
    Some((m.dev(), m.ino()))
}

/// The readable committed steps of `primary` that hold the inode `id`
/// ([`file_inode`]) under any of their file names: the steps a damaged
/// shared file damages (`verify` names them).
pub fn steps_sharing(primary: &Path, id: (u64, u64)) -> Vec<u64> {
    let Ok(steps) = catalog::readable_steps(primary) else { return Vec::new() };
    steps
        .into_iter()
        .filter(|&s| {
            crate::restore::read_index(primary, s)
                .is_ok_and(|index| index.ckpt.files.iter().any(|f| file_inode(primary, s, &f.name) == Some(id)))
        })
        .collect()
}
