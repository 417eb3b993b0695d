//! The daemon's life: `serve` (a long-lived sidecar), `launch` (the sidecar
//! as the parent of a trainer command), and `status` (a small client).
//!
//! Start-up order: bind the socket (fails fast if another sidecar owns it),
//! open the store (recovery), allocate and register staging, start the
//! committer, then accept. Signals (signal-hook, thread `ckpt-signals`):
//! - serve: the first SIGINT/SIGTERM stops new saves and waits for in-flight
//!   ones, then exits 0; a second aborts in-flight ones (temp folders
//!   removed; exit 1); a third exits at once (recovery cleans at next start).
//!   SIGHUP is logged and ignored (logs go to stderr; nothing to reopen).
//! - launch: SIGINT/SIGTERM/SIGHUP are forwarded to the child, which decides
//!   (it may save a last checkpoint); when it exits, in-flight checkpoints
//!   finish and the sidecar exits with the child's status (128 + signal if
//!   it was killed). A signal after the child exited aborts in-flight work.

pub mod fd_socket;
pub mod server;
pub mod session;

use std::ffi::OsString;
use std::io;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ckpt_wire::{FrameError, Reply, Request, StatusReport, PROTOCOL_VERSION};
use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use tracing::{info, warn};

use crate::config;
use crate::memory::staging::{Staging, StagingError};
use crate::state::jobs::Work;
use crate::state::DaemonState;
use ckpt_store::commit::{Store, StoreError, StoreOptions};
use ckpt_store::image::LayoutOptions;
use ckpt_store::io::IoPolicy;
use ckpt_store::lock::DirLock;
use ckpt_store::read_only::ReadOnly;
use ckpt_store::restore::{ReadOptions, ThisNode};
use ckpt_store::retention::Retention;
use server::{Listener, ServerError};

