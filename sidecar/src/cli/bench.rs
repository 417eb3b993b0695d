//! `bench`: the engine's own figures (`write`, `read`), and the benchmarks
//! that live elsewhere run as children measuring this very binary:
//! ckpt-bench (`stall`, `incremental`), the Python package (`compare`,
//! `ranks`), and the drain tier's (`drain`, `bench_drain.rs`). A child's
//! exit status is passed on as ours.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};

use ckpt_store::bench;
use ckpt_store::catalog;
use ckpt_store::units::human_bytes;

use super::args::{BenchCmd, CompareArgs};

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

/// Runs `PYTHON -m MODULE ARGS` ([`python_module`]); its exit status is ours.
fn python_bench(python: &Path, module: &str, args: &[OsString]) -> anyhow::Result<ExitCode> {
    let mut cmd = python_module(python, module)?;
    cmd.args(args);
    let status = cmd.status().with_context(|| format!("running {} -m {module}", python.display()))?;
    Ok(child_exit(status))
}

/// Runs `ckpt-bench SUB ARGS` from beside this binary, measuring this very
/// binary as the sidecar; its exit status is ours. The trainer's side of
/// these benchmarks lives in ckpt-bench, so that this binary links no
/// client code.
fn ckpt_bench(sub: &str, args: &[OsString]) -> anyhow::Result<ExitCode> {
    let me = std::env::current_exe().context("finding this executable")?;
    let bench = me.with_file_name("ckpt-bench");
    if !bench.is_file() {
        bail!("bench {sub} needs ckpt-bench beside {} (build it: cargo build --release -p ckpt-bench)", me.display());
    }
    let status = std::process::Command::new(&bench)
        .arg(sub)
        .args(args)
        .env("CKPT_SIDECAR_BIN", &me)
        .status()
        .with_context(|| format!("running {}", bench.display()))?;
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

pub fn bench_cmd(what: BenchCmd) -> anyhow::Result<ExitCode> {
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
        BenchCmd::Incremental { args } => return ckpt_bench("incremental", &args),
        BenchCmd::Stall { args } => return ckpt_bench("stall", &args),
        BenchCmd::Drain { url, size, local, shard_size, parallel, part_size, json } => {
            super::bench_drain::run(&super::bench_drain::Args {
                url,
                size,
                local,
                shard_size,
                parallel,
                part_size,
                json,
            })?;
        }
        BenchCmd::Ranks { args } => return python_bench(&bench_python(None), "ckpt_sidecar.bench_ranks", &args),
        BenchCmd::Tensors { args } => return python_bench(&bench_python(None), "ckpt_sidecar.bench_tensors", &args),
        BenchCmd::Compare(a) => {
            // The comparison drives Python libraries (torch, safetensors, DCP):
            // it lives in the Python package, measuring this very binary.
            let python = bench_python(a.python.clone());
            return python_bench(&python, "ckpt_sidecar.bench_compare", &compare_args(a));
        }
        BenchCmd::Read { dir, compare_fio, json, io } => {
            catalog::check_dir(&dir)?;
            let f = bench::read(&bench::ReadArgs { dir, io: io.policy(), compare_fio })?;
            print_figures(&f, json)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `bench compare`'s options as ckpt_sidecar.bench_compare takes them.
fn compare_args(a: CompareArgs) -> Vec<OsString> {
    let sizes: Vec<String> = a.sizes.iter().map(u64::to_string).collect();
    let mut args: Vec<OsString> = vec!["--dir".into(), a.dir.into()];
    for (flag, value) in
        [("--sizes", sizes.join(",")), ("--rounds", a.rounds.to_string()), ("--warmup", a.warmup.to_string())]
    {
        args.extend([flag.into(), value.into()]);
    }
    if let Some(m) = a.methods {
        args.extend(["--methods".into(), m.into()]);
    }
    if a.json {
        args.push("--json".into());
    }
    if let Some(p) = a.plot {
        args.extend(["--plot".into(), p.into()]);
    }
    if a.with_loop {
        args.push("--loop".into());
    }
    if a.loop_only {
        args.push("--loop-only".into());
    }
    if let Some(l) = a.lora {
        args.extend(["--lora".into(), l.to_string().into()]);
    }
    if a.loop_lora {
        args.push("--loop-lora".into());
    }
    if a.peers {
        args.push("--peers".into());
    }
    let loop_values = [
        ("--loop-size", a.loop_size.map(|v| v.to_string())),
        ("--loop-steps", a.loop_steps.map(|v| v.to_string())),
        ("--loop-rounds", a.loop_rounds.map(|v| v.to_string())),
        ("--loop-kind", a.loop_kind),
        ("--drain", a.drain),
        ("--scrub-interval", a.scrub_interval),
        ("--peer-bandwidth", a.peer_bandwidth),
    ];
    for (flag, value) in loop_values {
        if let Some(v) = value {
            args.extend([flag.into(), v.into()]);
        }
    }
    args
}
