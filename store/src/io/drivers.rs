//! The chunked drivers over an engine: [`drive`] reads or writes files from
//! memory that is ready, [`drive_fed`] writes memory a filler is still
//! filling, [`sync_all`] fdatasyncs descriptors.
//!
//! Invariants (the module's, [`super`]): a driver returns only once every
//! request it pushed has completed; it issues no request into memory a
//! request in flight uses, nor into bytes of a window not yet handed on.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use super::completions::{next_generation, reap, tag, untag, InFlight};
use super::{Completion, IoEngine, Op, OpKind};
use crate::progress::Progress;

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

#[derive(Clone, Copy)]
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

/// A gate on writes ([`drive_fed`]): file `i` starts at staging offset
/// `starts[i]` of memory whose ready prefix `progress` tells.
type Gate<'a> = (&'a [u64], &'a Progress);

/// [`drive`], with writes gated by a filler's progress when `gate` is given.
///
/// # Safety
/// As [`drive`], and with a gate as [`drive_fed`].
unsafe fn drive_gated(
    engine: &mut dyn IoEngine,
    kind: OpKind,
    files: &[FileIo],
    chunk_bytes: usize,
    mut on_bytes: impl FnMut(usize, &[u8]),
    gate: Option<Gate<'_>>,
) -> Result<(), DriveError> {
    assert!(kind != OpKind::Fdatasync);
    assert!(chunk_bytes > 0 && chunk_bytes <= u32::MAX as usize);
    for f in files {
        assert!(f.window_bytes == 0 || (kind == OpKind::Read && f.window_bytes % chunk_bytes as u64 == 0));
    }
    // SAFETY: this function's contract, passed on.
    let mut run = unsafe { Run::new(kind, files, chunk_bytes, engine.queue_depth().max(1), gate) };
    loop {
        run.issue(engine);
        run.submit(engine);
        // Let the caller work on what has arrived while the disk works on.
        run.deliver_arrived(&mut on_bytes);
        if run.in_flight.0 == 0 {
            if run.todo.is_empty() || run.first_err.is_some() {
                break;
            }
            continue; // delivery made room in a window
        }
        run.reap_some(engine);
    }
    run.finish()
}

/// What has arrived of one file in a driver call.
#[derive(Default)]
struct Arrived {
    /// Bytes transferred contiguously from the start.
    prefix: u64,
    /// How much of the prefix was handed to `on_bytes`.
    delivered: u64,
    /// Ranges transferred beyond the prefix.
    done: Vec<(u64, u64)>,
    /// A read that stopped at EOF: the file's real end.
    eof_at: Option<u64>,
}

impl Arrived {
    /// Counts `[from, to)` as transferred and extends the prefix over every
    /// range now contiguous with it.
    fn mark_done(&mut self, (from, to): (u64, u64)) {
        self.done.push((from, to));
        loop {
            let Some(i) = self.done.iter().position(|&(b, _)| b == self.prefix) else { return };
            self.prefix = self.done.swap_remove(i).1;
        }
    }
}

/// One driver call: the work list, the slots of requests in flight, and
/// per file what has arrived and was handed on.
struct Run<'a> {
    kind: OpKind,
    files: &'a [FileIo],
    gate: Option<Gate<'a>>,
    qd: usize,
    /// Chunks still to issue, in file order.
    todo: VecDeque<Pending>,
    /// `user_data`'s high half: this call's generation ([`tag`]).
    generation: u32,
    /// `user_data`'s low half indexes into it: the chunk of each request in flight.
    slots: Vec<Option<Pending>>,
    free: Vec<usize>,
    arrived: Vec<Arrived>,
    first_err: Option<DriveError>,
    /// Requests pushed and not reaped; a panic (of on_bytes, say) with any
    /// left aborts the process, as an engine that cannot reap does.
    in_flight: InFlight,
    comps: Vec<Completion>,
    /// The filler's ready prefix as last asked (gated writes only).
    ready: u64,
}

