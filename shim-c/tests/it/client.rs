//! The Rust client against the fake sidecar (tests/it/common.rs): handshake,
//! regions, asynchronous save acks, load, errors, sidecar death and
//! reconnection.

use std::time::Duration;

use crate::common::{temp_socket, Fake, Opts};
use ckpt::{BlobRef, Client, Error, SaveState, TensorRef, Wanted};
use ckpt_wire::{ErrorCode, LoadSource};

const SEC: Option<Duration> = Some(Duration::from_secs(10));

fn fill(region: &ckpt::ShmRegion, seed: u8, len: usize) {
    let bytes: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    region.write_at(0, &bytes).unwrap();
}

#[test]
fn save_released_durable_then_load_gives_the_same_bytes() {
    let (_d, sock) = temp_socket();
    let fake = Fake::start(&sock, Opts::default());
    let c = Client::connect(Some(&sock)).unwrap();
    assert_eq!(c.server_info().unwrap().server_pid, std::process::id());
    let r = c.alloc_region(8192).unwrap();
    fill(&r, 1, 8192);
    let t =
        [TensorRef::in_region("a", "F32", &[2, 4], &r, 0, 32), TensorRef::in_region("b", "U8", &[100], &r, 4096, 100)];
    let h = c.save(7, &t, &[BlobRef { name: "rng", bytes: b"state-7" }]).unwrap();
    assert_eq!(h.step, 7);
    let s = c.wait(h.id, Wanted::Released, SEC).unwrap();
    assert!(s.released);
    let s = c.wait(h.id, Wanted::Durable, SEC).unwrap();
    assert_eq!(s.state, SaveState::Durable);
    assert_eq!(s.path.as_deref(), Some("/fake/step-000000000007"));
    assert_eq!(c.poll(h.id).unwrap().state, SaveState::Durable);

    let mut before = vec![0u8; 8192];
    r.read_at(0, &mut before).unwrap();
    fill(&r, 99, 8192); // the trainer moves on
    let info = c.load(None, &t).unwrap();
    assert_eq!((info.step, info.source), (7, LoadSource::Ram));
    assert_eq!(info.tensors.len(), 2);
    assert_eq!(info.blobs[0].bytes, b"state-7");
    let mut after = vec![0u8; 8192];
    r.read_at(0, &mut after).unwrap();
    assert_eq!(after[..32], before[..32]);
    assert_eq!(after[4096..4196], before[4096..4196]);
    assert_ne!(after[32..64], before[32..64], "bytes outside the tensors were not loaded");
    assert_eq!(c.list().unwrap(), (vec![7], Some(7)));
    assert_eq!(c.status().unwrap().server_pid, std::process::id());
    let log = fake.log();
    assert!(log[0].starts_with("Hello "), "{log:?}");
    assert_eq!(log[1], "RegisterRegion 1");
    // A lazy release is asked for from the next save on.
    c.set_lazy_release(true);
    let h = c.save(8, &t, &[]).unwrap();
    c.wait(h.id, Wanted::Durable, SEC).unwrap();
    let log = fake.log();
    assert!(log.contains(&"Save 7".to_string()) && log.contains(&"Save 8 lazy".to_string()), "{log:?}");
}

#[test]
fn a_rank_of_several_sends_save_parts() {
    let (_d, sock) = temp_socket();
    let fake = Fake::start(&sock, Opts::default());
    let c = Client::connect(Some(&sock)).unwrap();
    assert!(matches!(c.set_rank(2, 2), Err(Error::InvalidArgument(_))));
    assert!(matches!(c.set_rank(0, 0), Err(Error::InvalidArgument(_))));
    c.set_rank(1, 2).unwrap();
    let h = c.save(5, &[], &[]).unwrap();
    assert!(matches!(c.wait(h.id, Wanted::Durable, SEC), Err(Error::SaveFailed { .. })));
    // World size 1 again: plain saves.
    c.set_rank(0, 1).unwrap();
    let h = c.save(6, &[], &[]).unwrap();
    c.wait(h.id, Wanted::Durable, SEC).unwrap();
    let log = fake.log();
    assert!(log.contains(&"SavePart 5 rank 1 of 2".to_string()) && log.contains(&"Save 6".to_string()), "{log:?}");
}

