//! `bench drain`: the drain tier's upload and download against the plain
//! object_store client on the same target in the same run (and, for
//! file://, fio's write into that directory), and the restore of the step
//! through the sidecar's load path (`load::load_remote_step`: what Load
//! and LoadPacked do for a step only the target holds, every checksum
//! verified) beside the plain client's download of the same bytes.
//! Figures only.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use ckpt_sidecar::drain::{Drain, DrainOptions};
use ckpt_sidecar::load;
use ckpt_store::mem::AlignedBuf;

use ckpt_store::bench;
use ckpt_store::units::human_bytes;
use ckpt_tier::bench::{self as tier_bench, DrainBenchArgs, DrainFigures};
use ckpt_tier::TargetOptions;

/// `bench drain`'s options (`args::BenchCmd::Drain`).
pub struct Args {
    pub url: String,
    pub size: u64,
    pub local: PathBuf,
    pub shard_size: u64,
    pub parallel: usize,
    pub part_size: u64,
    pub json: bool,
}

/// `bench drain`: measures, then prints the figures; the local step is
/// removed whatever happened.
pub fn run(a: &Args) -> anyhow::Result<()> {
    // fio first, into the target directory, while nothing else runs.
    let fio = match tier_bench::file_url_dir(&a.url) {
        Some(dir) => Some(
            bench::fio_gib_per_s(&dir, a.size, "write").with_context(|| format!("fio write into {}", dir.display()))?,
        ),
        None => None,
    };
    let local = tempfile_in(&a.local)?;
    let r = measure(a, &local);
    let _ = std::fs::remove_dir_all(&local);
    let f = r?;
    print_figures(&f, fio, a.json)
}

/// Writes the local step into `local`, then runs the tier's drain
/// benchmark on it (restores through the sidecar's own load path).
fn measure(a: &Args, local: &Path) -> anyhow::Result<DrainFigures> {
    let w = bench::write(&bench::WriteArgs {
        dirs: vec![local.to_path_buf()],
        size_bytes: a.size,
        step: Some(1),
        io: Default::default(),
        shard_bytes_max: a.shard_size,
        compare_fio: false,
    })?;
    let (files, index_json) =
        tier_bench::local_step(local, w.step).with_context(|| format!("reading the step in {}", local.display()))?;
    let opts =
        TargetOptions { bandwidth_bytes_per_s: None, parallel: a.parallel, part_size_bytes: a.part_size as usize };
    let index = ckpt_store::format::Index::from_json_bytes(&index_json)?;
    let need_bytes = ckpt_store::restore::load_len_bytes(&index) as usize;
    // The daemon's load path: a sidecar whose directory lacks the step
    // (an empty one) and whose drain is the target our upload went to.
    let empty = local.join("empty");
    std::fs::create_dir_all(&empty)?;
    let restore = move |url: &str, step: u64| -> Result<f64, String> {
        let drain = Drain::open(
            DrainOptions { url: url.to_string(), every: 1, keep: None, bandwidth_bytes_per_s: None },
            vec![empty.clone()],
        )
        .map_err(|e| e.to_string())?;
        // Memory as the daemon's staging is: allocated and touched before.
        let mut dest = AlignedBuf::new(need_bytes.max(1)).map_err(|e| e.to_string())?;
        dest.as_mut_slice().iter_mut().step_by(4096).for_each(|b| *b = 1);
        let t0 = Instant::now();
        load::load_remote_step(&drain, step, dest.as_mut_slice())?;
        Ok(t0.elapsed().as_secs_f64())
    };
    Ok(tier_bench::drain(&DrainBenchArgs {
        url: a.url.clone(),
        step: w.step,
        files,
        index_json,
        opts,
        restore: Some(Box::new(restore)),
        from_memory: true,
    })?)
}

/// The figures, one line per phase (ours beside the plain client), and
/// with `json` one JSON document after them.
fn print_figures(f: &DrainFigures, fio: Option<f64>, json: bool) -> anyhow::Result<()> {
    let gib = |secs: f64| bench::gib_per_s(f.bytes, secs);
    println!(
        "drain {}: {} in {} files, {} parts of {} in flight",
        f.url,
        human_bytes(f.bytes),
        f.files,
        f.parallel,
        human_bytes(f.part_size_bytes as u64)
    );
    println!(
        "upload    ours (upload_step)        {:>7.3} s {:>7.3} GiB/s | plain object_store WriteMultipart {:>7.3} s {:>7.3} GiB/s | ours/plain {:.2}",
        f.upload_seconds,
        gib(f.upload_seconds),
        f.plain_upload_seconds,
        gib(f.plain_upload_seconds),
        f.upload_ratio()
    );
    if let Some(m) = f.upload_from_memory_seconds {
        println!(
            "upload    ours from memory (staging) {:>7.3} s {:>7.3} GiB/s | (the daemon's path while the step is resident)                  | ours/plain {:.2}",
            m,
            gib(m),
            f.plain_upload_seconds / m.max(1e-12)
        );
    }
    println!(
        "download  ours (read_range)         {:>7.3} s {:>7.3} GiB/s | plain object_store get            {:>7.3} s {:>7.3} GiB/s | ours/plain {:.2}",
        f.download_seconds,
        gib(f.download_seconds),
        f.plain_download_seconds,
        gib(f.plain_download_seconds),
        f.download_ratio()
    );
    if let (Some(r), Some(again), Some(ratio)) = (f.restore_seconds, f.plain_download_again_seconds, f.restore_ratio())
    {
        println!(
            "restore   ours (the sidecar's load) {:>7.3} s {:>7.3} GiB/s | plain object_store get (again)    {:>7.3} s {:>7.3} GiB/s | ours/plain {:.2}",
            r,
            gib(r),
            again,
            gib(again),
            ratio
        );
    }
    if let Some(fio) = fio {
        println!(
            "fio write into the directory (bs 4M, O_DIRECT, iodepth 16): {fio:.3} GiB/s | ours/fio {:.2} (from disk)",
            gib(f.upload_seconds) / fio
        );
        if let Some(m) = f.upload_from_memory_seconds {
            println!("ours from memory / fio {:.2}", gib(m) / fio);
        }
    }
    if json {
        let mut j = serde_json::to_value(f)?;
        j["upload_ratio"] = f.upload_ratio().into();
        j["download_ratio"] = f.download_ratio().into();
        j["restore_ratio"] = f.restore_ratio().into();
        j["fio_write_gib_per_s"] = fio.into();
        j["upload_ratio_to_fio"] = fio.map(|x| gib(f.upload_seconds) / x).into();
        j["upload_from_memory_ratio_to_fio"] = fio.zip(f.upload_from_memory_seconds).map(|(x, m)| gib(m) / x).into();
        println!("{j}");
    }
    Ok(())
}

/// A fresh folder inside `dir` for the local step.
fn tempfile_in(dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    let p = dir.join(format!("ckpt-bench-drain-{}", std::process::id()));
    std::fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
    Ok(p)
}
