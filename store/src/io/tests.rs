use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use super::completions::{next_generation, tag};
use super::*;
use crate::config::{self, DIRECT_ALIGN_BYTES};
use crate::mem::{AlignedBuf, RawBuf};

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
        let files =
            [FileIo { fd: f.as_raw_fd(), ptr: src.as_mut_ptr(), io_len: 1 << 20, file_len: 1 << 20, window_bytes: 0 }];
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
        assert!(self.queued.is_empty(), "{what}: the driver returned with {} requests in flight", self.queued.len());
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
            let result = if r < 0 { -io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO) } else { r as i32 };
            out.push(Completion { user_data: op.user_data, result });
        }
        Ok(())
    }

    fn register(&mut self, _buf: Arc<RawBuf>) -> io::Result<()> {
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
            let fds: Vec<RawFd> = std::iter::repeat_n(f.as_raw_fd(), N_CHUNKS).collect();
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
