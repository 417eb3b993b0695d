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
//!   instead: linking only ever saves work;
//! - what a Store compares with is what the newest step's index records:
//!   read from disk, or kept in memory from the commit that wrote it
//!   ([`Kept`]) only while that step is still the newest readable one, its
//!   index file (one node) the very file that commit wrote.

use std::collections::{HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use tracing::{debug, warn};

use crate::catalog;
use crate::format::{Index, INDEX_FILE_NAME};
use crate::image::{Layout, TensorSpec};

/// The newest committed step an incremental commit compares with: what
/// its index records of each tensor and file, read from disk
/// ([`Prev::newest`], [`Prev::newest_shared`]) or kept from the commit
/// that wrote it ([`Prev::of_layout`]).
pub struct Prev {
    pub step: u64,
    /// The step's tensors' names, dtypes and shapes, in the order of
    /// `tensors`: the committing layout's own (shared, not copied) when
    /// kept from its commit ([`Prev::of_layout`]), so a state saved again
    /// finds tensor `i` at `i` ([`Prev::tensor`]).
    specs: Arc<Vec<TensorSpec>>,
    /// What the step recorded of each tensor besides its spec.
    tensors: Vec<PrevTensor>,
    /// Name → position, built at the first lookup that the position does
    /// not answer (a hash of every name costs more than the rest of a
    /// commit's comparison at 10k tensors).
    by_name: OnceLock<HashMap<String, usize>>,
    /// The step's files; a tensor's `file` indexes them.
    files: Vec<PrevFile>,
}

struct PrevTensor {
    /// Into [`Prev::files`]; None: a file the index does not list.
    file: Option<usize>,
    data_offsets: [u64; 2],
    crc32c: u32,
    /// None: no digest recorded (then the tensor counts as changed).
    digest: Option<u128>,
}

struct PrevFile {
    dir_idx: u32,
    len_bytes: u64,
    /// How many tensors it holds (counted once: a step of many small
    /// tensors has many stable shards, each asked about).
    held: usize,
    /// Where this store may link it from: in one node's store, every file,
    /// in the step's folder of the directory its `dir_idx` names; in a
    /// rank's part of several nodes, only those on the same file system
    /// as the part's shards ([`Prev::newest_shared`]).
    linkable: Option<PathBuf>,
}

impl Prev {
    /// The newest readable committed step of the store whose directories
    /// are `paths` (primary first), with its index; None when there is
    /// none, its index does not read, or it was written for other
    /// directories than these (then nothing can be linked).
    pub fn newest(paths: &[PathBuf]) -> Option<Prev> {
        let step = *catalog::readable_steps(&paths[0]).ok()?.last()?;
        Prev::read(paths, step)
    }

    /// Step `step` of the store whose directories are `paths`, its index
    /// read from disk ([`Prev::newest`]).
    fn read(paths: &[PathBuf], step: u64) -> Option<Prev> {
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
        Some(Prev::of_index(step, index, |f| Some(step_dirs.get(f.dir_idx as usize)?.join(&f.name))))
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
        Prev::read_shared(shared, step, node)
    }

    fn read_shared(shared: &Path, step: u64, node: Option<(&str, &[PathBuf])>) -> Option<Prev> {
        let index = match crate::restore::read_index(shared, step) {
            Ok(i) => i,
            Err(e) => {
                warn!(step, "incremental: the newest step's index in the shared directory does not read ({e}); everything is written");
                return None;
            }
        };
        Prev::of_shared_index(shared, step, node, index)
    }

    /// Rank `rank`'s part of the committed step `step` of the shared
    /// directory, from its marker in the step's folder (the coordinator
    /// merged the index from the markers, file and tensor entries as they
    /// are): this rank's bytes, not every rank's. None when the marker does
    /// not read, or is of another step or world size (then the caller reads
    /// the index).
    fn read_shared_part(
        shared: &Path,
        step: u64,
        node: Option<(&str, &[PathBuf])>,
        rank: u32,
        world_size: u32,
    ) -> Option<Prev> {
        let p = catalog::step_path(shared, step).join(crate::format::rank_marker_name(rank));
        let raw = std::fs::read(&p).ok()?;
        let marker = Index::from_json_bytes(&raw).ok()?;
        if marker.ckpt.step != step || marker.ckpt.world_size != world_size {
            return None;
        }
        debug!(step, rank, "incremental: compared with this rank's marker of the newest step");
        Prev::of_shared_index(shared, step, node, marker)
    }

    fn of_shared_index(shared: &Path, step: u64, node: Option<(&str, &[PathBuf])>, index: Index) -> Option<Prev> {
        // File name → its holder (Index::holder, the first node listing it).
        let mut holders: HashMap<&str, (&str, &crate::format::IndexNode)> = HashMap::new();
        for (id, n) in &index.ckpt.nodes {
            for f in &n.files {
                holders.entry(f.as_str()).or_insert((id.as_str(), n));
            }
        }
        let linkable = |f: &crate::format::IndexFile| match (holders.get(f.name.as_str()), node) {
            (None, None) => Some(catalog::step_path(shared, step).join(&f.name)),
            (Some(&(holder, entry)), Some((id, dirs)))
                if holder == id
                    && entry.dirs.len() == dirs.len()
                    && entry.dirs.iter().zip(dirs).all(|(a, b)| Path::new(a) == b) =>
            {
                let folder = crate::format::node_step_dir_name(step).ok()?;
                Some(dirs.get(f.dir_idx as usize)?.join(folder).join(&f.name))
            }
            // Another node's disk, or another layout: never linked.
            _ => None,
        };
        let files: Vec<Option<PathBuf>> = index.ckpt.files.iter().map(linkable).collect();
        let mut files = files.into_iter();
        Some(Prev::of_index(step, index, |_| files.next().flatten()))
    }

    /// What `index` (of step `step`) records; `linkable` says where each
    /// of its files may be linked from, asked once per file in order.
    fn of_index(
        step: u64,
        index: Index,
        mut linkable: impl FnMut(&crate::format::IndexFile) -> Option<PathBuf>,
    ) -> Prev {
        let ckpt = index.ckpt;
        let mut ids: HashMap<&str, usize> = HashMap::with_capacity(ckpt.files.len());
        let mut files = Vec::with_capacity(ckpt.files.len());
        for f in &ckpt.files {
            ids.entry(f.name.as_str()).or_insert(files.len());
            files.push(PrevFile { dir_idx: f.dir_idx, len_bytes: f.len_bytes, held: 0, linkable: linkable(f) });
        }
        let (mut specs, mut tensors) = (Vec::with_capacity(ckpt.tensors.len()), Vec::with_capacity(ckpt.tensors.len()));
        for (name, t) in ckpt.tensors {
            let file = ids.get(t.file.as_str()).copied();
            if let Some(i) = file {
                files[i].held += 1;
            }
            let digest = t.xxh128.as_deref().and_then(crate::digest::parse_hex);
            specs.push(TensorSpec { name, dtype: t.dtype, shape: t.shape });
            tensors.push(PrevTensor { file, data_offsets: t.data_offsets, crc32c: t.crc32c, digest });
        }
        Prev { step, specs: Arc::new(specs), tensors, by_name: OnceLock::new(), files }
    }

    /// What the index of step `step` records when `layout` committed it
    /// with these checksums and digests (the commit that wrote it keeps
    /// this instead of reading it back); `linkable` says where shard `s`'s
    /// file may be linked from.
    pub(crate) fn of_layout(
        step: u64,
        layout: &Layout,
        crcs: &[u32],
        digests: &[u128],
        linkable: impl Fn(&crate::image::ShardPlan) -> Option<PathBuf>,
    ) -> Prev {
        let files = layout
            .shards
            .iter()
            .map(|sh| PrevFile {
                dir_idx: sh.dir_idx,
                len_bytes: sh.file_len,
                held: sh.tensors.len(),
                linkable: linkable(sh),
            })
            .collect();
        let tensors = (layout.places.iter().enumerate())
            .map(|(i, p)| PrevTensor {
                file: Some(p.shard_idx),
                data_offsets: [p.data_offsets.0, p.data_offsets.1],
                crc32c: crcs[i],
                digest: Some(digests[i]),
            })
            .collect();
        // The layout's specs themselves: at 20k tensors, a copy of every
        // name and shape (and freeing the last one's) cost milliseconds of
        // each commit, before `latest` was written.
        let specs = Arc::clone(&layout.specs);
        Prev { step, specs, tensors, by_name: OnceLock::new(), files }
    }

    /// What this step recorded of `layout`'s tensor `i`, if it has one of
    /// that name, and whether its dtype and shape are the same: at
    /// position `i` when the name there is the same (the same state saved
    /// again; with the very specs of the layout, nothing to compare), else
    /// found by name.
    fn tensor(&self, layout: &Layout, i: usize) -> Option<(&PrevTensor, bool)> {
        if Arc::ptr_eq(&self.specs, &layout.specs) {
            return self.tensors.get(i).map(|t| (t, true));
        }
        let s = &layout.specs[i];
        let k = match self.specs.get(i) {
            Some(p) if p.name == s.name => i,
            _ => {
                let by_name = self
                    .by_name
                    .get_or_init(|| self.specs.iter().enumerate().map(|(k, p)| (p.name.clone(), k)).collect());
                *by_name.get(&s.name)?
            }
        };
        let p = &self.specs[k];
        Some((&self.tensors[k], p.dtype == s.dtype && p.shape == s.shape))
    }

    /// Whether layout tensor `i` (crc `crc`, digest `digest`) is unchanged
    /// since this step.
    pub fn unchanged(&self, layout: &Layout, i: usize, crc: u32, digest: u128) -> bool {
        let Some((t, same_spec)) = self.tensor(layout, i) else { return false };
        same_spec && t.crc32c == crc && t.digest == Some(digest)
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
        let file = self.tensor(layout, sh.tensors[0])?.0.file?;
        let f = &self.files[file];
        if f.dir_idx != sh.dir_idx || f.len_bytes != sh.file_len || f.held != sh.tensors.len() {
            return None;
        }
        for &i in &sh.tensors {
            let (t, same_spec) = self.tensor(layout, i)?;
            let p = &layout.places[i];
            if t.file != Some(file)
                || !same_spec
                || t.data_offsets != [p.data_offsets.0, p.data_offsets.1]
                || t.digest.is_none()
            {
                return None;
            }
        }
        f.linkable.clone()
    }
}

/// The step a Store committed last, as its index records it ([`Prev::of_layout`]),
/// kept for the next incremental commit: a step of many tensors has an
/// index of tens of megabytes, read back and parsed at every commit
/// otherwise. Used only while that step is still the newest readable one
/// and its index file the one the commit wrote ([`Prev::newest_or_kept`]).
pub(crate) struct Kept {
    prev: Prev,
    index: IndexStamp,
}

/// What tells an index file from another one written in its place (a
/// rollback and a new commit of the same step, by another process): its
/// identity, modification time and length, and its last bytes, which hold
/// its checksum. Read without parsing it.
#[derive(PartialEq, Eq)]
struct IndexStamp {
    dev: u64,
    ino: u64,
    mtime_ns: i128,
    len: u64,
    tail: Vec<u8>,
}

/// Bytes at the end of an index file compared by [`IndexStamp`]: its
/// closing `index_crc32c` field and more.
const INDEX_STAMP_TAIL_BYTES: u64 = 64;

impl IndexStamp {
    fn of(path: &Path) -> Option<IndexStamp> {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let f = std::fs::File::open(path).ok()?;
        let m = f.metadata().ok()?;
        let len = m.len();
        let tail_len = len.min(INDEX_STAMP_TAIL_BYTES);
        let mut tail = vec![0; tail_len as usize];
        f.read_exact_at(&mut tail, len - tail_len).ok()?;
        let mtime_ns = i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec());
        Some(IndexStamp { dev: m.dev(), ino: m.ino(), mtime_ns, len, tail })
    }
}

