//! The wire protocol between a trainer's shim and the sidecar.
//!
//! A connection is a Unix stream socket carrying frames: a 4-byte
//! little-endian length, then that many bytes of one postcard-encoded
//! message. The client speaks [`Request`]s, the sidecar [`Reply`]s. The first
//! request is always [`Request::Hello`]; a version the sidecar does not speak
//! gets [`Reply::Refused`] and the connection closes, and a client that gets a
//! [`Reply::Welcome`] of another version refuses it on its side.
//!
//! Invariants:
//! - this crate is the only place that derives Serialize/Deserialize for
//!   messages, so both sides always agree (golden tests pin the bytes);
//! - a frame's length is checked against [`FRAME_BYTES_MAX`] before any
//!   allocation or read of its body;
//! - decoding never panics on any input (fuzzed: `fuzz/fuzz_targets/wire_frame.rs`).

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

pub mod peer;
mod save;
pub use save::{
    decode_save, decode_save_head, decode_tensors, encode_save, encode_save_with, encode_tensors, BlobRef, Dims,
    RankOf, SaveHead, SaveIn, SaveRest, TensorDescIn, TensorDescRef, UnchangedRef,
};

/// Bumped on any change of the messages below (the golden tests fail first).
pub const PROTOCOL_VERSION: u32 = 16;
/// First bytes of every Hello, so a stray client is told apart from an old one.
pub const MAGIC: [u8; 4] = *b"CKPT";
/// Largest frame either side accepts: tensor descriptors plus small blobs.
pub const FRAME_BYTES_MAX: u32 = 64 << 20;
/// Environment variable that names the sidecar's socket.
pub const SOCKET_ENV: &str = "CKPT_SIDECAR_SOCKET";

/// Where a tensor's bytes are: `len_bytes` at `offset_bytes` in the client's
/// registered region `region_id`. For a save they are read from there; for a
/// load they are written there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDesc {
    pub name: String,
    /// safetensors spelling: F32, BF16, I64, ...
    pub dtype: String,
    pub shape: Vec<u64>,
    pub region_id: u32,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

/// Tensors the trainer proves unchanged since its own save of `since_step`
/// (a Save's, SavePart's or SaveAfterEvent's `unchanged`, version 13): bit
/// `i % 8` of byte `i / 8` set means tensor `i` of the request holds the
/// very bytes it held when that save copied it (the Python shim proves it
/// with torch's version counters, `incremental="trust-version"`). The
/// sidecar may then take those bytes from step `since_step` instead of
/// the client's memory, when it holds that step as this session saved it;
/// else it copies them as usual. A bitmap shorter than the tensor list
/// flags none of the tensors past it; a bit past the list is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unchanged {
    pub since_step: u64,
    #[serde(with = "byte_buf")]
    pub bits: Vec<u8>,
}

impl Unchanged {
    /// Whether tensor `i` is flagged.
    pub fn is_set(&self, i: usize) -> bool {
        self.bits.get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0)
    }

    /// The bitmap of `flags` (true: unchanged), trailing zero bytes dropped.
    pub fn bits_of(flags: impl IntoIterator<Item = bool>) -> Vec<u8> {
        let mut bits = Vec::new();
        for (i, f) in flags.into_iter().enumerate() {
            if i % 8 == 0 {
                bits.push(0u8);
            }
            if f {
                bits[i / 8] |= 1 << (i % 8);
            }
        }
        while bits.last() == Some(&0) {
            bits.pop();
        }
        bits
    }

    /// How many tensors are flagged.
    pub fn count(&self) -> usize {
        self.bits.iter().map(|b| b.count_ones() as usize).sum()
    }

    /// Checks the bitmap against a request of `n_tensors` tensors: no bit
    /// past the list.
    pub fn check(&self, n_tensors: usize) -> Result<(), String> {
        let past = self
            .bits
            .iter()
            .enumerate()
            .flat_map(|(k, &b)| (0..8).filter(move |j| b & (1 << j) != 0).map(move |j| k * 8 + j))
            .find(|&i| i >= n_tensors);
        match past {
            Some(i) => Err(format!("unchanged flags name tensor {i}, but the save has {n_tensors} tensors")),
            None => Ok(()),
        }
    }
}

