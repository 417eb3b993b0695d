//! The client side of docs/protocol.md: one connection to the sidecar, the
//! regions registered on it, and the saves in flight.
//!
//! Threads: the caller's threads send requests (one at a time, under the
//! `inner` lock); one reader thread per connection (`ckpt-shim-reader`)
//! decodes every reply and files it in the shared [`State`]: replies to
//! requests by id (only ids someone still waits for), and the asynchronous
//! `Released` / `Durable` / `Failed` of saves into the save table, whatever
//! order they arrive in. Callers block on a condition variable, never on the
//! socket, so a `wait` on one thread and a `load` on another both work.
//!
//! Connection loss: when the reader sees EOF or an unreadable reply it marks
//! the connection dead, fails every save not yet durable (saying whether it
//! had been released), and wakes every waiter with "sidecar gone: …". The
//! next call that needs the sidecar (or [`Client::reconnect`]) connects again
//! and re-registers every region under its old id and name, so tensor
//! addresses stay valid across sidecar restarts; if no sidecar is there that
//! call fails with the reason and the trainer can go on training.
//!
//! Invariants:
//! - request ids are unique and increasing for the client's whole life, so
//!   they are unique per connection as the protocol asks, and a save id
//!   names one save forever;
//! - every table is bounded: replies are kept only for ids being waited for,
//!   finished saves only for the newest [`SAVES_FINISHED_MAX`];
//! - nothing is written to the socket with SIGPIPE possible (MSG_NOSIGNAL):
//!   a dead sidecar must never kill the trainer;
//! - a forked child never speaks on, shuts down or closes its parent's
//!   connection, nor unlinks its regions: a fork handler closes the child's
//!   copies of every connection's descriptors (so the sidecar still sees
//!   EOF when the parent dies, even while children such as data-loader
//!   workers live on), and every call in the child fails with
//!   [`Error::Forked`].

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ckpt_wire::{
    Blob, ErrorCode, FileFinish, FilePiece, FrameError, LoadSource, Reply, Request, StatusReport, TensorDesc,
    TensorInfo, FRAME_BYTES_MAX, PROTOCOL_VERSION, SOCKET_ENV,
};

use crate::error::{Error, Result};
use crate::region::ShmRegion;

/// Finished (durable or failed) saves remembered for `poll`/`wait`.
pub const SAVES_FINISHED_MAX: usize = 1024;
/// How long the handshake may take before the sidecar counts as hung.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A region allocated by a client: shared memory the sidecar can read.
/// The mapping lives while any clone of the `Arc` does.
pub type Region = Arc<ShmRegion>;

/// Where a tensor is, for save (its bytes) or load (where to put them).
/// `ptr` must lie inside a region of this client; it is only compared with
/// region addresses, never dereferenced by the client.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    /// safetensors spelling: F32, BF16, I64, ...
    pub dtype: &'a str,
    pub shape: &'a [u64],
    pub ptr: *const u8,
    pub len_bytes: u64,
}

impl<'a> TensorRef<'a> {
    /// A tensor at `offset_bytes` in `region`.
    pub fn in_region(
        name: &'a str,
        dtype: &'a str,
        shape: &'a [u64],
        region: &ShmRegion,
        offset_bytes: u64,
        len_bytes: u64,
    ) -> Self {
        TensorRef { name, dtype, shape, ptr: region.as_ptr().wrapping_add(offset_bytes as usize), len_bytes }
    }
}

/// A CUDA device allocation registered as a region (legacy IPC, or a VMM
/// allocation passed as a file descriptor), or a span of such allocations
/// mapped back to back (PyTorch's expandable segments): tensors inside
/// `base..base+len_bytes` are described as (region, offset, length).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaRegion {
    pub region_id: u32,
    pub base: u64,
    pub len_bytes: u64,
    pub device: i32,
    /// The allocation's identity (`ckpt_cuda::Allocation::buffer_id`; 0 for
    /// a span, or a driver that does not say): checked at each save, so a
    /// registration never outlives the memory it was made for.
    pub buffer_id: u64,
    kind: CudaKind,
}

/// How a CUDA region is shared with the sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
enum CudaKind {
    Legacy([u8; ckpt_cuda::IPC_HANDLE_BYTES]),
    /// Exported as a POSIX fd (SCM_RIGHTS) at each registration, closed here
    /// once sent: the trainer keeps no descriptor of its own.
    Vmm,
    /// A VMM allocation exported as a FABRIC handle (its only exportable
    /// type), sent as bytes.
    Fabric([u8; ckpt_cuda::FABRIC_HANDLE_BYTES]),
    /// Allocations registered as regions `pieces`, mapped back to back in
    /// this order (RegisterCudaSpan); `vmm`: all of them are VMM ones.
    Span {
        pieces: Vec<u32>,
        vmm: bool,
    },
}

impl CudaRegion {
    /// Whether the memory is VMM (valid in the sidecar after this process
    /// dies), not legacy IPC.
    pub fn is_vmm(&self) -> bool {
        matches!(self.kind, CudaKind::Vmm | CudaKind::Fabric(_) | CudaKind::Span { vmm: true, .. })
    }

    /// The regions a span is made of (empty for a single allocation).
    pub fn pieces(&self) -> &[u32] {
        match &self.kind {
            CudaKind::Span { pieces, .. } => pieces,
            _ => &[],
        }
    }

    fn overlaps(&self, a: &ckpt_cuda::Allocation) -> bool {
        self.base < a.base.saturating_add(a.len_bytes) && a.base < self.base.saturating_add(self.len_bytes)
    }

    /// The offset of `len_bytes` at device address `ptr` in this allocation.
    fn offset_of(&self, ptr: u64, len_bytes: u64) -> Option<u64> {
        let off = ptr.checked_sub(self.base)?;
        (off.checked_add(len_bytes)? <= self.len_bytes).then_some(off)
    }
}

/// A small named byte string saved beside the tensors.
#[derive(Debug, Clone, Copy)]
pub struct BlobRef<'a> {
    pub name: &'a str,
    pub bytes: &'a [u8],
}

/// What to wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wanted {
    /// The snapshot is copied: the tensors may change again.
    Released,
    /// The checkpoint is committed on disk.
    Durable,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveState {
    Pending,
    Released,
    Durable,
    Failed,
}

/// A save issued by [`Client::save`] or [`Client::save_file`] (step 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SaveHandle {
    pub id: u64,
    pub step: u64,
}

/// Everything known about one save.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveStatus {
    /// 0 for a save_file.
    pub step: u64,
    /// The destination of a save_file; None for a checkpoint.
    pub file: Option<String>,
    pub state: SaveState,
    /// Whether the sidecar said Released (a failed save may have been).
    pub released: bool,
    pub copy_seconds: Option<f64>,
    pub waited_seconds: Option<f64>,
    pub path: Option<String>,
    pub persist_seconds: Option<f64>,
    /// Why it failed, when `state` is Failed.
    pub error: Option<String>,
    /// The drain target it was replicated to, once a
    /// [`Client::wait_replicated`] saw it (protocol 13).
    pub replicated_to: Option<String>,
}

impl SaveStatus {
    /// "step N" or "file PATH", for messages.
    pub fn what(&self) -> String {
        match &self.file {
            Some(p) => format!("file {p}"),
            None => format!("step {}", self.step),
        }
    }
}

/// What a load returned.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadInfo {
    pub step: u64,
    pub source: LoadSource,
    /// Every tensor of the checkpoint (not just the ones loaded).
    pub tensors: Vec<TensorInfo>,
    pub blobs: Vec<Blob>,
    /// Newer checkpoints skipped as damaged, and why.
    pub fell_back: Vec<String>,
    /// [`Client::load_packed`] only (else empty): where `tensors[i]` starts,
    /// from the start of the memory given ([`ckpt_wire::NOT_PLACED`] for a
    /// tensor stored in slices, not contiguous there).
    pub offsets: Vec<u64>,
    /// [`Client::load_packed`] only (else 0): the bytes the checkpoint needs;
    /// above the length given, nothing was written.
    pub need_bytes: u64,
}

/// What the sidecar said in its Welcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    pub server_pid: u32,
    pub dirs: Vec<String>,
    pub staging_bytes: u64,
}

/// The socket path from the environment, as docs/protocol.md says:
/// `$CKPT_SIDECAR_SOCKET`, else `$XDG_RUNTIME_DIR/ckpt-sidecar/sidecar.sock`,
/// else `/tmp/ckpt-sidecar-<uid>/sidecar.sock`. Empty variables count as unset.
pub fn default_socket_path() -> PathBuf {
    if let Some(p) = std::env::var_os(SOCKET_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|p| !p.is_empty()) {
        return Path::new(&d).join("ckpt-sidecar").join("sidecar.sock");
    }
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    PathBuf::from(format!("/tmp/ckpt-sidecar-{uid}/sidecar.sock"))
}

/// Descriptors of live connections, closed in a forked child (lock-free: the
/// child of a multi-threaded process may only do async-signal-safe things).
/// A connection that finds no free slot is simply not closed on fork.
const FORK_FDS_MAX: usize = 128;
static FORK_FDS: [AtomicI32; FORK_FDS_MAX] = [const { AtomicI32::new(-1) }; FORK_FDS_MAX];

fn fork_fd_register(fd: i32) {
    static ATFORK: Once = Once::new();
    ATFORK.call_once(|| {
        // SAFETY: registers a plain extern "C" fn that only calls close(2).
        unsafe { libc::pthread_atfork(None, None, Some(close_fds_in_child)) };
    });
    for slot in &FORK_FDS {
        if slot.compare_exchange(-1, fd, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            return;
        }
    }
}