#[derive(Debug, Clone)]
pub struct DaemonOptions {
    pub dirs: Vec<PathBuf>,
    /// None: protocol.md's default path (serve) or a private temp dir (launch).
    pub socket: Option<PathBuf>,
    /// None: [`default_staging_bytes`].
    pub staging_bytes: Option<u64>,
    pub retention: Option<Retention>,
    pub allow_uids: Vec<u32>,
    pub io: IoPolicy,
    pub shard_bytes_max: u64,
    /// Run the sidecar's threads on these CPUs only (None: wherever the
    /// scheduler likes); launch's command keeps the CPUs it would have had.
    pub cpus: Option<Vec<usize>>,
    /// Several nodes: the directory all nodes' sidecars share (multi-rank
    /// steps are written and committed there, `crate::commit::nodes`).
    pub shared_dir: Option<PathBuf>,
    /// Several nodes, node-local files (`--node-local`): this node's id;
    /// its ranks' shards go to its own directories.
    pub node_local: Option<String>,
    /// Serve metrics on this address (`crate::state::metrics`).
    pub metrics: Option<std::net::SocketAddr>,
    /// Serve loads only, without the directory lock (`--read-only`); a
    /// directory that cannot be written is served so without it too.
    pub read_only: bool,
    /// The drain tier: every committed step is uploaded there (`crate::drain`).
    pub drain: Option<crate::drain::DrainOptions>,
    /// Incremental checkpoints (`--incremental`): digests, stable shards, links.
    pub incremental: bool,
    /// Every K-th save written in full (`--full-every`; 0: never).
    pub full_every: u32,
    /// The background scrub's interval (`--scrub-interval`; None: off).
    pub scrub_interval: Option<std::time::Duration>,
    /// Peers (`--peer-listen`, `--peers`): this node's steps replicated to
    /// them, theirs held here (`crate::peer`).
    pub peers: Option<crate::peer::PeerOptions>,
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Staging(#[from] StagingError),
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("staging budget of {0} bytes is below the minimum of {min} bytes", min = config::STAGING_BYTES_MIN)]
    StagingTooSmall(u64),
    #[error("installing signal handlers: {0}")]
    Signals(io::Error),
    #[error("starting {cmd:?}: {source}")]
    Spawn { cmd: OsString, source: io::Error },
    #[error("creating a private socket directory: {0}")]
    TempDir(io::Error),
    #[error("starting a thread: {0}")]
    Thread(io::Error),
    #[error(transparent)]
    Metrics(#[from] crate::state::metrics_http::BindError),
    #[error("cannot run on CPUs {cpus:?} (--cpus): {err}; this process may use CPUs {allowed:?}")]
    Cpus { cpus: Vec<usize>, allowed: Vec<usize>, err: io::Error },
    /// An environment variable the daemon reads has a value it refuses.
    #[error("{0}")]
    Env(String),
    #[error(transparent)]
    Drain(#[from] crate::drain::DrainError),
    #[error(transparent)]
    Peer(#[from] crate::peer::PeerError),
}

/// Pins this thread, and so every thread it starts later, to `cpus`;
/// returns the mask it had (for a child to get back).
fn pin_cpus(cpus: &[usize]) -> Result<libc::cpu_set_t, DaemonError> {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: cpu_set_t is plain data and all-zero is the empty set; the
    // calls get valid pointers to sets of `size` bytes and pid 0 (this thread).
    unsafe {
        let mut old: libc::cpu_set_t = std::mem::zeroed();
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::sched_getaffinity(0, size, &mut old);
        let allowed: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &old)).collect();
        let fail = |err: io::Error| DaemonError::Cpus { cpus: cpus.to_vec(), allowed: allowed.clone(), err };
        for &c in cpus {
            if c >= libc::CPU_SETSIZE as usize {
                return Err(fail(io::Error::from_raw_os_error(libc::EINVAL)));
            }
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, size, &set) != 0 {
            return Err(fail(io::Error::last_os_error()));
        }
        info!(?cpus, "sidecar threads pinned");
        Ok(old)
    }
}

/// The default staging budget: a quarter of physical memory, at most
/// 8 GiB ([`config::STAGING_BYTES_DEFAULT_MAX`]), at least the minimum.
pub fn default_staging_bytes() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    let ram = if pages > 0 && page > 0 { pages as u64 * page as u64 } else { 4 << 30 };
    (ram / config::STAGING_RAM_DIVISOR).clamp(config::STAGING_BYTES_MIN, config::STAGING_BYTES_DEFAULT_MAX)
}

enum Event {
    Signal(i32),
    ChildExited(i32),
}

struct Running {
    state: Arc<DaemonState>,
    listener: Listener,
    /// The target directories' locks: released (their files removed) when
    /// the daemon stops, after draining; the committer's Store does not
    /// hold them because its thread is never joined.
    _locks: Vec<DirLock>,
}

/// Starts the daemon; `role` (`serve` or `launch`) goes into the directory
/// locks with the socket, so a second process on a directory names us.
/// The steps run in the start-up order the module doc states.
fn start(opts: &DaemonOptions, socket: &Path, role: &str) -> Result<Running, DaemonError> {
    let budget = check_start_options(opts)?;
    let metrics = opts.metrics.map(crate::state::metrics_http::bind).transpose()?;
    // The drain target first: a wrong credential or an unreachable URL
    // stops the start before anything is bound, locked or allocated.
    let drain = opts.drain.as_ref().map(|d| open_drain(opts, d)).transpose()?;
    // The peer secret too: a missing, short or readable one stops it.
    if let Some(p) = &opts.peers {
        crate::peer::read_secret(&p.secret_file).map_err(crate::peer::PeerError::from)?;
    }
    let mut listener = server::bind(socket, !opts.allow_uids.is_empty())?;
    let mut store = open_store(opts, socket, role)?;
    let locks = store.take_locks();
    if let Some(d) = &drain {
        store.set_retention_hold(d.hold());
        crate::drain::remove_stale_fetches(&store.dirs()[0]);
    }
    let staging = Staging::new(budget)?;
    if let Some(d) = &drain {
        d.use_staging(staging.clone());
        d.on_damage(Box::new(|step, file, why| {
            crate::state::damage::record(step, file, why, crate::state::damage::Finder::Drain)
        }));
    }
    store.register_staging(staging.buf());
    let (tx, rx) = bounded(config::COMMIT_QUEUE_MAX);
    let peers = start_peers(opts, &store)?;
    if let (Some(d), Some(p)) = (&drain, &peers) {
        let p = p.clone();
        d.on_uploaded(Box::new(move |step| p.uploaded(step)));
    }
    let state = new_state(opts, &store, staging, tx, &drain, peers);
    log_ready(&state, &store);
    crate::commit::committer::spawn(store, rx, state.clone());
    if let Some(d) = &drain {
        d.spawn()?;
    }
    if let Some(m) = metrics {
        let s = state.clone();
        crate::state::metrics_http::spawn(m, move || s.report()).map_err(DaemonError::Thread)?;
    }
    server::spawn_accept(&listener, state.clone()).map_err(DaemonError::Thread)?;
    spawn_housekeeping(state.clone()).map_err(DaemonError::Thread)?;
    if let Some(every) = opts.scrub_interval {
        crate::scrub::spawn(state.clone(), every).map_err(DaemonError::Thread)?;
    }
    // Only now may clients find the socket: they get answers at once.
    listener.publish()?;
    Ok(Running { state, listener, _locks: locks })
}

