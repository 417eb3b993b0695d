//! Serving a Load: the requested checkpoint from the resident image in
//! staging when it is the one asked for (source Ram), else read from disk
//! with every checksum verified (source Disk) into a staging lease, then the
//! requested tensors written into the client's regions with pwrite.
//!
//! Invariants: nothing unverified reaches a client, and nothing at all when
//! any tensor is damaged (RAM bytes of every tensor asked for are checked
//! against their checksums before the first is written; disk reads go
//! through `restore::load_into`, whole); a descriptor is used only after its dtype,
//! shape and length equal the checkpoint's and its bytes lie inside its
//! region; the load borrows staging rather than allocating, unless the
//! checkpoint is larger than the whole budget (then it allocates, and says so).
//! Tensors are named as readers see them (`Index::logical`): a tensor that
//! several ranks stored in slices is listed and loaded whole, each slice
//! written at its offset in the descriptor's range.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use ckpt_wire::{Blob, ErrorCode, LoadSource, Reply, TensorDesc, TensorInfo};
use tracing::{info, warn};

use crate::drain::{RemoteCkpt, RemoteFrom, RemoteStep};
use crate::memory::regions::Region;
use crate::memory::staging::StagingError;
use crate::save::checks::{check_desc_shape, check_no_overlap};
use crate::state::damage::{self, Finder};
use crate::state::refusal::Refusal;
use crate::state::reply::Replies;
use crate::state::DaemonState;
use ckpt_store::catalog;
use ckpt_store::fetch::FetchFiles;
use ckpt_store::format::Index;
use ckpt_store::restore::{self, LoadError, Placed, Which};

mod packed;
pub use packed::{run_load_packed, PackedRange};

impl From<LoadError> for Refusal {
    fn from(e: LoadError) -> Refusal {
        let code = match &e {
            LoadError::NoCheckpoint { .. } | LoadError::NotCommitted { .. } | LoadError::OnAnotherNode { .. } => {
                ErrorCode::NotFound
            }
            LoadError::Damaged { .. } | LoadError::NoneLoads { .. } => ErrorCode::Damaged,
            LoadError::Io { .. } | LoadError::Probe(_) | LoadError::BufferTooSmall { .. } => ErrorCode::Io,
            // The client's region failed under the load: its error, not the checkpoint's.
            LoadError::Destination { .. } => ErrorCode::BadRegion,
        };
        Refusal::new(code, e.to_string())
    }
}

/// One tensor of the checkpoint being served: what it is and its bytes,
/// in one piece or, for a tensor stored in slices, several (each at its
/// byte offset in the whole tensor).
struct Have<'a> {
    dtype: &'a str,
    shape: &'a [u64],
    pieces: Vec<(u64, &'a [u8])>,
    /// Checked against the bytes before they go out (RAM only, whole
    /// tensors; disk bytes were checked as they were read).
    crc32c: Option<u32>,
}

impl Have<'_> {
    fn len_bytes(&self) -> u64 {
        self.pieces.iter().map(|(_, b)| b.len() as u64).sum()
    }
}

/// A tensor by name from a verified index: a stored tensor, or a logical
/// one put together from its slices; `bytes(stored name)` finds a stored
/// tensor's bytes in memory.
fn from_index<'a>(index: &'a Index, name: &str, bytes: impl Fn(&str) -> Option<&'a [u8]>) -> Option<Have<'a>> {
    let t = index.logical_tensor(name)?;
    let size = t.dtype.size_bytes();
    let pieces = t.slices.iter().map(|s| Some((s.elems[0] * size, bytes(s.tensor)?))).collect::<Option<Vec<_>>>()?;
    Some(Have { dtype: t.dtype.as_str(), shape: t.shape, pieces, crc32c: None })
}

pub fn run_load(
    state: &DaemonState,
    replies: &Arc<Replies>,
    regions: &HashMap<u32, Arc<Region>>,
    id: u64,
    step: Option<u64>,
    descs: Vec<TensorDesc>,
) {
    let t0 = Instant::now();
    let reply = match load(state, replies, regions, step, &descs) {
        Ok((step, source, tensors, blobs, fell_back)) => {
            info!(
                step,
                ?source,
                from = read_from(state, source),
                n_tensors = descs.len(),
                seconds = t0.elapsed().as_secs_f64(),
                "loaded"
            );
            crate::state::metrics::record_load(Ok((source, !fell_back.is_empty())));
            Reply::Loaded { id, step, source, tensors, blobs, fell_back }
        }
        Err(r) => {
            info!(?step, code = ?r.code, "load failed: {}", r.reason);
            crate::state::metrics::record_load(Err(r.code));
            r.error(id)
        }
    };
    replies.send(&reply);
}

