//! A fake sidecar for the shim's tests: a UnixListener in a temp dir that
//! speaks ckpt-wire as docs/protocol.md says, keeps "committed" checkpoints
//! in memory (in a store that outlives a kill, like a disk), maps client
//! regions read-only by name and writes loads with pwrite, as the real one.
//! Knobs make it slow, wrong-versioned, refusing, failing, or dead.

use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ckpt_wire::{Blob, ErrorCode, LoadSource, Reply, Request, StatusReport, TensorDesc, TensorInfo, PROTOCOL_VERSION};

#[derive(Clone, Default)]
pub struct Opts {
    /// Welcome with this version instead of ours.
    pub version: Option<u32>,
    /// Refuse every Hello with this reason.
    pub refuse: Option<String>,
    pub release_delay: Duration,
    pub durable_delay: Duration,
    /// Saves of this step fail after release with Io.
    pub fail_step: Option<u64>,
}

#[derive(Default)]
pub struct Store {
    pub steps: BTreeMap<u64, Ckpt>,
    /// Every request the fake received, in order (for assertions).
    pub log: Vec<String>,
    pub sessions: u32,
}

impl Store {
    /// Step `step` (the newest for None) and a copy of its checkpoint.
    fn find(&self, step: Option<u64>) -> Option<(u64, Ckpt)> {
        match step {
            Some(n) => self.steps.get(&n).map(|c| (n, c.clone())),
            None => self.steps.iter().next_back().map(|(n, c)| (*n, c.clone())),
        }
    }
}

#[derive(Clone)]
pub struct Ckpt {
    pub tensors: Vec<(TensorInfo, Vec<u8>)>,
    pub blobs: Vec<Blob>,
}

pub struct Fake {
    pub socket: PathBuf,
    pub store: Arc<Mutex<Store>>,
    stop: Arc<AtomicBool>,
    streams: Arc<Mutex<Vec<UnixStream>>>,
    accept: Option<JoinHandle<()>>,
}

impl Fake {
    pub fn start(socket: &Path, opts: Opts) -> Fake {
        Fake::start_with(socket, opts, Arc::new(Mutex::new(Store::default())))
    }

