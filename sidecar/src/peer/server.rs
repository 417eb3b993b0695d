//! The listening side: a task per connection on the peer runtime. A
//! connection is counted against its host's limit from its accept (so
//! unauthenticated handshakes are bounded too), must finish the handshake
//! within its deadline with frames no larger than a Hello's, and then
//! serves offers (a replica received, every byte checked, then held) and
//! gets (a held file sent back) until the peer closes or stalls. Whatever
//! goes wrong ends that connection only.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ckpt_store::format::Index;
use ckpt_store::nodes::{FolderId, SentMarker, SentPart};
use ckpt_wire::peer::{self, Nodes, PeerMsg, Role, PEER_FRAME_BYTES_MAX, PEER_HELLO_BYTES_MAX};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

use super::bells::{Bells, Inbox, Rang};
use super::frames::{fresh_nonce, kind, recv_async, recv_raw_async, send_async, send_raw_async, ConnError};
use super::held::{Held, Replica, ReplicaFile};
use crate::config;

pub struct Server {
    pub secret: Arc<Vec<u8>>,
    /// This node's id (the listener's in every proof).
    pub node: String,
    /// This node's failure domain (`--failure-domain`; empty: none), said
    /// in the Challenge.
    pub domain: String,
    /// This node's directories: its own files are served from them.
    pub dirs: Vec<std::path::PathBuf>,
    /// No shared file system (`--shared-over-peers`): this node's own
    /// shared directory, whose committed steps a Newest asks for. None: the
    /// messages of that mode are answered with an Error.
    pub shared_over: Option<std::path::PathBuf>,
    pub held: Arc<Held>,
    /// Connections refused (over a limit, a failed handshake, garbage, a stall).
    pub refused: Arc<AtomicU64>,
    /// An authenticated peer silent this long is dropped.
    pub io_timeout: Duration,
    /// Where doorbells received go (the committer).
    pub inbox: Arc<Inbox>,
    /// This node's sending side (learns the coordinator from a Decided).
    pub bells: Arc<Bells>,
    /// The runtime a replica is received and checked on: its threads run at
    /// nice 19 ([`crate::priority::nice_19`]).
    pub offers: tokio::runtime::Handle,
}

/// What a connection is counted against: its remote host until its
/// handshake succeeded, then the node it proved to be.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Owner {
    Host(IpAddr),
    Node(String),
}

/// Open connections per host (before their handshake) and per node (after it).
#[derive(Default)]
struct Slots {
    per_owner: HashMap<Owner, usize>,
    total: usize,
}

/// One connection's place among the open ones; freed when dropped.
struct Slot {
    slots: Arc<Mutex<Slots>>,
    owner: Owner,
}

impl Slot {
    fn take(slots: &Arc<Mutex<Slots>>, host: IpAddr) -> Option<Slot> {
        let mut s = slots.lock().expect("peer slots lock");
        let owner = Owner::Host(host);
        let n = s.per_owner.get(&owner).copied().unwrap_or(0);
        if n >= config::PEER_CONNECTIONS_PER_HOST_MAX || s.total >= config::PEER_CONNECTIONS_MAX {
            return None;
        }
        s.per_owner.insert(owner.clone(), n + 1);
        s.total += 1;
        Some(Slot { slots: slots.clone(), owner })
    }

    /// The handshake proved node `node`: the connection counts against it
    /// from now on, not against its host (several nodes may share one);
    /// false when that node holds its most already.
    fn authenticated(&mut self, node: &str) -> bool {
        let mut s = self.slots.lock().expect("peer slots lock");
        let owner = Owner::Node(node.to_string());
        let n = s.per_owner.get(&owner).copied().unwrap_or(0);
        if n >= config::PEER_CONNECTIONS_PER_NODE_MAX {
            return false;
        }
        s.per_owner.insert(owner.clone(), n + 1);
        let old = std::mem::replace(&mut self.owner, owner);
        release(&mut s, &old);
        true
    }
}

