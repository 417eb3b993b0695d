//! The CUDA path through the real sidecar and the real C shim, with the
//! test-only fake driver (`ckpt-fake-cuda`: libcuda.so.1 on host memory,
//! cross-process IPC handles and events, async copies that finish late on
//! purpose). The sidecar and the C trainer (tests/c/cuda_trainer.c) find
//! it through LD_LIBRARY_PATH set here for the processes started, exactly
//! as they would find a real driver.
//!
//! Their own test binary (`cargo test --release -p ckpt-shim --test
//! cuda_fake`), apart from `it`: the suite is also run whole under each
//! `CKPT_FAKE_CUDA_REFUSE` answer of the fake. They need a built
//! `ckpt-sidecar` (this profile's, else the release one: cargo build
//! --release); they fail, never skip, without it.

// Shared with tests/it; not every helper of it is used here.
#[allow(dead_code)]
#[path = "../it/support.rs"]
mod support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod answers;

use crate::support::{lib_dir, text};
use ckpt::{BlobRef, Client, TensorRef, Wanted};
use ckpt_test_support::{kill9, terminate};

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// This profile's ckpt-sidecar, else the release one: `cargo test -p
/// ckpt-shim` builds no binary of another crate, and the suite is most often
/// run without `--release` after the workspace's release build.
pub(crate) fn sidecar() -> PathBuf {
    let own = ckpt_test_support::sidecar_bin().to_path_buf();
    if own.exists() {
        return own;
    }
    let release = own.parent().and_then(Path::parent).map(|t| t.join("release").join("ckpt-sidecar"));
    match release.filter(|r| r.exists()) {
        Some(r) => {
            eprintln!("{} missing: using {}", own.display(), r.display());
            r
        }
        None => panic!("{} missing: run `cargo build --release --workspace` first", own.display()),
    }
}

pub(crate) fn fake_dir() -> PathBuf {
    let d = ckpt_fake_cuda::dir();
    assert!(d.join("libcuda.so.1").exists(), "the fake driver is missing from {}", d.display());
    d
}

