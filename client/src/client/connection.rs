//! One connection to the sidecar: connect, the handshake, the reply thread
//! started behind it, and the reconnect that re-registers every region.
//!
//! Invariants:
//! - a connection is current only after its handshake succeeded; its
//!   generation is new, so replies of older connections are dropped;
//! - both descriptors of a live connection (the callers' and the reply
//!   thread's) are in the fork table ([`super::fork`]) until it ends;
//! - a reconnect re-registers every region under its old id and name, so
//!   tensor addresses stay valid across sidecar restarts; if any fails the
//!   new connection is dropped again, never left half registered.

use std::io;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use ckpt_wire::{FrameError, Reply, Request, PROTOCOL_VERSION};

use super::fork::{fork_fd_register, fork_fd_unregister};
use super::reply_thread::reader_loop;
use super::requests::unexpected;
use super::transport::send_frame;
use super::types::ServerInfo;
use super::{Client, Inner};
use crate::error::{Error, Result};
use crate::region::ShmRegion;

/// How long the handshake may take before the sidecar counts as hung.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A live connection: the socket callers write to, its generation, the
/// reply thread reading its other descriptor, and the sidecar's Welcome.
pub(super) struct Conn {
    /// Shared with the watchdog ([`super::stream_watch`]), which may shut it down.
    pub(super) stream: Arc<UnixStream>,
    pub(super) gen: u64,
    reader: Option<JoinHandle<()>>,
    pub(super) info: ServerInfo,
}

impl Conn {
    /// Ends the connection and waits for its reader thread.
    pub(super) fn shut(mut self) {
        fork_fd_unregister(self.stream.as_raw_fd());
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(h) = self.reader.take() {
            let _ = h.join();
        }
    }
}

impl Client {
    /// Connects and shakes hands; on success the new connection is current.
    pub(super) fn open(&self, inner: &mut Inner) -> Result<()> {
        let path = &self.socket_path;
        let mut stream = UnixStream::connect(path).map_err(|source| Error::Connect { path: path.clone(), source })?;
        let info = self.handshake(&mut stream)?;
        let hs = |detail: String| Error::Handshake { path: path.clone(), detail };
        let reader_stream = stream.try_clone().map_err(|e| hs(e.to_string()))?;
        fork_fd_register(stream.as_raw_fd());
        fork_fd_register(reader_stream.as_raw_fd());
        let stream = Arc::new(stream);
        let gen = {
            let mut st = self.lock_state();
            st.gen += 1;
            st.dead = None;
            st.socket = Some(stream.clone());
            st.gen
        };
        let shared = self.shared.clone();
        let fds = (stream.as_raw_fd(), reader_stream.as_raw_fd());
        let reader = std::thread::Builder::new()
            .name("ckpt-shim-reader".into())
            .spawn(move || reader_loop(reader_stream, gen, shared))
            .map_err(|e| {
                fork_fd_unregister(fds.0);
                fork_fd_unregister(fds.1);
                hs(format!("cannot start the reader thread: {e}"))
            })?;
        inner.conn = Some(Conn { stream, gen, reader: Some(reader), info });
        Ok(())
    }

    /// Hello, then the sidecar's Welcome within [`HANDSHAKE_TIMEOUT`]: what
    /// it says about itself, once its protocol version is ours.
    fn handshake(&self, stream: &mut UnixStream) -> Result<ServerInfo> {
        let path = &self.socket_path;
        let hs = |detail: String| Error::Handshake { path: path.clone(), detail };
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| hs(e.to_string()))?;
        send_frame(stream, &ckpt_wire::hello(&self.name)).map_err(|e| hs(e.to_string()))?;
        let info = match ckpt_wire::read_frame::<Reply>(stream) {
            Ok(Reply::Welcome { version, server_pid, dirs, staging_bytes }) => {
                if version != PROTOCOL_VERSION {
                    return Err(Error::Version { path: path.clone(), ours: PROTOCOL_VERSION, theirs: version });
                }
                ServerInfo { server_pid, dirs, staging_bytes }
            }
            Ok(Reply::Refused { reason }) => return Err(Error::Refused { path: path.clone(), reason }),
            Ok(other) => return Err(hs(format!("expected Welcome, got {other:?}"))),
            Err(FrameError::Io(e)) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(Error::Timeout {
                    what: format!("the sidecar at {} to answer Hello", path.display()),
                    timeout_ms: HANDSHAKE_TIMEOUT.as_millis() as u64,
                })
            }
            Err(FrameError::Closed) => {
                return Err(hs("the sidecar closed the connection without answering Hello".into()))
            }
            Err(e) => return Err(hs(e.to_string())),
        };
        stream.set_read_timeout(None).map_err(|e| hs(e.to_string()))?;
        Ok(info)
    }

    /// The live connection, reconnecting (and re-registering every region)
    /// if the last one died.
    pub(super) fn ensure_connected<'a>(&self, inner: &'a mut Inner) -> Result<&'a Conn> {
        self.check_owner()?;
        if inner.closed {
            return Err(Error::Closed);
        }
        let lost = {
            let st = self.lock_state();
            match &inner.conn {
                Some(c) if c.gen == st.gen && st.dead.is_none() => None,
                Some(_) => Some(st.dead.clone().unwrap_or_else(|| "the connection was replaced".into())),
                None => Some("not connected".into()),
            }
        };
        let Some(lost) = lost else {
            return Ok(inner.conn.as_ref().expect("checked above"));
        };
        if let Some(old) = inner.conn.take() {
            old.shut();
        }
        let fail = |e: Error| Error::Disconnected {
            reason: format!("{lost}; reconnecting to {} failed: {e}", self.socket_path.display()),
        };
        self.open(inner).map_err(fail)?;
        if let Err(e) = self.register_again(inner) {
            if let Some(c) = inner.conn.take() {
                self.lock_state().lose(e.to_string());
                c.shut();
            }
            return Err(e);
        }
        Ok(inner.conn.as_ref().expect("still there"))
    }

    /// Registers every region of `inner` on its new connection, under its
    /// old id (and name); the first failure says which region.
    fn register_again(&self, inner: &Inner) -> Result<()> {
        let timeout = inner.request_timeout;
        let conn = inner.conn.as_ref().expect("open sets it");
        for region in inner.regions.values() {
            if let Err(e) = self.register(conn, region, timeout) {
                return Err(Error::Disconnected {
                    reason: format!(
                        "reconnected to {}, but re-registering region {} ({}) failed: {e}",
                        self.socket_path.display(),
                        region.region_id(),
                        region.shm_name()
                    ),
                });
            }
        }
        for r in inner.cuda_regions.values() {
            if let Err(e) = self.register_cuda_on(conn, r, timeout, None) {
                return Err(Error::Disconnected {
                    reason: format!(
                        "reconnected to {}, but re-registering CUDA region {} failed: {e}",
                        self.socket_path.display(),
                        r.region_id
                    ),
                });
            }
        }
        Ok(())
    }

    /// Registers shared-memory region `region` on `conn`.
    pub(super) fn register(&self, conn: &Conn, region: &ShmRegion, timeout: Option<Duration>) -> Result<()> {
        let (region_id, shm_name, len_bytes, hand_over) =
            (region.region_id(), region.shm_name().to_string(), region.len_bytes(), region.hands_over());
        match self.call_on(conn, timeout, "RegisterRegion", |id| Request::RegisterRegion {
            id,
            region_id,
            shm_name,
            len_bytes,
            hand_over,
        })? {
            Reply::RegionRegistered { region_id: got, .. } if got == region_id => Ok(()),
            other => Err(unexpected("RegisterRegion", other)),
        }
    }
}
