//! Several nodes through the real binary: 4 ranks on 2 simulated nodes, one
//! sidecar per node (each with its own socket and node-local directory),
//! one shared directory (`--shared`). Each node's sidecar writes its ranks'
//! parts and markers into the step's temp folder there; the sidecar serving
//! rank 0 commits. Durable reaches every rank only after that commit. A
//! node whose sidecar is SIGKILLed before its markers means the step never
//! commits, and its temp folder is gone after the part timeout. A rank that
//! never sends its part fails the step on every node, naming the rank.
//! Ranks whose sessions are gone after Released still commit.

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckpt_store::restore::{self, ReadOptions, Which};
use ckpt_store::{catalog, ranks};
use ckpt_test_support::{cli, sidecar_bin};
use ckpt_wire::{Blob, Reply, Request, TensorDesc};

/// One shared directory and the node-local directories beside it.
struct Cluster {
    tmp: tempfile::TempDir,
}

impl Cluster {
    fn new() -> Cluster {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("shared")).unwrap();
        Cluster { tmp }
    }

    fn shared(&self) -> PathBuf {
        self.tmp.path().join("shared")
    }

    /// Node `node`'s sidecar: socket and directory of its own, the shared one.
    fn node(&self, node: u32, part_timeout_s: &str) -> Node {
        self.node_with(node, part_timeout_s, &[])
    }

    /// Node `node`'s own directory (`--dir`).
    fn local(&self, node: u32) -> PathBuf {
        self.tmp.path().join(format!("node{node}")).join("local")
    }

    /// Node `node`'s sidecar with more options (`--node-local`, ...).
    fn node_with(&self, node: u32, part_timeout_s: &str, extra: &[&str]) -> Node {
        self.node_with_env(node, part_timeout_s, extra, &[])
    }

    /// [`Cluster::node_with`] with more environment (test hooks).
    fn node_with_env(&self, node: u32, part_timeout_s: &str, extra: &[&str], env: &[(&str, &str)]) -> Node {
        let base = self.tmp.path().join(format!("node{node}"));
        let (dir, socket, log) =
            (base.join("local"), base.join("run").join("s.sock"), self.tmp.path().join(format!("node{node}.log")));
        std::fs::create_dir_all(&base).unwrap();
        let child = Command::new(sidecar_bin())
            .args(["serve", "--staging", "64MiB", "--dir"])
            .arg(&dir)
            .arg("--shared")
            .arg(self.shared())
            .arg("--socket")
            .arg(&socket)
            .args(extra)
            .env("CKPT_SIDECAR_PART_TIMEOUT_S", part_timeout_s)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while UnixStream::connect(&socket).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "node {node}'s sidecar did not listen: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Node { child, socket, log }
    }
}

struct Node {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Node {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One rank: its connection to its node's sidecar and its shm segment.
struct Rank {
    rank: u32,
    s: UnixStream,
    shm_name: String,
    bytes: Vec<u8>,
}

impl Rank {
    fn connect(node: &Node, rank: u32, len: usize) -> Rank {
        let mut s = UnixStream::connect(&node.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        ckpt_wire::write_frame(&mut s, &ckpt_wire::hello("nodes-test")).unwrap();
        assert!(matches!(ckpt_wire::read_frame::<Reply>(&mut s).unwrap(), Reply::Welcome { .. }));
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let shm_name = format!(
            "/ckpt-nodes-test-{}-{rank}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mut bytes = vec![0u8; len];
        ckpt_store::synthetic::fill(&mut bytes, 11 + rank as u64);
        let c = std::ffi::CString::new(shm_name.clone()).unwrap();
        // SAFETY: plain libc calls with checked results on a segment of our own name.
        unsafe {
            libc::shm_unlink(c.as_ptr());
            let fd = libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600);
            assert!(fd >= 0);
            assert_eq!(libc::pwrite(fd, bytes.as_ptr().cast(), len, 0), len as isize);
            libc::close(fd);
        }
        ckpt_wire::write_frame(
            &mut s,
            &Request::RegisterRegion {
                id: 1,
                region_id: 1,
                shm_name: shm_name.clone(),
                len_bytes: len as u64,
                hand_over: false,
            },
        )
        .unwrap();
        assert!(matches!(ckpt_wire::read_frame::<Reply>(&mut s).unwrap(), Reply::RegionRegistered { .. }));
        Rank { rank, s, shm_name, bytes }
    }

    /// Sends this rank's part of `step`: its whole segment as two tensors
    /// named after the rank, and an RNG-like blob of its own.
    fn save(&mut self, step: u64, world_size: u32) {
        let n = self.bytes.len() as u64 / 4;
        let half = n / 2;
        let tensors = vec![
            TensorDesc {
                name: format!("w.{}", self.rank),
                dtype: "F32".into(),
                shape: vec![half],
                region_id: 1,
                offset_bytes: 0,
                len_bytes: 4 * half,
            },
            TensorDesc {
                name: format!("b.{}", self.rank),
                dtype: "F32".into(),
                shape: vec![n - half],
                region_id: 1,
                offset_bytes: 4 * half,
                len_bytes: 4 * (n - half),
            },
        ];
        let blobs = vec![Blob { name: format!("rng.rank-{:05}.pkl", self.rank), bytes: vec![self.rank as u8; 16] }];
        let req = Request::SavePart {
            id: 100 + step,
            step,
            rank: self.rank,
            world_size,
            tensors,
            blobs,
            lazy_release: self.rank % 2 == 0,
            unchanged: None,
        };
        ckpt_wire::write_frame(&mut self.s, &req).unwrap();
    }

    /// Sends this rank's part of `step` as the given tensors and blobs.
    fn save_part(&mut self, step: u64, world_size: u32, tensors: Vec<TensorDesc>, blobs: Vec<Blob>) {
        let req = Request::SavePart {
            id: 100 + step,
            step,
            rank: self.rank,
            world_size,
            tensors,
            blobs,
            lazy_release: false,
            unchanged: None,
        };
        ckpt_wire::write_frame(&mut self.s, &req).unwrap();
    }

    /// The first `len` bytes of this rank's segment as they are now.
    fn read_shm(&self, len: usize) -> Vec<u8> {
        let c = std::ffi::CString::new(self.shm_name.clone()).unwrap();
        let mut out = vec![0u8; len];
        // SAFETY: plain libc calls with checked results on a segment of our own name.
        unsafe {
            let fd = libc::shm_open(c.as_ptr(), libc::O_RDONLY, 0);
            assert!(fd >= 0);
            assert_eq!(libc::pread(fd, out.as_mut_ptr().cast(), len, 0), len as isize);
            libc::close(fd);
        }
        out
    }

    /// Zeroes this rank's segment (before a load into it).
    fn zero_shm(&self) {
        let c = std::ffi::CString::new(self.shm_name.clone()).unwrap();
        let zeros = vec![0u8; self.bytes.len()];
        // SAFETY: plain libc calls with checked results on a segment of our own name.
        unsafe {
            let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR, 0);
            assert!(fd >= 0);
            assert_eq!(libc::pwrite(fd, zeros.as_ptr().cast(), zeros.len(), 0), zeros.len() as isize);
            libc::close(fd);
        }
    }

    fn reply(&mut self) -> Reply {
        ckpt_wire::read_frame::<Reply>(&mut self.s).unwrap()
    }