/// Builds tests/c/cuda_trainer.c against libckpt and the fake libcuda.so.1.
pub(crate) fn trainer(tmp: &Path) -> PathBuf {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let exe = tmp.join("cuda_trainer");
    let (lib, fake) = (lib_dir(), fake_dir());
    let o = Command::new(&cc)
        .args(["-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Werror"])
        .arg(format!("-I{}", crate_dir().join("include").display()))
        .arg(crate_dir().join("tests/c/cuda_trainer.c"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg("-lckpt")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg(format!("-L{}", fake.display()))
        .arg("-l:libcuda.so.1")
        .output()
        .expect("running the C compiler");
    assert!(o.status.success(), "compiling cuda_trainer.c failed:\n{}", String::from_utf8_lossy(&o.stderr));
    exe
}

pub(crate) struct Serve {
    pub(crate) child: Option<Child>,
    log: PathBuf,
    stats: PathBuf,
}

impl Serve {
    /// The real sidecar; with `fake`, the fake driver's folder on its
    /// LD_LIBRARY_PATH and its counters in `stats`.
    pub(crate) fn start(tmp: &Path, fake: bool) -> Serve {
        Serve::start_with_delay(tmp, fake, None)
    }

    /// As [`Serve::start`]; the sidecar's own device copies late by `delay_us`.
    pub(crate) fn start_with_delay(tmp: &Path, fake: bool, delay_us: Option<u64>) -> Serve {
        Serve::start_with_env(tmp, fake, delay_us, &[])
    }

    /// As [`Serve::start_with_delay`], with more environment for the sidecar.
    pub(crate) fn start_with_env(tmp: &Path, fake: bool, delay_us: Option<u64>, env: &[(&str, &str)]) -> Serve {
        let (dir, sock, log, stats) = (tmp.join("ck"), tmp.join("s.sock"), tmp.join("sidecar.log"), tmp.join("stats"));
        std::fs::create_dir_all(&stats).unwrap();
        let mut cmd = Command::new(sidecar());
        cmd.args(["serve", "--staging", "64MiB", "--dir"]).arg(&dir).arg("--socket").arg(&sock);
        cmd.env("CKPT_SIDECAR_LOG", "info").env("FAKE_CUDA_STATS_DIR", &stats).env_remove("LD_LIBRARY_PATH");
        if fake {
            cmd.env("LD_LIBRARY_PATH", fake_dir());
        }
        if let Some(d) = delay_us {
            cmd.env("FAKE_CUDA_COPY_DELAY_US", d.to_string());
        }
        cmd.envs(env.iter().copied());
        let child = cmd.stdout(Stdio::null()).stderr(std::fs::File::create(&log).unwrap()).spawn().unwrap();
        let t0 = Instant::now();
        while std::os::unix::net::UnixStream::connect(&sock).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "serve did not come up:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Serve { child: Some(child), log, stats }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The fake driver's counter `key` in the sidecar's process.
    pub(crate) fn stat(&self, key: &str) -> Option<i64> {
        let s = std::fs::read_to_string(self.stats.join(self.pid().to_string())).ok()?;
        s.lines().find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
    }

    /// Waits until `cond` holds (generous: CI is loaded).
    pub(crate) fn wait_for(&self, what: &str, cond: impl Fn(&Serve) -> bool) {
        let t0 = Instant::now();
        while !cond(self) {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "timed out waiting for {what}; sidecar log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = terminate(&mut c, Duration::from_secs(20));
        }
    }
}

/// The trainer's command: the fake driver on its search path, its own
/// device copies late by `delay_us`.
pub(crate) fn trainer_cmd(exe: &Path, tmp: &Path, mode: &str, delay_us: u64) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg(mode)
        .env("LD_LIBRARY_PATH", fake_dir())
        .env("FAKE_CUDA_COPY_DELAY_US", delay_us.to_string())
        .env("CKPT_SIDECAR_SOCKET", tmp.join("s.sock"))
        .env_remove("CKPT_SIDECAR_PRELOAD");
    cmd
}

/// Runs a trainer to its end (or death), then removes the fake device
/// memory it left in /dev/shm.
pub(crate) fn run(mut cmd: Command) -> Output {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    sweep_fake_memory(pid);
    out
}

/// Removes the fake device memory a killed trainer left in /dev/shm.
pub(crate) fn sweep_fake_memory(pid: u32) {
    for e in std::fs::read_dir("/dev/shm").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&format!("fakecuda-{pid}-")) || name.starts_with(&format!("fakecuda-ev-{pid}-")) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The committed steps in `dir` (`ckpt-sidecar ls --json`).
pub(crate) fn committed(dir: &Path) -> Vec<u64> {
    let o = Command::new(sidecar()).arg("ls").arg(dir).arg("--json").output().unwrap();
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    j["checkpoints"].as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect()
}

/// Starts a trainer, waits for its first line to be `line`, then until the
/// sidecar's state says `what` (`cond`), and SIGKILLs it.
pub(crate) fn kill_when(mut cmd: Command, line: &str, serve: &Serve, what: &str, cond: impl Fn(&Serve) -> bool) {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut first).unwrap();
    if first.trim() != line {
        kill9(&mut child);
        panic!("the trainer said {first:?}, not {line:?}: {}", text(&child.wait_with_output().unwrap()));
    }
    serve.wait_for(what, cond);
    kill9(&mut child);
    sweep_fake_memory(child.id());
}

fn verify(dir: &Path) -> Output {
    Command::new(sidecar()).arg("verify").arg(dir).output().unwrap()
}

#[test]
fn device_memory_round_trips_bit_exact_behind_the_trainers_event() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    // The trainer's own copies finish 300 ms late: without the sidecar's
    // stream wait on the trainer's event, the snapshot would hold the
    // bytes from before them (the C trainer checks what it loads back).
    let o = run(trainer_cmd(&exe, tmp.path(), "roundtrip", 300_000));
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    let v = verify(&tmp.path().join("ck"));
    assert!(v.status.success(), "{}", text(&v));
    // Every import was closed when the client left; staging was page-locked once.
    serve.wait_for("imports closed", |s| s.stat("imports_open") == Some(0));
    assert!(serve.stat("imports_total").unwrap() >= 3, "three allocations were imported");
    assert_eq!(serve.stat("host_registered"), Some(1));
    // What opening and closing each request's legacy imports cost, in the log.
    let log = serve.log();
    assert!(
        log.lines().any(|l| l.contains("legacy CUDA imports of the last request opened and closed")
            && l.contains("open_ms=")
            && l.contains("close_ms=")),
        "{log}"
    );
}

