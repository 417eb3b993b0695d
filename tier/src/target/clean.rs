//! Removing what uploads left: the uploads S3 markers announce aborted
//! (then their markers deleted), whole step folders removed, and the
//! leftovers of a cut-short re-upload of a committed step.
//!
//! Invariant: a marker is deleted only after its upload is aborted (or
//! known to be gone), so no pending upload loses the record that finds it.

use ckpt_store::format::BLOBS_DIR_NAME;
use futures::{StreamExt, TryStreamExt};
use object_store::multipart::MultipartStore;
use object_store::path::Path;
use object_store::ObjectStoreExt;

use super::{Backend, Inner, UPLOAD_MARKER_PREFIX};
use crate::error::TierError;

impl Inner {
    /// Aborts the upload an S3 marker names, then deletes the marker.
    pub(super) async fn abort_marked(&self, marker: &Path) -> Result<(), TierError> {
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
    pub(super) async fn remove_step_folder(&self, step_dir: &Path) -> Result<usize, TierError> {
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
    pub(super) async fn clean_committed_folder(&self, step_dir: &Path) -> Result<usize, TierError> {
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
}
