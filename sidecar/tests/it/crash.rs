//! Crash tests in the sled / TigerBeetle manner: run the real binary, kill it
//! with SIGKILL at random instants, then recover through the library and
//! check every promise of DESIGN.md "Failure semantics" that a kill touches:
//!
//! - a committed checkpoint (index under its final name) is whole: it
//!   verifies byte for byte, before recovery and after it;
//! - every checkpoint the process reported committed is still there (or was
//!   legitimately removed by retention);
//! - after recovery nothing in flight survives (`.tmp-step-*`, `.del-step-*`,
//!   `.latest.tmp-*`), secondary directories hold only folders of committed
//!   checkpoints, and `latest` names the newest committed checkpoint;
//! - `load latest` succeeds without falling back, and returns the data of
//!   that very step.
//!
//! The kill instants come from a small xorshift PRNG; the seed is printed and
//! can be set with `CKPT_CRASH_SEED` to replay a run.

use std::collections::BTreeSet;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use ckpt_store::catalog;
use ckpt_store::commit::{Store, StoreOptions};
use ckpt_store::format::{self, DEL_PREFIX, LATEST_TMP_PREFIX, PROBE_PREFIX, ROLLBACK_FILE_NAME, TMP_PREFIX};
use ckpt_store::mem::AlignedBuf;
use ckpt_store::restore::{self, ReadOptions, Which};
use ckpt_store::synthetic;
use ckpt_test_support::sidecar_bin;
use ckpt_test_support::{seed_from_env, Rng};

const DEFAULT_SEED: u64 = 0x5EED_C0DE_2024_0001;

/// Kills of the torture writer (half with one directory, half with two).
const N_KILLS: usize = 60;
/// Torture checkpoint size, as given to `--size` and to `transformer_specs`.
const TORTURE_SIZE: &str = "6MiB";
const TORTURE_SIZE_BYTES: u64 = 6 << 20;
const TORTURE_KEEP: usize = 3;
/// Upper bound of the kill delay: a commit of 6 MiB takes some tens of
/// milliseconds, so this spans several whole commit cycles.
const MAX_DELAY_US: u64 = 400_000;

/// Kills of `gc` (half with one directory, half with two).
const N_GC_KILLS: usize = 24;
const GC_SIZE: &str = "2MiB";
const GC_SIZE_BYTES: u64 = 2 << 20;
const GC_POPULATE: u64 = 6;

/// Kills of `rollback` (half with one directory, half with two).
const N_ROLLBACK_KILLS: usize = 24;
/// Checkpoints added before each rollback (retention off).
const ROLLBACK_POPULATE: u64 = 5;

// ------------------------------------------------------------------ helpers

fn seed(test: &str) -> u64 {
    seed_from_env("CKPT_CRASH_SEED", DEFAULT_SEED, test)
}

fn dir_args(cmd: &mut Command, dirs: &[PathBuf]) {
    for d in dirs {
        cmd.arg("--dir").arg(d);
    }
}

fn sigkill(child: &Child) {
    // SAFETY: plain syscall; the child is ours and not yet waited for, so its
    // pid cannot have been reused.
    let r = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
    assert_eq!(r, 0, "kill: {}", std::io::Error::last_os_error());
}

/// Kills `child` after `delay`, reaps it, returns its status and stdout and
/// stderr. A process that ended by itself before the kill is fine for `gc`
/// (it finished); the caller decides.
fn kill_after(mut child: Child, delay: Duration) -> (ExitStatus, String, String) {
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
    // If it already exited, it is a zombie until waited for: kill is harmless.
    sigkill(&child);
    let status = child.wait().expect("wait for the child");
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut o) = child.stdout.take() {
        o.read_to_string(&mut out).expect("read child stdout");
    }
    if let Some(mut e) = child.stderr.take() {
        e.read_to_string(&mut err).expect("read child stderr");
    }
    (status, out, err)
}

fn killed_by_sigkill(status: &ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal() == Some(libc::SIGKILL)
}

