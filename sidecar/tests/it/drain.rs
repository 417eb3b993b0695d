//! The drain as the operator sees it, through the real binary: a target
//! that is not there is refused at the start, and what `status` and
//! `/metrics` say about the drain.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Instant;

use ckpt_test_support::daemon::HANG_BOUND;
use ckpt_test_support::sidecar_bin;

/// The child's output once it exits; killed (and the test failed) once it
/// listens on `socket` (it started after all), or at the hang bound.
fn exit_before_listening(mut child: Child, socket: &Path) -> Output {
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if socket.exists() || t0.elapsed() > HANG_BOUND {
            child.kill().unwrap();
            panic!("the sidecar started: {:?}", child.wait_with_output().unwrap());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn serve_refuses_a_missing_file_drain_target_naming_it_and_creates_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("mnt/shared/ckpt");
    let child = Command::new(sidecar_bin())
        .arg("serve")
        .arg("--dir")
        .arg(tmp.path().join("ckpt"))
        .arg("--socket")
        .arg(tmp.path().join("s.sock"))
        .args(["--staging", "16MiB"])
        .arg("--drain")
        .arg(format!("file://{}", missing.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = exit_before_listening(child, &tmp.path().join("s.sock"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("no such directory: {}", missing.display())), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!tmp.path().join("mnt").exists(), "the drain target's folder was created");
}
