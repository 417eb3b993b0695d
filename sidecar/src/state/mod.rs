//! What the daemon's threads share: configuration, staging, the committer's
//! queue and what goes on it ([`jobs`]), the registry of in-flight
//! checkpoints (`flights`: for `status`, for the "not in flight" rule and
//! for draining) and that of sessions (`sessions`), the last figures, each
//! session's reply side ([`reply`]) and the one shape of a refusal it
//! answers with ([`refusal`]), the metrics they feed ([`metrics`]), the
//! damage found in committed steps ([`damage`]) and the
//! panics tests inject ([`test_panic`]). Every stage above `memory/` and
//! `drain/` may use it; it uses neither a stage nor the daemon.
//!
//! Invariants: a step is in the in-flight registry from the moment its Save
//! passed validation until it is durable, failed or aborted, and at most
//! once; the daemon drains by waiting for the registry to be empty.

pub mod damage;
mod flights;
pub mod frame_budget;
pub mod jobs;
pub mod metrics;
pub mod metrics_http;
pub mod refusal;
pub mod refusal_log;
pub mod reply;
mod sessions;
pub mod test_panic;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ckpt_wire::{LastFigures, StatusReport};
use crossbeam_channel::Sender;

use crate::memory::staging::Staging;
use crate::state::flights::Flights;
use crate::state::jobs::{Flight, Work};
use crate::state::reply::Replies;
use crate::state::sessions::Sessions;
pub use crate::state::sessions::{
    process_is_gone, Peer, SessionEntry, SessionGuard, SessionsFull, ToolGuard, ToolsFull,
};
use ckpt_store::image::LayoutOptions;
use ckpt_store::restore::ReadOptions;

/// Phases a checkpoint goes through in the daemon (shown by `status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    WaitingForStaging,
    Copying,
    Queued,
    /// A rank's part, released (or written, several nodes), waiting for the
    /// other ranks' parts of its step.
    WaitingForRanks,
    Writing,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::WaitingForStaging => "waiting for staging",
            Phase::Copying => "copying",
            Phase::Queued => "queued for writing",
            Phase::WaitingForRanks => "waiting for the other ranks' parts",
            Phase::Writing => "writing",
        }
    }
}

pub struct DaemonState {
    pub dirs: Vec<PathBuf>,
    pub layout_opts: LayoutOptions,
    pub read_opts: ReadOptions,
    pub staging: Arc<Staging>,
    pub commit_tx: Sender<Work>,
    pub server_pid: u32,
    pub uid: u32,
    pub allow_uids: Vec<u32>,
    /// First signal: no new saves; in-flight ones finish.
    pub draining: AtomicBool,
    /// Second signal: in-flight saves stop (the Store sees this flag too).
    pub aborting: Arc<AtomicBool>,
    /// The in-flight registry.
    flights: Flights,
    /// The session registry.
    sessions: Sessions,
    last: Mutex<Option<LastFigures>>,
    /// Several nodes: the directory every node's sidecar shares (set once at
    /// start); parts are planned for it and committed there (`nodes`).
    pub shared_dir: Option<std::path::PathBuf>,
    /// Several nodes: the steps this sidecar coordinates now (the committer's
    /// `nodes` keeps it current), for status.
    pub coordinating: Mutex<Vec<u64>>,
    /// The store was opened read-only (set once at start): saves and
    /// rollbacks are refused with its text, loads served.
    pub read_only: Option<ckpt_store::read_only::ReadOnlyDir>,
    /// Bytes of flagged-unchanged tensors taken from the resident image
    /// instead of the client (`crate::save::trusted_unchanged`), since start.
    pub unchanged_taken_bytes: AtomicU64,
    /// Of those, the bytes taken in place: the resident image's lease became
    /// the save's (`crate::save::trusted_unchanged::adopt`), so they were not copied at all.
    pub unchanged_in_place_bytes: AtomicU64,
    /// The drain tier (`--drain URL`), set once at start (`crate::drain`).
    pub drain: Option<Arc<crate::drain::Drain>>,
    /// The peers (`--peers`), set once at start (`crate::peer`).
    pub peers: Option<Arc<crate::peer::Peers>>,
    /// Incremental saves: which tensors changed at the last commit (the
    /// committer sets it; sessions plan stable shards from it).
    history: Mutex<History>,
    /// `--full-every` (incremental): every K-th save written in full.
    pub full_every: std::sync::atomic::AtomicU32,
    /// Saves committed since the last one that linked nothing (the
    /// committer's, `crate::commit::full_every`).
    pub saves_since_full: std::sync::atomic::AtomicU32,
    /// The background scrub's report (`serve --scrub-interval`), set once
    /// at start by the daemon (the scrub is a layer above this one).
    pub scrub: std::sync::OnceLock<Box<dyn Fn() -> ckpt_wire::ScrubReport + Send + Sync>>,
}