    /// Starts at `socket` with an existing store (a "restarted" sidecar).
    pub fn start_with(socket: &Path, opts: Opts, store: Arc<Mutex<Store>>) -> Fake {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket).unwrap();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let streams = Arc::new(Mutex::new(Vec::new()));
        let (s2, st2, store2) = (stop.clone(), streams.clone(), store.clone());
        let accept = std::thread::spawn(move || {
            while !s2.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nonblocking(false).unwrap();
                        st2.lock().unwrap().push(stream.try_clone().unwrap());
                        let (opts, store) = (opts.clone(), store2.clone());
                        std::thread::spawn(move || session(stream, opts, store));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Fake { socket: socket.to_path_buf(), store, stop, streams, accept: Some(accept) }
    }

    /// The sidecar "dies": listener gone, every session's socket shut.
    pub fn kill(mut self) -> Arc<Mutex<Store>> {
        self.shut();
        self.store.clone()
    }

    fn shut(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.accept.take() {
            h.join().unwrap();
        }
        for s in self.streams.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    pub fn log(&self) -> Vec<String> {
        self.store.lock().unwrap().log.clone()
    }

    /// The log once `done` holds for it. The fake handles each connection on
    /// its own thread, so what a client sent just before it exited or closed
    /// may not be logged yet when the test looks; panics after 5 s.
    pub fn log_when(&self, done: impl Fn(&[String]) -> bool) -> Vec<String> {
        self.log_within(Duration::from_secs(5), done)
    }

    /// [`Fake::log_when`] with a deadline of the test's choosing.
    pub fn log_within(&self, limit: Duration, done: impl Fn(&[String]) -> bool) -> Vec<String> {
        let t0 = std::time::Instant::now();
        loop {
            let log = self.log();
            if done(&log) {
                return log;
            }
            assert!(t0.elapsed() < limit, "the fake's log never got there within {limit:?}: {log:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The log once the last session has ended, by Bye or by a closed socket.
    pub fn log_when_ended(&self) -> Vec<String> {
        self.log_when(|l| matches!(l.last().map(String::as_str), Some("Bye" | "End")))
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.shut();
    }
}

struct MappedRegion {
    fd: i32,
    ptr: *const u8,
    len: u64,
}

// SAFETY: the mapping and fd belong to this value alone, and the fake only
// reads the mapping from the one session thread that owns the value.
unsafe impl Send for MappedRegion {}

impl Drop for MappedRegion {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are this value's own mapping and `fd` its own
        // descriptor, each released once, here.
        unsafe {
            libc::munmap(self.ptr as *mut _, self.len as usize);
            libc::close(self.fd);
        }
    }
}

fn open_region(name: &str, len: u64) -> Result<MappedRegion, String> {
    let c = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: `c` is a valid C string; `st` is plain data fstat fills in;
    // the mapping is of `len` bytes of a segment at least that long
    // (checked), and it and the fd belong to the MappedRegion returned.
    unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR, 0);
        if fd < 0 {
            return Err(format!("shm_open {name}: {}", std::io::Error::last_os_error()));
        }
        let mut st: libc::stat = std::mem::zeroed();
        libc::fstat(fd, &mut st);
        if (st.st_size as u64) < len || st.st_uid != libc::getuid() || st.st_mode & 0o777 != 0o600 {
            libc::close(fd);
            return Err(format!("{name}: size {} mode {:o} uid {}", st.st_size, st.st_mode, st.st_uid));
        }
        let p = libc::mmap(std::ptr::null_mut(), len as usize, libc::PROT_READ, libc::MAP_SHARED, fd, 0);
        if p == libc::MAP_FAILED {
            libc::close(fd);
            return Err("mmap failed".into());
        }
        Ok(MappedRegion { fd, ptr: p as *const u8, len })
    }
}

fn send(w: &Arc<Mutex<UnixStream>>, r: &Reply) {
    let _ = ckpt_wire::write_frame(&mut *w.lock().unwrap(), r);
}

fn session(stream: UnixStream, opts: Opts, store: Arc<Mutex<Store>>) {
    let mut rd = stream.try_clone().unwrap();
    let w = Arc::new(Mutex::new(stream));
    match ckpt_wire::read_frame::<Request>(&mut rd) {
        Ok(Request::Hello { name, .. }) => {
            let mut s = store.lock().unwrap();
            s.sessions += 1;
            s.log.push(format!("Hello {name}"));
        }
        _ => return,
    }
    if let Some(reason) = &opts.refuse {
        send(&w, &Reply::Refused { reason: reason.clone() });
        return;
    }
    send(
        &w,
        &Reply::Welcome {
            version: opts.version.unwrap_or(PROTOCOL_VERSION),
            server_pid: std::process::id(),
            dirs: vec!["/fake".into()],
            staging_bytes: 1 << 30,
        },
    );
    let mut regions: HashMap<u32, MappedRegion> = HashMap::new();
    loop {
        let req = match ckpt_wire::read_frame::<Request>(&mut rd) {
            Ok(r) => r,
            Err(_) => {
                store.lock().unwrap().log.push("End".into());
                return;
            }
        };
        store.lock().unwrap().log.push(kind(&req));
        match req {
            Request::RegisterRegion { id, region_id, shm_name, len_bytes, .. } => {
                match open_region(&shm_name, len_bytes) {
                    Ok(m) => {
                        regions.insert(region_id, m);
                        send(&w, &Reply::RegionRegistered { id, region_id });
                    }
                    Err(message) => send(&w, &Reply::Error { id, code: ErrorCode::BadRegion, message }),
                }
            }
            Request::UnregisterRegion { id, region_id } => {
                regions.remove(&region_id);
                send(&w, &Reply::RegionUnregistered { id, region_id });
            }
            Request::Save { id, step, tensors, blobs, .. } => {
                let mut copied = Vec::new();
                let mut bad = None;
                for t in &tensors {
                    match copy_out(&regions, t) {
                        Ok(b) => copied.push((
                            TensorInfo {
                                name: t.name.clone(),
                                dtype: t.dtype.clone(),
                                shape: t.shape.clone(),
                                len_bytes: t.len_bytes,
                            },
                            b,
                        )),
                        Err(e) => bad = Some(e),
                    }
                }
                if let Some(reason) = bad {
                    send(&w, &Reply::Failed { id, step, code: ErrorCode::BadRegion, reason });
                    continue;
                }
                if store.lock().unwrap().steps.contains_key(&step) {
                    send(
                        &w,
                        &Reply::Failed {
                            id,
                            step,
                            code: ErrorCode::BadRequest,
                            reason: format!("step {step} is already committed"),
                        },
                    );
                    continue;
                }
                std::thread::sleep(opts.release_delay);
                send(&w, &Reply::Released { id, step, copy_seconds: 0.001, waited_seconds: 0.0 });
                let (w2, store2, opts2) = (w.clone(), store.clone(), opts.clone());
                std::thread::spawn(move || {
                    std::thread::sleep(opts2.durable_delay);
                    if opts2.fail_step == Some(step) {
                        send(
                            &w2,
                            &Reply::Failed {
                                id,
                                step,
                                code: ErrorCode::Io,
                                reason: "No space left on device (fake)".into(),
                            },
                        );
                        return;
                    }
                    store2.lock().unwrap().steps.insert(step, Ckpt { tensors: copied, blobs });
                    send(
                        &w2,
                        &Reply::Durable { id, step, path: format!("/fake/step-{step:012}"), persist_seconds: 0.002 },
                    );
                });
            }
            Request::SavePart { id, step, .. } => {
                // The fake gathers no parts: the kind in the log is what tests look at.
                send(
                    &w,
                    &Reply::Failed {
                        id,
                        step,
                        code: ErrorCode::BadRequest,
                        reason: "the fake sidecar does not gather parts".into(),
                    },
                );
            }
            Request::Load { id, step, tensors } => {
                let Some((n, ck)) = store.lock().unwrap().find(step) else {
                    send(&w, &Reply::Error { id, code: ErrorCode::NotFound, message: "no checkpoint".into() });
                    continue;
                };
                match write_in(&regions, &ck, &tensors) {
                    Ok(()) => send(
                        &w,
                        &Reply::Loaded {
                            id,
                            step: n,
                            source: LoadSource::Ram,
                            tensors: ck.tensors.iter().map(|t| t.0.clone()).collect(),
                            blobs: ck.blobs.clone(),
                            fell_back: vec![],
                        },
                    ),
                    Err((code, message)) => send(&w, &Reply::Error { id, code, message }),
                }
            }
            Request::List { id } => {
                let s = store.lock().unwrap();
                let steps: Vec<u64> = s.steps.keys().copied().collect();
                let latest = steps.last().copied();
                send(&w, &Reply::Listing { id, steps, latest });
            }
            Request::Status { id } => send(
                &w,
                &Reply::Status {
                    id,
                    report: StatusReport {
                        server_pid: std::process::id(),
                        staging_bytes: 1 << 30,
                        ..Default::default()
                    },
                },
            ),
            Request::SaveFile { id, .. } | Request::SaveFilePieces { id, .. } => {
                send(
                    &w,
                    &Reply::Failed {
                        id,
                        step: 0,
                        code: ErrorCode::BadRequest,
                        reason: "the fake sidecar writes no files".into(),
                    },
                );
            }
            Request::Rollback { id, step } => {
                let mut s = store.lock().unwrap();
                if !s.steps.contains_key(&step) {
                    send(
                        &w,
                        &Reply::Error {
                            id,
                            code: ErrorCode::NotFound,
                            message: format!("step {step} is not committed"),
                        },
                    );
                    continue;
                }
                let removed: Vec<u64> = s.steps.keys().copied().filter(|&k| k > step).rev().collect();
                s.steps.retain(|&k, _| k <= step);
                send(&w, &Reply::RolledBack { id, step, removed });
            }
            Request::RegisterCudaRegion { id, region_id, .. }
            | Request::RegisterCudaVmmRegion { id, region_id, .. }
            | Request::RegisterCudaSpan { id, region_id, .. } => send(
                &w,
                &Reply::Error {
                    id,
                    code: ErrorCode::BadRegion,
                    message: format!("CUDA region {region_id}: the fake sidecar has no CUDA"),
                },
            ),
            Request::SaveAfterEvent { id, step, .. } => send(
                &w,
                &Reply::Failed { id, step, code: ErrorCode::BadRequest, reason: "the fake sidecar has no CUDA".into() },
            ),
            Request::LoadPacked { id, step, region_id, offset_bytes, len_bytes } => {
                let Some((n, ck)) = store.lock().unwrap().find(step) else {
                    send(&w, &Reply::Error { id, code: ErrorCode::NotFound, message: "no checkpoint".into() });
                    continue;
                };
                match place_in(&regions, &ck, region_id, offset_bytes, len_bytes) {
                    Ok((offsets, need_bytes)) => {
                        let blobs = if offsets.is_empty() { vec![] } else { ck.blobs.clone() };
                        let tensors = ck.tensors.iter().map(|t| t.0.clone()).collect();
                        send(
                            &w,
                            &Reply::Placed {
                                id,
                                step: n,
                                source: LoadSource::Ram,
                                tensors,
                                offsets,
                                need_bytes,
                                blobs,
                                fell_back: vec![],
                            },
                        )
                    }
                    Err((code, message)) => send(&w, &Reply::Error { id, code, message }),
                }
            }
            Request::WaitReplicated { id, step } => send(
                &w,
                &Reply::Error {
                    id,
                    code: ErrorCode::NotFound,
                    message: format!("step {step}: the fake sidecar has no drain target"),
                },
            ),
            Request::WaitPeers { id, step } => send(
                &w,
                &Reply::Error {
                    id,
                    code: ErrorCode::NotFound,
                    message: format!("step {step}: the fake sidecar has no peers"),
                },
            ),
            Request::Bye => return,
            Request::Hello { .. } => return,
        }
    }
}

fn kind(r: &Request) -> String {
    match r {
        Request::RegisterRegion { region_id, .. } => format!("RegisterRegion {region_id}"),
        Request::UnregisterRegion { region_id, .. } => format!("UnregisterRegion {region_id}"),
        Request::Save { step, lazy_release, .. } => format!("Save {step}{}", if *lazy_release { " lazy" } else { "" }),
        Request::Load { .. } => "Load".into(),
        Request::LoadPacked { .. } => "LoadPacked".into(),
        Request::WaitReplicated { step, .. } => format!("WaitReplicated {step}"),
        Request::WaitPeers { step, .. } => format!("WaitPeers {step}"),
        Request::List { .. } => "List".into(),
        Request::Status { .. } => "Status".into(),
        Request::SaveFile { path, .. } => format!("SaveFile {path}"),
        Request::SaveFilePieces { path, pieces, .. } => format!("SaveFilePieces {path} ({} pieces)", pieces.len()),
        Request::Rollback { step, .. } => format!("Rollback {step}"),
        Request::RegisterCudaRegion { region_id, .. } => format!("RegisterCudaRegion {region_id}"),
        Request::RegisterCudaVmmRegion { region_id, .. } => format!("RegisterCudaVmmRegion {region_id}"),
        Request::RegisterCudaSpan { region_id, .. } => format!("RegisterCudaSpan {region_id}"),
        Request::SaveAfterEvent { step, .. } => format!("SaveAfterEvent {step}"),
        Request::SavePart { step, rank, world_size, .. } => format!("SavePart {step} rank {rank} of {world_size}"),
        Request::Bye => "Bye".into(),
        Request::Hello { .. } => "Hello".into(),
    }
}

fn copy_out(regions: &HashMap<u32, MappedRegion>, t: &TensorDesc) -> Result<Vec<u8>, String> {
    if t.len_bytes == 0 {
        return Ok(Vec::new());
    }
    let r = regions.get(&t.region_id).ok_or(format!("{}: unknown region {}", t.name, t.region_id))?;
    let end = t.offset_bytes.checked_add(t.len_bytes).ok_or("overflow")?;
    if end > r.len {
        return Err(format!("{}: outside region {}", t.name, t.region_id));
    }
    // SAFETY: `offset_bytes + len_bytes` lies inside the mapping of `r.len`
    // bytes (checked above), which lives while `regions` is borrowed.
    Ok(unsafe { std::slice::from_raw_parts(r.ptr.add(t.offset_bytes as usize), t.len_bytes as usize) }.to_vec())
}

fn write_in(regions: &HashMap<u32, MappedRegion>, ck: &Ckpt, descs: &[TensorDesc]) -> Result<(), (ErrorCode, String)> {
    for d in descs {
        let (info, bytes) = ck
            .tensors
            .iter()
            .find(|t| t.0.name == d.name)
            .ok_or((ErrorCode::NotFound, format!("no tensor {:?}", d.name)))?;
        if info.dtype != d.dtype || info.shape != d.shape || info.len_bytes != d.len_bytes {
            return Err((ErrorCode::BadRequest, format!("{}: dtype/shape/len differ", d.name)));
        }
        let r = regions.get(&d.region_id).ok_or((ErrorCode::BadRegion, "unknown region".to_string()))?;
        if d.offset_bytes + d.len_bytes > r.len {
            return Err((ErrorCode::BadRegion, "outside region".into()));
        }
        // SAFETY: the pointer and length describe the live `bytes`; `r.fd` is open.
        let n = unsafe { libc::pwrite(r.fd, bytes.as_ptr().cast(), bytes.len(), d.offset_bytes as i64) };
        assert_eq!(n as usize, bytes.len());
    }
    Ok(())
}

/// The fake's LoadPacked: the tensors back to back in checkpoint order, each
/// at a multiple of 64 bytes from `offset_bytes`; (offsets, need_bytes), the
/// offsets empty and nothing written when `len_bytes` is below need_bytes.
fn place_in(
    regions: &HashMap<u32, MappedRegion>,
    ck: &Ckpt,
    region_id: u32,
    offset_bytes: u64,
    len_bytes: u64,
) -> Result<(Vec<u64>, u64), (ErrorCode, String)> {
    if offset_bytes % 4096 != 0 {
        return Err((ErrorCode::BadRequest, format!("offset {offset_bytes} is not a multiple of 4096")));
    }
    let r = regions.get(&region_id).ok_or((ErrorCode::BadRegion, "unknown region".to_string()))?;
    if offset_bytes.checked_add(len_bytes).is_none_or(|end| end > r.len) {
        return Err((ErrorCode::BadRegion, "outside region".into()));
    }
    let mut offsets = Vec::with_capacity(ck.tensors.len());
    let mut need_bytes = 0u64;
    for (info, _) in &ck.tensors {
        offsets.push(need_bytes);
        need_bytes = (need_bytes + info.len_bytes).div_ceil(64) * 64;
    }
    if need_bytes > len_bytes {
        return Ok((Vec::new(), need_bytes));
    }
    for ((_, bytes), at) in ck.tensors.iter().zip(&offsets) {
        // SAFETY: the pointer and length describe the live `bytes`; `r.fd` is open.
        let n = unsafe { libc::pwrite(r.fd, bytes.as_ptr().cast(), bytes.len(), (offset_bytes + at) as i64) };
        assert_eq!(n as usize, bytes.len());
    }
    Ok((offsets, need_bytes))
}

pub fn temp_socket() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("s.sock");
    (d, p)
}
