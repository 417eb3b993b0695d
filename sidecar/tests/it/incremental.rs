//! Incremental checkpoints through the real binary: `serve` with
//! its default `--incremental on`, a raw client over the wire crate, tensors
//! in POSIX shared memory. Unchanged stable shards are hard-linked from the
//! previous step; every step must still load bit-equal, verify, and survive
//! rollback and gc.

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use ckpt_store::catalog;
use ckpt_store::restore::{self, ReadOptions, Which};
use ckpt_test_support::daemon::{Client, Shm, Sidecar};
use ckpt_test_support::{cli, Rng};
use ckpt_wire::{ErrorCode, Reply, Request, TensorDesc};

const MIB: u64 = 1 << 20;

/// The staging of every sidecar here: room for the 64 MiB steps.
const STAGING_MIB: u64 = 256;

/// F32 tensors of the given byte sizes, packed in region 1 (4 KiB apart).
fn f32_tensors(sizes: &[(String, u64)]) -> (Vec<TensorDesc>, usize) {
    let mut at = 0u64;
    let mut v = Vec::new();
    for (name, len) in sizes {
        v.push(TensorDesc {
            name: name.clone(),
            dtype: "F32".into(),
            shape: vec![len / 4],
            region_id: 1,
            offset_bytes: at,
            len_bytes: *len,
        });
        at += len.div_ceil(4096) * 4096;
    }
    (v, at as usize)
}

/// Disk usage of `dir` as `du` counts it (every inode once).
fn du_bytes(dir: &Path) -> u64 {
    let out = Command::new("du").arg("-s").arg("-B1").arg(dir).output().unwrap();
    assert!(out.status.success(), "du: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap().parse().unwrap()
}

fn assert_loads(dir: &Path, step: u64, want: &BTreeMap<String, Vec<u8>>) {
    let l = restore::load(dir, Which::Step(step), &ReadOptions::default(), None)
        .unwrap_or_else(|e| panic!("step {step}: {e}"));
    for (name, bytes) in want {
        assert!(l.tensor(name).unwrap() == &bytes[..], "step {step}: tensor {name} differs from what was saved");
    }
}

/// The (dev, ino) of every shard file of `step`.
fn inodes(dir: &Path, step: u64) -> HashSet<(u64, u64)> {
    std::fs::read_dir(catalog::step_path(dir, step))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| {
            let m = e.metadata().unwrap();
            (m.dev(), m.ino())
        })
        .collect()
}

/// The Bar: 64 MiB that never changes plus 1 MiB that changes every
/// step, saved as steps 1..6 with the defaults: the directory's disk usage
/// (hard links counted once) is at most 64 + 6 × 1 + 8 MiB, every step
/// loads bit-equal, verify exits 0, and after `gc --keep 2` the two kept
/// steps load bit-equal.
#[test]
fn bar_a_frozen_64_mib_and_a_changing_1_mib_saved_six_times_take_the_disk_of_one_plus_six_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    // Frozen: 16 tensors of 4 MiB. Changing: 1 MiB in three tensors (512,
    // 256 and 256 KiB), small ones that start in a bucket of their own.
    let mut sizes: Vec<(String, u64)> = (0..16).map(|i| (format!("base.layer{i:02}.weight"), 4 * MIB)).collect();
    sizes.extend([
        ("lora.a".to_string(), 512 << 10),
        ("lora.b".to_string(), 256 << 10),
        ("opt.state".to_string(), 256 << 10),
    ]);
    let (descs, len) = f32_tensors(&sizes);
    let mut shm = Shm::new(len);
    ckpt_store::synthetic::fill(shm.bytes_mut(), 7);
    let mut sc = Sidecar::start_at(tmp.path(), &dir, STAGING_MIB, &[], &[]);
    let mut c = sc.client_with(&shm);
    let mut saved: BTreeMap<u64, BTreeMap<String, Vec<u8>>> = BTreeMap::new();
    for step in 1..=6u64 {
        for d in descs.iter().filter(|d| !d.name.starts_with("base.")) {
            let r = d.offset_bytes as usize..(d.offset_bytes + d.len_bytes) as usize;
            ckpt_store::synthetic::fill(&mut shm.bytes_mut()[r], 1000 + step);
        }
        c.save_durable(step, descs.clone(), vec![]);
        saved.insert(step, descs.iter().map(|d| (d.name.clone(), shm.of(d).to_vec())).collect());
    }
    drop(c);
    sc.stop_ok();
    let du = du_bytes(&dir);
    println!("du of 6 steps: {du} bytes ({:.1} MiB)", du as f64 / MIB as f64);
    assert!(du <= (64 + 6 + 8) * MIB, "disk usage {du} bytes is above 64 + 6 × 1 + 8 MiB:\n{}", sc.log_text());
    for (step, want) in &saved {
        assert_loads(&dir, *step, want);
    }
    let (code, out) = cli(&["verify", dir.to_str().unwrap()]).joined();
    assert_eq!(code, 0, "{out}");
    let (code, out) = cli(&["gc", dir.to_str().unwrap(), "--keep", "2"]).joined();
    assert_eq!(code, 0, "{out}");
    assert_eq!(catalog::committed_steps(&dir).unwrap(), vec![5, 6]);
    assert_loads(&dir, 5, &saved[&5]);
    assert_loads(&dir, 6, &saved[&6]);
    let (code, out) = cli(&["verify", dir.to_str().unwrap()]).joined();
    assert_eq!(code, 0, "{out}");
}

