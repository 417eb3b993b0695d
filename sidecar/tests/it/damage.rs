//! Damage the sidecar can know about is visible: a load that finds a step
//! damaged and the drain's read-back of a local file that does not match
//! its index each leave a record (step, file, reason, when, by what) that
//! `status` (wire, text and `--json`) shows; the background scrub
//! (`serve --scrub-interval`) finds damage nobody loaded, records it and
//! marks the step so loads of `latest` pass over it with the reason.

use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ckpt_test_support::cli;
use ckpt_test_support::daemon::{Shm, Sidecar, HANG_BOUND};
use ckpt_wire::{Blob, ErrorCode, Reply, StatusReport, TensorDesc};

fn tensors(region_id: u32) -> Vec<TensorDesc> {
    vec![TensorDesc {
        name: "w".into(),
        dtype: "F32".into(),
        shape: vec![4096],
        region_id,
        offset_bytes: 0,
        len_bytes: 4 * 4096,
    }]
}

fn blobs(step: u64) -> Vec<Blob> {
    vec![Blob { name: "rng.state".into(), bytes: format!("rng at {step}").into_bytes() }]
}

/// The one shard of `step` in `dir`.
fn shard(dir: &Path, step: u64) -> PathBuf {
    let folder = ckpt_store::catalog::step_path(dir, step);
    std::fs::read_dir(&folder)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .expect("a shard")
}

/// Flips one byte of the shard's tensor data (past its header).
fn flip_data_byte(path: &Path) {
    let mut f = OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).unwrap();
    let at = 8 + u64::from_le_bytes(n) + 100;
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut b).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&[b[0] ^ 1]).unwrap();
}

fn file_name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

