//! The `ckpt-bench` binary: benchmarks that play the trainer (the real
//! client) against a real sidecar process. `ckpt-sidecar bench stall` runs
//! it; it can be run by itself too. Exit codes: 0 success, 1 error, 2 usage;
//! every error is one line on stderr, each cause said once (as ckpt-sidecar).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use ckpt_bench::{incremental, stall};
use ckpt_store::catalog;
use ckpt_store::units::{human_bytes, parse_size};

/// A size that must be at least one byte (`--size`, `--staging`).
fn parse_nonzero_size(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err(format!("size {s:?} must be at least 1 byte")),
        n => Ok(n),
    }
}

#[derive(Parser)]
#[command(name = "ckpt-bench", version, about = "Benchmarks of ckpt-sidecar through the real client")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The trainer's stall per save through a real client and a real sidecar
    /// process (`$CKPT_SIDECAR_BIN`, else the `ckpt-sidecar` beside this
    /// binary), beside one memcpy of the same bytes; persist throughput,
    /// sidecar memory, optionally fio and torch.save + fsync.
    Stall {
        /// Target directory (committed checkpoints stay there).
        #[arg(long)]
        dir: PathBuf,
        /// Size of the synthetic ~50-tensor state.
        #[arg(long, value_parser = parse_nonzero_size)]
        size: u64,
        /// Also time torch.save + fsync of a state of the same size with this Python.
        #[arg(long)]
        python: Option<PathBuf>,
        /// Staging budget of the sidecar (default: room for two images of SIZE).
        #[arg(long, value_parser = parse_nonzero_size)]
        staging: Option<u64>,
        /// Saves to measure.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        repeats: u32,
        /// Also run fio with the checkpoint's size in the same directory, first, and print the ratio.
        #[arg(long)]
        compare_fio: bool,
        #[arg(long)]
        json: bool,
    },
    /// Incremental checkpoints: a LoRA-like state saved every
    /// step (bytes written and time to durable beside saving the changed
    /// tensors alone, through a second sidecar), and a full save with
    /// detection on vs off, alternated. Subfolders of DIR are replaced.
    Incremental {
        /// Directory on the disk to measure (subfolders lora/, changed-alone/, full-on/, full-off/).
        #[arg(long)]
        dir: PathBuf,
        /// The frozen base.
        #[arg(long, value_parser = parse_nonzero_size, default_value = "1GiB")]
        base: u64,
        /// The adapters' parameters (each with two AdamW-like moments of the same size).
        #[arg(long, value_parser = parse_nonzero_size, default_value = "16MiB")]
        adapters: u64,
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(2..=10_000))]
        steps: u32,
        /// Rounds of the full save with detection on and off (after two warm-up rounds).
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
        full_rounds: u32,
        /// Saves ask for a lazy release (as the Python package's): checksums and digests during the copy.
        #[arg(long)]
        lazy_release: bool,
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            // clap's text up to its first blank line, as one line.
            let text = e.render().to_string();
            let msg: Vec<&str> = text.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
            eprintln!("{} (see --help)", msg.join(" "));
            return ExitCode::from(2);
        }
    };
    // A closed stdout (`| head`) ends this tool quietly, as other Unix tools;
    // the figures are printed after the sidecar it ran has stopped. Its
    // socket writes go through the client, which never raises SIGPIPE.
    // SAFETY: setting a signal's disposition before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let r = match cli.cmd {
        Cmd::Stall { dir, size, python, staging, repeats, compare_fio, json } => {
            // The sidecar it starts creates the directory; a failed run
            // removes what it made (only folders left empty).
            let made: Vec<PathBuf> = dir
                .ancestors()
                .filter(|a| !a.as_os_str().is_empty())
                .take_while(|a| std::fs::symlink_metadata(a).is_err())
                .map(Path::to_path_buf)
                .collect();
            let r = check_stall_args(&dir, python.as_deref()).and_then(|()| {
                stall::run(&stall::StallArgs {
                    dir,
                    size_bytes: size,
                    python,
                    staging_bytes: staging,
                    repeats: repeats as usize,
                    compare_fio,
                })
            });
            if r.is_err() {
                for p in &made {
                    let _ = std::fs::remove_dir(p);
                }
            }
            r.and_then(|f| print_stall(&f, json))
        }
        Cmd::Incremental { dir, base, adapters, steps, full_rounds, lazy_release, json } => {
            incremental::run(&incremental::IncrementalArgs {
                dir,
                base_bytes: base,
                adapter_bytes: adapters,
                steps: steps as usize,
                full_rounds: full_rounds as usize,
                lazy_release,
            })
            .and_then(|f| print_incremental(&f, json))
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The directory is one (or does not exist yet), and `--python` can be run.
fn check_stall_args(dir: &Path, python: Option<&Path>) -> anyhow::Result<()> {
    match catalog::check_dir(dir) {
        Err(catalog::DirError::NoSuchDir(_)) | Ok(()) => {}
        Err(e) => return Err(e.into()),
    }
    if let Some(py) = python {
        use std::os::unix::fs::PermissionsExt;
        let runnable =
            |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
        let found = if py.components().count() > 1 {
            runnable(py)
        } else {
            std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|d| runnable(&d.join(py))))
        };
        anyhow::ensure!(found, "--python {}: no such program (give the path of an executable)", py.display());
    }
    Ok(())
}

