//! Names of the folders and files of a checkpoint (docs/format.md): the
//! step folders and their temp, delete and rank-sharing kin, shard files,
//! rank markers, node-local folders, and the checks on names that come from
//! outside (tensor, blob and node names).
//!
//! Invariant: every name built here parses back to what built it, and every
//! name checked here is safe as a file name or JSON key (no `../`, NUL,
//! control characters or hidden files).

use super::FormatError;
use crate::config;

pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";
pub const LATEST_FILE_NAME: &str = "latest";
pub const BLOBS_DIR_NAME: &str = "blobs";
pub const STEP_PREFIX: &str = "step-";
pub const TMP_PREFIX: &str = ".tmp-step-";
pub const DEL_PREFIX: &str = ".del-step-";
pub const LATEST_TMP_PREFIX: &str = ".latest.tmp-";
/// Scratch files of the O_DIRECT probe, when the file system lacks O_TMPFILE.
pub const PROBE_PREFIX: &str = ".ckpt-probe-";
/// A rollback in progress (the step it goes back to), in the primary;
/// recovery finishes what it names.
pub const ROLLBACK_FILE_NAME: &str = ".ckpt-rollback";
const STEP_DIGITS: usize = 12;
/// Largest step that fits the 12-digit folder name.
pub const STEP_MAX: u64 = 999_999_999_999;

/// Tensor names are free text for safetensors, but they end up as JSON keys
/// and in error messages: no NUL or other control characters, not empty, not
/// the reserved `__metadata__`, bounded length.
pub fn validate_tensor_name(name: &str) -> Result<(), FormatError> {
    let err = |why| Err(FormatError::TensorName { name: name.to_string(), why });
    if name.is_empty() {
        return err("empty");
    }
    if name.len() > config::TENSOR_NAME_BYTES_MAX {
        return err("longer than 1024 bytes");
    }
    if name.chars().any(char::is_control) {
        return err("contains a control character (NUL, newline, ...)");
    }
    if name == "__metadata__" {
        return err("reserved by safetensors");
    }
    Ok(())
}

/// Blob names become file names under `blobs/`: a strict alphabet, so that
/// `../`, absolute paths, NUL and hidden files are impossible.
pub fn validate_blob_name(name: &str) -> Result<(), FormatError> {
    let err = |why| Err(FormatError::BlobName { name: name.to_string(), why });
    if name.is_empty() {
        return err("empty");
    }
    if name.len() > config::BLOB_NAME_BYTES_MAX {
        return err("longer than 200 bytes");
    }
    if name.starts_with('.') {
        return err("starts with '.'");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-') {
        return err("only ASCII letters, digits, '.', '_' and '-' are allowed");
    }
    Ok(())
}

pub fn step_dir_name(step: u64) -> Result<String, FormatError> {
    if step > STEP_MAX {
        return Err(FormatError::StepTooLarge(step));
    }
    Ok(format!("{STEP_PREFIX}{step:0w$}", w = STEP_DIGITS))
}

/// Parses `step-000000000100` into 100; anything else is None.
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.len() != STEP_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

pub fn shard_file_name(rank: u32, world_size: u32, shard_idx: usize) -> String {
    format!("rank-{rank:05}-of-{world_size:05}-shard-{shard_idx:04}.safetensors")
}

/// The temp folder of a step that the sidecars of several nodes write
/// together into the shared directory (docs/format.md, "Several nodes"):
/// `.tmp-step-<12 digits>-ranks`. Its name is a function of the step alone,
/// so every node finds the same folder without speaking to the others.
pub fn ranks_tmp_name(step: u64) -> Result<String, FormatError> {
    let step_name = step_dir_name(step)?;
    Ok(format!("{TMP_PREFIX}{}{RANKS_TMP_SUFFIX}", &step_name[STEP_PREFIX.len()..]))
}

/// The step of a [`ranks_tmp_name`] folder.
pub fn parse_ranks_tmp_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(TMP_PREFIX)?.strip_suffix(RANKS_TMP_SUFFIX)?;
    parse_step_dir_name(&format!("{STEP_PREFIX}{digits}"))
}

pub const RANKS_TMP_SUFFIX: &str = "-ranks";

/// What follows a [`ranks_tmp_name`] in the name of its coordinator's
/// abort record (a file beside the folder: `nodes::abort_record_path`).
pub const RANKS_ABORT_SUFFIX: &str = ".aborted";

/// One rank's marker in a [`ranks_tmp_name`] folder: `rank-RRRRR.done`, an
/// index of that rank's files, tensors and blobs, written and synced after
/// them.
pub fn rank_marker_name(rank: u32) -> String {
    format!("rank-{rank:05}{RANK_MARKER_SUFFIX}")
}

