//! One session: a client after its handshake, served by its own thread
//! (`ckpt-session-<n>`) that reads request frames in order and answers them.
//! Saves (and SaveFiles) are checked and copied on this thread (so a
//! session's saves keep their order); their Durable/Failed replies come later from the committer
//! through the shared [`Replies`].
//!
//! Invariants: a frame is length-checked before its body is read and decoded
//! without panicking; a malformed frame ends this session only (an `Error`
//! with id `u64::MAX` says why, then the socket closes); a frame's body is
//! held only as far as it arrived, a large one's bytes taken piece by piece
//! from the daemon's [`crate::state::frame_budget`] before they are read, and one that
//! stalls for [`config::FRAME_STALL_TIMEOUT_MS`] ends the session; the
//! session's regions are unmapped when the last copy using them is done (Arc).

use std::collections::HashMap;
use std::io::{self, BufReader, Read as _};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_wire::{ErrorCode, FileFinish, FilePiece, FrameError, Reply, Request, TensorDescIn};
use tracing::{debug, info, warn};

use crate::config;
use crate::daemon::fd_socket::FdSocket;
use crate::load;
use crate::memory::regions::cuda::ImportTimes;
use crate::memory::regions::{CudaSession, CudaSource, Region, RegionError};
use crate::save::file_save::{self, FileRequest};
use crate::save::plan::SaveTensors;
use crate::save::plan_cache::SavePlans;
use crate::save::snapshot::{self, SaveRequest};
use crate::state::frame_budget::{Lease, NoRoom};
use crate::state::jobs::{Part, RollbackJob, Work};
use crate::state::refusal::Refusal;
use crate::state::reply::Replies;
use crate::state::{process_is_gone, refusal_log, DaemonState};
use ckpt_store::catalog;

/// The id of an `Error` that answers no request (a malformed frame).
pub const NO_REQUEST_ID: u64 = u64::MAX;

pub struct Session {
    pub session_id: u64,
    pub peer_uid: u32,
    /// The connecting process (SO_PEERCRED), which owns the regions.
    pub peer_pid: u32,
    pub client_pid: u32,
    pub name: String,
}

/// A Save's tensor list as the session read it from the frame: a kept
/// plan's list found byte for byte, or the descriptors and their bytes.
enum Read<'a> {
    Kept(&'a [u8]),
    Decoded(Vec<TensorDescIn<'a>>, &'a [u8]),
}

/// Why no frame was read.
#[derive(Debug, thiserror::Error)]
enum FrameRead {
    #[error("{0}")]
    Frame(FrameError),
    #[error(
        "a frame of {len} bytes stopped arriving after {got} bytes for {} s; its bytes are dropped",
        config::FRAME_STALL_TIMEOUT_MS / 1000
    )]
    Stalled { len: u32, got: usize },
    #[error(
        "a frame of {len} bytes found no room after {got} bytes (the daemon holds at most {} bytes of partly received frames, {} of one process){}",
        config::LARGE_FRAMES_BYTES_MAX,
        config::LARGE_FRAMES_PER_PROCESS_BYTES_MAX,
        if *.why == NoRoom::TimedOut { format!(" within {} s", config::FRAME_STALL_TIMEOUT_MS / 1000) } else { String::new() }
    )]
    NoRoom { len: u32, got: usize, why: NoRoom },
}

/// Whether the session reads another frame.
enum Flow {
    Next,
    Close,
}

/// One session's connection: the daemon's shared state, the peer, the
/// reply side, and what the client registered (its regions, its CUDA
/// devices and streams, its kept save plans). A handler per request.
struct Conn {
    state: Arc<DaemonState>,
    s: Session,
    replies: Arc<Replies>,
    regions: HashMap<u32, Arc<Region>>,
    cuda: CudaSession,
    plans: SavePlans,
}

