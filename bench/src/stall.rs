//! `bench stall`: the trainer's stall per save, measured end to end with a
//! real client (the `ckpt-shim` Rust API, the same code as libckpt) against
//! a real sidecar process (this binary's `serve`, spawned on a private
//! socket), beside one single-threaded memcpy of the same bytes measured in
//! the same run. Also the persist throughput (from Durable), fio's figure
//! for the same size in the same directory (`--compare-fio`), the sidecar's
//! resident memory during the saves, and optionally torch.save + fsync of a
//! state of the same size (`--python`).
//!
//! Memory: the client's region, the memcpy buffers and the sidecar's
//! staging are allocated and touched before anything is timed (the sidecar
//! pre-faults its staging at start and maps the region with MAP_POPULATE at
//! registration). Committed checkpoints stay in DIR; steps continue after
//! the newest one there.

use std::fs::File;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context};
use ckpt_client::{Client, TensorRef, Wanted};
use serde::Serialize;

use ckpt_store::bench;
use ckpt_store::catalog;
use ckpt_store::config;
use ckpt_store::image::{Layout, LayoutOptions, TensorSpec};
use ckpt_store::mem::AlignedBuf;
use ckpt_store::restore;
use ckpt_store::synthetic;

/// How long the sidecar may take to start (it pre-faults its staging, about
/// 2.2 s per GiB of fresh memory on our VMs).
const START_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest a single save may take to be released or made durable.
const SAVE_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest the sidecar may take to drain after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(120);
/// Interval of the sidecar memory sampler.
const RSS_SAMPLE_EVERY: Duration = Duration::from_millis(5);
/// Tensors start at multiples of this in the client's region.
const REGION_ALIGN_BYTES: usize = 4096;
/// The region is filled through a scratch buffer of this size.
const FILL_CHUNK_BYTES: usize = 4 << 20;
/// memcpy is measured at least this many times.
const MEMCPY_RUNS_MIN: usize = 5;
/// torch.save is measured at most this many times (each writes SIZE).
const TORCH_RUNS_MAX: usize = 3;
/// The bars of the issue, printed beside the figures (not asserted).
pub const BAR_STALL_OVER_MEMCPY: f64 = 1.25;
pub const BAR_PERSIST_OVER_FIO: f64 = 0.9;
pub const BAR_RSS_OVER_STAGING_BYTES: u64 = 64 << 20;

