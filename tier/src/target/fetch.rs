//! A restore's reads: one file of a committed step streamed straight into
//! the caller's memory, each piece handed to the caller (to check it) as
//! soon as it is there, in file order, on the calling thread, with no copy
//! anywhere else. The request pattern ([`fetch_ranges`], limits in
//! `config.rs`): one GET per file, its body copied into place as it
//! arrives, files fetched side by side by the caller's threads; only a
//! lone file much larger than a part is split into ranged GETs (a part
//! each, several in flight, handed over in order).

use std::os::unix::fs::FileExt;

use ckpt_store::format;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;

use super::Target;
use crate::config::{LOCAL_FETCH_CHUNK_BYTES, RANGED_GET_FILES_MAX, RANGED_GET_MIN_PARTS};
use crate::error::TierError;

/// How many ranged GETs to have in flight for one file of `len_bytes` in a
/// step whose restore fetches `n_files` files side by side, `parallel`
/// requests at once with parts of `part_bytes`: 1 (one whole-object GET,
/// streamed) unless the file is at least [`RANGED_GET_MIN_PARTS`] parts and
/// the step has at most [`RANGED_GET_FILES_MAX`] files fetched, and then
/// the file's share of `parallel`, at most its parts.
pub fn fetch_ranges(n_files: usize, len_bytes: u64, parallel: usize, part_bytes: usize) -> usize {
    let parts = len_bytes.div_ceil(part_bytes.max(1) as u64);
    if n_files == 0 || n_files > RANGED_GET_FILES_MAX || parts < RANGED_GET_MIN_PARTS {
        return 1;
    }
    (parallel / n_files).clamp(1, parts as usize)
}

impl Target {
    /// Concurrent requests of one call (`TargetOptions::parallel`).
    pub fn parallel(&self) -> usize {
        self.inner.parallel
    }

    /// The part size in use (`TargetOptions::part_size_bytes`, raised to S3's minimum).
    pub fn part_size_bytes(&self) -> usize {
        self.inner.part_size
    }

    /// Reads all of file `name` of committed step `step` into `dst`, which
    /// must be exactly its length (another length on the target is an
    /// error naming it), calling `feed` with each piece once it is in
    /// `dst`, in file order. `ranges` 1: one GET whose body is copied into
    /// place as it arrives; more: ranged GETs of a part each, that many in
    /// flight ([`fetch_ranges`] chooses). Every byte is written to `dst`
    /// and `feed` runs on the calling thread only (a destination whose
    /// accesses must be guarded is touched nowhere else). The caller
    /// verifies checksums as a local load does.
    pub fn fetch_file(
        &self,
        step: u64,
        name: &str,
        dst: &mut [u8],
        ranges: usize,
        feed: &mut dyn FnMut(&[u8]),
    ) -> Result<(), TierError> {
        let inner = &*self.inner;
        let path = self.file_path(step, name)?;
        let path = &path;
        let len = dst.len() as u64;
        let wrong_len =
            |size: u64| TierError::WrongLength { url: inner.url.clone(), object: inner.rel(path), expected: len, size };
        if let super::Backend::Local { root } = &inner.backend {
            // A directory: read in place, a chunk at a time (no runtime).
            let file_path = name
                .split('/')
                .fold(root.join(format::step_dir_name(step).expect("checked by file_path")), |p, part| p.join(part));
            let io_err = |op, e| TierError::TargetIo { url: inner.url.clone(), op, path: file_path.clone(), source: e };
            let file = std::fs::File::open(&file_path).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => TierError::NotFound { url: inner.url.clone(), object: inner.rel(path) },
                _ => io_err("open", e),
            })?;
            let size = file.metadata().map_err(|e| io_err("stat", e))?.len();
            if size != len {
                return Err(wrong_len(size));
            }
            for (i, buf) in dst.chunks_mut(LOCAL_FETCH_CHUNK_BYTES).enumerate() {
                file.read_exact_at(buf, (i * LOCAL_FETCH_CHUNK_BYTES) as u64).map_err(|e| io_err("read", e))?;
                feed(buf);
            }
            return Ok(());
        }
        if ranges <= 1 {
            return inner.rt.block_on(async {
                let r = inner.store.get(path).await.map_err(|e| inner.store_err("get", path, e))?;
                if r.meta.size != len {
                    return Err(wrong_len(r.meta.size));
                }
                let mut body = r.into_stream();
                let mut pos = 0usize;
                while let Some(piece) = body.next().await {
                    let piece = piece.map_err(|e| inner.store_err("get", path, e))?;
                    let end = pos + piece.len();
                    if end > dst.len() {
                        return Err(wrong_len(end as u64));
                    }
                    dst[pos..end].copy_from_slice(&piece);
                    feed(&dst[pos..end]);
                    pos = end;
                }
                if pos != dst.len() {
                    return Err(wrong_len(pos as u64));
                }
                Ok(())
            });
        }
        let part = inner.part_size;
        inner.rt.block_on(async {
            // Polled here (block_on's thread): the copies into `dst` happen
            // on the calling thread; only the sockets are the runtime's.
            let mut pieces = futures::stream::iter(dst.chunks_mut(part).enumerate())
                .map(|(i, buf)| async move {
                    let start = (i * part) as u64;
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
                    Ok::<&mut [u8], TierError>(buf)
                })
                .buffered(ranges);
            while let Some(buf) = pieces.try_next().await? {
                feed(buf);
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn many_files_or_small_ones_take_one_get_each_a_lone_large_one_is_split() {
        let mib = 1u64 << 20;
        assert_eq!(fetch_ranges(8, 256 * mib, 8, 16 << 20), 1, "many files: one GET per file");
        assert_eq!(fetch_ranges(1, 32 * mib, 8, 16 << 20), 1, "two parts: one GET");
        assert_eq!(fetch_ranges(1, 512 * mib, 8, 16 << 20), 8, "one large file: every slot");
        assert_eq!(fetch_ranges(2, 512 * mib, 8, 16 << 20), 1, "two large files: one GET each");
        assert_eq!(fetch_ranges(1, 64 * mib, 16, 16 << 20), 4, "never more ranges than parts");
    }
}