/// What a checkpoint holds for one tensor (no bytes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub len_bytes: u64,
}

/// A small opaque byte blob saved beside the tensors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Blob {
    pub name: String,
    #[serde(with = "byte_buf")]
    pub bytes: Vec<u8>,
}

/// A blob's bytes written and read as one byte string, not as a sequence
/// of single bytes: postcard writes both alike (the length, then the
/// bytes; the goldens pin it), but a sequence goes through serde one byte
/// at a time, which for the 40 KB structure blob of a 1000-tensor state
/// cost tens of µs per save on each side.
pub(crate) mod byte_buf {
    use serde::de::{Deserializer, SeqAccess, Visitor};
    use serde::Serializer;
    use std::fmt;

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte string")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(b) = seq.next_element()? {
                    v.push(b);
                }
                Ok(v)
            }
        }
        d.deserialize_byte_buf(V)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    Hello {
        magic: [u8; 4],
        version: u32,
        pid: u32,
        name: String,
    },
    /// A POSIX shared-memory segment (name as for shm_open, e.g. "/ckpt-1-0")
    /// the sidecar maps read-only; `len_bytes` may not exceed its size.
    /// `hand_over` (version 9): the client writes this region only to fill
    /// a save before sending it, and not again until that save is released,
    /// so a save whose every tensor lies in such regions is the sidecar's
    /// once sent: it commits even if the client goes before Released.
    RegisterRegion {
        id: u64,
        region_id: u32,
        shm_name: String,
        len_bytes: u64,
        hand_over: bool,
    },
    UnregisterRegion {
        id: u64,
        region_id: u32,
    },
    /// Snapshot these tensors and blobs as checkpoint `step`; replies:
    /// Released, then Durable or Failed, all with `id`. `lazy_release`: the
    /// trainer does not block on Released (it computes meanwhile), so the
    /// sidecar checksums each block during the copy, while it is in cache
    /// (one memory pass fewer, a later Released); false: Released as early
    /// as possible, checksums after it. (Version 2.) `unchanged` (version
    /// 13): tensors the trainer proves unchanged since an earlier save of
    /// its own ([`Unchanged`]).
    Save {
        id: u64,
        step: u64,
        tensors: Vec<TensorDesc>,
        blobs: Vec<Blob>,
        lazy_release: bool,
        unchanged: Option<Unchanged>,
    },
    /// Write the named tensors of `step` (None: latest) into the regions the
    /// descriptors name, verified; reply: Loaded or Error.
    Load {
        id: u64,
        step: Option<u64>,
        tensors: Vec<TensorDesc>,
    },
    List {
        id: u64,
    },
    Status {
        id: u64,
    },
    Bye,
    /// Write the `len_bytes` at `offset_bytes` of region `region_id` as the
    /// whole content of the file `path` (absolute; its directory must
    /// exist), atomically: an unnamed temp file in that directory, synced,
    /// then renamed over `path`. Replies as a Save does, with step 0:
    /// Released (the bytes are in staging; the region may change), then
    /// Durable (path renamed, directory synced) or Failed. Added in
    /// version 2 (the torch.save hook).
    SaveFile {
        id: u64,
        path: String,
        region_id: u32,
        offset_bytes: u64,
        len_bytes: u64,
    },
    /// Make the committed checkpoint `step` the newest again: `latest`
    /// moves to it first, then every later step is un-committed (crash-safe,
    /// across all target directories), so later steps can be saved anew.
    /// Queued behind the saves sent before it. Reply: RolledBack or Error.
    /// Added in version 3.
    Rollback {
        id: u64,
        step: u64,
    },
    /// CUDA device memory of the client as region `region_id`: one whole
    /// allocation (`cudaMalloc`, PyTorch's caching allocator) on CUDA device
    /// `device`, named by its legacy IPC handle (`cuIpcGetMemHandle`, 64
    /// bytes). The sidecar opens it once (cuIpcOpenMemHandle) and closes it
    /// when the region is unregistered or the session ends; `len_bytes` may
    /// not exceed the allocation. Descriptors then name (region, offset,
    /// length) inside the allocation, as for shm. Reply: RegionRegistered or
    /// Error. Added in version 4.
    ///
    /// `device_uuid` (version 12): the UUID (16 bytes, `cuDeviceGetUuid_v2`)
    /// of the client's device `device`. Ordinals are per process
    /// (`CUDA_VISIBLE_DEVICES`), so the sidecar opens the allocation on its
    /// own device of that UUID and refuses a UUID it does not see, naming
    /// it; later messages naming `device` mean that device too.
    RegisterCudaRegion {
        id: u64,
        region_id: u32,
        device: i32,
        device_uuid: Vec<u8>,
        ipc_handle: Vec<u8>,
        len_bytes: u64,
    },
    /// A Save whose CUDA tensors are ready once `event` completes: the IPC
    /// handle (64 bytes) of an event created with CU_EVENT_INTERPROCESS |
    /// CU_EVENT_DISABLE_TIMING, recorded on the trainer's stream just before
    /// this message was sent. The sidecar polls it (after the message
    /// arrived; it never makes its stream wait on it, nor blocks on it: a
    /// wait on an event whose process died may never end) and queues its
    /// copies once it completed; the trainer's CPU never waits. `device` is
    /// the client's ordinal, as registered. Replies as a Save does. Added in
    /// version 4. (Versions 6 to 11 had a `done_event` the sidecar recorded
    /// behind its copies; since 12 the trainer's stream waits on nothing
    /// only the sidecar can complete: see docs/protocol.md, CUDA.)
    ///
    /// `rank`, `world_size` (version 6): with world_size > 1 this is rank
    /// `rank`'s part of the checkpoint, as a SavePart; 0 of 1 is a whole save.
    SaveAfterEvent {
        id: u64,
        step: u64,
        tensors: Vec<TensorDesc>,
        blobs: Vec<Blob>,
        lazy_release: bool,
        device: i32,
        event: Vec<u8>,
        rank: u32,
        world_size: u32,
        /// Version 13: as a Save's.
        unchanged: Option<Unchanged>,
    },
    /// A Save of rank `rank`'s part of a checkpoint written by `world_size`
    /// ranks (1 ≤ world_size, rank < world_size). Replies as a Save does;
    /// Durable comes only once every rank's part of `step` reached this
    /// sidecar and the whole checkpoint is committed; a part whose group is
    /// not complete within the sidecar's part timeout gets Failed, and so
    /// do the others. Blob names must differ between the ranks' parts.
    /// Added in version 5. `unchanged` (version 13): as a Save's.
    SavePart {
        id: u64,
        step: u64,
        rank: u32,
        world_size: u32,
        tensors: Vec<TensorDesc>,
        blobs: Vec<Blob>,
        lazy_release: bool,
        unchanged: Option<Unchanged>,
    },
    /// Registers a CUDA VMM allocation (cuMemCreate, mapped with cuMemMap)
    /// of `device` as region `region_id`: its first byte of this frame
    /// carries exactly one file descriptor (SCM_RIGHTS), the allocation
    /// exported with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR. The sidecar
    /// imports and maps it (reference-counted by the driver: it stays valid
    /// after the trainer dies) and closes the descriptor. Descriptors are
    /// matched to these requests in the order they arrive. Reply:
    /// RegionRegistered or Error. Added in version 6. `device_uuid`
    /// (version 12): as in [`Request::RegisterCudaRegion`]. `fabric_handle`
    /// (version 12; empty: the fd way above): the allocation exported as a
    /// CU_MEM_HANDLE_TYPE_FABRIC handle (64 bytes; PyTorch's expandable
    /// segments where an IMEX channel exists), imported from those bytes:
    /// the frame then carries no descriptor.
    RegisterCudaVmmRegion {
        id: u64,
        region_id: u32,
        device: i32,
        device_uuid: Vec<u8>,
        fabric_handle: Vec<u8>,
        len_bytes: u64,
    },
    /// Registers region `region_id` as the concatenation of CUDA regions
    /// this client registered before (`pieces`, in address order): device
    /// allocations mapped back to back in the client's address space, as
    /// PyTorch's expandable segments map cuMemCreate chunks into one
    /// reserved range, so a tensor crossing a chunk boundary is one
    /// (region, offset, length). Its length is the pieces' sum; the sidecar
    /// opens nothing new (the pieces' imports stay open while the span
    /// lives, even after a piece is unregistered). All pieces lie on one
    /// device. Reply: RegionRegistered or Error. Added in version 8.
    RegisterCudaSpan {
        id: u64,
        region_id: u32,
        pieces: Vec<u32>,
    },
    /// A SaveFile whose content is `pieces` laid end to end: each names
    /// bytes of a registered region, host shm or CUDA device memory (the
    /// torch.save hook's CUDA way: the file's skeleton in shm, each CUDA
    /// storage's bytes in place on the device). With device pieces, `event`
    /// is the IPC handle (64 bytes) of an interprocess event recorded on the
    /// trainer's stream on `device` just before this message was sent: the
    /// sidecar's stream waits on it (after the message arrived), then copies
    /// (empty `event`: no device piece, `device` unused). `finish` says what
    /// the sidecar completes in its copy before writing it ([`FileFinish`]).
    /// Replies as SaveFile does: Released once every piece is in staging
    /// (the device copy done: the trainer may change the tensors), then
    /// Durable or Failed. Added in version 10.
    SaveFilePieces {
        id: u64,
        path: String,
        pieces: Vec<FilePiece>,
        device: i32,
        event: Vec<u8>,
        finish: FileFinish,
    },
    /// Load every tensor of `step` (None: latest, falling back past damaged
    /// ones) into `len_bytes` at `offset_bytes` of host region `region_id`,
    /// laid out as the sidecar chooses: the checkpoint's shard images back to
    /// back, read from disk straight into the region (O_DIRECT) and verified
    /// there, or copied from the resident image. Reply: [`Reply::Placed`]
    /// (nothing written when the checkpoint needs more than `len_bytes`) or
    /// Error. The bytes are the client's from then on: the sidecar writes the
    /// region again only when asked to. Added in version 11.
    LoadPacked {
        id: u64,
        step: Option<u64>,
        region_id: u32,
        offset_bytes: u64,
        len_bytes: u64,
    },
    /// Tell me when the committed checkpoint `step` is **Replicated**: its
    /// files and then its index (the remote commit) are on the sidecar's
    /// drain target (`--drain URL`). Reply: [`Reply::Replicated`] once it
    /// is (at once if it already is), or Error: NotFound when the sidecar
    /// has no drain target, or the drain skipped the step (a newer one was
    /// drained instead, or `--drain-every` leaves it out), or the step is
    /// not committed; ShuttingDown when the sidecar stops first. The
    /// sidecar never answers Replicated for a step whose remote index is
    /// not written. Added in version 13.
    WaitReplicated {
        id: u64,
        step: u64,
    },
    /// Tell me when this node's files of the committed checkpoint `step`
    /// are **held by peers**: `--peer-replicas` other nodes' sidecars
    /// (`--peers`) hold them in memory, every byte checked against the
    /// step's checksums. Reply: [`Reply::HeldByPeers`] once they do (at
    /// once if they already do), or Error: NotFound when the sidecar has no
    /// peers, or the step is not committed; Io when its replication failed
    /// (the reason says which peer and why); ShuttingDown when the sidecar
    /// stops first. Added in version 15.
    WaitPeers {
        id: u64,
        step: u64,
    },
}

