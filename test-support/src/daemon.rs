//! The harness of the sidecar's integration tests that drive the real
//! binary (`sidecar/tests/it/daemon.rs`, `incremental.rs`): `ckpt-sidecar
//! serve` on a temporary socket ([`Daemon`]), the same with the folders it
//! lives in ([`Sidecar`]), a raw client speaking the wire crate's frames
//! ([`Client`]), and POSIX shared-memory segments made here with
//! shm_open/ftruncate/mmap ([`Shm`]). Waits are on conditions (the socket
//! answering, a reply); the durations only bound a hang.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use ckpt_wire::{Blob, ErrorCode, Reply, Request, TensorDesc, PROTOCOL_VERSION};

/// How long a reply, a start or a stop may take before the test fails
/// instead of hanging (a busy 2-core CI machine is slow, never this slow).
pub const HANG_BOUND: Duration = Duration::from_secs(60);

/// A `ckpt-sidecar serve` child; killed on drop if still running.
pub struct Daemon {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Daemon {
    /// Starts `bin serve --dir DIR --socket SOCKET --staging STAGING EXTRA…`
    /// with `env` (and `CKPT_SIDECAR_LOG=info`), its stderr in `log`, and
    /// returns once the socket accepts a connection.
    pub fn serve(
        bin: &Path,
        dir: &Path,
        socket: PathBuf,
        log: PathBuf,
        staging: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let child = Command::new(bin)
            .arg("serve")
            .arg("--dir")
            .arg(dir)
            .arg("--socket")
            .arg(&socket)
            .args(["--staging", staging])
            .args(extra)
            .env("CKPT_SIDECAR_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut d = Daemon { child: Some(child), socket, log };
        let t0 = Instant::now();
        while UnixStream::connect(&d.socket).is_err() {
            if let Some(st) = d.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("sidecar exited at start ({st}):\n{}", d.log_text());
            }
            assert!(t0.elapsed() < HANG_BOUND, "sidecar did not listen:\n{}", d.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// SIGTERM, then the exit code (-1: ended by a signal).
    pub fn stop(&mut self) -> i32 {
        let mut c = self.child.take().unwrap();
        crate::terminate(&mut c, HANG_BOUND)
            .unwrap_or_else(|| panic!("sidecar did not exit after SIGTERM:\n{}", self.log_text()))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A [`Daemon`] (which it derefs to) with the folders it lives in: the
/// checkpoint directory it serves, and a folder for its socket
/// (`run-N/sidecar.sock`) and log (`sidecar-N.log`), N counting the
/// sidecars of this process. That folder is a temporary directory of its
/// own (removed on drop) or one the test owns, where several may live.
pub struct Sidecar {
    daemon: Daemon,
    /// The checkpoint directory it serves.
    pub dir: PathBuf,
    staging_mib: u64,
    run_dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl Sidecar {
    /// The staging of the sidecars [`Sidecar::start`] and its kin start.
    pub const STAGING_MIB: u64 = 64;

    /// 64 MiB of staging, in a temporary directory of its own (the
    /// checkpoints in its `ckpt/`).
    pub fn start(extra: &[&str]) -> Sidecar {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        Self::start_in(tmp, dir, extra)
    }

    /// 64 MiB of staging, serving `dir`, living in `tmp` (kept until drop).
    pub fn start_in(tmp: tempfile::TempDir, dir: PathBuf, extra: &[&str]) -> Sidecar {
        Self::start_in_env(tmp, dir, extra, &[])
    }

    /// As [`Sidecar::start_in`], with `env` set for the daemon.
    pub fn start_in_env(tmp: tempfile::TempDir, dir: PathBuf, extra: &[&str], env: &[(&str, &str)]) -> Sidecar {
        let mut sc = Self::start_at(tmp.path(), &dir, Self::STAGING_MIB, extra, env);
        sc._tmp = Some(tmp);
        sc
    }

    /// `staging_mib` MiB of staging, serving `dir`, its socket and log in
    /// `run_dir`, a folder the test owns (several sidecars may share it).
    pub fn start_at(run_dir: &Path, dir: &Path, staging_mib: u64, extra: &[&str], env: &[(&str, &str)]) -> Sidecar {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let socket = run_dir.join(format!("run-{n}")).join("sidecar.sock");
        Self::serve(run_dir, dir, socket, staging_mib, extra, env)
    }

    fn serve(
        run_dir: &Path,
        dir: &Path,
        socket: PathBuf,
        staging_mib: u64,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Sidecar {
        static N: AtomicU32 = AtomicU32::new(0);
        let log = run_dir.join(format!("sidecar-{}.log", N.fetch_add(1, Ordering::Relaxed)));
        let staging = format!("{staging_mib}MiB");
        let daemon = Daemon::serve(crate::bin::sidecar_bin(), dir, socket, log, &staging, extra, env);
        Sidecar { daemon, dir: dir.to_path_buf(), staging_mib, run_dir: run_dir.to_path_buf(), _tmp: None }
    }

    /// A session that has said Hello; the Welcome must report this
    /// sidecar's staging.
    pub fn client(&self) -> Client {
        let c = Client::connect(&self.socket, "sidecar-test");
        assert_eq!(c.staging_bytes, self.staging_mib << 20);
        c
    }

    /// A session with `shm` registered as region 1.
    pub fn client_with(&self, shm: &Shm) -> Client {
        let mut c = self.client();
        match c.register(1, shm) {
            Reply::RegionRegistered { .. } => c,
            other => panic!("register: {other:?}"),
        }
    }

    /// SIGTERM; the sidecar must exit 0.
    pub fn stop_ok(&mut self) {
        let code = self.daemon.stop();
        assert_eq!(code, 0, "{}", self.log_text());
    }

    /// Stops this one (it must exit 0) and starts another on the same
    /// directory and socket, without its extra arguments.
    pub fn restart(mut self) -> Sidecar {
        self.stop_ok();
        let socket = self.socket.clone();
        let mut next = Self::serve(&self.run_dir, &self.dir, socket, self.staging_mib, &[], &[]);
        next._tmp = self._tmp.take();
        next
    }
}

impl std::ops::Deref for Sidecar {
    type Target = Daemon;
    fn deref(&self) -> &Daemon {
        &self.daemon
    }
}

impl std::ops::DerefMut for Sidecar {
    fn deref_mut(&mut self) -> &mut Daemon {
        &mut self.daemon
    }
}

/// A session over the raw wire protocol.
pub struct Client {
    pub s: UnixStream,
    next_id: u64,
    /// What the sidecar's Welcome said its staging holds.
    pub staging_bytes: u64,
}

impl Client {
    /// A connection that has said nothing yet (replies bounded by [`HANG_BOUND`]).
    pub fn raw(socket: &Path) -> UnixStream {
        let s = UnixStream::connect(socket).unwrap();
        s.set_read_timeout(Some(HANG_BOUND)).unwrap();
        s
    }

    /// Says Hello as `name` and expects Welcome in this protocol's version.
    pub fn connect(socket: &Path, name: &str) -> Client {
        let mut s = Self::raw(socket);
        ckpt_wire::write_frame(&mut s, &ckpt_wire::hello(name)).unwrap();
        match ckpt_wire::read_frame::<Reply>(&mut s).unwrap() {
            Reply::Welcome { version, staging_bytes, .. } => {
                assert_eq!(version, PROTOCOL_VERSION);
                Client { s, next_id: 1, staging_bytes }
            }
            other => panic!("expected Welcome, got {other:?}"),
        }
    }

    /// A new request id.
    pub fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub fn send(&mut self, r: &Request) {
        ckpt_wire::write_frame(&mut self.s, r).unwrap();
    }

    /// Sends the request `r` makes of a new id; returns the id.
    pub fn call(&mut self, r: impl FnOnce(u64) -> Request) -> u64 {
        let id = self.id();
        self.send(&r(id));
        id
    }

    pub fn recv(&mut self) -> Reply {
        ckpt_wire::read_frame::<Reply>(&mut self.s).unwrap()
    }

    pub fn register(&mut self, region_id: u32, shm: &Shm) -> Reply {
        self.register_as(region_id, shm, false)
    }

    /// Registers `shm`, as a hand-over region (protocol.md) or not.
    pub fn register_as(&mut self, region_id: u32, shm: &Shm, hand_over: bool) -> Reply {
        self.call(|id| Request::RegisterRegion {
            id,
            region_id,
            shm_name: shm.name.clone(),
            len_bytes: shm.len as u64,
            hand_over,
        });
        self.recv()
    }

    /// Sends a Save; returns its id. Odd steps ask for a lazy release
    /// (checksums, and digests, during the copy), even ones for an early
    /// one (after it): every test covers both.
    pub fn save(&mut self, step: u64, tensors: Vec<TensorDesc>, blobs: Vec<Blob>) -> u64 {
        self.call(|id| Request::Save { id, step, tensors, blobs, lazy_release: step % 2 == 1, unchanged: None })
    }

    /// Save, then expect Released and Durable; returns the step's path.
    pub fn save_durable(&mut self, step: u64, tensors: Vec<TensorDesc>, blobs: Vec<Blob>) -> String {
        let id = self.save(step, tensors, blobs);
        match self.recv() {
            Reply::Released { id: i, step: s, .. } => assert_eq!((i, s), (id, step)),
            other => panic!("step {step}: expected Released, got {other:?}"),
        }
        match self.recv() {
            Reply::Durable { id: i, step: s, path, .. } => {
                assert_eq!((i, s), (id, step));
                path
            }
            other => panic!("step {step}: expected Durable, got {other:?}"),
        }
    }

    /// Save, then expect Failed with `code`; returns its reason.
    pub fn expect_failed(&mut self, step: u64, tensors: Vec<TensorDesc>, blobs: Vec<Blob>, code: ErrorCode) -> String {
        let id = self.save(step, tensors, blobs);
        match self.recv() {
            Reply::Failed { id: i, code: c, reason, .. } if i == id && c == code => reason,
            other => panic!("expected Failed {code:?}, got {other:?}"),
        }
    }

    pub fn load(&mut self, step: Option<u64>, tensors: Vec<TensorDesc>) -> Reply {
        self.call(|id| Request::Load { id, step, tensors });
        self.recv()
    }

    pub fn rollback(&mut self, step: u64) -> Reply {
        self.call(|id| Request::Rollback { id, step });
        self.recv()
    }

    pub fn status(&mut self) -> ckpt_wire::StatusReport {
        self.call(|id| Request::Status { id });
        match self.recv() {
            Reply::Status { report, .. } => report,
            other => panic!("expected Status, got {other:?}"),
        }
    }

    /// The session was closed by the sidecar: EOF (after an optional Error).
    pub fn expect_closed(mut s: UnixStream) {
        loop {
            match ckpt_wire::read_frame::<Reply>(&mut s) {
                Ok(Reply::Error { code: ErrorCode::BadRequest, .. }) => {}
                Ok(other) => panic!("expected the session to close, got {other:?}"),
                Err(ckpt_wire::FrameError::Closed) => return,
                Err(ckpt_wire::FrameError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
                Err(e) => panic!("expected EOF, got {e}"),
            }
        }
    }
}

static SHM_N: AtomicU32 = AtomicU32::new(0);

/// A POSIX shared-memory segment, mapped read-write here; unmapped and
/// unlinked on drop.
pub struct Shm {
    pub name: String,
    pub ptr: *mut u8,
    pub len: usize,
}

impl Shm {
    pub fn new(len: usize) -> Shm {
        let name = format!(
            "/ckpt-test-{}-{}-{:08x}",
            std::process::id(),
            SHM_N.fetch_add(1, Ordering::Relaxed),
            Instant::now().elapsed().subsec_nanos() ^ 0x5a5a
        );
        let c = std::ffi::CString::new(name.clone()).unwrap();
        // SAFETY: plain libc calls with checked results; the mapping is ours.
        unsafe {
            let fd = libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600);
            assert!(fd >= 0, "shm_open: {}", std::io::Error::last_os_error());
            assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            libc::close(fd);
            Shm { name, ptr: p.cast(), len }
        }
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: our own live mapping of len bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusive through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The bytes tensor `d` names in this segment.
    pub fn of(&self, d: &TensorDesc) -> &[u8] {
        &self.bytes()[d.offset_bytes as usize..(d.offset_bytes + d.len_bytes) as usize]
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.name.clone()).unwrap();
        // SAFETY: unmapping our mapping; unlinking our name.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len.max(1));
            libc::shm_unlink(c.as_ptr());
        }
    }
}
