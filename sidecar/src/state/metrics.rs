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

use ckpt_wire::{ErrorCode, Reply, StatusReport};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::config;

type Reason = [(&'static str, &'static str); 1];

/// What the daemon counts from its start.
pub struct Metrics {
    started: Counter,
    released: Counter,
    durable: Counter,
    failed: Family<Reason, Counter>,
    bytes_written: Counter,
    release_seconds: Histogram,
    durable_seconds: Histogram,
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
        let failed = Family::default();
        for code in REASONS {
            let _ = failed.get_or_create(&[("reason", reason(&code))]); // every reason shown, from 0
        }
        Metrics {
            started: Counter::default(),
            released: Counter::default(),
            durable: Counter::default(),
            failed,
            bytes_written: Counter::default(),
            release_seconds: Histogram::new(seconds_buckets()),
            durable_seconds: Histogram::new(seconds_buckets()),
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
    let mut out = String::new();
    let _whole = m.snapshot.write().unwrap_or_else(|e| e.into_inner());
    encode(&mut out, &r).expect("encoding into a String cannot fail");
    out
}