#[test]
fn durable_acks_interleave_with_other_replies() {
    let (_d, sock) = temp_socket();
    let _fake = Fake::start(&sock, Opts { durable_delay: Duration::from_millis(300), ..Opts::default() });
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(4096).unwrap();
    let t = [TensorRef::in_region("w", "U8", &[64], &r, 0, 64)];
    let mut ids = Vec::new();
    for step in 1..=5 {
        let h = c.save(step, &t, &[]).unwrap();
        c.wait(h.id, Wanted::Released, SEC).unwrap();
        ids.push(h.id);
    }
    // None is durable yet; List's reply arrives before their Durable acks.
    let (steps, _) = c.list().unwrap();
    assert!(steps.len() < 5, "{steps:?}");
    assert!(ids.iter().any(|id| c.poll(*id).unwrap().state == SaveState::Released));
    for id in &ids {
        c.wait(*id, Wanted::Durable, SEC).unwrap();
    }
    assert_eq!(c.list().unwrap(), (vec![1, 2, 3, 4, 5], Some(5)));
}

#[test]
fn saves_from_several_threads_share_one_client() {
    let (_d, sock) = temp_socket();
    let _fake = Fake::start(&sock, Opts { durable_delay: Duration::from_millis(20), ..Opts::default() });
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(4096).unwrap();
    std::thread::scope(|s| {
        for k in 0..4u64 {
            let (c, r) = (&c, &r);
            s.spawn(move || {
                for i in 0..10u64 {
                    let t = [TensorRef::in_region("w", "U8", &[8], r, 8 * k, 8)];
                    let h = c.save(100 * k + i, &t, &[]).unwrap();
                    c.wait(h.id, Wanted::Durable, SEC).unwrap();
                    c.list().unwrap();
                }
            });
        }
    });
    assert_eq!(c.list().unwrap().0.len(), 40);
}

#[test]
fn a_welcome_of_another_version_is_refused_with_a_clear_error() {
    let (_d, sock) = temp_socket();
    let _fake = Fake::start(&sock, Opts { version: Some(99), ..Opts::default() });
    let e = Client::connect(Some(&sock)).err().unwrap();
    assert!(matches!(e, Error::Version { ours: ckpt_wire::PROTOCOL_VERSION, theirs: 99, .. }), "{e:?}");
    assert!(e.to_string().contains("protocol version 99"), "{e}");
}

#[test]
fn a_refusal_carries_the_sidecars_reason() {
    let (_d, sock) = temp_socket();
    let _fake = Fake::start(&sock, Opts { refuse: Some("uid 1234 is not allowed".into()), ..Opts::default() });
    let e = Client::connect(Some(&sock)).err().unwrap();
    assert!(matches!(e, Error::Refused { .. }), "{e:?}");
    assert!(e.to_string().contains("uid 1234 is not allowed"), "{e}");
}

#[test]
fn no_sidecar_is_a_connect_error_naming_the_path() {
    let (_d, sock) = temp_socket();
    let e = Client::connect(Some(&sock)).err().unwrap();
    assert!(matches!(e, Error::Connect { .. }), "{e:?}");
    assert!(e.to_string().contains(&sock.display().to_string()), "{e}");
}

#[test]
fn tensors_outside_regions_are_caught_before_sending() {
    let (_d, sock) = temp_socket();
    let fake = Fake::start(&sock, Opts::default());
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(4096).unwrap();
    let heap = [0u8; 64];
    let bad = TensorRef { name: "heap", dtype: "U8", shape: &[64], ptr: heap.as_ptr(), len_bytes: 64 };
    let e = c.save(1, &[bad], &[]).err().unwrap();
    assert!(matches!(e, Error::OutsideRegion { .. }), "{e:?}");
    // Straddling the region's end.
    let straddle = TensorRef::in_region("s", "U8", &[64], &r, 4090, 64);
    assert!(matches!(c.save(1, &[straddle], &[]), Err(Error::OutsideRegion { .. })));
    assert!(!fake.log().iter().any(|l| l.starts_with("Save")));
}

#[test]
fn failures_after_release_are_reported_by_wait() {
    let (_d, sock) = temp_socket();
    let _fake = Fake::start(&sock, Opts { fail_step: Some(3), ..Opts::default() });
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(4096).unwrap();
    let t = [TensorRef::in_region("w", "U8", &[8], &r, 0, 8)];
    let h = c.save(3, &t, &[]).unwrap();
    c.wait(h.id, Wanted::Released, SEC).unwrap();
    let e = c.wait(h.id, Wanted::Durable, SEC).err().unwrap();
    assert!(matches!(&e, Error::SaveFailed { what, code: ErrorCode::Io, .. } if what == "step 3"), "{e:?}");
    assert!(e.to_string().contains("No space left"), "{e}");
    let s = c.poll(h.id).unwrap();
    assert_eq!(s.state, SaveState::Failed);
    assert!(s.released);
    // Waiting for release of a save that was released and then failed is fine.
    c.wait(h.id, Wanted::Released, SEC).unwrap();
}