#[test]
fn many_allocations_with_tensors_at_offsets_round_trip_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    let o = run(trainer_cmd(&exe, tmp.path(), "many", 2_000));
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    serve.wait_for("imports closed", |s| s.stat("imports_open") == Some(0));
    // Each legacy allocation opened three times, each closed again: checked
    // at registration, for the save, for the load (none outlives its request).
    assert_eq!(serve.stat("imports_total"), Some(3 * 64));
}

#[test]
fn a_sidecar_without_a_driver_refuses_device_memory_saying_why() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), false);
    let o = run(trainer_cmd(&exe, tmp.path(), "refused", 2_000));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("refused:") && out.contains("no CUDA driver"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
}

#[test]
fn a_trainer_killed_right_after_released_still_commits() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    let o = run(trainer_cmd(&exe, tmp.path(), "die-after-release", 2_000));
    assert!(String::from_utf8_lossy(&o.stdout).contains("released"), "{}", text(&o));
    let dir = tmp.path().join("ck");
    serve.wait_for("step 5 committed", |_| committed(&dir) == [5]);
    let v = verify(&dir);
    assert!(v.status.success(), "{}", text(&v));
    serve.wait_for("imports closed", |s| s.stat("imports_open") == Some(0));
}

#[test]
fn an_unreleased_legacy_snapshot_of_a_dead_trainer_is_aborted() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    // The sidecar's copies are 3 s late; the trainer is killed once its
    // event completed and the sidecar opened both allocations for the copy.
    let serve = Serve::start_with_delay(tmp.path(), true, Some(3_000_000));
    kill_when(
        trainer_cmd(&exe, tmp.path(), "die-mid-copy", 2_000),
        "synced",
        &serve,
        "both allocations open for the copy",
        |s| s.stat("imports_open") == Some(2),
    );
    serve.wait_for("the save aborted", |s| s.log().contains("aborted before release"));
    assert!(serve.log().contains("the client disconnected before release"), "{}", serve.log());
    // The reason names the CUDA cause: legacy IPC memory is undefined once its exporter died.
    assert!(
        serve.log().contains("shared by legacy IPC, undefined once the exporting process is gone"),
        "{}",
        serve.log()
    );
    assert!(committed(&tmp.path().join("ck")).is_empty(), "nothing may commit");
    serve.wait_for("imports closed", |s| s.stat("imports_open") == Some(0));
}

/// Hazard 1, the trainer's side: a trainer killed before the event its save
/// waits on ran (its work never completes: the fake's waits on it never
/// end, as the real driver's may not). The sidecar, polling the event while
/// it watches the client, gives the save up: the session ends, its staging
/// is free, nothing commits, every import closes.
#[test]
fn a_trainer_killed_before_its_event_ran_ends_its_session_and_frees_staging() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    // The trainer's writes finish 5 s late: its event cannot complete before
    // it is killed, once the sidecar opened the event to poll it.
    kill_when(
        trainer_cmd(&exe, tmp.path(), "die-before-release", 5_000_000),
        "saved",
        &serve,
        "the trainer's event opened",
        |s| s.stat("events_opened") == Some(1),
    );
    serve.wait_for("the session ended", |s| s.log().contains("session ended"));
    // The client is checked before every query: the fake's query of an
    // event whose exporter died is an error, never reached.
    assert!(
        serve.log().contains("the client went away")
            && serve.log().contains("nothing of this save was copied")
            && !serve.log().contains("cuEventQuery"),
        "{}",
        serve.log()
    );
    serve.wait_for("imports closed", |s| s.stat("imports_open") == Some(0));
    assert!(committed(&tmp.path().join("ck")).is_empty(), "nothing may commit");
    // Staging is free: a new client's save of all of it (64 MiB) goes through.
    let c = Client::connect(Some(&tmp.path().join("s.sock"))).unwrap();
    let st = c.status().unwrap();
    assert_eq!(st.staging_used_bytes, 0, "{st:?}");
    assert!(st.sessions.len() == 1, "only this client's session is left: {st:?}");
    c.close();
}

