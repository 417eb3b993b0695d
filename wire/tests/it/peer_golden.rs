//! Golden encodings of the peer protocol (`ckpt_wire::peer`): every message
//! kind, encoded, must equal the hex under `tests/golden/peer_messages.txt`,
//! and the proof of a fixed handshake its hex. A change means two nodes of
//! different builds no longer understand each other: bump
//! PEER_PROTOCOL_VERSION and regenerate with
//! `CKPT_UPDATE_GOLDEN=1 cargo test -p ckpt-wire --test it peer_golden::`.

use ckpt_wire::peer::*;
use ckpt_wire::{decode, encode};

fn handshake() -> (Vec<u8>, Nonces) {
    (b"0123456789abcdef0123456789abcdef".to_vec(), Nonces { connector: [1; NONCE_BYTES], listener: [2; NONCE_BYTES] })
}

fn samples() -> Vec<(&'static str, Vec<u8>)> {
    let (secret, nonces) = handshake();
    let nodes = Nodes { connector: "a", listener: "b" };
    let p = proof(&secret, Role::Listener, &nonces, &nodes);
    vec![
        (
            "hello",
            encode(&PeerMsg::Hello {
                magic: PEER_MAGIC,
                version: PEER_PROTOCOL_VERSION,
                node: "a".into(),
                nonce: nonces.connector,
            }),
        ),
        (
            "challenge",
            encode(&PeerMsg::Challenge {
                version: PEER_PROTOCOL_VERSION,
                node: "b".into(),
                nonce: nonces.listener,
                proof: p,
                domain: "rack-1".into(),
            }),
        ),
        ("proof", encode(&PeerMsg::Proof { proof: proof(&secret, Role::Connector, &nonces, &nodes) })),
        ("welcome", encode(&PeerMsg::Welcome)),
        ("refused", encode(&PeerMsg::Refused { reason: "bad proof".into() })),
        ("offer", encode(&PeerMsg::Offer { node: "a".into(), step: 7, index: b"{}".to_vec(), files: 2 })),
        ("file", encode(&PeerMsg::File { name: "model-00001-of-00002.safetensors".into(), len_bytes: 8192 })),
        ("done", encode(&PeerMsg::Done)),
        ("held", encode(&PeerMsg::Held { node: "a".into(), step: 7 })),
        ("error", encode(&PeerMsg::Error { message: "over budget".into() })),
        ("get", encode(&PeerMsg::Get { node: "a".into(), step: 7, name: "x.safetensors".into() })),
        ("list", encode(&PeerMsg::List { node: "a".into() })),
        ("steps", encode(&PeerMsg::Steps { node: "a".into(), steps: vec![6, 7] })),
        ("ready", encode(&PeerMsg::Ready)),
        (
            "marked",
            encode(&PeerMsg::Marked {
                step: 7,
                world_size: 2,
                rank: 1,
                folder_ino: 4242,
                folder_born_ns: 1_765_000_000_123_456_789,
                marker: b"{}".to_vec(),
                slices: Vec::new(),
            }),
        ),
        ("decided", encode(&PeerMsg::Decided { step: 7, port: 7000 })),
        ("rung", encode(&PeerMsg::Rung)),
        (
            "part",
            encode(&PeerMsg::Part {
                step: 7,
                world_size: 2,
                rank: 1,
                marker: b"{}".to_vec(),
                slices: Vec::new(),
                blobs: vec![("extra-1.json".into(), b"[]".to_vec())],
            }),
        ),
        (
            "committed",
            encode(&PeerMsg::Committed {
                step: 7,
                port: 7000,
                files: vec![
                    ("model.safetensors.index.json".into(), b"{}".to_vec()),
                    ("blobs/extra-1.json".into(), b"[]".to_vec()),
                ],
            }),
        ),
        ("aborted", encode(&PeerMsg::Aborted { step: 7, port: 7000, reason: "rank 1 wrote no marker".into() })),
        ("newest", encode(&PeerMsg::Newest)),
        ("coordinating", encode(&PeerMsg::Coordinating { step: 7, port: 7000 })),
        ("uploaded", encode(&PeerMsg::Uploaded { step: 7 })),
        ("get_committed", encode(&PeerMsg::GetCommitted { step: 7 })),
    ]
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn peer_encodings_match_golden_file() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/peer_messages.txt");
    let actual: String = samples().iter().map(|(n, b)| format!("{n} {}\n", hex(b))).collect();
    if std::env::var_os("CKPT_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).expect("golden file (regenerate with CKPT_UPDATE_GOLDEN=1)");
    for (e, a) in expected.lines().zip(actual.lines()) {
        assert_eq!(e, a, "peer encoding changed: bump PEER_PROTOCOL_VERSION and regenerate");
    }
    assert_eq!(expected.lines().count(), actual.lines().count(), "message kinds added or removed");
}

#[test]
fn every_peer_golden_frame_decodes_back() {
    for (name, frame) in samples() {
        let m: PeerMsg = decode(&frame[4..]).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(encode(&m), frame, "{name} does not round-trip");
    }
}

#[test]
fn a_proof_checks_only_with_its_secret_role_nonces_and_nodes() {
    let (secret, nonces) = handshake();
    let nodes = Nodes { connector: "a", listener: "b" };
    let p = proof(&secret, Role::Connector, &nonces, &nodes);
    assert!(proof_matches(&p, &secret, Role::Connector, &nonces, &nodes));
    // Pinned: the HMAC-SHA256 of the fixed handshake (any change breaks every older node).
    assert_eq!(hex(&p), include_str!("../golden/peer_proof.txt").trim());
    let mut other_secret = secret.clone();
    other_secret[0] ^= 1;
    assert!(!proof_matches(&p, &other_secret, Role::Connector, &nonces, &nodes), "another secret");
    assert!(!proof_matches(&p, &secret, Role::Listener, &nonces, &nodes), "the other side's label");
    let fresh = Nonces { listener: [3; NONCE_BYTES], ..nonces };
    assert!(!proof_matches(&p, &secret, Role::Connector, &fresh, &nodes), "a replay meets a new nonce");
    assert!(!proof_matches(&p, &secret, Role::Connector, &nonces, &Nodes { connector: "ab", listener: "" }));
}