#[test]
fn wait_times_out_and_the_save_goes_on() {
    let (_d, sock) = temp_socket();
    // The release comes long after the wait's 50 ms: Timeout shows the wait
    // did not wait for it (a wait that had would have got it); no timed
    // bound, which a loaded machine can break.
    let _fake = Fake::start(&sock, Opts { release_delay: Duration::from_secs(3), ..Opts::default() });
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(4096).unwrap();
    let h = c.save(1, &[TensorRef::in_region("w", "U8", &[8], &r, 0, 8)], &[]).unwrap();
    let e = c.wait(h.id, Wanted::Released, Some(Duration::from_millis(50))).err().unwrap();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    c.wait(h.id, Wanted::Durable, SEC).unwrap();
}

#[test]
fn unknown_save_ids_and_loads_of_nothing_are_errors() {
    let (_d, sock) = temp_socket();
    let _fake = Fake::start(&sock, Opts::default());
    let c = Client::connect(Some(&sock)).unwrap();
    assert!(matches!(c.poll(12345), Err(Error::UnknownSave { save_id: 12345 })));
    let e = c.load(None, &[]).err().unwrap();
    assert!(matches!(e, Error::Remote { code: ErrorCode::NotFound, .. }), "{e:?}");
    // The session goes on after an Error reply.
    assert_eq!(c.list().unwrap(), (vec![], None));
}

#[test]
fn sidecar_death_fails_pending_saves_and_a_later_call_reconnects() {
    let (_d, sock) = temp_socket();
    let fake = Fake::start(&sock, Opts { durable_delay: Duration::from_secs(30), ..Opts::default() });
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(4096).unwrap();
    fill(&r, 5, 4096);
    let t = [TensorRef::in_region("w", "U8", &[16], &r, 0, 16)];
    let h = c.save(1, &t, &[]).unwrap();
    c.wait(h.id, Wanted::Released, SEC).unwrap();

    let store = fake.kill();
    let e = c.wait(h.id, Wanted::Durable, SEC).err().unwrap();
    assert!(matches!(e, Error::Disconnected { .. }), "{e:?}");
    assert!(e.to_string().contains("may still commit"), "{e}");
    assert!(!c.is_connected());

    // No sidecar: the call fails with the reason, and the trainer goes on.
    let e = c.list().err().unwrap();
    assert!(matches!(e, Error::Disconnected { .. }), "{e:?}");
    assert!(e.to_string().contains("reconnecting"), "{e}");

    // A sidecar is back (same socket, same "disk"): the next call reconnects
    // and the old region is registered again under its id.
    let fake = Fake::start_with(&sock, Opts::default(), store);
    assert_eq!(c.list().unwrap().0, Vec::<u64>::new());
    assert!(c.is_connected());
    let h = c.save(2, &t, &[]).unwrap();
    c.wait(h.id, Wanted::Durable, SEC).unwrap();
    fill(&r, 0, 4096);
    c.load(Some(2), &t).unwrap();
    let mut got = [0u8; 16];
    r.read_at(0, &mut got).unwrap();
    let want: Vec<u8> = (0..16).map(|i| (i as u8).wrapping_mul(31).wrapping_add(5)).collect();
    assert_eq!(got[..], want[..]);
    let log = fake.log();
    assert!(log.iter().filter(|l| *l == "RegisterRegion 1").count() == 2, "{log:?}");
}