/// One piece of a [`Request::SaveFilePieces`]: `len_bytes` at `offset_bytes`
/// of region `region_id`. (Version 10.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilePiece {
    pub region_id: u32,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

/// What the sidecar completes in a [`Request::SaveFilePieces`] file once
/// every piece is in staging. (Version 10.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileFinish {
    /// Written as the pieces are.
    AsIs,
    /// A torch.save zip archive (stored records, data descriptors) written
    /// with `torch.serialization.skip_data()`, its storage bytes then placed
    /// by device pieces: the sidecar computes each record's CRC-32 into its
    /// data descriptor and central-directory entry, and the crc half of
    /// `.data/serialization_id`, as torch.save computes them. A piece list
    /// that is not such an archive is refused before Released.
    TorchZip,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LoadSource {
    /// The checkpoint was still resident in the sidecar's memory.
    Ram,
    Disk,
    /// The checkpoint was read (and verified) from the drain target
    /// (`--drain URL`): not in the local directories, newer there, or the
    /// local copy damaged. (Version 15.)
    Drain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The request is malformed or breaks a rule (names, sizes, overlaps).
    BadRequest,
    /// A descriptor points outside its region, or at an unknown region.
    BadRegion,
    /// No such checkpoint or tensor.
    NotFound,
    /// The checkpoint on disk is damaged.
    Damaged,
    /// An I/O error in the sidecar (disk full, EIO, ...).
    Io,
    /// The sidecar is shutting down.
    ShuttingDown,
    /// The save can never fit the staging budget.
    TooLarge,
}