/// Randomized: between saves, 0, 1 or many tensors change in one element
/// each; a change is never missed (every step loads bit-equal to what was
/// saved), also after a rollback to an older step and saves after it, and
/// after gc of earlier steps; unchanged big tensors share inodes.
#[test]
fn a_change_of_one_element_is_never_missed_across_rollback_and_gc() {
    let seed = ckpt_test_support::seed_from_env(
        "CKPT_TEST_SEED",
        21,
        "a_change_of_one_element_is_never_missed_across_rollback_and_gc",
    );
    let mut rng = Rng::new(seed);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let mut sizes: Vec<(String, u64)> = Vec::new();
    for i in 0..24 {
        // Big (own shards), middling and small (buckets) tensors.
        let len = match i % 3 {
            0 => MIB + 4 * rng.below(1 << 16),
            1 => 4 * (1 + rng.below(64 << 10)),
            _ => 4 * (1 + rng.below(1 << 10)),
        };
        sizes.push((format!("t{i:02}"), len));
    }
    let (descs, len) = f32_tensors(&sizes);
    let mut shm = Shm::new(len);
    ckpt_store::synthetic::fill(shm.bytes_mut(), seed);
    let mut sc = Sidecar::start_at(tmp.path(), &dir, STAGING_MIB, &["--full-every", "0"], &[]);
    let mut c = sc.client_with(&shm);
    let mut saved: BTreeMap<u64, BTreeMap<String, Vec<u8>>> = BTreeMap::new();
    let mut step = 0u64;
    let save_round = |c: &mut Client,
                      shm: &mut Shm,
                      step: u64,
                      rng: &mut Rng,
                      saved: &mut BTreeMap<u64, BTreeMap<String, Vec<u8>>>| {
        let n = match rng.below(3) {
            0 => 0,
            1 => 1,
            _ => 2 + rng.below(descs.len() as u64 - 2) as usize,
        };
        let mut picked: Vec<usize> = (0..descs.len()).collect();
        for k in 0..n {
            let j = k + rng.below((descs.len() - k) as u64) as usize;
            picked.swap(k, j);
        }
        for &k in &picked[..n] {
            let d = &descs[k];
            // One element (4 bytes) changes, at a random place.
            let at = d.offset_bytes as usize + 4 * rng.below(d.len_bytes / 4) as usize;
            let b = shm.bytes_mut();
            b[at] = b[at].wrapping_add(1 + rng.below(255) as u8);
        }
        c.save_durable(step, descs.clone(), vec![]);
        saved.insert(step, descs.iter().map(|d| (d.name.clone(), shm.of(d).to_vec())).collect());
    };
    for _ in 0..10 {
        step += 1;
        save_round(&mut c, &mut shm, step, &mut rng, &mut saved);
        assert_loads(&dir, step, &saved[&step]);
    }
    // Unchanged tensors' shards are shared with the step before (somewhere
    // in ten steps of 0, 1 or many changes).
    let shared: usize = (1..10).map(|s| inodes(&dir, s).intersection(&inodes(&dir, s + 1)).count()).sum();
    // Back to step 6, then on from there: nothing of steps 7..10 may be linked.
    match c.rollback(6) {
        Reply::RolledBack { step: 6, .. } => {}
        other => panic!("rollback to 6: {other:?}"),
    }
    for s in 7..=10 {
        saved.remove(&s);
    }
    // The state goes on from what step 10 saved (the trainer's memory), as a
    // trainer that rolled back and reloaded would not; either way every
    // step must hold exactly what it saved.
    step = 6;
    for _ in 0..6 {
        step += 1;
        save_round(&mut c, &mut shm, step, &mut rng, &mut saved);
    }
    drop(c);
    sc.stop_ok();
    for (s, want) in &saved {
        assert_loads(&dir, *s, want);
    }
    let (code, out) = cli(&["verify", dir.to_str().unwrap()]).joined();
    assert_eq!(code, 0, "{out}");
    let (code, out) = cli(&["gc", dir.to_str().unwrap(), "--keep", "3"]).joined();
    assert_eq!(code, 0, "{out}");
    for s in catalog::committed_steps(&dir).unwrap() {
        assert_loads(&dir, s, &saved[&s]);
    }
    assert!(shared > 0, "no shard shared between consecutive steps 1..10 (seed {seed})");
    let (code, out) = cli(&["verify", dir.to_str().unwrap()]).joined();
    assert_eq!(code, 0, "{out}");
}

