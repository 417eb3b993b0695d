//! Serving a LoadPacked: the checkpoint read from disk straight into the
//! client's region (O_DIRECT into a writable mapping of it, no staging, no
//! copy), or copied there from the resident image; a region too small is
//! answered with the bytes it needs.
//!
//! Invariant: as for a Load (`crate::load`), nothing unverified reaches the
//! client: its region's bytes are only the verified checkpoint's.

use crate::memory::regions::shm::Writable;
use crate::memory::regions::{Region, ShmMemory};
use crate::memory::staging::Resident;
use crate::state::refusal::Refusal;
use crate::state::reply::Replies;
use crate::state::DaemonState;
use ckpt_store::catalog;
use ckpt_store::format::Index;
use ckpt_store::restore::{self, LoadError, Which};
use ckpt_wire::{Blob, ErrorCode, LoadSource, Reply, TensorInfo};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tracing::{info, warn};

use super::{other_nodes_files, remote_source, served_from_index, Origin};

impl super::FellBack for PlacedReply {
    fn fell_back_mut(&mut self) -> &mut Vec<String> {
        &mut self.fell_back
    }
}

/// What a LoadPacked serves: step, source, tensors, their offsets, the
/// bytes needed, blobs, fell_back.
struct PlacedReply {
    step: u64,
    source: LoadSource,
    tensors: Vec<TensorInfo>,
    offsets: Vec<u64>,
    need_bytes: u64,
    blobs: Vec<Blob>,
    fell_back: Vec<String>,
}

