//! [`Target`]: one drain target (a `file://` directory or an S3 bucket and
//! prefix) behind a blocking API.
//!
//! Upload of one file: the local file is read in parts (pread on the
//! runtime's blocking pool), each part's crc32c computed as it is read and
//! the parts' crcs combined in order; parts go out in parallel (at most
//! `parallel` parts in memory and in flight over all files of the call),
//! each after the token bucket let it. Only when every part is uploaded
//! *and* the combined crc equals [`LocalFile::crc32c`] is the upload
//! completed; otherwise it is aborted, so a file changed under the upload
//! never becomes a remote object. The index goes up after every file (the
//! remote commit), `latest` after the index.
//!
//! S3 multipart uploads are announced by a small marker object in the step
//! folder (`.ckpt-upload-<nonce>`: the object's key and the upload id)
//! written before the first part and deleted after the completion, so
//! that `clean_incomplete` can abort the uploads of a sidecar that died
//! mid-upload (object_store cannot list a bucket's pending uploads). A
//! `file://` upload is object_store's staged file (`<name>#<n>`, renamed on
//! completion, synced: `with_fsync`); `clean_incomplete` removes leftovers.
//!
//! [`Target::copy_file`]: a file of a step made from the same-named file of
//! another step on the target, without uploading it (S3: a server-side copy,
//! an independent object; file://: a hard link within the target).
//!
//! The parts: opening a target from its URL (`open`), the upload of one
//! file (`upload`: its parts read, checked, retried from disk), through
//! the object store (`s3`: one put, or S3 multipart with its marker) or
//! written directly (`local`: file://), what the target lists (`listing`),
//! its clean-up (`clean`), and a restore's reads (`fetch`).

