//! Disk I/O engines and the chunked write/read drivers over them.
//!
//! An engine takes raw read, write and fdatasync requests and returns their
//! completions; `uring` does it with io_uring (registered buffers where the
//! memory is registered), `pool` with a few threads calling pwrite/pread, the
//! fallback when io_uring is refused. Whether files are opened with O_DIRECT
//! is chosen beside it, per directory, by [`probe`].
//!
//! Invariants:
//! - a buffer handed to an engine belongs to it until its completion has been
//!   returned by [`IoEngine::wait`]; a failed push hands it back at once.
//!   This is the one unsafe contract of the module ([`IoEngine::push`]).
//! - the drivers never leave a request in flight when they return, on success
//!   or on error, so their callers may free or reuse buffers afterwards:
//!   every path out of [`drive`], [`drive_fed`] and [`sync_all`] first reaps
//!   every completion of what it pushed. An engine that fails to return
//!   completions is asked again ([`reap`]); one that never does again leaves
//!   no sound way out (the buffers can never be handed back), and the
//!   process aborts rather than unwind into code that frees them.
//! - a completion is taken only by the call that pushed its request: each
//!   call tags its requests' `user_data` with a generation of its own
//!   ([`tag`]), and a completion of any other is ignored, never taken for a
//!   slot of this one.

mod pool;
mod uring;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

pub use pool::PoolEngine;
pub use uring::UringEngine;

use crate::config::{self, DIRECT_ALIGN_BYTES};
use crate::mem::{AlignedBuf, SharedBuf};
use crate::progress::Progress;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Write,
    Read,
    Fdatasync,
}

/// One request. `ptr`/`len` are unused for `Fdatasync`.
#[derive(Debug, Clone, Copy)]
pub struct Op {
    pub kind: OpKind,
    pub fd: RawFd,
    pub ptr: *mut u8,
    pub len: u32,
    pub offset: u64,
    pub user_data: u64,
}

/// `result` is the byte count (>= 0) or a negated errno, as the kernel says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub user_data: u64,
    pub result: i32,
}

pub trait IoEngine: Send {
    /// How many requests may be in flight at once.
    fn queue_depth(&self) -> usize;

    /// Queues one request; it starts at the latest with the next [`submit`]
    /// or [`wait`](IoEngine::wait).
    ///
    /// # Safety
    /// For reads and writes, `op.ptr .. op.ptr + op.len` must stay valid until
    /// the completion carrying `op.user_data` has been returned by `wait`, and
    /// for reads nothing else may access that memory meanwhile. If `push`
    /// returns an error, the request was not queued and the buffer is free.
    unsafe fn push(&mut self, op: Op) -> io::Result<()>;

    /// Starts every queued request without waiting.
    fn submit(&mut self) -> io::Result<()>;

    /// Starts every queued request and blocks until at least `min`
    /// completions have been appended to `out`.
    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()>;

    /// Registers `buf` as fixed buffers (io_uring) so requests inside it skip
    /// the per-request page pinning; engines without the notion keep nothing.
    /// The engine keeps `buf` alive as long as it is registered.
    fn register(&mut self, buf: Arc<SharedBuf>) -> io::Result<()>;
}

// ----------------------------------------------------------- engine choice

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
/// per file by [`open_for_read_with`].
pub fn probe_for_read(dir: &Path, policy: IoPolicy) -> Result<(EngineChoice, Want), ProbeError> {
    let policy = policy.or_env().map_err(ProbeError::Policy)?;
    let (backend, why) = probe_backend(dir, policy)?;
    let choice = EngineChoice { backend, direct: policy.direct != Want::Off, queue_depth: policy.queue_depth, why };
    Ok((choice, policy.direct))
}

/// Opens for reading with O_DIRECT as `want` says; with `Auto`, a file
/// system that refuses O_DIRECT (EINVAL) gets a buffered open instead.
/// Returns the file and whether it is direct.
pub fn open_for_read_with(path: &Path, want: Want) -> io::Result<(File, bool)> {
    if want == Want::Off {
        return Ok((open_for_read(path, false)?, false));
    }
    match open_for_read(path, true) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) && want == Want::Auto => {
            Ok((open_for_read(path, false)?, false))
        }
        Err(e) => Err(e),
    }
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

/// Creates a new file (never truncates one that exists).
pub fn open_for_write(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.write(true).create_new(true).mode(0o644);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

pub fn open_for_read(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// A random 64-bit value for temp names (getrandom; the pid and clock if it fails).
pub fn nonce() -> u64 {
    let mut v = 0u64;
    // SAFETY: writes at most 8 bytes into v.
    let n = unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, 0) };
    if n != 8 {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        v = t ^ ((std::process::id() as u64) << 32) ^ COUNTER.fetch_add(1, Ordering::Relaxed);
    }
    v
}