/// An error and its causes, each said once, on one line.
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
    line.replace('\n', " ")
}

fn print_incremental(f: &incremental::IncrementalFigures, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(f)?);
        return Ok(());
    }
    println!(
        "op: incremental (real client -> real sidecars, host memory, {}, {} release)",
        f.memory,
        if f.lazy_release { "lazy" } else { "early" }
    );
    println!(
        "state: frozen base {}, changing {} (adapters + 2 moments) every step",
        human_bytes(f.base_bytes),
        human_bytes(f.changing_bytes)
    );
    println!(
        "{:>5} {:>12} {:>12} {:>8} {:>9} {:>10} {:>10} {:>8}",
        "step", "written", "changed+idx", "w/c", "stall_s", "durable_s", "alone_s", "d/alone"
    );
    for s in &f.steps {
        println!(
            "{:>5} {:>12} {:>12} {:>8.3} {:>9.4} {:>10.4} {:>10.4} {:>8.2}",
            s.step,
            human_bytes(s.written_bytes),
            human_bytes(s.changed_bytes),
            s.written_over_changed,
            s.stall_seconds,
            s.durable_seconds,
            s.alone_durable_seconds,
            s.durable_over_alone
        );
    }
    println!(
        "median over linked steps: written/changed {:.3} (bar 1.1), durable/alone {:.2} (bar 1.5)",
        f.written_over_changed_median, f.durable_over_alone_median
    );
    let secs = |v: &[f64]| v.iter().map(|s| format!("{s:.3}")).collect::<Vec<_>>().join(" ");
    let full = &f.full;
    println!("full save of {} (every tensor changed), detection on vs off, alternated:", human_bytes(full.bytes));
    println!(
        "  stall   on  {}   off {}   median on/off {:.3} (bar 1.05)",
        secs(&full.on_stall_seconds),
        secs(&full.off_stall_seconds),
        full.stall_on_over_off
    );
    println!(
        "  durable on  {}   off {}   median on/off {:.3} (bar 1.05)",
        secs(&full.on_durable_seconds),
        secs(&full.off_durable_seconds),
        full.durable_on_over_off
    );
    println!(
        "  second save after start (no history yet: all stable, shards wait for the digests; not in the medians): durable on {:.3} off {:.3}",
        full.on_second_save_durable_seconds, full.off_second_save_durable_seconds
    );
    Ok(())
}

