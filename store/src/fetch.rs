//! Loading a step whose files are (partly) not in this node's directories:
//! streamed from a drain target straight into the load's destination, with
//! the very checks of a local load ([`crate::restore::FileCheck`]: header
//! against the index, every tensor's crc32c as its bytes arrive, the file's
//! crc32c, every blob, the Python skeleton), and no local copy.
//!
//! The engine stays free of networking: the caller gives a [`FetchFiles`]
//! (the sidecar wraps `ckpt-tier`'s `Target`). A load reads the files this
//! node holds in its directories as a local load does and fetches the rest
//! ([`crate::restore::load_into_raw_with`]), or fetches every file of a
//! step only the target holds ([`load_remote_into_raw`]).
//!
//! Invariants: as `restore`'s: nothing is handed out before its checksum
//! matched; a fetched file is checked piece by piece in file order as the
//! source hands it over, while it is already in the destination.

use std::time::Instant;

use crate::mem::AlignedBuf;
use crate::restore::fetched::{label_path, verifies_when_fetched_again};
pub use crate::restore::FetchFiles;
pub use crate::restore::SourceError;
use crate::restore::{self, LoadError, Loaded, OwnMemory, Placed, ReadDest, ReadOptions};
use crate::source;

/// Loads step `step` that only `src` holds (its index bytes `index_bytes`,
/// as the source gave them: parsed and checked as a local load does) into
/// memory at `dest`: every file fetched straight into its place there and
/// checked as it arrives; nothing is written to any directory.
///
/// # Safety
/// As [`restore::load_into_raw`]: `dest` block-aligned and valid for
/// `dest_len` bytes for the whole call, or faulting only inside `guard.run`
/// in a way it handles.
pub unsafe fn load_remote_into_raw(
    index_bytes: &[u8],
    step: u64,
    src: &dyn FetchFiles,
    dest: *mut u8,
    dest_len: usize,
    guard: &dyn ReadDest,
) -> Result<Placed, LoadError> {
    assert_eq!(dest as usize % crate::config::DIRECT_ALIGN_BYTES, 0, "load destination must be block-aligned");
    let t0 = Instant::now();
    let index = source::parse_index(index_bytes, step).map_err(|p| LoadError::Damaged {
        dir: label_path(src),
        step,
        problems: vec![p],
    })?;
    let need_bytes = restore::load_len_bytes(&index);
    if need_bytes > dest_len as u64 {
        return Err(LoadError::BufferTooSmall { step, need_bytes, have_bytes: dest_len as u64 });
    }
    // SAFETY: dest is block-aligned and valid for need_bytes (this
    // function's contract, checked against need_bytes above).
    match unsafe { restore::read_step_at(restore::Origin::Remote(src), step, index, &ReadOptions::default(), dest, t0, guard) } {
        // A checksum failed in memory someone else writes: the step is
        // damaged only if its files also fail when fetched on their own.
        Err(LoadError::Damaged { problems, .. }) if guard.foreign() && {
            let names: std::collections::BTreeSet<String> = problems.iter().filter_map(|p| p.file.clone()).collect();
            let names: Vec<String> = names.into_iter().collect();
            let index = source::parse_index(index_bytes, step).expect("parsed above");
            !names.is_empty() && verifies_when_fetched_again(&index, &names, src)
        } =>
        {
            Err(LoadError::Destination {
                step,
                why: "its bytes changed in the destination while they were fetched and checked there (written by its owner?); the checkpoint itself verifies".into(),
            })
        }
        r => r,
    }
}

/// [`load_remote_into_raw`] into a slice of the caller's.
pub fn load_remote_into(
    index_bytes: &[u8],
    step: u64,
    src: &dyn FetchFiles,
    dest: &mut [u8],
) -> Result<Placed, LoadError> {
    // SAFETY: dest is a live, exclusively borrowed slice of dest.len()
    // bytes, untouched by anything else until this returns.
    unsafe { load_remote_into_raw(index_bytes, step, src, dest.as_mut_ptr(), dest.len(), &OwnMemory) }
}

