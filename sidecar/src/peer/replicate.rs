//! This node's replication: each durable step's node-local files sent to
//! `--peer-replicas` peers, in ring order of node id after this node's
//! (so with every node doing the same, each node's files land on the next
//! K), on the `ckpt-peer-send` thread; its outcome (held by which peers,
//! or failed and why) remembered, and the clients waiting for it answered
//! once (WaitPeers).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use ckpt_store::catalog;
use ckpt_store::format::{self, Index, INDEX_FILE_NAME};
use ckpt_store::restore::ThisNode;
use ckpt_wire::{ErrorCode, PeerReport, Reply};
use crossbeam_channel::Sender as Tx;
use tracing::{info, warn};

use super::conn::{Conn, LocalFile};
use super::pool::{Pool, Pooled};
use crate::config;
use crate::drain::Answer;

/// What the replication thread needs.
pub struct Sender {
    pub secret: Arc<Vec<u8>>,
    pub me: ThisNode,
    pub shared_dir: PathBuf,
    pub peers: Vec<String>,
    pub replicas: u32,
    /// The steps of this node its peers keep (`--peer-keep`): when more
    /// wait to be sent, the older ones are skipped.
    pub keep: usize,
    pub staged: Arc<Staged>,
    /// A peer silent this long fails the replication to it.
    pub io_timeout: std::time::Duration,
    /// The node id each peer address proved last, and the failure domain
    /// it said: the ring order without a connection to every peer each step.
    pub ids: Mutex<std::collections::HashMap<String, (String, String)>>,
    /// The committed indexes read so far (by template when laid out as
    /// the step before's).
    pub kept: ckpt_store::nodes::KeptIndex,
    /// `--peer-bandwidth`: every byte sent to any peer takes its tokens.
    pub pace: Option<ckpt_tier::TokenBucket>,
    /// This node's failure domain (`--failure-domain`; empty: none).
    pub domain: String,
}

/// This node's files of recent steps in memory, copied from each part's
/// staging image as it was written, until sent (bounded in bytes); the
/// copies of a step sent are the next step's memory.
pub struct Staged {
    files: Mutex<BTreeMap<u64, StepFiles>>,
    pool: Arc<Pool>,
}

/// One step's files by name.
type StepFiles = std::collections::HashMap<String, Pooled>;

impl Default for Staged {
    fn default() -> Staged {
        Staged { files: Mutex::default(), pool: Pool::new(config::PEER_SEND_STAGED_BYTES_MAX) }
    }
}

impl Staged {
    /// Keeps a copy of each of `layout`'s shard files from `image` (a
    /// part's lease, at the layout's offsets) that fits the bound.
    pub fn stage(&self, step: u64, layout: &ckpt_store::image::Layout, image: &[u8]) {
        let mut g = self.files.lock().expect("staged files lock");
        let mut held: u64 = g.values().flat_map(|m| m.values()).map(|b| b.as_slice().len() as u64).sum();
        for s in &layout.shards {
            let (off, len) = (s.staging_offset as usize, s.file_len as usize);
            if off + len > image.len() || held + len as u64 > config::PEER_SEND_STAGED_BYTES_MAX {
                continue;
            }
            // No memory for a copy: this file is sent from disk.
            let Ok(mut copy) = self.pool.take(len) else { continue };
            crate::memory::regions::shm::copy_streaming_fenced(copy.as_mut_slice(), &image[off..off + len]);
            held += len as u64;
            g.entry(step).or_default().insert(s.file_name.clone(), copy);
        }
    }

    /// Takes `step`'s copies, and lets every older step's go.
    fn take(&self, step: u64) -> StepFiles {
        let mut g = self.files.lock().expect("staged files lock");
        let mine = g.remove(&step).unwrap_or_default();
        g.retain(|&s, _| s > step);
        mine
    }
}

#[derive(Debug, Clone)]
enum Outcome {
    Pending,
    Held(Vec<String>),
    Failed(String),
    /// Not sent: `--peer-keep` newer steps, up to this one, waited behind it.
    Skipped(u64),
}

struct Waiter {
    replies: Arc<dyn Answer>,
    id: u64,
    step: u64,
}

#[derive(Default)]
struct State {
    outcomes: BTreeMap<u64, Outcome>,
    waiters: Vec<Waiter>,
    report: PeerReport,
    /// `--peer-keep`: named when a skipped step is waited for.
    keep: usize,
}

pub struct Replication {
    tx: Tx<u64>,
    st: Arc<Mutex<State>>,
}

