//! The command line's shape: the clap types of every command and flag,
//! and the value parsers that range-check sizes, steps, counts and CPU
//! lists, so no bad value reaches a command (a usage error, exit code 2,
//! instead). What each command does lives in the sibling modules.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use ckpt_sidecar::config;
use ckpt_store::format::STEP_MAX;
use ckpt_store::io::{IoPolicy, Want};
use ckpt_store::units::parse_size;

/// A size that must be at least one byte (`--size`, `--shard-size`, `--staging`).
pub fn parse_nonzero_size(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err(format!("size {s:?} must be at least 1 byte")),
        n => Ok(n),
    }
}

/// A checkpoint step: 0 to the largest step a folder name holds.
pub fn parse_step(s: &str) -> Result<u64, String> {
    let n: u64 = s.trim().parse().map_err(|_| format!("step {s:?} is not a whole number from 0 to {STEP_MAX}"))?;
    if n > STEP_MAX {
        return Err(format!("step {n} is above the largest step {STEP_MAX}"));
    }
    Ok(n)
}

/// A count that must be at least 1 (`--keep`, `--keep-every`).
pub fn parse_positive(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err(format!("{s:?} must be at least 1")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}

pub fn parse_node_id(s: &str) -> Result<String, String> {
    ckpt_store::format::validate_node_id(s).map(|()| s.to_string()).map_err(|e| e.to_string())
}

pub fn parse_keep(s: &str) -> Result<usize, String> {
    parse_positive(s)
        .map(|n| n.min(usize::MAX as u64) as usize)
        .map_err(|e| format!("{e} (the newest checkpoint is never deleted)"))
}

#[derive(Parser)]
#[command(name = "ckpt-sidecar", version, about = "Checkpoint sidecar for deep-learning training")]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// I/O engine choices, also settable as CKPT_SIDECAR_URING / CKPT_SIDECAR_DIRECT.
#[derive(Args, Clone, Copy)]
pub struct IoArgs {
    /// Use io_uring: auto (if the kernel allows), on (or fail), off (thread pool).
    #[arg(long, default_value = "auto", value_parser = parse_want)]
    pub uring: Want,
    /// Use O_DIRECT: auto (if the file system allows), on (or fail), off (buffered + fdatasync).
    #[arg(long, default_value = "auto", value_parser = parse_want)]
    pub direct: Want,
    /// Requests in flight per directory.
    #[arg(long, default_value_t = config::QUEUE_DEPTH_DEFAULT,
          value_parser = clap::value_parser!(u32).range(config::QUEUE_DEPTH_MIN as i64..=config::QUEUE_DEPTH_MAX as i64))]
    pub queue_depth: u32,
}

impl IoArgs {
    pub fn policy(self) -> IoPolicy {
        IoPolicy { uring: self.uring, direct: self.direct, queue_depth: self.queue_depth }
    }
}

pub fn parse_want(s: &str) -> Result<Want, String> {
    s.parse()
}

/// CPU numbers, sorted, without repeats.
#[derive(Debug, Clone)]
pub struct CpuList(pub Vec<usize>);

