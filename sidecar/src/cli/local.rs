//! The tools over a local checkpoint directory: `ls`, `inspect`,
//! `verify`, `gc`, `rollback` and `doctor`. A directory a live sidecar
//! serves may lose its oldest steps to that sidecar's `--keep` while a tool
//! reads it: a step deleted so is passed over (or re-picked), never shown
//! as damaged.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use serde_json::json;

use ckpt_sidecar::config;
use ckpt_sidecar::daemon;
use ckpt_store::catalog;
use ckpt_store::commit::{Store, StoreError, StoreOptions};
use ckpt_store::format;
use ckpt_store::io::{self as eio, IoPolicy};
use ckpt_store::lock::LockError;
use ckpt_store::restore::{self, ReadOptions};
use ckpt_store::retention::{self, Retention};

use super::print::{print_inspect, print_ls, print_verify, verify_row};

/// `ls`: the committed steps, each with its ranks, tensors and bytes, and
/// what the cheap checks found ([`restore::quick_check`]: the index reads,
/// every file is present with its size; a step failing them is marked
/// damaged), and, for node-local files, where each node's are: its
/// directories, and (asked with `--peers`) the peers holding them in
/// memory. The output says what was and was not checked.
pub fn ls(dir: &Path, json: bool, peers: &[String], secret_file: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    catalog::check_dir(dir)?;
    let steps = catalog::readable_steps(dir).with_context(|| format!("listing {}", dir.display()))?;
    let latest = catalog::latest_step(dir)?;
    let mut rows = Vec::new();
    for s in steps {
        let (tensors, bytes, world_size, per_rank, nodes) = match restore::read_index(dir, s) {
            Ok(i) => {
                let per_rank: Vec<u64> = ckpt_store::ranks::bytes_per_rank(&i).into_values().collect();
                (
                    Some(i.logical().len()),
                    Some(i.ckpt.files.iter().map(|f| f.len_bytes).sum::<u64>()),
                    Some(i.ckpt.world_size),
                    Some(per_rank),
                    node_files(&i),
                )
            }
            // Deleted since it was listed (a live sidecar's --keep): not shown as damaged.
            Err(_) if !catalog::is_committed(dir, s) => continue,
            Err(_) => (None, None, None, None, serde_json::Map::new()),
        };
        let (damage, not_checked_files) = match restore::quick_check(dir, s) {
            Ok((problems, elsewhere)) => (problems.iter().map(|p| p.to_string()).collect::<Vec<_>>(), elsewhere),
            Err(e) => (vec![e.to_string()], 0),
        };
        if !damage.is_empty() && !catalog::is_committed(dir, s) {
            continue;
        }
        rows.push(json!({"step": s, "path": catalog::step_path(dir, s), "latest": Some(s) == latest, "tensors": tensors, "bytes": bytes, "world_size": world_size, "bytes_per_rank": per_rank, "damaged": !damage.is_empty(), "damage": damage, "files_not_checked": not_checked_files, "nodes": nodes}));
    }
    let mut doc = json!({"dir": dir, "latest": latest, "checked": restore::QUICK_CHECKED, "not_checked": restore::QUICK_NOT_CHECKED, "checkpoints": rows});
    if !peers.is_empty() {
        ask_peers(&mut doc, peers, secret_file)?;
    }
    print_ls(&dir.display().to_string(), doc, json);
    Ok(ExitCode::SUCCESS)
}

/// A step's node-local files by node: {id: {"dirs", "files", "bytes"}}
/// (empty for a step of one machine's directories).
fn node_files(index: &format::Index) -> serde_json::Map<String, serde_json::Value> {
    let len = |name: &String| index.ckpt.files.iter().find(|f| &f.name == name).map_or(0, |f| f.len_bytes);
    index
        .ckpt
        .nodes
        .iter()
        .map(|(id, n)| {
            let bytes: u64 = n.files.iter().map(len).sum();
            (id.clone(), json!({"dirs": n.dirs, "files": n.files.len(), "bytes": bytes}))
        })
        .collect()
}