/// The rank of a [`rank_marker_name`].
pub fn parse_rank_marker_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("rank-")?.strip_suffix(RANK_MARKER_SUFFIX)?;
    (digits.len() == 5 && digits.bytes().all(|b| b.is_ascii_digit())).then(|| digits.parse().ok()).flatten()
}

pub const RANK_MARKER_SUFFIX: &str = ".done";

/// A node's own folder of a step whose shards it holds on its local disks
/// (docs/format.md, "Node-local files"): `node-step-<12 digits>` in each of
/// the node's directories. Not a checkpoint by itself (no index): its files
/// count only through the shared directory's committed index, which names
/// the node holding each of them.
pub fn node_step_dir_name(step: u64) -> Result<String, FormatError> {
    Ok(format!("{NODE_STEP_PREFIX}{}", step_dir_name(step)?))
}

/// The step of a [`node_step_dir_name`] folder.
pub fn parse_node_step_dir_name(name: &str) -> Option<u64> {
    parse_step_dir_name(name.strip_prefix(NODE_STEP_PREFIX)?)
}

pub const NODE_STEP_PREFIX: &str = "node-";

/// A node id as the index records it (`--node-id`, default the host
/// name): 1 to 64 bytes of ASCII letters, digits, `.`, `_`, `-`, not
/// starting with `.` (it is shown in errors and logs, never a path).
pub fn validate_node_id(id: &str) -> Result<(), FormatError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(FormatError::Index(format!(
            "node id {id:?}: 1 to 64 of ASCII letters, digits, '.', '_', '-', not starting with '.'"
        )))
    }
}

/// Rank `rank`'s slice declarations beside its marker, `rank-RRRRR.slices.json`
/// (only when it declares some): JSON `{"slices": [{"piece", "of", "shape",
/// "elems"}]}`, written and synced before the marker.
pub fn rank_slices_name(rank: u32) -> String {
    format!("rank-{rank:05}.slices.json")
}

/// Whether `name` could have been produced by [`shard_file_name`].
pub fn is_shard_file_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("rank-").and_then(|r| r.strip_suffix(".safetensors")) else {
        return false;
    };
    let b = rest.as_bytes();
    // "00000-of-00001-shard-0000"
    b.len() == 25
        && b[..5].iter().all(u8::is_ascii_digit)
        && &rest[5..9] == "-of-"
        && b[9..14].iter().all(u8::is_ascii_digit)
        && &rest[14..21] == "-shard-"
        && b[21..].iter().all(u8::is_ascii_digit)
}

/// The rank that wrote a shard, from its name (`rank-RRRRR-of-...`).
pub fn rank_of_shard_file(name: &str) -> Option<u32> {
    if !is_shard_file_name(name) {
        return None;
    }
    name["rank-".len().."rank-".len() + 5].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_round_trip_and_reject_others() {
        assert_eq!(step_dir_name(100).unwrap(), "step-000000000100");
        assert_eq!(parse_step_dir_name("step-000000000100"), Some(100));
        assert_eq!(parse_step_dir_name("step-100"), None);
        assert_eq!(parse_step_dir_name("step-00000000010a"), None);
        assert_eq!(parse_step_dir_name(".tmp-step-000000000100-ab"), None);
        assert!(step_dir_name(STEP_MAX + 1).is_err());
    }

    #[test]
    fn blob_names_refuse_path_tricks() {
        for bad in ["", "..", "../x", "/etc/passwd", "a/b", "a\0b", ".hidden", "a b"] {
            assert!(validate_blob_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["rng", "loader-state.pkl", "config_v2.json"] {
            validate_blob_name(good).unwrap();
        }
    }

    #[test]
    fn tensor_names_refuse_control_characters() {
        assert!(validate_tensor_name("a\0b").is_err());
        assert!(validate_tensor_name("a\nb").is_err());
        assert!(validate_tensor_name("").is_err());
        assert!(validate_tensor_name("__metadata__").is_err());
        validate_tensor_name("model.layers.0.weight").unwrap();
    }

    #[test]
    fn shard_names_are_recognised() {
        let n = shard_file_name(3, 8, 12);
        assert_eq!(n, "rank-00003-of-00008-shard-0012.safetensors");
        assert!(is_shard_file_name(&n));
        assert!(!is_shard_file_name("../rank-00003-of-00008-shard-0012.safetensors"));
        assert!(!is_shard_file_name("rank-0003-of-00008-shard-0012.safetensors"));
    }
}
