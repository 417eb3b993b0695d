//! The session registry: every connected client's session (pid, name,
//! its regions' count and bytes for `status`, and a handle on its socket
//! to shut down at the daemon's exit), bounded by
//! [`SESSIONS_MAX`](crate::config::SESSIONS_MAX).
//!
//! Invariant: an entry is removed however its session's thread ends (its
//! [`SessionGuard`], also while a panic unwinds), so a drain never waits
//! for a session that no thread serves.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ckpt_wire::SessionInfo;

use crate::state::DaemonState;

pub struct SessionEntry {
    pub pid: u32,
    pub name: String,
    pub regions: u32,
    pub region_bytes: u64,
    /// A handle on the socket, to shut it down when the daemon exits.
    pub stream: Option<UnixStream>,
}

/// See [`DaemonState::session_guard`].
pub struct SessionGuard {
    pub(super) state: Arc<DaemonState>,
    pub(super) id: u64,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.state.remove_session(self.id);
    }
}

pub(super) struct Sessions {
    sessions: Mutex<BTreeMap<u64, SessionEntry>>,
    next_session_id: AtomicU64,
}

impl Sessions {
    pub(super) fn new() -> Sessions {
        Sessions { sessions: Mutex::new(BTreeMap::new()), next_session_id: AtomicU64::new(1) }
    }

    /// Whether a session of a client that is gone is still registered.
    pub(super) fn any_client_gone(&self) -> bool {
        self.sessions
            .lock()
            .expect("sessions lock")
            .values()
            .any(|e| e.stream.as_ref().is_some_and(|s| crate::state::reply::closed(s.as_raw_fd())))
    }

    pub(super) fn add(&self, e: SessionEntry) -> Option<u64> {
        let mut m = self.sessions.lock().expect("sessions lock");
        if m.len() >= crate::config::SESSIONS_MAX {
            return None;
        }
        let id = self.next_session_id.fetch_add(1, Ordering::Relaxed);
        m.insert(id, e);
        Some(id)
    }

    pub(super) fn update(&self, id: u64, f: impl FnOnce(&mut SessionEntry)) {
        if let Some(e) = self.sessions.lock().expect("sessions lock").get_mut(&id) {
            f(e);
        }
    }

    pub(super) fn remove(&self, id: u64) {
        // Also from a guard's drop while a panic unwinds: a poisoned lock
        // still removes the entry.
        self.sessions.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    /// Shuts every session's socket down: clients see EOF.
    pub(super) fn close_all(&self) {
        for e in self.sessions.lock().expect("sessions lock").values() {
            if let Some(s) = &e.stream {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.sessions.lock().expect("sessions lock").is_empty()
    }

    /// The registry as `status` shows it.
    pub(super) fn report(&self) -> Vec<SessionInfo> {
        self.sessions
            .lock()
            .expect("sessions lock")
            .values()
            .map(|e| SessionInfo { pid: e.pid, name: e.name.clone(), regions: e.regions, region_bytes: e.region_bytes })
            .collect()
    }
}