/// A CPU list as in /proc and taskset: `0`, `1,3`, `2-7,12`.
pub fn parse_cpus(s: &str) -> Result<CpuList, String> {
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
pub struct DaemonArgs {
    /// Target directory; repeat for several disks (the first is the primary).
    #[arg(long = "dir", required = true)]
    pub dirs: Vec<PathBuf>,
    /// Socket path (default: $CKPT_SIDECAR_SOCKET, else
    /// $XDG_RUNTIME_DIR/ckpt-sidecar/sidecar.sock, else
    /// /tmp/ckpt-sidecar-<uid>/sidecar.sock; launch: a private temp dir).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Staging memory budget, allocated at start (default: a quarter of RAM, at most 8 GiB).
    #[arg(long, value_parser = parse_nonzero_size)]
    pub staging: Option<u64>,
    /// Keep only the newest N committed checkpoints (default: keep all).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_keep)]
    pub keep: Option<usize>,
    /// With --keep, also keep every step that is a multiple of K.
    #[arg(long, requires = "keep", allow_negative_numbers = true, value_parser = parse_positive)]
    pub keep_every: Option<u64>,
    /// Also accept clients of this uid (repeatable); default: only our own uid.
    #[arg(long = "allow-uid")]
    pub allow_uids: Vec<u32>,
    /// Largest shard file (a larger tensor gets a shard of its own).
    #[arg(long, value_parser = parse_nonzero_size, default_value = "1GiB")]
    pub shard_size: u64,
    /// Run the sidecar's threads on these CPUs only, e.g. `1` or `2-7,12`
    /// (keeps them off a trainer's cores on a small machine); launch's
    /// command keeps the CPUs it would have had.
    #[arg(long, value_parser = parse_cpus)]
    pub cpus: Option<CpuList>,
    /// Several nodes: the directory every node's sidecar sees (a shared file
    /// system), where the ranks' parts of a step (SavePart) are written and
    /// committed together; --dir stays this node's own. The sidecar serving
    /// rank 0 coordinates each step's commit; a save sent without a rank
    /// (one process, no WORLD_SIZE) is rank 0 of a world of 1, committed
    /// there too. It must exist (never made: a missing one is likely a
    /// shared file system not mounted here).
    #[arg(long)]
    pub shared: Option<PathBuf>,
    /// With --shared: each node's ranks' shards go to this node's own
    /// --dir(s) (striped over them as a one-node save), in `node-step-…` folders; only
    /// blobs, markers and the index go to the shared directory, and the
    /// index names the node holding each file. A node's ranks load their
    /// own node's files from its disks; another node's files need a drain
    /// target (docs/guide.md, "Several nodes"). --shared with --drain
    /// implies it (each node drains its own files).
    #[arg(long, requires = "shared")]
    pub node_local: bool,
    /// This node's id in the index (with --node-local, or --shared and
    /// --drain): letters, digits, '.', '_', '-' (default: the host name).
    #[arg(long, requires = "shared", value_name = "NAME", value_parser = parse_node_id)]
    pub node_id: Option<String>,
    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics,
    /// e.g. 127.0.0.1:9464 (docs/metrics.md); port 0 picks a free one (logged).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Serve loads (and ls, status) only: take no directory lock, run no
    /// recovery, refuse saves and rollback. A directory whose lock file
    /// cannot be written (a read-only file system, no write permission) is
    /// served so without this flag too, as the log says at start.
    #[arg(long)]
    pub read_only: bool,
    /// Drain every committed step to this target after it is durable:
    /// file:///abs/path (a shared file system) or an object store
    /// (s3://bucket/prefix; gs://, az:// as object_store gives them),
    /// credentials from the standard environment (AWS_ACCESS_KEY_ID, ...,
    /// AWS_ENDPOINT_URL, AWS_ALLOW_HTTP). Checked at start: a wrong
    /// credential or an unreachable URL stops the sidecar. Loads read a
    /// step that is not local (or newer there) from it.
    #[arg(long, value_name = "URL")]
    pub drain: Option<String>,
    /// With --drain, drain every K-th step only (multiples of K).
    #[arg(long, requires = "drain", value_name = "K", allow_negative_numbers = true, value_parser = parse_positive, default_value_t = 1)]
    pub drain_every: u64,
    /// With --drain, keep only the newest N steps on the drain target.
    #[arg(long, requires = "drain", value_name = "N", allow_negative_numbers = true, value_parser = parse_keep)]
    pub drain_keep: Option<usize>,
    /// With --drain, upload at most SIZE per second (e.g. 500MB/s, 1GiB/s),
    /// so the next save's local writes are not starved.
    #[arg(long, requires = "drain", value_name = "SIZE/s", value_parser = parse_bandwidth)]
    pub drain_bandwidth: Option<u64>,
    /// Incremental checkpoints: on (default) takes a 128-bit digest of every
    /// tensor during the copy and hard-links, instead of writing, each
    /// stable shard whose tensors are unchanged since the newest committed
    /// step (docs/format.md, "Incremental checkpoints"); off writes every
    /// step in full and records no digests.
    #[arg(long, default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set, value_name = "on|off")]
    pub incremental: bool,
    /// With --incremental on, every K-th save is written in full (nothing
    /// linked), so a file is shared by at most K consecutive steps and one
    /// damaged file damages at most those; 0: never (default: 10).
    #[arg(long, default_value_t = ckpt_store::config::FULL_EVERY_DEFAULT, value_name = "K")]
    pub full_every: u32,
    /// Re-verify every committed step on disk, every byte, once per
    /// DURATION (e.g. 6h, 30m, 90s), in the background at idle CPU and
    /// I/O priority and bounded bandwidth; a damaged step is reported
    /// (status, log, metrics) and marked so loads pass over it (default: off).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub scrub_interval: Option<std::time::Duration>,
    /// Listen for peers (other nodes' sidecars) on ADDR:PORT: their
    /// replicas are held here, and this node's files sent to them after each
    /// durable step (docs/guide.md, "Peers"). Needs --shared, --node-local,
    /// --peers and --peer-secret-file.
    #[arg(long, value_name = "ADDR:PORT", requires_all = ["peers", "node_local"])]
    pub peer_listen: Option<std::net::SocketAddr>,
    /// The other nodes' sidecars' --peer-listen addresses (HOST:PORT, comma-separated).
    #[arg(long, value_name = "A,B,...", value_delimiter = ',', requires = "peer_listen")]
    pub peers: Vec<String>,
    /// The cluster secret (a file of 32 bytes or more, readable by its owner
    /// only, the same on every node): every peer connection proves it both
    /// ways before anything else. Also from CKPT_SIDECAR_PEER_SECRET_FILE.
    #[arg(long, value_name = "FILE")]
    pub peer_secret_file: Option<PathBuf>,
    /// Peers each of this node's steps is sent to (ring order by node id).
    #[arg(long, value_name = "K", requires = "peer_listen", value_parser = clap::value_parser!(u32).range(1..), default_value_t = ckpt_sidecar::config::PEER_REPLICAS_DEFAULT)]
    pub peer_replicas: u32,
    /// Newest steps of each peer held here.
    #[arg(long, value_name = "N", requires = "peer_listen", value_parser = parse_keep, default_value_t = ckpt_sidecar::config::PEER_KEEP_DEFAULT)]
    pub peer_keep: usize,
    /// Memory lent to other nodes' replicas at most (e.g. 16GiB); an offer
    /// that does not fit is refused (its node reports why).
    #[arg(long, value_name = "SIZE", requires = "peer_listen", value_parser = parse_nonzero_size, default_value_t = ckpt_sidecar::config::PEER_BUDGET_BYTES_DEFAULT)]
    pub peer_budget: u64,
    /// A peer connection silent this long is dropped (e.g. 30s, 5s): a cut
    /// link or a stalled peer fails that replication (reported, training
    /// goes on) or that fetch (the load tries its next source) after it,
    /// and never hangs it (default: 30s).
    #[arg(long, value_name = "DURATION", requires = "peer_listen", value_parser = parse_duration)]
    pub peer_timeout: Option<std::time::Duration>,
    /// Send this node's steps to its peers at most SIZE per second (e.g.
    /// 500MB/s, 1GiB/s), so replication leaves the link to the training's
    /// own traffic; restores from peers are not paced (default: unlimited).
    #[arg(long, value_name = "SIZE/s", requires = "peer_listen", value_parser = parse_bandwidth)]
    pub peer_bandwidth: Option<u64>,
    /// This node's failure domain (e.g. its rack, rack-07): its steps go to
    /// peers in other domains first, one domain per replica where there
    /// are enough, and to peers of its own only when no other takes them
    /// (said in the log). Default: none (every node its own).
    #[arg(long, value_name = "NAME", requires = "peer_listen", value_parser = parse_failure_domain)]
    pub failure_domain: Option<String>,
    /// A folder on this node's own disks for replicas of other nodes that
    /// do not fit --peer-budget: received into files in DIR/ckpt-peer-spill
    /// (every byte checked as in memory, again when read) instead of
    /// refused; that folder is emptied at start. Default: none (such an
    /// offer is refused).
    #[arg(long, value_name = "DIR", requires = "peer_listen")]
    pub peer_spill: Option<PathBuf>,
    /// No shared file system: --shared DIR is this node's own folder (on
    /// its own disk), and the peers carry what the nodes share. Each rank's
    /// marker and blobs go to the coordinator (rank 0's sidecar), which
    /// sends each committed step's index and blobs to every peer; a node
    /// answers its ranks Durable once its own folder holds the step's index
    /// and `latest`, and a sidecar starting on an empty one takes the newest
    /// step from its peers. --peers must list every other node (docs/guide.md,
    /// "Several nodes without a shared file system"). With --drain, each
    /// node's upload of a step is told to the coordinator by the peers.
    #[arg(long, requires = "peer_listen")]
    pub shared_over_peers: bool,
    #[command(flatten)]
    pub io: IoArgs,
}

/// The cluster secret's file: `given` (--peer-secret-file), else
/// CKPT_SIDECAR_PEER_SECRET_FILE; an error naming `needed_by` (the option
/// that needs it) when neither is set.
pub fn peer_secret_file(given: Option<PathBuf>, needed_by: &str) -> anyhow::Result<PathBuf> {
    let env = config::PEER_SECRET_FILE_ENV;
    given
        .or_else(|| std::env::var_os(env).map(PathBuf::from))
        .ok_or_else(|| anyhow::anyhow!("{needed_by} needs the cluster secret: --peer-secret-file FILE (or {env})"))
}

/// A failure domain's name: as a node id (letters, digits, `.`, `_`, `-`).
pub fn parse_failure_domain(s: &str) -> Result<String, String> {
    match ckpt_store::format::validate_node_id(s) {
        Ok(()) => Ok(s.to_string()),
        Err(_) => Err(format!("{s:?}: 1 to 64 of ASCII letters, digits, '.', '_', '-', not starting with '.'")),
    }
}

/// A bandwidth: a size (as everywhere, KB = 1000, KiB = 1024) per second,
/// with or without the `/s`.
pub fn parse_bandwidth(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let size = t.strip_suffix("/s").unwrap_or(t);
    parse_nonzero_size(size).map_err(|e| format!("{e} (a bandwidth is a size per second, e.g. 500MB/s)"))
}

/// A human duration: a number and a unit, `ms`, `s`, `m`, `h` or `d`
/// (`6h`, `90s`, `1.5h`), at least [`ckpt_sidecar::config::SCRUB_INTERVAL_MIN_MS`].
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let at = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (n, unit) = t.split_at(at);
    let per_unit_s = match unit.trim() {
        "ms" => 0.001,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        "" => return Err(format!("{s:?}: give a unit (ms, s, m, h, d), e.g. 6h")),
        u => return Err(format!("{s:?}: unknown unit {u:?} (ms, s, m, h, d)")),
    };
    let n: f64 = n.parse().map_err(|_| format!("{s:?}: expected a number and a unit, e.g. 6h"))?;
    let d = std::time::Duration::try_from_secs_f64(n * per_unit_s).map_err(|e| format!("{s:?}: {e}"))?;
    let min = std::time::Duration::from_millis(ckpt_sidecar::config::SCRUB_INTERVAL_MIN_MS);
    if d < min {
        return Err(format!("{s:?}: at least {} ms", min.as_millis()));
    }
    Ok(d)
}