/// `ls --peers`: each step's nodes get `held_by`, the peers (by node id)
/// holding their files in memory, and the document a `peers` list of what
/// each peer answered (its node id, or why not).
fn ask_peers(doc: &mut serde_json::Value, peers: &[String], secret_file: Option<PathBuf>) -> anyhow::Result<()> {
    let secret_file = super::args::peer_secret_file(secret_file, "--peers")?;
    let rows = doc["checkpoints"].as_array_mut().expect("checkpoints is a list");
    let mut nodes: Vec<String> =
        rows.iter().flat_map(|r| r["nodes"].as_object().into_iter().flat_map(|m| m.keys().cloned())).collect();
    nodes.sort();
    nodes.dedup();
    let answers = ckpt_sidecar::peer::holdings(peers, &secret_file, &nodes)?;
    for r in rows.iter_mut() {
        let step = r["step"].as_u64().unwrap_or_default();
        let Some(ns) = r["nodes"].as_object_mut() else { continue };
        for (id, n) in ns.iter_mut() {
            let by: Vec<&str> = (answers.iter())
                .filter_map(|a| a.answer.as_ref().ok())
                .filter(|h| h.held.iter().any(|(node, steps)| node == id && steps.contains(&step)))
                .map(|h| h.node.as_str())
                .collect();
            n["held_by"] = json!(by);
        }
    }
    doc["peers"] = answers
        .iter()
        .map(|a| match &a.answer {
            Ok(h) => json!({"addr": a.addr, "node": h.node}),
            Err(why) => json!({"addr": a.addr, "error": why}),
        })
        .collect();
    Ok(())
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

/// `inspect`: one step's tensors and blobs ([`read_step_index`] picks it).
pub fn inspect(dir: &Path, step: Option<u64>, json: bool) -> anyhow::Result<ExitCode> {
    let (step, index) = read_step_index(dir, step)?;
    print_inspect(&index, &catalog::step_path(dir, step).display().to_string(), json)?;
    Ok(ExitCode::SUCCESS)
}

/// `verify`: every byte of the step asked for (else of every committed
/// step) against its checksums; exit code 3 when any is damaged.
pub fn verify(
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
    let bar = progress_bar(json);
    let mut results = Vec::new();
    let mut damaged = false;
    let mut damaged_files: Vec<(u64, String)> = Vec::new();
    let mut verifier = restore::Verifier::default();
    for s in steps {
        let Some(r) = verify_step(&mut verifier, dir, s, step.is_some(), &opts, bar.as_ref(), json)? else { continue };
        damaged |= !r.problems.is_empty();
        damaged_files.extend(r.problems.iter().filter_map(|p| p.file.clone()).map(|f| (s, f)));
        // Ranks as the index says (verify just checked it, or said why not).
        let index = restore::read_index(dir, s).ok();
        let ranks_line = index.as_ref().map(ckpt_store::ranks::describe);
        if !json {
            say(bar.as_ref(), || {
                print_verify(&r);
                if let Some(l) = &ranks_line {
                    println!("  {l}");
                }
            });
        }
        results.push(verify_row(&r, index.as_ref()));
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let shared_damage = shared_damage(dir, &damaged_files, json);
    if json {
        println!("{}", json!({"dir": dir, "ok": !damaged, "checkpoints": results, "shared_damage": shared_damage}));
    }
    Ok(if damaged { ExitCode::from(crate::EXIT_DAMAGED) } else { ExitCode::SUCCESS })
}

/// `verify`'s progress bar: on a terminal, unless the output is JSON.
fn progress_bar(json: bool) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() || json {
        return None;
    }
    let b = indicatif::ProgressBar::new(0);
    b.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .expect("valid template"),
    );
    Some(b)
}