fn print_stall(f: &stall::StallFigures, json: bool) -> anyhow::Result<()> {
    let secs = |v: &[f64]| v.iter().map(|s| format!("{s:.4}")).collect::<Vec<_>>().join(" ");
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    println!("op:                 stall (real client -> real sidecar pid {}, host memory)", f.sidecar_pid);
    println!(
        "bytes:              {} ({}) in {} tensors; files {} ({})",
        f.bytes,
        human_bytes(f.bytes),
        f.n_tensors,
        f.file_bytes,
        human_bytes(f.file_bytes)
    );
    println!("steps:              {:?}", f.steps);
    println!("stall s:            {} (save() until Released)", secs(&f.stall_seconds));
    println!("stall median/max:   {:.4} / {:.4} s", f.stall_seconds_median, f.stall_seconds_max);
    println!("sidecar copy s:     {} (median {:.4}; from Released)", secs(&f.copy_seconds), f.copy_seconds_median);
    println!("memcpy s:           {} (one thread, same bytes, same run)", secs(&f.memcpy_seconds));
    println!(
        "memcpy median:      {:.4} s ({:.2} GiB/s)",
        f.memcpy_seconds_median,
        f.bytes as f64 / f.memcpy_seconds_median / (1u64 << 30) as f64
    );
    println!(
        "stall / memcpy:     {:.3} (bar <= {}: {})",
        f.stall_over_memcpy,
        stall::BAR_STALL_OVER_MEMCPY,
        verdict(f.stall_over_memcpy <= stall::BAR_STALL_OVER_MEMCPY)
    );
    println!("persist s:          {}", secs(&f.persist_seconds));
    println!("persist gib_per_s:  {:.3} (median)", f.persist_gib_per_s);
    println!("released->durable:  {:.4} s (median, seen by the client)", f.release_to_durable_seconds_median);
    if let (Some(fio), Some(r)) = (f.fio_gib_per_s, f.persist_over_fio) {
        println!("fio gib_per_s:      {fio:.3} (same size, same directory, just before)");
        println!(
            "persist / fio:      {r:.3} (bar >= {}: {})",
            stall::BAR_PERSIST_OVER_FIO,
            verdict(r >= stall::BAR_PERSIST_OVER_FIO)
        );
    }
    let limit = f.staging_bytes + stall::BAR_RSS_OVER_STAGING_BYTES;
    println!("staging:            {} ({})", f.staging_bytes, human_bytes(f.staging_bytes));
    println!(
        "sidecar RssAnon:    {} ({}; max during the saves; bar <= staging + 64 MiB: {})",
        f.sidecar_rss_anon_bytes,
        human_bytes(f.sidecar_rss_anon_bytes),
        verdict(f.sidecar_rss_anon_bytes <= limit)
    );
    println!(
        "sidecar VmRSS:      {} ({}; RssFile {}, RssShmem {} = the client's region mapped read-only; VmRSS - RssShmem {}: {})",
        f.sidecar_rss_bytes,
        human_bytes(f.sidecar_rss_bytes),
        human_bytes(f.sidecar_rss_file_bytes),
        human_bytes(f.sidecar_rss_shmem_bytes),
        human_bytes(f.sidecar_rss_bytes.saturating_sub(f.sidecar_rss_shmem_bytes)),
        verdict(f.sidecar_rss_bytes.saturating_sub(f.sidecar_rss_shmem_bytes) <= limit)
    );
    match (f.torch_save_seconds, &f.torch_note) {
        (Some(s), note) => println!(
            "torch.save+fsync:   {s:.3} s ({}); stall is {:.1}x below",
            note.as_deref().unwrap_or(""),
            s / f.stall_seconds_median
        ),
        (None, Some(why)) => println!("torch.save+fsync:   none: {why}"),
        (None, None) => {}
    }
    println!("memory:             {} (prepared in {:.2} s, untimed)", f.memory, f.prepare_seconds);
    if json {
        println!("{}", serde_json::to_string(f)?);
    }
    Ok(())
}
