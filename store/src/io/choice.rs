//! Choosing an engine per directory: what the user asked for ([`IoPolicy`],
//! filled in from the environment), and what the system allows, found by
//! trying ([`probe`]): an io_uring instance with the opcodes we need, and an
//! O_DIRECT write of one block.
//!
//! Invariant: a probe leaves nothing behind in the directory it probes (an
//! unnamed file, or a named one removed at once and by recovery after a
//! crash).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::open::{nonce, open_for_write};
use super::{IoEngine, PoolEngine, UringEngine};
use crate::config::{self, DIRECT_ALIGN_BYTES};
use crate::mem::AlignedBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Uring,
    Pool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Want {
    /// Use the best the system allows.
    #[default]
    Auto,
    /// Use it or fail.
    On,
    /// Do not use it.
    Off,
}

impl std::str::FromStr for Want {
    type Err = String;
    fn from_str(s: &str) -> Result<Want, String> {
        match s {
            "auto" => Ok(Want::Auto),
            "on" | "1" | "yes" | "true" => Ok(Want::On),
            "off" | "0" | "no" | "false" => Ok(Want::Off),
            _ => Err(format!("{s:?}: expected auto, on or off")),
        }
    }
}

/// What the user asked for; the environment variables `CKPT_SIDECAR_URING`
/// and `CKPT_SIDECAR_DIRECT` (auto|on|off) fill in what options left Auto,
/// so a fallback can be forced from outside any program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IoPolicy {
    pub uring: Want,
    pub direct: Want,
    pub queue_depth: u32,
}

impl IoPolicy {
    pub fn from_env() -> Result<IoPolicy, String> {
        let get = |k: &str| match std::env::var(k) {
            Ok(v) => v.parse::<Want>().map_err(|e| format!("{k}: {e}")),
            Err(_) => Ok(Want::Auto),
        };
        Ok(IoPolicy {
            uring: get("CKPT_SIDECAR_URING")?,
            direct: get("CKPT_SIDECAR_DIRECT")?,
            queue_depth: config::QUEUE_DEPTH_DEFAULT,
        })
    }

    /// `self` with every Auto replaced by the environment's choice.
    pub fn or_env(self) -> Result<IoPolicy, String> {
        let env = IoPolicy::from_env()?;
        let pick = |a: Want, b: Want| if a == Want::Auto { b } else { a };
        let qd = if self.queue_depth == 0 { config::QUEUE_DEPTH_DEFAULT } else { self.queue_depth };
        Ok(IoPolicy { uring: pick(self.uring, env.uring), direct: pick(self.direct, env.direct), queue_depth: qd })
    }
}

/// The engine chosen for one directory, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineChoice {
    pub backend: Backend,
    pub direct: bool,
    pub queue_depth: u32,
    pub why: Vec<String>,
}

impl EngineChoice {
    /// `io_uring+O_DIRECT`, `pwrite-pool+buffered`, ...
    pub fn name(&self) -> String {
        let b = match self.backend {
            Backend::Uring => "io_uring",
            Backend::Pool => "thread-pool",
        };
        let d = if self.direct { "O_DIRECT" } else { "buffered" };
        format!("{b}+{d}")
    }

    pub fn open_engine(&self) -> io::Result<Box<dyn IoEngine>> {
        Ok(match self.backend {
            Backend::Uring => Box::new(UringEngine::new(self.queue_depth)?),
            Backend::Pool => Box::new(PoolEngine::new(config::POOL_THREADS_DEFAULT, self.queue_depth as usize)),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{dir}: {what}: {source}")]
    Io { dir: String, what: &'static str, source: io::Error },
    #[error("{0}")]
    Policy(String),
}

/// Decides the engine for `dir` by trying: an io_uring instance with the
/// opcodes we need (ENOSYS/EPERM, e.g. under a container's seccomp profile,
/// means the thread pool), and an O_DIRECT write of one block in a probe file
/// (EINVAL, e.g. on some network file systems, means buffered writes).
pub fn probe(dir: &Path, policy: IoPolicy) -> Result<EngineChoice, ProbeError> {
    let policy = policy.or_env().map_err(ProbeError::Policy)?;
    let (backend, mut why) = probe_backend(dir, policy)?;
    let direct = match policy.direct {
        Want::Off => {
            why.push("O_DIRECT disabled by configuration".to_string());
            false
        }
        w => match probe_direct(dir) {
            Ok(()) => true,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && w == Want::Auto => {
                why.push(format!("O_DIRECT refused by the file system ({e}); using buffered writes + fdatasync"));
                false
            }
            Err(e) => {
                let what = if e.raw_os_error() == Some(libc::EINVAL) {
                    "O_DIRECT required but refused"
                } else {
                    "probe write"
                };
                return Err(ProbeError::Io { dir: dir.display().to_string(), what, source: e });
            }
        },
    };
    if why.is_empty() {
        why.push("io_uring and O_DIRECT both work here".to_string());
    }
    Ok(EngineChoice { backend, direct, queue_depth: policy.queue_depth, why })
}

/// The engine for reading files in `dir`, which writes nothing there: the
/// backend as [`probe`] chooses it; O_DIRECT unless disabled, to be confirmed
/// per file by [`open_for_read_with`](super::open_for_read_with).
pub fn probe_for_read(dir: &Path, policy: IoPolicy) -> Result<(EngineChoice, Want), ProbeError> {
    let policy = policy.or_env().map_err(ProbeError::Policy)?;
    let (backend, why) = probe_backend(dir, policy)?;
    let choice = EngineChoice { backend, direct: policy.direct != Want::Off, queue_depth: policy.queue_depth, why };
    Ok((choice, policy.direct))
}

fn probe_backend(dir: &Path, policy: IoPolicy) -> Result<(Backend, Vec<String>), ProbeError> {
    let mut why = Vec::new();
    let backend = match policy.uring {
        Want::Off => {
            why.push("io_uring disabled by configuration".to_string());
            Backend::Pool
        }
        w => match UringEngine::probe(policy.queue_depth) {
            Ok(()) => Backend::Uring,
            Err(e) if w == Want::On => {
                return Err(ProbeError::Io {
                    dir: dir.display().to_string(),
                    what: "io_uring required but refused",
                    source: e,
                })
            }
            Err(e) => {
                why.push(format!("io_uring refused ({e}); using a thread pool of pwrite/pread"));
                Backend::Pool
            }
        },
    };
    Ok((backend, why))
}

/// Writes one block with O_DIRECT into an unnamed file (O_TMPFILE), so a
/// crash leaves nothing behind; file systems without O_TMPFILE get a named
/// `.ckpt-probe-…` file, which recovery removes if a crash leaves it.
fn probe_direct(dir: &Path) -> io::Result<()> {
    let write_block = |f: &File| -> io::Result<()> {
        let mut block = AlignedBuf::new(DIRECT_ALIGN_BYTES)?;
        block.as_mut_slice()[0] = 1;
        // SAFETY: fd and the aligned block are valid for the call.
        let n = unsafe { libc::pwrite(f.as_raw_fd(), block.as_ptr().cast(), DIRECT_ALIGN_BYTES, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    };
    let mut o = OpenOptions::new();
    o.write(true).mode(0o600).custom_flags(libc::O_TMPFILE | libc::O_DIRECT);
    match o.open(dir) {
        Ok(f) => return write_block(&f),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::ENOENT)) => {}
        Err(e) => return Err(e),
    }
    let path = dir.join(format!("{}{:016x}", crate::format::PROBE_PREFIX, nonce()));
    let result = open_for_write(&path, true).and_then(|f| write_block(&f));
    let _ = std::fs::remove_file(&path);
    result
}
