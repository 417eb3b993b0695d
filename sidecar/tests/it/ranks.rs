//! Saves of several ranks through the real binary: every rank's SavePart of
//! a step is committed as one checkpoint (files per rank, world size in the
//! index), Durable reaching each rank only then; a step some rank never
//! sends is given up after the part timeout with nothing left on disk; a
//! part of another world size is refused alone.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckpt_store::restore::{self, ReadOptions, Which};
use ckpt_store::{catalog, ranks};
use ckpt_test_support::sidecar_bin;
use ckpt_wire::{Blob, ErrorCode, Reply, Request, TensorDesc};

struct Sidecar {
    child: Child,
    socket: PathBuf,
    dir: PathBuf,
    log: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Sidecar {
    fn start(part_timeout_s: &str) -> Sidecar {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, socket, log) =
            (tmp.path().join("ckpt"), tmp.path().join("run").join("s.sock"), tmp.path().join("sidecar.log"));
        let child = Command::new(sidecar_bin())
            .args(["serve", "--staging", "64MiB", "--dir"])
            .arg(&dir)
            .arg("--socket")
            .arg(&socket)
            .env("CKPT_SIDECAR_PART_TIMEOUT_S", part_timeout_s)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while UnixStream::connect(&socket).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "sidecar did not listen: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Sidecar { child, socket, dir, log, _tmp: tmp }
    }

