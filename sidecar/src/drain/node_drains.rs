//! The drain of several nodes with node-local files (`--shared` and
//! `--drain`): the steps are committed in the shared directory; each node
//! uploads the files it holds and marks them uploaded there; the drain
//! coordinator (the node holding rank 0's files) uploads the blobs and
//! commits the remote step once every node's mark is in, then removes the
//! marks. A node waiting for the others' marks reports nothing replicated.
//! With no shared file system (`--shared-over-peers`) each node's mark is
//! also sent to the coordinator by the peers (`Drain::on_uploaded`), which
//! writes it into its own shared directory as the node would have.

use std::path::PathBuf;

use ckpt_store::catalog;
use ckpt_store::format::{self, Index, BLOBS_DIR_NAME, INDEX_FILE_NAME};
use ckpt_tier::LocalFile;
use tracing::{info, warn};

use super::uploads::{Round, Upload};
use super::{Drain, Handled};

/// Several nodes with node-local files (`--shared` and a drain): the
/// committed steps are in the shared directory; each node uploads the
/// files it holds and marks them uploaded there; the drain's coordinator
/// (`ckpt_store::nodes::drain_coordinator`: the node holding rank 0's files)
/// uploads the blobs and commits the remote step once every node's mark is in.
#[derive(Debug, Clone)]
pub struct NodesDrain {
    pub shared_dir: PathBuf,
    pub me: ckpt_store::restore::ThisNode,
}

impl Drain {
    /// [`Drain::drain_once`] for a node of several: the newest step
    /// committed in the shared directory not yet drained; Round::Idle also
    /// while it waits for the other nodes' uploads or the remote commit.
    pub(super) fn drain_once_nodes(&self, n: &NodesDrain) -> Round {
        let committed = catalog::committed_steps(&n.shared_dir).unwrap_or_default();
        let Some(newest) = self.next_step(&committed, |st, newest| st.mine_uploaded.retain(|&s| s >= newest)) else {
            return Round::Idle;
        };
        // Held from the coordinator's retention in the shared directory
        // until replicated (or a newer one is the newest not replicated).
        {
            let mut h = self.hold.lock().expect("hold lock");
            h.clear();
            h.insert(newest);
        }
        let outcome = self.upload_nodes(n, newest);
        if !matches!(outcome, Ok(None) | Err(Upload::Failed(_))) {
            self.unhold(newest);
        }
        let mut st = self.lock();
        match outcome {
            Ok(Some(stats)) => {
                st.uploading = None;
                let bps = stats.bytes as f64 / stats.seconds.max(1e-9);
                info!(
                    step = newest,
                    url = self.url(),
                    bytes = stats.bytes,
                    files = stats.files,
                    seconds = stats.seconds,
                    "replicated (every node's files; the remote index is written)"
                );
                st.handled(newest, Handled::Replicated);
                st.done_upto = Some(newest);
                st.bytes_per_s = bps;
                st.mine_uploaded.remove(&newest);
                self.mark_up(&mut st, true, String::new());
                self.answer(&mut st);
                drop(st);
                self.retain_remote();
                Round::Moved
            }
            Ok(None) => {
                if st.waiting_said != Some(newest) {
                    st.waiting_said = Some(newest);
                    info!(
                        step = newest,
                        url = self.url(),
                        "this node's files are uploaded; waiting for the other nodes' uploads and the remote commit"
                    );
                }
                self.answer(&mut st);
                Round::Idle
            }
            Err(Upload::Gone) => {
                st.uploading = None;
                info!(step = newest, "drain: step deleted before it was drained (retention or rollback); skipped");
                st.handled(newest, Handled::Deleted);
                st.done_upto = Some(newest);
                self.answer(&mut st);
                Round::Moved
            }
            Err(Upload::Damaged(why)) => {
                // Not marked uploaded: the coordinator commits no remote
                // step of it, and the nodes go on with the next step.
                self.pass_over_damaged(&mut st, newest, &why);
                self.answer(&mut st);
                Round::Moved
            }
            Err(Upload::Failed(e)) => {
                st.uploading = None;
                st.upload_failures += 1;
                self.mark_up(&mut st, false, format!("step {newest}: {e}"));
                Round::TargetFailed
            }
        }
    }

