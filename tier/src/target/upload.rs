//! The upload of one local file: its length checked, its parts read on
//! the blocking pool (or taken from a holder's memory) with their crc32c,
//! and the whole upload redone from the file when lent bytes did not match.
//! Where the parts go is the backend's: `s3` (through the object store) or
//! `local` (file://, written directly).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use object_store::path::Path;
use tokio::sync::Semaphore;

use super::{BufPool, HeldBytes, Inner, LocalFile};
use crate::config::*;
use crate::error::TierError;

impl Inner {
    /// Reads `len` bytes at `offset` of a local file on the blocking pool;
    /// returns them and their crc32c.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn read_part(
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

    pub(super) fn part_size_for(&self, len: u64) -> usize {
        // Whole blocks, so that every part but the last starts and ends on
        // one (file:// writes with O_DIRECT).
        let p = (self.part_size as u64).max(len.div_ceil(MAX_PARTS));
        (p.div_ceil(DIRECT_BLOCK_BYTES as u64) * DIRECT_BLOCK_BYTES as u64) as usize
    }

    pub(super) async fn upload_one(
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
}
