//! The shim against the real `ckpt-sidecar` binary (target/<profile>/ckpt-sidecar,
//! built by `cargo build --release`; these tests print `skipped: …` without it):
//! the Rust client through serve (RAM and disk loads, many saves in flight,
//! sidecar killed and restarted with reconnection), and the C example trainer
//! under `launch` with a crash and a verified resume.

use crate::support::text;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckpt::{BlobRef, Client, Error, TensorRef, Wanted};
use ckpt_test_support::{kill9, sidecar_bin_if_built, terminate};
use ckpt_wire::LoadSource;

const SEC: Option<Duration> = Some(Duration::from_secs(30));

struct Serve {
    /// None once killed and reaped (its pid must not be signalled again).
    child: Option<Child>,
}

impl Serve {
    fn start(bin: &Path, dir: &Path, sock: &Path) -> Serve {
        let child = Command::new(bin)
            .args(["serve", "--staging", "64MiB", "--dir"])
            .arg(dir)
            .arg("--socket")
            .arg(sock)
            .env("CKPT_SIDECAR_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while std::os::unix::net::UnixStream::connect(sock).is_err() {
            assert!(t0.elapsed() < Duration::from_secs(20), "serve did not come up at {}", sock.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        Serve { child: Some(child) }
    }

    fn kill9(mut self) {
        kill9(&mut self.child.take().expect("running"));
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGKILLed and reaped by terminate when it does not drain in time.
            let _ = terminate(&mut c, Duration::from_secs(20));
        }
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i as u64).wrapping_mul(2654435761).wrapping_add(seed * 97) >> 3) as u8).collect()
}

#[test]
fn save_release_durable_and_load_from_ram_then_disk() {
    let Some(bin) = sidecar_bin_if_built().map(Path::to_path_buf) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (dir, sock) = (tmp.path().join("ck"), tmp.path().join("s.sock"));
    let serve = Serve::start(&bin, &dir, &sock);
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(1 << 20).unwrap();
    let shape = [256u64, 256];
    let t = [
        TensorRef::in_region("a", "F32", &shape, &r, 0, 256 * 256 * 4),
        TensorRef::in_region("b", "U8", &[1000], &r, 512 * 1024, 1000),
    ];
    // Many saves in flight: wait only for release between them.
    let mut ids = Vec::new();
    for step in 1..=8u64 {
        r.write_at(0, &pattern(step, 1 << 20)).unwrap();
        let blob = format!("step {step}");
        let h = c.save(step, &t, &[BlobRef { name: "meta", bytes: blob.as_bytes() }]).unwrap();
        c.wait(h.id, Wanted::Released, SEC).unwrap();
        ids.push(h.id);
    }
    for id in &ids {
        let s = c.wait(*id, Wanted::Durable, SEC).unwrap();
        assert!(s.path.as_deref().unwrap().contains("step-"), "{s:?}");
    }
    assert_eq!(c.list().unwrap(), ((1..=8).collect(), Some(8)));
    let report = c.status().unwrap();
    assert_eq!(report.sessions.len(), 1);

    // The sidecar makes step 8 resident just after it sends Durable (a Load in
    // between is served from disk), so wait until its status says so.
    let t0 = Instant::now();
    while c.status().unwrap().resident_step != Some(8) {
        assert!(t0.elapsed() < Duration::from_secs(60), "step 8 never became resident");
        std::thread::sleep(Duration::from_millis(5));
    }
    let want = pattern(8, 1 << 20);
    r.write_at(0, &vec![0u8; 1 << 20]).unwrap();
    let info = c.load(None, &t).unwrap();
    assert_eq!((info.step, info.source), (8, LoadSource::Ram));
    assert_eq!(info.blobs.iter().find(|b| b.name == "meta").unwrap().bytes, b"step 8");
    let mut got = vec![0u8; 1 << 20];
    r.read_at(0, &mut got).unwrap();
    assert_eq!(got[..256 * 256 * 4], want[..256 * 256 * 4]);
    assert_eq!(got[512 * 1024..512 * 1024 + 1000], want[512 * 1024..512 * 1024 + 1000]);

    // An older step is not resident: read from disk, verified.
    let info = c.load(Some(3), &t).unwrap();
    assert_eq!((info.step, info.source), (3, LoadSource::Disk));
    r.read_at(0, &mut got).unwrap();
    assert_eq!(got[..1000], pattern(3, 1000)[..]);
    // A second save of a committed step is refused, and the session goes on.
    let h = c.save(3, &t, &[]).unwrap();
    let e = c.wait(h.id, Wanted::Released, SEC).err().unwrap();
    assert!(matches!(e, Error::SaveFailed { .. }), "{e:?}");
    c.list().unwrap();
    c.close();
    drop(serve);
}

