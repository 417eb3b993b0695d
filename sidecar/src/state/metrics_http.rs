//! The HTTP side of `--metrics ADDR`: `GET /metrics` answered with
//! [`crate::state::metrics::render`] over plain HTTP/1.x, one exchange per
//! connection, on the `ckpt-metrics` thread (a request of at most
//! [`config::METRICS_REQUEST_BYTES_MAX`] read within
//! [`config::METRICS_IO_TIMEOUT_MS`]).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

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

/// Serves `GET /metrics` on `listener` from a thread of its own; `report`
/// gives the status report at each scrape.
pub fn spawn(listener: TcpListener, report: impl Fn() -> StatusReport + Send + 'static) -> std::io::Result<()> {
    if let Ok(a) = listener.local_addr() {
        info!(metrics = %format!("http://{a}/metrics"), "metrics listening");
    }
    std::thread::Builder::new().name("ckpt-metrics".into()).spawn(move || {
        for conn in listener.incoming() {
            match conn {
                Ok(s) => {
                    if let Err(e) = answer(s, &report) {
                        info!("metrics request: {e}");
                    }
                }
                Err(e) => warn!("metrics accept: {e}"),
            }
        }
    })?;
    Ok(())
}

/// One HTTP/1.x exchange: the request head read (bounded, timed out), one
/// response, the connection closed.
fn answer(mut s: TcpStream, report: &dyn Fn() -> StatusReport) -> std::io::Result<()> {
    let timeout = Some(Duration::from_millis(config::METRICS_IO_TIMEOUT_MS));
    s.set_read_timeout(timeout)?;
    s.set_write_timeout(timeout)?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() >= config::METRICS_REQUEST_BYTES_MAX {
            return respond(&mut s, "431 Request Header Fields Too Large", "text/plain", "request head too large\n");
        }
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
