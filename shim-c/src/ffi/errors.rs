//! Errors across the ABI: the thread's last error message, and [`guard`],
//! which runs every `extern "C"` body under `catch_unwind`, turning an
//! [`Error`] into its status code plus that message, and a panic into
//! `CKPT_E_PANIC`.
//!
//! Invariant: no panic crosses the ABI; a failing call always leaves its
//! reason in `ckpt_last_error()` on the calling thread.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::codes::{status_of, CKPT_E_PANIC, CKPT_OK};
use crate::error::Error;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Makes `msg` this thread's last error (a NUL in it is written as `\0`).
pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).expect("NULs replaced");
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs an ABI body: errors become status codes plus the thread's last
/// error, panics become CKPT_E_PANIC.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Error>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CKPT_OK,
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            status_of(&e)
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("internal error in libckpt (please report): {what}"));
            CKPT_E_PANIC
        }
    }
}

/// A bad argument, saying which and why.
pub(super) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// The message of the last failed call on this thread ("" if none). Never
/// NULL; valid until the next failing ckpt_ call on this thread.
#[no_mangle]
pub extern "C" fn ckpt_last_error() -> *const c_char {
    catch_unwind(|| LAST_ERROR.with(|e| e.borrow().as_ptr())).unwrap_or(c"".as_ptr())
}