/// Hazard 1, the sidecar's side: a sidecar SIGKILLed with a save's copies
/// queued (3 s late) while the trainer's stream waits on that copy
/// (`ckpt_stream_wait_copy`): the save fails and the trainer's next device
/// work on that very stream completes. A stream waiting on an event the
/// dead sidecar was to record would never run again.
#[test]
fn the_sidecar_killed_while_the_trainers_stream_waits_on_its_copy_leaves_that_stream_running() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start_with_delay(tmp.path(), true, Some(3_000_000));
    // About the stream's wait: pinned to a driver that has it.
    let mut child = trainer_cmd(&exe, tmp.path(), "sidecar-dies-guarded", 2_000)
        .env_remove("CKPT_FAKE_CUDA_REFUSE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "guarded on_stream=1", "the stream wait was queued while the copy ran");
    let mut serve = serve;
    kill9(&mut serve.child.take().unwrap());
    let pid = child.id();
    // Bounded: a stream that never runs again leaves the trainer hanging.
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(60) {
            kill9(&mut child);
            panic!("the trainer hung: its stream still waits on the dead sidecar's copy");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    sweep_fake_memory(pid);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("trained on"), "{}", text(&out));
}

#[test]
fn the_sidecar_killed_mid_copy_leaves_the_trainer_training() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    let mut child = trainer_cmd(&exe, tmp.path(), "sidecar-dies", 3_000_000)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "saved");
    let mut serve = serve;
    kill9(&mut serve.child.take().unwrap());
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    sweep_fake_memory(pid);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("trained on"), "{}", text(&out));
}

#[test]
fn without_a_driver_cuda_registration_fails_clearly_and_host_checkpoints_still_work() {
    let tmp = tempfile::tempdir().unwrap();
    let serve = Serve::start(tmp.path(), false);
    let c = Client::connect(Some(&tmp.path().join("s.sock"))).unwrap();
    let e = c.register_cuda(0x7000_0000).unwrap_err().to_string();
    match ckpt_cuda_probe_in_this_process() {
        // This test process has no driver (CI): a clear refusal.
        None => assert!(e.contains("no CUDA driver"), "{e}"),
        // A GPU machine: the address is no device memory.
        Some(_) => assert!(e.contains("not CUDA device memory"), "{e}"),
    }
    let r = c.alloc_region(4096).unwrap();
    r.write_at(0, &[7u8; 4096]).unwrap();
    let h = c
        .save(1, &[TensorRef::in_region("w", "U8", &[4096], &r, 0, 4096)], &[BlobRef { name: "m", bytes: b"x" }])
        .unwrap();
    c.wait(h.id, Wanted::Durable, Some(Duration::from_secs(60))).unwrap();
    let status = c.status().unwrap();
    c.close();
    // The sidecar without a driver says so (status, doctor), and serves on.
    assert!(status.cuda.contains("no CUDA driver"), "{}", status.cuda);
    let o = Command::new(sidecar())
        .arg("doctor")
        .arg(tmp.path().join("ck"))
        .arg("--json")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    assert_eq!(j["cuda"]["available"], false, "{j}");
    assert!(j["cuda"]["error"].as_str().unwrap().contains("no CUDA driver"), "{j}");
    drop(serve);
}

