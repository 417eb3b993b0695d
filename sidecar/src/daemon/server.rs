//! The listening socket and the handshake: where the socket lives (0600, in
//! a 0700 directory), who may connect (SO_PEERCRED: the sidecar's uid, or
//! one allowed with `--allow-uid`), and one named thread per session.
//!
//! Trust boundary: until its Hello is accepted, a peer gets a small frame
//! limit and a read timeout; a peer of another uid, a wrong magic or version,
//! or a first frame that is not a Hello gets `Refused` and is closed. A peer
//! process gets at most its share of the sessions (`SessionsFull` names the
//! process that holds them). Refusals are logged through
//! [`refusal_log`](crate::state::refusal_log), rate-limited per process.
//!
//! A Hello named [`STATUS_TOOL_NAME`] is a read-only tool's: it is no
//! session (it takes none of the sessions' places, so `status` gets in when
//! every place is taken), may ask only Status and List, and is closed after
//! [`config::TOOL_ANSWER_TIMEOUT_MS`] without a request.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ckpt_wire::{ErrorCode, FrameError, Reply, Request, MAGIC, PROTOCOL_VERSION};
use tracing::{debug, info, warn};

use crate::config;
use crate::daemon::session::{self, Session, NO_REQUEST_ID};
use crate::state::refusal::Refusal;
use crate::state::{refusal_log, DaemonState, Peer, SessionEntry};

/// The Hello name of `ckpt-sidecar status`: a read-only tool connection.
pub const STATUS_TOOL_NAME: &str = "ckpt-sidecar status";

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{path}: {what}: {source}")]
    Io { path: PathBuf, what: &'static str, source: io::Error },
    #[error("{0}: another sidecar is already listening there")]
    InUse(PathBuf),
    #[error("{path}: {why}")]
    Unsafe { path: PathBuf, why: String },
    #[error("socket path {} is {len} bytes, longer than a Unix socket address holds ({max}); pass a shorter --socket", .path.display(), max = config::SOCKET_PATH_BYTES_MAX)]
    PathTooLong { path: PathBuf, len: usize },
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> ServerError + 'a {
    move |source| ServerError::Io { path: path.to_path_buf(), what, source }
}

/// The socket path protocol.md prescribes: `$CKPT_SIDECAR_SOCKET`, else
/// `$XDG_RUNTIME_DIR/ckpt-sidecar/sidecar.sock`, else
/// `/tmp/ckpt-sidecar-<uid>/sidecar.sock`.
pub fn default_socket_path() -> PathBuf {
    if let Some(p) = std::env::var_os(ckpt_wire::SOCKET_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|p| !p.is_empty()) {
        return PathBuf::from(d).join("ckpt-sidecar").join("sidecar.sock");
    }
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    PathBuf::from(format!("/tmp/ckpt-sidecar-{uid}")).join("sidecar.sock")
}

/// A bound listening socket; removes its file (and the directory, if it
/// made it) on drop.
///
/// It is bound under a starting name in the socket's directory and reaches
/// `path` only through [`Listener::publish`], once the daemon serves: the
/// staging pre-fault before that can take many seconds (about 2 s per GiB
/// on VMs whose free memory went back to the hypervisor), and a client that
/// connected meanwhile would wait for its Hello's answer until it timed out.
/// A client that finds the socket finds a sidecar that answers.
pub struct Listener {
    pub path: PathBuf,
    /// Where the socket is bound until published (`path` itself when the
    /// starting name would not fit a socket address).
    bound_at: PathBuf,
    published: bool,
    listener: UnixListener,
    made_dir: Option<PathBuf>,
}

impl Listener {
    /// Makes the socket reachable at `path` (a hard link: it fails if
    /// another sidecar published there since [`bind`] checked).
    pub fn publish(&mut self) -> Result<(), ServerError> {
        if self.bound_at != self.path {
            fs::hard_link(&self.bound_at, &self.path).map_err(|e| match e.kind() {
                io::ErrorKind::AlreadyExists => ServerError::InUse(self.path.clone()),
                _ => ServerError::Io { path: self.path.clone(), what: "link the socket into place", source: e },
            })?;
            let _ = fs::remove_file(&self.bound_at);
        }
        self.published = true;
        info!(path = %self.path.display(), "listening");
        Ok(())
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = fs::remove_file(if self.published { &self.path } else { &self.bound_at });
        if let Some(d) = &self.made_dir {
            let _ = fs::remove_dir(d);
        }
    }
}

/// Prefix of the name a socket is bound under while its daemon starts.
const STARTING_PREFIX: &str = ".ckpt-starting-";