/// The `ckpt-housekeeping` thread: every [`config::SESSION_REAP_INTERVAL_MS`]
/// it closes the sessions whose client process is gone and writes the
/// refusal log's summary of an interval that ended.
fn spawn_housekeeping(state: Arc<DaemonState>) -> io::Result<()> {
    std::thread::Builder::new().name("ckpt-housekeeping".into()).spawn(move || loop {
        std::thread::sleep(Duration::from_millis(config::SESSION_REAP_INTERVAL_MS));
        state.reap_sessions();
        crate::state::refusal_log::flush();
    })?;
    Ok(())
}

/// The checks of the options before anything is started: the part timeout
/// from the environment, and the staging budget (returned).
fn check_start_options(opts: &DaemonOptions) -> Result<u64, DaemonError> {
    crate::commit::committer::check_part_timeout().map_err(DaemonError::Env)?;
    let budget = opts.staging_bytes.unwrap_or_else(default_staging_bytes);
    if budget < config::STAGING_BYTES_MIN {
        return Err(DaemonError::StagingTooSmall(budget));
    }
    Ok(budget)
}

/// Opens the drain target (reaching it, so a bad one fails the start).
fn open_drain(opts: &DaemonOptions, d: &crate::drain::DrainOptions) -> Result<Arc<crate::drain::Drain>, DaemonError> {
    let dirs = opts.dirs.iter().map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone())).collect();
    let dirs: Vec<PathBuf> = dirs;
    // Several nodes with node-local files: this node drains its own
    // files of the steps committed in the shared directory.
    let nodes = match (&opts.shared_dir, &opts.node_local) {
        (Some(sh), Some(id)) => Some(crate::drain::NodesDrain {
            shared_dir: std::fs::canonicalize(sh)
                .unwrap_or_else(|_| std::path::absolute(sh).unwrap_or_else(|_| sh.clone())),
            me: ThisNode { id: id.clone(), dirs: dirs.clone() },
        }),
        _ => None,
    };
    let drain = crate::drain::Drain::open_nodes(d.clone(), dirs, nodes)?;
    info!(url = drain.url(), every = d.every, keep = ?d.keep, bandwidth_bytes_per_s = ?d.bandwidth_bytes_per_s, "drain target reachable");
    Ok(drain)
}

/// Starts the peer tier (server, replication) once the store named this
/// node; only a node-local layout has files of its own to replicate.
fn start_peers(opts: &DaemonOptions, store: &Store) -> Result<Option<Arc<crate::peer::Peers>>, DaemonError> {
    let Some(p) = &opts.peers else { return Ok(None) };
    let (Some(id), Some(shared)) = (store.node_id(), store.shared_dir()) else {
        return Err(crate::peer::PeerError::NotNodeLocal.into());
    };
    let me = ThisNode { id: id.to_string(), dirs: store.dirs().to_vec() };
    let peers = crate::peer::Peers::start(p.clone(), me, shared.to_path_buf())?;
    // No shared file system: this node's folder catches up with the steps
    // its peers hold newer than its own `latest` before a load can ask for
    // `latest`, and only then are this node's folders of steps it does not
    // know swept.
    if peers.over_peers() {
        peers.take_newer(store);
        store.sweep_node_local(&Default::default());
    }
    Ok(Some(peers))
}

