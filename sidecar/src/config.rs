//! The daemon's limits (server, sessions, staging, committer), named once
//! and related to each other and to the storage engine's at compile time.
//! The engine's own limits are `ckpt_store::config`'s, re-exported here so
//! that one `config::` names every limit the daemon uses.

pub use ckpt_store::config::*;

/// Default staging budget: a quarter of physical memory, at most this.
/// Staging is allocated once at start and holds every checkpoint image in
/// flight plus the newest durable one (for RAM restores).
pub const STAGING_BYTES_DEFAULT_MAX: u64 = 8 << 30;
/// The default budget is physical memory divided by this.
pub const STAGING_RAM_DIVISOR: u64 = 4;
/// Smallest staging budget accepted (one block more than a tiny checkpoint).
pub const STAGING_BYTES_MIN: u64 = 1 << 20;
/// Staging is handed out in multiples of this, at offsets that are multiples
/// of it, so every image is an O_DIRECT-aligned buffer.
pub const STAGING_ALIGN_BYTES: usize = DIRECT_ALIGN_BYTES;
/// How often a save waiting for staging (or a session copying) checks that
/// its client is still there and the daemon is not aborting.
pub const STAGING_WAIT_POLL_MS: u64 = 50;

/// Largest frame either side accepts (the wire crate's limit, repeated here
/// so it is related to the others).
pub const FRAME_BYTES_MAX: u32 = ckpt_wire::FRAME_BYTES_MAX;
/// Longest socket path: a Unix socket address holds 108 bytes of path,
/// the terminating NUL included.
pub const SOCKET_PATH_BYTES_MAX: usize = 107;
/// Largest first frame (Hello) read from a peer not yet checked.
pub const HELLO_BYTES_MAX: u32 = 64 << 10;
/// A peer that connects and says nothing for this long is dropped.
pub const HELLO_TIMEOUT_MS: u64 = 5_000;
/// A command-line tool (status, rollback) waits this long for a sidecar's
/// Welcome, and status for its report: what does not answer is no sidecar,
/// or a stuck one.
pub const TOOL_ANSWER_TIMEOUT_MS: u64 = 10_000;
/// A reply the client does not take within this long ends its session
/// (a client that never reads cannot stall the committer).
pub const SEND_TIMEOUT_MS: u64 = 10_000;
/// Concurrent sessions (clients).
pub const SESSIONS_MAX: usize = 256;
/// Sessions one client process (its SO_PEERCRED pid) may hold: a fair
/// share of [`SESSIONS_MAX`], so a process that leaks clients (forked
/// data-loader workers, a loop) cannot lock the others out.
pub const SESSIONS_PER_PROCESS_MAX: usize = 64;
const _: () = assert!(SESSIONS_PER_PROCESS_MAX * 4 <= SESSIONS_MAX, "at least four processes get their share");
/// How often the sessions are looked at for a client process that is gone
/// (or whose pid another process took since): those are closed, even while
/// a child the client forked keeps the socket open. Also the interval of
/// the housekeeping thread (the refusal log's summaries).
pub const SESSION_REAP_INTERVAL_MS: u64 = 1_000;
/// Read-only tool connections (`status`, which says Hello as
/// `ckpt-sidecar status`) served at once. They are no sessions: never
/// counted against [`SESSIONS_MAX`], limited to Status and List, closed
/// after [`TOOL_ANSWER_TIMEOUT_MS`] without a request.
pub const TOOL_CONNECTIONS_MAX: usize = 16;
/// Of those, one process may hold.
pub const TOOL_CONNECTIONS_PER_PROCESS_MAX: usize = 4;
const _: () = assert!(TOOL_CONNECTIONS_PER_PROCESS_MAX < TOOL_CONNECTIONS_MAX);

