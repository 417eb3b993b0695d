//! What belongs to the process, not to one client: the preemption flag
//! SIGTERM raises, and the default client preload mode connects at load.
//!
//! Invariant: the default client is set once, at load, and never freed
//! (`ckpt_close` refuses it; the exit handler only closes it): every pointer
//! `ckpt_default_client` returned stays valid for the process's life.

use std::ffi::c_int;
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;

use super::errors::{guard, set_last_error};
use super::types::ckpt_client;
use crate::error::Error;

/// 1 once SIGTERM arrived (the trainer should checkpoint and exit), else 0.
/// Only a handler installed by preload mode or ckpt_install_sigterm_handler
/// sets it.
#[no_mangle]
pub extern "C" fn ckpt_preempted() -> c_int {
    crate::sigterm::preempted() as c_int
}

/// Installs the SIGTERM handler that sets the preemption flag (preload mode
/// does this at load). The first SIGTERM only sets the flag (and calls a
/// previously installed handler function, if any); a second one gets the
/// previous disposition (by default: the process terminates). Idempotent.
#[no_mangle]
pub extern "C" fn ckpt_install_sigterm_handler() -> c_int {
    guard(|| {
        crate::sigterm::install_sigterm_handler()
            .map_err(|e| Error::InvalidArgument(format!("sigaction(SIGTERM) failed: {e}")))
    })
}

/// The client connected at load time in preload mode (CKPT_SIDECAR_PRELOAD=1),
/// or NULL, with the reason in ckpt_last_error() (not in preload mode, or the
/// connection failed). It lives as long as the process.
#[no_mangle]
pub extern "C" fn ckpt_default_client() -> *mut ckpt_client {
    catch_unwind(|| {
        let p = default_client_ptr();
        if p.is_null() {
            set_last_error(&default_client_error());
        }
        p
    })
    .unwrap_or(std::ptr::null_mut())
}

/// The default client (preload mode's connection), set once at load.
static DEFAULT_CLIENT: AtomicPtr<ckpt_client> = AtomicPtr::new(std::ptr::null_mut());
/// Why there is no default client, when preload mode tried and failed.
static DEFAULT_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// The default client, or NULL.
pub(crate) fn default_client_ptr() -> *mut ckpt_client {
    DEFAULT_CLIENT.load(Ordering::Acquire)
}

/// Sets the default client (preload mode, once, at load).
pub(crate) fn set_default_client(p: *mut ckpt_client) {
    DEFAULT_CLIENT.store(p, Ordering::Release);
}

/// Records why preload mode made no default client.
pub(crate) fn set_default_client_error(msg: String) {
    *DEFAULT_ERROR.lock().unwrap_or_else(|p| p.into_inner()) = Some(msg);
}

fn default_client_error() -> String {
    DEFAULT_ERROR
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_else(|| "no default client: preload mode did not run".to_string())
}

/// Closes client `p` without freeing it (the default client at exit:
/// pointers to it stay valid, calls on it fail with CKPT_E_CLOSED).
///
/// # Safety
/// `p` is NULL or a live client pointer.
pub(crate) unsafe fn close_client_in_place(p: *mut ckpt_client) {
    // SAFETY: `p` is NULL or a live client (the caller's contract).
    if let Some(c) = unsafe { p.as_ref() } {
        c.client.close();
    }
}