// The large variant (Status) is one reply to a rare request; boxing it would
// change every decoder's view of the message for no gain on the hot replies.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Welcome {
        version: u32,
        server_pid: u32,
        dirs: Vec<String>,
        staging_bytes: u64,
    },
    /// The handshake failed (version, magic, uid); the connection closes.
    Refused {
        reason: String,
    },
    RegionRegistered {
        id: u64,
        region_id: u32,
    },
    RegionUnregistered {
        id: u64,
        region_id: u32,
    },
    /// The snapshot is complete: the trainer may change the tensors again.
    Released {
        id: u64,
        step: u64,
        copy_seconds: f64,
        waited_seconds: f64,
    },
    /// The checkpoint is committed on disk.
    Durable {
        id: u64,
        step: u64,
        path: String,
        persist_seconds: f64,
    },
    /// The save did not commit (before or after Released), and why.
    Failed {
        id: u64,
        step: u64,
        code: ErrorCode,
        reason: String,
    },
    /// The requested tensors are in place. `tensors` lists every tensor of
    /// the checkpoint (so a client can size its regions with a first Load of
    /// no tensors); `blobs` are all its blobs; `fell_back` says which newer
    /// checkpoints were skipped as damaged, and why.
    Loaded {
        id: u64,
        step: u64,
        source: LoadSource,
        tensors: Vec<TensorInfo>,
        blobs: Vec<Blob>,
        fell_back: Vec<String>,
    },
    Listing {
        id: u64,
        steps: Vec<u64>,
        latest: Option<u64>,
    },
    Status {
        id: u64,
        report: StatusReport,
    },
    /// A request failed; the session goes on.
    Error {
        id: u64,
        code: ErrorCode,
        message: String,
    },
    /// The rollback to `step` is done; `removed` lists the steps that were
    /// un-committed, newest first. (Version 3.)
    RolledBack {
        id: u64,
        step: u64,
        removed: Vec<u64>,
    },
    /// Versions 6 to 11: the device copies of a SaveAfterEvent were queued
    /// behind its `done_event`. Never sent since version 12 (kept so the
    /// replies after it keep their encoding).
    CopyQueued {
        id: u64,
        step: u64,
    },
    /// The answer to a LoadPacked: as [`Reply::Loaded`], plus where each
    /// tensor of `tensors` now starts (`offsets[i]`, from the request's
    /// `offset_bytes`; [`NOT_PLACED`] for a tensor stored in slices, which
    /// is not contiguous there: load it with a Load) and the bytes the
    /// checkpoint needs. `need_bytes` above the request's `len_bytes`:
    /// nothing was written and `offsets` and `blobs` are empty (`tensors`
    /// then come from the index, to size a region; ask again with one large
    /// enough). (Version 11.)
    Placed {
        id: u64,
        step: u64,
        source: LoadSource,
        tensors: Vec<TensorInfo>,
        offsets: Vec<u64>,
        need_bytes: u64,
        blobs: Vec<Blob>,
        fell_back: Vec<String>,
    },
    /// The answer to a WaitReplicated: `step` is committed on the drain
    /// target `url` (no secrets in it). (Version 13.)
    Replicated {
        id: u64,
        step: u64,
        url: String,
    },
    /// The answer to a WaitPeers: this node's files of `step` are held by
    /// the peers `peers` (their node ids). (Version 15.)
    HeldByPeers {
        id: u64,
        step: u64,
        peers: Vec<String>,
    },
}