impl Replication {
    pub fn spawn(sender: Sender) -> std::io::Result<Replication> {
        let (tx, rx) = crossbeam_channel::unbounded::<u64>();
        let st = Arc::new(Mutex::new(State { keep: sender.keep, ..State::default() }));
        let shared = st.clone();
        std::thread::Builder::new().name("ckpt-peer-send".into()).spawn(move || {
            crate::priority::nice_19();
            // Steps committed and not sent yet, sent oldest first.
            let mut waiting = std::collections::BTreeSet::new();
            loop {
                if waiting.is_empty() {
                    let Ok(s) = rx.recv() else { return };
                    waiting.insert(s);
                }
                waiting.extend(rx.try_iter());
                // Replication behind the steps: beyond the newest `--peer-keep`
                // waiting, a step would only be evicted from the peers by the
                // newer ones behind it, so it is skipped, not sent (sending
                // each in turn only falls further behind).
                let newest = *waiting.last().expect("a step waits");
                let mut skipped = Vec::new();
                while waiting.len() > sender.keep.max(1) {
                    skipped.extend(waiting.pop_first());
                }
                if !skipped.is_empty() {
                    let mut g = shared.lock().expect("peer replication lock");
                    for &s in &skipped {
                        g.outcomes.insert(s, Outcome::Skipped(newest));
                    }
                    g.report.skipped_count += skipped.len() as u64;
                    g.report.last_skipped = skipped.last().copied();
                    answer(&mut g);
                    drop(g);
                    info!(
                        ?skipped,
                        newest,
                        "peers: replication behind: skipping steps the peers would not keep (more than --peer-keep newer ones wait)"
                    );
                }
                let step = waiting.pop_first().expect("a step waits");
                let t0 = Instant::now();
                let (outcome, bytes) = match sender.replicate(step) {
                    Ok((held, bytes)) => (Outcome::Held(held), bytes),
                    Err(why) => (Outcome::Failed(why), 0),
                };
                let seconds = t0.elapsed().as_secs_f64();
                let mut g = shared.lock().expect("peer replication lock");
                match &outcome {
                    Outcome::Held(by) => {
                        info!(step, peers = ?by, bytes, seconds, "peers: this node's files are held by its peers");
                        g.report.last_held = Some(step);
                        g.report.last_held_by = by.clone();
                        if bytes > 0 {
                            g.report.bytes_per_s = bytes as f64 / seconds.max(1e-9);
                        }
                    }
                    Outcome::Failed(why) => {
                        warn!(step, "peers: replication failed: {why}");
                        g.report.last_failed = Some(step);
                        g.report.last_error = why.clone();
                    }
                    Outcome::Pending | Outcome::Skipped(_) => {}
                }
                g.outcomes.insert(step, outcome);
                while g.outcomes.len() > config::PEER_OUTCOMES_KEPT {
                    g.outcomes.pop_first();
                }
                answer(&mut g);
            }
        })?;
        Ok(Replication { tx, st })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().expect("peer replication lock")
    }

    pub fn committed(&self, step: u64) {
        self.lock().outcomes.insert(step, Outcome::Pending);
        // The thread lives as long as the daemon: a send cannot fail before.
        let _ = self.tx.send(step);
    }

    pub fn wait(&self, replies: Arc<dyn Answer>, id: u64, step: u64, committed: bool) {
        let mut g = self.lock();
        if !g.outcomes.contains_key(&step) {
            let why = if committed {
                "it was not durable through this sidecar since it started, so this node did not replicate it"
            } else {
                "not committed"
            };
            replies.send(&Reply::Error {
                id,
                code: ErrorCode::NotFound,
                message: format!("step {step}: {why}; it is not held by peers"),
            });
            return;
        }
        if g.waiters.len() >= config::PEER_WAITERS_MAX {
            replies.send(&Reply::Error {
                id,
                code: ErrorCode::BadRequest,
                message: format!("more than {} waits for peers at once", config::PEER_WAITERS_MAX),
            });
            return;
        }
        g.waiters.push(Waiter { replies, id, step });
        answer(&mut g);
    }

    pub fn report(&self) -> PeerReport {
        self.lock().report.clone()
    }
}

