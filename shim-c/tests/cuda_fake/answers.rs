//! Answers a real driver may give where the fake used to be lenient, and a
//! sidecar alive but stuck: each a way a training step could run unguarded
//! or a stream could hang. The fake's switches: `CKPT_FAKE_CUDA_REFUSE`
//! (stream waits, device pointers of memory registered without DEVICEMAP),
//! graph capture (cuStreamBeginCapture_v2), a query of an event whose
//! exporter died (an error), a blocking event open
//! (`FAKE_CUDA_EVENT_OPEN_DELAY_US`), MIG (`CKPT_FAKE_CUDA_MIG`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{committed, fake_dir, run, sidecar, sweep_fake_memory, trainer, trainer_cmd, Serve};
use crate::support::text;
use ckpt::{BlobRef, Client, TensorRef, Wanted};
use ckpt_test_support::kill9;

/// A driver without stream memory operations (`cuStreamWaitValue32`:
/// NOT_SUPPORTED): the guarded step waits for Released on the CPU, so the
/// next step's write, queued at once on the save's stream, stays out of the
/// snapshot (the sidecar's copies are 1.5 s late). Before, the refusal was
/// an error the guard let pass, and the step ran while the sidecar copied.
#[test]
fn a_refused_stream_wait_makes_the_guarded_step_wait_on_the_cpu_and_keeps_the_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start_with_delay(tmp.path(), true, Some(1_500_000));
    let mut cmd = trainer_cmd(&exe, tmp.path(), "guard", 2_000);
    cmd.env("CKPT_FAKE_CUDA_REFUSE", "stream_wait,devptr_without_devicemap");
    let o = run(cmd);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("on_stream=0 state=not-pending") && out.contains("snapshot=saved"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("wait for Released on the CPU instead"), "{}", text(&o));
}

/// A sidecar alive but stuck (SIGSTOPped while the trainer's stream waits
/// on its copy): once the client's deadline (set short here by its
/// environment variable) passes, the save fails saying why, the stream goes
/// on (device work on it completes) and the trainer trains on. Resumed, the
/// sidecar finds its client gone and commits nothing of that copy.
#[test]
fn a_stopped_sidecar_fails_the_guarded_save_after_the_deadline_and_the_stream_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let mut serve = Serve::start_with_delay(tmp.path(), true, Some(5_000_000));
    let mut cmd = trainer_cmd(&exe, tmp.path(), "sidecar-dies-guarded", 2_000);
    cmd.env(ckpt::client::STREAM_WAIT_DEADLINE_ENV, "1000").env_remove("CKPT_FAKE_CUDA_REFUSE");
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "guarded on_stream=1", "the stream wait was queued while the copy ran");
    let sidecar_pid = serve.pid() as i32;
    // SAFETY: signals our own child, the sidecar.
    assert_eq!(unsafe { libc::kill(sidecar_pid, libc::SIGSTOP) }, 0);
    let pid = child.id();
    // Bounded: a stream that waits for ever leaves the trainer hanging.
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(90) {
            kill9(&mut child);
            // SAFETY: as above.
            unsafe { libc::kill(sidecar_pid, libc::SIGCONT) };
            panic!("the trainer hung: its stream still waits on the stopped sidecar's copy");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    sweep_fake_memory(pid);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(sidecar_pid, libc::SIGCONT) }, 0);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("trained on"), "{}", text(&out));
    assert!(
        err.contains("did not release") && err.contains(ckpt::client::STREAM_WAIT_DEADLINE_ENV),
        "the save's error says why: {}",
        text(&out)
    );
    serve.wait_for("the copy given up", |s| s.log().contains("session ended"));
    assert!(committed(&tmp.path().join("ck")).is_empty(), "nothing may commit:\n{}", serve.log());
    // Killed, not drained: its fake copies are seconds late by design. (A
    // dropped Child is not killed: it outlived the test run, for good.)
    kill9(&mut serve.child.take().expect("running"));
}

/// CUDA-graph capture: an event recorded on a capturing stream is never
/// recorded (the fake's poll then says done at once, as a real one does),
/// so a save there is refused, saying why; a guarded step on a capturing
/// stream waits on the CPU (a captured stream wait would replay stale).
#[test]
fn a_save_on_a_capturing_stream_is_refused_and_a_guard_there_waits_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start_with_delay(tmp.path(), true, Some(300_000));
    let o = run(trainer_cmd(&exe, tmp.path(), "capture", 2_000));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success()
            && out.contains("capture-save=refused:")
            && out.contains("capturing a CUDA graph")
            && out.contains("capture-guard on_stream=0 state=not-pending"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    assert_eq!(committed(&tmp.path().join("ck")), vec![4]);
}

/// An event open that hangs in the driver (an import seen blocking on a
/// busy GPU; here `FAKE_CUDA_EVENT_OPEN_DELAY_US`, an hour) runs on a
/// thread of its own: meanwhile another client's save commits, and when the
/// trainer goes its session ends and its save fails, saying so. Before,
/// the open ran on the session thread, which it held for the hour.
#[test]
fn a_hung_event_open_holds_neither_its_session_nor_another() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start_with_env(tmp.path(), true, None, &[("FAKE_CUDA_EVENT_OPEN_DELAY_US", "3600000000")]);
    let mut child = trainer_cmd(&exe, tmp.path(), "die-before-release", 2_000)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "saved", "{line}");
    // Another client saves host memory and it commits while the open hangs.
    let c = Client::connect(Some(&tmp.path().join("s.sock"))).unwrap();
    let region = c.alloc_region(4096).unwrap();
    let t = [TensorRef::in_region("h", "U8", &[4096], &region, 0, 4096)];
    let blobs: [BlobRef; 0] = [];
    let h = c.save(9, &t, &blobs).unwrap();
    c.wait(h.id, Wanted::Durable, Some(Duration::from_secs(60))).unwrap();
    kill9(&mut child);
    sweep_fake_memory(child.id());
    serve.wait_for("the trainer's session ended", |s| s.log().contains("into opening its CUDA event"));
    assert_eq!(committed(&tmp.path().join("ck")), vec![9], "{}", serve.log());
    c.close();
}

/// MIG: the driver names a MIG instance `MIG-…` (`cuDeviceGetUuid_v2` gives
/// the instance's UUID, the legacy call its GPU's); doctor says so and warns
/// that legacy IPC is not supported there.
#[test]
fn doctor_names_a_mig_instance_as_the_driver_does_and_warns_of_legacy_ipc() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(sidecar())
        .arg("doctor")
        .arg(tmp.path())
        .arg("--json")
        .env("LD_LIBRARY_PATH", fake_dir())
        .env("CKPT_FAKE_CUDA_MIG", "1")
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    let d = &j["cuda"]["devices"][0];
    assert_eq!(d["uuid"], "MIG-66616b65-6375-6461-2d75-7569642dd000", "{j}");
    assert_eq!(d["mig"], true, "{j}");
    assert!(d["warning"].as_str().unwrap().contains("not supported under MIG"), "{j}");
}
