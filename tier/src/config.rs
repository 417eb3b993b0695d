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
/// A restore's request pattern (`Target::fetch_file`, `fetch_ranges`):
/// one GET per file, its body streamed into the load's memory as it
/// arrives, the files of a step fetched `parallel` at once. Measured
/// (`bench drain`, 512 MiB, docs/performance.md), against moto, which
/// copies the whole object for every ranged GET: 8 files by whole GETs
/// restored at 3.0 x the plain client's sequential download; 2 files by
/// ranged GETs of a part (4 in flight each) at 0.18 x. So only a step of
/// one file (`RANGED_GET_FILES_MAX`) of at least `RANGED_GET_MIN_PARTS`
/// parts is split into ranged GETs of a part each (`parallel` in flight):
/// one GET is one connection's bandwidth on S3, which serves ranges
/// cheaply (not measured here: no real S3 in reach).
pub const RANGED_GET_FILES_MAX: usize = 1;
pub const RANGED_GET_MIN_PARTS: u64 = 4;
/// A file:// target's file is read into place in pieces of this size.
pub const LOCAL_FETCH_CHUNK_BYTES: usize = 4 << 20;

/// Concurrency is bounded: each slot holds one part in memory.
pub const MAX_PARALLEL: usize = 256;

/// Transient errors (5xx, timeouts, dropped connections) are retried by
/// object_store with exponential backoff, at most this many times ...
/// Few: a request that keeps failing fails within about a second
/// (100 + 200 ms of backoff, plus the attempts), so the caller (the
/// sidecar's drain, with a backoff of its own) shows the target down at
/// once rather than after object_store's default ten retries (seconds to
/// minutes of `up` during an outage). Two still ride out a lone dropped
/// connection or 503 without redoing the step's upload.
pub const RETRY_MAX: usize = 2;
/// ... and for at most this long per request.
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(10);
pub const RETRY_BACKOFF_INIT: Duration = Duration::from_millis(100);
pub const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(1);
pub const RETRY_BACKOFF_BASE: f64 = 2.0;
/// A connection that is not made within this long fails the attempt (an
/// endpoint that drops packets, not one that refuses): object_store's
/// default is 5 s, per attempt. The request's own timeout stays
/// object_store's (30 s): a part of [`DEFAULT_PART_SIZE_BYTES`] on a slow
/// link needs it.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The start-up request retries little: a wrong endpoint is one clear error
/// at open, not minutes of backoff.
pub const OPEN_RETRY_MAX: usize = 2;
pub const OPEN_RETRY_TIMEOUT: Duration = Duration::from_secs(15);

/// file:// uploads write with O_DIRECT in whole blocks of this size (the
/// last part padded, then the file truncated).
pub const DIRECT_BLOCK_BYTES: usize = 4096;

/// Worker threads of the tier's own tokio runtime (network I/O; reads and
/// checksums run on its blocking pool).
pub const RUNTIME_WORKER_THREADS: usize = 2;

const _: () = assert!(RETRY_MAX <= 3 && OPEN_RETRY_MAX <= RETRY_MAX);
const _: () = assert!(CONNECT_TIMEOUT.as_secs() <= RETRY_TIMEOUT.as_secs());
const _: () = assert!(DEFAULT_PART_SIZE_BYTES >= MIN_PART_SIZE_BYTES);
const _: () = assert!(DEFAULT_PARALLEL <= MAX_PARALLEL);
const _: () = assert!(RANGED_GET_FILES_MAX >= 1 && RANGED_GET_MIN_PARTS >= 2);