fn spawn_torture(dirs: &[PathBuf], size: &str, keep: usize, count: Option<u64>) -> Child {
    let mut cmd = Command::new(sidecar_bin());
    cmd.args(["debug", "torture", "--size", size, "--keep", &keep.to_string()]);
    dir_args(&mut cmd, dirs);
    if let Some(c) = count {
        cmd.args(["--count", &c.to_string()]);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.spawn().expect("spawn ckpt-sidecar debug torture")
}

/// Steps the torture process printed as committed.
fn reported_commits(stdout: &str) -> Vec<u64> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("committed "))
        .map(|s| s.trim().parse().expect("step number"))
        .collect()
}

/// Names of the entries of `dir` that are in-flight leftovers.
fn leftovers(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").file_name().to_string_lossy().into_owned())
        .filter(|n| {
            [TMP_PREFIX, DEL_PREFIX, LATEST_TMP_PREFIX, PROBE_PREFIX, ROLLBACK_FILE_NAME]
                .iter()
                .any(|p| n.starts_with(p))
        })
        .collect()
}

/// `.ckpt-probe-*` files (the O_DIRECT probe's scratch file, when O_TMPFILE
/// is missing) in `dir` and its step folders.
fn probe_leftovers(dir: &Path) -> usize {
    let mut n = 0;
    for e in fs::read_dir(dir).expect("read dir") {
        let e = e.expect("dir entry");
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(PROBE_PREFIX) {
            n += 1;
        } else if e.file_type().expect("file type").is_dir() && format::parse_step_dir_name(&name).is_some() {
            n += probe_leftovers(&e.path());
        }
    }
    n
}

/// How to check that the committed checkpoints are whole.
///
/// Checks directories, reusing one load buffer and one verify window.
struct Checker {
    size_bytes: u64,
    buf: Option<AlignedBuf>,
    verifier: restore::Verifier,
    /// `restore::verify` calls made.
    verified: usize,
}

impl Checker {
    fn new(size_bytes: u64) -> Checker {
        Checker { size_bytes, buf: None, verifier: restore::Verifier::default(), verified: 0 }
    }

    fn load(&mut self, primary: &Path, which: Which) -> Result<restore::Loaded, restore::LoadError> {
        restore::load(primary, which, &ReadOptions::default(), self.buf.take())
    }

    /// Every committed checkpoint readers see in the primary is whole (a
    /// pending rollback's later steps are not among them). Holds at every
    /// instant, recovery or not: that is what the commit point means.
    fn assert_committed_whole(&mut self, dirs: &[PathBuf], ctx: &str) -> Vec<u64> {
        let primary = &dirs[0];
        let committed = catalog::readable_steps(primary).expect("list committed steps");
        for &s in &committed {
            let l = self
                .load(primary, Which::Step(s))
                .unwrap_or_else(|e| panic!("{ctx}: committed step {s} does not load: {e}"));
            assert_eq!(l.step, s);
            assert!(!l.index.ckpt.files.is_empty() && !l.index.ckpt.tensors.is_empty(), "{ctx}: step {s} is empty");
            self.buf = Some(l.into_buf());
        }
        for &s in &committed {
            let r = self
                .verifier
                .verify(primary, s, &ReadOptions::default(), |_, _| {})
                .unwrap_or_else(|e| panic!("{ctx}: verify of committed step {s} failed: {e}"));
            assert!(r.problems.is_empty(), "{ctx}: verify finds committed step {s} damaged: {:?}", r.problems);
            assert!(r.files > 0 && r.tensors > 0, "{ctx}: committed step {s} has no content: {r:?}");
            self.verified += 1;
        }
        committed
    }