// ----------------------------------------------------------- fault injection

/// Faults to inject into an engine's completions, for tests: the n-th write
/// (0-based, counted per engine) fails with `errno`, and/or every write is cut
/// to a fraction of its length so the driver's short-write path runs for
/// real (the kernel only writes the shortened request).
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    pub fail_write_n: Option<(u64, i32)>,
    pub short_writes: bool,
}

pub struct FaultyEngine {
    inner: Box<dyn IoEngine>,
    plan: FaultPlan,
    n_writes: u64,
    /// user_data of writes to fail on completion.
    doomed: Vec<u64>,
}

impl FaultyEngine {
    pub fn new(inner: Box<dyn IoEngine>, plan: FaultPlan) -> FaultyEngine {
        FaultyEngine { inner, plan, n_writes: 0, doomed: Vec::new() }
    }
}

impl IoEngine for FaultyEngine {
    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    unsafe fn push(&mut self, mut op: Op) -> io::Result<()> {
        if op.kind == OpKind::Write {
            if let Some((n, _)) = self.plan.fail_write_n {
                if self.n_writes == n {
                    self.doomed.push(op.user_data);
                }
            }
            self.n_writes += 1;
            // Cut writes of more than one block to half (block-aligned), so the
            // kernel really writes less and the driver must resubmit the rest.
            if self.plan.short_writes && op.len as usize > DIRECT_ALIGN_BYTES {
                op.len = ((op.len as usize / 2) & !(DIRECT_ALIGN_BYTES - 1)).max(DIRECT_ALIGN_BYTES) as u32;
            }
        }
        // SAFETY: forwarded contract; a shortened request covers a sub-range.
        unsafe { self.inner.push(op) }
    }

    fn submit(&mut self) -> io::Result<()> {
        self.inner.submit()
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        let start = out.len();
        self.inner.wait(min, out)?;
        if let Some((_, errno)) = self.plan.fail_write_n {
            for c in &mut out[start..] {
                if let Some(i) = self.doomed.iter().position(|&u| u == c.user_data) {
                    self.doomed.swap_remove(i);
                    c.result = -errno;
                }
            }
        }
        Ok(())
    }

    fn register(&mut self, buf: Arc<SharedBuf>) -> io::Result<()> {
        self.inner.register(buf)
    }
}

// ----------------------------------------------------------- drivers

/// Where a driver request failed.
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error("{what} of file #{file_idx} at offset {offset_bytes}: {source}")]
    Io { what: &'static str, file_idx: usize, offset_bytes: u64, source: io::Error },
    #[error("write of file #{file_idx} at offset {offset_bytes} made no progress (expected {expected_bytes} bytes, wrote {written_bytes})")]
    ShortWrite { file_idx: usize, offset_bytes: u64, expected_bytes: u64, written_bytes: u64 },
    #[error("read of file #{file_idx} ended at offset {offset_bytes}, before its expected length {expected_bytes}")]
    ShortRead { file_idx: usize, offset_bytes: u64, expected_bytes: u64 },
    #[error("engine: {0}")]
    Engine(io::Error),
    #[error("the image was not filled: {0}")]
    Source(String),
}

impl DriveError {
    pub fn errno(&self) -> Option<i32> {
        match self {
            DriveError::Io { source, .. } | DriveError::Engine(source) => source.raw_os_error(),
            _ => None,
        }
    }
}

/// One file for a driver: its descriptor and the memory it is written from
/// or read into. `io_len` is what is transferred (a multiple of the block size
/// under O_DIRECT); reads accept EOF at `file_len` and no earlier. With
/// `window_bytes > 0` (reads only) the memory is a ring of that many bytes:
/// file offset `o` lands at `ptr + o % window_bytes`, and no request is
/// issued into bytes not yet handed to `on_bytes`, so a file of any size
/// streams through a small buffer.
pub struct FileIo {
    pub fd: RawFd,
    pub ptr: *mut u8,
    pub io_len: u64,
    pub file_len: u64,
    pub window_bytes: u64,
}

impl FileIo {
    fn addr(&self, offset: u64) -> *mut u8 {
        let at = if self.window_bytes > 0 { offset % self.window_bytes } else { offset };
        self.ptr.wrapping_add(at as usize)
    }
}

struct Pending {
    file_idx: usize,
    offset: u64,
    len: u64,
}