#[test]
fn save_file_writes_whole_files_atomically_and_refuses_bad_paths() {
    let Some(bin) = sidecar_bin_if_built().map(Path::to_path_buf) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (dir, sock) = (tmp.path().join("ck"), tmp.path().join("s.sock"));
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let serve = Serve::start(&bin, &dir, &sock);
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(8 << 20).unwrap();
    let dest = out.join("model.pt");
    let dest_s = dest.to_str().unwrap();
    std::fs::write(&dest, b"the old file").unwrap();
    // Sizes around the block size, at an unaligned offset; each replaces the last.
    for (i, len) in [5000usize, 4096, 1, (3 << 20) + 17].into_iter().enumerate() {
        let bytes = pattern(i as u64, len);
        r.write_at(100, &bytes).unwrap();
        let h = c.save_file(dest_s, r.as_ptr().wrapping_add(100), len as u64).unwrap();
        c.wait(h.id, Wanted::Released, SEC).unwrap();
        r.write_at(100, &vec![0xEE; len]).unwrap(); // released: the region may change
        let s = c.wait(h.id, Wanted::Durable, SEC).unwrap();
        assert_eq!(s.path.as_deref(), Some(dest_s));
        assert_eq!(std::fs::read(&dest).unwrap(), bytes, "len {len}");
    }
    // Nothing but the file is left in its directory (no temp names).
    let names: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("model.pt")]);
    // An empty file.
    let empty = out.join("empty.pt");
    let h = c.save_file(empty.to_str().unwrap(), r.as_ptr(), 0).unwrap();
    c.wait(h.id, Wanted::Durable, SEC).unwrap();
    assert_eq!(std::fs::read(&empty).unwrap(), b"");
    // Refusals name the problem, and the session goes on.
    let missing = out.join("no/such/dir/x.pt");
    for (path, needle) in [
        ("relative.pt", "not absolute"),
        (missing.to_str().unwrap(), "No such file"),
        (out.to_str().unwrap(), "is a directory"),
    ] {
        let h = c.save_file(path, r.as_ptr(), 10).unwrap();
        let e = c.wait(h.id, Wanted::Durable, SEC).err().unwrap();
        assert!(matches!(&e, Error::SaveFailed { what, .. } if what.contains(path)), "{e:?}");
        assert!(e.to_string().contains(needle), "{path}: {e}");
    }
    let outside = [0u8; 16];
    let e = c.save_file(dest_s, outside.as_ptr(), 16).err().unwrap();
    assert!(matches!(e, Error::OutsideRegion { .. }), "{e:?}");
    // Checkpoints and files share the session and the committer's order.
    let t = [TensorRef::in_region("w", "U8", &[4096], &r, 0, 4096)];
    let h1 = c.save(1, &t, &[]).unwrap();
    let h2 = c.save_file(dest_s, r.as_ptr(), 4096).unwrap();
    c.wait(h1.id, Wanted::Durable, SEC).unwrap();
    c.wait(h2.id, Wanted::Durable, SEC).unwrap();
    assert_eq!(c.list().unwrap(), (vec![1], Some(1)));
    c.close();
    drop(serve);
}

#[test]
fn sidecar_killed_during_save_file_leaves_the_old_file_or_the_new_one() {
    let Some(bin) = sidecar_bin_if_built().map(Path::to_path_buf) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (dir, sock) = (tmp.path().join("ck"), tmp.path().join("s.sock"));
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let dest = out.join("model.pt");
    let len = 48usize << 20;
    let new = pattern(7, len);
    let mut outcomes = (0, 0);
    for kill_after_ms in [0u64, 2, 5, 10, 20, 40] {
        std::fs::write(&dest, b"old").unwrap();
        let serve = Serve::start(&bin, &dir, &sock);
        let c = Client::connect(Some(&sock)).unwrap();
        let r = c.alloc_region(len as u64).unwrap();
        r.write_at(0, &new).unwrap();
        let h = c.save_file(dest.to_str().unwrap(), r.as_ptr(), len as u64).unwrap();
        c.wait(h.id, Wanted::Released, SEC).unwrap();
        std::thread::sleep(Duration::from_millis(kill_after_ms));
        serve.kill9();
        let got = std::fs::read(&dest).unwrap();
        if got == b"old" {
            outcomes.0 += 1;
        } else {
            assert!(
                got == new,
                "after a kill at {kill_after_ms} ms the file is neither old nor new ({} bytes)",
                got.len()
            );
            outcomes.1 += 1;
        }
        // The temp file is unnamed until just before the rename; a kill in
        // that instant leaves a complete copy under the temp name, no more.
        for e in std::fs::read_dir(&out).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if name != "model.pt" {
                assert!(name.starts_with(".model.pt.ckpt-tmp-"), "unexpected {name}");
                assert!(std::fs::read(out.join(&name)).unwrap() == new, "{name} is not a complete copy");
                std::fs::remove_file(out.join(&name)).unwrap();
            }
        }
        c.close();
    }
    eprintln!("kills: {} left the old file, {} the new one", outcomes.0, outcomes.1);
}

