//! The cluster secret (`--peer-secret-file`, or the file
//! `CKPT_SIDECAR_PEER_SECRET_FILE` names): read once at start and refused
//! when it is short or readable by others than its owner (as ssh refuses a
//! private key), so a secret that leaked through its mode never counts.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use ckpt_wire::peer::PEER_SECRET_BYTES_MIN;

/// Bytes read from the secret file at most (a secret is a few dozen).
const SECRET_FILE_BYTES_MAX: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("peer secret {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("peer secret {path}: mode {mode:o} lets others than its owner read it; chmod 600 it")]
    Readable { path: PathBuf, mode: u32 },
    #[error("peer secret {path}: {len_bytes} bytes; at least {min} (e.g. head -c 32 /dev/urandom > FILE)", min = PEER_SECRET_BYTES_MIN)]
    Short { path: PathBuf, len_bytes: u64 },
    #[error("peer secret {path}: {len_bytes} bytes; at most {max}", max = SECRET_FILE_BYTES_MAX)]
    Long { path: PathBuf, len_bytes: u64 },
}

/// The secret's bytes, as the file holds them (every byte counts: a
/// trailing newline is part of the secret on every node alike).
pub fn read_secret(path: &Path) -> Result<Vec<u8>, SecretError> {
    let read = |source| SecretError::Read { path: path.to_path_buf(), source };
    let meta = std::fs::metadata(path).map_err(read)?;
    if meta.mode() & 0o077 != 0 {
        return Err(SecretError::Readable { path: path.to_path_buf(), mode: meta.mode() & 0o7777 });
    }
    if meta.len() > SECRET_FILE_BYTES_MAX {
        return Err(SecretError::Long { path: path.to_path_buf(), len_bytes: meta.len() });
    }
    let bytes = std::fs::read(path).map_err(read)?;
    if bytes.len() < PEER_SECRET_BYTES_MIN {
        return Err(SecretError::Short { path: path.to_path_buf(), len_bytes: bytes.len() as u64 });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file(dir: &Path, bytes: &[u8], mode: u32) -> PathBuf {
        let p = dir.join("k");
        std::fs::write(&p, bytes).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn a_secret_is_refused_when_short_or_readable_by_others_and_read_whole_otherwise() {
        let d = tempfile::tempdir().unwrap();
        let p = file(d.path(), &[7u8; 31], 0o600);
        assert!(matches!(read_secret(&p), Err(SecretError::Short { len_bytes: 31, .. })));
        let p = file(d.path(), &[7u8; 32], 0o640);
        assert!(matches!(read_secret(&p), Err(SecretError::Readable { mode: 0o640, .. })));
        let p = file(d.path(), &[7u8; 32], 0o400);
        assert_eq!(read_secret(&p).unwrap(), vec![7u8; 32]);
        assert!(matches!(read_secret(&d.path().join("none")), Err(SecretError::Read { .. })));
    }
}