/// A flipped byte in a shard that several steps share (one inode) is
/// damage in every one of them, and verify says which steps share it.
#[test]
fn a_flipped_byte_in_a_shared_shard_is_reported_for_every_step_that_links_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let (descs, len) = f32_tensors(&[("frozen".to_string(), 2 * MIB), ("moving".to_string(), 64 << 10)]);
    let mut shm = Shm::new(len);
    ckpt_store::synthetic::fill(shm.bytes_mut(), 3);
    let mut sc = Sidecar::start_at(tmp.path(), &dir, STAGING_MIB, &[], &[]);
    let mut c = sc.client_with(&shm);
    for step in 1..=4u64 {
        let d = &descs[1];
        shm.bytes_mut()[d.offset_bytes as usize] = step as u8;
        c.save_durable(step, descs.clone(), vec![]);
    }
    drop(c);
    sc.stop_ok();
    let index = restore::read_index(&dir, 4).unwrap();
    let file = index.ckpt.tensors["frozen"].file.clone();
    let path = catalog::step_path(&dir, 4).join(&file);
    let ino = std::fs::metadata(&path).unwrap().ino();
    // The stable shards' numbers may change between steps (a link takes the new name).
    let frozen_ino = |s: u64| {
        std::fs::metadata(
            catalog::step_path(&dir, s).join(&restore::read_index(&dir, s).unwrap().ckpt.tensors["frozen"].file),
        )
        .unwrap()
        .ino()
    };
    let sharing: Vec<u64> = (1..=4).filter(|&s| frozen_ino(s) == ino).collect();
    assert_eq!(sharing, vec![1, 2, 3, 4], "the frozen tensor's shard is one inode in every step");
    // Flip one byte of the frozen tensor's data (the file is read-only to no one here).
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap_or_else(|e| panic!("{e}"));
    // Written in place: still one inode.
    assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino);
    let (code, out) = cli(&["verify", dir.to_str().unwrap()]).joined();
    assert_eq!(code, 3, "{out}");
    for s in 1..=4 {
        assert!(out.contains(&format!("step {s}: DAMAGED")), "step {s} not reported damaged:\n{out}");
    }
    assert!(out.contains("is shared by steps 1, 2, 3, 4"), "no sharing line:\n{out}");
    // verify --json names the shared file per step (a link may take another name).
    let (_, out) = cli(&["verify", dir.to_str().unwrap(), "--json"]).joined();
    let j: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let names = &j["shared_damage"][0]["names"];
    for s in 1..=4u64 {
        let want = &restore::read_index(&dir, s).unwrap().ckpt.tensors["frozen"].file;
        assert_eq!(names[s.to_string()].as_str(), Some(want.as_str()), "{j}");
    }
    // After a restart (nothing resident), a load of latest says that no
    // step loads, each step tried, and the one shared file.
    let sc = Sidecar::start_at(tmp.path(), &dir, STAGING_MIB, &[], &[]);
    let mut c = sc.client_with(&shm);
    match c.load(None, descs.clone()) {
        Reply::Error { code: ErrorCode::Damaged, message, .. } => {
            assert!(message.contains("no committed step loads"), "{message}");
            for s in 1..=4 {
                assert!(message.contains(&format!("step {s}: ")), "step {s} not named: {message}");
            }
            assert!(message.contains("share one damaged file") && message.contains(&file), "{message}");
        }
        other => panic!("expected Damaged, got {other:?}"),
    }
}

