//! One step's upload to the drain target (one node's own steps): its
//! files from staging while the step's image is resident there
//! ([`ResidentFiles`], every part checked against the index's crc32c), else
//! from disk, or copied on the target when the file is the same local file
//! as in the step last replicated (an incremental save's hard link); then
//! the index, the remote commit point. Nothing counts as replicated before
//! that index is written. Also `--drain-keep`'s remote retention.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use ckpt_store::catalog;
use ckpt_store::format::{self, Index, BLOBS_DIR_NAME, INDEX_FILE_NAME};
use ckpt_tier::LocalFile;
use tracing::{error, info, warn};

use super::{Drain, Handled, State};
use crate::config;
use crate::memory::staging::Lent;

/// A local file's identity: the same inode (an incremental save links an
/// unchanged shard of the previous step), not modified since, with the
/// same length and checksum in both indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FileId {
    dev: u64,
    ino: u64,
    mtime_ns: i128,
    len: u64,
    crc32c: u32,
}

impl FileId {
    fn of(f: &LocalFile) -> Option<FileId> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&f.local_path).ok()?;
        Some(FileId {
            dev: m.dev(),
            ino: m.ino(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            len: f.len,
            crc32c: f.crc32c,
        })
    }
}

/// What one step's drain moved: uploaded, or copied on the target.
#[derive(Debug, Clone, Copy)]
struct Moved {
    stats: ckpt_tier::UploadStats,
    copied_bytes: u64,
    copied_files: usize,
    /// Of the bytes uploaded, those taken from staging memory.
    from_memory_bytes: u64,
}

/// What one round of the drain did, and so when the next one runs.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Round {
    /// A step was uploaded, or passed over (gone locally): look again at once.
    Moved,
    /// Nothing to drain: wait for a new durable step, or the poll interval.
    Idle,
    /// The target failed (said in status): back off before the next round.
    TargetFailed,
}

/// Why a step was not uploaded.
pub(super) enum Upload {
    /// The step is no longer committed locally.
    Gone,
    /// The target failed (or the step's local index or plan could not be read): why.
    Failed(String),
    /// A local file of the step does not match its index (told to the
    /// damage sink): uploading it again cannot help, and the target is
    /// not at fault. The step is passed over; newer steps drain.
    Damaged(String),
}

impl Drain {
    /// One round: the steps to drain now. Round::Moved: a step was uploaded (look
    /// again at once); Round::Idle: nothing to do; Err: the target failed.
    pub(super) fn drain_once(&self) -> Round {
        let committed = catalog::committed_steps(self.primary()).unwrap_or_default();
        let Some(newest) = self.next_step(&committed, |_, _| {}) else { return Round::Idle };
        // Held from local retention from now until it is replicated (or a
        // newer one replaces it as the newest not replicated).
        {
            let mut h = self.hold.lock().expect("hold lock");
            h.clear();
            h.insert(newest);
        }
        let outcome =
            if catalog::is_committed(self.primary(), newest) { self.upload(newest) } else { Err(Upload::Gone) };
        let mut st = self.lock();
        st.uploading = None;
        match outcome {
            Ok(Moved { stats, copied_bytes, copied_files, from_memory_bytes }) => {
                let bps = stats.bytes as f64 / stats.seconds.max(1e-9);
                info!(step = newest, url = self.url(), bytes = stats.bytes, files = stats.files, from_memory_bytes, copied_bytes, copied_files, seconds = stats.seconds, bytes_per_s = bps, "replicated (from memory: bytes taken from staging, not read back from disk; copied: unchanged files the target holds already)");
                st.uploaded_bytes += stats.bytes;
                st.copied_bytes += copied_bytes;
                st.handled(newest, Handled::Replicated);
                st.done_upto = Some(newest);
                st.bytes_per_s = bps;
                self.unhold(newest);
                self.mark_up(&mut st, true, String::new());
                self.answer(&mut st);
                drop(st);
                self.retain_remote();
                Round::Moved
            }
            Err(Upload::Gone) => {
                info!(
                    step = newest,
                    "drain: step deleted locally before it was drained (retention or rollback); skipped"
                );
                st.handled(newest, Handled::Deleted);
                st.done_upto = Some(newest);
                self.unhold(newest);
                self.answer(&mut st);
                Round::Moved
            }
            Err(Upload::Damaged(why)) => {
                self.pass_over_damaged(&mut st, newest, &why);
                self.unhold(newest);
                self.answer(&mut st);
                Round::Moved
            }
            Err(Upload::Failed(e)) => {
                drop(st);
                // Deleted under the upload: not the target's fault.
                if !catalog::is_committed(self.primary(), newest) {
                    let mut st = self.lock();
                    st.handled(newest, Handled::Deleted);
                    st.done_upto = Some(newest);
                    self.answer(&mut st);
                    return Round::Moved;
                }
                let mut st = self.lock();
                st.upload_failures += 1;
                self.mark_up(&mut st, false, format!("step {newest}: {e}"));
                Round::TargetFailed
            }
        }
    }

