//! The peer protocol's frames on both kinds of socket: a blocking one
//! (`conn`, a thread's own) and a tokio one (`server`), each read with the
//! limit of its phase checked before the body is allocated, and each
//! read bounded in time (a stall ends the connection, never the server).

use std::io::{Read, Write};
use std::time::Duration;

use ckpt_wire::peer::PeerMsg;
use ckpt_wire::FrameError;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Why a peer connection ended.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error(transparent)]
    Frame(FrameError),
    #[error("{0}")]
    Io(std::io::Error),
    /// A blocking socket's timeout (`--peer-timeout`) ran out.
    #[error("no progress within the peer timeout (a cut link or a stalled peer): {0}")]
    TimedOut(std::io::Error),
    #[error("no answer within {0:?}")]
    Stalled(Duration),
    #[error("refused: {0}")]
    Refused(String),
    #[error("{0}")]
    Protocol(String),
}

impl From<std::io::Error> for ConnError {
    fn from(e: std::io::Error) -> ConnError {
        // What a socket read or write whose SO_RCVTIMEO / SO_SNDTIMEO ran
        // out returns (EAGAIN), and a connect's or TCP's own timeout.
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => ConnError::TimedOut(e),
            _ => ConnError::Io(e),
        }
    }
}

impl From<FrameError> for ConnError {
    fn from(e: FrameError) -> ConnError {
        match e {
            FrameError::Io(e) => ConnError::from(e),
            e => ConnError::Frame(e),
        }
    }
}

/// Writes one message (blocking).
pub fn send(w: &mut impl Write, msg: &PeerMsg) -> Result<(), ConnError> {
    w.write_all(&ckpt_wire::encode(msg))?;
    Ok(())
}

/// Reads one message of at most `max_bytes` (blocking; the socket's read
/// timeout bounds each read).
pub fn recv(r: &mut impl Read, max_bytes: u32) -> Result<PeerMsg, ConnError> {
    let body = ckpt_wire::read_frame_body(r, max_bytes)?;
    Ok(ckpt_wire::decode(&body)?)
}

/// Writes one message (async), within `limit`.
pub async fn send_async(w: &mut (impl AsyncWriteExt + Unpin), msg: &PeerMsg, limit: Duration) -> Result<(), ConnError> {
    let frame = ckpt_wire::encode(msg);
    tokio::time::timeout(limit, w.write_all(&frame)).await.map_err(|_| ConnError::Stalled(limit))??;
    Ok(())
}

/// Reads one message of at most `max_bytes` (async), within `limit`.
pub async fn recv_async(
    r: &mut (impl AsyncReadExt + Unpin),
    max_bytes: u32,
    limit: Duration,
) -> Result<PeerMsg, ConnError> {
    let body = tokio::time::timeout(limit, async {
        let mut len = [0u8; 4];
        match r.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(ConnError::Frame(FrameError::Closed))
            }
            Err(e) => return Err(e.into()),
        }
        let len = u32::from_le_bytes(len);
        if len > max_bytes {
            return Err(FrameError::TooLarge { len_bytes: len as u64, max_bytes }.into());
        }
        let mut body = vec![0u8; len as usize];
        r.read_exact(&mut body).await.map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => ConnError::Frame(FrameError::Truncated),
            _ => e.into(),
        })?;
        Ok(body)
    })
    .await
    .map_err(|_| ConnError::Stalled(limit))??;
    Ok(ckpt_wire::decode(&body)?)
}

/// Reads exactly `dst.len()` raw bytes (async) in pieces, each within
/// `limit`, handing each piece to `each` as it arrives.
pub async fn recv_raw_async(
    r: &mut (impl AsyncReadExt + Unpin),
    dst: &mut [u8],
    limit: Duration,
    mut each: impl FnMut(&[u8]),
) -> Result<(), ConnError> {
    for piece in dst.chunks_mut(crate::config::PEER_PIECE_BYTES) {
        tokio::time::timeout(limit, r.read_exact(piece)).await.map_err(|_| ConnError::Stalled(limit))??;
        each(piece);
    }
    Ok(())
}

/// Writes `bytes` raw (async) in pieces, each within `limit`.
pub async fn send_raw_async(
    w: &mut (impl AsyncWriteExt + Unpin),
    bytes: &[u8],
    limit: Duration,
) -> Result<(), ConnError> {
    for piece in bytes.chunks(crate::config::PEER_PIECE_BYTES) {
        tokio::time::timeout(limit, w.write_all(piece)).await.map_err(|_| ConnError::Stalled(limit))??;
    }
    Ok(())
}

/// A nonce from the OS's random source.
pub fn fresh_nonce() -> Result<[u8; ckpt_wire::peer::NONCE_BYTES], ConnError> {
    let mut n = [0u8; ckpt_wire::peer::NONCE_BYTES];
    getrandom::getrandom(&mut n).map_err(|e| ConnError::Protocol(format!("no random nonce: {e}")))?;
    Ok(n)
}

/// A message's kind, for errors (never its bytes).
pub fn kind(m: &PeerMsg) -> &'static str {
    match m {
        PeerMsg::Hello { .. } => "Hello",
        PeerMsg::Challenge { .. } => "Challenge",
        PeerMsg::Proof { .. } => "Proof",
        PeerMsg::Welcome => "Welcome",
        PeerMsg::Refused { .. } => "Refused",
        PeerMsg::Offer { .. } => "Offer",
        PeerMsg::File { .. } => "File",
        PeerMsg::Done => "Done",
        PeerMsg::Held { .. } => "Held",
        PeerMsg::Error { .. } => "Error",
        PeerMsg::Get { .. } => "Get",
        PeerMsg::List { .. } => "List",
        PeerMsg::Steps { .. } => "Steps",
        PeerMsg::Ready => "Ready",
        PeerMsg::Marked { .. } => "Marked",
        PeerMsg::Decided { .. } => "Decided",
        PeerMsg::Rung => "Rung",
        PeerMsg::Part { .. } => "Part",
        PeerMsg::Committed { .. } => "Committed",
        PeerMsg::Aborted { .. } => "Aborted",
        PeerMsg::Newest => "Newest",
        PeerMsg::Coordinating { .. } => "Coordinating",
        PeerMsg::Uploaded { .. } => "Uploaded",
        PeerMsg::GetCommitted { .. } => "GetCommitted",
    }
}