/// `--incremental off` writes every step in full and records no digests.
#[test]
fn incremental_off_links_nothing_and_writes_no_digests() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let (descs, len) = f32_tensors(&[("frozen".to_string(), 2 * MIB)]);
    let mut shm = Shm::new(len);
    ckpt_store::synthetic::fill(shm.bytes_mut(), 5);
    let mut sc = Sidecar::start_at(tmp.path(), &dir, STAGING_MIB, &["--incremental", "off"], &[]);
    let mut c = sc.client_with(&shm);
    for step in 1..=2u64 {
        c.save_durable(step, descs.clone(), vec![]);
    }
    drop(c);
    sc.stop_ok();
    assert!(inodes(&dir, 1).is_disjoint(&inodes(&dir, 2)));
    let index = restore::read_index(&dir, 2).unwrap();
    assert!(index.ckpt.tensors.values().all(|t| t.xxh128.is_none()));
}

/// SIGKILL of the sidecar while it links a step's shards (after its k-th
/// link, for every k through three steps' links): no step that `ls` lists
/// fails `verify` or loads other bytes than were saved, and a sidecar
/// started on the directory afterwards (recovery) saves on, linking again.
#[test]
fn sigkill_while_linking_leaves_no_listed_step_that_fails_verify() {
    let (descs, len) = f32_tensors(&[
        ("f0".to_string(), MIB),
        ("f1".to_string(), 2 * MIB),
        ("f2".to_string(), MIB + 4096),
        ("moving".to_string(), 64 << 10),
    ]);
    // Steps 2 and 3 link three files each (f0, f1, f2).
    for k in 1..=7u64 {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        let mut shm = Shm::new(len);
        ckpt_store::synthetic::fill(shm.bytes_mut(), k);
        let kv = k.to_string();
        let mut sc = Sidecar::start_at(
            tmp.path(),
            &dir,
            STAGING_MIB,
            &["--full-every", "0"],
            &[(ckpt_store::incremental::TEST_KILL_AFTER_LINKS_ENV, &kv)],
        );
        let mut c = sc.client_with(&shm);
        let mut saved: BTreeMap<u64, BTreeMap<String, Vec<u8>>> = BTreeMap::new();
        let moving = descs[3].offset_bytes as usize;
        for step in 1..=4u64 {
            shm.bytes_mut()[moving] = step as u8;
            let id = c.call(|id| Request::Save {
                id,
                step,
                tensors: descs.clone(),
                blobs: vec![],
                lazy_release: step % 2 == 1,
                unchanged: None,
            });
            let snapshot: BTreeMap<String, Vec<u8>> =
                descs.iter().map(|d| (d.name.clone(), shm.of(d).to_vec())).collect();
            let durable = loop {
                match ckpt_wire::read_frame::<Reply>(&mut c.s) {
                    Ok(Reply::Released { .. }) => {}
                    Ok(Reply::Durable { id: i, .. }) if i == id => break true,
                    Ok(other) => panic!("k={k} step {step}: {other:?}"),
                    Err(_) => break false,
                }
            };
            // A save may be committed without its Durable reaching us.
            saved.insert(step, snapshot);
            if !durable {
                break;
            }
        }
        let status = sc.child.as_mut().unwrap().wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL),
            "k={k}: the sidecar was not killed while linking:\n{}",
            sc.log_text()
        );
        sc.child = None;
        let listed = catalog::readable_steps(&dir).unwrap();
        let (code, out) = cli(&["verify", dir.to_str().unwrap()]).joined();
        assert_eq!(code, 0, "k={k}: listed {listed:?}:\n{out}");
        for s in &listed {
            assert_loads(&dir, *s, &saved[s]);
        }
        // Recovery, then saves that link again.
        let mut sc = Sidecar::start_at(tmp.path(), &dir, STAGING_MIB, &[], &[]);
        let mut c = sc.client_with(&shm);
        let next = listed.last().map_or(1, |s| s + 1);
        for step in next..next + 2 {
            shm.bytes_mut()[moving] = step as u8;
            c.save_durable(step, descs.clone(), vec![]);
            saved.insert(step, descs.iter().map(|d| (d.name.clone(), shm.of(d).to_vec())).collect());
        }
        drop(c);
        sc.stop_ok();
        for s in catalog::readable_steps(&dir).unwrap() {
            assert_loads(&dir, s, &saved[&s]);
        }
        let (code, out) = cli(&["verify", dir.to_str().unwrap()]).joined();
        assert_eq!(code, 0, "k={k}:\n{out}");
        assert!(
            std::fs::read_dir(&dir).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().starts_with(".tmp-")),
            "k={k}: a temp folder stayed"
        );
    }
}
