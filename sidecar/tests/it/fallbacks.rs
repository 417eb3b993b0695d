//! The fallback engines, through the real binary: each forced mode
//! (environment `CKPT_SIDECAR_URING` / `CKPT_SIDECAR_DIRECT`, or the flags
//! `--uring` / `--direct`) is what `doctor` reports, with its reason, and what
//! `bench write` uses, and its checkpoints verify and read back.
//!
//! A real refusal of io_uring is produced with a seccomp filter in the child
//! that answers io_uring_setup with EPERM, as a container's default seccomp
//! profile does.
//!
//! A real refusal of O_DIRECT cannot be produced here: tmpfs (since 6.6) and
//! ext4 both accept O_DIRECT, and the file systems that refuse it (some
//! network and FUSE file systems) are not mountable in a test. The forced
//! modes (`CKPT_SIDECAR_DIRECT=off`, `--direct off`) cover the buffered path
//! that such a refusal falls back to.

use std::path::Path;
use std::process::{Command, Output};

use ckpt_test_support::sidecar_bin;
use serde_json::Value;

// ------------------------------------------------------------------ helpers

/// The binary with `args`, the forcing variables of the caller's environment
/// removed and `env` set instead.
fn sidecar(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(sidecar_bin());
    c.args(args).env_remove("CKPT_SIDECAR_URING").env_remove("CKPT_SIDECAR_DIRECT").env_remove("CKPT_SIDECAR_LOG");
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

fn output(mut c: Command) -> Output {
    c.output().unwrap_or_else(|e| panic!("running {c:?}: {e}"))
}

fn describe(o: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn run_ok(c: Command, ctx: &str) -> Output {
    let dbg = format!("{c:?}");
    let o = output(c);
    assert!(o.status.success(), "{ctx}: {dbg} failed: {}", describe(&o));
    o
}

/// The last line of stdout, as JSON.
fn last_json(o: &Output, ctx: &str) -> Value {
    let s = String::from_utf8_lossy(&o.stdout);
    let line = s.lines().last().unwrap_or_else(|| panic!("{ctx}: no output: {}", describe(o)));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{ctx}: last line is not JSON ({e}): {}", describe(o)))
}

fn p(dir: &Path) -> &str {
    dir.to_str().expect("UTF-8 temp path")
}

/// How one run forces the engine.
struct Mode {
    name: &'static str,
    env: Vec<(&'static str, &'static str)>,
    flags: Vec<&'static str>,
    engine: &'static str,
    /// Each must be one of doctor's reasons.
    why: Vec<&'static str>,
}

impl Mode {
    fn needs_uring(&self) -> bool {
        self.engine.starts_with("io_uring")
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(&self.flags);
        sidecar(&all, &self.env)
    }
}

fn modes() -> Vec<Mode> {
    const URING_OFF: &str = "io_uring disabled by configuration";
    const DIRECT_OFF: &str = "O_DIRECT disabled by configuration";
    const BOTH_WORK: &str = "io_uring and O_DIRECT both work here";
    vec![
        Mode { name: "default", env: vec![], flags: vec![], engine: "io_uring+O_DIRECT", why: vec![BOTH_WORK] },
        Mode {
            name: "env uring=off",
            env: vec![("CKPT_SIDECAR_URING", "off")],
            flags: vec![],
            engine: "thread-pool+O_DIRECT",
            why: vec![URING_OFF],
        },
        Mode {
            name: "env direct=off",
            env: vec![("CKPT_SIDECAR_DIRECT", "off")],
            flags: vec![],
            engine: "io_uring+buffered",
            why: vec![DIRECT_OFF],
        },
        Mode {
            name: "env uring=off direct=off",
            env: vec![("CKPT_SIDECAR_URING", "off"), ("CKPT_SIDECAR_DIRECT", "off")],
            flags: vec![],
            engine: "thread-pool+buffered",
            why: vec![URING_OFF, DIRECT_OFF],
        },
        Mode {
            name: "--uring off",
            env: vec![],
            flags: vec!["--uring", "off"],
            engine: "thread-pool+O_DIRECT",
            why: vec![URING_OFF],
        },
        Mode {
            name: "--direct off",
            env: vec![],
            flags: vec!["--direct", "off"],
            engine: "io_uring+buffered",
            why: vec![DIRECT_OFF],
        },
        Mode {
            name: "--uring off --direct off",
            env: vec![],
            flags: vec!["--uring", "off", "--direct", "off"],
            engine: "thread-pool+buffered",
            why: vec![URING_OFF, DIRECT_OFF],
        },
        // Flags win over the environment, which only fills in what they left auto.
        Mode {
            name: "env off, flags on",
            env: vec![("CKPT_SIDECAR_URING", "off"), ("CKPT_SIDECAR_DIRECT", "off")],
            flags: vec!["--uring", "on", "--direct", "on"],
            engine: "io_uring+O_DIRECT",
            why: vec![BOTH_WORK],
        },
        Mode {
            name: "env on, flag --uring off",
            env: vec![("CKPT_SIDECAR_URING", "on"), ("CKPT_SIDECAR_DIRECT", "off")],
            flags: vec!["--uring", "off"],
            engine: "thread-pool+buffered",
            why: vec![URING_OFF, DIRECT_OFF],
        },
    ]
}

/// Whether this machine lets the binary use io_uring (a container's seccomp
/// profile may not); modes that need it are skipped otherwise.
fn uring_available() -> bool {
    let d = tempfile::tempdir().unwrap();
    let o = run_ok(sidecar(&["doctor", p(d.path()), "--json"], &[]), "doctor (auto)");
    let row = &last_json(&o, "doctor (auto)")["dirs"][0];
    let yes = row["uring"].as_bool() == Some(true);
    if !yes {
        println!("io_uring is refused on this machine: {}", row["why"]);
    }
    yes
}

/// doctor's one row for `dir`, checked against the mode.
fn check_doctor(dir: &Path, m: &Mode) -> Value {
    let ctx = format!("doctor, {}", m.name);
    let o = run_ok(m.cmd(&["doctor", p(dir), "--json"]), &ctx);
    let v = last_json(&o, &ctx);
    let rows = v["dirs"].as_array().unwrap_or_else(|| panic!("{ctx}: {v}"));
    assert_eq!(rows.len(), 1, "{ctx}: {v}");
    let row = rows[0].clone();
    assert_eq!(row["engine"], m.engine, "{ctx}: {row}");
    assert_eq!(row["uring"].as_bool(), Some(m.engine.starts_with("io_uring")), "{ctx}: {row}");
    assert_eq!(row["direct"].as_bool(), Some(m.engine.ends_with("O_DIRECT")), "{ctx}: {row}");
    let why: Vec<&str> = row["why"]
        .as_array()
        .unwrap_or_else(|| panic!("{ctx}: no why: {row}"))
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    for w in &m.why {
        assert!(why.contains(w), "{ctx}: why {why:?} lacks {w:?}");
    }
    assert_eq!(why.len(), m.why.len(), "{ctx}: why {why:?}");
    // The human form says the same.
    let o = run_ok(m.cmd(&["doctor", p(dir)]), &ctx);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains(m.engine) && m.why.iter().all(|w| text.contains(w)), "{ctx}: {text}");
    // Probing leaves nothing behind.
    assert_eq!(std::fs::read_dir(dir).unwrap().count(), 0, "{ctx}: probe files left in {}", dir.display());
    row
}

/// bench write, verify, bench read in `dir` under the mode.
fn check_round_trip(dir: &Path, m: &Mode) {
    let ctx = format!("bench, {}", m.name);
    let o =
        run_ok(m.cmd(&["bench", "write", "--dir", p(dir), "--size", "8MiB", "--shard-size", "3MiB", "--json"]), &ctx);
    let w = last_json(&o, &ctx);
    assert_eq!(w["op"], "write", "{ctx}: {w}");
    assert_eq!(w["engine"], m.engine, "{ctx}: bench write used another engine: {w}");
    assert!(w["bytes"].as_u64().unwrap() > 7 << 20, "{ctx}: {w}");
    assert!(w["n_files"].as_u64().unwrap() >= 2, "{ctx}: several shards: {w}");
    let step = w["step"].as_u64().unwrap();

    // verify with the same forcing, and with none (another engine reads it).
    let o = run_ok(m.cmd(&["verify", p(dir)]), &ctx);
    assert!(String::from_utf8_lossy(&o.stdout).contains(&format!("step {step}: ok")), "{ctx}: {}", describe(&o));
    let o = run_ok(m.cmd(&["verify", p(dir), "--json"]), &ctx);
    let v = last_json(&o, &ctx);
    assert_eq!(v["ok"], true, "{ctx}: {v}");
    assert_eq!(v["checkpoints"][0]["step"], step, "{ctx}: {v}");
    let o = output(sidecar(&["verify", p(dir)], &[]));
    assert!(o.status.success(), "{ctx}: verify with the default engine: {}", describe(&o));

    let o = run_ok(m.cmd(&["bench", "read", "--dir", p(dir), "--json"]), &ctx);
    let r = last_json(&o, &ctx);
    assert_eq!(r["op"], "read", "{ctx}: {r}");
    assert_eq!(r["step"], step, "{ctx}: {r}");
    assert_eq!(r["engine"], m.engine, "{ctx}: bench read used another engine: {r}");
    assert_eq!(r["n_tensors"], w["n_tensors"], "{ctx}");
    assert_eq!(r["n_files"], w["n_files"], "{ctx}");
}

// ------------------------------------------------------------------ forced modes

/// Runs `check` in a fresh directory for every mode this machine allows.
fn for_each_mode(check: impl Fn(&Path, &Mode)) {
    let uring = uring_available();
    for m in modes() {
        if m.needs_uring() && !uring {
            println!("skipped {}: io_uring refused on this machine", m.name);
            continue;
        }
        let d = tempfile::tempdir().unwrap();
        check(d.path(), &m);
    }
}

#[test]
fn doctor_reports_each_forced_engine_and_why() {
    for_each_mode(|d, m| {
        check_doctor(d, m);
    });
}

#[test]
fn every_forced_engine_writes_checkpoints_that_verify() {
    for_each_mode(check_round_trip);
}

/// Successive checkpoints in one directory with alternating engines: each
/// engine reads back what the others wrote.
#[test]
fn engines_read_each_others_checkpoints() {
    let uring = uring_available();
    let d = tempfile::tempdir().unwrap();
    let ms: Vec<Mode> = modes().into_iter().filter(|m| (uring || !m.needs_uring()) && m.env.is_empty()).collect();
    for m in &ms {
        let o = run_ok(m.cmd(&["bench", "write", "--dir", p(d.path()), "--size", "4MiB", "--json"]), m.name);
        assert_eq!(last_json(&o, m.name)["engine"], m.engine);
    }
    for m in &ms {
        let o = run_ok(m.cmd(&["verify", p(d.path()), "--json"]), m.name);
        let v = last_json(&o, m.name);
        assert_eq!(v["ok"], true, "{}: {v}", m.name);
        assert_eq!(v["checkpoints"].as_array().unwrap().len(), ms.len(), "{}: {v}", m.name);
    }
}

#[test]
fn bad_forcing_values_are_refused() {
    let d = tempfile::tempdir().unwrap();
    // A bad environment value is an error naming the variable, not a silent default.
    let o = output(sidecar(&["doctor", p(d.path()), "--json"], &[("CKPT_SIDECAR_URING", "sometimes")]));
    assert!(!o.status.success(), "{}", describe(&o));
    let all = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(all.contains("CKPT_SIDECAR_URING"), "{}", describe(&o));
    // A bad flag value is a usage error (exit 2).
    let o = output(sidecar(&["doctor", p(d.path()), "--direct", "maybe"], &[]));
    assert_eq!(o.status.code(), Some(2), "{}", describe(&o));
}

// ------------------------------------------------------------------ real io_uring refusal

#[cfg(target_arch = "x86_64")]
mod seccomp {
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    // Classic BPF opcodes (linux/filter.h).
    const BPF_LD: u16 = 0x00;
    const BPF_W: u16 = 0x00;
    const BPF_ABS: u16 = 0x20;
    const BPF_JMP: u16 = 0x05;
    const BPF_JEQ: u16 = 0x10;
    const BPF_K: u16 = 0x00;
    const BPF_RET: u16 = 0x06;
    /// EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE (linux/audit.h).
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;

    fn stmt(code: u16, k: u32) -> libc::sock_filter {
        libc::sock_filter { code, jt: 0, jf: 0, k }
    }

    fn jump(code: u16, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
        libc::sock_filter { code, jt, jf, k }
    }

    /// io_uring_setup fails with EPERM, everything else is allowed.
    fn program() -> Vec<libc::sock_filter> {
        let arch = std::mem::offset_of!(libc::seccomp_data, arch) as u32;
        let nr = std::mem::offset_of!(libc::seccomp_data, nr) as u32;
        assert_eq!((nr, arch), (0, 4));
        assert_eq!(libc::SYS_io_uring_setup, 425);
        vec![
            stmt(BPF_LD | BPF_W | BPF_ABS, arch),
            // Another ABI than x86_64: not ours to judge, allow.
            jump(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
            stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ALLOW),
            stmt(BPF_LD | BPF_W | BPF_ABS, nr),
            jump(BPF_JMP | BPF_JEQ | BPF_K, libc::SYS_io_uring_setup as u32, 0, 1),
            stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ERRNO | (libc::EPERM as u32 & libc::SECCOMP_RET_DATA)),
            stmt(BPF_RET | BPF_K, libc::SECCOMP_RET_ALLOW),
        ]
    }

    /// Installs the filter in the child between fork and exec.
    pub fn deny_io_uring(mut c: Command) -> Command {
        // Built before the fork: the child only makes two prctl calls.
        let prog = program();
        // SAFETY: the closure only calls prctl (async-signal-safe) and reads
        // `prog`, which it owns; no allocation happens in the child.
        unsafe {
            c.pre_exec(move || {
                let fprog = libc::sock_fprog {
                    len: prog.len() as libc::c_ushort,
                    filter: prog.as_ptr() as *mut libc::sock_filter,
                };
                if libc::prctl(
                    libc::PR_SET_NO_NEW_PRIVS,
                    1 as libc::c_ulong,
                    0 as libc::c_ulong,
                    0 as libc::c_ulong,
                    0 as libc::c_ulong,
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER as libc::c_ulong,
                    &fprog as *const libc::sock_fprog,
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        c
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn io_uring_refused_by_seccomp_falls_back_to_the_thread_pool() {
    use seccomp::deny_io_uring;
    let d = tempfile::tempdir().unwrap();
    let dir = p(d.path());

    // doctor (auto): the thread pool, and why.
    let o = run_ok(deny_io_uring(sidecar(&["doctor", dir, "--json"], &[])), "doctor under seccomp");
    let row = last_json(&o, "doctor under seccomp")["dirs"][0].clone();
    println!("doctor under seccomp: {row}");
    assert_eq!(row["engine"], "thread-pool+O_DIRECT", "{row}");
    assert_eq!(row["uring"], false, "{row}");
    let why = row["why"].as_array().unwrap();
    assert!(
        why.iter().any(|w| w.as_str().unwrap().contains("io_uring refused")
            && w.as_str().unwrap().contains("Operation not permitted")),
        "the reason names the refusal: {row}"
    );

    // --uring on: refused outright, with the reason.
    let o = output(deny_io_uring(sidecar(&["doctor", dir, "--json", "--uring", "on"], &[])));
    assert_eq!(o.status.code(), Some(1), "{}", describe(&o));
    let row = last_json(&o, "doctor --uring on under seccomp")["dirs"][0].clone();
    assert!(row["engine"].is_null(), "{row}");
    assert!(row["error"].as_str().unwrap().contains("io_uring required but refused"), "{row}");

    // bench write falls back by itself, and its checkpoint verifies and reads.
    let o = run_ok(
        deny_io_uring(sidecar(
            &["bench", "write", "--dir", dir, "--size", "8MiB", "--shard-size", "3MiB", "--json"],
            &[],
        )),
        "bench write under seccomp",
    );
    let w = last_json(&o, "bench write under seccomp");
    assert_eq!(w["engine"], "thread-pool+O_DIRECT", "{w}");
    let o = run_ok(deny_io_uring(sidecar(&["verify", dir, "--json"], &[])), "verify under seccomp");
    assert_eq!(last_json(&o, "verify under seccomp")["ok"], true);
    let o = run_ok(deny_io_uring(sidecar(&["bench", "read", "--dir", dir, "--json"], &[])), "bench read under seccomp");
    let r = last_json(&o, "bench read under seccomp");
    assert_eq!(r["engine"], "thread-pool+O_DIRECT", "{r}");
    assert_eq!(r["step"], w["step"], "{r}");
    // And without the filter, whatever engine the machine gives reads it too.
    run_ok(sidecar(&["verify", dir], &[]), "verify without seccomp");

    // bench write with --uring on under the filter fails cleanly (exit 1, no leftovers).
    let e = tempfile::tempdir().unwrap();
    let o = output(deny_io_uring(sidecar(
        &["bench", "write", "--dir", p(e.path()), "--size", "1MiB", "--uring", "on"],
        &[],
    )));
    assert_eq!(o.status.code(), Some(1), "{}", describe(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("io_uring required but refused"), "{}", describe(&o));
    assert_eq!(std::fs::read_dir(e.path()).unwrap().count(), 0, "nothing written after the refusal");
}

#[cfg(not(target_arch = "x86_64"))]
#[test]
fn io_uring_refused_by_seccomp_falls_back_to_the_thread_pool() {
    println!("skipped: the seccomp filter here is written for x86_64 only");
}
