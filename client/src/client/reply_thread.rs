//! The reply thread (`ckpt-shim-reader`, one per connection) and the table
//! it files replies into.
//!
//! The thread decodes every reply and files it in the shared [`State`]:
//! replies to requests by id (only ids someone still waits for), and the
//! asynchronous `Released` / `Durable` / `Failed` of saves into the save
//! table, whatever order they arrive in. Callers block on [`Shared::changed`],
//! never on the socket.
//!
//! Invariants:
//! - replies of an older connection (another generation) are dropped, so a
//!   reconnect never sees the past's answers;
//! - the tables are bounded: replies are kept only for ids being waited for,
//!   finished saves only for the newest [`SAVES_FINISHED_MAX`];
//! - when the connection is lost every save not yet final fails, saying
//!   whether it had been released, and every stream waiting on a device
//!   copy of it goes on ([`crate::done_word`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};

use ckpt_wire::{ErrorCode, FrameError, Reply};

use super::fork::fork_fd_unregister;
use super::types::{SaveState, SaveStatus};

/// Finished (durable or failed) saves remembered for `poll`/`wait`.
pub const SAVES_FINISHED_MAX: usize = 1024;

/// What a connection's callers and its reply thread share.
pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    /// Notified whenever the reply thread filed something or the connection
    /// was lost.
    pub(super) changed: Condvar,
}

/// The client's requests and saves as the replies leave them.
#[derive(Default)]
pub(super) struct State {
    /// Generation of the current connection; replies of older ones are dropped.
    pub(super) gen: u64,
    /// Why the current connection is dead, once it is.
    pub(super) dead: Option<String>,
    pub(super) next_id: u64,
    /// Request ids someone is waiting for, and their replies once here.
    pub(super) waiting: HashSet<u64>,
    pub(super) replies: HashMap<u64, Reply>,
    pub(super) saves: HashMap<u64, SaveEntry>,
    pub(super) finished: VecDeque<u64>,
    /// The word device saves' stream waits wait on, made at the first such
    /// save (None: not yet, or the driver refused it: waits are then the
    /// CPU's), and the highest value given to a save sent.
    pub(super) done_word: Option<Arc<crate::done_word::DoneWord>>,
    pub(super) done_sent: u32,
    /// How long a stream may wait on a save's copy (None: for ever), the
    /// deadlines of the saves streams wait on, and whether the watchdog
    /// runs ([`super::stream_watch`]).
    pub(super) stream_wait_deadline: Option<std::time::Duration>,
    pub(super) stream_deadlines: Vec<(u64, std::time::Instant)>,
    pub(super) watchdog_running: bool,
    /// The current connection's socket, for the watchdog to shut down.
    pub(super) socket: Option<Arc<UnixStream>>,
    /// The client is closed: the watchdog ends.
    pub(super) closed: bool,
    /// Stream waits became the CPU's once already (said once on stderr).
    pub(super) cpu_wait_said: bool,
}

/// One save as far as the replies tell.
#[derive(Debug, Clone)]
pub(super) struct SaveEntry {
    pub(super) status: SaveStatus,
    /// Set when failed: the code the sidecar gave, or None for a lost connection.
    pub(super) code: Option<ErrorCode>,
    /// A CUDA save: its device, and the value the copy-done word reaches
    /// once its copy is over ([`crate::done_word`]).
    pub(super) cuda_device: Option<(i32, u32)>,
    /// The request named one of this client's interprocess events, and
    /// the sidecar has not answered it yet: it may still poll the event,
    /// which must not be destroyed under it ([`super::Client::close`]).
    pub(super) event_pending: bool,
}

impl State {
    /// Files one reply: into the save table, or beside the request waiting
    /// for it.
    fn file(&mut self, reply: Reply) {
        match reply {
            Reply::Released { id, copy_seconds, waited_seconds, .. } => {
                self.copy_over(id);
                if let Some(e) = self.saves.get_mut(&id) {
                    if e.status.state == SaveState::Pending {
                        e.status.state = SaveState::Released;
                        e.status.released = true;
                        e.status.copy_seconds = Some(copy_seconds);
                        e.status.waited_seconds = Some(waited_seconds);
                    }
                }
            }
            Reply::Durable { id, path, persist_seconds, .. } => {
                self.copy_over(id);
                if let Some(e) = self.saves.get_mut(&id) {
                    if matches!(e.status.state, SaveState::Pending | SaveState::Released) {
                        // Durable implies released, even if Released was never seen.
                        e.status.state = SaveState::Durable;
                        e.status.released = true;
                        e.status.path = Some(path);
                        e.status.persist_seconds = Some(persist_seconds);
                        self.finish(id);
                    }
                }
            }
            // A sidecar of this protocol never sends it; nothing waits for it.
            Reply::CopyQueued { .. } => {}
            Reply::Failed { id, code, reason, .. } => {
                self.copy_over(id);
                self.fail_save(id, Some(code), reason)
            }
            Reply::Error { id, code, message } if self.saves.get(&id).is_some_and(|e| !is_final(e.status.state)) => {
                self.copy_over(id);
                self.fail_save(id, Some(code), message)
            }
            Reply::Refused { reason } => self.lose(format!("the sidecar ended the session: {reason}")),
            Reply::Welcome { .. } => {}
            other => {
                if let Some(id) = reply_id(&other) {
                    if self.waiting.contains(&id) {
                        self.replies.insert(id, other);
                    }
                }
            }
        }
    }