#[test]
fn unreleased_saves_fail_as_not_taken_when_the_sidecar_dies() {
    let (_d, sock) = temp_socket();
    let fake = Fake::start(&sock, Opts { release_delay: Duration::from_secs(2), ..Opts::default() });
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(4096).unwrap();
    let h = c.save(1, &[TensorRef::in_region("w", "U8", &[16], &r, 0, 16)], &[]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(fake);
    let e = c.wait(h.id, Wanted::Released, SEC).err().unwrap();
    assert!(e.to_string().contains("was not taken"), "{e}");
    assert!(c.reconnect().is_err());
}

#[test]
fn free_and_close_unregister_and_remove_the_shared_memory() {
    let (_d, sock) = temp_socket();
    let fake = Fake::start(&sock, Opts::default());
    let c = Client::connect(Some(&sock)).unwrap();
    let a = c.alloc_region(4096).unwrap();
    let b = c.alloc_region(4096).unwrap();
    let (na, nb) = (format!("/dev/shm{}", a.shm_name()), format!("/dev/shm{}", b.shm_name()));
    assert!(std::path::Path::new(&na).exists() && std::path::Path::new(&nb).exists());
    c.free_region(&a).unwrap();
    drop(a);
    assert!(!std::path::Path::new(&na).exists());
    assert!(matches!(c.free_region_at(std::ptr::null()), Err(Error::UnknownRegion { .. })));
    drop(b);
    c.close();
    assert!(!std::path::Path::new(&nb).exists());
    assert!(matches!(c.list(), Err(Error::Closed)));
    let log = fake.log_when_ended();
    assert!(log.contains(&"UnregisterRegion 1".to_string()) && log.last().unwrap() == "Bye", "{log:?}");
}

/// A save of the same tensors again sends the last save's encoded list
/// (the client keeps it); any change to a tensor or to the regions makes a
/// new one. Each save's tensors, as the sidecar received and copied them,
/// are the ones of that save: names, dtypes, shapes and bytes.
#[test]
fn each_save_describes_its_tensors_as_they_are_now_though_the_last_list_is_kept() {
    let (_d, sock) = temp_socket();
    let fake = Fake::start(&sock, Opts::default());
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(8192).unwrap();
    fill(&r, 1, 8192);
    let mut step = 0;
    let mut check = |c: &Client, t: &[TensorRef], region: &ckpt::ShmRegion| {
        step += 1;
        let h = c.save(step, t, &[]).unwrap();
        c.wait(h.id, Wanted::Durable, SEC).unwrap();
        let got = fake.store.lock().unwrap().steps[&step].tensors.clone();
        assert_eq!(got.len(), t.len(), "step {step}");
        for ((info, bytes), t) in got.iter().zip(t) {
            assert_eq!(
                (info.name.as_str(), info.dtype.as_str(), &info.shape[..], info.len_bytes),
                (t.name, t.dtype, t.shape, t.len_bytes),
                "step {step}"
            );
            let mut want = vec![0u8; t.len_bytes as usize];
            region.read_at(t.ptr as u64 - region.as_ptr() as u64, &mut want).unwrap();
            assert_eq!(bytes, &want, "step {step}: {}", t.name);
        }
    };
    let a = TensorRef::in_region("a", "F32", &[2, 4], &r, 0, 32);
    let b = TensorRef::in_region("b", "U8", &[100], &r, 4096, 100);
    check(&c, &[a, b], &r);
    check(&c, &[a, b], &r); // the kept list
    fill(&r, 2, 8192); // new bytes, same tensors
    check(&c, &[a, b], &r);
    // Each field of one tensor changed in turn, and the list kept between.
    let changed = [
        TensorRef::in_region("b2", "U8", &[100], &r, 4096, 100),
        TensorRef::in_region("b", "I8", &[100], &r, 4096, 100),
        TensorRef::in_region("b", "U8", &[10, 10], &r, 4096, 100),
        TensorRef::in_region("b", "U8", &[100], &r, 2048, 100),
        TensorRef::in_region("b", "U8", &[99], &r, 4096, 99),
    ];
    for b2 in changed {
        check(&c, &[a, b2], &r);
        check(&c, &[a, b], &r);
    }
    check(&c, &[a], &r); // fewer tensors
    check(&c, &[a, b, TensorRef::in_region("c", "U8", &[8], &r, 8000, 8)], &r);
    // The same addresses in another region: the region freed and another
    // made (its id differs), the tensors at its start.
    let r2 = c.alloc_region(8192).unwrap();
    fill(&r2, 3, 8192);
    let a2 = TensorRef::in_region("a", "F32", &[2, 4], &r2, 0, 32);
    check(&c, &[a2], &r2);
    let at = r2.as_ptr() as usize;
    c.free_region(&r2).unwrap();
    drop(r2); // unmapped: the next region is usually mapped at its address
    let r3 = c.alloc_region(8192).unwrap();
    eprintln!("the next region mapped at the same address: {}", r3.as_ptr() as usize == at);
    fill(&r3, 4, 8192);
    let a3 = TensorRef::in_region("a", "F32", &[2, 4], &r3, 0, 32);
    check(&c, &[a3], &r3);
    let log = fake.log();
    assert_eq!(log.iter().filter(|l| l.starts_with("Save ")).count(), step as usize, "{log:?}");
}
