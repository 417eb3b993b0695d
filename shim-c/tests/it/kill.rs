//! The kill tests, through the real shim and the real sidecar
//! binary (target/<profile>/ckpt-sidecar; without it these print
//! `skipped: …`). The trainer is tests/c/kill_trainer.c, a C program on
//! libckpt whose every tensor byte is a function of the step.
//!
//! 1. Trainer SIGKILLed at random points, many runs against one `serve`:
//!    each run resumes from `latest` (checked byte for byte), saves step
//!    after step and is killed after a random delay (xorshift, fixed seed,
//!    printed; `CKPT_KILL_SEED` replays another). Once the sidecar has no
//!    in-flight work and the trainer's session is gone: every step the
//!    trainer saw released is committed; the steps committed in the run are
//!    exactly those the sidecar logged as released (so a save not released
//!    never commits) and all were saved by the trainer; each holds exactly
//!    its step's bytes and verifies; `latest` is the newest and loads; no
//!    temp folder is left; the next trainer is served. At the end the
//!    sidecar maps no dead trainer's memory, and the shim of a last trainer
//!    (run to completion) has swept the segments the killed ones left.
//! 2. Sidecar SIGKILLed mid-write (64 MiB checkpoints), five times: nothing
//!    committed is damaged (`latest` may name the step before the newest
//!    when the kill fell between the commit point and its update), a new
//!    `serve` removes the temp folders and repairs `latest`, the trainer's
//!    next call fails with CKPT_E_DISCONNECTED naming the sidecar, training
//!    goes on (every step, in order), and once a sidecar is back the
//!    trainer's saves reconnect and commit.
//!
//! What is checked on disk is read without the sidecar's library: committed
//! steps and `latest` from `ckpt-sidecar ls --json`, checksums from
//! `ckpt-sidecar verify --step N`, content by parsing the safetensors shards
//! (docs/format.md) here. Tests assert behaviour, never timing; the kill
//! points each run hit are printed.

use crate::support::{cc, lib_dir, text};
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckpt::{Client, TensorRef};
use ckpt_test_support::{kill9, seed_from_env, terminate, Rng};

/// Trainer runs killed in test 1 (the bar is at least 50).
const RUNS: usize = 60;
/// Kill delays in test 1 are uniform in [0, this): the trainer's start-up
/// (about 10 ms) and several 4 MiB steps (a few ms each).
const KILL_DELAY_US_MAX: u64 = 40_000;
/// Sidecar kills in test 2.
const ROUNDS: usize = 5;
/// Generous limit for anything this test waits for (never a timing assertion).
const PATIENCE: Duration = Duration::from_secs(60);
const CKPT_E_DISCONNECTED: i32 = -4;

// ------------------------------------------------------------ set-up

/// The sidecar binary and the trainer, or None (skipped) when either cannot be had.
fn prerequisites(tmp: &Path) -> Option<(PathBuf, PathBuf)> {
    let bin = ckpt_test_support::sidecar_bin_if_built()?.to_path_buf();
    let cc = cc()?;
    let exe = tmp.join("kill_trainer");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/kill_trainer.c");
    let d = lib_dir();
    assert!(d.join("libckpt.so").exists(), "{}/libckpt.so missing", d.display());
    let o = Command::new(&cc)
        .args(["-std=c99", "-O2", "-g", "-Wall", "-Wextra", "-Werror"])
        .arg(format!("-I{}", Path::new(env!("CARGO_MANIFEST_DIR")).join("include").display()))
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", d.display()))
        .arg("-lckpt")
        .arg(format!("-Wl,-rpath,{}", d.display()))
        .output()
        .unwrap();
    assert!(o.status.success(), "compiling {} failed:\n{}", src.display(), text(&o));
    Some((bin, exe))
}

/// The kill points' PRNG, reproducible from the printed seed.
fn rng(test: &str, salt: u64) -> Rng {
    Rng::new((seed_from_env("CKPT_KILL_SEED", 0x2545_F491_4F6C_DD1D, test) ^ salt) | 1)
}