/// [`Reply::Placed`]'s offset of a tensor that is not contiguous in the region.
pub const NOT_PLACED: u64 = u64::MAX;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct StatusReport {
    pub server_pid: u32,
    pub dirs: Vec<String>,
    pub sessions: Vec<SessionInfo>,
    pub in_flight: Vec<InFlight>,
    pub staging_bytes: u64,
    pub staging_used_bytes: u64,
    pub resident_step: Option<u64>,
    pub last: Option<LastFigures>,
    /// What the sidecar's CUDA probe found: "driver 12.8, 1 device(s): …",
    /// or why there is none ("no CUDA driver …"). (Version 4.)
    pub cuda: String,
    /// Several nodes: the directory every node's sidecar shares (`--shared`),
    /// where multi-rank steps are committed and loads read; empty when this
    /// sidecar serves one node alone. (Version 7.)
    pub shared_dir: String,
    /// Several nodes: the steps this sidecar coordinates now (it serves
    /// their rank 0, and commits or aborts them). (Version 7.)
    pub coordinating: Vec<u64>,
    /// Bytes of tensors flagged unchanged ([`Unchanged`]) that saves took
    /// from the sidecar's own copy of the step named instead of copying
    /// them from the client, since the sidecar started. (Version 13.)
    pub unchanged_taken_bytes: u64,
    /// Of those, the bytes taken in place: the sidecar's copy of the step
    /// named became the new save's image, so they were copied from nowhere.
    /// (Version 13.)
    pub unchanged_in_place_bytes: u64,
    /// The drain tier (`--drain URL`), when the sidecar has one. (Version 13.)
    pub drain: Option<DrainReport>,
    /// Damage the sidecar found in committed steps (a load, the drain's
    /// read-back, the scrub), newest last, at most the last few. (Version 15.)
    pub damaged: Vec<DamageReport>,
    /// Damage records made since the start (the list above keeps the
    /// last few only). (Version 15.)
    pub damaged_total: u64,
    /// The background scrub (`serve --scrub-interval`), when on. (Version 15.)
    pub scrub: Option<ScrubReport>,
    /// The peers (`--peers`), when the sidecar has any. (Version 15.)
    pub peers: Option<PeerReport>,
}

