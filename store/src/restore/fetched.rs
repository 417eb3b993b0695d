//! Reading fetched files (a drain target's, through a [`FetchFiles`]) into
//! a load's memory: each file streamed straight into its place and checked
//! piece by piece with the per-file check a local read uses. Part of
//! `restore` (its reader threads run these); the public entry points of a
//! remote load are in `crate::fetch`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::format::{Index, BLOBS_DIR_NAME};
use crate::restore::SourceError;
use crate::restore::{problem, FileCheck, Problem, ReadDest};

/// Where a step's files come from when this node's directories do not hold
/// them (a drain target). Shared by several reader threads at once.
pub trait FetchFiles: Sync {
    /// Names the source in errors (a URL without secrets).
    fn label(&self) -> &str;
    /// Files fetched at once (one reader thread each).
    fn parallel(&self) -> usize;
    /// Reads all of file `name` of the step (`blobs/<name>` for a blob),
    /// exactly `dst.len()` bytes, into `dst`, calling `feed` with each piece
    /// once it is in `dst`, in file order, from the calling thread (a
    /// destination that needs its accesses guarded is touched only there).
    fn fetch(&self, name: &str, dst: &mut [u8], feed: &mut dyn FnMut(&[u8])) -> Result<(), SourceError>;
}

/// What the remote reader threads found, as `restore`'s directory readers say it.
pub(crate) struct Fetched {
    pub problems: Vec<Problem>,
    /// Each file's data-section start.
    pub starts: Vec<(String, u64)>,
}

/// Fetches the files `targets` (index into `index.ckpt.files`, byte offset
/// in `base`) with at most `src.parallel()` reader threads, each inside
/// `guard.run`, checking every file as its pieces arrive.
///
/// # Safety
/// `base + offset` must be valid for writes of each file's length, the
/// ranges disjoint and touched by nothing else during the call (or fault
/// only inside `guard.run` in a way it handles).
pub(crate) unsafe fn fetch_and_check(
    index: &Index,
    targets: &[(usize, usize)],
    src: &dyn FetchFiles,
    base: usize,
    guard: &dyn ReadDest,
) -> Fetched {
    let next = AtomicUsize::new(0);
    let n_threads = src.parallel().clamp(1, targets.len().max(1));
    let outs: Vec<Fetched> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n_threads)
            .map(|_| {
                let next = &next;
                s.spawn(move || {
                    let mut out = Fetched { problems: Vec::new(), starts: Vec::new() };
                    guard.run(&mut || loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(fi, off)) = targets.get(i) else { break };
                        let f = &index.ckpt.files[fi];
                        // SAFETY: this file's range of the destination,
                        // disjoint from every other target's, valid for
                        // f.len_bytes (this function's contract).
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut((base + off) as *mut u8, f.len_bytes as usize) };
                        let mut check = FileCheck::new(f, index.tensors_of(&f.name).collect());
                        let mut problems = Vec::new();
                        if let Err(e) = src.fetch(&f.name, dst, &mut |bytes| check.feed(bytes, &mut problems)) {
                            problems.push(problem(Some(&f.name), None, format!("read failed: {e}")));
                        }
                        check.finish(&mut problems);
                        out.starts.push((f.name.clone(), check.data_start().unwrap_or(0)));
                        out.problems.extend(problems);
                    });
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("fetch thread panicked")).collect()
    });
    let mut all = Fetched { problems: Vec::new(), starts: Vec::new() };
    for o in outs {
        all.problems.extend(o.problems);
        all.starts.extend(o.starts);
    }
    all
}

/// Every blob of the step fetched and checked against the index (into `out`).
pub(crate) fn fetch_blobs(index: &Index, src: &dyn FetchFiles, out: &mut BTreeMap<String, Vec<u8>>) -> Vec<Problem> {
    crate::restore::check_blobs(index, out, |name, len| {
        let mut bytes = vec![0u8; len];
        src.fetch(&format!("{BLOBS_DIR_NAME}/{name}"), &mut bytes, &mut |_| {}).map_err(|e| e.to_string())?;
        Ok(bytes)
    })
}

/// Whether every file of `names` verifies when fetched again into memory
/// of our own (a checksum that failed in a client's memory: its writes, or
/// the source's bytes?).
pub(crate) fn verifies_when_fetched_again(index: &Index, names: &[String], src: &dyn FetchFiles) -> bool {
    names.iter().all(|name| {
        // A blob's problem is never the destination's (blobs go to memory of their own).
        let Some(f) = index.ckpt.files.iter().find(|f| &f.name == name) else { return false };
        let mut buf = vec![0u8; f.len_bytes as usize];
        let mut check = FileBytesCheck::new(index, &f.name);
        if src.fetch(&f.name, &mut buf, &mut |bytes| check.feed(bytes)).is_err() {
            return false;
        }
        check.finish().is_empty()
    })
}

/// Every byte of file `name` of the step `index` describes checked as a
/// load checks it (header, each tensor's crc32c, the file's): the problems
/// found, none when it is sound. For bytes held apart from a load (a peer's
/// replica, checked before it counts and before it is handed to a load).
pub fn check_file_bytes(index: &Index, name: &str, bytes: &[u8]) -> Vec<Problem> {
    let mut check = FileBytesCheck::new(index, name);
    check.feed(bytes);
    check.finish()
}

/// [`check_file_bytes`] fed the file's bytes in order, in pieces of any
/// size: bytes checked as they arrive, while they are still in cache.
pub struct FileBytesCheck<'a> {
    /// None: `name` is not a file of the index (the problem is in `problems`).
    check: Option<FileCheck<'a>>,
    problems: Vec<Problem>,
}

impl<'a> FileBytesCheck<'a> {
    pub fn new(index: &'a Index, name: &str) -> FileBytesCheck<'a> {
        match index.ckpt.files.iter().find(|f| f.name == name) {
            Some(f) => FileBytesCheck {
                check: Some(FileCheck::new(f, index.tensors_of(&f.name).collect())),
                problems: Vec::new(),
            },
            None => FileBytesCheck {
                check: None,
                problems: vec![problem(Some(name), None, "not a file of the step's index".to_string())],
            },
        }
    }

    /// The next bytes of the file.
    pub fn feed(&mut self, bytes: &[u8]) {
        if let Some(c) = &mut self.check {
            c.feed(bytes, &mut self.problems);
        }
    }

    /// The problems found once every byte was fed (a file that ended early is one).
    pub fn finish(mut self) -> Vec<Problem> {
        if let Some(c) = &mut self.check {
            c.finish(&mut self.problems);
        }
        self.problems
    }
}

/// The label of a source as the `dir` of a [`LoadError::Damaged`].
pub(crate) fn label_path(src: &dyn FetchFiles) -> PathBuf {
    PathBuf::from(src.label())
}