/// Answers every waiter whose step's replication ended; drops those whose client is gone.
fn answer(g: &mut State) {
    let (outcomes, keep) = (&g.outcomes, g.keep);
    g.waiters.retain(|w| {
        if w.replies.is_gone() {
            return false;
        }
        let reply = match outcomes.get(&w.step) {
            Some(Outcome::Pending) => return true,
            Some(Outcome::Held(peers)) => Reply::HeldByPeers { id: w.id, step: w.step, peers: peers.clone() },
            Some(Outcome::Failed(why)) => Reply::Error {
                id: w.id,
                code: ErrorCode::Io,
                message: format!("step {}: not held by peers: {why}", w.step),
            },
            Some(Outcome::Skipped(newest)) => Reply::Error {
                id: w.id,
                code: ErrorCode::NotFound,
                message: format!(
                    "step {}: not held by peers: skipped, as {keep} newer steps (up to step {newest}) were waiting \
                     to be sent, and the peers keep the newest {keep} of this node (--peer-keep): replication \
                     was behind the steps",
                    w.step
                ),
            },
            None => Reply::Error {
                id: w.id,
                code: ErrorCode::NotFound,
                message: format!("step {}: its replication outcome is no longer remembered", w.step),
            },
        };
        w.replies.send(&reply);
        false
    });
}

impl Sender {
    /// Sends this node's files of `step` to the first `replicas` peers in
    /// ring order that take them: their node ids and the bytes sent, or why not.
    fn replicate(&self, step: u64) -> Result<(Vec<String>, u64), String> {
        let index_path = catalog::step_path(&self.shared_dir, step).join(INDEX_FILE_NAME);
        let index_bytes = std::fs::read(&index_path).map_err(|e| format!("{}: {e}", index_path.display()))?;
        let mut staged = self.staged.take(step);
        // This node's part of the index (its files, their tensors): the
        // peers check the files against it, so that what they parse grows
        // with this node's tensors, not the job's; the index itself is
        // read by the template of the step before when laid out the same.
        let part =
            self.kept.node_part(&index_bytes, &self.me.id).map_err(|e| format!("{}: {e}", index_path.display()))?;
        let Some(part) = part else { return Ok((Vec::new(), 0)) };
        let mut files = self.files(&part, step)?;
        for f in &mut files {
            f.bytes = staged.remove(&f.name);
        }
        if files.is_empty() {
            return Ok((Vec::new(), 0));
        }
        let part = part.to_json_bytes();
        let bytes: u64 = files.iter().map(|f| f.len_bytes).sum();
        let mut reasons = Vec::new();
        let mut ids = self.ids.lock().expect("peer ids lock");
        // The peers whose node id is not known yet are asked (a handshake
        // says it); the others are connected to only when their turn in
        // the ring comes.
        let mut open: std::collections::HashMap<&str, Conn> = std::collections::HashMap::new();
        let unknown: Vec<&String> = self.peers.iter().filter(|a| !ids.contains_key(*a)).collect();
        for addr in unknown {
            match Conn::open(addr, &self.secret, &self.me.id, self.io_timeout) {
                Ok(c) => {
                    ids.insert(addr.clone(), (c.node.clone(), c.domain.clone()));
                    open.insert(addr, c);
                }
                Err(e) => reasons.push(format!("peer {addr}: {e}")),
            }
        }
        let known: Vec<Peer<'_>> =
            self.peers.iter().filter_map(|a| ids.get(a).map(|(node, domain)| Peer { addr: a, node, domain })).collect();
        let order: Vec<(String, String)> = offer_order(&self.me.id, &self.domain, &known)
            .into_iter()
            .map(|p| (p.addr.to_string(), p.node.to_string()))
            .collect();
        let mut held: Vec<(String, String)> = Vec::new();
        for (addr, node) in &order {
            let addr = addr.as_str();
            if held.len() >= self.replicas as usize {
                break;
            }
            if *node == self.me.id {
                reasons.push(format!("{addr} is this node ({node:?})"));
                continue;
            }
            let mut c = match open.remove(addr) {
                Some(c) => c,
                None => match Conn::open(addr, &self.secret, &self.me.id, self.io_timeout) {
                    Ok(c) => c,
                    Err(e) => {
                        reasons.push(format!("peer {addr}: {e}"));
                        continue;
                    }
                },
            };
            // Another node at this address now: the ring is ordered by it next time.
            ids.insert(addr.to_string(), (c.node.clone(), c.domain.clone()));
            match c.offer(&self.me.id, step, &part, &files, self.pace.as_ref()) {
                Ok(()) => held.push((c.node.clone(), c.domain.clone())),
                Err(e) => reasons.push(format!("peer {addr} ({:?}): {e}", c.node)),
            }
            c.close();
        }
        for (_, c) in open {
            c.close();
        }
        let by: Vec<String> = held.iter().map(|(node, _)| node.clone()).collect();
        if by.len() < self.replicas as usize {
            return Err(format!(
                "held by {} of the {} peers wanted ({by:?}): {}",
                by.len(),
                self.replicas,
                if reasons.is_empty() { "too few peers".to_string() } else { reasons.join("; ") }
            ));
        }
        if !self.domain.is_empty() && held.iter().all(|(_, d)| *d == self.domain) {
            warn!(
                step,
                failure_domain = %self.domain,
                peers = ?by,
                "peers: this node's files are held only within its own failure domain (no peer of another domain took them)"
            );
        }
        Ok((by, bytes))
    }

