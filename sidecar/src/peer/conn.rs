//! The connecting side: one blocking TCP connection to a peer, owned by
//! the thread using it (the replication thread, a load's fetching thread).
//! It proves nothing before the peer proved the secret, and every read and
//! write is bounded in time, so a stalled peer fails a replication or a
//! fetch (which then tries the next source) instead of hanging it.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use ckpt_tier::TokenBucket;
use ckpt_wire::peer::{self, Nodes, PeerMsg, Role, PEER_FRAME_BYTES_MAX, PEER_HELLO_BYTES_MAX};

use super::frames::{fresh_nonce, kind, recv, send, ConnError};
use crate::config;

/// The bytes of `f` into `w`: from its copy in memory when it has one of
/// its length, else from its file.
fn send_body<W: Write>(w: &mut W, f: &LocalFile) -> Result<(), ConnError> {
    if let Some(b) = f.bytes.as_ref().filter(|b| b.as_slice().len() as u64 == f.len_bytes) {
        w.write_all(b.as_slice())?;
        return Ok(());
    }
    let file = std::fs::File::open(&f.path)?;
    // File to socket: std copies with sendfile/splice where it can (when
    // not paced).
    let sent = std::io::copy(&mut file.take(f.len_bytes), w)?;
    if sent != f.len_bytes {
        return Err(ConnError::Protocol(format!("{}: {sent} of {} bytes on disk", f.path.display(), f.len_bytes)));
    }
    Ok(())
}

/// A writer that takes a bucket's tokens for each piece before writing
/// it. A piece is an eighth of a second at the bucket's rate (within 4 KiB
/// and [`config::PEER_PIECE_BYTES`]), so the pauses between pieces stay
/// far below the peer's silence timeout.
struct Paced<'a, W> {
    inner: W,
    bucket: &'a TokenBucket,
    piece: usize,
}

impl<'a, W: Write> Paced<'a, W> {
    fn new(inner: W, bucket: &'a TokenBucket) -> Self {
        let piece = (bucket.rate_bytes_per_s() / 8).clamp(4 << 10, config::PEER_PIECE_BYTES as u64) as usize;
        Paced { inner, bucket, piece }
    }
}

impl<W: Write> Write for Paced<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.piece);
        self.bucket.acquire_blocking(n as u64);
        self.inner.write_all(&buf[..n])?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A file of this node's, sent from memory (a copy of the part's staging
/// image) when given, else from disk.
pub struct LocalFile {
    pub name: String,
    pub path: PathBuf,
    pub len_bytes: u64,
    pub bytes: Option<super::pool::Pooled>,
}

pub struct Conn {
    stream: TcpStream,
    /// The peer's node id, as it proved it.
    pub node: String,
    /// The peer's failure domain, as it said it (empty: none).
    pub domain: String,
}

