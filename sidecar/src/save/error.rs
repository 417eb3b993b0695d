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
    /// Committed, it would be older than `latest` and retention's first
    /// victim: durable, then gone (a run restarted from step 0 in a used
    /// folder). Refused before anything is copied.
    #[error("step {step} is below the newest committed step {newest} in {}: it would not be latest and retention would delete it at once; to go back to an earlier step, roll back first (ckpt-sidecar rollback {} --to STEP, or rollback(STEP) in the shim), or save into another folder, or save steps above {newest}", dir.display(), dir.display())]
    BelowNewest { step: u64, newest: u64, dir: std::path::PathBuf },
}

impl SaveError {
    pub fn code(&self) -> ErrorCode {
        match self {
            SaveError::BadRequest(_) | SaveError::BelowNewest { .. } => ErrorCode::BadRequest,
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