/// Prints what `print` prints with the progress bar, if any, out of the way.
fn say(bar: Option<&indicatif::ProgressBar>, print: impl FnOnce()) {
    match bar {
        Some(b) => b.suspend(print),
        None => print(),
    }
}

/// Verifies step `s`. A step a live sidecar's --keep (or a rollback)
/// deleted after it was listed reads as missing files: gone, not damaged;
/// then None (said, unless `json`), or an error when it is the step asked
/// for (`asked`).
fn verify_step(
    verifier: &mut restore::Verifier,
    dir: &Path,
    s: u64,
    asked: bool,
    opts: &ReadOptions,
    bar: Option<&indicatif::ProgressBar>,
    json: bool,
) -> anyhow::Result<Option<restore::VerifyReport>> {
    if let Some(b) = bar {
        b.set_message(format!("step {s}"));
        b.set_position(0);
    }
    let r = verifier.verify(dir, s, opts, |done, total| {
        if let Some(b) = bar {
            b.set_length(total);
            b.set_position(done);
        }
    });
    match r {
        Ok(r) if r.problems.is_empty() => Ok(Some(r)),
        Ok(_) | Err(_) if !catalog::is_committed(dir, s) => {
            if asked {
                bail!(
                    "{}: step {s} was deleted while it was being verified (a sidecar's --keep, or a rollback)",
                    dir.display()
                );
            }
            if !json {
                say(bar, || {
                    println!("step {s}: deleted while being verified (a sidecar's --keep, or a rollback); not checked")
                });
            }
            Ok(None)
        }
        r => Ok(Some(r?)),
    }
}

/// Incremental checkpoints share files between steps (hard links): a
/// damaged one damages every step that links it. Each such file of
/// `damaged_files` (step, file), said (unless `json`) and as `verify
/// --json`'s `shared_damage` rows.
fn shared_damage(dir: &Path, damaged_files: &[(u64, String)], json: bool) -> Vec<serde_json::Value> {
    let mut shared_damage = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (s, file) in damaged_files {
        let Some(id) = ckpt_store::incremental::file_inode(dir, *s, file) else { continue };
        if !seen.insert(id) {
            continue;
        }
        let steps = ckpt_store::incremental::steps_sharing(dir, id);
        if steps.len() > 1 {
            let list = steps.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
            // A link may take another name in a later step: named per step.
            let names: serde_json::Map<String, serde_json::Value> = steps
                .iter()
                .filter_map(|&t| {
                    let index = restore::read_index(dir, t).ok()?;
                    let f = index
                        .ckpt
                        .files
                        .iter()
                        .find(|f| ckpt_store::incremental::file_inode(dir, t, &f.name) == Some(id))?;
                    Some((t.to_string(), json!(f.name)))
                })
                .collect();
            if !json {
                let each: Vec<String> =
                    names.iter().map(|(t, n)| format!("step {t}: {}", n.as_str().unwrap_or(""))).collect();
                println!("damaged file {file} (step {s}) is shared by steps {list} (one file, hard-linked: every one of them is damaged; named {})", each.join(", "));
            }
            shared_damage.push(json!({"step": s, "file": file, "shared_by": steps, "names": names}));
        }
    }
    shared_damage
}

/// `gc`: deletes old checkpoints, keeping the newest `keep` (and every
/// `keep_every`-th step), after the store's recovery; refused beside a live
/// sidecar, and when what it keeps would not load.
pub fn gc(dirs: &[PathBuf], keep: usize, keep_every: Option<u64>, json: bool) -> anyhow::Result<ExitCode> {
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

/// `rollback`: makes committed step `to` the newest again.
pub fn rollback(dirs: &[PathBuf], to: u64, json: bool) -> anyhow::Result<ExitCode> {
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

/// `doctor`: which I/O engine each directory gets and why; CUDA as found.
pub fn doctor(dirs: &[PathBuf], json: bool, io: IoPolicy) -> anyhow::Result<ExitCode> {
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
