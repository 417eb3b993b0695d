//! Recovery at startup: put the target directories back into a state where
//! every folder is either a committed checkpoint or gone.
//!
//! Invariants:
//! - a committed checkpoint (a `step-…` folder holding an index in the
//!   primary) is never touched;
//! - a secondary `step-…` folder is removed only when the primary has no
//!   committed checkpoint of that step *and* the folder holds no index itself
//!   (so a directory list given in another order never destroys a primary);
//! - afterwards `latest` names the newest committed checkpoint whose index
//!   reads back whole, or is absent when there is none.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::catalog;
use crate::format::{self, DEL_PREFIX, INDEX_FILE_NAME, LATEST_TMP_PREFIX, PROBE_PREFIX, TMP_PREFIX};
use crate::rollback::Interrupted;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Temp, half-deleted and orphaned folders (and temp and probe files) removed.
    pub removed: Vec<PathBuf>,
    /// `latest` before and after, when it had to change.
    pub latest_repaired: Option<(Option<String>, Option<u64>)>,
    /// Things found and left alone, worth a line in the log.
    pub warnings: Vec<String>,
}

impl RecoveryReport {
    pub fn is_clean(&self) -> bool {
        self.removed.is_empty() && self.latest_repaired.is_none()
    }
}

/// `dirs[0]` is the primary. Each directory must exist.
pub fn recover(dirs: &[PathBuf]) -> io::Result<RecoveryReport> {
    assert!(!dirs.is_empty());
    let mut report = RecoveryReport::default();
    let primary = &dirs[0];
    for dir in dirs {
        let mut removed_here = false;
        for e in fs::read_dir(dir)? {
            let e = e?;
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if [TMP_PREFIX, DEL_PREFIX, LATEST_TMP_PREFIX, PROBE_PREFIX].iter().any(|p| name.starts_with(p)) {
                let p = e.path();
                if e.file_type()?.is_dir() {
                    catalog::remove_tree(&p)?;
                } else {
                    fs::remove_file(&p)?;
                }
                report.removed.push(p);
                removed_here = true;
            }
        }
        if dir != primary {
            for step in catalog::step_dirs(dir)? {
                let p = catalog::step_path(dir, step);
                if catalog::is_committed(primary, step) {
                    continue;
                }
                if p.join(INDEX_FILE_NAME).exists() {
                    report.warnings.push(format!(
                        "{} holds an index but is given as a secondary directory; left alone (is the directory order right?)",
                        p.display()
                    ));
                    continue;
                }
                catalog::remove_tree(&p)?;
                report.removed.push(p);
                removed_here = true;
            }
        }
        if removed_here {
            catalog::fsync_dir(dir)?;
        }
    }
    for step in catalog::step_dirs(primary)? {
        if !catalog::is_committed(primary, step) {
            report.warnings.push(format!(
                "{} has no index, so it is not a committed checkpoint; left alone",
                catalog::step_path(primary, step).display()
            ));
        }
    }
    match crate::rollback::finish_interrupted(dirs)? {
        Some(Interrupted::Finished { step, removed }) => {
            report.warnings.push(format!("finished an interrupted rollback to step {step}: un-committed {removed:?}"))
        }
        Some(Interrupted::Dropped(w)) => report.warnings.push(w),
        None => {}
    }
    repair_latest(primary, &mut report)?;
    Ok(report)
}

fn repair_latest(primary: &Path, report: &mut RecoveryReport) -> io::Result<()> {
    let raw = catalog::read_latest(primary)?;
    let committed = catalog::committed_steps(primary)?;
    // `latest` only ever names a checkpoint whose index reads back whole (its
    // own CRC matches): a damaged newest one is passed over, with a warning.
    let mut newest = None;
    for &s in committed.iter().rev() {
        match crate::restore::read_index(primary, s) {
            Ok(_) => {
                newest = Some(s);
                break;
            }
            Err(e) => report.warnings.push(format!("{e}; `latest` does not point at it")),
        }
    }
    let named = raw.as_deref().and_then(format::parse_step_dir_name);
    let named_ok = named.is_some_and(|s| catalog::is_committed(primary, s));
    if named_ok && named == newest {
        return Ok(());
    }
    // Here `latest` is missing, names something uncommitted or damaged, or
    // names a committed checkpoint that is not the newest (a crash between a
    // commit and its `latest` update): point it at the newest readable one.
    match newest {
        Some(s) => catalog::write_latest(primary, s)?,
        None if raw.is_some() => catalog::remove_latest(primary)?,
        None => return Ok(()),
    }
    report.latest_repaired = Some((raw, newest));
    Ok(())
}

