//! The client side of docs/protocol.md: one connection to the sidecar, the
//! regions registered on it, and the saves in flight.
//!
//! Threads: the caller's threads send requests (one at a time, under the
//! `inner` lock); one reader thread per connection (`ckpt-shim-reader`)
//! decodes every reply and files it in the shared `State`: replies to
//! requests by id (only ids someone still waits for), and the asynchronous
//! `Released` / `Durable` / `Failed` of saves into the save table, whatever
//! order they arrive in. Callers block on a condition variable, never on the
//! socket, so a `wait` on one thread and a `load` on another both work.
//!
//! Connection loss: when the reader sees EOF or an unreadable reply it marks
//! the connection dead, fails every save not yet durable (saying whether it
//! had been released), and wakes every waiter with "sidecar gone: …". The
//! next call that needs the sidecar (or [`Client::reconnect`]) connects again
//! and re-registers every region under its old id and name, so tensor
//! addresses stay valid across sidecar restarts; if no sidecar is there that
//! call fails with the reason and the trainer can go on training.
//!
//! Invariants:
//! - request ids are unique and increasing for the client's whole life, so
//!   they are unique per connection as the protocol asks, and a save id
//!   names one save forever;
//! - every table is bounded: replies are kept only for ids being waited for,
//!   finished saves only for the newest [`SAVES_FINISHED_MAX`];
//! - nothing is written to the socket with SIGPIPE possible (MSG_NOSIGNAL):
//!   a dead sidecar must never kill the trainer;
//! - a forked child never speaks on, shuts down or closes its parent's
//!   connection, nor unlinks its regions: a fork handler closes the child's
//!   copies of every connection's descriptors (so the sidecar still sees
//!   EOF when the parent dies, even while children such as data-loader
//!   workers live on), and every call in the child fails with
//!   [`Error::Forked`].
//!
//! Where each part lives: the [`Client`] and its settings here; the
//! connection and handshake in `connection`, requests and their replies in
//! `requests`, the socket writes in `transport`, the reply thread and its
//! tables in `reply_thread`, fork safety in `fork`; regions in
//! `shm_regions` and `cuda_regions`; saves in `saves` and `stream_saves`,
//! loads in `loads`, list/rollback/status in `catalog`; the tensor list a
//! save sends in `tensor_list`; the API's value types in `types`.

mod catalog;
mod connection;
mod cuda_regions;
mod fork;
mod loads;
mod reply_thread;
mod requests;
mod saves;
mod shm_regions;
mod stream_saves;
mod stream_watch;
mod tensor_list;
mod transport;
mod types;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ckpt_wire::Request;

use crate::error::{Error, Result};
use connection::Conn;
use reply_thread::{Shared, State};
use tensor_list::KeptLists;
use transport::send_frame;

pub use connection::HANDSHAKE_TIMEOUT;
pub use reply_thread::SAVES_FINISHED_MAX;
pub use stream_watch::{STREAM_WAIT_DEADLINE_DEFAULT, STREAM_WAIT_DEADLINE_ENV};
pub use types::{
    default_socket_path, BlobRef, CudaRegion, LoadInfo, Region, SaveHandle, SaveState, SaveStatus, ServerInfo,
    TensorRef, Wanted,
};

/// A connection to the sidecar (reconnecting on demand), its regions and saves.
/// All methods take `&self`: a client may be shared between threads.
pub struct Client {
    /// The process that connected; in a fork child every call fails.
    owner_pid: u32,
    socket_path: PathBuf,
    name: String,
    shared: Arc<Shared>,
    inner: Mutex<Inner>,
}

/// What the caller's threads share under the client's lock: the
/// connection, the regions, and the settings later requests use.
struct Inner {
    conn: Option<Conn>,
    regions: BTreeMap<u32, Region>,
    cuda_regions: BTreeMap<u32, CudaRegion>,
    /// One interprocess event per CUDA device, recorded at each save.
    cuda_events: HashMap<i32, ckpt_cuda::IpcEvent>,
    /// The last value of the copy-done sequence given to a device save
    /// ([`crate::done_word`]).
    done_seq: u32,
    next_region_id: u32,
    closed: bool,
    request_timeout: Option<Duration>,
    /// Saves ask for a lazy release (see [`Client::set_lazy_release`]).
    lazy_release: bool,
    /// (rank, world size) of this trainer; saves are parts when world > 1.
    rank: (u32, u32),
    /// The last saves' tensor lists, encoded, and what each was made from.
    kept_lists: KeptLists,
}

impl Inner {
    /// A region id never given before on this client (host and CUDA
    /// regions share the numbering).
    fn fresh_region_id(&mut self) -> Result<u32> {
        let region_id = self.next_region_id;
        self.next_region_id =
            self.next_region_id.checked_add(1).ok_or_else(|| Error::InvalidArgument("region ids exhausted".into()))?;
        Ok(region_id)
    }
}