/// One damaged committed step the sidecar found. (Version 15.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct DamageReport {
    pub step: u64,
    /// The damaged file, as the step's index names it (empty: the step as
    /// a whole, e.g. an unreadable index).
    pub file: String,
    pub reason: String,
    /// When it was found, in seconds since the Unix epoch.
    pub found_unix_s: u64,
    /// What found it: "load", "drain" (its read-back for an upload),
    /// "scrub", "scrub_drain" (the scrub, of the drain target's copy).
    pub found_by: String,
}

/// The background scrub's progress. (Version 15.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ScrubReport {
    /// A pass over every committed step starts this often.
    pub interval_s: f64,
    /// The step being verified now.
    pub verifying: Option<u64>,
    /// Passes finished since the start, and the end of the last one.
    pub passes: u64,
    pub last_pass_unix_s: Option<u64>,
    /// Steps and bytes verified since the start.
    pub steps_verified: u64,
    pub bytes_verified: u64,
    /// The same of the drain target's steps (`--drain`).
    pub remote_steps_verified: u64,
    pub remote_bytes_verified: u64,
}

/// What this node's peer replication is doing, for `status`. (Version 15.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct PeerReport {
    /// This sidecar's own peer address (`--peer-listen`).
    pub listen: String,
    /// The peers' addresses (`--peers`).
    pub peers: Vec<String>,
    /// Replicas of each of this node's steps wanted (`--peer-replicas`).
    pub replicas: u32,
    /// The newest step of this node held by its peers, and by which.
    pub last_held: Option<u64>,
    pub last_held_by: Vec<String>,
    /// The newest step whose replication failed, and why (empty: none).
    pub last_failed: Option<u64>,
    pub last_error: String,
    /// Bytes per second of the last replication.
    pub bytes_per_s: f64,
    /// Steps not sent because a newer one was committed before their turn
    /// (replication behind the steps): the newest such step, and how many
    /// since the start. (Version 16.)
    pub last_skipped: Option<u64>,
    pub skipped_count: u64,
    /// `--shared-over-peers`: no shared file system; the "shared"
    /// directory is this node's own, kept the same as the other nodes' by
    /// the peer channel. (Version 16.)
    pub shared_over_peers: bool,
    /// Other nodes' steps held here: (node, step) pairs, and their bytes
    /// against the budget.
    pub holding: Vec<(String, u64)>,
    pub holding_bytes: u64,
    pub budget_bytes: u64,
    /// Connections refused since the start (a failed handshake, garbage, a stall).
    pub refused_connections: u64,
}

