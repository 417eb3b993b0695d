//! Fork safety for connections: a table of every live connection's
//! descriptors, closed in a forked child by a `pthread_atfork` handler, so
//! the sidecar still sees EOF when the parent dies while children (data
//! loader workers) live on.
//!
//! The table is lock-free: the child of a multi-threaded process may only do
//! async-signal-safe things before exec. A connection that finds no free
//! slot is simply not closed on fork.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Once;

/// Descriptors the table holds (two per connection: the caller's and the
/// reply thread's).
const FORK_FDS_MAX: usize = 128;
static FORK_FDS: [AtomicI32; FORK_FDS_MAX] = [const { AtomicI32::new(-1) }; FORK_FDS_MAX];

/// Adds `fd` to the table (installing the fork handler the first time).
pub(super) fn fork_fd_register(fd: i32) {
    static ATFORK: Once = Once::new();
    ATFORK.call_once(|| {
        // SAFETY: registers a plain extern "C" fn that only calls close(2).
        unsafe { libc::pthread_atfork(None, None, Some(close_fds_in_child)) };
    });
    for slot in &FORK_FDS {
        if slot.compare_exchange(-1, fd, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            return;
        }
    }
}

/// Takes `fd` out of the table; call it while `fd` is still open, so a
/// child never closes whatever descriptor reuses the number.
pub(super) fn fork_fd_unregister(fd: i32) {
    for slot in &FORK_FDS {
        if slot.compare_exchange(fd, -1, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            return;
        }
    }
}

/// The fork handler, run in the child: closes every descriptor in the table.
extern "C" fn close_fds_in_child() {
    for slot in &FORK_FDS {
        let fd = slot.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: `fd` is this (child) process's copy of a connection
            // descriptor; nothing in the child uses it (calls fail with Forked).
            unsafe { libc::close(fd) };
        }
    }
}