/// Opens the store: the directories are locked (a second sidecar on one
/// fails here, naming the holder) and recovered before the staging budget
/// is allocated.
fn open_store(opts: &DaemonOptions, socket: &Path, role: &str) -> Result<Store, StoreError> {
    Store::open(StoreOptions {
        io: opts.io,
        retention: opts.retention,
        lock_role: role.into(),
        lock_socket: Some(std::path::absolute(socket).unwrap_or_else(|_| socket.to_path_buf())),
        shared: opts.shared_dir.clone(),
        // Twice the part timeout: a live coordinator aborts long before.
        shared_stale_after: crate::commit::committer::part_timeout() * 2,
        node_local: opts.node_local.clone(),
        sweep_later: opts.peers.as_ref().is_some_and(|p| p.shared_over_peers),
        read_only: if opts.read_only { ReadOnly::Always } else { ReadOnly::Auto },
        ..StoreOptions::new(opts.dirs.clone())
    })
}

/// The daemon's shared state, from the options and the opened store.
fn new_state(
    opts: &DaemonOptions,
    store: &Store,
    staging: Arc<Staging>,
    tx: Sender<Work>,
    drain: &Option<Arc<crate::drain::Drain>>,
    peers: Option<Arc<crate::peer::Peers>>,
) -> Arc<DaemonState> {
    let layout_opts = LayoutOptions {
        n_dirs: store.dirs().len(),
        shard_bytes_max: opts.shard_bytes_max,
        incremental: opts.incremental,
        ..Default::default()
    };
    let mut state = DaemonState::new(
        store.dirs().to_vec(),
        layout_opts,
        ReadOptions {
            io: opts.io,
            node: store.node_id().map(|id| ThisNode { id: id.to_string(), dirs: store.dirs().to_vec() }),
            kept_index: Some(Default::default()),
            ..Default::default()
        },
        staging,
        tx,
        opts.allow_uids.clone(),
        Arc::new(AtomicBool::new(false)),
    );
    state.shared_dir = store.shared_dir().map(Path::to_path_buf);
    state.read_only = store.read_only().cloned();
    state.drain = drain.clone();
    state.peers = peers;
    state.full_every.store(opts.full_every, std::sync::atomic::Ordering::Relaxed);
    Arc::new(state)
}

/// Logs how this sidecar serves several nodes (if it does) and that it is ready.
fn log_ready(state: &DaemonState, store: &Store) {
    if let Some(d) = &state.shared_dir {
        match &state.read_opts.node {
            None => {
                info!(shared = %d.display(), "several nodes: multi-rank steps are written into the shared directory; this sidecar coordinates every step whose rank 0 it serves")
            }
            Some(n) if state.peers.as_ref().is_some_and(|p| p.over_peers()) => {
                info!(shared = %d.display(), node = %n.id, dirs = ?n.dirs, "several nodes, no shared file system: this node's ranks' shards go to its own directories, markers and blobs to the coordinator by the peers, and each committed step's index comes back into this node's own shared directory; this sidecar coordinates every step whose rank 0 it serves")
            }
            Some(n) => {
                info!(shared = %d.display(), node = %n.id, dirs = ?n.dirs, "several nodes, node-local: this node's ranks' shards go to its own directories, markers and the index to the shared directory; this sidecar coordinates every step whose rank 0 it serves")
            }
        }
    }
    info!(dirs = ?state.dirs, engines = %store.engine_names(), staging_bytes = state.staging.budget_bytes(), cuda = %crate::memory::cuda_probe::summary(), "sidecar ready");
}

