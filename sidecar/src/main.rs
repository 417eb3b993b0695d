//! The `ckpt-sidecar` binary: the command line over the library. Only this
//! file uses `anyhow`; it maps outcomes to exit codes:
//! 0 success, 1 error, 2 usage, 3 `verify` found damage; a tool whose
//! stdout is closed (`| head`) ends quietly by SIGPIPE (141 in a shell).
//! Every error is one line on stderr, each cause said once.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use serde_json::json;

use ckpt_sidecar::config;
use ckpt_sidecar::daemon::{self, DaemonOptions};
use ckpt_store::bench;
use ckpt_store::catalog;
use ckpt_store::commit::{Store, StoreError, StoreOptions};
use ckpt_store::format::STEP_MAX;
use ckpt_store::format::{self, Dtype};
use ckpt_store::image::{Blob, Layout, LayoutOptions, TensorSpec};
use ckpt_store::io::{self as eio, IoPolicy, Want};
use ckpt_store::lock::LockError;
use ckpt_store::mem::AlignedBuf;
use ckpt_store::restore::{self, ReadOptions};
use ckpt_store::retention::{self, Retention};
use ckpt_store::synthetic;
use ckpt_store::units::{human_bytes, parse_size};

mod cli;

const EXIT_DAMAGED: u8 = 3;
const EXIT_USAGE: u8 = 2;

/// A size that must be at least one byte (`--size`, `--shard-size`, `--staging`).
fn parse_nonzero_size(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err(format!("size {s:?} must be at least 1 byte")),
        n => Ok(n),
    }
}

/// A checkpoint step: 0 to the largest step a folder name holds.
fn parse_step(s: &str) -> Result<u64, String> {
    let n: u64 = s.trim().parse().map_err(|_| format!("step {s:?} is not a whole number from 0 to {STEP_MAX}"))?;
    if n > STEP_MAX {
        return Err(format!("step {n} is above the largest step {STEP_MAX}"));
    }
    Ok(n)
}

/// A count that must be at least 1 (`--keep`, `--keep-every`).
fn parse_positive(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err(format!("{s:?} must be at least 1")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}

fn parse_node_id(s: &str) -> Result<String, String> {
    ckpt_store::format::validate_node_id(s).map(|()| s.to_string()).map_err(|e| e.to_string())
}

/// The default node id: this host's name, as far as it is a valid one
/// (`--node-id` otherwise).
fn host_node_id() -> anyhow::Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        bail!("--node-local: cannot read the host name ({}); give --node-id NAME", std::io::Error::last_os_error());
    }
    let name = String::from_utf8_lossy(buf.split(|&b| b == 0).next().unwrap_or_default()).into_owned();
    ckpt_store::format::validate_node_id(&name)
        .map_err(|e| anyhow::anyhow!("--node-local: the host name is no valid node id ({e}); give --node-id NAME"))?;
    Ok(name)
}

fn parse_keep(s: &str) -> Result<usize, String> {
    parse_positive(s)
        .map(|n| n.min(usize::MAX as u64) as usize)
        .map_err(|e| format!("{e} (the newest checkpoint is never deleted)"))
}

#[derive(Parser)]
#[command(name = "ckpt-sidecar", version, about = "Checkpoint sidecar for deep-learning training")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// I/O engine choices, also settable as CKPT_SIDECAR_URING / CKPT_SIDECAR_DIRECT.
#[derive(Args, Clone, Copy)]
struct IoArgs {
    /// Use io_uring: auto (if the kernel allows), on (or fail), off (thread pool).
    #[arg(long, default_value = "auto", value_parser = parse_want)]
    uring: Want,
    /// Use O_DIRECT: auto (if the file system allows), on (or fail), off (buffered + fdatasync).
    #[arg(long, default_value = "auto", value_parser = parse_want)]
    direct: Want,
    /// Requests in flight per directory.
    #[arg(long, default_value_t = config::QUEUE_DEPTH_DEFAULT,
          value_parser = clap::value_parser!(u32).range(config::QUEUE_DEPTH_MIN as i64..=config::QUEUE_DEPTH_MAX as i64))]
    queue_depth: u32,
}

impl IoArgs {
    fn policy(self) -> IoPolicy {
        IoPolicy { uring: self.uring, direct: self.direct, queue_depth: self.queue_depth }
    }
}

fn parse_want(s: &str) -> Result<Want, String> {
    s.parse()
}

/// CPU numbers, sorted, without repeats.
#[derive(Debug, Clone)]
struct CpuList(Vec<usize>);

