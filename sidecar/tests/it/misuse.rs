//! Every subcommand against bad input, table-driven, through the real
//! binary: a nonexistent path, a file where a directory belongs, an empty
//! directory, a directory with junk and a damaged step, zero and absurd
//! sizes and steps. Each case asserts the exit status (from the documented
//! set: 0 ok, 1 error, 2 usage, 3 damage found), one line on stderr naming
//! the path or value, no clause said twice, no panic, and that nothing was
//! created in or left behind under the test's folder.

use ckpt_test_support::sidecar_bin;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Every path under `root` (files and folders, recursively), with each
/// file's length: what a command may not change.
fn tree(root: &Path) -> BTreeSet<(PathBuf, u64)> {
    let mut out = BTreeSet::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            out.insert((e.path(), if m.is_dir() { 0 } else { m.len() }));
            if m.is_dir() {
                todo.push(e.path());
            }
        }
    }
    out
}

struct Fixture {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

impl Fixture {
    /// `nx` (missing), `afile` (a file), `empty/`, `junk/` (stray files and
    /// folders, an uncommitted step folder, and committed step 1 whose index
    /// is garbage), `good/` (one sound checkpoint, step 1).
    fn new() -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        std::fs::write(root.join("afile"), b"not a directory").unwrap();
        std::fs::create_dir(root.join("empty")).unwrap();
        let junk = root.join("junk");
        std::fs::create_dir_all(junk.join("step-000000000001")).unwrap();
        std::fs::write(junk.join("step-000000000001/model.safetensors.index.json"), b"{ this is not an index").unwrap();
        std::fs::create_dir_all(junk.join("step-000000000002")).unwrap();
        std::fs::create_dir_all(junk.join("step-abc")).unwrap();
        std::fs::write(junk.join("notes.txt"), b"hello").unwrap();
        std::fs::write(junk.join("latest"), b"garbage\n").unwrap();
        let out = Command::new(sidecar_bin())
            .args(["bench", "write", "--size", "256KiB", "--dir"])
            .arg(root.join("good"))
            .env("CKPT_SIDECAR_LOG", "warn")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        // `stale/`: a sound checkpoint whose `latest` names a step not there.
        let out = Command::new(sidecar_bin())
            .args(["bench", "write", "--size", "64KiB", "--dir"])
            .arg(root.join("stale"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        std::fs::write(root.join("stale/latest"), b"step-000000000099\n").unwrap();
        Fixture { _tmp: tmp, root }
    }

    fn p(&self, name: &str) -> String {
        self.root.join(name).to_str().unwrap().to_string()
    }
}

/// A clause (text between `: ` or `; `) said twice on a line.
fn repeated_clause(line: &str) -> Option<String> {
    let parts: Vec<&str> = line.split([':', ';']).map(str::trim).filter(|p| p.len() > 3).collect();
    for (i, a) in parts.iter().enumerate() {
        if parts[i + 1..].contains(a) {
            return Some(a.to_string());
        }
    }
    None
}

struct Case {
    args: Vec<String>,
    /// Allowed exit statuses.
    exit: &'static [i32],
    /// Text the one stderr line must contain (None: no error line).
    names: Option<String>,
    /// A command that cleans (gc, rollback on junk): its recovery may repair
    /// `latest` and say so in warnings; everything else must stay as it was.
    cleans: bool,
}

/// The log's lines (`2026-…Z  WARN target: …` and their indented
/// continuations): a cleaning command's recovery warnings, not its error.
fn error_lines(err: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut in_log = false;
    for l in err.lines().filter(|l| !l.trim().is_empty()) {
        let is_log =
            l.as_bytes().first().is_some_and(u8::is_ascii_digit) && (l.contains(" WARN ") || l.contains(" INFO "));
        if is_log || (in_log && l.starts_with(' ')) {
            in_log = true;
            continue;
        }
        in_log = false;
        out.push(l);
    }
    out
}

fn run_case(fx: &Fixture, c: &Case) -> Result<(), String> {
    let before = tree(&fx.root);
    let mut cmd = Command::new(sidecar_bin());
    cmd.args(&c.args).env("CKPT_SIDECAR_LOG", "warn").env_remove("CKPT_SIDECAR_SOCKET").stdin(Stdio::null());
    // The default socket of serve must not be a shared one.
    cmd.env("XDG_RUNTIME_DIR", fx.root.join("nx-runtime"));
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let t0 = std::time::Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            return Err("still running after 120 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let code = out.status.code();
    if err.contains("panicked") || code == Some(101) {
        return Err(format!("panicked: {err}"));
    }
    if !code.is_some_and(|x| c.exit.contains(&x)) {
        return Err(format!("exit {code:?}, want one of {:?}; stderr: {err}", c.exit));
    }
    let lines: Vec<&str> =
        if c.cleans { error_lines(&err) } else { err.lines().filter(|l| !l.trim().is_empty()).collect() };
    match &c.names {
        None if !lines.is_empty() => return Err(format!("stderr not empty: {err}")),
        None => {}
        Some(want) => {
            if lines.len() != 1 {
                return Err(format!("{} lines on stderr, want 1: {err}", lines.len()));
            }
            if !lines[0].contains(want.as_str()) {
                return Err(format!("stderr does not name {want:?}: {err}"));
            }
            if let Some(r) = repeated_clause(lines[0]) {
                return Err(format!("says {r:?} twice: {err}"));
            }
        }
    }
    let mut after = tree(&fx.root);
    if c.cleans {
        let latest =
            |t: &BTreeSet<(PathBuf, u64)>| t.iter().filter(|(p, _)| p.ends_with("latest")).cloned().collect::<Vec<_>>();
        for l in latest(&before).into_iter().chain(latest(&after)) {
            after.remove(&l);
        }
        let mut b = before.clone();
        for l in latest(&before) {
            b.remove(&l);
        }
        if b != after {
            return Err(format!(
                "the tree changed beyond `latest`: new {:?}, gone {:?}",
                after.difference(&b).collect::<Vec<_>>(),
                b.difference(&after).collect::<Vec<_>>()
            ));
        }
        return Ok(());
    }
    if before != after {
        let made: Vec<_> = after.difference(&before).collect();
        let gone: Vec<_> = before.difference(&after).collect();
        return Err(format!("the tree changed: new {made:?}, gone {gone:?}"));
    }
    Ok(())
}

fn case(args: &[&str], exit: &'static [i32], names: Option<&str>) -> Case {
    Case { args: args.iter().map(|s| s.to_string()).collect(), exit, names: names.map(str::to_string), cleans: false }
}

fn cleaning(args: &[&str], exit: &'static [i32], names: Option<&str>) -> Case {
    Case { cleans: true, ..case(args, exit, names) }
}

#[test]
fn every_subcommand_refuses_bad_paths_and_values_in_one_line_and_leaves_nothing() {
    let fx = Fixture::new();
    let (nx, afile, empty, junk, good) = (fx.p("nx"), fx.p("afile"), fx.p("empty"), fx.p("junk"), fx.p("good"));
    let nx_sock = format!("{nx}/s.sock");
    let long_sock = format!("{}/{}/s.sock", fx.p("sockdir"), "x".repeat(120));
    let no_such = format!("no such directory: {nx}");
    let not_dir = format!("{afile} is not a directory");
    let sock = fx.p("nx-sock/s.sock");
    let mut cases = Vec::new();
    // Commands that read or clean a directory: a missing one or a file.
    for (bad, msg) in [(&nx, &no_such), (&afile, &not_dir)] {
        for args in [
            vec!["ls", bad],
            vec!["ls", bad, "--json"],
            vec!["inspect", bad],
            vec!["inspect", bad, "1", "--json"],
            vec!["verify", bad],
            vec!["verify", bad, "--step", "1", "--json"],
            vec!["verify", &good, "--secondary", bad],
            vec!["gc", bad, "--keep", "1"],
            vec!["gc", &good, bad, "--keep", "1"],
            vec!["rollback", bad, "--to", "1"],
            vec!["doctor", bad],
            vec!["bench", "read", "--dir", bad],
        ] {
            cases.push(case(&args, &[1], Some(msg)));
        }
    }
    // Commands that create their directory refuse a file, and a failed
    // start leaves nothing (not even the socket's folder).
    for args in [
        vec!["serve", "--dir", &afile, "--socket", &sock, "--staging", "2MiB"],
        vec!["serve", "--dir", &nx, "--dir", &afile, "--socket", &sock, "--staging", "2MiB"],
        vec!["launch", "--dir", &afile, "--staging", "2MiB", "--", "true"],
        vec!["launch", "--dir", &afile, "--socket", &sock, "--staging", "2MiB", "--", "true"],
        vec!["bench", "write", "--dir", &afile, "--size", "1MiB"],
        vec!["bench", "write", "--dir", &nx, "--dir", &afile, "--size", "1MiB"],
        vec!["bench", "stall", "--dir", &afile, "--size", "1MiB"],
    ] {
        cases.push(case(&args, &[1], Some(&not_dir)));
    }
    cases.push(case(
        &["serve", "--dir", &nx, "--socket", &long_sock, "--staging", "2MiB"],
        &[1],
        Some("pass a shorter --socket"),
    ));
    cases.push(case(
        &["launch", "--dir", &nx, "--socket", &long_sock, "--staging", "2MiB", "--", "true"],
        &[1],
        Some("pass a shorter --socket"),
    ));
    // A preload library that is no shared library: the loader would ignore it.
    cases.push(case(
        &["launch", "--dir", &nx, "--staging", "2MiB", "--preload", "--preload-lib", &afile, "--", "true"],
        &[1],
        Some(&format!("--preload: {afile} is not a shared library")),
    ));
    cases.push(case(
        &["launch", "--dir", &nx, "--staging", "2MiB", "--preload", "--preload-lib", &empty, "--", "true"],
        &[1],
        Some(&format!("--preload: {empty}: ")),
    ));
    cases.push(case(&["status", "--socket", &nx_sock], &[1], Some(&format!("no sidecar is listening at {nx_sock}"))));
    cases.push(case(&["status", "--socket", &afile, "--json"], &[1], Some(afile.as_str())));
    // An empty directory: nothing to read, nothing to clean.
    cases.push(case(&["ls", &empty], &[0], None));
    cases.push(case(&["inspect", &empty], &[1], Some(&format!("{empty}: no committed checkpoint"))));
    cases.push(case(&["verify", &empty], &[1], Some(&format!("{empty}: no committed checkpoint"))));
    cases.push(case(&["gc", &empty, "--keep", "1"], &[0], None));
    cases.push(case(&["rollback", &empty, "--to", "1"], &[1], Some("step 1")));
    cases.push(case(&["doctor", &empty], &[0], None));
    cases.push(case(&["bench", "read", "--dir", &empty], &[1], Some(&format!("{empty}: no committed checkpoint"))));
    // Junk and a damaged step: listed, named as damaged, never "missing".
    cases.push(case(&["ls", &junk], &[0], None));
    cases.push(case(&["ls", &junk, "--json"], &[0], None));
    cases.push(case(&["inspect", &junk], &[1], Some("damaged")));
    cases.push(case(&["inspect", &junk, "1"], &[1], Some("damaged")));
    cases.push(case(&["inspect", &junk, "2"], &[1], Some("step 2")));
    cases.push(case(&["verify", &junk], &[3], None));
    cases.push(case(&["verify", &junk, "--json"], &[3], None));
    cases.push(case(&["bench", "read", "--dir", &junk], &[1], Some(junk.as_str())));
    // `latest` naming a step that is not there: the newest committed one is read, as a load would.
    let stale = fx.p("stale");
    cases.push(case(&["bench", "read", "--dir", &stale], &[0], None));
    cases.push(case(&["inspect", &stale], &[0], None));
    cases.push(case(&["verify", &stale], &[0], None));
    cases.push(cleaning(&["gc", &junk, "--keep", "1"], &[0], None));
    // Step 1's index does not read: a trainer sent back to it could not load.
    cases.push(cleaning(&["rollback", &junk, "--to", "1"], &[1], Some("cannot roll back to it: ")));
    cases.push(cleaning(&["rollback", &junk, "--to", "2"], &[1], Some("step 2")));
    // Zero and absurd sizes, counts and steps: usage errors naming the
    // value, or (memory) an error naming the size; nothing created.
    for (args, value) in [
        (vec!["bench", "write", "--dir", &nx, "--size", "0"], "\"0\""),
        (vec!["bench", "write", "--dir", &nx, "--size", "1MiB", "--shard-size", "0"], "\"0\""),
        (vec!["bench", "write", "--dir", &nx, "--size", "lots"], "\"lots\""),
        (vec!["bench", "write", "--dir", &nx, "--size", "99999999PiB"], "\"99999999PiB\""),
        (vec!["bench", "write", "--dir", &nx, "--size", "1MiB", "--step", "1000000000000"], "1000000000000"),
        (vec!["bench", "write", "--dir", &nx, "--size", "1MiB", "--queue-depth", "0"], "0"),
        (vec!["bench", "stall", "--dir", &nx, "--size", "0"], "\"0\""),
        (vec!["bench", "stall", "--dir", &nx, "--size", "1MiB", "--staging", "0"], "\"0\""),
        (vec!["bench", "stall", "--dir", &nx, "--size", "1MiB", "--repeats", "0"], "0"),
        (vec!["bench", "compare", "--dir", &nx, "--sizes", "256MiB,0"], "\"0\""),
        (vec!["bench", "compare", "--dir", &nx, "--loop-only", "--loop-size", "0"], "\"0\""),
        (vec!["serve", "--dir", &nx, "--socket", &sock, "--staging", "0"], "\"0\""),
        (vec!["serve", "--dir", &nx, "--socket", &sock, "--shard-size", "0"], "\"0\""),
        (vec!["serve", "--dir", &nx, "--socket", &sock, "--keep", "0"], "\"0\""),
        (vec!["serve", "--dir", &nx, "--socket", &sock, "--keep", "1", "--keep-every", "0"], "\"0\""),
        (vec!["serve", "--dir", &nx, "--socket", &sock, "--staging", "1.5XB"], "1.5XB"),
        (vec!["serve", "--dir", &nx, "--socket", &sock, "--cpus", "9-1"], "9-1"),
        (vec!["launch", "--dir", &nx, "--staging", "0", "--", "true"], "\"0\""),
        (vec!["gc", &good, "--keep", "0"], "\"0\""),
        (vec!["gc", &good, "--keep", "1", "--keep-every", "0"], "\"0\""),
        (vec!["inspect", &good, "1000000000000"], "1000000000000"),
        (vec!["inspect", &good, "-1"], "-1"),
        (vec!["verify", &good, "--step", "18446744073709551615"], "18446744073709551615"),
        (vec!["rollback", &good, "--to", "1000000000000"], "1000000000000"),
        (vec!["verify", &good, "--queue-depth", "100000"], "100000"),
    ] {
        cases.push(case(&args, &[2], Some(value)));
    }
    cases.push(case(&["bench", "write", "--dir", &nx, "--size", "15PiB"], &[1], Some("cannot allocate")));
    cases.push(case(&["serve", "--dir", &nx, "--socket", &sock, "--staging", "15PiB"], &[1], Some("--staging")));
    // A shared directory is never made: a missing one is likely an unmounted
    // shared file system, and each node would commit into its own.
    let no_shared = format!("{nx}-shared");
    cases.push(case(
        &["serve", "--dir", &nx, "--socket", &sock, "--staging", "64MiB", "--shared", &no_shared],
        &[1],
        Some(&format!("shared directory {no_shared} does not exist")),
    ));
    cases.push(case(
        &["bench", "stall", "--dir", &nx, "--size", "1MiB", "--python", &format!("{nx}/python")],
        &[1],
        Some(&format!("{nx}/python")),
    ));
    // A Python that is missing, or cannot import the package the bench
    // modules live in, is named in one line (not Python's module lookup).
    cases.push(case(
        &["bench", "compare", "--dir", &nx, "--python", &format!("{nx}/python")],
        &[1],
        Some(&format!("{nx}/python")),
    ));
    cases.push(case(
        &["bench", "compare", "--dir", &nx, "--python", "/bin/false"],
        &[1],
        Some("/bin/false cannot import ckpt_sidecar"),
    ));
    let mut failures = Vec::new();
    for c in &cases {
        if let Err(e) = run_case(&fx, c) {
            failures.push(format!("ckpt-sidecar {}: {e}", c.args.join(" ")));
        }
    }
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn a_closed_stdout_ends_a_tool_quietly() {
    let fx = Fixture::new();
    let good = fx.p("good");
    // A reader that takes one byte and goes away, as `| head -c 1` does.
    for args in [
        vec!["inspect", &good],
        vec!["inspect", &good, "--json"],
        vec!["verify", &good, "--json"],
        vec!["ls", &good],
        vec!["doctor", &good],
    ] {
        let mut child =
            Command::new(sidecar_bin()).args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        drop(child.stdout.take()); // closed before the command writes
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        use std::os::unix::process::ExitStatusExt;
        let quiet = out.status.code() == Some(0)
            || out.status.code() == Some(141)
            || out.status.signal() == Some(libc::SIGPIPE);
        assert!(quiet && !err.contains("panicked"), "{args:?}: {:?}: {err}", out.status);
        assert!(err.is_empty(), "{args:?}: {err}");
    }
}

#[test]
fn gc_of_a_nonexistent_directory_creates_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let nx = tmp.path().join("a/b");
    let out = Command::new(sidecar_bin()).arg("gc").arg(&nx).args(["--keep", "1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim(), format!("error: no such directory: {}", nx.display()));
    assert!(!tmp.path().join("a").exists());
}

#[test]
fn serve_on_a_file_says_once_that_it_is_not_a_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("afile");
    std::fs::write(&f, b"x").unwrap();
    // With the daemon's default logging: the one line is the error.
    let out = Command::new(sidecar_bin())
        .args(["serve", "--staging", "2MiB", "--dir"])
        .arg(&f)
        .arg("--socket")
        .arg(tmp.path().join("run/s.sock"))
        .env_remove("CKPT_SIDECAR_LOG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(err.trim(), format!("error: {} is not a directory", f.display()));
    assert!(!tmp.path().join("run").exists(), "the socket's folder was left");
}

#[test]
fn recovery_points_latest_only_at_a_checkpoint_whose_index_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d");
    for _ in 0..2 {
        let out =
            Command::new(sidecar_bin()).args(["bench", "write", "--size", "256KiB", "--dir"]).arg(&d).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    // Step 2's index unreadable, `latest` lost (as after a crash).
    std::fs::write(d.join("step-000000000002/model.safetensors.index.json"), b"{\"metadata\":").unwrap();
    std::fs::remove_file(d.join("latest")).unwrap();
    let out = Command::new(sidecar_bin()).arg("gc").arg(&d).args(["--keep", "5"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(d.join("latest")).unwrap().trim(), "step-000000000001");
    // ls shows both, the damaged one marked, columns kept; inspect of the
    // damaged step says it is damaged.
    let out = Command::new(sidecar_bin()).arg("ls").arg(&d).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(lines[3].starts_with("checked: "), "{text}");
    assert!(lines[2].contains("index unreadable") && lines[1].trim_end().ends_with('*'), "{text}");
    assert_eq!(lines[1].find("KiB"), lines[0].find("BYTES").map(|b| b + 2), "{text}");
    let out = Command::new(sidecar_bin()).arg("inspect").arg(&d).arg("2").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("damaged"));
}

#[test]
fn status_lists_no_session_of_its_own_and_a_closed_stdout_leaves_the_sidecar_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("run/s.sock");
    let mut serve = serve_listening(&tmp.path().join("ckpt"), &socket);
    let out = Command::new(sidecar_bin()).arg("status").arg("--socket").arg(&socket).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.lines().any(|l| l == "sessions: 0"), "{text}");
    let out = Command::new(sidecar_bin()).arg("status").arg("--socket").arg(&socket).arg("--json").output().unwrap();
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["sessions"].as_array().map(Vec::len), Some(0), "{j}");
    for _ in 0..3 {
        let mut c = Command::new(sidecar_bin())
            .arg("status")
            .arg("--socket")
            .arg(&socket)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(c.stdout.take());
        let out = c.wait_with_output().unwrap();
        assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    assert!(serve.try_wait().unwrap().is_none(), "the sidecar died of its clients' closed pipes");
    ckpt_test_support::terminate(&mut serve, Duration::from_secs(30)).expect("serve stops on SIGTERM");
}

/// `verify`, `ls` and `inspect` beside a process that commits and deletes
/// old checkpoints as it goes (a live sidecar's --keep; here `debug
/// torture --keep 1`, the same store code): a step deleted after it was
/// listed is gone, never reported as damaged (exit 3) nor as an unreadable
/// index. Runs until the race was seen a few times (verify says so).
#[test]
fn tools_beside_a_directory_whose_old_steps_are_deleted_never_call_them_damaged() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d");
    let mut writer = Command::new(sidecar_bin())
        .args(["debug", "torture", "--size", "1MiB", "--keep", "1", "--dir"])
        .arg(&d)
        .env("CKPT_SIDECAR_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !d.join("latest").exists() {
        assert!(writer.try_wait().unwrap().is_none(), "the writer exited");
        assert!(t0.elapsed() < Duration::from_secs(60), "no first commit");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (mut seen, mut runs, mut failures) = (0, 0, Vec::new());
    while seen < 3 && t0.elapsed() < Duration::from_secs(120) {
        runs += 1;
        let json = runs % 2 == 0;
        let mut args = vec!["verify".to_string(), d.to_str().unwrap().to_string()];
        if json {
            args.push("--json".into());
        }
        let out = Command::new(sidecar_bin()).args(&args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if out.status.code() != Some(0) {
            failures.push(format!("{args:?}: {:?}: {text}{}", out.status, String::from_utf8_lossy(&out.stderr)));
        } else if json {
            let j: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert_eq!(j["ok"], true, "{j}");
        }
        seen += text.matches("deleted while being verified").count();
        let ls = Command::new(sidecar_bin()).arg("ls").arg(&d).output().unwrap();
        let ls_text = String::from_utf8_lossy(&ls.stdout);
        if ls.status.code() != Some(0) || ls_text.contains("unreadable") {
            failures.push(format!("ls: {:?}: {ls_text}{}", ls.status, String::from_utf8_lossy(&ls.stderr)));
        }
        let ins = Command::new(sidecar_bin()).arg("inspect").arg(&d).output().unwrap();
        if ins.status.code() != Some(0) {
            failures.push(format!("inspect: {:?}: {}", ins.status, String::from_utf8_lossy(&ins.stderr)));
        }
        if failures.len() >= 3 {
            break;
        }
    }
    ckpt_test_support::kill9(&mut writer);
    assert!(failures.is_empty(), "{} failures in {runs} runs:\n{}", failures.len(), failures.join("\n"));
    assert!(seen >= 1, "no step was deleted while it was verified in {runs} runs: the race was not exercised");
}

/// A directory no file can be made in (/proc): doctor's row names it once,
/// then why, and the command fails; the JSON row says the same.
#[test]
fn doctor_names_an_unusable_directory_once() {
    let out = Command::new(sidecar_bin()).args(["doctor", "/proc"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    let row = text.lines().find(|l| l.starts_with("/proc:")).unwrap_or_else(|| panic!("no row for /proc: {text}"));
    assert!(row.starts_with("/proc: unusable: probe write: "), "{row}");
    assert_eq!(repeated_clause(row), None, "{row}");
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(sidecar_bin()).args(["doctor", "/proc", "--json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let err = j["dirs"][0]["error"].as_str().unwrap_or_default();
    assert!(err.starts_with("probe write: ") && !err.contains("/proc"), "{j}");
}

/// `rollback --to` a step whose shard is truncated would move `latest` to a
/// checkpoint no trainer loads and un-commit the later, sound ones: refused
/// in one line naming the file, nothing changed, by the tool and through a
/// sidecar serving the directory.
#[test]
fn rollback_to_a_step_with_a_truncated_shard_is_refused_and_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d");
    let shard = truncated_shard_among_two_steps(&d, 1);
    let before = tree(&d);
    let want = format!("error: cannot roll back to step 1: {}: 1000 bytes where the index says", shard.display());
    let out = Command::new(sidecar_bin())
        .arg("rollback")
        .arg(&d)
        .args(["--to", "1"])
        .env("CKPT_SIDECAR_LOG", "warn")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.trim().starts_with(&want) && err.trim().lines().count() == 1, "{err}");
    assert_eq!(tree(&d), before, "the tool changed the directory");
    // The same through a sidecar that serves the directory.
    let socket = tmp.path().join("run/s.sock");
    let mut serve = serve_listening(&d, &socket);
    let before = tree(&d);
    let out = Command::new(sidecar_bin()).arg("rollback").arg(&d).args(["--to", "1"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("1000 bytes where the index says") && err.trim().lines().count() == 1, "{err}");
    assert_eq!(repeated_clause(err.trim()), None, "{err}");
    assert_eq!(tree(&d), before, "the sidecar changed the directory");
    assert_eq!(std::fs::read_to_string(d.join("latest")).unwrap().trim(), "step-000000000002");
    ckpt_test_support::terminate(&mut serve, Duration::from_secs(30)).expect("serve stops on SIGTERM");
}

/// `status` against a socket where something else listens: one that never
/// answers, one that answers garbage. One line naming the socket and what
/// went wrong (a timeout said as one, not as "Resource temporarily unavailable").
#[test]
fn status_of_a_socket_that_is_no_sidecar_names_it_in_one_line() {
    use std::io::Write;
    let tmp = tempfile::tempdir().unwrap();
    let silent = tmp.path().join("silent.sock");
    let garbage = tmp.path().join("garbage.sock");
    let l_silent = std::os::unix::net::UnixListener::bind(&silent).unwrap();
    let l_garbage = std::os::unix::net::UnixListener::bind(&garbage).unwrap();
    // Accepted and held open, never answered.
    let held = std::thread::spawn(move || l_silent.accept().map(|(c, _)| c));
    std::thread::spawn(move || {
        for c in l_garbage.incoming() {
            let mut c = c.unwrap();
            let _ = c.write_all(&[0xff, 0xff, 0xff, 0x7f, b'x', b'y']);
            std::thread::sleep(Duration::from_millis(500));
        }
    });
    for (sock, want) in [(&silent, "no answer within 10 s"), (&garbage, "frame of 2147483647 bytes is above the limit")]
    {
        let out = Command::new(sidecar_bin()).arg("status").arg("--socket").arg(sock).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(&format!("asking {} for its status: ", sock.display())) && err.contains(want), "{err}");
        assert!(out.stdout.is_empty());
    }
    drop(held);
}

/// `gc --keep 1` when the newest step's shard is truncated would delete the
/// only step that loads: refused in one line naming why, nothing deleted.
#[test]
fn gc_never_keeps_only_steps_that_would_not_load() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d");
    let shard = truncated_shard_among_two_steps(&d, 2);
    let before = tree(&d);
    let out = Command::new(sidecar_bin())
        .arg("gc")
        .arg(&d)
        .args(["--keep", "1"])
        .env("CKPT_SIDECAR_LOG", "warn")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let want = format!(
        "error: gc would keep only steps that would not load (step 2: {}: 1000 bytes where the index says",
        shard.display()
    );
    assert!(err.trim().starts_with(&want) && err.trim().lines().count() == 1, "{err}");
    assert_eq!(tree(&d), before, "gc changed the directory");
    // Both damaged: nothing to protect, retention does what it is told.
    let shard1 = d.join("step-000000000001/rank-00000-of-00001-shard-0000.safetensors");
    std::fs::OpenOptions::new().write(true).open(&shard1).unwrap().set_len(1000).unwrap();
    let out = Command::new(sidecar_bin()).arg("gc").arg(&d).args(["--keep", "1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!d.join("step-000000000001").exists());
}

/// A `serve` of `dir` with 2 MiB of staging, once it listens on `socket`.
fn serve_listening(dir: &Path, socket: &Path) -> std::process::Child {
    let mut serve = Command::new(sidecar_bin())
        .args(["serve", "--staging", "2MiB", "--dir"])
        .arg(dir)
        .arg("--socket")
        .arg(socket)
        .env("CKPT_SIDECAR_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        assert!(serve.try_wait().unwrap().is_none(), "serve exited");
        assert!(t0.elapsed() < Duration::from_secs(30), "serve did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    serve
}

/// Commits steps 1 and 2 into `d` (bench write, 256 KiB each), then cuts step
/// `step`'s shard to 1000 bytes; returns the shard's path.
fn truncated_shard_among_two_steps(d: &Path, step: u64) -> PathBuf {
    for _ in 0..2 {
        let out =
            Command::new(sidecar_bin()).args(["bench", "write", "--size", "256KiB", "--dir"]).arg(d).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let shard = d.join(format!("step-{step:012}/rank-00000-of-00001-shard-0000.safetensors"));
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(1000).unwrap();
    shard
}

#[test]
fn negative_steps_and_counts_are_range_errors_naming_the_value() {
    // Before: clap took "-1" for a flag ("unexpected argument '-1' found").
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d");
    let d = d.to_str().unwrap();
    for (args, want) in [
        (vec!["rollback", d, "--to", "-1"], "step \"-1\""),
        (vec!["verify", d, "--step", "-1"], "step \"-1\""),
        (vec!["inspect", d, "-1"], "step \"-1\""),
        (vec!["gc", d, "--keep", "-1"], "-1"),
    ] {
        let out = Command::new(sidecar_bin()).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(want) && !err.contains("unexpected argument") && err.trim().lines().count() == 1,
            "{args:?}: {err}"
        );
    }
    assert!(!Path::new(d).exists());
}

#[test]
fn an_invalid_part_timeout_is_refused_at_start_naming_it() {
    // Before: any value that did not parse silently meant 300 s.
    let tmp = tempfile::tempdir().unwrap();
    let before = tree(tmp.path());
    for v in ["abc", "0", "-5", "inf", "NaN", "1e12"] {
        let d = tmp.path().join("d");
        let out = Command::new(sidecar_bin())
            .args(["serve", "--staging", "2MiB", "--dir"])
            .arg(&d)
            .arg("--socket")
            .arg(tmp.path().join("run/s.sock"))
            .env("CKPT_SIDECAR_PART_TIMEOUT_S", v)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{v}: {err}");
        assert!(
            err.contains(&format!("CKPT_SIDECAR_PART_TIMEOUT_S={v:?}")) && error_lines(&err).len() == 1,
            "{v}: {err}"
        );
        assert_eq!(tree(tmp.path()), before, "{v}: a refused start left something");
    }
}

#[test]
fn rollback_to_a_step_whose_bytes_are_damaged_is_refused_naming_the_damage() {
    // Before: a stat-only check let it through, un-committing sound step 2.
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d");
    for _ in 0..2 {
        let out =
            Command::new(sidecar_bin()).args(["bench", "write", "--size", "256KiB", "--dir"]).arg(&d).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let shard = d.join("step-000000000001/rank-00000-of-00001-shard-0000.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0xff;
    std::fs::write(&shard, &bytes).unwrap();
    let before = tree(&d);
    let out = Command::new(sidecar_bin())
        .arg("rollback")
        .arg(&d)
        .args(["--to", "1"])
        .env("CKPT_SIDECAR_LOG", "warn")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot roll back to step 1: it is damaged")
            && err.contains("checksum mismatch")
            && error_lines(&err).len() == 1,
        "{err}"
    );
    assert_eq!(tree(&d), before, "the tool changed the directory");
}

#[test]
fn readers_see_one_timeline_while_a_rollback_killed_midway_is_pending() {
    // A rollback to step 1 killed after its intent was durable, before
    // `latest` moved and before steps 2 and 3 were un-committed. Before:
    // `ls`, `verify` and `inspect` listed and read steps 2 and 3 while
    // `latest` named 3 (or 1), until the next owner finished the rollback.
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d");
    for _ in 0..3 {
        let out =
            Command::new(sidecar_bin()).args(["bench", "write", "--size", "256KiB", "--dir"]).arg(&d).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    std::fs::write(d.join(".ckpt-rollback"), "step-000000000001\n").unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(sidecar_bin()).args(args).arg(&d).env("CKPT_SIDECAR_LOG", "warn").output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let ls: serde_json::Value = serde_json::from_str(&run(&["ls", "--json"])).unwrap();
    let steps: Vec<u64> =
        ls["checkpoints"].as_array().map(|a| a.iter().filter_map(|c| c["step"].as_u64()).collect()).unwrap_or_default();
    assert_eq!(steps, [1], "{ls}");
    assert_eq!(ls["latest"].as_u64(), Some(1), "{ls}");
    let verify: serde_json::Value = serde_json::from_str(&run(&["verify", "--json"])).unwrap();
    assert!(verify.to_string().contains("\"step\":1") && !verify.to_string().contains("\"step\":3"), "{verify}");
    assert!(run(&["inspect"]).contains("step 1"));
    assert_eq!(
        ckpt_store::restore::load(&d, ckpt_store::restore::Which::Latest, &Default::default(), None).unwrap().step,
        1
    );
    assert!(ckpt_store::restore::load(&d, ckpt_store::restore::Which::Step(3), &Default::default(), None).is_err());
    // The next owner (here gc) finishes the rollback: the same timeline.
    run(&["gc", "--keep", "10"]);
    assert_eq!(ckpt_store::catalog::committed_steps(&d).unwrap(), [1]);
    assert!(!d.join(".ckpt-rollback").exists());
}