/// Bytes that all sessions together may hold in frames they received only
/// in part: the one limit on what clients can make the daemon buffer.
/// Frames carry requests (a tensor's bytes go through shared memory into
/// staging), so this is a small fraction of the staging. The rule that
/// splits it: every session may hold one frame of up to
/// [`SMALL_FRAME_BYTES_MAX`] at any time (that share, [`SESSIONS_MAX`]
/// times over, set aside: a trainer's Save never waits for it); larger
/// frames are read in [`FRAME_CHUNK_BYTES`] pieces, each taken from the
/// rest ([`LARGE_FRAMES_BYTES_MAX`]) before it is read, of which one process
/// may hold [`LARGE_FRAMES_PER_PROCESS_BYTES_MAX`]. A frame that finds no
/// room waits (its bytes stay in the kernel's socket buffer).
pub const PARTIAL_FRAMES_BYTES_MAX: u64 = 256 << 20;
/// See [`PARTIAL_FRAMES_BYTES_MAX`].
pub const SMALL_FRAME_BYTES_MAX: u32 = 256 << 10;
/// See [`PARTIAL_FRAMES_BYTES_MAX`].
pub const FRAME_CHUNK_BYTES: u32 = 1 << 20;
/// See [`PARTIAL_FRAMES_BYTES_MAX`].
pub const LARGE_FRAMES_BYTES_MAX: u64 = PARTIAL_FRAMES_BYTES_MAX - SESSIONS_MAX as u64 * SMALL_FRAME_BYTES_MAX as u64;
/// See [`PARTIAL_FRAMES_BYTES_MAX`]: half of the large frames' room, so
/// one process's stalled frames leave the other half to the others.
pub const LARGE_FRAMES_PER_PROCESS_BYTES_MAX: u64 = LARGE_FRAMES_BYTES_MAX / 2;
const _: () = assert!(PARTIAL_FRAMES_BYTES_MAX <= STAGING_BYTES_DEFAULT_MAX / 32, "a small fraction of the staging");
const _: () = assert!(SESSIONS_MAX as u64 * SMALL_FRAME_BYTES_MAX as u64 <= PARTIAL_FRAMES_BYTES_MAX / 2);
const _: () = assert!(LARGE_FRAMES_PER_PROCESS_BYTES_MAX >= FRAME_BYTES_MAX as u64, "any one frame can be received");
const _: () = assert!(FRAME_CHUNK_BYTES >= SMALL_FRAME_BYTES_MAX);
/// A frame whose body stops arriving for this long (no byte read), or that
/// waits this long for room under [`PARTIAL_FRAMES_BYTES_MAX`], ends its
/// session: its bytes are dropped, said once in the log.
pub const FRAME_STALL_TIMEOUT_MS: u64 = 10_000;

