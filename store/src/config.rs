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

/// Incremental layouts (`Layout::plan_with`): a stable tensor (unchanged at
/// the previous save, or with no history yet) of at least this many bytes
/// gets a shard of its own, so that whether it can be linked depends on it
/// alone, never on a neighbour; smaller stable tensors share shards of at
/// most [`STABLE_BUCKET_BYTES_MAX`] (a change in one of them rewrites its
/// bucket once, then moves it to the volatile shards).
pub const STABLE_OWN_SHARD_BYTES_MIN: u64 = 1 << 20;
pub const STABLE_BUCKET_BYTES_MAX: u64 = 16 << 20;
/// The checksum pass of an incremental save checksums (crc32c) this much,
/// then hashes it (XXH3-128) while it is still in the first-level cache
/// (`digest::crc_and_digest`): small enough to stay there, large enough
/// that each call's fixed cost is nothing (a multiple of XXH3's 1 KiB block).
pub const SUM_CHUNK_BYTES: usize = 16 << 10;
/// Default of `--full-every`: every this many saves of a daemon, a step is
/// written in full (nothing linked), so no file is shared by more than
/// this many consecutive steps and a damaged one damages at most those.
pub const FULL_EVERY_DEFAULT: u32 = 10;

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
/// What a coordinator keeps of its ranks' markers to read the next ones
/// by template (`kept_markers.rs`): about three times their bytes each;
/// beyond it a marker is parsed as it comes.
pub const KEPT_MARKERS_BYTES_MAX: usize = 512 << 20;
/// Worker threads of the thread-pool (pwrite/pread) fallback engine, per directory.
pub const POOL_THREADS_DEFAULT: usize = 4;
/// A multi-node step's coordinator reads the rank markers that appeared
/// since its last look with at most this many threads (on a shared file
/// system each read is a round trip to its server).
pub const MARKER_READ_THREADS_MAX: usize = 8;
/// A driver whose engine fails to return completions while requests are in
/// flight tries again this many times, `ENGINE_RETRY_PAUSE_MS` apart (the
/// kernel's EAGAIN/ENOMEM under memory pressure passes); past that it can
/// never hand the buffers back safely, and the process aborts.
pub const ENGINE_WAIT_RETRIES_MAX: u32 = 3000;
pub const ENGINE_RETRY_PAUSE_MS: u64 = 1;
/// Times the io_uring engine retries `io_uring_enter` on EAGAIN/ENOMEM
/// (memory pressure), `ENGINE_RETRY_PAUSE_MS` apart, before it reports it.
pub const URING_ENTER_RETRIES_MAX: u32 = 100;

/// Several nodes: a multi-rank temp folder in the shared directory that
/// nothing touched for this long is abandoned (its coordinator died, or
/// aborted it before a late node wrote into it) and removed when any
/// node's sidecar starts. Above the daemon's part timeout (300 s), so a
/// live coordinator always aborts first.
pub const SHARED_STALE_AFTER_DEFAULT_S: u64 = 900;

/// The newest index format this build writes and reads. Version 2 added
/// `ckpt.slices` (tensors stored in pieces), version 3 the per-tensor
/// digest `xxh128` (incremental checkpoints); an index that uses nothing
/// newer is written as [`FORMAT_VERSION_OLDEST`], so older readers still
/// read it. Readers refuse versions outside the two.
pub const FORMAT_VERSION: u32 = 3;
/// The version of an index with `ckpt.slices` and no digests.
pub const FORMAT_VERSION_SLICES: u32 = 2;
/// The version of an index with per-tensor digests (`xxh128`).
pub const FORMAT_VERSION_DIGESTS: u32 = 3;

/// The oldest version that has everything an index uses: readers of older
/// builds keep reading what needs nothing newer.
pub fn format_version_for(slices: bool, digests: bool) -> u32 {
    if digests {
        FORMAT_VERSION_DIGESTS
    } else if slices {
        FORMAT_VERSION_SLICES
    } else {
        FORMAT_VERSION_OLDEST
    }
}
/// The oldest index format this build reads (and writes, when it suffices).
pub const FORMAT_VERSION_OLDEST: u32 = 1;

const _: () = assert!(
    FORMAT_VERSION_OLDEST >= 1
        && FORMAT_VERSION_OLDEST < FORMAT_VERSION_SLICES
        && FORMAT_VERSION_SLICES < FORMAT_VERSION_DIGESTS
        && FORMAT_VERSION_DIGESTS <= FORMAT_VERSION
);
const _: () = assert!(DIRECT_ALIGN_BYTES.is_power_of_two());
const _: () = assert!(SUM_CHUNK_BYTES > 0 && SUM_CHUNK_BYTES % 1024 == 0);
const _: () = assert!(HUGE_PAGE_BYTES.is_power_of_two() && HUGE_PAGE_BYTES % DIRECT_ALIGN_BYTES == 0);
const _: () = assert!(DATA_ALIGN_BYTES % DIRECT_ALIGN_BYTES == 0);
const _: () = assert!(CHUNK_BYTES_DEFAULT % DIRECT_ALIGN_BYTES == 0);
const _: () = assert!(SLAB_BYTES % CHUNK_BYTES_DEFAULT == 0);
const _: () = assert!(SLAB_BYTES <= SLAB_BYTES_MAX);
const _: () = assert!(QUEUE_DEPTH_MIN <= QUEUE_DEPTH_DEFAULT && QUEUE_DEPTH_DEFAULT <= QUEUE_DEPTH_MAX);
const _: () = assert!(CHUNK_BYTES_DEFAULT <= u32::MAX as usize);
const _: () = assert!(HEADER_BYTES_MAX < 100_000_000);
const _: () =
    assert!(STABLE_OWN_SHARD_BYTES_MIN <= STABLE_BUCKET_BYTES_MAX && STABLE_BUCKET_BYTES_MAX <= SHARD_BYTES_DEFAULT);

/// Rounds `n` up to a multiple of `align` (a power of two).
pub const fn align_up(n: u64, align: usize) -> u64 {
    let a = align as u64;
    (n + a - 1) & !(a - 1)
}
