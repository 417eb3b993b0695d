//! Reading checkpoints back: load (every shard into memory, verified) and
//! verify (every byte checked, one shard in memory at a time).
//!
//! Invariants:
//! - nothing read is handed out before its checksum matched: a load either
//!   returns a checkpoint whose every tensor and blob matched the index, or
//!   an error naming each file and tensor that did not;
//! - only committed checkpoints are read; `latest` with a bad checkpoint
//!   falls back to the newest good one and says which it skipped and why.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::catalog;
use crate::config::{self, DIRECT_ALIGN_BYTES};

use crate::format::{self, Index, BLOBS_DIR_NAME, INDEX_FILE_NAME};
use crate::io::{self as eio, FileIo, IoPolicy, OpKind};
use crate::mem::AlignedBuf;
use crate::skeleton;

pub(crate) mod fetched;
pub use fetched::FetchFiles;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    Latest,
    Step(u64),
}

#[derive(Debug, Clone, Default)]
pub struct ReadOptions {
    pub io: IoPolicy,
    /// Secondary directories to use instead of those the index recorded.
    pub secondary_dirs: Option<Vec<PathBuf>>,
    /// The node reading (several nodes, node-local files: `--node-local`):
    /// files it holds are read from its own directories, a file another
    /// node holds is [`LoadError::OnAnotherNode`]. None: every node-held
    /// file is read where its node's directories were recorded (one
    /// machine, or tools that name no node).
    pub node: Option<ThisNode>,
    /// Read only the files holding these tensors (names as readers see
    /// them, `Index::logical`; a load of some tensors): those files are
    /// checked whole, every blob is read; a name the step lacks is
    /// ignored here (the caller finds it missing). None: every file.
    pub only_tensors: Option<std::collections::BTreeSet<String>>,
}

/// The node a reader runs on ([`ReadOptions::node`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThisNode {
    pub id: String,
    /// Its directories, in the order a node-held file's `dir_idx` names them.
    pub dirs: Vec<PathBuf>,
}

/// One thing wrong with a checkpoint, naming where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub file: Option<String>,
    pub tensor: Option<String>,
    pub what: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{file}: ")?;
        }
        if let Some(t) = &self.tensor {
            write!(f, "tensor {t:?}: ")?;
        }
        f.write_str(&self.what)
    }
}

pub(crate) fn problem(file: Option<&str>, tensor: Option<&str>, what: impl Into<String>) -> Problem {
    Problem { file: file.map(str::to_string), tensor: tensor.map(str::to_string), what: what.into() }
}

