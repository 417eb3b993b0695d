//! Directories a command that creates its own (`serve`, `launch`: their
//! target directories and the socket's; `bench write`) found missing: a
//! failed start removes again those it left empty, so a refused command
//! leaves nothing behind. Only empty ones go (`remove_dir`), deepest first:
//! nothing a command wrote is ever removed.

use std::path::{Path, PathBuf};

use super::args::{BenchCmd, Cmd};

/// The directories a command will create that are missing now, every
/// missing ancestor too (ckpt-bench does the same for `bench stall`).
pub struct Made(Vec<PathBuf>);

impl Made {
    /// What `cmd` would create that is missing, taken before it runs.
    pub fn before(cmd: &Cmd) -> Made {
        let mut paths: Vec<PathBuf> = Vec::new();
        match cmd {
            Cmd::Serve { d } | Cmd::Launch { d, .. } => {
                paths.extend(d.dirs.iter().cloned());
                if matches!(cmd, Cmd::Serve { .. }) || d.socket.is_some() {
                    let sock = d.socket.clone().unwrap_or_else(ckpt_sidecar::daemon::server::default_socket_path);
                    paths.extend(sock.parent().map(Path::to_path_buf));
                }
            }
            Cmd::Bench { what: BenchCmd::Write { dirs, .. } } => paths.extend(dirs.iter().cloned()),
            _ => {}
        }
        let mut missing = Vec::new();
        for p in paths {
            // Every missing ancestor, deepest first.
            for a in p.ancestors().filter(|a| !a.as_os_str().is_empty()) {
                if std::fs::symlink_metadata(a).is_ok() {
                    break;
                }
                if !missing.contains(&a.to_path_buf()) {
                    missing.push(a.to_path_buf());
                }
            }
        }
        Made(missing)
    }

    /// Removes what `before` found missing and is empty now, deepest first.
    pub fn undo(mut self) {
        self.0.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for p in &self.0 {
            let _ = std::fs::remove_dir(p); // only if empty
        }
    }
}