    /// Opens the store (which runs recovery) and checks the invariants of a
    /// recovered set of directories; returns the committed steps.
    fn recover_and_check(&mut self, dirs: &[PathBuf], ctx: &str) -> Vec<u64> {
        let store = Store::open(StoreOptions::new(dirs.to_vec()))
            .unwrap_or_else(|e| panic!("{ctx}: Store::open (recovery) failed: {e}"));
        drop(store);
        let primary = &dirs[0];

        for d in dirs {
            let left = leftovers(d);
            assert!(left.is_empty(), "{ctx}: recovery left in-flight entries in {}: {left:?}", d.display());
        }

        let committed = self.assert_committed_whole(dirs, ctx);
        // A primary step folder is committed or absent: commit renames a
        // folder that already holds its index, retention renames it away
        // first.
        let primary_steps = catalog::step_dirs(primary).expect("list primary");
        assert_eq!(primary_steps, committed, "{ctx}: the primary holds step folders without an index");

        let committed_set: BTreeSet<u64> = committed.iter().copied().collect();
        for d in &dirs[1..] {
            for s in catalog::step_dirs(d).expect("list secondary") {
                assert!(
                    committed_set.contains(&s),
                    "{ctx}: secondary {} holds step {s}, which is not committed in the primary (committed: {committed:?})",
                    d.display()
                );
            }
        }

        match committed.last() {
            None => {
                assert_eq!(catalog::latest_step(primary).unwrap(), None, "{ctx}: latest without a checkpoint");
                assert_eq!(
                    catalog::read_latest(primary).unwrap(),
                    None,
                    "{ctx}: a `latest` file without any checkpoint"
                );
                assert!(matches!(self.load(primary, Which::Latest), Err(restore::LoadError::NoCheckpoint { .. })));
            }
            Some(&newest) => {
                assert_eq!(
                    catalog::latest_step(primary).unwrap(),
                    Some(newest),
                    "{ctx}: latest is not the newest committed step"
                );
                let raw = catalog::read_latest(primary).unwrap();
                assert_eq!(
                    raw.as_deref(),
                    Some(format::step_dir_name(newest).unwrap().as_str()),
                    "{ctx}: `latest` file content"
                );
                assert!(catalog::is_committed(primary, newest));

                let l = self.load(primary, Which::Latest).unwrap_or_else(|e| panic!("{ctx}: load latest failed: {e}"));
                assert_eq!(l.step, newest, "{ctx}: load latest returned another step");
                assert!(l.fell_back.is_empty(), "{ctx}: load latest fell back: {:?}", l.fell_back);
                assert_eq!(l.blobs.get("meta").map(|b| b.as_slice()), Some(&b"torture blob"[..]), "{ctx}: blob");
                // The bytes are those of this very step (synthetic::stage
                // fills tensor i with fill(seed = step + i)).
                let specs = synthetic::transformer_specs(self.size_bytes);
                for i in [0, specs.len() / 2, specs.len() - 1] {
                    let got =
                        l.tensor(&specs[i].name).unwrap_or_else(|| panic!("{ctx}: tensor {} missing", specs[i].name));
                    let mut want = vec![0u8; got.len()];
                    synthetic::fill(&mut want, newest.wrapping_add(i as u64));
                    assert!(
                        got == want.as_slice(),
                        "{ctx}: tensor {} of step {newest} does not hold that step's data",
                        specs[i].name
                    );
                }
                self.buf = Some(l.into_buf());
            }
        }
        committed
    }
}

/// Whether the disappearance of `gone` from `after` is explained by a
/// keep-`keep` retention: at least `keep` newer checkpoints are committed.
fn retention_explains(gone: u64, after: &[u64], keep: usize) -> bool {
    after.iter().filter(|&&s| s > gone).count() >= keep
}

// -------------------------------------------------------------------- tests

struct Target {
    name: &'static str,
    dirs: Vec<PathBuf>,
    committed: Vec<u64>,
    kills: usize,
    progress: usize,
}