    /// Uploads `step`: a file that is the same local file (inode, mtime,
    /// length, crc32c) as the same-named file of the step this sidecar last
    /// replicated, which the target still holds, is copied there on the
    /// target instead ([`ckpt_tier::Target::copy_file`]; uploaded if the copy fails);
    /// the rest uploaded; the index last (the remote commit).
    fn upload(&self, step: u64) -> Result<Moved, Upload> {
        let t0 = Instant::now();
        let index_bytes =
            std::fs::read(catalog::step_path(self.primary(), step).join(INDEX_FILE_NAME)).map_err(|_| Upload::Gone)?;
        let index = Index::from_json_bytes(&index_bytes)
            .map_err(|e| Upload::Failed(format!("local index of step {step}: {e}")))?;
        let (files, remote_index) = remote_plan(&self.dirs, step, index).map_err(Upload::Failed)?;
        let ids: HashMap<String, FileId> =
            files.iter().filter_map(|f| Some((f.name.clone(), FileId::of(f)?))).collect();
        let prev = {
            let st = self.lock();
            st.last_files.clone().filter(|(s, _)| *s != step && st.replicated.contains(s))
        };
        let (mut copied_bytes, mut copied_files) = (0, 0);
        let mut to_upload = Vec::with_capacity(files.len());
        for f in files {
            let same = prev
                .as_ref()
                .filter(|(_, by_name)| ids.get(&f.name).is_some_and(|id| by_name.get(&f.name) == Some(id)));
            match same {
                Some((from, _)) => match self.target.copy_file(*from, step, &f.name) {
                    Ok(()) => {
                        copied_bytes += f.len;
                        copied_files += 1;
                    }
                    Err(e) => {
                        warn!(
                            step,
                            from = *from,
                            file = f.name,
                            "drain: copying an unchanged file on the target failed ({e}); uploading it"
                        );
                        to_upload.push(f);
                    }
                },
                None => to_upload.push(f),
            }
        }
        // From staging while the step's image is resident there (lent: a
        // save takes it back whenever it needs it), else from disk.
        let lent = self.staging.get().and_then(|s| Some((s, s.lend_resident(step)?)));
        let held = lent.as_ref().and_then(|(_, l)| ResidentFiles::new(l.clone(), &to_upload));
        let up = match held {
            Some(h) => self.target.upload_files_held(step, &to_upload, Arc::new(h)),
            None => self.target.upload_files(step, &to_upload).map(|s| (s, 0)),
        };
        if let Some((s, l)) = &lent {
            s.end_lend(l);
        }
        let (mut stats, from_memory_bytes) = up.map_err(|e| self.upload_failed(step, &to_upload, e))?;
        self.target.commit_step(step, &remote_index).map_err(|e| Upload::Failed(e.to_string()))?;
        stats.seconds = t0.elapsed().as_secs_f64();
        let mut st = self.lock();
        st.last_files = Some((step, ids));
        st.from_memory_bytes += from_memory_bytes;
        drop(st);
        Ok(Moved { stats, copied_bytes, copied_files, from_memory_bytes })
    }

    /// A damaged `step` (see [`Upload::Damaged`]) leaves the pending set
    /// as passed over: its waiters are told why, the target stays up, and
    /// the drain goes on with the next step committed.
    pub(super) fn pass_over_damaged(&self, st: &mut State, step: u64, why: &str) {
        error!(
            step,
            url = self.url(),
            "drain: step {step} is damaged on this node ({why}); it is not uploaded (the target keeps what it holds), newer steps drain"
        );
        st.uploading = None;
        st.damaged.insert(step, why.to_string());
        while st.damaged.len() > config::DRAIN_SKIPPED_SHOWN_MAX {
            st.damaged.pop_first();
        }
        st.handled(step, Handled::Skipped);
        st.done_upto = Some(step);
    }

    /// An upload of `step`'s `files` that failed with `e`; a local file
    /// whose bytes do not match its index is damage of the step, told to
    /// the damage sink ([`Upload::Damaged`]: the step is passed over, it
    /// stays committed locally); any other failure is the target's.
    pub(super) fn upload_failed(&self, step: u64, files: &[LocalFile], e: ckpt_tier::TierError) -> Upload {
        if let ckpt_tier::TierError::LocalChanged { path, detail, .. } = &e {
            let name = files
                .iter()
                .find(|f| &f.local_path == path)
                .map_or_else(|| path.display().to_string(), |f| f.name.clone());
            warn!(
                step,
                file = name,
                "drain: a local file of the step does not match its index ({detail}): the step is damaged on disk"
            );
            if let Some(sink) = self.on_damage.get() {
                sink(step, &name, &format!("read back for the drain: {detail}"));
            }
            return Upload::Damaged(format!("{name}: {detail}"));
        }
        Upload::Failed(e.to_string())
    }

