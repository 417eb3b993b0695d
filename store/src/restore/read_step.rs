//! One step read into memory: a reader thread per folder its files are
//! read from (each with its own engine), another node's files fetched
//! meanwhile, then blobs, skeleton and slices checked and the outcome
//! decided (damage, or the destination's failure).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::check::{check_skeleton, name_slices, read_blobs};
use super::fetched::{self, FetchFiles};
use super::load::{Placed, ReadDest};
use super::locate::{dir_paths, file_folder};
use super::read_dir::{read_and_check, Dest, DirRead, DirReader};
use super::{LoadError, Problem, ReadOptions};
use crate::catalog;
use crate::config::{self, DIRECT_ALIGN_BYTES};
use crate::format::Index;

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
    let mut plan = plan_reads(primary, remote.is_some(), step, &index, opts)?;
    // SAFETY: every planned file has its own range of `base` (plan_reads lays
    // them out as load_len_bytes counts them), valid and untouched by anything
    // else for this whole call (this function's contract).
    let (reads, got) = match unsafe { run_readers(&plan, &index, opts, remote, base as usize, guard) } {
        Ok(o) => o,
        // An engine that would not start: still the memory's fault if it failed.
        Err(e) => return Err(guard.check().err().map_or(e, |why| LoadError::Destination { step, why })),
    };
    let mut problems = Vec::new();
    let mut engines = Vec::new();
    let mut dest_failed = None;
    for d in reads {
        problems.extend(d.problems);
        plan.record_starts(d.starts);
        engines.push(d.engine);
        dest_failed = dest_failed.or(d.dest_failed);
    }
    if let (Some(g), Some(src)) = (got, remote) {
        problems.extend(g.problems);
        plan.record_starts(g.starts);
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
        return Err(failure(primary, remote, step, problems, dest_failed, guard));
    }
    engines.dedup();
    let files = plan.files;
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
        index_stamp: None,
    })
}

/// Which files a step's read reads, from where, into which offset of its
/// memory.
struct ReadPlan {
    /// Per file read: (offset of its image in the memory, data-section
    /// start once its header was checked).
    files: BTreeMap<String, (usize, u64)>,
    /// The folders files are read from (a directory's step folder, or a
    /// node's node-step folder), one reader thread each.
    folders: Vec<PathBuf>,
    /// Per folder: (index into `index.ckpt.files`, offset in the memory).
    per_folder: Vec<Vec<(usize, usize)>>,
    /// The files fetched from the remote source instead.
    to_fetch: Vec<(usize, usize)>,
}

impl ReadPlan {
    fn record_starts(&mut self, starts: Vec<(String, u64)>) {
        for (name, ds) in starts {
            self.files.get_mut(&name).expect("file listed").1 = ds;
        }
    }
}

/// Lays the step's files out in memory in index order (each at its
/// block-aligned offset, read or not: `opts.only_tensors` reads only the
/// files holding those) and groups them by the folder they are read from;
/// with no `primary`, or a file another node holds (or this node's own, gone from its disks) and a remote source
/// given (`fetching`), a file is fetched instead.
fn plan_reads(
    primary: Option<&Path>,
    fetching: bool,
    step: u64,
    index: &Index,
    opts: &ReadOptions,
) -> Result<ReadPlan, LoadError> {
    let dirs = primary.map(|p| dir_paths(p, index, opts)).unwrap_or_default();
    let mut plan =
        ReadPlan { files: BTreeMap::new(), folders: Vec::new(), per_folder: Vec::new(), to_fetch: Vec::new() };
    let only_files: Option<std::collections::BTreeSet<&str>> = opts.only_tensors.as_ref().map(|names| {
        names
            .iter()
            .filter_map(|n| index.logical_tensor(n))
            .flat_map(|t| t.slices.into_iter().map(|s| s.file))
            .collect()
    });
    let mut at = 0usize;
    for (fi, f) in index.ckpt.files.iter().enumerate() {
        let here = at;
        at += config::align_up(f.len_bytes, DIRECT_ALIGN_BYTES) as usize;
        if only_files.as_ref().is_some_and(|only| !only.contains(f.name.as_str())) {
            continue;
        }
        plan.files.insert(f.name.clone(), (here, 0u64));
        let folder = match primary {
            Some(_) => match file_folder(index, &dirs, step, fi, opts) {
                // This node's own file, gone from its disks (a replaced
                // node): fetched too, when there is a source.
                Ok(folder) if fetching && index.holder(&f.name).is_some() && !folder.join(&f.name).exists() => {
                    plan.to_fetch.push((fi, here));
                    continue;
                }
                Ok(folder) => folder,
                Err(LoadError::OnAnotherNode { .. }) if fetching => {
                    plan.to_fetch.push((fi, here));
                    continue;
                }
                Err(e) => return Err(e),
            },
            None => {
                plan.to_fetch.push((fi, here));
                continue;
            }
        };
        let di = match plan.folders.iter().position(|d| *d == folder) {
            Some(di) => di,
            None => {
                plan.folders.push(folder);
                plan.per_folder.push(Vec::new());
                plan.folders.len() - 1
            }
        };
        plan.per_folder[di].push((fi, here));
    }
    Ok(plan)
}

/// Runs one reader thread per folder of `plan`, each inside `guard.run`,
/// and fetches the remote files on this thread meanwhile.
///
/// # Safety
/// `base + offset` must be valid for writes of each planned file's length
/// rounded up to the O_DIRECT block, touched by nothing else until this
/// returns (or fault only inside `guard.run` in a way it handles).
unsafe fn run_readers(
    plan: &ReadPlan,
    index: &Index,
    opts: &ReadOptions,
    remote: Option<&dyn FetchFiles>,
    base: usize,
    guard: &dyn ReadDest,
) -> Result<(Vec<DirRead>, Option<fetched::Fetched>), LoadError> {
    std::thread::scope(|s| {
        let handles: Vec<_> = plan
            .per_folder
            .iter()
            .zip(&plan.folders)
            .filter(|(p, _)| !p.is_empty())
            .map(|(p, dir)| {
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
            Some(src) if !plan.to_fetch.is_empty() => {
                // SAFETY: the fetched files' ranges are disjoint from each
                // other and from the local readers' (each file has its own),
                // valid until this scope ends (this function's contract).
                Some(unsafe { fetched::fetch_and_check(index, &plan.to_fetch, src, base, guard) })
            }
            _ => None,
        };
        let reads =
            handles.into_iter().map(|h| h.join().expect("reader thread panicked")).collect::<Result<Vec<_>, _>>()?;
        Ok((reads, got))
    })
}

/// The error of a step whose read found problems: the destination's
/// failure if the memory failed under it (`guard.check`, or a read that
/// faulted on it), else damage of the checkpoint.
fn failure(
    primary: Option<&Path>,
    remote: Option<&dyn FetchFiles>,
    step: u64,
    problems: Vec<Problem>,
    dest_failed: Option<String>,
    guard: &dyn ReadDest,
) -> LoadError {
    // A checksum that failed because the memory under it went (zero
    // pages mapped over a shrunk segment) is the memory's failure.
    if let Err(why) = guard.check() {
        return LoadError::Destination { step, why };
    }
    if let Some(why) = dest_failed {
        return LoadError::Destination { step, why };
    }
    let dir = match (primary, remote) {
        (Some(p), _) => p.to_path_buf(),
        (None, Some(src)) => fetched::label_path(src),
        (None, None) => unreachable!("an origin has a directory or a source"),
    };
    LoadError::Damaged { dir, step, problems }
}
