//! The peer protocol: one node's sidecar speaking to another's over TCP
//! (replicas of its node-local files, and those files read back for a
//! restore). docs/protocol.md, "Peer protocol", is the contract and its
//! threat model.
//!
//! Frames as the client protocol's (a 4-byte little-endian length, then one
//! postcard-encoded [`PeerMsg`]), except that a file's bytes follow a
//! [`PeerMsg::File`] raw, exactly `len_bytes` of them, so that neither side
//! copies a shard through an encoder.
//!
//! Authentication, both ways, before anything else: the connecting side
//! sends [`PeerMsg::Hello`] with a fresh nonce; the listening side answers
//! [`PeerMsg::Challenge`] with a fresh nonce of its own and its proof
//! ([`proof`], HMAC-SHA256 over both nonces and both node ids, keyed by the
//! cluster secret); the connecting side checks it and sends
//! [`PeerMsg::Proof`], its own proof over the same, under another label; the
//! listening side checks that and says [`PeerMsg::Welcome`]. A replayed
//! conversation meets a new nonce and fails; nothing but the handshake's
//! small frames ([`PEER_HELLO_BYTES_MAX`]) is read before it succeeds.
//!
//! Invariants:
//! - no request is served and no byte of a checkpoint sent before both
//!   sides proved the secret;
//! - a frame's length is checked against the limit of its phase before any
//!   allocation or read of its body.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// Bumped on any change of the messages below (the golden tests fail first).
pub const PEER_PROTOCOL_VERSION: u32 = 4;
/// First bytes of every peer Hello: a client of the other protocol (or a
/// stray one) is told apart at once.
pub const PEER_MAGIC: [u8; 4] = *b"CKPP";
/// Largest frame before the handshake is done (Hello, Challenge, Proof).
pub const PEER_HELLO_BYTES_MAX: u32 = 1024;
/// Largest frame after it (an offered step's index, a committed step's
/// index and blobs with no shared file system: ~400 bytes per tensor, so
/// about 600,000 tensors in a job's step).
pub const PEER_FRAME_BYTES_MAX: u32 = 256 << 20;
/// Bytes of each side's nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of a proof (HMAC-SHA256).
pub const PROOF_BYTES: usize = 32;
/// The shortest cluster secret either side accepts.
pub const PEER_SECRET_BYTES_MIN: usize = 32;

