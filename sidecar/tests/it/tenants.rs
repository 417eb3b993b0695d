//! One sidecar, many tenants, some of them misbehaving: a process gets its
//! share of the sessions and `status` always gets in; partly sent frames
//! hold a bounded number of the daemon's bytes and are dropped when they
//! stall; refusals are rate-limited in the log; a metrics scrape answers
//! while other connections hold half-sent requests.
//!
//! Several processes are the test binary itself, run again as
//! [`session_hog`] (an ignored test that does its work only when
//! `CKPT_TEST_HOG_SOCKET` is set).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_sidecar::config;
use ckpt_test_support::cli;
use ckpt_test_support::daemon::{Client, Shm, Sidecar, HANG_BOUND};
use ckpt_wire::{Reply, TensorDesc};

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < HANG_BOUND, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Says Hello; the Welcome (Ok) or the refusal's reason (Err).
fn hello(socket: &Path) -> Result<UnixStream, String> {
    let mut s = Client::raw(socket);
    ckpt_wire::write_frame(&mut s, &ckpt_wire::hello("tenant")).unwrap();
    match ckpt_wire::read_frame::<Reply>(&mut s).unwrap() {
        Reply::Welcome { .. } => Ok(s),
        Reply::Refused { reason } => Err(reason),
        other => panic!("expected Welcome or Refused, got {other:?}"),
    }
}

/// The helper process of the tests below: opens `CKPT_TEST_HOG_N` sessions
/// on `CKPT_TEST_HOG_SOCKET`, prints "hog ready", and holds them until its
/// stdin closes. With `CKPT_TEST_HOG_FORK` set it forks a child that keeps
/// the sockets open, prints "hog ready CHILD_PID" and exits at once.
#[test]
#[ignore = "a helper process of the tenants tests, run by them"]
fn session_hog() {
    let Some(socket) = std::env::var_os("CKPT_TEST_HOG_SOCKET") else { return };
    let n: usize = std::env::var("CKPT_TEST_HOG_N").unwrap().parse().unwrap();
    let held: Vec<UnixStream> = (0..n).map(|_| hello(Path::new(&socket)).expect("the hog's share")).collect();
    if std::env::var_os("CKPT_TEST_HOG_FORK").is_some() {
        // SAFETY: the child only calls pause (async-signal-safe) until it
        // is killed; the parent goes on as before.
        let child = unsafe { libc::fork() };
        if child == 0 {
            loop {
                // SAFETY: pause has no preconditions.
                unsafe { libc::pause() };
            }
        }
        println!("hog ready {child}");
        std::process::exit(0);
    }
    println!("hog ready");
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(held);
}

/// A child process holding `n` sessions (killed on drop), and what it
/// printed after "hog ready".
struct Hog(Child, String);

impl Hog {
    fn start(socket: &Path, n: usize) -> Hog {
        Self::start_with(socket, n, &[])
    }

    fn start_with(socket: &Path, n: usize, env: &[(&str, &str)]) -> Hog {
        let mut c = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "tenants::session_hog", "--ignored", "--nocapture", "--test-threads=1"])
            .env("CKPT_TEST_HOG_SOCKET", socket)
            .env("CKPT_TEST_HOG_N", n.to_string())
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(c.stdout.take().unwrap());
        for line in out.lines() {
            if let Some(rest) = line.unwrap().split_once("hog ready").map(|(_, r)| r.trim().to_string()) {
                return Hog(c, rest);
            }
        }
        panic!("the hog process ended before it held its sessions: {:?}", c.wait());
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn one_process_gets_its_share_of_sessions_and_the_refusal_names_it() {
    let sc = Sidecar::start(&[]);
    let mut held = Vec::new();
    let refusal = loop {
        match hello(&sc.socket) {
            Ok(s) => held.push(s),
            Err(reason) => break reason,
        }
        assert!(held.len() <= config::SESSIONS_MAX, "one process took every session");
    };
    assert_eq!(held.len(), config::SESSIONS_PER_PROCESS_MAX, "{refusal}");
    let me = std::process::id();
    assert!(refusal.contains(&format!("pid {me} holds {}", held.len())), "{refusal}");
    let st = cli(&["status", "--json", "--socket", sc.socket.to_str().unwrap()]);
    assert_eq!(st.code, 0, "{}", st.stderr);
}