/// A problem found in a stored tensor that is a slice names the logical
/// tensor and says which slice: `FILE: tensor "w": slice elems [a, b) of
/// rank R (stored as "w#…"): checksum mismatch …`.
pub(crate) fn name_slices(index: &Index, problems: &mut [Problem]) {
    if index.ckpt.slices.is_empty() {
        return;
    }
    for p in problems {
        let Some((logical, s)) = p.tensor.as_deref().and_then(|t| index.slice_of(t)) else { continue };
        p.what = format!(
            "slice elems [{}, {}) of rank {} (stored as {:?}): {}",
            s.elems[0], s.elems[1], s.rank, s.tensor, p.what
        );
        p.tensor = Some(logical.to_string());
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{dir}: no committed checkpoint")]
    NoCheckpoint { dir: PathBuf },
    #[error("{dir}: step {step} is not a committed checkpoint")]
    NotCommitted { dir: PathBuf, step: u64 },
    /// One line (it reaches a trainer's exception over the wire): the problems joined by "; ".
    #[error("{}: step {step} is damaged: {}", dir.display(), problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; "))]
    Damaged { dir: PathBuf, step: u64, problems: Vec<Problem> },
    #[error("{path}: {what}: {source}")]
    Io { path: PathBuf, what: &'static str, source: io::Error },
    #[error(transparent)]
    Probe(#[from] eio::ProbeError),
    #[error("step {step} needs {need_bytes} bytes of memory to load; {have_bytes} given")]
    BufferTooSmall { step: u64, need_bytes: u64, have_bytes: u64 },
    /// The memory read into failed under the load (a client's shared
    /// memory that shrank or could not be backed: a read into it got EFAULT,
    /// or the caller's check says so): an error of this load, never damage
    /// of the checkpoint, so `latest` does not fall back past the step.
    #[error("step {step} could not be read into its destination: {why}")]
    Destination { step: u64, why: String },
    /// A file the load needs is on another node's own disks (node-local
    /// files, docs/format.md): not damage, so `latest` does not fall back.
    #[error("step {step}: {file} is held by node {node:?} on its own disks ({dir}); this is node {this:?}, which cannot read it: restore on that node, give a drain target (--drain) that holds the step, or save in the shared layout (without --node-local)")]
    OnAnotherNode { step: u64, file: String, node: String, dir: String, this: String },
}

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

/// The folder file `fi` of `step` is read from: its node's `node-step-…`
/// folder for a node-held file (this node's own directories when the
/// reader names its node; refused when another node holds it), else the
/// step's folder in the directory its `dir_idx` names.
fn file_folder(
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

/// A checkpoint in memory of its own, every checksum matched: a [`Placed`]
/// (step, index, blobs, figures; reachable through `Deref`) and the buffer
/// holding the shard images.
pub struct Loaded {
    placed: Placed,
    buf: AlignedBuf,
}

impl std::ops::Deref for Loaded {
    type Target = Placed;
    fn deref(&self) -> &Placed {
        &self.placed
    }
}

impl Loaded {
    pub(crate) fn new(placed: Placed, buf: AlignedBuf) -> Loaded {
        Loaded { placed, buf }
    }

    pub fn tensor(&self, name: &str) -> Option<&[u8]> {
        self.placed.tensor_range(name).map(|r| &self.buf.as_slice()[r])
    }

    /// A tensor by name as a reader sees it (`Index::logical`): a stored
    /// tensor's bytes, or a sliced tensor's slices put together in order.
    /// Every byte was verified when the checkpoint was loaded.
    pub fn logical_bytes(&self, name: &str) -> Option<Vec<u8>> {
        let t = self.placed.index.logical_tensor(name)?;
        let mut out = Vec::with_capacity(t.len_bytes() as usize);
        for s in &t.slices {
            out.extend_from_slice(self.tensor(s.tensor)?);
        }
        Some(out)
    }

    /// Hands back the memory for reuse in the next load.
    pub fn into_buf(self) -> AlignedBuf {
        self.buf
    }
}

/// Bytes of memory a load of `index` needs.
pub fn load_len_bytes(index: &Index) -> u64 {
    index.ckpt.files.iter().map(|f| config::align_up(f.len_bytes, DIRECT_ALIGN_BYTES)).sum()
}

pub fn read_index(primary: &Path, step: u64) -> Result<Index, LoadError> {
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

fn dir_paths(primary: &Path, index: &Index, opts: &ReadOptions) -> Vec<PathBuf> {
    let mut v = vec![primary.to_path_buf()];
    match &opts.secondary_dirs {
        Some(s) => v.extend(s.iter().cloned()),
        None => v.extend(index.ckpt.secondary_dirs.iter().map(PathBuf::from)),
    }
    v
}

/// Steps to try, in order, for `which`.
fn candidates(primary: &Path, which: Which) -> Result<Vec<u64>, LoadError> {
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
fn falls_back(which: Which, e: &LoadError) -> bool {
    which == Which::Latest && matches!(e, LoadError::Damaged { .. } | LoadError::Io { .. })
}

/// Loads a checkpoint; with `Which::Latest` a damaged one falls back to the
/// newest good one. `buf`, if given and large enough, is reused (no fresh
/// pages on the data path).
pub fn load(primary: &Path, which: Which, opts: &ReadOptions, buf: Option<AlignedBuf>) -> Result<Loaded, LoadError> {
    let mut fell_back = Vec::new();
    let mut buf = buf;
    let mut last_err = None;
    for step in candidates(primary, which)? {
        match load_step(primary, step, opts, buf.take()) {
            Ok(mut l) => {
                l.placed.fell_back = fell_back;
                return Ok(l);
            }
            Err((e, b)) => {
                buf = b;
                if falls_back(which, &e) {
                    tracing::warn!(step, "checkpoint unusable, falling back: {e}");
                    fell_back.push((step, e.to_string()));
                    last_err = Some(e);
                    continue;
                }
                return Err(e);
            }
        }
    }
    Err(last_err.expect("at least one candidate"))
}

/// A checkpoint read into memory (the caller's with [`load_into`], its own
/// in [`Loaded`]); every checksum matched.
pub struct Placed {
    pub step: u64,
    pub index: Index,
    pub blobs: BTreeMap<String, Vec<u8>>,
    /// Newer checkpoints skipped on the way (step, why), newest first.
    pub fell_back: Vec<(u64, String)>,
    /// Bytes of shard files read.
    pub bytes: u64,
    pub seconds: f64,
    pub engine: String,
    /// Per file: (offset of the file image in the memory, data section start).
    files: BTreeMap<String, (usize, u64)>,
}

impl Placed {
    /// Where tensor `name`'s bytes are in the destination given to `load_into`.
    pub fn tensor_range(&self, name: &str) -> Option<std::ops::Range<usize>> {
        let t = self.index.ckpt.tensors.get(name)?;
        let &(base, data_start) = self.files.get(&t.file)?;
        Some(base + (data_start + t.data_offsets[0]) as usize..base + (data_start + t.data_offsets[1]) as usize)
    }

    /// Where a tensor as readers see it (`Index::logical`) lies whole in the
    /// destination: a stored tensor's range; None for one stored in several
    /// slices (not contiguous there) or not in the checkpoint.
    pub fn logical_range(&self, name: &str) -> Option<std::ops::Range<usize>> {
        match self.index.logical_tensor(name)?.slices.as_slice() {
            [s] => self.tensor_range(s.tensor),
            _ => None,
        }
    }
}

/// Like [`load`], but into `dest` (block-aligned, e.g. a part of the
/// daemon's staging memory) instead of a buffer of its own. A checkpoint
/// larger than `dest` is [`LoadError::BufferTooSmall`], which does not fall
/// back: the caller retries with more memory.
pub fn load_into(primary: &Path, which: Which, opts: &ReadOptions, dest: &mut [u8]) -> Result<Placed, LoadError> {
    // SAFETY: dest is a live, exclusively borrowed slice of dest.len() bytes,
    // untouched by anything else until this returns.
    unsafe { load_into_raw(primary, which, opts, dest.as_mut_ptr(), dest.len(), &OwnMemory) }
}

/// [`load_into`], with another node's files fetched from `remote`
/// ([`load_into_raw_with`]).
pub fn load_into_with(
    primary: &Path,
    which: Which,
    opts: &ReadOptions,
    remote: Option<&dyn FetchFiles>,
    dest: &mut [u8],
) -> Result<Placed, LoadError> {
    // SAFETY: dest is a live, exclusively borrowed slice of dest.len() bytes,
    // untouched by anything else until this returns.
    unsafe { load_into_raw_with(primary, which, opts, remote, dest.as_mut_ptr(), dest.len(), &OwnMemory) }
}

/// What a load needs around the memory it reads into, when that memory is
/// not its own (a client's shared memory, which may shrink under it).
pub trait ReadDest: Sync {
    /// Runs a reader thread's work (reading into the destination and
    /// checking it) inside whatever the caller needs around every access to
    /// that memory, on that thread: the daemon arms its fault handler for a
    /// client's segment there.
    fn run(&self, work: &mut dyn FnMut());

    /// After a step failed to load: `Err(why)` when the destination failed
    /// under it (then the failure is [`LoadError::Destination`], not damage).
    fn check(&self) -> Result<(), String>;

    /// Whether another process may write the destination meanwhile (a
    /// client's shared memory): then a checksum that fails there may be its
    /// writes, and the step is verified again from disk before it is called
    /// damaged.
    fn foreign(&self) -> bool {
        false
    }
}

/// Memory of the loader's own: nothing around its accesses, never failing.
pub struct OwnMemory;

impl ReadDest for OwnMemory {
    fn run(&self, work: &mut dyn FnMut()) {
        work()
    }

    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// [`load_into`] into memory given by address: `dest_len` bytes at `dest`,
/// read by every reader thread inside `guard.run`. A read into it that
/// fails with EFAULT, or a step that fails while `guard.check` says the
/// memory failed, is [`LoadError::Destination`] (no fallback).
///
/// # Safety
/// `dest` must be block-aligned and valid for reads and writes of
/// `dest_len` bytes for the whole call, or fault only inside `guard.run`
/// in a way it handles. Another process may change those bytes meanwhile (a
/// client's shared memory): then what it wrote may fail a checksum, never
/// pass one it did not.
pub unsafe fn load_into_raw(
    primary: &Path,
    which: Which,
    opts: &ReadOptions,
    dest: *mut u8,
    dest_len: usize,
    guard: &dyn ReadDest,
) -> Result<Placed, LoadError> {
    // SAFETY: this function's contract, passed on.
    unsafe { load_into_raw_with(primary, which, opts, None, dest, dest_len, guard) }
}

/// [`load_into_raw`], where a file another node holds (node-local files,
/// `opts.node`) is fetched from `remote` (a drain target holding the step:
/// `crate::fetch`) straight into its place instead of refused: this node's
/// own files are read from its disks, the rest streamed, all checked alike.
///
/// # Safety
/// As [`load_into_raw`].
pub unsafe fn load_into_raw_with(
    primary: &Path,
    which: Which,
    opts: &ReadOptions,
    remote: Option<&dyn FetchFiles>,
    dest: *mut u8,
    dest_len: usize,
    guard: &dyn ReadDest,
) -> Result<Placed, LoadError> {
    assert_eq!(dest as usize % DIRECT_ALIGN_BYTES, 0, "load destination must be block-aligned");
    let mut fell_back = Vec::new();
    let mut last_err = None;
    for step in candidates(primary, which)? {
        let t0 = Instant::now();
        let r = read_index(primary, step).and_then(|index| {
            let need_bytes = load_len_bytes(&index);
            if need_bytes > dest_len as u64 {
                return Err(LoadError::BufferTooSmall { step, need_bytes, have_bytes: dest_len as u64 });
            }
            // SAFETY: dest is block-aligned and valid for need_bytes (this
            // function's contract, checked against need_bytes above).
            unsafe { read_step_at(Origin::Local { primary, remote }, step, index, opts, dest, t0, guard) }
        });
        match r {
            Ok(mut p) => {
                p.fell_back = fell_back;
                return Ok(p);
            }
            // A checksum failed in memory someone else writes: the step is
            // damaged only if it also fails when verified on its own.
            Err(LoadError::Damaged { ref problems, .. })
                if guard.foreign() && verifies_apart(primary, step, opts, remote, problems) =>
            {
                return Err(LoadError::Destination {
                    step,
                    why: "its bytes changed in the destination while they were read and checked there (written by its owner?); the checkpoint itself verifies".into(),
                });
            }
            Err(e) if falls_back(which, &e) => {
                tracing::warn!(step, "checkpoint unusable, falling back: {e}");
                fell_back.push((step, e.to_string()));
                last_err = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last_err.expect("at least one candidate"))
}

/// Whether a step whose checksums failed in a client's memory verifies on
/// its own (then the failure was that memory's, not the checkpoint's). With
/// files fetched from `remote`: only when every file with a problem is one
/// fetched, and verifies when fetched again into memory of our own.
fn verifies_apart(
    primary: &Path,
    step: u64,
    opts: &ReadOptions,
    remote: Option<&dyn FetchFiles>,
    problems: &[Problem],
) -> bool {
    let Some(src) = remote else { return verify(primary, step, opts, |_, _| {}).is_ok_and(|r| r.problems.is_empty()) };
    let Ok(index) = read_index(primary, step) else { return false };
    let names: std::collections::BTreeSet<String> = problems.iter().filter_map(|p| p.file.clone()).collect();
    let is_fetched = |n: &str| matches!((index.holder(n), &opts.node), (Some((id, _)), Some(me)) if id != me.id);
    let names: Vec<String> = names.into_iter().collect();
    !names.is_empty()
        && names.iter().all(|n| is_fetched(n))
        && fetched::verifies_when_fetched_again(&index, &names, src)
}

type LoadFail = (LoadError, Option<AlignedBuf>);

fn load_step(primary: &Path, step: u64, opts: &ReadOptions, buf: Option<AlignedBuf>) -> Result<Loaded, LoadFail> {
    let t0 = Instant::now();
    let index = match read_index(primary, step) {
        Ok(i) => i,
        Err(e) => return Err((e, buf)),
    };
    let need = load_len_bytes(&index) as usize;
    let mut buf = match buf {
        Some(b) if b.len() >= need => b,
        _ => match AlignedBuf::new(need) {
            Ok(b) => b,
            Err(e) => {
                return Err((
                    LoadError::Io { path: primary.to_path_buf(), what: "allocate load buffer", source: e },
                    None,
                ))
            }
        },
    };
    // SAFETY: buf is owned here, page-aligned, at least `need` bytes, and
    // not touched by anything else until read_step_at returns.
    match unsafe {
        read_step_at(Origin::Local { primary, remote: None }, step, index, opts, buf.as_mut_ptr(), t0, &OwnMemory)
    } {
        Ok(placed) => Ok(Loaded { placed, buf }),
        Err(e) => Err((e, Some(buf))),
    }
}

/// What one directory's reader thread found ([`read_and_check`]).
struct DirRead {
    problems: Vec<Problem>,
    /// Each file's data-section start.
    starts: Vec<(String, u64)>,
    engine: String,
    /// A read into the destination failed with EFAULT: the memory, not the file.
    dest_failed: Option<String>,
}

/// Where a load's files come from ([`read_step_at`]).
#[derive(Clone, Copy)]
pub(crate) enum Origin<'a> {
    /// The step is committed in `primary`; a file another node holds is
    /// fetched from `remote` when given (else refused).
    Local { primary: &'a Path, remote: Option<&'a dyn FetchFiles> },
    /// Every file and blob fetched (a step only a drain target holds).
    Remote(&'a dyn FetchFiles),
}

/// Reads and checks every shard and blob of `step` (whose index is `index`)
/// into memory at `base`.
///
/// # Safety
/// `base` must be block-aligned and valid for writes of
/// `load_len_bytes(&index)` bytes that nothing else touches during the call.
pub(crate) unsafe fn read_step_at(
    origin: Origin<'_>,
    step: u64,
    index: Index,
    opts: &ReadOptions,
    base: *mut u8,
    t0: Instant,
    guard: &dyn ReadDest,
) -> Result<Placed, LoadError> {
    let (primary, remote) = match origin {
        Origin::Local { primary, remote } => (Some(primary), remote),
        Origin::Remote(src) => (None, Some(src)),
    };
    let dirs = primary.map(|p| dir_paths(p, &index, opts)).unwrap_or_default();
    let mut files = BTreeMap::new();
    let mut at = 0usize;
    // One reader per folder the files are read from (a directory's step
    // folder, or a node's node-step folder); the fetched files apart.
    let mut step_dirs: Vec<PathBuf> = Vec::new();
    let mut plan: Vec<Vec<(usize, usize)>> = Vec::new();
    let mut to_fetch: Vec<(usize, usize)> = Vec::new();
    let only_files: Option<std::collections::BTreeSet<&str>> = opts.only_tensors.as_ref().map(|names| {
        names
            .iter()
            .filter_map(|n| index.logical_tensor(n))
            .flat_map(|t| t.slices.into_iter().map(|s| s.file))
            .collect()
    });
    for (fi, f) in index.ckpt.files.iter().enumerate() {
        let here = at;
        at += config::align_up(f.len_bytes, DIRECT_ALIGN_BYTES) as usize;
        if only_files.as_ref().is_some_and(|only| !only.contains(f.name.as_str())) {
            continue;
        }
        files.insert(f.name.clone(), (here, 0u64));
        let folder = match (primary, remote) {
            (Some(_), _) => match file_folder(&index, &dirs, step, fi, opts) {
                Ok(folder) => folder,
                Err(LoadError::OnAnotherNode { .. }) if remote.is_some() => {
                    to_fetch.push((fi, here));
                    continue;
                }
                Err(e) => return Err(e),
            },
            (None, _) => {
                to_fetch.push((fi, here));
                continue;
            }
        };
        let di = match step_dirs.iter().position(|d| *d == folder) {
            Some(di) => di,
            None => {
                step_dirs.push(folder);
                plan.push(Vec::new());
                step_dirs.len() - 1
            }
        };
        plan[di].push((fi, here));
    }
    let base = base as usize;
    let outcome: Result<(Vec<DirRead>, Option<fetched::Fetched>), LoadError> = std::thread::scope(|s| {
        let handles: Vec<_> = plan
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.is_empty())
            .map(|(di, p)| {
                let index = &index;
                let dir = &step_dirs[di];
                s.spawn(move || {
                    let targets: Vec<(usize, Dest)> =
                        p.iter().map(|&(fi, off)| (fi, Dest::Whole((base + off) as *mut u8))).collect();
                    let mut reader = DirReader::open(dir, opts.io)?;
                    let mut out = None;
                    guard.run(&mut || {
                        // SAFETY: each target is a disjoint range of the
                        // caller's memory, valid until this scope ends (this
                        // function's contract).
                        out = Some(unsafe { read_and_check(dir, index, &targets, &mut reader) });
                    });
                    Ok::<DirRead, LoadError>(out.expect("the guard runs the work"))
                })
            })
            .collect();
        // The fetched files on this thread's own readers meanwhile.
        let got = match remote {
            // SAFETY: the fetched files' ranges are disjoint from each other
            // and from the local readers' (each file has its own), valid
            // until this scope ends (this function's contract).
            Some(src) if !to_fetch.is_empty() => {
                Some(unsafe { fetched::fetch_and_check(&index, &to_fetch, src, base, guard) })
            }
            _ => None,
        };
        let reads =
            handles.into_iter().map(|h| h.join().expect("reader thread panicked")).collect::<Result<Vec<_>, _>>()?;
        Ok((reads, got))
    });
    let mut problems = Vec::new();
    let mut engines = Vec::new();
    let mut dest_failed = None;
    let (outcome, got) = match outcome {
        Ok(o) => o,
        // An engine that would not start: still the memory's fault if it failed.
        Err(e) => return Err(guard.check().err().map_or(e, |why| LoadError::Destination { step, why })),
    };
    for d in outcome {
        problems.extend(d.problems);
        for (name, ds) in d.starts {
            files.get_mut(&name).expect("file listed").1 = ds;
        }
        engines.push(d.engine);
        dest_failed = dest_failed.or(d.dest_failed);
    }
    if let (Some(g), Some(src)) = (got, remote) {
        problems.extend(g.problems);
        for (name, ds) in g.starts {
            files.get_mut(&name).expect("file listed").1 = ds;
        }
        engines.push(format!("fetched from {}", src.label()));
    }
    let mut blobs = BTreeMap::new();
    match (primary, remote) {
        (Some(p), _) => problems.extend(read_blobs(&catalog::step_path(p, step), &index, &mut blobs)),
        (None, Some(src)) => problems.extend(fetched::fetch_blobs(&index, src, &mut blobs)),
        (None, None) => unreachable!("an origin has a directory or a source"),
    }
    check_skeleton(&index, &blobs, &mut problems);
    name_slices(&index, &mut problems);
    if !problems.is_empty() || dest_failed.is_some() {
        // A checksum that failed because the memory under it went (zero
        // pages mapped over a shrunk segment) is the memory's failure.
        if let Err(why) = guard.check() {
            return Err(LoadError::Destination { step, why });
        }
        if let Some(why) = dest_failed {
            return Err(LoadError::Destination { step, why });
        }
        let dir = match (primary, remote) {
            (Some(p), _) => p.to_path_buf(),
            (None, Some(src)) => fetched::label_path(src),
            (None, None) => unreachable!("an origin has a directory or a source"),
        };
        return Err(LoadError::Damaged { dir, step, problems });
    }
    engines.dedup();
    let bytes = index.ckpt.files.iter().filter(|f| files.contains_key(&f.name)).map(|f| f.len_bytes).sum();
    Ok(Placed {
        step,
        index,
        blobs,
        fell_back: Vec::new(),
        bytes,
        seconds: t0.elapsed().as_secs_f64(),
        engine: engines.join(","),
        files,
    })
}

/// A checkpoint whose Python skeleton names a tensor it does not hold does
/// not load (crate::skeleton): a problem of its `structure.pkl`.
pub(crate) fn check_skeleton(index: &Index, blobs: &BTreeMap<String, Vec<u8>>, problems: &mut Vec<Problem>) {
    let missing = skeleton::missing_from_index(index, blobs.get(skeleton::STRUCTURE_BLOB).map(Vec::as_slice));
    if !missing.is_empty() {
        let file = format!("{BLOBS_DIR_NAME}/{}", skeleton::STRUCTURE_BLOB);
        problems.push(problem(Some(&file), None, skeleton::describe_missing(&missing)));
    }
}

fn read_blobs(step_dir: &Path, index: &Index, out: &mut BTreeMap<String, Vec<u8>>) -> Vec<Problem> {
    check_blobs(index, out, |name, _| fs::read(step_dir.join(BLOBS_DIR_NAME).join(name)).map_err(|e| e.to_string()))
}

/// Every blob of the step read by `read(name, len from the index)` and
/// checked against the index (length, crc32c) into `out`: the problems.
pub(crate) fn check_blobs(
    index: &Index,
    out: &mut BTreeMap<String, Vec<u8>>,
    mut read: impl FnMut(&str, usize) -> Result<Vec<u8>, String>,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    for b in &index.ckpt.blobs {
        let file = format!("{BLOBS_DIR_NAME}/{}", b.name);
        match read(&b.name, b.len_bytes as usize) {
            Err(e) => problems.push(problem(Some(&file), None, format!("cannot read: {e}"))),
            Ok(bytes) if bytes.len() as u64 != b.len_bytes => problems.push(problem(
                Some(&file),
                None,
                format!("{} bytes where the index says {}", bytes.len(), b.len_bytes),
            )),
            Ok(bytes) => {
                let crc = crc32c::crc32c(&bytes);
                if crc != b.crc32c {
                    problems.push(problem(
                        Some(&file),
                        None,
                        format!("checksum mismatch (index {:#010x}, file {crc:#010x})", b.crc32c),
                    ));
                } else {
                    out.insert(b.name.clone(), bytes);
                }
            }
        }
    }
    problems
}

/// Where a file is read to: its own place in a buffer large enough for all
/// of it (load), or a ring window it streams through (verify).
#[derive(Clone, Copy)]
enum Dest {
    Whole(*mut u8),
    Window(*mut u8, u64),
}

/// Reads the files `targets` (index into `index.ckpt.files`, destination) of
/// one directory and checks each as its bytes arrive: length, header against
/// the index, every tensor's checksum (computed while later chunks are still
/// in flight), the file checksum. Returns the problems, the data-section
/// start of each file, and the engine name.
///
/// # Safety
/// Each destination must be valid, writable and otherwise untouched for the
/// whole call: for `Whole`, the file's length rounded up to the O_DIRECT
/// block; for `Window`, the window.
unsafe fn read_and_check(step_dir: &Path, index: &Index, targets: &[(usize, Dest)], reader: &mut DirReader) -> DirRead {
    let mut any_direct = false;
    let mut problems = Vec::new();
    let mut opened = Vec::new();
    let mut ios = Vec::new();
    let mut checks = Vec::new();
    for &(fi, dest) in targets {
        let f = &index.ckpt.files[fi];
        let path = step_dir.join(&f.name);
        let (file, direct) = match eio::open_for_read_with(&path, reader.want_direct) {
            Ok(f) => f,
            Err(e) => {
                problems.push(problem(Some(&f.name), None, format!("cannot open: {e}")));
                continue;
            }
        };
        let actual = file.metadata().map(|m| m.len()).unwrap_or(0);
        if actual != f.len_bytes {
            problems.push(problem(Some(&f.name), None, format!("{actual} bytes where the index says {}", f.len_bytes)));
            continue;
        }
        any_direct |= direct;
        let io_len = if direct { config::align_up(f.len_bytes, DIRECT_ALIGN_BYTES) } else { f.len_bytes };
        let (ptr, window_bytes) = match dest {
            Dest::Whole(p) => (p, 0),
            Dest::Window(p, w) => (p, w),
        };
        ios.push(FileIo { fd: file.as_raw_fd(), ptr, io_len, file_len: f.len_bytes, window_bytes });
        checks.push(FileCheck::new(f, index.tensors_of(&f.name).collect()));
        opened.push(file);
    }
    let mut check_problems: Vec<Problem> = Vec::new();
    let r = eio::drive(reader.engine.as_mut(), OpKind::Read, &ios, config::CHUNK_BYTES_DEFAULT, |i, bytes| {
        checks[i].feed(bytes, &mut check_problems);
    });
    let mut dest_failed = None;
    if let Err(e) = r {
        let name = match &e {
            eio::DriveError::Io { file_idx, .. }
            | eio::DriveError::ShortRead { file_idx, .. }
            | eio::DriveError::ShortWrite { file_idx, .. } => Some(checks[*file_idx].file.name.as_str()),
            eio::DriveError::Engine(_) | eio::DriveError::Source(_) => None,
        };
        if e.errno() == Some(libc::EFAULT) {
            // The kernel could not write the destination's pages: the
            // memory failed (a client's segment shrunk or unbacked), not the file.
            dest_failed = Some(format!("{}: the destination memory faulted: {e}", name.unwrap_or("a shard")));
        } else {
            problems.push(problem(name, None, format!("read failed: {e}")));
        }
    }
    problems.extend(check_problems);
    let mut starts = Vec::new();
    for c in &checks {
        c.finish(&mut problems);
        starts.push((c.file.name.clone(), c.data_start.unwrap_or(0)));
    }
    let engine = eio::EngineChoice { direct: any_direct, ..reader.choice.clone() }.name();
    DirRead { problems, starts, engine, dest_failed }
}

/// An engine for reading one directory, opened once and reused for its files.
struct DirReader {
    choice: eio::EngineChoice,
    want_direct: eio::Want,
    engine: Box<dyn eio::IoEngine>,
}

impl DirReader {
    fn open(dir: &Path, policy: IoPolicy) -> Result<DirReader, LoadError> {
        let (choice, want_direct) = eio::probe_for_read(dir, policy)?;
        let engine = choice.open_engine().map_err(|e| LoadError::Io {
            path: dir.to_path_buf(),
            what: "start I/O engine",
            source: e,
        })?;
        Ok(DirReader { choice, want_direct, engine })
    }
}

/// Checks one file from a stream of its bytes in order: the header (kept
/// until whole), then each tensor's crc32c computed incrementally, and the
/// file's crc32c combined from them.
pub(crate) struct FileCheck<'a> {
    file: &'a format::IndexFile,
    tensors: Vec<(&'a String, &'a format::IndexTensor)>,
    /// Bytes fed so far.
    pos: u64,
    header: Vec<u8>,
    data_start: Option<u64>,
    next: usize,
    tensor_crc: u32,
    file_crc: u32,
    failed: bool,
}

impl<'a> FileCheck<'a> {
    pub(crate) fn new(
        file: &'a format::IndexFile,
        tensors: Vec<(&'a String, &'a format::IndexTensor)>,
    ) -> FileCheck<'a> {
        FileCheck {
            file,
            tensors,
            pos: 0,
            header: Vec::new(),
            data_start: None,
            next: 0,
            tensor_crc: 0,
            file_crc: 0,
            failed: false,
        }
    }

    fn fail(&mut self, problems: &mut Vec<Problem>, what: String) {
        problems.push(problem(Some(&self.file.name), None, what));
        self.failed = true;
    }

    pub(crate) fn feed(&mut self, mut bytes: &[u8], problems: &mut Vec<Problem>) {
        let f = self.file;
        while !bytes.is_empty() && !self.failed {
            let Some(ds) = self.data_start else {
                // Header: 8 length bytes, then that many bytes of JSON.
                let want = if self.header.len() < 8 {
                    8
                } else {
                    let hlen = u64::from_le_bytes(self.header[..8].try_into().expect("8 bytes"));
                    if hlen > config::HEADER_BYTES_MAX as u64 || 8 + hlen > f.len_bytes {
                        let e = format::decode_header(&self.header, f.len_bytes)
                            .err()
                            .map_or_else(|| "bad header length".to_string(), |e| e.to_string());
                        return self.fail(problems, e);
                    }
                    8 + hlen as usize
                };
                let take = (want - self.header.len()).min(bytes.len());
                self.header.extend_from_slice(&bytes[..take]);
                self.pos += take as u64;
                bytes = &bytes[take..];
                let whole = self.header.len() >= 8
                    && self.header.len() as u64
                        == 8 + u64::from_le_bytes(self.header[..8].try_into().expect("8 bytes"));
                if whole {
                    self.parse_header(problems);
                }
                continue;
            };
            self.finish_tensors_ending_at_pos(problems);
            let Some(&(_, t)) = self.tensors.get(self.next) else {
                return self.fail(problems, "bytes after the last tensor".to_string());
            };
            let end = ds + t.data_offsets[1];
            let take = ((end - self.pos) as usize).min(bytes.len());
            self.tensor_crc = crc32c::crc32c_append(self.tensor_crc, &bytes[..take]);
            self.pos += take as u64;
            bytes = &bytes[take..];
            self.finish_tensors_ending_at_pos(problems);
        }
    }

    fn parse_header(&mut self, problems: &mut Vec<Problem>) {
        match format::decode_header(&self.header, self.file.len_bytes) {
            Err(e) => self.fail(problems, e.to_string()),
            Ok(h) => {
                let listed: Vec<_> = self
                    .tensors
                    .iter()
                    .map(|(n, t)| (n.as_str(), t.dtype, t.shape.as_slice(), t.data_offsets))
                    .collect();
                let mut found: Vec<_> = h
                    .tensors
                    .iter()
                    .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), [t.data_offsets.0, t.data_offsets.1]))
                    .collect();
                // File order, ties (zero-byte tensors) by name: as tensors_of.
                found.sort_by(|a, b| (a.3, a.0).cmp(&(b.3, b.0)));
                if listed != found {
                    return self.fail(problems, "safetensors header disagrees with the index".to_string());
                }
                self.data_start = Some(h.data_start);
                self.file_crc = crc32c::crc32c(&self.header);
                self.header = Vec::new();
                // Zero-byte tensors right after the header end here: a file
                // holding only those has no byte after it to close them.
                self.finish_tensors_ending_at_pos(problems);
            }
        }
    }

    /// Closes every tensor whose last byte has been fed (empty ones included).
    fn finish_tensors_ending_at_pos(&mut self, problems: &mut Vec<Problem>) {
        let ds = self.data_start.expect("header parsed");
        while let Some(&(name, t)) = self.tensors.get(self.next) {
            if ds + t.data_offsets[1] > self.pos {
                return;
            }
            if self.tensor_crc != t.crc32c {
                problems.push(problem(
                    Some(&self.file.name),
                    Some(name),
                    format!("checksum mismatch (index {:#010x}, data {:#010x})", t.crc32c, self.tensor_crc),
                ));
            }
            self.file_crc = crate::crc::combine(self.file_crc, self.tensor_crc, t.data_offsets[1] - t.data_offsets[0]);
            self.tensor_crc = 0;
            self.next += 1;
        }
    }

    /// Where the file's data section starts, once its header was parsed.
    pub(crate) fn data_start(&self) -> Option<u64> {
        self.data_start
    }

    pub(crate) fn finish(&self, problems: &mut Vec<Problem>) {
        let f = self.file;
        if self.failed || problems.iter().any(|p| p.file.as_deref() == Some(&f.name)) {
            return;
        }
        if self.pos != f.len_bytes || self.next != self.tensors.len() {
            problems.push(problem(Some(&f.name), None, format!("only {} of {} bytes checked", self.pos, f.len_bytes)));
        } else if self.file_crc != f.crc32c {
            problems.push(problem(
                Some(&f.name),
                None,
                format!("file checksum mismatch (index {:#010x}, file {:#010x})", f.crc32c, self.file_crc),
            ));
        }
    }
}

/// What `verify` found.
#[derive(Debug, Clone)]
pub struct VerifyReport {
    pub step: u64,
    pub files: usize,
    pub tensors: usize,
    pub bytes: u64,
    pub problems: Vec<Problem>,
    pub seconds: f64,
}

/// Most memory `verify` streams a file through: queue depth x chunk, twice.
const VERIFY_WINDOW_BYTES_MAX: usize = 2 * config::QUEUE_DEPTH_DEFAULT as usize * config::CHUNK_BYTES_DEFAULT;
const _: () = assert!(VERIFY_WINDOW_BYTES_MAX % config::CHUNK_BYTES_DEFAULT == 0);

/// Checks every byte of a committed checkpoint, streaming each file through
/// a window of memory; `progress(bytes_done, bytes_total)` after each file.
/// To verify several checkpoints, keep one [`Verifier`] (it reuses its window).
pub fn verify(
    primary: &Path,
    step: u64,
    opts: &ReadOptions,
    progress: impl FnMut(u64, u64),
) -> Result<VerifyReport, LoadError> {
    Verifier::default().verify(primary, step, opts, progress)
}

/// Verifies checkpoints through one window of at most 128 MiB, allocated on
/// first use no larger than the biggest file needs, and reused.
#[derive(Default)]
pub struct Verifier {
    window: Option<AlignedBuf>,
}

impl Verifier {
    fn window_for(&mut self, biggest_file_bytes: u64) -> std::io::Result<(*mut u8, u64)> {
        let want = (config::align_up(biggest_file_bytes.max(1), config::CHUNK_BYTES_DEFAULT) as usize)
            .min(VERIFY_WINDOW_BYTES_MAX);
        if self.window.as_ref().is_none_or(|w| w.len() < want) {
            self.window = None; // the old one goes before the new one comes
            self.window = Some(AlignedBuf::new(want)?);
        }
        let w = self.window.as_mut().expect("set above");
        // A multiple of the chunk size, as the driver requires of a window.
        let len = (w.len() / config::CHUNK_BYTES_DEFAULT * config::CHUNK_BYTES_DEFAULT) as u64;
        Ok((w.as_mut_ptr(), len))
    }

    pub fn verify(
        &mut self,
        primary: &Path,
        step: u64,
        opts: &ReadOptions,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<VerifyReport, LoadError> {
        let t0 = Instant::now();
        let index = match read_index(primary, step) {
            Ok(i) => i,
            Err(LoadError::Damaged { problems, .. }) => {
                return Ok(VerifyReport {
                    step,
                    files: 0,
                    tensors: 0,
                    bytes: 0,
                    problems,
                    seconds: t0.elapsed().as_secs_f64(),
                })
            }
            Err(e) => return Err(e),
        };
        let dirs = dir_paths(primary, &index, opts);
        let total: u64 = index.ckpt.files.iter().map(|f| f.len_bytes).sum();
        let biggest = index.ckpt.files.iter().map(|f| f.len_bytes).max().unwrap_or(0);
        let (window, window_bytes) = self.window_for(biggest).map_err(|e| LoadError::Io {
            path: primary.to_path_buf(),
            what: "allocate verify window",
            source: e,
        })?;
        let mut problems = Vec::new();
        let mut done = 0;
        let mut readers: Vec<(PathBuf, DirReader)> = Vec::new();
        for (fi, f) in index.ckpt.files.iter().enumerate() {
            let dir = file_folder(&index, &dirs, step, fi, opts)?;
            let ri = match readers.iter().position(|(d, _)| *d == dir) {
                Some(ri) => ri,
                None => {
                    readers.push((dir.clone(), DirReader::open(&dir, opts.io)?));
                    readers.len() - 1
                }
            };
            let reader = &mut readers[ri].1;
            // SAFETY: the window belongs to self, borrowed mutably for this
            // whole call, and nothing else touches it during read_and_check.
            let d = unsafe { read_and_check(&dir, &index, &[(fi, Dest::Window(window, window_bytes))], reader) };
            problems.extend(d.problems);
            // Our own window never faults; if it did, say so.
            problems.extend(d.dest_failed.map(|why| problem(Some(&f.name), None, why)));
            done += f.len_bytes;
            progress(done, total);
        }
        let mut blobs = BTreeMap::new();
        problems.extend(read_blobs(&catalog::step_path(primary, step), &index, &mut blobs));
        check_skeleton(&index, &blobs, &mut problems);
        name_slices(&index, &mut problems);
        Ok(VerifyReport {
            step,
            files: index.ckpt.files.len(),
            tensors: index.logical().len(),
            bytes: total,
            problems,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }
}