impl Conn {
    /// Connects to `addr` and runs the handshake as node `me`.
    /// Every read and write after it is bounded by `io_timeout`.
    pub fn open(addr: &str, secret: &[u8], me: &str, io_timeout: Duration) -> Result<Conn, ConnError> {
        let connect = Duration::from_millis(config::PEER_CONNECT_TIMEOUT_MS);
        let mut last = None;
        let mut stream = None;
        for a in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, connect) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let mut stream = stream
            .ok_or_else(|| last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))?;
        stream.set_nodelay(true)?;
        let hs = Some(Duration::from_millis(config::PEER_HANDSHAKE_TIMEOUT_MS));
        stream.set_read_timeout(hs)?;
        stream.set_write_timeout(hs)?;
        let nonce = fresh_nonce()?;
        let hello = PeerMsg::Hello {
            magic: peer::PEER_MAGIC,
            version: peer::PEER_PROTOCOL_VERSION,
            node: me.to_string(),
            nonce,
        };
        send(&mut stream, &hello)?;
        let (node, domain, nonces) = match recv(&mut stream, PEER_HELLO_BYTES_MAX)? {
            PeerMsg::Challenge { version, node, nonce: theirs, proof, domain } => {
                if version != peer::PEER_PROTOCOL_VERSION {
                    return Err(ConnError::Protocol(format!(
                        "peer protocol {version}; this sidecar speaks {}",
                        peer::PEER_PROTOCOL_VERSION
                    )));
                }
                let nonces = peer::Nonces { connector: nonce, listener: theirs };
                let nodes = Nodes { connector: me, listener: &node };
                if !peer::proof_matches(&proof, secret, Role::Listener, &nonces, &nodes) {
                    return Err(ConnError::Protocol(format!(
                        "{addr} (node {node:?}) did not prove this cluster's secret"
                    )));
                }
                (node, domain, nonces)
            }
            PeerMsg::Refused { reason } => return Err(ConnError::Refused(reason)),
            other => return Err(ConnError::Protocol(format!("{} instead of a Challenge", kind(&other)))),
        };
        let proof = peer::proof(secret, Role::Connector, &nonces, &Nodes { connector: me, listener: &node });
        send(&mut stream, &PeerMsg::Proof { proof })?;
        match recv(&mut stream, PEER_HELLO_BYTES_MAX)? {
            PeerMsg::Welcome => {}
            PeerMsg::Refused { reason } => return Err(ConnError::Refused(reason)),
            other => return Err(ConnError::Protocol(format!("{} instead of a Welcome", kind(&other)))),
        }
        let io = Some(io_timeout);
        stream.set_read_timeout(io)?;
        stream.set_write_timeout(io)?;
        Ok(Conn { stream, node, domain })
    }

    /// Offers this node's (`node`) files of `step` (its committed index
    /// `index`): Ok once the peer checked and holds every byte. `pace`:
    /// the files' bytes take its tokens as they are sent (`--peer-bandwidth`).
    pub fn offer(
        &mut self,
        node: &str,
        step: u64,
        index: &[u8],
        files: &[LocalFile],
        pace: Option<&TokenBucket>,
    ) -> Result<(), ConnError> {
        let offer = PeerMsg::Offer { node: node.into(), step, index: index.to_vec(), files: files.len() as u32 };
        send(&mut self.stream, &offer)?;
        self.expect(|m| matches!(m, PeerMsg::Ready))?;
        for f in files {
            send(&mut self.stream, &PeerMsg::File { name: f.name.clone(), len_bytes: f.len_bytes })?;
            match pace {
                None => send_body(&mut self.stream, f)?,
                Some(bucket) => send_body(&mut Paced::new(&mut self.stream, bucket), f)?,
            }
        }
        send(&mut self.stream, &PeerMsg::Done)?;
        self.expect(|m| matches!(m, PeerMsg::Held { .. }))
    }

    /// File `name` of `node`'s replica of `step`, exactly `dst.len()`
    /// bytes, into `dst`, each piece handed to `each` as it arrives.
    pub fn get(
        &mut self,
        node: &str,
        step: u64,
        name: &str,
        dst: &mut [u8],
        mut each: impl FnMut(&[u8]),
    ) -> Result<(), ConnError> {
        send(&mut self.stream, &PeerMsg::Get { node: node.into(), step, name: name.into() })?;
        match recv(&mut self.stream, PEER_FRAME_BYTES_MAX)? {
            PeerMsg::File { len_bytes, .. } if len_bytes == dst.len() as u64 => {
                for piece in dst.chunks_mut(config::PEER_PIECE_BYTES) {
                    self.stream.read_exact(piece)?;
                    each(piece);
                }
                Ok(())
            }
            PeerMsg::File { len_bytes, .. } => Err(ConnError::Protocol(format!(
                "{name}: the replica is {len_bytes} bytes; the index says {}",
                dst.len()
            ))),
            PeerMsg::Error { message } => Err(ConnError::Refused(message)),
            other => Err(ConnError::Protocol(format!("{} instead of a File", kind(&other)))),
        }
    }

    /// The steps of `node` this peer holds in memory.
    pub fn list(&mut self, node: &str) -> Result<Vec<u64>, ConnError> {
        send(&mut self.stream, &PeerMsg::List { node: node.into() })?;
        match recv(&mut self.stream, PEER_FRAME_BYTES_MAX)? {
            PeerMsg::Steps { steps, .. } => Ok(steps),
            PeerMsg::Error { message } => Err(ConnError::Refused(message)),
            other => Err(ConnError::Protocol(format!("{} instead of Steps", kind(&other)))),
        }
    }

    /// No shared file system: the steps committed in the peer's own shared
    /// directory, ascending (a peer of an earlier build: its newest alone).
    pub fn committed_steps(&mut self) -> Result<Vec<u64>, ConnError> {
        send(&mut self.stream, &PeerMsg::Newest)?;
        match recv(&mut self.stream, PEER_FRAME_BYTES_MAX)? {
            PeerMsg::Steps { steps, .. } => Ok(steps),
            PeerMsg::Error { message } => Err(ConnError::Refused(message)),
            other => Err(ConnError::Protocol(format!("{} instead of Steps", kind(&other)))),
        }
    }

    /// No shared file system: committed `step`'s folder files as the peer's
    /// own shared directory holds them; None when it is not committed there.
    pub fn committed(&mut self, step: u64) -> Result<Option<ckpt_store::nodes::StepFiles>, ConnError> {
        send(&mut self.stream, &PeerMsg::GetCommitted { step })?;
        match recv(&mut self.stream, PEER_FRAME_BYTES_MAX)? {
            PeerMsg::Committed { step: s, files, .. } if s == step => Ok(Some(files)),
            PeerMsg::Error { .. } => Ok(None),
            other => Err(ConnError::Protocol(format!("{} instead of Committed", kind(&other)))),
        }
    }

    /// A doorbell ([`PeerMsg::Marked`], [`PeerMsg::Decided`]): Ok once the
    /// peer took it.
    pub fn ring(&mut self, msg: &PeerMsg) -> Result<(), ConnError> {
        send(&mut self.stream, msg)?;
        self.expect(|m| matches!(m, PeerMsg::Rung))
    }

    /// The next message is one `ok` accepts, else its Error as ours.
    fn expect(&mut self, ok: impl Fn(&PeerMsg) -> bool) -> Result<(), ConnError> {
        match recv(&mut self.stream, PEER_FRAME_BYTES_MAX)? {
            m if ok(&m) => Ok(()),
            PeerMsg::Error { message } => Err(ConnError::Refused(message)),
            other => Err(ConnError::Protocol(format!("unexpected {}", kind(&other)))),
        }
    }

    /// Flushes nothing (writes are whole); for a caller that wants the
    /// stream closed now rather than when dropped.
    pub fn close(mut self) {
        let _ = self.stream.flush();
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}
