//! A forked child's calls on its parent's client never block on a lock a
//! thread of the parent held at the fork (that thread does not exist in the
//! child): they fail with `Forked` at once, and `close` returns.

use std::os::unix::net::UnixListener;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ckpt_client::{Client, Error};
use ckpt_wire::{Reply, Request, PROTOCOL_VERSION};

/// A sidecar that answers the handshake and RegisterRegion, says on `seen`
/// when an UnregisterRegion arrives, never answers it, and drops the
/// connection once `done` says so.
fn stalling_sidecar(listener: UnixListener, seen: mpsc::Sender<()>, done: mpsc::Receiver<()>) {
    let (mut s, _) = listener.accept().unwrap();
    let _hello: Request = ckpt_wire::read_frame(&mut s).unwrap();
    ckpt_wire::write_frame(
        &mut s,
        &Reply::Welcome {
            version: PROTOCOL_VERSION,
            server_pid: std::process::id(),
            dirs: vec![],
            staging_bytes: 64 << 20,
        },
    )
    .unwrap();
    while let Ok(r) = ckpt_wire::read_frame::<Request>(&mut s) {
        match r {
            Request::RegisterRegion { id, region_id, .. } => {
                ckpt_wire::write_frame(&mut s, &Reply::RegionRegistered { id, region_id }).unwrap()
            }
            Request::UnregisterRegion { .. } => {
                let _ = seen.send(());
                let _ = done.recv();
                return;
            }
            _ => {}
        }
    }
}

#[test]
fn a_forked_child_never_blocks_on_a_lock_its_parent_held_at_the_fork() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("sidecar.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let (tx, rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || stalling_sidecar(listener, tx, done_rx));
    let client = Client::connect(Some(&sock)).unwrap();
    let region = client.alloc_region(4096).unwrap();
    // A thread of the parent frees the region: it holds the client's lock
    // across the round trip, which the fake never completes.
    let c = &client;
    std::thread::scope(|s| {
        s.spawn(move || {
            let _ = c.free_region(&region);
        });
        rx.recv_timeout(Duration::from_secs(20)).expect("the UnregisterRegion never came");
        // SAFETY: the child only calls the client (which must not block) and _exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let forked = matches!(client.list(), Err(Error::Forked { .. }))
                && matches!(client.status(), Err(Error::Forked { .. }));
            client.close();
            // SAFETY: leaving the child without running the test harness.
            unsafe { libc::_exit(if forked { 0 } else { 3 }) };
        }
        // The child must be done long before this (it does no I/O); the
        // deadline only bounds a hang.
        let t0 = Instant::now();
        let mut status = 0;
        let hung = loop {
            // SAFETY: polling our own child.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                break false;
            }
            if t0.elapsed() > Duration::from_secs(20) {
                // SAFETY: our own child.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                break true;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // Let the parent's free return (the connection goes) before asserting.
        done_tx.send(()).unwrap();
        assert!(!hung, "the forked child hung on its parent's lock");
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status:#x}");
    });
}
