//! The C ABI (`include/ckpt.h` is generated from these files by cbindgen;
//! the test `tests/header.rs` fails when the checked-in header drifts).
//!
//! Conventions:
//! - every function returns an `int` status: `CKPT_OK` (0) or a negative
//!   `CKPT_E_*`; results come back through out-parameters;
//! - after a failure, `ckpt_last_error()` gives this thread's message;
//! - no panic crosses the ABI: every body runs under `catch_unwind`, and a
//!   caught panic is `CKPT_E_PANIC` with the panic's message;
//! - a `ckpt_client*` may be used from several threads at once, except that
//!   `ckpt_close` must be the last call on it.
//!
//! One file per area, in the header's order: `codes` (status codes and
//! enumeration values), `types` (the handle and the descriptors), `version`,
//! `errors` (the last error, `guard`), `connection`, `regions` (shared
//! memory), `save`, `load`, `catalog` (list, status, rollback), `process`
//! (preemption flag, default client), `cuda`, and `pykey` (a helper of the
//! Python package's save key); `args` turns the caller's pointers into Rust
//! values for all of them.

#![allow(non_camel_case_types)]

mod args;
mod catalog;
mod codes;
mod connection;
mod cuda;
mod errors;
mod load;
mod process;
mod pykey;
mod regions;
mod save;
mod types;
mod version;

pub use catalog::*;
pub use codes::*;
pub use connection::*;
pub use cuda::*;
pub use errors::*;
pub use load::*;
pub use process::*;
pub use pykey::*;
pub use regions::*;
pub use save::*;
pub use types::*;
pub use version::*;