/// What the drain (`--drain URL`) is doing, for `status`. (Version 13.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct DrainReport {
    /// The target, as given (no secrets).
    pub url: String,
    /// Whether the last request to the target succeeded.
    pub up: bool,
    /// Why the target counts as down (empty when up).
    pub error: String,
    /// The newest step this sidecar knows to be replicated (remote latest).
    pub last_replicated: Option<u64>,
    /// The step being uploaded now.
    pub uploading: Option<u64>,
    /// Committed local steps not yet replicated that the drain will take
    /// (the newest of them next; the others will be skipped).
    pub backlog: Vec<u64>,
    /// Steps the drain skipped (a newer one was drained instead), newest
    /// last, at most the last few.
    pub skipped: Vec<u64>,
    /// Bytes per second of the last upload.
    pub bytes_per_s: f64,
    /// Every K-th step only (1: every step).
    pub every: u64,
    /// Remote retention (`--drain-keep`), if any.
    pub keep: Option<u64>,
    /// Every committed step the drain saw since the start is counted in
    /// exactly one of: replicated, backlog (or uploading), skipped
    /// (superseded by a newer step), deleted locally before it was
    /// drained (retention or a rollback got there first). (Version 14.)
    pub replicated_count: u64,
    pub skipped_count: u64,
    pub deleted_undrained_count: u64,
    /// The newest few of those deleted before they were drained. (Version 14.)
    pub deleted_undrained: Vec<u64>,
    /// File bytes of the backlog and the step uploading. (Version 14.)
    pub backlog_bytes: u64,
    /// Uploads of a step that failed since the start. (Version 14.)
    pub upload_failures: u64,
    /// Seconds since the oldest step not yet drained (backlog or
    /// uploading) was committed; 0 when none waits. (Version 14.)
    pub lag_seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub pid: u32,
    pub name: String,
    pub regions: u32,
    pub region_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlight {
    /// 0 for a SaveFile, which names `file` instead.
    pub step: u64,
    pub file: Option<String>,
    /// "waiting for staging", "copying", "writing", ...
    pub phase: String,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LastFigures {
    pub step: u64,
    pub bytes: u64,
    pub copy_seconds: f64,
    pub persist_seconds: f64,
    pub persist_gib_per_s: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection closed")]
    Closed,
    #[error("connection closed in the middle of a frame")]
    Truncated,
    #[error("frame of {len_bytes} bytes is above the limit of {max_bytes}")]
    TooLarge { len_bytes: u64, max_bytes: u32 },
    #[error("undecodable message: {0}")]
    Decode(postcard::Error),
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Encodes one message as a frame (length prefix included).
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let mut out = postcard::to_extend(msg, vec![0u8; 4]).expect("encoding into a Vec cannot fail");
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

/// Decodes a frame body (without its length prefix).
pub fn decode<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, FrameError> {
    postcard::from_bytes(body).map_err(FrameError::Decode)
}

pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), FrameError> {
    let f = encode(msg);
    if f.len() - 4 > FRAME_BYTES_MAX as usize {
        return Err(FrameError::TooLarge { len_bytes: (f.len() - 4) as u64, max_bytes: FRAME_BYTES_MAX });
    }
    w.write_all(&f)?;
    Ok(())
}

/// Reads one frame body, checking its length before reading it.
pub fn read_frame_body(r: &mut impl Read, max_bytes: u32) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_le_bytes(len);
    if len > max_bytes {
        return Err(FrameError::TooLarge { len_bytes: len as u64, max_bytes });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            FrameError::Truncated
        } else {
            e.into()
        }
    })?;
    Ok(body)
}

