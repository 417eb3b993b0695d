//! Panics injected on purpose, for the tests of what a panic does to the
//! daemon (the binary aborts: its trainers see EOF, the next start recovers
//! the directory). `CKPT_SIDECAR_TEST_PANIC=session` panics the session
//! thread that receives a Save; `=commit` panics the committer when it
//! takes a checkpoint. Unset (always, outside tests), nothing happens: the
//! variable is read once.

use std::sync::OnceLock;

pub const TEST_PANIC_ENV: &str = "CKPT_SIDECAR_TEST_PANIC";

/// Where a panic can be injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    Session,
    Commit,
}

fn injected() -> Option<At> {
    static AT: OnceLock<Option<At>> = OnceLock::new();
    *AT.get_or_init(|| match std::env::var(TEST_PANIC_ENV).ok().as_deref() {
        Some("session") => Some(At::Session),
        Some("commit") => Some(At::Commit),
        _ => None,
    })
}

/// Panics if the tests asked for a panic `at` this place.
pub fn maybe_panic(at: At) {
    if injected() == Some(at) {
        panic!("{TEST_PANIC_ENV}: a panic injected in the {at:?} thread");
    }
}
