//! `status`: a running sidecar's sessions, in-flight checkpoints, staging
//! use, last figures and drain, asked over its socket, printed for a person
//! or as one JSON document.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use serde_json::json;

use ckpt_sidecar::daemon;
use ckpt_store::units::human_bytes;
use ckpt_wire::StatusReport;

/// `status`: asks the sidecar at `socket` (default: where `serve` puts it);
/// a socket nobody listens at is said in one line, with how to start one.
pub fn status(socket: Option<PathBuf>, json: bool) -> anyhow::Result<ExitCode> {
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
        print_json(&socket, &r);
    } else {
        print_text(&socket, &r);
    }
    Ok(ExitCode::SUCCESS)
}

/// `status --json`: the report as one JSON document on one line.
fn print_json(socket: &Path, r: &StatusReport) {
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
            "replicated_count": d.replicated_count, "skipped_count": d.skipped_count,
            "deleted_undrained_count": d.deleted_undrained_count, "deleted_undrained": d.deleted_undrained,
            "backlog_bytes": d.backlog_bytes, "upload_failures": d.upload_failures, "lag_seconds": d.lag_seconds,
        })),
        "damaged": r.damaged.iter().map(|d| json!({"step": d.step, "file": (!d.file.is_empty()).then_some(&d.file), "reason": d.reason, "found_unix_s": d.found_unix_s, "found_by": d.found_by})).collect::<Vec<_>>(),
        "damaged_total": r.damaged_total,
        "scrub": r.scrub.as_ref().map(|s| json!({
            "interval_s": s.interval_s, "verifying": s.verifying, "passes": s.passes, "last_pass_unix_s": s.last_pass_unix_s,
            "steps_verified": s.steps_verified, "bytes_verified": s.bytes_verified,
            "remote_steps_verified": s.remote_steps_verified, "remote_bytes_verified": s.remote_bytes_verified,
        })),
        "peers": r.peers.as_ref().map(|p| json!({
            "listen": p.listen, "peers": p.peers, "replicas": p.replicas,
            "last_held": p.last_held, "last_held_by": p.last_held_by,
            "last_failed": p.last_failed, "last_error": (!p.last_error.is_empty()).then_some(&p.last_error),
            "bytes_per_s": p.bytes_per_s, "last_skipped": p.last_skipped, "skipped_count": p.skipped_count,
            "holding": p.holding, "holding_bytes": p.holding_bytes,
            "budget_bytes": p.budget_bytes, "refused_connections": p.refused_connections,
            "shared_over_peers": p.shared_over_peers,
        })),
    });
    println!("{j}");
}

/// `status`: the report for a person, one line per subject.
fn print_text(socket: &Path, r: &StatusReport) {
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
        let kind = if r.peers.as_ref().is_some_and(|p| p.shared_over_peers) {
            "several nodes, no shared file system: this node's own folder, kept by the peer channel"
        } else {
            "several nodes"
        };
        println!("shared:   {} ({kind}); {role}", r.shared_dir);
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
        println!(
            "          of the committed steps seen: {} replicated, {} in the backlog or uploading ({}, {:.1} s behind), {} skipped (superseded), {} deleted locally before drained{}; {} failed upload(s)",
            d.replicated_count,
            d.backlog.len() + usize::from(d.uploading.is_some()),
            human_bytes(d.backlog_bytes),
            d.lag_seconds,
            d.skipped_count,
            d.deleted_undrained_count,
            if d.deleted_undrained.is_empty() { String::new() } else { format!(" (newest: {:?})", d.deleted_undrained) },
            d.upload_failures
        );
    }
    print_damage(r);
    if let Some(p) = &r.peers {
        print_peers(p);
    }
}

/// `status`'s damage lines: each damaged step the sidecar found, and the scrub.
fn print_damage(r: &StatusReport) {
    let now_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let ago = |t: u64| format!("{} s ago", now_s.saturating_sub(t));
    if let Some(s) = &r.scrub {
        println!(
            "scrub:    every {:.0} s; {} pass(es), last {}; verifying: {}; {} step(s), {} verified (drain target: {} step(s), {})",
            s.interval_s,
            s.passes,
            s.last_pass_unix_s.map_or("none yet".into(), ago),
            s.verifying.map_or("none".into(), |v| v.to_string()),
            s.steps_verified,
            human_bytes(s.bytes_verified),
            s.remote_steps_verified,
            human_bytes(s.remote_bytes_verified)
        );
    }
    if r.damaged.is_empty() {
        println!("damaged:  none found");
        return;
    }
    println!("damaged:  {} record(s) ({} since the start; the newest shown)", r.damaged.len(), r.damaged_total);
    for d in &r.damaged {
        let file = if d.file.is_empty() { String::new() } else { format!("{}: ", d.file) };
        println!(
            "  step {:>12}  DAMAGED {file}{} (found by {}, {})",
            d.step,
            d.reason,
            d.found_by,
            ago(d.found_unix_s)
        );
    }
}

/// `status`'s peer lines: this node's replication, and what it holds for others.
fn print_peers(p: &ckpt_wire::PeerReport) {
    println!(
        "peers:    listening on {}; peers {}; {} replica(s) wanted; last held: {}{}; {}/s",
        p.listen,
        p.peers.join(", "),
        p.replicas,
        p.last_held.map_or("none".into(), |s| format!("step {s}")),
        if p.last_held_by.is_empty() { String::new() } else { format!(" by {}", p.last_held_by.join(", ")) },
        human_bytes(p.bytes_per_s as u64)
    );
    if let Some(s) = p.last_failed {
        println!("          last failed: step {s}: {}", p.last_error);
    }
    if let Some(s) = p.last_skipped {
        println!(
            "          skipped (more than --peer-keep newer steps waited to be sent): {} step(s), the newest step {s}",
            p.skipped_count
        );
    }
    let holding: Vec<String> = p.holding.iter().map(|(n, s)| format!("{n}:{s}")).collect();
    println!(
        "          holding for others: {} ({} of {}); {} connection(s) refused",
        if holding.is_empty() { "nothing".to_string() } else { holding.join(", ") },
        human_bytes(p.holding_bytes),
        human_bytes(p.budget_bytes),
        p.refused_connections
    );
}