#[test]
fn sidecar_killed_then_restarted_the_client_reconnects_and_keeps_its_regions() {
    let Some(bin) = sidecar_bin_if_built().map(Path::to_path_buf) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (dir, sock) = (tmp.path().join("ck"), tmp.path().join("s.sock"));
    let serve = Serve::start(&bin, &dir, &sock);
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(64 * 1024).unwrap();
    let t = [TensorRef::in_region("w", "U8", &[4096], &r, 0, 4096)];
    r.write_at(0, &pattern(1, 4096)).unwrap();
    let h = c.save(1, &t, &[]).unwrap();
    c.wait(h.id, Wanted::Durable, SEC).unwrap();

    serve.kill9();
    let t0 = Instant::now();
    while c.is_connected() {
        assert!(t0.elapsed() < Duration::from_secs(60), "EOF not noticed");
        std::thread::sleep(Duration::from_millis(10));
    }
    let e = c.save(2, &t, &[]).err().unwrap();
    assert!(matches!(e, Error::Disconnected { .. }), "{e:?}");
    assert!(e.to_string().contains("reconnecting"), "{e}");

    let _serve = Serve::start(&bin, &dir, &sock);
    r.write_at(0, &pattern(2, 4096)).unwrap();
    let h = c.save(2, &t, &[]).unwrap(); // reconnects, re-registers region 1
    c.wait(h.id, Wanted::Durable, SEC).unwrap();
    assert_eq!(c.list().unwrap().0, vec![1, 2]);
    r.write_at(0, &[0; 4096]).unwrap();
    let info = c.load(Some(1), &t).unwrap();
    assert_eq!(info.source, LoadSource::Disk);
    let mut got = vec![0u8; 4096];
    r.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(1, 4096));
}

#[test]
fn example_trainer_under_launch_crashes_and_resumes_verified() {
    let Some(bin) = sidecar_bin_if_built().map(Path::to_path_buf) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let exe = tmp.path().join("trainer");
    let libdir = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let o = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/c/build.sh"))
        .arg(&exe)
        .env("SKIP_CARGO", "1")
        .env("CKPT_LIBDIR", &libdir)
        .output()
        .unwrap();
    if !o.status.success() {
        eprintln!("skipped: cannot build the C trainer: {}", text(&o));
        return;
    }
    let dir = tmp.path().join("ck");
    let launch = |args: &[&str]| {
        Command::new(&bin)
            .args(["launch", "--staging", "64MiB", "--dir"])
            .arg(&dir)
            .arg("--")
            .arg(&exe)
            .args(args)
            .env("CKPT_SIDECAR_LOG", "warn")
            .output()
            .unwrap()
    };
    let o = launch(&["--steps", "12", "--quiet"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("12 saves, 12 durable, 0 failed"), "{}", text(&o));
    // The trainer SIGKILLs itself after step 20's release; launch exits with its status.
    let o = launch(&["--steps", "40", "--resume", "--crash-at", "20", "--quiet"]);
    assert!(!o.status.success(), "{}", text(&o));
    let o = launch(&["--steps", "25", "--resume", "--quiet"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("resumed from step 20 (source disk), state verified"), "{}", text(&o));
    assert!(out.contains("5 saves, 5 durable, 0 failed"), "{}", text(&o));
    // What the sidecar committed verifies on its own.
    let v = Command::new(&bin).arg("verify").arg(&dir).output().unwrap();
    assert!(v.status.success(), "verify: {}", text(&v));
}

/// ckpt_save_flagged from C against the real sidecar (tests/c/unchanged.c):
/// a tensor flagged CKPT_TENSOR_UNCHANGED since the step this client saved
/// last is taken from the sidecar's copy of that step (a write the flag did
/// not declare is not saved), one not flagged is copied, a flag naming
/// another step is ignored, unknown flag bits are refused.
#[test]
fn c_flag_unchanged_takes_the_named_steps_bytes_and_only_those() {
    let Some(bin) = sidecar_bin_if_built().map(Path::to_path_buf) else { return };
    let Some(cc) = crate::support::cc() else { return };
    let d = tempfile::tempdir().unwrap();
    let exe = d.path().join("unchanged");
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = crate::support::lib_dir();
    let o = Command::new(&cc)
        .args(["-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .arg(format!("-I{}", crate_dir.join("include").display()))
        .arg(crate_dir.join("tests/c/unchanged.c"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg("-lckpt")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .output()
        .unwrap();
    assert!(o.status.success(), "compiling tests/c/unchanged.c failed:\n{}", String::from_utf8_lossy(&o.stderr));
    let sock = d.path().join("s.sock");
    let _serve = Serve::start(&bin, &d.path().join("ckpt"), &sock);
    let o = Command::new(&exe).env("CKPT_SIDECAR_SOCKET", &sock).env_remove("CKPT_SIDECAR_PRELOAD").output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"), "{}", text(&o));
}