    /// This node's part of draining `step` (several nodes): its files
    /// uploaded and marked; the coordinator then, once every node's mark is
    /// in, the blobs and the remote index. Some(stats) once the step is
    /// committed remotely; None while waiting for others.
    fn upload_nodes(&self, n: &NodesDrain, step: u64) -> Result<Option<ckpt_tier::UploadStats>, Upload> {
        use ckpt_store::nodes as cn;
        let index_bytes =
            std::fs::read(catalog::step_path(&n.shared_dir, step).join(INDEX_FILE_NAME)).map_err(|_| Upload::Gone)?;
        let index = Index::from_json_bytes(&index_bytes)
            .map_err(|e| Upload::Failed(format!("index of step {step} in {}: {e}", n.shared_dir.display())))?;
        let failed = |e: ckpt_tier::TierError| Upload::Failed(e.to_string());
        let done = ckpt_tier::UploadStats { bytes: 0, files: 0, seconds: 0.0 };
        if self.target.steps().map_err(failed)?.contains(&step) {
            return Ok(Some(done));
        }
        let mut stats = done;
        if !self.lock().mine_uploaded.contains(&step) {
            let mine = node_files(&index, &n.me, step).map_err(Upload::Failed)?;
            if !mine.is_empty() {
                stats = self.target.upload_files(step, &mine).map_err(|e| self.upload_failed(step, &mine, e))?;
            }
            if index.ckpt.nodes.contains_key(&n.me.id) {
                cn::mark_uploaded(&n.shared_dir, step, &n.me.id).map_err(|e| {
                    Upload::Failed(format!("upload mark of step {step} in {}: {e}", n.shared_dir.display()))
                })?;
                if let Some(tell) = self.on_uploaded.get() {
                    tell(step);
                }
            }
            self.lock().mine_uploaded.insert(step);
        }
        if cn::drain_coordinator(&index) != Some(n.me.id.as_str()) {
            return Ok(None);
        }
        let marked = cn::uploaded_nodes(&n.shared_dir, step)
            .map_err(|e| Upload::Failed(format!("upload marks of step {step}: {e}")))?;
        if index.ckpt.nodes.keys().any(|id| !marked.contains(id)) {
            return Ok(None);
        }
        let step_name = format::step_dir_name(step).map_err(|e| Upload::Failed(e.to_string()))?;
        let blobs: Vec<LocalFile> = index
            .ckpt
            .blobs
            .iter()
            .map(|b| {
                let name = format!("{BLOBS_DIR_NAME}/{}", b.name);
                LocalFile {
                    local_path: n.shared_dir.join(&step_name).join(&name),
                    name,
                    len: b.len_bytes,
                    crc32c: b.crc32c,
                }
            })
            .collect();
        if !blobs.is_empty() {
            let b = self.target.upload_files(step, &blobs).map_err(failed)?;
            stats = ckpt_tier::UploadStats {
                bytes: stats.bytes + b.bytes,
                files: stats.files + b.files,
                seconds: stats.seconds + b.seconds,
            };
        }
        self.target.commit_step(step, &cn::flattened_index(index).to_json_bytes()).map_err(failed)?;
        if let Err(e) = cn::remove_upload_marks(&n.shared_dir, step) {
            warn!(step, "could not remove the upload marks of step {step} ({e})");
        }
        Ok(Some(stats))
    }
}

/// This node's files of a node-local step (`ckpt.nodes`), read from its own
/// directories' `node-step-…` folders.
fn node_files(index: &Index, me: &ckpt_store::restore::ThisNode, step: u64) -> Result<Vec<LocalFile>, String> {
    let folder = format::node_step_dir_name(step).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for f in &index.ckpt.files {
        if index.holder(&f.name).map(|(id, _)| id) != Some(me.id.as_str()) {
            continue;
        }
        let dir = me.dirs.get(f.dir_idx as usize).ok_or_else(|| {
            format!("step {step}: file {} is in directory #{} of this node's {}", f.name, f.dir_idx, me.dirs.len())
        })?;
        out.push(LocalFile {
            local_path: dir.join(&folder).join(&f.name),
            name: f.name.clone(),
            len: f.len_bytes,
            crc32c: f.crc32c,
        });
    }
    Ok(out)
}
