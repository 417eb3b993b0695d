//! The shim against the real `ckpt-sidecar` binary (target/<profile>/ckpt-sidecar,
//! built by `cargo build --release`; these tests print `skipped: …` without it):
//! the Rust client through serve (RAM and disk loads, many saves in flight,
//! sidecar killed and restarted with reconnection), and the C example trainer
//! under `launch` with a crash and a verified resume.

mod support;

use support::{sidecar_bin, text};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckpt::{BlobRef, Client, Error, TensorRef, Wanted};
use ckpt_wire::LoadSource;

const SEC: Option<Duration> = Some(Duration::from_secs(30));

struct Serve {
    child: Child,
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
        Serve { child }
    }

    fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            if t0.elapsed() > Duration::from_secs(20) {
                let _ = self.child.kill();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i as u64).wrapping_mul(2654435761).wrapping_add(seed * 97) >> 3) as u8).collect()
}

#[test]
fn save_release_durable_and_load_from_ram_then_disk() {
    let Some(bin) = sidecar_bin() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (dir, sock) = (tmp.path().join("ck"), tmp.path().join("s.sock"));
    let serve = Serve::start(&bin, &dir, &sock);
    let c = Client::connect(Some(&sock)).unwrap();
    let r = c.alloc_region(1 << 20).unwrap();
    let shape = [256u64, 256];
    let t = [TensorRef::in_region("a", "F32", &shape, &r, 0, 256 * 256 * 4), TensorRef::in_region("b", "U8", &[1000], &r, 512 * 1024, 1000)];
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
        assert!(t0.elapsed() < Duration::from_secs(5), "step 8 never became resident");
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
fn sidecar_killed_then_restarted_the_client_reconnects_and_keeps_its_regions() {
    let Some(bin) = sidecar_bin() else { return };
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
        assert!(t0.elapsed() < Duration::from_secs(5), "EOF not noticed");
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
    let Some(bin) = sidecar_bin() else { return };
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
        Command::new(&bin).args(["launch", "--staging", "64MiB", "--dir"]).arg(&dir).arg("--").arg(&exe).args(args).env("CKPT_SIDECAR_LOG", "warn").output().unwrap()
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
