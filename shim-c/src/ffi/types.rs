//! The ABI's types: the opaque client handle and the `#[repr(C)]`
//! descriptors a caller fills in (tensors, blobs, file pieces), with the
//! values of a file's finish.
//!
//! Invariant: the `#[repr(C)]` layouts are the header's (`include/ckpt.h`);
//! a field changes only with the header, which a test checks.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Mutex;

use super::load::LoadedC;
use crate::client::Client;

/// A connection to the sidecar, its shared-memory regions and saves (opaque).
pub struct ckpt_client {
    pub(crate) client: Client,
    /// What the last successful ckpt_load returned, with C strings for it.
    pub(super) last_load: Mutex<Option<LoadedC>>,
}

impl ckpt_client {
    /// `client` as a handle the caller owns (freed by ckpt_close).
    pub(crate) fn new_boxed(client: Client) -> *mut ckpt_client {
        Box::into_raw(Box::new(ckpt_client { client, last_load: Mutex::new(None) }))
    }
}

/// A tensor to save, or a place to load one into.
#[repr(C)]
pub struct ckpt_tensor {
    /// NUL-terminated UTF-8 name, unique within the checkpoint (e.g. "layers.0.weight").
    pub name: *const c_char,
    /// safetensors dtype: "F32", "BF16", "F16", "I64", "U8", ...
    pub dtype: *const c_char,
    /// `ndim` dimensions (may be NULL when ndim is 0).
    pub shape: *const u64,
    pub ndim: u32,
    /// Save: the tensor's bytes. Load: where to put them. Must lie inside memory from ckpt_alloc.
    pub data: *const c_void,
    /// Must equal the dtype's size times the product of the shape.
    pub len_bytes: u64,
}

/// One piece of a file for ckpt_save_file_pieces: `len_bytes` at `data`,
/// inside memory from ckpt_alloc or a CUDA allocation registered with
/// ckpt_register_cuda.
#[repr(C)]
pub struct ckpt_file_piece {
    pub data: *const c_void,
    pub len_bytes: u64,
}

/// ckpt_save_file_pieces: write the pieces as they are.
pub const CKPT_FILE_AS_IS: c_int = 0;
/// ckpt_save_file_pieces: the pieces make a torch.save zip archive written
/// under torch.serialization.skip_data() with its storages' bytes placed by
/// pieces; the sidecar computes the CRC-32s torch.save would have written.
pub const CKPT_FILE_TORCH_ZIP: c_int = 1;

/// A small named byte string saved beside the tensors (RNG state, data position, ...).
#[repr(C)]
pub struct ckpt_blob {
    /// NUL-terminated name (a plain file name: no '/', no "..").
    pub name: *const c_char,
    pub data: *const c_void,
    pub len_bytes: u64,
}

/// One tensor of the last successful load, as ckpt_loaded_tensors describes
/// it: what ckpt_loaded_tensor and ckpt_loaded_tensor_offset say, in one
/// entry. The strings and shape stay valid until the next load or
/// ckpt_close on this client.
#[repr(C)]
pub struct ckpt_loaded_tensor_info {
    /// NUL-terminated UTF-8 name.
    pub name: *const c_char,
    /// safetensors dtype.
    pub dtype: *const c_char,
    /// `ndim` dimensions.
    pub shape: *const u64,
    pub ndim: u32,
    pub len_bytes: u64,
    /// As ckpt_loaded_tensor_offset: where the tensor starts in a
    /// ckpt_load_packed's `data`, UINT64_MAX where it was not placed there.
    pub offset: u64,
}