fn signals(tx: crossbeam_channel::Sender<Event>) -> Result<(), DaemonError> {
    let mut sigs = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]).map_err(DaemonError::Signals)?;
    std::thread::Builder::new()
        .name("ckpt-signals".into())
        .spawn(move || {
            for s in sigs.forever() {
                if tx.send(Event::Signal(s)).is_err() {
                    return;
                }
            }
        })
        .map_err(DaemonError::Thread)?;
    Ok(())
}

fn stop(r: Running) {
    r.state.close_sessions();
    drop(r.listener);
}

/// Runs the daemon until signalled; returns the exit code.
pub fn serve(opts: &DaemonOptions) -> Result<u8, DaemonError> {
    if let Some(cpus) = &opts.cpus {
        pin_cpus(cpus)?;
    }
    let socket = opts.socket.clone().unwrap_or_else(server::default_socket_path);
    let (tx, rx) = bounded(16);
    signals(tx)?;
    let r = start(opts, &socket, "serve")?;
    let mut n_signals = 0;
    let aborted = loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(Event::Signal(SIGHUP)) => info!("SIGHUP: logs go to stderr, nothing to reopen"),
            Ok(Event::Signal(s)) => {
                n_signals += 1;
                on_stop_signal(&r.state, s, n_signals);
            }
            Ok(Event::ChildExited(_)) => unreachable!("serve has no child"),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => unreachable!("the signal thread never ends"),
        }
        if r.state.is_draining() && r.state.drained() && drain_settled(&r.state) {
            break r.state.is_aborting();
        }
    };
    info!(aborted, "sidecar exits");
    stop(r);
    Ok(if aborted { 1 } else { 0 })
}

/// A stopping sidecar waits for its drain to replicate the newest committed
/// step (unless it aborts, or the target is down): the local disks may
/// not outlive it.
fn drain_settled(state: &DaemonState) -> bool {
    match &state.drain {
        Some(d) if !state.is_aborting() => {
            // After the retention a replicated held step made due (the committer's).
            let settled = d.settled() && !d.retention_due();
            if !settled {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| info!(url = d.url(), "waiting for the drain to replicate the newest committed step before exiting (signal again to exit without)"));
            }
            settled
        }
        _ => true,
    }
}

fn on_stop_signal(state: &DaemonState, sig: i32, n: u32) {
    match n {
        1 => {
            state.draining.store(true, Ordering::SeqCst);
            info!(
                sig,
                in_flight = state.n_in_flight(),
                "stopping: no new saves; finishing in-flight checkpoints (signal again to abort them)"
            );
        }
        2 => {
            state.draining.store(true, Ordering::SeqCst);
            state.aborting.store(true, Ordering::SeqCst);
            warn!(
                sig,
                in_flight = state.n_in_flight(),
                "aborting in-flight checkpoints (signal again to exit at once)"
            );
        }
        _ => {
            warn!("exiting at once; the next start removes what was in flight");
            std::process::exit(1);
        }
    }
}

/// A private directory for launch's socket (0700, under XDG_RUNTIME_DIR
/// or /tmp); removed at exit.
fn private_dir() -> io::Result<PathBuf> {
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|p| !p.is_empty() && Path::new(p).is_dir())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    let mut template = base.join("ckpt-sidecar-launch-XXXXXX").into_os_string().into_encoded_bytes();
    template.push(0);
    // SAFETY: template is a writable NUL-terminated buffer ending in XXXXXX,
    // as mkdtemp requires; it creates the directory with mode 0700.
    let p = unsafe { libc::mkdtemp(template.as_mut_ptr().cast()) };
    if p.is_null() {
        return Err(io::Error::last_os_error());
    }
    template.pop();
    // SAFETY: the bytes came from an OsString plus mkdtemp's ASCII suffix.
    Ok(PathBuf::from(unsafe { OsString::from_encoded_bytes_unchecked(template) }))
}

