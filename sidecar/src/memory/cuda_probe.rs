//! What the daemon's CUDA probe found ([`ckpt_cuda::probe`], once per
//! process), for `doctor --json`, `status --json` and the start-up log.

use serde_json::{json, Value};

/// `{"available": true, "driver_version": "12.8", "devices": [...]}`, or
/// `{"available": false, "error": "no CUDA driver (...)"}`. Each device says
/// its UUID (what the sidecar matches a client's device by), its compute
/// mode (exclusive-process refuses the sidecar's context beside the
/// trainer's) and, only when `with_free_memory` (doctor), its free and
/// total memory: asking creates this process's context on it, which costs
/// device memory itself.
pub fn json_with(with_free_memory: bool) -> Value {
    match ckpt_cuda::probe() {
        Ok(info) => json!({
            "available": true,
            "driver_version": version_text(info.driver_version),
            "devices": info.devices.iter().map(|d| {
                let mut row = json!({
                    "ordinal": d.ordinal,
                    "name": d.name,
                    "uuid": ckpt_cuda::uuid_text(&d.uuid),
                    "total_bytes": d.total_bytes,
                    "compute_mode": compute_mode_text(d.compute_mode),
                });
                if let Some(w) = compute_mode_warning(d.compute_mode) {
                    row["warning"] = json!(w);
                } else if d.mig {
                    row["warning"] = json!(MIG_WARNING);
                }
                row["mig"] = json!(d.mig);
                if with_free_memory {
                    match ckpt_cuda::memory_info(d.ordinal) {
                        Ok((free, _)) => row["free_bytes"] = json!(free),
                        Err(e) => row["free_bytes_error"] = json!(e.to_string()),
                    }
                }
                row
            }).collect::<Vec<_>>(),
        }),
        Err(e) => json!({"available": false, "error": e.to_string()}),
    }
}

/// [`json_with`] without free memory (no context is created).
pub fn json() -> Value {
    json_with(false)
}

/// One line: "driver 12.8, 1 device(s): NAME" or why there is none.
pub fn summary() -> String {
    match ckpt_cuda::probe() {
        Ok(info) => {
            let names: Vec<String> = info
                .devices
                .iter()
                .map(|d| match compute_mode_warning(d.compute_mode) {
                    Some(w) => format!("{} ({w})", d.name),
                    None => d.name.clone(),
                })
                .collect();
            format!(
                "driver {}, {} device(s): {}",
                version_text(info.driver_version),
                info.devices.len(),
                names.join(", ")
            )
        }
        Err(e) => e.to_string(),
    }
}

fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// `CUcomputemode` as nvidia-smi names it.
fn compute_mode_text(m: i32) -> String {
    match m {
        0 => "default".into(),
        2 => "prohibited".into(),
        3 => "exclusive-process".into(),
        other => format!("mode {other}"),
    }
}

/// What a MIG instance cannot do (docs/guide.md, "CUDA under MIG").
const MIG_WARNING: &str = "a MIG instance: legacy CUDA IPC (cudaMalloc memory, PyTorch's default allocator) is not supported under MIG, so such memory cannot be shared with the sidecar (VMM allocations exported as file descriptors are unverified there)";

fn compute_mode_warning(m: i32) -> Option<&'static str> {
    match m {
        2 => Some("compute mode prohibited: no process can create a context, the sidecar cannot copy device memory"),
        3 => Some("compute mode exclusive-process: the sidecar cannot create its context while the trainer holds one (nvidia-smi -c DEFAULT)"),
        _ => None,
    }
}
