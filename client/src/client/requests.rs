//! A request and its reply: a fresh id marked as waited for, the frame
//! sent, then a wait on the reply thread's table until the reply is filed,
//! the connection dies, or the timeout passes.
//!
//! Invariants: request ids are unique and increasing for the client's whole
//! life (so unique per connection, as the protocol asks); an id leaves the
//! waited-for set however the wait ends, so no reply is kept for nobody.

use std::time::{Duration, Instant};

use ckpt_wire::{Reply, Request};

use super::connection::Conn;
use super::transport::send_frame_with;
use super::Client;
use crate::error::{Error, Result};

impl Client {
    /// Sends a request built for a fresh id; the id is marked as waited for.
    pub(super) fn send_request(&self, conn: &Conn, make: impl FnOnce(u64) -> Request) -> Result<u64> {
        self.send_request_passing(conn, None, make)
    }

    /// As [`Client::send_request`], the frame carrying descriptor `fd`
    /// (SCM_RIGHTS on its first bytes).
    pub(super) fn send_request_with_fd(&self, conn: &Conn, fd: i32, make: impl FnOnce(u64) -> Request) -> Result<u64> {
        self.send_request_passing(conn, Some(fd), make)
    }

    fn send_request_passing(
        &self,
        conn: &Conn,
        pass_fd: Option<i32>,
        make: impl FnOnce(u64) -> Request,
    ) -> Result<u64> {
        let id = {
            let mut st = self.lock_state();
            let id = st.next_id;
            st.next_id += 1;
            st.waiting.insert(id);
            id
        };
        if let Err(e) = send_frame_with(&conn.stream, &make(id), pass_fd) {
            self.lock_state().waiting.remove(&id);
            return Err(e);
        }
        Ok(id)
    }

    /// One round trip on the live connection (reconnecting if needed),
    /// limited by the request timeout; `what` names the request in errors.
    pub(super) fn call(&self, what: &str, make: impl FnOnce(u64) -> Request) -> Result<Reply> {
        // Before the lock: in a forked child it may be held for good.
        self.check_owner()?;
        let mut inner = self.lock_inner();
        let timeout = inner.request_timeout;
        let conn = self.ensure_connected(&mut inner)?;
        let gen = conn.gen;
        let id = self.send_request(conn, make)?;
        drop(inner);
        self.await_reply(id, gen, &format!("the sidecar to answer {what}"), timeout)
    }

    /// One round trip on `conn`, the caller holding the client's lock.
    pub(super) fn call_on(
        &self,
        conn: &Conn,
        timeout: Option<Duration>,
        what: &str,
        make: impl FnOnce(u64) -> Request,
    ) -> Result<Reply> {
        let id = self.send_request(conn, make)?;
        self.await_reply(id, conn.gen, &format!("the sidecar to answer {what}"), timeout)
    }

    /// Waits for the reply to request `id` of connection `gen`: an Error
    /// reply is [`Error::Remote`], a lost or replaced connection
    /// [`Error::Disconnected`].
    pub(super) fn await_reply(&self, id: u64, gen: u64, what: &str, timeout: Option<Duration>) -> Result<Reply> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = self.lock_state();
        loop {
            if let Some(r) = st.replies.remove(&id) {
                st.waiting.remove(&id);
                return match r {
                    Reply::Error { code, message, .. } => Err(Error::Remote { code, message }),
                    r => Ok(r),
                };
            }
            if st.gen != gen || st.dead.is_some() {
                st.waiting.remove(&id);
                return Err(Error::Disconnected {
                    reason: st.dead.clone().unwrap_or_else(|| "the connection was replaced".into()),
                });
            }
            st = match self.wait_changed(st, deadline) {
                Ok(st) => st,
                Err(()) => {
                    let mut st = self.lock_state();
                    st.waiting.remove(&id);
                    st.replies.remove(&id);
                    return Err(Error::Timeout {
                        what: what.to_string(),
                        timeout_ms: timeout.map(|t| t.as_millis() as u64).unwrap_or(0),
                    });
                }
            };
        }
    }
}

/// The error for a reply that does not answer request `what`.
pub(super) fn unexpected(what: &str, reply: Reply) -> Error {
    Error::Protocol(format!("unexpected reply to {what}: {reply:?}"))
}
