//! What the daemon's CUDA probe found ([`ckpt_cuda::probe`], once per
//! process), for `doctor --json`, `status --json` and the start-up log.

use serde_json::{json, Value};

/// `{"available": true, "driver_version": "12.8", "devices": [...]}`, or
/// `{"available": false, "error": "no CUDA driver (...)"}`.
pub fn json() -> Value {
    match ckpt_cuda::probe() {
        Ok(info) => json!({
            "available": true,
            "driver_version": version_text(info.driver_version),
            "devices": info.devices.iter().map(|d| json!({"ordinal": d.ordinal, "name": d.name, "total_bytes": d.total_bytes})).collect::<Vec<_>>(),
        }),
        Err(e) => json!({"available": false, "error": e.to_string()}),
    }
}

/// One line: "driver 12.8, 1 device(s): NAME" or why there is none.
pub fn summary() -> String {
    match ckpt_cuda::probe() {
        Ok(info) => {
            let names: Vec<&str> = info.devices.iter().map(|d| d.name.as_str()).collect();
            format!("driver {}, {} device(s): {}", version_text(info.driver_version), info.devices.len(), names.join(", "))
        }
        Err(e) => e.to_string(),
    }
}

fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}