/// A CPU list as in /proc and taskset: `0`, `1,3`, `2-7,12`.
fn parse_cpus(s: &str) -> Result<CpuList, String> {
    let bad = || format!("{s:?} is not a CPU list like 1 or 2-7,12");
    let mut out = Vec::new();
    for part in s.split(',') {
        let (a, b) = part.trim().split_once('-').unwrap_or((part.trim(), part.trim()));
        let (a, b): (usize, usize) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
        if a > b || b >= 1 << 16 {
            return Err(bad());
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(CpuList(out))
}

/// Options of the daemon (serve and launch).
#[derive(Args, Clone)]
struct DaemonArgs {
    /// Target directory; repeat for several disks (the first is the primary).
    #[arg(long = "dir", required = true)]
    dirs: Vec<PathBuf>,
    /// Socket path (default: $CKPT_SIDECAR_SOCKET, else
    /// $XDG_RUNTIME_DIR/ckpt-sidecar/sidecar.sock, else
    /// /tmp/ckpt-sidecar-<uid>/sidecar.sock; launch: a private temp dir).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Staging memory budget, allocated at start (default: a quarter of RAM, at most 8 GiB).
    #[arg(long, value_parser = parse_nonzero_size)]
    staging: Option<u64>,
    /// Keep only the newest N committed checkpoints (default: keep all).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_keep)]
    keep: Option<usize>,
    /// With --keep, also keep every step that is a multiple of K.
    #[arg(long, requires = "keep", allow_negative_numbers = true, value_parser = parse_positive)]
    keep_every: Option<u64>,
    /// Also accept clients of this uid (repeatable); default: only our own uid.
    #[arg(long = "allow-uid")]
    allow_uids: Vec<u32>,
    /// Largest shard file (a larger tensor gets a shard of its own).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "1GiB")]
    shard_size: u64,
    /// Run the sidecar's threads on these CPUs only, e.g. `1` or `2-7,12`
    /// (keeps them off a trainer's cores on a small machine); launch's
    /// command keeps the CPUs it would have had.
    #[arg(long, value_parser = parse_cpus)]
    cpus: Option<CpuList>,
    /// Several nodes: the directory every node's sidecar sees (a shared file
    /// system), where the ranks' parts of a step (SavePart) are written and
    /// committed together; --dir stays this node's own. The sidecar serving
    /// rank 0 coordinates each step's commit. It must exist (never made: a
    /// missing one is likely a shared file system not mounted here).
    #[arg(long)]
    shared: Option<PathBuf>,
    /// With --shared: each node's ranks' shards go to this node's own
    /// --dir(s) (striped over them as a one-node save), in `node-step-…` folders; only
    /// blobs, markers and the index go to the shared directory, and the
    /// index names the node holding each file. A node's ranks load their
    /// own node's files from its disks; another node's files need a drain
    /// target (docs/guide.md, "Several nodes"). --shared with --drain
    /// implies it (each node drains its own files).
    #[arg(long, requires = "shared")]
    node_local: bool,
    /// This node's id in the index (with --node-local, or --shared and
    /// --drain): letters, digits, '.', '_', '-' (default: the host name).
    #[arg(long, requires = "shared", value_name = "NAME", value_parser = parse_node_id)]
    node_id: Option<String>,
    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics,
    /// e.g. 127.0.0.1:9464 (docs/metrics.md); port 0 picks a free one (logged).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// Serve loads (and ls, status) only: take no directory lock, run no
    /// recovery, refuse saves and rollback. A directory whose lock file
    /// cannot be written (a read-only file system, no write permission) is
    /// served so without this flag too, as the log says at start.
    #[arg(long)]
    read_only: bool,
    /// Drain every committed step to this target after it is durable:
    /// file:///abs/path (a shared file system) or an object store
    /// (s3://bucket/prefix; gs://, az:// as object_store gives them),
    /// credentials from the standard environment (AWS_ACCESS_KEY_ID, ...,
    /// AWS_ENDPOINT_URL, AWS_ALLOW_HTTP). Checked at start: a wrong
    /// credential or an unreachable URL stops the sidecar. Loads read a
    /// step that is not local (or newer there) from it.
    #[arg(long, value_name = "URL")]
    drain: Option<String>,
    /// With --drain, drain every K-th step only (multiples of K).
    #[arg(long, requires = "drain", value_name = "K", allow_negative_numbers = true, value_parser = parse_positive, default_value_t = 1)]
    drain_every: u64,
    /// With --drain, keep only the newest N steps on the drain target.
    #[arg(long, requires = "drain", value_name = "N", allow_negative_numbers = true, value_parser = parse_keep)]
    drain_keep: Option<usize>,
    /// With --drain, upload at most SIZE per second (e.g. 500MB/s, 1GiB/s),
    /// so the next save's local writes are not starved.
    #[arg(long, requires = "drain", value_name = "SIZE/s", value_parser = parse_bandwidth)]
    drain_bandwidth: Option<u64>,
    /// Incremental checkpoints: on (default) takes a 128-bit digest of every
    /// tensor during the copy and hard-links, instead of writing, each
    /// stable shard whose tensors are unchanged since the newest committed
    /// step (docs/format.md, "Incremental checkpoints"); off writes every
    /// step in full and records no digests.
    #[arg(long, default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set, value_name = "on|off")]
    incremental: bool,
    /// With --incremental on, every K-th save is written in full (nothing
    /// linked), so a file is shared by at most K consecutive steps and one
    /// damaged file damages at most those; 0: never (default: 10).
    #[arg(long, default_value_t = ckpt_store::config::FULL_EVERY_DEFAULT, value_name = "K")]
    full_every: u32,
    #[command(flatten)]
    io: IoArgs,
}

/// A bandwidth: a size (as everywhere, KB = 1000, KiB = 1024) per second,
/// with or without the `/s`.
fn parse_bandwidth(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let size = t.strip_suffix("/s").unwrap_or(t);
    parse_nonzero_size(size).map_err(|e| format!("{e} (a bandwidth is a size per second, e.g. 500MB/s)"))
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
}

impl DaemonArgs {
    fn options(&self) -> anyhow::Result<DaemonOptions> {
        Ok(DaemonOptions {
            dirs: self.dirs.clone(),
            socket: self.socket.clone(),
            staging_bytes: self.staging,
            retention: self.keep.map(|k| Retention { keep_last: k, keep_every: self.keep_every }),
            allow_uids: self.allow_uids.clone(),
            io: self.io.policy(),
            shard_bytes_max: self.shard_size,
            cpus: self.cpus.as_ref().map(|c| c.0.clone()),
            shared_dir: self.shared.clone(),
            node_local: match (self.node_local || (self.shared.is_some() && self.drain.is_some()), &self.node_id) {
                (false, Some(_)) => {
                    bail!("--node-id names this node's files: it needs --node-local (or --shared with --drain)")
                }
                (false, None) => None,
                (true, Some(id)) => Some(id.clone()),
                (true, None) => Some(host_node_id()?),
            },
            metrics: self.metrics,
            read_only: self.read_only,
            drain: self.drain.as_ref().map(|url| ckpt_sidecar::drain::DrainOptions {
                url: url.clone(),
                every: self.drain_every,
                keep: self.drain_keep,
                bandwidth_bytes_per_s: self.drain_bandwidth,
            }),
            incremental: self.incremental,
            full_every: self.full_every,
        })
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the sidecar daemon: trainers connect over the socket (docs/protocol.md).
    Serve {
        #[command(flatten)]
        d: DaemonArgs,
    },
    /// Run the sidecar with CMD as its child (socket in CKPT_SIDECAR_SOCKET);
    /// exits with CMD's status once its checkpoints are durable.
    Launch {
        #[command(flatten)]
        d: DaemonArgs,
        /// LD_PRELOAD the C shim into CMD, so an unmodified trainer connects
        /// at start and gets SIGTERM as the preemption flag (sets
        /// CKPT_SIDECAR_PRELOAD=1).
        #[arg(long)]
        preload: bool,
        /// The library --preload uses (default: libckpt.so beside this binary).
        #[arg(long, value_name = "PATH", requires = "preload")]
        preload_lib: Option<PathBuf>,
        /// The trainer command.
        #[arg(last = true, required = true)]
        cmd: Vec<std::ffi::OsString>,
    },
    /// Ask a running sidecar for its sessions, in-flight checkpoints, staging use and last figures.
    Status {
        #[arg(long)]
        socket: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// List committed checkpoints.
    Ls {
        /// A checkpoint directory, or a drain target's URL (file:///dir, s3://bucket/prefix).
        dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Show a checkpoint's tensors (dtype, shape, bytes) and blobs.
    Inspect {
        /// A checkpoint directory, or a drain target's URL (file:///dir, s3://bucket/prefix).
        dir: PathBuf,
        /// Step to show (default: latest).
        #[arg(allow_negative_numbers = true, value_parser = parse_step)]
        step: Option<u64>,
        /// The step to show, as an option (the same as STEP).
        #[arg(long = "step", id = "step_flag", allow_negative_numbers = true, value_parser = parse_step, conflicts_with = "step")]
        step_flag: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// Check every byte of checkpoints against their checksums.
    Verify {
        /// A checkpoint directory, or a drain target's URL (file:///dir, s3://bucket/prefix).
        dir: PathBuf,
        /// Only this step (default: every committed checkpoint).
        #[arg(long, allow_negative_numbers = true, value_parser = parse_step)]
        step: Option<u64>,
        /// Secondary directories, when they moved since the write.
        #[arg(long = "secondary")]
        secondaries: Vec<PathBuf>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        io: IoArgs,
    },
    /// Make the committed checkpoint STEP the newest again: `latest` moves
    /// to it, then every later step is un-committed, crash-safely, in every
    /// directory. Through the sidecar when one serves the directory.
    Rollback {
        /// Target directories, primary first.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// The step to go back to (a committed checkpoint whose index reads).
        #[arg(long, allow_negative_numbers = true, value_parser = parse_step)]
        to: u64,
        #[arg(long)]
        json: bool,
    },
    /// Delete old checkpoints, keeping the newest N (and every K-th step).
    /// Refused while a sidecar serves the directory (its --keep does this).
    Gc {
        /// Target directories, primary first.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        #[arg(long, allow_negative_numbers = true, value_parser = parse_keep)]
        keep: usize,
        #[arg(long, allow_negative_numbers = true, value_parser = parse_positive)]
        keep_every: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// Say which I/O engine each directory gets, and why.
    Doctor {
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        io: IoArgs,
    },
    /// Benchmarks (figures, not tests).
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
    /// Internal commands used by the test suite.
    #[command(hide = true)]
    Debug {
        #[command(subcommand)]
        what: DebugCmd,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Write a synthetic ~50-tensor state of SIZE through the engine to a committed checkpoint.
    Write {
        /// Target directory; repeat for several disks (the first is the primary).
        #[arg(long = "dir", required = true)]
        dirs: Vec<PathBuf>,
        #[arg(long, value_parser = parse_nonzero_size)]
        size: u64,
        /// Step to write (default: one past the newest).
        #[arg(long, allow_negative_numbers = true, value_parser = parse_step)]
        step: Option<u64>,
        /// Largest shard file.
        #[arg(long, value_parser = parse_nonzero_size, default_value = "1GiB")]
        shard_size: u64,
        /// Also run fio with the same size in the same directory, first, and print the ratio.
        #[arg(long)]
        compare_fio: bool,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        io: IoArgs,
    },
    /// The trainer's stall per save through a real client and a real sidecar
    /// process, beside one memcpy of the same bytes; persist throughput,
    /// sidecar memory, optionally fio and torch.save + fsync.
    #[command(disable_help_flag = true)]
    Stall {
        /// `ckpt-bench stall`'s options (--dir DIR --size SIZE [--python PY]
        /// [--staging SIZE] [--repeats N] [--compare-fio] [--json]; --help
        /// lists them), passed on as they are.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Incremental checkpoints: a LoRA-like state (frozen base + adapters
    /// with AdamW-like moments) saved every step, bytes written and time to
    /// durable beside saving the changed tensors alone; a full save with
    /// detection on vs off, alternated.
    #[command(disable_help_flag = true)]
    Incremental {
        /// `ckpt-bench incremental`'s options (--dir DIR [--base SIZE]
        /// [--adapters SIZE] [--steps N] [--full-rounds N] [--lazy-release] [--json]; --help
        /// lists them), passed on as they are.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// This sidecar against torch.save, safetensors, torch.distributed.checkpoint
    /// (save, async_save) and DeepSpeed FastPersist (when it can run) on the same
    /// state, in one run: stall, time to durable, restore, beside fio and memcpy.
    /// Runs the Python module ckpt_sidecar.bench_compare (needs torch; safetensors
    /// for its method, matplotlib for --plot).
    Compare {
        /// Directory on the disk to measure (a temp folder inside, removed at the end).
        #[arg(long)]
        dir: PathBuf,
        /// State sizes, comma-separated (e.g. 256MiB,1GiB,4GiB).
        #[arg(long, value_parser = parse_nonzero_size, value_delimiter = ',', default_value = "256MiB")]
        sizes: Vec<u64>,
        /// Timed rounds per size (the figures are medians); methods rotate between rounds.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
        rounds: u32,
        /// Untimed rounds first, so every method's memory is warm.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=1000))]
        warmup: u32,
        /// Only these methods (comma-separated; default: all).
        #[arg(long)]
        methods: Option<String>,
        /// Print the figures as one JSON document on the last line of standard output.
        #[arg(long)]
        json: bool,
        /// Also draw stall and throughput per method and size into this PNG.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// The Python to run it with (default: $CKPT_SIDECAR_PYTHON, else python3).
        #[arg(long)]
        python: Option<PathBuf>,
        /// Also the training-loop benchmark: a small model trained with a
        /// checkpoint every step, every 10 steps and never, through each method.
        #[arg(long = "loop")]
        with_loop: bool,
        /// Only the training-loop benchmark.
        #[arg(long, conflicts_with = "with_loop")]
        loop_only: bool,
        /// Parameter bytes of the loop's model (e.g. 32MiB).
        #[arg(long, value_parser = parse_nonzero_size)]
        loop_size: Option<u64>,
        /// Training steps per loop.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        loop_steps: Option<u32>,
        /// Rounds of the training loop, methods rotated between rounds (medians).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
        loop_rounds: Option<u32>,
        /// What a step's compute is: gpu_like (a sleep, the CPU free) or cpu.
        #[arg(long, value_parser = ["gpu_like", "cpu"])]
        loop_kind: Option<String>,
        /// With --loop/--loop-only: run the sidecar's loop again with
        /// `serve --drain URL` and print its overhead beside the plain loop's.
        #[arg(long, value_name = "URL")]
        drain: Option<String>,
        /// LoRA-like states: each size is a frozen base plus adapters of
        /// this size with AdamW-like moments written before every save; adds
        /// the methods sidecar_trust and sidecar_changed_only.
        #[arg(long, value_parser = parse_nonzero_size)]
        lora: Option<u64>,
        /// The training loop with a LoRA-like model (frozen MLP, rank-8
        /// adapters); adds the loop method sidecar_trust.
        #[arg(long)]
        loop_lora: bool,
    },
    /// The same state written by 1, 2 and 4 ranks, each rank's share into
    /// its own directory, beside fio over the same directories in parallel:
    /// aggregate throughput and bytes per rank. Runs the Python module
    /// ckpt_sidecar.bench_ranks with the Python of $CKPT_SIDECAR_PYTHON (else
    /// python3); its options (--dir DIR [--size SIZE] [--ranks 1,2,4] ...;
    /// --help lists them) are passed on as they are.
    #[command(disable_help_flag = true)]
    Ranks {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// A drain target's throughput: a committed step of SIZE written locally,
    /// uploaded by the drain tier (ckpt-tier) beside the plain object_store
    /// client's multipart put of the same files, then downloaded by both;
    /// for file:// also fio's write into that directory. Ratios printed.
    Drain {
        /// The drain target: file:///dir or s3://bucket/prefix (AWS_* environment).
        #[arg(long)]
        url: String,
        #[arg(long, value_parser = parse_nonzero_size)]
        size: u64,
        /// Where the local step is written (a temp folder inside, removed at the end).
        #[arg(long, default_value = "/tmp")]
        local: PathBuf,
        /// Largest shard file of the local step.
        #[arg(long, value_parser = parse_nonzero_size, default_value = "256MiB")]
        shard_size: u64,
        /// Parts in flight (both clients).
        #[arg(long, default_value_t = 8)]
        parallel: usize,
        /// Multipart part size (both clients).
        #[arg(long, value_parser = parse_nonzero_size, default_value = "16MiB")]
        part_size: u64,
        #[arg(long)]
        json: bool,
    },
    /// Read `latest` back with verification.
    Read {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        compare_fio: bool,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        io: IoArgs,
    },
}

#[derive(Subcommand)]
enum DebugCmd {
    /// Commit tensors given as raw files listed in a JSON manifest
    /// ({"tensors":[{"name","dtype","shape","file"}],"blobs":[{"name","file"}]}).
    WriteRaw {
        manifest: PathBuf,
        #[arg(long = "dir", required = true)]
        dirs: Vec<PathBuf>,
        #[arg(long, allow_negative_numbers = true, value_parser = parse_step)]
        step: u64,
        #[arg(long, value_parser = parse_nonzero_size, default_value = "1GiB")]
        shard_size: u64,
        #[command(flatten)]
        io: IoArgs,
    },
    /// Commit synthetic checkpoints of SIZE forever (steps 1, 2, ...), with
    /// retention; the crash tests kill it at random points.
    Torture {
        #[arg(long = "dir", required = true)]
        dirs: Vec<PathBuf>,
        #[arg(long, value_parser = parse_nonzero_size)]
        size: u64,
        #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = parse_keep)]
        keep: usize,
        #[arg(long)]
        count: Option<u64>,
        #[command(flatten)]
        io: IoArgs,
    },
}

/// A panic anywhere in this binary ends the process at once (issue 23): a
/// thread that unwound would leave what it held registered (its session's
/// duplicate socket, a step in flight), so its trainer would wait forever
/// for an answer and a drain never end. An abort closes every socket (the
/// trainers see EOF) and the next start recovers the directory. libckpt, a
/// library inside the trainer, keeps unwinding into its catch_unwind.
fn abort_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        eprintln!("ckpt-sidecar: aborting on a broken invariant (clients see their connection close; the next start recovers the directory)");
        std::process::abort();
    }));
}

fn main() -> ExitCode {
    abort_on_panic();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            eprintln!("{}", usage_line(&e));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let daemon = matches!(cli.cmd, Cmd::Serve { .. } | Cmd::Launch { .. });
    if !daemon {
        // A tool whose reader went away (`inspect D | head -1`) ends quietly,
        // as other Unix tools do. The daemon keeps ignoring SIGPIPE: it
        // writes to client sockets, and a client gone is not its end.
        // SAFETY: setting a signal's disposition before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    // The daemon says what it does (one line per checkpoint); tools stay quiet.
    let default_level = if daemon { "info" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CKPT_SIDECAR_LOG").unwrap_or_else(|_| default_level.into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let made = Made::before(&cli.cmd);
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            made.undo();
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// clap's error as one line: its text up to the first blank line (the
/// message and any argument it lists), then where help is.
fn usage_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let msg: Vec<&str> = text.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
    format!("{} (see --help)", msg.join(" "))
}

/// An error and its causes, each said once: a cause whose text the line
/// already holds (a wrapper that printed its source) is not repeated.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    // A multi-line message (a list of problems, each indented) reads as one
    // line: each break and the indent after it become one space.
    line.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

/// Directories that did not exist before a command that creates its own
/// (`serve`, `launch`, `bench write`; ckpt-bench does the same for `bench
/// stall`): a failed start removes
/// those it left empty, so a refused command leaves nothing behind.
struct Made(Vec<PathBuf>);

impl Made {
    fn before(cmd: &Cmd) -> Made {
        let mut paths: Vec<PathBuf> = Vec::new();
        match cmd {
            Cmd::Serve { d } | Cmd::Launch { d, .. } => {
                paths.extend(d.dirs.iter().cloned());
                if matches!(cmd, Cmd::Serve { .. }) || d.socket.is_some() {
                    let sock = d.socket.clone().unwrap_or_else(ckpt_sidecar::daemon::server::default_socket_path);
                    paths.extend(sock.parent().map(Path::to_path_buf));
                }
            }
            Cmd::Bench { what: BenchCmd::Write { dirs, .. } } => paths.extend(dirs.iter().cloned()),
            _ => {}
        }
        let mut missing = Vec::new();
        for p in paths {
            // Every missing ancestor, deepest first.
            for a in p.ancestors().filter(|a| !a.as_os_str().is_empty()) {
                if std::fs::symlink_metadata(a).is_ok() {
                    break;
                }
                if !missing.contains(&a.to_path_buf()) {
                    missing.push(a.to_path_buf());
                }
            }
        }
        Made(missing)
    }

    fn undo(mut self) {
        self.0.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for p in &self.0 {
            let _ = std::fs::remove_dir(p); // only if empty
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Serve { d } => Ok(ExitCode::from(daemon::serve(&d.options()?)?)),
        Cmd::Launch { d, preload, preload_lib, cmd } => {
            let preload = if preload { Some(resolve_preload(preload_lib)?) } else { None };
            Ok(ExitCode::from(daemon::launch(&d.options()?, &cmd, preload.as_deref())?))
        }
        Cmd::Status { socket, json } => status(socket, json),
        // A drain target's URL (file://, s3://) is read through ckpt-tier (remote_cli.rs).
        Cmd::Ls { dir, json } => match cli::remote::url_of(&dir) {
            Some(url) => cli::remote::ls(url, json),
            None => ls(&dir, json),
        },
        Cmd::Inspect { dir, step, step_flag, json } => match cli::remote::url_of(&dir) {
            Some(url) => cli::remote::inspect(url, step.or(step_flag), json),
            None => inspect(&dir, step.or(step_flag), json),
        },
        Cmd::Verify { dir, step, secondaries, json, io } => match cli::remote::url_of(&dir) {
            Some(url) => cli::remote::verify(url, step, &secondaries, json),
            None => verify(&dir, step, secondaries, json, io.policy()),
        },
        Cmd::Gc { dirs, keep, keep_every, json } => gc(&dirs, keep, keep_every, json),
        Cmd::Rollback { dirs, to, json } => rollback(&dirs, to, json),
        Cmd::Doctor { dirs, json, io } => doctor(&dirs, json, io.policy()),
        Cmd::Bench { what } => bench_cmd(what),
        Cmd::Debug { what } => debug_cmd(what),
    }
}

/// The library `--preload` uses: the given one, else libckpt.so beside this binary.
fn resolve_preload(p: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let p = match p {
        Some(p) => p,
        None => std::env::current_exe().context("locating this binary")?.with_file_name("libckpt.so"),
    };
    let p = std::fs::canonicalize(&p).with_context(|| {
        format!("--preload: {} (build it with cargo build --release, or pass its path)", p.display())
    })?;
    // The dynamic loader ignores a preload it cannot load (one line of its
    // own, then the trainer runs without the shim): refused here instead.
    let mut magic = [0u8; 4];
    std::fs::File::open(&p)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .with_context(|| format!("--preload: {}", p.display()))?;
    if &magic != b"\x7fELF" {
        bail!("--preload: {} is not a shared library (no ELF header)", p.display());
    }
    Ok(p)
}

fn ls(dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    catalog::check_dir(dir)?;
    let steps = catalog::readable_steps(dir).with_context(|| format!("listing {}", dir.display()))?;
    let latest = catalog::latest_step(dir)?;
    let mut rows = Vec::new();
    for s in steps {
        let (tensors, bytes, world_size, per_rank) = match restore::read_index(dir, s) {
            Ok(i) => {
                let per_rank: Vec<u64> = ckpt_store::ranks::bytes_per_rank(&i).into_values().collect();
                (
                    Some(i.logical().len()),
                    Some(i.ckpt.files.iter().map(|f| f.len_bytes).sum::<u64>()),
                    Some(i.ckpt.world_size),
                    Some(per_rank),
                )
            }
            // Deleted since it was listed (a live sidecar's --keep): not shown as damaged.
            Err(_) if !catalog::is_committed(dir, s) => continue,
            Err(_) => (None, None, None, None),
        };
        rows.push(json!({"step": s, "path": catalog::step_path(dir, s), "latest": Some(s) == latest, "tensors": tensors, "bytes": bytes, "world_size": world_size, "bytes_per_rank": per_rank}));
    }
    print_ls(&dir.display().to_string(), json!({"dir": dir, "latest": latest, "checkpoints": rows}), json);
    Ok(ExitCode::SUCCESS)
}

/// `ls`'s output (a directory's or a drain target's): `doc` is the JSON
/// document, `{"dir" or "url", "latest", "checkpoints": rows}`.
fn print_ls(shown: &str, doc: serde_json::Value, json: bool) {
    let rows = doc["checkpoints"].as_array().cloned().unwrap_or_default();
    if json {
        println!("{doc}");
    } else if rows.is_empty() {
        println!("{shown}: no committed checkpoint");
    } else {
        println!("{:>12}  {:>5}  {:>8}  {:>12}  LATEST", "STEP", "RANKS", "TENSORS", "BYTES");
        for r in &rows {
            let latest = if r["latest"].as_bool() == Some(true) { "*" } else { "" };
            let readable = r["bytes"].as_u64().is_some();
            let line = format!(
                "{:>12}  {:>5}  {:>8}  {:>12}  {:<6}{}",
                r["step"].as_u64().unwrap_or_default(),
                r["world_size"].as_u64().map_or("?".into(), |t| t.to_string()),
                r["tensors"].as_u64().map_or("?".into(), |t| t.to_string()),
                r["bytes"].as_u64().map_or("?".into(), human_bytes),
                latest,
                if readable { "" } else { "  index unreadable (damaged: see inspect, verify)" }
            );
            println!("{}", line.trim_end());
        }
    }
}

fn status(socket: Option<PathBuf>, json: bool) -> anyhow::Result<ExitCode> {
    let socket = socket.unwrap_or_else(ckpt_sidecar::daemon::server::default_socket_path);
    let mut r = match daemon::status(&socket) {
        Err(daemon::ClientError::Connect { source, .. })
            if matches!(source.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) =>
        {
            bail!(
                "no sidecar is listening at {} (start one: ckpt-sidecar serve --dir DIR, or give its --socket)",
                socket.display()
            )
        }
        Err(e @ daemon::ClientError::Connect { .. }) => return Err(e.into()), // names the socket
        r => r.with_context(|| format!("asking {} for its status", socket.display()))?,
    };
    // Our own connection is not one of the sidecar's sessions worth listing.
    let me = std::process::id();
    r.sessions.retain(|s| s.pid != me);
    if json {
        let j = json!({
            "socket": socket, "server_pid": r.server_pid, "dirs": r.dirs,
            "sessions": r.sessions.iter().map(|s| json!({"pid": s.pid, "name": s.name, "regions": s.regions, "region_bytes": s.region_bytes})).collect::<Vec<_>>(),
            "in_flight": r.in_flight.iter().map(|f| json!({"step": f.step, "file": f.file, "phase": f.phase, "bytes": f.bytes})).collect::<Vec<_>>(),
            "staging_bytes": r.staging_bytes, "staging_used_bytes": r.staging_used_bytes, "resident_step": r.resident_step,
            "unchanged_taken_bytes": r.unchanged_taken_bytes, "unchanged_in_place_bytes": r.unchanged_in_place_bytes,
            "last": r.last.as_ref().map(|l| json!({"step": l.step, "bytes": l.bytes, "copy_seconds": l.copy_seconds, "persist_seconds": l.persist_seconds, "persist_gib_per_s": l.persist_gib_per_s})),
            "cuda": r.cuda,
            "shared_dir": (!r.shared_dir.is_empty()).then_some(&r.shared_dir),
            "coordinating": r.coordinating,
            "drain": r.drain.as_ref().map(|d| json!({
                "url": d.url, "state": if d.up { "up" } else { "down" }, "error": (!d.error.is_empty()).then_some(&d.error),
                "last_replicated": d.last_replicated, "uploading": d.uploading, "backlog": d.backlog, "skipped": d.skipped,
                "bytes_per_s": d.bytes_per_s, "every": d.every, "keep": d.keep,
            })),
        });
        println!("{j}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("sidecar pid {} at {}", r.server_pid, socket.display());
    println!("dirs:     {}", r.dirs.join(", "));
    println!(
        "staging:  {} of {} in use; resident step: {}",
        human_bytes(r.staging_used_bytes),
        human_bytes(r.staging_bytes),
        r.resident_step.map_or("none".into(), |s| s.to_string())
    );
    println!(
        "unchanged: {} taken from the resident image, not copied ({} of it in place)",
        human_bytes(r.unchanged_taken_bytes),
        human_bytes(r.unchanged_in_place_bytes)
    );
    println!("sessions: {}", r.sessions.len());
    for s in &r.sessions {
        println!("  pid {:>8}  {:<24} {} region(s), {}", s.pid, s.name, s.regions, human_bytes(s.region_bytes));
    }
    println!("in flight: {}", r.in_flight.len());
    for f in &r.in_flight {
        match &f.file {
            Some(path) => println!("  file {path}  {:<22} {}", f.phase, human_bytes(f.bytes)),
            None => println!("  step {:>12}  {:<22} {}", f.step, f.phase, human_bytes(f.bytes)),
        }
    }
    match &r.last {
        Some(l) => println!(
            "last:     step {} ({}): copy {:.3} s, persist {:.3} s, {:.2} GiB/s",
            l.step,
            human_bytes(l.bytes),
            l.copy_seconds,
            l.persist_seconds,
            l.persist_gib_per_s
        ),
        None => println!("last:     none yet"),
    }
    println!("cuda:     {}", r.cuda);
    if !r.shared_dir.is_empty() {
        let role = if r.coordinating.is_empty() {
            "coordinator of no step now (a step's coordinator is the sidecar serving its rank 0)".to_string()
        } else {
            format!("coordinator of step(s) {:?} (serves their rank 0)", r.coordinating)
        };
        println!("shared:   {} (several nodes); {role}", r.shared_dir);
    }
    if let Some(d) = &r.drain {
        let state = if d.up { "up".to_string() } else { format!("DOWN ({}); retrying", d.error) };
        println!(
            "drain:    {} {state}; last replicated: {}; uploading: {}; backlog: {:?}; skipped: {:?}; {}/s",
            d.url,
            d.last_replicated.map_or("none".into(), |s| s.to_string()),
            d.uploading.map_or("none".into(), |s| s.to_string()),
            d.backlog,
            d.skipped,
            human_bytes(d.bytes_per_s as u64)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The step asked for, else `latest`, else the newest committed one (so a
/// damaged newest checkpoint is shown as damaged, not as missing).
fn resolve_step(dir: &Path, step: Option<u64>) -> anyhow::Result<u64> {
    catalog::check_dir(dir)?;
    if let Some(s) = step {
        return Ok(s);
    }
    if let Some(s) = catalog::latest_step(dir)? {
        return Ok(s);
    }
    catalog::readable_steps(dir)?.last().copied().with_context(|| format!("{}: no committed checkpoint", dir.display()))
}

/// The step asked for (else as [`resolve_step`] picks it) and its index. The
/// newest step of a directory a live sidecar serves may be deleted by its
/// --keep between picking and reading: then the new newest one is read.
fn read_step_index(dir: &Path, step: Option<u64>) -> anyhow::Result<(u64, format::Index)> {
    let mut tries = 0;
    loop {
        let s = resolve_step(dir, step)?;
        match restore::read_index(dir, s) {
            Err(_) if step.is_none() && tries < config::RESOLVE_TRIES_MAX && !catalog::is_committed(dir, s) => {
                tries += 1
            }
            r => return Ok((s, r?)),
        }
    }
}

/// `1 file`, `2 files`.
fn plural(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

fn inspect(dir: &Path, step: Option<u64>, json: bool) -> anyhow::Result<ExitCode> {
    let (step, index) = read_step_index(dir, step)?;
    print_inspect(&index, &catalog::step_path(dir, step).display().to_string(), json)?;
    Ok(ExitCode::SUCCESS)
}

/// `inspect`'s output for one step's index, found at `location`.
fn print_inspect(index: &format::Index, location: &str, json: bool) -> anyhow::Result<()> {
    let logical = index.logical();
    if json {
        // The index as stored, plus `logical`: every tensor as readers see
        // it (a tensor stored in slices once, with its slices).
        let mut v = serde_json::to_value(&index)?;
        let l: serde_json::Map<String, serde_json::Value> = logical
            .iter()
            .map(|t| {
                let slices: Vec<_> = t
                    .slices
                    .iter()
                    .map(|s| json!({"tensor": s.tensor, "rank": ckpt_store::ranks::rank_of_file(s.file), "file": s.file, "elems": s.elems, "data_offsets": s.data_offsets, "crc32c": s.crc32c}))
                    .collect();
                (t.name.to_string(), json!({"dtype": t.dtype.as_str(), "shape": t.shape, "len_bytes": t.len_bytes(), "slices": slices}))
            })
            .collect();
        v["logical"] = serde_json::Value::Object(l);
        println!("{v}");
        return Ok(());
    }
    let c = &index.ckpt;
    let bytes: u64 = c.files.iter().map(|f| f.len_bytes).sum();
    let stored =
        if logical.len() == c.tensors.len() { String::new() } else { format!(" ({} stored)", c.tensors.len()) };
    println!(
        "step {} in {}: {}{stored}, {}, {}",
        c.step,
        location,
        plural(logical.len(), "tensor"),
        plural(c.files.len(), "file"),
        human_bytes(bytes)
    );
    println!("{}", ckpt_store::ranks::describe(index));
    println!("{:<48} {:<8} {:<20} {:>12}  FILE", "TENSOR", "DTYPE", "SHAPE", "SIZE");
    for t in &logical {
        let (size, shape) = (human_bytes(t.len_bytes()), format!("{:?}", t.shape));
        if !t.is_sliced() {
            println!("{:<48} {:<8} {:<20} {:>12}  {}", t.name, t.dtype.as_str(), shape, size, t.slices[0].file);
            continue;
        }
        println!(
            "{:<48} {:<8} {:<20} {:>12}  {}",
            t.name,
            t.dtype.as_str(),
            shape,
            size,
            plural(t.slices.len(), "slice")
        );
        for s in &t.slices {
            let rank = ckpt_store::ranks::rank_of_file(s.file).map_or("?".into(), |r| r.to_string());
            let what = format!("slice elems [{}, {}) rank {rank}", s.elems[0], s.elems[1]);
            println!("  {:<75} {:>12}  {}", what, human_bytes(s.data_offsets[1] - s.data_offsets[0]), s.file);
        }
    }
    for b in &c.blobs {
        println!("blob {:<43} {:>42}", b.name, human_bytes(b.len_bytes));
    }
    Ok(())
}

fn verify(
    dir: &Path,
    step: Option<u64>,
    secondaries: Vec<PathBuf>,
    json: bool,
    io: IoPolicy,
) -> anyhow::Result<ExitCode> {
    catalog::check_dir(dir)?;
    for d in &secondaries {
        catalog::check_dir(d)?;
    }
    let steps = match step {
        Some(s) => vec![s],
        None => catalog::readable_steps(dir).with_context(|| format!("listing {}", dir.display()))?,
    };
    if steps.is_empty() {
        bail!("{}: no committed checkpoint to verify", dir.display());
    }
    let opts = ReadOptions {
        io,
        secondary_dirs: if secondaries.is_empty() { None } else { Some(secondaries) },
        ..Default::default()
    };
    let bar = if std::io::stderr().is_terminal() && !json {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
                .expect("valid template"),
        );
        Some(b)
    } else {
        None
    };
    let mut results = Vec::new();
    let mut damaged = false;
    let mut damaged_files: Vec<(u64, String)> = Vec::new();
    let mut verifier = restore::Verifier::default();
    for s in steps {
        if let Some(b) = &bar {
            b.set_message(format!("step {s}"));
            b.set_position(0);
        }
        let r = verifier.verify(dir, s, &opts, |done, total| {
            if let Some(b) = &bar {
                b.set_length(total);
                b.set_position(done);
            }
        });
        // A step a live sidecar's --keep (or a rollback) deleted after it was
        // listed reads as missing files: gone, not damaged.
        let r = match r {
            Ok(r) if r.problems.is_empty() => r,
            Ok(_) | Err(_) if !catalog::is_committed(dir, s) => {
                if step.is_some() {
                    bail!(
                        "{}: step {s} was deleted while it was being verified (a sidecar's --keep, or a rollback)",
                        dir.display()
                    );
                }
                if !json {
                    let say = || {
                        println!(
                            "step {s}: deleted while being verified (a sidecar's --keep, or a rollback); not checked"
                        )
                    };
                    if let Some(b) = &bar {
                        b.suspend(say);
                    } else {
                        say();
                    }
                }
                continue;
            }
            r => r?,
        };
        damaged |= !r.problems.is_empty();
        damaged_files.extend(r.problems.iter().filter_map(|p| p.file.clone()).map(|f| (s, f)));
        // Ranks as the index says (verify just checked it, or said why not).
        let index = restore::read_index(dir, s).ok();
        let ranks_line = index.as_ref().map(ckpt_store::ranks::describe);
        if !json {
            let print = || {
                print_verify(&r);
                if let Some(l) = &ranks_line {
                    println!("  {l}");
                }
            };
            if let Some(b) = &bar {
                b.suspend(print);
            } else {
                print();
            }
        }
        results.push(verify_row(&r, index.as_ref()));
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    // Incremental checkpoints share files between steps (hard links): a
    // damaged one damages every step that links it; say which.
    let mut shared_damage = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (s, file) in &damaged_files {
        let Some(id) = ckpt_store::incremental::file_inode(dir, *s, file) else { continue };
        if !seen.insert(id) {
            continue;
        }
        let steps = ckpt_store::incremental::steps_sharing(dir, id);
        if steps.len() > 1 {
            let list = steps.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
            if !json {
                println!("damaged file {file} (step {s}) is shared by steps {list} (one file, hard-linked: every one of them is damaged)");
            }
            shared_damage.push(json!({"step": s, "file": file, "shared_by": steps}));
        }
    }
    if json {
        println!("{}", json!({"dir": dir, "ok": !damaged, "checkpoints": results, "shared_damage": shared_damage}));
    }
    Ok(if damaged { ExitCode::from(EXIT_DAMAGED) } else { ExitCode::SUCCESS })
}

/// One checkpoint of `verify --json`.
fn verify_row(r: &restore::VerifyReport, index: Option<&format::Index>) -> serde_json::Value {
    json!({
        "step": r.step, "ok": r.problems.is_empty(), "files": r.files, "tensors": r.tensors, "bytes": r.bytes,
        "world_size": index.map(|i| i.ckpt.world_size),
        "bytes_per_rank": index.map(|i| ckpt_store::ranks::bytes_per_rank(i).into_values().collect::<Vec<u64>>()),
        "seconds": r.seconds, "problems": r.problems.iter().map(|p| json!({"file": p.file, "tensor": p.tensor, "what": p.what})).collect::<Vec<_>>(),
    })
}

fn print_verify(r: &restore::VerifyReport) {
    if r.problems.is_empty() {
        println!(
            "step {}: ok ({} files, {} tensors, {} in {:.2} s)",
            r.step,
            r.files,
            r.tensors,
            human_bytes(r.bytes),
            r.seconds
        );
    } else {
        println!("step {}: DAMAGED", r.step);
        for p in &r.problems {
            println!("  {p}");
        }
    }
}

fn gc(dirs: &[PathBuf], keep: usize, keep_every: Option<u64>, json: bool) -> anyhow::Result<ExitCode> {
    // Opening the store locks the directories (a serving sidecar's are
    // refused, naming it) and runs recovery first, so leftovers go too.
    let store = match Store::open(StoreOptions {
        create: false,
        lock_role: "gc".into(),
        ..StoreOptions::new(dirs.to_vec())
    }) {
        Err(StoreError::Locked(e @ LockError::Held { .. })) => {
            bail!("{e}; gc does not run beside a live sidecar: its --keep N deletes old checkpoints as it commits (or stop it, then gc)")
        }
        r => r?,
    };
    let policy = Retention { keep_last: keep, keep_every };
    // Never delete the last checkpoints that would load for steps that would
    // not (a truncated newest one): what is kept must hold one that loads.
    let doomed = retention::plan(store.dirs(), policy)?;
    if !doomed.is_empty() {
        let kept: Vec<u64> =
            catalog::committed_steps(store.primary())?.into_iter().filter(|s| !doomed.contains(s)).collect();
        let why: Vec<String> = kept
            .iter()
            .map_while(|&s| ckpt_store::rollback::would_not_load(store.dirs(), s).map(|w| format!("step {s}: {w}")))
            .collect();
        if why.len() == kept.len()
            && doomed.iter().any(|&s| ckpt_store::rollback::would_not_load(store.dirs(), s).is_none())
        {
            bail!("gc would keep only steps that would not load ({}); nothing deleted: keep more (--keep), or roll back to a sound step first (ckpt-sidecar verify DIR)", why.join("; "));
        }
    }
    let deleted = retention::apply(store.dirs(), policy)?;
    let kept = catalog::committed_steps(store.primary())?;
    let recovered = store.recovery().removed.clone();
    // The locks go (and their files with them) before any output: a closed
    // stdout ends this process by SIGPIPE.
    drop(store);
    if json {
        println!("{}", json!({"deleted": deleted, "kept": kept, "recovered": recovered}));
    } else {
        for p in &recovered {
            println!("removed leftover {}", p.display());
        }
        println!("deleted {} checkpoint(s) {:?}; kept {:?}", deleted.len(), deleted, kept);
    }
    Ok(ExitCode::SUCCESS)
}

fn rollback(dirs: &[PathBuf], to: u64, json: bool) -> anyhow::Result<ExitCode> {
    // A sidecar serving the directory does it itself, in order with its
    // saves; otherwise this process takes the locks and does it.
    let served = dirs.iter().find_map(|d| ckpt_store::lock::holder(d).and_then(|h| h.socket.clone().map(|s| (h, s))));
    let (removed, via) = match served {
        Some((holder, socket)) => {
            let removed = daemon::rollback(&socket, to).with_context(|| {
                format!("rolling back through the sidecar that holds the directory ({})", holder.describe())
            })?;
            (removed, Some(socket))
        }
        None => {
            let mut store = Store::open(StoreOptions {
                create: false,
                lock_role: "rollback".into(),
                ..StoreOptions::new(dirs.to_vec())
            })?;
            (store.rollback(to)?, None)
        }
    };
    if json {
        println!("{}", json!({"step": to, "removed": removed, "via_socket": via}));
    } else {
        println!("rolled back to step {to}; un-committed {} later step(s) {:?}", removed.len(), removed);
    }
    Ok(ExitCode::SUCCESS)
}

fn doctor(dirs: &[PathBuf], json: bool, io: IoPolicy) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    let mut failed = false;
    for d in dirs {
        catalog::check_dir(d)?;
    }
    for d in dirs {
        match eio::probe(d, io) {
            Ok(c) => {
                if !json {
                    println!("{}: {} (queue depth {}): {}", d.display(), c.name(), c.queue_depth, c.why.join("; "));
                }
                rows.push(json!({"dir": d, "engine": c.name(), "uring": c.backend == eio::Backend::Uring, "direct": c.direct, "queue_depth": c.queue_depth, "why": c.why}));
            }
            Err(e) => {
                failed = true;
                // The row names the directory; the error's own naming of it is not repeated.
                let why = match &e {
                    eio::ProbeError::Io { what, source, .. } => format!("{what}: {source}"),
                    other => other.to_string(),
                };
                if !json {
                    println!("{}: unusable: {why}", d.display());
                }
                rows.push(json!({"dir": d, "engine": null, "error": why}));
            }
        }
    }
    // CUDA is optional: its absence is reported, never a failure.
    if json {
        println!("{}", json!({"dirs": rows, "cuda": ckpt_sidecar::memory::cuda_probe::json_with(true)}));
    } else {
        println!("cuda: {}", ckpt_sidecar::memory::cuda_probe::summary());
    }
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

fn print_figures(f: &bench::Figures, json: bool) -> anyhow::Result<()> {
    println!("op:              {}", f.op);
    println!("step:            {}", f.step);
    println!("bytes:           {} ({})", f.bytes, human_bytes(f.bytes));
    println!("files/tensors:   {}/{}", f.n_files, f.n_tensors);
    println!("engine:          {}", f.engine);
    println!("seconds:         {:.3}", f.seconds);
    println!("gib_per_s:       {:.3}", f.gib_per_s);
    println!("cpu user s/GiB:  {:.3}", f.cpu_user_s_per_gib);
    println!("cpu sys s/GiB:   {:.3}", f.cpu_sys_s_per_gib);
    println!("memory:          {} (prepared in {:.2} s, untimed)", f.memory, f.prepare_seconds);
    if let (Some(fio), Some(r)) = (f.fio_gib_per_s, f.ratio_to_fio) {
        println!("fio gib_per_s:   {fio:.3} (same size, same directory, just before)");
        println!("ratio to fio:    {r:.3}");
    }
    if json {
        println!("{}", serde_json::to_string(f)?);
    }
    Ok(())
}

/// The Python a bench module runs with: --python, else $CKPT_SIDECAR_PYTHON,
/// else `python3`.
fn bench_python(given: Option<PathBuf>) -> PathBuf {
    given
        .or_else(|| std::env::var_os("CKPT_SIDECAR_PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("python3"))
}

const PYTHON_HINT: &str = "point $CKPT_SIDECAR_PYTHON (or bench compare's --python) at a Python where it is installed (pip install ./shim-py; the README's .venv has it)";

/// `PYTHON -m MODULE`, measuring this very binary, once PYTHON has been seen
/// to import the package: a Python without it is named in one line, with
/// what to do, rather than in Python's own module-lookup error.
fn python_module(python: &Path, module: &str) -> anyhow::Result<std::process::Command> {
    let probe = std::process::Command::new(python)
        .args(["-c", "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('ckpt_sidecar') else 3)"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    match probe {
        Err(e) => bail!("cannot run {} for {module}: {e}; {PYTHON_HINT}", python.display()),
        Ok(s) if !s.success() => {
            bail!("{} cannot import ckpt_sidecar, which {module} needs; {PYTHON_HINT}", python.display())
        }
        Ok(_) => {}
    }
    let me = std::env::current_exe().context("finding this executable")?;
    let mut cmd = std::process::Command::new(python);
    cmd.args(["-m", module]).env("CKPT_SIDECAR_BIN", me);
    Ok(cmd)
}

fn run_bench_child(mut cmd: std::process::Command, python: &Path, module: &str) -> anyhow::Result<ExitCode> {
    let status = cmd.status().with_context(|| format!("running {} -m {module}", python.display()))?;
    Ok(child_exit(status))
}

/// A child's exit status as ours: its code, or 128 + the signal that ended
/// it (SIGPIPE: its stdout closed), as a shell says it.
fn child_exit(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(0), _) => ExitCode::SUCCESS,
        (Some(c), _) => ExitCode::from(c.clamp(1, 255) as u8),
        (None, Some(sig)) => ExitCode::from((128 + sig).clamp(1, 255) as u8),
        (None, None) => ExitCode::FAILURE,
    }
}

fn bench_cmd(what: BenchCmd) -> anyhow::Result<ExitCode> {
    match what {
        BenchCmd::Write { dirs, size, step, shard_size, compare_fio, json, io } => {
            let f = bench::write(&bench::WriteArgs {
                dirs,
                size_bytes: size,
                step,
                io: io.policy(),
                shard_bytes_max: shard_size,
                compare_fio,
            })?;
            print_figures(&f, json)?;
        }
        BenchCmd::Incremental { args } => {
            let me = std::env::current_exe().context("finding this executable")?;
            let bench = me.with_file_name("ckpt-bench");
            if !bench.is_file() {
                bail!(
                    "bench incremental needs ckpt-bench beside {} (build it: cargo build --release -p ckpt-bench)",
                    me.display()
                );
            }
            let status = std::process::Command::new(&bench)
                .arg("incremental")
                .args(args)
                .env("CKPT_SIDECAR_BIN", &me)
                .status()
                .with_context(|| format!("running {}", bench.display()))?;
            return Ok(child_exit(status));
        }
        BenchCmd::Stall { args } => {
            // The trainer's side lives in ckpt-bench, so that this binary links
            // no client code; it measures this very binary as the sidecar.
            let me = std::env::current_exe().context("finding this executable")?;
            let bench = me.with_file_name("ckpt-bench");
            if !bench.is_file() {
                bail!(
                    "bench stall needs ckpt-bench beside {} (build it: cargo build --release -p ckpt-bench)",
                    me.display()
                );
            }
            let status = std::process::Command::new(&bench)
                .arg("stall")
                .args(args)
                .env("CKPT_SIDECAR_BIN", &me)
                .status()
                .with_context(|| format!("running {}", bench.display()))?;
            return Ok(child_exit(status));
        }
        BenchCmd::Drain { url, size, local, shard_size, parallel, part_size, json } => {
            cli::bench_drain::run(&cli::bench_drain::Args { url, size, local, shard_size, parallel, part_size, json })?;
        }
        BenchCmd::Ranks { args } => {
            let python = bench_python(None);
            let mut cmd = python_module(&python, "ckpt_sidecar.bench_ranks")?;
            cmd.args(&args);
            return run_bench_child(cmd, &python, "ckpt_sidecar.bench_ranks");
        }
        BenchCmd::Compare {
            dir,
            sizes,
            rounds,
            warmup,
            methods,
            json,
            plot,
            python,
            with_loop,
            loop_only,
            loop_size,
            loop_steps,
            loop_rounds,
            loop_kind,
            drain,
            lora,
            loop_lora,
        } => {
            // The comparison drives Python libraries (torch, safetensors, DCP):
            // it lives in the Python package, measuring this very binary.
            let python = bench_python(python);
            let sizes: Vec<String> = sizes.iter().map(u64::to_string).collect();
            let mut cmd = python_module(&python, "ckpt_sidecar.bench_compare")?;
            cmd.arg("--dir").arg(&dir);
            cmd.arg("--sizes")
                .arg(sizes.join(","))
                .arg("--rounds")
                .arg(rounds.to_string())
                .arg("--warmup")
                .arg(warmup.to_string());
            if let Some(m) = methods {
                cmd.arg("--methods").arg(m);
            }
            if json {
                cmd.arg("--json");
            }
            if let Some(p) = plot {
                cmd.arg("--plot").arg(p);
            }
            if with_loop {
                cmd.arg("--loop");
            }
            if loop_only {
                cmd.arg("--loop-only");
            }
            if let Some(a) = lora {
                cmd.arg("--lora").arg(a.to_string());
            }
            if loop_lora {
                cmd.arg("--loop-lora");
            }
            let loop_values = [
                ("--loop-size", loop_size.map(|v| v.to_string())),
                ("--loop-steps", loop_steps.map(|v| v.to_string())),
                ("--loop-rounds", loop_rounds.map(|v| v.to_string())),
                ("--loop-kind", loop_kind),
                ("--drain", drain),
            ];
            for (flag, value) in loop_values {
                if let Some(v) = value {
                    cmd.arg(flag).arg(v);
                }
            }
            return run_bench_child(cmd, &python, "ckpt_sidecar.bench_compare");
        }
        BenchCmd::Read { dir, compare_fio, json, io } => {
            catalog::check_dir(&dir)?;
            let f = bench::read(&bench::ReadArgs { dir, io: io.policy(), compare_fio })?;
            print_figures(&f, json)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(serde::Deserialize)]
struct Manifest {
    tensors: Vec<ManifestTensor>,
    #[serde(default)]
    blobs: Vec<ManifestBlob>,
}

#[derive(serde::Deserialize)]
struct ManifestTensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    file: PathBuf,
}

#[derive(serde::Deserialize)]
struct ManifestBlob {
    name: String,
    file: PathBuf,
}

fn debug_cmd(what: DebugCmd) -> anyhow::Result<ExitCode> {
    match what {
        DebugCmd::WriteRaw { manifest, dirs, step, shard_size, io } => {
            let base = manifest.parent().unwrap_or(Path::new(".")).to_path_buf();
            let m: Manifest = serde_json::from_slice(&std::fs::read(&manifest)?).context("parsing the manifest")?;
            let specs = m
                .tensors
                .iter()
                .map(|t| {
                    Ok(TensorSpec { name: t.name.clone(), dtype: Dtype::parse(&t.dtype)?, shape: t.shape.clone() })
                })
                .collect::<Result<Vec<_>, format::FormatError>>()?;
            let mut store = Store::open(StoreOptions { io: io.policy(), ..StoreOptions::new(dirs.clone()) })?;
            let layout = Layout::plan(
                specs,
                LayoutOptions { n_dirs: dirs.len(), shard_bytes_max: shard_size, ..Default::default() },
            )?;
            let mut staging = AlignedBuf::new(layout.staging_len as usize)?;
            layout.write_headers(staging.as_mut_slice());
            for (i, t) in m.tensors.iter().enumerate() {
                let bytes =
                    std::fs::read(base.join(&t.file)).with_context(|| format!("reading {}", t.file.display()))?;
                let r = layout.tensor_range(i);
                if bytes.len() != r.len() {
                    bail!(
                        "{}: {} bytes, but {} {:?} needs {}",
                        t.file.display(),
                        bytes.len(),
                        t.dtype,
                        t.shape,
                        r.len()
                    );
                }
                staging.as_mut_slice()[r].copy_from_slice(&bytes);
            }
            let blob_bytes =
                m.blobs.iter().map(|b| std::fs::read(base.join(&b.file))).collect::<Result<Vec<_>, _>>()?;
            let blobs: Vec<Blob> =
                m.blobs.iter().zip(&blob_bytes).map(|(b, bytes)| Blob { name: &b.name, bytes }).collect();
            let crcs = layout.tensor_crcs(staging.as_slice());
            let r = store.commit(step, &layout, &staging, &crcs, &blobs)?;
            println!("{}", json!({"step": r.step, "path": r.path, "bytes": r.bytes, "engine": store.engine_names()}));
        }
        DebugCmd::Torture { dirs, size, keep, count, io } => {
            let mut store = Store::open(StoreOptions {
                io: io.policy(),
                retention: Some(Retention { keep_last: keep, keep_every: None }),
                ..StoreOptions::new(dirs.clone())
            })?;
            let layout = Layout::plan(
                synthetic::transformer_specs(size),
                LayoutOptions { n_dirs: dirs.len(), shard_bytes_max: (size / 3).max(1 << 20), ..Default::default() },
            )?;
            let mut staging = AlignedBuf::new(layout.staging_len as usize)?;
            let first = catalog::committed_steps(store.primary())?.last().map_or(1, |s| s + 1);
            let blob = b"torture blob".to_vec();
            let mut step = first;
            loop {
                if count.is_some_and(|c| step >= first + c) {
                    break;
                }
                let crcs = synthetic::stage(&layout, staging.as_mut_slice(), step);
                store.commit(step, &layout, &staging, &crcs, &[Blob { name: "meta", bytes: &blob }])?;
                println!("committed {step}");
                step += 1;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
