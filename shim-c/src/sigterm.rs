//! The preemption flag: a SIGTERM handler that turns the scheduler's
//! warning into `ckpt_preempted()` (installed by preload mode, or by
//! `ckpt_install_sigterm_handler` for a trainer that links or dlopens
//! libckpt, such as the Python package).
//!
//! The handler is async-signal-safe (atomics, `sigaction`, `raise`,
//! and the previous handler). The first SIGTERM sets the preemption flag that
//! `ckpt_preempted()` reports, then calls the previously installed handler
//! function, if there was one. A second SIGTERM restores the previous
//! disposition and re-raises it, so with the default disposition the process
//! terminates: an unmodified program that never polls the flag can still be
//! stopped with two SIGTERMs (no SIGKILL needed). A program that installs its
//! own SIGTERM handler later replaces ours (the flag then stays 0).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

static PREEMPTED: AtomicBool = AtomicBool::new(false);
/// 0: not installed, 1: being installed, 2: installed.
static HANDLER_STATE: AtomicU8 = AtomicU8::new(0);
/// SIGTERM count seen by our handler.
static TERM_SEEN: AtomicBool = AtomicBool::new(false);
/// The disposition before ours; written once, before our handler is installed.
static mut PREVIOUS: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::uninit();

pub fn preempted() -> bool {
    PREEMPTED.load(Ordering::SeqCst)
}

extern "C" fn on_sigterm(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    PREEMPTED.store(true, Ordering::SeqCst);
    // SAFETY: PREVIOUS was fully written before this handler was installed
    // (HANDLER_STATE orders it) and is never written again.
    let prev = unsafe { (*std::ptr::addr_of!(PREVIOUS)).assume_init_ref() };
    let second = TERM_SEEN.swap(true, Ordering::SeqCst);
    let h = prev.sa_sigaction;
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        if second && h == libc::SIG_DFL {
            // SAFETY: sigaction and raise are async-signal-safe; `prev` is valid.
            unsafe {
                libc::sigaction(sig, prev, std::ptr::null_mut());
                libc::raise(sig);
            }
        }
        return;
    }
    // SAFETY: `h` is the handler function the program installed before us,
    // called with the signature its flags declare.
    unsafe {
        if prev.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = std::mem::transmute(h);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(h);
            f(sig);
        }
    }
}

/// Installs the SIGTERM handler (see the module doc). Idempotent.
pub fn install_sigterm_handler() -> io::Result<()> {
    if HANDLER_STATE.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        return Ok(());
    }
    // SAFETY: we are the only writer of PREVIOUS (HANDLER_STATE 0 → 1 above),
    // and the handler that reads it is installed only after it is written.
    unsafe {
        let mut prev: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGTERM, std::ptr::null(), &mut prev) != 0 {
            HANDLER_STATE.store(0, Ordering::SeqCst);
            return Err(io::Error::last_os_error());
        }
        (*std::ptr::addr_of_mut!(PREVIOUS)).write(prev);
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigterm as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        libc::sigemptyset(&mut act.sa_mask);
        if libc::sigaction(libc::SIGTERM, &act, std::ptr::null_mut()) != 0 {
            HANDLER_STATE.store(0, Ordering::SeqCst);
            return Err(io::Error::last_os_error());
        }
    }
    HANDLER_STATE.store(2, Ordering::SeqCst);
    Ok(())
}
