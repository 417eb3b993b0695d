//! The SIGBUS guard of host regions: a client that shrinks its segment
//! (ftruncate) under a copy or a load must not kill the sidecar. A thread
//! that reads or writes a region names it ([`arm`]) for the span of the
//! access; a fault inside that region maps zero pages over the rest of it
//! and marks it truncated, so the access runs on and the save or load is
//! refused after. Any other SIGBUS goes to the handler that was there
//! before. The handler makes only async-signal-safe calls.

use std::cell::Cell;
use std::io;
use std::sync::atomic::{compiler_fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

/// The region a thread is reading, as its SIGBUS handler needs it.
#[derive(Clone, Copy)]
pub(super) struct Armed {
    pub(super) start: usize,
    pub(super) len: usize,
    /// A writable mapping ([`Writable`](super::Writable)): the pages mapped over a fault are
    /// writable too, so the store that faulted runs again and lands in
    /// them (read-only ones would turn it into a SIGSEGV: death).
    pub(super) writable: bool,
    pub(super) truncated: *const AtomicBool,
}

/// Runs `f` with this thread's SIGBUS handler armed for `armed`, and puts
/// back what was armed before when `f` returns or unwinds (a drop guard: a
/// panic inside must not leave the handler pointing at a region that may be
/// unmapped next).
pub(super) fn arm<R>(armed: Armed, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Armed>);
    impl Drop for Restore {
        fn drop(&mut self) {
            compiler_fence(Ordering::SeqCst);
            ARMED.with(|a| a.set(self.0));
        }
    }
    let _restore = Restore(ARMED.with(|a| a.replace(Some(armed))));
    // The handler runs on this thread, between any two instructions:
    // keep the compiler from moving the accesses out of the armed span.
    compiler_fence(Ordering::SeqCst);
    f()
}

thread_local! {
    /// Const-initialised and without a destructor, so reading it is a plain
    /// TLS load: safe inside a signal handler.
    static ARMED: Cell<Option<Armed>> = const { Cell::new(None) };
}

/// The SIGBUS action found at install time, run for faults not ours.
static mut PREVIOUS: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::uninit();
static PAGE_BYTES: AtomicUsize = AtomicUsize::new(4096);

pub(super) fn install_fault_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            PAGE_BYTES.store(page as usize, Ordering::Relaxed);
        }
        // SAFETY: a zeroed sigaction is valid; the handler has the
        // SA_SIGINFO signature; PREVIOUS is written here only, once, before
        // the handler that reads it is installed (same sigaction call fills
        // it first).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            let previous = std::ptr::addr_of_mut!(PREVIOUS).cast::<libc::sigaction>();
            libc::sigaction(libc::SIGBUS, std::ptr::null(), previous);
            if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
                tracing::warn!("cannot install the SIGBUS handler: {}; a client that truncates its shm during a copy will kill the sidecar", io::Error::last_os_error());
            }
        }
    });
}

/// SIGBUS: if this thread is reading a region and the fault lies in it, map
/// zero pages from the faulting page to the region's end (the faulting load
/// then re-runs and reads zeros; in a writable mapping they are writable,
/// and the faulting store lands in them, lost) and mark the region
/// truncated. Otherwise
/// put the previous action back and return: the fault repeats and is that
/// action's (Rust's guard-page check, or death by SIGBUS).
/// Only async-signal-safe calls: a TLS load, mmap, sigaction, an atomic store.
extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    if let Some(a) = ARMED.with(|a| a.get()) {
        if addr >= a.start && addr - a.start < a.len {
            let page = PAGE_BYTES.load(Ordering::Relaxed);
            let from = addr & !(page - 1);
            let end = (a.start + a.len).div_ceil(page) * page;
            let prot = if a.writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
            // SAFETY: [from, end) lies inside the region's own mapping (mmap
            // rounds it up to whole pages; the read-only one, or the writable
            // one of a Writable), which the armed thread holds alive;
            // replacing it with private zero pages changes only what our
            // accesses of it see and where our stores land (nowhere the
            // client sees). Checked against MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    from as *mut libc::c_void,
                    end - from,
                    prot,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                // SAFETY: `truncated` points into the ShmMemory that `read`
                // borrows for as long as ARMED names it.
                unsafe { (*a.truncated).store(true, Ordering::Release) };
                return;
            }
        }
    }
    // SAFETY: PREVIOUS was filled before this handler was installed.
    unsafe {
        libc::sigaction(libc::SIGBUS, std::ptr::addr_of!(PREVIOUS).cast::<libc::sigaction>(), std::ptr::null_mut())
    };
}

#[cfg(test)]
mod tests {
    use super::super::test_region;
    use super::*;

    #[test]
    fn the_armed_region_is_put_back_when_the_armed_closure_panics() {
        let (r, _name, _fd) = test_region(4096);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.read(|| panic!("inside"))));
        assert!(caught.is_err());
        assert!(ARMED.with(|a| a.get()).is_none(), "the handler still names the region after the panic");
    }
}