pub fn run(state: Arc<DaemonState>, s: Session, stream: UnixStream) {
    let replies = match stream.try_clone() {
        Ok(w) => Arc::new(Replies::new(w)),
        Err(e) => {
            // The caller's guard removes the session's registration.
            warn!("cannot clone the client socket: {e}");
            return;
        }
    };
    let mut reader = BufReader::with_capacity(64 << 10, FdSocket::new(stream));
    let mut conn =
        Conn { state, s, replies, regions: HashMap::new(), cuda: CudaSession::default(), plans: SavePlans::default() };
    loop {
        // Every request runs its copies and loads to their end on this
        // thread: between requests no legacy CUDA import is needed, and none
        // stays open (regions/cuda.rs: the trainer may free the memory).
        conn.regions.values().fold(ImportTimes::default(), |t, r| t.and(r.close_imports())).log();
        // The lease (a large frame's room in the budget) is held until
        // the frame has been served and its body dropped.
        let Some((body, _lease)) = conn.read_frame(&mut reader) else { break };
        if let Flow::Close = conn.serve_frame(body, &mut reader) {
            break;
        }
    }
    conn.end();
}

impl Conn {
    /// The next frame's body (and, for a large one, its room in the frame
    /// budget); None when the client closed the connection or sent a bad or
    /// stalled frame (answered, the session then closes).
    fn read_frame(&self, reader: &mut BufReader<FdSocket>) -> Option<(Vec<u8>, Option<Lease>)> {
        match self.read_frame_bounded(reader) {
            Ok(b) => Some(b),
            Err(FrameRead::Frame(FrameError::Closed)) => {
                debug!("client closed the connection");
                None
            }
            Err(e) => {
                refusal_log::refused(self.s.peer_pid, "bad frame, closing the session", &e.to_string());
                self.replies.send(
                    &Refusal::new(ErrorCode::BadRequest, format!("bad frame, closing: {e}")).error(NO_REQUEST_ID),
                );
                None
            }
        }
    }

