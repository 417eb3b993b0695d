//! The save stage's refusals: why a Save (checked, planned, copied) is
//! answered Failed, each variant with the wire code it is answered with
//! ([`SaveError::code`]).

use ckpt_wire::ErrorCode;

use crate::state::refusal::Refusal;

/// Why a Save is refused or aborted.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    BadRegion(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("the sidecar is shutting down; no new saves")]
    ShuttingDown,
    #[error("aborted: {0}")]
    Aborted(&'static str),
    #[error("step {step}: {dir}")]
    ReadOnly { step: u64, dir: ckpt_store::read_only::ReadOnlyDir },
}

impl SaveError {
    pub fn code(&self) -> ErrorCode {
        match self {
            SaveError::BadRequest(_) => ErrorCode::BadRequest,
            SaveError::BadRegion(_) => ErrorCode::BadRegion,
            SaveError::TooLarge(_) => ErrorCode::TooLarge,
            SaveError::ShuttingDown | SaveError::Aborted(_) => ErrorCode::ShuttingDown,
            SaveError::ReadOnly { .. } => ErrorCode::Io,
        }
    }
}

impl From<SaveError> for Refusal {
    fn from(e: SaveError) -> Refusal {
        Refusal::new(e.code(), e.to_string())
    }
}