    fn released(&mut self, step: u64) {
        match self.reply() {
            Reply::Released { step: s, .. } if s == step => {}
            other => panic!("rank {}: expected Released of step {step}, got {other:?}", self.rank),
        }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.shm_name.clone()).unwrap();
        // SAFETY: unlinking our own name.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// Temp folders (and files) left in `dir`, the coordinators' abort records
/// (`.tmp-step-…-ranks.aborted`, kept for the other nodes) aside.
fn temp_folders(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp") && !n.ends_with(".aborted"))
        .collect()
}

/// The reason the coordinator left in its abort record of `step`.
fn abort_record(dir: &Path, step: u64) -> String {
    std::fs::read_to_string(ckpt_store::nodes::abort_record_path(dir, step).unwrap()).unwrap_or_default()
}

/// Waits until the markers of `ranks` for `step` are in the shared
/// directory (bounded: a marker that never comes fails the test).
fn wait_for_markers(shared: &Path, step: u64, ranks: &[u32]) {
    let tmp = ckpt_store::nodes::ranks_tmp_path(shared, step).unwrap();
    let t0 = Instant::now();
    while !ranks.iter().all(|&r| tmp.join(ckpt_store::format::rank_marker_name(r)).exists()) {
        assert!(t0.elapsed() < Duration::from_secs(120), "markers of ranks {ranks:?} of step {step} never came");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Saves `step` on ranks 0..4 (0, 1 on node a; 2, 3 on node b), node b's
/// ranks first and rank 0 last, once the others' markers are in: the
/// coordinator's part timeout starts with rank 0's part, so it never decides
/// the outcome here, however slow the machine. Checks every rank gets
/// Durable only once the step is committed in the shared directory.
fn save_all(ranks: &mut [Rank], step: u64, shared: &Path) {
    for i in [2, 3, 1] {
        ranks[i].save(step, 4);
        ranks[i].released(step);
    }
    wait_for_markers(shared, step, &[1, 2, 3]);
    ranks[0].save(step, 4);
    ranks[0].released(step);
    for r in ranks.iter_mut() {
        match r.reply() {
            Reply::Durable { step: s, path, .. } => {
                assert_eq!(s, step);
                assert_eq!(Path::new(&path), catalog::step_path(&std::fs::canonicalize(shared).unwrap(), step));
                assert!(catalog::is_committed(shared, step), "rank {} got Durable before the commit", r.rank);
            }
            other => panic!("rank {}: expected Durable, got {other:?}", r.rank),
        }
    }
}

#[test]
fn four_ranks_on_two_nodes_commit_one_checkpoint_with_every_tensor() {
    let c = Cluster::new();
    let (a, b) = (c.node(0, "300"), c.node(1, "300"));
    let len = 3 << 20;
    let mut ranks = vec![
        Rank::connect(&a, 0, len),
        Rank::connect(&a, 1, len),
        Rank::connect(&b, 2, len),
        Rank::connect(&b, 3, len),
    ];
    save_all(&mut ranks, 5, &c.shared());
    let shared = c.shared();
    let index = restore::read_index(&shared, 5).unwrap();
    assert_eq!(index.ckpt.world_size, 4);
    assert_eq!(catalog::latest_step(&shared).unwrap(), Some(5));
    let per = ranks::bytes_per_rank(&index);
    let (lo, hi) = (*per.values().min().unwrap(), *per.values().max().unwrap());
    assert!(lo > 0 && (hi as f64) < lo as f64 * 1.10, "bytes per rank {per:?}");
    let l = restore::load(&shared, Which::Latest, &ReadOptions::default(), None).unwrap();
    assert_eq!(l.step, 5);
    for r in &ranks {
        let half = r.bytes.len() / 8 * 4;
        assert_eq!(l.tensor(&format!("w.{}", r.rank)).unwrap(), &r.bytes[..half], "rank {}", r.rank);
        assert_eq!(l.tensor(&format!("b.{}", r.rank)).unwrap(), &r.bytes[half..], "rank {}", r.rank);
        assert_eq!(l.blobs[&format!("rng.rank-{:05}.pkl", r.rank)], vec![r.rank as u8; 16]);
    }
    // Every marker is in the committed folder (the newest); nothing in flight
    // is left; the nodes' own directories hold no checkpoint.
    for r in 0..4 {
        assert!(catalog::step_path(&shared, 5).join(format!("rank-{r:05}.done")).is_file());
    }
    assert!(temp_folders(&shared).is_empty());
    assert!(a.log().contains("coordinator of this step"), "{}", a.log());
    assert!(!b.log().contains("coordinator of this step"), "{}", b.log());
    // A rank loads the whole checkpoint through its own node's sidecar
    // (a Load with no descriptors lists every tensor and blob).
    let mut r3 = Rank::connect(&b, 3, 4096);
    ckpt_wire::write_frame(&mut r3.s, &Request::Load { id: 9, step: None, tensors: vec![] }).unwrap();
    match r3.reply() {
        Reply::Loaded { step: 5, tensors, blobs, .. } => {
            assert_eq!(tensors.len(), 8);
            assert_eq!(blobs.len(), 4);
        }
        other => panic!("expected Loaded, got {other:?}"),
    }
    // A second step commits the same way, and `latest` moves.
    save_all(&mut ranks, 6, &c.shared());
    assert_eq!(catalog::latest_step(&shared).unwrap(), Some(6));
    // Each node then removes its own ranks' markers (and slice declarations)
    // of step 5, which no part compares with any more, so that retention on
    // the coordinator does not unlink them rank by rank. Step 5 still loads.
    let markers = |step: u64| -> Vec<u32> {
        (0..4).filter(|r| catalog::step_path(&shared, step).join(format!("rank-{r:05}.done")).exists()).collect()
    };
    let t0 = Instant::now();
    while !markers(5).is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(120), "step 5 still holds the markers of ranks {:?}", markers(5));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(markers(6), vec![0, 1, 2, 3]);
    let l5 = restore::load(&shared, Which::Step(5), &ReadOptions::default(), None).unwrap();
    assert_eq!(l5.tensor("w.3").unwrap(), &ranks[3].bytes[..ranks[3].bytes.len() / 8 * 4]);
}

#[test]
fn a_save_without_a_rank_is_rank_0_of_one_committed_in_the_shared_directory() {
    // One process and no WORLD_SIZE (a plain Save): before, it was
    // committed into --dir alone, Durable, and load("latest"), which reads
    // the shared directory, found no checkpoint.
    let c = Cluster::new();
    let a = c.node(0, "300");
    let mut r = Rank::connect(&a, 0, 1 << 20);
    let n = r.bytes.len() as u64 / 4;
    let tensors = vec![TensorDesc {
        name: "w".into(),
        dtype: "F32".into(),
        shape: vec![n],
        region_id: 1,
        offset_bytes: 0,
        len_bytes: 4 * n,
    }];
    for step in [3, 4] {
        let blobs = vec![Blob { name: "rng.state".into(), bytes: vec![step as u8; 8] }];
        let req =
            Request::Save { id: step, step, tensors: tensors.clone(), blobs, lazy_release: false, unchanged: None };
        ckpt_wire::write_frame(&mut r.s, &req).unwrap();
        r.released(step);
        match r.reply() {
            Reply::Durable { step: s, path, .. } if s == step => {
                assert_eq!(Path::new(&path), catalog::step_path(&c.shared(), step), "{}", a.log())
            }
            other => panic!("expected Durable of step {step}, got {other:?}\n{}", a.log()),
        }
    }
    assert_eq!(catalog::latest_step(&c.shared()).unwrap(), Some(4));
    assert!(!catalog::is_committed(&c.local(0), 4), "committed into --dir as well");
    let l = restore::load(&c.shared(), Which::Latest, &ReadOptions::default(), None).unwrap();
    assert_eq!((l.step, l.tensor("w").unwrap()), (4, &r.bytes[..]));
    assert_eq!(l.blobs["rng.state"], vec![4u8; 8]);
    // And through the sidecar, as the trainer resumes.
    ckpt_wire::write_frame(&mut r.s, &Request::Load { id: 9, step: None, tensors: vec![] }).unwrap();
    assert!(matches!(r.reply(), Reply::Loaded { step: 4, .. }));
}

#[test]
fn a_node_whose_sidecar_is_killed_mid_write_never_commits_and_its_folder_is_removed() {
    let c = Cluster::new();
    let (a, mut b) = (c.node(0, "5"), c.node(1, "5"));
    let shared = c.shared();
    let mut ranks = vec![
        Rank::connect(&a, 0, 1 << 20),
        Rank::connect(&a, 1, 1 << 20),
        Rank::connect(&b, 2, 48 << 20),
        Rank::connect(&b, 3, 1 << 20),
    ];
    save_all(&mut ranks, 1, &shared);
    // Step 2: rank 2's large part is released, then node b's sidecar is
    // SIGKILLed (mid-write or just after; rank 3's part never goes out).
    ranks[2].save(2, 4);
    ranks[2].released(2);
    ckpt_test_support::kill9(&mut b.child);
    for i in [0, 1] {
        ranks[i].save(2, 4);
        ranks[i].released(2);
    }
    for i in [0, 1] {
        match ranks[i].reply() {
            Reply::Failed { step: 2, reason, .. } => {
                assert!(
                    reason.contains("wrote no marker") && reason.contains('3') && reason.contains("of 4"),
                    "{reason}"
                );
                assert!(reason.contains("aborted"), "{reason}");
            }
            other => panic!("rank {i}: expected Failed, got {other:?}\n{}", a.log()),
        }
    }
    // The coordinator removed the step's temp folder (node b's half-written
    // files with it) before answering; step 1 is still the newest and loads.
    assert!(!catalog::is_committed(&shared, 2));
    assert!(temp_folders(&shared).is_empty(), "{:?}", temp_folders(&shared));
    assert_eq!(catalog::latest_step(&shared).unwrap(), Some(1));
    let l = restore::load(&shared, Which::Latest, &ReadOptions::default(), None).unwrap();
    assert_eq!(l.step, 1);
    assert_eq!(l.tensor("b.3").unwrap(), &ranks[3].bytes[ranks[3].bytes.len() / 8 * 4..]);
}

#[test]
fn a_rank_that_never_sends_fails_the_step_on_every_node_naming_it() {
    let c = Cluster::new();
    // Long enough for the three present ranks' parts (and the four of the
    // retry) to arrive on a loaded machine: at 1.5 s the test failed there.
    // Node b's own timeout far longer: it never gives its rank up before the
    // coordinator's abort (which decides), however slow the machine.
    let (a, b) = (c.node(0, "5"), c.node(1, "60"));
    let shared = c.shared();
    let mut ranks = vec![Rank::connect(&a, 0, 1 << 20), Rank::connect(&a, 1, 1 << 20), Rank::connect(&b, 2, 1 << 20)];
    // Rank 3 (node b) died before its part: ranks 0, 1, 2 wait, then fail.
    // Rank 0 (whose part starts the coordinator's clock) last, once the
    // others' markers are in: only rank 3's absence decides the outcome.
    for i in [1, 2] {
        ranks[i].save(7, 4);
        ranks[i].released(7);
    }
    wait_for_markers(&shared, 7, &[1, 2]);
    ranks[0].save(7, 4);
    ranks[0].released(7);
    for r in ranks.iter_mut() {
        match r.reply() {
            Reply::Failed { step: 7, reason, .. } => assert!(reason.contains("[3] of 4"), "rank {}: {reason}", r.rank),
            other => panic!("rank {}: expected Failed, got {other:?}", r.rank),
        }
    }
    assert!(!catalog::is_committed(&shared, 7));
    assert!(temp_folders(&shared).is_empty());
    // Node b learned it from the shared directory (its own rank 2's answer):
    // the coordinator's reason, naming the ranks missing when it aborted,
    // whenever node b last looked (before: node b named the ranks whose
    // markers it had not seen, [0, 1, 3] when it last looked before theirs came).
    assert!(abort_record(&shared, 7).contains("[3] of 4"), "{}", abort_record(&shared, 7));
    assert!(b.log().contains("the coordinator (rank 0's sidecar) aborted the step"), "{}", b.log());
    // The step can be saved again, by all four ranks.
    ranks.push(Rank::connect(&b, 3, 1 << 20));
    save_all(&mut ranks, 7, &shared);
}

#[test]
fn ranks_gone_after_release_still_commit_on_every_node() {
    let c = Cluster::new();
    let (a, b) = (c.node(0, "300"), c.node(1, "300"));
    let shared = c.shared();
    {
        let mut ranks = [
            Rank::connect(&a, 0, 2 << 20),
            Rank::connect(&a, 1, 2 << 20),
            Rank::connect(&b, 2, 2 << 20),
            Rank::connect(&b, 3, 2 << 20),
        ];
        for i in [3, 2, 1, 0] {
            ranks[i].save(9, 4);
            ranks[i].released(9);
        }
        // Every trainer is gone (its connection closed, its segment unlinked).
    }
    let t0 = Instant::now();
    while !catalog::is_committed(&shared, 9) {
        assert!(t0.elapsed() < Duration::from_secs(120), "step 9 not committed:\n{}\n{}", a.log(), b.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let l = restore::load(&shared, Which::Step(9), &ReadOptions::default(), None).unwrap();
    assert_eq!(l.index.ckpt.tensors.len(), 8);
    assert_eq!(l.index.ckpt.world_size, 4);
}

#[test]
fn status_names_the_shared_directory_and_the_steps_a_sidecar_coordinates() {
    let c = Cluster::new();
    let a = c.node(0, "300");
    let mut r0 = Rank::connect(&a, 0, 1 << 20);
    r0.save(8, 2);
    r0.released(8);
    // Rank 1 never comes: node a coordinates step 8 until the test ends.
    let out = Command::new(sidecar_bin()).args(["status", "--json", "--socket"]).arg(&a.socket).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["shared_dir"].as_str().map(PathBuf::from), Some(std::fs::canonicalize(c.shared()).unwrap()));
    let t0 = Instant::now();
    loop {
        let out = Command::new(sidecar_bin()).args(["status", "--socket"]).arg(&a.socket).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.contains("coordinator of step(s) [8]") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_dead_coordinator_fails_the_other_nodes_ranks_and_its_folder_goes_at_a_later_start() {
    let c = Cluster::new();
    let (mut a, b) = (c.node(0, "1"), c.node(1, "1"));
    let shared = c.shared();
    let mut r0 = Rank::connect(&a, 0, 1 << 20);
    let mut r1 = Rank::connect(&b, 1, 1 << 20);
    r0.save(3, 2);
    r0.released(3);
    // Rank 0's marker is in: then its sidecar (the coordinator) dies.
    let marker = shared.join(".tmp-step-000000000003-ranks").join("rank-00000.done");
    let t0 = Instant::now();
    while !marker.exists() {
        assert!(t0.elapsed() < Duration::from_secs(60), "{}", a.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    ckpt_test_support::kill9(&mut a.child);
    r1.save(3, 2);
    r1.released(3);
    match r1.reply() {
        Reply::Failed { step: 3, reason, .. } => {
            assert!(reason.contains("no commit nor abort by the coordinator"), "{reason}")
        }
        other => panic!("expected Failed, got {other:?}\n{}", b.log()),
    }
    // Node b withdrew its own rank's files; rank 0's are left to recovery.
    let tmp = shared.join(".tmp-step-000000000003-ranks");
    assert!(tmp.join("rank-00000.done").exists() && !tmp.join("rank-00001.done").exists());
    assert!(!catalog::is_committed(&shared, 3));
    // Once nothing touched it for twice the part timeout, a sidecar that
    // starts removes it.
    let newest = || {
        std::fs::read_dir(&tmp)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().modified().unwrap())
            .chain([std::fs::metadata(&tmp).unwrap().modified().unwrap()])
            .max()
            .unwrap()
    };
    let t0 = Instant::now();
    while newest().elapsed().unwrap_or_default() < Duration::from_millis(2500) {
        assert!(t0.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(50));
    }
    let a2 = c.node(2, "1");
    assert!(!tmp.exists(), "{}", a2.log());
    assert!(a2.log().contains("ranks"), "{}", a2.log());
}

fn f32s(name: &str, n: u64, offset_bytes: u64) -> TensorDesc {
    TensorDesc { name: name.into(), dtype: "F32".into(), shape: vec![n], region_id: 1, offset_bytes, len_bytes: 4 * n }
}

/// Rank `rank`'s declaration that its tensor `piece` is elements `[a, b)` of
/// `w`, F32 [3, 100] (the blob ckpt.slices.json).
fn declares(piece: &str, a: u64, b: u64) -> Blob {
    let json = format!(r#"{{"slices":[{{"tensor":"{piece}","of":"w","shape":[3,100],"elems":[{a},{b}]}}]}}"#);
    Blob { name: ckpt_sidecar::commit::slices::SLICES_BLOB.into(), bytes: json.into_bytes() }
}

#[test]
fn a_tensor_split_across_two_nodes_is_one_logical_tensor_that_loads_whole_by_name() {
    let c = Cluster::new();
    let (a, b) = (c.node(0, "300"), c.node(1, "300"));
    let shared = c.shared();
    let (mut r0, mut r1) = (Rank::connect(&a, 0, 1 << 20), Rank::connect(&b, 1, 1 << 20));
    // w is F32 [3, 100]: elements [0, 100) on rank 0 (node a), [100, 300) on rank 1 (node b).
    r1.save_part(
        4,
        2,
        vec![f32s("w#elems[100:300]", 200, 4096), f32s("b", 10, 8192)],
        vec![declares("w#elems[100:300]", 100, 300)],
    );
    r1.released(4);
    r0.save_part(4, 2, vec![f32s("w#elems[0:100]", 100, 0)], vec![declares("w#elems[0:100]", 0, 100)]);
    r0.released(4);
    for r in [&mut r0, &mut r1] {
        match r.reply() {
            Reply::Durable { step: 4, .. } => {}
            other => panic!("rank {}: expected Durable, got {other:?}\n{}\n{}", r.rank, a.log(), b.log()),
        }
    }
    // Each rank's declarations travelled beside its marker into the index.
    let dir = catalog::step_path(&shared, 4);
    assert!(dir.join("rank-00000.slices.json").is_file() && dir.join("rank-00001.slices.json").is_file());
    let index = restore::read_index(&shared, 4).unwrap();
    // Slices (2) and, with the default --incremental on, the parts' digests (3).
    assert_eq!(index.ckpt.format_version, 3);
    assert!(index.ckpt.blobs.is_empty(), "declarations are not stored as blobs");
    let w = index.logical_tensor("w").unwrap();
    assert_eq!((w.shape, w.slices.len()), (&[3u64, 100][..], 2));
    assert_eq!(w.slices.iter().map(|s| s.elems).collect::<Vec<_>>(), [[0, 100], [100, 300]]);
    let whole: Vec<u8> = [&r0.bytes[..400], &r1.bytes[4096..4096 + 800]].concat();
    let l = restore::load(&shared, Which::Step(4), &ReadOptions::default(), None).unwrap();
    assert_eq!(l.logical_bytes("w").unwrap(), whole);

    // Through node b's sidecar: the listing names the logical tensor, and a
    // Load by that name gets it whole.
    let mut r = Rank::connect(&b, 1, 1 << 20);
    ckpt_wire::write_frame(&mut r.s, &Request::Load { id: 20, step: Some(4), tensors: vec![] }).unwrap();
    match r.reply() {
        Reply::Loaded { tensors, .. } => {
            let names: Vec<(&str, &[u64], u64)> =
                tensors.iter().map(|t| (t.name.as_str(), t.shape.as_slice(), t.len_bytes)).collect();
            assert_eq!(names, [("b", &[10u64][..], 40), ("w", &[3, 100][..], 1200)]);
        }
        other => panic!("expected Loaded, got {other:?}"),
    }
    let desc = TensorDesc {
        name: "w".into(),
        dtype: "F32".into(),
        shape: vec![3, 100],
        region_id: 1,
        offset_bytes: 65536,
        len_bytes: 1200,
    };
    ckpt_wire::write_frame(&mut r.s, &Request::Load { id: 21, step: Some(4), tensors: vec![desc] }).unwrap();
    assert!(matches!(r.reply(), Reply::Loaded { step: 4, .. }));
    assert_eq!(&r.read_shm(65536 + 1200)[65536..], &whole[..]);

    // Declarations that leave a gap across the nodes: the coordinator's
    // commit fails, every rank is told so in one line, nothing is committed.
    r0.save_part(5, 2, vec![f32s("w#elems[0:100]", 100, 0)], vec![declares("w#elems[0:100]", 0, 100)]);
    r0.released(5);
    r1.save_part(5, 2, vec![f32s("w#elems[100:300]", 200, 4096)], vec![declares("w#elems[100:300]", 120, 300)]);
    r1.released(5);
    for r in [&mut r0, &mut r1] {
        match r.reply() {
            Reply::Failed { step: 5, reason, .. } => {
                assert!(!reason.contains('\n'), "rank {}: {reason}", r.rank);
                // Rank 0's sidecar (the coordinator) names the cause, and
                // node b answers with it (its abort record).
                assert!(
                    reason.contains("sliced tensor \"w\"") && reason.contains("the coordinator's commit failed"),
                    "rank {}: {reason}",
                    r.rank
                );
            }
            other => panic!("rank {}: expected Failed, got {other:?}", r.rank),
        }
    }
    assert!(a.log().contains("sliced tensor \"w\""), "{}", a.log());
    assert!(!catalog::is_committed(&shared, 5));
    assert!(temp_folders(&shared).is_empty(), "{:?}", temp_folders(&shared));
    // A rank that declares a tensor not in its part is refused by its own node at once.
    r1.save_part(6, 2, vec![f32s("v", 10, 0)], vec![declares("w#elems[100:300]", 100, 300)]);
    r1.released(6);
    match r1.reply() {
        Reply::Failed { step: 6, reason, .. } => assert!(reason.contains("which is not in its part"), "{reason}"),
        other => panic!("expected Failed, got {other:?}"),
    }
}

/// A part is written while it is copied (the pipeline): a part whose copy
/// is stopped (its trainer gone before Released) leaves no file and no
/// marker of its rank in the step's temp folder, though its shards were
/// being written meanwhile (32 MiB: handed to the committer before the
/// copy), and the step does not commit.
#[test]
fn a_part_whose_copy_is_stopped_leaves_no_file_of_its_rank() {
    let c = Cluster::new();
    let a = c.node(0, "60");
    let shared = c.shared();
    let mut r0 = Rank::connect(&a, 0, 32 << 20);
    // Gone before Released: the copy stops at its next check. The sidecar
    // is stopped while the part is sent and the client goes, so its copy
    // cannot end first (before: on a loaded machine it sometimes did, the
    // part was released and written, and the test waited for ever).
    let pid = a.child.id() as i32;
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    r0.save(5, 2);
    r0.s.shutdown(std::net::Shutdown::Both).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let t0 = Instant::now();
    while !a.log().contains("writing this rank's part into the shared directory failed") {
        assert!(t0.elapsed() < Duration::from_secs(120), "the stopped part was never given up: {}", a.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(a.log().contains("aborted before release"), "{}", a.log());
    let tmp = ckpt_store::nodes::ranks_tmp_path(&shared, 5).unwrap();
    let left: Vec<String> = std::fs::read_dir(&tmp)
        .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(
        left.iter().all(|n| ranks::rank_of_file(n) != Some(0) && !n.contains("rank-00000")),
        "rank 0's files left: {left:?}"
    );
    assert!(!catalog::is_committed(&shared, 5));
}

#[test]
fn ranks_on_two_nodes_that_saved_different_states_are_refused_on_both_naming_the_tensor() {
    // Before: the coordinator committed a and only1 under rank 0's skeleton
    // naming a and only0, a step the Python package cannot load.
    let c = Cluster::new();
    let (a, b) = (c.node(0, "300"), c.node(1, "300"));
    let shared = c.shared();
    let (mut r0, mut r1) = (Rank::connect(&a, 0, 1 << 20), Rank::connect(&b, 1, 1 << 20));
    let skeleton = Blob {
        name: ckpt_store::skeleton::STRUCTURE_BLOB.into(),
        bytes: ckpt_store::skeleton::minimal_skeleton(&["a", "only0"]),
    };
    r1.save_part(5, 2, vec![f32s("only1", 100, 0)], vec![]);
    r1.released(5);
    r0.save_part(5, 2, vec![f32s("a", 100, 0)], vec![skeleton]);
    r0.released(5);
    for r in [&mut r0, &mut r1] {
        match r.reply() {
            Reply::Failed { step: 5, reason, .. } => {
                assert!(
                    reason.contains("\"only0\"")
                        && reason.contains("rank 1 stores \"only1\"")
                        && !reason.contains('\n'),
                    "rank {}: {reason}",
                    r.rank
                );
            }
            other => panic!("rank {}: expected Failed, got {other:?}", r.rank),
        }
    }
    assert!(!catalog::is_committed(&shared, 5));
    assert!(temp_folders(&shared).is_empty(), "{:?}", temp_folders(&shared));
}

// ------------------------------------------------ node-local files (--node-local)

/// The files of `dir` (names), sorted; empty when it does not exist.
fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// The shard files of ranks `ranks` of a world of 4 (one shard each here).
/// The ranks whose shards `names` are (`rank-R-of-…-shard-…`), each once, in
/// order: how many shards a rank's part takes is the layout's business (an
/// incremental save puts stable tensors in shards of their own).
fn ranks_of(names: &[String]) -> Vec<u32> {
    let mut ranks: Vec<u32> = names
        .iter()
        .map(|n| {
            assert!(n.ends_with(".safetensors"), "{n}: not a shard");
            n.strip_prefix("rank-")
                .and_then(|r| r.get(..5))
                .and_then(|r| r.parse().ok())
                .unwrap_or_else(|| panic!("{n}: not a rank's shard"))
        })
        .collect();
    ranks.dedup();
    ranks
}

/// Sends a Load of `names` (each with its shape and bytes as rank `owner`
/// saved them: `w.R` then `b.R`, F32) into `r`'s region at offset 0.
fn load_tensors(r: &mut Rank, step: u64, owner: &Rank) -> Reply {
    let n = owner.bytes.len() as u64 / 4;
    let half = n / 2;
    let tensors = vec![
        TensorDesc {
            name: format!("w.{}", owner.rank),
            dtype: "F32".into(),
            shape: vec![half],
            region_id: 1,
            offset_bytes: 0,
            len_bytes: 4 * half,
        },
        TensorDesc {
            name: format!("b.{}", owner.rank),
            dtype: "F32".into(),
            shape: vec![n - half],
            region_id: 1,
            offset_bytes: 4 * half,
            len_bytes: 4 * (n - half),
        },
    ];
    ckpt_wire::write_frame(&mut r.s, &Request::Load { id: 50, step: Some(step), tensors }).unwrap();
    r.reply()
}

#[test]
fn node_local_shards_stay_on_each_nodes_own_disk_and_the_index_names_their_holders() {
    // Before: every node's shards went into the shared directory; there was
    // no way to write with each node's own disks.
    let c = Cluster::new();
    let (a, mut b) = (
        c.node_with(0, "300", &["--node-local", "--node-id", "node-a"]),
        c.node_with(1, "300", &["--node-local", "--node-id", "node-b"]),
    );
    let shared = c.shared();
    let len = 2 << 20;
    let mut ranks = vec![
        Rank::connect(&a, 0, len),
        Rank::connect(&a, 1, len),
        Rank::connect(&b, 2, len),
        Rank::connect(&b, 3, len),
    ];
    save_all(&mut ranks, 5, &shared);
    // The shared directory holds the index, markers and blobs, no shard.
    let step_dir = catalog::step_path(&shared, 5);
    assert!(names_in(&step_dir).iter().all(|n| !n.ends_with(".safetensors")), "{:?}", names_in(&step_dir));
    assert!(step_dir.join("blobs").join("rng.rank-00002.pkl").is_file());
    // Each node's shards are in its own node-step folder.
    let folder = ckpt_store::format::node_step_dir_name(5).unwrap();
    assert_eq!(ranks_of(&names_in(&c.local(0).join(&folder))), [0, 1]);
    assert_eq!(ranks_of(&names_in(&c.local(1).join(&folder))), [2, 3]);
    // The index says which node holds which file, and where.
    let index = restore::read_index(&shared, 5).unwrap();
    assert_eq!(index.ckpt.nodes.keys().collect::<Vec<_>>(), ["node-a", "node-b"]);
    for (id, node, ranks) in [("node-a", 0, [0, 1]), ("node-b", 1, [2, 3])] {
        let n = &index.ckpt.nodes[id];
        assert_eq!(ranks_of(&n.files), ranks);
        let (mut listed, mut on_disk) = (n.files.clone(), names_in(&c.local(node).join(&folder)));
        listed.sort();
        on_disk.sort();
        assert_eq!(listed, on_disk, "the index lists exactly the files in {id}'s folder");
        assert_eq!(n.dirs, [std::fs::canonicalize(c.local(node)).unwrap().display().to_string()]);
        for f in &n.files {
            assert_eq!(index.holder(f).map(|(h, _)| h), Some(id));
        }
    }
    // On this one machine a reader that names no node reads every node's
    // files where they were recorded: the whole step, bit-equal.
    let l = restore::load(&shared, Which::Latest, &ReadOptions::default(), None).unwrap();
    assert_eq!(l.step, 5);
    for r in &ranks {
        let half = r.bytes.len() / 8 * 4;
        assert_eq!(l.tensor(&format!("w.{}", r.rank)).unwrap(), &r.bytes[..half]);
        assert_eq!(l.tensor(&format!("b.{}", r.rank)).unwrap(), &r.bytes[half..]);
    }
    // Node b is gone, and its disk with it.
    ckpt_test_support::kill9(&mut b.child);
    std::fs::remove_dir_all(c.local(1)).unwrap();
    // Node a's rank 0 restores its own tensors from node a's disk alone.
    let mut r0 = Rank::connect(&a, 0, len);
    r0.zero_shm();
    assert_eq!(r0.read_shm(len), vec![0u8; len]);
    match load_tensors(&mut r0, 5, &ranks[0]) {
        Reply::Loaded { step: 5, source, .. } => assert_eq!(source, ckpt_wire::LoadSource::Disk),
        other => panic!("expected Loaded, got {other:?}\n{}", a.log()),
    }
    assert_eq!(r0.read_shm(len), ranks[0].bytes);
    // A tensor node b held: a clear error naming node b and the way out.
    match load_tensors(&mut r0, 5, &ranks[2]) {
        Reply::Error { code, message, .. } => {
            assert_eq!(code, ckpt_wire::ErrorCode::NotFound);
            assert!(
                message.contains("held by node \"node-b\"")
                    && message.contains("this is node \"node-a\"")
                    && message.contains("--drain"),
                "{message}"
            );
        }
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn node_local_step_whose_node_is_killed_before_its_marker_aborts_on_both_and_leaves_no_folder() {
    let c = Cluster::new();
    let (a, mut b) = (
        c.node_with(0, "5", &["--node-local", "--node-id", "a"]),
        c.node_with(1, "5", &["--node-local", "--node-id", "b"]),
    );
    let shared = c.shared();
    let mut ranks = vec![
        Rank::connect(&a, 0, 1 << 20),
        Rank::connect(&a, 1, 1 << 20),
        Rank::connect(&b, 2, 48 << 20),
        Rank::connect(&b, 3, 1 << 20),
    ];
    save_all(&mut ranks, 1, &shared);
    // Step 2: rank 2's large part is released, then node b's sidecar is
    // SIGKILLed (mid-write or just after; rank 3's part never goes out).
    ranks[2].save(2, 4);
    ranks[2].released(2);
    ckpt_test_support::kill9(&mut b.child);
    for i in [0, 1] {
        ranks[i].save(2, 4);
        ranks[i].released(2);
    }
    for i in [0, 1] {
        match ranks[i].reply() {
            Reply::Failed { step: 2, reason, .. } => assert!(
                reason.contains("wrote no marker") && reason.contains("of 4") && reason.contains("aborted"),
                "{reason}"
            ),
            other => panic!("rank {i}: expected Failed, got {other:?}\n{}", a.log()),
        }
    }
    // Nothing of step 2 is visible: not committed, no temp folder, and
    // node a removed its own node-local folder of it when the step failed.
    let folder = ckpt_store::format::node_step_dir_name(2).unwrap();
    assert!(!catalog::is_committed(&shared, 2));
    assert!(temp_folders(&shared).is_empty(), "{:?}", temp_folders(&shared));
    assert!(!c.local(0).join(&folder).exists(), "{:?}", names_in(&c.local(0)));
    assert_eq!(catalog::latest_step(&shared).unwrap(), Some(1));
    // Node b's sidecar starts again: its half-written folder of the aborted
    // step goes (recovery), its folder of the committed step 1 stays.
    let b2 = c.node_with(1, "5", &["--node-local", "--node-id", "b"]);
    assert!(!c.local(1).join(&folder).exists(), "{:?}\n{}", names_in(&c.local(1)), b2.log());
    assert_eq!(ranks_of(&names_in(&c.local(1).join(ckpt_store::format::node_step_dir_name(1).unwrap()))), [2, 3]);
    let l = restore::load(&shared, Which::Latest, &ReadOptions::default(), None).unwrap();
    assert_eq!(l.step, 1);
    assert_eq!(l.tensor("b.3").unwrap(), &ranks[3].bytes[ranks[3].bytes.len() / 8 * 4..]);
}

#[test]
fn node_local_folders_follow_the_coordinators_retention() {
    let c = Cluster::new();
    let args = |id| ["--node-local", "--node-id", id, "--keep", "1"];
    let (a, b) = (c.node_with(0, "300", &args("a")), c.node_with(1, "300", &args("b")));
    let shared = c.shared();
    let mut ranks = vec![
        Rank::connect(&a, 0, 1 << 20),
        Rank::connect(&a, 1, 1 << 20),
        Rank::connect(&b, 2, 1 << 20),
        Rank::connect(&b, 3, 1 << 20),
    ];
    let folder = |s| ckpt_store::format::node_step_dir_name(s).unwrap();
    save_all(&mut ranks, 1, &shared);
    save_all(&mut ranks, 2, &shared);
    // The coordinator un-commits step 1 after its answer (retention is off
    // the commit path), then removes node a's folder of it.
    wait_until("retention and node a's sweep after step 2", || {
        catalog::committed_steps(&shared).unwrap() == [2] && !c.local(0).join(folder(1)).exists()
    });
    assert!(c.local(0).join(folder(2)).is_dir());
    save_all(&mut ranks, 3, &shared);
    // Node b follows at its next decision at the latest.
    assert!(!c.local(1).join(folder(1)).exists() && c.local(1).join(folder(3)).is_dir(), "{:?}", names_in(&c.local(1)));
    wait_until("node a's sweep after step 3", || !c.local(0).join(folder(2)).exists());
}

/// Waits for `cond`, which the sidecars make true after an answer; the
/// deadline only bounds a hang.
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "{what}: not within 120 s");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Sends a Load of every tensor of `owners` (as `load_tensors` lays out one
/// rank's) into `r`'s region, one owner after the other at `stride`.
fn load_all_tensors(r: &mut Rank, step: Option<u64>, owners: &[Rank], stride: u64) -> Reply {
    let mut tensors = Vec::new();
    for (i, o) in owners.iter().enumerate() {
        let n = o.bytes.len() as u64 / 4;
        let half = n / 2;
        let base = i as u64 * stride;
        tensors.push(TensorDesc {
            name: format!("w.{}", o.rank),
            dtype: "F32".into(),
            shape: vec![half],
            region_id: 1,
            offset_bytes: base,
            len_bytes: 4 * half,
        });
        tensors.push(TensorDesc {
            name: format!("b.{}", o.rank),
            dtype: "F32".into(),
            shape: vec![n - half],
            region_id: 1,
            offset_bytes: base + 4 * half,
            len_bytes: 4 * (n - half),
        });
    }
    ckpt_wire::write_frame(&mut r.s, &Request::Load { id: 60, step, tensors }).unwrap();
    r.reply()
}

#[test]
fn node_local_steps_drain_from_every_node_and_load_from_the_drain_once_a_node_is_gone() {
    // Before: a drain target with --shared drained nothing of the nodes'
    // steps, and a node-local step whose other node was gone did not load.
    let c = Cluster::new();
    let remote = c.tmp.path().join("remote");
    std::fs::create_dir(&remote).unwrap();
    let url = format!("file://{}", remote.display());
    // --shared with --drain: node-local files (no --node-local needed).
    let (a, mut b) = (
        c.node_with(0, "300", &["--node-id", "node-a", "--drain", &url]),
        c.node_with(1, "300", &["--node-id", "node-b", "--drain", &url]),
    );
    let shared = c.shared();
    let len = 1 << 20;
    let mut ranks = vec![
        Rank::connect(&a, 0, len),
        Rank::connect(&a, 1, len),
        Rank::connect(&b, 2, len),
        Rank::connect(&b, 3, len),
    ];
    save_all(&mut ranks, 4, &shared);
    assert!(names_in(&catalog::step_path(&shared, 4)).iter().all(|n| !n.ends_with(".safetensors")));
    // Every rank hears Replicated: each node uploaded its own files, node a
    // (holding rank 0's) the blobs and the remote index once both had.
    for r in ranks.iter_mut() {
        ckpt_wire::write_frame(&mut r.s, &Request::WaitReplicated { id: 70, step: 4 }).unwrap();
        match r.reply() {
            Reply::Replicated { step: 4, .. } => {}
            other => panic!("rank {}: expected Replicated, got {other:?}\n{}\n{}", r.rank, a.log(), b.log()),
        }
    }
    // The target holds an ordinary one-directory checkpoint: every file, no node.
    let index = restore::read_index(&remote, 4).unwrap();
    assert!(index.ckpt.nodes.is_empty() && index.ckpt.files.iter().all(|f| f.dir_idx == 0));
    assert_eq!(names_in(&catalog::step_path(&remote, 4)).iter().filter(|n| n.ends_with(".safetensors")).count(), 4);
    assert!(!shared.join(".drain-step-000000000004").exists(), "upload marks left: {:?}", names_in(&shared));
    let l = restore::load(&remote, Which::Latest, &ReadOptions::default(), None).unwrap();
    assert_eq!(l.step, 4);
    for r in &ranks {
        let half = r.bytes.len() / 8 * 4;
        assert_eq!(l.tensor(&format!("w.{}", r.rank)).unwrap(), &r.bytes[..half]);
        assert_eq!(l.tensor(&format!("b.{}", r.rank)).unwrap(), &r.bytes[half..]);
    }
    // Node b is gone, and its disk with it: through node a, every tensor
    // of `latest` (node b's from the drain target), bit-equal.
    ckpt_test_support::kill9(&mut b.child);
    std::fs::remove_dir_all(c.local(1)).unwrap();
    let mut r = Rank::connect(&a, 0, 4 * len);
    r.zero_shm();
    match load_all_tensors(&mut r, None, &ranks, len as u64) {
        Reply::Loaded { step: 4, .. } => {}
        other => panic!("expected Loaded, got {other:?}\n{}", a.log()),
    }
    let got = r.read_shm(4 * len);
    for (i, o) in ranks.iter().enumerate() {
        assert_eq!(&got[i * len..(i + 1) * len], &o.bytes[..], "rank {}'s tensors", o.rank);
    }
    assert!(a.log().contains("loading from the drain target: another node holds"), "{}", a.log());
}

#[test]
fn node_local_shards_are_striped_over_a_nodes_directories_and_its_ranks_load_them() {
    let c = Cluster::new();
    let second = c.tmp.path().join("node1").join("local2");
    let (a, b) = (
        c.node_with(0, "300", &["--node-local", "--node-id", "a"]),
        c.node_with(
            1,
            "300",
            &["--node-local", "--node-id", "b", "--dir", second.to_str().unwrap(), "--shard-size", "1MiB"],
        ),
    );
    let shared = c.shared();
    let len = 4 << 20;
    let mut ranks = vec![
        Rank::connect(&a, 0, len),
        Rank::connect(&a, 1, len),
        Rank::connect(&b, 2, len),
        Rank::connect(&b, 3, len),
    ];
    save_all(&mut ranks, 6, &shared);
    let index = restore::read_index(&shared, 6).unwrap();
    let nb = &index.ckpt.nodes["b"];
    assert_eq!(nb.dirs, [c.local(1), second.clone()].map(|d| std::fs::canonicalize(d).unwrap().display().to_string()));
    // Node b's ranks' shards are spread over both of its directories.
    let folder = ckpt_store::format::node_step_dir_name(6).unwrap();
    let (in1, in2) = (names_in(&c.local(1).join(&folder)), names_in(&second.join(&folder)));
    assert!(!in1.is_empty() && !in2.is_empty(), "{in1:?} {in2:?}");
    let mut all: Vec<String> = in1.iter().chain(&in2).cloned().collect();
    all.sort();
    assert_eq!(all, nb.files);
    for f in &index.ckpt.files {
        if let Some(("b", _)) = index.holder(&f.name) {
            let d = if in1.contains(&f.name) { 0 } else { 1 };
            assert_eq!(f.dir_idx, d, "{}", f.name);
        }
    }
    // Rank 3 restores its tensors through node b's sidecar, from both disks.
    let mut r3 = Rank::connect(&b, 3, len);
    r3.zero_shm();
    assert!(matches!(load_tensors(&mut r3, 6, &ranks[3]), Reply::Loaded { step: 6, .. }));
    assert_eq!(r3.read_shm(len), ranks[3].bytes);
}

// ------------------------------------------------------ incremental parts

impl Rank {
    /// Writes `bytes` at `offset` of this rank's segment (and of its copy).
    fn write_shm(&mut self, offset: usize, bytes: &[u8]) {
        self.bytes[offset..offset + bytes.len()].copy_from_slice(bytes);
        let c = std::ffi::CString::new(self.shm_name.clone()).unwrap();
        // SAFETY: plain libc calls with checked results on a segment of our own name.
        unsafe {
            let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR, 0);
            assert!(fd >= 0);
            assert_eq!(
                libc::pwrite(fd, bytes.as_ptr().cast(), bytes.len(), offset as libc::off_t),
                bytes.len() as isize
            );
            libc::close(fd);
        }
    }
}

/// One rank's state of the incremental tests: `frozen.R` (the first
/// `frozen` bytes of its segment) and `moving.R` (the rest), F32.
fn frozen_and_moving(rank: u32, frozen: u64, moving: u64) -> Vec<TensorDesc> {
    vec![f32s(&format!("frozen.{rank}"), frozen / 4, 0), f32s(&format!("moving.{rank}"), moving / 4, frozen)]
}

/// Saves `step` on ranks 0 (node a) and 1 (node b) of a world of 2, rank
/// 1 first and rank 0 once rank 1's marker is in (as `save_all`); both Durable.
fn save_two(ranks: &mut [Rank], step: u64, shared: &Path, frozen: u64, moving: u64) {
    for i in [1, 0] {
        if i == 0 {
            wait_for_markers(shared, step, &[1]);
        }
        let r = &mut ranks[i];
        r.save_part(step, 2, frozen_and_moving(r.rank, frozen, moving), vec![]);
        r.released(step);
    }
    for r in ranks.iter_mut() {
        match r.reply() {
            Reply::Durable { step: s, .. } if s == step => {}
            other => panic!("rank {}: expected Durable of step {step}, got {other:?}", r.rank),
        }
    }
}

/// (dev, ino) of the file holding tensor `name` in committed step `step`
/// of the shared directory (a node-held file where its node recorded it).
fn inode_of(shared: &Path, step: u64, name: &str) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let index = restore::read_index(shared, step).unwrap();
    let file = &index.ckpt.tensors[name].file;
    let id = ckpt_store::incremental::file_inode(shared, step, file)
        .unwrap_or_else(|| panic!("step {step}: no file {file}"));
    let folder = match index.holder(file) {
        Some((_, n)) => PathBuf::from(&n.dirs[0]).join(ckpt_store::format::node_step_dir_name(step).unwrap()),
        None => catalog::step_path(shared, step),
    };
    let m = std::fs::metadata(folder.join(file)).unwrap();
    assert_eq!((m.dev(), m.ino()), id);
    id
}

/// Bytes of the files under `dirs` whose inode is not in `seen` (added to
/// it): what was written since the last look, a hard link to a file seen
/// before counting nothing, whatever retention deleted meanwhile.
fn new_file_bytes(dirs: &[PathBuf], seen: &mut std::collections::HashSet<(u64, u64)>) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut todo: Vec<PathBuf> = dirs.to_vec();
    let mut bytes = 0;
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                todo.push(e.path());
            } else if m.is_file() && seen.insert((m.dev(), m.ino())) {
                bytes += m.len();
            }
        }
    }
    bytes
}

/// Rank `owner`'s tensors of `step` loaded through `reader`'s sidecar into
/// `reader`'s region (a rank of world size 2 restoring its own part).
fn load_own_part(reader: &mut Rank, step: u64, owner: u32, frozen: u64, moving: u64) -> Vec<u8> {
    reader.zero_shm();
    ckpt_wire::write_frame(
        &mut reader.s,
        &Request::Load { id: 80, step: Some(step), tensors: frozen_and_moving(owner, frozen, moving) },
    )
    .unwrap();
    match reader.reply() {
        Reply::Loaded { step: s, .. } if s == step => {}
        other => panic!("rank {owner}: expected Loaded of step {step}, got {other:?}"),
    }
    reader.read_shm((frozen + moving) as usize)
}

/// Incremental saves on several nodes, with the shards in the shared directory or
/// on each node's own disk (`node_local`): each rank's part is compared
/// with the newest committed step, so a stable shard whose tensors are all
/// unchanged is a hard link of that step's file (the same inode), never
/// written again; a tensor changed in one rank is written; every step loads
/// bit-equal at world size 2 (each rank its part, through its node) and 1
/// (the whole step); the index records digests; `verify` passes; after
/// retention and gc the kept steps load. Prints the bytes each step added
/// (2 ranks: 64 MiB frozen + 1 MiB changing in all).
// Rank i indexes several tables at once (saved bytes, inodes): a range reads best.
#[allow(clippy::needless_range_loop)]
fn incremental_parts_are_linked_on_two_nodes(node_local: bool) {
    const FROZEN: u64 = 32 << 20;
    const MOVING: u64 = 512 << 10;
    let c = Cluster::new();
    let shared = c.shared();
    let args = |id: &'static str| -> Vec<&'static str> {
        let mut v = vec!["--keep", "2"];
        if node_local {
            v.extend(["--node-local", "--node-id", id]);
        }
        v
    };
    let (a, b) = (c.node_with(0, "300", &args("a")), c.node_with(1, "300", &args("b")));
    let len = (FROZEN + MOVING) as usize;
    let mut ranks = vec![Rank::connect(&a, 0, len), Rank::connect(&b, 1, len)];
    let mut readers = [Rank::connect(&a, 0, len), Rank::connect(&b, 1, len)];
    let dirs = [shared.clone(), c.local(0), c.local(1)];
    let mut seen = std::collections::HashSet::new();
    new_file_bytes(&dirs, &mut seen);
    let mut saved: BTreeMap<u64, [Vec<u8>; 2]> = BTreeMap::new();
    let mut frozen_inodes = BTreeMap::new();
    for step in 1..=4u64 {
        // Every step, each rank's moving tensor changes (4 bytes of each
        // 4 KiB); at step 4 one element of rank 1's frozen tensor too.
        for r in ranks.iter_mut() {
            for k in 0..MOVING as usize / 4096 {
                r.write_shm(FROZEN as usize + k * 4096, &[step as u8, k as u8, 0x5a, r.rank as u8]);
            }
        }
        if step == 4 {
            let old = ranks[1].bytes[4 * 1000];
            ranks[1].write_shm(4 * 1000, &[old ^ 0x40]);
        }
        save_two(&mut ranks, step, &shared, FROZEN, MOVING);
        let written = new_file_bytes(&dirs, &mut seen);
        println!(
            "{} layout, step {step}: {written} bytes in files written (hard links of earlier files not counted)",
            if node_local { "node-local" } else { "shared" }
        );
        if (2..=3).contains(&step) {
            // The two moving tensors, their shards' headers, index, markers.
            let limit = 2 * MOVING + (256 << 10);
            assert!(written <= limit, "step {step} wrote {written} bytes; at most {limit} expected");
        }
        saved.insert(step, [ranks[0].bytes.clone(), ranks[1].bytes.clone()]);
        frozen_inodes.insert(step, [inode_of(&shared, step, "frozen.0"), inode_of(&shared, step, "frozen.1")]);
        // World size 2: each rank restores its own part through its node.
        for (i, reader) in readers.iter_mut().enumerate() {
            assert!(
                load_own_part(reader, step, i as u32, FROZEN, MOVING) == saved[&step][i],
                "step {step}: rank {i}'s part differs"
            );
        }
        // World size 1: the whole step, in one reader.
        let l = restore::load(&shared, Which::Step(step), &ReadOptions::default(), None).unwrap();
        for (i, want) in saved[&step].iter().enumerate() {
            assert!(l.tensor(&format!("frozen.{i}")).unwrap() == &want[..FROZEN as usize], "step {step}: frozen.{i}");
            assert!(l.tensor(&format!("moving.{i}")).unwrap() == &want[FROZEN as usize..], "step {step}: moving.{i}");
        }
        let index = restore::read_index(&shared, step).unwrap();
        assert!(
            index.ckpt.tensors.values().all(|t| t.xxh128.is_some()),
            "step {step}: the parts' digests are in the index"
        );
    }
    // Rank 0's frozen tensor never changed: one file, step 1's, in every
    // step. Rank 1's changed at step 4: written then, linked before.
    for s in 2..=4 {
        assert_eq!(frozen_inodes[&s][0], frozen_inodes[&1][0], "step {s}: rank 0's frozen shard is not step 1's file");
    }
    assert_eq!(frozen_inodes[&2][1], frozen_inodes[&1][1]);
    assert_eq!(frozen_inodes[&3][1], frozen_inodes[&1][1]);
    assert_ne!(frozen_inodes[&4][1], frozen_inodes[&3][1], "rank 1's changed tensor was not written");
    // Steps 3 and 4 are kept (--keep 2); steps 1 and 2, whose files they
    // link, are gone (node-local: the nodes' folders of them too).
    assert_eq!(catalog::committed_steps(&shared).unwrap(), [3, 4]);
    if node_local {
        for n in 0..2 {
            assert!(
                !c.local(n).join(ckpt_store::format::node_step_dir_name(1).unwrap()).exists(),
                "{:?}",
                names_in(&c.local(n))
            );
        }
    }
    for s in [3, 4] {
        let l = restore::load(&shared, Which::Step(s), &ReadOptions::default(), None).unwrap();
        for i in 0..2 {
            assert!(
                l.tensor(&format!("frozen.{i}")).unwrap() == &saved[&s][i][..FROZEN as usize],
                "step {s}: frozen.{i}"
            );
        }
    }
    let (code, out) = cli(&["verify", shared.to_str().unwrap()]).joined();
    assert_eq!(code, 0, "{out}");
    let (code, out) = cli(&["gc", shared.to_str().unwrap(), "--keep", "1"]).joined();
    assert_eq!(code, 0, "{out}");
    let l = restore::load(&shared, Which::Latest, &ReadOptions::default(), None).unwrap();
    assert_eq!(l.step, 4);
    for i in 0..2 {
        assert!(l.tensor(&format!("frozen.{i}")).unwrap() == &saved[&4][i][..FROZEN as usize]);
        assert!(l.tensor(&format!("moving.{i}")).unwrap() == &saved[&4][i][FROZEN as usize..]);
    }
    drop((a, b));
}

#[test]
fn incremental_parts_in_the_shared_directory_link_each_ranks_unchanged_shards() {
    incremental_parts_are_linked_on_two_nodes(false);
}

#[test]
fn incremental_node_local_parts_link_within_each_nodes_own_directory() {
    incremental_parts_are_linked_on_two_nodes(true);
}

/// `--full-every K` on several nodes counts each rank's parts: with K = 2,
/// every second part of a rank links nothing, so a file is shared by at
/// most 2 steps. A flipped byte in a node-held file that two steps link is
/// reported by `verify` for both (it finds the file on its node's disk).
#[test]
#[allow(clippy::needless_range_loop)] // as above: rank i indexes two steps' inodes
fn node_local_parts_are_written_in_full_every_kth_step_and_verify_names_the_steps_sharing_a_damaged_file() {
    const FROZEN: u64 = 2 << 20;
    const MOVING: u64 = 64 << 10;
    let c = Cluster::new();
    let shared = c.shared();
    let args = |id| ["--node-local", "--node-id", id, "--full-every", "2"];
    let (a, b) = (c.node_with(0, "300", &args("a")), c.node_with(1, "300", &args("b")));
    let len = (FROZEN + MOVING) as usize;
    let mut ranks = vec![Rank::connect(&a, 0, len), Rank::connect(&b, 1, len)];
    let mut inodes = BTreeMap::new();
    for step in 1..=4u64 {
        for r in ranks.iter_mut() {
            r.write_shm(FROZEN as usize, &[step as u8]);
        }
        save_two(&mut ranks, step, &shared, FROZEN, MOVING);
        inodes.insert(step, [inode_of(&shared, step, "frozen.0"), inode_of(&shared, step, "frozen.1")]);
    }
    for i in 0..2 {
        assert_eq!(inodes[&2][i], inodes[&1][i], "rank {i}: step 2 links step 1's file");
        assert_ne!(
            inodes[&3][i], inodes[&2][i],
            "rank {i}: step 3 is its second part since a full one: written in full"
        );
        assert_eq!(inodes[&4][i], inodes[&3][i], "rank {i}: step 4 links step 3's file");
    }
    let (code, out) = cli(&["verify", shared.to_str().unwrap()]).joined();
    assert_eq!(code, 0, "{out}");
    // Flip one byte of rank 1's frozen tensor in the file steps 3 and 4 share.
    let index = restore::read_index(&shared, 4).unwrap();
    let file = &index.ckpt.tensors["frozen.1"].file;
    let path = c.local(1).join(ckpt_store::format::node_step_dir_name(4).unwrap()).join(file);
    let mut raw = std::fs::read(&path).unwrap();
    let at = raw.len() - 100;
    raw[at] ^= 1;
    std::fs::write(&path, &raw).unwrap();
    let (code, out) = cli(&["verify", shared.to_str().unwrap()]).joined();
    assert_eq!(code, 3, "{out}");
    assert!(out.contains(&format!("damaged file {file} (step 3) is shared by steps 3, 4")), "{out}");
    drop((a, b));
}

/// A node's sidecar SIGKILLed while it links its rank's unchanged shard
/// (node-local: in its own directory) leaves no marker: the coordinator
/// aborts the step, `verify` passes on what is committed, the earlier step
/// loads; restarted, the node removes its half-linked folder, and the step
/// saved again commits, its shard linked.
#[test]
fn node_local_sidecar_killed_while_linking_leaves_no_step_that_fails_and_the_retry_links() {
    const FROZEN: u64 = 2 << 20;
    const MOVING: u64 = 64 << 10;
    let c = Cluster::new();
    let shared = c.shared();
    let args = |id| ["--node-local", "--node-id", id];
    let a = c.node_with(0, "5", &args("a"));
    let mut b = c.node_with_env(1, "60", &args("b"), &[(ckpt_store::incremental::TEST_KILL_AFTER_LINKS_ENV, "1")]);
    let len = (FROZEN + MOVING) as usize;
    let mut ranks = vec![Rank::connect(&a, 0, len), Rank::connect(&b, 1, len)];
    save_two(&mut ranks, 1, &shared, FROZEN, MOVING);
    // Step 2: node b's sidecar kills itself at its first link.
    for r in ranks.iter_mut() {
        r.write_shm(FROZEN as usize, &[2]);
    }
    ranks[1].save_part(2, 2, frozen_and_moving(1, FROZEN, MOVING), vec![]);
    let t0 = Instant::now();
    while b.child.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "node b's sidecar never linked a shard (it kills itself at its first link)\n{}",
            b.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    ranks[0].save_part(2, 2, frozen_and_moving(0, FROZEN, MOVING), vec![]);
    ranks[0].released(2);
    match ranks[0].reply() {
        Reply::Failed { step: 2, reason, .. } => assert!(reason.contains("wrote no marker"), "{reason}"),
        other => panic!("rank 0: expected Failed, got {other:?}\n{}", a.log()),
    }
    assert_eq!(catalog::committed_steps(&shared).unwrap(), [1]);
    let (code, out) = cli(&["verify", shared.to_str().unwrap()]).joined();
    assert_eq!(code, 0, "{out}");
    let folder2 = c.local(1).join(ckpt_store::format::node_step_dir_name(2).unwrap());
    assert!(folder2.exists(), "node b was killed after it made its folder of step 2");
    // Node b again (no kill): recovery removes its folder of the aborted step.
    let b = c.node_with(1, "60", &args("b"));
    assert!(!folder2.exists(), "{:?}", names_in(&c.local(1)));
    ranks[1] = Rank::connect(&b, 1, len);
    ranks[1].write_shm(FROZEN as usize, &[2]);
    save_two(&mut ranks, 2, &shared, FROZEN, MOVING);
    for i in 0..2 {
        assert_eq!(
            inode_of(&shared, 2, &format!("frozen.{i}")),
            inode_of(&shared, 1, &format!("frozen.{i}")),
            "rank {i}"
        );
    }
    let l = restore::load(&shared, Which::Step(2), &ReadOptions::default(), None).unwrap();
    for (i, r) in ranks.iter().enumerate() {
        assert!(l.tensor(&format!("frozen.{i}")).unwrap() == &r.bytes[..FROZEN as usize]);
        assert!(l.tensor(&format!("moving.{i}")).unwrap() == &r.bytes[FROZEN as usize..]);
    }
    let (code, out) = cli(&["verify", shared.to_str().unwrap()]).joined();
    assert_eq!(code, 0, "{out}");
}
