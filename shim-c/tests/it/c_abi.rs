//! The C face of libckpt, from C programs built here with the system C
//! compiler: every entry point (tests/c/abi_smoke.c), dlopen (tests/c/dlopen.c),
//! LD_PRELOAD into unmodified programs, preload mode's default client and
//! SIGTERM flag (tests/c/preempt.c), and the example trainer with --resume,
//! all against the fake sidecar of tests/it/common.rs.

use crate::support::{cc, lib_dir, text};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{temp_socket, Fake, Opts};

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn so_path() -> PathBuf {
    let p = lib_dir().join("libckpt.so");
    assert!(
        p.exists(),
        "{} missing: cargo builds the cdylib with the tests; run `cargo build -p ckpt-shim`",
        p.display()
    );
    p
}

/// Compiles a C file; `link` links it with -lckpt (rpath to lib_dir).
fn compile(cc: &str, src: &Path, out: &Path, link: bool, pedantic: bool) {
    let mut cmd = Command::new(cc);
    cmd.args(["-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Werror"]);
    if pedantic {
        cmd.arg("-pedantic");
    }
    cmd.arg(format!("-I{}", crate_dir().join("include").display())).arg(src).arg("-o").arg(out);
    if link {
        let d = lib_dir();
        cmd.arg(format!("-L{}", d.display())).arg("-lckpt").arg(format!("-Wl,-rpath,{}", d.display()));
    } else {
        cmd.arg("-ldl");
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "compiling {} failed:\n{}", src.display(), String::from_utf8_lossy(&o.stderr));
}

#[test]
fn every_entry_point_from_c_against_the_fake() {
    let Some(cc) = cc() else { return };
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("abi_smoke");
    compile(&cc, &crate_dir().join("tests/c/abi_smoke.c"), &exe, true, true);
    let (_d, sock) = temp_socket();
    let _fake = Fake::start(&sock, Opts::default());
    let o = Command::new(&exe).env("CKPT_SIDECAR_SOCKET", &sock).env_remove("CKPT_SIDECAR_PRELOAD").output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"), "{}", text(&o));
}

#[test]
fn dlopen_and_call_by_symbol() {
    let Some(cc) = cc() else { return };
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("dlopen");
    compile(&cc, &crate_dir().join("tests/c/dlopen.c"), &exe, false, false);
    let o = Command::new(&exe).arg(so_path()).env_remove("CKPT_SIDECAR_PRELOAD").output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("version: libckpt "), "{}", text(&o));
}

#[test]
fn preloading_into_unmodified_programs_changes_nothing_without_preload_mode() {
    let so = so_path();
    let o = Command::new("true").env("LD_PRELOAD", &so).env_remove("CKPT_SIDECAR_PRELOAD").output().unwrap();
    assert!(o.status.success() && o.stderr.is_empty(), "{}", text(&o));
    let o = Command::new("sh")
        .args(["-c", "echo hello; exit 7"])
        .env("LD_PRELOAD", &so)
        .env_remove("CKPT_SIDECAR_PRELOAD")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(7), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "hello\n");
    assert!(o.stderr.is_empty(), "{}", text(&o));
}

#[test]
fn preload_mode_connects_unmodified_programs_and_never_breaks_them() {
    let so = so_path();
    let (_d, sock) = temp_socket();
    // No sidecar: one line on stderr, the program runs as usual.
    let o = Command::new("true")
        .env("LD_PRELOAD", &so)
        .env("CKPT_SIDECAR_PRELOAD", "1")
        .env("CKPT_SIDECAR_SOCKET", &sock)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("libckpt: preload: not connected"), "{}", text(&o));
    // With a sidecar: the process says Hello (name from /proc/self/comm) and exits normally.
    let fake = Fake::start(&sock, Opts::default());
    let o = Command::new("sh")
        .args(["-c", "echo out; exit 3"])
        .env("LD_PRELOAD", &so)
        .env("CKPT_SIDECAR_PRELOAD", "1")
        .env("CKPT_SIDECAR_SOCKET", &sock)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "out\n");
    assert!(o.stderr.is_empty(), "{}", text(&o));
    fake.log_when(|l| l.iter().any(|l| l == "Hello sh"));
}

/// Whether `pid` has a handler for `sig` (its SigCgt mask in /proc).
fn catches(pid: i32, sig: i32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mask =
        status.lines().find_map(|l| l.strip_prefix("SigCgt:")).and_then(|m| u64::from_str_radix(m.trim(), 16).ok());
    mask.is_some_and(|m| m & (1 << (sig - 1)) != 0)
}

