//! Metrics a cluster can scrape: `serve`/`launch --metrics ADDR` answers
//! `GET /metrics` over plain HTTP on ADDR with the OpenMetrics text format
//! (which Prometheus scrapes), encoded by the `prometheus-client` crate.
//! docs/metrics.md says what each metric means.
//!
//! Owns: the process's counters and histograms ([`record_started`],
//! [`record_reply`]: fed by every session's [`crate::state::reply::Replies`], the one
//! place Released/Durable/Failed leave the daemon) and their rendering
//! ([`render`]); [`crate::state::metrics_http`] serves it over HTTP.
//!
//! Invariant: the gauges (staging, in-flight, sessions) are read at each
//! scrape from the status report (`Shared::report`, passed in by the daemon
//! as a function, so this module needs nothing of the daemon's state), the
//! very report `status --json` prints, so both say the same of one moment.
//! The counters and histograms a scrape prints are one moment's too: a
//! reply's updates happen under `Metrics::snapshot` shared, the encoding
//! under it exclusive.

use std::sync::{OnceLock, RwLock};

use ckpt_wire::{DrainReport, ErrorCode, LoadSource, Reply, StatusReport};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::config;

type Reason = [(&'static str, &'static str); 1];
type Source = [(&'static str, &'static str); 1];

/// What the daemon counts from its start.
pub struct Metrics {
    started: Counter,
    released: Counter,
    durable: Counter,
    failed: Family<Reason, Counter>,
    bytes_written: Counter,
    release_seconds: Histogram,
    durable_seconds: Histogram,
    /// Incremental commits written in full (nothing linked), and the bytes
    /// of shards hard-linked from the previous step instead of written.
    incremental_full: Counter,
    incremental_linked_bytes: Counter,
    /// Loads answered, by where the step was read; failed, by reason; and
    /// those that skipped a damaged newer step (`fell_back`).
    loads: Family<Source, Counter>,
    loads_failed: Family<Reason, Counter>,
    loads_fell_back: Counter,
    /// Held shared by every update of several metrics that belong together
    /// (a Durable's counter, bytes and histogram), and exclusively while a
    /// scrape reads them all, so a scrape never sees half an update (the
    /// durable counter one behind its histogram's count, say).
    snapshot: RwLock<()>,
}

fn seconds_buckets() -> impl Iterator<Item = f64> {
    // 1 ms .. about 4.4 min, doubling.
    exponential_buckets(0.001, 2.0, config::METRICS_BUCKETS_N)
}

/// The process's metrics (made at first use).
pub fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let (failed, loads_failed) = (Family::default(), Family::default());
        for code in REASONS {
            let _ = failed.get_or_create(&[("reason", reason(&code))]); // every reason shown, from 0
            let _ = loads_failed.get_or_create(&[("reason", reason(&code))]);
        }
        let loads = Family::default();
        for source in ["ram", "disk", "drain"] {
            let _ = loads.get_or_create(&[("source", source)]);
        }
        Metrics {
            started: Counter::default(),
            released: Counter::default(),
            durable: Counter::default(),
            failed,
            bytes_written: Counter::default(),
            release_seconds: Histogram::new(seconds_buckets()),
            durable_seconds: Histogram::new(seconds_buckets()),
            incremental_full: Counter::default(),
            incremental_linked_bytes: Counter::default(),
            loads,
            loads_failed,
            loads_fell_back: Counter::default(),
            snapshot: RwLock::new(()),
        }
    })
}

const REASONS: [ErrorCode; 7] = [
    ErrorCode::BadRequest,
    ErrorCode::BadRegion,
    ErrorCode::NotFound,
    ErrorCode::Damaged,
    ErrorCode::Io,
    ErrorCode::ShuttingDown,
    ErrorCode::TooLarge,
];

/// A save (Save, SavePart or SaveFile) passed its checks and is in flight.
pub fn record_started() {
    let m = metrics();
    let _whole = m.snapshot.read().unwrap_or_else(|e| e.into_inner());
    m.started.inc();
}

/// The label value of a failure's code (a bounded set: the wire's codes).
fn reason(code: &ErrorCode) -> &'static str {
    match code {
        ErrorCode::BadRequest => "bad_request",
        ErrorCode::BadRegion => "bad_region",
        ErrorCode::NotFound => "not_found",
        ErrorCode::Damaged => "damaged",
        ErrorCode::Io => "io",
        ErrorCode::ShuttingDown => "shutting_down",
        ErrorCode::TooLarge => "too_large",
    }
}

