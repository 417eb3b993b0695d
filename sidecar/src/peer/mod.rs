//! Peers (`--peer-listen`, `--peers`): this node's files of each durable
//! step replicated into other nodes' sidecars' memory, theirs held here,
//! and a replaced node's files read back from them by a load
//! (docs/guide.md, "Peers"; the protocol and its threat model:
//! docs/protocol.md, "Peer protocol").
//!
//! A tier beside the drain: `state` holds it, `commit` tells it of each
//! durable step, `load` fetches from it. Files: `secret` (the cluster
//! secret, checked at start), `frames` (the framing on both kinds of
//! socket), `conn` (the connecting side: blocking, a thread's own),
//! `server` (the listening side: a tokio runtime of its own, a task per
//! connection), `held` (the replicas held for other nodes, within the
//! budget), `pool` (pre-faulted buffers for whole files, reused step after
//! step), `replicate` (this node's steps sent, outcomes, waiters),
//! `fetch` (a load's [`ckpt_store::fetch::FetchFiles`] over the peers).
//!
//! Invariants:
//! - nothing is served, and no byte of a checkpoint sent, on a connection
//!   before both sides proved the cluster secret;
//! - a replica counts (held here, or reported held to its node) only once
//!   every byte of it matched the step's index;
//! - training never waits for a peer: replication runs on its own thread
//!   after the step is durable; a failure is reported, never raised.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use ckpt_store::restore::ThisNode;

mod bells;
mod conn;
mod fetch;
mod frames;
mod held;
mod pool;
mod replicate;
mod secret;
mod server;

pub use bells::{Inbox, PartSent, Rang};
pub use fetch::PeerFiles;

/// What the peer at `addr` answered [`holdings`], or why it did not.
#[derive(Debug, Clone)]
pub struct PeerHoldings {
    pub addr: String,
    pub answer: Result<Holding, String>,
}

/// A peer's node id and, for each node asked about, the steps of it held
/// in its memory.
#[derive(Debug, Clone)]
pub struct Holding {
    pub node: String,
    pub held: Vec<(String, Vec<u64>)>,
}

/// The node id a tool (`ls --peers`) proves itself as: not a node's.
pub const TOOL_NODE_ID: &str = "ckpt-sidecar-tool";

/// Asks each peer at `peers` (the cluster secret in `secret_file`) which
/// steps of each of `nodes` it holds in memory (`ls --peers`).
pub fn holdings(
    peers: &[String],
    secret_file: &std::path::Path,
    nodes: &[String],
) -> Result<Vec<PeerHoldings>, SecretError> {
    let secret = read_secret(secret_file)?;
    let timeout = std::time::Duration::from_millis(crate::config::PEER_IO_TIMEOUT_MS);
    let ask = |addr: &String| -> Result<Holding, String> {
        let mut c = conn::Conn::open(addr, &secret, TOOL_NODE_ID, timeout).map_err(|e| e.to_string())?;
        let mut held = Vec::new();
        for n in nodes {
            held.push((n.clone(), c.list(n).map_err(|e| e.to_string())?));
        }
        let node = c.node.clone();
        c.close();
        Ok(Holding { node, held })
    };
    Ok(peers.iter().map(|addr| PeerHoldings { addr: addr.clone(), answer: ask(addr) }).collect())
}
pub use secret::{read_secret, SecretError};

/// The peer settings of `serve`/`launch`.
#[derive(Debug, Clone)]
pub struct PeerOptions {
    /// Where this sidecar listens for its peers.
    pub listen: SocketAddr,
    /// The other nodes' sidecars' peer addresses.
    pub peers: Vec<String>,
    /// The cluster secret's file (`--peer-secret-file`).
    pub secret_file: PathBuf,
    /// Peers each of this node's steps goes to.
    pub replicas: u32,
    /// Newest steps of each peer held here.
    pub keep: usize,
    /// Bytes of other nodes' replicas held here at most.
    pub budget_bytes: u64,
    /// A peer connection silent this long is dropped (`--peer-timeout`).
    pub io_timeout: std::time::Duration,
    /// No shared file system (`--shared-over-peers`): the shared directory
    /// is this node's own, and the peers carry what the nodes share
    /// (`ckpt_store::nodes::over_peers`).
    pub shared_over_peers: bool,
    /// This node's replication sends at most this many bytes per second
    /// (`--peer-bandwidth`); None: as fast as the link takes them.
    pub bandwidth_bytes_per_s: Option<u64>,
    /// This node's failure domain (`--failure-domain`, e.g. its rack):
    /// its steps go to peers outside it first. Empty: none.
    pub failure_domain: String,
    /// `--peer-spill DIR`: replicas that do not fit `budget_bytes` are
    /// received into files here instead of being refused.
    pub spill: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error("--peer-listen {addr}: cannot listen ({source})")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("--peers needs a node-local layout (--shared DIR --node-local): only a node's own files are replicated")]
    NotNodeLocal,
    #[error("starting the peer runtime: {0}")]
    Runtime(std::io::Error),
    #[error("--peer-spill {}: cannot use it ({source})", dir.display())]
    Spill { dir: PathBuf, source: std::io::Error },
}

