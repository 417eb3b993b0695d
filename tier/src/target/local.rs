//! A file:// upload, written directly (parallel pread, crc32c, pwrite
//! with O_DIRECT where the file system takes it) into a staging file that
//! is renamed into place only when the combined crc32c matches, synced up
//! to the root; and the removal of object_store's staging files.
//!
//! Invariant: a destination file exists only whole and synced; a failed
//! upload leaves no staging file behind.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path as FsPath, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ckpt_store::mem::AlignedBuf;
use futures::StreamExt;
use object_store::path::Path;
use tokio::sync::Semaphore;

use super::{nonce, BufPool, HeldBytes, Inner, LocalFile};
use crate::config::*;
use crate::error::TierError;

impl Inner {
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
    pub(super) async fn upload_local(
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
        let dest = root.join(path.as_ref());
        let tmp = PathBuf::from(format!("{}#{:016x}", dest.display(), nonce()));
        let (out, direct) = self.create_staging(f, &dest, &tmp)?;
        let out = Arc::new(out);
        // The source read with O_DIRECT too where it can be (a step just
        // written with O_DIRECT is not in the page cache anyway).
        let (src, src_direct) = match File::options().read(true).custom_flags(libc::O_DIRECT).open(&f.local_path) {
            Ok(d) => (Arc::new(d), true),
            Err(_) => (src, false),
        };
        let buf_len = part.div_ceil(DIRECT_BLOCK_BYTES) * DIRECT_BLOCK_BYTES;
        let n_parts = f.len.div_ceil(part as u64) as usize;
        let results: Vec<Result<(u32, u64), TierError>> = futures::stream::iter(0..n_parts)
            .map(|i| {
                let offset = (i * part) as u64;
                let len = (f.len - offset).min(part as u64) as usize;
                let job = PartJob {
                    src: src.clone(),
                    src_direct,
                    out: out.clone(),
                    direct,
                    pool: pool.clone(),
                    buf_len,
                    offset,
                    len,
                    held: held.clone(),
                };
                let (sem, tmp) = (sem.clone(), &tmp);
                async move {
                    let _permit = sem.acquire_owned().await.expect("the semaphore is never closed");
                    self.throttle(len as u64).await;
                    let r = tokio::task::spawn_blocking(move || job.run())
                        .await
                        .map_err(|e| TierError::Task { url: self.url.clone(), reason: e.to_string() })?;
                    match r {
                        Ok((crc, from_mem)) => {
                            if from_mem {
                                from_memory.fetch_add(len as u64, Ordering::Relaxed);
                            }
                            Ok((crc, len as u64))
                        }
                        Err(e) => Err(self.part_error(f, path, tmp, e)),
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
        let r = match failed {
            Some(e) => Err(e),
            None => tokio::task::block_in_place(|| self.finish_staging(f, &out, &tmp, &dest, root)),
        };
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r
    }

    /// The staging file `tmp` of `dest` created (its folder first), with
    /// O_DIRECT where the file system takes it (the bool), its blocks
    /// allocated at once.
    fn create_staging(&self, f: &LocalFile, dest: &FsPath, tmp: &FsPath) -> Result<(File, bool), TierError> {
        let parent = dest.parent().expect("an object is inside the root").to_path_buf();
        std::fs::create_dir_all(&parent).map_err(|e| self.target_io("create directory", &parent, e))?;
        let open = |direct: bool| {
            let mut o = File::options();
            o.write(true).create_new(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(tmp)
        };
        let (out, direct) = match open(true) {
            Ok(f) => (f, true),
            // A file system without O_DIRECT (tmpfs): buffered, synced at the end.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                (open(false).map_err(|e| self.target_io("create", tmp, e))?, false)
            }
            Err(e) => return Err(self.target_io("create", tmp, e)),
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
        Ok((out, direct))
    }

    /// A part that failed, as the upload's error: a short read is a local
    /// file that changed.
    fn part_error(&self, f: &LocalFile, path: &Path, tmp: &FsPath, e: PartError) -> TierError {
        match e {
            PartError::Read(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                self.changed(f, path, format!("shorter than the {} bytes of its index", f.len))
            }
            PartError::Read(e) => TierError::LocalIo {
                url: self.url.clone(),
                object: self.rel(path),
                path: f.local_path.clone(),
                source: e,
            },
            PartError::Write(e) => self.target_io("write", tmp, e),
        }
    }

    /// Every part in and checked: the staging file cut to its length,
    /// synced, renamed into place, and the new entry (and any folder
    /// created for it) made durable up to the root.
    fn finish_staging(
        &self,
        f: &LocalFile,
        out: &File,
        tmp: &FsPath,
        dest: &FsPath,
        root: &FsPath,
    ) -> Result<(), TierError> {
        out.set_len(f.len).map_err(|e| self.target_io("truncate", tmp, e))?;
        out.sync_data().map_err(|e| self.target_io("sync", tmp, e))?;
        std::fs::rename(tmp, dest).map_err(|e| self.target_io("rename", tmp, e))?;
        for dir in dest.ancestors().skip(1) {
            File::open(dir).and_then(|d| d.sync_all()).map_err(|e| self.target_io("sync", dir, e))?;
            if dir == root {
                break;
            }
        }
        Ok(())
    }

    fn target_io(&self, op: &'static str, p: &FsPath, e: std::io::Error) -> TierError {
        TierError::TargetIo { url: self.url.clone(), op, path: p.to_path_buf(), source: e }
    }

    /// Removes object_store's staging files (`<name>#<n>`) of one directory.
    pub(super) fn remove_staging_files(&self, dir: &FsPath) -> Result<usize, TierError> {
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

/// Why a part failed: reading it (the local file, or a buffer for it) or
/// writing it (the staging file).
enum PartError {
    Read(std::io::Error),
    Write(std::io::Error),
}

/// One part of a file:// upload, run on the blocking pool: bytes
/// `offset..offset + len` read (or taken from the holder's memory while it
/// lends them), their crc32c computed, written at the same offset of the
/// staging file.
struct PartJob {
    src: Arc<File>,
    /// `src` was opened with O_DIRECT: read whole blocks.
    src_direct: bool,
    out: Arc<File>,
    /// `out` was opened with O_DIRECT: write whole blocks.
    direct: bool,
    pool: BufPool,
    buf_len: usize,
    offset: u64,
    len: usize,
    held: Option<(Arc<dyn HeldBytes>, usize)>,
}

impl PartJob {
    /// The part's crc32c, and whether its bytes came from memory.
    fn run(self) -> Result<(u32, bool), PartError> {
        let PartJob { ref src, src_direct, ref out, direct, ref held, offset, len, .. } = self;
        let block = DIRECT_BLOCK_BYTES;
        let take_buf = || -> std::io::Result<AlignedBuf> {
            match self.pool.lock().expect("buffer pool").pop() {
                Some(b) if b.len() >= self.buf_len => Ok(b),
                _ => AlignedBuf::new(self.buf_len),
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
                    lent = Some(out.write_all_at(&m[..wlen], offset).map(|()| crc).map_err(PartError::Write));
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
        self.pool.lock().expect("buffer pool").push(buf);
        r
    }
}
