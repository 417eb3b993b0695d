//! Benchmarks of the storage engine (commands, not tests): write a synthetic
//! state through the real engine to a committed checkpoint, or read `latest`
//! back with verification, and print the figures, optionally beside fio's
//! sequential O_DIRECT figure for the same size in the same directory,
//! measured in the same run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::catalog;
use crate::commit::{Store, StoreOptions};
use crate::image::{Layout, LayoutOptions};
use crate::io::IoPolicy;
use crate::mem::{AlignedBuf, RawBuf};
use crate::restore::{self, ReadOptions, Which};
use crate::synthetic;

#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    pub op: &'static str,
    pub step: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub gib_per_s: f64,
    pub engine: String,
    pub n_files: usize,
    pub n_tensors: usize,
    /// CPU time of this process during the timed part, per GiB moved.
    pub cpu_user_s_per_gib: f64,
    pub cpu_sys_s_per_gib: f64,
    /// "pre-faulted": every buffer was allocated and touched before timing.
    pub memory: &'static str,
    /// Untimed preparation (building and checksumming the state, or
    /// allocating the read buffer).
    pub prepare_seconds: f64,
    pub fio_gib_per_s: Option<f64>,
    pub ratio_to_fio: Option<f64>,
}

/// GiB per second; a zero duration counts as a picosecond (never inf/NaN).
pub fn gib_per_s(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds.max(1e-12) / (1u64 << 30) as f64
}

struct Cpu {
    user_s: f64,
    sys_s: f64,
}

fn cpu_now() -> Cpu {
    // SAFETY: rusage is plain integers, for which all zeroes is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only fills the struct we pass, which outlives the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    Cpu { user_s: t(u.ru_utime), sys_s: t(u.ru_stime) }
}

pub struct WriteArgs {
    pub dirs: Vec<PathBuf>,
    pub size_bytes: u64,
    pub step: Option<u64>,
    pub io: IoPolicy,
    pub shard_bytes_max: u64,
    pub compare_fio: bool,
}

pub fn write(args: &WriteArgs) -> anyhow::Result<Figures> {
    let fio = if args.compare_fio { Some(fio_gib_per_s(&args.dirs[0], args.size_bytes, "write")?) } else { None };
    let t_prep = Instant::now();
    anyhow::ensure!(
        args.size_bytes > 0 && args.shard_bytes_max > 0,
        "bench write needs a size and a shard size of at least 1 byte"
    );
    // Memory first: a size this machine cannot hold fails before any
    // directory is created or locked.
    let specs = synthetic::transformer_specs(args.size_bytes);
    let layout = Layout::plan(
        specs,
        LayoutOptions { n_dirs: args.dirs.len(), shard_bytes_max: args.shard_bytes_max, ..Default::default() },
    )?;
    let mut staging = alloc(layout.staging_len, &format!("the state of --size {} bytes", args.size_bytes))?;
    staging.try_lock();
    let mut store = Store::open(StoreOptions {
        io: args.io,
        lock_role: "bench write".into(),
        ..StoreOptions::new(args.dirs.clone())
    })?;
    let step = match args.step {
        Some(s) => s,
        None => catalog::committed_steps(store.primary())?.last().map_or(1, |s| s + 1),
    };
    let crcs = synthetic::stage(&layout, staging.as_mut_slice(), step);
    // Registered: shared with the engines from now on, only its address used.
    let staging = Arc::new(RawBuf::from(staging));
    store.register_staging(&staging);
    let prepare_seconds = t_prep.elapsed().as_secs_f64();

    let cpu0 = cpu_now();
    let t0 = Instant::now();
    let report = store.commit(step, &layout, &*staging, &crcs, &[])?;
    let seconds = t0.elapsed().as_secs_f64();
    let cpu1 = cpu_now();
    let gib = report.bytes as f64 / (1u64 << 30) as f64;
    let ours = gib_per_s(report.bytes, seconds);
    Ok(Figures {
        op: "write",
        step,
        bytes: report.bytes,
        seconds,
        gib_per_s: ours,
        engine: store.engine_names(),
        n_files: layout.shards.len(),
        n_tensors: layout.specs.len(),
        cpu_user_s_per_gib: (cpu1.user_s - cpu0.user_s) / gib,
        cpu_sys_s_per_gib: (cpu1.sys_s - cpu0.sys_s) / gib,
        memory: "pre-faulted",
        prepare_seconds,
        fio_gib_per_s: fio,
        ratio_to_fio: fio.map(|f| ours / f),
    })
}

pub struct ReadArgs {
    pub dir: PathBuf,
    pub io: IoPolicy,
    pub compare_fio: bool,
}

