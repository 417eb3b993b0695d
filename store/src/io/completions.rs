//! The bookkeeping every driver call shares: generation tags that keep one
//! call's completions apart from another's, reaping that asks a failing
//! engine again, and the guard that aborts rather than unwind with
//! requests in flight.

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};

use super::{Completion, IoEngine};
use crate::config;

/// Requests of a driver call in flight. Dropped with some left only by an
/// unwinding panic, which would free buffers the kernel still uses: abort.
pub(super) struct InFlight(pub(super) usize);

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
pub(super) fn next_generation() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// `user_data` of request `idx` of the call of `generation`.
pub(super) fn tag(generation: u32, idx: usize) -> u64 {
    debug_assert!(idx <= u32::MAX as usize);
    (u64::from(generation) << 32) | idx as u64
}

/// The request index in `user_data` if the call of `generation` tagged it.
pub(super) fn untag(generation: u32, user_data: u64) -> Option<usize> {
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
pub(super) fn reap(engine: &mut dyn IoEngine, min: usize, out: &mut Vec<Completion>) -> Option<io::Error> {
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