fn fork_fd_unregister(fd: i32) {
    for slot in &FORK_FDS {
        if slot.compare_exchange(fd, -1, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            return;
        }
    }
}

extern "C" fn close_fds_in_child() {
    for slot in &FORK_FDS {
        let fd = slot.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: `fd` is this (child) process's copy of a connection
            // descriptor; nothing in the child uses it (calls fail with Forked).
            unsafe { libc::close(fd) };
        }
    }
}

/// A connection to the sidecar (reconnecting on demand), its regions and saves.
/// All methods take `&self`: a client may be shared between threads.
pub struct Client {
    /// The process that connected; in a fork child every call fails.
    owner_pid: u32,
    socket_path: PathBuf,
    name: String,
    shared: Arc<Shared>,
    inner: Mutex<Inner>,
}

struct Inner {
    conn: Option<Conn>,
    regions: BTreeMap<u32, Region>,
    cuda_regions: BTreeMap<u32, CudaRegion>,
    /// One interprocess event per CUDA device, recorded at each save.
    cuda_events: HashMap<i32, ckpt_cuda::IpcEvent>,
    /// The last value of the copy-done sequence given to a device save
    /// ([`crate::done_word`]).
    done_seq: u32,
    next_region_id: u32,
    closed: bool,
    request_timeout: Option<Duration>,
    /// Saves ask for a lazy release (see [`Client::set_lazy_release`]).
    lazy_release: bool,
    /// (rank, world size) of this trainer; saves are parts when world > 1.
    rank: (u32, u32),
    /// The last save's tensor list, encoded, and what it was made from.
    kept_list: Option<KeptList>,
}

/// A save's encoded tensor list ([`ckpt_wire::encode_tensors`]) with what
/// it is a function of: each tensor's name, dtype, shape, address and
/// length, and the regions that place addresses (their ids, addresses and
/// lengths: [`locate`] reads nothing else). A save of the same tensors
/// while the regions are the same (a trainer saving one state again and
/// again) sends these bytes again: no locating, no encoding per tensor.
struct KeptList {
    regions: Vec<(u32, usize, u64)>,
    cuda_regions: Vec<(u32, u64, u64)>,
    /// Names and dtypes end to end (a tensor's end where its entry says).
    text: String,
    /// Shapes end to end.
    dims: Vec<u64>,
    tensors: Vec<KeptTensor>,
    encoded: Vec<u8>,
}

struct KeptTensor {
    name_end: usize,
    dtype_end: usize,
    dims_end: usize,
    ptr: usize,
    len_bytes: u64,
}

impl KeptList {
    fn new(inner: &Inner, tensors: &[TensorRef], encoded: Vec<u8>) -> KeptList {
        let mut text = String::with_capacity(tensors.iter().map(|t| t.name.len() + t.dtype.len()).sum());
        let mut dims = Vec::with_capacity(tensors.iter().map(|t| t.shape.len()).sum());
        let kept = tensors
            .iter()
            .map(|t| {
                text.push_str(t.name);
                let name_end = text.len();
                text.push_str(t.dtype);
                dims.extend_from_slice(t.shape);
                KeptTensor {
                    name_end,
                    dtype_end: text.len(),
                    dims_end: dims.len(),
                    ptr: t.ptr as usize,
                    len_bytes: t.len_bytes,
                }
            })
            .collect();
        KeptList {
            regions: inner.regions.values().map(|r| (r.region_id(), r.as_ptr() as usize, r.len_bytes())).collect(),
            cuda_regions: inner.cuda_regions.values().map(|r| (r.region_id, r.base, r.len_bytes)).collect(),
            text,
            dims,
            tensors: kept,
            encoded,
        }
    }

    /// Whether this is the list of `tensors` with `inner`'s regions now.
    fn is_of(&self, inner: &Inner, tensors: &[TensorRef]) -> bool {
        if self.tensors.len() != tensors.len()
            || self.regions.len() != inner.regions.len()
            || self.cuda_regions.len() != inner.cuda_regions.len()
            || !inner
                .regions
                .values()
                .zip(&self.regions)
                .all(|(r, &k)| (r.region_id(), r.as_ptr() as usize, r.len_bytes()) == k)
            || !inner
                .cuda_regions
                .values()
                .zip(&self.cuda_regions)
                .all(|(r, &k)| (r.region_id, r.base, r.len_bytes) == k)
        {
            return false;
        }
        let (mut at, mut d0) = (0, 0);
        for (k, t) in self.tensors.iter().zip(tensors) {
            if k.ptr != t.ptr as usize
                || k.len_bytes != t.len_bytes
                || self.text[at..k.name_end] != *t.name
                || self.text[k.name_end..k.dtype_end] != *t.dtype
                || self.dims[d0..k.dims_end] != *t.shape
            {
                return false;
            }
            (at, d0) = (k.dtype_end, k.dims_end);
        }
        true
    }
}

struct Conn {
    stream: UnixStream,
    gen: u64,
    reader: Option<JoinHandle<()>>,
    info: ServerInfo,
}

impl Conn {
    /// Ends the connection and waits for its reader thread.
    fn shut(mut self) {
        fork_fd_unregister(self.stream.as_raw_fd());
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(h) = self.reader.take() {
            let _ = h.join();
        }
    }
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Generation of the current connection; replies of older ones are dropped.
    gen: u64,
    /// Why the current connection is dead, once it is.
    dead: Option<String>,
    next_id: u64,
    /// Request ids someone is waiting for, and their replies once here.
    waiting: HashSet<u64>,
    replies: HashMap<u64, Reply>,
    saves: HashMap<u64, SaveEntry>,
    finished: VecDeque<u64>,
    /// The word device saves' stream waits wait on, made at the first such
    /// save (None: not yet, or the driver refused it: waits are then the
    /// CPU's), and the highest value given to a save sent.
    done_word: Option<Arc<crate::done_word::DoneWord>>,
    done_sent: u32,
}

#[derive(Debug, Clone)]
struct SaveEntry {
    status: SaveStatus,
    /// Set when failed: the code the sidecar gave, or None for a lost connection.
    code: Option<ErrorCode>,
    /// A CUDA save: its device, and the value the copy-done word reaches
    /// once its copy is over ([`crate::done_word`]).
    cuda_device: Option<(i32, u32)>,
    /// The request named one of this client's interprocess events, and
    /// the sidecar has not answered it yet: it may still poll the event,
    /// which must not be destroyed under it ([`Client::close`]).
    event_pending: bool,
}

impl State {
    fn file(&mut self, reply: Reply) {
        match reply {
            Reply::Released { id, copy_seconds, waited_seconds, .. } => {
                self.copy_over(id);
                if let Some(e) = self.saves.get_mut(&id) {
                    if e.status.state == SaveState::Pending {
                        e.status.state = SaveState::Released;
                        e.status.released = true;
                        e.status.copy_seconds = Some(copy_seconds);
                        e.status.waited_seconds = Some(waited_seconds);
                    }
                }
            }
            Reply::Durable { id, path, persist_seconds, .. } => {
                self.copy_over(id);
                if let Some(e) = self.saves.get_mut(&id) {
                    if matches!(e.status.state, SaveState::Pending | SaveState::Released) {
                        // Durable implies released, even if Released was never seen.
                        e.status.state = SaveState::Durable;
                        e.status.released = true;
                        e.status.path = Some(path);
                        e.status.persist_seconds = Some(persist_seconds);
                        self.finish(id);
                    }
                }
            }
            // Not sent since protocol version 12.
            Reply::CopyQueued { .. } => {}
            Reply::Failed { id, code, reason, .. } => {
                self.copy_over(id);
                self.fail_save(id, Some(code), reason)
            }
            Reply::Error { id, code, message } if self.saves.get(&id).is_some_and(|e| !is_final(e.status.state)) => {
                self.copy_over(id);
                self.fail_save(id, Some(code), message)
            }
            Reply::Refused { reason } => self.lose(format!("the sidecar ended the session: {reason}")),
            Reply::Welcome { .. } => {}
            other => {
                if let Some(id) = reply_id(&other) {
                    if self.waiting.contains(&id) {
                        self.replies.insert(id, other);
                    }
                }
            }
        }
    }

    /// Save `id`'s device copy is over (or will never run): the trainer's
    /// streams waiting on it go on ([`crate::done_word`]).
    fn copy_over(&mut self, id: u64) {
        if let (Some(w), Some(&SaveEntry { cuda_device: Some((_, value)), .. })) =
            (&self.done_word, self.saves.get(&id))
        {
            w.release(value);
        }
        // The sidecar answered: it polled the request's event to its end
        // (or gave it up) before.
        if let Some(e) = self.saves.get_mut(&id) {
            e.event_pending = false;
        }
    }

    /// Whether the sidecar may still poll one of this client's events.
    fn events_in_use(&self) -> bool {
        self.saves.values().any(|e| e.event_pending)
    }

    fn fail_save(&mut self, id: u64, code: Option<ErrorCode>, reason: String) {
        if let Some(e) = self.saves.get_mut(&id) {
            if !is_final(e.status.state) {
                e.status.state = SaveState::Failed;
                e.status.error = Some(reason);
                e.code = code;
                self.finish(id);
            }
        }
    }

    fn finish(&mut self, id: u64) {
        self.finished.push_back(id);
        while self.finished.len() > SAVES_FINISHED_MAX {
            let old = self.finished.pop_front().expect("non-empty");
            self.saves.remove(&old);
        }
    }