/// Polls `f` every 2 ms until it gives a value; panics with `what()` after PATIENCE.
fn wait_for<T>(what: impl Fn() -> String, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < PATIENCE, "gave up after {PATIENCE:?} waiting for {}", what());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A child killed and reaped when dropped, so a failing test leaves no
/// trainer behind (a live one would keep trying to reconnect forever).
struct Reaped(Child);

/// Starts the test trainer on `sock` with `args`, its stdout in `out` and
/// stderr beside it, never in preload mode.
fn spawn_trainer(exe: &Path, args: &[&str], sock: &Path, out: &Path) -> Reaped {
    Reaped(
        Command::new(exe)
            .args(args)
            .arg("--socket")
            .arg(sock)
            .env_remove("CKPT_SIDECAR_PRELOAD")
            .stdout(fs::File::create(out).unwrap())
            .stderr(fs::File::create(out.with_extension("err")).unwrap())
            .spawn()
            .unwrap(),
    )
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = kill9(&mut self.0);
        }
    }
}

// ------------------------------------------------------------ the model

/// Word `i` of tensor `tensor` at `step` (tests/c/kill_trainer.c: content_word).
fn content_word(step: u64, tensor: u64, i: u64) -> u64 {
    i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03)
        ^ (tensor + 1).wrapping_mul(0x94D0_49BB_1331_11EB)
}

/// The trainer's tensors for a model of `mib` MiB: (name, dtype, words).
fn tensors(mib: u64) -> [(&'static str, &'static str, u64); 4] {
    let words = mib * (1 << 20) / 8;
    [("a", "U64", words / 2), ("b", "U64", words / 4), ("c", "U64", words / 4), ("step", "I64", 1)]
}

/// Whether `bytes` are exactly tensor `name` at `step`.
fn check_tensor(mib: u64, step: u64, name: &str, bytes: &[u8]) -> Result<(), String> {
    let (k, (_, _, words)) = tensors(mib)
        .into_iter()
        .enumerate()
        .find(|(_, t)| t.0 == name)
        .ok_or_else(|| format!("unexpected tensor {name:?}"))?;
    if bytes.len() as u64 != words * 8 {
        return Err(format!("tensor {name}: {} bytes, expected {}", bytes.len(), words * 8));
    }
    for (i, w) in bytes.chunks_exact(8).enumerate() {
        let got = u64::from_le_bytes(w.try_into().unwrap());
        let want = if name == "step" { step } else { content_word(step, k as u64, i as u64) };
        if got != want {
            return Err(format!("tensor {name} word {i} is {got:#x}, step {step} has {want:#x} there"));
        }
    }
    Ok(())
}

// ------------------------------------------------------------ the sidecar

struct Sidecar {
    child: Option<Child>,
    log: PathBuf,
}

impl Sidecar {
    /// Starts `serve` and returns once it has answered a handshake (so
    /// start-up, recovery included, is over: the socket is bound first).
    fn start(bin: &Path, dir: &Path, sock: &Path, staging: &str, log: &Path) -> Sidecar {
        let child = Command::new(bin)
            .args(["serve", "--staging", staging, "--dir"])
            .arg(dir)
            .arg("--socket")
            .arg(sock)
            .env("CKPT_SIDECAR_LOG", "info")
            .env_remove("CKPT_SIDECAR_PRELOAD")
            .stdout(Stdio::null())
            .stderr(fs::File::create(log).unwrap())
            .spawn()
            .unwrap();
        let mut s = Sidecar { child: Some(child), log: log.to_path_buf() };
        let t0 = Instant::now();
        loop {
            if let Ok(c) = Client::connect(Some(sock)) {
                c.close();
                return s;
            }
            if let Some(st) = s.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("sidecar exited at start ({st}):\n{}", s.log_text());
            }
            assert!(t0.elapsed() < PATIENCE, "sidecar did not answer at {}:\n{}", sock.display(), s.log_text());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    fn kill9(&mut self) {
        let mut c = self.child.take().unwrap();
        let st = kill9(&mut c);
        assert_eq!(st.signal(), Some(libc::SIGKILL), "the sidecar had exited by itself ({st}):\n{}", self.log_text());
    }

    /// SIGTERM (drain), then its exit code.
    fn stop(&mut self) -> i32 {
        let mut c = self.child.take().unwrap();
        terminate(&mut c, PATIENCE)
            .unwrap_or_else(|| panic!("sidecar did not exit after SIGTERM:\n{}", self.log_text()))
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = kill9(&mut c);
        }
    }
}

