//! `bench incremental`: incremental checkpoints measured with a
//! real client against real sidecar processes, in one run:
//!
//! 1. a LoRA-like state (a frozen base, and adapters whose parameters and
//!    AdamW-like moments all change every step) saved every step: per step,
//!    the bytes written (files of the step whose inode the step before does
//!    not hold, plus the index) beside the changed tensors' bytes, and the
//!    time to durable beside that of
//! 2. a sidecar saving the changed tensors alone (same steps, same bytes);
//! 3. a full save (every tensor changed) with detection on and off,
//!    alternated round by round (two sidecars): stall and time to durable.
//!
//! Figures only, nothing asserted. Memory: the regions and the sidecars'
//! staging are allocated and touched before anything is timed.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use ckpt_client::{Client, Region, TensorRef, Wanted};
use serde::Serialize;

use ckpt_store::catalog;
use ckpt_store::config;
use ckpt_store::format::INDEX_FILE_NAME;
use ckpt_store::synthetic;

use crate::stall::{median, Sidecar};

const SAVE_TIMEOUT: Duration = Duration::from_secs(600);
const REGION_ALIGN_BYTES: u64 = 4096;
const FILL_CHUNK_BYTES: usize = 4 << 20;
/// One frozen base tensor (BF16 matrices of a 1 GiB base: 32 of them).
const BASE_TENSOR_BYTES: u64 = 32 << 20;
/// One adapter tensor (a LoRA A or B matrix, F32).
const ADAPTER_TENSOR_BYTES: u64 = 128 << 10;
/// Steps the full-save sidecars keep (`--keep`): the one an incremental
/// save compares with, and the one it commits.
const FULL_KEEP: &str = "2";

