//! One timeline per folder: a save below the newest committed step (a run
//! restarted from step 0 in a used folder) is refused before anything is
//! copied, naming the newest step and the way out, whether it is a whole
//! save or every rank's part, and whether the newer step committed before
//! the save arrived or while it was in flight. Never durable, then gone.

use ckpt_store::catalog;
use ckpt_test_support::daemon::{Client, Shm, Sidecar};
use ckpt_wire::{Blob, ErrorCode, Reply, Request, TensorDesc};

fn tensors(region_id: u32) -> Vec<TensorDesc> {
    let f32s = |name: &str, n: u64, offset_bytes: u64| TensorDesc {
        name: name.into(),
        dtype: "F32".into(),
        shape: vec![n],
        region_id,
        offset_bytes,
        len_bytes: 4 * n,
    };
    vec![f32s("w", 1024, 0), f32s("b", 16, 4096)]
}

fn blobs(step: u64) -> Vec<Blob> {
    vec![Blob { name: "rng.state".into(), bytes: format!("rng at {step}").into_bytes() }]
}

/// Nothing of `step` on disk: no step folder, no temp folder.
fn nothing_of(dir: &std::path::Path, step: u64) -> bool {
    let name = ckpt_store::format::step_dir_name(step).unwrap();
    let digits = &name[ckpt_store::format::STEP_PREFIX.len()..];
    std::fs::read_dir(dir).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(digits))
}

fn assert_names_the_way_out(reason: &str, step: u64, newest: u64) {
    for want in [format!("step {step} is below the newest committed step {newest}"), "rollback".into()] {
        assert!(reason.contains(&want), "{want:?} not in {reason:?}");
    }
    assert!(reason.contains("another folder"), "{reason}");
}

#[test]
fn a_save_below_the_newest_committed_step_is_refused_naming_it_and_the_way_out() {
    let sc = Sidecar::start(&["--keep", "3"]);
    let mut c = sc.client();
    let shm = Shm::new(8192);
    assert!(matches!(c.register(1, &shm), Reply::RegionRegistered { .. }));
    for step in [10, 11, 12] {
        c.save_durable(step, tensors(1), blobs(step));
    }
    let reason = c.expect_failed(7, tensors(1), blobs(7), ErrorCode::BadRequest);
    assert_names_the_way_out(&reason, 7, 12);
    // Between committed steps is below the newest too.
    c.rollback(11);
    let reason = c.expect_failed(5, tensors(1), blobs(5), ErrorCode::BadRequest);
    assert_names_the_way_out(&reason, 5, 11);
    assert!(nothing_of(&sc.dir, 7) && nothing_of(&sc.dir, 5));
    assert_eq!(catalog::committed_steps(&sc.dir).unwrap(), vec![10, 11]);
    assert_eq!(catalog::latest_step(&sc.dir).unwrap(), Some(11));
    // The way out: after a rollback to 10, step 11 is saved again.
    assert!(matches!(c.rollback(10), Reply::RolledBack { .. }), "rollback");
    c.save_durable(11, tensors(1), blobs(11));
    assert_eq!(catalog::latest_step(&sc.dir).unwrap(), Some(11));
}

/// Whether the newer step is committed before the older save is checked
/// or only while it is in flight, the older one is never Durable.
#[test]
fn a_save_sent_behind_a_newer_one_in_flight_is_never_durable() {
    let sc = Sidecar::start(&["--keep", "3"]);
    let mut c = sc.client();
    let shm = Shm::new(8192);
    assert!(matches!(c.register(1, &shm), Reply::RegionRegistered { .. }));
    c.save_durable(1, tensors(1), blobs(1));
    let newer = c.save(12, tensors(1), blobs(12));
    let older = c.save(7, tensors(1), blobs(7));
    let (mut newer_durable, mut older_failed) = (false, None);
    while !newer_durable || older_failed.is_none() {
        match c.recv() {
            Reply::Released { .. } => {}
            Reply::Durable { id, .. } if id == newer => newer_durable = true,
            Reply::Failed { id, code: ErrorCode::BadRequest, reason, .. } if id == older => older_failed = Some(reason),
            other => panic!("expected step 12 Durable and step 7 Failed, got {other:?}"),
        }
    }
    assert_names_the_way_out(&older_failed.unwrap(), 7, 12);
    assert!(nothing_of(&sc.dir, 7));
    assert_eq!(catalog::latest_step(&sc.dir).unwrap(), Some(12));
}

fn part(c: &mut Client, step: u64, rank: u32) -> u64 {
    let tensors = tensors(1).into_iter().map(|mut t| (t.name += &format!(".{rank}"), t).1).collect();
    c.call(|id| Request::SavePart {
        id,
        step,
        rank,
        world_size: 2,
        tensors,
        blobs: Vec::new(),
        lazy_release: false,
        unchanged: None,
    })
}

#[test]
fn every_ranks_part_below_the_newest_committed_step_is_refused() {
    let sc = Sidecar::start(&["--keep", "3"]);
    let (mut a, mut b) = (sc.client(), sc.client());
    let (sa, sb) = (Shm::new(8192), Shm::new(8192));
    assert!(matches!(a.register(1, &sa), Reply::RegionRegistered { .. }));
    assert!(matches!(b.register(1, &sb), Reply::RegionRegistered { .. }));
    part(&mut a, 12, 0);
    part(&mut b, 12, 1);
    for c in [&mut a, &mut b] {
        assert!(matches!(c.recv(), Reply::Released { step: 12, .. }));
        assert!(matches!(c.recv(), Reply::Durable { step: 12, .. }));
    }
    for (rank, c) in [&mut a, &mut b].into_iter().enumerate() {
        let id = part(c, 7, rank as u32);
        match c.recv() {
            Reply::Failed { id: i, code: ErrorCode::BadRequest, reason, .. } if i == id => {
                assert_names_the_way_out(&reason, 7, 12)
            }
            other => panic!("rank {rank}: expected Failed, got {other:?}"),
        }
    }
    assert!(nothing_of(&sc.dir, 7));
}