    /// `--drain-keep N`: the oldest remote steps beyond N deleted (index
    /// first); the remote latest is never one of them.
    pub(super) fn retain_remote(&self) {
        let Some(keep) = self.opts.keep else { return };
        let steps = match self.target.steps() {
            Ok(s) => s,
            Err(e) => {
                warn!(url = self.url(), "drain retention: listing failed ({e}); retried after the next upload");
                return;
            }
        };
        let latest = self.target.latest().ok().flatten();
        let doomed: Vec<u64> =
            steps[..steps.len().saturating_sub(keep)].iter().copied().filter(|&s| Some(s) != latest).collect();
        for s in doomed {
            match self.target.delete_step(s) {
                Ok(()) => {
                    info!(step = s, url = self.url(), "drain retention: remote step deleted");
                    self.lock().replicated.remove(&s);
                }
                Err(e) => warn!(step = s, url = self.url(), "drain retention: delete failed ({e})"),
            }
        }
    }
}

/// The files of an upload that a lent staging image holds: a shard of the
/// image's layout with the same name and length as the committed file, at
/// its offset in the lease (block-aligned, padded to the block: the
/// `file://` path writes from it with O_DIRECT, no copy). Blobs are read
/// from disk (small).
struct ResidentFiles {
    lent: Arc<Lent>,
    /// Per file of the call: (offset in the lease, bytes there: `io_len`).
    places: Vec<Option<(u64, u64)>>,
}

impl ResidentFiles {
    /// None when the image holds none of the files.
    fn new(lent: Arc<Lent>, files: &[LocalFile]) -> Option<ResidentFiles> {
        let places: Vec<Option<(u64, u64)>> = lent.with(|r| {
            files
                .iter()
                .map(|f| {
                    r.layout
                        .shards
                        .iter()
                        .find(|s| s.file_name == f.name && s.file_len == f.len)
                        .map(|s| (s.staging_offset, s.io_len))
                })
                .map(|p| p.filter(|&(off, io_len)| off + io_len <= r.lease.len_bytes()))
                .collect()
        })?;
        places.iter().any(Option::is_some).then_some(ResidentFiles { lent, places })
    }
}

impl ckpt_tier::HeldBytes for ResidentFiles {
    fn with_part(&self, file_idx: usize, offset: u64, len: usize, f: &mut dyn FnMut(&[u8])) -> bool {
        let Some(&Some((start, io_len))) = self.places.get(file_idx) else { return false };
        let end =
            (offset + len as u64).div_ceil(ckpt_tier::DIRECT_BLOCK_BYTES as u64) * ckpt_tier::DIRECT_BLOCK_BYTES as u64;
        if offset + len as u64 > io_len {
            return false;
        }
        self.lent
            .with(|r| f(&r.lease.as_slice()[(start + offset) as usize..(start + end.min(io_len)) as usize]))
            .is_some()
    }
}

/// The files of a committed local step as the target takes them (shards
/// from every directory, blobs), and the index the target gets: the same,
/// with every file in the one step folder (no secondary directories), so
/// the remote step is an ordinary one-directory checkpoint.
pub fn remote_plan(dirs: &[PathBuf], step: u64, mut index: Index) -> Result<(Vec<LocalFile>, Vec<u8>), String> {
    let step_name = format::step_dir_name(step).map_err(|e| e.to_string())?;
    let mut files = Vec::with_capacity(index.ckpt.files.len() + index.ckpt.blobs.len());
    for f in &mut index.ckpt.files {
        let dir = dirs
            .get(f.dir_idx as usize)
            .ok_or_else(|| format!("step {step}: file {} is in directory #{} of {}", f.name, f.dir_idx, dirs.len()))?;
        files.push(LocalFile {
            local_path: dir.join(&step_name).join(&f.name),
            name: f.name.clone(),
            len: f.len_bytes,
            crc32c: f.crc32c,
        });
        f.dir_idx = 0;
    }
    for b in &index.ckpt.blobs {
        let name = format!("{BLOBS_DIR_NAME}/{}", b.name);
        files.push(LocalFile {
            local_path: dirs[0].join(&step_name).join(&name),
            name,
            len: b.len_bytes,
            crc32c: b.crc32c,
        });
    }
    index.ckpt.secondary_dirs.clear();
    Ok((files, index.sealed_json_bytes()))
}