pub fn read(args: &ReadArgs) -> anyhow::Result<Figures> {
    // `latest`, else (missing, or naming no committed step) the newest, as a load picks.
    let newest = || catalog::committed_steps(&args.dir).map(|s| s.last().copied());
    let step = match catalog::latest_step(&args.dir)? {
        Some(s) => s,
        None => newest()?.ok_or_else(|| anyhow::anyhow!("{}: no committed checkpoint to read", args.dir.display()))?,
    };
    let index = restore::read_index(&args.dir, step)?;
    let file_bytes: u64 = index.ckpt.files.iter().map(|f| f.len_bytes).sum();
    let fio = if args.compare_fio { Some(fio_gib_per_s(&args.dir, file_bytes, "read")?) } else { None };
    let t_prep = Instant::now();
    let buf = alloc(restore::load_len_bytes(&index), &format!("the read buffer of step {step}"))?;
    buf.try_lock();
    let prepare_seconds = t_prep.elapsed().as_secs_f64();
    let cpu0 = cpu_now();
    let t0 = Instant::now();
    let loaded =
        restore::load(&args.dir, Which::Step(step), &ReadOptions { io: args.io, ..Default::default() }, Some(buf))?;
    let seconds = t0.elapsed().as_secs_f64();
    let cpu1 = cpu_now();
    let gib = loaded.bytes as f64 / (1u64 << 30) as f64;
    let ours = gib_per_s(loaded.bytes, seconds);
    Ok(Figures {
        op: "read",
        step,
        bytes: loaded.bytes,
        seconds,
        gib_per_s: ours,
        engine: loaded.engine.clone(),
        n_files: loaded.index.ckpt.files.len(),
        n_tensors: loaded.index.ckpt.tensors.len(),
        cpu_user_s_per_gib: (cpu1.user_s - cpu0.user_s) / gib,
        cpu_sys_s_per_gib: (cpu1.sys_s - cpu0.sys_s) / gib,
        memory: "pre-faulted",
        prepare_seconds,
        fio_gib_per_s: fio,
        ratio_to_fio: fio.map(|f| ours / f),
    })
}

/// Pre-faulted memory of `len` bytes for a benchmark; the error names the
/// size and what it was for.
fn alloc(len: u64, what: &str) -> anyhow::Result<AlignedBuf> {
    let n = usize::try_from(len).map_err(|_| {
        anyhow::anyhow!("cannot allocate {} for {what}: too large for this machine", crate::units::human_bytes(len))
    })?;
    AlignedBuf::new(n)
        .map_err(|e| anyhow::anyhow!("cannot allocate {} for {what}: {e}", crate::units::human_bytes(len)))
}

/// fio's sequential O_DIRECT throughput for `size_bytes` in `dir`, with the
/// flags the bars name (bs 4M, io_uring, iodepth 16, end_fsync); for reads the
/// file is written first. The scratch file is removed afterwards.
pub fn fio_gib_per_s(dir: &Path, size_bytes: u64, rw: &str) -> anyhow::Result<f64> {
    let f = dir.join(format!(".fio-baseline-{}", std::process::id()));
    let size = format!("{}", crate::config::align_up(size_bytes, 4 << 20));
    let base = |name: &str, rw: &str| {
        let mut c = Command::new("fio");
        c.args([
            &format!("--name={name}"),
            &format!("--filename={}", f.display()),
            &format!("--rw={rw}"),
            "--bs=4M",
            &format!("--size={size}"),
            "--ioengine=io_uring",
            "--direct=1",
            "--iodepth=16",
            "--end_fsync=1",
            "--output-format=json",
        ]);
        c
    };
    let run = |mut c: Command| -> anyhow::Result<serde_json::Value> {
        let out = c.output().map_err(|e| anyhow::anyhow!("running fio (apt-get install fio): {e}"))?;
        anyhow::ensure!(out.status.success(), "fio failed: {}", String::from_utf8_lossy(&out.stderr));
        // fio may print notes before the JSON object.
        let s = String::from_utf8_lossy(&out.stdout);
        let j = s.find('{').ok_or_else(|| anyhow::anyhow!("fio printed no JSON"))?;
        Ok(serde_json::from_str(&s[j..])?)
    };
    let result = (|| {
        if rw == "read" {
            run(base("prep", "write"))?;
        }
        let j = run(base("limit", rw))?;
        let bw = j["jobs"][0][rw]["bw_bytes"]
            .as_f64()
            .ok_or_else(|| anyhow::anyhow!("fio JSON without jobs[0].{rw}.bw_bytes"))?;
        Ok(bw / (1u64 << 30) as f64)
    })();
    let _ = std::fs::remove_file(&f);
    result
}
