//! `debug` (hidden): commands the test suite drives. `write-raw` commits
//! tensors given as raw files, so a test checks the format against bytes it
//! chose; `torture` commits synthetic checkpoints with retention forever,
//! for the crash tests to kill at random points.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use serde_json::json;

use ckpt_store::catalog;
use ckpt_store::commit::{Store, StoreOptions};
use ckpt_store::format::{self, Dtype};
use ckpt_store::image::{Blob, Layout, LayoutOptions, TensorSpec};
use ckpt_store::io::IoPolicy;
use ckpt_store::mem::AlignedBuf;
use ckpt_store::retention::Retention;
use ckpt_store::synthetic;

use super::args::DebugCmd;

/// `write-raw`'s manifest: each tensor or blob and the raw file holding its bytes.
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

pub fn debug_cmd(what: DebugCmd) -> anyhow::Result<ExitCode> {
    match what {
        DebugCmd::WriteRaw { manifest, dirs, step, shard_size, io } => {
            write_raw(&manifest, &dirs, step, shard_size, io.policy())?
        }
        DebugCmd::Torture { dirs, size, keep, count, io } => torture(&dirs, size, keep, count, io.policy())?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Commits step `step` of the tensors and blobs `manifest` lists, each read
/// from its raw file (relative to the manifest's folder); prints the commit.
fn write_raw(manifest: &Path, dirs: &[PathBuf], step: u64, shard_size: u64, io: IoPolicy) -> anyhow::Result<()> {
    let base = manifest.parent().unwrap_or(Path::new(".")).to_path_buf();
    let m: Manifest = serde_json::from_slice(&std::fs::read(manifest)?).context("parsing the manifest")?;
    let specs = m
        .tensors
        .iter()
        .map(|t| Ok(TensorSpec { name: t.name.clone(), dtype: Dtype::parse(&t.dtype)?, shape: t.shape.clone() }))
        .collect::<Result<Vec<_>, format::FormatError>>()?;
    let mut store = Store::open(StoreOptions { io, ..StoreOptions::new(dirs.to_vec()) })?;
    let layout =
        Layout::plan(specs, LayoutOptions { n_dirs: dirs.len(), shard_bytes_max: shard_size, ..Default::default() })?;
    let mut staging = AlignedBuf::new(layout.staging_len as usize)?;
    layout.write_headers(staging.as_mut_slice());
    for (i, t) in m.tensors.iter().enumerate() {
        let bytes = std::fs::read(base.join(&t.file)).with_context(|| format!("reading {}", t.file.display()))?;
        let r = layout.tensor_range(i);
        if bytes.len() != r.len() {
            bail!("{}: {} bytes, but {} {:?} needs {}", t.file.display(), bytes.len(), t.dtype, t.shape, r.len());
        }
        staging.as_mut_slice()[r].copy_from_slice(&bytes);
    }
    let blob_bytes = m.blobs.iter().map(|b| std::fs::read(base.join(&b.file))).collect::<Result<Vec<_>, _>>()?;
    let blobs: Vec<Blob> = m.blobs.iter().zip(&blob_bytes).map(|(b, bytes)| Blob { name: &b.name, bytes }).collect();
    let crcs = layout.tensor_crcs(staging.as_slice());
    let r = store.commit(step, &layout, &staging, &crcs, &blobs)?;
    println!("{}", json!({"step": r.step, "path": r.path, "bytes": r.bytes, "engine": store.engine_names()}));
    Ok(())
}

/// Commits synthetic checkpoints of `size` from one past the newest step
/// on, `count` of them (None: forever), keeping the newest `keep`.
fn torture(dirs: &[PathBuf], size: u64, keep: usize, count: Option<u64>, io: IoPolicy) -> anyhow::Result<()> {
    let mut store = Store::open(StoreOptions {
        io,
        retention: Some(Retention { keep_last: keep, keep_every: None }),
        ..StoreOptions::new(dirs.to_vec())
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
    Ok(())
}