    /// The current connection is gone: every unfinished save fails.
    fn lose(&mut self, reason: String) {
        if self.dead.is_some() {
            return;
        }
        // No copy of a save sent on this connection may still be waited for:
        // the sidecar cannot finish it any more.
        if let Some(w) = &self.done_word {
            w.release(self.done_sent);
        }
        let open: Vec<u64> = self.saves.iter().filter(|(_, e)| !is_final(e.status.state)).map(|(id, _)| *id).collect();
        for id in open {
            let released = self.saves[&id].status.released;
            let why = if released {
                format!("{reason}; the snapshot had been released, so the checkpoint may still commit (check the list)")
            } else {
                format!("{reason}; the snapshot was not released, so this checkpoint was not taken")
            };
            self.fail_save(id, None, why);
        }
        self.dead = Some(reason);
    }
}

fn is_final(s: SaveState) -> bool {
    matches!(s, SaveState::Durable | SaveState::Failed)
}

fn reply_id(r: &Reply) -> Option<u64> {
    match r {
        Reply::Welcome { .. } | Reply::Refused { .. } => None,
        Reply::RegionRegistered { id, .. }
        | Reply::RegionUnregistered { id, .. }
        | Reply::Released { id, .. }
        | Reply::Durable { id, .. }
        | Reply::Failed { id, .. }
        | Reply::Loaded { id, .. }
        | Reply::Listing { id, .. }
        | Reply::Status { id, .. }
        | Reply::RolledBack { id, .. }
        | Reply::CopyQueued { id, .. }
        | Reply::Placed { id, .. }
        | Reply::Replicated { id, .. }
        | Reply::Error { id, .. } => Some(*id),
    }
}

fn program_name() -> String {
    std::fs::read_to_string("/proc/self/comm").map(|s| s.trim().to_string()).unwrap_or_else(|_| "ckpt-shim".to_string())
}

/// Writes one frame without ever raising SIGPIPE.
fn send_frame(stream: &UnixStream, msg: &Request) -> Result<()> {
    send_frame_with(stream, msg, None)
}

/// Writes one frame without ever raising SIGPIPE; with `fd`, its first
/// bytes carry that descriptor (SCM_RIGHTS: the sidecar gets its own).
fn send_frame_with(stream: &UnixStream, msg: &Request, pass_fd: Option<i32>) -> Result<()> {
    send_encoded_with(stream, &ckpt_wire::encode(msg), pass_fd)
}

/// Writes one encoded frame (length prefix included) without ever raising SIGPIPE.
fn send_encoded(stream: &UnixStream, frame: &[u8]) -> Result<()> {
    send_encoded_with(stream, frame, None)
}

/// [`send_encoded`], with `fd` passed as [`send_frame_with`] does.
fn send_encoded_with(stream: &UnixStream, frame: &[u8], mut pass_fd: Option<i32>) -> Result<()> {
    let body_bytes = frame.len() - 4;
    if body_bytes > FRAME_BYTES_MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "the request is {body_bytes} bytes encoded, above the protocol's frame limit of {FRAME_BYTES_MAX} bytes (fewer tensors or smaller blobs per save)"
        )));
    }
    let fd = stream.as_raw_fd();
    let mut off = 0;
    while off < frame.len() {
        let n = match pass_fd {
            Some(passed) => send_with_fd(fd, &frame[off..], passed),
            // SAFETY: the pointer and length describe the live `frame[off..]`.
            None => unsafe { libc::send(fd, frame[off..].as_ptr().cast(), frame.len() - off, libc::MSG_NOSIGNAL) },
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::Disconnected { reason: format!("sending to the sidecar failed: {e}") });
        }
        off += n as usize;
        // Sent with the first bytes that went: never twice.
        pass_fd = None;
    }
    Ok(())
}

/// One sendmsg of `bytes` on socket `sock` with descriptor `passed` in an
/// SCM_RIGHTS control message; returns what sendmsg returns.
fn send_with_fd(sock: i32, bytes: &[u8], passed: i32) -> isize {
    // Room for one int, aligned as the kernel wants (u64 words).
    let mut control = [0u64; 4];
    let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
    // SAFETY: msghdr is plain data; all-zero is valid before the fields are set.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is arithmetic.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as usize;
    assert!(msg.msg_controllen <= std::mem::size_of_val(&control));
    // SAFETY: msg_control points at `control`, large enough for one
    // header and one int (asserted); CMSG_FIRSTHDR is then non-null, and the
    // data pointer lies inside `control`. iov describes the live `bytes`.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), passed);
        libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL)
    }
}

fn reader_loop(mut stream: UnixStream, gen: u64, shared: Arc<Shared>) {
    read_replies(&mut stream, gen, &shared);
    // Unregistered while still open: a fork after the close would have the
    // child's handler close whatever descriptor took the number meanwhile.
    // (A fork between the two leaves the child a copy of this socket,
    // closed when the child exits: the lesser harm.)
    fork_fd_unregister(stream.as_raw_fd());
    drop(stream);
}

fn read_replies(stream: &mut UnixStream, gen: u64, shared: &Shared) {
    loop {
        let got = ckpt_wire::read_frame::<Reply>(stream);
        let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.gen != gen {
            return;
        }
        match got {
            Ok(reply) => st.file(reply),
            Err(e) => {
                let reason = match e {
                    FrameError::Closed => {
                        "the sidecar closed the connection (it exited, was killed, or ended the session)".to_string()
                    }
                    FrameError::Truncated => "the sidecar closed the connection in the middle of a reply".to_string(),
                    FrameError::Io(e) => format!("reading from the sidecar failed: {e}"),
                    e @ (FrameError::TooLarge { .. } | FrameError::Decode(_)) => {
                        format!("unreadable reply from the sidecar ({e}); connection dropped")
                    }
                };
                st.lose(reason);
                let _ = stream.shutdown(std::net::Shutdown::Both);
                shared.changed.notify_all();
                return;
            }
        }
        shared.changed.notify_all();
    }
}

impl Client {
    /// Connects to the sidecar at `path`, or the path from the environment
    /// ([`default_socket_path`]) when None, and does the handshake.
    pub fn connect(path: Option<&Path>) -> Result<Client> {
        let socket_path = path.map(Path::to_path_buf).unwrap_or_else(default_socket_path);
        let client = Client {
            owner_pid: std::process::id(),
            socket_path,
            name: program_name(),
            shared: Arc::new(Shared {
                state: Mutex::new(State { next_id: 1, ..State::default() }),
                changed: Condvar::new(),
            }),
            inner: Mutex::new(Inner {
                conn: None,
                regions: BTreeMap::new(),
                cuda_regions: BTreeMap::new(),
                cuda_events: HashMap::new(),
                done_seq: 0,
                next_region_id: 1,
                closed: false,
                request_timeout: None,
                lazy_release: false,
                rank: (0, 1),
                kept_list: None,
            }),
        };
        {
            let mut inner = client.lock_inner();
            client.open(&mut inner)?;
        }
        Ok(client)
    }

    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// What the sidecar said at the last handshake, if connected.
    pub fn server_info(&self) -> Option<ServerInfo> {
        self.lock_inner().conn.as_ref().map(|c| c.info.clone())
    }

    /// Whether the connection is up (as far as the reader thread knows).
    pub fn is_connected(&self) -> bool {
        let inner = self.lock_inner();
        let st = self.lock_state();
        inner.conn.as_ref().is_some_and(|c| c.gen == st.gen && st.dead.is_none())
    }

    /// Limits how long load, list, status and region calls wait for their
    /// reply (None: as long as the connection lives). Saves are not limited
    /// here: [`Client::wait`] takes its own timeout.
    pub fn set_request_timeout(&self, timeout: Option<Duration>) {
        self.lock_inner().request_timeout = timeout;
    }

    /// Whether later saves ask for a lazy release: for a trainer that does
    /// not block on Released right after saving (it computes meanwhile), the
    /// sidecar then checksums during the copy, one pass over memory fewer,
    /// at the price of a later Released. Default false: Released as early as
    /// possible (the checksums follow it).
    pub fn set_lazy_release(&self, on: bool) {
        self.lock_inner().lazy_release = on;
    }

