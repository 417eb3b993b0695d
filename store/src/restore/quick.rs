//! The cheap checks of a committed step (`ls`): its index reads, and every
//! file and blob it names is present with the length it records. One
//! `stat` per file, no byte read: a flipped byte is not found here (only
//! `verify` and loads read every byte).

use std::fs;
use std::path::Path;

use super::locate::dir_paths;
use super::{problem, LoadError, Problem, ReadOptions};
use crate::catalog;
use crate::format::BLOBS_DIR_NAME;

/// What [`quick_check`] looked at, and what it did not.
pub const QUICK_CHECKED: &str = "index readable, every file and blob present with its recorded size";
pub const QUICK_NOT_CHECKED: &str = "contents (checksums): run verify to read every byte";

/// What the cheap checks found in `step` of `primary`: its problems (none:
/// nothing found wrong by them) and how many files another node holds on
/// its own disks (not checked: they are not visible here). Err when the
/// index itself does not read (the step does not load).
pub fn quick_check(primary: &Path, step: u64) -> Result<(Vec<Problem>, usize), LoadError> {
    let index = super::read_index(primary, step)?;
    let opts = ReadOptions::default();
    let dirs = dir_paths(primary, &index, &opts);
    let mut problems = Vec::new();
    let mut elsewhere = 0;
    let check = |problems: &mut Vec<Problem>, path: &Path, name: &str, want: u64| match fs::metadata(path) {
        Ok(m) if m.is_file() && m.len() == want => {}
        Ok(m) if m.is_file() => {
            problems.push(problem(Some(name), None, format!("{} bytes where the index says {want}", m.len())))
        }
        Ok(_) => problems.push(problem(Some(name), None, "not a regular file")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            problems.push(problem(Some(name), None, format!("missing ({})", path.display())))
        }
        Err(e) => problems.push(problem(Some(name), None, format!("cannot stat {}: {e}", path.display()))),
    };
    for f in &index.ckpt.files {
        // Another node's own disks (node-local files): not visible here.
        if index.holder(&f.name).is_some() {
            elsewhere += 1;
            continue;
        }
        match dirs.get(f.dir_idx as usize) {
            Some(dir) => check(&mut problems, &catalog::step_path(dir, step).join(&f.name), &f.name, f.len_bytes),
            None => problems.push(problem(Some(&f.name), None, format!("directory {} is not in the index", f.dir_idx))),
        }
    }
    let blobs = catalog::step_path(primary, step).join(BLOBS_DIR_NAME);
    for b in &index.ckpt.blobs {
        check(&mut problems, &blobs.join(&b.name), &format!("{BLOBS_DIR_NAME}/{}", b.name), b.len_bytes);
    }
    Ok((problems, elsewhere))
}
