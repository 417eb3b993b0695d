//! Every limit of the storage engine, named once and related to the others at
//! compile time. Other modules take their numbers from here; a limit that is
//! written as a literal anywhere else is a bug.

/// Alignment of O_DIRECT offsets, lengths and buffer addresses. 4 KiB covers
/// every logical block size we meet (512 B and 4 KiB devices).
pub const DIRECT_ALIGN_BYTES: usize = 4096;

/// Tensor data in every shard starts at a multiple of this (the safetensors
/// header is padded with spaces up to it), so tensor bytes sit at aligned
/// file offsets and aligned staging addresses.
pub const DATA_ALIGN_BYTES: usize = 4096;

/// Size of a transparent huge page (x86-64 and aarch64 with 4 KiB pages).
/// Buffers of at least this size are aligned to it and asked for huge
/// pages: the copy and checksum passes then take ~500x fewer TLB misses, and
/// a write request spans a few physically contiguous segments instead of one
/// per 4 KiB page (so the block layer does not split it), which together cut
/// the sidecar's CPU time per checkpoint by about a quarter on our VMs.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Size of one write or read request handed to the kernel.
pub const CHUNK_BYTES_DEFAULT: usize = 4 << 20;
/// Requests in flight per target directory.
pub const QUEUE_DEPTH_DEFAULT: u32 = 16;
pub const QUEUE_DEPTH_MIN: u32 = 8;
pub const QUEUE_DEPTH_MAX: u32 = 256;

/// io_uring refuses a registered buffer larger than 1 GiB, so staging memory
/// is registered as slabs of at most this size; no request crosses a slab.
pub const SLAB_BYTES_MAX: usize = 1 << 30;
pub const SLAB_BYTES: usize = 256 << 20;

/// Largest shard file the planner makes unless a single tensor is larger.
pub const SHARD_BYTES_DEFAULT: u64 = 1 << 30;

/// The safetensors library refuses headers above 100 MB; stay well below.
pub const HEADER_BYTES_MAX: usize = 64 << 20;
/// Longest tensor name accepted.
pub const TENSOR_NAME_BYTES_MAX: usize = 1024;
/// Longest blob name accepted (it becomes a file name).
pub const BLOB_NAME_BYTES_MAX: usize = 200;
/// Largest blob accepted; blobs are small opaque metadata, not tensors.
pub const BLOB_BYTES_MAX: usize = 256 << 20;
/// Largest index file the reader parses.
pub const INDEX_BYTES_MAX: u64 = 256 << 20;
/// Worker threads of the thread-pool (pwrite/pread) fallback engine, per directory.
pub const POOL_THREADS_DEFAULT: usize = 4;

/// Version written into every index; readers refuse a newer major format.
pub const FORMAT_VERSION: u32 = 1;

const _: () = assert!(DIRECT_ALIGN_BYTES.is_power_of_two());
const _: () = assert!(HUGE_PAGE_BYTES.is_power_of_two() && HUGE_PAGE_BYTES % DIRECT_ALIGN_BYTES == 0);
const _: () = assert!(DATA_ALIGN_BYTES % DIRECT_ALIGN_BYTES == 0);
const _: () = assert!(CHUNK_BYTES_DEFAULT % DIRECT_ALIGN_BYTES == 0);
const _: () = assert!(SLAB_BYTES % CHUNK_BYTES_DEFAULT == 0);
const _: () = assert!(SLAB_BYTES <= SLAB_BYTES_MAX);
const _: () = assert!(QUEUE_DEPTH_MIN <= QUEUE_DEPTH_DEFAULT && QUEUE_DEPTH_DEFAULT <= QUEUE_DEPTH_MAX);
const _: () = assert!(CHUNK_BYTES_DEFAULT <= u32::MAX as usize);
const _: () = assert!(HEADER_BYTES_MAX < 100_000_000);

/// Rounds `n` up to a multiple of `align` (a power of two).
pub const fn align_up(n: u64, align: usize) -> u64 {
    let a = align as u64;
    (n + a - 1) & !(a - 1)
}

// ---- The daemon (server, sessions, staging, committer) ----

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
/// Largest first frame (Hello) read from a peer not yet checked.
pub const HELLO_BYTES_MAX: u32 = 64 << 10;
/// A peer that connects and says nothing for this long is dropped.
pub const HELLO_TIMEOUT_MS: u64 = 5_000;
/// A reply the client does not take within this long ends its session
/// (a client that never reads cannot stall the committer).
pub const SEND_TIMEOUT_MS: u64 = 10_000;
/// Concurrent sessions (clients).
pub const SESSIONS_MAX: usize = 256;
/// Regions one session may register.
pub const REGIONS_PER_SESSION_MAX: usize = 4096;
/// Longest shm_open name, leading '/' included (NAME_MAX).
pub const SHM_NAME_BYTES_MAX: usize = 255;
/// Tensors in one save or load.
pub const TENSORS_PER_REQUEST_MAX: usize = 1 << 20;
/// Blobs in one save.
pub const BLOBS_PER_SAVE_MAX: usize = 4096;
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
/// Writes into a client region on load go in requests of at most this.
pub const LOAD_PWRITE_BYTES_MAX: usize = 64 << 20;

const _: () = assert!(STAGING_BYTES_MIN <= STAGING_BYTES_DEFAULT_MAX);
const _: () = assert!(STAGING_BYTES_MIN % STAGING_ALIGN_BYTES as u64 == 0);
const _: () = assert!(STAGING_ALIGN_BYTES % DIRECT_ALIGN_BYTES == 0);
const _: () = assert!(HELLO_BYTES_MAX < FRAME_BYTES_MAX);
const _: () = assert!((BLOB_BYTES_MAX as u64) >= FRAME_BYTES_MAX as u64, "a blob that fits a frame fits the blob limit");
const _: () = assert!(COPY_THREADS >= 1);
const _: () = assert!(COPY_PIECE_BYTES % COPY_BLOCK_BYTES == 0);
const _: () = assert!(LOAD_PWRITE_BYTES_MAX <= (isize::MAX as usize));
const _: () = assert!(SHM_NAME_BYTES_MAX <= 255);
const _: () = assert!(COMMIT_QUEUE_MAX >= 1);
