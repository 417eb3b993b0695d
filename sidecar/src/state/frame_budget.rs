//! The room sessions share for frames they received only in part
//! ([`config::PARTIAL_FRAMES_BYTES_MAX`] and the rule that splits it): a
//! session reading a large frame takes each piece's bytes from here before
//! it reads the piece, and gives them back when the frame is dropped.
//!
//! Invariant: the bytes taken and not given back are at most
//! [`config::LARGE_FRAMES_BYTES_MAX`] in all and
//! [`config::LARGE_FRAMES_PER_PROCESS_BYTES_MAX`] per client process, so
//! however many clients send large frames and stop halfway, the daemon
//! holds at most the limit of them (the rest waits in the kernel's socket
//! buffers, which the kernel bounds).

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::config;

struct Held {
    total: u64,
    by_pid: HashMap<u32, u64>,
}

pub struct FrameBudget {
    held: Mutex<Held>,
    freed: Condvar,
}

/// The daemon's one budget (made at first use).
pub fn budget() -> &'static FrameBudget {
    static B: OnceLock<FrameBudget> = OnceLock::new();
    B.get_or_init(|| FrameBudget { held: Mutex::new(Held { total: 0, by_pid: HashMap::new() }), freed: Condvar::new() })
}

/// Why no room was taken.
#[derive(Debug, PartialEq)]
pub enum NoRoom {
    /// None came free before the deadline.
    TimedOut,
    /// `give_up` said to stop waiting (the client left, the daemon aborts).
    GaveUp,
}

/// Bytes taken from the budget by one frame, given back on drop.
pub struct Lease {
    pid: u32,
    bytes: u64,
}

impl Lease {
    pub fn new(pid: u32) -> Lease {
        Lease { pid, bytes: 0 }
    }

    /// Takes `bytes` more, waiting until `deadline` for room; `give_up` is
    /// asked between waits.
    pub fn grow(&mut self, bytes: u64, deadline: Instant, give_up: &dyn Fn() -> bool) -> Result<(), NoRoom> {
        let b = budget();
        let mut h = b.held.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let mine = h.by_pid.get(&self.pid).copied().unwrap_or(0);
            if h.total + bytes <= config::LARGE_FRAMES_BYTES_MAX
                && mine + bytes <= config::LARGE_FRAMES_PER_PROCESS_BYTES_MAX
            {
                h.total += bytes;
                *h.by_pid.entry(self.pid).or_default() += bytes;
                self.bytes += bytes;
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(NoRoom::TimedOut);
            }
            if give_up() {
                return Err(NoRoom::GaveUp);
            }
            let wait = (deadline - now).min(Duration::from_millis(config::STAGING_WAIT_POLL_MS));
            h = b.freed.wait_timeout(h, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        let b = budget();
        let mut h = b.held.lock().unwrap_or_else(|p| p.into_inner());
        h.total -= self.bytes;
        if let Some(m) = h.by_pid.get_mut(&self.pid) {
            *m -= self.bytes;
            if *m == 0 {
                h.by_pid.remove(&self.pid);
            }
        }
        drop(h);
        b.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_holds_at_most_its_share_and_a_dropped_lease_gives_its_bytes_back() {
        let soon = || Instant::now() + Duration::from_millis(20);
        let share = config::LARGE_FRAMES_PER_PROCESS_BYTES_MAX;
        let mut a = Lease::new(u32::MAX - 1);
        a.grow(share, soon(), &|| false).unwrap();
        let mut b = Lease::new(u32::MAX - 1);
        assert_eq!(b.grow(1, soon(), &|| false), Err(NoRoom::TimedOut), "the share is full");
        assert_eq!(b.grow(1, Instant::now() + Duration::from_secs(60), &|| true), Err(NoRoom::GaveUp));
        let mut other = Lease::new(u32::MAX - 2);
        other.grow(1, soon(), &|| false).expect("another process has room");
        drop(a);
        b.grow(share - 1, soon(), &|| false).expect("room came back");
    }
}
