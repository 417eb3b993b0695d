//! Verification of a committed step whose bytes are not in this node's
//! directories (a drain target: `ckpt-tier`), with the very checks of
//! [`crate::restore::Verifier`]: the index's own checksum and step, each
//! file's length, safetensors header against the index, every tensor's
//! crc32c, the file's crc32c, every blob, the Python skeleton. The bytes
//! come through a [`StepSource`], streamed through one bounded window; the
//! engine itself stays free of networking.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::config;
use crate::format::{Index, BLOBS_DIR_NAME, INDEX_FILE_NAME};
use crate::restore::{check_skeleton, name_slices, problem, FileCheck, Problem, VerifyReport};
// Defined beside the restore's readers, which both kinds of source feed.
pub use crate::restore::SourceError;

/// Where a step's files are read from.
pub trait StepSource {
    /// The length of file `name` of the step (`blobs/<name>` for a blob).
    fn file_len(&mut self, name: &str) -> Result<u64, SourceError>;
    /// Fills `dst` with the bytes of `name` from `offset`.
    fn read(&mut self, name: &str, offset: u64, dst: &mut [u8]) -> Result<(), SourceError>;
}

/// Parses a step's index bytes as a local load reads them: size limit, its
/// own checksum, valid names and offsets, the step it names. The error is
/// the index's problem.
pub fn parse_index(bytes: &[u8], step: u64) -> Result<Index, Problem> {
    if bytes.len() as u64 > config::INDEX_BYTES_MAX {
        return Err(problem(Some(INDEX_FILE_NAME), None, format!("index of {} bytes is above the limit", bytes.len())));
    }
    let index = Index::from_json_bytes(bytes).map_err(|e| problem(Some(INDEX_FILE_NAME), None, e.to_string()))?;
    if index.ckpt.step != step {
        return Err(problem(
            Some(INDEX_FILE_NAME),
            None,
            format!("index says step {} in folder of step {step}", index.ckpt.step),
        ));
    }
    Ok(index)
}

/// Checks every byte of step `step` whose index bytes are `index_bytes`,
/// reading through a window of at most `window_bytes` (at least 1 byte);
/// `progress(bytes_done, bytes_total)` after each file. Damage is in the
/// report's problems, each naming its file (and tensor).
pub fn verify_source(
    index_bytes: &[u8],
    step: u64,
    src: &mut dyn StepSource,
    window_bytes: usize,
    mut progress: impl FnMut(u64, u64),
) -> VerifyReport {
    let t0 = Instant::now();
    let index = match parse_index(index_bytes, step) {
        Ok(i) => i,
        Err(p) => {
            return VerifyReport {
                step,
                files: 0,
                tensors: 0,
                bytes: 0,
                problems: vec![p],
                seconds: t0.elapsed().as_secs_f64(),
            }
        }
    };
    let total: u64 = index.ckpt.files.iter().map(|f| f.len_bytes).sum();
    let biggest = index.ckpt.files.iter().map(|f| f.len_bytes).max().unwrap_or(0);
    let mut window = vec![0u8; (biggest.min(window_bytes.max(1) as u64)).max(1) as usize];
    let mut problems = Vec::new();
    let mut done = 0;
    for f in &index.ckpt.files {
        match src.file_len(&f.name) {
            Err(e) => problems.push(problem(Some(&f.name), None, format!("cannot read: {e}"))),
            Ok(actual) if actual != f.len_bytes => problems.push(problem(
                Some(&f.name),
                None,
                format!("{actual} bytes where the index says {}", f.len_bytes),
            )),
            Ok(_) => {
                let mut check = FileCheck::new(f, index.tensors_of(&f.name).collect());
                let mut file_problems = Vec::new();
                let mut off = 0u64;
                while off < f.len_bytes {
                    let n = (f.len_bytes - off).min(window.len() as u64) as usize;
                    if let Err(e) = src.read(&f.name, off, &mut window[..n]) {
                        file_problems.push(problem(Some(&f.name), None, format!("read failed: {e}")));
                        break;
                    }
                    check.feed(&window[..n], &mut file_problems);
                    off += n as u64;
                }
                check.finish(&mut file_problems);
                problems.extend(file_problems);
            }
        }
        done += f.len_bytes;
        progress(done, total);
    }
    let mut blobs = BTreeMap::new();
    for b in &index.ckpt.blobs {
        let file = format!("{BLOBS_DIR_NAME}/{}", b.name);
        let got = src.file_len(&file).map_err(|e| format!("cannot read: {e}")).and_then(|len| {
            if len != b.len_bytes {
                return Err(format!("{len} bytes where the index says {}", b.len_bytes));
            }
            let mut bytes = vec![0u8; len as usize];
            src.read(&file, 0, &mut bytes).map_err(|e| format!("cannot read: {e}"))?;
            Ok(bytes)
        });
        match got {
            Err(e) => problems.push(problem(Some(&file), None, e)),
            Ok(bytes) => {
                let crc = crc32c::crc32c(&bytes);
                if crc != b.crc32c {
                    problems.push(problem(
                        Some(&file),
                        None,
                        format!("checksum mismatch (index {:#010x}, file {crc:#010x})", b.crc32c),
                    ));
                } else {
                    blobs.insert(b.name.clone(), bytes);
                }
            }
        }
    }
    check_skeleton(&index, &blobs, &mut problems);
    name_slices(&index, &mut problems);
    VerifyReport {
        step,
        files: index.ckpt.files.len(),
        tensors: index.logical().len(),
        bytes: total,
        problems,
        seconds: t0.elapsed().as_secs_f64(),
    }
}
