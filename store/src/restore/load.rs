//! The public loads: into memory of the load's own ([`load`], a
//! [`Loaded`]), into the caller's slice ([`load_into`]), or into memory given
//! by address and read under a caller's guard ([`load_into_raw`], the
//! daemon's path into a client's shared memory), and what they return
//! ([`Placed`]). Each tries the candidates of a [`Which`] in turn; `latest`
//! falls back past a damaged step, never past a failed destination.
//!
//! Invariant: nothing is returned before every checksum matched; a step whose
//! checksums failed in memory another process writes is called damaged only
//! if it also fails when verified on its own.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use super::fetched::{self, FetchFiles};
use super::locate::{candidates, dir_paths, falls_back, file_folder};
use super::read_step::{read_step_at, Origin};
use super::{load_len_bytes, read_index, verify, LoadError, Problem, ReadOptions, Which};
use crate::catalog;
use crate::config::DIRECT_ALIGN_BYTES;
use crate::format::Index;
use crate::mem::AlignedBuf;

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
    Err(none_loads(primary, fell_back, last_err.expect("at least one candidate")))
}

/// The error of a load of `latest` that tried every step in `tried`: the
/// last error when it tried one, else [`LoadError::NoneLoads`], naming the
/// one damaged file every step tried shares when there is one.
fn none_loads(primary: &Path, tried: Vec<(u64, String)>, last: LoadError) -> LoadError {
    if tried.len() < 2 {
        return last;
    }
    let shared = match &last {
        LoadError::Damaged { step, problems, .. } => problems.iter().filter_map(|p| p.file.as_deref()).find_map(|f| {
            let id = inode_of(primary, *step, f)?;
            let names: Option<Vec<String>> =
                tried.iter().map(|&(s, _)| Some(format!("{} of step {s}", name_of_inode(primary, s, id)?))).collect();
            Some(format!("one inode, hard-linked as {}", names?.join(", ")))
        }),
        _ => None,
    };
    LoadError::NoneLoads { dir: primary.to_path_buf(), tried, shared }
}

/// The (device, inode) of file `name` of `step` where a read finds it.
fn inode_of(primary: &Path, step: u64, name: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let index = read_index(primary, step).ok()?;
    let fi = index.ckpt.files.iter().position(|f| f.name == name)?;
    let opts = ReadOptions::default();
    let folder = file_folder(&index, &dir_paths(primary, &index, &opts), step, fi, &opts).ok()?;
    let m = std::fs::metadata(folder.join(name)).ok()?;
    Some((m.dev(), m.ino()))
}

/// The name under which `step` holds the inode `id`, if it does.
fn name_of_inode(primary: &Path, step: u64, id: (u64, u64)) -> Option<String> {
    let index = read_index(primary, step).ok()?;
    index.ckpt.files.iter().find(|f| inode_of(primary, step, &f.name) == Some(id)).map(|f| f.name.clone())
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
    pub(super) files: BTreeMap<String, (usize, u64)>,
    /// The index file's stamp taken before it was parsed, when the load was
    /// given a [`super::KeptIndex`]: what keeping `index` for the next load
    /// needs ([`super::KeptIndex::keep`]).
    pub index_stamp: Option<super::IndexStamp>,
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
        let kept = opts.kept_index.as_deref();
        // The index an earlier load of this step kept (a too-small one, or
        // the daemon's after placing it), if the step is still one to read
        // (its marks looked at as a parse would).
        let (index, stamp) = match kept.and_then(|k| k.take(primary, step)) {
            Some((i, s)) if catalog::damage_mark(primary, step).is_none() && catalog::is_readable(primary, step) => {
                (Ok(i), Some(s))
            }
            _ => {
                let stamp = kept.and_then(|_| super::IndexStamp::of(primary, step));
                (read_index(primary, step), stamp)
            }
        };
        let r = index.and_then(|index| {
            let need_bytes = load_len_bytes(&index);
            if need_bytes > dest_len as u64 {
                if let (Some(k), Some(s)) = (kept, stamp) {
                    k.keep(primary, step, s, index);
                }
                return Err(LoadError::BufferTooSmall { step, need_bytes, have_bytes: dest_len as u64 });
            }
            // SAFETY: dest is block-aligned and valid for need_bytes (this
            // function's contract, checked against need_bytes above).
            unsafe { read_step_at(Origin::Local { primary, remote }, step, index, opts, dest, t0, guard) }
        });
        match r {
            Ok(mut p) => {
                p.fell_back = fell_back;
                p.index_stamp = stamp;
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
    Err(none_loads(primary, fell_back, last_err.expect("at least one candidate")))
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
