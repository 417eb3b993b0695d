//! One shape for the daemon's refusals: a request it will not (or cannot)
//! serve is answered with a wire [`ErrorCode`] and a reason a person can
//! read. Every stage's own error converts into it (`From`, beside each
//! error), and the session answers with it: `Error` for a request, `Failed`
//! for a save that was accepted as one.
//!
//! Invariant: the code and the reason are sent as they are here; a stage's
//! conversion keeps the code its error always had on the wire.

use ckpt_wire::{ErrorCode, Reply};

/// Why a request is refused, as the client is told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct Refusal {
    pub code: ErrorCode,
    pub reason: String,
}

impl Refusal {
    pub fn new(code: ErrorCode, reason: impl Into<String>) -> Refusal {
        Refusal { code, reason: reason.into() }
    }

    /// The answer to request `id`: an `Error`.
    pub fn error(self, id: u64) -> Reply {
        Reply::Error { id, code: self.code, message: self.reason }
    }

    /// The answer to save `id` of `step` (0: a file): a `Failed`.
    pub fn failed(self, id: u64, step: u64) -> Reply {
        Reply::Failed { id, step, code: self.code, reason: self.reason }
    }
}
