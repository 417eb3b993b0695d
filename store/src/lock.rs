//! One owner per directory: every process that recovers, commits or deletes
//! in a target directory (`serve`/`launch`, `gc`, `rollback`, `bench write`)
//! holds an exclusive `flock` on `<dir>/.ckpt-sidecar.lock` for its lifetime
//! ([`DirLock`]). The holder writes who it is into the file (pid, what it
//! does, and a daemon's socket), so that a second process can name it, and a
//! tool can reach a serving sidecar instead of working under it.
//!
//! The lock is the kernel's: it goes with the holder's last file descriptor,
//! so a killed holder never leaves a stale lock (the file stays, unlocked,
//! and the next holder reuses it). A holder that ends normally removes the
//! file while it still holds the lock; a process that locked a file that
//! was removed meanwhile sees that its inode is no longer the path's and
//! tries again, so two processes never both hold "the" lock.
//! Read-only commands (`ls`, `inspect`, `verify`) take no lock.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The lock file's name in a target directory.
pub const LOCK_FILE_NAME: &str = ".ckpt-sidecar.lock";

/// Who holds a directory, as its lock file says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Holder {
    pub pid: Option<u32>,
    /// What the holder does (`serve`, `gc`, ...).
    pub role: String,
    /// A serving sidecar's socket, where tools can reach it.
    pub socket: Option<PathBuf>,
}

impl Holder {
    fn parse(text: &str) -> Holder {
        let mut h = Holder::default();
        for line in text.lines() {
            match line.split_once('=') {
                Some(("pid", v)) => h.pid = v.trim().parse().ok(),
                Some(("role", v)) => h.role = v.trim().to_string(),
                Some(("socket", v)) if !v.trim().is_empty() => h.socket = Some(PathBuf::from(v.trim())),
                _ => {}
            }
        }
        h
    }

    fn render(&self) -> String {
        let mut s = format!("pid={}\nrole={}\n", self.pid.unwrap_or(0), self.role);
        if let Some(p) = &self.socket {
            s.push_str(&format!("socket={}\n", p.display()));
        }
        s
    }

    /// `pid 123 (ckpt-sidecar serve, socket /run/x.sock)`.
    pub fn describe(&self) -> String {
        let pid = self.pid.map_or("an unknown process".to_string(), |p| format!("pid {p}"));
        let role = if self.role.is_empty() { String::new() } else { format!("ckpt-sidecar {}", self.role) };
        match (&self.socket, role.is_empty()) {
            (Some(s), _) => format!("{pid} ({role}, socket {})", s.display()),
            (None, false) => format!("{pid} ({role})"),
            (None, true) => pid,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{} is in use by {}", dir.display(), holder.describe())]
    Held { dir: PathBuf, holder: Holder },
    #[error("cannot lock {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

/// An exclusive lock on one directory, held until dropped.
#[derive(Debug)]
pub struct DirLock {
    file: File,
    dir: PathBuf,
}

/// Tries to lock a lock file that another holder removes at the same time.
const LOCK_ATTEMPTS_MAX: usize = 16;

/// Whether `file` is still what `path` names (a holder that ended may have
/// removed it between our open and our flock).
fn is_current(file: &File, path: &Path) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let a = file.metadata()?;
    match std::fs::metadata(path) {
        Ok(b) => Ok(a.dev() == b.dev() && a.ino() == b.ino()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Removed while still held: whoever opens it now either finds no file
        // (and makes a new one) or finds, after its flock, that its inode is
        // gone from the path, and tries again.
        // Only our own file: a directory removed and made again under us
        // has another holder's lock file at that path now.
        use std::os::unix::fs::MetadataExt;
        let path = self.dir.join(LOCK_FILE_NAME);
        let ours = match (self.file.metadata(), std::fs::metadata(&path)) {
            (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
            _ => false,
        };
        if ours {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl DirLock {
    /// Takes the lock on `dir` (which must exist) without waiting, writing
    /// `holder` (our pid is filled in) into the lock file.
    pub fn acquire(dir: &Path, role: &str, socket: Option<&Path>) -> Result<DirLock, LockError> {
        let path = dir.join(LOCK_FILE_NAME);
        let io_err = |source| LockError::Io { path: path.clone(), source };
        for _ in 0..LOCK_ATTEMPTS_MAX {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o644)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map_err(io_err)?;
            // SAFETY: flock on a descriptor we own; no memory is involved.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(LockError::Held { dir: dir.to_path_buf(), holder: read_holder(&mut file) });
                }
                return Err(io_err(e));
            }
            if !is_current(&file, &path).map_err(io_err)? {
                continue;
            }
            let me =
                Holder { pid: Some(std::process::id()), role: role.to_string(), socket: socket.map(Path::to_path_buf) };
            file.set_len(0)
                .and_then(|()| file.rewind())
                .and_then(|()| file.write_all(me.render().as_bytes()))
                .map_err(io_err)?;
            return Ok(DirLock { file, dir: dir.to_path_buf() });
        }
        Err(io_err(io::Error::other("the lock file kept being replaced while locking it")))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records the socket a daemon serves on (known after the lock is taken).
    pub fn set_socket(&mut self, socket: &Path, role: &str) -> io::Result<()> {
        let me = Holder { pid: Some(std::process::id()), role: role.to_string(), socket: Some(socket.to_path_buf()) };
        self.file.set_len(0)?;
        self.file.rewind()?;
        self.file.write_all(me.render().as_bytes())
    }
}

fn read_holder(file: &mut File) -> Holder {
    let mut s = String::new();
    let _ = file.rewind().and_then(|()| file.take(4096).read_to_string(&mut s));
    Holder::parse(&s)
}

/// Who holds `dir` now, if anyone (without taking the lock for long).
pub fn holder(dir: &Path) -> Option<Holder> {
    let mut file = File::open(dir.join(LOCK_FILE_NAME)).ok()?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
        return None;
    }
    Some(read_holder(&mut file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_fails_naming_the_holder_and_a_dropped_one_frees_the_dir() {
        let d = tempfile::tempdir().unwrap();
        let sock = Path::new("/run/x/sidecar.sock");
        let first = DirLock::acquire(d.path(), "serve", Some(sock)).unwrap();
        // flock locks belong to the open file description: a second open in
        // the same process conflicts as another process's would.
        let e = DirLock::acquire(d.path(), "gc", None).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id()))
                && msg.contains("serve")
                && msg.contains("/run/x/sidecar.sock"),
            "{msg}"
        );
        let h = holder(d.path()).unwrap();
        assert_eq!(h.socket.as_deref(), Some(sock));
        drop(first);
        assert_eq!(holder(d.path()), None);
        assert!(!d.path().join(LOCK_FILE_NAME).exists(), "a released lock leaves its file");
        let again = DirLock::acquire(d.path(), "gc", None).unwrap();
        // A killed holder's file stays, its lock does not: the file is reused.
        let killed = std::mem::ManuallyDrop::new(again);
        // SAFETY: `killed` is never used or dropped again; this takes its
        // File out to close the descriptor without running DirLock's Drop.
        drop(unsafe { std::ptr::read(&killed.file) });
        assert!(d.path().join(LOCK_FILE_NAME).exists());
        let _third = DirLock::acquire(d.path(), "serve", None).unwrap();
    }
}
