//! The values the client's API speaks in: tensor and blob references given
//! to a save or load, the regions tensors live in (host shared memory, CUDA
//! allocations), a save's handle and status, what a load returned and what
//! the sidecar said at the handshake; and where the socket is by default.
//!
//! None of these owns a connection: a [`TensorRef`]'s pointer is only
//! compared with region addresses, never dereferenced here.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ckpt_wire::{Blob, LoadSource, TensorInfo, SOCKET_ENV};

use crate::region::ShmRegion;

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
    pub(super) kind: CudaKind,
}

/// How a CUDA region is shared with the sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum CudaKind {
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

    pub(super) fn overlaps(&self, a: &ckpt_cuda::Allocation) -> bool {
        self.base < a.base.saturating_add(a.len_bytes) && a.base < self.base.saturating_add(self.len_bytes)
    }

    /// The offset of `len_bytes` at device address `ptr` in this allocation.
    pub(super) fn offset_of(&self, ptr: u64, len_bytes: u64) -> Option<u64> {
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

/// A save issued by [`super::Client::save`] or [`super::Client::save_file`] (step 0).
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
    /// [`super::Client::wait_replicated`] saw it.
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
    /// [`super::Client::load_packed`] only (else empty): where `tensors[i]` starts,
    /// from the start of the memory given ([`ckpt_wire::NOT_PLACED`] for a
    /// tensor stored in slices, not contiguous there).
    pub offsets: Vec<u64>,
    /// [`super::Client::load_packed`] only (else 0): the bytes the checkpoint needs;
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
