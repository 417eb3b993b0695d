//! The tier's limits and defaults, in one place.

use std::time::Duration;

/// Concurrent part uploads / ranged gets of one call, by default.
pub const DEFAULT_PARALLEL: usize = 8;
/// Multipart part size, by default; also the read window of a ranged read.
pub const DEFAULT_PART_SIZE_BYTES: usize = 16 << 20;
/// S3 refuses parts under 5 MiB (all but the last): smaller settings are raised.
pub const MIN_PART_SIZE_BYTES: usize = 5 << 20;
/// S3 allows at most 10 000 parts: larger files get larger parts.
pub const MAX_PARTS: u64 = 10_000;
/// Concurrency is bounded: each slot holds one part in memory.
pub const MAX_PARALLEL: usize = 256;

/// Transient errors (5xx, timeouts, dropped connections) are retried by
/// object_store with exponential backoff, at most this many times ...
pub const RETRY_MAX: usize = 10;
/// ... and for at most this long per request.
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(180);
pub const RETRY_BACKOFF_INIT: Duration = Duration::from_millis(100);
pub const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(15);
pub const RETRY_BACKOFF_BASE: f64 = 2.0;

/// The start-up request retries little: a wrong endpoint is one clear error
/// at open, not minutes of backoff.
pub const OPEN_RETRY_MAX: usize = 2;
pub const OPEN_RETRY_TIMEOUT: Duration = Duration::from_secs(15);

/// Worker threads of the tier's own tokio runtime (network I/O; reads and
/// checksums run on its blocking pool).
pub const RUNTIME_WORKER_THREADS: usize = 2;

const _: () = assert!(DEFAULT_PART_SIZE_BYTES >= MIN_PART_SIZE_BYTES);
const _: () = assert!(DEFAULT_PARALLEL <= MAX_PARALLEL);
