//! A load's files from the peers ([`PeerFiles`], a
//! [`ckpt_store::fetch::FetchFiles`]): each file taken from the replicas
//! this sidecar holds for other nodes, else asked of each peer in turn, checked whole against the step's index before the load sees a
//! byte of it, so a peer whose replica is damaged or missing is passed
//! over (and named) for the next peer, then the next source (the drain
//! target) when one is given.

use std::sync::{Arc, Mutex};

use ckpt_store::fetch::FetchFiles;
use ckpt_store::format::Index;
use ckpt_store::restore::SourceError;

use super::conn::Conn;
use super::held::{Held, ReplicaFile};

/// Files fetched at once by a load (a connection each).
const PEER_FETCH_PARALLEL: usize = 4;

pub struct PeerFiles {
    secret: Arc<Vec<u8>>,
    me: String,
    peers: Vec<String>,
    step: u64,
    index: Index,
    label: String,
    then: Option<Box<dyn FetchFiles + Send>>,
    skipped: Mutex<Vec<String>>,
    /// The replicas this sidecar holds (tried first: its own memory).
    held: Arc<Held>,
    /// A peer silent this long is passed over.
    io_timeout: std::time::Duration,
}

impl PeerFiles {
    pub fn new(
        secret: Arc<Vec<u8>>,
        me: String,
        peers: Vec<String>,
        step: u64,
        index: Index,
        held: Arc<Held>,
        io_timeout: std::time::Duration,
    ) -> PeerFiles {
        let label = format!("peers {}", peers.join(","));
        let skipped = Mutex::new(Vec::new());
        PeerFiles { secret, me, peers, step, index, label, then: None, skipped, held, io_timeout }
    }

    /// The source tried when no peer gives a file (the drain target).
    pub fn then(mut self, next: Option<Box<dyn FetchFiles + Send>>) -> PeerFiles {
        if let Some(n) = &next {
            self.label = format!("{}, then {}", self.label, n.label());
        }
        self.then = next;
        self
    }

    /// What was passed over (a peer without the file, a damaged replica), in order.
    pub fn skipped(&self) -> Vec<String> {
        self.skipped.lock().expect("skipped lock").clone()
    }

    fn skip(&self, why: String) {
        tracing::warn!(step = self.step, "peers: {why}");
        self.skipped.lock().expect("skipped lock").push(why);
    }

    /// File `name` of `node`'s step from peer `addr`, every byte checked.
    fn fetch_from_peer(&self, addr: &str, node: &str, name: &str, dst: &mut [u8]) -> Result<(), String> {
        let mut c = Conn::open(addr, &self.secret, &self.me, self.io_timeout).map_err(|e| e.to_string())?;
        // Each piece checked as it arrives (its bytes still in cache).
        let mut check = ckpt_store::restore::FileBytesCheck::new(&self.index, name);
        c.get(node, self.step, name, dst, |piece| check.feed(piece)).map_err(|e| e.to_string())?;
        c.close();
        let problems = check.finish();
        if problems.is_empty() {
            return Ok(());
        }
        let list: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
        Err(format!("its replica is damaged: {}", list.join("; ")))
    }
}

impl FetchFiles for PeerFiles {
    fn label(&self) -> &str {
        &self.label
    }

    fn parallel(&self) -> usize {
        PEER_FETCH_PARALLEL
    }

    fn fetch(&self, name: &str, dst: &mut [u8], feed: &mut dyn FnMut(&[u8])) -> Result<(), SourceError> {
        let node = self.index.holder(name).map(|(id, _)| id.to_string());
        let mut tried = Vec::new();
        if let Some(node) = &node {
            // A replica this sidecar holds: checked when it came, checked again here.
            if let Some(held) = self.held.file(node, self.step, name).filter(|b| b.len_bytes() == dst.len() as u64) {
                let read = match held {
                    ReplicaFile::Mem(bytes) => {
                        dst.copy_from_slice(bytes.as_slice());
                        Ok(())
                    }
                    ReplicaFile::Disk { path, .. } => {
                        std::fs::File::open(&path).and_then(|mut f| std::io::Read::read_exact(&mut f, dst))
                    }
                };
                if read.is_ok() && ckpt_store::restore::check_file_bytes(&self.index, name, dst).is_empty() {
                    feed(dst);
                    return Ok(());
                }
                self.skip(format!("step {}: {name} of node {node:?}: the replica held here is damaged", self.step));
            }
            for addr in &self.peers {
                match self.fetch_from_peer(addr, node, name, dst) {
                    Ok(()) => {
                        feed(dst);
                        return Ok(());
                    }
                    Err(why) => {
                        let why = format!("step {}: {name} of node {node:?} from peer {addr}: {why}", self.step);
                        self.skip(why.clone());
                        tried.push(why);
                    }
                }
            }
        }
        if let Some(next) = &self.then {
            return next.fetch(name, dst, feed);
        }
        Err(SourceError::Failed(
            format!(
                "{name}: no peer gives it ({})",
                if tried.is_empty() { "no node holds it".into() } else { tried.join("; ") }
            )
            .into(),
        ))
    }
}
