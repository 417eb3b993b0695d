//! What `ls`, `inspect` and `verify` print, for a local directory and a
//! drain target alike (`local.rs`, `remote.rs`): the table or line a
//! person reads, or with `--json` one document on one line.

use ckpt_store::format;
use ckpt_store::restore;
use ckpt_store::units::human_bytes;
use serde_json::json;

/// `ls`'s output (a directory's or a drain target's): `doc` is the JSON
/// document, `{"dir" or "url", "latest", "checked", "not_checked",
/// "checkpoints": rows}`, each row with `damaged` and `damage` (what the
/// checks named in `checked` found).
pub fn print_ls(shown: &str, doc: serde_json::Value, json: bool) {
    let rows = doc["checkpoints"].as_array().cloned().unwrap_or_default();
    if json {
        println!("{doc}");
        return;
    }
    if rows.is_empty() {
        println!("{shown}: no committed checkpoint");
        return;
    }
    println!("{:>12}  {:>5}  {:>8}  {:>12}  LATEST", "STEP", "RANKS", "TENSORS", "BYTES");
    for r in &rows {
        let latest = if r["latest"].as_bool() == Some(true) { "*" } else { "" };
        let damage: Vec<&str> =
            r["damage"].as_array().map(|d| d.iter().filter_map(|p| p.as_str()).collect()).unwrap_or_default();
        let mark = if r["bytes"].as_u64().is_none() {
            "  index unreadable (damaged: see inspect, verify)".to_string()
        } else if let Some(first) = damage.first() {
            let more =
                if damage.len() > 1 { format!(" (and {} more: see verify)", damage.len() - 1) } else { String::new() };
            format!("  DAMAGED: {first}{more}")
        } else {
            String::new()
        };
        let line = format!(
            "{:>12}  {:>5}  {:>8}  {:>12}  {:<6}{}",
            r["step"].as_u64().unwrap_or_default(),
            r["world_size"].as_u64().map_or("?".into(), |t| t.to_string()),
            r["tensors"].as_u64().map_or("?".into(), |t| t.to_string()),
            r["bytes"].as_u64().map_or("?".into(), human_bytes),
            latest,
            mark
        );
        println!("{}", line.trim_end());
        for (id, n) in r["nodes"].as_object().into_iter().flatten() {
            let files = n["files"].as_u64().unwrap_or_default();
            let dirs: Vec<&str> = n["dirs"].as_array().into_iter().flatten().filter_map(|d| d.as_str()).collect();
            let held = match n["held_by"].as_array() {
                Some(by) if by.is_empty() => "; held by no peer asked".to_string(),
                Some(by) => {
                    format!("; held by peers: {}", by.iter().filter_map(|p| p.as_str()).collect::<Vec<_>>().join(", "))
                }
                None => String::new(),
            };
            println!(
                "{:>14}node {id}: {} ({}) in {}{held}",
                "",
                plural(files as usize, "file"),
                human_bytes(n["bytes"].as_u64().unwrap_or_default()),
                dirs.join(", ")
            );
        }
    }
    for p in doc["peers"].as_array().into_iter().flatten() {
        match (p["node"].as_str(), p["error"].as_str()) {
            (Some(node), _) => println!("peer {} is node {node}", p["addr"].as_str().unwrap_or_default()),
            (_, Some(why)) => println!("peer {}: not asked: {why}", p["addr"].as_str().unwrap_or_default()),
            _ => {}
        }
    }
    if let (Some(checked), Some(not)) = (doc["checked"].as_str(), doc["not_checked"].as_str()) {
        println!("checked: {checked}; not checked: {not}");
    }
}

/// `1 file`, `2 files`.
fn plural(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// `inspect`'s output for one step's index, found at `location`.
pub fn print_inspect(index: &format::Index, location: &str, json: bool) -> anyhow::Result<()> {
    let logical = index.logical();
    if json {
        // The index as stored, plus `logical`: every tensor as readers see
        // it (a tensor stored in slices once, with its slices).
        let mut v = serde_json::to_value(index)?;
        let l: serde_json::Map<String, serde_json::Value> = logical
            .iter()
            .map(|t| {
                let slices: Vec<_> = t
                    .slices
                    .iter()
                    .map(|s| json!({"tensor": s.tensor, "rank": ckpt_store::ranks::rank_of_file(s.file), "file": s.file, "elems": s.elems, "data_offsets": s.data_offsets, "crc32c": s.crc32c}))
                    .collect();
                (t.name.to_string(), json!({"dtype": t.dtype.as_str(), "shape": t.shape, "len_bytes": t.len_bytes(), "slices": slices}))
            })
            .collect();
        v["logical"] = serde_json::Value::Object(l);
        println!("{v}");
        return Ok(());
    }
    let c = &index.ckpt;
    let bytes: u64 = c.files.iter().map(|f| f.len_bytes).sum();
    let stored =
        if logical.len() == c.tensors.len() { String::new() } else { format!(" ({} stored)", c.tensors.len()) };
    println!(
        "step {} in {}: {}{stored}, {}, {}",
        c.step,
        location,
        plural(logical.len(), "tensor"),
        plural(c.files.len(), "file"),
        human_bytes(bytes)
    );
    println!("{}", ckpt_store::ranks::describe(index));
    println!("{:<48} {:<8} {:<20} {:>12}  FILE", "TENSOR", "DTYPE", "SHAPE", "SIZE");
    for t in &logical {
        let (size, shape) = (human_bytes(t.len_bytes()), format!("{:?}", t.shape));
        if !t.is_sliced() {
            println!("{:<48} {:<8} {:<20} {:>12}  {}", t.name, t.dtype.as_str(), shape, size, t.slices[0].file);
            continue;
        }
        println!(
            "{:<48} {:<8} {:<20} {:>12}  {}",
            t.name,
            t.dtype.as_str(),
            shape,
            size,
            plural(t.slices.len(), "slice")
        );
        for s in &t.slices {
            let rank = ckpt_store::ranks::rank_of_file(s.file).map_or("?".into(), |r| r.to_string());
            let what = format!("slice elems [{}, {}) rank {rank}", s.elems[0], s.elems[1]);
            println!("  {:<75} {:>12}  {}", what, human_bytes(s.data_offsets[1] - s.data_offsets[0]), s.file);
        }
    }
    for b in &c.blobs {
        println!("blob {:<43} {:>42}", b.name, human_bytes(b.len_bytes));
    }
    Ok(())
}

/// One checkpoint of `verify --json`.
pub fn verify_row(r: &restore::VerifyReport, index: Option<&format::Index>) -> serde_json::Value {
    json!({
        "step": r.step, "ok": r.problems.is_empty(), "files": r.files, "tensors": r.tensors, "bytes": r.bytes,
        "world_size": index.map(|i| i.ckpt.world_size),
        "bytes_per_rank": index.map(|i| ckpt_store::ranks::bytes_per_rank(i).into_values().collect::<Vec<u64>>()),
        "seconds": r.seconds, "problems": r.problems.iter().map(|p| json!({"file": p.file, "tensor": p.tensor, "what": p.what})).collect::<Vec<_>>(),
    })
}

pub fn print_verify(r: &restore::VerifyReport) {
    if r.problems.is_empty() {
        println!(
            "step {}: ok ({} files, {} tensors, {} in {:.2} s)",
            r.step,
            r.files,
            r.tensors,
            human_bytes(r.bytes),
            r.seconds
        );
    } else {
        println!("step {}: DAMAGED", r.step);
        for p in &r.problems {
            println!("  {p}");
        }
    }
}