    /// Reads one frame: its length prefix without a time limit (a session
    /// may be idle between requests for as long as it likes), then its body
    /// as it arrives, each read within [`config::FRAME_STALL_TIMEOUT_MS`]; a
    /// body over [`config::SMALL_FRAME_BYTES_MAX`] in pieces whose bytes are
    /// taken from the frame budget before each is read.
    fn read_frame_bounded(&self, reader: &mut BufReader<FdSocket>) -> Result<(Vec<u8>, Option<Lease>), FrameRead> {
        let mut prefix = [0u8; 4];
        let mut got = 0;
        while got < 4 {
            match reader.read(&mut prefix[got..]) {
                Ok(0) if got == 0 => return Err(FrameRead::Frame(FrameError::Closed)),
                Ok(0) => return Err(FrameRead::Frame(FrameError::Truncated)),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(FrameRead::Frame(e.into())),
            }
        }
        let len = u32::from_le_bytes(prefix);
        if len > config::FRAME_BYTES_MAX {
            let max_bytes = config::FRAME_BYTES_MAX;
            return Err(FrameRead::Frame(FrameError::TooLarge { len_bytes: len as u64, max_bytes }));
        }
        let stall = Duration::from_millis(config::FRAME_STALL_TIMEOUT_MS);
        let socket = reader.get_ref();
        socket.set_read_timeout(Some(stall)).map_err(|e| FrameRead::Frame(e.into()))?;
        let mut lease = (len > config::SMALL_FRAME_BYTES_MAX).then(|| Lease::new(self.s.peer_pid));
        // Only reserved: the pages are touched as the bytes arrive.
        let mut body = Vec::with_capacity(len as usize);
        while body.len() < len as usize {
            let piece = (len as usize - body.len()).min(config::FRAME_CHUNK_BYTES as usize);
            if let Some(l) = &mut lease {
                let gone = || self.replies.is_gone() || self.state.is_aborting();
                l.grow(piece as u64, Instant::now() + stall, &gone).map_err(|why| FrameRead::NoRoom {
                    len,
                    got: body.len(),
                    why,
                })?;
            }
            let at = body.len();
            body.resize(at + piece, 0);
            reader.read_exact(&mut body[at..]).map_err(|e| match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => FrameRead::Stalled { len, got: at },
                io::ErrorKind::UnexpectedEof => FrameRead::Frame(FrameError::Truncated),
                _ => FrameRead::Frame(e.into()),
            })?;
        }
        reader.get_ref().set_read_timeout(None).map_err(|e| FrameRead::Frame(e.into()))?;
        Ok((body, lease))
    }

    /// Answers an undecodable message; the session then closes.
    fn undecodable(&self, e: impl std::fmt::Display) -> Flow {
        refusal_log::refused(self.s.peer_pid, "undecodable message, closing the session", &e.to_string());
        self.replies.send(&Refusal::new(ErrorCode::BadRequest, format!("{e}; closing")).error(NO_REQUEST_ID));
        Flow::Close
    }

    /// Decodes one frame and serves its request.
    fn serve_frame(&mut self, body: Vec<u8>, reader: &mut BufReader<FdSocket>) -> Flow {
        if let Some(read) = self.serve_save_frame(&body) {
            return read;
        }
        let req: Request = match ckpt_wire::decode(&body) {
            Ok(r) => r,
            Err(e) => return self.undecodable(e),
        };
        drop(body);
        self.serve(req, reader)
    }

    /// A Save (or SavePart), the hot message, read into descriptors that
    /// borrow the frame: no allocation per tensor; and not even that when
    /// its tensor list is, byte for byte, one a kept plan was made from (a
    /// trainer saving the same state again). None: the frame is another
    /// request.
    fn serve_save_frame(&mut self, body: &[u8]) -> Option<Flow> {
        let read = ckpt_wire::decode_save_head(body)?.and_then(|head| {
            let part = head.part.map(|p| Part { rank: p.rank, world_size: p.world_size });
            if let Some((list, rest)) = self.plans.kept_list(&head) {
                let (blobs, lazy_release, unchanged) = rest?;
                return Ok((head.id, head.step, part, Read::Kept(list), blobs, lazy_release, unchanged));
            }
            let rest = head.rest()?;
            Ok((
                head.id,
                head.step,
                part,
                Read::Decoded(rest.tensors, rest.tensors_encoded),
                rest.blobs,
                rest.lazy_release,
                rest.unchanged,
            ))
        });
        let (id, step, part, read, blobs, lazy_release, unchanged) = match read {
            Ok(x) => x,
            Err(e) => return Some(self.undecodable(e)),
        };
        crate::state::test_panic::maybe_panic(crate::state::test_panic::At::Session);
        let tensors = match &read {
            Read::Kept(list) => SaveTensors::Kept(list),
            Read::Decoded(tensors, encoded) => SaveTensors::Decoded { tensors, encoded: Some(encoded) },
        };
        self.save(SaveRequest { id, step, tensors, blobs, lazy_release, part, unchanged });
        Some(Flow::Next)
    }

    /// Serves one request, a handler each.
    fn serve(&mut self, req: Request, reader: &mut BufReader<FdSocket>) -> Flow {
        match req {
            Request::Hello { .. } => {
                self.replies
                    .send(&Refusal::new(ErrorCode::BadRequest, "Hello after the handshake").error(NO_REQUEST_ID));
            }
            Request::RegisterRegion { id, region_id, shm_name, len_bytes, hand_over } => {
                let reply = register(&self.s, &mut self.regions, id, region_id, &shm_name, len_bytes, hand_over);
                self.answer_registration(id, reply);
            }
            Request::UnregisterRegion { id, region_id } => self.unregister(id, region_id),
            // Read by serve_save_frame; kept whole for any other path here.
            Request::Save { id, step, tensors, blobs, lazy_release, unchanged } => {
                let views: Vec<TensorDescIn> = tensors.iter().map(TensorDescIn::of).collect();
                let tensors = SaveTensors::Decoded { tensors: &views, encoded: None };
                self.save(SaveRequest { id, step, tensors, blobs, lazy_release, part: None, unchanged })
            }
            Request::SavePart { id, step, rank, world_size, tensors, blobs, lazy_release, unchanged } => {
                let views: Vec<TensorDescIn> = tensors.iter().map(TensorDescIn::of).collect();
                let tensors = SaveTensors::Decoded { tensors: &views, encoded: None };
                let part = Some(Part { rank, world_size });
                self.save(SaveRequest { id, step, tensors, blobs, lazy_release, part, unchanged })
            }
            Request::SaveFile { id, path, region_id, offset_bytes, len_bytes } => {
                let pieces = vec![FilePiece { region_id, offset_bytes, len_bytes }];
                self.save_file(FileRequest { id, path, pieces, finish: FileFinish::AsIs })
            }
            Request::SaveFilePieces { id, path, pieces, device, event, finish } => {
                self.save_file_pieces(device, &event, FileRequest { id, path, pieces, finish })
            }
            Request::Load { id, step, tensors } => {
                load::run_load(&self.state, &self.replies, &self.regions, id, step, tensors)
            }
            Request::LoadPacked { id, step, region_id, offset_bytes, len_bytes } => load::run_load_packed(
                &self.state,
                &self.regions,
                &self.replies,
                id,
                step,
                load::PackedRange { region_id, offset_bytes, len_bytes },
            ),
            Request::List { id } => {
                self.replies.send(&list(&self.state, id));
            }
            Request::Status { id } => {
                self.replies.send(&Reply::Status { id, report: self.state.report() });
            }
            Request::Rollback { id, step } => self.answer_refused(id, self.rollback(id, step)),
            Request::RegisterCudaRegion { id, region_id, device, device_uuid, ipc_handle, len_bytes } => {
                let reply =
                    self.register_cuda(id, region_id, (device, &device_uuid), CudaSource::Ipc(&ipc_handle), len_bytes);
                self.answer_registration(id, reply);
            }
            Request::RegisterCudaVmmRegion { id, region_id, device, device_uuid, fabric_handle, len_bytes }
                if !fabric_handle.is_empty() =>
            {
                let source = CudaSource::Fabric(&fabric_handle);
                let reply = self.register_cuda(id, region_id, (device, &device_uuid), source, len_bytes);
                self.answer_registration(id, reply);
            }
            Request::RegisterCudaVmmRegion { id, region_id, device, device_uuid, len_bytes, .. } => {
                // The allocation's fd came with the frame (SCM_RIGHTS).
                let fd = reader.get_mut().take_fd();
                let reply = self.register_cuda_fd(id, region_id, (device, &device_uuid), fd, len_bytes);
                self.answer_registration(id, reply);
            }
            Request::RegisterCudaSpan { id, region_id, pieces } => {
                let reply = register_cuda_span(&mut self.regions, id, region_id, &pieces);
                self.answer_registration(id, reply);
            }
            Request::SaveAfterEvent {
                id,
                step,
                tensors,
                blobs,
                lazy_release,
                device,
                event,
                rank,
                world_size,
                unchanged,
            } => {
                let views: Vec<TensorDescIn> = tensors.iter().map(TensorDescIn::of).collect();
                let tensors = SaveTensors::Decoded { tensors: &views, encoded: None };
                // 0 of 1: a whole save; anything else a part (run_save checks rank < world_size).
                let part = ((rank, world_size) != (0, 1)).then_some(Part { rank, world_size });
                self.save_after_event(
                    device,
                    &event,
                    SaveRequest { id, step, tensors, blobs, lazy_release, part, unchanged },
                )
            }
            Request::WaitReplicated { id, step } => self.answer_refused(id, self.wait_replicated(id, step)),
            Request::WaitPeers { id, step } => self.answer_refused(id, self.wait_peers(id, step)),
            Request::Bye => {
                debug!("client said bye");
                return Flow::Close;
            }
        }
        Flow::Next
    }

    fn save(&mut self, req: SaveRequest<'_>) {
        snapshot::run_save(&self.state, &self.replies, &self.regions, &mut self.plans, req);
    }

    fn save_file(&self, req: FileRequest) {
        file_save::run_save_file(&self.state, &self.replies, &self.regions, self.s.peer_uid, req)
    }

    /// A SaveFilePieces: with device pieces, the session's stream waits on
    /// the trainer's event (as recorded now, after the message arrived)
    /// before any copy is queued on it.
    fn save_file_pieces(&mut self, device: i32, event: &[u8], req: FileRequest) {
        let fenced = if event.is_empty() { Ok(()) } else { self.fence(device, event) };
        match fenced {
            Ok(()) => self.save_file(req),
            Err(e) => {
                let path = &req.path;
                info!(path = %path, "save of a file refused: the trainer's CUDA event: {e}");
                let reason = format!("{path}: cannot wait on the trainer's CUDA event: {e}");
                self.replies.send(&Refusal::new(ErrorCode::BadRequest, reason).failed(req.id, 0));
            }
        }
    }

    /// A SaveAfterEvent: the trainer's event is polled here, watching the
    /// client: nothing is queued on the device before its work is done.
    fn save_after_event(&mut self, device: i32, event: &[u8], req: SaveRequest<'_>) {
        match self.fence(device, event) {
            Ok(()) => self.save(req),
            Err(e) => {
                let step = req.step;
                info!(step, "save refused: the trainer's CUDA event: {e}");
                let reason = format!("step {step}: cannot wait on the trainer's CUDA events: {e}");
                self.replies.send(&Refusal::new(ErrorCode::BadRequest, reason).failed(req.id, step));
            }
        }
    }

    /// Waits for the trainer's CUDA event `event` on `device`, watching the
    /// client (its connection and its process: a killed process's
    /// connection may close only after it is gone) and the daemon's abort.
    fn fence(&mut self, device: i32, event: &[u8]) -> Result<(), RegionError> {
        let (replies, state, pid) = (&self.replies, &self.state, self.s.peer_pid);
        self.cuda.fence(device, event, &|| replies.is_gone() || state.is_aborting() || process_is_gone(pid))
    }

    fn unregister(&mut self, id: u64, region_id: u32) {
        // Copies run on this thread, so none uses the region now;
        // no kept plan may hold its mapping either.
        self.plans.clear();
        let reply = match self.regions.remove(&region_id) {
            Some(_) => Ok(Reply::RegionUnregistered { id, region_id }),
            None => Err(Refusal::new(ErrorCode::BadRegion, format!("region {region_id} is not registered"))),
        };
        self.answer_registration(id, reply);
    }

    /// Sends a (un)registration's reply, after the session's counts in the
    /// registry were brought up to date.
    fn answer_registration(&self, id: u64, reply: Result<Reply, Refusal>) {
        update_counts(&self.state, &self.s, &self.regions);
        self.replies.send(&reply.unwrap_or_else(|r| r.error(id)));
    }

    fn register_cuda(
        &mut self,
        id: u64,
        region_id: u32,
        device: (i32, &[u8]),
        source: CudaSource,
        len_bytes: u64,
    ) -> Result<Reply, Refusal> {
        register_cuda(&self.state, &mut self.regions, &mut self.cuda, id, region_id, device, source, len_bytes)
    }

    /// A VMM allocation registered by its fd (`fd` None: the frame carried none).
    fn register_cuda_fd(
        &mut self,
        id: u64,
        region_id: u32,
        device: (i32, &[u8]),
        fd: Option<std::os::fd::OwnedFd>,
        len_bytes: u64,
    ) -> Result<Reply, Refusal> {
        match fd {
            Some(fd) => self.register_cuda(id, region_id, device, CudaSource::Fd(fd), len_bytes),
            None => Err(Refusal::new(
                ErrorCode::BadRegion,
                format!("CUDA VMM region {region_id}: the request carried no file descriptor (send it with SCM_RIGHTS on the frame)"),
            )),
        }
    }

    fn rollback(&self, id: u64, step: u64) -> Result<(), Refusal> {
        let state = &self.state;
        if let Some(dir) = &state.read_only {
            return Err(Refusal::new(ErrorCode::Io, format!("rollback to step {step}: {dir}")));
        }
        if state.is_draining() || state.is_aborting() {
            let reason = format!("rollback to step {step}: the sidecar is shutting down");
            return Err(Refusal::new(ErrorCode::ShuttingDown, reason));
        }
        state
            .commit_tx
            .send(Work::Rollback(RollbackJob { id, step, replies: self.replies.clone() }))
            .map_err(|_| Refusal::new(ErrorCode::ShuttingDown, "the committer has stopped"))
    }

    fn wait_replicated(&self, id: u64, step: u64) -> Result<(), Refusal> {
        let Some(d) = &self.state.drain else {
            return Err(Refusal::new(
                ErrorCode::NotFound,
                format!("step {step}: this sidecar has no drain target (start it with --drain URL), so nothing is ever replicated"),
            ));
        };
        d.wait(self.replies.clone(), id, step, catalog::is_committed(self.state.read_dir(), step));
        Ok(())
    }

    fn wait_peers(&self, id: u64, step: u64) -> Result<(), Refusal> {
        let Some(p) = &self.state.peers else {
            return Err(Refusal::new(
                ErrorCode::NotFound,
                format!("step {step}: this sidecar has no peers (start it with --peers and --peer-listen), so nothing is held by peers"),
            ));
        };
        p.wait(self.replies.clone(), id, step, catalog::is_committed(self.state.read_dir(), step));
        Ok(())
    }

    /// Answers a request refused with an `Error`.
    fn answer_refused(&self, id: u64, done: Result<(), Refusal>) {
        if let Err(r) = done {
            self.replies.send(&r.error(id));
        }
    }

    /// The session's end: a dead client's regions removed, then every
    /// mapping and import closed before the session's streams and events go.
    fn end(self) {
        let Conn { s, regions, cuda, plans, .. } = self;
        // A client that died (SIGKILL, a crash) could not remove its memory: the
        // regions it registered are the sidecar's to remove, so a daemon that
        // outlives many trainers does not fill /dev/shm. A live client (it said
        // Bye, or only closed this connection) keeps them.
        if !regions.is_empty() && process_is_gone(s.peer_pid) {
            for r in regions.values() {
                r.remove_dead_owners_memory();
            }
            info!(pid = s.peer_pid, n_regions = regions.len(), "client died: its regions removed");
        }
        // Closes every imported CUDA allocation (the last Arc of each region,
        // the kept plans' included) before the session's streams and events go.
        drop(plans);
        drop(regions);
        drop(cuda);
        info!(pid = s.client_pid, name = %s.name, "session ended");
    }
}

