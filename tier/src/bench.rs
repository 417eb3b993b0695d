//! `bench drain`'s measurements: our upload of a committed local step
//! (`Target::upload_step`) against the plain object_store client's
//! multipart put of the same files (`WriteMultipart`, the same part size
//! and parts in flight), and our download (`read_range` of every file)
//! against the plain client's `get`, on the same target in the same run;
//! and, given by the caller, a restore of the step through its load path
//! (the sidecar's), beside the plain client's download again.
//! Figures only; nothing here asserts a time.

use std::io::Read;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ckpt_store::format;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, WriteMultipart};

use crate::error::TierError;
use crate::target::{nonce, LocalFile, Target, TargetOptions};

/// The caller's restore of a step from a URL (its seconds, or why it failed).
pub type RestoreFn = dyn Fn(&str, u64) -> Result<f64, String>;

pub struct DrainBenchArgs {
    /// The drain target (file:///dir, s3://bucket/prefix); the bench works
    /// under `<url>/bench-drain-<nonce>/` and removes it at the end.
    pub url: String,
    /// A committed local step: its files and its index bytes.
    pub step: u64,
    pub files: Vec<LocalFile>,
    pub index_json: Vec<u8>,
    pub opts: TargetOptions,
    /// A restore of the uploaded step through the caller's load path
    /// (the sidecar's: a step only the target holds, loaded verified into
    /// memory), given the URL our upload went to and the step: its seconds.
    pub restore: Option<Box<RestoreFn>>,
    /// Also time the upload from memory (the files held in page-aligned
    /// buffers, as the sidecar's staging holds a step right after its
    /// commit: [`Target::upload_files_held`]).
    pub from_memory: bool,
}

/// The files' bytes in page-aligned, pre-faulted buffers (padded to the
/// block), lent to an upload as the sidecar's staging image is.
pub struct MemFiles {
    bufs: Vec<ckpt_store::mem::AlignedBuf>,
    lens: Vec<u64>,
}

impl MemFiles {
    pub fn read(files: &[LocalFile]) -> std::io::Result<MemFiles> {
        use std::os::unix::fs::FileExt;
        let block = crate::config::DIRECT_BLOCK_BYTES as u64;
        let mut bufs = Vec::with_capacity(files.len());
        for f in files {
            let mut b = ckpt_store::mem::AlignedBuf::new((f.len.div_ceil(block) * block).max(block) as usize)?;
            std::fs::File::open(&f.local_path)?.read_exact_at(&mut b.as_mut_slice()[..f.len as usize], 0)?;
            bufs.push(b);
        }
        Ok(MemFiles { bufs, lens: files.iter().map(|f| f.len).collect() })
    }
}