/// Refusals and warnings about one client process (a bad frame, a refused
/// handshake) are logged at most this many per interval of
/// [`LOG_SUMMARY_INTERVAL_MS`], and all of them together at most
/// [`LOG_REFUSALS_PER_INTERVAL_MAX`]; the rest are counted and said at the
/// interval's end in one line per process ("N more refusals from pid P in
/// the last 10 s: <the last reason>"), for at most
/// [`LOG_SUMMARY_PIDS_MAX`] processes (the others in one line more).
pub const LOG_REFUSALS_PER_PROCESS_MAX: u32 = 3;
pub const LOG_REFUSALS_PER_INTERVAL_MAX: u32 = 20;
pub const LOG_SUMMARY_INTERVAL_MS: u64 = 10_000;
pub const LOG_SUMMARY_PIDS_MAX: usize = 8;
const _: () = assert!(LOG_REFUSALS_PER_PROCESS_MAX <= LOG_REFUSALS_PER_INTERVAL_MAX);
const _: () = assert!(SESSION_REAP_INTERVAL_MS <= LOG_SUMMARY_INTERVAL_MS);
/// Regions one session may register.
pub const REGIONS_PER_SESSION_MAX: usize = 4096;
/// Interprocess CUDA events a session keeps open (a trainer records one
/// event per save again and again; more distinct ones clear the cache).
pub const CUDA_EVENTS_PER_SESSION_MAX: usize = 64;
/// How long opening a trainer's interprocess CUDA event may take (on a
/// thread of its own, watched: an import was seen blocking on a busy GPU)
/// before the save that needs it is refused; the open is left to finish on
/// its thread, never holding the session.
pub const CUDA_EVENT_OPEN_TIMEOUT_MS: u64 = 30_000;
/// How often the wait for that open checks the client and the deadline.
pub const CUDA_EVENT_OPEN_POLL_MS: u64 = 20;
const _: () = assert!(CUDA_EVENT_OPEN_POLL_MS < CUDA_EVENT_OPEN_TIMEOUT_MS);
/// File descriptors one read of a session's socket may carry (SCM_RIGHTS:
/// one per RegisterCudaVmmRegion; a read may span a few such frames).
pub const FDS_PER_READ_MAX: usize = 8;
/// Descriptors a session may have received and not yet matched to a
/// RegisterCudaVmmRegion (more closes the session).
pub const PASSED_FDS_MAX: usize = 64;
const _: () = assert!(FDS_PER_READ_MAX <= PASSED_FDS_MAX);
/// Longest shm_open name, leading '/' included (NAME_MAX).
pub const SHM_NAME_BYTES_MAX: usize = 255;
/// Tensors in one save or load.
pub const TENSORS_PER_REQUEST_MAX: usize = 1 << 20;
/// Blobs in one save.
pub const BLOBS_PER_SAVE_MAX: usize = 4096;
/// Save plans a session keeps for saves of the same tensors again
/// (`save_plan`): a trainer alternating a few states (the Python shim keeps
/// eight prepared requests, two save regions) finds its plan.
pub const SAVE_PLANS_KEPT: usize = 8;
/// Descriptors in all the plans one session keeps (about 300 bytes each
/// with their layout: at most ~80 MB a session, for a state of 100k tensors
/// and a few small ones); a save of more tensors is planned every time.
pub const SAVE_PLAN_TENSORS_MAX: usize = 1 << 18;
/// Checkpoints copied and waiting for the committer; a full queue makes the
/// next save wait (its staging is already held, so this bounds nothing
/// else). Saves waiting for staging are bounded by the staging budget.
pub const COMMIT_QUEUE_MAX: usize = 16;
/// Threads that copy tensors into staging (the snapshot stage), the
/// session's own thread included.
pub const COPY_THREADS: usize = 2;
/// A tensor is copied in pieces of at most this, so both copy threads share
/// even a single large tensor. Small, because the helper thread runs in the
/// SCHED_IDLE class: when every core is busy it may wait long for CPU, and
/// the release waits for the piece it holds (~0.1 ms of work at 1 MiB).
pub const COPY_PIECE_BYTES: usize = 1 << 20;
/// Copy then checksum this much at a time, while it is still in cache.
pub const COPY_BLOCK_BYTES: usize = 256 << 10;
/// A lazily released save's copy checksums the very values it loads and
/// stores (`regions::shm`), in three lanes of this many bytes side by side
/// (halved for the rest of a tensor shorter than three).
pub const COPY_CRC_LANE_BYTES: usize = 8 << 10;
/// Without SSE4.2 it copies through a bounce buffer of this size on the
/// copying thread's stack, checksummed there.
pub const COPY_BOUNCE_BYTES: usize = 16 << 10;
/// Largest single device-to-host copy a CUDA region's batch queues
/// (adjacent pieces merged up to this).
pub const DEVICE_COPY_BYTES_MAX: usize = 64 << 20;
/// A pipelined save with device regions copies them in windows of about
/// this many bytes (each waited for on its own), so the disk writes the
/// early windows while later ones are still copied from the device. The
/// default; [`DEVICE_WINDOW_ENV`] (a size: "64KiB", "1GiB") sets another,
/// read once per process ([`device_window_bytes`]). Windows end at copy
/// runs (about [`COPY_PIECE_BYTES`]), so a window is never smaller than one.
pub const DEVICE_WINDOW_BYTES_DEFAULT: usize = 256 << 20;
pub const DEVICE_WINDOW_ENV: &str = "CKPT_SIDECAR_DEVICE_WINDOW";
/// Smallest window [`DEVICE_WINDOW_ENV`] may ask for.
pub const DEVICE_WINDOW_BYTES_MIN: usize = 4 << 10;

/// The device copy window: [`DEVICE_WINDOW_ENV`] if set and valid (a bad
/// value is said once, in one warning line, and the default used), else
/// [`DEVICE_WINDOW_BYTES_DEFAULT`].
pub fn device_window_bytes() -> usize {
    static WINDOW: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *WINDOW.get_or_init(|| {
        let Some(text) = std::env::var_os(DEVICE_WINDOW_ENV) else { return DEVICE_WINDOW_BYTES_DEFAULT };
        let text = text.to_string_lossy();
        match ckpt_store::units::parse_size(&text).map_err(|e| e.to_string()).and_then(|n| {
            usize::try_from(n).ok().filter(|&n| n >= DEVICE_WINDOW_BYTES_MIN).ok_or_else(|| format!("below the smallest window, {DEVICE_WINDOW_BYTES_MIN} bytes"))
        }) {
            Ok(n) => n,
            Err(why) => {
                tracing::warn!("{DEVICE_WINDOW_ENV}={text:?} ignored ({why}); device copies use windows of {DEVICE_WINDOW_BYTES_DEFAULT} bytes");
                DEVICE_WINDOW_BYTES_DEFAULT
            }
        }
    })
}
/// A pipelined save whose image is at least this large goes to the
/// committer before its copy starts, so the disk writes while it copies;
/// a smaller one goes right after its copy (and Released): its copy is
/// shorter than the committer's start (temp folder, files, reserve),
/// which would only take a core from the copy the trainer waits for.
pub const FED_EARLY_BYTES_MIN: u64 = 16 << 20;
/// Writes into a client region on load go in requests of at most this.
pub const LOAD_PWRITE_BYTES_MAX: usize = 64 << 20;

