//! The drain as the operator sees it, through the real binary: a target
//! that is not there is refused at the start, and what `status` and
//! `/metrics` say about the drain.

use std::process::Command;

use ckpt_test_support::sidecar_bin;

#[test]
fn serve_refuses_a_missing_file_drain_target_naming_it_and_creates_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("mnt/shared/ckpt");
    let out = Command::new(sidecar_bin())
        .arg("serve")
        .arg("--dir")
        .arg(tmp.path().join("ckpt"))
        .arg("--socket")
        .arg(tmp.path().join("s.sock"))
        .args(["--staging", "16MiB"])
        .arg("--drain")
        .arg(format!("file://{}", missing.display()))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("no such directory: {}", missing.display())), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!tmp.path().join("mnt").exists(), "the drain target's folder was created");
}
