//! Golden encodings pin the wire format: every message kind, encoded, must
//! equal the hex checked in under `tests/golden/messages.txt`. A change here
//! means old shims and new sidecars (or the reverse) no longer understand
//! each other: bump PROTOCOL_VERSION and regenerate with
//! `CKPT_UPDATE_GOLDEN=1 cargo test -p ckpt-wire --test it golden::`.

use ckpt_wire::*;

fn samples() -> Vec<(&'static str, Vec<u8>)> {
    let t = TensorDesc {
        name: "model.w".into(),
        dtype: "BF16".into(),
        shape: vec![4, 3],
        region_id: 2,
        offset_bytes: 4096,
        len_bytes: 24,
    };
    let b = Blob { name: "rng".into(), bytes: vec![9, 8, 7] };
    let report = StatusReport {
        server_pid: 42,
        dirs: vec!["/ckpt".into()],
        sessions: vec![SessionInfo { pid: 7, name: "trainer".into(), regions: 1, region_bytes: 1 << 20 }],
        in_flight: vec![
            InFlight { step: 5, file: None, phase: "writing".into(), bytes: 1000 },
            InFlight { step: 0, file: Some("/runs/a.pt".into()), phase: "copying".into(), bytes: 10 },
        ],
        staging_bytes: 1 << 30,
        staging_used_bytes: 1000,
        resident_step: Some(4),
        last: Some(LastFigures {
            step: 4,
            bytes: 1000,
            copy_seconds: 0.5,
            persist_seconds: 1.5,
            persist_gib_per_s: 2.0,
        }),
        cuda: "no CUDA driver".into(),
        shared_dir: "/shared/ckpt".into(),
        coordinating: vec![100],
        unchanged_taken_bytes: 1 << 20,
        unchanged_in_place_bytes: 1 << 19,
        drain: Some(DrainReport {
            url: "s3://ckpt-test/run1".into(),
            up: true,
            error: String::new(),
            last_replicated: Some(3),
            uploading: Some(4),
            backlog: vec![5],
            skipped: vec![2],
            bytes_per_s: 1e9,
            every: 1,
            keep: Some(2),
            replicated_count: 3,
            skipped_count: 1,
            deleted_undrained_count: 1,
            deleted_undrained: vec![1],
            backlog_bytes: 2000,
            upload_failures: 2,
            lag_seconds: 1.5,
        }),
        damaged: vec![DamageReport {
            step: 3,
            file: "rank-00000-of-00001-shard-0000.safetensors".into(),
            reason: "checksum mismatch".into(),
            found_unix_s: 1_700_000_000,
            found_by: "scrub".into(),
        }],
        damaged_total: 1,
        scrub: Some(ScrubReport {
            interval_s: 21600.0,
            verifying: Some(4),
            passes: 1,
            last_pass_unix_s: Some(1_700_000_000),
            steps_verified: 3,
            bytes_verified: 3000,
            remote_steps_verified: 2,
            remote_bytes_verified: 2000,
        }),
        peers: Some(PeerReport {
            listen: "10.0.0.1:7000".into(),
            peers: vec!["10.0.0.2:7000".into()],
            replicas: 1,
            last_held: Some(4),
            last_held_by: vec!["b".into()],
            last_failed: Some(3),
            last_error: "peer b: refused".into(),
            bytes_per_s: 2e9,
            last_skipped: Some(2),
            skipped_count: 1,
            shared_over_peers: true,
            holding: vec![("b".into(), 4)],
            holding_bytes: 1 << 20,
            budget_bytes: 1 << 30,
            refused_connections: 2,
        }),
    };
    vec![
        ("hello", encode(&Request::Hello { magic: MAGIC, version: PROTOCOL_VERSION, pid: 7, name: "trainer".into() })),
        (
            "register",
            encode(&Request::RegisterRegion {
                id: 1,
                region_id: 2,
                shm_name: "/ckpt-7-2".into(),
                len_bytes: 1 << 20,
                hand_over: true,
            }),
        ),
        ("unregister", encode(&Request::UnregisterRegion { id: 2, region_id: 2 })),
        (
            "save",
            encode(&Request::Save {
                id: 3,
                step: 100,
                tensors: vec![t.clone()],
                blobs: vec![b.clone()],
                lazy_release: false,
                unchanged: None,
            }),
        ),
        ("load", encode(&Request::Load { id: 4, step: None, tensors: vec![t.clone()] })),
        ("list", encode(&Request::List { id: 5 })),
        ("status", encode(&Request::Status { id: 6 })),
        ("bye", encode(&Request::Bye)),
        (
            "save_file",
            encode(&Request::SaveFile {
                id: 7,
                path: "/runs/model.pt".into(),
                region_id: 2,
                offset_bytes: 0,
                len_bytes: 1234,
            }),
        ),
        ("rollback", encode(&Request::Rollback { id: 8, step: 4 })),
        (
            "register_cuda",
            encode(&Request::RegisterCudaRegion {
                id: 9,
                region_id: 3,
                device: 0,
                device_uuid: vec![0x5a; 16],
                ipc_handle: vec![0xab; 64],
                len_bytes: 1 << 21,
            }),
        ),
        (
            "save_after_event",
            encode(&Request::SaveAfterEvent {
                id: 10,
                step: 101,
                tensors: vec![t.clone()],
                blobs: vec![],
                lazy_release: true,
                device: 0,
                event: vec![0xcd; 64],
                rank: 1,
                world_size: 2,
                unchanged: Some(Unchanged { since_step: 100, bits: vec![1] }),
            }),
        ),
        (
            "save_part",
            encode(&Request::SavePart {
                id: 11,
                step: 100,
                rank: 1,
                world_size: 2,
                tensors: vec![t.clone()],
                blobs: vec![b.clone()],
                lazy_release: true,
                unchanged: None,
            }),
        ),
        (
            "save_unchanged",
            encode(&Request::Save {
                id: 16,
                step: 102,
                tensors: vec![t],
                blobs: vec![],
                lazy_release: true,
                unchanged: Some(Unchanged { since_step: 101, bits: vec![0b1] }),
            }),
        ),
        (
            "register_cuda_vmm_region",
            encode(&Request::RegisterCudaVmmRegion {
                id: 12,
                region_id: 4,
                device: 0,
                device_uuid: vec![0x5a; 16],
                fabric_handle: vec![],
                len_bytes: 2 << 20,
            }),
        ),
        ("register_cuda_span", encode(&Request::RegisterCudaSpan { id: 13, region_id: 9, pieces: vec![4, 5, 7] })),
        (
            "save_file_pieces",
            encode(&Request::SaveFilePieces {
                id: 14,
                path: "/runs/model.pt".into(),
                pieces: vec![
                    FilePiece { region_id: 2, offset_bytes: 0, len_bytes: 704 },
                    FilePiece { region_id: 4, offset_bytes: 512, len_bytes: 4000 },
                ],
                device: 0,
                event: vec![0xcd; 64],
                finish: FileFinish::TorchZip,
            }),
        ),
        (
            "load_packed",
            encode(&Request::LoadPacked {
                id: 15,
                step: Some(100),
                region_id: 2,
                offset_bytes: 4096,
                len_bytes: 1 << 20,
            }),
        ),
        ("copy_queued", encode(&Reply::CopyQueued { id: 10, step: 101 })),
        (
            "welcome",
            encode(&Reply::Welcome {
                version: PROTOCOL_VERSION,
                server_pid: 42,
                dirs: vec!["/ckpt".into()],
                staging_bytes: 1 << 30,
            }),
        ),
        ("refused", encode(&Reply::Refused { reason: "version".into() })),
        ("registered", encode(&Reply::RegionRegistered { id: 1, region_id: 2 })),
        ("unregistered", encode(&Reply::RegionUnregistered { id: 2, region_id: 2 })),
        ("released", encode(&Reply::Released { id: 3, step: 100, copy_seconds: 0.25, waited_seconds: 0.0 })),
        (
            "durable",
            encode(&Reply::Durable { id: 3, step: 100, path: "/ckpt/step-000000000100".into(), persist_seconds: 1.0 }),
        ),
        ("failed", encode(&Reply::Failed { id: 3, step: 100, code: ErrorCode::Io, reason: "disk full".into() })),
        (
            "loaded",
            encode(&Reply::Loaded {
                id: 4,
                step: 100,
                source: LoadSource::Ram,
                tensors: vec![TensorInfo {
                    name: "model.w".into(),
                    dtype: "BF16".into(),
                    shape: vec![4, 3],
                    len_bytes: 24,
                }],
                blobs: vec![b],
                fell_back: vec![],
            }),
        ),
        ("listing", encode(&Reply::Listing { id: 5, steps: vec![99, 100], latest: Some(100) })),
        ("status_reply", encode(&Reply::Status { id: 6, report })),
        ("error", encode(&Reply::Error { id: 4, code: ErrorCode::BadRegion, message: "outside".into() })),
        (
            "placed",
            encode(&Reply::Placed {
                id: 13,
                step: 100,
                source: LoadSource::Drain,
                tensors: vec![TensorInfo {
                    name: "model.w".into(),
                    dtype: "BF16".into(),
                    shape: vec![4, 3],
                    len_bytes: 24,
                }],
                offsets: vec![4096 + 88],
                need_bytes: 8192,
                blobs: vec![],
                fell_back: vec!["step 101: damaged".into()],
            }),
        ),
        ("rolled_back", encode(&Reply::RolledBack { id: 8, step: 4, removed: vec![10, 9] })),
        ("wait_replicated", encode(&Request::WaitReplicated { id: 16, step: 100 })),
        ("replicated", encode(&Reply::Replicated { id: 16, step: 100, url: "s3://ckpt-test/run1".into() })),
        ("wait_peers", encode(&Request::WaitPeers { id: 17, step: 100 })),
        ("held_by_peers", encode(&Reply::HeldByPeers { id: 17, step: 100, peers: vec!["b".into()] })),
    ]
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn encodings_match_golden_file() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/messages.txt");
    let actual: String = samples().iter().map(|(n, b)| format!("{n} {}\n", hex(b))).collect();
    if std::env::var_os("CKPT_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).expect("golden file (regenerate with CKPT_UPDATE_GOLDEN=1)");
    for (e, a) in expected.lines().zip(actual.lines()) {
        assert_eq!(e, a, "wire encoding changed: bump PROTOCOL_VERSION and regenerate");
    }
    assert_eq!(expected.lines().count(), actual.lines().count(), "message kinds added or removed");
}

#[test]
fn every_golden_frame_decodes_back() {
    for (name, frame) in samples() {
        let body = &frame[4..];
        let ok = decode::<Request>(body).map(|r| encode(&r) == frame).unwrap_or(false)
            || decode::<Reply>(body).map(|r| encode(&r) == frame).unwrap_or(false);
        assert!(ok, "{name} does not round-trip");
    }
}