#[test]
fn doctor_reports_the_fake_device_when_its_folder_is_on_the_search_path() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(sidecar())
        .arg("doctor")
        .arg(tmp.path())
        .arg("--json")
        .env("LD_LIBRARY_PATH", fake_dir())
        .env("FAKE_CUDA_DEVICE_MEMORY_BYTES", "1073741824")
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    assert_eq!(j["cuda"]["available"], true, "{j}");
    assert_eq!(j["cuda"]["driver_version"], "12.8", "{j}");
    assert!(j["cuda"]["devices"][0]["name"].as_str().unwrap().contains("fake CUDA device"), "{j}");
    // The device's UUID, compute mode and free memory (the fake's cap, nothing used).
    assert_eq!(j["cuda"]["devices"][0]["uuid"], "GPU-66616b65-6375-6461-2d75-7569642dd000", "{j}");
    assert_eq!(j["cuda"]["devices"][0]["compute_mode"], "default", "{j}");
    assert_eq!(j["cuda"]["devices"][0]["free_bytes"], 1u64 << 30, "{j}");
    // A device in exclusive-process mode is named as one the sidecar cannot use beside a trainer.
    let o = Command::new(sidecar())
        .arg("doctor")
        .arg(tmp.path())
        .arg("--json")
        .env("LD_LIBRARY_PATH", fake_dir())
        .env("FAKE_CUDA_COMPUTE_MODE", "3")
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    assert_eq!(j["cuda"]["devices"][0]["compute_mode"], "exclusive-process", "{j}");
    assert!(
        j["cuda"]["devices"][0]["warning"]
            .as_str()
            .unwrap()
            .contains("cannot create its context while the trainer holds one"),
        "{j}"
    );
}

#[test]
fn vmm_allocations_round_trip_bit_exact_behind_the_trainers_event() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    // Late writes (300 ms): only the sidecar's wait on the event makes the
    // snapshot right; the trainer checks what it loads back in place.
    let o = run(trainer_cmd(&exe, tmp.path(), "vmm-roundtrip", 300_000));
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    let v = verify(&tmp.path().join("ck"));
    assert!(v.status.success(), "{}", text(&v));
    // Both allocations came as fds and were imported once each; every import
    // was released and unmapped when the client left.
    serve.wait_for("VMM imports released and unmapped", |s| {
        s.stat("imports_open") == Some(0) && s.stat("vmm_maps") == Some(0)
    });
    assert_eq!(serve.stat("imports_total"), Some(2));
}

#[test]
fn a_vmm_trainer_killed_right_after_released_still_commits_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    let o = run(trainer_cmd(&exe, tmp.path(), "vmm-die-after-release", 300_000));
    assert!(String::from_utf8_lossy(&o.stdout).contains("released"), "{}\nsidecar log:\n{}", text(&o), serve.log());
    assert!(o.status.code().is_none(), "the trainer was to die by SIGKILL: {}", text(&o));
    let dir = tmp.path().join("ck");
    serve.wait_for("step 5 committed", |_| committed(&dir) == [5]);
    let v = verify(&dir);
    assert!(v.status.success(), "{}", text(&v));
    serve.wait_for("VMM imports released and unmapped", |s| {
        s.stat("imports_open") == Some(0) && s.stat("vmm_maps") == Some(0)
    });
    // Another process loads the committed step: exactly the bytes saved.
    let o = run(trainer_cmd(&exe, tmp.path(), "vmm-check", 2_000));
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
}

#[test]
fn a_vmm_allocation_not_exportable_as_an_fd_is_refused_saying_why() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    let o = run(trainer_cmd(&exe, tmp.path(), "vmm-unexportable", 2_000));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("refused:") && out.contains("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    assert_eq!(serve.stat("imports_total").unwrap_or(0), 0, "nothing was sent to import");
}