#[test]
fn sigkill_during_commits_never_breaks_a_committed_checkpoint() {
    let t_start = Instant::now();
    let mut rng = Rng::new(seed("crash"));
    let tmp = tempfile::tempdir().expect("temp dir");
    let mut targets = [
        Target { name: "one dir", dirs: vec![tmp.path().join("single")], committed: vec![], kills: 0, progress: 0 },
        Target {
            name: "two dirs",
            dirs: vec![tmp.path().join("primary"), tmp.path().join("secondary")],
            committed: vec![],
            kills: 0,
            progress: 0,
        },
    ];
    let mut check = Checker::new(TORTURE_SIZE_BYTES);
    let mut early_kills = 0;
    let mut recovery_kills = 0;

    for i in 0..N_KILLS {
        let t = &mut targets[i % 2];
        let ctx = format!("kill {i} ({})", t.name);
        // 1 in 6: within the first 3 ms, i.e. while the process starts and
        // runs recovery; otherwise anywhere over several commit cycles.
        let delay_us = if rng.below(6) == 0 {
            early_kills += 1;
            rng.below(3_000)
        } else {
            rng.below(MAX_DELAY_US)
        };
        let child = spawn_torture(&t.dirs, TORTURE_SIZE, TORTURE_KEEP, None);
        let (status, out, err) = kill_after(child, Duration::from_micros(delay_us));
        if !killed_by_sigkill(&status) {
            panic!("{ctx}: torture ended by itself ({status}) instead of being killed; stderr:\n{err}");
        }
        let mut reported = reported_commits(&out);
        // Whether the last process run printed a commit (see the bound below).
        let mut last_proc_reported = !reported.is_empty();

        // Before any recovery: what is committed is whole.
        check.assert_committed_whole(&t.dirs, &format!("{ctx}, before recovery"));

        // Now and then a second process, killed within its first 1.5 ms, so
        // that kills also land inside startup recovery with leftovers present.
        if rng.below(3) == 0 {
            recovery_kills += 1;
            let child = spawn_torture(&t.dirs, TORTURE_SIZE, TORTURE_KEEP, None);
            let (status, out2, err2) = kill_after(child, Duration::from_micros(rng.below(1_500)));
            assert!(killed_by_sigkill(&status), "{ctx}: second torture ended by itself ({status}); stderr:\n{err2}");
            let r2 = reported_commits(&out2);
            last_proc_reported = !r2.is_empty();
            reported.extend(r2);
            check.assert_committed_whole(&t.dirs, &format!("{ctx}, after a kill in startup"));
        }

        let after = check.recover_and_check(&t.dirs, &ctx);

        // Nothing committed goes away but by retention; the newest never does.
        let before_newest = t.committed.last().copied();
        let after_newest = after.last().copied();
        assert!(after_newest >= before_newest, "{ctx}: newest went from {before_newest:?} to {after_newest:?}");
        for &s in &t.committed {
            assert!(
                after.contains(&s) || retention_explains(s, &after, TORTURE_KEEP),
                "{ctx}: committed step {s} vanished (before {:?}, after {after:?})",
                t.committed
            );
        }
        // Every step the process reported committed is durable.
        for &s in &reported {
            assert!(
                after.contains(&s) || retention_explains(s, &after, TORTURE_KEEP),
                "{ctx}: step {s} was reported committed but is gone (after {after:?}; reported {reported:?})"
            );
        }
        if let Some(&last) = reported.last() {
            assert!(after_newest >= Some(last), "{ctx}: reported {last} committed, newest is {after_newest:?}");
        }
        // Retention keeps the set bounded. "committed N" is printed after
        // commit() returned, retention included, so if the last process
        // printed one, at most one newer commit's retention can be pending.
        // (Without a print, consecutive kills between a commit and its
        // retention can each leave one more.)
        if last_proc_reported {
            assert!(
                after.len() <= TORTURE_KEEP + 1,
                "{ctx}: {} checkpoints with keep {TORTURE_KEEP}: {after:?}",
                after.len()
            );
        }

        t.kills += 1;
        if after_newest > before_newest {
            t.progress += 1;
        }
        t.committed = after;
    }

    let mut probes = 0;
    for t in &targets {
        for d in &t.dirs {
            probes += probe_leftovers(d);
        }
        eprintln!(
            "crash [{}]: {} kills, {} with progress, newest committed step {:?}, committed now {:?}",
            t.name,
            t.kills,
            t.progress,
            t.committed.last(),
            t.committed
        );
        assert!(t.progress > 0, "[{}] no kill ever saw a new checkpoint: the test did not exercise commits", t.name);
        assert!(
            t.committed.last().copied().unwrap_or(0) >= 3,
            "[{}] too few commits happened: {:?}",
            t.name,
            t.committed
        );
    }
    eprintln!(
        "crash: {N_KILLS} kills ({early_kills} in the first 3 ms, {recovery_kills} extra kills during startup recovery), \
         {} verify calls, {probes} leftover .ckpt-probe-* files, {:.1} s",
        check.verified,
        t_start.elapsed().as_secs_f64()
    );
}