impl Kept {
    /// `prev`, of the step whose index the commit just wrote at `index`;
    /// None if that file cannot be looked at (then the next commit reads it).
    pub(crate) fn committed(prev: Prev, index: &Path) -> Option<Kept> {
        Some(Kept { index: IndexStamp::of(index)?, prev })
    }
}

impl Prev {
    /// [`Prev::newest`], taken from `kept` when its step is still the
    /// newest readable one and its index file the one that commit wrote
    /// (not rolled back, deleted by retention, or replaced by another
    /// process's commit); with whether it was.
    pub(crate) fn newest_or_kept(paths: &[PathBuf], kept: Option<Kept>) -> (Option<Prev>, bool) {
        let Some(step) = catalog::readable_steps(&paths[0]).ok().and_then(|s| s.last().copied()) else {
            return (None, false);
        };
        if let Some(k) = kept.filter(|k| k.prev.step == step) {
            let index = catalog::step_path(&paths[0], step).join(INDEX_FILE_NAME);
            if IndexStamp::of(&index).as_ref() == Some(&k.index) {
                return (Some(k.prev), true);
            }
            debug!(step, "incremental: the newest step's index is not the one this store wrote; read again");
        }
        (Prev::read(paths, step), false)
    }

    /// [`Prev::newest_shared`], taken from `kept` (this rank's part of a
    /// step, [`Prev::of_layout`]) when that step is the newest readable one
    /// in the shared directory: committed, its index merged from every
    /// rank's part, this one's as written. Only this rank's tensors are
    /// compared then (another rank's never are its to link). With whether
    /// it was kept.
    /// Not kept (the part of a step that is not yet committed was, or the
    /// sidecar started since), it is this rank's marker in that step's
    /// folder, when the step has the same world size, else its index.
    pub(crate) fn newest_shared_or_kept(
        shared: &Path,
        node: Option<(&str, &[PathBuf])>,
        kept: Option<Prev>,
        (rank, world_size): (u32, u32),
    ) -> (Option<Prev>, bool) {
        let Some(step) = catalog::readable_steps(shared).ok().and_then(|s| s.last().copied()) else {
            return (None, false);
        };
        match kept.filter(|k| k.step == step) {
            Some(k) => (Some(k), true),
            None => {
                let prev = Prev::read_shared_part(shared, step, node, rank, world_size)
                    .or_else(|| Prev::read_shared(shared, step, node));
                (prev, false)
            }
        }
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
