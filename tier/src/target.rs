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

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path as FsPath, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once};
use std::time::Instant;

use bytes::Bytes;
use ckpt_store::format::{self, Index, BLOBS_DIR_NAME, INDEX_FILE_NAME, LATEST_FILE_NAME};
use ckpt_store::mem::AlignedBuf;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::local::LocalFileSystem;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{BackoffConfig, MultipartUpload, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};
use tokio::sync::Semaphore;

use crate::config::*;
use crate::error::TierError;
use crate::limiter::TokenBucket;

mod fetch;
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

/// The URL to show: scheme, host and path only.
fn shown_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.set_fragment(None);
            u.to_string().trim_end_matches('/').to_string()
        }
        // Unparsable: show up to an '@' or '?', which could start a secret.
        Err(_) => url.split(['@', '?']).next().unwrap_or("").to_string(),
    }
}

fn retry(max_retries: usize, timeout: std::time::Duration) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: RETRY_BACKOFF_INIT,
            max_backoff: RETRY_BACKOFF_MAX,
            base: RETRY_BACKOFF_BASE,
        },
        max_retries,
        retry_timeout: timeout,
    }
}

/// rustls needs one crypto provider per process: ring (object_store's
/// `aws-lc-rs` would build aws-lc-sys with cmake).
fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err: the process installed one already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
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
    /// file:///abs/path (created if missing) or s3://bucket/prefix.
    /// Credentials from the standard environment (AWS_*, incl.
    /// AWS_ENDPOINT_URL and AWS_ALLOW_HTTP); never logged or put in an
    /// error. Makes one cheap authenticated request (a listing of the
    /// prefix) so that a wrong credential, a missing bucket or an
    /// unreachable endpoint is one clear error naming the URL, here.
    pub fn open(url: &str, opts: TargetOptions) -> Result<Target, TierError> {
        install_crypto_provider();
        let shown = shown_url(url);
        let bad = |reason: String| TierError::BadUrl { url: shown.clone(), reason };
        let parsed = url::Url::parse(url).map_err(|e| bad(format!("not a URL ({e})")))?;
        if !parsed.username().is_empty() || parsed.password().is_some() || parsed.query().is_some() {
            return Err(bad("credentials or options in the URL are not accepted: use the environment (AWS_*)".into()));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_WORKER_THREADS)
            .thread_name("ckpt-tier")
            .enable_all()
            .build()
            .map_err(|e| TierError::TargetIo {
                url: shown.clone(),
                op: "start runtime",
                path: PathBuf::new(),
                source: e,
            })?;
        let (store, probe, backend, prefix): (Arc<dyn ObjectStore>, Arc<dyn ObjectStore>, Backend, Path) = match parsed
            .scheme()
        {
            "file" => {
                if parsed.host_str().is_some_and(|h| !h.is_empty() && h != "localhost") {
                    return Err(bad("file:// takes an absolute path (file:///dir), no host".into()));
                }
                let root =
                    parsed.to_file_path().map_err(|_| bad("file:// takes an absolute path (file:///dir)".into()))?;
                std::fs::create_dir_all(&root).map_err(|e| TierError::TargetIo {
                    url: shown.clone(),
                    op: "create directory",
                    path: root.clone(),
                    source: e,
                })?;
                let fs = LocalFileSystem::new_with_prefix(&root)
                    .map_err(|e| TierError::Open {
                        url: shown.clone(),
                        what: format!("directory {}", root.display()),
                        source: e,
                    })?
                    .with_fsync(true);
                let fs: Arc<dyn ObjectStore> = Arc::new(fs);
                (fs.clone(), fs, Backend::Local { root }, Path::default())
            }
            "s3" => {
                let bucket = parsed
                    .host_str()
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| bad("s3:// needs a bucket (s3://bucket/prefix)".into()))?;
                let prefix = parsed.path().trim_matches('/');
                let prefix = Path::parse(prefix).map_err(|e| bad(format!("bad prefix {prefix:?}: {e}")))?;
                let build = |r: RetryConfig| {
                    AmazonS3Builder::from_env().with_url(format!("s3://{bucket}")).with_retry(r).build().map_err(|e| {
                        TierError::Open {
                            url: shown.clone(),
                            what: "S3 configuration from the environment".into(),
                            source: e,
                        }
                    })
                };
                let s3 = Arc::new(build(retry(RETRY_MAX, RETRY_TIMEOUT))?);
                let probe: Arc<dyn ObjectStore> = Arc::new(build(retry(OPEN_RETRY_MAX, OPEN_RETRY_TIMEOUT))?);
                (s3.clone(), probe, Backend::S3 { s3 }, prefix)
            }
            "gs" | "az" | "azure" | "abfs" | "abfss" => {
                return Err(bad(format!("{}:// is not built in (this build has file:// and s3://)", parsed.scheme())));
            }
            other => return Err(bad(format!("{other}:// is not supported (file:///dir, s3://bucket/prefix)"))),
        };
        let prefix_opt = (prefix.parts_count() > 0).then_some(&prefix);
        rt.block_on(probe.list_with_delimiter(prefix_opt)).map_err(|e| TierError::Open {
            url: shown.clone(),
            what: "listing it with the credentials of the environment".into(),
            source: e,
        })?;
        let parallel = opts.parallel.clamp(1, MAX_PARALLEL);
        let part_size = opts.part_size_bytes.max(MIN_PART_SIZE_BYTES);
        let limiter = opts.bandwidth_bytes_per_s.map(|r| Arc::new(TokenBucket::new(r)));
        Ok(Target { inner: Arc::new(Inner { url: shown, rt, store, backend, prefix, parallel, part_size, limiter }) })
    }

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