pub struct StallArgs {
    pub dir: PathBuf,
    pub size_bytes: u64,
    pub python: Option<PathBuf>,
    /// None: room for two images of SIZE (one being written, one resident
    /// or being copied).
    pub staging_bytes: Option<u64>,
    pub repeats: usize,
    pub compare_fio: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct StallFigures {
    pub op: &'static str,
    /// Tensor bytes saved per step (what the stall copies and memcpy copies).
    pub bytes: u64,
    /// Bytes of the checkpoint's files on disk (what persist writes).
    pub file_bytes: u64,
    pub n_tensors: usize,
    pub steps: Vec<u64>,
    pub stall_seconds: Vec<f64>,
    pub stall_seconds_median: f64,
    pub stall_seconds_max: f64,
    /// The sidecar's own copy time, from Released (stall minus this is the
    /// request, planning, staging lease and reply round trip).
    pub copy_seconds: Vec<f64>,
    pub copy_seconds_median: f64,
    pub memcpy_seconds: Vec<f64>,
    pub memcpy_seconds_median: f64,
    pub stall_over_memcpy: f64,
    pub persist_seconds: Vec<f64>,
    pub persist_gib_per_s: f64,
    /// Client-side time from Released to Durable (the sidecar's checksums,
    /// queueing and persist), median.
    pub release_to_durable_seconds_median: f64,
    pub fio_gib_per_s: Option<f64>,
    pub persist_over_fio: Option<f64>,
    pub sidecar_pid: u32,
    /// Max VmRSS while saving; counts the client's region, which the sidecar
    /// maps read-only (shared memory, RssShmem).
    pub sidecar_rss_bytes: u64,
    /// Max RssAnon while saving: the sidecar's own memory (staging included).
    pub sidecar_rss_anon_bytes: u64,
    pub sidecar_rss_file_bytes: u64,
    pub sidecar_rss_shmem_bytes: u64,
    /// VmHWM at the end of the saves (peak VmRSS since start).
    pub sidecar_vm_hwm_bytes: u64,
    pub staging_bytes: u64,
    pub torch_save_seconds: Option<f64>,
    /// Why there is no torch figure, or which torch gave it.
    pub torch_note: Option<String>,
    /// "pre-faulted": every buffer was allocated and touched before timing.
    pub memory: &'static str,
    /// Untimed preparation: sidecar start, region allocation and fill.
    pub prepare_seconds: f64,
}

pub fn median(v: &[f64]) -> f64 {
    assert!(!v.is_empty(), "median of nothing");
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The image the sidecar will plan for the synthetic state (serve's defaults:
/// one directory, 1 GiB shards).
fn plan(size_bytes: u64) -> anyhow::Result<Layout> {
    Ok(Layout::plan(synthetic::transformer_specs(size_bytes), LayoutOptions::default())?)
}

/// Where each tensor of `specs` lies in the client's region; the region's length.
fn region_offsets(layout: &Layout) -> (Vec<u64>, u64) {
    let mut at = 0u64;
    let offsets = (0..layout.specs.len())
        .map(|i| {
            let off = at;
            at = config::align_up(at + layout.tensor_range(i).len() as u64, REGION_ALIGN_BYTES);
            off
        })
        .collect();
    (offsets, at.max(REGION_ALIGN_BYTES as u64))
}

/// A sidecar process of this binary, stopped (SIGTERM, drained) by
/// [`Sidecar::stop`], killed on drop otherwise; its socket directory is
/// removed either way.
pub(crate) struct Sidecar {
    child: Option<Child>,
    sock_dir: PathBuf,
    socket: PathBuf,
    log: Option<PathBuf>,
}

impl Sidecar {
    /// `serve` with `--incremental off`: this benchmark measures the write
    /// path, and its state changes little between saves (incremental saves
    /// would link most of it: `bench incremental` measures that).
    fn spawn(dir: &Path, staging_bytes: u64) -> anyhow::Result<Sidecar> {
        Sidecar::spawn_with(dir, staging_bytes, &["--incremental", "off"])
    }

    /// `serve` on DIR with this staging budget and these extra options.
    pub(crate) fn spawn_with(dir: &Path, staging_bytes: u64, extra: &[&str]) -> anyhow::Result<Sidecar> {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let sock_dir = std::env::temp_dir().join(format!("ckpt-bench-stall-{}-{nanos:08x}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&sock_dir)
            .with_context(|| format!("creating {}", sock_dir.display()))?;
        let socket = sock_dir.join("sidecar.sock");
        // The sidecar's log goes to the terminal when asked for
        // (CKPT_SIDECAR_LOG), else to a file shown if something fails.
        let (stderr, log) = if std::env::var_os("CKPT_SIDECAR_LOG").is_some() {
            (Stdio::inherit(), None)
        } else {
            let p = sock_dir.join("sidecar.log");
            (Stdio::from(File::create(&p).with_context(|| format!("creating {}", p.display()))?), Some(p))
        };
        let exe = sidecar_exe()?;
        let mut sc = Sidecar { child: None, sock_dir, socket, log };
        let child = Command::new(exe)
            .arg("serve")
            .arg("--dir")
            .arg(dir)
            .arg("--socket")
            .arg(&sc.socket)
            .arg("--staging")
            .arg(staging_bytes.to_string())
            .args(extra)
            // The sidecar must never act as a client of another sidecar.
            .env_remove("CKPT_SIDECAR_PRELOAD")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .context("starting the sidecar (serve)")?;
        sc.child = Some(child);
        Ok(sc)
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub(crate) fn log_tail(&self) -> String {
        let Some(p) = &self.log else { return String::new() };
        let s = std::fs::read_to_string(p).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        if tail.is_empty() {
            String::new()
        } else {
            format!("\nsidecar log (last lines):\n{tail}")
        }
    }

    /// Connects once the sidecar accepts (it allocates its staging first).
    pub(crate) fn connect(&mut self) -> anyhow::Result<Client> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.as_mut().expect("running").try_wait()? {
                bail!("the sidecar exited before accepting ({st}){}", self.log_tail());
            }
            if self.socket.exists() {
                match Client::connect(Some(&self.socket)) {
                    Ok(c) => return Ok(c),
                    Err(e) if t0.elapsed() > START_TIMEOUT => {
                        bail!("the sidecar did not accept within {START_TIMEOUT:?}: {e}{}", self.log_tail())
                    }
                    Err(_) => {}
                }
            } else if t0.elapsed() > START_TIMEOUT {
                bail!(
                    "the sidecar did not create {} within {START_TIMEOUT:?}{}",
                    self.socket.display(),
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then waits for it to drain and exit; its status must be 0.
    pub(crate) fn stop(mut self) -> anyhow::Result<()> {
        let mut child = self.child.take().expect("running");
        // SAFETY: signalling our own child, which has not been reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let t0 = Instant::now();
        let st = loop {
            if let Some(st) = child.try_wait()? {
                break st;
            }
            if t0.elapsed() > STOP_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the sidecar did not exit within {STOP_TIMEOUT:?} of SIGTERM{}", self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        ensure!(st.success(), "the sidecar exited with {st} after SIGTERM{}", self.log_tail());
        Ok(())
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.sock_dir);
    }
}

/// Maxima of a process's memory figures (bytes) from /proc/<pid>/status.
#[derive(Debug, Default, Clone, Copy)]
struct Rss {
    vm_rss: u64,
    rss_anon: u64,
    rss_file: u64,
    rss_shmem: u64,
    vm_hwm: u64,
}

fn read_rss(pid: u32) -> Option<Rss> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let mut r = Rss::default();
    for l in s.lines() {
        let mut it = l.split_whitespace();
        let (Some(k), Some(v)) = (it.next(), it.next()) else { continue };
        let Ok(kib) = v.parse::<u64>() else { continue };
        let b = kib * 1024;
        match k {
            "VmRSS:" => r.vm_rss = b,
            "RssAnon:" => r.rss_anon = b,
            "RssFile:" => r.rss_file = b,
            "RssShmem:" => r.rss_shmem = b,
            "VmHWM:" => r.vm_hwm = b,
            _ => {}
        }
    }
    Some(r)
}

/// Samples a process's memory every few milliseconds until stopped; keeps
/// each figure's maximum.
struct RssSampler {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Rss>,
}

impl RssSampler {
    fn start(pid: u32) -> anyhow::Result<RssSampler> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::Builder::new().name("ckpt-bench-rss".into()).spawn(move || {
            let mut max = Rss::default();
            loop {
                if let Some(r) = read_rss(pid) {
                    max.vm_rss = max.vm_rss.max(r.vm_rss);
                    max.rss_anon = max.rss_anon.max(r.rss_anon);
                    max.rss_file = max.rss_file.max(r.rss_file);
                    max.rss_shmem = max.rss_shmem.max(r.rss_shmem);
                    max.vm_hwm = max.vm_hwm.max(r.vm_hwm);
                }
                if s.load(Ordering::Relaxed) {
                    return max;
                }
                std::thread::sleep(RSS_SAMPLE_EVERY);
            }
        })?;
        Ok(RssSampler { stop, handle })
    }

    fn finish(self) -> Rss {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().expect("rss sampler panicked")
    }
}

/// One single-threaded memcpy of `n` bytes from `src` to `dst` (both
/// pre-faulted), timed.
fn time_memcpy(src: &AlignedBuf, dst: &mut AlignedBuf, n: usize) -> f64 {
    let t0 = Instant::now();
    dst.as_mut_slice()[..n].copy_from_slice(&src.as_slice()[..n]);
    let s = t0.elapsed().as_secs_f64();
    std::hint::black_box(&dst.as_slice()[n / 2]);
    s
}

/// The sidecar binary to measure: `$CKPT_SIDECAR_BIN`, else the
/// `ckpt-sidecar` beside this executable (both are built into one folder).
pub fn sidecar_exe() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("CKPT_SIDECAR_BIN") {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe().context("finding this executable")?;
    let exe = me.with_file_name("ckpt-sidecar");
    ensure!(exe.is_file(), "no ckpt-sidecar beside {} (build the workspace, or set CKPT_SIDECAR_BIN)", me.display());
    Ok(exe)
}

pub fn run(args: &StallArgs) -> anyhow::Result<StallFigures> {
    ensure!(args.repeats >= 1, "--repeats must be at least 1");
    ensure!(args.size_bytes > 0, "--size must be positive");
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let layout = plan(args.size_bytes)?;
    let tensor_bytes = layout.tensor_bytes();
    let image_bytes = config::align_up(layout.staging_len, config::DIRECT_ALIGN_BYTES);
    let staging_bytes = args.staging_bytes.unwrap_or_else(|| config::align_up(2 * image_bytes, 1 << 20));
    ensure!(
        staging_bytes >= image_bytes,
        "--staging {staging_bytes} is smaller than one image of this state ({image_bytes} bytes); saves would be refused"
    );
    let fio =
        if args.compare_fio { Some(bench::fio_gib_per_s(&args.dir, layout.file_bytes(), "write")?) } else { None };

    let t_prep = Instant::now();
    // memcpy buffers, pre-faulted (MAP_POPULATE) and the source filled.
    let n = tensor_bytes as usize;
    let mut mc_src = AlignedBuf::new(n)?;
    let mut mc_dst = AlignedBuf::new(n)?;
    synthetic::fill(mc_src.as_mut_slice(), 0x5eed);
    mc_dst.as_mut_slice().fill(1);

    let first_step = catalog::committed_steps(&args.dir)?.last().map_or(1, |s| s + 1);
    let mut sc = Sidecar::spawn(&args.dir, staging_bytes)?;
    let result = (|| -> anyhow::Result<StallFigures> {
        let client = sc.connect()?;
        let staging_actual = client.server_info().map_or(staging_bytes, |i| i.staging_bytes);
        let (offsets, region_len) = region_offsets(&layout);
        let region = client.alloc_region(region_len)?;
        // Fill every tensor with non-constant bytes (this touches every page).
        let mut scratch = vec![0u8; FILL_CHUNK_BYTES];
        for (i, &off) in offsets.iter().enumerate() {
            let len = layout.tensor_range(i).len();
            let mut at = 0usize;
            while at < len {
                let k = (len - at).min(FILL_CHUNK_BYTES);
                synthetic::fill(&mut scratch[..k], ((i as u64) << 32) ^ at as u64);
                region.write_at(off + at as u64, &scratch[..k]).map_err(|e| anyhow!(e))?;
                at += k;
            }
        }
        let dtypes: Vec<&str> = layout.specs.iter().map(|s| s.dtype.as_str()).collect();
        let refs: Vec<TensorRef> = layout
            .specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                TensorRef::in_region(
                    &s.name,
                    dtypes[i],
                    &s.shape,
                    &region,
                    offsets[i],
                    layout.tensor_range(i).len() as u64,
                )
            })
            .collect();
        let step_idx = layout.specs.iter().position(|s| s.name == "train.step");
        // A warm-up memcpy (first touch of the code path, TLB).
        time_memcpy(&mc_src, &mut mc_dst, n);
        let prepare_seconds = t_prep.elapsed().as_secs_f64();

        let sampler = RssSampler::start(sc.pid())?;
        let mut memcpy_seconds = Vec::new();
        let mut stall_seconds = Vec::new();
        let mut copy_seconds = Vec::new();
        let mut persist_seconds = Vec::new();
        let mut release_to_durable = Vec::new();
        let mut steps = Vec::new();
        let mut file_bytes = 0u64;
        for k in 0..args.repeats {
            let step = first_step + k as u64;
            // Change a little, as a training step would between checkpoints.
            if let Some(i) = step_idx {
                region.write_at(offsets[i], &(step as i64).to_le_bytes()).map_err(|e| anyhow!(e))?;
            }
            let len0 = layout.tensor_range(0).len();
            let page = [step as u8; 4096];
            let at = (step as usize * 4096 * 7) % len0.saturating_sub(4096).max(1);
            region.write_at(offsets[0] + at as u64, &page[..len0.min(4096)]).map_err(|e| anyhow!(e))?;
            memcpy_seconds.push(time_memcpy(&mc_src, &mut mc_dst, n));

            let t0 = Instant::now();
            let h = client.save(step, &refs, &[])?;
            let released = client.wait(h.id, Wanted::Released, Some(SAVE_TIMEOUT))?;
            let stall = t0.elapsed().as_secs_f64();
            let durable = client.wait(h.id, Wanted::Durable, Some(SAVE_TIMEOUT))?;
            release_to_durable.push(t0.elapsed().as_secs_f64() - stall);
            stall_seconds.push(stall);
            copy_seconds.push(released.copy_seconds.unwrap_or(f64::NAN));
            persist_seconds
                .push(durable.persist_seconds.ok_or_else(|| anyhow!("step {step}: Durable without persist_seconds"))?);
            let index = restore::read_index(&args.dir, step)?;
            file_bytes = index.ckpt.files.iter().map(|f| f.len_bytes).sum();
            steps.push(step);
        }
        while memcpy_seconds.len() < MEMCPY_RUNS_MIN {
            memcpy_seconds.push(time_memcpy(&mc_src, &mut mc_dst, n));
        }
        let rss = sampler.finish();
        drop(refs);
        client.close();
        drop(region);

        let stall_median = median(&stall_seconds);
        let memcpy_median = median(&memcpy_seconds);
        let persist_rates: Vec<f64> = persist_seconds.iter().map(|&s| bench::gib_per_s(file_bytes, s)).collect();
        let persist = median(&persist_rates);
        Ok(StallFigures {
            op: "stall",
            bytes: tensor_bytes,
            file_bytes,
            n_tensors: layout.specs.len(),
            steps,
            stall_seconds_median: stall_median,
            stall_seconds_max: stall_seconds.iter().copied().fold(0.0, f64::max),
            stall_seconds,
            copy_seconds_median: median(&copy_seconds),
            copy_seconds,
            memcpy_seconds_median: memcpy_median,
            memcpy_seconds,
            stall_over_memcpy: stall_median / memcpy_median,
            persist_seconds,
            persist_gib_per_s: persist,
            release_to_durable_seconds_median: median(&release_to_durable),
            fio_gib_per_s: fio,
            persist_over_fio: fio.map(|f| persist / f),
            sidecar_pid: sc.pid(),
            sidecar_rss_bytes: rss.vm_rss,
            sidecar_rss_anon_bytes: rss.rss_anon,
            sidecar_rss_file_bytes: rss.rss_file,
            sidecar_rss_shmem_bytes: rss.rss_shmem,
            sidecar_vm_hwm_bytes: rss.vm_hwm,
            staging_bytes: staging_actual,
            torch_save_seconds: None,
            torch_note: None,
            memory: "pre-faulted",
            prepare_seconds,
        })
    })();
    let mut figures = match result {
        Ok(f) => f,
        Err(e) => return Err(anyhow!("{e:#}{}", sc.log_tail())),
    };
    sc.stop()?;
    drop((mc_src, mc_dst));
    if let Some(py) = &args.python {
        match torch_save_seconds(py, &args.dir, &layout.specs, args.repeats.min(TORCH_RUNS_MAX)) {
            Ok((s, note)) => {
                figures.torch_save_seconds = Some(s);
                figures.torch_note = Some(note);
            }
            Err(e) => figures.torch_note = Some(format!("{e:#}")),
        }
    }
    Ok(figures)
}

/// Builds a state dict of torch tensors with these specs in `py`, then
/// times `torch.save(state, path)` + `os.fsync` in `dir`, `runs` times;
/// returns the median and which torch it was. An error says why not (torch
/// not importable, python missing).
const TORCH_SCRIPT: &str = r#"
import json, os, sys, time
try:
    import torch
except Exception as e:
    print(json.dumps({"error": "torch is not importable with " + sys.executable + ": " + repr(e)}))
    sys.exit(0)
specs = json.loads(sys.stdin.read())
path, runs = sys.argv[1], int(sys.argv[2])
dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
      "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
g = torch.Generator().manual_seed(0)
state = {}
for name, dtype, shape in specs:
    t = torch.empty(shape, dtype=dt[dtype])
    if t.is_floating_point():
        t.uniform_(-1.0, 1.0, generator=g)
    else:
        t.random_(0, 1 << 20, generator=g)
    state[name] = t
nbytes = sum(t.numel() * t.element_size() for t in state.values())
times = []
for _ in range(runs):
    if os.path.exists(path):
        os.remove(path)
    t0 = time.perf_counter()
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    times.append(time.perf_counter() - t0)
    os.remove(path)
print(json.dumps({"seconds": times, "torch": torch.__version__, "bytes": nbytes}))
"#;

fn torch_save_seconds(py: &Path, dir: &Path, specs: &[TensorSpec], runs: usize) -> anyhow::Result<(f64, String)> {
    let spec_json: Vec<serde_json::Value> =
        specs.iter().map(|s| serde_json::json!([s.name, s.dtype.as_str(), s.shape])).collect();
    let path = dir.join(format!(".torch-save-bench-{}.pt", std::process::id()));
    // The specs go in through a file, not a pipe: this process dies of
    // SIGPIPE on a closed pipe (its stdout's rule), and a Python that exits
    // at once (not there, no torch) closes its stdin unread.
    let specs_path = dir.join(format!(".torch-save-bench-{}.json", std::process::id()));
    std::fs::write(&specs_path, serde_json::to_string(&spec_json)?)
        .with_context(|| format!("writing {}", specs_path.display()))?;
    let specs_file = std::fs::File::open(&specs_path).with_context(|| format!("opening {}", specs_path.display()));
    let _ = std::fs::remove_file(&specs_path);
    let child = Command::new(py)
        .arg("-c")
        .arg(TORCH_SCRIPT)
        .arg(&path)
        .arg(runs.max(1).to_string())
        .stdin(Stdio::from(specs_file?))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", py.display()))?;
    let out = child.wait_with_output()?;
    let _ = std::fs::remove_file(&path);
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{} failed ({}): {}",
        py.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let last = stdout.lines().last().ok_or_else(|| anyhow!("{} printed nothing", py.display()))?;
    let j: serde_json::Value =
        serde_json::from_str(last).with_context(|| format!("{} printed {last:?}", py.display()))?;
    if let Some(e) = j["error"].as_str() {
        bail!("{e}");
    }
    let times: Vec<f64> = j["seconds"]
        .as_array()
        .ok_or_else(|| anyhow!("no seconds in {last}"))?
        .iter()
        .filter_map(|v| v.as_f64())
        .collect();
    ensure!(!times.is_empty(), "no times in {last}");
    Ok((
        median(&times),
        format!(
            "torch {} ({}), {} bytes, {} run(s), median",
            j["torch"].as_str().unwrap_or("?"),
            py.display(),
            j["bytes"],
            times.len()
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn region_offsets_are_aligned_and_disjoint() {
        let l = plan(4 << 20).unwrap();
        let (offs, len) = region_offsets(&l);
        for (i, &o) in offs.iter().enumerate() {
            assert_eq!(o % REGION_ALIGN_BYTES as u64, 0);
            assert!(o + l.tensor_range(i).len() as u64 <= len);
            if i + 1 < offs.len() {
                assert!(o + l.tensor_range(i).len() as u64 <= offs[i + 1]);
            }
        }
    }
}