/// Runs the sidecar with `cmd` as its child; returns the child's status.
/// With `preload`, the child gets that library in LD_PRELOAD (before any it
/// already had) and CKPT_SIDECAR_PRELOAD=1, which tells the shim to connect at
/// load and take SIGTERM as the preemption flag.
pub fn launch(opts: &DaemonOptions, cmd: &[OsString], preload: Option<&Path>) -> Result<u8, DaemonError> {
    assert!(!cmd.is_empty(), "clap requires a command");
    let child_cpus = opts.cpus.as_deref().map(pin_cpus).transpose()?;
    let (tx, rx) = bounded(16);
    signals(tx.clone())?;
    let tmp = if opts.socket.is_none() { Some(private_dir().map_err(DaemonError::TempDir)?) } else { None };
    let socket = opts.socket.clone().unwrap_or_else(|| tmp.as_ref().expect("made above").join("sidecar.sock"));
    let r = match start(opts, &socket, "launch") {
        Ok(r) => r,
        Err(e) => {
            if let Some(t) = &tmp {
                let _ = std::fs::remove_dir(t);
            }
            return Err(e);
        }
    };
    let result = run_child(&r, &socket, cmd, preload, child_cpus, tx, &rx);
    stop(r);
    if let Some(t) = &tmp {
        let _ = std::fs::remove_dir(t);
    }
    result
}