fn release(s: &mut Slots, owner: &Owner) {
    if let Some(n) = s.per_owner.get_mut(owner) {
        *n -= 1;
        if *n == 0 {
            s.per_owner.remove(owner);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.slots.lock().expect("peer slots lock");
        s.total -= 1;
        release(&mut s, &self.owner);
    }
}

/// Accepts connections for good (the runtime's life).
pub async fn serve(listener: TcpListener, srv: Arc<Server>) {
    let slots = Arc::new(Mutex::new(Slots::default()));
    loop {
        let (sock, addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Out of descriptors, say: the next accept may work.
                warn!("peer accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(slot) = Slot::take(&slots, addr.ip()) else {
            srv.refused.fetch_add(1, Ordering::Relaxed);
            warn!(%addr, "peer connection refused: too many open from this host");
            continue;
        };
        let srv = srv.clone();
        tokio::spawn(async move {
            if let Err(e) = srv.connection(sock, addr, slot).await {
                warn!(%addr, "peer connection dropped: {e}");
            }
        });
    }
}

impl Server {
    async fn connection(self: &Arc<Self>, sock: TcpStream, addr: SocketAddr, mut slot: Slot) -> Result<(), ConnError> {
        let _ = sock.set_nodelay(true);
        let (mut r, mut w) = sock.into_split();
        let limit = Duration::from_millis(config::PEER_HANDSHAKE_TIMEOUT_MS);
        let peer_node = match tokio::time::timeout(limit, self.handshake(&mut r, &mut w)).await {
            Ok(Ok(node)) => node,
            Ok(Err(e)) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                linger_close(r, w).await;
                return Err(ConnError::Refused(format!("handshake failed: {e}")));
            }
            Err(_) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Err(ConnError::Stalled(limit));
            }
        };
        debug!(%addr, node = %peer_node, "peer authenticated");
        let io = self.io_timeout;
        if !slot.authenticated(&peer_node) {
            self.refused.fetch_add(1, Ordering::Relaxed);
            let reason =
                format!("node {peer_node:?} holds {} connections already", config::PEER_CONNECTIONS_PER_NODE_MAX);
            let _ = send_async(&mut w, &PeerMsg::Refused { reason: reason.clone() }, io).await;
            return Err(ConnError::Refused(reason));
        }
        loop {
            let msg = match recv_async(&mut r, PEER_FRAME_BYTES_MAX, io).await {
                Ok(m) => m,
                Err(ConnError::Frame(ckpt_wire::FrameError::Closed)) => return Ok(()),
                // An authenticated peer that goes quiet: it is done with this connection.
                Err(ConnError::Stalled(_)) => return Ok(()),
                Err(e) => return Err(e),
            };
            match msg {
                PeerMsg::Offer { node, step, index, files } => {
                    if node != peer_node {
                        let m = format!("node {peer_node:?} offered node {node:?}'s files; a node offers only its own");
                        send_async(&mut w, &PeerMsg::Error { message: m.clone() }, io).await?;
                        return Err(ConnError::Protocol(m));
                    }
                    // A replica's receive and check (a copy and a checksum of
                    // every byte) is background work on this node: the
                    // connection moves to the offers' runtime for it, so this
                    // node's trainer and saves come first. Every other message
                    // (doorbells, a commit's parts, fetches) stays here.
                    let srv = self.clone();
                    let sock = unsplit(r, w)?;
                    let (sock, out) = self
                        .offers
                        .spawn(async move {
                            let (mut r, mut w) = TcpStream::from_std(sock)?.into_split();
                            let out = srv.offer(&mut r, &mut w, &node, step, &index, files).await;
                            Ok::<_, ConnError>((unsplit(r, w)?, out))
                        })
                        .await
                        .map_err(|e| ConnError::Protocol(format!("receiving a replica: {e}")))??;
                    (r, w) = TcpStream::from_std(sock)?.into_split();
                    out?;
                }
                PeerMsg::Get { node, step, name } => {
                    if let Some(held) = self.held.file(&node, step, &name) {
                        match held {
                            ReplicaFile::Mem(bytes) => {
                                let len_bytes = bytes.as_slice().len() as u64;
                                send_async(&mut w, &PeerMsg::File { name, len_bytes }, io).await?;
                                send_raw_async(&mut w, bytes.as_slice(), io).await?;
                            }
                            ReplicaFile::Disk { path, .. } => send_file(&mut w, name, path, io).await?,
                        }
                    } else if let Some(path) = self.own_file(&node, step, &name).await {
                        send_file(&mut w, name, path, io).await?;
                    } else {
                        let message = format!(
                            "node {node:?} step {step} file {name}: not held by {:?} (in memory it holds steps {:?} of that node)",
                            self.node,
                            self.held.steps(&node)
                        );
                        send_async(&mut w, &PeerMsg::Error { message }, io).await?;
                    }
                }
                PeerMsg::List { node } => {
                    let steps = self.held.steps(&node);
                    send_async(&mut w, &PeerMsg::Steps { node, steps }, io).await?;
                }
                PeerMsg::Marked { step, world_size, rank, folder_ino, folder_born_ns, marker, slices } => {
                    let folder = FolderId { ino: folder_ino, born_ns: folder_born_ns };
                    let sent = SentMarker { rank, folder, marker, slices };
                    if !self.inbox.put(Rang::Marked { from: peer_node.clone(), step, world_size, sent }) {
                        debug!(step, rank, node = %peer_node, "peers: a Marked dropped (the doorbells' queue is full)");
                    }
                    send_async(&mut w, &PeerMsg::Rung, io).await?;
                }
                PeerMsg::Decided { step, port } => {
                    self.bells.learn_coordinator(addr.ip(), port);
                    if !self.inbox.put(Rang::Decided { step }) {
                        debug!(step, node = %peer_node, "peers: a Decided dropped (the doorbells' queue is full)");
                    }
                    send_async(&mut w, &PeerMsg::Rung, io).await?;
                }
                m @ (PeerMsg::Part { .. }
                | PeerMsg::Committed { .. }
                | PeerMsg::Aborted { .. }
                | PeerMsg::Newest
                | PeerMsg::Coordinating { .. }
                | PeerMsg::Uploaded { .. }
                | PeerMsg::GetCommitted { .. })
                    if self.shared_over.is_none() =>
                {
                    let message = format!(
                        "{} is for nodes with no shared file system (--shared-over-peers); node {:?} has a shared directory",
                        kind(&m),
                        self.node
                    );
                    send_async(&mut w, &PeerMsg::Error { message }, io).await?;
                }
                PeerMsg::Part { step, world_size, rank, marker, slices, blobs } => {
                    let part = SentPart { rank, marker, slices, blobs };
                    if !self.inbox.put(Rang::Part { from: peer_node.clone(), step, world_size, part }) {
                        warn!(step, rank, node = %peer_node, "peers: a Part dropped (the doorbells' queue is full); the coordinator aborts the step if it was its");
                    }
                    send_async(&mut w, &PeerMsg::Rung, io).await?;
                }
                PeerMsg::Committed { step, port, files } => {
                    self.bells.learn_coordinator(addr.ip(), port);
                    if !self.inbox.put(Rang::Committed { step, files }) {
                        warn!(step, node = %peer_node, "peers: a Committed dropped (the doorbells' queue is full); this node's ranks of the step fail when their wait runs out");
                    }
                    send_async(&mut w, &PeerMsg::Rung, io).await?;
                }
                PeerMsg::Aborted { step, port, reason } => {
                    self.bells.learn_coordinator(addr.ip(), port);
                    if !self.inbox.put(Rang::Aborted { step, reason }) {
                        debug!(step, node = %peer_node, "peers: an Aborted dropped (the doorbells' queue is full)");
                    }
                    send_async(&mut w, &PeerMsg::Rung, io).await?;
                }
                PeerMsg::Coordinating { step, port } => {
                    if let Some(to) = self.bells.learn_coordinator(addr.ip(), port) {
                        if !self.inbox.put(Rang::Coordinating { step, to }) {
                            warn!(step, node = %peer_node, "peers: a Coordinating dropped (the doorbells' queue is full)");
                        }
                    }
                    send_async(&mut w, &PeerMsg::Rung, io).await?;
                }
                PeerMsg::Uploaded { step } => {
                    // The mark the node would have left in a shared
                    // directory, under its proven node id.
                    let shared = self.shared_over.clone().expect("matched above");
                    let node = peer_node.clone();
                    let marked =
                        tokio::task::spawn_blocking(move || ckpt_store::nodes::mark_uploaded(&shared, step, &node))
                            .await
                            .map_err(|e| ConnError::Protocol(format!("writing an upload mark: {e}")))?;
                    match marked {
                        Ok(()) => send_async(&mut w, &PeerMsg::Rung, io).await?,
                        Err(e) => {
                            let message = format!("step {step}: upload mark of node {peer_node:?} not written: {e}");
                            send_async(&mut w, &PeerMsg::Error { message }, io).await?
                        }
                    }
                }
                PeerMsg::Newest => {
                    let shared = self.shared_over.clone().expect("matched above");
                    let steps = tokio::task::spawn_blocking(move || ckpt_store::catalog::readable_steps(&shared))
                        .await
                        .map_err(|e| ConnError::Protocol(format!("listing the committed steps: {e}")))?;
                    let answer = match steps {
                        Ok(steps) => PeerMsg::Steps { node: self.node.clone(), steps },
                        Err(e) => PeerMsg::Error { message: format!("listing the committed steps: {e}") },
                    };
                    send_async(&mut w, &answer, io).await?;
                }
                PeerMsg::GetCommitted { step } => {
                    let shared = self.shared_over.clone().expect("matched above");
                    let files = tokio::task::spawn_blocking(move || committed_step(&shared, step))
                        .await
                        .map_err(|e| ConnError::Protocol(format!("reading step {step}: {e}")))?;
                    let answer = match files {
                        Ok(files) => PeerMsg::Committed { step, port: 0, files },
                        Err(message) => PeerMsg::Error { message },
                    };
                    send_async(&mut w, &answer, io).await?;
                }
                other => return Err(ConnError::Protocol(format!("unexpected {}", kind(&other)))),
            }
        }
    }

    /// Where this node's own file `name` of step `step` is on its disks.
    async fn own_file(&self, node: &str, step: u64, name: &str) -> Option<std::path::PathBuf> {
        // A plain file name of the step's folder, never a path out of it.
        if node != self.node || name.is_empty() || name.starts_with('.') || name.contains('/') {
            return None;
        }
        let folder = ckpt_store::format::node_step_dir_name(step).ok()?;
        let paths: Vec<_> = self.dirs.iter().map(|d| d.join(&folder).join(name)).collect();
        tokio::task::spawn_blocking(move || paths.into_iter().find(|p| p.is_file())).await.ok().flatten()
    }

    /// Both sides prove the secret; the peer's node id once they did.
    async fn handshake(&self, r: &mut OwnedReadHalf, w: &mut OwnedWriteHalf) -> Result<String, ConnError> {
        let limit = Duration::from_millis(config::PEER_HANDSHAKE_TIMEOUT_MS);
        let PeerMsg::Hello { magic, version, node, nonce } = recv_async(r, PEER_HELLO_BYTES_MAX, limit).await? else {
            return Err(ConnError::Protocol("the first message is no Hello".into()));
        };
        if magic != peer::PEER_MAGIC {
            return Err(ConnError::Protocol("no peer protocol magic".into()));
        }
        if version != peer::PEER_PROTOCOL_VERSION {
            let reason = format!("peer protocol {version}; this sidecar speaks {}", peer::PEER_PROTOCOL_VERSION);
            send_async(w, &PeerMsg::Refused { reason: reason.clone() }, limit).await?;
            return Err(ConnError::Protocol(reason));
        }
        ckpt_store::format::validate_node_id(&node).map_err(|e| ConnError::Protocol(e.to_string()))?;
        let nonces = peer::Nonces { connector: nonce, listener: fresh_nonce()? };
        let nodes = Nodes { connector: &node, listener: &self.node };
        let proof = peer::proof(&self.secret, Role::Listener, &nonces, &nodes);
        let challenge = PeerMsg::Challenge {
            version: peer::PEER_PROTOCOL_VERSION,
            node: self.node.clone(),
            nonce: nonces.listener,
            proof,
            domain: self.domain.clone(),
        };
        send_async(w, &challenge, limit).await?;
        let PeerMsg::Proof { proof } = recv_async(r, PEER_HELLO_BYTES_MAX, limit).await? else {
            return Err(ConnError::Protocol("no Proof after the Challenge".into()));
        };
        if !peer::proof_matches(&proof, &self.secret, Role::Connector, &nonces, &nodes) {
            let reason = "the proof does not match this cluster's secret".to_string();
            send_async(w, &PeerMsg::Refused { reason: reason.clone() }, limit).await?;
            return Err(ConnError::Protocol(format!("node {node:?}: {reason}")));
        }
        send_async(w, &PeerMsg::Welcome, limit).await?;
        Ok(node)
    }

    /// One offered replica: room reserved, every file read and checked
    /// against the offered index, then held; the answer says which.
    async fn offer(
        &self,
        r: &mut OwnedReadHalf,
        w: &mut OwnedWriteHalf,
        node: &str,
        step: u64,
        index_bytes: &[u8],
        n_files: u32,
    ) -> Result<(), ConnError> {
        let io = self.io_timeout;
        let refuse = |message: String| PeerMsg::Error { message };
        let index = match Index::from_json_bytes(index_bytes) {
            Ok(i) if i.ckpt.step == step => Arc::new(i),
            Ok(i) => {
                return send_async(
                    w,
                    &refuse(format!("the index offered for step {step} is step {}'s", i.ckpt.step)),
                    io,
                )
                .await
            }
            Err(e) => {
                return send_async(w, &refuse(format!("step {step}: the offered index is damaged: {e}")), io).await
            }
        };
        let expected: HashMap<&str, u64> = index
            .ckpt
            .files
            .iter()
            .filter(|f| index.holder(&f.name).is_some_and(|(id, _)| id == node))
            .map(|f| (f.name.as_str(), f.len_bytes))
            .collect();
        if expected.len() != n_files as usize {
            let m =
                format!("step {step}: {n_files} files offered; the index names {} of node {node:?}", expected.len());
            return send_async(w, &refuse(m), io).await;
        }
        let total: u64 = expected.values().sum();
        let room = match self.held.reserve(node, step, total) {
            Ok(room) => room,
            Err(m) => return send_async(w, &refuse(m), io).await,
        };
        send_async(w, &PeerMsg::Ready, io).await?;
        if let Some(folder) = &room.spill_to {
            tokio::task::block_in_place(|| std::fs::create_dir_all(folder))?;
        }
        // The spill's receive buffer: one piece, reused for every file.
        let mut piece_buf = Vec::new();
        let mut files = HashMap::new();
        let (mut recv_s, mut check_s, mut fresh_bytes) = (0f64, 0f64, 0u64);
        for _ in 0..n_files {
            let PeerMsg::File { name, len_bytes } = recv_async(r, PEER_FRAME_BYTES_MAX, io).await? else {
                return Err(ConnError::Protocol(format!("step {step}: a File expected")));
            };
            if expected.get(name.as_str()) != Some(&len_bytes) || files.contains_key(&name) {
                let m =
                    format!("step {step}: file {name} of {len_bytes} bytes is not one the index names (or sent twice)");
                send_async(w, &refuse(m.clone()), io).await?;
                return Err(ConnError::Protocol(m));
            }
            let t0 = std::time::Instant::now();
            // Each piece checked as it arrives (its bytes still in cache).
            let mut check = ckpt_store::restore::FileBytesCheck::new(&index, &name);
            let mut check_t = Duration::ZERO;
            let mut feed = |piece: &[u8]| {
                let t = std::time::Instant::now();
                check.feed(piece);
                check_t += t.elapsed();
            };
            let stored = match &room.spill_to {
                None => {
                    let mut buf = self.held.buffer(len_bytes as usize)?;
                    fresh_bytes += if buf.fresh { len_bytes } else { 0 };
                    recv_raw_async(r, buf.as_mut_slice(), io, &mut feed).await?;
                    ReplicaFile::Mem(Arc::new(buf))
                }
                Some(folder) => {
                    if name.contains('/') || name.starts_with('.') {
                        return Err(ConnError::Protocol(format!("step {step}: file name {name:?} is not a shard's")));
                    }
                    let path = folder.join(&name);
                    recv_to_file(r, &path, len_bytes, &mut piece_buf, io, &mut feed).await?;
                    ReplicaFile::Disk { path, len_bytes }
                }
            };
            let problems = check.finish();
            check_s += check_t.as_secs_f64();
            recv_s += (t0.elapsed() - check_t).as_secs_f64();
            if !problems.is_empty() {
                let list: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
                let m = format!("step {step}: file {name} does not match the index: {}", list.join("; "));
                send_async(w, &refuse(m.clone()), io).await?;
                return Err(ConnError::Protocol(m));
            }
            files.insert(name, stored);
        }
        if !matches!(recv_async(r, PEER_FRAME_BYTES_MAX, io).await?, PeerMsg::Done) {
            return Err(ConnError::Protocol(format!("step {step}: Done expected after the files")));
        }
        let spilled = room.spill_to.clone();
        let on_disk = spilled.as_ref().map(|f| f.display().to_string());
        self.held.insert(room, node, step, Replica { files, bytes: total, spilled });
        info!(node, step, bytes = total, recv_s, check_s, fresh_bytes, spilled = ?on_disk, "peers: holding a replica (every byte checked)");
        send_async(w, &PeerMsg::Held { node: node.to_string(), step }, io).await
    }
}

