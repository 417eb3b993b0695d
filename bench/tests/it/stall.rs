//! `bench stall` through the real binary: it starts its own sidecar, saves
//! through the real client, and prints one JSON object last. Only that the
//! figures exist and are sane is checked here; the bars are for the bench.

use std::path::Path;
use std::process::Command;

use ckpt_store::catalog;
use ckpt_store::restore::{self, ReadOptions};

/// `ckpt-sidecar bench stall` runs ckpt-bench beside it; both are built into
/// the same folder as this package's binary.
fn sidecar_bin() -> &'static Path {
    let p = ckpt_test_support::sidecar_bin();
    assert_eq!(p, Path::new(env!("CARGO_BIN_EXE_ckpt-bench")).with_file_name("ckpt-sidecar"));
    assert!(p.is_file(), "{} is missing: build the workspace first (cargo build --release --workspace)", p.display());
    p
}

fn bench_stall(dir: &Path, extra: &[&str]) -> serde_json::Value {
    let out = Command::new(sidecar_bin())
        .args(["bench", "stall", "--dir"])
        .arg(dir)
        .args(["--size", "16MiB", "--json"])
        .args(extra)
        .env_remove("CKPT_SIDECAR_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench stall failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // Human lines first, the JSON object last.
    assert!(stdout.lines().count() > 5, "{stdout}");
    serde_json::from_str(stdout.lines().last().unwrap())
        .unwrap_or_else(|e| panic!("last line is not JSON ({e}):\n{stdout}"))
}

fn positive(j: &serde_json::Value, key: &str) -> f64 {
    let v = j[key].as_f64().unwrap_or_else(|| panic!("{key} missing or not a number in {j}"));
    assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    v
}

#[test]
fn bench_stall_prints_sane_figures_and_leaves_committed_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    // A Python that runs but cannot time torch.save (here: one that fails).
    let j = bench_stall(&dir, &["--repeats", "2", "--python", "/bin/false"]);
    assert_eq!(j["op"], "stall");
    assert_eq!(j["memory"], "pre-faulted");
    let bytes = positive(&j, "bytes");
    assert!((14e6..=18e6).contains(&bytes), "bytes {bytes}");
    assert!(positive(&j, "file_bytes") >= bytes);
    let median = positive(&j, "stall_seconds_median");
    let max = positive(&j, "stall_seconds_max");
    assert!(max >= median);
    assert!(positive(&j, "copy_seconds_median") <= max);
    positive(&j, "memcpy_seconds_median");
    positive(&j, "stall_over_memcpy");
    positive(&j, "persist_gib_per_s");
    positive(&j, "release_to_durable_seconds_median");
    for key in ["stall_seconds", "copy_seconds", "persist_seconds"] {
        let v = j[key].as_array().unwrap_or_else(|| panic!("{key} in {j}"));
        assert_eq!(v.len(), 2, "{key}");
        assert!(v.iter().all(|x| x.as_f64().is_some_and(|x| x.is_finite() && x > 0.0)), "{key}: {v:?}");
    }
    assert!(j["memcpy_seconds"].as_array().unwrap().len() >= 2);
    // Memory: staging holds two images; the sidecar's own memory includes it,
    // its VmRSS also counts the client's region it maps.
    let staging = positive(&j, "staging_bytes");
    assert!(staging >= 2.0 * bytes, "staging {staging} for {bytes}");
    let anon = positive(&j, "sidecar_rss_anon_bytes");
    let rss = positive(&j, "sidecar_rss_bytes");
    assert!(rss >= anon);
    assert!(positive(&j, "sidecar_rss_shmem_bytes") >= bytes * 0.9, "the region is mapped and populated");
    // No fio asked for; a Python that fails gives null and says why.
    assert!(j["fio_gib_per_s"].is_null() && j["persist_over_fio"].is_null());
    assert!(j["torch_save_seconds"].is_null());
    assert!(j["torch_note"].as_str().is_some_and(|s| s.contains("/bin/false")), "{}", j["torch_note"]);

    assert_eq!(j["steps"], serde_json::json!([1, 2]));
    assert_eq!(catalog::committed_steps(&dir).unwrap(), vec![1, 2]);
    assert_eq!(catalog::latest_step(&dir).unwrap(), Some(2));
    for step in [1, 2] {
        let r = restore::verify(&dir, step, &ReadOptions::default(), |_, _| {}).unwrap();
        assert!(r.problems.is_empty(), "step {step}: {:?}", r.problems);
    }

    // A second run continues after the newest step and keeps the others.
    let j = bench_stall(&dir, &["--repeats", "1"]);
    assert_eq!(j["steps"], serde_json::json!([3]));
    assert!(j["torch_save_seconds"].is_null() && j["torch_note"].is_null());
    assert_eq!(catalog::committed_steps(&dir).unwrap(), vec![1, 2, 3]);
    // Nothing of the bench is left beside the checkpoints.
    let stray: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with("step-") && n != "latest")
        .collect();
    assert!(stray.is_empty(), "{stray:?}");
}

#[test]
fn bench_stall_with_a_python_that_is_not_there_fails_at_once_and_creates_nothing() {
    // It used to run the whole bench and exit 0 with a note.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let out = Command::new(sidecar_bin())
        .args(["bench", "stall", "--dir"])
        .arg(&dir)
        .args(["--size", "1MiB", "--python", "/nonexistent/python3"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim(), "error: --python /nonexistent/python3: no such program (give the path of an executable)");
    assert!(!dir.exists());
}
