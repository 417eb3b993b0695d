//! What is in a target directory: committed steps, `latest`, and the small
//! file-system helpers (directory sync, tree removal) every stage shares.
//!
//! A checkpoint is committed iff `step-<12 digits>/model.safetensors.index.json`
//! exists in the primary directory. Nothing else makes a folder count.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::format::{self, INDEX_FILE_NAME, LATEST_FILE_NAME, LATEST_TMP_PREFIX};

/// Why a path given as a target directory cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    #[error("no such directory: {}", .0.display())]
    NoSuchDir(PathBuf),
    #[error("{} is not a directory", .0.display())]
    NotADir(PathBuf),
    #[error("{}: {source}", .path.display())]
    Io { path: PathBuf, source: io::Error },
}

/// `dir` exists and is a directory (the first check of every command that
/// reads or cleans one; nothing is created).
pub fn check_dir(dir: &Path) -> Result<(), DirError> {
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(DirError::NotADir(dir.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(DirError::NoSuchDir(dir.to_path_buf())),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => Err(DirError::NotADir(dir.to_path_buf())),
        Err(source) => Err(DirError::Io { path: dir.to_path_buf(), source }),
    }
}

pub fn step_path(dir: &Path, step: u64) -> PathBuf {
    dir.join(format::step_dir_name(step).expect("steps are validated before they reach the catalog"))
}

pub fn is_committed(primary: &Path, step: u64) -> bool {
    step_path(primary, step).join(INDEX_FILE_NAME).is_file()
}

/// Step folders in `dir` (committed or not), ascending.
pub fn step_dirs(dir: &Path) -> io::Result<Vec<u64>> {
    let mut v = Vec::new();
    for e in fs::read_dir(dir)? {
        let e = e?;
        if let Some(step) = e.file_name().to_str().and_then(format::parse_step_dir_name) {
            if e.file_type()?.is_dir() {
                v.push(step);
            }
        }
    }
    v.sort_unstable();
    Ok(v)
}

/// Committed steps in the primary directory, ascending.
pub fn committed_steps(primary: &Path) -> io::Result<Vec<u64>> {
    Ok(step_dirs(primary)?.into_iter().filter(|&s| is_committed(primary, s)).collect())
}

/// The step a pending rollback goes back to: `.ckpt-rollback` naming a
/// committed step (a rollback whose intent is durable and that did not
/// finish yet: running, or killed midway until the next owner of the
/// directory finishes it in recovery).
pub fn rollback_pending_to(primary: &Path) -> Option<u64> {
    let raw = fs::read_to_string(primary.join(format::ROLLBACK_FILE_NAME)).ok()?;
    format::parse_step_dir_name(raw.trim()).filter(|&s| is_committed(primary, s))
}

/// The committed steps readers see (`ls`, `verify`, `inspect`, loads,
/// List): one timeline, even while a rollback is pending, whose later
/// steps are not among them although some are still on disk.
pub fn readable_steps(primary: &Path) -> io::Result<Vec<u64>> {
    let mut steps = committed_steps(primary)?;
    if let Some(to) = rollback_pending_to(primary) {
        steps.retain(|&s| s <= to);
    }
    Ok(steps)
}

/// Whether readers see `step` as committed ([`readable_steps`]).
pub fn is_readable(primary: &Path, step: u64) -> bool {
    is_committed(primary, step) && rollback_pending_to(primary).is_none_or(|to| step <= to)
}

/// What `latest` says, trimmed; None when there is no such file.
pub fn read_latest(primary: &Path) -> io::Result<Option<String>> {
    match fs::read_to_string(primary.join(LATEST_FILE_NAME)) {
        Ok(s) => Ok(Some(s.trim().to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The step `latest` names, if it names a committed checkpoint; while a
/// rollback is pending, its target (where it moves `latest` first).
pub fn latest_step(primary: &Path) -> io::Result<Option<u64>> {
    if let Some(to) = rollback_pending_to(primary) {
        return Ok(Some(to));
    }
    Ok(read_latest(primary)?.and_then(|s| format::parse_step_dir_name(&s)).filter(|&s| is_committed(primary, s)))
}

/// Points `latest` at `step` atomically: write a temp file, sync it, rename
/// it over `latest`, sync the directory.
pub fn write_latest(primary: &Path, step: u64) -> io::Result<()> {
    write_step_file(primary, LATEST_FILE_NAME, step)
}

/// Writes `<step dir name>\n` as the file `name` in `primary` atomically
/// (temp file named with [`LATEST_TMP_PREFIX`], which recovery removes;
/// synced; renamed over `name`; directory synced).
pub fn write_step_file(primary: &Path, name: &str, step: u64) -> io::Result<()> {
    let tmp = primary.join(format!("{LATEST_TMP_PREFIX}{:016x}", crate::io::nonce()));
    let r = (|| {
        let mut f = File::options().write(true).create_new(true).open(&tmp)?;
        writeln!(f, "{}", format::step_dir_name(step).expect("validated step"))?;
        f.sync_data()?;
        fs::rename(&tmp, primary.join(name))?;
        fsync_dir(primary)
    })();
    if r.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    r
}

/// The mark of a committed step found damaged (by the sidecar's scrub): a
/// file in the step's folder holding why. Loads pass over a marked step
/// with that reason (`restore::read_index`), `verify` and `ls` report it;
/// removing the file (after a repair) makes the step readable again.
pub const DAMAGED_MARK_NAME: &str = ".ckpt-damaged";
/// Most bytes of the mark read back (the reason is one line).
pub const DAMAGED_MARK_BYTES_MAX: u64 = 4096;

/// Why `step` is marked damaged, if it is ([`DAMAGED_MARK_NAME`]).
pub fn damage_mark(primary: &Path, step: u64) -> Option<String> {
    use std::io::Read;
    let f = File::open(step_path(primary, step).join(DAMAGED_MARK_NAME)).ok()?;
    let mut why = String::new();
    f.take(DAMAGED_MARK_BYTES_MAX).read_to_string(&mut why).ok()?;
    Some(why.trim().to_string())
}

/// Marks committed `step` damaged for `reason`, crash-safe: a temp file in
/// the step's folder, synced, renamed to [`DAMAGED_MARK_NAME`], the folder
/// synced (a crash leaves the step marked or not, never half; a temp left
/// over is removed with the step).
pub fn mark_damaged(primary: &Path, step: u64, reason: &str) -> io::Result<()> {
    let folder = step_path(primary, step);
    let tmp = folder.join(format!("{DAMAGED_MARK_NAME}.tmp-{:016x}", crate::io::nonce()));
    // One line, within what is read back (whole characters).
    let mut line = String::new();
    for c in reason.chars().filter(|c| *c != '\n') {
        if line.len() + c.len_utf8() >= DAMAGED_MARK_BYTES_MAX as usize {
            break;
        }
        line.push(c);
    }
    let r = (|| {
        let mut f = File::options().write(true).create_new(true).open(&tmp)?;
        writeln!(f, "{line}")?;
        f.sync_data()?;
        fs::rename(&tmp, folder.join(DAMAGED_MARK_NAME))?;
        fsync_dir(&folder)
    })();
    if r.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    r
}

/// Removes `latest` (no committed checkpoint is left) and syncs the directory.
pub fn remove_latest(primary: &Path) -> io::Result<()> {
    match fs::remove_file(primary.join(LATEST_FILE_NAME)) {
        Ok(()) => fsync_dir(primary),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Makes the directory's entries (creations, renames, removals) durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Removes a tree; a tree already gone is fine.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Total size in bytes of the regular files in a folder and its subfolders.
pub fn tree_bytes(path: &Path) -> io::Result<u64> {
    let mut total = 0;
    for e in fs::read_dir(path)? {
        let e = e?;
        let ft = e.file_type()?;
        if ft.is_dir() {
            total += tree_bytes(&e.path())?;
        } else if ft.is_file() {
            total += e.metadata()?.len();
        }
    }
    Ok(total)
}