/// Where a load of `source` read the step, for the log: the resident
/// image, the directory, or the drain target's URL.
fn read_from(state: &DaemonState, source: LoadSource) -> String {
    match (source, &state.drain) {
        (LoadSource::Ram, _) => "the resident image in staging".into(),
        (LoadSource::Drain, Some(d)) => d.url().to_string(),
        _ => state.read_dir().display().to_string(),
    }
}

type Served = (u64, LoadSource, Vec<TensorInfo>, Vec<Blob>, Vec<String>);

fn check_descs(regions: &HashMap<u32, Arc<Region>>, descs: &[TensorDesc]) -> Result<(), Refusal> {
    if descs.len() > crate::config::TENSORS_PER_REQUEST_MAX {
        return Err(Refusal::new(
            ErrorCode::BadRequest,
            format!("{} tensors; at most {} per load", descs.len(), crate::config::TENSORS_PER_REQUEST_MAX),
        ));
    }
    let mut seen = HashSet::new();
    for d in descs {
        if !seen.insert(d.name.as_str()) {
            return Err(Refusal::new(ErrorCode::BadRequest, format!("tensor {:?} asked for twice", d.name)));
        }
        check_desc_shape(d).map_err(|e| Refusal::new(ErrorCode::BadRequest, e))?;
        if d.len_bytes > 0 {
            let r = regions.get(&d.region_id).ok_or_else(|| {
                Refusal::new(
                    ErrorCode::BadRegion,
                    format!("tensor {:?}: region {} is not registered", d.name, d.region_id),
                )
            })?;
            r.contains(d.offset_bytes, d.len_bytes)
                .map_err(|e| Refusal::new(ErrorCode::BadRegion, format!("tensor {:?}: {e}", d.name)))?;
        }
    }
    check_no_overlap(descs).map_err(|e| Refusal::new(ErrorCode::BadRequest, e))
}

/// Checks every descriptor against the checkpoint, then writes the bytes.
fn deliver<'a>(
    regions: &HashMap<u32, Arc<Region>>,
    descs: &[TensorDesc],
    lookup: impl Fn(&str) -> Option<Have<'a>>,
) -> Result<(), Refusal> {
    let mut haves = Vec::with_capacity(descs.len());
    for d in descs {
        let h = lookup(&d.name).ok_or_else(|| {
            Refusal::new(ErrorCode::NotFound, format!("tensor {:?} is not in the checkpoint", d.name))
        })?;
        if h.dtype != d.dtype || h.shape != d.shape.as_slice() || h.len_bytes() != d.len_bytes {
            return Err(Refusal::new(
                ErrorCode::BadRequest,
                format!(
                    "tensor {:?}: the checkpoint has {} {:?} ({} bytes), the request says {} {:?} ({} bytes)",
                    d.name,
                    h.dtype,
                    h.shape,
                    h.len_bytes(),
                    d.dtype,
                    d.shape,
                    d.len_bytes
                ),
            ));
        }
        haves.push(h);
    }
    // Every checksum before any write: a damaged tensor leaves the client's
    // memory as it was, not half loaded (load_into counts on it).
    for (d, h) in descs.iter().zip(&haves) {
        if let (Some(want), [(_, bytes)]) = (h.crc32c, h.pieces.as_slice()) {
            let got = ckpt_store::image::crc32c_parallel(bytes);
            if got != want {
                return Err(Refusal::new(
                    ErrorCode::Damaged,
                    format!(
                        "tensor {:?}: checksum mismatch in memory ({want:#010x} expected, {got:#010x} found)",
                        d.name
                    ),
                ));
            }
        }
    }
    for (d, h) in descs.iter().zip(haves) {
        if d.len_bytes == 0 {
            continue;
        }
        let r = regions.get(&d.region_id).expect("checked in check_descs");
        for (at, bytes) in &h.pieces {
            // Inside the descriptor's range: the pieces' lengths sum to len_bytes (checked above).
            r.write_at(d.offset_bytes + at, bytes)
                .map_err(|e| Refusal::new(ErrorCode::BadRegion, format!("tensor {:?}: {e}", d.name)))?;
        }
    }
    Ok(())
}

