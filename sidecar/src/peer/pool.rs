//! Pre-faulted buffers for whole files, kept for reuse: a replica received
//! and the copy of a part's files taken for sending live in them, and a
//! buffer let go (a replica evicted, a copy sent) waits here for the next
//! step's file instead of going back to the kernel. Fresh pages cost more
//! than the network (~0.8 s/GiB to fault on the VMs we run on, against
//! ~0.1 s/GiB to write pages already there; DESIGN.md, "Memory
//! discipline"), so a step's files land in the memory the step before
//! them used.
//!
//! Invariant: the buffers out and the spares together stay within the
//! pool's bound of bytes, except a buffer asked for when nothing spare
//! fits and the bound is already met (its user bounds what it asks for:
//! the replica budget, the bound of staged copies); spares are given up
//! first, largest first, to make room.

use std::sync::{Arc, Mutex, MutexGuard};

use ckpt_store::mem::AlignedBuf;

/// A spare is reused for a file of at least this share of its size (so a
/// small file does not pin a large buffer), in sixteenths.
const FIT_MIN_SIXTEENTHS: usize = 8;
/// A new buffer's room over the file it is for, in sixteenths: the next
/// step's file of the same tensors, a little longer (its header names
/// another step), still fits it.
const HEADROOM_SIXTEENTHS: usize = 1;

pub struct Pool {
    max_bytes: u64,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    spare: Vec<AlignedBuf>,
    spare_bytes: u64,
    out_bytes: u64,
}

/// `len` bytes of a pooled buffer; the buffer goes back to its pool when
/// this is dropped.
pub struct Pooled {
    buf: Option<AlignedBuf>,
    len: usize,
    pool: Arc<Pool>,
    /// Mapped for this file (no spare fitted it).
    pub fresh: bool,
}

impl Pool {
    pub fn new(max_bytes: u64) -> Arc<Pool> {
        Arc::new(Pool { max_bytes, inner: Mutex::new(Inner::default()) })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().expect("buffer pool lock")
    }

    /// A buffer of `len` bytes (its contents are whatever it held before:
    /// the caller writes every byte): the smallest spare that fits, else a
    /// new one, pre-faulted.
    pub fn take(self: &Arc<Self>, len: usize) -> std::io::Result<Pooled> {
        let mut g = self.lock();
        let best = (g.spare.iter().enumerate())
            .filter(|(_, b)| b.len() >= len && len * 16 >= b.len() * FIT_MIN_SIXTEENTHS)
            .min_by_key(|(_, b)| b.len())
            .map(|(i, _)| i);
        if let Some(i) = best {
            let buf = g.spare.swap_remove(i);
            g.spare_bytes -= buf.len() as u64;
            g.out_bytes += buf.len() as u64;
            return Ok(Pooled { buf: Some(buf), len, pool: self.clone(), fresh: false });
        }
        let want = len + len / 16 * HEADROOM_SIXTEENTHS;
        // Room for it: the largest spares go first.
        let mut freed = Vec::new();
        g.spare.sort_by_key(|b| b.len());
        while g.out_bytes + g.spare_bytes + want as u64 > self.max_bytes {
            let Some(b) = g.spare.pop() else { break };
            g.spare_bytes -= b.len() as u64;
            freed.push(b);
        }
        drop(g);
        // Unmapped and mapped outside the lock: both take time.
        drop(freed);
        let buf = AlignedBuf::new(want)?;
        self.lock().out_bytes += buf.len() as u64;
        Ok(Pooled { buf: Some(buf), len, pool: self.clone(), fresh: true })
    }

    fn give(&self, buf: AlignedBuf) {
        let mut g = self.lock();
        g.out_bytes -= buf.len() as u64;
        if g.out_bytes + g.spare_bytes + buf.len() as u64 <= self.max_bytes {
            g.spare_bytes += buf.len() as u64;
            g.spare.push(buf);
            return;
        }
        drop(g);
        drop(buf);
    }

    /// (bytes out, bytes spare).
    #[cfg(test)]
    fn figures(&self) -> (u64, u64) {
        let g = self.lock();
        (g.out_bytes, g.spare_bytes)
    }
}

impl Pooled {
    pub fn as_slice(&self) -> &[u8] {
        &self.buf.as_ref().expect("held until dropped").as_slice()[..self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.buf.as_mut().expect("held until dropped").as_mut_slice()[..len]
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn a_buffer_let_go_is_reused_for_the_next_file_that_fits_it() {
        let pool = Pool::new(64 << 20);
        let mut a = pool.take(8 * MIB).unwrap();
        a.as_mut_slice().fill(7);
        let addr = a.as_slice().as_ptr();
        drop(a);
        let (out, spare) = pool.figures();
        assert_eq!(out, 0);
        assert!(spare >= 8 * MIB as u64, "{spare}");
        // A file a little longer (within the headroom): the same memory, as it was left.
        let b = pool.take(8 * MIB + 4096).unwrap();
        assert_eq!(b.as_slice().as_ptr(), addr);
        assert_eq!(b.as_slice().len(), 8 * MIB + 4096);
        assert_eq!(b.as_slice()[0], 7);
        assert_eq!(pool.figures().1, 0);
        // A much smaller file does not pin a large spare.
        drop(b);
        let c = pool.take(MIB).unwrap();
        assert_ne!(c.as_slice().as_ptr(), addr);
        assert!(pool.figures().1 > 0, "the large spare stays spare");
    }

    #[test]
    fn spares_give_way_to_a_new_buffer_and_the_bound_holds() {
        let pool = Pool::new(24 << 20);
        let a = pool.take(10 * MIB).unwrap();
        let b = pool.take(MIB).unwrap();
        drop(a);
        drop(b);
        let (_, spare) = pool.figures();
        assert!(spare > 11 * MIB as u64, "{spare}");
        // 20 MiB fits neither spare; with them both kept it would exceed the
        // bound: the larger goes, the smaller stays.
        let c = pool.take(20 * MIB).unwrap();
        let (out, spare) = pool.figures();
        assert!(out >= 20 * MIB as u64 && out + spare <= 24 << 20, "out {out} spare {spare}");
        assert!(spare > 0 && spare < 2 * MIB as u64, "{spare}");
        // Let go beyond the bound: unmapped, not kept.
        let d = pool.take(3 * MIB).unwrap();
        drop(c);
        let (out, spare) = pool.figures();
        assert!(out + spare <= 24 << 20, "out {out} spare {spare}");
        drop(d);
        let (out, spare) = pool.figures();
        assert_eq!(out, 0);
        assert!(spare <= 24 << 20);
    }
}