impl<'a> Run<'a> {
    /// Splits every file into chunks of at most `chunk_bytes`.
    ///
    /// # Safety
    /// `files` as [`drive`] requires (and with a gate as [`drive_fed`]), for
    /// as long as the Run lives: its methods push requests into that memory
    /// and hand out what arrived there.
    unsafe fn new(kind: OpKind, files: &'a [FileIo], chunk_bytes: usize, qd: usize, gate: Option<Gate<'a>>) -> Run<'a> {
        let mut todo = VecDeque::new();
        for (file_idx, f) in files.iter().enumerate() {
            let mut off = 0;
            while off < f.io_len {
                let len = (f.io_len - off).min(chunk_bytes as u64);
                todo.push_back(Pending { file_idx, offset: off, len });
                off += len;
            }
        }
        Run {
            kind,
            files,
            gate,
            qd,
            todo,
            generation: next_generation(),
            slots: (0..qd).map(|_| None).collect(),
            free: (0..qd).rev().collect(),
            arrived: files.iter().map(|_| Arrived::default()).collect(),
            first_err: None,
            in_flight: InFlight(0),
            comps: Vec::with_capacity(qd),
            ready: 0,
        }
    }

    /// Pushes chunks from the work list while a slot is free and the next
    /// one may go ([`Run::may_issue`]); a failed push stops issuing, its
    /// chunk first in line again.
    fn issue(&mut self, engine: &mut dyn IoEngine) {
        while self.first_err.is_none() && !self.free.is_empty() {
            let Some(&p) = self.todo.front() else { break };
            if !self.may_issue(&p) {
                break;
            }
            self.todo.pop_front();
            let a = &mut self.arrived[p.file_idx];
            if a.eof_at.is_some_and(|e| p.offset >= e) {
                // Past EOF: nothing to read, and it counts as done.
                a.mark_done((p.offset, p.offset + p.len));
                continue;
            }
            let slot = self.free.pop().expect("checked non-empty");
            let f = &self.files[p.file_idx];
            let op = Op {
                kind: self.kind,
                fd: f.fd,
                ptr: f.addr(p.offset),
                len: p.len as u32,
                offset: p.offset,
                user_data: tag(self.generation, slot),
            };
            // SAFETY: the range lies inside the caller's FileIo memory, valid
            // while the Run lives (Run::new's contract); no request in flight
            // uses it (each chunk is its own range, a window's place is reused
            // only once handed on: may_issue); the driver reaps every
            // completion before the Run goes (and aborts if it cannot).
            match unsafe { engine.push(op) } {
                Ok(()) => {
                    self.slots[slot] = Some(p);
                    self.in_flight.0 += 1;
                }
                Err(e) => {
                    self.free.push(slot);
                    self.todo.push_front(p);
                    self.first_err = Some(DriveError::Engine(e));
                }
            }
        }
    }

    /// Whether chunk `p` may be issued now: its place in a window has been
    /// handed on, and (gated) the filler has filled its bytes. A failed
    /// filler stops issuing like an I/O error.
    fn may_issue(&mut self, p: &Pending) -> bool {
        let f = &self.files[p.file_idx];
        if f.window_bytes > 0 && p.offset + p.len > self.arrived[p.file_idx].delivered + f.window_bytes {
            return false; // its place in the window is not consumed yet
        }
        let Some((starts, progress)) = self.gate else { return true };
        let need = starts[p.file_idx] + p.offset + p.len;
        if need > self.ready {
            // Wait for the filler only when the disk has nothing to do.
            match progress.ready(need, self.in_flight.0 == 0) {
                Ok(r) => self.ready = r,
                Err(why) => {
                    self.first_err = Some(DriveError::Source(why));
                    return false;
                }
            }
        }
        need <= self.ready // else not copied yet: reap a completion meanwhile
    }

    fn submit(&mut self, engine: &mut dyn IoEngine) {
        if self.in_flight.0 > 0 {
            if let Err(e) = engine.submit() {
                // Nothing new started; what was in flight must still be reaped.
                self.first_err.get_or_insert(DriveError::Engine(e));
            }
        }
    }

    /// Hands each file's bytes that became contiguous (up to `file_len`) to
    /// `on_bytes`, unless the call has failed.
    fn deliver_arrived(&mut self, on_bytes: &mut impl FnMut(usize, &[u8])) {
        if self.first_err.is_some() {
            return;
        }
        for (i, (f, a)) in self.files.iter().zip(&mut self.arrived).enumerate() {
            let upto = a.prefix.min(f.file_len);
            if upto > a.delivered {
                // SAFETY: the memory is valid while the Run lives (Run::new's
                // contract); [delivered, upto) lies in the prefix, so it was
                // transferred, and no request in flight targets it: those lie
                // in [prefix, delivered + window_bytes), other bytes of a window.
                unsafe { deliver(f, a.delivered, upto, |b| on_bytes(i, b)) };
                a.delivered = upto;
            }
        }
    }

    /// Waits for at least one completion and accounts for each; an engine
    /// that failed to return them is the call's error once they are in.
    fn reap_some(&mut self, engine: &mut dyn IoEngine) {
        let mut comps = std::mem::take(&mut self.comps);
        comps.clear();
        if let Some(e) = reap(engine, 1, &mut comps) {
            // Nothing new is issued; what is in flight is still reaped.
            self.first_err.get_or_insert(DriveError::Engine(e));
        }
        for c in comps.drain(..) {
            self.complete(c);
        }
        self.comps = comps;
    }

    /// Frees the slot of `c`'s request and counts what it transferred; a
    /// completion of no request of this call is ignored.
    fn complete(&mut self, c: Completion) {
        let Some(slot) = untag(self.generation, c.user_data).filter(|&s| s < self.qd && self.slots[s].is_some()) else {
            tracing::error!(
                user_data = c.user_data,
                result = c.result,
                "a completion of no request of this call: ignored"
            );
            return;
        };
        let p = self.slots[slot].take().expect("checked above");
        self.free.push(slot);
        self.in_flight.0 -= 1;
        match self.transferred(&p, c.result) {
            Ok(range) => self.arrived[p.file_idx].mark_done(range),
            Err(e) => {
                self.first_err.get_or_insert(e);
            }
        }
    }

    /// The range of chunk `p` that a completion with `result` counts as
    /// done: all of it, or up to EOF in a read's padded tail, or (a short
    /// transfer) the part done, the rest going first in line.
    fn transferred(&mut self, p: &Pending, result: i32) -> Result<(u64, u64), DriveError> {
        let f = &self.files[p.file_idx];
        if result < 0 {
            let what = if self.kind == OpKind::Write { "write" } else { "read" };
            return Err(DriveError::Io {
                what,
                file_idx: p.file_idx,
                offset_bytes: p.offset,
                source: io::Error::from_raw_os_error(-result),
            });
        }
        let n = result as u64;
        if n == p.len {
            Ok((p.offset, p.offset + n))
        } else if self.kind == OpKind::Read && p.offset + n >= f.file_len {
            // EOF inside this chunk: expected for the padded tail.
            self.arrived[p.file_idx].eof_at = Some(p.offset + n);
            Ok((p.offset, p.offset + p.len))
        } else if n == 0 {
            Err(if self.kind == OpKind::Write {
                DriveError::ShortWrite {
                    file_idx: p.file_idx,
                    offset_bytes: p.offset,
                    expected_bytes: p.len,
                    written_bytes: 0,
                }
            } else {
                DriveError::ShortRead { file_idx: p.file_idx, offset_bytes: p.offset, expected_bytes: f.file_len }
            })
        } else {
            // Short transfer: the done part counts, the rest goes first in line.
            self.todo.push_front(Pending { file_idx: p.file_idx, offset: p.offset + n, len: p.len - n });
            Ok((p.offset, p.offset + n))
        }
    }

    /// The call's outcome, once nothing is in flight: its first error, or a
    /// read that ended before a file's expected length.
    fn finish(mut self) -> Result<(), DriveError> {
        debug_assert_eq!(self.in_flight.0, 0);
        if let Some(e) = self.first_err.take() {
            return Err(e);
        }
        for (i, (f, a)) in self.files.iter().zip(&self.arrived).enumerate() {
            let end = a.eof_at.unwrap_or(f.io_len);
            if self.kind == OpKind::Read && end < f.file_len {
                return Err(DriveError::ShortRead { file_idx: i, offset_bytes: end, expected_bytes: f.file_len });
            }
            debug_assert_eq!(a.delivered, f.file_len.min(f.io_len));
        }
        Ok(())
    }
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