/// A served load's notes of what it passed over (`fell_back`), for the
/// sources [`other_nodes_files`] skipped.
trait FellBack {
    fn fell_back_mut(&mut self) -> &mut Vec<String>;
}

impl FellBack for Served {
    fn fell_back_mut(&mut self) -> &mut Vec<String> {
        &mut self.4
    }
}

/// Several nodes with node-local files, and peers or a drain target: a
/// load of `step` (None: latest) that needs a file another node holds, or
/// one of this node's own that its disks lost (a replaced node; `descs`:
/// the tensors asked for; None: all), reads this node's files from its own
/// disks and fetches the others straight into the load's memory: from the
/// peers first, then the drain target (`load`, from the shared directory
/// with the fetcher, for step `s`). A peer passed over is named in the
/// load's `fell_back`. None: no such file, or neither source (the local
/// read then says which node holds it).
fn other_nodes_files<T: FellBack>(
    state: &DaemonState,
    step: Option<u64>,
    descs: Option<&[TensorDesc]>,
    load: impl FnOnce(Origin<'_>, u64) -> Result<T, Refusal>,
) -> Result<Option<T>, Refusal> {
    let Some(me) = &state.read_opts.node else { return Ok(None) };
    if state.drain.is_none() && state.peers.is_none() {
        return Ok(None);
    }
    let Some(s) = step.or_else(|| catalog::latest_step(state.read_dir()).ok().flatten()) else { return Ok(None) };
    let Ok(index) = restore::read_index(state.read_dir(), s) else { return Ok(None) };
    let opts = restore::ReadOptions {
        only_tensors: descs.map(|ds| ds.iter().map(|x| x.name.clone()).collect()),
        ..state.read_opts.clone()
    };
    let missing = restore::own_files_missing(&index, s, &opts);
    let node = match (restore::held_elsewhere(&index, &opts), missing.first()) {
        (Some(node), _) => node,
        (None, Some(_)) => me.id.clone(),
        (None, None) => return Ok(None),
    };
    let n_fetched = missing.len()
        + index.ckpt.files.iter().filter(|f| index.holder(&f.name).is_some_and(|(id, _)| id != me.id)).count();
    let cannot = |m: String| {
        let whose = if node == me.id {
            "this node's disks lost some of its files".to_string()
        } else {
            format!("node {node:?} holds some of its files on its own disks")
        };
        Refusal::new(ErrorCode::NotFound, format!("step {s}: {whose}, and the drain target cannot give them: {m}"))
    };
    let remote = match &state.drain {
        Some(d) => match d.remote_files(s, n_fetched) {
            Ok(r) => Some(r),
            // The peers may hold them still.
            Err((_, m)) if state.peers.is_some() => {
                info!(
                    step = s,
                    url = d.url(),
                    "the drain target cannot give the step's files ({m}); asking the peers only"
                );
                None
            }
            Err((_, m)) => return Err(cannot(m)),
        },
        None => None,
    };
    let Some(p) = &state.peers else {
        let r = remote.expect("a drain target when there are no peers");
        let url = state.drain.as_ref().map_or("", |d| d.url());
        info!(step = s, node, url, "loading from the drain target: another node holds some of the step's files, or this node's disks lost them (this node's own are read from its disks)");
        return load(Origin::Dir(state.read_dir(), Some(&r)), s).map(Some);
    };
    let then = remote.map(|r| Box::new(r) as Box<dyn FetchFiles + Send>);
    let from = p.fetcher(s, index).then(then);
    info!(step = s, node, source = from.label(), files = n_fetched, "loading from the peers: another node holds some of the step's files, or this node's disks lost them (this node's own are read from its disks)");
    let mut served = load(Origin::Dir(state.read_dir(), Some(&from)), s)?;
    served.fell_back_mut().splice(0..0, from.skipped());
    Ok(Some(served))
}

/// With a drain target (`crate::drain`): the remote step a load of `step`
/// (None: latest) reads, when it is not committed locally or (latest) the
/// target holds a newer one; None: the local directories.
fn remote_source(state: &DaemonState, step: Option<u64>) -> Result<Option<crate::drain::RemoteCkpt>, Refusal> {
    let Some(d) = state.drain.as_ref().filter(|_| state.shared_dir.is_none()) else { return Ok(None) };
    let local_latest = catalog::latest_step(state.read_dir()).ok().flatten();
    let r = d.remote_source(step, local_latest).map_err(|(code, m)| Refusal::new(code, m))?;
    if let Some(r) = &r {
        info!(
            step = r.step,
            url = d.url(),
            "loading from the drain target (not in the local directories, or newer there)"
        );
    }
    Ok(r)
}

fn load(
    state: &DaemonState,
    replies: &Arc<Replies>,
    regions: &HashMap<u32, Arc<Region>>,
    step: Option<u64>,
    descs: &[TensorDesc],
) -> Result<Served, Refusal> {
    check_descs(regions, descs)?;
    if let Some(served) = other_nodes_files(state, step, Some(descs), |origin, s| {
        load_from(state, replies, regions, origin, Some(s), descs, false)
    })? {
        return Ok(served);
    }
    let remote = remote_source(state, step)?;
    match &remote {
        // A local copy that is damaged: the drain target's, if it has one.
        None => match (
            load_from(state, replies, regions, Origin::Dir(state.read_dir(), None), step, descs, true),
            step,
            &state.drain,
        ) {
            (Err(Refusal { code: ErrorCode::Damaged, reason: why }), Some(s), Some(d))
                if state.shared_dir.is_none() =>
            {
                let r = d.remote_copy(s).map_err(|_| Refusal::new(ErrorCode::Damaged, why.clone()))?;
                warn!(step = s, url = d.url(), "local copy damaged ({why}); loading the drain target's");
                let mut served = load_from(state, replies, regions, Origin::of(&r), Some(s), descs, false)?;
                served.4.insert(0, format!("step {s}: local copy damaged, read from {}: {why}", d.url()));
                Ok(served)
            }
            (r, ..) => r,
        },
        Some(r) => {
            let mut served = load_from(state, replies, regions, Origin::of(r), Some(r.step), descs, false)?;
            served.4.splice(0..0, r.fell_back.iter().cloned());
            Ok(served)
        }
    }
}

/// Where a load reads the checkpoint from.
#[derive(Clone, Copy)]
enum Origin<'a> {
    /// A checkpoint directory (this node's, or a `file://` drain target's);
    /// a file another node holds is fetched from the source when given.
    Dir(&'a std::path::Path, Option<&'a dyn FetchFiles>),
    /// A step only an object store holds: every file streamed into the
    /// load's memory, no local copy (`crate::drain::remote_source`).
    Remote(&'a RemoteStep),
}

impl<'a> Origin<'a> {
    fn of(r: &'a RemoteCkpt) -> Origin<'a> {
        match &r.from {
            RemoteFrom::Dir(dir) => Origin::Dir(dir, None),
            RemoteFrom::Stream(rs) => Origin::Remote(rs),
        }
    }

    /// Whether this is the sidecar's own directory (else the drain target).
    fn is_local(self, state: &DaemonState) -> bool {
        self.dir() == Some(state.read_dir())
    }

    /// The checkpoint directory, if it is one.
    fn dir(self) -> Option<&'a std::path::Path> {
        match self {
            Origin::Dir(dir, _) => Some(dir),
            Origin::Remote(_) => None,
        }
    }

    /// The step `which` tries first.
    fn first_step(self, which: Which) -> Option<u64> {
        match (which, self) {
            (Which::Step(s), _) => Some(s),
            (Which::Latest, Origin::Dir(dir, _)) => catalog::latest_step(dir).ok().flatten(),
            (Which::Latest, Origin::Remote(r)) => Some(r.step),
        }
    }

    /// The index of `step`.
    fn index(self, step: u64) -> Result<std::borrow::Cow<'a, Index>, LoadError> {
        match self {
            Origin::Dir(dir, _) => restore::read_index(dir, step).map(std::borrow::Cow::Owned),
            Origin::Remote(r) => Ok(std::borrow::Cow::Borrowed(&r.index)),
        }
    }

    /// Reads and verifies the checkpoint into `dest`.
    fn read_into(self, which: Which, opts: &restore::ReadOptions, dest: &mut [u8]) -> Result<Placed, LoadError> {
        match self {
            Origin::Dir(dir, remote) => restore::load_into_with(dir, which, opts, remote, dest),
            Origin::Remote(r) => ckpt_store::fetch::load_remote_into(&r.index_bytes, r.step, r, dest),
        }
    }

    /// [`Origin::read_into`] by address.
    ///
    /// # Safety
    /// As `restore::load_into_raw`.
    unsafe fn read_into_raw(
        self,
        which: Which,
        opts: &restore::ReadOptions,
        dest: *mut u8,
        dest_len: usize,
        guard: &dyn restore::ReadDest,
    ) -> Result<Placed, LoadError> {
        match self {
            // SAFETY: this function's contract, passed on.
            Origin::Dir(dir, remote) => unsafe {
                restore::load_into_raw_with(dir, which, opts, remote, dest, dest_len, guard)
            },
            // SAFETY: this function's contract, passed on.
            Origin::Remote(r) => unsafe {
                ckpt_store::fetch::load_remote_into_raw(&r.index_bytes, r.step, r, dest, dest_len, guard)
            },
        }
    }
}