#[test]
fn a_stream_wait_on_the_sidecars_copy_keeps_the_next_step_out_of_the_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    // The sidecar's device copies are 1.5 s late, the trainer's prompt: a
    // write queued right after the save lands long before the copy runs
    // unless the trainer's stream waits on the sidecar's done event.
    let serve = Serve::start_with_delay(tmp.path(), true, Some(1_500_000));
    let o = run(trainer_cmd(&exe, tmp.path(), "guard", 2_000));
    let out = String::from_utf8_lossy(&o.stdout);
    // The stream wait was queued while the sidecar still copied: the CPU did
    // not wait for the copy (unless this run's fake refuses stream waits).
    assert!(
        o.status.success() && out.contains(guarded_line()) && out.contains("snapshot=saved"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    // The control: the same write without the stream wait leaks into the snapshot.
    let tmp2 = tempfile::tempdir().unwrap();
    let serve2 = Serve::start_with_delay(tmp2.path(), true, Some(1_500_000));
    let o = run(trainer_cmd(&exe, tmp2.path(), "no-guard", 2_000));
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("snapshot=overwritten"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve2.log()
    );
}

#[test]
fn device_tensors_saved_as_ranks_parts_commit_as_one_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    // Each rank's write is 300 ms late: each part waits on its own client's event.
    let o = run(trainer_cmd(&exe, tmp.path(), "parts", 300_000));
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    let dir = tmp.path().join("ck");
    assert_eq!(committed(&dir), [8]);
    let v = verify(&dir);
    assert!(v.status.success(), "{}", text(&v));
}

#[test]
fn a_freed_allocation_replaced_at_the_same_address_is_saved_with_its_new_bytes_and_the_old_import_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    // Late writes (300 ms): each save must also wait on the trainer's event.
    let mut cmd = trainer_cmd(&exe, tmp.path(), "realloc", 300_000);
    cmd.env("CKPT_TEST_SIDECAR_STATS", serve.stats.join(serve.pid().to_string()));
    let o = run(cmd);
    let out = String::from_utf8_lossy(&o.stdout);
    // Each step loads back with the bytes of the allocation it was saved
    // from; after each re-save the sidecar held no import: legacy imports
    // close with the request that opened them (the stale one included).
    assert!(
        o.status.success() && out.contains("ok") && out.contains("open=0,0"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    let dir = tmp.path().join("ck");
    assert_eq!(committed(&dir), [20, 21, 22]);
    let v = verify(&dir);
    assert!(v.status.success(), "{}", text(&v));
    // Three allocations at one address, then the load target: four checked
    // at registration, one opened per save and per load (three each): ten
    // imports, all closed at the end.
    serve.wait_for("imports closed", |s| s.stat("imports_open") == Some(0));
    assert_eq!(serve.stat("imports_total"), Some(10));
}

#[test]
fn tensors_crossing_vmm_chunks_of_one_reserved_range_round_trip_and_a_range_into_unmapped_memory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    let o = run(trainer_cmd(&exe, tmp.path(), "span", 300_000));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("ok"), "{}\nsidecar log:\n{}", text(&o), serve.log());
    // One clear line, naming where the mapping stops, at registration and at save.
    let refusals: Vec<&str> = out.lines().filter(|l| l.contains("refused: ")).collect();
    assert_eq!(refusals.len(), 2, "{out}");
    for l in refusals {
        assert!(l.contains("is not all mapped memory") && l.contains("ends at"), "{l}");
    }
    let v = verify(&tmp.path().join("ck"));
    assert!(v.status.success(), "{}", text(&v));
    // Four chunks of the range, one of the half-mapped one: each imported once, all closed at the end.
    serve.wait_for("VMM imports released and unmapped", |s| {
        s.stat("imports_open") == Some(0) && s.stat("vmm_maps") == Some(0)
    });
    assert_eq!(serve.stat("imports_total"), Some(5));
}

/// The `device_windows` of every save the sidecar released (its log).
fn device_windows(log: &str) -> Vec<usize> {
    log.lines()
        .filter(|l| l.contains("released"))
        .filter_map(|l| l.split("device_windows=").nth(1)?.split_whitespace().next()?.parse().ok())
        .collect()
}