    fn client(&self) -> UnixStream {
        let mut s = UnixStream::connect(&self.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        ckpt_wire::write_frame(&mut s, &ckpt_wire::hello("ranks-test")).unwrap();
        assert!(matches!(ckpt_wire::read_frame::<Reply>(&mut s).unwrap(), Reply::Welcome { .. }));
        s
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A shared-memory segment filled with `seed`-dependent bytes, registered as region 1.
struct Shm {
    name: String,
    bytes: Vec<u8>,
}

fn register(s: &mut UnixStream, rank: u32, len: usize) -> Shm {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let name = format!(
        "/ckpt-ranks-test-{}-{rank}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let mut bytes = vec![0u8; len];
    ckpt_store::synthetic::fill(&mut bytes, 7 + rank as u64);
    let c = std::ffi::CString::new(name.clone()).unwrap();
    // SAFETY: plain libc calls with checked results on a segment of our own name.
    unsafe {
        libc::shm_unlink(c.as_ptr());
        let fd = libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600);
        assert!(fd >= 0);
        assert_eq!(libc::pwrite(fd, bytes.as_ptr().cast(), len, 0), len as isize);
        libc::close(fd);
    }
    ckpt_wire::write_frame(
        s,
        &Request::RegisterRegion {
            id: 1,
            region_id: 1,
            shm_name: name.clone(),
            len_bytes: len as u64,
            hand_over: false,
        },
    )
    .unwrap();
    assert!(matches!(ckpt_wire::read_frame::<Reply>(s).unwrap(), Reply::RegionRegistered { .. }));
    Shm { name, bytes }
}

impl Drop for Shm {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.name.clone()).unwrap();
        // SAFETY: unlinking our own name.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

fn part(s: &mut UnixStream, step: u64, rank: u32, world_size: u32, tensors: Vec<TensorDesc>, blobs: Vec<Blob>) {
    let req = Request::SavePart {
        id: 10 + rank as u64,
        step,
        rank,
        world_size,
        tensors,
        blobs,
        lazy_release: rank % 2 == 0,
        unchanged: None,
    };
    ckpt_wire::write_frame(s, &req).unwrap();
}

fn reply(s: &mut UnixStream) -> Reply {
    ckpt_wire::read_frame::<Reply>(s).unwrap()
}

fn f32s(name: &str, n: u64, offset_bytes: u64) -> TensorDesc {
    TensorDesc { name: name.into(), dtype: "F32".into(), shape: vec![n], region_id: 1, offset_bytes, len_bytes: 4 * n }
}

fn hidden(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp"))
        .collect()
}

#[test]
fn every_ranks_part_commits_as_one_checkpoint_and_only_then_is_durable() {
    let sc = Sidecar::start("300");
    let (mut a, mut b) = (sc.client(), sc.client());
    let (sa, sb) = (register(&mut a, 0, 1 << 20), register(&mut b, 1, 1 << 20));
    part(
        &mut a,
        3,
        0,
        2,
        vec![f32s("w.0", 100_000, 0)],
        vec![Blob { name: "structure.pkl".into(), bytes: b"s".to_vec() }],
    );
    assert!(matches!(reply(&mut a), Reply::Released { step: 3, .. }));
    // Rank 0 alone: released, but not committed until rank 1's part is here.
    assert!(!catalog::is_committed(&sc.dir, 3));
    part(
        &mut b,
        3,
        1,
        2,
        vec![f32s("w.1", 90_000, 4096), f32s("b.1", 10_000, 400_000)],
        vec![Blob { name: "rng.rank-00001.pkl".into(), bytes: b"r1".to_vec() }],
    );
    assert!(matches!(reply(&mut b), Reply::Released { step: 3, .. }));
    for s in [&mut a, &mut b] {
        match reply(s) {
            Reply::Durable { step: 3, path, .. } => assert!(path.ends_with("step-000000000003")),
            other => panic!("expected Durable, got {other:?}"),
        }
    }
    let index = restore::read_index(&sc.dir, 3).unwrap();
    assert_eq!(index.ckpt.world_size, 2);
    let per = ranks::bytes_per_rank(&index);
    assert_eq!(per.len(), 2);
    assert!(index.ckpt.files.iter().any(|f| f.name.starts_with("rank-00000-of-00002")));
    assert!(index.ckpt.files.iter().any(|f| f.name.starts_with("rank-00001-of-00002")));
    let l = restore::load(&sc.dir, Which::Latest, &ReadOptions::default(), None).unwrap();
    assert_eq!(l.tensor("w.0").unwrap(), &sa.bytes[..400_000]);
    assert_eq!(l.tensor("w.1").unwrap(), &sb.bytes[4096..4096 + 360_000]);
    assert_eq!(l.tensor("b.1").unwrap(), &sb.bytes[400_000..440_000]);
    assert_eq!(l.blobs["rng.rank-00001.pkl"], b"r1");
    assert!(hidden(&sc.dir).is_empty());
}

#[test]
fn a_step_some_rank_never_sends_is_given_up_and_a_stray_world_size_refused() {
    let sc = Sidecar::start("1.5");
    let (mut a, mut b) = (sc.client(), sc.client());
    let (_sa, _sb) = (register(&mut a, 0, 1 << 20), register(&mut b, 1, 1 << 20));
    part(&mut a, 4, 0, 2, vec![f32s("w.0", 1000, 0)], vec![]);
    assert!(matches!(reply(&mut a), Reply::Released { step: 4, .. }));
    // Rank 1 thinks the world has 3 ranks: whichever part reaches the
    // coordinator second is refused alone; the first waits and times out.
    part(&mut b, 4, 1, 3, vec![f32s("w.1", 1000, 0)], vec![]);
    assert!(matches!(reply(&mut b), Reply::Released { .. }));
    let reasons = [&mut a, &mut b].map(|s| match reply(s) {
        Reply::Failed { step: 4, code, reason, .. } => (code, reason),
        other => panic!("expected Failed, got {other:?}"),
    });
    let refused = reasons.iter().filter(|(c, r)| *c == ErrorCode::BadRequest && r.contains("world size")).count();
    let timed_out = reasons.iter().filter(|(_, r)| r.contains("sent no released part within 1.5 s")).count();
    assert_eq!((refused, timed_out), (1, 1), "{reasons:?}");
    assert!(!catalog::is_committed(&sc.dir, 4));
    assert!(hidden(&sc.dir).is_empty());
    // The step can be saved afterwards by both.
    part(&mut a, 4, 0, 2, vec![f32s("w.0", 1000, 0)], vec![]);
    part(&mut b, 4, 1, 2, vec![f32s("w.1", 1000, 0)], vec![]);
    for s in [&mut a, &mut b] {
        assert!(matches!(reply(s), Reply::Released { step: 4, .. }));
        assert!(
            matches!(reply(s), Reply::Durable { step: 4, .. }),
            "{}",
            std::fs::read_to_string(&sc.log).unwrap_or_default()
        );
    }
}

fn slices_blob(json: &str) -> Blob {
    Blob { name: ckpt_sidecar::commit::slices::SLICES_BLOB.into(), bytes: json.as_bytes().to_vec() }
}

fn read_shm(name: &str, len: usize) -> Vec<u8> {
    let c = std::ffi::CString::new(name).unwrap();
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

#[test]
fn declared_slices_become_one_logical_tensor_that_loads_whole_by_name() {
    let sc = Sidecar::start("300");
    let (mut a, mut b) = (sc.client(), sc.client());
    let (sa, sb) = (register(&mut a, 0, 1 << 20), register(&mut b, 1, 1 << 20));
    // w is F32 [3, 100]: elements [0, 100) on rank 0, [100, 300) on rank 1.
    let decl = |t: &str, a: u64, b: u64| {
        format!(r#"{{"slices":[{{"tensor":"{t}","of":"w","shape":[3,100],"elems":[{a},{b}]}}]}}"#)
    };
    part(&mut a, 6, 0, 2, vec![f32s("w#elems[0:100]", 100, 0)], vec![slices_blob(&decl("w#elems[0:100]", 0, 100))]);
    part(
        &mut b,
        6,
        1,
        2,
        vec![f32s("w#elems[100:300]", 200, 4096), f32s("b", 10, 8192)],
        vec![slices_blob(&decl("w#elems[100:300]", 100, 300))],
    );
    for s in [&mut a, &mut b] {
        assert!(matches!(reply(s), Reply::Released { step: 6, .. }));
        assert!(
            matches!(reply(s), Reply::Durable { step: 6, .. }),
            "{}",
            std::fs::read_to_string(&sc.log).unwrap_or_default()
        );
    }
    let index = restore::read_index(&sc.dir, 6).unwrap();
    // Slices (2) and, with the default --incremental on, digests (3).
    assert_eq!(index.ckpt.format_version, 3);
    assert!(index.ckpt.blobs.is_empty(), "declarations are not stored as blobs");
    let w = index.logical_tensor("w").unwrap();
    assert_eq!((w.shape, w.slices.len()), (&[3u64, 100][..], 2));
    let whole: Vec<u8> = [&sa.bytes[..400], &sb.bytes[4096..4096 + 800]].concat();

    // The listing names the logical tensor, not its pieces; a Load by that
    // name gets the whole tensor.
    ckpt_wire::write_frame(&mut a, &Request::Load { id: 20, step: Some(6), tensors: vec![] }).unwrap();
    match reply(&mut a) {
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
    ckpt_wire::write_frame(&mut a, &Request::Load { id: 21, step: Some(6), tensors: vec![desc] }).unwrap();
    assert!(matches!(reply(&mut a), Reply::Loaded { step: 6, .. }));
    assert_eq!(&read_shm(&sa.name, 65536 + 1200)[65536..], &whole[..]);

    // Declarations that leave a gap fail every rank's part with one line.
    part(&mut a, 7, 0, 2, vec![f32s("w#elems[0:100]", 100, 0)], vec![slices_blob(&decl("w#elems[0:100]", 0, 100))]);
    part(
        &mut b,
        7,
        1,
        2,
        vec![f32s("w#elems[100:300]", 200, 4096)],
        vec![slices_blob(&decl("w#elems[100:300]", 120, 300))],
    );
    for s in [&mut a, &mut b] {
        assert!(matches!(reply(s), Reply::Released { step: 7, .. }));
        match reply(s) {
            Reply::Failed { step: 7, reason, .. } => {
                assert!(reason.contains("sliced tensor \"w\"") && !reason.contains('\n'), "{reason}")
            }
            other => panic!("expected Failed, got {other:?}"),
        }
    }
    assert!(!catalog::is_committed(&sc.dir, 7));
}

/// The Python package's skeleton blob naming `names`.
fn structure_blob(names: &[&str]) -> Blob {
    Blob { name: ckpt_store::skeleton::STRUCTURE_BLOB.into(), bytes: ckpt_store::skeleton::minimal_skeleton(names) }
}

/// Rank 0 (`a`) and rank 1 (`b`) of 2 send their parts of `step`: tensor
/// `tensors[r]` (1000 floats) each, rank 0 with the skeleton naming
/// `skeleton`. Each is Released, then answered: Ok when both are Durable,
/// the reasons when both are refused (BadRequest); anything else panics.
fn two_parts(
    (a, b): (&mut UnixStream, &mut UnixStream),
    step: u64,
    tensors: [&str; 2],
    skeleton: &[&str],
) -> Result<(), Vec<String>> {
    part(a, step, 0, 2, vec![f32s(tensors[0], 1000, 0)], vec![structure_blob(skeleton)]);
    part(b, step, 1, 2, vec![f32s(tensors[1], 1000, 0)], vec![]);
    let (mut durable, mut refused) = (0, Vec::new());
    for s in [a, b] {
        assert!(matches!(reply(s), Reply::Released { step: s_, .. } if s_ == step));
        match reply(s) {
            Reply::Durable { step: s_, .. } if s_ == step => durable += 1,
            Reply::Failed { step: s_, code: ErrorCode::BadRequest, reason, .. } if s_ == step => refused.push(reason),
            other => panic!("expected Durable or Failed of step {step}, got {other:?}"),
        }
    }
    match (durable, refused.len()) {
        (2, 0) => Ok(()),
        (0, 2) => Err(refused),
        _ => panic!("step {step}: one rank durable, the other refused: {refused:?}"),
    }
}

#[test]
fn ranks_that_saved_different_states_under_one_step_are_refused_naming_the_ranks_and_the_tensor() {
    // Before: rank 0's {"a", "only0"} and rank 1's {"a", "only1"}, each
    // partitioned on its own, committed a and only1 under rank 0's skeleton:
    // durable, verified, and not loadable ("tensor 'only0' ... missing").
    let sc = Sidecar::start("300");
    let (mut a, mut b) = (sc.client(), sc.client());
    let (_sa, _sb) = (register(&mut a, 0, 1 << 20), register(&mut b, 1, 1 << 20));
    for reason in two_parts((&mut a, &mut b), 5, ["a", "only1"], &["a", "only0"]).unwrap_err() {
        assert!(
            reason.contains("rank 0") && reason.contains("\"only0\"") && reason.contains("rank 1 stores \"only1\""),
            "{reason}"
        );
        assert!(!reason.contains('\n'), "{reason}");
    }
    assert!(!catalog::is_committed(&sc.dir, 5));
    assert!(hidden(&sc.dir).is_empty(), "{:?}", hidden(&sc.dir));
    // The same state on both ranks (a to rank 0, b to rank 1): it commits.
    two_parts((&mut a, &mut b), 5, ["a", "b"], &["a", "b"]).unwrap();
    // The same parts (their plans kept, their merge kept by the committer)
    // under a skeleton that names another tensor: checked again, refused.
    for reason in two_parts((&mut a, &mut b), 6, ["a", "b"], &["a", "c"]).unwrap_err() {
        assert!(reason.contains("\"c\"") && reason.contains("rank 1 stores \"b\""), "{reason}");
    }
    assert!(!catalog::is_committed(&sc.dir, 6));
    // And the skeleton of step 5 again: it commits.
    two_parts((&mut a, &mut b), 6, ["a", "b"], &["a", "b"]).unwrap();
}

#[test]
fn a_rank_that_resumes_after_the_part_timeout_is_told_the_others_sent_to_the_attempt_given_up() {
    // Before: rank 1, alone in the step's new attempt, was told "rank(s)
    // [0] of 2 sent no released part" although rank 0 had sent its part
    // (to the attempt given up), and status said "queued for writing"
    // while its part waited for the other ranks'.
    // Long enough for the status look to find rank 0's part waiting.
    let sc = Sidecar::start("8");
    let (mut a, mut b, mut watcher) = (sc.client(), sc.client(), sc.client());
    let (_sa, _sb) = (register(&mut a, 0, 1 << 20), register(&mut b, 1, 1 << 20));
    part(&mut a, 4, 0, 2, vec![f32s("w.0", 1000, 0)], vec![]);
    assert!(matches!(reply(&mut a), Reply::Released { step: 4, .. }));
    let phase_of_step_4 = |s: &mut UnixStream| {
        ckpt_wire::write_frame(s, &Request::Status { id: 99 }).unwrap();
        match reply(s) {
            Reply::Status { report, .. } => report.in_flight.iter().find(|f| f.step == 4).map(|f| f.phase.clone()),
            other => panic!("expected Status, got {other:?}"),
        }
    };
    // Briefly copying or queued, then waiting for rank 1 until the timeout.
    let t0 = Instant::now();
    loop {
        let phase = phase_of_step_4(&mut watcher);
        if phase.as_deref() == Some("waiting for the other ranks' parts") {
            break;
        }
        assert!(phase.is_some() && t0.elapsed() < Duration::from_secs(30), "step 4's phase: {phase:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    match reply(&mut a) {
        Reply::Failed { step: 4, reason, .. } => {
            assert!(reason.contains("rank(s) [1] of 2") && !reason.contains("earlier attempt"), "{reason}")
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    // Rank 1 resumes after the timeout: a new attempt, alone.
    part(&mut b, 4, 1, 2, vec![f32s("w.1", 1000, 0)], vec![]);
    assert!(matches!(reply(&mut b), Reply::Released { step: 4, .. }));
    match reply(&mut b) {
        Reply::Failed { step: 4, reason, .. } => {
            assert!(
                reason.contains("rank(s) [0] of 2") && reason.contains("rank(s) [0] sent theirs to an earlier attempt"),
                "{reason}"
            )
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    assert!(!catalog::is_committed(&sc.dir, 4));
}

/// Writes `bytes` at `offset` of the shared-memory segment `name`.
fn shm_write(name: &str, offset: usize, bytes: &[u8]) {
    let c = std::ffi::CString::new(name).unwrap();
    // SAFETY: plain libc calls with checked results on a segment of our own name.
    unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR, 0o600);
        assert!(fd >= 0);
        assert_eq!(libc::pwrite(fd, bytes.as_ptr().cast(), bytes.len(), offset as libc::off_t), bytes.len() as isize);
        libc::close(fd);
    }
}

/// Incremental saves of several ranks: each rank's part is
/// compared with the same rank's previous part through the merged image,
/// so a rank's unchanged stable shard is linked from the step before, and
/// every step still loads what each rank saved.
#[test]
fn each_ranks_unchanged_shards_are_linked_from_its_previous_part() {
    use std::os::unix::fs::MetadataExt;
    let sc = Sidecar::start("300");
    let (mut a, mut b) = (sc.client(), sc.client());
    let len = 2 << 20;
    let (mut sa, mut sb) = (register(&mut a, 0, len), register(&mut b, 1, len));
    let frozen_ino = |step: u64, name: &str| {
        let index = restore::read_index(&sc.dir, step).unwrap();
        std::fs::metadata(catalog::step_path(&sc.dir, step).join(&index.ckpt.tensors[name].file)).unwrap().ino()
    };
    for step in 1..=3u64 {
        // The small tensor of each rank changes every step; the big one never.
        for shm in [&mut sa, &mut sb] {
            shm.bytes[1 << 20] = step as u8;
            shm_write(&shm.name, 1 << 20, &[step as u8]);
        }
        part(&mut a, step, 0, 2, vec![f32s("r0.frozen", 1 << 18, 0), f32s("r0.moving", 1000, 1 << 20)], vec![]);
        part(&mut b, step, 1, 2, vec![f32s("r1.frozen", 1 << 18, 0), f32s("r1.moving", 1000, 1 << 20)], vec![]);
        for s in [&mut a, &mut b] {
            assert!(matches!(reply(s), Reply::Released { .. }));
        }
        for s in [&mut a, &mut b] {
            assert!(matches!(reply(s), Reply::Durable { .. }));
        }
        let l = restore::load(&sc.dir, Which::Step(step), &ReadOptions::default(), None).unwrap();
        assert_eq!(l.tensor("r0.frozen").unwrap(), &sa.bytes[..1 << 20]);
        assert_eq!(l.tensor("r1.moving").unwrap(), &sb.bytes[1 << 20..(1 << 20) + 4000]);
        assert_eq!(l.tensor("r0.moving").unwrap(), &sa.bytes[1 << 20..(1 << 20) + 4000]);
        let index = restore::read_index(&sc.dir, step).unwrap();
        assert!(index.ckpt.tensors.values().all(|t| t.xxh128.is_some()), "incremental parts record digests");
    }
    for name in ["r0.frozen", "r1.frozen"] {
        assert_eq!(frozen_ino(1, name), frozen_ino(3, name), "{name}: not linked across steps");
    }
    assert_ne!(frozen_ino(3, "r0.frozen"), frozen_ino(3, "r1.frozen"));
}