#[test]
fn sigkill_during_gc_never_leaves_a_half_deleted_checkpoint_committed() {
    let t_start = Instant::now();
    let mut rng = Rng::new(seed("gc crash") ^ 0x9C);
    let tmp = tempfile::tempdir().expect("temp dir");
    let sets: [(&str, Vec<PathBuf>); 2] = [
        ("one dir", vec![tmp.path().join("gc-single")]),
        ("two dirs", vec![tmp.path().join("gc-primary"), tmp.path().join("gc-secondary")]),
    ];
    // Time of an uninterrupted gc (process start included), per set.
    let mut gc_us: [Option<u64>; 2] = [None, None];
    let (mut interrupted, mut untouched, mut finished) = (0usize, 0usize, 0usize);
    let mut check = Checker::new(GC_SIZE_BYTES);

    for i in 0..N_GC_KILLS + 2 {
        let k = i % 2;
        let (name, dirs) = &sets[k];
        let ctx = format!("gc kill {i} ({name})");

        // Add checkpoints (retention off in effect), let it finish.
        let child = spawn_torture(dirs, GC_SIZE, 1000, Some(GC_POPULATE));
        let out = child.wait_with_output().expect("wait for torture");
        assert!(out.status.success(), "{ctx}: populating failed: {}", String::from_utf8_lossy(&out.stderr));
        let before = check.recover_and_check(dirs, &format!("{ctx}, populated"));
        assert!(before.len() as u64 >= GC_POPULATE, "{ctx}: {before:?}");

        let mut cmd = Command::new(sidecar_bin());
        cmd.arg("gc").args(dirs).args(["--keep", "1"]);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let t0 = Instant::now();
        let child = cmd.spawn().expect("spawn gc");
        let (status, _out, err) = match gc_us[k] {
            None => {
                // First round of each set: measure an uncrashed gc.
                let o = child.wait_with_output().expect("wait for gc");
                gc_us[k] = Some((t0.elapsed().as_micros() as u64).max(1_000));
                (
                    o.status,
                    String::from_utf8_lossy(&o.stdout).into_owned(),
                    String::from_utf8_lossy(&o.stderr).into_owned(),
                )
            }
            Some(us) => kill_after(child, Duration::from_micros(rng.below(us + us / 5))),
        };
        let was_killed = killed_by_sigkill(&status);
        assert!(was_killed || status.success(), "{ctx}: gc failed ({status}): {err}");

        check.assert_committed_whole(dirs, &format!("{ctx}, before recovery"));
        let after = check.recover_and_check(dirs, &ctx);

        // The newest is never deleted; deletions go oldest first, so what is
        // left is a tail of what was there; a finished gc keeps just one.
        let newest = *before.last().unwrap();
        assert_eq!(
            after.last(),
            Some(&newest),
            "{ctx}: the newest checkpoint is gone (before {before:?}, after {after:?})"
        );
        assert!(
            before.ends_with(&after),
            "{ctx}: what is left is not the newest ones (before {before:?}, after {after:?})"
        );
        if !was_killed {
            assert_eq!(after, vec![newest], "{ctx}: gc finished but kept {after:?}");
        }
        if after.len() == 1 {
            finished += 1;
        } else if after == before {
            untouched += 1;
        } else {
            interrupted += 1;
        }
    }
    eprintln!(
        "gc crash: {N_GC_KILLS} kills after a measured gc of {:?} us: {untouched} before any deletion, {interrupted} mid-way, {finished} after all deletions, {:.1} s",
        gc_us,
        t_start.elapsed().as_secs_f64()
    );
}