/// Removes sockets left under a starting name by daemons that died while
/// starting (their pid is gone).
fn sweep_starting(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(STARTING_PREFIX)).and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() && e.file_type().is_ok_and(|t| t.is_socket()) {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// Creates the socket's directory (0700) if missing, checks an existing one
/// is ours and private, clears a stale socket, binds with mode 0600 under a
/// starting name: nothing connects before [`Listener::publish`].
/// `open_to_other_uids` (serve --allow-uid) makes the socket 0666 and a
/// directory it creates 0711, so the allowed uids can reach it at all; the
/// SO_PEERCRED check then decides who is served.
pub fn bind(path: &Path, open_to_other_uids: bool) -> Result<Listener, ServerError> {
    // Refused before anything is created, so a failed start leaves no folder.
    if path.as_os_str().len() > config::SOCKET_PATH_BYTES_MAX {
        return Err(ServerError::PathTooLong { path: path.to_path_buf(), len: path.as_os_str().len() });
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let made_dir = if dir.exists() {
        None
    } else {
        let mode = if open_to_other_uids { 0o711 } else { 0o700 };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(&dir)
            .map_err(io_err(&dir, "create socket directory"))?;
        Some(dir.clone())
    };
    let md = fs::metadata(&dir).map_err(io_err(&dir, "stat socket directory"))?;
    if md.uid() != uid {
        return Err(ServerError::Unsafe { path: dir, why: format!("belongs to uid {}, not to us ({uid})", md.uid()) });
    }
    if md.mode() & 0o077 != 0 && !open_to_other_uids {
        if made_dir.is_some() || dir.file_name().is_some_and(|n| n.to_string_lossy().starts_with("ckpt-sidecar")) {
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
                .map_err(io_err(&dir, "make socket directory private"))?;
        } else {
            warn!(dir = %dir.display(), "socket directory is accessible to others; the socket itself is 0600");
        }
    }
    if let Ok(m) = fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(ServerError::Unsafe { path: path.to_path_buf(), why: "exists and is not a socket".into() });
        }
        if UnixStream::connect(path).is_ok() {
            return Err(ServerError::InUse(path.to_path_buf()));
        }
        info!(path = %path.display(), "removing a stale socket");
        fs::remove_file(path).map_err(io_err(path, "remove stale socket"))?;
    }
    sweep_starting(&dir);
    let starting = dir.join(format!("{STARTING_PREFIX}{}", std::process::id()));
    let bound_at =
        if starting.as_os_str().len() <= config::SOCKET_PATH_BYTES_MAX { starting } else { path.to_path_buf() };
    if bound_at != path {
        let _ = fs::remove_file(&bound_at); // ours by its pid: left by a dead namesake
    }
    // The socket is created with the umask's mode; make it 0600 from the
    // start (no window where others could connect), then restore.
    // SAFETY: umask has no preconditions; called while binding only.
    let old = unsafe { libc::umask(0o177) };
    let r = UnixListener::bind(&bound_at);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let listener = r.map_err(io_err(path, "bind"))?;
    let l = Listener { path: path.to_path_buf(), published: bound_at == path, bound_at, listener, made_dir };
    let mode = if open_to_other_uids { 0o666 } else { 0o600 };
    fs::set_permissions(&l.bound_at, fs::Permissions::from_mode(mode)).map_err(io_err(path, "chmod socket"))?;
    if open_to_other_uids {
        warn!(path = %path.display(), "socket is open to other users (--allow-uid); peers are checked by uid");
    }
    Ok(l)
}

/// The peer's uid and pid (SO_PEERCRED).
pub fn peer_cred(s: &UnixStream) -> io::Result<(u32, u32)> {
    let mut c = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: c and len are valid out-pointers of the right size for
    // SO_PEERCRED; the fd is an open Unix socket.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((c.uid, c.pid as u32))
}

