//! The sending side of one session ([`Replies`]): replies from the session
//! thread and the committer go through it, one whole frame at a time.

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckpt_wire::Reply;

/// The sending side of one session: replies from the session thread and the
/// committer go through here, one whole frame at a time.
pub struct Replies {
    stream: Mutex<UnixStream>,
    fd: i32,
    broken: AtomicBool,
    /// Request id -> (arrival, file bytes) of this client's saves in flight,
    /// for the metrics (`crate::state::metrics`): until their Durable or Failed.
    started: Mutex<HashMap<u64, (Instant, u64)>>,
}

impl Replies {
    /// This session as the origin of a resident image (`Resident::origin`).
    pub fn origin(self: &Arc<Self>) -> crate::memory::staging::Origin {
        let any: Arc<dyn std::any::Any + Send + Sync> = self.clone();
        Arc::downgrade(&any)
    }

    pub fn new(stream: UnixStream) -> Replies {
        let _ = stream.set_write_timeout(Some(Duration::from_millis(crate::config::SEND_TIMEOUT_MS)));
        let fd = stream.as_raw_fd();
        Replies { stream: Mutex::new(stream), fd, broken: AtomicBool::new(false), started: Mutex::new(HashMap::new()) }
    }

    /// Save `id` (of `bytes` file bytes, received at `t_received`) is in
    /// flight: timed until its Released/Durable/Failed. (Counted when its
    /// flight began: `Shared::begin_step`, `begin_file`.)
    pub fn started(&self, id: u64, t_received: Instant, bytes: u64) {
        self.started.lock().expect("started lock").insert(id, (t_received, bytes));
    }

    /// Sends one reply; false (and the replies marked broken) if it could not.
    /// Released, Durable and Failed are counted first (`crate::state::metrics`),
    /// sent or not.
    pub fn send(&self, reply: &Reply) -> bool {
        if let Reply::Released { id, .. } | Reply::Durable { id, .. } | Reply::Failed { id, .. } = reply {
            let mut started = self.started.lock().expect("started lock");
            let at =
                if matches!(reply, Reply::Released { .. }) { started.get(id).copied() } else { started.remove(id) };
            drop(started);
            crate::state::metrics::record_reply(
                reply,
                at.map(|(t, _)| t.elapsed().as_secs_f64()),
                at.map_or(0, |(_, b)| b),
            );
        }
        if self.broken.load(Ordering::SeqCst) {
            return false;
        }
        let frame = ckpt_wire::encode(reply);
        let mut s = self.stream.lock().expect("replies lock");
        match s.write_all(&frame) {
            Ok(()) => true,
            Err(e) => {
                tracing::info!("client no longer takes replies: {e}");
                self.broken.store(true, Ordering::SeqCst);
                false
            }
        }
    }

    /// Whether the client has closed its end (or the socket broke): checked
    /// without reading, so frames it already sent stay queued.
    pub fn is_gone(&self) -> bool {
        // The fd stays open while self (which owns the stream) lives.
        self.broken.load(Ordering::SeqCst) || closed(self.fd)
    }
}

/// Whether the client at the other end of the socket `fd` has closed its
/// end (or the socket broke), without reading: frames it sent stay queued.
/// `fd` must be open for the call.
pub fn closed(fd: RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd (its fd open: the caller's contract; a
    // closed one would only be reported as POLLNVAL); timeout 0 never blocks.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0 && (p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR)) != 0
}

impl crate::drain::Answer for Replies {
    fn send(&self, reply: &Reply) -> bool {
        Replies::send(self, reply)
    }

    fn is_gone(&self) -> bool {
        Replies::is_gone(self)
    }
}
