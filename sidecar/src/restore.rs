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

fn problem(file: Option<&str>, tensor: Option<&str>, what: impl Into<String>) -> Problem {
    Problem { file: file.map(str::to_string), tensor: tensor.map(str::to_string), what: what.into() }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{dir}: no committed checkpoint")]
    NoCheckpoint { dir: PathBuf },
    #[error("{dir}: step {step} is not a committed checkpoint")]
    NotCommitted { dir: PathBuf, step: u64 },
    #[error("{}: step {step} is damaged:\n  {}", dir.display(), problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("\n  "))]
    Damaged { dir: PathBuf, step: u64, problems: Vec<Problem> },
    #[error("{path}: {what}: {source}")]
    Io { path: PathBuf, what: &'static str, source: io::Error },
    #[error("{0}")]
    Probe(#[from] eio::ProbeError),
}

/// A checkpoint in memory, every checksum matched.
pub struct Loaded {
    pub step: u64,
    pub index: Index,
    pub blobs: BTreeMap<String, Vec<u8>>,
    /// Newer checkpoints skipped on the way (step, why), newest first.
    pub fell_back: Vec<(u64, String)>,
    /// Bytes of shard files read.
    pub bytes: u64,
    pub seconds: f64,
    pub engine: String,
    buf: AlignedBuf,
    /// Per file: (offset of the file image in `buf`, data section start).
    files: BTreeMap<String, (usize, u64)>,
}

impl Loaded {
    pub fn tensor(&self, name: &str) -> Option<&[u8]> {
        let t = self.index.ckpt.tensors.get(name)?;
        let &(base, data_start) = self.files.get(&t.file)?;
        let b = base + (data_start + t.data_offsets[0]) as usize;
        let e = base + (data_start + t.data_offsets[1]) as usize;
        Some(&self.buf.as_slice()[b..e])
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
    if !catalog::is_committed(primary, step) {
        return Err(LoadError::NotCommitted { dir: primary.to_path_buf(), step });
    }
    let p = catalog::step_path(primary, step).join(INDEX_FILE_NAME);
    let damaged = |what: String| LoadError::Damaged { dir: primary.to_path_buf(), step, problems: vec![problem(Some(INDEX_FILE_NAME), None, what)] };
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

/// Loads a checkpoint; with `Which::Latest` a damaged one falls back to the
/// newest good one. `buf`, if given and large enough, is reused (no fresh
/// pages on the data path).
pub fn load(primary: &Path, which: Which, opts: &ReadOptions, buf: Option<AlignedBuf>) -> Result<Loaded, LoadError> {
    let mut fell_back = Vec::new();
    let candidates: Vec<u64> = match which {
        Which::Step(s) => vec![s],
        Which::Latest => {
            let mut c = catalog::committed_steps(primary).map_err(|e| LoadError::Io { path: primary.to_path_buf(), what: "list", source: e })?;
            // `latest` first if it names a committed one, then newest down.
            if let Some(l) = catalog::latest_step(primary).ok().flatten() {
                c.retain(|&s| s <= l);
            }
            c.reverse();
            if c.is_empty() {
                return Err(LoadError::NoCheckpoint { dir: primary.to_path_buf() });
            }
            c
        }
    };
    let mut buf = buf;
    let mut last_err = None;
    for step in candidates {
        match load_step(primary, step, opts, buf.take()) {
            Ok(mut l) => {
                l.fell_back = fell_back;
                return Ok(l);
            }
            Err((e, b)) => {
                buf = b;
                if which == Which::Latest && matches!(e, LoadError::Damaged { .. } | LoadError::Io { .. }) {
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
            Err(e) => return Err((LoadError::Io { path: primary.to_path_buf(), what: "allocate load buffer", source: e }, None)),
        },
    };
    let dirs = dir_paths(primary, &index, opts);
    let mut files = BTreeMap::new();
    let mut at = 0usize;
    let mut plan: Vec<Vec<(usize, usize)>> = vec![Vec::new(); dirs.len()];
    for (fi, f) in index.ckpt.files.iter().enumerate() {
        files.insert(f.name.clone(), (at, 0u64));
        plan[f.dir_idx as usize].push((fi, at));
        at += config::align_up(f.len_bytes, DIRECT_ALIGN_BYTES) as usize;
    }
    let base = buf.as_mut_ptr() as usize;
    let step_dirs: Vec<PathBuf> = dirs.iter().map(|d| catalog::step_path(d, step)).collect();
    let outcome: Result<Vec<(Vec<Problem>, Vec<(String, u64)>, String)>, LoadError> = std::thread::scope(|s| {
        let handles: Vec<_> = plan
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.is_empty())
            .map(|(di, p)| {
                let index = &index;
                let dir = &step_dirs[di];
                s.spawn(move || {
                    let targets: Vec<(usize, *mut u8)> = p.iter().map(|&(fi, off)| (fi, (base + off) as *mut u8)).collect();
                    let mut reader = DirReader::open(dir, opts.io)?;
                    // SAFETY: each target is a disjoint range of `buf`, which
                    // outlives this scope and is not touched until it ends.
                    Ok(unsafe { read_and_check(dir, index, &targets, &mut reader) })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("reader thread panicked")).collect()
    });
    let outcome = match outcome {
        Ok(o) => o,
        Err(e) => return Err((e, Some(buf))),
    };
    let mut problems = Vec::new();
    let mut engines = Vec::new();
    for (p, starts, engine) in outcome {
        problems.extend(p);
        for (name, ds) in starts {
            files.get_mut(&name).expect("file listed").1 = ds;
        }
        engines.push(engine);
    }
    let mut blobs = BTreeMap::new();
    problems.extend(read_blobs(&step_dirs[0], &index, &mut blobs));
    if !problems.is_empty() {
        return Err((LoadError::Damaged { dir: primary.to_path_buf(), step, problems }, Some(buf)));
    }
    engines.dedup();
    let bytes = index.ckpt.files.iter().map(|f| f.len_bytes).sum();
    Ok(Loaded { step, index, blobs, fell_back: Vec::new(), bytes, seconds: t0.elapsed().as_secs_f64(), engine: engines.join(","), buf, files })
}

fn read_blobs(step_dir: &Path, index: &Index, out: &mut BTreeMap<String, Vec<u8>>) -> Vec<Problem> {
    let mut problems = Vec::new();
    for b in &index.ckpt.blobs {
        let file = format!("{BLOBS_DIR_NAME}/{}", b.name);
        match fs::read(step_dir.join(BLOBS_DIR_NAME).join(&b.name)) {
            Err(e) => problems.push(problem(Some(&file), None, format!("cannot read: {e}"))),
            Ok(bytes) if bytes.len() as u64 != b.len_bytes => {
                problems.push(problem(Some(&file), None, format!("{} bytes where the index says {}", bytes.len(), b.len_bytes)))
            }
            Ok(bytes) => {
                let crc = crc32c::crc32c(&bytes);
                if crc != b.crc32c {
                    problems.push(problem(Some(&file), None, format!("checksum mismatch (index {:#010x}, file {crc:#010x})", b.crc32c)));
                } else {
                    out.insert(b.name.clone(), bytes);
                }
            }
        }
    }
    problems
}

/// Reads the files `targets` (index into `index.ckpt.files`, destination) of
/// one directory into memory and checks each: length, header against the
/// index, every tensor's checksum (computed while later chunks are still in
/// flight), the file checksum. Returns the problems, the data-section start
/// of each file, and the engine name.
///
/// # Safety
/// Each destination must be valid, writable and otherwise untouched for the
/// file's length rounded up to the O_DIRECT block, for the whole call.
unsafe fn read_and_check(
    step_dir: &Path,
    index: &Index,
    targets: &[(usize, *mut u8)],
    reader: &mut DirReader,
) -> (Vec<Problem>, Vec<(String, u64)>, String) {
    let mut any_direct = false;
    let mut problems = Vec::new();
    let mut opened = Vec::new();
    let mut ios = Vec::new();
    let mut metas = Vec::new();
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
        ios.push(FileIo { fd: file.as_raw_fd(), ptr: dest, io_len, file_len: f.len_bytes });
        // Tensors of this file in file order, and the next one to check.
        let tensors: Vec<(&String, &format::IndexTensor)> = index.tensors_of(&f.name).collect();
        metas.push(FileCheck { fi, dest, tensors, next: 0, data_start: None, crc: 0, crc_done_to: 0, failed: false });
        opened.push(file);
    }
    let mut check_problems: Vec<Problem> = Vec::new();
    let r = eio::drive(reader.engine.as_mut(), OpKind::Read, &ios, config::CHUNK_BYTES_DEFAULT, |i, done| {
        let m = &mut metas[i];
        let f = &index.ckpt.files[m.fi];
        // SAFETY: bytes below `done` have been read and no request targets them any more.
        let bytes = std::slice::from_raw_parts(m.dest as *const u8, done as usize);
        m.advance(f, bytes, &mut check_problems);
    });
    if let Err(e) = r {
        let name = match &e {
            eio::DriveError::Io { file_idx, .. } | eio::DriveError::ShortRead { file_idx, .. } | eio::DriveError::ShortWrite { file_idx, .. } => {
                Some(index.ckpt.files[metas[*file_idx].fi].name.as_str())
            }
            eio::DriveError::Engine(_) => None,
        };
        problems.push(problem(name, None, format!("read failed: {e}")));
    }
    problems.extend(check_problems);
    let mut starts = Vec::new();
    for m in &metas {
        let f = &index.ckpt.files[m.fi];
        if !m.failed && m.next == m.tensors.len() && m.crc_done_to == f.len_bytes && m.crc != f.crc32c {
            problems.push(problem(Some(&f.name), None, format!("file checksum mismatch (index {:#010x}, file {:#010x})", f.crc32c, m.crc)));
        }
        if !m.failed && m.next < m.tensors.len() && !problems.iter().any(|p| p.file.as_deref() == Some(&f.name)) {
            problems.push(problem(Some(&f.name), None, "not fully checked".to_string()));
        }
        starts.push((f.name.clone(), m.data_start.unwrap_or(0)));
    }
    let engine = eio::EngineChoice { direct: any_direct, ..reader.choice.clone() }.name();
    (problems, starts, engine)
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
        let engine = choice.open_engine().map_err(|e| LoadError::Io { path: dir.to_path_buf(), what: "start I/O engine", source: e })?;
        Ok(DirReader { choice, want_direct, engine })
    }
}

/// Progress of checking one file as its bytes arrive in order.
struct FileCheck<'a> {
    fi: usize,
    dest: *mut u8,
    tensors: Vec<(&'a String, &'a format::IndexTensor)>,
    next: usize,
    data_start: Option<u64>,
    /// crc32c of the file's first `crc_done_to` bytes.
    crc: u32,
    crc_done_to: u64,
    failed: bool,
}

impl FileCheck<'_> {
    fn advance(&mut self, f: &format::IndexFile, bytes: &[u8], problems: &mut Vec<Problem>) {
        if self.failed {
            return;
        }
        let done = bytes.len() as u64;
        if self.data_start.is_none() {
            if done < 8 {
                return;
            }
            let hlen = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
            let need = 8u64.saturating_add(hlen).min(f.len_bytes);
            if done < need && done < f.len_bytes {
                return;
            }
            match format::decode_header(bytes, f.len_bytes) {
                Err(e) => {
                    problems.push(problem(Some(&f.name), None, e.to_string()));
                    self.failed = true;
                    return;
                }
                Ok(h) => {
                    let listed: Vec<(&str, format::Dtype, &[u64], [u64; 2])> =
                        self.tensors.iter().map(|(n, t)| (n.as_str(), t.dtype, t.shape.as_slice(), t.data_offsets)).collect();
                    let found: Vec<(&str, format::Dtype, &[u64], [u64; 2])> =
                        h.tensors.iter().map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), [t.data_offsets.0, t.data_offsets.1])).collect();
                    if listed != found {
                        problems.push(problem(Some(&f.name), None, "safetensors header disagrees with the index"));
                        self.failed = true;
                        return;
                    }
                    self.data_start = Some(h.data_start);
                    self.crc = crc32c::crc32c(&bytes[..h.data_start as usize]);
                    self.crc_done_to = h.data_start;
                }
            }
        }
        let ds = self.data_start.expect("set above");
        while self.next < self.tensors.len() {
            let (name, t) = self.tensors[self.next];
            let (b, e) = (ds + t.data_offsets[0], ds + t.data_offsets[1]);
            if e > done {
                return;
            }
            let crc = crate::image::crc32c_parallel(&bytes[b as usize..e as usize]);
            if crc != t.crc32c {
                problems.push(problem(Some(&f.name), Some(name), format!("checksum mismatch (index {:#010x}, data {crc:#010x})", t.crc32c)));
            }
            self.crc = crc32c::crc32c_combine(self.crc, crc, (e - b) as usize);
            self.crc_done_to = e;
            self.next += 1;
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

/// Checks every byte of a committed checkpoint, holding one shard in memory
/// at a time; `progress(bytes_done, bytes_total)` after each file.
pub fn verify(primary: &Path, step: u64, opts: &ReadOptions, mut progress: impl FnMut(u64, u64)) -> Result<VerifyReport, LoadError> {
    let t0 = Instant::now();
    let index = match read_index(primary, step) {
        Ok(i) => i,
        Err(LoadError::Damaged { problems, .. }) => {
            return Ok(VerifyReport { step, files: 0, tensors: 0, bytes: 0, problems, seconds: t0.elapsed().as_secs_f64() })
        }
        Err(e) => return Err(e),
    };
    let dirs = dir_paths(primary, &index, opts);
    let total: u64 = index.ckpt.files.iter().map(|f| f.len_bytes).sum();
    let biggest = index.ckpt.files.iter().map(|f| config::align_up(f.len_bytes, DIRECT_ALIGN_BYTES)).max().unwrap_or(0);
    let mut buf = AlignedBuf::new(biggest as usize).map_err(|e| LoadError::Io { path: primary.to_path_buf(), what: "allocate verify buffer", source: e })?;
    let mut problems = Vec::new();
    let mut done = 0;
    let mut readers: Vec<Option<DirReader>> = dirs.iter().map(|_| None).collect();
    for (fi, f) in index.ckpt.files.iter().enumerate() {
        let di = f.dir_idx as usize;
        let dir = catalog::step_path(&dirs[di], step);
        let reader = match &mut readers[di] {
            Some(r) => r,
            slot => slot.insert(DirReader::open(&dir, opts.io)?),
        };
        // SAFETY: buf is ours, large enough, and untouched during the call.
        let (p, _, _) = unsafe { read_and_check(&dir, &index, &[(fi, buf.as_mut_ptr())], reader) };
        problems.extend(p);
        done += f.len_bytes;
        progress(done, total);
    }
    let mut blobs = BTreeMap::new();
    problems.extend(read_blobs(&catalog::step_path(primary, step), &index, &mut blobs));
    Ok(VerifyReport { step, files: index.ckpt.files.len(), tensors: index.ckpt.tensors.len(), bytes: total, problems, seconds: t0.elapsed().as_secs_f64() })
}
