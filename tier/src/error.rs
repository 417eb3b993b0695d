//! What can go wrong on a tier. Every message names the target's URL (as
//! given, credentials never part of it) and the object concerned. The
//! object store's errors are boxed: they are large, and every call of the
//! tier returns a `Result` with this error.

use std::path::PathBuf;

use ckpt_store::source::SourceError;

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The URL itself is unusable (scheme, bucket, path).
    #[error("drain target {url}: {reason}")]
    BadUrl { url: String, reason: String },

    /// The start-up request failed: wrong credentials, no such bucket,
    /// endpoint unreachable, directory missing.
    #[error("drain target {url}: cannot open it ({what}): {source}")]
    Open {
        url: String,
        what: String,
        #[source]
        source: Box<object_store::Error>,
    },

    /// A request on one object failed (after the bounded retries).
    #[error("drain target {url}: {op} {object}: {source}")]
    Store {
        url: String,
        op: &'static str,
        object: String,
        #[source]
        source: Box<object_store::Error>,
    },

    /// The object (or step) is not on the target.
    #[error("drain target {url}: {object} not found")]
    NotFound { url: String, object: String },

    /// A local file to upload could not be read.
    #[error("drain target {url}: reading {path} for {object}: {source}")]
    LocalIo {
        url: String,
        object: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The bytes read for the upload are not those the local index
    /// recorded (the file changed or was damaged): the upload was aborted
    /// and nothing was committed.
    #[error("drain target {url}: {path} does not match its index ({detail}); {object} not uploaded")]
    LocalChanged { url: String, object: String, path: PathBuf, detail: String },

    /// The index given to commit a step is not a valid index of that step.
    #[error("drain target {url}: index of step {step}: {reason}")]
    BadIndex { url: String, step: u64, reason: String },

    /// A step cannot be committed: a file its index names is not on the
    /// target as the index says (the upload of some node is missing).
    #[error("drain target {url}: step {step} not committed: {object} {detail}")]
    Incomplete { url: String, step: u64, object: String, detail: String },

    /// A ranged read asked for bytes past the end of the object.
    #[error("drain target {url}: {object}: read of {len} bytes at {offset} is past its end ({size} bytes)")]
    PastEnd { url: String, object: String, offset: u64, len: u64, size: u64 },

    /// An object read whole is not of the length its index says.
    #[error("drain target {url}: {object} is {size} bytes (at least) where the index says {expected}")]
    WrongLength { url: String, object: String, expected: u64, size: u64 },

    /// A name or step that cannot be an object of the layout.
    #[error("drain target {url}: bad object name {object:?}: {reason}")]
    BadName { url: String, object: String, reason: String },

    /// A file:// target's own file-system work (sync, tree removal).
    #[error("drain target {url}: {op} {path}: {source}")]
    TargetIo {
        url: String,
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The runtime's worker task failed (a bug or a panic in a task).
    #[error("drain target {url}: internal task failed: {reason}")]
    Task { url: String, reason: String },

    /// A file:// target's folder is missing (or not a folder): never
    /// created, as an unmounted shared file system looks just like it.
    #[error("drain target {url}: no such directory: {} (it is never created: an unmounted file system looks the same; mount it, or create the folder)", path.display())]
    NoSuchDir { url: String, path: PathBuf },
}

/// A tier's failure as the engine's checks of a remote step see it
/// (`ckpt_store::source`): the failures they tell apart by name, every
/// other one as it is. The messages stay the tier's, word for word.
impl From<TierError> for SourceError {
    fn from(e: TierError) -> SourceError {
        match e {
            TierError::NotFound { url, object } => SourceError::NotFound { at: format!("drain target {url}"), object },
            TierError::PastEnd { url, object, offset, len, size } => SourceError::PastEnd {
                at: format!("drain target {url}"),
                object,
                offset,
                len_bytes: len,
                size_bytes: size,
            },
            TierError::WrongLength { url, object, expected, size } => SourceError::WrongLength {
                at: format!("drain target {url}"),
                object,
                expected_bytes: expected,
                size_bytes: size,
            },
            other => SourceError::Failed(Box::new(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_error_from_the_tier_says_what_the_tier_said() {
        let url = "s3://b/p".to_string();
        let object = "step-000000000003/x".to_string();
        for e in [
            TierError::NotFound { url: url.clone(), object: object.clone() },
            TierError::PastEnd { url: url.clone(), object: object.clone(), offset: 5, len: 9, size: 10 },
            TierError::WrongLength { url: url.clone(), object: object.clone(), expected: 4, size: 7 },
            TierError::Task { url: url.clone(), reason: "gone".into() },
        ] {
            let said = e.to_string();
            assert_eq!(SourceError::from(e).to_string(), said);
        }
    }
}