/// Where a LoadPacked puts the checkpoint: `len_bytes` at `offset_bytes` of
/// host region `region_id`.
#[derive(Clone, Copy)]
pub struct PackedRange {
    pub region_id: u32,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

/// LoadPacked: every tensor of the checkpoint into one range of a host
/// region, at offsets the sidecar chooses. From disk the shard images are
/// read straight into the region (O_DIRECT into a writable mapping of it,
/// no staging, no copy) and verified there; from the resident image each
/// tensor is checked, then copied to its offset in the file image. Nothing
/// is written when the range is too small: the reply says how much is needed.
pub fn run_load_packed(
    state: &DaemonState,
    regions: &HashMap<u32, Arc<Region>>,
    replies: &Arc<Replies>,
    id: u64,
    step: Option<u64>,
    into: PackedRange,
) {
    let t0 = Instant::now();
    let len_bytes = into.len_bytes;
    let reply = match load_packed(state, regions, step, into) {
        Ok(p) => {
            let placed = p.need_bytes <= len_bytes;
            info!(step = p.step, source = ?p.source, from = super::read_from(state, p.source), n_tensors = p.tensors.len(), need_bytes = p.need_bytes, placed, seconds = t0.elapsed().as_secs_f64(), "loaded (packed)");
            if placed {
                crate::state::metrics::record_load(Ok((p.source, !p.fell_back.is_empty())));
            }
            Reply::Placed {
                id,
                step: p.step,
                source: p.source,
                tensors: p.tensors,
                offsets: p.offsets,
                need_bytes: p.need_bytes,
                blobs: p.blobs,
                fell_back: p.fell_back,
            }
        }
        Err(r) => {
            info!(?step, code = ?r.code, "load (packed) failed: {}", r.reason);
            crate::state::metrics::record_load(Err(r.code));
            r.error(id)
        }
    };
    replies.send(&reply);
}

fn load_packed(
    state: &DaemonState,
    regions: &HashMap<u32, Arc<Region>>,
    step: Option<u64>,
    into: PackedRange,
) -> Result<PlacedReply, Refusal> {
    if let Some(placed) = other_nodes_files(state, step, None, |origin, s| {
        load_packed_from(state, regions, origin, Some(s), into, false)
    })? {
        return Ok(placed);
    }
    let remote = remote_source(state, step)?;
    match &remote {
        // A local copy that is damaged: the drain target's, if it has one.
        None => match (
            load_packed_from(state, regions, Origin::Dir(state.read_dir(), None), step, into, true),
            step,
            &state.drain,
        ) {
            (Err(Refusal { code: ErrorCode::Damaged, reason: why }), Some(s), Some(d))
                if state.shared_dir.is_none() =>
            {
                let r = d.remote_copy(s).map_err(|_| Refusal::new(ErrorCode::Damaged, why.clone()))?;
                warn!(step = s, url = d.url(), "local copy damaged ({why}); loading the drain target's");
                let mut placed = load_packed_from(state, regions, Origin::of(&r), Some(s), into, false)?;
                placed.fell_back.insert(0, format!("step {s}: local copy damaged, read from {}: {why}", d.url()));
                Ok(placed)
            }
            (r, ..) => r,
        },
        Some(r) => {
            let mut placed = load_packed_from(state, regions, Origin::of(r), Some(r.step), into, false)?;
            placed.fell_back.splice(0..0, r.fell_back.iter().cloned());
            Ok(placed)
        }
    }
}

/// A LoadPacked from `origin` (`ram`: the resident image may serve it; a
/// checkpoint directory's only).
/// A LoadPacked's answer when the load range is too small for `step`:
/// what it needs, from its index, with nothing read.
fn too_small(step: u64, index: &Index, need_bytes: u64) -> PlacedReply {
    PlacedReply {
        step,
        source: LoadSource::Disk,
        tensors: index
            .logical()
            .iter()
            .map(|t| TensorInfo {
                name: t.name.to_string(),
                dtype: t.dtype.as_str().into(),
                shape: t.shape.to_vec(),
                len_bytes: t.len_bytes(),
            })
            .collect(),
        offsets: Vec::new(),
        need_bytes,
        blobs: Vec::new(),
        fell_back: Vec::new(),
    }
}

/// A LoadPacked served from the resident image (the step asked for, as
/// committed): each tensor checked against its checksum, then copied into
/// the client's region's load range (`offset_bytes`, `len_bytes`, checked
/// to lie inside the region, which `map` covers).
fn packed_from_resident(
    r: &Resident,
    shm: &ShmMemory,
    map: &Writable<'_>,
    offset_bytes: u64,
    len_bytes: u64,
) -> Result<PlacedReply, Refusal> {
    // SAFETY (of the pointer arithmetic below): offset_bytes + len_bytes lie
    // inside the region (the caller checked), and the mapping covers it.
    let dest = map.ptr().wrapping_add(offset_bytes as usize);
    // In the image's order: the copy below reads and writes straight
    // through, and a client that walks its state in the order it saved it
    // (the layout keeps that order within a dtype) finds the tensors in
    // the order it asks for them.
    let mut order: Vec<usize> = (0..r.layout.specs.len()).collect();
    order.sort_by_key(|&i| r.layout.tensor_range(i).start);
    let need_bytes =
        r.layout.specs.iter().enumerate().map(|(i, _)| r.layout.tensor_range(i).end as u64).max().unwrap_or(0);
    let tensors = order
        .iter()
        .map(|&i| {
            let s = &r.layout.specs[i];
            TensorInfo {
                name: s.name.clone(),
                dtype: s.dtype.as_str().into(),
                shape: s.shape.clone(),
                len_bytes: r.layout.tensor_range(i).len() as u64,
            }
        })
        .collect();
    if need_bytes > len_bytes {
        return Ok(PlacedReply {
            step: r.step,
            source: LoadSource::Ram,
            tensors,
            offsets: Vec::new(),
            need_bytes,
            blobs: Vec::new(),
            fell_back: Vec::new(),
        });
    }
    let image = r.lease.as_slice();
    for &i in &order {
        let range = r.layout.tensor_range(i);
        let bytes = &image[range.clone()];
        let got = ckpt_store::image::crc32c_parallel(bytes);
        if got != r.crcs[i] {
            let name = &r.layout.specs[i].name;
            return Err(Refusal::new(
                ErrorCode::Damaged,
                format!(
                    "tensor {name:?}: checksum mismatch in memory ({:#010x} expected, {got:#010x} found)",
                    r.crcs[i]
                ),
            ));
        }
        // SAFETY: range.end ≤ need_bytes ≤ len_bytes, so the copy stays in
        // the load range of the mapping; the source is our own lease.
        map.run(|| unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dest.add(range.start), bytes.len()) });
    }
    shm.check_intact().map_err(|e| Refusal::new(ErrorCode::BadRegion, e.to_string()))?;
    let offsets = order.iter().map(|&i| r.layout.tensor_range(i).start as u64).collect();
    Ok(PlacedReply {
        step: r.step,
        source: LoadSource::Ram,
        tensors,
        offsets,
        need_bytes,
        blobs: r.blobs.clone(),
        fell_back: Vec::new(),
    })
}

