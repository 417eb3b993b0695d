//! Loads that read the drain target: whether a load must (the step is not
//! committed locally, or the target holds a newer `latest`), and the
//! remote step made readable ([`RemoteCkpt`]: a `file://` target's
//! directory in place, or an object store's step streamed into the load's
//! memory). A remote step whose index is damaged is passed over, said in
//! `fell_back`.

use std::path::PathBuf;

use ckpt_store::catalog;
use ckpt_store::format::Index;
use ckpt_wire::ErrorCode;
use tracing::warn;

use super::remote_source::{RemoteCkpt, RemoteFrom, RemoteStep};
use super::Drain;

/// Why a remote step could not be made readable.
enum Fetch {
    Missing,
    Damaged(String),
    Io(String),
}

impl Drain {
    /// Remote steps (for List and `latest`); None when the target does not
    /// answer, or is known to be down (a load of `latest` then reads the
    /// local directories at once, without waiting for the target's retries).
    pub fn remote_steps(&self) -> Option<Vec<u64>> {
        if !self.lock().up {
            return None;
        }
        match self.target.steps() {
            Ok(s) => Some(s),
            Err(e) => {
                warn!(url = self.url(), "listing the drain target failed ({e}); loads use the local directories");
                None
            }
        }
    }

    /// Whether a load of `step` (None: latest) must read the drain target:
    /// the step is not committed locally, or (latest) the target holds a
    /// newer one. Then the step, made readable as a checkpoint directory;
    /// a remote step whose index is damaged is passed over (latest: the
    /// previous remote step is tried, and `fell_back` says so).
    pub fn remote_source(
        &self,
        step: Option<u64>,
        local_latest: Option<u64>,
    ) -> Result<Option<RemoteCkpt>, (ErrorCode, String)> {
        match step {
            Some(s) => {
                if catalog::is_readable(self.primary(), s) {
                    return Ok(None);
                }
                self.fetch(s).map(Some).map_err(|e| match e {
                    Fetch::Missing => (
                        ErrorCode::NotFound,
                        format!("step {s} is committed neither locally nor on the drain target {}", self.url()),
                    ),
                    Fetch::Damaged(why) => (ErrorCode::Damaged, why),
                    Fetch::Io(why) => (ErrorCode::Io, why),
                })
            }
            None => {
                let Some(remote) = self.remote_steps() else { return Ok(None) };
                let mut fell_back = Vec::new();
                for &s in remote.iter().rev().filter(|&&s| local_latest.is_none_or(|l| s > l)) {
                    match self.fetch(s) {
                        Ok(mut r) => {
                            r.fell_back = fell_back;
                            return Ok(Some(r));
                        }
                        Err(Fetch::Missing) => {}
                        Err(Fetch::Damaged(why) | Fetch::Io(why)) => {
                            warn!(
                                step = s,
                                url = self.url(),
                                "remote step unreadable, falling back to the previous replicated step: {why}"
                            );
                            fell_back.push(why);
                        }
                    }
                }
                if !fell_back.is_empty() {
                    warn!(?fell_back, "no newer remote step readable; loading the local latest");
                }
                Ok(None)
            }
        }
    }

    /// Remote step `step`, made readable as a checkpoint directory (a load
    /// whose local copy of it is damaged reads this one).
    pub fn remote_copy(&self, step: u64) -> Result<RemoteCkpt, (ErrorCode, String)> {
        self.fetch(step).map_err(|e| match e {
            Fetch::Missing => (ErrorCode::NotFound, format!("step {step} is not on the drain target {}", self.url())),
            Fetch::Damaged(why) => (ErrorCode::Damaged, why),
            Fetch::Io(why) => (ErrorCode::Io, why),
        })
    }

    /// Makes remote step `step` readable for a load: a `file://` target's
    /// directory, read in place; an object store's step, streamed into the
    /// load's memory (its index fetched and parsed here; every file's
    /// bytes are checked by the load as they arrive).
    fn fetch(&self, step: u64) -> Result<RemoteCkpt, Fetch> {
        let url = self.url();
        let index_bytes = self.target.get_index(step).map_err(|e| match e {
            ckpt_tier::TierError::NotFound { .. } => Fetch::Missing,
            e => Fetch::Io(e.to_string()),
        })?;
        let index = Index::from_json_bytes(&index_bytes)
            .map_err(|e| Fetch::Damaged(format!("step {step} on {url}: remote index damaged: {e}")))?;
        // A file:// target is a checkpoint directory: read in place.
        if let Some(root) = url.strip_prefix("file://") {
            return Ok(RemoteCkpt { step, from: RemoteFrom::Dir(PathBuf::from(root)), fell_back: Vec::new() });
        }
        let n_files = index.ckpt.files.len();
        Ok(RemoteCkpt {
            step,
            from: RemoteFrom::Stream(RemoteStep::new(self.target.clone(), step, index_bytes, index, n_files)),
            fell_back: Vec::new(),
        })
    }

    /// The files of step `step` on the target, for a load that reads this
    /// node's own files locally and fetches `n_files` others (several
    /// nodes): the step must be committed there.
    pub fn remote_files(&self, step: u64, n_files: usize) -> Result<RemoteStep, (ErrorCode, String)> {
        let index_bytes = self.target.get_index(step).map_err(|e| match e {
            ckpt_tier::TierError::NotFound { .. } => {
                (ErrorCode::NotFound, format!("step {step} is not on the drain target {}", self.url()))
            }
            e => (ErrorCode::Io, e.to_string()),
        })?;
        let index = Index::from_json_bytes(&index_bytes)
            .map_err(|e| (ErrorCode::Damaged, format!("step {step} on {}: remote index damaged: {e}", self.url())))?;
        Ok(RemoteStep::new(self.target.clone(), step, index_bytes, index, n_files))
    }
}
