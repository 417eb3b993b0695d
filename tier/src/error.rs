//! What can go wrong on a tier. Every message names the target's URL (as
//! given, credentials never part of it) and the object concerned.

use std::path::PathBuf;

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
        source: object_store::Error,
    },

    /// A request on one object failed (after the bounded retries).
    #[error("drain target {url}: {op} {object}: {source}")]
    Store {
        url: String,
        op: &'static str,
        object: String,
        #[source]
        source: object_store::Error,
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
}