/// Receives `len_bytes` raw bytes into a new file `path` (a spilled
/// replica's), a piece at a time through `buf`, each handed to `each`
/// before it is written. Not synced: a spilled replica is checked again
/// when it is read.
async fn recv_to_file(
    r: &mut OwnedReadHalf,
    path: &std::path::Path,
    len_bytes: u64,
    buf: &mut Vec<u8>,
    io: Duration,
    mut each: impl FnMut(&[u8]),
) -> Result<(), ConnError> {
    use std::io::Write;
    use tokio::io::AsyncReadExt;
    buf.resize(config::PEER_PIECE_BYTES.min(len_bytes as usize).max(buf.len()), 0);
    let mut file = tokio::task::block_in_place(|| std::fs::File::create(path))?;
    let mut left = len_bytes;
    while left > 0 {
        let n = (left as usize).min(buf.len());
        tokio::time::timeout(io, r.read_exact(&mut buf[..n])).await.map_err(|_| ConnError::Stalled(io))??;
        each(&buf[..n]);
        tokio::task::block_in_place(|| file.write_all(&buf[..n]))?;
        left -= n as u64;
    }
    Ok(())
}

/// Sends file `path` as `name`: its File frame, then its bytes, read from
/// disk in pieces by [`SEND_FILE_READERS`] blocking readers at once
/// (O_DIRECT where the file system takes it: one buffered reader does not
/// reach a disk's limit) while the pieces before go out in order; a few
/// pieces of memory whatever the file's size. A file that ends early, or
/// fails to read after its frame went out, ends the connection: the
/// fetching side's read fails and it tries its next source.
/// The socket of a connection's two halves, out of its runtime (to move to
/// another).
fn unsplit(r: OwnedReadHalf, w: OwnedWriteHalf) -> Result<std::net::TcpStream, ConnError> {
    let sock = r.reunite(w).map_err(|_| ConnError::Protocol("split halves of two sockets".into()))?;
    Ok(sock.into_std()?)
}

