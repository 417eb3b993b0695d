//! The log of refusals and warnings about clients (a refused handshake, a
//! bad or stalled frame, a session over its share): rate-limited per peer
//! process, so clients that misbehave in a loop cannot flood the disk.
//!
//! Per interval of [`config::LOG_SUMMARY_INTERVAL_MS`], each process's
//! first [`config::LOG_REFUSALS_PER_PROCESS_MAX`] lines are written as they
//! come (and at most [`config::LOG_REFUSALS_PER_INTERVAL_MAX`] of all
//! processes together); the rest are counted, and when the interval ends
//! ([`flush`], called by the housekeeping thread, or the next refusal)
//! summarised in one line per process: "N more refusals from pid P in the
//! last 10 s: <the last reason>". So an interval writes at most
//! `LOG_REFUSALS_PER_INTERVAL_MAX + LOG_SUMMARY_PIDS_MAX + 1` lines.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::config;

#[derive(Default)]
struct Pid {
    written: u32,
    suppressed: u64,
    last_reason: String,
}

struct Interval {
    started: Instant,
    written: u32,
    by_pid: HashMap<u32, Pid>,
}

fn interval() -> &'static Mutex<Interval> {
    static I: std::sync::OnceLock<Mutex<Interval>> = std::sync::OnceLock::new();
    I.get_or_init(|| Mutex::new(Interval { started: Instant::now(), written: 0, by_pid: HashMap::new() }))
}

const INTERVAL: Duration = Duration::from_millis(config::LOG_SUMMARY_INTERVAL_MS);

/// Logs (a WARN line) `what` about the client process `pid` with its
/// `reason`, unless that process or all of them said enough this interval:
/// then it is counted for the interval's summary.
pub fn refused(pid: u32, what: &str, reason: &str) {
    let mut guard = interval().lock().unwrap_or_else(|p| p.into_inner());
    let i = &mut *guard;
    if i.started.elapsed() >= INTERVAL {
        summarise(i);
    }
    let room = i.written < config::LOG_REFUSALS_PER_INTERVAL_MAX;
    let p = i.by_pid.entry(pid).or_default();
    if room && p.written < config::LOG_REFUSALS_PER_PROCESS_MAX {
        p.written += 1;
        i.written += 1;
        warn!(pid, "{what}: {reason}");
    } else {
        p.suppressed += 1;
        p.last_reason = format!("{what}: {reason}");
    }
}

/// Summarises the interval if it has ended.
pub fn flush() {
    let mut i = interval().lock().unwrap_or_else(|p| p.into_inner());
    if i.started.elapsed() >= INTERVAL {
        summarise(&mut i);
    }
}

/// Writes the ended interval's summary lines and starts the next one.
fn summarise(i: &mut Interval) {
    let secs = i.started.elapsed().as_secs();
    let mut counted: Vec<(u32, Pid)> = i.by_pid.drain().filter(|(_, p)| p.suppressed > 0).collect();
    counted.sort_unstable_by(|a, b| b.1.suppressed.cmp(&a.1.suppressed).then(a.0.cmp(&b.0)));
    for (pid, p) in counted.iter().take(config::LOG_SUMMARY_PIDS_MAX) {
        warn!(pid, "{} more refusals from pid {pid} in the last {secs} s: {}", p.suppressed, p.last_reason);
    }
    let rest = &counted[counted.len().min(config::LOG_SUMMARY_PIDS_MAX)..];
    if !rest.is_empty() {
        let n: u64 = rest.iter().map(|(_, p)| p.suppressed).sum();
        warn!("{n} more refusals from {} other processes in the last {secs} s", rest.len());
    }
    i.started = Instant::now();
    i.written = 0;
}