#[test]
fn status_gets_in_when_every_session_is_taken_and_a_gone_holder_frees_its_share() {
    let sc = Sidecar::start(&[]);
    let share = config::SESSIONS_PER_PROCESS_MAX;
    let mut hogs: Vec<Hog> = (0..config::SESSIONS_MAX / share).map(|_| Hog::start(&sc.socket, share)).collect();
    let refusal = hello(&sc.socket).expect_err("every session is taken");
    assert!(refusal.contains(&format!("at most {}", config::SESSIONS_MAX)), "{refusal}");
    assert!(hogs.iter().any(|h| refusal.contains(&format!("pid {} holds {share}", h.pid()))), "{refusal}");
    let st = cli(&["status", "--json", "--socket", sc.socket.to_str().unwrap()]);
    assert_eq!(st.code, 0, "status when every session is taken: {}", st.stderr);
    let report: serde_json::Value = serde_json::from_str(&st.stdout).unwrap();
    assert_eq!(report["sessions"].as_array().unwrap().len(), config::SESSIONS_MAX);
    drop(hogs.pop());
    wait_for("a session place after a holder died", || hello(&sc.socket).is_ok());
}

#[test]
fn the_sessions_of_a_process_gone_are_closed_though_a_child_keeps_their_sockets() {
    let sc = Sidecar::start(&[]);
    let share = config::SESSIONS_PER_PROCESS_MAX;
    let mut hog = Hog::start_with(&sc.socket, share, &[("CKPT_TEST_HOG_FORK", "1")]);
    let _child = KillOnDrop(hog.1.parse().unwrap());
    hog.0.wait().unwrap();
    let sessions = || {
        let st = cli(&["status", "--json", "--socket", sc.socket.to_str().unwrap()]);
        assert_eq!(st.code, 0, "{}", st.stderr);
        serde_json::from_str::<serde_json::Value>(&st.stdout).unwrap()["sessions"].as_array().unwrap().len()
    };
    wait_for("the sessions of the gone process closed", || sessions() == 0);
    assert!(sc.log_text().contains("client process gone: session closed"), "{}", sc.log_text());
}

/// A process killed on drop (the hog's child, which no one waits for).
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: kill has no memory preconditions; the pid is the hog's
        // child, which lives until this kill.
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}

/// VmRSS of process `pid`, in bytes.
fn rss_bytes(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap();
    kib << 10
}

#[test]
fn partly_sent_large_frames_hold_bounded_memory_are_dropped_when_stalled_and_a_save_beside_them_commits() {
    const CLIENTS: usize = 20;
    const ANNOUNCED: u32 = (64 << 20) - 1;
    const SENT: usize = 60 << 20;
    let mut sc = Sidecar::start(&[]);
    let before = rss_bytes(sc.pid());
    let sent = Arc::new(AtomicU64::new(0));
    let stallers: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (socket, sent) = (sc.socket.clone(), sent.clone());
            std::thread::spawn(move || {
                let mut s = hello(&socket).unwrap();
                let chunk = vec![7u8; 1 << 20];
                let mut wrote = s.write_all(&ANNOUNCED.to_le_bytes()).is_ok();
                for _ in 0..SENT / chunk.len() {
                    wrote = wrote && s.write_all(&chunk).is_ok();
                    if !wrote {
                        break; // the sidecar dropped the frame
                    }
                    sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
                // Idle until the sidecar closes the session.
                Client::expect_closed(s);
            })
        })
        .collect();
    // What the sidecar took settles: every sender done, or all of them
    // blocked (their bytes in the socket buffers, not in the sidecar).
    let mut last = (u64::MAX, Instant::now());
    wait_for("the senders to settle", || {
        let now = sent.load(Ordering::Relaxed);
        if now != last.0 {
            last = (now, Instant::now());
        }
        now == (CLIENTS * SENT) as u64 || last.1.elapsed() > Duration::from_millis(500)
    });
    let after = rss_bytes(sc.pid());
    eprintln!(
        "VmRSS before {} MiB, after {CLIENTS} partly sent frames {} MiB (sent {} MiB)",
        before >> 20,
        after >> 20,
        sent.load(Ordering::Relaxed) >> 20
    );
    assert!(after <= before + (512 << 20), "VmRSS grew from {before} to {after} bytes");
    // A trainer's save beside them is served at once.
    let mut shm = Shm::new(1 << 20);
    ckpt_store::synthetic::fill(shm.bytes_mut(), 1);
    let mut c = sc.client_with(&shm);
    let t = TensorDesc {
        name: "w".into(),
        dtype: "U8".into(),
        shape: vec![1 << 20],
        region_id: 1,
        offset_bytes: 0,
        len_bytes: 1 << 20,
    };
    c.save_durable(1, vec![t], vec![]);
    for s in stallers {
        s.join().unwrap();
    }
    let log = sc.log_text();
    assert!(log.contains("stopped arriving after") || log.contains("found no room after"), "{log}");
    sc.stop_ok();
}