#[test]
fn preload_mode_one_sigterm_sets_the_flag_a_second_terminates() {
    let so = so_path();
    let (_d, sock) = temp_socket();
    let mut child = Command::new("sleep")
        .arg("20")
        .env("LD_PRELOAD", &so)
        .env("CKPT_SIDECAR_PRELOAD", "1")
        .env("CKPT_SIDECAR_SOCKET", &sock)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    // Past the constructor: wait until the process catches SIGTERM.
    let t0 = Instant::now();
    while !catches(pid, libc::SIGTERM) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the preloaded constructor never installed its SIGTERM handler"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.try_wait().unwrap().is_none(), "one SIGTERM must only set the preemption flag");
    // SAFETY: signalling our own child, still running (checked just above).
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "a second SIGTERM must terminate");
        std::thread::sleep(Duration::from_millis(10));
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGTERM));
}

#[test]
fn preload_mode_gives_a_default_client_and_the_preemption_flag() {
    let Some(cc) = cc() else { return };
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("preempt");
    compile(&cc, &crate_dir().join("tests/c/preempt.c"), &exe, true, true);
    let (_d, sock) = temp_socket();
    let o = Command::new(&exe).env("CKPT_SIDECAR_PRELOAD", "1").env("CKPT_SIDECAR_SOCKET", &sock).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let _fake = Fake::start(&sock, Opts::default());
    let o = Command::new(&exe)
        .arg("connected")
        .env("CKPT_SIDECAR_PRELOAD", "1")
        .env("CKPT_SIDECAR_SOCKET", &sock)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("preempted: 1"), "{}", text(&o));
}

#[test]
fn example_trainer_checkpoints_every_step_and_resumes_verified() {
    let Some(cc) = cc() else { return };
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("trainer");
    let build = crate_dir().join("../examples/c/build.sh");
    let o = Command::new("bash")
        .arg(&build)
        .arg(&exe)
        .env("SKIP_CARGO", "1")
        .env("CC", &cc)
        .env("CKPT_LIBDIR", lib_dir())
        .output()
        .unwrap();
    assert!(o.status.success(), "build.sh: {}", text(&o));

    let (_d, sock) = temp_socket();
    let fake = Fake::start(&sock, Opts::default());
    let run = |args: &[&str]| Command::new(&exe).args(args).env("CKPT_SIDECAR_SOCKET", &sock).output().unwrap();
    let o = run(&["--steps", "8", "--width", "256"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("8 saves, 8 durable, 0 failed"), "{}", text(&o));

    let o = run(&["--steps", "12", "--width", "256", "--resume"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("resumed from step 8 (source ram), state verified"), "{}", text(&o));
    assert!(out.contains("4 saves, 4 durable"), "{}", text(&o));

    // Crash right after step 15 was released: it still commits (the fake,
    // like the sidecar, finishes released saves), and resume verifies it.
    let o = run(&["--steps", "30", "--width", "256", "--resume", "--crash-at", "15"]);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(o.status.signal(), Some(libc::SIGKILL), "{}", text(&o));
    let t0 = Instant::now();
    while !fake.store.lock().unwrap().steps.contains_key(&15) {
        assert!(t0.elapsed() < Duration::from_secs(60), "released step 15 never committed after the crash");
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = run(&["--steps", "16", "--width", "256", "--resume"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("resumed from step 15"), "{}", text(&o));

    // A model that is not what the step says is caught.
    {
        let mut s = fake.store.lock().unwrap();
        let ck = s.steps.get_mut(&16).unwrap();
        ck.tensors[1].1[7] ^= 1;
    }
    let o = run(&["--steps", "16", "--width", "256", "--resume"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("VERIFY FAILED: tensor layer.0.weight"), "{}", text(&o));
}

#[test]
fn a_forked_child_never_touches_its_parents_connection() {
    let Some(cc) = cc() else { return };
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("fork");
    compile(&cc, &crate_dir().join("tests/c/fork.c"), &exe, true, true);
    let (_d, sock) = temp_socket();
    let fake = Fake::start(&sock, Opts::default());
    let o = Command::new(&exe)
        .arg("calls")
        .env("CKPT_SIDECAR_SOCKET", &sock)
        .env_remove("CKPT_SIDECAR_PRELOAD")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    // One session only (the child never spoke), and it ended with Bye from the parent.
    let log = fake.log_when_ended();
    assert_eq!(log.iter().filter(|l| l.starts_with("Hello")).count(), 1, "{log:?}");
    assert_eq!(log.iter().filter(|l| l.starts_with("Save")).count(), 2, "{log:?}");
    assert_eq!(log.last().map(String::as_str), Some("Bye"), "{log:?}");

    // The parent dies while its child lives on: the session must still end now.
    let fake = Fake::start(&sock, Opts::default());
    let mut parent = Command::new(&exe)
        .arg("orphan")
        .env("CKPT_SIDECAR_SOCKET", &sock)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // The orphaned child lives until this pipe closes: an End while it lives
    // means it did not keep the session's socket open (before: it lived 3 s
    // and the End had to come within 2 s, a race on a loaded machine).
    let child_lives = parent.stdin.take();
    assert!(parent.wait().unwrap().success());
    fake.log_within(Duration::from_secs(60), |l| l.iter().any(|l| l == "End"));
    drop(child_lives);
}
