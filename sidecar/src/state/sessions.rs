//! The session registry: every connected client's session (pid, name,
//! its regions' count and bytes for `status`, the peer process that
//! connected, and a handle on its socket to shut down at the daemon's exit
//! or when that process is gone), bounded by
//! [`SESSIONS_MAX`](config::SESSIONS_MAX) and, per peer process, by
//! [`SESSIONS_PER_PROCESS_MAX`](config::SESSIONS_PER_PROCESS_MAX); and the
//! count of read-only tool connections, which are no sessions.
//!
//! Invariants: an entry is removed however its session's thread ends (its
//! [`SessionGuard`], also while a panic unwinds), so a drain never waits
//! for a session that no thread serves; an entry whose peer process is gone
//! (no such pid, a zombie, or a pid that another process took since, by its
//! start time) is shut down and removed by [`Sessions::reap`], even while a
//! child that inherited the socket keeps it open.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ckpt_wire::SessionInfo;
use tracing::info;

use crate::config;
use crate::state::DaemonState;

pub struct SessionEntry {
    /// The pid the client's Hello gave.
    pub pid: u32,
    pub name: String,
    pub regions: u32,
    pub region_bytes: u64,
    /// The process that connected (SO_PEERCRED; 0: not visible here) and
    /// its start time (`/proc/PID/stat`), to know it is still the same one.
    pub peer: Peer,
    /// A handle on the socket, to shut it down when the daemon exits.
    pub stream: Option<UnixStream>,
}

/// A client process: its pid and start time (None: not readable at connect).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peer {
    pub pid: u32,
    pub start_ticks: Option<u64>,
}

impl Peer {
    /// The process `pid` as it is now.
    pub fn of(pid: u32) -> Peer {
        Peer { pid, start_ticks: if pid == 0 { None } else { process_start_ticks(pid) } }
    }

    /// Whether this process no longer runs (or its pid is another's now).
    fn is_gone(&self) -> bool {
        if self.pid == 0 {
            return false;
        }
        process_is_gone(self.pid) || (self.start_ticks.is_some() && process_start_ticks(self.pid) != self.start_ticks)
    }
}

/// Why a session was not admitted; its Display is the refusal's reason.
#[derive(Debug, thiserror::Error)]
pub enum SessionsFull {
    #[error(
        "too many sessions from one process: pid {pid} holds {held} (at most {} per process); close the clients it does not use",
        config::SESSIONS_PER_PROCESS_MAX
    )]
    ProcessShare { pid: u32, held: usize },
    #[error("too many sessions (at most {}); pid {pid} holds {held} of them (\"{name}\")", config::SESSIONS_MAX)]
    Total { pid: u32, held: usize, name: String },
}

/// Why a read-only tool connection was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum ToolsFull {
    #[error("too many read-only tool connections (at most {}); try again", config::TOOL_CONNECTIONS_MAX)]
    Total,
    #[error(
        "too many read-only tool connections from pid {pid} (at most {} per process)",
        config::TOOL_CONNECTIONS_PER_PROCESS_MAX
    )]
    ProcessShare { pid: u32 },
}

/// A read-only tool connection's place, given back on drop.
pub struct ToolGuard {
    pub(super) state: Arc<DaemonState>,
    pub(super) pid: u32,
}

impl Drop for ToolGuard {
    fn drop(&mut self) {
        self.state.sessions.leave_tool(self.pid);
    }
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
    /// Read-only tool connections now, by peer pid.
    tools: Mutex<HashMap<u32, usize>>,
}