/// What the sidecar's log says about saves: steps released, steps aborted
/// before release, and any other refusal (lines).
#[derive(Default, Debug)]
struct SaveLog {
    released: BTreeSet<u64>,
    aborted: BTreeSet<u64>,
    refused: Vec<String>,
}

fn parse_save_log(log: &str) -> SaveLog {
    let mut out = SaveLog::default();
    for line in log.lines() {
        let step = || -> u64 {
            let at = line.find("step=").unwrap_or_else(|| panic!("no step in {line:?}")) + 5;
            line[at..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap()
        };
        if line.contains("ckpt_sidecar::save::snapshot: released") {
            out.released.insert(step());
        } else if line.contains("ckpt_sidecar::save::snapshot: aborted") {
            out.aborted.insert(step());
        } else if line.contains("save refused") && !line.contains("save refused: aborted:") {
            out.refused.push(line.to_string());
        }
    }
    out
}

// ------------------------------------------------------------ the disk

/// Committed steps and `latest`, as `ckpt-sidecar ls --json` reports them.
fn committed(bin: &Path, dir: &Path) -> (BTreeSet<u64>, Option<u64>) {
    let o = Command::new(bin).arg("ls").arg(dir).arg("--json").output().unwrap();
    assert!(o.status.success(), "ls: {}", text(&o));
    let v: serde_json::Value =
        serde_json::from_slice(o.stdout.trim_ascii()).unwrap_or_else(|e| panic!("ls --json: {e}: {}", text(&o)));
    let steps = v["checkpoints"].as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    (steps, v["latest"].as_u64())
}

/// `ckpt-sidecar verify --step N`: every checksum of the checkpoint.
fn verify(bin: &Path, dir: &Path, step: Option<u64>) -> Result<(), String> {
    let mut cmd = Command::new(bin);
    cmd.arg("verify").arg(dir);
    if let Some(s) = step {
        cmd.args(["--step", &s.to_string()]);
    }
    let o = cmd.output().unwrap();
    if o.status.success() {
        Ok(())
    } else {
        Err(format!("verify {step:?}: {}", text(&o)))
    }
}

/// Reads the committed checkpoint of `step` straight from its safetensors
/// shards and blob folder, and checks it holds exactly that step's model.
fn check_files(dir: &Path, step: u64, mib: u64) -> Result<(), String> {
    let folder = dir.join(format!("step-{step:012}"));
    let mut seen = BTreeSet::new();
    for e in fs::read_dir(&folder).map_err(|e| format!("{}: {e}", folder.display()))? {
        let path = e.unwrap().path();
        if path.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let mut f = fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut file = Vec::new();
        f.read_to_end(&mut file).map_err(|e| format!("{}: {e}", path.display()))?;
        let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value =
            serde_json::from_slice(&file[8..8 + n]).map_err(|e| format!("{}: header: {e}", path.display()))?;
        let data = &file[8 + n..];
        for (name, t) in header.as_object().unwrap() {
            if name == "__metadata__" {
                continue;
            }
            let off: Vec<usize> =
                t["data_offsets"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
            let want_dtype = tensors(mib).iter().find(|x| x.0 == name).map(|x| x.1).unwrap_or("?");
            if t["dtype"] != want_dtype {
                return Err(format!("step {step}: tensor {name} has dtype {}", t["dtype"]));
            }
            check_tensor(mib, step, name, &data[off[0]..off[1]])
                .map_err(|e| format!("step {step} ({}): {e}", path.display()))?;
            seen.insert(name.clone());
        }
    }
    let want: BTreeSet<String> = tensors(mib).iter().map(|t| t.0.to_string()).collect();
    if seen != want {
        return Err(format!("step {step}: tensors {seen:?}, expected {want:?}"));
    }
    let blob = fs::read(folder.join("blobs/state")).map_err(|e| format!("step {step}: blob state: {e}"))?;
    if blob != format!("step={step}").as_bytes() {
        return Err(format!("step {step}: blob state is {:?}", String::from_utf8_lossy(&blob)));
    }
    Ok(())
}

fn tmp_dirs(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp-step-"))
        .collect()
}

/// Removes the shared memory a SIGKILLed trainer could not.
fn remove_shm_of(pids: &[u32]) {
    let Ok(rd) = fs::read_dir("/dev/shm") else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if pids.iter().any(|p| name.starts_with(&format!("ckpt-{p}-"))) {
            let _ = fs::remove_file(e.path());
        }
    }
}

// ------------------------------------------------------------ the trainer's log

#[derive(Debug, Clone, PartialEq)]
enum Line {
    /// None: nothing to resume from; Some((step, verified)).
    Resumed(Option<(u64, bool)>),
    Save(u64),
    Released(u64),
    Step(u64),
    Durable(u64),
    /// A failed call: step, call, status, ckpt_last_error().
    Error(u64, String, i32, String),
    /// A save whose durable wait failed: step, status, message.
    Failed(u64, i32, String),
    Done,
}

fn parse_line(l: &str) -> Line {
    let w: Vec<&str> = l.split(' ').collect();
    let num = |i: usize| -> u64 { w[i].parse().unwrap_or_else(|_| panic!("bad trainer line {l:?}")) };
    let rest = |i: usize| w[i..].join(" ");
    match w[0] {
        "resumed" if w[1] == "none" => Line::Resumed(None),
        "resumed" => Line::Resumed(Some((num(1), w[2] == "ok"))),
        "save" => Line::Save(num(1)),
        "released" => Line::Released(num(1)),
        "step" => Line::Step(num(1)),
        "durable" => Line::Durable(num(1)),
        "error" => Line::Error(num(1), w[2].to_string(), w[3].parse().unwrap(), rest(4)),
        "failed" => Line::Failed(num(1), w[2].parse().unwrap(), rest(3)),
        "done" => Line::Done,
        _ => panic!("unexpected trainer line {l:?}"),
    }
}

/// The complete lines the trainer has written so far (each is flushed whole).
fn trainer_lines(path: &Path) -> Vec<Line> {
    let s = fs::read_to_string(path).unwrap_or_default();
    let complete = match s.rfind('\n') {
        Some(i) => &s[..i],
        None => "",
    };
    complete.lines().map(parse_line).collect()
}

fn tail(path: &Path, n: usize) -> String {
    let s = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

// ------------------------------------------------------------ test 1

/// Where a run's SIGKILL landed, judged afterwards from both logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum KillPoint {
    BeforeFirstSave,
    SaveNotYetReceived,
    DuringSaveAborted,
    AfterReleaseUnseen,
    AfterReleaseSeen,
}

#[test]
fn trainer_sigkilled_at_random_points_released_saves_commit_the_others_never() {
    let t_start = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let Some((bin, exe)) = prerequisites(tmp.path()) else { return };
    let (dir, sock, log) = (tmp.path().join("ck"), tmp.path().join("s.sock"), tmp.path().join("sidecar.log"));
    const MIB: u64 = 4;
    let mut sidecar = Sidecar::start(&bin, &dir, &sock, "64MiB", &log);
    let mut rng = rng("trainer kills", 0x0074_7261_696e_6572);

    // The harness's own session: status (drain) and a load of latest per run.
    let me = Client::connect(Some(&sock)).unwrap();
    me.set_request_timeout(Some(PATIENCE));
    let specs = tensors(MIB);
    let region_bytes: u64 = specs.iter().map(|t| t.2 * 8).sum();
    let region = me.alloc_region(region_bytes).unwrap();
    let shapes: Vec<[u64; 1]> = specs.iter().map(|t| [t.2]).collect();
    let mut at = 0;
    let refs: Vec<TensorRef> = specs
        .iter()
        .zip(&shapes)
        .map(|(t, shape)| {
            let r = TensorRef::in_region(t.0, t.1, shape, &region, at, t.2 * 8);
            at += t.2 * 8;
            r
        })
        .collect();

    let mut known: BTreeSet<u64> = BTreeSet::new(); // committed and checked
    let mut points: BTreeMap<KillPoint, usize> = BTreeMap::new();
    let mut pids = Vec::new();
    let mut log_offset = 0;
    for run in 0..RUNS {
        let latest_before = known.last().copied();
        let out = tmp.path().join(format!("trainer-{run}.log"));
        let mut child = spawn_trainer(&exe, &["--mib", &MIB.to_string(), "--resume"], &sock, &out);
        let pid = child.0.id();
        pids.push(pid);
        let delay = Duration::from_micros(rng.below(KILL_DELAY_US_MAX));
        std::thread::sleep(delay);
        let st = kill9(&mut child.0);
        let ctx = || {
            format!(
                "run {run} (trainer pid {pid}, killed after {delay:?}):\n{}\nstderr: {}",
                tail(&out, 30),
                fs::read_to_string(out.with_extension("err")).unwrap_or_default()
            )
        };
        assert_eq!(st.signal(), Some(libc::SIGKILL), "the trainer exited by itself ({st}) in {}", ctx());

        // Wait until the dead trainer's session has ended (every frame it
        // sent has been handled) and nothing is in flight.
        wait_for(
            || format!("the sidecar to drain after {}; status {:?}", ctx(), me.status()),
            || {
                let r = me.status().unwrap();
                (r.in_flight.is_empty() && !r.sessions.iter().any(|s| s.pid == pid)).then_some(())
            },
        );

        let lines = trainer_lines(&out);
        let issued: BTreeSet<u64> =
            lines.iter().filter_map(|l| if let Line::Save(s) = l { Some(*s) } else { None }).collect();
        let seen_released: BTreeSet<u64> =
            lines.iter().filter_map(|l| if let Line::Released(s) = l { Some(*s) } else { None }).collect();
        for l in &lines {
            match l {
                Line::Resumed(r) => {
                    let got = r.map(|(s, ok)| {
                        assert!(ok, "resume verification failed in {}", ctx());
                        s
                    });
                    assert_eq!(got, latest_before, "the trainer resumed from another step than latest in {}", ctx());
                }
                Line::Save(_) | Line::Released(_) | Line::Step(_) => {}
                other => panic!("unexpected {other:?} in {}", ctx()),
            }
        }
        if let Some(first) = issued.first() {
            assert_eq!(*first, latest_before.unwrap_or(0) + 1, "{}", ctx());
        }

        let full_log = sidecar.log_text();
        let end = full_log.rfind('\n').map_or(log_offset, |i| i + 1);
        let run_log = parse_save_log(&full_log[log_offset..end]);
        log_offset = end;
        assert!(run_log.refused.is_empty(), "the sidecar refused a save: {:?} in {}", run_log.refused, ctx());

        let (now, latest) = committed(&bin, &dir);
        assert!(known.is_subset(&now), "committed steps vanished: had {known:?}, now {now:?}");
        let new: BTreeSet<u64> = now.difference(&known).copied().collect();
        // Released (seen by the trainer) ⇒ committed.
        assert!(
            seen_released.is_subset(&now),
            "released steps {:?} not committed ({now:?}) in {}",
            seen_released.difference(&now).collect::<Vec<_>>(),
            ctx()
        );
        // Committed in this run ⇔ released by the sidecar in this run; never an aborted one.
        assert_eq!(
            new,
            run_log.released,
            "committed in this run vs released by the sidecar ({run_log:?}) in {}",
            ctx()
        );
        assert!(new.is_disjoint(&run_log.aborted), "an aborted save was committed: {run_log:?}, {}", ctx());
        assert!(new.is_subset(&issued), "committed {new:?}, but the trainer saved only {issued:?} in {}", ctx());
        for &s in &new {
            verify(&bin, &dir, Some(s)).unwrap_or_else(|e| panic!("{e}\nin {}", ctx()));
            check_files(&dir, s, MIB).unwrap_or_else(|e| panic!("{e}\nin {}", ctx()));
        }
        assert_eq!(latest, now.last().copied(), "latest is not the newest committed step");
        assert!(tmp_dirs(&dir).is_empty(), "temp folders left after the drain: {:?} in {}", tmp_dirs(&dir), ctx());
        if let Some(l) = latest {
            // `latest` loads, through the sidecar, holding exactly step l.
            let info = me.load(None, &refs).unwrap_or_else(|e| panic!("load latest: {e} in {}", ctx()));
            assert_eq!(info.step, l);
            assert!(info.fell_back.is_empty(), "{:?}", info.fell_back);
            let mut got = vec![0u8; region_bytes as usize];
            region.read_at(0, &mut got).unwrap();
            let mut at = 0;
            for t in &specs {
                check_tensor(MIB, l, t.0, &got[at..at + t.2 as usize * 8])
                    .unwrap_or_else(|e| panic!("load latest: {e} in {}", ctx()));
                at += t.2 as usize * 8;
            }
        }

        let point = match issued.last() {
            None => KillPoint::BeforeFirstSave,
            Some(s) if seen_released.contains(s) => KillPoint::AfterReleaseSeen,
            Some(s) if run_log.released.contains(s) => KillPoint::AfterReleaseUnseen,
            Some(s) if run_log.aborted.contains(s) => KillPoint::DuringSaveAborted,
            Some(_) => KillPoint::SaveNotYetReceived,
        };
        *points.entry(point).or_default() += 1;
        known = now;
    }

    // The sidecar holds no mapping of a dead trainer's memory.
    let maps = fs::read_to_string(format!("/proc/{}/maps", sidecar.pid())).unwrap();
    let held: Vec<&str> = maps.lines().filter(|l| pids.iter().any(|p| l.contains(&format!("/ckpt-{p}-")))).collect();
    assert!(held.is_empty(), "the sidecar still maps regions of killed trainers:\n{}", held.join("\n"));

    // The sidecar still serves: a last trainer resumes and runs to its end.
    let l = *known.last().expect("60 runs committed nothing");
    let out = tmp.path().join("trainer-last.log");
    let o = Command::new(&exe)
        .args(["--mib", &MIB.to_string(), "--resume", "--max-steps", &(l + 3).to_string(), "--socket"])
        .arg(&sock)
        .env_remove("CKPT_SIDECAR_PRELOAD")
        .stdout(fs::File::create(&out).unwrap())
        .output()
        .unwrap();
    assert!(o.status.success(), "last trainer: {}\n{}", text(&o), tail(&out, 20));
    let lines = trainer_lines(&out);
    assert_eq!(lines.first(), Some(&Line::Resumed(Some((l, true)))), "{lines:?}");
    for s in l + 1..=l + 3 {
        assert!(lines.contains(&Line::Durable(s)), "step {s} not durable: {lines:?}");
        check_files(&dir, s, MIB).unwrap();
    }
    // Its first allocation removed the shared memory the killed ones left
    // (the shim's sweep of segments whose pid is dead).
    let left: Vec<String> = fs::read_dir("/dev/shm")
        .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    // SAFETY: kill(pid, 0) only asks whether the pid exists (a reused pid is alive: not swept).
    let dead = |p: u32| unsafe { libc::kill(p as i32, 0) } != 0;
    let stale: Vec<&String> =
        left.iter().filter(|n| pids.iter().any(|&p| n.starts_with(&format!("ckpt-{p}-")) && dead(p))).collect();
    assert!(stale.is_empty(), "shared memory of killed trainers not swept: {stale:?}");
    me.close();
    assert_eq!(sidecar.stop(), 0, "{}", sidecar.log_text());
    verify(&bin, &dir, None).unwrap();
    assert!(tmp_dirs(&dir).is_empty());
    remove_shm_of(&pids);
    eprintln!(
        "trainer kills: {RUNS} runs, {} steps committed, kill points {points:?}, {:.1} s",
        known.len() + 3,
        t_start.elapsed().as_secs_f64()
    );
}

// ------------------------------------------------------------ test 2

#[test]
fn sidecar_sigkilled_mid_write_nothing_committed_is_damaged_the_trainer_goes_on_and_reconnects() {
    let t_start = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let Some((bin, exe)) = prerequisites(tmp.path()) else { return };
    let (dir, sock) = (tmp.path().join("ck"), tmp.path().join("s.sock"));
    const MIB: u64 = 64;
    let slog = |i: usize| tmp.path().join(format!("sidecar-{i}.log"));
    let mut sidecar = Sidecar::start(&bin, &dir, &sock, "256MiB", &slog(0));
    let mut rng = rng("sidecar kills", 0x0073_6964_6563_6172);

    let out = tmp.path().join("trainer.log");
    let mut trainer = spawn_trainer(&exe, &["--mib", &MIB.to_string(), "--keep-going", "--step-ms", "50"], &sock, &out);
    let ctx = |round: usize, sidecar: &Sidecar| {
        format!("round {round}; trainer log:\n{}\nsidecar log:\n{}", tail(&out, 25), sidecar.log_text())
    };

    let mut known: BTreeSet<u64> = BTreeSet::new(); // committed and checked
    let mut mid_write = 0;
    let mut latest_behind = 0; // kills between a commit point and the update of latest
    let mut mark = 0; // saves after this step went to the current sidecar
    for round in 0..ROUNDS {
        // A save released by this sidecar.
        wait_for(
            || format!("a release after step {mark}: {}", ctx(round, &sidecar)),
            || trainer_lines(&out).iter().any(|l| matches!(l, Line::Released(s) if *s > mark)).then_some(()),
        );
        if round % 2 == 0 {
            // While a checkpoint is being written.
            let c = Client::connect(Some(&sock)).unwrap();
            c.set_request_timeout(Some(PATIENCE));
            wait_for(
                || format!("a checkpoint in phase writing: {}", ctx(round, &sidecar)),
                || c.status().unwrap().in_flight.iter().any(|f| f.phase == "writing").then_some(()),
            );
            std::thread::sleep(Duration::from_micros(rng.below(3_000)));
            c.close();
        } else {
            // At a random point after the next release (copying, queued, writing, committed).
            let n = trainer_lines(&out).iter().filter(|l| matches!(l, Line::Released(_))).count();
            wait_for(
                || format!("the next release: {}", ctx(round, &sidecar)),
                || (trainer_lines(&out).iter().filter(|l| matches!(l, Line::Released(_))).count() > n).then_some(()),
            );
            std::thread::sleep(Duration::from_micros(rng.below(40_000)));
        }
        let lines_before = trainer_lines(&out).len();
        let old_pid = sidecar.pid();
        sidecar.kill9();
        let left = tmp_dirs(&dir);
        if !left.is_empty() {
            mid_write += 1;
        }

        // Nothing committed is damaged: every new checkpoint verifies and
        // holds exactly its step; the older ones are all still there.
        let (now, latest) = committed(&bin, &dir);
        assert!(known.is_subset(&now), "committed steps vanished after the kill: had {known:?}, now {now:?}");
        for &s in now.difference(&known) {
            verify(&bin, &dir, Some(s)).unwrap_or_else(|e| panic!("{e}\n{}", ctx(round, &sidecar)));
            check_files(&dir, s, MIB).unwrap_or_else(|e| panic!("{e}\n{}", ctx(round, &sidecar)));
        }
        // `latest` names a committed step: the newest, or the one before
        // when the kill fell between the commit point (the rename) and the
        // update of `latest` (the next start repairs that, checked below).
        let newest_two: Vec<u64> = now.iter().rev().take(2).copied().collect();
        assert!(
            latest.is_none_or(|l| newest_two.contains(&l)) && latest.is_some() != now.is_empty(),
            "latest {latest:?} after the kill; committed {now:?}"
        );
        if latest != now.last().copied() {
            latest_behind += 1;
        }
        known = now;

        // The trainer's next call fails clearly; it goes on training, and a
        // save with no sidecar there fails too (reconnecting fails).
        let (first_err, save_err_at) = wait_for(
            || format!("the trainer to fail a save with no sidecar and train 2 more steps: {}", ctx(round, &sidecar)),
            || {
                let lines = trainer_lines(&out);
                let after = &lines[lines_before..];
                let first = after.iter().find(|l| matches!(l, Line::Error(..) | Line::Failed(..)))?.clone();
                let at = after.iter().position(
                    |l| matches!(l, Line::Error(_, call, _, msg) if call == "save" && msg.contains("reconnecting")),
                )?;
                let steps_after = after[at..].iter().filter(|l| matches!(l, Line::Step(_))).count();
                (steps_after >= 2).then_some((first, after[at].clone()))
            },
        );
        let (rc, msg) = match &first_err {
            Line::Error(_, _, rc, msg) | Line::Failed(_, rc, msg) => (*rc, msg.clone()),
            _ => unreachable!(),
        };
        assert_eq!(rc, CKPT_E_DISCONNECTED, "first call after the sidecar (pid {old_pid}) died: {first_err:?}");
        assert!(msg.contains("sidecar"), "not a clear error: {first_err:?}");
        let Line::Error(_, _, rc, msg) = &save_err_at else { unreachable!() };
        assert_eq!(*rc, CKPT_E_DISCONNECTED, "{save_err_at:?}");
        assert!(
            msg.contains("sidecar") && msg.contains(&*sock.to_string_lossy()),
            "not a clear error: {save_err_at:?}"
        );
        assert!(trainer.0.try_wait().unwrap().is_none(), "the trainer stopped: {}", ctx(round, &sidecar));

        // A new sidecar on the same directory and socket cleans up at start.
        mark = trainer_lines(&out)
            .iter()
            .filter_map(|l| if let Line::Save(s) = l { Some(*s) } else { None })
            .max()
            .unwrap();
        sidecar = Sidecar::start(&bin, &dir, &sock, "256MiB", &slog(round + 1));
        // Every folder the kill left is gone. (The trainer may already have
        // reconnected: a pipelined save writes its own temp folder from the
        // start of its copy, so that one may be there.)
        let stale: Vec<String> = tmp_dirs(&dir).into_iter().filter(|d| left.contains(d)).collect();
        assert!(
            stale.is_empty(),
            "temp folders the kill left are still there after a new start: {stale:?} (left by the kill: {left:?})"
        );
        let (after_start, latest) = committed(&bin, &dir);
        assert!(known.is_subset(&after_start), "the new sidecar removed committed steps: {known:?} vs {after_start:?}");
        assert_eq!(latest, after_start.last().copied(), "latest after a new start");

        // The trainer's next saves reconnect and commit.
        wait_for(
            || format!("a save after step {mark} to be durable: {}", ctx(round, &sidecar)),
            || trainer_lines(&out).iter().any(|l| matches!(l, Line::Durable(s) if *s > mark)).then_some(()),
        );
    }

    let st = kill9(&mut trainer.0);
    assert_eq!(st.signal(), Some(libc::SIGKILL), "the trainer had exited ({st}): {}", ctx(ROUNDS, &sidecar));
    assert_eq!(sidecar.stop(), 0, "{}", sidecar.log_text());
    let lines = trainer_lines(&out);
    let (now, latest) = committed(&bin, &dir);
    assert!(tmp_dirs(&dir).is_empty(), "{:?}", tmp_dirs(&dir));
    assert!(known.is_subset(&now));
    for &s in now.difference(&known) {
        check_files(&dir, s, MIB).unwrap();
    }
    verify(&bin, &dir, None).unwrap();
    assert_eq!(latest, now.last().copied());
    // Every durable step is committed, every committed step was saved.
    let durable: BTreeSet<u64> =
        lines.iter().filter_map(|l| if let Line::Durable(s) = l { Some(*s) } else { None }).collect();
    let issued: BTreeSet<u64> =
        lines.iter().filter_map(|l| if let Line::Save(s) = l { Some(*s) } else { None }).collect();
    assert!(durable.is_subset(&now), "durable but not committed: {:?}", durable.difference(&now).collect::<Vec<_>>());
    assert!(now.is_subset(&issued));
    // Training never stopped: one "step" line per step, in order, through every outage.
    let steps: Vec<u64> = lines.iter().filter_map(|l| if let Line::Step(s) = l { Some(*s) } else { None }).collect();
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
    assert!(mid_write >= 1, "no kill of {ROUNDS} landed while a checkpoint was being written (no temp folder left)");
    remove_shm_of(&[trainer.0.id()]);
    eprintln!(
        "sidecar kills: {ROUNDS}, {mid_write} mid-write (temp folder left), {latest_behind} before latest was updated; {} steps trained, {} saves, {} committed, {:.1} s",
        steps.len(),
        issued.len(),
        now.len(),
        t_start.elapsed().as_secs_f64()
    );
}