/// Committed `step`'s folder files in `shared`, or why there are none to give.
fn committed_step(shared: &std::path::Path, step: u64) -> Result<ckpt_store::nodes::StepFiles, String> {
    if !ckpt_store::catalog::is_committed(shared, step) {
        return Err(format!("step {step} is not committed in {}", shared.display()));
    }
    ckpt_store::nodes::committed_files(shared, step).map_err(|e| format!("step {step}: {e}"))
}

async fn send_file(
    w: &mut OwnedWriteHalf,
    name: String,
    path: std::path::PathBuf,
    io: Duration,
) -> Result<(), ConnError> {
    use tokio::io::AsyncWriteExt;
    let piece = config::PEER_PIECE_BYTES;
    let opened = {
        let p = path.clone();
        tokio::task::spawn_blocking(move || -> std::io::Result<_> {
            let (f, direct) = ckpt_store::io::open_for_read_with(&p, ckpt_store::io::Want::Auto)?;
            let len = f.metadata()?.len();
            Ok((Arc::new(f), direct, len))
        })
        .await
        .map_err(|e| ConnError::Protocol(format!("{}: {e}", path.display())))?
    };
    let (file, direct, len_bytes) = opened?;
    send_async(w, &PeerMsg::File { name, len_bytes }, io).await?;
    let pieces = len_bytes.div_ceil(piece as u64);
    // Pieces in flight: each reader's, and a few read ahead of the socket.
    let bufs = SEND_FILE_READERS + 2;
    let (empty, empty_rx) = crossbeam_channel::bounded::<ckpt_store::mem::AlignedBuf>(bufs);
    for _ in 0..bufs {
        let b = ckpt_store::mem::AlignedBuf::new(piece)?;
        let _ = empty.send(b);
    }
    let (full_tx, mut full) = tokio::sync::mpsc::channel::<(u64, std::io::Result<ckpt_store::mem::AlignedBuf>)>(bufs);
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    for _ in 0..SEND_FILE_READERS.min(pieces as usize) {
        let (file, next, empty_rx, full_tx) = (file.clone(), next.clone(), empty_rx.clone(), full_tx.clone());
        tokio::task::spawn_blocking(move || loop {
            let Ok(mut buf) = empty_rx.recv() else { return };
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= pieces {
                return;
            }
            let r = read_piece(&file, direct, i * piece as u64, len_bytes, &mut buf).map(|()| buf);
            let failed = r.is_err();
            if full_tx.blocking_send((i, r)).is_err() || failed {
                return;
            }
        });
    }
    drop(full_tx);
    // Pieces that came ahead of their turn, by index.
    let mut early = std::collections::BTreeMap::new();
    for want in 0..pieces {
        let buf = loop {
            if let Some(b) = early.remove(&want) {
                break b;
            }
            let Some((i, r)) = full.recv().await else {
                return Err(ConnError::Protocol(format!("{}: the reading of it stopped", path.display())));
            };
            let b = r.map_err(|e| ConnError::Protocol(format!("{}: {e}", path.display())))?;
            early.insert(i, b);
        };
        let n = (len_bytes - want * piece as u64).min(piece as u64) as usize;
        tokio::time::timeout(io, w.write_all(&buf.as_slice()[..n])).await.map_err(|_| ConnError::Stalled(io))??;
        let _ = empty.send(buf);
    }
    Ok(())
}