impl crate::target::HeldBytes for MemFiles {
    fn with_part(&self, file_idx: usize, offset: u64, len: usize, f: &mut dyn FnMut(&[u8])) -> bool {
        let (Some(b), Some(&flen)) = (self.bufs.get(file_idx), self.lens.get(file_idx)) else { return false };
        if offset + len as u64 > flen {
            return false;
        }
        f(&b.as_slice()[offset as usize..]);
        true
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DrainFigures {
    pub url: String,
    pub bytes: u64,
    pub files: usize,
    pub parallel: usize,
    pub part_size_bytes: usize,
    /// Target::upload_step: files, index (the commit), latest.
    pub upload_seconds: f64,
    /// object_store's WriteMultipart of the same files, one after another.
    pub plain_upload_seconds: f64,
    /// Target::read_range of every file.
    pub download_seconds: f64,
    /// object_store's get(...).bytes() of every file.
    pub plain_download_seconds: f64,
    /// [`DrainBenchArgs::restore`], when given.
    pub restore_seconds: Option<f64>,
    /// The plain client's download again, right after the restore (same
    /// bytes, same conditions; the restore's ratio is taken against it).
    pub plain_download_again_seconds: Option<f64>,
    /// Target::upload_files_held (from memory) + commit_step, when asked.
    pub upload_from_memory_seconds: Option<f64>,
}

impl DrainFigures {
    pub fn upload_ratio(&self) -> f64 {
        self.plain_upload_seconds / self.upload_seconds.max(1e-12)
    }
    pub fn download_ratio(&self) -> f64 {
        self.plain_download_seconds / self.download_seconds.max(1e-12)
    }
    /// Restore speed over the plain client's download speed (the better
    /// of its two runs); a verified restore must reach 0.8 of it.
    pub fn restore_ratio(&self) -> Option<f64> {
        let plain = self
            .plain_download_again_seconds
            .map_or(self.plain_download_seconds, |a| a.min(self.plain_download_seconds));
        self.restore_seconds.map(|r| plain / r.max(1e-12))
    }
}

/// Drops the local files' cached pages (they are synced), so that both
/// uploads read from the disk as a drain of a step just written with
/// O_DIRECT does.
fn drop_cache(files: &[LocalFile]) {
    for f in files {
        if let Ok(file) = std::fs::File::open(&f.local_path) {
            use std::os::fd::AsRawFd;
            // SAFETY: an advisory call on a descriptor we own; no memory passed.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
}

/// The plain client of the same target (object_store as a user would
/// build it, durability as ours for file://) and the prefix inside it.
fn plain_store(url: &str, sub: &str) -> Result<(Arc<dyn ObjectStore>, Path), TierError> {
    let bad = |reason: String| TierError::BadUrl { url: url.to_string(), reason };
    let u = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
    match u.scheme() {
        "file" => {
            let root: PathBuf = u.to_file_path().map_err(|_| bad("file:// needs an absolute path".into()))?;
            let fs = LocalFileSystem::new_with_prefix(&root)
                .map_err(|e| TierError::Open {
                    url: url.to_string(),
                    what: "plain client".into(),
                    source: Box::new(e),
                })?
                .with_fsync(true);
            Ok((Arc::new(fs), Path::from(sub)))
        }
        "s3" => {
            let bucket = u.host_str().unwrap_or_default();
            let s3 = AmazonS3Builder::from_env().with_url(format!("s3://{bucket}")).build().map_err(|e| {
                TierError::Open { url: url.to_string(), what: "plain client".into(), source: Box::new(e) }
            })?;
            let prefix = u.path().trim_matches('/');
            let p = if prefix.is_empty() { sub.to_string() } else { format!("{prefix}/{sub}") };
            Ok((Arc::new(s3), Path::parse(p).map_err(|e| bad(e.to_string()))?))
        }
        other => Err(bad(format!("{other}:// is not supported"))),
    }
}

fn store_err(url: &str, op: &'static str, p: &Path, e: object_store::Error) -> TierError {
    TierError::Store { url: url.to_string(), op, object: p.to_string(), source: Box::new(e) }
}

async fn plain_upload(
    url: &str,
    store: &dyn ObjectStore,
    dir: &Path,
    files: &[LocalFile],
    part: usize,
    parallel: usize,
) -> Result<(), TierError> {
    let mut buf = vec![0u8; part];
    for f in files {
        let path = f.name.split('/').fold(dir.clone(), |p, part| p.join(part));
        let up = store.put_multipart(&path).await.map_err(|e| store_err(url, "start upload of", &path, e))?;
        let mut w = WriteMultipart::new_with_chunk_size(up, part);
        let mut file = std::fs::File::open(&f.local_path).map_err(|e| TierError::LocalIo {
            url: url.to_string(),
            object: f.name.clone(),
            path: f.local_path.clone(),
            source: e,
        })?;
        loop {
            let n = file.read(&mut buf).map_err(|e| TierError::LocalIo {
                url: url.to_string(),
                object: f.name.clone(),
                path: f.local_path.clone(),
                source: e,
            })?;
            if n == 0 {
                break;
            }
            w.wait_for_capacity(parallel).await.map_err(|e| store_err(url, "upload part of", &path, e))?;
            w.write(&buf[..n]);
        }
        w.finish().await.map_err(|e| store_err(url, "complete upload of", &path, e))?;
    }
    Ok(())
}

/// Runs the four measurements once each, in this order: our upload, the
/// plain upload, our download, the plain download (each upload from a
/// cold page cache); then removes what it uploaded.
/// The upload from memory timed ([`DrainBenchArgs::from_memory`]): the
/// files lent from page-aligned buffers, committed, then deleted again.
fn time_upload_from_memory(args: &DrainBenchArgs, t: &Target, bytes: u64) -> Result<f64, TierError> {
    let mem = Arc::new(MemFiles::read(&args.files).map_err(|e| TierError::LocalIo {
        url: args.url.clone(),
        object: String::new(),
        path: PathBuf::new(),
        source: e,
    })?);
    let t0 = Instant::now();
    let (_, from_memory) = t.upload_files_held(args.step, &args.files, mem)?;
    t.commit_step(args.step, &args.index_json)?;
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(from_memory, bytes, "every byte lent was taken from memory");
    t.delete_step(args.step)?;
    Ok(secs)
}

/// Every file read whole through the plain client, its length checked.
async fn plain_download(args: &DrainBenchArgs, plain: &dyn ObjectStore, plain_dir: &Path) -> Result<(), TierError> {
    for f in &args.files {
        let path = f.name.split('/').fold(plain_dir.clone(), |p, part| p.join(part));
        let got = plain.get(&path).await.map_err(|e| store_err(&args.url, "get", &path, e))?;
        let b = got.bytes().await.map_err(|e| store_err(&args.url, "get", &path, e))?;
        if b.len() as u64 != f.len {
            return Err(TierError::PastEnd {
                url: args.url.clone(),
                object: path.to_string(),
                offset: 0,
                len: f.len,
                size: b.len() as u64,
            });
        }
    }
    Ok(())
}

pub fn drain(args: &DrainBenchArgs) -> Result<DrainFigures, TierError> {
    let sub = format!("bench-drain-{:016x}", nonce());
    let ours_url = format!("{}/{sub}/ours", args.url.trim_end_matches('/'));
    let t = Target::open_creating(&ours_url, args.opts.clone())?;
    let (plain, plain_dir) = plain_store(&args.url, &format!("{sub}/plain"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(crate::config::RUNTIME_WORKER_THREADS)
        .enable_all()
        .build()
        .map_err(|e| TierError::TargetIo {
            url: args.url.clone(),
            op: "start runtime",
            path: PathBuf::new(),
            source: e,
        })?;
    let part = args.opts.part_size_bytes.max(crate::config::MIN_PART_SIZE_BYTES);
    let parallel = args.opts.parallel.max(1);
    let bytes: u64 = args.files.iter().map(|f| f.len).sum();

    let result = (|| {
        let upload_from_memory_seconds =
            if args.from_memory { Some(time_upload_from_memory(args, &t, bytes)?) } else { None };
        drop_cache(&args.files);
        let t0 = Instant::now();
        t.upload_step(args.step, &args.files, &args.index_json)?;
        let upload_seconds = t0.elapsed().as_secs_f64();

        drop_cache(&args.files);
        let t0 = Instant::now();
        rt.block_on(plain_upload(&args.url, plain.as_ref(), &plain_dir, &args.files, part, parallel))?;
        let plain_upload_seconds = t0.elapsed().as_secs_f64();

        let biggest = args.files.iter().map(|f| f.len).max().unwrap_or(0) as usize;
        let mut buf = vec![0u8; biggest];
        drop_target_cache(&args.url, &sub);
        let t0 = Instant::now();
        for f in &args.files {
            t.read_range(args.step, &f.name, 0, &mut buf[..f.len as usize])?;
        }
        let download_seconds = t0.elapsed().as_secs_f64();

        let time_plain_download = || {
            drop_target_cache(&args.url, &sub);
            let t0 = Instant::now();
            rt.block_on(plain_download(args, plain.as_ref(), &plain_dir))?;
            Ok::<f64, TierError>(t0.elapsed().as_secs_f64())
        };
        let plain_download_seconds = time_plain_download()?;
        let (restore_seconds, plain_download_again_seconds) = match &args.restore {
            Some(restore) => {
                drop_target_cache(&args.url, &sub);
                let r = restore(&ours_url, args.step).map_err(|reason| TierError::Task {
                    url: args.url.clone(),
                    reason: format!("restore: {reason}"),
                })?;
                (Some(r), Some(time_plain_download()?))
            }
            None => (None, None),
        };
        Ok(DrainFigures {
            url: args.url.clone(),
            bytes,
            files: args.files.len(),
            parallel,
            part_size_bytes: part,
            upload_seconds,
            plain_upload_seconds,
            download_seconds,
            plain_download_seconds,
            restore_seconds,
            plain_download_again_seconds,
            upload_from_memory_seconds,
        })
    })();

    // Clean up whatever happened above.
    let _ = t.delete_step(args.step);
    let _ = t.clean_incomplete();
    rt.block_on(async {
        use futures::TryStreamExt;
        let all: Vec<Path> =
            plain.list(Some(&plain_dir)).map_ok(|m| m.location).try_collect().await.unwrap_or_default();
        for p in all {
            let _ = plain.delete(&p).await;
        }
    });
    remove_empty_file_dirs(&args.url, &sub);
    result
}

/// file://: the bench's files on the target dropped from the page cache,
/// so that every download reads the disk (ours uploads with O_DIRECT, the
/// plain client through the cache).
fn drop_target_cache(url: &str, sub: &str) {
    let Some(root) = file_url_dir(url) else { return };
    let mut stack = vec![root.join(sub)];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => {
                    drop_cache(&[LocalFile { local_path: e.path(), name: String::new(), len: 0, crc32c: 0 }])
                }
                _ => {}
            }
        }
    }
}

/// file:// leaves empty folders behind object deletes: removed.
fn remove_empty_file_dirs(url: &str, sub: &str) {
    if let Ok(u) = url::Url::parse(url) {
        if u.scheme() == "file" {
            if let Ok(root) = u.to_file_path() {
                let _ = std::fs::remove_dir_all(root.join(sub));
            }
        }
    }
}

/// The directory of a file:// URL (for fio), None for others.
pub fn file_url_dir(url: &str) -> Option<PathBuf> {
    url::Url::parse(url).ok().filter(|u| u.scheme() == "file").and_then(|u| u.to_file_path().ok())
}

/// The step's files and index of a committed local step.
pub fn local_step(primary: &FsPath, step: u64) -> std::io::Result<(Vec<LocalFile>, Vec<u8>)> {
    let index_json = std::fs::read(
        primary.join(format::step_dir_name(step).map_err(std::io::Error::other)?).join(format::INDEX_FILE_NAME),
    )?;
    let index = format::Index::from_json_bytes(&index_json).map_err(std::io::Error::other)?;
    Ok((crate::target::local_files(primary, &index), index_json))
}
