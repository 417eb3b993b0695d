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
//! The SIGTERM handler itself is `sigterm.rs`'s; the default client's pointer
//! is kept by `ffi/process.rs` (`ckpt_default_client`).

use crate::client::Client;
use crate::ffi::{
    ckpt_client, close_client_in_place, default_client_ptr, set_default_client, set_default_client_error,
};
use crate::sigterm::install_sigterm_handler;

/// The environment variable that turns preload mode on ("1").
pub const PRELOAD_ENV: &str = "CKPT_SIDECAR_PRELOAD";

extern "C" fn close_default_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let p = default_client_ptr();
        if !p.is_null() {
            // SAFETY: `p` came from ckpt_client::new_boxed and is never freed.
            unsafe { close_client_in_place(p) };
        }
    });
}

fn record_error(msg: String) {
    eprintln!("libckpt: preload: {msg}");
    set_default_client_error(msg);
}

extern "C" fn on_load() {
    let _ = std::panic::catch_unwind(|| {
        if std::env::var_os(PRELOAD_ENV).is_none_or(|v| v != "1") {
            set_default_client_error(format!("no default client: {PRELOAD_ENV}=1 was not set when libckpt was loaded"));
            return;
        }
        if let Err(e) = install_sigterm_handler() {
            record_error(format!("cannot install the SIGTERM handler: {e}"));
        }
        match Client::connect(None) {
            Ok(client) => {
                set_default_client(ckpt_client::new_boxed(client));
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