    /// This trainer is rank `rank` of `world_size`: with world_size > 1,
    /// later saves are that rank's part of a checkpoint all ranks write
    /// (SavePart); the sidecar commits a step once every part is there.
    pub fn set_rank(&self, rank: u32, world_size: u32) -> Result<()> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of world size {world_size}: need 0 <= rank < world_size"
            )));
        }
        self.lock_inner().rank = (rank, world_size);
        Ok(())
    }

    /// Connects again if the connection is down (re-registering every region);
    /// does nothing if it is up.
    pub fn reconnect(&self) -> Result<()> {
        let mut inner = self.lock_inner();
        self.ensure_connected(&mut inner).map(|_| ())
    }

    /// Creates a shared-memory region of `len_bytes` and registers it.
    pub fn alloc_region(&self, len_bytes: u64) -> Result<Region> {
        self.alloc_region_as(len_bytes, false)
    }

    /// As [`Client::alloc_region`], for memory the caller fills with copies
    /// made at save: it writes the region only to fill a save before
    /// sending it, and not again until that save is released. A save whose
    /// every tensor lies in such regions is then the sidecar's once
    /// [`Client::save`] returned: it commits even if this process dies
    /// before Released (docs/protocol.md, RegisterRegion).
    pub fn alloc_hand_over_region(&self, len_bytes: u64) -> Result<Region> {
        self.alloc_region_as(len_bytes, true)
    }

    fn alloc_region_as(&self, len_bytes: u64, hand_over: bool) -> Result<Region> {
        self.check_owner()?;
        let mut inner = self.lock_inner();
        if inner.closed {
            return Err(Error::Closed);
        }
        let region_id = inner.next_region_id;
        inner.next_region_id =
            inner.next_region_id.checked_add(1).ok_or_else(|| Error::InvalidArgument("region ids exhausted".into()))?;
        let region = Arc::new(ShmRegion::create(region_id, len_bytes)?.handing_over(hand_over));
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(&mut inner)?;
        self.register(conn, &region, timeout)?;
        inner.regions.insert(region_id, region.clone());
        Ok(region)
    }

    /// Unregisters a region and forgets it; its memory is unmapped and its
    /// name unlinked when the last `Region` clone is dropped. The sidecar
    /// answers only once no copy reads the region any more.
    pub fn free_region(&self, region: &Region) -> Result<()> {
        self.free_region_id(region.region_id())
    }

    /// As [`Client::free_region`], by the region's base address (the C ABI's `ckpt_free`).
    pub fn free_region_at(&self, ptr: *const u8) -> Result<()> {
        let id = {
            let inner = self.lock_inner();
            inner.regions.values().find(|r| std::ptr::eq(r.as_ptr(), ptr)).map(|r| r.region_id())
        };
        match id {
            Some(id) => self.free_region_id(id),
            None => Err(Error::UnknownRegion { ptr: ptr as usize }),
        }
    }

    fn free_region_id(&self, region_id: u32) -> Result<()> {
        // Before the lock: in a forked child it may be held by a thread of
        // the parent that does not exist here (held across a round trip).
        self.check_owner()?;
        let mut inner = self.lock_inner();
        let Some(region) = inner.regions.remove(&region_id) else {
            return Err(Error::UnknownRegion { ptr: 0 });
        };
        // The region is forgotten either way; if the sidecar is gone it has
        // nothing to unregister, and a later reconnect will not register it.
        let timeout = inner.request_timeout;
        let conn = match self.ensure_connected(&mut inner) {
            Ok(c) => c,
            Err(_) => return Ok(()),
        };
        let reply =
            self.call_on(conn, timeout, "UnregisterRegion", |id| Request::UnregisterRegion { id, region_id })?;
        drop(region);
        match reply {
            Reply::RegionUnregistered { .. } => Ok(()),
            other => Err(unexpected("UnregisterRegion", other)),
        }
    }

    /// Regions currently allocated.
    pub fn regions(&self) -> Vec<Region> {
        self.lock_inner().regions.values().cloned().collect()
    }

    /// Asks for checkpoint `step` of these tensors and blobs. Returns at once;
    /// [`Client::wait`] or [`Client::poll`] tell when it is released / durable.
    /// The tensors must not change until it is released.
    pub fn save(&self, step: u64, tensors: &[TensorRef], blobs: &[BlobRef]) -> Result<SaveHandle> {
        self.save_unchanged(step, tensors, blobs, None)
    }

    /// [`Client::save`] with tensors the trainer proves unchanged since its
    /// own save of `unchanged.since_step` (protocol 13, [`ckpt_wire::Unchanged`]:
    /// bit `i` flags `tensors[i]`). The sidecar may take their bytes from
    /// that step instead of the regions, when it holds it as this
    /// connection saved it; else it copies them. A flag on a changed tensor
    /// makes the checkpoint hold its old bytes: flag only what is proven.
    pub fn save_unchanged(
        &self,
        step: u64,
        tensors: &[TensorRef],
        blobs: &[BlobRef],
        unchanged: Option<&ckpt_wire::Unchanged>,
    ) -> Result<SaveHandle> {
        if let Some(u) = unchanged {
            u.check(tensors.len()).map_err(Error::InvalidArgument)?;
        }
        let mut inner = self.lock_inner();
        self.refresh_cuda_locked(&mut inner, tensors)?;
        // The same tensors as the last save, with the same regions: its
        // list again. Else encoded from the caller's borrowed names and
        // shapes: no copy of them (a save of thousands of tensors costs a
        // pass, not allocations), and kept for the next save.
        let kept = inner.kept_list.take().filter(|k| k.is_of(&inner, tensors));
        let kept = match kept {
            Some(k) => k,
            None => {
                let mut descs = Vec::with_capacity(tensors.len());
                for t in tensors {
                    let (region_id, offset_bytes) = locate(&inner, t)?;
                    descs.push(ckpt_wire::TensorDescRef {
                        name: t.name,
                        dtype: t.dtype,
                        shape: t.shape,
                        region_id,
                        offset_bytes,
                        len_bytes: t.len_bytes,
                    });
                }
                KeptList::new(&inner, tensors, ckpt_wire::encode_tensors(&descs))
            }
        };
        let blobs: Vec<ckpt_wire::BlobRef> =
            blobs.iter().map(|b| ckpt_wire::BlobRef { name: b.name, bytes: b.bytes }).collect();
        let lazy_release = inner.lazy_release;
        let part = match inner.rank {
            (_, 1) => None,
            (rank, world_size) => Some(ckpt_wire::RankOf { rank, world_size }),
        };
        let unchanged = unchanged
            .filter(|u| u.count() > 0)
            .map(|u| ckpt_wire::UnchangedRef { since_step: u.since_step, bits: &u.bits });
        let sent = self.submit_encoded(&mut inner, step, None, |id| {
            ckpt_wire::encode_save_with(id, step, part, &kept.encoded, &blobs, lazy_release, unchanged)
        });
        inner.kept_list = Some(kept);
        sent
    }

    /// Registers the CUDA allocation holding device address `ptr` (found
    /// with cuMemGetAddressRange) as a region, exported once: by its legacy
    /// IPC handle, or, for a VMM allocation, as a file descriptor passed over
    /// the socket (SCM_RIGHTS); an allocation already registered returns its
    /// region. A registration made for memory since freed (another
    /// allocation now at the address: its buffer id differs), and any other
    /// whose memory is gone, is unregistered first when a new allocation is
    /// registered, so the sidecar closes its import.
    /// Fails with [`Error::Cuda`] when there is no CUDA driver or `ptr` is
    /// not device memory.
    pub fn register_cuda(&self, ptr: u64) -> Result<CudaRegion> {
        self.register_cuda_range(ptr, 1)
    }

    /// As [`Client::register_cuda`] for the `len_bytes` at `ptr`, which may
    /// cross from one allocation into the next ones mapped right after it
    /// (VMM chunks in one reserved range: PyTorch's expandable segments):
    /// each allocation is registered once, and the run of them as one span
    /// region holding the whole range. A range that runs into unmapped
    /// memory is refused, saying where.
    pub fn register_cuda_range(&self, ptr: u64, len_bytes: u64) -> Result<CudaRegion> {
        self.check_owner()?;
        let mut inner = self.lock_inner();
        if inner.closed {
            return Err(Error::Closed);
        }
        self.register_range_locked(&mut inner, ptr, len_bytes.max(1))
    }

    fn register_range_locked(&self, inner: &mut MutexGuard<'_, Inner>, ptr: u64, len_bytes: u64) -> Result<CudaRegion> {
        let allocs = ckpt_cuda::allocations_covering(ptr, len_bytes)?;
        let mut pieces = Vec::with_capacity(allocs.len());
        let mut vmm = true;
        for a in &allocs {
            let r = self.register_allocation_locked(inner, a)?;
            vmm &= r.is_vmm();
            pieces.push(r.region_id);
        }
        if let [one] = pieces[..] {
            return Ok(inner.cuda_regions[&one].clone());
        }
        if let Some(r) = inner.cuda_regions.values().find(|r| r.pieces() == pieces) {
            return Ok(r.clone());
        }
        let region_id = self.next_region_id(inner)?;
        let len_bytes = allocs.iter().map(|a| a.len_bytes).sum();
        let r = CudaRegion {
            region_id,
            base: allocs[0].base,
            len_bytes,
            device: allocs[0].device,
            buffer_id: 0,
            kind: CudaKind::Span { pieces, vmm },
        };
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(inner)?;
        self.register_cuda_on(conn, &r, timeout, None)?;
        inner.cuda_regions.insert(region_id, r.clone());
        Ok(r)
    }

    /// The region of allocation `a`: the one registered for it, else a new
    /// one, after unregistering every registration whose memory is gone:
    /// one `a` replaced, and any other freed since (one driver call each,
    /// only when a new allocation is registered), so the sidecar closes
    /// their imports (a VMM import keeps the freed chunk's memory alive)
    /// now rather than when this client leaves.
    fn register_allocation_locked(
        &self,
        inner: &mut MutexGuard<'_, Inner>,
        a: &ckpt_cuda::Allocation,
    ) -> Result<CudaRegion> {
        if let Some(r) = inner.cuda_regions.values().find(|r| {
            r.pieces().is_empty() && r.base == a.base && r.len_bytes == a.len_bytes && r.buffer_id == a.buffer_id
        }) {
            return Ok(r.clone());
        }
        // Two live allocations never overlap: one registered over `a` was
        // freed since (the address was reused).
        let all = &inner.cuda_regions;
        let stale: Vec<u32> = all
            .values()
            .filter(|r| r.pieces().is_empty() && (r.overlaps(a) || !still_there(all, r)))
            .map(|r| r.region_id)
            .collect();
        self.drop_cuda_regions_locked(inner, &stale)?;
        let (kind, fd) = match ckpt_cuda::export(a)? {
            ckpt_cuda::Export::Legacy(h) => (CudaKind::Legacy(h), None),
            ckpt_cuda::Export::Vmm(fd) => (CudaKind::Vmm, Some(fd)),
            ckpt_cuda::Export::Fabric(h) => (CudaKind::Fabric(h), None),
        };
        let region_id = self.next_region_id(inner)?;
        let r = CudaRegion {
            region_id,
            base: a.base,
            len_bytes: a.len_bytes,
            device: a.device,
            buffer_id: a.buffer_id,
            kind,
        };
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(inner)?;
        self.register_cuda_on(conn, &r, timeout, fd)?;
        inner.cuda_regions.insert(region_id, r.clone());
        Ok(r)
    }

    fn next_region_id(&self, inner: &mut MutexGuard<'_, Inner>) -> Result<u32> {
        let region_id = inner.next_region_id;
        inner.next_region_id =
            inner.next_region_id.checked_add(1).ok_or_else(|| Error::InvalidArgument("region ids exhausted".into()))?;
        Ok(region_id)
    }

    /// Forgets the CUDA regions `ids` and the spans made of any of them,
    /// and has the sidecar close them (spans first).
    fn drop_cuda_regions_locked(&self, inner: &mut MutexGuard<'_, Inner>, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut gone: Vec<u32> = inner
            .cuda_regions
            .values()
            .filter(|r| r.pieces().iter().any(|p| ids.contains(p)))
            .map(|r| r.region_id)
            .collect();
        gone.extend_from_slice(ids);
        for id in &gone {
            inner.cuda_regions.remove(id);
        }
        let timeout = inner.request_timeout;
        // Not connected: the sidecar closed them with the session.
        let Ok(conn) = self.ensure_connected(inner) else { return Ok(()) };
        for region_id in gone {
            match self.call_on(conn, timeout, "UnregisterRegion", |id| Request::UnregisterRegion { id, region_id })? {
                // An Error: the sidecar no longer had it (nothing to close).
                Reply::RegionUnregistered { .. } | Reply::Error { .. } => {}
                other => return Err(unexpected("UnregisterRegion", other)),
            }
        }
        Ok(())
    }

    /// Before a save or load: every CUDA region its device tensors lie in
    /// must still name the memory at its address (one driver call per
    /// allocation: its buffer id), and a tensor that crosses the end of a
    /// registered allocation is registered as a span. A region whose memory
    /// was freed (another allocation now at the address) is replaced:
    /// unregistered, the new allocation exported and registered.
    fn refresh_cuda_locked(&self, inner: &mut MutexGuard<'_, Inner>, tensors: &[TensorRef]) -> Result<()> {
        if inner.cuda_regions.is_empty() {
            return Ok(());
        }
        let mut checked: Vec<(u32, bool)> = Vec::new();
        let mut redo: Vec<(u64, u64)> = Vec::new();
        for t in tensors {
            let (ptr, len) = (t.ptr as u64, t.len_bytes);
            if len == 0 || inner.regions.values().any(|r| r.offset_of(ptr as usize, len).is_some()) {
                continue;
            }
            let fresh = match inner.cuda_regions.values().find(|r| r.offset_of(ptr, len).is_some()) {
                Some(r) => match checked.iter().find(|(id, _)| *id == r.region_id) {
                    Some(&(_, ok)) => ok,
                    None => {
                        let ok = still_there(&inner.cuda_regions, r);
                        checked.push((r.region_id, ok));
                        ok
                    }
                },
                // Starts in a registered allocation and runs past its end.
                None => !inner.cuda_regions.values().any(|r| r.offset_of(ptr, 0).is_some()),
            };
            if !fresh {
                redo.push((ptr, len));
            }
        }
        for (ptr, len) in redo {
            self.register_range_locked(inner, ptr, len)?;
        }
        Ok(())
    }

    /// Unregisters the CUDA region holding device address `ptr` (the
    /// sidecar closes its import); the memory itself stays the trainer's.
    pub fn unregister_cuda(&self, ptr: u64) -> Result<()> {
        let id = {
            let inner = self.lock_inner();
            inner
                .cuda_regions
                .values()
                .find(|r| r.pieces().is_empty() && r.offset_of(ptr, 0).is_some())
                .map(|r| r.region_id)
        };
        let Some(region_id) = id else { return Err(Error::UnknownRegion { ptr: ptr as usize }) };
        let mut inner = self.lock_inner();
        let pieces = inner.cuda_regions.get(&region_id).map(|r| r.pieces().to_vec()).unwrap_or_default();
        // A span goes with its pieces; a piece with the spans made of it.
        let ids = if pieces.is_empty() { vec![region_id] } else { pieces };
        self.drop_cuda_regions_locked(&mut inner, &ids)
    }

    /// CUDA regions currently registered.
    pub fn cuda_regions(&self) -> Vec<CudaRegion> {
        self.lock_inner().cuda_regions.values().cloned().collect()
    }

    /// As [`Client::save`], for tensors some of which are CUDA device memory
    /// written by work queued on `stream` (a CUstream / cudaStream_t; 0: the
    /// legacy default stream): an interprocess event is recorded on
    /// `stream` and sent with the save, and the sidecar's own stream waits
    /// on it before copying. The CPU never waits. With no CUDA tensor this is
    /// a plain save.
    pub fn save_on_stream(
        &self,
        step: u64,
        tensors: &[TensorRef],
        blobs: &[BlobRef],
        stream: u64,
    ) -> Result<SaveHandle> {
        self.save_on_stream_unchanged(step, tensors, blobs, stream, None)
    }

    /// [`Client::save_on_stream`] with tensors proven unchanged, as
    /// [`Client::save_unchanged`]: on a GPU the sidecar then skips their
    /// device-to-host copy.
    pub fn save_on_stream_unchanged(
        &self,
        step: u64,
        tensors: &[TensorRef],
        blobs: &[BlobRef],
        stream: u64,
        unchanged: Option<&ckpt_wire::Unchanged>,
    ) -> Result<SaveHandle> {
        if let Some(u) = unchanged {
            u.check(tensors.len()).map_err(Error::InvalidArgument)?;
        }
        let unchanged = unchanged.filter(|u| u.count() > 0).cloned();
        let mut inner = self.lock_inner();
        self.refresh_cuda_locked(&mut inner, tensors)?;
        let descs = describe(&inner, tensors)?;
        let blobs: Vec<Blob> =
            blobs.iter().map(|b| Blob { name: b.name.to_string(), bytes: b.bytes.to_vec() }).collect();
        let lazy_release = inner.lazy_release;
        let mut devices: Vec<i32> =
            descs.iter().filter_map(|d| inner.cuda_regions.get(&d.region_id)).map(|r| r.device).collect();
        devices.sort_unstable();
        devices.dedup();
        let (rank, world_size) = inner.rank;
        if devices.is_empty() && unchanged.is_some() {
            // No device tensor: a plain save, its tensor list kept for the next.
            drop(inner);
            let blobs: Vec<BlobRef> = blobs.iter().map(|b| BlobRef { name: &b.name, bytes: &b.bytes }).collect();
            return self.save_unchanged(step, tensors, &blobs, unchanged.as_ref());
        }
        let device = match devices[..] {
            [] if world_size == 1 => return self.submit(&mut inner, step, None, |id| Request::Save { id, step, tensors: descs, blobs, lazy_release, unchanged }),
            [] => return self.submit(&mut inner, step, None, |id| Request::SavePart { id, step, rank, world_size, tensors: descs, blobs, lazy_release, unchanged }),
            [d] => d,
            _ => return Err(Error::InvalidArgument(format!("the CUDA tensors of one save lie on {} devices ({devices:?}); save each device's tensors from its own client", devices.len()))),
        };
        let event = match inner.cuda_events.entry(device) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(ckpt_cuda::IpcEvent::new(device)?),
        };
        event.record(stream)?;
        let event = event.handle().to_vec();
        let h = self.submit(&mut inner, step, None, |id| Request::SaveAfterEvent {
            id,
            step,
            tensors: descs,
            blobs,
            lazy_release,
            device,
            event,
            rank,
            world_size,
            unchanged,
        })?;
        // The copy-done word's next value is this save's; the word is made
        // at the first device save (a refusal only makes waits the CPU's).
        inner.done_seq = inner.done_seq.wrapping_add(1);
        let value = inner.done_seq;
        let mut st = self.lock_state();
        if st.done_word.is_none() {
            st.done_word = crate::done_word::DoneWord::new(device).map(Arc::new).ok();
        }
        st.done_sent = value;
        match st.saves.get_mut(&h.id) {
            Some(e) if !is_final(e.status.state) && !e.status.released => {
                e.cuda_device = Some((device, value));
                e.event_pending = true;
            }
            // Over already (a reply came first): nothing will wait on it.
            _ => {
                if let Some(w) = &st.done_word {
                    w.release(value);
                }
            }
        }
        Ok(h)
    }

    /// Makes the trainer's `stream` (a CUstream; 0: the legacy default
    /// stream) wait until the sidecar's device-to-host copy of save
    /// `save_id` is over, without the CPU waiting: the lazy wait before an
    /// optimizer step. The stream waits on a word of this process's memory
    /// that the client itself sets when the copy is over (Released), the
    /// save ended, or the sidecar is gone ([`crate::done_word`]): never on
    /// anything only the sidecar could complete, so a sidecar that dies
    /// mid-copy cannot freeze the stream. Returns true when such a stream
    /// wait was queued, false when none was needed (the save is released,
    /// failed, or has no device tensors: a host save's release is waited
    /// for on the CPU, as [`Client::wait`] does, and so is a device save's
    /// where the driver refused the word).
    pub fn stream_wait_copy(&self, save_id: u64, stream: u64, timeout: Option<Duration>) -> Result<bool> {
        self.check_owner()?;
        let (device, value, word) = {
            let st = self.lock_state();
            let e = st.saves.get(&save_id).ok_or(Error::UnknownSave { save_id })?;
            if e.status.released || is_final(e.status.state) {
                return Ok(false);
            }
            match (e.cuda_device, &st.done_word) {
                (Some((device, value)), Some(w)) => (device, value, w.clone()),
                _ => {
                    drop(st);
                    self.wait(save_id, Wanted::Released, timeout)?;
                    return Ok(false);
                }
            }
        };
        // Raised already if the copy ended meanwhile: the wait then passes at once.
        word.wait_on(stream, device, value)?;
        Ok(true)
    }

    /// Asks the sidecar to write `len_bytes` at `ptr` (inside one of this
    /// client's regions) as the whole content of the file `path` (absolute,
    /// in an existing directory), atomically: temp file, sync, rename. Like
    /// a save: returns at once; the bytes must not change until released
    /// (wait with [`Wanted::Released`]); durable once renamed and synced.
    pub fn save_file(&self, path: &str, ptr: *const u8, len_bytes: u64) -> Result<SaveHandle> {
        let mut inner = self.lock_inner();
        let t = TensorRef { name: path, dtype: "U8", shape: &[], ptr, len_bytes };
        let d = describe(&inner, &[t])?.pop().expect("one descriptor for one ref");
        let path = path.to_string();
        self.submit(&mut inner, 0, Some(path.clone()), |id| Request::SaveFile {
            id,
            path,
            region_id: d.region_id,
            offset_bytes: d.offset_bytes,
            len_bytes: d.len_bytes,
        })
    }

    /// Has the sidecar write `pieces` (address, length), laid end to end, as
    /// the whole file `path`: each lies in one of this client's shm regions
    /// or registered CUDA memory ([`Client::register_cuda`]; a piece across
    /// VMM chunks: [`Client::register_cuda_range`]). With CUDA
    /// pieces, an interprocess event is recorded on `stream` (a CUstream of
    /// this process; 0: the legacy default stream) and sent with the request:
    /// the sidecar's stream waits on it before copying, the CPU never waits.
    /// `finish` says what the sidecar completes before writing
    /// ([`FileFinish::TorchZip`]: a torch.save skip_data archive's CRC-32s).
    /// Replies as [`Client::save_file`]. (Protocol 9.)
    pub fn save_file_pieces(
        &self,
        path: &str,
        pieces: &[(*const u8, u64)],
        stream: u64,
        finish: FileFinish,
    ) -> Result<SaveHandle> {
        let mut inner = self.lock_inner();
        let mut out = Vec::with_capacity(pieces.len());
        let mut devices: Vec<i32> = Vec::new();
        for (i, &(ptr, len_bytes)) in pieces.iter().enumerate() {
            let name = format!("{path} piece {i}");
            let (region_id, offset_bytes) =
                locate(&inner, &TensorRef { name: &name, dtype: "U8", shape: &[], ptr, len_bytes })?;
            if len_bytes > 0 {
                if let Some(r) = inner.cuda_regions.get(&region_id) {
                    if !devices.contains(&r.device) {
                        devices.push(r.device);
                    }
                }
            }
            out.push(FilePiece { region_id, offset_bytes, len_bytes });
        }
        let (device, event) = match devices[..] {
            [] => (0, Vec::new()),
            [d] => {
                let event = match inner.cuda_events.entry(d) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => e.insert(ckpt_cuda::IpcEvent::new(d)?),
                };
                event.record(stream)?;
                (d, event.handle().to_vec())
            }
            _ => return Err(Error::InvalidArgument(format!("the CUDA pieces of file {path} lie on {} devices ({devices:?}); one file's device pieces must share one device", devices.len()))),
        };
        let path = path.to_string();
        let with_event = !event.is_empty();
        let h = self.submit(&mut inner, 0, Some(path.clone()), |id| Request::SaveFilePieces {
            id,
            path,
            pieces: out,
            device,
            event,
            finish,
        })?;
        if with_event {
            if let Some(e) =
                self.lock_state().saves.get_mut(&h.id).filter(|e| !is_final(e.status.state) && !e.status.released)
            {
                e.event_pending = true;
            }
        }
        Ok(h)
    }

    /// Files a save under a fresh id and sends the request `make` builds.
    fn submit(
        &self,
        inner: &mut MutexGuard<'_, Inner>,
        step: u64,
        file: Option<String>,
        make: impl FnOnce(u64) -> Request,
    ) -> Result<SaveHandle> {
        self.submit_encoded(inner, step, file, |id| ckpt_wire::encode(&make(id)))
    }

    /// [`Client::submit`] of a request already encoded as a frame by `make`.
    fn submit_encoded(
        &self,
        inner: &mut MutexGuard<'_, Inner>,
        step: u64,
        file: Option<String>,
        make: impl FnOnce(u64) -> Vec<u8>,
    ) -> Result<SaveHandle> {
        let conn = self.ensure_connected(inner)?;
        let id = {
            let mut st = self.lock_state();
            let id = st.next_id;
            st.next_id += 1;
            let status = SaveStatus {
                step,
                file,
                state: SaveState::Pending,
                released: false,
                copy_seconds: None,
                waited_seconds: None,
                path: None,
                persist_seconds: None,
                error: None,
                replicated_to: None,
            };
            st.saves.insert(id, SaveEntry { status, code: None, cuda_device: None, event_pending: false });
            id
        };
        if let Err(e) = send_encoded(&conn.stream, &make(id)) {
            let mut st = self.lock_state();
            st.saves.remove(&id);
            return Err(e);
        }
        Ok(SaveHandle { id, step })
    }

    /// The state of a save, without blocking.
    pub fn poll(&self, save_id: u64) -> Result<SaveStatus> {
        self.check_owner()?;
        let st = self.lock_state();
        st.saves.get(&save_id).map(|e| e.status.clone()).ok_or(Error::UnknownSave { save_id })
    }

    /// Blocks until the save is released or durable (as `wanted` says), it
    /// fails, or `timeout` passes (None: no limit). A failed save is an error
    /// naming why; waiting for Released on a save that was released and then
    /// lost its connection succeeds (the tensors may change).
    pub fn wait(&self, save_id: u64, wanted: Wanted, timeout: Option<Duration>) -> Result<SaveStatus> {
        self.check_owner()?;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = self.lock_state();
        loop {
            let e = st.saves.get(&save_id).ok_or(Error::UnknownSave { save_id })?;
            let s = &e.status;
            let done = match (wanted, s.state) {
                (_, SaveState::Durable) => true,
                (Wanted::Released, SaveState::Released) => true,
                (Wanted::Released, SaveState::Failed) if s.released => true,
                (_, SaveState::Failed) => {
                    let reason = s.error.clone().unwrap_or_default();
                    return Err(match e.code {
                        Some(code) => Error::SaveFailed { what: s.what(), code, reason },
                        None => Error::Disconnected { reason },
                    });
                }
                _ => false,
            };
            if done {
                return Ok(s.clone());
            }
            let what = s.what();
            st = self.wait_changed(st, deadline).map_err(|()| Error::Timeout {
                what: format!(
                    "save of {what} to be {}",
                    if wanted == Wanted::Released { "released" } else { "durable" }
                ),
                timeout_ms: timeout.map(|t| t.as_millis() as u64).unwrap_or(0),
            })?;
        }
    }

    /// Blocks until checkpoint save `save_id` is **Replicated**: durable,
    /// then committed on the sidecar's drain target (`--drain URL`, its
    /// remote index written), or `timeout` passes (None: no limit;
    /// [`Error::Timeout`], the replication goes on). A sidecar without a
    /// drain target, or a step its drain skipped (a newer one was drained
    /// instead, `--drain-every`), answers at once with
    /// [`Error::Remote`] (NotFound) saying why: never a hang.
    pub fn wait_replicated(&self, save_id: u64, timeout: Option<Duration>) -> Result<SaveStatus> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let s = self.wait(save_id, Wanted::Durable, timeout)?;
        if let Some(f) = &s.file {
            return Err(Error::InvalidArgument(format!(
                "save {save_id} wrote the file {f}; only checkpoints are replicated"
            )));
        }
        if s.replicated_to.is_some() {
            return Ok(s);
        }
        let step = s.step;
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        self.check_owner()?;
        let mut inner = self.lock_inner();
        let conn = self.ensure_connected(&mut inner)?;
        let gen = conn.gen;
        let id = self.send_request(conn, |id| Request::WaitReplicated { id, step })?;
        drop(inner);
        match self.await_reply(id, gen, &format!("step {step} to be replicated"), left)? {
            Reply::Replicated { url, .. } => {
                let mut st = self.lock_state();
                let mut s = s;
                s.replicated_to = Some(url.clone());
                if let Some(e) = st.saves.get_mut(&save_id) {
                    e.status.replicated_to = Some(url);
                }
                Ok(s)
            }
            other => Err(unexpected("WaitReplicated", other)),
        }
    }

    /// Loads the named tensors of `step` (None: latest) into the places the
    /// refs point at (inside this client's regions). With no refs, only
    /// tells what the checkpoint holds.
    pub fn load(&self, step: Option<u64>, tensors: &[TensorRef]) -> Result<LoadInfo> {
        let mut inner = self.lock_inner();
        self.refresh_cuda_locked(&mut inner, tensors)?;
        let descs = describe(&inner, tensors)?;
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(&mut inner)?;
        let gen = conn.gen;
        let id = self.send_request(conn, |id| Request::Load { id, step, tensors: descs })?;
        drop(inner);
        match self.await_reply(id, gen, "the sidecar to load", timeout)? {
            Reply::Loaded { step, source, tensors, blobs, fell_back, .. } => {
                Ok(LoadInfo { step, source, tensors, blobs, fell_back, offsets: Vec::new(), need_bytes: 0 })
            }
            other => Err(unexpected("Load", other)),
        }
    }

    /// Loads every tensor of `step` (None: latest) into the `len_bytes` at
    /// `ptr` (inside one of this client's host regions, block-aligned), laid
    /// out as the sidecar chooses (`LoadInfo::offsets`): from disk it reads
    /// straight into that memory, verified. When the checkpoint needs more
    /// than `len_bytes` (`LoadInfo::need_bytes`) nothing is written and
    /// `tensors` only says what it holds: call again with more.
    pub fn load_packed(&self, step: Option<u64>, ptr: *const u8, len_bytes: u64) -> Result<LoadInfo> {
        let mut inner = self.lock_inner();
        let (region_id, offset_bytes) = inner
            .regions
            .values()
            .find_map(|r| r.offset_of(ptr as usize, len_bytes).map(|off| (r.region_id(), off)))
            .ok_or_else(|| Error::OutsideRegion { name: "(load range)".into(), ptr: ptr as usize, len_bytes })?;
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(&mut inner)?;
        let gen = conn.gen;
        let id = self.send_request(conn, |id| Request::LoadPacked { id, step, region_id, offset_bytes, len_bytes })?;
        drop(inner);
        match self.await_reply(id, gen, "the sidecar to load", timeout)? {
            Reply::Placed { step, source, tensors, offsets, need_bytes, blobs, fell_back, .. } => {
                Ok(LoadInfo { step, source, tensors, blobs, fell_back, offsets, need_bytes })
            }
            other => Err(unexpected("LoadPacked", other)),
        }
    }

    /// Committed steps, oldest first, and the latest one.
    pub fn list(&self) -> Result<(Vec<u64>, Option<u64>)> {
        match self.call("List", |id| Request::List { id })? {
            Reply::Listing { steps, latest, .. } => Ok((steps, latest)),
            other => Err(unexpected("List", other)),
        }
    }

    /// Makes the committed checkpoint `step` the newest again: the sidecar
    /// moves `latest` to it, then un-commits every later step (crash-safe),
    /// after the saves sent before this call. Returns the steps removed,
    /// newest first. Later steps can then be saved again.
    pub fn rollback(&self, step: u64) -> Result<Vec<u64>> {
        match self.call("Rollback", |id| Request::Rollback { id, step })? {
            Reply::RolledBack { removed, .. } => Ok(removed),
            other => Err(unexpected("Rollback", other)),
        }
    }

    /// The sidecar's status report.
    pub fn status(&self) -> Result<StatusReport> {
        match self.call("Status", |id| Request::Status { id })? {
            Reply::Status { report, .. } => Ok(report),
            other => Err(unexpected("Status", other)),
        }
    }

    /// Says Bye and closes. Saves already released still commit (this client
    /// will not hear of it); saves not yet released are aborted by the
    /// sidecar. Regions are unregistered by the session's end, then unmapped
    /// and unlinked here. Later calls fail with [`Error::Closed`].
    pub fn close(&self) {
        if self.check_owner().is_err() {
            // A forked child: the connection and the names are the parent's.
            // Its descriptors were closed by the fork handler (their numbers
            // may be reused by now), and its reader thread does not exist
            // here. The lock may be held for good by a thread of the parent
            // that was not forked: then leave everything as it is (the
            // child's exit releases its copies).
            let mut inner = match self.inner.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return,
            };
            if inner.closed {
                return;
            }
            inner.closed = true;
            if let Some(conn) = inner.conn.take() {
                std::mem::forget(conn);
            }
            for r in inner.regions.values() {
                r.keep_name_on_drop();
            }
            inner.regions.clear();
            inner.cuda_regions.clear();
            // The parent's events: CUDA is unusable in a forked child.
            std::mem::forget(std::mem::take(&mut inner.cuda_events));
            return;
        }
        let mut inner = self.lock_inner();
        if inner.closed {
            return;
        }
        inner.closed = true;
        if let Some(conn) = inner.conn.take() {
            let _ = send_frame(&conn.stream, &Request::Bye);
            {
                let mut st = self.lock_state();
                st.lose("this client closed the connection".to_string());
                st.gen += 1; // the reader's EOF belongs to the past now
            }
            self.shared.changed.notify_all();
            conn.shut();
        }
        inner.regions.clear();
        inner.cuda_regions.clear();
        self.retire_cuda_events(&mut inner);
    }

    /// Destroys this client's interprocess events once the sidecar can no
    /// longer use them: a request it has not answered may still have it
    /// polling one (a destroyed event's state is undefined: it could read
    /// as done before the trainer's work is). Those are left to the
    /// process's end (a few driver handles), never destroyed under it.
    fn retire_cuda_events(&self, inner: &mut Inner) {
        let events = std::mem::take(&mut inner.cuda_events);
        if self.lock_state().events_in_use() {
            std::mem::forget(events);
        }
    }

    // ---- internals ----

    fn check_owner(&self) -> Result<()> {
        if std::process::id() == self.owner_pid {
            Ok(())
        } else {
            Err(Error::Forked { owner_pid: self.owner_pid })
        }
    }

    fn lock_inner(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; go on.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait_changed<'a>(
        &self,
        st: MutexGuard<'a, State>,
        deadline: Option<Instant>,
    ) -> Result<MutexGuard<'a, State>, ()> {
        match deadline {
            None => Ok(self.shared.changed.wait(st).unwrap_or_else(|p| p.into_inner())),
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    return Err(());
                }
                let (st, _) = self.shared.changed.wait_timeout(st, d - now).unwrap_or_else(|p| p.into_inner());
                Ok(st)
            }
        }
    }

    /// Connects and shakes hands; on success the new connection is current.
    fn open(&self, inner: &mut Inner) -> Result<()> {
        let path = &self.socket_path;
        let mut stream = UnixStream::connect(path).map_err(|source| Error::Connect { path: path.clone(), source })?;
        let hs = |detail: String| Error::Handshake { path: path.clone(), detail };
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| hs(e.to_string()))?;
        send_frame(&stream, &ckpt_wire::hello(&self.name)).map_err(|e| hs(e.to_string()))?;
        let info = match ckpt_wire::read_frame::<Reply>(&mut stream) {
            Ok(Reply::Welcome { version, server_pid, dirs, staging_bytes }) => {
                if version != PROTOCOL_VERSION {
                    return Err(Error::Version { path: path.clone(), ours: PROTOCOL_VERSION, theirs: version });
                }
                ServerInfo { server_pid, dirs, staging_bytes }
            }
            Ok(Reply::Refused { reason }) => return Err(Error::Refused { path: path.clone(), reason }),
            Ok(other) => return Err(hs(format!("expected Welcome, got {other:?}"))),
            Err(FrameError::Io(e)) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(Error::Timeout {
                    what: format!("the sidecar at {} to answer Hello", path.display()),
                    timeout_ms: HANDSHAKE_TIMEOUT.as_millis() as u64,
                })
            }
            Err(FrameError::Closed) => {
                return Err(hs("the sidecar closed the connection without answering Hello".into()))
            }
            Err(e) => return Err(hs(e.to_string())),
        };
        stream.set_read_timeout(None).map_err(|e| hs(e.to_string()))?;
        let reader_stream = stream.try_clone().map_err(|e| hs(e.to_string()))?;
        fork_fd_register(stream.as_raw_fd());
        fork_fd_register(reader_stream.as_raw_fd());
        let gen = {
            let mut st = self.lock_state();
            st.gen += 1;
            st.dead = None;
            st.gen
        };
        let shared = self.shared.clone();
        let fds = (stream.as_raw_fd(), reader_stream.as_raw_fd());
        let reader = std::thread::Builder::new()
            .name("ckpt-shim-reader".into())
            .spawn(move || reader_loop(reader_stream, gen, shared))
            .map_err(|e| {
                fork_fd_unregister(fds.0);
                fork_fd_unregister(fds.1);
                hs(format!("cannot start the reader thread: {e}"))
            })?;
        inner.conn = Some(Conn { stream, gen, reader: Some(reader), info });
        Ok(())
    }

    /// The live connection, reconnecting (and re-registering every region)
    /// if the last one died.
    fn ensure_connected<'a>(&self, inner: &'a mut Inner) -> Result<&'a Conn> {
        self.check_owner()?;
        if inner.closed {
            return Err(Error::Closed);
        }
        let lost = {
            let st = self.lock_state();
            match &inner.conn {
                Some(c) if c.gen == st.gen && st.dead.is_none() => None,
                Some(_) => Some(st.dead.clone().unwrap_or_else(|| "the connection was replaced".into())),
                None => Some("not connected".into()),
            }
        };
        let Some(lost) = lost else {
            return Ok(inner.conn.as_ref().expect("checked above"));
        };
        if let Some(old) = inner.conn.take() {
            old.shut();
        }
        let fail = |e: Error| Error::Disconnected {
            reason: format!("{lost}; reconnecting to {} failed: {e}", self.socket_path.display()),
        };
        self.open(inner).map_err(fail)?;
        let timeout = inner.request_timeout;
        let conn = inner.conn.as_ref().expect("open sets it");
        for region in inner.regions.values() {
            if let Err(e) = self.register(conn, region, timeout) {
                let e = Error::Disconnected {
                    reason: format!(
                        "reconnected to {}, but re-registering region {} ({}) failed: {e}",
                        self.socket_path.display(),
                        region.region_id(),
                        region.shm_name()
                    ),
                };
                if let Some(c) = inner.conn.take() {
                    self.lock_state().lose(e.to_string());
                    c.shut();
                }
                return Err(e);
            }
        }
        for r in inner.cuda_regions.values() {
            if let Err(e) = self.register_cuda_on(conn, r, timeout, None) {
                let e = Error::Disconnected {
                    reason: format!(
                        "reconnected to {}, but re-registering CUDA region {} failed: {e}",
                        self.socket_path.display(),
                        r.region_id
                    ),
                };
                if let Some(c) = inner.conn.take() {
                    self.lock_state().lose(e.to_string());
                    c.shut();
                }
                return Err(e);
            }
        }
        Ok(inner.conn.as_ref().expect("still there"))
    }

    /// Registers `r` on `conn`; a VMM region's fd is `fd` (exported by
    /// the caller) or exported again now (a reconnect), and closed once sent.
    fn register_cuda_on(
        &self,
        conn: &Conn,
        r: &CudaRegion,
        timeout: Option<Duration>,
        fd: Option<std::os::fd::OwnedFd>,
    ) -> Result<()> {
        let (region_id, device, len_bytes) = (r.region_id, r.device, r.len_bytes);
        let reply = match &r.kind {
            CudaKind::Legacy(h) => {
                let ipc_handle = h.to_vec();
                let device_uuid = ckpt_cuda::uuid_of(device)?.to_vec();
                self.call_on(conn, timeout, "RegisterCudaRegion", |id| Request::RegisterCudaRegion {
                    id,
                    region_id,
                    device,
                    device_uuid,
                    ipc_handle,
                    len_bytes,
                })?
            }
            CudaKind::Vmm => {
                let fd = match fd {
                    Some(fd) => fd,
                    None => match ckpt_cuda::export(&ckpt_cuda::Allocation {
                        base: r.base,
                        len_bytes,
                        device,
                        buffer_id: r.buffer_id,
                    })? {
                        ckpt_cuda::Export::Vmm(fd) => fd,
                        ckpt_cuda::Export::Legacy(_) | ckpt_cuda::Export::Fabric(_) => {
                            return Err(Error::InvalidArgument(format!(
                                "CUDA region {region_id} at {:#x} is no longer a VMM allocation exportable as an fd",
                                r.base
                            )))
                        }
                    },
                };
                let device_uuid = ckpt_cuda::uuid_of(device)?.to_vec();
                let id = self.send_request_with_fd(conn, fd.as_raw_fd(), |id| Request::RegisterCudaVmmRegion {
                    id,
                    region_id,
                    device,
                    device_uuid,
                    fabric_handle: Vec::new(),
                    len_bytes,
                })?;
                drop(fd);
                self.await_reply(id, conn.gen, "the sidecar to answer RegisterCudaVmmRegion", timeout)?
            }
            CudaKind::Fabric(h) => {
                let (device_uuid, fabric_handle) = (ckpt_cuda::uuid_of(device)?.to_vec(), h.to_vec());
                self.call_on(conn, timeout, "RegisterCudaVmmRegion", |id| Request::RegisterCudaVmmRegion {
                    id,
                    region_id,
                    device,
                    device_uuid,
                    fabric_handle,
                    len_bytes,
                })?
            }
            CudaKind::Span { pieces, .. } => {
                let pieces = pieces.clone();
                self.call_on(conn, timeout, "RegisterCudaSpan", |id| Request::RegisterCudaSpan {
                    id,
                    region_id,
                    pieces,
                })?
            }
        };
        match reply {
            Reply::RegionRegistered { region_id: got, .. } if got == region_id => Ok(()),
            other => Err(unexpected("RegisterCudaRegion", other)),
        }
    }

    fn register(&self, conn: &Conn, region: &ShmRegion, timeout: Option<Duration>) -> Result<()> {
        let (region_id, shm_name, len_bytes, hand_over) =
            (region.region_id(), region.shm_name().to_string(), region.len_bytes(), region.hands_over());
        match self.call_on(conn, timeout, "RegisterRegion", |id| Request::RegisterRegion {
            id,
            region_id,
            shm_name,
            len_bytes,
            hand_over,
        })? {
            Reply::RegionRegistered { region_id: got, .. } if got == region_id => Ok(()),
            other => Err(unexpected("RegisterRegion", other)),
        }
    }

    /// Sends a request built for a fresh id; the id is marked as waited for.
    fn send_request(&self, conn: &Conn, make: impl FnOnce(u64) -> Request) -> Result<u64> {
        let id = {
            let mut st = self.lock_state();
            let id = st.next_id;
            st.next_id += 1;
            st.waiting.insert(id);
            id
        };
        if let Err(e) = send_frame(&conn.stream, &make(id)) {
            self.lock_state().waiting.remove(&id);
            return Err(e);
        }
        Ok(id)
    }

    /// As [`Client::send_request`], the frame carrying descriptor `fd`
    /// (SCM_RIGHTS on its first bytes).
    fn send_request_with_fd(&self, conn: &Conn, fd: i32, make: impl FnOnce(u64) -> Request) -> Result<u64> {
        let id = {
            let mut st = self.lock_state();
            let id = st.next_id;
            st.next_id += 1;
            st.waiting.insert(id);
            id
        };
        if let Err(e) = send_frame_with(&conn.stream, &make(id), Some(fd)) {
            self.lock_state().waiting.remove(&id);
            return Err(e);
        }
        Ok(id)
    }

    fn call(&self, what: &str, make: impl FnOnce(u64) -> Request) -> Result<Reply> {
        // Before the lock: in a forked child it may be held for good.
        self.check_owner()?;
        let mut inner = self.lock_inner();
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(&mut inner)?;
        let gen = conn.gen;
        let id = self.send_request(conn, make)?;
        drop(inner);
        self.await_reply(id, gen, &format!("the sidecar to answer {what}"), timeout)
    }

    fn call_on(
        &self,
        conn: &Conn,
        timeout: Option<Duration>,
        what: &str,
        make: impl FnOnce(u64) -> Request,
    ) -> Result<Reply> {
        let id = self.send_request(conn, make)?;
        self.await_reply(id, conn.gen, &format!("the sidecar to answer {what}"), timeout)
    }

    fn await_reply(&self, id: u64, gen: u64, what: &str, timeout: Option<Duration>) -> Result<Reply> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = self.lock_state();
        loop {
            if let Some(r) = st.replies.remove(&id) {
                st.waiting.remove(&id);
                return match r {
                    Reply::Error { code, message, .. } => Err(Error::Remote { code, message }),
                    r => Ok(r),
                };
            }
            if st.gen != gen || st.dead.is_some() {
                st.waiting.remove(&id);
                return Err(Error::Disconnected {
                    reason: st.dead.clone().unwrap_or_else(|| "the connection was replaced".into()),
                });
            }
            st = match self.wait_changed(st, deadline) {
                Ok(st) => st,
                Err(()) => {
                    let mut st = self.lock_state();
                    st.waiting.remove(&id);
                    st.replies.remove(&id);
                    return Err(Error::Timeout {
                        what: what.to_string(),
                        timeout_ms: timeout.map(|t| t.as_millis() as u64).unwrap_or(0),
                    });
                }
            };
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.close();
    }
}

