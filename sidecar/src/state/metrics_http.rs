//! The HTTP side of `--metrics ADDR`: `GET /metrics` answered with
//! [`crate::state::metrics::render`] over plain HTTP/1.x, one exchange per
//! connection. The `ckpt-metrics` thread accepts; each connection is served
//! on a thread of its own (`ckpt-metrics-conn`), at most
//! [`config::METRICS_CONNECTIONS_MAX`] at once, its request head (at most
//! [`config::METRICS_REQUEST_BYTES_MAX`]) read within
//! [`config::METRICS_IO_TIMEOUT_MS`] in all. So clients that send half a
//! request and wait delay no scrape; past the bound, the next connection
//! waits for a slot, which each frees within its deadlines.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ckpt_wire::StatusReport;
use tracing::{info, warn};

use crate::config;
use crate::state::metrics::render;

#[derive(Debug, thiserror::Error)]
#[error("cannot serve metrics on {addr} (--metrics): {source}")]
pub struct BindError {
    addr: SocketAddr,
    source: std::io::Error,
}

/// Binds ADDR (before the daemon starts, so a taken port fails the start).
pub fn bind(addr: SocketAddr) -> Result<TcpListener, BindError> {
    TcpListener::bind(addr).map_err(|source| BindError { addr, source })
}

/// Serves `GET /metrics` on `listener` from threads of its own; `report`
/// gives the status report at each scrape.
pub fn spawn(listener: TcpListener, report: impl Fn() -> StatusReport + Send + Sync + 'static) -> std::io::Result<()> {
    if let Ok(a) = listener.local_addr() {
        info!(metrics = %format!("http://{a}/metrics"), "metrics listening");
    }
    let report: Arc<dyn Fn() -> StatusReport + Send + Sync> = Arc::new(report);
    let slots = Arc::new(Slots { busy: Mutex::new(0), freed: Condvar::new() });
    std::thread::Builder::new().name("ckpt-metrics".into()).spawn(move || {
        for conn in listener.incoming() {
            match conn {
                Ok(s) => {
                    let slot = Slots::take(&slots);
                    let report = report.clone();
                    let served = std::thread::Builder::new().name("ckpt-metrics-conn".into()).spawn(move || {
                        let _slot = slot;
                        if let Err(e) = answer(s, &*report) {
                            info!("metrics request: {e}");
                        }
                    });
                    if let Err(e) = served {
                        warn!("cannot start a metrics thread: {e}");
                    }
                }
                Err(e) => warn!("metrics accept: {e}"),
            }
        }
    })?;
    Ok(())
}

/// The connections being served, at most [`config::METRICS_CONNECTIONS_MAX`].
struct Slots {
    busy: Mutex<usize>,
    freed: Condvar,
}

/// One connection's slot, freed on drop.
struct Slot(Arc<Slots>);

impl Slots {
    /// Waits for a free slot and takes it.
    fn take(slots: &Arc<Slots>) -> Slot {
        let mut busy = slots.busy.lock().unwrap_or_else(|p| p.into_inner());
        while *busy >= config::METRICS_CONNECTIONS_MAX {
            busy = slots.freed.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        *busy += 1;
        Slot(slots.clone())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        *self.0.busy.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
        self.0.freed.notify_one();
    }
}

/// One HTTP/1.x exchange: the request head read (bounded, within one
/// deadline for all its reads), one response, the connection closed.
fn answer(mut s: TcpStream, report: &dyn Fn() -> StatusReport) -> std::io::Result<()> {
    let timeout = Duration::from_millis(config::METRICS_IO_TIMEOUT_MS);
    let deadline = Instant::now() + timeout;
    s.set_write_timeout(Some(timeout))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() >= config::METRICS_REQUEST_BYTES_MAX {
            return respond(&mut s, "431 Request Header Fields Too Large", "text/plain", "request head too large\n");
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the request head did not arrive in time"));
        }
        s.set_read_timeout(Some(left))?;
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or(&[]);
    let mut words = line.split(|&b| b == b' ');
    let (method, target) = (words.next().unwrap_or(&[]), words.next().unwrap_or(&[]));
    let path = target.split(|&b| b == b'?').next().unwrap_or(&[]);
    match (method, path) {
        (b"GET", b"/metrics") => {
            respond(&mut s, "200 OK", "application/openmetrics-text; version=1.0.0; charset=utf-8", &render(&report()))
        }
        (b"GET", _) => respond(&mut s, "404 Not Found", "text/plain", "only /metrics here\n"),
        _ => respond(&mut s, "405 Method Not Allowed", "text/plain", "GET /metrics\n"),
    }
}

fn respond(s: &mut TcpStream, status: &str, content_type: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    s.flush()
}
