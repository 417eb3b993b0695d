//! Verifying a committed checkpoint: every byte checked, each file
//! streamed through one bounded window of memory reused across files and
//! checkpoints.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::check::{check_skeleton, name_slices, read_blobs};
use super::locate::{dir_paths, file_folder, mark_problem, read_index_unmarked};
use super::read_dir::{read_and_check, Dest, DirReader};
use super::{problem, LoadError, Problem, ReadOptions};
use crate::catalog;
use crate::config;
use crate::mem::AlignedBuf;

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
        let index = match read_index_unmarked(primary, step) {
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
        problems.extend(catalog::damage_mark(primary, step).map(|why| mark_problem(&why)));
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