fn unexpected(what: &str, reply: Reply) -> Error {
    Error::Protocol(format!("unexpected reply to {what}: {reply:?}"))
}

/// Whether CUDA region `r` (of `all`) still names the memory at its
/// address: the allocation there has the buffer id it was registered with
/// (each piece's, for a span); with no id from the driver, the same base
/// and length.
fn still_there(all: &BTreeMap<u32, CudaRegion>, r: &CudaRegion) -> bool {
    if !r.pieces().is_empty() {
        return r.pieces().iter().all(|p| all.get(p).is_some_and(|p| still_there(all, p)));
    }
    match r.buffer_id {
        0 => ckpt_cuda::allocation_of(r.base).is_ok_and(|a| a.base == r.base && a.len_bytes == r.len_bytes),
        id => ckpt_cuda::buffer_id(r.base).is_ok_and(|now| now == id),
    }
}

/// Turns tensor refs into descriptors: the region each lies in (host shm or
/// a CUDA allocation) and its offset.
fn describe(inner: &Inner, tensors: &[TensorRef]) -> Result<Vec<TensorDesc>> {
    tensors
        .iter()
        .map(|t| {
            let (region_id, offset_bytes) = locate(inner, t)?;
            Ok(TensorDesc {
                name: t.name.to_string(),
                dtype: t.dtype.to_string(),
                shape: t.shape.to_vec(),
                region_id,
                offset_bytes,
                len_bytes: t.len_bytes,
            })
        })
        .collect()
}

/// The region a tensor ref lies in (host shm or a CUDA allocation) and its offset there.
fn locate(inner: &Inner, t: &TensorRef) -> Result<(u32, u64)> {
    let regions = &inner.regions;
    let ptr = t.ptr as usize;
    let found =
        regions.values().find_map(|r| r.offset_of(ptr, t.len_bytes).map(|off| (r.region_id(), off))).or_else(|| {
            inner.cuda_regions.values().find_map(|r| r.offset_of(ptr as u64, t.len_bytes).map(|off| (r.region_id, off)))
        });
    match found {
        Some(f) => Ok(f),
        // A zero-byte tensor needs no region bytes: any region at offset 0.
        None if t.len_bytes == 0 => Ok((regions.keys().next().copied().unwrap_or(0), 0)),
        None => Err(Error::OutsideRegion { name: t.name.to_string(), ptr, len_bytes: t.len_bytes }),
    }
}