impl Client {
    /// Connects to the sidecar at `path`, or the path from the environment
    /// ([`default_socket_path`]) when None, and does the handshake.
    pub fn connect(path: Option<&Path>) -> Result<Client> {
        let socket_path = path.map(Path::to_path_buf).unwrap_or_else(default_socket_path);
        let client = Client {
            owner_pid: std::process::id(),
            socket_path,
            name: program_name(),
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    next_id: 1,
                    stream_wait_deadline: stream_watch::deadline_from_env(),
                    ..State::default()
                }),
                changed: Condvar::new(),
            }),
            inner: Mutex::new(Inner {
                conn: None,
                regions: BTreeMap::new(),
                cuda_regions: BTreeMap::new(),
                cuda_events: HashMap::new(),
                done_seq: 0,
                next_region_id: 1,
                closed: false,
                request_timeout: None,
                lazy_release: false,
                rank: (0, 1),
                kept_lists: KeptLists::default(),
            }),
        };
        {
            let mut inner = client.lock_inner();
            client.open(&mut inner)?;
        }
        Ok(client)
    }

    /// Where this client connects, and reconnects.
    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// What the sidecar said at the last handshake, if connected.
    pub fn server_info(&self) -> Option<ServerInfo> {
        self.lock_inner().conn.as_ref().map(|c| c.info.clone())
    }

    /// Whether the connection is up (as far as the reader thread knows).
    pub fn is_connected(&self) -> bool {
        let inner = self.lock_inner();
        let st = self.lock_state();
        inner.conn.as_ref().is_some_and(|c| c.gen == st.gen && st.dead.is_none())
    }

    /// Limits how long load, list, status and region calls wait for their
    /// reply (None: as long as the connection lives). Saves are not limited
    /// here: [`Client::wait`] takes its own timeout.
    pub fn set_request_timeout(&self, timeout: Option<Duration>) {
        self.lock_inner().request_timeout = timeout;
    }

    /// Whether later saves ask for a lazy release: for a trainer that does
    /// not block on Released right after saving (it computes meanwhile), the
    /// sidecar then checksums during the copy, one pass over memory fewer,
    /// at the price of a later Released. Default false: Released as early as
    /// possible (the checksums follow it).
    pub fn set_lazy_release(&self, on: bool) {
        self.lock_inner().lazy_release = on;
    }

    /// This trainer is rank `rank` of `world_size`: with world_size > 1,
    /// later saves are that rank's part of a checkpoint all ranks write
    /// (SavePart); the sidecar commits a step once every part is there.
    pub fn set_rank(&self, rank: u32, world_size: u32) -> Result<()> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of world size {world_size}: need 0 <= rank < world_size"
            )));
        }
        self.lock_inner().rank = (rank, world_size);
        Ok(())
    }

    /// Connects again if the connection is down (re-registering every region);
    /// does nothing if it is up.
    pub fn reconnect(&self) -> Result<()> {
        let mut inner = self.lock_inner();
        self.ensure_connected(&mut inner).map(|_| ())
    }

    /// Says Bye and closes. Saves already released still commit (this client
    /// will not hear of it); saves not yet released are aborted by the
    /// sidecar. Regions are unregistered by the session's end, then unmapped
    /// and unlinked here. Later calls fail with [`Error::Closed`].
    pub fn close(&self) {
        if self.check_owner().is_err() {
            self.close_in_forked_child();
            return;
        }
        let mut inner = self.lock_inner();
        if inner.closed {
            return;
        }
        inner.closed = true;
        if let Some(conn) = inner.conn.take() {
            let _ = send_frame(&conn.stream, &Request::Bye);
            {
                let mut st = self.lock_state();
                st.lose("this client closed the connection".to_string());
                st.gen += 1; // the reader's EOF belongs to the past now
            }
            self.shared.changed.notify_all();
            conn.shut();
        }
        self.lock_state().closed = true;
        self.shared.changed.notify_all();
        inner.regions.clear();
        inner.cuda_regions.clear();
        self.retire_cuda_events(&mut inner);
    }

    /// [`Client::close`] in a forked child: forgets everything, touches
    /// nothing of the parent's.
    fn close_in_forked_child(&self) {
        // A forked child: the connection and the names are the parent's.
        // Its descriptors were closed by the fork handler (their numbers
        // may be reused by now), and its reader thread does not exist
        // here. The lock may be held for good by a thread of the parent
        // that was not forked: then leave everything as it is (the
        // child's exit releases its copies).
        let mut inner = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        if inner.closed {
            return;
        }
        inner.closed = true;
        if let Some(conn) = inner.conn.take() {
            std::mem::forget(conn);
        }
        for r in inner.regions.values() {
            r.keep_name_on_drop();
        }
        inner.regions.clear();
        inner.cuda_regions.clear();
        // The parent's events: CUDA is unusable in a forked child.
        std::mem::forget(std::mem::take(&mut inner.cuda_events));
    }

    /// Destroys this client's interprocess events once the sidecar can no
    /// longer use them: a request it has not answered may still have it
    /// polling one (a destroyed event's state is undefined: it could read
    /// as done before the trainer's work is). Those are left to the
    /// process's end (a few driver handles), never destroyed under it.
    fn retire_cuda_events(&self, inner: &mut Inner) {
        let events = std::mem::take(&mut inner.cuda_events);
        if self.lock_state().events_in_use() {
            std::mem::forget(events);
        }
    }

    fn check_owner(&self) -> Result<()> {
        if std::process::id() == self.owner_pid {
            Ok(())
        } else {
            Err(Error::Forked { owner_pid: self.owner_pid })
        }
    }

    fn lock_inner(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; go on.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait_changed<'a>(
        &self,
        st: MutexGuard<'a, State>,
        deadline: Option<Instant>,
    ) -> Result<MutexGuard<'a, State>, ()> {
        match deadline {
            None => Ok(self.shared.changed.wait(st).unwrap_or_else(|p| p.into_inner())),
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    return Err(());
                }
                let (st, _) = self.shared.changed.wait_timeout(st, d - now).unwrap_or_else(|p| p.into_inner());
                Ok(st)
            }
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.close();
    }
}

/// The name this process gives in Hello: its command name, as `ps` shows it.
fn program_name() -> String {
    std::fs::read_to_string("/proc/self/comm").map(|s| s.trim().to_string()).unwrap_or_else(|_| "ckpt-shim".to_string())
}