/// This node's peer tier: the server, the replicas it holds, and this
/// node's replication.
pub struct Peers {
    opts: PeerOptions,
    secret: Arc<Vec<u8>>,
    me: ThisNode,
    shared_dir: PathBuf,
    held: Arc<held::Held>,
    staged: Arc<replicate::Staged>,
    repl: replicate::Replication,
    /// The bound address (a port 0 made real).
    local_addr: SocketAddr,
    refused: Arc<std::sync::atomic::AtomicU64>,
    bells: Arc<bells::Bells>,
    inbox: Arc<Inbox>,
    _runtime: tokio::runtime::Runtime,
    /// Receives and checks the replicas offered (`server::Server::offers`).
    _offers: tokio::runtime::Runtime,
}

impl Peers {
    /// Reads the secret, binds the listening address and starts the server
    /// and the replication thread: a bad secret or a taken port stops the
    /// start.
    pub fn start(opts: PeerOptions, me: ThisNode, shared_dir: PathBuf) -> Result<Arc<Peers>, PeerError> {
        let secret = Arc::new(read_secret(&opts.secret_file)?);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(crate::config::PEER_RUNTIME_THREADS)
            .thread_name("ckpt-peer")
            .enable_io()
            .enable_time()
            .build()
            .map_err(PeerError::Runtime)?;
        let offers = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(crate::config::PEER_RECV_THREADS)
            .thread_name("ckpt-peer-recv")
            .on_thread_start(crate::priority::nice_19)
            .enable_io()
            .enable_time()
            .build()
            .map_err(PeerError::Runtime)?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(opts.listen))
            .map_err(|source| PeerError::Bind { addr: opts.listen, source })?;
        let local_addr = listener.local_addr().map_err(|source| PeerError::Bind { addr: opts.listen, source })?;
        let held = Arc::new(
            held::Held::new(opts.budget_bytes, opts.keep, opts.spill.clone())
                .map_err(|source| PeerError::Spill { dir: opts.spill.clone().unwrap_or_default(), source })?,
        );
        let refused = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let bells = bells::Bells::new(secret.clone(), me.id.clone(), &opts.peers, local_addr.port(), opts.io_timeout);
        let inbox = Inbox::new();
        let srv = server::Server {
            inbox: inbox.clone(),
            bells: bells.clone(),
            secret: secret.clone(),
            node: me.id.clone(),
            domain: opts.failure_domain.clone(),
            dirs: me.dirs.clone(),
            shared_over: opts.shared_over_peers.then(|| shared_dir.clone()),
            held: held.clone(),
            refused: refused.clone(),
            io_timeout: opts.io_timeout,
            offers: offers.handle().clone(),
        };
        runtime.spawn(server::serve(listener, Arc::new(srv)));
        let staged = Arc::new(replicate::Staged::default());
        let repl = replicate::Replication::spawn(replicate::Sender {
            staged: staged.clone(),
            secret: secret.clone(),
            me: me.clone(),
            shared_dir: shared_dir.clone(),
            peers: opts.peers.clone(),
            replicas: opts.replicas,
            keep: opts.keep,
            io_timeout: opts.io_timeout,
            ids: Default::default(),
            kept: Default::default(),
            pace: opts.bandwidth_bytes_per_s.map(ckpt_tier::TokenBucket::new),
            domain: opts.failure_domain.clone(),
        })
        .map_err(PeerError::Runtime)?;
        tracing::info!(listen = %local_addr, peers = ?opts.peers, replicas = opts.replicas, keep = opts.keep, budget_bytes = opts.budget_bytes, bandwidth_bytes_per_s = ?opts.bandwidth_bytes_per_s, failure_domain = %opts.failure_domain, spill = ?opts.spill, "peers: listening");
        Ok(Arc::new(Peers {
            opts,
            secret,
            me,
            shared_dir,
            held,
            staged,
            repl,
            local_addr,
            refused,
            bells,
            inbox,
            _runtime: runtime,
            _offers: offers,
        }))
    }

    /// No shared file system, at start: the steps the peers' own shared
    /// folders hold (every peer is asked which: a light answer) that are
    /// newer than this node's `latest` (a replaced node on an empty disk,
    /// or one that missed steps while down), each installed into this
    /// node's from a peer that holds it, the newest first: a load here
    /// then finds the step every other node's `latest` names, and the
    /// older ones their retention keeps. A peer that cannot be asked, or
    /// gives a step that does not install, is named and passed over;
    /// returns the steps installed.
    pub fn take_newer(&self, store: &ckpt_store::commit::Store) -> Vec<u64> {
        // Asked several at once: a peer that does not answer costs its
        // timeout once, not once per peer before it.
        let next = std::sync::atomic::AtomicUsize::new(0);
        let answers: Vec<(&str, _)> = std::thread::scope(|s| {
            let askers: Vec<_> = (0..self.opts.peers.len().min(crate::config::PEER_START_ASKS_AT_ONCE))
                .map(|_| {
                    s.spawn(|| {
                        let mut out = Vec::new();
                        while let Some(addr) =
                            self.opts.peers.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                        {
                            out.push((addr.as_str(), self.ask(addr, |c| c.committed_steps())));
                        }
                        out
                    })
                })
                .collect();
            askers.into_iter().flat_map(|h| h.join().expect("a start ask panicked")).collect()
        });
        let mut held: std::collections::BTreeMap<u64, Vec<&str>> = Default::default();
        for (addr, r) in answers {
            match r {
                Ok(steps) => steps.into_iter().for_each(|s| held.entry(s).or_default().push(addr)),
                Err(e) => tracing::info!(peer = %addr, "peers: not asked for its committed steps ({e})"),
            }
        }
        let here = ckpt_store::catalog::latest_step(&self.shared_dir).ok().flatten();
        let mut installed = Vec::new();
        for (&step, from) in held.iter().rev().filter(|(&s, _)| here.is_none_or(|h| s > h)) {
            // From the first peer that holds it and gives it whole.
            if let Some(peer) = from.iter().find(|p| self.install_from(store, step, p)) {
                tracing::info!(step, peer = %peer, "peers: a committed step newer than this node's latest taken from a peer into this node's shared directory");
                installed.push(step);
            }
        }
        installed
    }

    /// No shared file system: committed `step` asked of the coordinator
    /// known (this node's ranks' wait for its outcome ran out: its
    /// Committed may have been lost) and installed here; whether it was.
    pub fn take_committed(&self, store: &ckpt_store::commit::Store, step: u64) -> bool {
        let Some(from) = self.bells.coordinator() else { return false };
        self.install_from(store, step, &from)
    }

    /// Committed `step`'s folder files asked of peer `from` and installed
    /// in this node's shared directory; whether they were (why not: logged).
    fn install_from(&self, store: &ckpt_store::commit::Store, step: u64, from: &str) -> bool {
        let files = match self.ask(from, |c| c.committed(step)) {
            Ok(Some(files)) => files,
            Ok(None) => {
                tracing::info!(step, peer = %from, "peers: the step is not committed there");
                return false;
            }
            Err(e) => {
                tracing::warn!(step, peer = %from, "peers: committed step not fetched ({e})");
                return false;
            }
        };
        match store.install_committed(step, &files) {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(step, peer = %from, "peers: a committed step a peer holds could not be installed here ({e})");
                false
            }
        }
    }

    /// One request to peer `addr` on a connection of its own, answered
    /// within `PEER_IO_TIMEOUT_START_MS` (or the peer timeout, if shorter).
    fn ask<T>(
        &self,
        addr: &str,
        f: impl FnOnce(&mut conn::Conn) -> Result<T, frames::ConnError>,
    ) -> Result<T, frames::ConnError> {
        let timeout =
            self.opts.io_timeout.min(std::time::Duration::from_millis(crate::config::PEER_IO_TIMEOUT_START_MS));
        let mut c = conn::Conn::open(addr, &self.secret, &self.me.id, timeout)?;
        let r = f(&mut c);
        c.close();
        r
    }

    /// The address peers reach this sidecar at (the port bound).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Step `step` is durable (committed in the shared directory): this
    /// node's files of it go to its peers, on the replication thread.
    pub fn committed(&self, step: u64) {
        self.repl.committed(step);
    }

    /// A rank's marker of `step` is written: sent to the step's coordinator
    /// when this sidecar knows it (never waited for). No shared file
    /// system: with its slice declarations and `blobs` (its part's blobs
    /// but the declarations), and returned, to be sent again to the step's
    /// coordinator should another say it is ([`Peers::part_to`]).
    pub fn marked(
        &self,
        step: u64,
        world_size: u32,
        sent: &ckpt_store::nodes::SentMarker,
        blobs: &[&ckpt_wire::Blob],
    ) -> Option<PartSent> {
        if !self.opts.shared_over_peers {
            self.bells.marked(step, world_size, sent);
            return None;
        }
        let part = ckpt_store::nodes::SentPart {
            rank: sent.rank,
            marker: sent.marker.clone(),
            slices: sent.slices.clone(),
            blobs: blobs.iter().map(|b| (b.name.clone(), b.bytes.clone())).collect(),
        };
        Some(self.bells.part(step, world_size, part))
    }

    /// No shared file system: a part of this node's sent to peer `to` (the
    /// step's coordinator), unless it went there already.
    pub fn part_to(&self, sent: &mut PartSent, to: &str) {
        self.bells.part_to(sent, to);
    }

    /// No shared file system, with a drain: this node uploaded its files
    /// of `step` (its upload mark is written here); the coordinator is told.
    pub fn uploaded(&self, step: u64) {
        if self.opts.shared_over_peers {
            self.bells.uploaded(step);
        }
    }

    /// This sidecar coordinates `step` (it serves its rank 0): with no
    /// shared file system, every peer is told, so that their parts of it
    /// come here.
    pub fn coordinating(&self, step: u64) {
        if self.opts.shared_over_peers {
            self.bells.coordinating(step);
        }
    }

    /// Whether the shared directory is this node's own (`--shared-over-peers`).
    pub fn over_peers(&self) -> bool {
        self.opts.shared_over_peers
    }

    /// The doorbells received, for the committer.
    pub fn inbox(&self) -> &Inbox {
        &self.inbox
    }

    /// This sidecar, the coordinator, decided `step`: every peer is told
    /// (never waited for). No shared file system: they get the committed
    /// step's folder (read back from the shared directory), or the abort's
    /// reason.
    pub fn decided(&self, step: u64, aborted: Option<&str>) {
        if !self.opts.shared_over_peers {
            return self.bells.decided(step);
        }
        match aborted {
            Some(why) => self.bells.aborted(step, why),
            None => match ckpt_store::nodes::committed_files(&self.shared_dir, step) {
                Ok(files) => self.bells.committed(step, files),
                Err(e) => tracing::warn!(
                    step,
                    "peers: cannot read the committed step's folder to send it ({e}); the other nodes' ranks fail once their wait runs out"
                ),
            },
        }
    }

    /// A part of `step` was written from `image` (its staging lease, at
    /// `layout`'s offsets): its files are copied, so the replication sends
    /// them from memory instead of reading them back from disk.
    pub fn stage_part(&self, step: u64, layout: &ckpt_store::image::Layout, image: &[u8]) {
        self.staged.stage(step, layout, image);
    }

    /// A WaitPeers: answered now, or once the step's replication ended.
    pub fn wait(&self, replies: Arc<dyn crate::drain::Answer>, id: u64, step: u64, committed: bool) {
        self.repl.wait(replies, id, step, committed);
    }

    /// A load's source of `step`'s files this node's disks do not hold:
    /// the replicas held here, then the peers.
    pub fn fetcher(&self, step: u64, index: ckpt_store::format::Index) -> PeerFiles {
        let (secret, me, peers) = (self.secret.clone(), self.me.id.clone(), self.opts.peers.clone());
        PeerFiles::new(secret, me, peers, step, index, self.held.clone(), self.opts.io_timeout)
    }

    /// The shared directory the replicated steps are committed in.
    pub fn shared_dir(&self) -> &std::path::Path {
        &self.shared_dir
    }

    /// What `status` shows.
    pub fn report(&self) -> ckpt_wire::PeerReport {
        let mut r = self.repl.report();
        r.listen = self.local_addr.to_string();
        r.peers = self.opts.peers.clone();
        r.replicas = self.opts.replicas;
        let (holding, holding_bytes) = self.held.summary();
        r.holding = holding;
        r.holding_bytes = holding_bytes;
        r.budget_bytes = self.opts.budget_bytes;
        r.refused_connections = self.refused.load(std::sync::atomic::Ordering::Relaxed);
        r.shared_over_peers = self.opts.shared_over_peers;
        r
    }
}