#[test]
fn sigkill_during_rollback_leaves_the_old_or_the_new_timeline() {
    let t_start = Instant::now();
    let mut rng = Rng::new(seed("rollback crash") ^ 0x7B);
    let tmp = tempfile::tempdir().expect("temp dir");
    let sets: [(&str, Vec<PathBuf>); 2] = [
        ("one dir", vec![tmp.path().join("rb-single")]),
        ("two dirs", vec![tmp.path().join("rb-primary"), tmp.path().join("rb-secondary")]),
    ];
    let mut rollback_us: [Option<u64>; 2] = [None, None];
    let (mut old_timeline, mut new_timeline) = (0usize, 0usize);
    let mut check = Checker::new(GC_SIZE_BYTES);

    for i in 0..N_ROLLBACK_KILLS + 2 {
        let k = i % 2;
        let (name, dirs) = &sets[k];
        let ctx = format!("rollback kill {i} ({name})");
        let child = spawn_torture(dirs, GC_SIZE, 1000, Some(ROLLBACK_POPULATE));
        let out = child.wait_with_output().expect("wait for torture");
        assert!(out.status.success(), "{ctx}: populating failed: {}", String::from_utf8_lossy(&out.stderr));
        let before = check.recover_and_check(dirs, &format!("{ctx}, populated"));
        // Back to a step that leaves at least two later ones to un-commit.
        let to = before[before.len() - 3 - rng.below(before.len() as u64 - 2) as usize];

        let mut cmd = Command::new(sidecar_bin());
        cmd.arg("rollback").args(dirs).args(["--to", &to.to_string()]);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let t0 = Instant::now();
        let child = cmd.spawn().expect("spawn rollback");
        let (status, _out, err) = match rollback_us[k] {
            None => {
                let o = child.wait_with_output().expect("wait for rollback");
                rollback_us[k] = Some((t0.elapsed().as_micros() as u64).max(1_000));
                (
                    o.status,
                    String::from_utf8_lossy(&o.stdout).into_owned(),
                    String::from_utf8_lossy(&o.stderr).into_owned(),
                )
            }
            Some(us) => kill_after(child, Duration::from_micros(rng.below(us + us / 5))),
        };
        let was_killed = killed_by_sigkill(&status);
        assert!(was_killed || status.success(), "{ctx}: rollback failed ({status}): {err}");

        // Before recovery: whatever readers see is whole and is one timeline,
        // the old or the new (a pending intent hides the steps it
        // un-commits), and `latest` as they see it names a step of it (the
        // target is never touched, later steps go away by one rename each).
        let new: Vec<u64> = before.iter().copied().filter(|&s| s <= to).collect();
        let listed = check.assert_committed_whole(dirs, &format!("{ctx}, before recovery"));
        assert!(
            listed == before || listed == new,
            "{ctx}: readers see {listed:?}, neither the old timeline {before:?} nor the new one"
        );
        let named = catalog::latest_step(&dirs[0]).unwrap().unwrap_or_else(|| panic!("{ctx}: no latest"));
        assert_eq!(Some(&named), listed.last(), "{ctx}: latest names step {named} (listed {listed:?})");

        let after = check.recover_and_check(dirs, &ctx);
        if after == before {
            assert!(was_killed, "{ctx}: a finished rollback left the old timeline");
            old_timeline += 1;
        } else {
            assert_eq!(after, new, "{ctx}: neither the old timeline {before:?} nor the new one (to {to})");
            new_timeline += 1;
        }
    }
    assert!(new_timeline > 0, "no rollback ever took effect");
    eprintln!(
        "rollback crash: {N_ROLLBACK_KILLS} kills after a measured rollback of {:?} us: {old_timeline} old timeline, {new_timeline} new, {:.1} s",
        rollback_us,
        t_start.elapsed().as_secs_f64()
    );
}

/// A kill between the O_DIRECT probe's create and unlink (`io::probe`, run by
/// every `Store::open`, so at every start of the sidecar, `gc` and the
/// torture writer) leaves a `.ckpt-probe-<nonce>` file that nothing ever
/// removes: recovery only knows `.tmp-step-*`, `.del-step-*` and
/// `.latest.tmp-*`. The crash test above counts them ("leftover
/// .ckpt-probe-* files"); this reproduces it deterministically.
#[test]
fn recovery_removes_o_direct_probe_leftovers() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dirs = vec![tmp.path().join("p"), tmp.path().join("s")];
    for d in &dirs {
        fs::create_dir_all(d).unwrap();
        // What a SIGKILL right after probe_direct's open leaves.
        fs::write(d.join(".ckpt-probe-0123456789abcdef"), vec![0u8; 4096]).unwrap();
    }
    let _store = Store::open(StoreOptions::new(dirs.clone())).expect("open");
    for d in &dirs {
        assert_eq!(probe_leftovers(d), 0, "{}: probe file survived recovery", d.display());
    }
}