/// Accepts connections forever on a thread of its own (`ckpt-accept`).
pub fn spawn_accept(listener: &Listener, state: Arc<DaemonState>) -> io::Result<std::thread::JoinHandle<()>> {
    let l = listener.listener.try_clone()?;
    std::thread::Builder::new().name("ckpt-accept".into()).spawn(move || {
        for (conn_no, conn) in l.incoming().enumerate() {
            match conn {
                Ok(s) => {
                    // The handshake runs on the session's own thread, so a
                    // silent peer cannot hold up the next accept.
                    let sh = state.clone();
                    if let Err(e) = std::thread::Builder::new()
                        .name(format!("ckpt-session-{conn_no}"))
                        .spawn(move || handshake(&sh, s))
                    {
                        warn!("cannot start a session thread: {e}");
                    }
                }
                Err(e) => {
                    warn!("accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    })
}

fn refuse(mut s: UnixStream, pid: u32, reason: String) {
    refusal_log::refused(pid, "refused a client", &reason);
    let _ = ckpt_wire::write_frame(&mut s, &Reply::Refused { reason });
    let _ = s.shutdown(std::net::Shutdown::Both);
}

/// Checks the peer and its Hello, then serves the session (or the
/// read-only tool connection) on this thread.
fn handshake(state: &Arc<DaemonState>, mut s: UnixStream) {
    let (uid, pid) = match peer_cred(&s) {
        Ok(c) => c,
        Err(e) => return refuse(s, 0, format!("cannot read peer credentials: {e}")),
    };
    // Read before the process may exit: its start time tells it from a
    // later process given the same pid.
    let peer = Peer::of(pid);
    let _ = s.set_read_timeout(Some(Duration::from_millis(config::HELLO_TIMEOUT_MS)));
    let _ = s.set_write_timeout(Some(Duration::from_millis(config::HELLO_TIMEOUT_MS)));
    let hello =
        ckpt_wire::read_frame_body(&mut s, config::HELLO_BYTES_MAX).and_then(|b| ckpt_wire::decode::<Request>(&b));
    if uid != state.uid && !state.allow_uids.contains(&uid) {
        let reason =
            format!("uid {uid} may not use this sidecar (it runs as uid {}; see serve --allow-uid)", state.uid);
        return refuse(s, pid, reason);
    }
    let (client_pid, name) = match hello {
        Ok(Request::Hello { magic, version, pid: client_pid, name }) => {
            if magic != MAGIC {
                return refuse(s, pid, format!("bad magic {magic:?}; this is a ckpt-sidecar socket"));
            }
            if version != PROTOCOL_VERSION {
                let reason = format!(
                    "protocol version {version} is not supported; this sidecar speaks version {PROTOCOL_VERSION}"
                );
                return refuse(s, pid, reason);
            }
            (client_pid, name)
        }
        Ok(_) => return refuse(s, pid, "the first message must be a Hello".into()),
        // A probe (is anyone listening?) that said nothing is no refusal.
        Err(FrameError::Closed) => return debug!(peer_pid = pid, "a client closed before its Hello"),
        Err(e) => return refuse(s, pid, format!("bad handshake: {e}")),
    };
    if state.is_aborting() {
        return refuse(s, pid, "the sidecar is shutting down".into());
    }
    if name == STATUS_TOOL_NAME {
        return serve_tool(state, s, pid);
    }
    let _ = s.set_read_timeout(None);
    let name: String = name.chars().take(256).collect();
    let entry = SessionEntry {
        pid: client_pid,
        name: name.clone(),
        regions: 0,
        region_bytes: 0,
        peer,
        stream: s.try_clone().ok(),
    };
    let session_id = match state.add_session(entry) {
        Ok(id) => id,
        Err(full) => return refuse(s, pid, full.to_string()),
    };
    // Removed however this thread ends, after the session's own state.
    let _registered = state.session_guard(session_id);
    if ckpt_wire::write_frame(&mut s, &welcome(state)).is_err() {
        return;
    }
    info!(session_id, uid, peer_pid = pid, client_pid, name = %name, "session started");
    session::run(state.clone(), Session { session_id, peer_uid: uid, peer_pid: pid, client_pid, name }, s);
}

fn welcome(state: &DaemonState) -> Reply {
    Reply::Welcome {
        version: PROTOCOL_VERSION,
        server_pid: state.server_pid,
        dirs: state.dirs.iter().map(|d| d.display().to_string()).collect(),
        staging_bytes: state.staging.budget_bytes(),
    }
}

/// A read-only tool connection: Status and List answered until the tool
/// says Bye, closes, asks anything else, or is silent for
/// [`config::TOOL_ANSWER_TIMEOUT_MS`].
fn serve_tool(state: &Arc<DaemonState>, mut s: UnixStream, pid: u32) {
    let _place = match state.enter_tool(pid) {
        Ok(g) => g,
        Err(full) => return refuse(s, pid, full.to_string()),
    };
    let timeout = Some(Duration::from_millis(config::TOOL_ANSWER_TIMEOUT_MS));
    let _ = s.set_read_timeout(timeout);
    let _ = s.set_write_timeout(timeout);
    if ckpt_wire::write_frame(&mut s, &welcome(state)).is_err() {
        return;
    }
    loop {
        let req = ckpt_wire::read_frame_body(&mut s, config::HELLO_BYTES_MAX).and_then(|b| ckpt_wire::decode(&b));
        let reply = match req {
            Ok(Request::Status { id }) => Reply::Status { id, report: state.report() },
            Ok(Request::List { id }) => session::list(state, id),
            Ok(Request::Bye) | Err(FrameError::Closed) => return,
            Ok(_) => {
                let reason =
                    format!("a read-only connection (Hello as \"{STATUS_TOOL_NAME}\") asks only Status or List");
                refusal_log::refused(pid, "refused a tool's request", &reason);
                let _ =
                    ckpt_wire::write_frame(&mut s, &Refusal::new(ErrorCode::BadRequest, reason).error(NO_REQUEST_ID));
                return;
            }
            Err(e) => {
                debug!(peer_pid = pid, "tool connection closed: {e}");
                return;
            }
        };
        if ckpt_wire::write_frame(&mut s, &reply).is_err() {
            return;
        }
    }
}
