//! The commit's doorbells (docs/protocol.md, "Peer protocol"): a rank's
//! marker sent to the step's coordinator as soon as it is written
//! ([`PeerMsg::Marked`]), and the coordinator's word that a step is decided
//! sent to every peer ([`PeerMsg::Decided`]). They replace waiting for the
//! next look at the shared directory, never the directory itself: a
//! doorbell only wakes its receiver, which still reads the outcome there,
//! and a lost one costs the look it would have saved.
//!
//! Sending: a line per peer address, each a thread of its own (a stalled
//! or unreachable peer delays only its own doorbells) with a bounded queue
//! and one kept connection, opened again once when it went stale. Nothing
//! that calls [`Bells`] waits for a peer.
//!
//! Where to send a marker: the coordinator of the last step decided here
//! (the peer whose Decided came last: its address is the connection's
//! remote host and the port it names, taken only when `--peers` lists it);
//! before any, nowhere (the coordinator finds the file).
//!
//! With no shared file system (`--shared-over-peers`) the messages are the
//! channel itself, not wake-ups: a part ([`PeerMsg::Part`]) goes to the
//! coordinator known, or is held ([`PartSent`]) until a
//! [`PeerMsg::Coordinating`] says who it is; the coordinator sends each
//! step's outcome ([`PeerMsg::Committed`], [`PeerMsg::Aborted`]) to every
//! peer. These are sent again for longer ([`Line::deliver`]), as nothing
//! stands in for one that is lost.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckpt_store::nodes::{SentMarker, SentPart, StepFiles};
use ckpt_wire::peer::PeerMsg;
use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use tracing::{debug, info, warn};

use super::conn::Conn;
use crate::config;

/// A doorbell received, for the committer.
#[derive(Debug)]
pub enum Rang {
    /// Node `from` wrote a rank's marker of `step`; its bytes.
    Marked { from: String, step: u64, world_size: u32, sent: SentMarker },
    /// The coordinator decided `step`.
    Decided { step: u64 },
    /// No shared file system: node `from` wrote a rank's part of `step`;
    /// what the coordinator's temp folder needs of it.
    Part { from: String, step: u64, world_size: u32, part: SentPart },
    /// No shared file system: the coordinator committed `step`; its step
    /// folder's files.
    Committed { step: u64, files: StepFiles },
    /// No shared file system: the coordinator aborted `step`, for this reason.
    Aborted { step: u64, reason: String },
    /// No shared file system: the peer `to` (its `--peers` entry)
    /// coordinates `step`.
    Coordinating { step: u64, to: String },
}

impl Rang {
    /// The bytes it holds (a marker's).
    fn len_bytes(&self) -> usize {
        match self {
            Rang::Marked { sent, .. } => sent.len_bytes(),
            Rang::Part { part, .. } => part.len_bytes(),
            Rang::Committed { files, .. } => files.iter().map(|(n, b)| n.len() + b.len()).sum(),
            Rang::Aborted { reason, .. } => reason.len(),
            Rang::Decided { .. } | Rang::Coordinating { .. } => 0,
        }
    }
}

/// Doorbells received, on their way to the committer (its own queue, so
/// that a burst of markers never waits behind, nor crowds out, the saves):
/// bounded in count and in marker bytes; one more is dropped (the looks
/// stand in).
pub struct Inbox {
    tx: Sender<Rang>,
    rx: Receiver<Rang>,
    queued_bytes: AtomicUsize,
    queued_bytes_max: usize,
}

impl Inbox {
    pub fn new() -> Arc<Inbox> {
        Inbox::with_limits(config::PEER_BELLS_RECEIVED_MAX, config::PEER_BELLS_RECEIVED_BYTES_MAX)
    }

    fn with_limits(count_max: usize, queued_bytes_max: usize) -> Arc<Inbox> {
        let (tx, rx) = bounded(count_max);
        Arc::new(Inbox { tx, rx, queued_bytes: AtomicUsize::new(0), queued_bytes_max })
    }

