//! Read-only directories: a checkpoint directory on a read-only file system
//! (a read-only mount, a snapshot, a dataset volume) or one this process may
//! not write is still worth serving loads from. A [`crate::commit::Store`]
//! opened read-only ([`ReadOnly`]) takes no directory lock (it could not
//! write the lock file, and, like `ls`/`verify`, a reader needs none), runs
//! no recovery (nothing is removed, `latest` is not repaired on disk:
//! readers skip temp folders and fall back past a `latest` that does not
//! load), and refuses every write (commit, rollback, retention) with one
//! error naming the directory ([`ReadOnlyDir`]).
//!
//! Invariant: a writable directory opened without `ReadOnly::Always` keeps
//! the one-owner lock of [`crate::lock`]; only a lock file that cannot be
//! opened for writing (EROFS, EACCES, EPERM) makes a `ReadOnly::Auto` store
//! read-only.

use std::io;
use std::path::PathBuf;

/// How a Store treats a directory it may not be able to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadOnly {
    /// The opener must write (`gc`, `rollback`, `bench write`): a read-only
    /// directory is an error naming it.
    #[default]
    Never,
    /// Read-only when the directory lock cannot be written (`serve`,
    /// `launch`); else the usual owner.
    Auto,
    /// Read-only whatever the directory allows (`serve --read-only`).
    Always,
}

/// Whether `e` (from opening the lock file for writing) says the directory
/// cannot be written by this process, as opposed to another failure.
pub fn is_read_only_error(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EROFS) | Some(libc::EACCES) | Some(libc::EPERM))
}

/// A Store opened read-only: the directory, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOnlyDir {
    pub dir: PathBuf,
    /// `Read-only file system (os error 30)`, or `--read-only`.
    pub why: String,
}

impl std::fmt::Display for ReadOnlyDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is read-only ({}): this sidecar serves loads only; saves, rollback and gc are refused (serve a writable directory to save)",
            self.dir.display(),
            self.why
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::{CommitError, Store, StoreError, StoreOptions};
    use crate::lock::{LockError, LOCK_FILE_NAME};
    use crate::rollback::RollbackError;

    fn opts(d: &std::path::Path, read_only: ReadOnly) -> StoreOptions {
        StoreOptions { read_only, ..StoreOptions::new(vec![d.to_path_buf()]) }
    }

    #[test]
    fn a_read_only_store_takes_no_lock_runs_no_recovery_and_refuses_writes_naming_the_dir() {
        let d = tempfile::tempdir().unwrap();
        let leftover = d.path().join(".tmp-step-000000000003-0123abcd");
        std::fs::create_dir(&leftover).unwrap();
        let mut store = Store::open(opts(d.path(), ReadOnly::Always)).unwrap();
        assert!(!d.path().join(LOCK_FILE_NAME).exists(), "a read-only store wrote a lock file");
        assert!(leftover.is_dir(), "a read-only store ran recovery");
        let dir = std::fs::canonicalize(d.path()).unwrap();
        assert_eq!(store.read_only(), Some(&ReadOnlyDir { dir: dir.clone(), why: "--read-only".into() }));
        let e = store.check_dirs_unchanged().unwrap_err();
        assert!(matches!(e, CommitError::ReadOnly(_)), "{e:?}");
        assert!(e.to_string().starts_with(&format!("{} is read-only (--read-only)", dir.display())), "{e}");
        let e = store.rollback(1).unwrap_err();
        assert!(matches!(&e, RollbackError::Refused { why, .. } if why.contains("is read-only")), "{e:?}");
        // A writer may still own the directory beside the reader.
        drop(Store::open(opts(d.path(), ReadOnly::Never)).unwrap());
    }

    #[test]
    fn a_writable_directory_opened_auto_keeps_its_one_owner_lock() {
        let d = tempfile::tempdir().unwrap();
        let first = Store::open(opts(d.path(), ReadOnly::Auto)).unwrap();
        assert_eq!(first.read_only(), None);
        assert!(d.path().join(LOCK_FILE_NAME).exists());
        let e = Store::open(opts(d.path(), ReadOnly::Auto)).err().expect("a second owner was let in");
        assert!(matches!(e, StoreError::Locked(LockError::Held { .. })), "{e:?}");
    }

    #[test]
    fn only_errors_that_say_the_directory_cannot_be_written_make_it_read_only() {
        for (errno, ro) in [
            (libc::EROFS, true),
            (libc::EACCES, true),
            (libc::EPERM, true),
            (libc::ENOSPC, false),
            (libc::EIO, false),
            (libc::ENOENT, false),
        ] {
            assert_eq!(is_read_only_error(&io::Error::from_raw_os_error(errno)), ro, "errno {errno}");
        }
    }
}