#[test]
fn device_copies_in_small_windows_round_trip_bit_exact_behind_the_trainers_event() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    // Windows of 64 KiB (at least one copy run, ~1 MiB, each), the sidecar's
    // copies late by 20 ms each: the windows complete one after another
    // while the disk writes the earlier ones.
    let serve = Serve::start_with_env(tmp.path(), true, Some(20_000), &[("CKPT_SIDECAR_DEVICE_WINDOW", "64KiB")]);
    // Two allocations, three tensors at offsets, written 300 ms late: only the
    // fence makes the snapshot right (the trainer checks what it loads back).
    let o = run(trainer_cmd(&exe, tmp.path(), "roundtrip", 300_000));
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    // 64 allocations, two tensors each (one at an offset): 4 MiB of device state.
    let o = run(trainer_cmd(&exe, tmp.path(), "many", 2_000));
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    let windows = device_windows(&serve.log());
    assert_eq!(windows.len(), 2, "two saves released: {}", serve.log());
    assert!(windows.iter().all(|&w| w >= 3), "each save's device copy ran in several windows: {windows:?}");
    let v = verify(&tmp.path().join("ck"));
    assert!(v.status.success(), "{}", text(&v));
    serve.wait_for("imports closed", |s| s.stat("imports_open") == Some(0));
}

#[test]
fn a_stream_wait_on_a_copy_in_several_windows_waits_for_the_last_window() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    // One 3 MiB tensor in windows of 64 KiB (three runs of 1 MiB), each window's
    // copy 1.5 s late: the trainer's done event must sit behind the last
    // window's copy, else the next step's write lands in the later windows.
    let serve = Serve::start_with_env(tmp.path(), true, Some(1_500_000), &[("CKPT_SIDECAR_DEVICE_WINDOW", "64KiB")]);
    let o = run(trainer_cmd(&exe, tmp.path(), "guard", 2_000));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains(guarded_line()) && out.contains("snapshot=saved"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    assert!(device_windows(&serve.log()).iter().all(|&w| w >= 3), "{}", serve.log());
}

/// What the `guard` trainer prints for its guarded step: the stream wait
/// queued while the sidecar still copies, or, where this run's fake refuses
/// stream waits (`CKPT_FAKE_CUDA_REFUSE=stream_wait`), the CPU's wait.
fn guarded_line() -> &'static str {
    if std::env::var("CKPT_FAKE_CUDA_REFUSE").is_ok_and(|v| v.split(',').any(|r| r.trim() == "stream_wait")) {
        "on_stream=0 state=not-pending"
    } else {
        "on_stream=1 state=pending"
    }
}

/// Whether this test process itself finds a CUDA driver.
fn ckpt_cuda_probe_in_this_process() -> Option<()> {
    ckpt_cuda::probe().ok().map(|_| ())
}

/// Hazard 3: ordinals are per process. With two devices, a trainer that sees
/// only device 1 (`CUDA_VISIBLE_DEVICES=1`: its ordinal 0) and a sidecar
/// that sees both: the sidecar opens the trainer's memory on its device 1,
/// found by UUID. Opened on its device 0 (the same ordinal), a legacy
/// import would be a peer import through the wrong GPU, and a VMM import
/// would be refused.
#[test]
fn devices_are_matched_by_uuid_not_by_ordinal() {
    for mode in ["roundtrip", "vmm-roundtrip"] {
        let tmp = tempfile::tempdir().unwrap();
        let exe = trainer(tmp.path());
        let serve = Serve::start_with_env(tmp.path(), true, None, &[("CKPT_FAKE_CUDA_DEVICES", "2")]);
        let mut cmd = trainer_cmd(&exe, tmp.path(), mode, 300_000);
        cmd.env("CKPT_FAKE_CUDA_DEVICES", "2").env("CUDA_VISIBLE_DEVICES", "1");
        let o = run(cmd);
        assert!(
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"),
            "{mode}: {}\nsidecar log:\n{}",
            text(&o),
            serve.log()
        );
        serve.wait_for("imports closed", |s| s.stat("imports_open") == Some(0));
        assert_eq!(
            serve.stat("peer_imports"),
            Some(0),
            "{mode}: every legacy import was opened on the memory's own device"
        );
    }
}