impl Sessions {
    pub(super) fn new() -> Sessions {
        Sessions {
            sessions: Mutex::new(BTreeMap::new()),
            next_session_id: AtomicU64::new(1),
            tools: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a session of a client that is gone is still registered.
    pub(super) fn any_client_gone(&self) -> bool {
        self.sessions
            .lock()
            .expect("sessions lock")
            .values()
            .any(|e| e.stream.as_ref().is_some_and(|s| crate::state::reply::closed(s.as_raw_fd())))
    }

    /// Registers a session, within its process's share and the total; a
    /// session whose process is gone is reaped first when either is full.
    pub(super) fn add(&self, e: SessionEntry) -> Result<u64, SessionsFull> {
        let mut m = self.sessions.lock().expect("sessions lock");
        let mut reaped = false;
        loop {
            let held = m.values().filter(|x| x.peer.pid == e.peer.pid).count();
            let full = if held >= config::SESSIONS_PER_PROCESS_MAX {
                Some(SessionsFull::ProcessShare { pid: e.peer.pid, held })
            } else if m.len() >= config::SESSIONS_MAX {
                Some(biggest_holder(&m))
            } else {
                None
            };
            match full {
                None => break,
                Some(f) if reaped => return Err(f),
                Some(_) => {
                    reap_in(&mut m);
                    reaped = true;
                }
            }
        }
        let id = self.next_session_id.fetch_add(1, Ordering::Relaxed);
        m.insert(id, e);
        Ok(id)
    }

    /// Shuts down and removes the sessions whose peer process is gone;
    /// returns how many.
    pub(super) fn reap(&self) -> usize {
        reap_in(&mut self.sessions.lock().expect("sessions lock"))
    }

    /// Takes a read-only tool connection's place for process `pid`.
    pub(super) fn enter_tool(&self, pid: u32) -> Result<(), ToolsFull> {
        let mut t = self.tools.lock().expect("tools lock");
        if t.values().sum::<usize>() >= config::TOOL_CONNECTIONS_MAX {
            return Err(ToolsFull::Total);
        }
        let n = t.entry(pid).or_default();
        if *n >= config::TOOL_CONNECTIONS_PER_PROCESS_MAX {
            return Err(ToolsFull::ProcessShare { pid });
        }
        *n += 1;
        Ok(())
    }

    fn leave_tool(&self, pid: u32) {
        let mut t = self.tools.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = t.get_mut(&pid) {
            *n -= 1;
            if *n == 0 {
                t.remove(&pid);
            }
        }
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

/// The refusal of a full registry: the process holding the most sessions.
fn biggest_holder(m: &BTreeMap<u64, SessionEntry>) -> SessionsFull {
    let mut by_pid: HashMap<u32, (usize, &str)> = HashMap::new();
    for e in m.values() {
        by_pid.entry(e.peer.pid).or_insert((0, &e.name)).0 += 1;
    }
    let (pid, (held, name)) =
        by_pid.into_iter().max_by_key(|(pid, (n, _))| (*n, u32::MAX - pid)).unwrap_or((0, (0, "")));
    SessionsFull::Total { pid, held, name: name.to_string() }
}

fn reap_in(m: &mut BTreeMap<u64, SessionEntry>) -> usize {
    let gone: Vec<u64> = m.iter().filter(|(_, e)| e.peer.is_gone()).map(|(id, _)| *id).collect();
    for id in &gone {
        if let Some(e) = m.remove(id) {
            // Its thread reads EOF and ends; its guard then finds no entry.
            if let Some(s) = &e.stream {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            info!(session_id = id, peer_pid = e.peer.pid, name = %e.name, "client process gone: session closed");
        }
    }
    gone.len()
}

/// The start time of process `pid` (field 22 of /proc/PID/stat, in clock
/// ticks since boot); None when it cannot be read.
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name's closing parenthesis start with
    // the third (state); starttime is the 22nd.
    stat.rsplit_once(") ")?.1.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Whether `pid` no longer runs: no such process, a zombie, or one already
/// exiting. The last matters: a killed process closes its files (so its
/// connection reads EOF) before it becomes a zombie, and the kernel marks it
/// exiting (PF_EXITING in /proc's flags) before either.
pub fn process_is_gone(pid: u32) -> bool {
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
        // ESRCH: the process was reaped while its stat was read.
        Err(e) => e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_start_time_is_read_and_a_missing_pid_is_gone() {
        let me = Peer::of(std::process::id());
        assert!(me.start_ticks.is_some());
        assert!(!me.is_gone());
        let reused = Peer { start_ticks: me.start_ticks.map(|t| t + 1), ..me };
        assert!(reused.is_gone(), "a pid whose start time changed is another process");
        assert!(Peer { pid: u32::MAX - 7, start_ticks: None }.is_gone());
    }
}