/// A multipart upload in progress, S3's (with its marker) or a file://
/// staging file.
enum Sink {
    S3 { s3: Arc<AmazonS3>, path: Path, id: String, marker: Path },
    Local { up: Box<dyn MultipartUpload> },
}

impl Sink {
    fn put_part(&mut self, idx: usize, data: PutPayload) -> BoxFuture<'static, object_store::Result<PartId>> {
        match self {
            Sink::S3 { s3, path, id, .. } => {
                let (s3, path, id) = (s3.clone(), path.clone(), id.clone());
                async move { s3.put_part(&path, &id, idx, data).await }.boxed()
            }
            Sink::Local { up } => up.put_part(data).map(|r| r.map(|()| PartId { content_id: String::new() })).boxed(),
        }
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
            e => TierError::Store { url: self.url.clone(), op, object: self.rel(p), source: e },
        }
    }

    async fn throttle(&self, bytes: u64) {
        if let Some(l) = &self.limiter {
            l.acquire(bytes).await;
        }
    }

    /// Reads `len` bytes at `offset` of a local file on the blocking pool;
    /// returns them and their crc32c.
    #[allow(clippy::too_many_arguments)]
    async fn read_part(
        &self,
        file: Arc<File>,
        f: &LocalFile,
        object: &Path,
        offset: u64,
        len: usize,
        held: Option<(Arc<dyn HeldBytes>, usize)>,
        from_memory: &AtomicU64,
    ) -> Result<(Bytes, u32), TierError> {
        let r = tokio::task::spawn_blocking(move || -> std::io::Result<(Bytes, u32, bool)> {
            let mut buf = vec![0u8; len];
            // Copied out of the holder's memory (it may take it back as soon as this returns).
            let lent =
                held.is_some_and(|(h, idx)| h.with_part(idx, offset, len, &mut |s| buf.copy_from_slice(&s[..len])));
            if !lent {
                file.read_exact_at(&mut buf, offset)?;
            }
            let crc = crc32c::crc32c(&buf);
            Ok((Bytes::from(buf), crc, lent))
        })
        .await
        .map_err(|e| TierError::Task { url: self.url.clone(), reason: e.to_string() })?
        .map(|(b, crc, lent)| {
            if lent {
                from_memory.fetch_add(len as u64, Ordering::Relaxed);
            }
            (b, crc)
        });
        r.map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                self.changed(f, object, format!("shorter than the {} bytes of its index", f.len))
            } else {
                TierError::LocalIo {
                    url: self.url.clone(),
                    object: self.rel(object),
                    path: f.local_path.clone(),
                    source: e,
                }
            }
        })
    }

    fn changed(&self, f: &LocalFile, object: &Path, detail: String) -> TierError {
        TierError::LocalChanged { url: self.url.clone(), object: self.rel(object), path: f.local_path.clone(), detail }
    }

    fn part_size_for(&self, len: u64) -> usize {
        // Whole blocks, so that every part but the last starts and ends on
        // one (file:// writes with O_DIRECT).
        let p = (self.part_size as u64).max(len.div_ceil(MAX_PARTS));
        (p.div_ceil(DIRECT_BLOCK_BYTES as u64) * DIRECT_BLOCK_BYTES as u64) as usize
    }

    async fn upload_one(
        &self,
        f: &LocalFile,
        path: Path,
        sem: Arc<Semaphore>,
        held: Option<(Arc<dyn HeldBytes>, usize)>,
        pool: BufPool,
        from_memory: &AtomicU64,
    ) -> Result<(), TierError> {
        let io_err = |e| TierError::LocalIo {
            url: self.url.clone(),
            object: self.rel(&path),
            path: f.local_path.clone(),
            source: e,
        };
        let file = File::open(&f.local_path).map_err(io_err)?;
        let actual = file.metadata().map_err(io_err)?.len();
        if actual != f.len {
            return Err(self.changed(f, &path, format!("it is {actual} bytes, its index says {}", f.len)));
        }
        let file = Arc::new(file);
        let part = self.part_size_for(f.len);
        let mine = AtomicU64::new(0);
        let r = self.upload_one_from(f, &path, file.clone(), part, sem.clone(), held, pool.clone(), &mine).await;
        if matches!(r, Err(TierError::LocalChanged { .. })) && mine.load(Ordering::Relaxed) > 0 {
            // Memory is a cache; the committed file is the truth.
            tracing::warn!(file = %f.local_path.display(), "the bytes held in memory differ from the committed file; uploading it from the file");
            return self.upload_one_from(f, &path, file, part, sem, None, pool, &AtomicU64::new(0)).await;
        }
        from_memory.fetch_add(mine.load(Ordering::Relaxed), Ordering::Relaxed);
        r
    }

    /// One file's upload, its parts taken from `held` while it lends them
    /// (counted in `from_memory`), else read from the local file.
    #[allow(clippy::too_many_arguments)]
    async fn upload_one_from(
        &self,
        f: &LocalFile,
        path: &Path,
        file: Arc<File>,
        part: usize,
        sem: Arc<Semaphore>,
        held: Option<(Arc<dyn HeldBytes>, usize)>,
        pool: BufPool,
        from_memory: &AtomicU64,
    ) -> Result<(), TierError> {
        let path = path.clone();
        if let Backend::Local { root } = &self.backend {
            return self.upload_local(f, &path, root, file, part, sem, held, pool, from_memory).await;
        }
        if f.len <= part as u64 {
            let _permit = sem.acquire().await.expect("the semaphore is never closed");
            let (data, crc) = self.read_part(file, f, &path, 0, f.len as usize, held.clone(), from_memory).await?;
            if crc != f.crc32c {
                return Err(self.changed(f, &path, format!("crc32c {crc:#010x}, its index says {:#010x}", f.crc32c)));
            }
            self.throttle(f.len).await;
            self.store.put(&path, PutPayload::from(data)).await.map_err(|e| self.store_err("put", &path, e))?;
            return Ok(());
        }

        let mut sink = match &self.backend {
            Backend::S3 { s3 } => {
                let id = s3.create_multipart(&path).await.map_err(|e| self.store_err("start upload of", &path, e))?;
                let dir = Path::from_iter(path.parts().take(path.parts_count() - 1));
                let marker = dir.join(format!("{UPLOAD_MARKER_PREFIX}{:016x}", nonce()).as_str());
                let body = format!("{path}\n{id}\n");
                if let Err(e) = self.store.put(&marker, PutPayload::from(body)).await {
                    let _ = s3.abort_multipart(&path, &id).await;
                    return Err(self.store_err("put", &marker, e));
                }
                Sink::S3 { s3: s3.clone(), path: path.clone(), id, marker }
            }
            Backend::Local { .. } => Sink::Local {
                up: self.store.put_multipart(&path).await.map_err(|e| self.store_err("start upload of", &path, e))?,
            },
        };

        let n_parts = f.len.div_ceil(part as u64) as usize;
        let mut failed: Option<TierError> = None;
        let mut crc_all = 0u32;
        let mut puts = tokio::task::JoinSet::new();
        {
            let mut reads = futures::stream::iter(0..n_parts)
                .map(|i| {
                    let (sem, file, path, held) = (sem.clone(), file.clone(), &path, held.clone());
                    async move {
                        let permit = sem.acquire_owned().await.expect("the semaphore is never closed");
                        let offset = (i * part) as u64;
                        let len = (f.len - offset).min(part as u64) as usize;
                        let (data, crc) = self.read_part(file, f, path, offset, len, held, from_memory).await?;
                        Ok::<_, TierError>((i, data, crc, permit))
                    }
                })
                .buffered(self.parallel);
            while let Some(r) = reads.next().await {
                match r {
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                    Ok((i, data, crc, permit)) => {
                        crc_all = ckpt_store::crc::combine(crc_all, crc, data.len() as u64);
                        self.throttle(data.len() as u64).await;
                        let put = sink.put_part(i, PutPayload::from(data));
                        puts.spawn(async move {
                            let r = put.await;
                            drop(permit);
                            r.map(|id| (i, id))
                        });
                    }
                }
            }
        }
        let mut parts = Vec::with_capacity(n_parts);
        while let Some(j) = puts.join_next().await {
            match j {
                Ok(Ok(p)) => parts.push(p),
                Ok(Err(e)) => {
                    failed.get_or_insert(self.store_err("upload part of", &path, e));
                }
                Err(e) => {
                    failed.get_or_insert(TierError::Task { url: self.url.clone(), reason: e.to_string() });
                }
            }
        }
        if failed.is_none() && crc_all != f.crc32c {
            failed = Some(self.changed(f, &path, format!("crc32c {crc_all:#010x}, its index says {:#010x}", f.crc32c)));
        }
        if let Some(e) = failed {
            self.abort(sink).await;
            return Err(e);
        }
        parts.sort_by_key(|(i, _)| *i);
        match sink {
            Sink::S3 { s3, path, id, marker } => {
                let ids = parts.into_iter().map(|(_, p)| p).collect();
                if let Err(e) = s3.complete_multipart(&path, &id, ids).await {
                    let err = self.store_err("complete upload of", &path, e);
                    self.abort(Sink::S3 { s3, path, id, marker }).await;
                    return Err(err);
                }
                if let Err(e) = self.store.delete(&marker).await {
                    // A stale marker only costs clean_incomplete an abort of a finished upload.
                    tracing::warn!("{}", self.store_err("delete", &marker, e));
                }
            }
            Sink::Local { mut up } => {
                up.complete().await.map_err(|e| self.store_err("complete upload of", &path, e))?;
            }
        }
        Ok(())
    }

    /// A file:// upload, written directly: parts read and written in
    /// parallel (pread, crc32c, pwrite on the blocking pool, page-aligned
    /// buffers reused) into `<name>#<nonce>` beside the destination, with
    /// O_DIRECT where the file system takes it (the last part padded to the
    /// block, the file truncated to its length after); if the combined
    /// crc32c matches, fdatasync, rename into place, sync the folders up to
    /// the root; otherwise the staging file is removed. (object_store's
    /// LocalFileSystem upload writes its parts one at a time, under a lock,
    /// buffered.)
    #[allow(clippy::too_many_arguments)]
    async fn upload_local(
        &self,
        f: &LocalFile,
        path: &Path,
        root: &FsPath,
        src: Arc<File>,
        part: usize,
        sem: Arc<Semaphore>,
        held: Option<(Arc<dyn HeldBytes>, usize)>,
        pool: BufPool,
        from_memory: &AtomicU64,
    ) -> Result<(), TierError> {
        use std::os::unix::fs::OpenOptionsExt;
        enum PartError {
            Read(std::io::Error),
            Write(std::io::Error),
        }
        let tio = |op: &'static str, p: &FsPath, e: std::io::Error| TierError::TargetIo {
            url: self.url.clone(),
            op,
            path: p.to_path_buf(),
            source: e,
        };
        let dest = root.join(path.as_ref());
        let parent = dest.parent().expect("an object is inside the root").to_path_buf();
        let tmp = PathBuf::from(format!("{}#{:016x}", dest.display(), nonce()));
        std::fs::create_dir_all(&parent).map_err(|e| tio("create directory", &parent, e))?;
        let open = |direct: bool| {
            let mut o = File::options();
            o.write(true).create_new(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(&tmp)
        };
        let (out, direct) = match open(true) {
            Ok(f) => (f, true),
            // A file system without O_DIRECT (tmpfs): buffered, synced at the end.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                (open(false).map_err(|e| tio("create", &tmp, e))?, false)
            }
            Err(e) => return Err(tio("create", &tmp, e)),
        };
        // The whole file allocated at once (as fio does before it writes):
        // parallel parts would otherwise allocate their blocks one write at
        // a time, interleaved. Refused (a file system without it): written
        // as it comes.
        {
            use std::os::fd::AsRawFd;
            let alloc_len =
                if direct { f.len.div_ceil(DIRECT_BLOCK_BYTES as u64) * DIRECT_BLOCK_BYTES as u64 } else { f.len };
            if alloc_len > 0 {
                // SAFETY: fallocate on a descriptor we own; no memory passed.
                let _ = unsafe { libc::fallocate(out.as_raw_fd(), 0, 0, alloc_len as libc::off_t) };
            }
        }
        let out = Arc::new(out);
        // The source read with O_DIRECT too where it can be (a step just
        // written with O_DIRECT is not in the page cache anyway).
        let (src, src_direct) = match File::options().read(true).custom_flags(libc::O_DIRECT).open(&f.local_path) {
            Ok(d) => (Arc::new(d), true),
            Err(_) => (src, false),
        };
        let block = DIRECT_BLOCK_BYTES;
        let buf_len = part.div_ceil(block) * block;
        let n_parts = f.len.div_ceil(part as u64) as usize;
        let results: Vec<Result<(u32, u64), TierError>> = futures::stream::iter(0..n_parts)
            .map(|i| {
                let (sem, src, out, pool, tmp, tio, held) =
                    (sem.clone(), src.clone(), out.clone(), pool.clone(), &tmp, &tio, held.clone());
                async move {
                    let _permit = sem.acquire_owned().await.expect("the semaphore is never closed");
                    let offset = (i * part) as u64;
                    let len = (f.len - offset).min(part as u64) as usize;
                    self.throttle(len as u64).await;
                    let r = tokio::task::spawn_blocking(move || {
                        let take_buf = || -> std::io::Result<AlignedBuf> {
                            match pool.lock().expect("buffer pool").pop() {
                                Some(b) if b.len() >= buf_len => Ok(b),
                                _ => AlignedBuf::new(buf_len),
                            }
                        };
                        // O_DIRECT writes whole blocks: the tail of the last part is
                        // padded, cut off by the truncate at the end.
                        let wlen = if direct { len.div_ceil(block) * block } else { len };
                        // From the holder's memory while it lends it: written from
                        // there when O_DIRECT takes it as it is (no copy), else copied.
                        let mut lent: Option<Result<u32, PartError>> = None;
                        let mut copied: Option<AlignedBuf> = None;
                        if let Some((h, idx)) = &held {
                            h.with_part(*idx, offset, len, &mut |m: &[u8]| {
                                if m.len() >= wlen && (!direct || (m.as_ptr() as usize) % block == 0) {
                                    let crc = crc32c::crc32c(&m[..len]);
                                    lent = Some(
                                        out.write_all_at(&m[..wlen], offset).map(|()| crc).map_err(PartError::Write),
                                    );
                                } else {
                                    match take_buf() {
                                        Ok(mut b) => {
                                            b.as_mut_slice()[..len].copy_from_slice(&m[..len]);
                                            copied = Some(b);
                                        }
                                        Err(e) => lent = Some(Err(PartError::Read(e))),
                                    }
                                }
                            });
                        }
                        if let Some(r) = lent {
                            return r.map(|crc| (crc, true));
                        }
                        let from_mem = copied.is_some();
                        let mut buf = match copied {
                            Some(b) => b,
                            None => take_buf().map_err(PartError::Read)?,
                        };
                        let b = buf.as_mut_slice();
                        let read = |b: &mut [u8]| -> std::io::Result<()> {
                            if !src_direct {
                                return src.read_exact_at(&mut b[..len], offset);
                            }
                            // Whole blocks; the file ends inside the last one.
                            let want = len.div_ceil(block) * block;
                            let mut got = 0;
                            while got < len {
                                match src.read_at(&mut b[got..want], offset + got as u64) {
                                    Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                                    Ok(n) => got += n,
                                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                                    Err(e) => return Err(e),
                                }
                            }
                            Ok(())
                        };
                        let got = if from_mem { Ok(()) } else { read(b) };
                        let r = got.map_err(PartError::Read).and_then(|()| {
                            let crc = crc32c::crc32c(&b[..len]);
                            b[len..wlen].fill(0);
                            out.write_all_at(&b[..wlen], offset).map_err(PartError::Write)?;
                            Ok((crc, from_mem))
                        });
                        pool.lock().expect("buffer pool").push(buf);
                        r
                    })
                    .await
                    .map_err(|e| TierError::Task { url: self.url.clone(), reason: e.to_string() })?;
                    match r {
                        Ok((crc, from_mem)) => {
                            if from_mem {
                                from_memory.fetch_add(len as u64, Ordering::Relaxed);
                            }
                            Ok((crc, len as u64))
                        }
                        Err(PartError::Read(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                            Err(self.changed(f, path, format!("shorter than the {} bytes of its index", f.len)))
                        }
                        Err(PartError::Read(e)) => Err(TierError::LocalIo {
                            url: self.url.clone(),
                            object: self.rel(path),
                            path: f.local_path.clone(),
                            source: e,
                        }),
                        Err(PartError::Write(e)) => Err(tio("write", tmp, e)),
                    }
                }
            })
            .buffered(self.parallel)
            .collect()
            .await;
        let mut crc_all = 0u32;
        let mut failed = None;
        for r in results {
            match r {
                Ok((crc, len)) => crc_all = ckpt_store::crc::combine(crc_all, crc, len),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if failed.is_none() && crc_all != f.crc32c {
            failed = Some(self.changed(f, path, format!("crc32c {crc_all:#010x}, its index says {:#010x}", f.crc32c)));
        }
        let finish = || -> Result<(), TierError> {
            if let Some(e) = failed {
                return Err(e);
            }
            out.set_len(f.len).map_err(|e| tio("truncate", &tmp, e))?;
            out.sync_data().map_err(|e| tio("sync", &tmp, e))?;
            std::fs::rename(&tmp, &dest).map_err(|e| tio("rename", &tmp, e))?;
            // The new entry, and any folder created for it, made durable.
            for dir in dest.ancestors().skip(1) {
                File::open(dir).and_then(|d| d.sync_all()).map_err(|e| tio("sync", dir, e))?;
                if dir == root {
                    break;
                }
            }
            Ok(())
        };
        let r = tokio::task::block_in_place(finish);
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r
    }

    async fn abort(&self, sink: Sink) {
        match sink {
            Sink::S3 { s3, path, id, marker } => {
                if let Err(e) = s3.abort_multipart(&path, &id).await {
                    // Its marker stays: clean_incomplete aborts it later.
                    tracing::warn!("{}", self.store_err("abort upload of", &path, e));
                    return;
                }
                let _ = self.store.delete(&marker).await;
            }
            Sink::Local { mut up } => {
                if let Err(e) = up.abort().await {
                    tracing::warn!("{}", self.store_err("abort upload", &self.prefix, e));
                }
            }
        }
    }

    async fn latest_object(&self) -> Result<Option<u64>, TierError> {
        let p = self.latest_path();
        match self.store.get(&p).await {
            Ok(r) => {
                let b = r.bytes().await.map_err(|e| self.store_err("get", &p, e))?;
                Ok(std::str::from_utf8(&b).ok().and_then(|s| format::parse_step_dir_name(s.trim())))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.store_err("get", &p, e)),
        }
    }

    async fn has_index(&self, step: u64) -> Result<bool, TierError> {
        let p = self.step_path(step)?.join(INDEX_FILE_NAME);
        match self.store.head(&p).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.store_err("head", &p, e)),
        }
    }

    /// Every step folder, and whether it holds an index, ascending.
    async fn step_folders(&self) -> Result<Vec<(u64, bool)>, TierError> {
        let list = self
            .store
            .list_with_delimiter(self.prefix_opt())
            .await
            .map_err(|e| self.store_err("list", &self.prefix, e))?;
        let steps: Vec<u64> =
            list.common_prefixes.iter().filter_map(|p| p.filename().and_then(format::parse_step_dir_name)).collect();
        let mut out: Vec<(u64, bool)> = futures::stream::iter(steps)
            .map(|s| async move { Ok::<_, TierError>((s, self.has_index(s).await?)) })
            .buffer_unordered(self.parallel)
            .try_collect()
            .await?;
        out.sort_unstable();
        Ok(out)
    }

    async fn steps(&self) -> Result<Vec<u64>, TierError> {
        Ok(self.step_folders().await?.into_iter().filter(|&(_, c)| c).map(|(s, _)| s).collect())
    }

    /// Aborts the upload an S3 marker names, then deletes the marker.
    async fn abort_marked(&self, marker: &Path) -> Result<(), TierError> {
        let Backend::S3 { s3 } = &self.backend else { return Ok(()) };
        let body = match self.store.get(marker).await {
            Ok(r) => r.bytes().await.map_err(|e| self.store_err("get", marker, e))?,
            Err(object_store::Error::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(self.store_err("get", marker, e)),
        };
        let text = String::from_utf8_lossy(&body);
        let mut lines = text.lines();
        if let (Some(key), Some(id)) = (lines.next(), lines.next()) {
            if let Ok(path) = Path::parse(key) {
                match s3.abort_multipart(&path, &id.to_string()).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    // An upload that is gone already (completed, aborted, expired).
                    Err(e) if e.to_string().contains("NoSuchUpload") => {}
                    Err(e) => return Err(self.store_err("abort upload of", &path, e)),
                }
            }
        }
        match self.store.delete(marker).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.store_err("delete", marker, e)),
        }
    }

    /// Every object of a step folder removed (uploads its markers name
    /// aborted first); returns how many uploads it aborted.
    async fn remove_step_folder(&self, step_dir: &Path) -> Result<usize, TierError> {
        let objects: Vec<Path> = self
            .store
            .list(Some(step_dir))
            .map_ok(|m| m.location)
            .try_collect()
            .await
            .map_err(|e| self.store_err("list", step_dir, e))?;
        let mut aborted = 0;
        for p in objects.iter().filter(|p| p.filename().is_some_and(|n| n.starts_with(UPLOAD_MARKER_PREFIX))) {
            self.abort_marked(p).await?;
            aborted += 1;
        }
        futures::stream::iter(
            objects.iter().filter(|p| !p.filename().is_some_and(|n| n.starts_with(UPLOAD_MARKER_PREFIX))),
        )
        .map(|p| async move {
            match self.store.delete(p).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(self.store_err("delete", p, e)),
            }
        })
        .buffer_unordered(self.parallel)
        .try_collect::<()>()
        .await?;
        if let Backend::Local { root } = &self.backend {
            // Empty folders and object_store's staging files, which its listing hides.
            let dir = root.join(self.rel(step_dir));
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(TierError::TargetIo { url: self.url.clone(), op: "remove", path: dir, source: e })
                }
            }
        }
        Ok(aborted)
    }

    /// A committed step's leftovers of a cut-short re-upload: S3 uploads
    /// (by marker) aborted, file:// staging files removed; returns how many.
    async fn clean_committed_folder(&self, step_dir: &Path) -> Result<usize, TierError> {
        match &self.backend {
            Backend::S3 { .. } => {
                let markers: Vec<Path> = self
                    .store
                    .list(Some(step_dir))
                    .map_ok(|m| m.location)
                    .try_filter(|p| {
                        std::future::ready(p.filename().is_some_and(|n| n.starts_with(UPLOAD_MARKER_PREFIX)))
                    })
                    .try_collect()
                    .await
                    .map_err(|e| self.store_err("list", step_dir, e))?;
                for m in &markers {
                    self.abort_marked(m).await?;
                }
                Ok(markers.len())
            }
            Backend::Local { root } => {
                let dir = root.join(self.rel(step_dir));
                let mut n = self.remove_staging_files(&dir)?;
                let blobs = dir.join(BLOBS_DIR_NAME);
                if blobs.is_dir() {
                    n += self.remove_staging_files(&blobs)?;
                }
                Ok(n)
            }
        }
    }

    /// Removes object_store's staging files (`<name>#<n>`) of one directory.
    fn remove_staging_files(&self, dir: &FsPath) -> Result<usize, TierError> {
        let io = |op, path: &FsPath, e| TierError::TargetIo {
            url: self.url.clone(),
            op,
            path: path.to_path_buf(),
            source: e,
        };
        let mut n = 0;
        for e in std::fs::read_dir(dir).map_err(|e| io("list", dir, e))? {
            let e = e.map_err(|e| io("list", dir, e))?;
            if e.file_name().to_string_lossy().contains('#') && e.file_type().is_ok_and(|t| t.is_file()) {
                match std::fs::remove_file(e.path()) {
                    Ok(()) => n += 1,
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                    Err(err) => return Err(io("remove", &e.path(), err)),
                }
            }
        }
        Ok(n)
    }
}