/// What the last incremental commit found changed, and a generation that
/// changes with it (a kept save plan is reused only under the same one).
#[derive(Clone, Default)]
pub struct History {
    pub generation: u64,
    /// None: nothing compared yet (every tensor counts as stable).
    pub changed: Option<Arc<std::collections::HashSet<String>>>,
}

impl DaemonState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dirs: Vec<PathBuf>,
        layout_opts: LayoutOptions,
        read_opts: ReadOptions,
        staging: Arc<Staging>,
        commit_tx: Sender<Work>,
        allow_uids: Vec<u32>,
        aborting: Arc<AtomicBool>,
    ) -> DaemonState {
        DaemonState {
            dirs,
            layout_opts,
            read_opts,
            staging,
            commit_tx,
            server_pid: std::process::id(),
            // SAFETY: getuid has no preconditions and cannot fail.
            uid: unsafe { libc::getuid() },
            allow_uids,
            draining: AtomicBool::new(false),
            aborting,
            flights: Flights::new(),
            sessions: Sessions::new(),
            unchanged_taken_bytes: AtomicU64::new(0),
            unchanged_in_place_bytes: AtomicU64::new(0),
            last: Mutex::new(None),
            shared_dir: None,
            coordinating: Mutex::new(Vec::new()),
            read_only: None,
            drain: None,
            peers: None,
            history: Mutex::new(History::default()),
            full_every: std::sync::atomic::AtomicU32::new(ckpt_store::config::FULL_EVERY_DEFAULT),
            saves_since_full: std::sync::atomic::AtomicU32::new(0),
            scrub: std::sync::OnceLock::new(),
        }
    }

    /// The history incremental saves plan their stable shards with.
    pub fn history(&self) -> History {
        self.history.lock().expect("history lock").clone()
    }

    /// After an incremental commit: the tensors it found changed (None:
    /// it had nothing to compare with; the history stays as it was).
    pub fn set_changed(&self, changed: Option<std::collections::HashSet<String>>) {
        let Some(changed) = changed else { return };
        let mut h = self.history.lock().expect("history lock");
        if h.changed.as_deref() != Some(&changed) {
            h.generation += 1;
            h.changed = Some(Arc::new(changed));
        }
    }

    /// After an incremental rank's part of several nodes was written
    /// (`crate::commit::nodes`): the history's entries for the part's tensors
    /// `names` become what it found changed (None: it had nothing to
    /// compare with; the history stays). Other ranks' entries stay: names
    /// are unique across ranks.
    pub fn merge_changed<'a>(
        &self,
        names: impl Iterator<Item = &'a str>,
        changed: Option<std::collections::HashSet<String>>,
    ) {
        let Some(changed) = changed else { return };
        let mut h = self.history.lock().expect("history lock");
        let mut next = h.changed.as_deref().cloned().unwrap_or_default();
        for n in names {
            next.remove(n);
        }
        next.extend(changed);
        if h.changed.as_deref() != Some(&next) {
            h.generation += 1;
            h.changed = Some(Arc::new(next));
        }
    }

    pub fn primary(&self) -> &std::path::Path {
        &self.dirs[0]
    }

    /// Where Load and List read checkpoints, and multi-rank steps are
    /// committed: the shared directory of several nodes, else the primary.
    pub fn read_dir(&self) -> &std::path::Path {
        self.shared_dir.as_deref().unwrap_or(self.primary())
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn is_aborting(&self) -> bool {
        self.aborting.load(Ordering::SeqCst)
    }

    /// Why work for `replies` must stop now, if it must: the daemon aborts, or
    /// the client is gone (`gone` says so in the caller's terms; None: work
    /// whose client's departure does not stop it, a handed-over save).
    pub fn stop_reason(&self, replies: &Replies, gone: Option<&'static str>) -> Option<&'static str> {
        if self.is_aborting() {
            Some("the sidecar is aborting")
        } else {
            gone.filter(|_| replies.is_gone())
        }
    }

    /// Registers `key` (a step, or one rank's part of a step) as in flight;
    /// false if it already is, or if a whole save and a part of one step
    /// would both be.
    pub fn begin_step(&self, key: Flight, bytes: u64) -> bool {
        self.flights.begin_step(key, bytes)
    }

    /// Registers a SaveFile of `path` as in flight; returns its key.
    pub fn begin_file(&self, path: &str, bytes: u64) -> Flight {
        self.flights.begin_file(path, bytes)
    }

    pub fn set_phase(&self, key: Flight, phase: Phase) {
        self.flights.set_phase(key, phase)
    }

    pub fn end(&self, key: Flight) {
        self.flights.end(key)
    }

    pub fn n_in_flight(&self) -> usize {
        self.flights.len()
    }

    /// Waits until nothing is in flight, or `timeout` passes; returns
    /// whether nothing is.
    pub fn wait_drained(&self, timeout: Duration) -> bool {
        self.flights.wait_empty(timeout)
    }

    /// Whether a draining daemon may exit: nothing in flight, and no
    /// session of a client that is gone still reading what it sent before
    /// it went (a handed-over save among it still commits: protocol.md).
    /// Sessions of live clients do not hold the exit.
    pub fn drained(&self) -> bool {
        self.wait_drained(Duration::ZERO) && !self.sessions.any_client_gone()
    }

    pub fn add_session(&self, e: SessionEntry) -> Result<u64, SessionsFull> {
        self.sessions.add(e)
    }

    /// Closes the sessions whose client process is gone; returns how many.
    pub fn reap_sessions(&self) -> usize {
        self.sessions.reap()
    }

    /// A read-only tool connection's place for process `pid`, given back
    /// when the guard drops.
    pub fn enter_tool(self: &Arc<Self>, pid: u32) -> Result<ToolGuard, ToolsFull> {
        self.sessions.enter_tool(pid)?;
        Ok(ToolGuard { state: self.clone(), pid })
    }

    pub fn update_session(&self, id: u64, f: impl FnOnce(&mut SessionEntry)) {
        self.sessions.update(id, f)
    }

    pub fn remove_session(&self, id: u64) {
        self.sessions.remove(id)
    }

    /// The registration of session `id`, removed when the guard drops:
    /// however the session's thread ends (a return, a panic that unwinds
    /// in a test build), its entry and the duplicate of its socket go, so
    /// `drained` never waits for a session that no thread serves.
    pub fn session_guard(self: &Arc<Self>, id: u64) -> SessionGuard {
        SessionGuard { state: self.clone(), id }
    }

    /// Shuts every session's socket down (daemon exit): clients see EOF.
    pub fn close_sessions(&self) {
        self.sessions.close_all()
    }

    pub fn set_last(&self, f: LastFigures) {
        *self.last.lock().expect("figures lock") = Some(f);
    }

    pub fn report(&self) -> StatusReport {
        let sessions = self.sessions.report();
        let in_flight = self.flights.report();
        let (damaged, damaged_total) = damage::report();
        StatusReport {
            server_pid: self.server_pid,
            dirs: self.dirs.iter().map(|d| d.display().to_string()).collect(),
            sessions,
            in_flight,
            staging_bytes: self.staging.budget_bytes(),
            staging_used_bytes: self.staging.used_bytes(),
            resident_step: self.staging.resident_step(),
            last: self.last.lock().expect("figures lock").clone(),
            cuda: crate::memory::cuda_probe::summary(),
            shared_dir: self.shared_dir.as_ref().map_or(String::new(), |d| d.display().to_string()),
            coordinating: self.coordinating.lock().expect("coordinating lock").clone(),
            unchanged_taken_bytes: self.unchanged_taken_bytes.load(Ordering::Relaxed),
            unchanged_in_place_bytes: self.unchanged_in_place_bytes.load(Ordering::Relaxed),
            drain: self.drain.as_ref().map(|d| d.report()),
            damaged,
            damaged_total,
            scrub: self.scrub.get().map(|s| s()),
            peers: self.peers.as_ref().map(|p| p.report()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_session_thread_that_ends_by_a_panic_leaves_no_registration_and_the_drain_ends() {
        // Were the entry (with its duplicate of a socket whose client is
        // gone) to stay, `drained` would be false for good: a sidecar that
        // never exits.
        let (tx, _rx) = crossbeam_channel::bounded(1);
        let staging = Staging::new(4 << 20).unwrap();
        let state = Arc::new(DaemonState::new(
            vec![],
            LayoutOptions::default(),
            ReadOptions::default(),
            staging,
            tx,
            vec![],
            Arc::new(AtomicBool::new(false)),
        ));
        let (ours, client) = UnixStream::pair().unwrap();
        drop(client);
        let id = state
            .add_session(SessionEntry {
                pid: 1,
                name: "t".into(),
                regions: 0,
                region_bytes: 0,
                peer: Peer { pid: 1, start_ticks: None },
                stream: Some(ours),
            })
            .unwrap();
        assert!(!state.drained(), "a registered session of a gone client holds the drain");
        let sh = state.clone();
        let ended = std::thread::spawn(move || {
            let _registered = sh.session_guard(id);
            panic!("a session thread ends early");
        })
        .join();
        assert!(ended.is_err());
        assert!(state.drained());
        assert!(state.sessions.is_empty());
    }
}
