//! An upload through the object store: a file of at most one part in one
//! put, a larger one as a multipart upload announced by a marker object
//! (S3) whose parts are read and sent in parallel; completed only when the
//! parts' combined crc32c is the index's, aborted otherwise.
//!
//! Invariant: an S3 multipart upload exists only while its marker does
//! (the marker is written before the first part and deleted after the
//! completion or abort), so `clean_incomplete` can find it.

use std::fs::File;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use object_store::aws::AmazonS3;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{MultipartUpload, ObjectStoreExt, PutPayload};
use tokio::sync::Semaphore;

use super::{nonce, Backend, BufPool, HeldBytes, Inner, LocalFile, UPLOAD_MARKER_PREFIX};
use crate::error::TierError;

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
    /// One file's upload, its parts taken from `held` while it lends them
    /// (counted in `from_memory`), else read from the local file.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn upload_one_from(
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

        let mut sink = self.start_multipart(&path).await?;

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
        self.complete(sink, &path, parts).await
    }

    /// A multipart upload of `path` started: S3's announced by its marker
    /// (written before any part), or object_store's staged file://.
    async fn start_multipart(&self, path: &Path) -> Result<Sink, TierError> {
        match &self.backend {
            Backend::S3 { s3 } => {
                let id = s3.create_multipart(path).await.map_err(|e| self.store_err("start upload of", path, e))?;
                let dir = Path::from_iter(path.parts().take(path.parts_count() - 1));
                let marker = dir.join(format!("{UPLOAD_MARKER_PREFIX}{:016x}", nonce()).as_str());
                let body = format!("{path}\n{id}\n");
                if let Err(e) = self.store.put(&marker, PutPayload::from(body)).await {
                    let _ = s3.abort_multipart(path, &id).await;
                    return Err(self.store_err("put", &marker, e));
                }
                Ok(Sink::S3 { s3: s3.clone(), path: path.clone(), id, marker })
            }
            Backend::Local { .. } => Ok(Sink::Local {
                up: self.store.put_multipart(path).await.map_err(|e| self.store_err("start upload of", path, e))?,
            }),
        }
    }

    /// Completes an upload whose every part is in (`parts`, by index);
    /// then its marker goes. A completion that fails aborts the upload.
    async fn complete(&self, sink: Sink, path: &Path, mut parts: Vec<(usize, PartId)>) -> Result<(), TierError> {
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
                up.complete().await.map_err(|e| self.store_err("complete upload of", path, e))?;
            }
        }
        Ok(())
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
}