/// Readers of one file [`send_file`] sends, at once.
const SEND_FILE_READERS: usize = 4;

/// Piece `at..` of a `len_bytes` file into `buf` (the whole piece, or the
/// file's rest): with O_DIRECT the read asks for whole blocks, and the
/// kernel stops at the end of the file.
fn read_piece(
    file: &std::fs::File,
    direct: bool,
    at: u64,
    len_bytes: u64,
    buf: &mut ckpt_store::mem::AlignedBuf,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let want = (len_bytes - at).min(buf.len() as u64) as usize;
    let ask = if direct {
        ckpt_store::config::align_up(want as u64, ckpt_store::config::DIRECT_ALIGN_BYTES) as usize
    } else {
        want
    };
    let cap = buf.len();
    let dst = &mut buf.as_mut_slice()[..ask.min(cap)];
    let mut got = 0;
    while got < want {
        match file.read_at(&mut dst[got..], at + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if got < want {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("{got} of {want} bytes at {at}: the file ended early"),
        ));
    }
    Ok(())
}

/// Closes a refused connection so that its peer reads the Refused sent
/// before (a close with unread bytes in the socket resets it, and the
/// reset may discard what the peer had not read yet): our side shut, the
/// rest of what it sent read and dropped, at most 64 KiB within 1 s.
async fn linger_close(mut r: OwnedReadHalf, mut w: OwnedWriteHalf) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = w.shutdown().await;
    let mut buf = vec![0u8; 64 << 10];
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let mut left = buf.len();
        while left > 0 {
            match r.read(&mut buf[..left]).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left -= n,
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_read_in_pieces_direct_or_buffered_to_its_last_unaligned_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let piece = 64 << 10;
        let bytes: Vec<u8> = (0..(3 * piece + 1234)).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        for want in [ckpt_store::io::Want::Auto, ckpt_store::io::Want::Off] {
            let (f, direct) = ckpt_store::io::open_for_read_with(&path, want).unwrap();
            let len = bytes.len() as u64;
            let mut buf = ckpt_store::mem::AlignedBuf::new(piece).unwrap();
            let mut got = Vec::new();
            for i in 0..len.div_ceil(piece as u64) {
                let at = i * piece as u64;
                read_piece(&f, direct, at, len, &mut buf).unwrap();
                let n = (len - at).min(piece as u64) as usize;
                got.extend_from_slice(&buf.as_slice()[..n]);
            }
            assert!(got == bytes, "direct={direct}");
            // A file shorter than its frame said: an error naming the shortfall.
            let e = read_piece(&f, direct, 3 * piece as u64, len + 10, &mut buf).unwrap_err();
            assert!(e.to_string().contains("ended early"), "{e}");
        }
    }
}