/// A Load from `origin` (`ram`: the resident image may serve it; a
/// checkpoint directory's only).
fn load_from(
    state: &DaemonState,
    replies: &Arc<Replies>,
    regions: &HashMap<u32, Arc<Region>>,
    origin: Origin<'_>,
    step: Option<u64>,
    descs: &[TensorDesc],
    ram: bool,
) -> Result<Served, Refusal> {
    // Several nodes: checkpoints are read from the shared directory, where
    // the multi-rank steps are committed; the resident image (a step of
    // this node's own directory) is never theirs.
    let resident = if state.shared_dir.is_some() || !ram { None } else { state.staging.resident() };
    // RAM: the resident image, if it is the checkpoint asked for.
    if let (Some(r), Some(primary)) = (resident, origin.dir()) {
        let wanted = match step {
            Some(s) => Some(s),
            None => catalog::latest_step(primary).ok().flatten(),
        };
        if wanted == Some(r.step) && catalog::is_committed(primary, r.step) {
            let by_name: HashMap<&str, usize> =
                r.layout.specs.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
            let image = r.lease.as_slice();
            deliver(regions, descs, |name| {
                let &i = by_name.get(name)?;
                let s = &r.layout.specs[i];
                Some(Have {
                    dtype: s.dtype.as_str(),
                    shape: &s.shape,
                    pieces: vec![(0, &image[r.layout.tensor_range(i)])],
                    crc32c: Some(r.crcs[i]),
                })
            })?;
            let mut tensors: Vec<TensorInfo> = r
                .layout
                .specs
                .iter()
                .enumerate()
                .map(|(i, s)| TensorInfo {
                    name: s.name.clone(),
                    dtype: s.dtype.as_str().into(),
                    shape: s.shape.clone(),
                    len_bytes: r.layout.tensor_range(i).len() as u64,
                })
                .collect();
            tensors.sort_by(|a, b| a.name.cmp(&b.name));
            return Ok((r.step, LoadSource::Ram, tensors, r.blobs.clone(), Vec::new()));
        }
    }
    // Disk (or the drain target), into a staging lease sized from the
    // index (retried if `latest` fell back to a larger checkpoint).
    let which = step.map_or(Which::Latest, Which::Step);
    let mut need_bytes = origin
        .first_step(which)
        .and_then(|s| origin.index(s).ok())
        .map_or(crate::config::STAGING_ALIGN_BYTES as u64, |i| restore::load_len_bytes(&i));
    // Node-local files: only the files of the tensors asked for are read
    // (a rank loading its own part needs no other node's disks).
    let read_opts = match &state.read_opts.node {
        Some(_) => std::borrow::Cow::Owned(restore::ReadOptions {
            only_tensors: Some(descs.iter().map(|d| d.name.clone()).collect()),
            ..state.read_opts.clone()
        }),
        None => std::borrow::Cow::Borrowed(&state.read_opts),
    };
    for _ in 0..3 {
        let r = if need_bytes > state.staging.budget_bytes() {
            warn!(
                need_bytes,
                budget_bytes = state.staging.budget_bytes(),
                "checkpoint larger than the staging budget: loading into freshly allocated memory"
            );
            let mut buf = ckpt_store::mem::AlignedBuf::new(need_bytes as usize)
                .map_err(|e| Refusal::new(ErrorCode::Io, format!("allocating {need_bytes} bytes to load into: {e}")))?;
            origin.read_into(which, &read_opts, buf.as_mut_slice()).map(|p| {
                let image = buf.as_slice();
                deliver(regions, descs, |name| from_index(&p.index, name, |t| Some(&image[p.tensor_range(t)?])))?;
                Ok(served_from_index(p.step, &p.index, &p.blobs, &p.fell_back, origin.is_local(state)))
            })
        } else {
            let give_up = || state.stop_reason(replies, Some("the client disconnected"));
            let (mut lease, _) = state.staging.acquire(need_bytes, "load", give_up).map_err(|e| match e {
                StagingError::GaveUp { .. } => Refusal::new(ErrorCode::ShuttingDown, e.to_string()),
                e => Refusal::new(ErrorCode::Io, e.to_string()),
            })?;
            origin.read_into(which, &read_opts, lease.as_mut_slice()).map(|p| {
                let image = lease.as_slice();
                deliver(regions, descs, |name| from_index(&p.index, name, |t| Some(&image[p.tensor_range(t)?])))?;
                Ok(served_from_index(p.step, &p.index, &p.blobs, &p.fell_back, origin.is_local(state)))
            })
        };
        match r {
            Ok(served) => return served,
            Err(LoadError::BufferTooSmall { need_bytes: n, .. }) => need_bytes = n,
            Err(e) => return Err(refuse(state, origin, e)),
        }
    }
    Err(Refusal::new(ErrorCode::Io, "checkpoints changed size while loading; try again"))
}