fn run_child(
    r: &Running,
    socket: &Path,
    cmd: &[OsString],
    preload: Option<&Path>,
    child_cpus: Option<libc::cpu_set_t>,
    tx: crossbeam_channel::Sender<Event>,
    rx: &Receiver<Event>,
) -> Result<u8, DaemonError> {
    let mut command = std::process::Command::new(&cmd[0]);
    command.args(&cmd[1..]).env(ckpt_wire::SOCKET_ENV, socket);
    if let Some(set) = child_cpus {
        use std::os::unix::process::CommandExt;
        // SAFETY: runs in the forked child before exec; sched_setaffinity is
        // a plain syscall (async-signal-safe) on a set copied into the closure.
        unsafe {
            command.pre_exec(move || {
                if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    if let Some(lib) = preload {
        let mut v = lib.as_os_str().to_os_string();
        if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
            v.push(":");
            v.push(old);
        }
        command.env("LD_PRELOAD", v).env("CKPT_SIDECAR_PRELOAD", "1");
    }
    let mut child = command.spawn().map_err(|source| DaemonError::Spawn { cmd: cmd[0].clone(), source })?;
    let pid = child.id() as i32;
    info!(pid, cmd = ?cmd, socket = %socket.display(), "trainer started");
    std::thread::Builder::new()
        .name("ckpt-child".into())
        .spawn(move || {
            let code = match child.wait() {
                Ok(st) => st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)),
                Err(e) => {
                    warn!("waiting for the trainer: {e}");
                    1
                }
            };
            let _ = tx.send(Event::ChildExited(code));
        })
        .map_err(DaemonError::Thread)?;
    let mut child_code: Option<i32> = None;
    let mut n_after_exit = 0;
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(Event::Signal(s)) if child_code.is_none() => {
                info!(sig = s, pid, "forwarding signal to the trainer");
                // SAFETY: kill has no memory preconditions; the child is not
                // yet reaped (its exit event has not arrived), so pid is it.
                unsafe { libc::kill(pid, s) };
            }
            Ok(Event::Signal(s)) => {
                if s != SIGHUP {
                    n_after_exit += 1;
                    on_stop_signal(&r.state, s, n_after_exit + 1);
                }
            }
            Ok(Event::ChildExited(code)) => {
                info!(code, in_flight = r.state.n_in_flight(), "trainer exited; finishing in-flight checkpoints");
                r.state.draining.store(true, Ordering::SeqCst);
                child_code = Some(code);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => unreachable!("the signal thread never ends"),
        }
        if let Some(code) = child_code {
            if r.state.drained() && drain_settled(&r.state) {
                return Ok(code.clamp(0, 255) as u8);
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to the sidecar at {path}: {source}")]
    Connect { path: PathBuf, source: io::Error },
    #[error("talking to the sidecar: {0}")]
    Frame(FrameError),
    /// A read timed out: what listens there is no sidecar, or a stuck one.
    #[error("no answer within {secs} s (not a ckpt-sidecar, or a stuck one)")]
    NoAnswer { secs: u64 },
    #[error("the sidecar refused: {0}")]
    Refused(String),
    #[error("the sidecar speaks protocol version {0}, this binary {PROTOCOL_VERSION}")]
    Version(u32),
    #[error("unexpected reply: {0}")]
    Unexpected(String),
    #[error("{message}")]
    Remote { code: ckpt_wire::ErrorCode, message: String },
}

/// Sends one request (id 1) to the sidecar at `socket` as a client over the
/// wire crate, and returns its reply (an `Error` reply as `ClientError::Remote`).
/// `timeout`: how long to wait for the answer (None: no limit).
fn request(socket: &Path, name: &str, req: &Request, timeout: Option<Duration>) -> Result<Reply, ClientError> {
    let stream =
        UnixStream::connect(socket).map_err(|source| ClientError::Connect { path: socket.to_path_buf(), source })?;
    let hello_timeout = Duration::from_millis(config::TOOL_ANSWER_TIMEOUT_MS);
    let _ = stream.set_read_timeout(Some(hello_timeout));
    let mut s = NoSigPipe(stream);
    let frame = |waited: Option<Duration>| {
        move |e: FrameError| match (&e, waited) {
            (FrameError::Io(io), Some(w))
                if matches!(io.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
            {
                ClientError::NoAnswer { secs: w.as_secs() }
            }
            _ => ClientError::Frame(e),
        }
    };
    ckpt_wire::write_frame(&mut s, &ckpt_wire::hello(name)).map_err(frame(None))?;
    match ckpt_wire::read_frame::<Reply>(&mut s).map_err(frame(Some(hello_timeout)))? {
        Reply::Welcome { version, .. } if version == PROTOCOL_VERSION => {}
        Reply::Welcome { version, .. } => return Err(ClientError::Version(version)),
        Reply::Refused { reason } => return Err(ClientError::Refused(reason)),
        other => return Err(ClientError::Unexpected(format!("{other:?}"))),
    }
    let _ = s.0.set_read_timeout(timeout);
    ckpt_wire::write_frame(&mut s, req).map_err(frame(None))?;
    let reply = ckpt_wire::read_frame::<Reply>(&mut s).map_err(frame(timeout))?;
    let _ = ckpt_wire::write_frame(&mut s, &Request::Bye);
    match reply {
        Reply::Error { code, message, .. } => Err(ClientError::Remote { code, message }),
        r => Ok(r),
    }
}

/// A client socket whose writes never raise SIGPIPE: the command line
/// tools let a closed stdout end them by SIGPIPE, but a sidecar that closes
/// the connection is an error to report, not a reason to die silently.
struct NoSigPipe(UnixStream);

impl io::Write for NoSigPipe {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        use std::os::fd::AsRawFd;
        // SAFETY: send reads at most buf.len() bytes from buf, a live slice;
        // the descriptor is the stream we own.
        let n = unsafe { libc::send(self.0.as_raw_fd(), buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl io::Read for NoSigPipe {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        io::Read::read(&mut self.0, buf)
    }
}

/// Asks the sidecar at `socket` for its status.
pub fn status(socket: &Path) -> Result<StatusReport, ClientError> {
    match request(
        socket,
        server::STATUS_TOOL_NAME,
        &Request::Status { id: 1 },
        Some(Duration::from_millis(config::TOOL_ANSWER_TIMEOUT_MS)),
    )? {
        Reply::Status { id: 1, report } => Ok(report),
        other => Err(ClientError::Unexpected(format!("{other:?}"))),
    }
}

/// Asks the sidecar at `socket` to roll its directories back to `step`
/// (after the saves queued before); returns the steps un-committed.
pub fn rollback(socket: &Path, step: u64) -> Result<Vec<u64>, ClientError> {
    match request(socket, "ckpt-sidecar rollback", &Request::Rollback { id: 1, step }, None)? {
        Reply::RolledBack { id: 1, removed, .. } => Ok(removed),
        other => Err(ClientError::Unexpected(format!("{other:?}"))),
    }
}
