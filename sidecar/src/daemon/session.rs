//! One session: a client after its handshake, served by its own thread
//! (`ckpt-session-<n>`) that reads request frames in order and answers them.
//! Saves (and SaveFiles) are checked and copied on this thread (so a
//! session's saves keep their order); their Durable/Failed replies come later from the committer
//! through the shared [`Replies`].
//!
//! Invariants: a frame is length-checked before its body is read and decoded
//! without panicking; a malformed frame ends this session only (an `Error`
//! with id `u64::MAX` says why, then the socket closes); the session's
//! regions are unmapped when the last copy using them is done (Arc).

use std::collections::HashMap;
use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use ckpt_wire::{ErrorCode, FileFinish, FilePiece, FrameError, Reply, Request, TensorDescIn};
use tracing::{debug, info, warn};

use crate::config;
use crate::daemon::fd_socket::FdSocket;
use crate::load;
use crate::memory::regions::{CudaSession, CudaSource, Region};
use crate::save::file_save::{self, FileRequest};
use crate::save::plan::SaveTensors;
use crate::save::plan_cache::SavePlans;
use crate::save::snapshot::{self, SaveRequest};
use crate::state::jobs::{Part, RollbackJob, Work};
use crate::state::reply::Replies;
use crate::state::DaemonState;
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
    let mut regions: HashMap<u32, Arc<Region>> = HashMap::new();
    let mut cuda = CudaSession::default();
    let mut plans = SavePlans::default();
    loop {
        // Every request runs its copies and loads to their end on this
        // thread: between requests no legacy CUDA import is needed, and none
        // stays open (regions/cuda.rs: the trainer may free the memory).
        for r in regions.values() {
            r.close_imports();
        }
        let body = match ckpt_wire::read_frame_body(&mut reader, config::FRAME_BYTES_MAX) {
            Ok(b) => b,
            Err(FrameError::Closed) => {
                debug!("client closed the connection");
                break;
            }
            Err(e) => {
                warn!(pid = s.client_pid, "bad frame, closing the session: {e}");
                replies.send(&Reply::Error {
                    id: NO_REQUEST_ID,
                    code: ErrorCode::BadRequest,
                    message: format!("bad frame, closing: {e}"),
                });
                break;
            }
        };
        // A Save (or SavePart), the hot message, is read into descriptors
        // that borrow the frame: no allocation per tensor; and not even
        // that when its tensor list is, byte for byte, one a kept plan was
        // made from (a trainer saving the same state again).
        let read = ckpt_wire::decode_save_head(&body).map(|head| -> Result<_, FrameError> {
            let head = head?;
            let part = head.part.map(|p| Part { rank: p.rank, world_size: p.world_size });
            if let Some((list, rest)) = plans.kept_list(&head) {
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
        match read {
            Some(Ok((id, step, part, read, blobs, lazy_release, unchanged))) => {
                crate::state::test_panic::maybe_panic(crate::state::test_panic::At::Session);
                let tensors = match &read {
                    Read::Kept(list) => SaveTensors::Kept(list),
                    Read::Decoded(tensors, encoded) => SaveTensors::Decoded { tensors, encoded: Some(encoded) },
                };
                snapshot::run_save(
                    &state,
                    &replies,
                    &regions,
                    &mut plans,
                    SaveRequest { id, step, tensors, blobs, lazy_release, part, unchanged },
                );
                continue;
            }
            Some(Err(e)) => {
                warn!(pid = s.client_pid, "undecodable message, closing the session: {e}");
                replies.send(&Reply::Error {
                    id: NO_REQUEST_ID,
                    code: ErrorCode::BadRequest,
                    message: format!("{e}; closing"),
                });
                break;
            }
            None => {}
        }
        let req: Request = match ckpt_wire::decode(&body) {
            Ok(r) => r,
            Err(e) => {
                warn!(pid = s.client_pid, "undecodable message, closing the session: {e}");
                replies.send(&Reply::Error {
                    id: NO_REQUEST_ID,
                    code: ErrorCode::BadRequest,
                    message: format!("{e}; closing"),
                });
                break;
            }
        };
        drop(body);
        match req {
            Request::Hello { .. } => {
                replies.send(&Reply::Error {
                    id: NO_REQUEST_ID,
                    code: ErrorCode::BadRequest,
                    message: "Hello after the handshake".into(),
                });
            }
            Request::RegisterRegion { id, region_id, shm_name, len_bytes, hand_over } => {
                let reply = register(&s, &mut regions, id, region_id, &shm_name, len_bytes, hand_over);
                update_counts(&state, &s, &regions);
                replies.send(&reply);
            }
            Request::UnregisterRegion { id, region_id } => {
                // Copies run on this thread, so none uses the region now;
                // no kept plan may hold its mapping either.
                plans.clear();
                let reply = match regions.remove(&region_id) {
                    Some(_) => Reply::RegionUnregistered { id, region_id },
                    None => Reply::Error {
                        id,
                        code: ErrorCode::BadRegion,
                        message: format!("region {region_id} is not registered"),
                    },
                };
                update_counts(&state, &s, &regions);
                replies.send(&reply);
            }
            // Read by decode_save above; kept whole for any other path here.
            Request::Save { id, step, tensors, blobs, lazy_release, unchanged } => {
                let views: Vec<TensorDescIn> = tensors.iter().map(TensorDescIn::of).collect();
                snapshot::run_save(
                    &state,
                    &replies,
                    &regions,
                    &mut plans,
                    SaveRequest {
                        id,
                        step,
                        tensors: SaveTensors::Decoded { tensors: &views, encoded: None },
                        blobs,
                        lazy_release,
                        part: None,
                        unchanged,
                    },
                )
            }
            Request::SavePart { id, step, rank, world_size, tensors, blobs, lazy_release, unchanged } => {
                let views: Vec<TensorDescIn> = tensors.iter().map(TensorDescIn::of).collect();
                snapshot::run_save(
                    &state,
                    &replies,
                    &regions,
                    &mut plans,
                    SaveRequest {
                        id,
                        step,
                        tensors: SaveTensors::Decoded { tensors: &views, encoded: None },
                        blobs,
                        lazy_release,
                        part: Some(Part { rank, world_size }),
                        unchanged,
                    },
                )
            }
            Request::SaveFile { id, path, region_id, offset_bytes, len_bytes } => {
                let pieces = vec![FilePiece { region_id, offset_bytes, len_bytes }];
                file_save::run_save_file(
                    &state,
                    &replies,
                    &regions,
                    s.peer_uid,
                    FileRequest { id, path, pieces, finish: FileFinish::AsIs },
                )
            }
            Request::SaveFilePieces { id, path, pieces, device, event, finish } => {
                // Device pieces: the session's stream waits on the trainer's
                // event (as recorded now, after the message arrived) before
                // any copy is queued on it.
                let fenced = if event.is_empty() {
                    Ok(())
                } else {
                    cuda.fence(device, &event, &|| replies.is_gone() || state.is_aborting())
                };
                match fenced {
                    Ok(()) => file_save::run_save_file(
                        &state,
                        &replies,
                        &regions,
                        s.peer_uid,
                        FileRequest { id, path, pieces, finish },
                    ),
                    Err(e) => {
                        info!(path = %path, "save of a file refused: the trainer's CUDA event: {e}");
                        replies.send(&Reply::Failed {
                            id,
                            step: 0,
                            code: ErrorCode::BadRequest,
                            reason: format!("{path}: cannot wait on the trainer's CUDA event: {e}"),
                        });
                    }
                }
            }
            Request::Load { id, step, tensors } => load::run_load(&state, &replies, &regions, id, step, tensors),
            Request::LoadPacked { id, step, region_id, offset_bytes, len_bytes } => load::run_load_packed(
                &state,
                &regions,
                &replies,
                id,
                step,
                load::PackedRange { region_id, offset_bytes, len_bytes },
            ),
            Request::List { id } => {
                let primary = state.read_dir();
                let reply = match catalog::readable_steps(primary) {
                    // With a drain target: its steps too (a load reads them
                    // from there), and `latest` the newer of both tiers'.
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
                    Err(e) => Reply::Error { id, code: ErrorCode::Io, message: format!("{}: {e}", primary.display()) },
                };
                replies.send(&reply);
            }
            Request::Status { id } => {
                replies.send(&Reply::Status { id, report: state.report() });
            }
            Request::Rollback { id, step } => {
                if let Some(dir) = &state.read_only {
                    replies.send(&Reply::Error {
                        id,
                        code: ErrorCode::Io,
                        message: format!("rollback to step {step}: {dir}"),
                    });
                } else if state.is_draining() || state.is_aborting() {
                    replies.send(&Reply::Error {
                        id,
                        code: ErrorCode::ShuttingDown,
                        message: format!("rollback to step {step}: the sidecar is shutting down"),
                    });
                } else if state
                    .commit_tx
                    .send(Work::Rollback(RollbackJob { id, step, replies: replies.clone() }))
                    .is_err()
                {
                    replies.send(&Reply::Error {
                        id,
                        code: ErrorCode::ShuttingDown,
                        message: "the committer has stopped".into(),
                    });
                }
            }
            Request::RegisterCudaRegion { id, region_id, device, device_uuid, ipc_handle, len_bytes } => {
                let reply = register_cuda(
                    &state,
                    &mut regions,
                    &mut cuda,
                    id,
                    region_id,
                    (device, &device_uuid),
                    CudaSource::Ipc(&ipc_handle),
                    len_bytes,
                );
                update_counts(&state, &s, &regions);
                replies.send(&reply);
            }
            Request::RegisterCudaVmmRegion { id, region_id, device, device_uuid, fabric_handle, len_bytes }
                if !fabric_handle.is_empty() =>
            {
                let reply = register_cuda(
                    &state,
                    &mut regions,
                    &mut cuda,
                    id,
                    region_id,
                    (device, &device_uuid),
                    CudaSource::Fabric(&fabric_handle),
                    len_bytes,
                );
                update_counts(&state, &s, &regions);
                replies.send(&reply);
            }
            Request::RegisterCudaVmmRegion { id, region_id, device, device_uuid, len_bytes, .. } => {
                let reply = match reader.get_mut().take_fd() {
                    Some(fd) => register_cuda(&state, &mut regions, &mut cuda, id, region_id, (device, &device_uuid), CudaSource::Fd(fd), len_bytes),
                    None => Reply::Error {
                        id,
                        code: ErrorCode::BadRegion,
                        message: format!("CUDA VMM region {region_id}: the request carried no file descriptor (send it with SCM_RIGHTS on the frame)"),
                    },
                };
                update_counts(&state, &s, &regions);
                replies.send(&reply);
            }
            Request::RegisterCudaSpan { id, region_id, pieces } => {
                let reply = register_cuda_span(&mut regions, id, region_id, &pieces);
                update_counts(&state, &s, &regions);
                replies.send(&reply);
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
                // 0 of 1: a whole save; anything else a part (run_save checks rank < world_size).
                let part = (rank, world_size) != (0, 1);
                // The trainer's event is polled here, watching the client:
                // nothing is queued on the device before its work is done.
                match cuda.fence(device, &event, &|| replies.is_gone() || state.is_aborting()) {
                    Ok(()) => {
                        let views: Vec<TensorDescIn> = tensors.iter().map(TensorDescIn::of).collect();
                        snapshot::run_save(
                            &state,
                            &replies,
                            &regions,
                            &mut plans,
                            SaveRequest {
                                id,
                                step,
                                tensors: SaveTensors::Decoded { tensors: &views, encoded: None },
                                blobs,
                                lazy_release,
                                part: part.then_some(Part { rank, world_size }),
                                unchanged,
                            },
                        );
                    }
                    Err(e) => {
                        info!(step, "save refused: the trainer's CUDA event: {e}");
                        replies.send(&Reply::Failed {
                            id,
                            step,
                            code: ErrorCode::BadRequest,
                            reason: format!("step {step}: cannot wait on the trainer's CUDA events: {e}"),
                        });
                    }
                }
            }
            Request::WaitReplicated { id, step } => match &state.drain {
                Some(d) => d.wait(replies.clone(), id, step, catalog::is_committed(state.read_dir(), step)),
                None => {
                    replies.send(&Reply::Error { id, code: ErrorCode::NotFound, message: format!("step {step}: this sidecar has no drain target (start it with --drain URL), so nothing is ever replicated") });
                }
            },
            Request::Bye => {
                debug!("client said bye");
                break;
            }
        }
    }
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

/// Whether `pid` no longer runs: no such process, a zombie, or one already
/// exiting. The last matters: a killed process closes its files (so its
/// connection reads EOF here) before it becomes a zombie, and the kernel
/// marks it exiting (PF_EXITING in /proc's flags) before either. (A pid
/// that was reused meanwhile counts as alive: its regions are then left to
/// the shim's own sweep.)
fn process_is_gone(pid: u32) -> bool {
    /// `PF_EXITING` of include/linux/sched.h: set at the start of the exit.
    const PF_EXITING: u64 = 0x4;
    if pid == 0 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The fields after the command name's closing parenthesis: state,
        // ppid, pgrp, session, tty_nr, tpgid, flags, ...
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| {
            let mut fields = rest.split_ascii_whitespace();
            let state = fields.next().unwrap_or("");
            let flags = fields.nth(5).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
            state.starts_with('Z') || state.starts_with('X') || flags & PF_EXITING != 0
        }),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
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
) -> Reply {
    let err = |message: String| Reply::Error { id, code: ErrorCode::BadRegion, message };
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
            Reply::RegionRegistered { id, region_id }
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
) -> Reply {
    let err = |message: String| Reply::Error { id, code: ErrorCode::BadRegion, message };
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
            Reply::RegionRegistered { id, region_id }
        }
        Err(e) => {
            info!(region_id, "CUDA region refused: {e}");
            err(format!("CUDA region {region_id}: {e}"))
        }
    }
}

fn register_cuda_span(regions: &mut HashMap<u32, Arc<Region>>, id: u64, region_id: u32, pieces: &[u32]) -> Reply {
    let err = |message: String| Reply::Error { id, code: ErrorCode::BadRegion, message };
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
            Reply::RegionRegistered { id, region_id }
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