const _: () = assert!(STAGING_BYTES_MIN <= STAGING_BYTES_DEFAULT_MAX);
const _: () = assert!(STAGING_BYTES_MIN % STAGING_ALIGN_BYTES as u64 == 0);
const _: () = assert!(STAGING_ALIGN_BYTES % DIRECT_ALIGN_BYTES == 0);
const _: () = assert!(HELLO_BYTES_MAX < FRAME_BYTES_MAX);
const _: () =
    assert!((BLOB_BYTES_MAX as u64) >= FRAME_BYTES_MAX as u64, "a blob that fits a frame fits the blob limit");
const _: () = assert!(COPY_THREADS >= 1);
const _: () = assert!(COPY_PIECE_BYTES % COPY_BLOCK_BYTES == 0);
const _: () = assert!(COPY_BOUNCE_BYTES <= 256 << 10); // on a thread's stack
const _: () = assert!(COPY_CRC_LANE_BYTES % 8 == 0);
const _: () = assert!(DEVICE_WINDOW_BYTES_DEFAULT >= DEVICE_COPY_BYTES_MAX);
const _: () = assert!(LOAD_PWRITE_BYTES_MAX <= (isize::MAX as usize));
const _: () = assert!(SHM_NAME_BYTES_MAX <= 255);
const _: () = assert!(COMMIT_QUEUE_MAX >= 1);

/// A multi-rank checkpoint whose every rank's part has not reached the
/// coordinator this long after its first part is given up (never
/// committed); `CKPT_SIDECAR_PART_TIMEOUT_S` (seconds) overrides it.
pub const PART_TIMEOUT_DEFAULT_S: u64 = 300;
pub const PART_TIMEOUT_ENV: &str = "CKPT_SIDECAR_PART_TIMEOUT_S";
/// The largest part timeout the environment may ask for (a week).
pub const PART_TIMEOUT_MAX_S: u64 = 7 * 24 * 3600;
const _: () = assert!(PART_TIMEOUT_DEFAULT_S <= PART_TIMEOUT_MAX_S);
/// The committer looks at incomplete groups at least this often; a step
/// waiting for other nodes in the shared directory, at least this often
/// while nothing changes there.
pub const PART_TICK_MS: u64 = 200;
const _: () = assert!(PART_TICK_MS < PART_TIMEOUT_DEFAULT_S * 1000);
/// A step waiting for other nodes is looked at this soon after something
/// changed (a part written here, a new marker seen), the wait doubling per
/// look that finds nothing new up to `PART_TICK_MS`: a wait of T costs at
/// most log2(PART_TICK_MS / PART_TICK_MIN_MS) + 1 + T / PART_TICK_MS looks
/// (docs/performance.md, "Several nodes: the commit's cost").
pub const PART_TICK_MIN_MS: u64 = 2;
const _: () = assert!(PART_TICK_MIN_MS > 0 && PART_TICK_MIN_MS < PART_TICK_MS);
/// A sidecar waiting for another node's coordinator looks again this soon
/// after a look that found the step's temp folder changed (markers coming
/// in): markers arriving over D cost it at most D / PART_TICK_BUSY_MS looks
/// more, and it sees the commit about this soon after the last marker.
pub const PART_TICK_BUSY_MS: u64 = 10;
const _: () = assert!(PART_TICK_MIN_MS <= PART_TICK_BUSY_MS && PART_TICK_BUSY_MS < PART_TICK_MS);

/// `inspect` without a step reads the newest checkpoint; in a directory a
/// live sidecar serves with --keep, that one may be deleted between picking
/// and reading it. The newest is picked again at most this many times.
pub const RESOLVE_TRIES_MAX: u32 = 8;

/// `verify URL` (a drain target) streams each file through a window of at
/// most this many bytes, filled by parallel ranged GETs of one part each.
pub const REMOTE_VERIFY_WINDOW_BYTES: usize = 64 << 20;