/// Hazard 3: a device the sidecar does not see is refused at registration,
/// naming its UUID.
#[test]
fn a_device_the_sidecar_does_not_see_is_refused_naming_its_uuid() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let _serve = Serve::start_with_env(
        tmp.path(),
        true,
        None,
        &[("CKPT_FAKE_CUDA_DEVICES", "2"), ("CUDA_VISIBLE_DEVICES", "0")],
    );
    let mut cmd = trainer_cmd(&exe, tmp.path(), "refused", 2_000);
    cmd.env("CKPT_FAKE_CUDA_DEVICES", "2").env("CUDA_VISIBLE_DEVICES", "1");
    let o = run(cmd);
    let out = String::from_utf8_lossy(&o.stdout);
    // The fake's device 1 has UUID "fakecuda-uuid-" d0 01.
    assert!(
        o.status.success()
            && out.contains("refused:")
            && out.contains("is not visible to the sidecar")
            && out.contains("GPU-66616b65-6375-6461-2d75-7569642dd001"),
        "{}",
        text(&o)
    );
}

/// Hazard 2: no legacy import outlives the request that needs it. A trainer
/// saves, frees the memory and allocates as much again: with the device
/// capped at 8 MiB that fits only if the sidecar closed its import (the
/// driver keeps memory freed while imported allocated: the trainer's OOM
/// retry would fail for the sidecar's sake). Without the cap, a second
/// client of the same trainer then registers the new allocation at the same
/// address: refused (ALREADY_MAPPED) while the old import is still open.
#[test]
fn a_legacy_import_is_closed_after_its_save_so_freed_memory_is_free_and_its_address_reusable() {
    for cap in [Some("8388608"), None] {
        let tmp = tempfile::tempdir().unwrap();
        let exe = trainer(tmp.path());
        let serve = Serve::start(tmp.path(), true);
        let stats = tmp.path().join("trainer-stats");
        std::fs::create_dir_all(&stats).unwrap();
        let mut cmd = trainer_cmd(&exe, tmp.path(), "free-and-reuse", 2_000);
        cmd.env("FAKE_CUDA_STATS_DIR", &stats);
        if let Some(cap) = cap {
            cmd.env("FAKE_CUDA_DEVICE_MEMORY_BYTES", cap);
        }
        let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let pid = child.id();
        let o = child.wait_with_output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success() && out.contains("ok"), "cap {cap:?}: {}\nsidecar log:\n{}", text(&o), serve.log());
        // The trainer's own counters: its free was not pinned by an importer.
        let s = std::fs::read_to_string(stats.join(pid.to_string())).unwrap();
        assert!(s.contains("frees_pinned 0"), "cap {cap:?}: {s}");
        assert_eq!(committed(&tmp.path().join("ck")), [1, 2]);
        serve.wait_for("imports closed", |s| s.stat("imports_open") == Some(0));
    }
}

/// Hazard 4: a VMM allocation whose only exportable handle type is FABRIC
/// (PyTorch's expandable segments where an IMEX channel exists) goes in
/// place by its fabric handle, not refused for lack of a POSIX fd type.
#[test]
fn vmm_allocations_exportable_only_as_fabric_handles_round_trip_in_place() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = trainer(tmp.path());
    let serve = Serve::start(tmp.path(), true);
    let mut cmd = trainer_cmd(&exe, tmp.path(), "vmm-roundtrip", 300_000);
    cmd.env("CKPT_TEST_VMM_HANDLE_TYPES", "8");
    let o = run(cmd);
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}\nsidecar log:\n{}",
        text(&o),
        serve.log()
    );
    serve.wait_for("VMM imports released and unmapped", |s| {
        s.stat("imports_open") == Some(0) && s.stat("vmm_maps") == Some(0)
    });
    assert_eq!(serve.stat("imports_total"), Some(2));
}