/// A List's answer: the steps readable here (with a drain target, its
/// steps too: a load reads them from there; `latest` the newer of both
/// tiers').
pub(crate) fn list(state: &DaemonState, id: u64) -> Reply {
    let primary = state.read_dir();
    match catalog::readable_steps(primary) {
        Ok(mut steps) => {
            let mut latest = catalog::latest_step(primary).ok().flatten();
            if let Some(remote) =
                state.drain.as_ref().filter(|_| state.shared_dir.is_none()).and_then(|d| d.remote_steps())
            {
                latest = latest.max(remote.last().copied());
                steps.extend(remote);
                steps.sort_unstable();
                steps.dedup();
            }
            Reply::Listing { id, steps, latest }
        }
        Err(e) => Refusal::new(ErrorCode::Io, format!("{}: {e}", primary.display())).error(id),
    }
}

#[allow(clippy::too_many_arguments)]
fn register(
    s: &Session,
    regions: &mut HashMap<u32, Arc<Region>>,
    id: u64,
    region_id: u32,
    shm_name: &str,
    len_bytes: u64,
    hand_over: bool,
) -> Result<Reply, Refusal> {
    let err = |reason: String| Err(Refusal::new(ErrorCode::BadRegion, reason));
    if regions.contains_key(&region_id) {
        return err(format!("region {region_id} is already registered"));
    }
    if regions.len() >= config::REGIONS_PER_SESSION_MAX {
        return err(format!("at most {} regions per session", config::REGIONS_PER_SESSION_MAX));
    }
    match Region::open_shm(region_id, shm_name, len_bytes, s.peer_uid, hand_over) {
        Ok(r) => {
            debug!(region_id, shm_name, len_bytes, hand_over, "region registered");
            regions.insert(region_id, Arc::new(r));
            Ok(Reply::RegionRegistered { id, region_id })
        }
        Err(e) => {
            info!(region_id, "region refused: {e}");
            err(e.to_string())
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn register_cuda(
    state: &DaemonState,
    regions: &mut HashMap<u32, Arc<Region>>,
    cuda: &mut CudaSession,
    id: u64,
    region_id: u32,
    (client_device, uuid): (i32, &[u8]),
    source: CudaSource,
    len_bytes: u64,
) -> Result<Reply, Refusal> {
    let err = |reason: String| Err(Refusal::new(ErrorCode::BadRegion, reason));
    if regions.contains_key(&region_id) {
        return err(format!("region {region_id} is already registered"));
    }
    if regions.len() >= config::REGIONS_PER_SESSION_MAX {
        return err(format!("at most {} regions per session", config::REGIONS_PER_SESSION_MAX));
    }
    // The client's ordinal means its device of that UUID, whatever the sidecar numbers it.
    let opened = cuda
        .device(client_device, uuid)
        .and_then(|device| Ok((device, cuda.stream(device, &state.staging)?)))
        .and_then(|(device, stream)| Region::open_cuda(region_id, source, device, len_bytes, stream));
    match opened {
        Ok(r) => {
            debug!(region_id, client_device, len_bytes, vmm = r.is_vmm_cuda(), "CUDA region registered");
            regions.insert(region_id, Arc::new(r));
            Ok(Reply::RegionRegistered { id, region_id })
        }
        Err(e) => {
            info!(region_id, "CUDA region refused: {e}");
            err(format!("CUDA region {region_id}: {e}"))
        }
    }
}

fn register_cuda_span(
    regions: &mut HashMap<u32, Arc<Region>>,
    id: u64,
    region_id: u32,
    pieces: &[u32],
) -> Result<Reply, Refusal> {
    let err = |reason: String| Err(Refusal::new(ErrorCode::BadRegion, reason));
    if regions.contains_key(&region_id) {
        return err(format!("region {region_id} is already registered"));
    }
    if regions.len() >= config::REGIONS_PER_SESSION_MAX {
        return err(format!("at most {} regions per session", config::REGIONS_PER_SESSION_MAX));
    }
    if pieces.len() > config::REGIONS_PER_SESSION_MAX {
        return err(format!(
            "CUDA span {region_id}: {} pieces, more than the {} regions a session may have",
            pieces.len(),
            config::REGIONS_PER_SESSION_MAX
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(pieces.len());
    if let Some(p) = pieces.iter().find(|&&p| !seen.insert(p)) {
        return err(format!(
            "CUDA span {region_id}: piece region {p} appears twice (pieces are mapped back to back, never twice)"
        ));
    }
    let found: Result<Vec<Arc<Region>>, u32> = pieces.iter().map(|p| regions.get(p).cloned().ok_or(*p)).collect();
    let opened = match found {
        Ok(ps) => Region::open_cuda_span(region_id, ps),
        Err(p) => return err(format!("CUDA span {region_id}: piece region {p} is not registered")),
    };
    match opened {
        Ok(r) => {
            debug!(region_id, pieces = pieces.len(), len_bytes = r.len_bytes, "CUDA span registered");
            regions.insert(region_id, Arc::new(r));
            Ok(Reply::RegionRegistered { id, region_id })
        }
        Err(e) => {
            info!(region_id, "CUDA span refused: {e}");
            err(format!("region {region_id}: {e}"))
        }
    }
}

fn update_counts(state: &DaemonState, s: &Session, regions: &HashMap<u32, Arc<Region>>) {
    let n = regions.len() as u32;
    // A span's bytes are its pieces', counted once.
    let bytes = regions.values().filter(|r| r.kind() != "cuda-span").map(|r| r.len_bytes).sum();
    state.update_session(s.session_id, |e| {
        e.regions = n;
        e.region_bytes = bytes;
    });
}