/// `--metrics`: the request head read from a scraper (bytes), and how long
/// its read (all of the head) or the response's write may take, so a stuck
/// client holds its connection's thread no longer.
pub const METRICS_REQUEST_BYTES_MAX: usize = 8 << 10;
pub const METRICS_IO_TIMEOUT_MS: u64 = 2_000;
/// Metrics connections served at once (a thread each); one more waits for
/// a slot, which each connection frees within [`METRICS_IO_TIMEOUT_MS`]
/// for its request's read (the whole head, not each read) and as much for
/// the answer's write.
pub const METRICS_CONNECTIONS_MAX: usize = 64;
/// Buckets of the metrics' seconds histograms: 1 ms doubling, so the last
/// bound is 2^(N-1) ms (about 4.4 minutes for 19).
pub const METRICS_BUCKETS_N: u16 = 19;
const _: () = assert!(METRICS_BUCKETS_N >= 2 && METRICS_BUCKETS_N <= 30);

/// The drain (`--drain URL`, `crate::drain`): how often it looks for new
/// committed steps when nothing woke it, and its retry backoff while the
/// target fails (doubling from the minimum to the maximum).
pub const DRAIN_POLL_MS: u64 = 1_000;
pub const DRAIN_BACKOFF_MIN_MS: u64 = 200;
pub const DRAIN_BACKOFF_MAX_MS: u64 = 10_000;
const _: () = assert!(DRAIN_BACKOFF_MIN_MS <= DRAIN_BACKOFF_MAX_MS);
/// Clients waiting for a step to be replicated, at once (all sessions).
pub const DRAIN_WAITERS_MAX: usize = 4096;
/// Skipped steps `status` lists (the newest).
pub const DRAIN_SKIPPED_SHOWN_MAX: usize = 64;
/// Name prefix of the temporary folder in the primary directory into which
/// older sidecars copied a remote step before loading it (removed at start;
/// a remote step is now streamed into the load's memory, `remote_step`).
pub const HYDRATE_PREFIX: &str = ".ckpt-fetch-";

/// Damage records `status` keeps (the newest; `crate::state::damage`): a
/// step found damaged again by the same finder, for the same file, updates
/// its record instead of adding one.
pub const DAMAGE_RECORDS_MAX: usize = 64;

/// The background scrub (`serve --scrub-interval`, `crate::scrub`): the
/// most bytes per second it reads (the sidecar's own saves and loads come
/// first), and the shortest interval accepted (a pass starts at most this
/// often; tests and the benchmark use it).
pub const SCRUB_BYTES_PER_S_MAX: u64 = 256 << 20;
pub const SCRUB_INTERVAL_MIN_MS: u64 = 100;
/// While a pass waits between files to keep to the bandwidth, it looks at
/// the daemon's exit this often.
pub const SCRUB_WAKE_MS: u64 = 200;
const _: () = assert!(SCRUB_WAKE_MS >= 1 && SCRUB_BYTES_PER_S_MAX >= 1 << 20);

