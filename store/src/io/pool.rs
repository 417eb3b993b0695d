//! The thread-pool engine: the fallback when io_uring is refused. A few named
//! worker threads take requests from a bounded channel and call
//! pwrite/pread/fdatasync; completions come back on another channel.

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver, Sender};

use super::{Completion, IoEngine, Op, OpKind};
use crate::mem::RawBuf;

/// `Op` carries raw pointers; this wrapper moves it to a worker.
struct SendOp(Op);
// SAFETY: the pointer is only dereferenced by the one worker that receives
// the op, while the IoEngine::push contract keeps the memory valid and
// otherwise untouched until the completion is returned.
unsafe impl Send for SendOp {}

pub struct PoolEngine {
    queue_depth: usize,
    tx: Option<Sender<SendOp>>,
    rx_done: Receiver<Completion>,
    workers: Vec<JoinHandle<()>>,
}

impl PoolEngine {
    pub fn new(n_threads: usize, queue_depth: usize) -> PoolEngine {
        let (tx, rx) = bounded::<SendOp>(queue_depth);
        let (tx_done, rx_done) = bounded::<Completion>(queue_depth);
        let workers = (0..n_threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                let tx_done = tx_done.clone();
                std::thread::Builder::new()
                    .name(format!("ckpt-io-pool-{i}"))
                    .spawn(move || {
                        for SendOp(op) in rx {
                            let result = run(op);
                            if tx_done.send(Completion { user_data: op.user_data, result }).is_err() {
                                return;
                            }
                        }
                    })
                    .expect("spawning an I/O worker thread")
            })
            .collect();
        PoolEngine { queue_depth, tx: Some(tx), rx_done, workers }
    }
}

fn run(op: Op) -> i32 {
    // SAFETY: the IoEngine::push contract makes ptr..ptr+len valid (and, for
    // reads, exclusively ours) until this completion is delivered.
    let r = unsafe {
        match op.kind {
            OpKind::Write => libc::pwrite(op.fd, op.ptr.cast(), op.len as usize, op.offset as libc::off_t),
            OpKind::Read => libc::pread(op.fd, op.ptr.cast(), op.len as usize, op.offset as libc::off_t),
            OpKind::Fdatasync => libc::fdatasync(op.fd) as isize,
        }
    };
    if r < 0 {
        -io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
    } else {
        r as i32
    }
}

impl IoEngine for PoolEngine {
    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    unsafe fn push(&mut self, op: Op) -> io::Result<()> {
        let tx = self.tx.as_ref().expect("sender lives until drop");
        tx.send(SendOp(op)).map_err(|_| io::Error::other("I/O worker threads are gone"))
    }

    fn submit(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        for _ in 0..min {
            out.push(self.rx_done.recv().map_err(|_| io::Error::other("I/O worker threads are gone"))?);
        }
        out.extend(self.rx_done.try_iter());
        Ok(())
    }

    fn register(&mut self, _buf: Arc<RawBuf>) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for PoolEngine {
    fn drop(&mut self) {
        self.tx = None;
        // Workers may be blocked sending a completion nobody will read.
        while self.rx_done.try_recv().is_ok() {}
        for w in self.workers.drain(..) {
            while !w.is_finished() {
                while self.rx_done.try_recv().is_ok() {}
                std::thread::yield_now();
            }
            let _ = w.join();
        }
    }
}
