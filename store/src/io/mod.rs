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
//!   completions is asked again ([`completions::reap`]); one that never does again leaves
//!   no sound way out (the buffers can never be handed back), and the
//!   process aborts rather than unwind into code that frees them.
//! - a completion is taken only by the call that pushed its request: each
//!   call tags its requests' `user_data` with a generation of its own
//!   ([`completions::tag`]), and a completion of any other is ignored, never taken for a
//!   slot of this one.
//!
//! Files: `choice` (the engine per directory: [`probe`]), `open` (files
//! for it), `drivers` ([`drive`], [`drive_fed`], [`sync_all`]),
//! `completions` (the bookkeeping every driver call shares), `fault` (fault
//! injection for tests), `uring` and `pool` (the engines).

mod choice;
mod completions;
mod drivers;
mod fault;
mod open;
mod pool;
mod uring;

#[cfg(test)]
pub(crate) mod tests;

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

pub use choice::{probe, probe_for_read, Backend, EngineChoice, IoPolicy, ProbeError, Want};
pub use drivers::{drive, drive_fed, sync_all, DriveError, FileIo};
pub use fault::{FaultPlan, FaultyEngine};
pub use open::{nonce, open_for_read, open_for_read_with, open_for_write};
pub use pool::PoolEngine;
pub use uring::UringEngine;

use crate::mem::RawBuf;

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
    fn register(&mut self, buf: Arc<RawBuf>) -> io::Result<()>;
}