/// One message of the peer protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerMsg {
    /// Connecting side, first: who it is and its challenge.
    Hello { magic: [u8; 4], version: u32, node: String, nonce: [u8; NONCE_BYTES] },
    /// Listening side: who it is, its challenge, and its proof
    /// ([`Role::Listener`]) over both; then its failure domain
    /// (`--failure-domain`; empty: none), which the connector's replication
    /// orders its peers by (version 4).
    Challenge { version: u32, node: String, nonce: [u8; NONCE_BYTES], proof: [u8; PROOF_BYTES], domain: String },
    /// Connecting side: its proof ([`Role::Connector`]).
    Proof { proof: [u8; PROOF_BYTES] },
    /// Listening side: the handshake succeeded; requests may follow.
    Welcome,
    /// Either side: the connection ends, for this reason.
    Refused { reason: String },
    /// A replica of `node`'s files of `step` follows: the step's index
    /// (JSON, sealed; the committed one, or its part naming `node`'s files
    /// and their tensors only: `ckpt_store::nodes::node_part`), then a [`PeerMsg::File`] per file, then
    /// [`PeerMsg::Done`]. Answered at once [`PeerMsg::Ready`] (the files
    /// may follow) or [`PeerMsg::Error`] (they may not), and after Done
    /// [`PeerMsg::Held`] or [`PeerMsg::Error`].
    Offer { node: String, step: u64, index: Vec<u8>, files: u32 },
    /// One file: `len_bytes` raw bytes follow this frame.
    File { name: String, len_bytes: u64 },
    /// The end of an offer's files.
    Done,
    /// The replica is held (every byte checked against the index).
    Held { node: String, step: u64 },
    /// A request failed: why.
    Error { message: String },
    /// Sends file `name` of `node`'s replica of `step`: answered by
    /// [`PeerMsg::File`] and its bytes, or [`PeerMsg::Error`].
    Get { node: String, step: u64, name: String },
    /// Which steps of `node` are held: answered by [`PeerMsg::Steps`].
    List { node: String },
    /// The steps of a node held.
    Steps { node: String, steps: Vec<u64> },
    /// An offer is accepted: room is reserved for its files.
    Ready,
    /// The commit's doorbell, to the step's coordinator: rank `rank`'s
    /// marker of `step` is written and synced in the step's temp folder
    /// (whose inode and birth time are `folder_ino` and `folder_born_ns`,
    /// 0: unknown, so that a message of an earlier attempt of the step is
    /// told apart), and these are its bytes
    /// (`marker`: as in the file; `slices`: its slice declarations' file,
    /// empty when it has none). Answered [`PeerMsg::Rung`].
    Marked {
        step: u64,
        world_size: u32,
        rank: u32,
        folder_ino: u64,
        folder_born_ns: u64,
        marker: Vec<u8>,
        slices: Vec<u8>,
    },
    /// The commit's doorbell, from the step's coordinator to every peer:
    /// `step` is decided (committed, or aborted with its abort record
    /// left); the shared directory says which. `port` is the coordinator's
    /// peer port, so that the next steps' [`PeerMsg::Marked`] find it.
    /// Answered [`PeerMsg::Rung`].
    Decided { step: u64, port: u16 },
    /// A doorbell was taken (what it says is checked against the shared
    /// directory, never trusted as the outcome).
    Rung,
    /// No shared file system (`--shared-over-peers`): rank `rank`'s part of
    /// `step` is written and synced on its node, and these are what the
    /// step's shared folder would hold of it: its marker, its slice
    /// declarations (empty when none) and its blobs (name, bytes). To the
    /// coordinator known (the last one heard of: [`PeerMsg::Coordinating`],
    /// a step's outcome), which writes them into its temp folder of the
    /// step. Answered [`PeerMsg::Rung`].
    Part { step: u64, world_size: u32, rank: u32, marker: Vec<u8>, slices: Vec<u8>, blobs: Vec<(String, Vec<u8>)> },
    /// No shared file system: the coordinator committed `step`, and these
    /// are the step folder's files (the index under its file name,
    /// `model.safetensors.index.json`, and each blob as `blobs/NAME`) for
    /// every peer's own shared folder; `port` as in [`PeerMsg::Decided`].
    /// Answered [`PeerMsg::Rung`]; also the answer to
    /// [`PeerMsg::GetCommitted`] (`port` 0).
    Committed { step: u64, port: u16, files: Vec<(String, Vec<u8>)> },
    /// No shared file system: the coordinator aborted `step`, for this
    /// reason (the abort record). Answered [`PeerMsg::Rung`].
    Aborted { step: u64, port: u16, reason: String },
    /// No shared file system: which steps are committed in the peer's own
    /// shared folder, asked by a sidecar starting (a replaced node).
    /// Answered [`PeerMsg::Steps`] with the listener's node id and those
    /// steps, ascending (a peer of an earlier build answers its `latest`
    /// alone), or none.
    Newest,
    /// No shared file system: the sender serves rank 0 of `step` and
    /// coordinates it (`port` as in [`PeerMsg::Decided`]); a node whose
    /// parts of the step went elsewhere, or waited for a coordinator to be
    /// known, sends them to it. Answered [`PeerMsg::Rung`].
    Coordinating { step: u64, port: u16 },
    /// No shared file system, with a drain: the sender uploaded its files
    /// of `step` to the drain target (the upload mark it would leave in a
    /// shared directory), to the coordinator, which commits the remote step
    /// once every node's mark is in. Answered [`PeerMsg::Rung`].
    Uploaded { step: u64 },
    /// No shared file system: committed `step`'s folder files, asked by a
    /// sidecar starting (of the peer with the newest step) or by one whose
    /// ranks' wait for the step's outcome ran out. Answered
    /// [`PeerMsg::Committed`], or [`PeerMsg::Error`] when the step is not
    /// committed there.
    GetCommitted { step: u64 },
}

/// Which side a proof is from: the labels keep one side's proof from being
/// replayed as the other's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Connector,
    Listener,
}

/// HMAC-SHA256 keyed by `secret` over the role's label, both nonces and
/// both node ids (each length-prefixed, so no two inputs run together).
pub fn proof(secret: &[u8], role: Role, nonces: &Nonces, nodes: &Nodes) -> [u8; PROOF_BYTES] {
    mac_over(secret, role, nonces, nodes).finalize().into_bytes().into()
}

/// Whether `got` is the proof [`proof`] gives (compared in constant time).
pub fn proof_matches(got: &[u8; PROOF_BYTES], secret: &[u8], role: Role, nonces: &Nonces, nodes: &Nodes) -> bool {
    mac_over(secret, role, nonces, nodes).verify_slice(got).is_ok()
}

/// The two nonces of a handshake.
#[derive(Debug, Clone, Copy)]
pub struct Nonces {
    pub connector: [u8; NONCE_BYTES],
    pub listener: [u8; NONCE_BYTES],
}

/// The two node ids of a handshake.
#[derive(Debug, Clone, Copy)]
pub struct Nodes<'a> {
    pub connector: &'a str,
    pub listener: &'a str,
}

fn mac_over(secret: &[u8], role: Role, nonces: &Nonces, nodes: &Nodes) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes a key of any length");
    let label: &[u8] = match role {
        Role::Connector => b"ckpt-peer-v1 connector",
        Role::Listener => b"ckpt-peer-v1 listener",
    };
    let parts: [&[u8]; 5] =
        [label, &nonces.connector, &nonces.listener, nodes.connector.as_bytes(), nodes.listener.as_bytes()];
    for part in parts {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac
}