/// A reply about to leave for a client: Released, Durable and Failed are
/// counted; `since_s` is the time since the save arrived (None: a Failed
/// before it was in flight), `bytes` its file bytes.
pub fn record_reply(reply: &Reply, since_s: Option<f64>, bytes: u64) {
    let m = metrics();
    let _whole = m.snapshot.read().unwrap_or_else(|e| e.into_inner());
    match reply {
        Reply::Released { copy_seconds, waited_seconds, .. } => {
            m.released.inc();
            m.release_seconds.observe(since_s.unwrap_or(copy_seconds + waited_seconds));
        }
        Reply::Durable { persist_seconds, .. } => {
            m.durable.inc();
            m.bytes_written.inc_by(bytes);
            m.durable_seconds.observe(since_s.unwrap_or(*persist_seconds));
        }
        Reply::Failed { code, .. } => {
            m.failed.get_or_create(&[("reason", reason(code))]).inc();
        }
        _ => {}
    }
}

/// An incremental commit: written in full (nothing linked), or with
/// `linked_bytes` of shards hard-linked from the previous step.
pub fn record_incremental(full: bool, linked_bytes: u64) {
    let m = metrics();
    let _whole = m.snapshot.read().unwrap_or_else(|e| e.into_inner());
    if full {
        m.incremental_full.inc();
    }
    m.incremental_linked_bytes.inc_by(linked_bytes);
}

/// A load answered: read from RAM or disk, skipping damaged newer steps
/// (`fell_back`), or failed with `Err(code)`.
pub fn record_load(outcome: Result<(LoadSource, bool), ErrorCode>) {
    let m = metrics();
    let _whole = m.snapshot.read().unwrap_or_else(|e| e.into_inner());
    match outcome {
        Ok((source, fell_back)) => {
            let source = match source {
                LoadSource::Ram => "ram",
                LoadSource::Disk => "disk",
                LoadSource::Drain => "drain",
            };
            m.loads.get_or_create(&[("source", source)]).inc();
            if fell_back {
                m.loads_fell_back.inc();
            }
        }
        Err(code) => {
            m.loads_failed.get_or_create(&[("reason", reason(&code))]).inc();
        }
    }
}

fn gauge(v: u64) -> Gauge {
    let g = Gauge::default();
    g.set(i64::try_from(v).unwrap_or(i64::MAX));
    g
}

/// The metrics as OpenMetrics text, the gauges from `report` (now's).
pub fn render(report: &StatusReport) -> String {
    let m = metrics();
    let mut r = Registry::with_prefix("ckpt");
    r.register(
        "checkpoints_started",
        "Saves (checkpoints, ranks' parts, hooked files) that passed their checks",
        m.started.clone(),
    );
    r.register(
        "checkpoints_released",
        "Saves released to the trainer (the sidecar holds its copy)",
        m.released.clone(),
    );
    r.register("checkpoints_durable", "Saves committed on disk and reported durable", m.durable.clone());
    r.register("checkpoints_failed", "Saves that failed, by reason (the wire's error code)", m.failed.clone());
    r.register("bytes_written", "File bytes of the saves reported durable", m.bytes_written.clone());
    r.register(
        "release_seconds",
        "From a save's arrival to Released: the longest the trainer can wait for it",
        m.release_seconds.clone(),
    );
    r.register("durable_seconds", "From a save's arrival to Durable", m.durable_seconds.clone());
    r.register("staging_bytes", "Staging memory budget, allocated at start", gauge(report.staging_bytes));
    r.register(
        "staging_used_bytes",
        "Staging memory leased now (copies, writes, the resident image)",
        gauge(report.staging_used_bytes),
    );
    r.register("in_flight", "Saves in flight now (status: in_flight)", gauge(report.in_flight.len() as u64));
    r.register("sessions", "Connected clients now (status: sessions)", gauge(report.sessions.len() as u64));
    r.register(
        "unchanged_taken_bytes",
        "Bytes of tensors flagged unchanged (trust-version) taken from the resident image instead of copied from the client (status: unchanged_taken_bytes)",
        ConstCounter::new(report.unchanged_taken_bytes),
    );
    r.register(
        "unchanged_in_place_bytes",
        "Of those, bytes taken in place: already where the new layout puts them, copied from nowhere (status: unchanged_in_place_bytes)",
        ConstCounter::new(report.unchanged_in_place_bytes),
    );
    r.register(
        "incremental_full",
        "Incremental commits written in full: nothing linked from the previous step (--full-every, or everything changed)",
        m.incremental_full.clone(),
    );
    r.register(
        "incremental_linked_bytes",
        "Bytes of unchanged shards hard-linked from the previous step instead of written",
        m.incremental_linked_bytes.clone(),
    );
    r.register("loads", "Loads answered, by where the step was read (ram, disk, drain)", m.loads.clone());
    r.register("loads_failed", "Loads that failed, by reason (the wire's error code)", m.loads_failed.clone());
    r.register(
        "loads_fell_back",
        "Loads of latest that skipped a damaged newer step: damage on disk the sidecar found",
        m.loads_fell_back.clone(),
    );
    register_damage(&mut r, report);
    if let Some(d) = &report.drain {
        register_drain(&mut r, d);
    }
    let mut out = String::new();
    let _whole = m.snapshot.write().unwrap_or_else(|e| e.into_inner());
    encode(&mut out, &r).expect("encoding into a String cannot fail");
    out
}