pub fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
}

#[derive(Subcommand)]
pub enum Cmd {
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
        /// Also ask these sidecars' peer ports (HOST:PORT, comma-separated)
        /// which nodes' steps they hold in memory (needs the cluster secret:
        /// --peer-secret-file or CKPT_SIDECAR_PEER_SECRET_FILE).
        #[arg(long, value_name = "A,B,...", value_delimiter = ',')]
        peers: Vec<String>,
        /// The cluster secret, for --peers.
        #[arg(long, value_name = "FILE", requires = "peers")]
        peer_secret_file: Option<PathBuf>,
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
pub enum BenchCmd {
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
    Compare(CompareArgs),
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
    /// The per-tensor cost of a save: states of many small tensors in shared
    /// memory (1,000 x 4 KiB alternated with one 4 MiB tensor; N x 1 KiB saved
    /// repeatedly, through the Python package and the C ABI), each beside one
    /// tensor of the same bytes, a changed structure's replan, load, the
    /// index's size, and several ranks on one sidecar. Runs the Python module
    /// ckpt_sidecar.bench_tensors (numpy; the Python of $CKPT_SIDECAR_PYTHON,
    /// else python3); its options (--dir DIR [--counts 1000,10000,100000]
    /// [--incremental-off] [--ranks 2] [--rank-tensors 10000] [--json];
    /// --help lists them) are passed on as they are.
    #[command(disable_help_flag = true)]
    Tensors {
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

// `bench compare`'s options, passed on to ckpt_sidecar.bench_compare; its
// help text is the `Compare` variant's doc comment.
#[derive(Args)]
pub struct CompareArgs {
    /// Directory on the disk to measure (a temp folder inside, removed at the end).
    #[arg(long)]
    pub dir: PathBuf,
    /// State sizes, comma-separated (e.g. 256MiB,1GiB,4GiB).
    #[arg(long, value_parser = parse_nonzero_size, value_delimiter = ',', default_value = "256MiB")]
    pub sizes: Vec<u64>,
    /// Timed rounds per size (the figures are medians); methods rotate between rounds.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub rounds: u32,
    /// Untimed rounds first, so every method's memory is warm.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub warmup: u32,
    /// Only these methods (comma-separated; default: all).
    #[arg(long)]
    pub methods: Option<String>,
    /// Print the figures as one JSON document on the last line of standard output.
    #[arg(long)]
    pub json: bool,
    /// Also draw stall and throughput per method and size into this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// The Python to run it with (default: $CKPT_SIDECAR_PYTHON, else python3).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Also the training-loop benchmark: a small model trained with a
    /// checkpoint every step, every 10 steps and never, through each method.
    #[arg(long = "loop")]
    pub with_loop: bool,
    /// Only the training-loop benchmark.
    #[arg(long, conflicts_with = "with_loop")]
    pub loop_only: bool,
    /// Parameter bytes of the loop's model (e.g. 32MiB).
    #[arg(long, value_parser = parse_nonzero_size)]
    pub loop_size: Option<u64>,
    /// Training steps per loop.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub loop_steps: Option<u32>,
    /// Rounds of the training loop, methods rotated between rounds (medians).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub loop_rounds: Option<u32>,
    /// What a step's compute is: gpu_like (a sleep, the CPU free) or cpu.
    #[arg(long, value_parser = ["gpu_like", "cpu"])]
    pub loop_kind: Option<String>,
    /// With --loop/--loop-only: run the sidecar's loop again with
    /// `serve --drain URL` and print its overhead beside the plain loop's.
    #[arg(long, value_name = "URL")]
    pub drain: Option<String>,
    /// With --loop/--loop-only: run the sidecar's loop again with
    /// `serve --scrub-interval DURATION` and print its overhead beside the
    /// plain loop's.
    #[arg(long, value_name = "DURATION")]
    pub scrub_interval: Option<String>,
    /// With --loop/--loop-only: run the sidecar's loop twice more as node a
    /// of two nodes (`serve --shared S --node-local`): alone, then with node
    /// b's sidecar as its peer (`--peer-replicas 1`, every step replicated
    /// into b's memory), and print both.
    #[arg(long)]
    pub peers: bool,
    /// With --peers: run the loop with the peer once more, node a's
    /// replication paced by `serve --peer-bandwidth SIZE/s`, and print it
    /// beside the unpaced one.
    #[arg(long, value_name = "SIZE/s", requires = "peers")]
    pub peer_bandwidth: Option<String>,
    /// LoRA-like states: each size is a frozen base plus adapters of
    /// this size with AdamW-like moments written before every save; adds
    /// the methods sidecar_trust and sidecar_changed_only.
    #[arg(long, value_parser = parse_nonzero_size)]
    pub lora: Option<u64>,
    /// The training loop with a LoRA-like model (frozen MLP, rank-8
    /// adapters); adds the loop method sidecar_trust.
    #[arg(long)]
    pub loop_lora: bool,
}

#[derive(Subcommand)]
pub enum DebugCmd {
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