/// The refusal of a load from `origin` that failed with `e`; damage of a
/// local step is recorded for `status` first.
fn refuse(state: &DaemonState, origin: Origin<'_>, e: LoadError) -> Refusal {
    if origin.is_local(state) {
        damage::record_load_error(&e, Finder::Load);
    }
    e.into()
}

/// What a served load read (`local`: from this sidecar's own directories,
/// whose steps `fell_back` passed over are recorded as damaged; else from
/// the drain target).
fn served_from_index(
    step: u64,
    index: &ckpt_store::format::Index,
    blobs: &std::collections::BTreeMap<String, Vec<u8>>,
    fell_back: &[(u64, String)],
    local: bool,
) -> Served {
    if local {
        for (s, why) in fell_back {
            damage::record(*s, "", why, Finder::Load);
        }
    }
    // Tensors as readers see them: a tensor stored in slices once, whole.
    let tensors = index
        .logical()
        .iter()
        .map(|t| TensorInfo {
            name: t.name.to_string(),
            dtype: t.dtype.as_str().into(),
            shape: t.shape.to_vec(),
            len_bytes: t.len_bytes(),
        })
        .collect();
    let blobs = blobs.iter().map(|(n, b)| Blob { name: n.clone(), bytes: b.clone() }).collect();
    // Each named by its step once: most reasons say it already.
    let fell_back = fell_back
        .iter()
        .map(|(s, why)| if why.contains(&format!("step {s} ")) { why.clone() } else { format!("step {s}: {why}") })
        .collect();
    let source = if local { LoadSource::Disk } else { LoadSource::Drain };
    (step, source, tensors, blobs, fell_back)
}

/// A load of step `step` that only the drain target holds, read as `Load`
/// and `LoadPacked` read it (`Drain::remote_source`, then the verified
/// load of [`Origin`]: a `file://` directory in place, an object store's
/// files streamed) into `dest` (at least `restore::load_len_bytes`);
/// returns the bytes of shard files read. For `bench drain`.
pub fn load_remote_step(drain: &crate::drain::Drain, step: u64, dest: &mut [u8]) -> Result<u64, String> {
    let r = drain
        .remote_source(Some(step), None)
        .map_err(|(_, m)| m)?
        .ok_or_else(|| format!("step {step} is in the local directories"))?;
    let p = Origin::of(&r)
        .read_into(Which::Step(step), &restore::ReadOptions::default(), dest)
        .map_err(|e| e.to_string())?;
    Ok(p.bytes)
}