/// Splits files into chunks and keeps up to the engine's queue depth of them
/// in flight. Short transfers are resubmitted for the rest; the first error
/// stops new submissions and is returned once everything in flight is back.
/// `on_bytes(file_idx, bytes)` receives each file's bytes in file order, as
/// soon as they are contiguous from the start (up to `file_len`), while later
/// requests are in flight, so the caller overlaps CPU work (checksums) with
/// the I/O. Writers pass a no-op.
///
/// # Safety
/// Every `FileIo` memory range (`io_len` bytes, or `window_bytes` with a
/// window) must be valid for the whole call, and for reads writable and
/// accessed by no one else.
pub unsafe fn drive(
    engine: &mut dyn IoEngine,
    kind: OpKind,
    files: &[FileIo],
    chunk_bytes: usize,
    on_bytes: impl FnMut(usize, &[u8]),
) -> Result<(), DriveError> {
    // SAFETY: the caller's contract.
    unsafe { drive_gated(engine, kind, files, chunk_bytes, on_bytes, None) }
}

/// Writes files whose memory is still being filled ([`Progress`]): file `i`
/// starts at staging offset `starts[i]`, and a chunk is issued only once the
/// ready prefix covers it; while it does not, the driver reaps completions,
/// or, with nothing in flight, waits for the filler. A failed filler stops
/// new writes like an I/O error ([`DriveError::Source`]); what is in flight
/// is reaped first.
///
/// # Safety
/// As [`drive`], and bytes below the ready prefix are not written by anyone
/// until this returns.
pub unsafe fn drive_fed(
    engine: &mut dyn IoEngine,
    files: &[FileIo],
    chunk_bytes: usize,
    starts: &[u64],
    progress: &Progress,
) -> Result<(), DriveError> {
    assert_eq!(files.len(), starts.len());
    // SAFETY: the caller's contract.
    unsafe { drive_gated(engine, OpKind::Write, files, chunk_bytes, |_, _| {}, Some((starts, progress))) }
}

