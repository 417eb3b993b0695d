//! `ls`, `inspect` and `verify` of a drain target (`file:///dir`,
//! `s3://bucket/prefix`): the same output as for a local directory, the
//! bytes read through ckpt-tier (credentials from the standard AWS_*
//! environment).

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context};
use serde_json::json;

use ckpt_sidecar::config;
use ckpt_store::format::{self, Index};
use ckpt_store::source::{self, SourceError, StepSource};
use ckpt_tier::{Target, TargetOptions, TierError};

/// The URL a command's DIR argument is, when it is one (`scheme://...`).
pub fn url_of(dir: &Path) -> Option<&str> {
    dir.to_str().filter(|s| s.contains("://"))
}

fn open(url: &str) -> anyhow::Result<Target> {
    Ok(Target::open(url, TargetOptions::default())?)
}

fn step_location(t: &Target, step: u64) -> String {
    format!("{}/{}", t.url(), format::step_dir_name(step).expect("a listed step"))
}

pub fn ls(url: &str, json: bool) -> anyhow::Result<ExitCode> {
    let t = open(url)?;
    let steps = t.steps()?;
    let latest = t.latest()?;
    let mut rows = Vec::new();
    for s in steps {
        let (tensors, bytes, world_size, per_rank) = match t.get_index(s) {
            // Deleted since it was listed (the drain's --drain-keep): not shown.
            Err(TierError::NotFound { .. }) => continue,
            Err(e) => return Err(e.into()),
            Ok(b) => match source::parse_index(&b, s) {
                Ok(i) => {
                    let per_rank: Vec<u64> = ckpt_store::ranks::bytes_per_rank(&i).into_values().collect();
                    (
                        Some(i.logical().len()),
                        Some(i.ckpt.files.iter().map(|f| f.len_bytes).sum::<u64>()),
                        Some(i.ckpt.world_size),
                        Some(per_rank),
                    )
                }
                Err(_) => (None, None, None, None),
            },
        };
        let damaged = bytes.is_none();
        let damage: Vec<&str> = if damaged { vec!["index unreadable"] } else { Vec::new() };
        rows.push(json!({"step": s, "path": step_location(&t, s), "latest": Some(s) == latest, "tensors": tensors, "bytes": bytes, "world_size": world_size, "bytes_per_rank": per_rank, "damaged": damaged, "damage": damage}));
    }
    let doc = json!({"url": t.url(), "latest": latest, "checked": "index readable", "not_checked": "the files (presence, sizes, checksums) on a drain target: run verify", "checkpoints": rows});
    super::print::print_ls(t.url(), doc, json);
    Ok(ExitCode::SUCCESS)
}

fn read_index(t: &Target, step: u64) -> anyhow::Result<Index> {
    let bytes = t.get_index(step)?;
    source::parse_index(&bytes, step).map_err(|p| anyhow::anyhow!("{}: step {step}: {p}", t.url()))
}

pub fn inspect(url: &str, step: Option<u64>, json: bool) -> anyhow::Result<ExitCode> {
    let t = open(url)?;
    let step = match step {
        Some(s) => s,
        None => t.latest()?.with_context(|| format!("{}: no committed checkpoint", t.url()))?,
    };
    let index = read_index(&t, step)?;
    super::print::print_inspect(&index, &step_location(&t, step), json)?;
    Ok(ExitCode::SUCCESS)
}

/// A step's files on a drain target, for the engine's checks.
struct TargetSource<'a> {
    t: &'a Target,
    step: u64,
}

impl StepSource for TargetSource<'_> {
    fn file_len(&mut self, name: &str) -> Result<u64, SourceError> {
        Ok(self.t.file_len(self.step, name)?)
    }

    fn read(&mut self, name: &str, offset: u64, dst: &mut [u8]) -> Result<(), SourceError> {
        Ok(self.t.read_range(self.step, name, offset, dst)?)
    }
}

pub fn verify(
    url: &str,
    step: Option<u64>,
    secondaries: &[std::path::PathBuf],
    json: bool,
) -> anyhow::Result<ExitCode> {
    if !secondaries.is_empty() {
        bail!("--secondary is for a local directory: a drain target holds every file of a step in its step folder");
    }
    let t = open(url)?;
    let steps = match step {
        Some(s) => vec![s],
        None => t.steps()?,
    };
    if steps.is_empty() {
        bail!("{}: no committed checkpoint to verify", t.url());
    }
    let mut results = Vec::new();
    let mut damaged = false;
    for s in steps {
        let index_bytes = match t.get_index(s) {
            Ok(b) => b,
            Err(TierError::NotFound { .. }) if step.is_some() => {
                bail!("{}: step {s} is not committed there (no index)", t.url())
            }
            Err(TierError::NotFound { .. }) => {
                if !json {
                    println!("step {s}: deleted while being verified (the drain's retention); not checked");
                }
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let mut src = TargetSource { t: &t, step: s };
        let r = source::verify_source(&index_bytes, s, &mut src, config::REMOTE_VERIFY_WINDOW_BYTES, |_, _| {});
        damaged |= !r.problems.is_empty();
        let index = source::parse_index(&index_bytes, s).ok();
        if !json {
            super::print::print_verify(&r);
            if let Some(i) = &index {
                println!("  {}", ckpt_store::ranks::describe(i));
            }
        }
        results.push(super::print::verify_row(&r, index.as_ref()));
    }
    if json {
        println!("{}", json!({"url": t.url(), "ok": !damaged, "checkpoints": results}));
    }
    Ok(if damaged { ExitCode::from(crate::EXIT_DAMAGED) } else { ExitCode::SUCCESS })
}