use std::fs::File;
use std::path::{Path as FsPath, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use ckpt_store::format::{self, Index, BLOBS_DIR_NAME, INDEX_FILE_NAME, LATEST_FILE_NAME};
use ckpt_store::mem::AlignedBuf;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use tokio::sync::Semaphore;

use crate::config::*;
use crate::error::TierError;
use crate::limiter::TokenBucket;

mod clean;
mod fetch;
mod listing;
mod local;
mod open;
mod s3;
mod upload;

pub use fetch::fetch_ranges;

/// Part buffers of one upload call, reused by its files' parts.
type BufPool = Arc<std::sync::Mutex<Vec<AlignedBuf>>>;

/// The name prefix of an S3 upload's marker object in its step folder.
const UPLOAD_MARKER_PREFIX: &str = ".ckpt-upload-";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetOptions {
    /// None = unlimited (one token bucket over all parts of the target).
    pub bandwidth_bytes_per_s: Option<u64>,
    /// Concurrent part uploads / ranged gets (default 8).
    pub parallel: usize,
    /// Multipart part size (default 16 MiB; at least 5 MiB, S3's minimum).
    pub part_size_bytes: usize,
}

impl Default for TargetOptions {
    fn default() -> Self {
        TargetOptions {
            bandwidth_bytes_per_s: None,
            parallel: DEFAULT_PARALLEL,
            part_size_bytes: DEFAULT_PART_SIZE_BYTES,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFile {
    /// Where the committed file is on this node.
    pub local_path: PathBuf,
    /// Its name inside the step folder, as in the index (`blobs/<name>` for a blob).
    pub name: String,
    pub len: u64,
    /// From the local index: the bytes read for upload are checked against it.
    pub crc32c: u32,
}

/// Bytes of some of an upload's files still held in memory (the sidecar's
/// staging image of a step just committed), lent to the upload so that it
/// does not read them back from the disk. The holder may take them back at
/// any time (a save needs the memory): the parts not started by then are
/// read from the local file, as without a holder. Memory is only a cache:
/// the bytes uploaded are checked against [`LocalFile::crc32c`] all the
/// same, and a file whose lent bytes do not match is uploaded again from
/// its local file.
pub trait HeldBytes: Send + Sync {
    /// Calls `f` with bytes `offset..` of file `file_idx` (an index into
    /// the call's `files`), at least `len` of them, and returns true; false
    /// when it holds them no longer (or never did). The slice should start
    /// on a [`DIRECT_BLOCK_BYTES`] boundary and run on to `len` rounded up
    /// to one (what follows the file in memory: the `file://` path writes
    /// whole blocks with O_DIRECT, then truncates), else the part is copied
    /// first. The memory stays lent while `f` runs: a holder that takes it
    /// back waits for the calls in progress (at most `parallel` parts).
    fn with_part(&self, file_idx: usize, offset: u64, len: usize, f: &mut dyn FnMut(&[u8])) -> bool;
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UploadStats {
    pub bytes: u64,
    pub files: usize,
    pub seconds: f64,
}

/// One drain target. Cheap to clone (an `Arc` inside); Send + Sync.
#[derive(Clone)]
pub struct Target {
    inner: Arc<Inner>,
}

struct Inner {
    /// As given, less any user info or query (never a secret).
    url: String,
    rt: tokio::runtime::Runtime,
    store: Arc<dyn ObjectStore>,
    backend: Backend,
    /// Inside the store: empty for file:// (the store is rooted at the directory).
    prefix: Path,
    parallel: usize,
    part_size: usize,
    limiter: Option<Arc<TokenBucket>>,
}

enum Backend {
    Local { root: PathBuf },
    S3 { s3: Arc<AmazonS3> },
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("url", &self.inner.url).finish_non_exhaustive()
    }
}

pub(crate) fn nonce() -> u64 {
    use std::hash::BuildHasher;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    std::hash::RandomState::new().hash_one((
        std::time::SystemTime::now(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
    ))
}

/// The index as a drain target holds it: every file in the step folder
/// itself (`dir_idx` 0, no secondary directories), resealed. The input is
/// the local index (any directories); [`Target::commit_step`] applies this.
pub fn remote_index_json(local_index_json: &[u8]) -> Result<Vec<u8>, format::FormatError> {
    let mut index = Index::from_json_bytes(local_index_json)?;
    index.ckpt.secondary_dirs.clear();
    for f in &mut index.ckpt.files {
        f.dir_idx = 0;
    }
    Ok(index.sealed_json_bytes())
}

/// The files of a committed local step as [`Target::upload_step`] takes
/// them: every shard in its directory (`primary` or the index's secondary
/// directory `dir_idx`), every blob as `blobs/<name>`, with the index's
/// lengths and checksums.
pub fn local_files(primary: &FsPath, index: &Index) -> Vec<LocalFile> {
    let step_dir = |dir: &FsPath| dir.join(format::step_dir_name(index.ckpt.step).expect("a valid index's step"));
    let dirs: Vec<PathBuf> =
        std::iter::once(primary.to_path_buf()).chain(index.ckpt.secondary_dirs.iter().map(PathBuf::from)).collect();
    let files = index.ckpt.files.iter().map(|f| LocalFile {
        local_path: step_dir(dirs.get(f.dir_idx as usize).map_or(primary, |d| d.as_path())).join(&f.name),
        name: f.name.clone(),
        len: f.len_bytes,
        crc32c: f.crc32c,
    });
    let blobs = index.ckpt.blobs.iter().map(|b| LocalFile {
        local_path: step_dir(primary).join(BLOBS_DIR_NAME).join(&b.name),
        name: format!("{BLOBS_DIR_NAME}/{}", b.name),
        len: b.len_bytes,
        crc32c: b.crc32c,
    });
    files.chain(blobs).collect()
}

/// Splits a file name of a step folder into path parts, refusing what
/// could leave the folder or is no object name.
fn name_parts(name: &str) -> Result<Vec<&str>, String> {
    if name.is_empty() {
        return Err("empty".into());
    }
    let parts: Vec<&str> = name.split('/').collect();
    for p in &parts {
        if p.is_empty() || *p == "." || *p == ".." {
            return Err("empty, '.' or '..' path part".into());
        }
        if p.contains('#') {
            // object_store's file:// staging files are named `<name>#<n>`.
            return Err("'#' is reserved".into());
        }
    }
    Ok(parts)
}

impl Target {
    /// The URL as given, without secrets.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// Uploads the files (multipart, parts in parallel, bandwidth-limited),
    /// then the index (the remote commit), then `latest` if `step` is newer
    /// than the remote latest. Idempotent: a rerun after a crash redoes it.
    pub fn upload_step(&self, step: u64, files: &[LocalFile], index_json: &[u8]) -> Result<UploadStats, TierError> {
        let t0 = Instant::now();
        let mut stats = self.upload_files(step, files)?;
        self.commit_step(step, index_json)?;
        stats.seconds = t0.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// Uploads only the named files of a step, no index. Every file is
    /// tried; the first error is returned (an aborted file is no object).
    pub fn upload_files(&self, step: u64, files: &[LocalFile]) -> Result<UploadStats, TierError> {
        self.upload(step, files, None).map(|(stats, _)| stats)
    }

    /// [`Target::upload_files`], the parts of `files` that `held` still
    /// lends taken from memory instead of read from the local files (see
    /// [`HeldBytes`]). Returns the stats and how many bytes came from
    /// memory.
    pub fn upload_files_held(
        &self,
        step: u64,
        files: &[LocalFile],
        held: Arc<dyn HeldBytes>,
    ) -> Result<(UploadStats, u64), TierError> {
        self.upload(step, files, Some(held))
    }

    fn upload(
        &self,
        step: u64,
        files: &[LocalFile],
        held: Option<Arc<dyn HeldBytes>>,
    ) -> Result<(UploadStats, u64), TierError> {
        let t0 = Instant::now();
        let mut paths = Vec::with_capacity(files.len());
        for f in files {
            paths.push(self.file_path(step, &f.name)?);
        }
        let inner = &*self.inner;
        let sem = Arc::new(Semaphore::new(inner.parallel));
        // One pool of part buffers for the whole call (at most `parallel`
        // of them live): fresh pages cost more than the write on some VMs.
        let pool: BufPool = Arc::default();
        let from_memory = AtomicU64::new(0);
        let results: Vec<Result<(), TierError>> = inner.rt.block_on(
            futures::stream::iter(files.iter().zip(paths).enumerate())
                .map(|(i, (f, p))| {
                    let held = held.clone().map(|h| (h, i));
                    inner.upload_one(f, p, sem.clone(), held, pool.clone(), &from_memory)
                })
                .buffer_unordered(inner.parallel)
                .collect(),
        );
        results.into_iter().collect::<Result<Vec<()>, _>>()?;
        let stats = UploadStats {
            bytes: files.iter().map(|f| f.len).sum(),
            files: files.len(),
            seconds: t0.elapsed().as_secs_f64(),
        };
        Ok((stats, from_memory.load(Ordering::Relaxed)))
    }

    /// Makes file `name` of step `to_step` a copy of the same-named file of
    /// step `from_step` on the target, without uploading it again: an
    /// object store's server-side copy (an independent object), a `file://`
    /// hard link within the target (a copy where the file system refuses a
    /// link). Either way each step folder stays complete on its own:
    /// deleting `from_step` later leaves `to_step` whole. The caller knows
    /// the two files are the same bytes; the remote commit
    /// ([`Target::commit_step`]) still checks every length.
    pub fn copy_file(&self, from_step: u64, to_step: u64, name: &str) -> Result<(), TierError> {
        let inner = &*self.inner;
        let from = self.file_path(from_step, name)?;
        let to = self.file_path(to_step, name)?;
        match &inner.backend {
            Backend::S3 { .. } => inner
                .rt
                .block_on(async { inner.store.copy(&from, &to).await.map_err(|e| inner.store_err("copy", &from, e)) }),
            Backend::Local { root } => {
                let tio = |op: &'static str, p: &FsPath, e: std::io::Error| TierError::TargetIo {
                    url: inner.url.clone(),
                    op,
                    path: p.to_path_buf(),
                    source: e,
                };
                let (src, dest) = (root.join(from.as_ref()), root.join(to.as_ref()));
                let parent = dest.parent().expect("an object is inside the root").to_path_buf();
                std::fs::create_dir_all(&parent).map_err(|e| tio("create directory", &parent, e))?;
                let tmp = PathBuf::from(format!("{}#{:016x}", dest.display(), nonce()));
                let made = match std::fs::hard_link(&src, &tmp) {
                    Ok(()) => Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        Err(TierError::NotFound { url: inner.url.clone(), object: inner.rel(&from) })
                    }
                    // EXDEV, EMLINK, a file system without links: a copy, synced.
                    Err(_) => std::fs::copy(&src, &tmp)
                        .and_then(|_| File::open(&tmp)?.sync_data())
                        .map_err(|e| tio("copy", &src, e)),
                };
                let r = made.and_then(|()| {
                    std::fs::rename(&tmp, &dest).map_err(|e| tio("rename", &tmp, e))?;
                    for dir in dest.ancestors().skip(1) {
                        File::open(dir).and_then(|d| d.sync_all()).map_err(|e| tio("sync", dir, e))?;
                        if dir == root {
                            break;
                        }
                    }
                    Ok(())
                });
                if r.is_err() {
                    let _ = std::fs::remove_file(&tmp);
                }
                r
            }
        }
    }

    /// The remote commit: checks that every file the index names is on the
    /// target at its length, then puts the index (as [`remote_index_json`]
    /// makes it), then `latest` if `step` is newer than the remote one.
    pub fn commit_step(&self, step: u64, index_json: &[u8]) -> Result<(), TierError> {
        let inner = &*self.inner;
        let bad = |reason: String| TierError::BadIndex { url: inner.url.clone(), step, reason };
        let remote = remote_index_json(index_json).map_err(|e| bad(e.to_string()))?;
        let index = Index::from_json_bytes(&remote).map_err(|e| bad(e.to_string()))?;
        if index.ckpt.step != step {
            return Err(bad(format!("it is the index of step {}", index.ckpt.step)));
        }
        let step_dir = self.step_path(step)?;
        let index_path = step_dir.clone().join(INDEX_FILE_NAME);
        inner.rt.block_on(async {
            let present: std::collections::HashMap<String, u64> = inner
                .store
                .list(Some(&step_dir))
                .map_ok(|m| (inner.rel_to(&step_dir, &m.location), m.size))
                .try_collect()
                .await
                .map_err(|e| inner.store_err("list", &step_dir, e))?;
            let expected = index
                .ckpt
                .files
                .iter()
                .map(|f| (f.name.clone(), f.len_bytes))
                .chain(index.ckpt.blobs.iter().map(|b| (format!("{BLOBS_DIR_NAME}/{}", b.name), b.len_bytes)));
            for (name, len) in expected {
                match present.get(&name) {
                    Some(&size) if size == len => {}
                    Some(&size) => {
                        return Err(TierError::Incomplete {
                            url: inner.url.clone(),
                            step,
                            object: name,
                            detail: format!("is {size} bytes, the index says {len}"),
                        })
                    }
                    None => {
                        return Err(TierError::Incomplete {
                            url: inner.url.clone(),
                            step,
                            object: name,
                            detail: "is missing".into(),
                        })
                    }
                }
            }
            inner
                .store
                .put(&index_path, PutPayload::from(remote))
                .await
                .map_err(|e| inner.store_err("put", &index_path, e))?;
            let newer = match inner.latest_object().await? {
                Some(cur) => step > cur,
                None => true,
            };
            if newer {
                let latest = inner.latest_path();
                let body = format!("{}\n", format::step_dir_name(step).expect("validated step"));
                inner
                    .store
                    .put(&latest, PutPayload::from(body))
                    .await
                    .map_err(|e| inner.store_err("put", &latest, e))?;
            }
            Ok(())
        })
    }

    /// Committed steps (index present), ascending.
    pub fn steps(&self) -> Result<Vec<u64>, TierError> {
        let inner = &*self.inner;
        inner.rt.block_on(inner.steps())
    }

    /// The step the `latest` object names, when it is committed; else the
    /// newest committed step; None when there is none.
    pub fn latest(&self) -> Result<Option<u64>, TierError> {
        let inner = &*self.inner;
        inner.rt.block_on(async {
            if let Some(s) = inner.latest_object().await? {
                if inner.has_index(s).await? {
                    return Ok(Some(s));
                }
            }
            Ok(inner.steps().await?.last().copied())
        })
    }

    /// The bytes of a committed step's index.
    pub fn get_index(&self, step: u64) -> Result<Vec<u8>, TierError> {
        let inner = &*self.inner;
        let path = self.step_path(step)?.join(INDEX_FILE_NAME);
        inner.rt.block_on(async {
            let r = inner.store.get(&path).await.map_err(|e| inner.store_err("get", &path, e))?;
            let b = r.bytes().await.map_err(|e| inner.store_err("get", &path, e))?;
            Ok(b.to_vec())
        })
    }

    /// The length of one file of a step (a HEAD request).
    pub fn file_len(&self, step: u64, name: &str) -> Result<u64, TierError> {
        let inner = &*self.inner;
        let path = self.file_path(step, name)?;
        inner.rt.block_on(async {
            inner.store.head(&path).await.map(|m| m.size).map_err(|e| inner.store_err("head", &path, e))
        })
    }

    /// Ranged read of one file of a step into `dst` (for a large `dst`, at
    /// most `parallel` ranged GETs in parallel, each at least a part). The caller verifies
    /// checksums as a local load does.
    pub fn read_range(&self, step: u64, name: &str, offset: u64, dst: &mut [u8]) -> Result<(), TierError> {
        let inner = &*self.inner;
        let path = self.file_path(step, name)?;
        if dst.is_empty() {
            return Ok(());
        }
        // At most `parallel` ranges, none under a part: fewer, larger
        // requests (a server may pay per request what a whole object costs:
        // moto reads the whole object for every ranged GET).
        let chunk = inner.part_size.max(dst.len().div_ceil(inner.parallel));
        let path = &path;
        inner.rt.block_on(
            futures::stream::iter(dst.chunks_mut(chunk).enumerate())
                .map(|(i, buf)| async move {
                    let start = offset + (i * chunk) as u64;
                    let end = start + buf.len() as u64;
                    let b =
                        inner.store.get_range(path, start..end).await.map_err(|e| inner.store_err("read", path, e))?;
                    if b.len() != buf.len() {
                        return Err(TierError::PastEnd {
                            url: inner.url.clone(),
                            object: inner.rel(path),
                            offset: start,
                            len: buf.len() as u64,
                            size: start + b.len() as u64,
                        });
                    }
                    buf.copy_from_slice(&b);
                    Ok(())
                })
                .buffer_unordered(inner.parallel)
                .try_collect::<()>(),
        )
    }

    /// Index first (un-commit), then the files (and any upload of the step
    /// still pending).
    pub fn delete_step(&self, step: u64) -> Result<(), TierError> {
        let inner = &*self.inner;
        let step_dir = self.step_path(step)?;
        let index_path = step_dir.clone().join(INDEX_FILE_NAME);
        inner.rt.block_on(async {
            match inner.store.delete(&index_path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(inner.store_err("delete", &index_path, e)),
            }
            inner.remove_step_folder(&step_dir).await.map(|_| ())
        })
    }

    /// Step folders without an index (half uploads of a dead sidecar)
    /// removed, incomplete uploads aborted; returns how many things (step
    /// folders, uploads, staging files) it removed. Run it when no other
    /// writer uploads to the same target (at start, by the one drainer).
    pub fn clean_incomplete(&self) -> Result<usize, TierError> {
        let inner = &*self.inner;
        inner.rt.block_on(async {
            let mut removed = 0;
            for (step, committed) in inner.step_folders().await? {
                let step_dir = self.step_path(step)?;
                if committed {
                    removed += inner.clean_committed_folder(&step_dir).await?;
                } else {
                    removed += 1 + inner.remove_step_folder(&step_dir).await?;
                }
            }
            if let Backend::Local { root } = &inner.backend {
                // object_store's staging files of `latest` (a put cut short).
                removed += inner.remove_staging_files(root)?;
            }
            Ok(removed)
        })
    }

    fn step_path(&self, step: u64) -> Result<Path, TierError> {
        self.inner.step_path(step)
    }

    fn file_path(&self, step: u64, name: &str) -> Result<Path, TierError> {
        let parts = name_parts(name).map_err(|reason| TierError::BadName {
            url: self.inner.url.clone(),
            object: name.to_string(),
            reason,
        })?;
        let mut p = self.step_path(step)?;
        for part in parts {
            p = p.join(part);
        }
        Ok(p)
    }
}

impl Inner {
    fn step_path(&self, step: u64) -> Result<Path, TierError> {
        let name = format::step_dir_name(step).map_err(|e| TierError::BadName {
            url: self.url.clone(),
            object: format!("step {step}"),
            reason: e.to_string(),
        })?;
        Ok(self.prefix.clone().join(name))
    }

    fn latest_path(&self) -> Path {
        self.prefix.clone().join(LATEST_FILE_NAME)
    }

    fn prefix_opt(&self) -> Option<&Path> {
        (self.prefix.parts_count() > 0).then_some(&self.prefix)
    }

    /// An object's key relative to the target's root, for messages.
    fn rel(&self, p: &Path) -> String {
        match p.prefix_match(&self.prefix) {
            Some(parts) => parts.map(|x| x.as_ref().to_string()).collect::<Vec<_>>().join("/"),
            None => p.to_string(),
        }
    }

    fn rel_to(&self, dir: &Path, p: &Path) -> String {
        match p.prefix_match(dir) {
            Some(parts) => parts.map(|x| x.as_ref().to_string()).collect::<Vec<_>>().join("/"),
            None => p.to_string(),
        }
    }

    fn store_err(&self, op: &'static str, p: &Path, e: object_store::Error) -> TierError {
        match e {
            object_store::Error::NotFound { .. } => TierError::NotFound { url: self.url.clone(), object: self.rel(p) },
            e => TierError::Store { url: self.url.clone(), op, object: self.rel(p), source: Box::new(e) },
        }
    }

    pub(super) async fn throttle(&self, bytes: u64) {
        if let Some(l) = &self.limiter {
            l.acquire(bytes).await;
        }
    }

    pub(super) fn changed(&self, f: &LocalFile, object: &Path, detail: String) -> TierError {
        TierError::LocalChanged { url: self.url.clone(), object: self.rel(object), path: f.local_path.clone(), detail }
    }
}
