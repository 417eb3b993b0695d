//! What the library says of itself: its version and the wire protocol
//! version it speaks.

use std::ffi::c_char;

/// The library's version, e.g. "libckpt 0.1.0 (protocol 1)". Never NULL; static.
#[no_mangle]
pub extern "C" fn ckpt_version() -> *const c_char {
    concat!("libckpt ", env!("CARGO_PKG_VERSION"), " (protocol 1)\0").as_ptr().cast()
}

/// The wire protocol version this library speaks.
#[no_mangle]
pub extern "C" fn ckpt_protocol_version() -> u32 {
    ckpt_wire::PROTOCOL_VERSION
}