    /// Queues a doorbell received; false when it is dropped (full).
    pub fn put(&self, r: Rang) -> bool {
        let len = r.len_bytes();
        if self.queued_bytes.fetch_add(len, Ordering::Relaxed) + len > self.queued_bytes_max {
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            return false;
        }
        if self.tx.try_send(r).is_err() {
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// The queue the committer waits on (with its own).
    pub fn receiver(&self) -> &Receiver<Rang> {
        &self.rx
    }

    /// A doorbell taken off the queue (its bytes no longer count).
    pub fn took(&self, r: &Rang) {
        self.queued_bytes.fetch_sub(r.len_bytes(), Ordering::Relaxed);
    }
}

/// This node's sending side.
pub struct Bells {
    secret: Arc<Vec<u8>>,
    me: String,
    /// `--peers` as given, each with the socket addresses it resolved to
    /// at the start.
    peers: Vec<(String, Vec<SocketAddr>)>,
    /// This sidecar's peer port (named in its Decided).
    port: u16,
    io_timeout: Duration,
    lines: Mutex<HashMap<String, Sender<Arc<PeerMsg>>>>,
    /// The `--peers` entry of the last step's coordinator.
    coordinator: Mutex<Option<String>>,
}

impl Bells {
    pub fn new(secret: Arc<Vec<u8>>, me: String, peers: &[String], port: u16, io_timeout: Duration) -> Arc<Bells> {
        let peers =
            peers.iter().map(|p| (p.clone(), p.to_socket_addrs().map(|a| a.collect()).unwrap_or_default())).collect();
        Arc::new(Bells {
            secret,
            me,
            peers,
            port,
            io_timeout,
            lines: Mutex::new(HashMap::new()),
            coordinator: Mutex::new(None),
        })
    }

    /// A rank's marker of `step` is written: to the coordinator, if known.
    pub fn marked(&self, step: u64, world_size: u32, sent: &SentMarker) {
        let Some(to) = self.coordinator.lock().expect("bells lock").clone() else { return };
        let msg = PeerMsg::Marked {
            step,
            world_size,
            rank: sent.rank,
            folder_ino: sent.folder.ino,
            folder_born_ns: sent.folder.born_ns,
            marker: sent.marker.clone(),
            slices: sent.slices.clone(),
        };
        self.ring(&to, Arc::new(msg));
    }

    /// No shared file system: a rank's part of `step` is written: sent to
    /// the coordinator if one is known; the part, and where it went.
    pub fn part(&self, step: u64, world_size: u32, part: SentPart) -> PartSent {
        let SentPart { rank, marker, slices, blobs } = part;
        let msg = Arc::new(PeerMsg::Part { step, world_size, rank, marker, slices, blobs });
        let mut sent = PartSent { msg, to: None };
        if let Some(to) = self.coordinator.lock().expect("bells lock").clone() {
            self.part_to(&mut sent, &to);
        }
        sent
    }

    /// A part sent to peer `to` (its `--peers` entry), unless it went there.
    pub fn part_to(&self, sent: &mut PartSent, to: &str) {
        if sent.to.as_deref() != Some(to) {
            self.ring(to, sent.msg.clone());
            sent.to = Some(to.to_string());
        }
    }

    /// No shared file system, with a drain: this node uploaded its files of
    /// `step`; the coordinator known is told (none known: this sidecar is
    /// the last coordinator, and its own mark is where it looks).
    pub fn uploaded(&self, step: u64) {
        if let Some(to) = self.coordinator.lock().expect("bells lock").clone() {
            self.ring(&to, Arc::new(PeerMsg::Uploaded { step }));
        }
    }

    /// No shared file system: this sidecar coordinates `step`; every peer is told.
    pub fn coordinating(&self, step: u64) {
        self.ring_all(Arc::new(PeerMsg::Coordinating { step, port: self.port }));
    }

    /// This sidecar decided `step`: every peer is told.
    pub fn decided(&self, step: u64) {
        self.ring_all(Arc::new(PeerMsg::Decided { step, port: self.port }));
    }

    /// No shared file system: this sidecar committed `step`; every peer gets
    /// its step folder's files.
    pub fn committed(&self, step: u64, files: StepFiles) {
        self.ring_all(Arc::new(PeerMsg::Committed { step, port: self.port, files }));
    }

    /// No shared file system: this sidecar aborted `step`; every peer gets why.
    pub fn aborted(&self, step: u64, reason: &str) {
        self.ring_all(Arc::new(PeerMsg::Aborted { step, port: self.port, reason: reason.to_string() }));
    }

    fn ring_all(&self, msg: Arc<PeerMsg>) {
        for (p, _) in &self.peers {
            self.ring(p, msg.clone());
        }
    }

    /// The `--peers` entry of the coordinator known (the last one heard of).
    pub fn coordinator(&self) -> Option<String> {
        self.coordinator.lock().expect("bells lock").clone()
    }

    /// A Decided (or Coordinating, Committed, Aborted) came from `host`,
    /// naming peer port `port`: that peer is where the next markers go, when
    /// `--peers` lists it; its `--peers` entry.
    pub fn learn_coordinator(&self, host: IpAddr, port: u16) -> Option<String> {
        let at = SocketAddr::new(host, port);
        let Some((name, _)) = self.peers.iter().find(|(_, addrs)| addrs.contains(&at)) else {
            debug!(%at, "peers: a coordinator at an address --peers does not list; no marker is sent to it (--peers should list every node)");
            return None;
        };
        let mut c = self.coordinator.lock().expect("bells lock");
        if c.as_deref() != Some(name) {
            info!(coordinator = %name, "peers: markers go to this coordinator (the last step's)");
            *c = Some(name.clone());
        }
        Some(name.clone())
    }

    fn ring(&self, to: &str, msg: Arc<PeerMsg>) {
        let mut lines = self.lines.lock().expect("bells lock");
        let line = match lines.get(to) {
            Some(l) => l.clone(),
            None => {
                let (tx, rx) = bounded(config::PEER_BELLS_QUEUED_MAX);
                let line = Line {
                    to: to.to_string(),
                    secret: self.secret.clone(),
                    me: self.me.clone(),
                    io_timeout: self.io_timeout,
                };
                let spawned =
                    std::thread::Builder::new().name(format!("ckpt-bell-{}", lines.len())).spawn(move || line.run(rx));
                if let Err(e) = spawned {
                    warn!(peer = to, "peers: no doorbell thread ({e}); its doorbells are dropped");
                    return;
                }
                lines.insert(to.to_string(), tx.clone());
                tx
            }
        };
        drop(lines);
        if let Err(TrySendError::Full(m) | TrySendError::Disconnected(m)) = line.try_send(msg) {
            debug!(peer = to, kind = super::frames::kind(&m), "peers: a doorbell dropped (its peer's queue is full)");
        }
    }
}

/// Whether `msg` is one that no shared directory stands in for when lost
/// (`--shared-over-peers`): sent again for longer ([`Line::deliver`]).
fn must_deliver(msg: &PeerMsg) -> bool {
    matches!(
        msg,
        PeerMsg::Part { .. }
            | PeerMsg::Committed { .. }
            | PeerMsg::Aborted { .. }
            | PeerMsg::Coordinating { .. }
            | PeerMsg::Uploaded { .. }
    )
}

/// No shared file system: a part's message, kept until its step is decided
/// so that it can go to another coordinator, and the peer it went to.
pub struct PartSent {
    msg: Arc<PeerMsg>,
    to: Option<String>,
}

/// One peer's doorbells, sent in order on one kept connection.
struct Line {
    to: String,
    secret: Arc<Vec<u8>>,
    me: String,
    io_timeout: Duration,
}

impl Line {
    fn run(self, rx: Receiver<Arc<PeerMsg>>) {
        let mut conn: Option<(Conn, Instant)> = None;
        let mut failed_at: Option<Instant> = None;
        let retry = Duration::from_millis(config::PEER_BELL_RETRY_MS);
        for msg in rx {
            let must = must_deliver(&msg);
            if !must && failed_at.is_some_and(|t| t.elapsed() < retry) {
                continue;
            }
            // The peer closes a connection quiet for its timeout: one quiet
            // for half of ours is opened again rather than found closed.
            if conn.as_ref().is_some_and(|(_, used)| used.elapsed() >= self.io_timeout / 2) {
                conn = None;
            }
            let sent = if must { self.deliver(&mut conn, &msg) } else { self.send_retrying(&mut conn, &msg) };
            match sent {
                Ok(()) => failed_at = None,
                Err(e) => self.failed(&e, &mut failed_at),
            }
        }
    }

    /// Sends `msg`, on a new connection if the kept one went stale, and
    /// again after a short wait while the peer refuses at once (a burst
    /// of handshakes over its per-host bound, a restart): never longer
    /// than `PEER_BELL_RETRY_MS` in all, and not after a timeout (a cut
    /// link stays cut for longer than the doorbell is worth).
    fn send_retrying(&self, conn: &mut Option<(Conn, Instant)>, msg: &PeerMsg) -> Result<(), super::frames::ConnError> {
        let t0 = Instant::now();
        let mut wait = Duration::from_millis(config::PEER_BELL_RETRY_FIRST_MS);
        loop {
            let kept = conn.is_some();
            let t = Instant::now();
            let e = match self.send(conn, msg) {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            // A refusal or a reset answers within this; a timeout takes seconds.
            let refused_at_once = t.elapsed() < Duration::from_millis(config::PEER_BELL_RETRY_MS / 4);
            if kept {
                continue; // the kept connection is dropped: once more on a new one
            }
            if !refused_at_once || t0.elapsed() + wait > Duration::from_millis(config::PEER_BELL_RETRY_MS) {
                return Err(e);
            }
            std::thread::sleep(wait);
            wait *= 2;
        }
    }

    /// A message with no shared directory behind it (a part, a step's
    /// outcome): sent as [`Line::send_retrying`] does, and again after a
    /// wait (doubling to 1 s) whatever the error, within
    /// `PEER_DELIVER_MS` in all (a peer restarting, a link down for
    /// seconds); after that the step's own timeouts decide.
    fn deliver(&self, conn: &mut Option<(Conn, Instant)>, msg: &PeerMsg) -> Result<(), super::frames::ConnError> {
        let t0 = Instant::now();
        let mut wait = Duration::from_millis(config::PEER_BELL_RETRY_FIRST_MS);
        loop {
            let e = match self.send_retrying(conn, msg) {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if t0.elapsed() + wait > Duration::from_millis(config::PEER_DELIVER_MS) {
                return Err(e);
            }
            debug!(peer = %self.to, kind = super::frames::kind(msg), "peers: sending again ({e})");
            std::thread::sleep(wait);
            wait = (wait * 2).min(Duration::from_secs(1));
        }
    }

    fn send(&self, conn: &mut Option<(Conn, Instant)>, msg: &PeerMsg) -> Result<(), super::frames::ConnError> {
        if conn.is_none() {
            *conn = Some((Conn::open(&self.to, &self.secret, &self.me, self.io_timeout)?, Instant::now()));
        }
        let (c, used) = conn.as_mut().expect("opened above");
        let r = c.ring(msg);
        *used = Instant::now();
        if r.is_err() {
            *conn = None;
        }
        r
    }

    fn failed(&self, e: &super::frames::ConnError, failed_at: &mut Option<Instant>) {
        if failed_at.is_none() {
            warn!(peer = %self.to, "peers: a doorbell could not be sent ({e}); the shared directory's looks stand in");
        }
        *failed_at = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_store::nodes::FolderId;

    fn marked(len_bytes: usize) -> Rang {
        let folder = FolderId { ino: 1, born_ns: 1 };
        let sent = SentMarker { rank: 0, folder, marker: vec![b'{'; len_bytes], slices: Vec::new() };
        Rang::Marked { from: "b".into(), step: 1, world_size: 2, sent }
    }

    #[test]
    fn the_inbox_drops_past_its_count_or_bytes_and_frees_them_when_taken() {
        let inbox = Inbox::with_limits(3, 100);
        assert!(inbox.put(marked(60)));
        assert!(!inbox.put(marked(41)), "past the bytes");
        assert!(inbox.put(marked(40)));
        assert!(inbox.put(Rang::Decided { step: 1 }), "no bytes");
        assert!(!inbox.put(Rang::Decided { step: 2 }), "past the count");
        let first = inbox.receiver().try_recv().expect("queued");
        inbox.took(&first);
        assert!(inbox.put(marked(60)), "the taken one's bytes are free again");
        assert!(!inbox.put(Rang::Decided { step: 3 }), "the count is full again");
    }
}