    /// This node's files of `step`, on its disks.
    fn files(&self, index: &Index, step: u64) -> Result<Vec<LocalFile>, String> {
        let folder = format::node_step_dir_name(step).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        for f in &index.ckpt.files {
            if index.holder(&f.name).map(|(id, _)| id) != Some(self.me.id.as_str()) {
                continue;
            }
            let dir = self.me.dirs.get(f.dir_idx as usize).ok_or_else(|| {
                format!(
                    "step {step}: file {} is in directory #{} of this node's {}",
                    f.name,
                    f.dir_idx,
                    self.me.dirs.len()
                )
            })?;
            out.push(LocalFile {
                name: f.name.clone(),
                path: dir.join(&folder).join(&f.name),
                len_bytes: f.len_bytes,
                bytes: None,
            });
        }
        Ok(out)
    }
}

/// A peer as the replication knows it: its address, and the node id and
/// failure domain it proved and said.
struct Peer<'a> {
    addr: &'a str,
    node: &'a str,
    domain: &'a str,
}

/// The order this node (`me`, of failure domain `domain`) offers its steps
/// to `peers` in, until `--peer-replicas` hold one: ring order by node id
/// (the ids after ours, then from the lowest, so every node's files land
/// on the next one), taken in three passes: one peer of each failure
/// domain other than ours, in ring order (so K replicas land in K domains
/// where there are that many); then the other peers outside our domain;
/// then those inside it. A peer without a domain is a domain of its own,
/// so with no domains anywhere this is the ring order itself.
fn offer_order<'p, 'a>(me: &str, domain: &str, peers: &'p [Peer<'a>]) -> Vec<&'p Peer<'a>> {
    let mut ring: Vec<&'p Peer<'a>> = peers.iter().collect();
    ring.sort_by(|a, b| ((a.node <= me), a.node).cmp(&((b.node <= me), b.node)));
    let key = |node: &'a str, d: &'a str| if d.is_empty() { (true, node) } else { (false, d) };
    let ours = if domain.is_empty() { (true, me) } else { (false, domain) };
    // One walk of the ring, each peer into its pass.
    let (mut first, mut other, mut own) = (Vec::new(), Vec::new(), Vec::new());
    let mut domains_taken = std::collections::HashSet::new();
    for p in ring {
        let k = key(p.node, p.domain);
        if k == ours {
            own.push(p);
        } else if domains_taken.insert(k) {
            first.push(p);
        } else {
            other.push(p);
        }
    }
    first.extend(other);
    first.extend(own);
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(me: &str, domain: &str, peers: &[(&str, &str)]) -> Vec<String> {
        let ps: Vec<Peer<'_>> = peers.iter().map(|(node, d)| Peer { addr: node, node, domain: d }).collect();
        offer_order(me, domain, &ps).into_iter().map(|p| p.node.to_string()).collect()
    }

    #[test]
    fn without_failure_domains_the_order_is_the_ring_after_this_node() {
        let peers = [("a", ""), ("b", ""), ("d", ""), ("e", "")];
        assert_eq!(order("c", "", &peers), ["d", "e", "a", "b"]);
        assert_eq!(order("e", "", &peers[..3]), ["a", "b", "d"]);
    }

    #[test]
    fn peers_of_other_failure_domains_come_first_one_per_domain_then_this_nodes_own() {
        // Racks r1 (a, b, c), r2 (d, e), r3 (f); c's ring: d e f a b.
        let peers = [("a", "r1"), ("b", "r1"), ("d", "r2"), ("e", "r2"), ("f", "r3")];
        assert_eq!(order("c", "r1", &peers), ["d", "f", "e", "a", "b"]);
        // f's ring: a b c d e; r1 first (a), then r2 (d), then the rest outside r3.
        let peers = [("a", "r1"), ("b", "r1"), ("c", "r1"), ("d", "r2"), ("e", "r2")];
        assert_eq!(order("f", "r3", &peers), ["a", "d", "b", "c", "e"]);
        // Every peer in this node's domain: the ring order, nothing lost.
        assert_eq!(order("b", "r1", &[("a", "r1"), ("c", "r1")]), ["c", "a"]);
        // A peer without a domain is a domain of its own.
        assert_eq!(order("a", "r1", &[("b", "r1"), ("c", ""), ("d", "r2")]), ["c", "d", "b"]);
    }
}
