//! The io_uring engine: one ring per target directory, requests inside
//! registered memory go as READ_FIXED/WRITE_FIXED (no per-request page
//! pinning), others as plain READ/WRITE; fdatasync goes through the ring too.

use std::io;
use std::sync::Arc;

use io_uring::{opcode, register::Probe, types, IoUring};

use super::{Completion, IoEngine, Op, OpKind};
use crate::config::{ENGINE_RETRY_PAUSE_MS, SLAB_BYTES, URING_ENTER_RETRIES_MAX};
use crate::mem::RawBuf;

pub struct UringEngine {
    ring: IoUring,
    queue_depth: usize,
    /// Registered slabs: (start address, end address) by buffer index.
    slabs: Vec<(usize, usize)>,
    /// Keeps registered memory alive while the ring may use it.
    registered: Option<Arc<RawBuf>>,
    /// Pushed but not yet accepted by the kernel.
    unsubmitted: usize,
}

impl UringEngine {
    pub fn new(queue_depth: u32) -> io::Result<UringEngine> {
        let ring = IoUring::new(queue_depth)?;
        Ok(UringEngine { ring, queue_depth: queue_depth as usize, slabs: Vec::new(), registered: None, unsubmitted: 0 })
    }

    /// Can this process make a ring that does what we need?
    pub fn probe(queue_depth: u32) -> io::Result<()> {
        let ring = IoUring::new(queue_depth)?;
        let mut p = Probe::new();
        ring.submitter().register_probe(&mut p)?;
        for (code, name) in [
            (opcode::WriteFixed::CODE, "WRITE_FIXED"),
            (opcode::ReadFixed::CODE, "READ_FIXED"),
            (opcode::Write::CODE, "WRITE"),
            (opcode::Read::CODE, "READ"),
            (opcode::Fsync::CODE, "FSYNC"),
        ] {
            if !p.is_supported(code) {
                return Err(io::Error::new(io::ErrorKind::Unsupported, format!("kernel lacks io_uring opcode {name}")));
            }
        }
        Ok(())
    }

    fn fixed_index(&self, ptr: usize, len: usize) -> Option<u16> {
        self.slabs.iter().position(|&(b, e)| ptr >= b && ptr + len <= e).map(|i| i as u16)
    }
}

impl IoEngine for UringEngine {
    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    unsafe fn push(&mut self, op: Op) -> io::Result<()> {
        let fd = types::Fd(op.fd);
        let entry = match op.kind {
            OpKind::Write => match self.fixed_index(op.ptr as usize, op.len as usize) {
                Some(idx) => opcode::WriteFixed::new(fd, op.ptr, op.len, idx).offset(op.offset).build(),
                None => opcode::Write::new(fd, op.ptr, op.len).offset(op.offset).build(),
            },
            OpKind::Read => match self.fixed_index(op.ptr as usize, op.len as usize) {
                Some(idx) => opcode::ReadFixed::new(fd, op.ptr, op.len, idx).offset(op.offset).build(),
                None => opcode::Read::new(fd, op.ptr, op.len).offset(op.offset).build(),
            },
            OpKind::Fdatasync => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build(),
        }
        .user_data(op.user_data);
        if self.ring.submission().is_full() {
            self.submit()?;
        }
        // SAFETY: the caller guarantees the buffer outlives the completion
        // (IoEngine::push contract); on Err the entry was not queued.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::new(io::ErrorKind::WouldBlock, "submission queue full"))?;
        self.unsubmitted += 1;
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        while self.unsubmitted > 0 {
            match self.ring.submit() {
                Ok(n) => self.unsubmitted -= n.min(self.unsubmitted),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN | libc::ENOMEM)) => {
                    // The completion queue is full, or the kernel is short of
                    // memory for now: wait() submits them again (and reaps
                    // first). Not an error: they are still queued.
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        let mut got = 0;
        let mut short_of_memory = 0;
        loop {
            for cqe in self.ring.completion() {
                out.push(Completion { user_data: cqe.user_data(), result: cqe.result() });
                got += 1;
            }
            if got >= min {
                return Ok(());
            }
            match self.ring.submit_and_wait(min - got) {
                Ok(n) => self.unsubmitted -= n.min(self.unsubmitted),
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY)) => {}
                // io_uring_enter under memory pressure: it passes.
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM))
                        && short_of_memory < URING_ENTER_RETRIES_MAX =>
                {
                    short_of_memory += 1;
                    std::thread::sleep(std::time::Duration::from_millis(ENGINE_RETRY_PAUSE_MS));
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn register(&mut self, buf: Arc<RawBuf>) -> io::Result<()> {
        if self.registered.is_some() {
            self.ring.submitter().unregister_buffers()?;
            self.slabs.clear();
            self.registered = None;
        }
        let base = buf.as_ptr() as usize;
        let mut iovecs = Vec::new();
        let mut off = 0;
        while off < buf.len() {
            let len = (buf.len() - off).min(SLAB_BYTES);
            iovecs.push(libc::iovec { iov_base: (base + off) as *mut libc::c_void, iov_len: len });
            self.slabs.push((base + off, base + off + len));
            off += len;
        }
        // SAFETY: the iovecs cover `buf`, which self.registered keeps alive
        // until it is unregistered (above) or the ring is dropped (the ring
        // field is dropped before `registered`, see field order).
        let r = unsafe { self.ring.submitter().register_buffers(&iovecs) };
        if let Err(e) = r {
            self.slabs.clear();
            return Err(e);
        }
        self.registered = Some(buf);
        Ok(())
    }
}