pub fn read_frame<T: for<'a> Deserialize<'a>>(r: &mut impl Read) -> Result<T, FrameError> {
    let body = read_frame_body(r, FRAME_BYTES_MAX)?;
    decode(&body)
}

/// The Hello a client sends first.
pub fn hello(name: &str) -> Request {
    Request::Hello { magic: MAGIC, version: PROTOCOL_VERSION, pid: std::process::id(), name: name.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let m = Request::Save {
            id: 7,
            step: 100,
            tensors: vec![TensorDesc {
                name: "w".into(),
                dtype: "F32".into(),
                shape: vec![2, 3],
                region_id: 1,
                offset_bytes: 64,
                len_bytes: 24,
            }],
            blobs: vec![Blob { name: "rng".into(), bytes: vec![1, 2, 3] }],
            lazy_release: true,
            unchanged: Some(Unchanged { since_step: 99, bits: vec![1] }),
        };
        let f = encode(&m);
        assert_eq!(u32::from_le_bytes(f[..4].try_into().unwrap()) as usize, f.len() - 4);
        let back: Request = read_frame(&mut &f[..]).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn unchanged_bitmaps_flag_the_tensors_they_name() {
        let u = Unchanged {
            since_step: 1,
            bits: Unchanged::bits_of([false, true, false, false, false, false, false, false, true, false, false]),
        };
        assert_eq!(u.bits, vec![0b10, 0b1]);
        assert!(!u.is_set(0) && u.is_set(1) && u.is_set(8) && !u.is_set(9) && !u.is_set(400));
        assert_eq!(u.count(), 2);
        u.check(9).unwrap();
        assert!(u.check(8).unwrap_err().contains("tensor 8"));
        assert!(Unchanged::bits_of([false, false]).is_empty());
    }

    #[test]
    fn oversized_lengths_are_refused_before_reading() {
        let mut f = (FRAME_BYTES_MAX + 1).to_le_bytes().to_vec();
        f.extend_from_slice(&[0; 16]);
        assert!(matches!(read_frame::<Request>(&mut &f[..]), Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn truncated_and_garbage_frames_are_errors() {
        let f = encode(&hello("t"));
        assert!(matches!(read_frame::<Request>(&mut &f[..f.len() - 1]), Err(FrameError::Truncated)));
        assert!(matches!(read_frame::<Request>(&mut &f[..2]), Err(FrameError::Truncated)));
        assert!(matches!(read_frame::<Request>(&mut &[][..]), Err(FrameError::Closed)));
        let garbage = [5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(read_frame::<Request>(&mut &garbage[..]), Err(FrameError::Decode(_))));
        // An unknown message kind (variant index past the last).
        let unknown = [1, 0, 0, 0, 99];
        assert!(matches!(read_frame::<Request>(&mut &unknown[..]), Err(FrameError::Decode(_))));
    }
}