/// Peers (`--peers`, `crate::peer`): the RAM a sidecar lends to other
/// nodes' replicas unless `--peer-budget` says otherwise, the newest steps
/// of each peer kept (`--peer-keep`) and the replicas wanted of each of
/// this node's steps (`--peer-replicas`).
pub const PEER_BUDGET_BYTES_DEFAULT: u64 = 16 << 30;
pub const PEER_KEEP_DEFAULT: usize = 2;
pub const PEER_REPLICAS_DEFAULT: u32 = 1;
/// Connections one remote host may hold open before their handshake (a
/// doorbell burst from several nodes of one host fits), one
/// authenticated node after it (its replication, fetches and doorbells:
/// several nodes on one host each count apart), and all of them together:
/// one more is closed at once. Per node: a doorbell line, a replication
/// and a load per rank of an 8-rank node fit; the total allows a
/// coordinator a doorbell line from each of about a thousand nodes.
pub const PEER_CONNECTIONS_PER_HOST_MAX: usize = 32;
pub const PEER_CONNECTIONS_PER_NODE_MAX: usize = 16;
pub const PEER_CONNECTIONS_MAX: usize = 1024;
const _: () = assert!(PEER_CONNECTIONS_PER_HOST_MAX <= PEER_CONNECTIONS_MAX);
const _: () = assert!(PEER_CONNECTIONS_PER_NODE_MAX <= PEER_CONNECTIONS_MAX);
/// The commit's doorbells (`peer::bells`): messages queued for one peer at
/// most (one more is dropped: the shared directory's looks still find
/// what it said).
pub const PEER_BELLS_QUEUED_MAX: usize = 64;
/// How long a peer that could not be reached is not tried again (its
/// doorbells dropped meanwhile); a doorbell refused at once is tried again
/// after `PEER_BELL_RETRY_FIRST_MS`, the wait doubling, within
/// `PEER_BELL_RETRY_MS` in all.
pub const PEER_BELL_RETRY_MS: u64 = 1_000;
pub const PEER_BELL_RETRY_FIRST_MS: u64 = 20;
/// With no shared file system (`--shared-over-peers`), a part or a step's
/// outcome that cannot be sent is tried again for this long in all (a
/// peer restarting, a link down for seconds): nothing else stands in for
/// it, and a loss fails the step (the coordinator's part timeout) or this
/// node's ranks of it (twice that).
pub const PEER_DELIVER_MS: u64 = 20_000;
const _: () = assert!(PEER_BELL_RETRY_FIRST_MS < PEER_BELL_RETRY_MS);
/// Doorbells received and not yet taken by the committer, at most: their
/// count, and their markers' bytes (one more is dropped). Room for a
/// committed step's files of the largest frame, and more.
pub const PEER_BELLS_RECEIVED_MAX: usize = 4096;
pub const PEER_BELLS_RECEIVED_BYTES_MAX: usize = 512 << 20;
const _: () = assert!(PEER_BELLS_RECEIVED_BYTES_MAX >= 2 * ckpt_wire::peer::PEER_FRAME_BYTES_MAX as usize);
/// Markers sent by message for steps this sidecar does not coordinate yet
/// (rank 0's part not here yet), kept at most: bytes, and steps. They
/// came through the received doorbells, and keep no more than those hold.
pub const PEER_EARLY_MARKERS_BYTES_MAX: usize = 64 << 20;
pub const PEER_EARLY_MARKER_STEPS_MAX: usize = 4;
const _: () = assert!(PEER_EARLY_MARKERS_BYTES_MAX <= PEER_BELLS_RECEIVED_BYTES_MAX);
/// A coordinator with peers reads a marker file its look found only this
/// long after (its message, when it comes, spares the read): what a lost
/// doorbell adds to the commit.
pub const PEER_MARKER_DEFER_MS: u64 = 20;
const _: () = assert!(PEER_MARKER_DEFER_MS < PART_TICK_MS);
/// How long a handshake may take (all of it), and any one read or write
/// after it (the default of `--peer-timeout`): a peer that stalls longer
/// is dropped (its connection only).
pub const PEER_HANDSHAKE_TIMEOUT_MS: u64 = 5_000;
pub const PEER_IO_TIMEOUT_MS: u64 = 30_000;
pub const PEER_CONNECT_TIMEOUT_MS: u64 = 3_000;
/// A sidecar starting with no shared file system asks each peer for its
/// newest step: an answer is waited for this long at most (the start
/// waits for it; a peer not up yet refuses at once).
pub const PEER_IO_TIMEOUT_START_MS: u64 = 5_000;
/// Peers asked at once by a sidecar starting with no shared file system
/// (which steps each holds): one that does not answer costs its timeout
/// once, not once per peer listed before it.
pub const PEER_START_ASKS_AT_ONCE: usize = 16;
/// A file's bytes move in pieces of this size (one read or write each).
pub const PEER_PIECE_BYTES: usize = 4 << 20;
/// Clients waiting for a step to be held by peers, at once (all sessions).
pub const PEER_WAITERS_MAX: usize = 4096;
/// Outcomes of this node's replications remembered (the newest).
pub const PEER_OUTCOMES_KEPT: usize = 256;
/// Bytes of this node's files kept in memory, copied from a part's staging
/// image as it is written, until they are sent to the peers (more: the
/// rest is read back from disk).
pub const PEER_SEND_STAGED_BYTES_MAX: u64 = 8 << 30;
/// Threads of the peer server's tokio runtime.
pub const PEER_RUNTIME_THREADS: usize = 2;
/// Threads of the runtime that receives and checks offered replicas, at
/// nice 19 (several peers' replicas at once share them).
pub const PEER_RECV_THREADS: usize = 2;
/// Environment variable naming the cluster secret's file (`--peer-secret-file`).
pub const PEER_SECRET_FILE_ENV: &str = "CKPT_SIDECAR_PEER_SECRET_FILE";