pub struct IncrementalArgs {
    pub dir: PathBuf,
    pub base_bytes: u64,
    pub adapter_bytes: u64,
    pub steps: usize,
    pub full_rounds: usize,
    /// Saves ask for a lazy release (the Python package's way): checksums
    /// and digests are taken during the copy, so they are in the stall.
    pub lazy_release: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepFigures {
    pub step: u64,
    /// Bytes of files this step wrote (not linked), plus its index.
    pub written_bytes: u64,
    /// Bytes of the tensors that changed since the step before, plus the index.
    pub changed_bytes: u64,
    pub written_over_changed: f64,
    pub stall_seconds: f64,
    pub durable_seconds: f64,
    /// The same step saving the changed tensors alone.
    pub alone_durable_seconds: f64,
    pub durable_over_alone: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct FullFigures {
    pub bytes: u64,
    pub on_stall_seconds: Vec<f64>,
    pub off_stall_seconds: Vec<f64>,
    pub on_durable_seconds: Vec<f64>,
    pub off_durable_seconds: Vec<f64>,
    pub stall_on_over_off: f64,
    pub durable_on_over_off: f64,
    /// The second save after a start, detection on: nothing compared yet,
    /// so every tensor was laid out stable and its shards waited for the
    /// copy's digests (a one-time cost; not in the medians), and off.
    pub on_second_save_durable_seconds: f64,
    pub off_second_save_durable_seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct IncrementalFigures {
    pub op: &'static str,
    pub base_bytes: u64,
    /// Parameters + two moments.
    pub changing_bytes: u64,
    pub steps: Vec<StepFigures>,
    /// Medians over steps 2.. that linked (a --full-every step excluded).
    pub written_over_changed_median: f64,
    pub durable_over_alone_median: f64,
    pub full: FullFigures,
    pub lazy_release: bool,
    pub memory: &'static str,
}

/// A state in one region: (name, dtype, shape, offset, bytes) per tensor.
struct State {
    tensors: Vec<(String, &'static str, Vec<u64>, u64, u64)>,
    len: u64,
}

impl State {
    fn new(parts: &[(String, &'static str, u64)]) -> State {
        let mut at = 0u64;
        let mut tensors = Vec::new();
        for (name, dtype, bytes) in parts {
            let el = if *dtype == "BF16" { 2 } else { 4 };
            tensors.push((name.clone(), *dtype, vec![bytes / el], at, *bytes));
            at = config::align_up(at + bytes, REGION_ALIGN_BYTES as usize);
        }
        State { tensors, len: at.max(REGION_ALIGN_BYTES) }
    }

    fn refs<'a>(&'a self, region: &'a Region, which: impl Fn(&str) -> bool) -> Vec<TensorRef<'a>> {
        self.tensors
            .iter()
            .filter(|t| which(&t.0))
            .map(|(n, d, s, off, len)| TensorRef::in_region(n, d, s, region, *off, *len))
            .collect()
    }

    /// Fills the tensors `which` says with bytes of `seed` (a training step's change).
    fn fill(&self, region: &Region, seed: u64, which: impl Fn(&str) -> bool) -> anyhow::Result<()> {
        let mut scratch = vec![0u8; FILL_CHUNK_BYTES];
        for (i, (name, _, _, off, len)) in self.tensors.iter().enumerate() {
            if !which(name) {
                continue;
            }
            let mut at = 0u64;
            while at < *len {
                let k = (*len - at).min(FILL_CHUNK_BYTES as u64) as usize;
                synthetic::fill(&mut scratch[..k], seed ^ ((i as u64) << 40) ^ at);
                region.write_at(off + at, &scratch[..k]).map_err(|e| anyhow!(e))?;
                at += k as u64;
            }
        }
        Ok(())
    }
}

fn lora_state(base_bytes: u64, adapter_bytes: u64) -> State {
    let mut parts: Vec<(String, &'static str, u64)> = Vec::new();
    let n_base = base_bytes.div_ceil(BASE_TENSOR_BYTES);
    for i in 0..n_base {
        parts.push((
            format!("model.layers.{i}.weight"),
            "BF16",
            BASE_TENSOR_BYTES.min(base_bytes - i * BASE_TENSOR_BYTES),
        ));
    }
    let n_adapter = adapter_bytes.div_ceil(ADAPTER_TENSOR_BYTES);
    for i in 0..n_adapter {
        let b = ADAPTER_TENSOR_BYTES.min(adapter_bytes - i * ADAPTER_TENSOR_BYTES);
        let ab = if i % 2 == 0 { "lora_A" } else { "lora_B" };
        parts.push((format!("model.layers.{}.{ab}.weight", i / 2), "F32", b));
        parts.push((format!("optimizer.exp_avg.{i}"), "F32", b));
        parts.push((format!("optimizer.exp_avg_sq.{i}"), "F32", b));
    }
    State::new(&parts)
}

fn is_changing(name: &str) -> bool {
    !name.ends_with(".weight") || name.contains("lora_")
}

/// Saves, waits for Released and Durable: (stall, time to durable) from the request.
fn save(client: &Client, step: u64, refs: &[TensorRef]) -> anyhow::Result<(f64, f64)> {
    let t0 = Instant::now();
    let h = client.save(step, refs, &[])?;
    client.wait(h.id, Wanted::Released, Some(SAVE_TIMEOUT))?;
    let stall = t0.elapsed().as_secs_f64();
    client.wait(h.id, Wanted::Durable, Some(SAVE_TIMEOUT))?;
    Ok((stall, t0.elapsed().as_secs_f64()))
}

/// One file of a step folder: its (dev, ino), its bytes, and whether it is
/// the index.
type FileOfStep = ((u64, u64), u64, bool);

/// Every file of a step folder.
fn files_of(dir: &Path, step: u64) -> anyhow::Result<Vec<FileOfStep>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(catalog::step_path(dir, step))? {
        let e = e?;
        let m = e.metadata()?;
        if m.is_file() {
            v.push(((m.dev(), m.ino()), m.len(), e.file_name() == INDEX_FILE_NAME));
        }
    }
    Ok(v)
}

/// Bytes of files of `step` whose inode `prev` does not hold (the index included).
fn written_bytes(dir: &Path, step: u64, prev: Option<u64>) -> anyhow::Result<(u64, u64)> {
    let old: HashSet<(u64, u64)> = match prev {
        Some(p) => files_of(dir, p)?.into_iter().map(|f| f.0).collect(),
        None => HashSet::new(),
    };
    let files = files_of(dir, step)?;
    let index = files.iter().filter(|f| f.2).map(|f| f.1).sum();
    Ok((files.iter().filter(|f| !old.contains(&f.0)).map(|f| f.1).sum(), index))
}

fn fresh_dir(p: &Path) -> anyhow::Result<PathBuf> {
    if p.exists() {
        std::fs::remove_dir_all(p).with_context(|| format!("clearing {}", p.display()))?;
    }
    std::fs::create_dir_all(p).with_context(|| format!("creating {}", p.display()))?;
    Ok(p.to_path_buf())
}

pub fn run(args: &IncrementalArgs) -> anyhow::Result<IncrementalFigures> {
    let state = lora_state(args.base_bytes, args.adapter_bytes);
    let changing_bytes: u64 = state.tensors.iter().filter(|t| is_changing(&t.0)).map(|t| t.4).sum();
    let staging = config::align_up(state.len + state.len / 8 + (64 << 20), 1 << 20);

    // 1 + 2: the LoRA-like run, and the changed tensors saved alone, step by step.
    let lora_dir = fresh_dir(&args.dir.join("lora"))?;
    let alone_dir = fresh_dir(&args.dir.join("changed-alone"))?;
    let mut sc = Sidecar::spawn_with(&lora_dir, staging, &[])?;
    let mut alone_sc =
        Sidecar::spawn_with(&alone_dir, config::align_up(3 * changing_bytes + (64 << 20), 1 << 20), &[])?;
    let steps = (|| -> anyhow::Result<Vec<StepFigures>> {
        let client = sc.connect()?;
        let alone = alone_sc.connect()?;
        client.set_lazy_release(args.lazy_release);
        alone.set_lazy_release(args.lazy_release);
        let region = client.alloc_region(state.len)?;
        let alone_region = alone.alloc_region(state.len)?;
        state.fill(&region, 1, |_| true)?;
        let refs = state.refs(&region, |_| true);
        let alone_refs = state.refs(&alone_region, is_changing);
        let mut out = Vec::new();
        for k in 0..args.steps {
            let step = 1 + k as u64;
            state.fill(&region, 100 + step, is_changing)?;
            state.fill(&alone_region, 100 + step, is_changing)?;
            let (stall, durable) = save(&client, step, &refs)?;
            let (_, alone_durable) = save(&alone, step, &alone_refs)?;
            let (written, index) = written_bytes(&lora_dir, step, step.checked_sub(1).filter(|&p| p >= 1))?;
            let changed = if step == 1 { written } else { changing_bytes + index };
            out.push(StepFigures {
                step,
                written_bytes: written,
                changed_bytes: changed,
                written_over_changed: written as f64 / changed as f64,
                stall_seconds: stall,
                durable_seconds: durable,
                alone_durable_seconds: alone_durable,
                durable_over_alone: durable / alone_durable,
            });
        }
        drop((refs, alone_refs));
        client.close();
        alone.close();
        Ok(out)
    })();
    let steps = match steps {
        Ok(s) => s,
        Err(e) => return Err(anyhow!("{e:#}{}{}", sc.log_tail(), alone_sc.log_tail())),
    };
    sc.stop()?;
    alone_sc.stop()?;

    // 3: full saves, detection on and off alternated.
    let on_dir = fresh_dir(&args.dir.join("full-on"))?;
    let off_dir = fresh_dir(&args.dir.join("full-off"))?;
    let base = lora_state(args.base_bytes, 0);
    let full_staging = config::align_up(base.len + base.len / 8 + (64 << 20), 1 << 20);
    // Both keep their last two steps (retention runs after Durable, and
    // alike on both): a run of many rounds keeps 4 GiB on disk, not 2 GiB
    // per round.
    let mut on = Sidecar::spawn_with(&on_dir, full_staging, &["--keep", FULL_KEEP])?;
    let mut off = Sidecar::spawn_with(&off_dir, full_staging, &["--incremental", "off", "--keep", FULL_KEEP])?;
    let full = (|| -> anyhow::Result<FullFigures> {
        let con = on.connect()?;
        let coff = off.connect()?;
        con.set_lazy_release(args.lazy_release);
        coff.set_lazy_release(args.lazy_release);
        let ron = con.alloc_region(base.len)?;
        let roff = coff.alloc_region(base.len)?;
        let refs_on = base.refs(&ron, |_| true);
        let refs_off = base.refs(&roff, |_| true);
        let mut f = FullFigures {
            bytes: base.tensors.iter().map(|t| t.4).sum(),
            on_stall_seconds: vec![],
            off_stall_seconds: vec![],
            on_durable_seconds: vec![],
            off_durable_seconds: vec![],
            stall_on_over_off: 0.0,
            durable_on_over_off: 0.0,
            on_second_save_durable_seconds: 0.0,
            off_second_save_durable_seconds: 0.0,
        };
        // Rounds 0 and 1 warm both up, not counted: the first save has
        // nothing to compare with; the second has no history yet (every
        // tensor stable: its shards wait for the digests), reported apart.
        const WARM_ROUNDS: usize = 2;
        for r in 0..args.full_rounds + WARM_ROUNDS {
            let step = 1 + r as u64;
            // Every tensor changes between saves.
            base.fill(&ron, 7 + step, |_| true)?;
            base.fill(&roff, 7 + step, |_| true)?;
            let order: [bool; 2] = if r % 2 == 0 { [true, false] } else { [false, true] };
            for is_on in order {
                let (stall, durable) = if is_on { save(&con, step, &refs_on)? } else { save(&coff, step, &refs_off)? };
                if r == 1 {
                    *(if is_on {
                        &mut f.on_second_save_durable_seconds
                    } else {
                        &mut f.off_second_save_durable_seconds
                    }) = durable;
                }
                if r < WARM_ROUNDS {
                    continue;
                }
                if is_on {
                    f.on_stall_seconds.push(stall);
                    f.on_durable_seconds.push(durable);
                } else {
                    f.off_stall_seconds.push(stall);
                    f.off_durable_seconds.push(durable);
                }
            }
        }
        f.stall_on_over_off = median(&f.on_stall_seconds) / median(&f.off_stall_seconds);
        f.durable_on_over_off = median(&f.on_durable_seconds) / median(&f.off_durable_seconds);
        drop((refs_on, refs_off));
        con.close();
        coff.close();
        Ok(f)
    })();
    let full = match full {
        Ok(f) => f,
        Err(e) => return Err(anyhow!("{e:#}{}{}", on.log_tail(), off.log_tail())),
    };
    on.stop()?;
    off.stop()?;

    let linked: Vec<&StepFigures> = steps.iter().skip(1).filter(|s| s.written_over_changed < 2.0).collect();
    let (w, d) = if linked.is_empty() {
        (f64::NAN, f64::NAN)
    } else {
        (
            median(&linked.iter().map(|s| s.written_over_changed).collect::<Vec<_>>()),
            median(&linked.iter().map(|s| s.durable_over_alone).collect::<Vec<_>>()),
        )
    };
    Ok(IncrementalFigures {
        op: "incremental",
        base_bytes: args.base_bytes,
        changing_bytes,
        steps,
        written_over_changed_median: w,
        durable_over_alone_median: d,
        full,
        lazy_release: args.lazy_release,
        memory: "pre-faulted",
    })
}