/// Asks `status` until `done` holds of its report (the drain and the scrub
/// find damage in threads of their own); HANG_BOUND only bounds a hang.
fn status_until(sc: &Sidecar, what: &str, done: impl Fn(&StatusReport) -> bool) -> StatusReport {
    let t0 = Instant::now();
    loop {
        let r = sc.client().status();
        if done(&r) {
            return r;
        }
        assert!(t0.elapsed() < HANG_BOUND, "{what}: {r:?}\n{}", sc.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `status` and `status --json` both name `step`'s damaged `file`, and what found it.
fn assert_cli_shows(sc: &Sidecar, step: u64, file: &str, by: &str) {
    let sock = sc.socket.to_str().unwrap();
    let text = cli(&["status", "--socket", sock]);
    assert_eq!(text.code, 0, "{text:?}");
    let line = text
        .stdout
        .lines()
        .find(|l| l.contains("DAMAGED") && l.split_whitespace().nth(1) == Some(&step.to_string()))
        .unwrap_or_else(|| panic!("{}", text.stdout));
    assert!(line.contains(file) && line.contains(by), "{line}");
    let j = cli(&["status", "--socket", sock, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&j.stdout).unwrap();
    let d = v["damaged"].as_array().unwrap().iter().find(|d| d["step"] == step).unwrap_or_else(|| panic!("{v}"));
    assert_eq!((d["file"].as_str(), d["found_by"].as_str()), (Some(file), Some(by)), "{d}");
    assert!(d["found_unix_s"].as_u64().unwrap() > 1_600_000_000, "{d}");
    assert!(v["damaged_total"].as_u64().unwrap() >= 1, "{v}");
}

#[test]
fn a_load_that_finds_a_step_damaged_leaves_a_record_status_shows() {
    let sc = Sidecar::start(&[]);
    let shm = Shm::new(4 * 4096);
    let mut c = sc.client_with(&shm);
    for step in [1, 2, 3] {
        c.save_durable(step, tensors(1), blobs(step));
    }
    assert!(c.status().damaged.is_empty(), "nothing found yet");
    let bad = shard(&sc.dir, 2);
    flip_data_byte(&bad);
    // Step 3 is resident (from RAM); step 2 is read from disk.
    match c.load(Some(2), vec![]) {
        Reply::Error { code: ErrorCode::Damaged, .. } => {}
        other => panic!("expected Damaged, got {other:?}"),
    }
    let r = c.status();
    let d = r.damaged.iter().find(|d| d.step == 2).unwrap_or_else(|| panic!("{r:?}"));
    assert_eq!((d.file.as_str(), d.found_by.as_str()), (file_name(&bad).as_str(), "load"));
    assert!(d.reason.contains("checksum"), "{d:?}");
    assert_cli_shows(&sc, 2, &file_name(&bad), "load");
    // Found again: the same record, not a second one.
    let _ = c.load(Some(2), vec![]);
    assert_eq!(c.status().damaged.iter().filter(|d| d.step == 2).count(), 1);
}

#[test]
fn the_drains_read_back_of_a_damaged_local_file_leaves_a_record_status_shows() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, remote) = (tmp.path().join("ckpt"), tmp.path().join("remote"));
    std::fs::create_dir(&remote).unwrap();
    let mut sc = Sidecar::start_at(tmp.path(), &dir, Sidecar::STAGING_MIB, &[], &[]);
    let shm = Shm::new(4 * 4096);
    sc.client_with(&shm).save_durable(5, tensors(1), blobs(5));
    sc.stop_ok();
    let bad = shard(&dir, 5);
    flip_data_byte(&bad);
    // Not resident after the restart: the drain reads the step from disk.
    let url = format!("file://{}", remote.display());
    let sc = Sidecar::start_at(tmp.path(), &dir, Sidecar::STAGING_MIB, &["--drain", &url], &[]);
    let r = status_until(&sc, "the drain's read-back found the damage", |r| r.damaged.iter().any(|d| d.step == 5));
    let d = r.damaged.iter().find(|d| d.step == 5).unwrap();
    assert_eq!((d.file.as_str(), d.found_by.as_str()), (file_name(&bad).as_str(), "drain"), "{d:?}");
    assert_cli_shows(&sc, 5, &file_name(&bad), "drain");
}

#[test]
fn the_scrub_finds_damage_nobody_loaded_marks_the_step_and_loads_pass_over_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let mut sc = Sidecar::start_at(tmp.path(), &dir, Sidecar::STAGING_MIB, &["--scrub-interval", "100ms"], &[]);
    let mut shm = Shm::new(4 * 4096);
    let mut c = sc.client_with(&shm);
    for step in [1, 2, 3] {
        // Other bytes each step: no shard hard-linked from the step before.
        shm.bytes_mut().fill(step as u8);
        c.save_durable(step, tensors(1), blobs(step));
    }
    // A pass over the intact steps marks nothing.
    let r =
        status_until(&sc, "a scrub pass", |r| r.scrub.as_ref().is_some_and(|s| s.passes >= 1 && s.steps_verified >= 3));
    assert!(r.damaged.is_empty(), "{r:?}");
    let bad = shard(&dir, 3);
    flip_data_byte(&bad);
    let r = status_until(&sc, "the scrub finding the damage", |r| r.damaged.iter().any(|d| d.step == 3));
    let d = r.damaged.iter().find(|d| d.step == 3).unwrap();
    assert_eq!((d.file.as_str(), d.found_by.as_str()), (file_name(&bad).as_str(), "scrub"), "{d:?}");
    assert!(d.reason.contains("checksum"), "{d:?}");
    assert_cli_shows(&sc, 3, &file_name(&bad), "scrub");
    let mark = ckpt_store::catalog::step_path(&dir, 3).join(ckpt_store::catalog::DAMAGED_MARK_NAME);
    assert!(std::fs::read_to_string(&mark).unwrap().contains(&file_name(&bad)));
    for s in [1, 2] {
        assert!(!ckpt_store::catalog::step_path(&dir, s).join(ckpt_store::catalog::DAMAGED_MARK_NAME).exists());
    }
    drop(c);
    sc.stop_ok();
    // Without the resident copy: `latest` no longer names the marked step
    // (the start's recovery says why), and a load of it passes over it.
    let sc = Sidecar::start_at(tmp.path(), &dir, Sidecar::STAGING_MIB, &[], &[]);
    assert_eq!(ckpt_store::catalog::latest_step(&dir).unwrap(), Some(2));
    assert!(sc.log_text().contains("marked damaged"), "{}", sc.log_text());
    assert!(matches!(sc.client().load(None, vec![]), Reply::Loaded { step: 2, .. }));
    match sc.client().load(Some(3), vec![]) {
        Reply::Error { code: ErrorCode::Damaged, message, .. } => {
            assert!(message.contains("marked damaged"), "{message}")
        }
        other => panic!("expected Damaged, got {other:?}"),
    }
    drop(sc);
    // ls and verify show the mark.
    let ls = cli(&["ls", dir.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&ls.stdout).unwrap_or_else(|e| panic!("{e}: {ls:?}"));
    let rows = v["checkpoints"].as_array().unwrap_or_else(|| panic!("{v}"));
    let row = |s: u64| rows.iter().find(|r| r["step"] == s).unwrap_or_else(|| panic!("{v}"));
    assert_eq!((row(3)["damaged"].as_bool(), row(2)["damaged"].as_bool()), (Some(true), Some(false)), "{v}");
    let verify = cli(&["verify", dir.to_str().unwrap()]);
    assert_eq!(verify.code, 3, "{verify:?}");
    assert!(verify.stdout.contains(ckpt_store::catalog::DAMAGED_MARK_NAME), "{verify:?}");
}

#[test]
fn the_scrub_verifies_the_drain_targets_copies_too_and_reports_a_damaged_one() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, remote) = (tmp.path().join("ckpt"), tmp.path().join("remote"));
    std::fs::create_dir(&remote).unwrap();
    let url = format!("file://{}", remote.display());
    let sc =
        Sidecar::start_at(tmp.path(), &dir, Sidecar::STAGING_MIB, &["--drain", &url, "--scrub-interval", "100ms"], &[]);
    let shm = Shm::new(4 * 4096);
    let mut c = sc.client_with(&shm);
    c.save_durable(1, tensors(1), blobs(1));
    status_until(&sc, "step 1 replicated and the target scrubbed", |r| {
        r.drain.as_ref().is_some_and(|d| d.last_replicated == Some(1))
            && r.scrub.as_ref().is_some_and(|s| s.remote_steps_verified >= 1)
    });
    let bad = shard(&remote, 1);
    flip_data_byte(&bad);
    let r = status_until(&sc, "the scrub finding the target's damage", |r| r.damaged.iter().any(|d| d.step == 1));
    let d = r.damaged.iter().find(|d| d.step == 1).unwrap();
    assert_eq!((d.file.as_str(), d.found_by.as_str()), (file_name(&bad).as_str(), "scrub_drain"), "{d:?}");
    // Reported, not marked: the local copy is intact and stays readable.
    assert!(!ckpt_store::catalog::step_path(&dir, 1).join(ckpt_store::catalog::DAMAGED_MARK_NAME).exists());
    assert!(!ckpt_store::catalog::step_path(&remote, 1).join(ckpt_store::catalog::DAMAGED_MARK_NAME).exists());
}