/// [`drive`], with writes gated by a filler's progress when `gate` is given.
unsafe fn drive_gated(
    engine: &mut dyn IoEngine,
    kind: OpKind,
    files: &[FileIo],
    chunk_bytes: usize,
    mut on_bytes: impl FnMut(usize, &[u8]),
    gate: Option<(&[u64], &Progress)>,
) -> Result<(), DriveError> {
    assert!(kind != OpKind::Fdatasync);
    assert!(chunk_bytes > 0 && chunk_bytes <= u32::MAX as usize);
    for f in files {
        assert!(f.window_bytes == 0 || (kind == OpKind::Read && f.window_bytes % chunk_bytes as u64 == 0));
    }
    let qd = engine.queue_depth().max(1);
    // The work list: (file, offset, len) still to issue, in file order.
    let mut todo: std::collections::VecDeque<Pending> = std::collections::VecDeque::new();
    for (file_idx, f) in files.iter().enumerate() {
        let mut off = 0;
        while off < f.io_len {
            let len = (f.io_len - off).min(chunk_bytes as u64);
            todo.push_back(Pending { file_idx, offset: off, len });
            off += len;
        }
    }
    // Slots: user_data's low half indexes into it, its high half is this call's generation.
    let generation = next_generation();
    let mut slots: Vec<Option<Pending>> = (0..qd).map(|_| None).collect();
    let mut free: Vec<usize> = (0..qd).rev().collect();
    // Per file: completed ranges beyond the contiguous prefix, the prefix,
    // and how much of it has been handed to on_bytes.
    let mut prefix: Vec<u64> = vec![0; files.len()];
    let mut delivered: Vec<u64> = vec![0; files.len()];
    let mut done_ranges: Vec<Vec<(u64, u64)>> = vec![Vec::new(); files.len()];
    // A read that stopped at EOF: the file's real end.
    let mut eof_at: Vec<Option<u64>> = vec![None; files.len()];
    let mut first_err: Option<DriveError> = None;
    // Requests pushed and not reaped; a panic (of on_bytes, say) with any
    // left aborts the process, as an engine that cannot reap does.
    let mut in_flight = InFlight(0);
    let mut comps = Vec::with_capacity(qd);
    // The filler's ready prefix as last asked (gated writes only).
    let mut ready = 0u64;
    loop {
        while first_err.is_none() && !free.is_empty() {
            let Some(p) = todo.front() else { break };
            let f = &files[p.file_idx];
            if f.window_bytes > 0 && p.offset + p.len > delivered[p.file_idx] + f.window_bytes {
                break; // its place in the window is not consumed yet
            }
            if let Some((starts, progress)) = gate {
                let need = starts[p.file_idx] + p.offset + p.len;
                if need > ready {
                    // Wait for the filler only when the disk has nothing to do.
                    match progress.ready(need, in_flight.0 == 0) {
                        Ok(r) => ready = r,
                        Err(why) => {
                            first_err = Some(DriveError::Source(why));
                            break;
                        }
                    }
                    if need > ready {
                        break; // not copied yet: reap a completion meanwhile
                    }
                }
            }
            let p = todo.pop_front().expect("checked non-empty");
            if eof_at[p.file_idx].is_some_and(|e| p.offset >= e) {
                // Past EOF: nothing to read, and it counts as done.
                done_ranges[p.file_idx].push((p.offset, p.offset + p.len));
                advance_prefix(&mut prefix[p.file_idx], &mut done_ranges[p.file_idx]);
                continue;
            }
            let slot = free.pop().expect("checked non-empty");
            let op = Op {
                kind,
                fd: f.fd,
                ptr: f.addr(p.offset),
                len: p.len as u32,
                offset: p.offset,
                user_data: tag(generation, slot),
            };
            // SAFETY: the range lies inside the caller's FileIo memory, valid for
            // the whole call; we reap every completion before returning.
            match engine.push(op) {
                Ok(()) => {
                    slots[slot] = Some(p);
                    in_flight.0 += 1;
                }
                Err(e) => {
                    free.push(slot);
                    todo.push_front(p);
                    first_err = Some(DriveError::Engine(e));
                }
            }
        }
        if in_flight.0 > 0 {
            if let Err(e) = engine.submit() {
                // Nothing new started; what was in flight must still be reaped.
                first_err.get_or_insert(DriveError::Engine(e));
            }
        }
        // Let the caller work on what has arrived while the disk works on.
        if first_err.is_none() {
            for (i, f) in files.iter().enumerate() {
                let upto = prefix[i].min(f.file_len);
                if upto > delivered[i] {
                    deliver(f, delivered[i], upto, |b| on_bytes(i, b));
                    delivered[i] = upto;
                }
            }
        }
        if in_flight.0 == 0 {
            if todo.is_empty() || first_err.is_some() {
                break;
            }
            continue; // delivery made room in a window
        }
        comps.clear();
        if let Some(e) = reap(engine, 1, &mut comps) {
            // Nothing new is issued; what is in flight is still reaped.
            first_err.get_or_insert(DriveError::Engine(e));
        }
        for c in comps.drain(..) {
            let Some(slot) = untag(generation, c.user_data).filter(|&s| s < qd && slots[s].is_some()) else {
                tracing::error!(
                    user_data = c.user_data,
                    result = c.result,
                    "a completion of no request of this call: ignored"
                );
                continue;
            };
            let p = slots[slot].take().expect("checked above");
            free.push(slot);
            in_flight.0 -= 1;
            let f = &files[p.file_idx];
            if c.result < 0 {
                let what = if kind == OpKind::Write { "write" } else { "read" };
                first_err.get_or_insert(DriveError::Io {
                    what,
                    file_idx: p.file_idx,
                    offset_bytes: p.offset,
                    source: io::Error::from_raw_os_error(-c.result),
                });
                continue;
            }
            let n = c.result as u64;
            let range = if n == p.len {
                (p.offset, p.offset + n)
            } else if kind == OpKind::Read && p.offset + n >= f.file_len {
                // EOF inside this chunk: expected for the padded tail.
                eof_at[p.file_idx] = Some(p.offset + n);
                (p.offset, p.offset + p.len)
            } else if n == 0 {
                first_err.get_or_insert(if kind == OpKind::Write {
                    DriveError::ShortWrite {
                        file_idx: p.file_idx,
                        offset_bytes: p.offset,
                        expected_bytes: p.len,
                        written_bytes: 0,
                    }
                } else {
                    DriveError::ShortRead { file_idx: p.file_idx, offset_bytes: p.offset, expected_bytes: f.file_len }
                });
                continue;
            } else {
                // Short transfer: the done part counts, the rest goes first in line.
                todo.push_front(Pending { file_idx: p.file_idx, offset: p.offset + n, len: p.len - n });
                (p.offset, p.offset + n)
            };
            done_ranges[p.file_idx].push(range);
            advance_prefix(&mut prefix[p.file_idx], &mut done_ranges[p.file_idx]);
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    for (i, f) in files.iter().enumerate() {
        let end = eof_at[i].unwrap_or(f.io_len);
        if kind == OpKind::Read && end < f.file_len {
            return Err(DriveError::ShortRead { file_idx: i, offset_bytes: end, expected_bytes: f.file_len });
        }
        debug_assert_eq!(delivered[i], f.file_len.min(f.io_len));
    }
    Ok(())
}

/// Hands `[from, to)` of a file's bytes to `f`, in one or (across the end of
/// a window) two slices.
///
/// # Safety
/// The range must have been fully transferred and not yet reused.
unsafe fn deliver(f: &FileIo, from: u64, to: u64, mut out: impl FnMut(&[u8])) {
    let mut at = from;
    while at < to {
        let run = if f.window_bytes > 0 { (to - at).min(f.window_bytes - at % f.window_bytes) } else { to - at };
        // SAFETY: the caller guarantees these bytes have arrived and are not
        // the target of any request in flight.
        out(std::slice::from_raw_parts(f.addr(at), run as usize));
        at += run;
    }
}

fn advance_prefix(prefix: &mut u64, ranges: &mut Vec<(u64, u64)>) {
    loop {
        let Some(i) = ranges.iter().position(|&(b, _)| b == *prefix) else { return };
        *prefix = ranges.swap_remove(i).1;
    }
}

/// fdatasync every descriptor, up to the queue depth in flight at once.
/// A failed push stops it after what was pushed is reaped.
pub fn sync_all(engine: &mut dyn IoEngine, fds: &[RawFd]) -> Result<(), DriveError> {
    let generation = next_generation();
    let mut first_err = None;
    let mut comps = Vec::new();
    let qd = engine.queue_depth().max(1);
    for (chunk_idx, chunk) in fds.chunks(qd).enumerate() {
        let mut pushed = 0;
        for (i, &fd) in chunk.iter().enumerate() {
            let op = Op {
                kind: OpKind::Fdatasync,
                fd,
                ptr: std::ptr::null_mut(),
                len: 0,
                offset: 0,
                user_data: tag(generation, chunk_idx * qd + i),
            };
            // SAFETY: fdatasync touches no memory of ours.
            match unsafe { engine.push(op) } {
                Ok(()) => pushed += 1,
                Err(e) => {
                    first_err.get_or_insert(DriveError::Engine(e));
                    break;
                }
            }
        }
        let mut reaped = 0;
        while reaped < pushed {
            comps.clear();
            if let Some(e) = reap(engine, pushed - reaped, &mut comps) {
                first_err.get_or_insert(DriveError::Engine(e));
            }
            for c in &comps {
                let Some(file_idx) = untag(generation, c.user_data).filter(|&i| i / qd == chunk_idx && i < fds.len())
                else {
                    tracing::error!(
                        user_data = c.user_data,
                        result = c.result,
                        "a completion of no fdatasync of this call: ignored"
                    );
                    continue;
                };
                reaped += 1;
                if c.result < 0 {
                    first_err.get_or_insert(DriveError::Io {
                        what: "fdatasync",
                        file_idx,
                        offset_bytes: 0,
                        source: io::Error::from_raw_os_error(-c.result),
                    });
                }
            }
        }
        if first_err.is_some() {
            break;
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Requests of a driver call in flight. Dropped with some left only by an
/// unwinding panic, which would free buffers the kernel still uses: abort.
struct InFlight(usize);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0 > 0 {
            eprintln!(
                "ckpt: a panic with {} I/O requests in flight; their buffers can never be freed safely: aborting",
                self.0
            );
            std::process::abort();
        }
    }
}

/// A fresh generation for one driver call's `user_data` tags.
fn next_generation() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// `user_data` of request `idx` of the call of `generation`.
fn tag(generation: u32, idx: usize) -> u64 {
    debug_assert!(idx <= u32::MAX as usize);
    (u64::from(generation) << 32) | idx as u64
}

/// The request index in `user_data` if the call of `generation` tagged it.
fn untag(generation: u32, user_data: u64) -> Option<usize> {
    ((user_data >> 32) as u32 == generation).then_some((user_data & u64::from(u32::MAX)) as usize)
}

/// Waits for at least `min` completions, appended to `out`. An engine that
/// fails is asked again, [`config::ENGINE_WAIT_RETRIES_MAX`] times
/// [`config::ENGINE_RETRY_PAUSE_MS`] apart, since requests in flight still
/// use the caller's buffers; the first failure is returned (the caller
/// issues nothing more and reports it) once the completions are in. An
/// engine that never answers again leaves the buffers with the kernel for
/// good: no return is sound (the caller would free or reuse them), and an
/// unwinding panic would free them too, so the process aborts.
fn reap(engine: &mut dyn IoEngine, min: usize, out: &mut Vec<Completion>) -> Option<io::Error> {
    let start = out.len();
    let mut first = None;
    for _ in 0..=config::ENGINE_WAIT_RETRIES_MAX {
        let want = min.saturating_sub(out.len() - start);
        match engine.wait(want, out) {
            Ok(()) => return first,
            Err(e) => {
                tracing::warn!("I/O engine failed to return completions, asking again: {e}");
                first.get_or_insert(e);
                if out.len() - start >= min {
                    return first;
                }
                std::thread::sleep(std::time::Duration::from_millis(config::ENGINE_RETRY_PAUSE_MS));
            }
        }
    }
    let e = first.expect("failed at least once");
    tracing::error!("I/O engine cannot return completions of requests in flight ({e}); their buffers can never be freed safely: aborting");
    eprintln!("ckpt: I/O engine cannot return completions of requests in flight ({e}); aborting");
    std::process::abort();
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn engines() -> Vec<(String, Box<dyn IoEngine>)> {
        let mut v: Vec<(String, Box<dyn IoEngine>)> = vec![("pool".into(), Box::new(PoolEngine::new(3, 8)))];
        match UringEngine::new(8) {
            Ok(u) => v.push(("uring".into(), Box::new(u))),
            Err(e) => println!("skipped: io_uring engine unavailable here: {e}"),
        }
        v
    }

    fn round_trip(engine: &mut dyn IoEngine, direct: bool, file_len: usize) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let io_len = if direct { config::align_up(file_len as u64, DIRECT_ALIGN_BYTES) as usize } else { file_len };
        let mut src = AlignedBuf::new(io_len).unwrap();
        for (i, b) in src.as_mut_slice()[..file_len].iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        let f = open_for_write(&path, direct).unwrap();
        let files = [FileIo {
            fd: f.as_raw_fd(),
            ptr: src.as_mut_ptr(),
            io_len: io_len as u64,
            file_len: file_len as u64,
            window_bytes: 0,
        }];
        // SAFETY: src outlives the call.
        unsafe { drive(engine, OpKind::Write, &files, 64 << 10, |_, _| {}) }.unwrap();
        f.set_len(file_len as u64).unwrap();
        sync_all(engine, &[f.as_raw_fd()]).unwrap();
        drop(f);
        assert_eq!(std::fs::read(&path).unwrap(), &src.as_slice()[..file_len]);
        let mut dst = AlignedBuf::new(io_len).unwrap();
        let f = open_for_read(&path, direct).unwrap();
        let files = [FileIo {
            fd: f.as_raw_fd(),
            ptr: dst.as_mut_ptr(),
            io_len: io_len as u64,
            file_len: file_len as u64,
            window_bytes: 0,
        }];
        let mut streamed = Vec::new();
        // SAFETY: dst outlives the call and is not touched during it.
        unsafe { drive(engine, OpKind::Read, &files, 64 << 10, |_, b| streamed.extend_from_slice(b)) }.unwrap();
        assert_eq!(streamed, &src.as_slice()[..file_len]);
        assert_eq!(&dst.as_slice()[..file_len], &src.as_slice()[..file_len]);
        // Again through a window of four chunks: the bytes stream in order.
        let mut window = AlignedBuf::new(4 * (64 << 10)).unwrap();
        let files = [FileIo {
            fd: f.as_raw_fd(),
            ptr: window.as_mut_ptr(),
            io_len: io_len as u64,
            file_len: file_len as u64,
            window_bytes: 4 * (64 << 10),
        }];
        let mut streamed = Vec::new();
        // SAFETY: window outlives the call and is not touched during it.
        unsafe { drive(engine, OpKind::Read, &files, 64 << 10, |_, b| streamed.extend_from_slice(b)) }.unwrap();
        assert_eq!(streamed, &src.as_slice()[..file_len]);
    }

    #[test]
    fn every_engine_round_trips_with_and_without_direct() {
        for (name, mut e) in engines() {
            println!("engine {name}");
            round_trip(e.as_mut(), true, 1_000_000);
            round_trip(e.as_mut(), false, 1_000_001);
            round_trip(e.as_mut(), true, 0);
        }
    }

    #[test]
    fn short_writes_are_completed() {
        for (name, e) in engines() {
            println!("engine {name}");
            let mut f = FaultyEngine::new(e, FaultPlan { short_writes: true, ..Default::default() });
            round_trip(&mut f, true, 3_000_000);
        }
    }

    #[test]
    fn injected_eio_is_reported_with_its_place() {
        for (name, e) in engines() {
            println!("engine {name}");
            let mut eng = FaultyEngine::new(e, FaultPlan { fail_write_n: Some((3, libc::EIO)), ..Default::default() });
            let dir = tempfile::tempdir().unwrap();
            let mut src = AlignedBuf::new(1 << 20).unwrap();
            let f = open_for_write(&dir.path().join("f"), true).unwrap();
            let files = [FileIo {
                fd: f.as_raw_fd(),
                ptr: src.as_mut_ptr(),
                io_len: 1 << 20,
                file_len: 1 << 20,
                window_bytes: 0,
            }];
            // SAFETY: src outlives the call.
            let err = unsafe { drive(&mut eng, OpKind::Write, &files, 64 << 10, |_, _| {}) }.unwrap_err();
            assert_eq!(err.errno(), Some(libc::EIO), "{err}");
            assert!(err.to_string().contains("offset 196608"), "{err}");
        }
    }

    /// An engine double that fails a chosen `push` or `wait` call (0-based,
    /// counted per engine), runs requests itself (pread/pwrite/fdatasync at
    /// `wait`, completions in reverse order), and checks the drivers'
    /// contract as it goes: no request is pushed onto memory a request in
    /// flight still uses, and after a driver returns nothing is in flight.
    pub(crate) struct FailingEngine {
        qd: usize,
        fail_push_at: Option<usize>,
        fail_wait_at: Option<usize>,
        n_push: usize,
        n_wait: usize,
        /// Pushed, not yet returned by `wait`.
        queued: Vec<Op>,
        /// Returned by the next `wait` before anything else (a stale completion).
        inject: Vec<Completion>,
        /// Pushes onto memory still in flight.
        reused_under_kernel: usize,
    }

    impl FailingEngine {
        pub(crate) fn new(qd: usize, fail_push_at: Option<usize>, fail_wait_at: Option<usize>) -> FailingEngine {
            FailingEngine {
                qd,
                fail_push_at,
                fail_wait_at,
                n_push: 0,
                n_wait: 0,
                queued: Vec::new(),
                inject: Vec::new(),
                reused_under_kernel: 0,
            }
        }

        pub(crate) fn assert_idle(&self, what: &str) {
            assert!(
                self.queued.is_empty(),
                "{what}: the driver returned with {} requests in flight",
                self.queued.len()
            );
            assert_eq!(self.reused_under_kernel, 0, "{what}: memory of a request in flight was handed out again");
        }
    }

    // SAFETY: the queued ops' pointers are dereferenced only by `wait`, on
    // the thread that owns the engine (as the io_uring engine's ring does).
    unsafe impl Send for FailingEngine {}

    impl IoEngine for FailingEngine {
        fn queue_depth(&self) -> usize {
            self.qd
        }

        unsafe fn push(&mut self, op: Op) -> io::Result<()> {
            let n = self.n_push;
            self.n_push += 1;
            if self.fail_push_at == Some(n) {
                return Err(io::Error::from_raw_os_error(libc::EAGAIN));
            }
            if op.kind != OpKind::Fdatasync {
                let (b, e) = (op.ptr as usize, op.ptr as usize + op.len as usize);
                let overlaps =
                    |q: &Op| q.kind != OpKind::Fdatasync && (q.ptr as usize) < e && b < q.ptr as usize + q.len as usize;
                if self.queued.iter().any(overlaps) {
                    self.reused_under_kernel += 1;
                }
            }
            assert!(self.queued.len() < self.qd, "more requests pushed than the queue depth");
            self.queued.push(op);
            Ok(())
        }

        fn submit(&mut self) -> io::Result<()> {
            Ok(())
        }

        fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
            let n = self.n_wait;
            self.n_wait += 1;
            if self.fail_wait_at == Some(n) {
                return Err(io::Error::from_raw_os_error(libc::ENOMEM));
            }
            out.append(&mut self.inject);
            assert!(
                min <= self.queued.len(),
                "waits for {min} completions with {} in flight: would block for ever",
                self.queued.len()
            );
            while let Some(op) = self.queued.pop() {
                // SAFETY: the push contract keeps op's memory valid until now.
                let r = unsafe {
                    match op.kind {
                        OpKind::Write => libc::pwrite(op.fd, op.ptr.cast(), op.len as usize, op.offset as libc::off_t),
                        OpKind::Read => libc::pread(op.fd, op.ptr.cast(), op.len as usize, op.offset as libc::off_t),
                        OpKind::Fdatasync => libc::fdatasync(op.fd) as isize,
                    }
                };
                let result =
                    if r < 0 { -io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO) } else { r as i32 };
                out.push(Completion { user_data: op.user_data, result });
            }
            Ok(())
        }

        fn register(&mut self, _buf: Arc<SharedBuf>) -> io::Result<()> {
            Ok(())
        }
    }

    const CHUNK: usize = 64 << 10;
    const N_CHUNKS: usize = 10;

    fn pattern(len: usize, seed: u8) -> AlignedBuf {
        let mut b = AlignedBuf::new(len).unwrap();
        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
            *x = (i % 251) as u8 ^ seed;
        }
        b
    }

    #[test]
    fn drivers_reap_every_request_when_push_or_wait_fails_at_any_position_of_a_batch() {
        let dir = tempfile::tempdir().unwrap();
        let len = N_CHUNKS * CHUNK;
        // Each driver call pushes at most N_CHUNKS requests and waits as often.
        for at in 0..N_CHUNKS + 2 {
            for (fail_push, fail_wait) in [(Some(at), None), (None, Some(at))] {
                let what = format!("push fails at {fail_push:?}, wait at {fail_wait:?}");
                // Write.
                let path = dir.path().join(format!("w{at}-{}", fail_push.is_some()));
                let mut src = pattern(len, at as u8);
                let f = open_for_write(&path, false).unwrap();
                let files = [FileIo {
                    fd: f.as_raw_fd(),
                    ptr: src.as_mut_ptr(),
                    io_len: len as u64,
                    file_len: len as u64,
                    window_bytes: 0,
                }];
                let mut e = FailingEngine::new(4, fail_push, fail_wait);
                // SAFETY: src outlives the call.
                let r = unsafe { drive(&mut e, OpKind::Write, &files, CHUNK, |_, _| {}) };
                e.assert_idle(&format!("write, {what}"));
                // The same engine, failing no more, serves the next call right.
                e.fail_push_at = None;
                e.fail_wait_at = None;
                if r.is_err() {
                    // SAFETY: as above.
                    unsafe { drive(&mut e, OpKind::Write, &files, CHUNK, |_, _| {}) }.unwrap();
                }
                e.assert_idle(&format!("write again, {what}"));
                assert_eq!(std::fs::read(&path).unwrap(), src.as_slice(), "{what}");
                // Read, through a window (requests wait for the bytes to be consumed).
                let mut e = FailingEngine::new(4, fail_push, fail_wait);
                let mut window = AlignedBuf::new(4 * CHUNK).unwrap();
                let rf = open_for_read(&path, false).unwrap();
                let files = [FileIo {
                    fd: rf.as_raw_fd(),
                    ptr: window.as_mut_ptr(),
                    io_len: len as u64,
                    file_len: len as u64,
                    window_bytes: 4 * CHUNK as u64,
                }];
                let mut got = Vec::new();
                // SAFETY: window outlives the call and nothing else touches it.
                let r = unsafe { drive(&mut e, OpKind::Read, &files, CHUNK, |_, b| got.extend_from_slice(b)) };
                e.assert_idle(&format!("read, {what}"));
                match r {
                    Ok(()) => assert_eq!(got, src.as_slice(), "{what}"),
                    Err(err) => assert!(matches!(err, DriveError::Engine(_)), "{what}: {err}"),
                }
                // fdatasync of more descriptors than the queue depth.
                let mut e = FailingEngine::new(4, fail_push, fail_wait);
                let fds: Vec<RawFd> = std::iter::repeat(f.as_raw_fd()).take(N_CHUNKS).collect();
                let r = sync_all(&mut e, &fds);
                e.assert_idle(&format!("sync_all, {what}"));
                if let Err(err) = r {
                    assert!(matches!(err, DriveError::Engine(_)), "{what}: {err}");
                }
            }
        }
    }

    #[test]
    fn a_completion_of_an_earlier_call_is_never_taken_for_one_of_a_new_call() {
        let dir = tempfile::tempdir().unwrap();
        let len = N_CHUNKS * CHUNK;
        let path = dir.path().join("f");
        let mut src = pattern(len, 7);
        let f = open_for_write(&path, false).unwrap();
        let files = [FileIo {
            fd: f.as_raw_fd(),
            ptr: src.as_mut_ptr(),
            io_len: len as u64,
            file_len: len as u64,
            window_bytes: 0,
        }];
        let mut e = FailingEngine::new(4, None, None);
        // SAFETY: src outlives the call.
        unsafe { drive(&mut e, OpKind::Write, &files, CHUNK, |_, _| {}) }.unwrap();
        // A late completion of slot 0 of a call that ended (as a driver that
        // returned early would have left), arriving in the next call's wait.
        for user_data in [0, tag(next_generation(), 0), tag(next_generation(), 3)] {
            e.inject.push(Completion { user_data, result: CHUNK as i32 });
            let mut dst = AlignedBuf::new(len).unwrap();
            let rf = open_for_read(&path, false).unwrap();
            let files = [FileIo {
                fd: rf.as_raw_fd(),
                ptr: dst.as_mut_ptr(),
                io_len: len as u64,
                file_len: len as u64,
                window_bytes: 0,
            }];
            // SAFETY: dst outlives the call and nothing else touches it.
            unsafe { drive(&mut e, OpKind::Read, &files, CHUNK, |_, _| {}) }.unwrap();
            e.assert_idle("read with a stale completion");
            assert_eq!(dst.as_slice(), src.as_slice());
        }
        e.inject.push(Completion { user_data: 1, result: 0 });
        sync_all(&mut e, &[f.as_raw_fd(); 6]).unwrap();
        e.assert_idle("sync_all with a stale completion");
    }
}