/// [`load_remote_into`] into memory of its own.
pub fn load_remote(index_bytes: &[u8], step: u64, src: &dyn FetchFiles) -> Result<Loaded, LoadError> {
    let index = source::parse_index(index_bytes, step).map_err(|p| LoadError::Damaged {
        dir: label_path(src),
        step,
        problems: vec![p],
    })?;
    let need = restore::load_len_bytes(&index) as usize;
    let mut buf = AlignedBuf::new(need.max(1)).map_err(|e| LoadError::Io {
        path: label_path(src),
        what: "allocate load buffer",
        source: e,
    })?;
    let placed = load_remote_into(index_bytes, step, src, buf.as_mut_slice())?;
    Ok(Loaded::new(placed, buf))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;
    use crate::commit::{Store, StoreOptions};
    use crate::format::Index;
    use crate::format::INDEX_FILE_NAME;
    use crate::image::{Blob, Layout, LayoutOptions};
    use crate::restore::Which;
    use crate::synthetic;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A step folder read as a drain target would give it: whole files in
    /// small pieces (tensor boundaries fall inside pieces), counting bytes.
    struct Folder {
        dir: PathBuf,
        fetched_bytes: AtomicU64,
    }

    impl FetchFiles for Folder {
        fn label(&self) -> &str {
            "test://remote"
        }
        fn parallel(&self) -> usize {
            3
        }
        fn fetch(&self, name: &str, dst: &mut [u8], feed: &mut dyn FnMut(&[u8])) -> Result<(), SourceError> {
            let bytes =
                std::fs::read(self.dir.join(name)).map_err(|e| SourceError::Failed(format!("{name}: {e}").into()))?;
            if bytes.len() != dst.len() {
                return Err(SourceError::WrongLength {
                    at: self.label().to_string(),
                    object: name.to_string(),
                    expected_bytes: dst.len() as u64,
                    size_bytes: bytes.len() as u64,
                });
            }
            for (d, s) in dst.chunks_mut(1000).zip(bytes.chunks(1000)) {
                d.copy_from_slice(s);
                feed(d);
            }
            self.fetched_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            Ok(())
        }
    }

    fn committed_step(root: &std::path::Path) -> (PathBuf, Vec<u8>) {
        let dir = root.join("ck");
        let mut store = Store::open(StoreOptions::new(vec![dir.clone()])).unwrap();
        let layout = Layout::plan(
            synthetic::transformer_specs(2 << 20),
            LayoutOptions { shard_bytes_max: 512 << 10, ..Default::default() },
        )
        .unwrap();
        let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
        let crcs = synthetic::stage(&layout, staging.as_mut_slice(), 5);
        store.commit(5, &layout, &staging, &crcs, &[Blob { name: "rng", bytes: b"seed" }]).unwrap();
        let step_dir = catalog::step_path(&dir, 5);
        let index_bytes = std::fs::read(step_dir.join(INDEX_FILE_NAME)).unwrap();
        (dir, index_bytes)
    }

    #[test]
    fn a_streamed_remote_step_loads_bit_equal_to_a_local_load_fetching_every_byte_once() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, index_bytes) = committed_step(tmp.path());
        let src = Folder { dir: catalog::step_path(&dir, 5), fetched_bytes: AtomicU64::new(0) };
        let got = load_remote(&index_bytes, 5, &src).unwrap();
        let want = restore::load(&dir, Which::Step(5), &ReadOptions::default(), None).unwrap();
        assert!(got.index.ckpt.files.len() > 3, "the test needs several files fetched side by side");
        for name in want.index.ckpt.tensors.keys() {
            assert!(got.tensor(name) == want.tensor(name), "tensor {name} differs");
        }
        assert_eq!(got.blobs["rng"], b"seed");
        let shard_bytes: u64 = want.index.ckpt.files.iter().map(|f| f.len_bytes).sum();
        assert_eq!(src.fetched_bytes.load(Ordering::Relaxed), shard_bytes + 4);
    }

    #[test]
    fn a_flipped_byte_in_a_streamed_file_is_damage_naming_the_source_file_and_tensor() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, index_bytes) = committed_step(tmp.path());
        let step_dir = catalog::step_path(&dir, 5);
        let index = Index::from_json_bytes(&index_bytes).unwrap();
        let f = index.ckpt.files.iter().max_by_key(|f| f.len_bytes).unwrap();
        let path = step_dir.join(&f.name);
        let mut raw = std::fs::read(&path).unwrap();
        let at = raw.len() - 100;
        raw[at] ^= 0x40;
        std::fs::write(&path, &raw).unwrap();
        let src = Folder { dir: step_dir, fetched_bytes: AtomicU64::new(0) };
        match load_remote(&index_bytes, 5, &src) {
            Err(e @ LoadError::Damaged { .. }) => {
                let said = e.to_string();
                assert!(
                    said.starts_with("test://remote: step 5 is damaged")
                        && said.contains(&f.name)
                        && said.contains("checksum mismatch"),
                    "{said}"
                );
            }
            Err(e) => panic!("not damage: {e}"),
            Ok(_) => panic!("a flipped byte loaded"),
        }
        // A file of another length: damage naming it, nothing loaded.
        std::fs::write(&path, &raw[..at]).unwrap();
        let err = load_remote(&index_bytes, 5, &src).err().expect("a short file loaded");
        assert!(matches!(err, LoadError::Damaged { .. }) && err.to_string().contains(&f.name), "{err}");
    }
}
