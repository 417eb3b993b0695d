//! A checkpoint directory that cannot be written:
//! `serve` serves it read-only (no lock, no recovery), the tools that read
//! (`ls`, `verify`) work, and those that write (`gc`, `rollback`) refuse in
//! one line naming the read-only directory. `serve --read-only` on a
//! writable directory takes no lock either, and the one-owner lock of a
//! writable directory is unchanged.
//!
//! Read-only for root too (CI runs as root, for whom `chmod -w` changes
//! nothing): the directory is bind-mounted read-only over itself in a
//! private mount namespace (`unshare -m`, or `unshare -rm` as another user).
//! The tests skip, saying why, where unshare is refused.

use ckpt_test_support::sidecar_bin;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const MOUNT_RO: &str = r#"mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@""#;

/// The unshare flags that let this process mount here, if any.
fn unshare_flags(dir: &Path) -> Option<&'static str> {
    ["-m", "-rm"].into_iter().find(|f| {
        Command::new("unshare")
            .args([f, "sh", "-c", MOUNT_RO])
            .arg(dir)
            .arg("true")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Runs `ckpt-sidecar ARGS` with `dir` read-only.
fn read_only(flags: &str, dir: &Path, args: &[&str]) -> Output {
    Command::new("unshare")
        .args([flags, "sh", "-c", MOUNT_RO])
        .arg(dir)
        .arg(sidecar_bin())
        .args(args)
        .output()
        .expect("run unshare")
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn write_steps(dir: &Path, steps: &[u64]) {
    for s in steps {
        let o = Command::new(sidecar_bin())
            .args(["bench", "write", "--dir"])
            .arg(dir)
            .args(["--size", "1MiB", "--step", &s.to_string()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
    }
}

#[test]
fn gc_and_rollback_on_a_read_only_directory_refuse_naming_it_and_ls_verify_read_it() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("ckpt");
    std::fs::create_dir(&d).unwrap();
    write_steps(&d, &[1, 2]);
    let Some(flags) = unshare_flags(&d) else {
        eprintln!("skipped: cannot bind-mount a directory read-only here (unshare -m and unshare -rm refused)");
        return;
    };
    let ds = d.to_str().unwrap();
    for args in [vec!["ls", ds], vec!["verify", ds]] {
        let o = read_only(flags, &d, &args);
        assert!(o.status.success(), "{args:?}: {}", text(&o));
    }
    for (args, role) in [(vec!["gc", ds, "--keep", "1"], "gc"), (vec!["rollback", ds, "--to", "1"], "rollback")] {
        let o = read_only(flags, &d, &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", text(&o));
        assert!(
            err.contains(&format!("{ds}: the checkpoint directory is read-only"))
                && err.contains(&format!("{role} writes there")),
            "{args:?}: {}",
            text(&o)
        );
        assert_eq!(err.trim().lines().count(), 1, "one line: {}", text(&o));
    }
    // Nothing was deleted or un-committed.
    let o = Command::new(sidecar_bin()).args(["ls", ds, "--json"]).output().unwrap();
    let listing = String::from_utf8_lossy(&o.stdout);
    assert!(listing.contains("\"step\":1") && listing.contains("\"step\":2"), "{}", text(&o));
}

/// Waits (bounded) until `socket` exists.
fn wait_socket(socket: &Path, child: &mut std::process::Child) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !socket.exists() {
        assert!(child.try_wait().unwrap().is_none(), "the sidecar exited before listening");
        assert!(Instant::now() < deadline, "the sidecar did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serve_read_only_on_a_writable_directory_takes_no_lock_and_leaves_the_owner_lock_to_others() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("ckpt");
    std::fs::create_dir(&d).unwrap();
    write_steps(&d, &[1]);
    // A leftover temp folder: recovery would remove it; a reader must not.
    let leftover = d.join(".tmp-step-000000000002-0123abcd");
    std::fs::create_dir(&leftover).unwrap();
    let sock = tmp.path().join("ro.sock");
    let mut ro = Command::new(sidecar_bin())
        .args(["serve", "--read-only", "--staging", "2MiB", "--dir"])
        .arg(&d)
        .arg("--socket")
        .arg(&sock)
        .spawn()
        .unwrap();
    wait_socket(&sock, &mut ro);
    let o = Command::new(sidecar_bin()).arg("status").arg("--socket").arg(&sock).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(!d.join(".ckpt-sidecar.lock").exists(), "a read-only sidecar wrote a lock file");
    assert!(leftover.is_dir(), "a read-only sidecar ran recovery");
    // The directory's owner can still start beside the reader (and locks it).
    let sock2 = tmp.path().join("rw.sock");
    let mut rw = Command::new(sidecar_bin())
        .args(["serve", "--staging", "2MiB", "--dir"])
        .arg(&d)
        .arg("--socket")
        .arg(&sock2)
        .spawn()
        .unwrap();
    wait_socket(&sock2, &mut rw);
    assert!(!leftover.exists(), "the owner's recovery removes the leftover");
    let o = Command::new(sidecar_bin()).args(["gc", "--keep", "1"]).arg(&d).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "gc beside the owner: {}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("is in use by"), "{}", text(&o));
    assert_eq!(ckpt_test_support::terminate(&mut rw, Duration::from_secs(60)), Some(0));
    assert_eq!(ckpt_test_support::terminate(&mut ro, Duration::from_secs(60)), Some(0));
}