/// Recovery of the directory several nodes' sidecars share (at any node's
/// start): a multi-rank temp folder (`.tmp-step-…-ranks`) is removed when
/// nothing in it changed for `stale_after` (its coordinator died, or a late
/// node wrote into it after the abort); younger ones may still be filled
/// and committed by live sidecars, so they are left alone, as is every
/// other entry (committed steps, `latest`: the coordinator's).
pub fn recover_shared(dir: &Path, stale_after: std::time::Duration) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let now = std::time::SystemTime::now();
    for e in fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        if name.to_str().and_then(format::parse_ranks_tmp_name).is_none() || !e.file_type()?.is_dir() {
            continue;
        }
        let p = e.path();
        let newest = newest_mtime(&p)?;
        if now.duration_since(newest).unwrap_or_default() >= stale_after {
            catalog::remove_tree(&p)?;
            removed.push(p);
        }
    }
    removed.extend(remove_stale_abort_records(dir, stale_after)?);
    if !removed.is_empty() {
        catalog::fsync_dir(dir)?;
    }
    Ok(removed)
}

/// The node-local rule (docs/format.md, "Node-local files"): a node's
/// `node-step-…` folder is kept while its step is committed in the shared
/// directory (its index names the files) or in flight there (its
/// multi-rank temp folder exists: the coordinator may still commit it), or
/// while this node's ranks wait for it (`waiting`); otherwise (aborted,
/// un-committed by retention, `gc` or a rollback) it is removed, in every
/// one of `dirs`. Returns what it removed.
pub fn sweep_node_local(
    dirs: &[PathBuf],
    shared: &Path,
    waiting: &std::collections::BTreeSet<u64>,
) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for d in dirs {
        let mut here = false;
        for e in fs::read_dir(d)? {
            let e = e?;
            let Some(step) = e.file_name().to_str().and_then(format::parse_node_step_dir_name) else { continue };
            if waiting.contains(&step) || !e.file_type()?.is_dir() {
                continue;
            }
            // In flight first, committed last: a commit between the two
            // looks is seen as committed.
            let in_flight = shared.join(format::ranks_tmp_name(step).map_err(io::Error::other)?).exists();
            if in_flight || catalog::is_committed(shared, step) {
                continue;
            }
            catalog::remove_tree(&e.path())?;
            removed.push(e.path());
            here = true;
        }
        if here {
            catalog::fsync_dir(d)?;
        }
    }
    Ok(removed)
}

/// Removes the coordinators' abort records (`nodes::abort_record_path`)
/// older than `stale_after` from the shared directory: every rank they were
/// for was answered by then (a node gives a step up after twice the part
/// timeout, the daemon's `stale_after`).
pub fn remove_stale_abort_records(dir: &Path, stale_after: std::time::Duration) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let now = std::time::SystemTime::now();
    for e in fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        let record = name
            .to_str()
            .and_then(|n| n.strip_suffix(format::RANKS_ABORT_SUFFIX))
            .and_then(format::parse_ranks_tmp_name)
            .is_some();
        if record
            && e.file_type()?.is_file()
            && now.duration_since(e.metadata()?.modified()?).unwrap_or_default() >= stale_after
        {
            let p = e.path();
            fs::remove_file(&p)?;
            removed.push(p);
        }
    }
    Ok(removed)
}

/// The newest modification time of a folder, its entries and its
/// subfolders' entries (a multi-rank temp folder is two levels deep).
fn newest_mtime(dir: &Path) -> io::Result<std::time::SystemTime> {
    let mut newest = fs::metadata(dir)?.modified()?;
    for e in fs::read_dir(dir)? {
        let e = e?;
        let m = e.metadata()?;
        newest = newest.max(m.modified()?);
        if m.is_dir() {
            for e2 in fs::read_dir(e.path())? {
                newest = newest.max(e2?.metadata()?.modified()?);
            }
        }
    }
    Ok(newest)
}

#[cfg(test)]
mod shared_tests {
    use super::*;

    #[test]
    fn stale_multi_rank_temp_folders_go_and_everything_else_stays() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let ranks_tmp = d.join(format::ranks_tmp_name(4).unwrap());
        fs::create_dir_all(ranks_tmp.join("blobs")).unwrap();
        fs::write(ranks_tmp.join(format::rank_marker_name(1)), b"{}").unwrap();
        fs::create_dir_all(catalog::step_path(d, 3)).unwrap();
        fs::write(catalog::step_path(d, 3).join(INDEX_FILE_NAME), b"{}").unwrap();
        let other_tmp = d.join(".tmp-step-000000000005-00000000deadbeef");
        fs::create_dir(&other_tmp).unwrap();
        // Fresh: a live coordinator may still commit it.
        assert!(recover_shared(d, std::time::Duration::from_secs(3600)).unwrap().is_empty());
        assert!(ranks_tmp.exists());
        // Stale: removed; a committed step and a one-node temp folder (not
        // this recovery's) are left alone.
        assert_eq!(recover_shared(d, std::time::Duration::ZERO).unwrap(), vec![ranks_tmp.clone()]);
        assert!(!ranks_tmp.exists() && other_tmp.exists() && catalog::is_committed(d, 3));
    }
}
