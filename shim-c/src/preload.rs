//! Preload mode: what libckpt does when it is loaded into a process that did
//! not ask for it (LD_PRELOAD, typically set by `ckpt-sidecar launch --preload`).
//!
//! The decision: the constructor acts **only when `CKPT_SIDECAR_PRELOAD=1`**
//! is in the environment, however the library was loaded (preloaded, linked
//! or dlopen'ed). Without it, loading libckpt changes nothing: a trainer that
//! links it and calls `ckpt_connect` itself does not get a second connection
//! behind its back. With it, the constructor
//! 1. installs the SIGTERM handler ([`install_sigterm_handler`]), and
//! 2. connects to the sidecar from the environment into the default client
//!    (`ckpt_default_client()`), closed again by an `atexit` handler.
//!
//! It never aborts the host process: a failed connection is recorded (and
//! one line goes to stderr), `ckpt_default_client()` then returns NULL with
//! that reason. Every process that inherits `CKPT_SIDECAR_PRELOAD=1` (e.g.
//! torchrun's workers, a shell's children) connects: one idle session each.
//!
//! SIGTERM: the handler is async-signal-safe (atomics, `sigaction`, `raise`,
//! and the previous handler). The first SIGTERM sets the preemption flag that
//! `ckpt_preempted()` reports, then calls the previously installed handler
//! function, if there was one. A second SIGTERM restores the previous
//! disposition and re-raises it, so with the default disposition the process
//! terminates: an unmodified program that never polls the flag can still be
//! stopped with two SIGTERMs (no SIGKILL needed). A program that installs its
//! own SIGTERM handler later replaces ours (the flag then stays 0).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, Ordering};
use std::sync::Mutex;

use crate::client::Client;
use crate::ffi::{ckpt_client, close_client_in_place, new_boxed_client};

/// The environment variable that turns preload mode on ("1").
pub const PRELOAD_ENV: &str = "CKPT_SIDECAR_PRELOAD";

static DEFAULT_CLIENT: AtomicPtr<ckpt_client> = AtomicPtr::new(std::ptr::null_mut());
static DEFAULT_ERROR: Mutex<Option<String>> = Mutex::new(None);

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

pub fn default_client_ptr() -> *mut ckpt_client {
    DEFAULT_CLIENT.load(Ordering::Acquire)
}

pub fn default_client_error() -> String {
    DEFAULT_ERROR
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_else(|| format!("no default client: {PRELOAD_ENV}=1 was not set when libckpt was loaded"))
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

extern "C" fn close_default_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let p = DEFAULT_CLIENT.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: `p` came from new_boxed_client and is never freed.
            unsafe { close_client_in_place(p) };
        }
    });
}

fn record_error(msg: String) {
    eprintln!("libckpt: preload: {msg}");
    *DEFAULT_ERROR.lock().unwrap_or_else(|p| p.into_inner()) = Some(msg);
}

extern "C" fn on_load() {
    let _ = std::panic::catch_unwind(|| {
        if std::env::var_os(PRELOAD_ENV).is_none_or(|v| v != "1") {
            return;
        }
        if let Err(e) = install_sigterm_handler() {
            record_error(format!("cannot install the SIGTERM handler: {e}"));
        }
        match Client::connect(None) {
            Ok(client) => {
                DEFAULT_CLIENT.store(new_boxed_client(client), Ordering::Release);
                // SAFETY: registering a plain extern "C" fn with atexit.
                unsafe { libc::atexit(close_default_at_exit) };
            }
            Err(e) => record_error(format!("not connected, ckpt_default_client() will be NULL: {e}")),
        }
    });
}

/// The constructor: glibc runs `.init_array` entries when the library is
/// loaded (preload, link, dlopen), before `main` for the first two.
#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;