    /// Save `id`'s device copy is over (or will never run): the trainer's
    /// streams waiting on it go on ([`crate::done_word`]).
    pub(super) fn copy_over(&mut self, id: u64) {
        if let (Some(w), Some(&SaveEntry { cuda_device: Some((_, value)), .. })) =
            (&self.done_word, self.saves.get(&id))
        {
            w.release(value);
        }
        // The sidecar answered: it polled the request's event to its end
        // (or gave it up) before.
        if let Some(e) = self.saves.get_mut(&id) {
            e.event_pending = false;
        }
    }

    /// Whether the sidecar may still poll one of this client's events.
    pub(super) fn events_in_use(&self) -> bool {
        self.saves.values().any(|e| e.event_pending)
    }

    pub(super) fn fail_save(&mut self, id: u64, code: Option<ErrorCode>, reason: String) {
        if let Some(e) = self.saves.get_mut(&id) {
            if !is_final(e.status.state) {
                e.status.state = SaveState::Failed;
                e.status.error = Some(reason);
                e.code = code;
                self.finish(id);
            }
        }
    }

    fn finish(&mut self, id: u64) {
        self.finished.push_back(id);
        while self.finished.len() > SAVES_FINISHED_MAX {
            let old = self.finished.pop_front().expect("non-empty");
            self.saves.remove(&old);
        }
    }

    /// The current connection is gone: every unfinished save fails.
    pub(super) fn lose(&mut self, reason: String) {
        if self.dead.is_some() {
            return;
        }
        // No copy of a save sent on this connection may still be waited for:
        // the sidecar cannot finish it any more.
        if let Some(w) = &self.done_word {
            w.release(self.done_sent);
        }
        let open: Vec<u64> = self.saves.iter().filter(|(_, e)| !is_final(e.status.state)).map(|(id, _)| *id).collect();
        for id in open {
            let released = self.saves[&id].status.released;
            let why = if released {
                format!("{reason}; the snapshot had been released, so the checkpoint may still commit (check the list)")
            } else {
                format!("{reason}; the snapshot was not released, so this checkpoint was not taken")
            };
            self.fail_save(id, None, why);
        }
        self.dead = Some(reason);
    }
}

/// Whether a save in state `s` can change no more.
pub(super) fn is_final(s: SaveState) -> bool {
    matches!(s, SaveState::Durable | SaveState::Failed)
}

/// The request a reply answers (None: the connection's own replies).
fn reply_id(r: &Reply) -> Option<u64> {
    match r {
        Reply::Welcome { .. } | Reply::Refused { .. } => None,
        Reply::RegionRegistered { id, .. }
        | Reply::RegionUnregistered { id, .. }
        | Reply::Released { id, .. }
        | Reply::Durable { id, .. }
        | Reply::Failed { id, .. }
        | Reply::Loaded { id, .. }
        | Reply::Listing { id, .. }
        | Reply::Status { id, .. }
        | Reply::RolledBack { id, .. }
        | Reply::CopyQueued { id, .. }
        | Reply::Placed { id, .. }
        | Reply::Replicated { id, .. }
        | Reply::HeldByPeers { id, .. }
        | Reply::Error { id, .. } => Some(*id),
    }
}

/// The reply thread's body: files the replies of connection `gen` until it
/// ends.
pub(super) fn reader_loop(mut stream: UnixStream, gen: u64, shared: Arc<Shared>) {
    read_replies(&mut stream, gen, &shared);
    // Unregistered while still open: a fork after the close would have the
    // child's handler close whatever descriptor took the number meanwhile.
    // (A fork between the two leaves the child a copy of this socket,
    // closed when the child exits: the lesser harm.)
    fork_fd_unregister(stream.as_raw_fd());
    drop(stream);
}

/// Reads and files replies until the connection ends or is replaced.
fn read_replies(stream: &mut UnixStream, gen: u64, shared: &Shared) {
    loop {
        let got = ckpt_wire::read_frame::<Reply>(stream);
        let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.gen != gen {
            return;
        }
        match got {
            Ok(reply) => st.file(reply),
            Err(e) => {
                st.lose(lost_reason(e));
                let _ = stream.shutdown(std::net::Shutdown::Both);
                shared.changed.notify_all();
                return;
            }
        }
        shared.changed.notify_all();
    }
}

/// Why a connection whose read failed with `e` is lost, for every waiter.
fn lost_reason(e: FrameError) -> String {
    match e {
        FrameError::Closed => {
            "the sidecar closed the connection (it exited, was killed, or ended the session)".to_string()
        }
        FrameError::Truncated => "the sidecar closed the connection in the middle of a reply".to_string(),
        FrameError::Io(e) => format!("reading from the sidecar failed: {e}"),
        e @ (FrameError::TooLarge { .. } | FrameError::Decode(_)) => {
            format!("unreadable reply from the sidecar ({e}); connection dropped")
        }
    }
}