/// The damage series (`crate::state::damage`), and the scrub's when it is on.
fn register_damage(r: &mut Registry, report: &StatusReport) {
    // A family of this scrape's own, from the damage record's counts.
    let found = Family::<Source, Counter>::default();
    for (by, n) in crate::state::damage::found_by() {
        found.get_or_create(&[("by", by.as_str())]).inc_by(n);
    }
    r.register(
        "damage_found",
        "Times damage of a committed step was found, by what found it (load, drain: a read-back checksum mismatch, scrub, scrub_drain: the drain target's copy); the same damage found again counts again",
        found,
    );
    let steps: std::collections::BTreeSet<u64> = report.damaged.iter().map(|d| d.step).collect();
    r.register(
        "damaged_steps",
        "Committed steps the sidecar found damaged, of the last few damage records (status: damaged)",
        gauge(steps.len() as u64),
    );
    let Some(s) = &report.scrub else { return };
    r.register(
        "scrub_passes",
        "Background scrub passes over every committed step finished",
        ConstCounter::new(s.passes),
    );
    r.register("scrub_steps_verified", "Committed steps the scrub verified", ConstCounter::new(s.steps_verified));
    r.register("scrub_bytes_verified", "File bytes the scrub read and checked", ConstCounter::new(s.bytes_verified));
    r.register(
        "scrub_drain_steps_verified",
        "Steps of the drain target the scrub verified (--drain)",
        ConstCounter::new(s.remote_steps_verified),
    );
    r.register(
        "scrub_drain_bytes_verified",
        "File bytes of the drain target's steps the scrub read and checked",
        ConstCounter::new(s.remote_bytes_verified),
    );
    let last: Gauge = Gauge::default();
    last.set(s.last_pass_unix_s.map_or(-1, |t| i64::try_from(t).unwrap_or(i64::MAX)));
    r.register(
        "scrub_last_pass_timestamp_seconds",
        "When the last scrub pass ended, in seconds since the Unix epoch (-1: none yet)",
        last,
    );
}

/// The drain's series (`--drain`), from the status report's.
fn register_drain(r: &mut Registry, d: &DrainReport) {
    let lag = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
    lag.set(d.lag_seconds);
    r.register("drain_up", "1 while the drain target answers, 0 once an upload to it failed", gauge(u64::from(d.up)));
    r.register(
        "drain_backlog_steps",
        "Committed steps not yet drained: the backlog and the step uploading",
        gauge(d.backlog.len() as u64 + u64::from(d.uploading.is_some())),
    );
    r.register("drain_backlog_bytes", "File bytes of those steps", gauge(d.backlog_bytes));
    let newest: Gauge = Gauge::default();
    newest.set(d.last_replicated.map_or(-1, |s| i64::try_from(s).unwrap_or(i64::MAX)));
    r.register("drain_last_replicated_step", "The newest step replicated on the target (-1: none yet)", newest);
    r.register("drain_lag_seconds", "Seconds since the oldest step not yet drained was committed (0: none waits)", lag);
    r.register(
        "drain_upload_failures",
        "Uploads of a step that failed (each retried with backoff)",
        ConstCounter::new(d.upload_failures),
    );
    r.register("drain_replicated", "Committed steps replicated on the target", ConstCounter::new(d.replicated_count));
    r.register(
        "drain_skipped",
        "Committed steps not drained because a newer one was drained instead",
        ConstCounter::new(d.skipped_count),
    );
    r.register(
        "drain_deleted_undrained",
        "Committed steps deleted locally (retention, rollback) before the drain reached them",
        ConstCounter::new(d.deleted_undrained_count),
    );
}