fn load_packed_from(
    state: &DaemonState,
    regions: &HashMap<u32, Arc<Region>>,
    origin: Origin<'_>,
    step: Option<u64>,
    into: PackedRange,
    ram: bool,
) -> Result<PlacedReply, Refusal> {
    let PackedRange { region_id, offset_bytes, len_bytes } = into;
    let region = regions
        .get(&region_id)
        .ok_or_else(|| Refusal::new(ErrorCode::BadRegion, format!("region {region_id} is not registered")))?;
    region
        .contains(offset_bytes, len_bytes)
        .map_err(|e| Refusal::new(ErrorCode::BadRegion, format!("load range: {e}")))?;
    let shm = region.as_shm().ok_or_else(|| {
        Refusal::new(
            ErrorCode::BadRegion,
            format!("region {region_id} is device memory; a packed load needs a host region"),
        )
    })?;
    if offset_bytes % ckpt_store::config::DIRECT_ALIGN_BYTES as u64 != 0 {
        return Err(Refusal::new(
            ErrorCode::BadRequest,
            format!("load offset {offset_bytes} is not a multiple of {} bytes", ckpt_store::config::DIRECT_ALIGN_BYTES),
        ));
    }
    shm.check_intact().map_err(|e| Refusal::new(ErrorCode::BadRegion, e.to_string()))?;
    let resident = if state.shared_dir.is_some() || !ram { None } else { state.staging.resident() };
    let which = step.map_or(Which::Latest, Which::Step);
    let wanted = origin.first_step(which);
    let map = shm.map_writable().map_err(|e| Refusal::new(ErrorCode::BadRegion, e.to_string()))?;
    // SAFETY (of the pointer arithmetic below): offset_bytes + len_bytes lie
    // inside the region (checked above), and the mapping covers the region.
    let dest = map.ptr().wrapping_add(offset_bytes as usize);
    if let Some(r) = resident.filter(|r| {
        wanted == Some(r.step) && origin.dir().is_some_and(|primary| catalog::is_committed(primary, r.step))
    }) {
        return packed_from_resident(&r, shm, &map, offset_bytes, len_bytes);
    }
    // Disk (or the drain target): straight into the region. Too small for
    // the first candidate: say what it needs, from its index, before
    // reading anything. An object store's index is at hand; a directory's
    // is parsed by the read itself, which checks the size before it reads
    // a byte (BufferTooSmall below): a second parse of a 100k-tensor index
    // here cost a third of the load.
    if let (Some(s), Origin::Remote(_)) = (wanted, origin) {
        if let Ok(index) = origin.index(s) {
            let need_bytes = restore::load_len_bytes(&index);
            if need_bytes > len_bytes {
                return Ok(too_small(s, &index, need_bytes));
            }
        }
    }
    // SAFETY: dest is page-aligned (the mapping is, and offset_bytes is a
    // multiple of the O_DIRECT block) and valid for len_bytes for as long as
    // `map` lives; every reader thread touches it only inside `map.run`,
    // where a fault of a shrunk or unbacked segment is handled (and the
    // kernel's reads into such pages fail with EFAULT, no signal).
    let r = unsafe {
        origin.read_into_raw(which, &state.read_opts, dest, len_bytes as usize, &IntoRegion { map: &map, shm })
    };
    let p = match r {
        Ok(p) => p,
        Err(LoadError::BufferTooSmall { step, need_bytes, .. }) => {
            // (A fallback to an older, larger checkpoint, maybe.) The index
            // the read parsed is kept for the retry: listed from there.
            if let (Origin::Dir(dir, _), Some(k)) = (origin, state.read_opts.kept_index.as_ref()) {
                if let Some(reply) = k.with(dir, step, |index| too_small(step, index, need_bytes)) {
                    return Ok(reply);
                }
            }
            let index = origin.index(step)?;
            return Ok(too_small(step, &index, need_bytes));
        }
        Err(e @ LoadError::Destination { .. }) => {
            let m = e.to_string();
            let m = if m.contains(&shm.shm_name) { m } else { format!("shm segment {:?}: {m}", shm.shm_name) };
            return Err(Refusal::new(ErrorCode::BadRegion, m));
        }
        Err(e) => return Err(super::refuse(state, origin, e)),
    };
    shm.check_intact().map_err(|e| Refusal::new(ErrorCode::BadRegion, e.to_string()))?;
    let (_, source, tensors, blobs, fell_back) =
        served_from_index(p.step, &p.index, &p.blobs, &p.fell_back, origin.is_local(state));
    // Listed in the order they lie in the region, as from the resident
    // image (those not placed last).
    let mut placed: Vec<(u64, TensorInfo)> = tensors
        .into_iter()
        .map(|t| (p.logical_range(&t.name).map_or(ckpt_wire::NOT_PLACED, |r| r.start as u64), t))
        .collect();
    placed.sort_by_key(|(at, _)| *at);
    let (offsets, tensors) = placed.into_iter().unzip();
    info!(step = p.step, bytes = p.bytes, read_seconds = p.seconds, engine = %p.engine, "read into the client's region");
    let need_bytes = restore::load_len_bytes(&p.index);
    // Kept for the next load of the step from this directory (the other
    // ranks of a resumed node read the same index: 40 MB at 100k tensors).
    if let (Origin::Dir(dir, _), Some(k), Some(s)) = (origin, state.read_opts.kept_index.as_ref(), p.index_stamp) {
        k.keep(dir, p.step, s, p.index);
    }
    Ok(PlacedReply { step: p.step, source, tensors, offsets, need_bytes, blobs, fell_back })
}

/// A LoadPacked's destination as the reader sees it: every access inside the
/// region's armed span, and the region's own check after a step failed, so
/// a segment its client shrank (or a /dev/shm too full to back it) is this
/// load's error, never damage of the checkpoint nor a reason to fall back.
struct IntoRegion<'a> {
    map: &'a crate::memory::regions::shm::Writable<'a>,
    shm: &'a crate::memory::regions::shm::ShmMemory,
}

impl restore::ReadDest for IntoRegion<'_> {
    fn run(&self, work: &mut dyn FnMut()) {
        self.map.run(work)
    }

    fn check(&self) -> Result<(), String> {
        self.shm.check_intact().map_err(|e| e.to_string())
    }

    fn foreign(&self) -> bool {
        true
    }
}