#[test]
fn refusals_of_clients_sending_garbage_are_rate_limited_and_every_one_is_counted() {
    const CLIENTS: usize = 4;
    const CONNECTIONS: usize = 300;
    let sc = Sidecar::start(&[]);
    let garbage: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let socket = sc.socket.clone();
            std::thread::spawn(move || {
                for n in 0..CONNECTIONS {
                    let mut s = Client::raw(&socket);
                    let body = format!("garbage {i} {n} ").repeat(4).into_bytes();
                    let _ = s.write_all(&(body.len() as u32).to_le_bytes());
                    let _ = s.write_all(&body);
                    let _ = s.read_to_end(&mut Vec::new());
                }
            })
        })
        .collect();
    for g in garbage {
        g.join().unwrap();
    }
    let me = std::process::id();
    let accounted = |log: &str| -> (usize, u64) {
        let written = log
            .lines()
            .filter(|l| l.contains("refused a client: bad handshake") && !l.contains(" more refusals from "))
            .count();
        let summarised: u64 = log
            .lines()
            .filter_map(|l| l.split_once(" more refusals from pid ")?.0.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        (written, summarised)
    };
    let t0 = Instant::now();
    loop {
        let log = sc.log_text();
        let (w, s) = accounted(&log);
        if w as u64 + s == (CLIENTS * CONNECTIONS) as u64 {
            break;
        }
        assert!(
            t0.elapsed() < HANG_BOUND,
            "{w} refusals written, {s} summarised, of {}:\n{log}",
            CLIENTS * CONNECTIONS
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = sc.log_text();
    let (written, _) = accounted(&log);
    let lines = log.lines().filter(|l| l.contains("refus")).count();
    eprintln!("{} refusals: {written} lines written, {lines} lines about refusals in all", CLIENTS * CONNECTIONS);
    assert!(lines <= 40, "{lines} lines for {} refusals:\n{log}", CLIENTS * CONNECTIONS);
    assert!(log.contains(&format!("more refusals from pid {me} in the last")), "{log}");
}

#[test]
fn a_metrics_scrape_answers_while_50_half_sent_requests_are_held_open() {
    let sc = Sidecar::start(&["--metrics", "127.0.0.1:0"]);
    let mut addr = String::new();
    wait_for("the metrics address in the log", || {
        let log = sc.log_text();
        let found = log.split("metrics=http://").nth(1).and_then(|r| r.split("/metrics").next());
        addr = found.unwrap_or_default().to_string();
        !addr.is_empty()
    });
    let held: Vec<TcpStream> = (0..50)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: held\r\n").unwrap();
            s
        })
        .collect();
    let mut s = TcpStream::connect(&addr).unwrap();
    // Generous: 50 connections served one after the other take 100 s.
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: scraper\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("the scrape's answer while 50 requests are held open");
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(answer.ends_with("# EOF\n"), "{answer}");
    // The held ones are closed once their time is up.
    for mut h in held {
        h.set_read_timeout(Some(HANG_BOUND)).unwrap();
        let _ = h.read_to_end(&mut Vec::new());
    }
}
