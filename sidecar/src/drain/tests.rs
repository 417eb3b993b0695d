//! The drain against real targets (a `file://` directory, the tests' S3
//! server): what a remote step holds and that it loads, bit-equal.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ckpt_store::catalog;
use ckpt_store::format::{Index, INDEX_FILE_NAME};

use super::*;
use ckpt_store::commit::{Store, StoreOptions};
use ckpt_store::image::{Blob, Layout, LayoutOptions};
use ckpt_store::mem::AlignedBuf;
use ckpt_store::restore::{self, ReadOptions, Which};
use ckpt_store::synthetic;

/// Regression: the local index names secondary directories (absolute
/// paths of this node) and files in them (`dir_idx` 1); uploaded as is,
/// a reader of the remote step would look for those files on this
/// node's disks. The remote step must be a one-directory checkpoint.
#[test]
fn a_step_striped_over_two_dirs_drains_as_a_one_directory_checkpoint_that_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = vec![tmp.path().join("a"), tmp.path().join("b")];
    let mut store = Store::open(StoreOptions::new(dirs.clone())).unwrap();
    let layout = Layout::plan(
        synthetic::transformer_specs(4 << 20),
        LayoutOptions { n_dirs: 2, shard_bytes_max: 1 << 20, ..Default::default() },
    )
    .unwrap();
    let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
    let crcs = synthetic::stage(&layout, staging.as_mut_slice(), 3);
    store.commit(7, &layout, &staging, &crcs, &[Blob { name: "rng", bytes: b"seed" }]).unwrap();
    drop(store);
    let dirs: Vec<PathBuf> = dirs.iter().map(|d| d.canonicalize().unwrap()).collect();
    let index =
        Index::from_json_bytes(&std::fs::read(catalog::step_path(&dirs[0], 7).join(INDEX_FILE_NAME)).unwrap()).unwrap();
    assert!(index.ckpt.files.iter().any(|f| f.dir_idx == 1), "the test needs files on the secondary");
    let (files, remote_index) = remote_plan(&dirs, 7, index).unwrap();
    let remote = tmp.path().join("remote");
    let step_dir = catalog::step_path(&remote, 7);
    for f in &files {
        let bytes = std::fs::read(&f.local_path).unwrap();
        assert_eq!((bytes.len() as u64, crc32c::crc32c(&bytes)), (f.len, f.crc32c), "{}", f.name);
        let to = step_dir.join(&f.name);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(to, bytes).unwrap();
    }
    assert!(files.iter().any(|f| f.name == "blobs/rng"));
    std::fs::write(step_dir.join(INDEX_FILE_NAME), &remote_index).unwrap();
    let parsed = Index::from_json_bytes(&remote_index).unwrap();
    assert!(parsed.ckpt.secondary_dirs.is_empty() && parsed.ckpt.files.iter().all(|f| f.dir_idx == 0));
    let loaded = restore::load(&remote, Which::Step(7), &ReadOptions::default(), None).unwrap();
    assert_eq!(loaded.blobs["rng"], b"seed");
}

/// An incremental run of 3 steps (a frozen tensor in its own stable
/// shard, hard-linked locally, and a changing one), drained: the frozen
/// shard is uploaded once and copied on the target after. Every
/// remote step loads bit-equal, and after `--drain-keep 1` deleted the
/// older steps the newest still does.
fn incremental_drain_uploads_unchanged_shard_once(url: &str) {
    use ckpt_store::format::Dtype;
    use ckpt_store::image::TensorSpec;
    use std::collections::HashSet;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("local");
    let mut store = Store::open(StoreOptions::new(vec![dir.clone()])).unwrap();
    let dir = dir.canonicalize().unwrap();
    let specs =
        vec![TensorSpec::new("frozen", Dtype::F32, &[1 << 19]), TensorSpec::new("moving", Dtype::F32, &[1 << 12])];
    let changed: HashSet<String> = ["moving".to_string()].into();
    let layout =
        Layout::plan_with(specs, LayoutOptions { incremental: true, ..Default::default() }, Some(&changed)).unwrap();
    let frozen_shard = layout.shards[layout.places[0].shard_idx].clone();
    assert!(
        frozen_shard.stable && frozen_shard.tensors == vec![0],
        "the test needs the frozen tensor alone in a stable shard"
    );
    let opts = DrainOptions { url: url.to_string(), every: 1, keep: None, bandwidth_bytes_per_s: None };
    let drain = Drain::open(opts.clone(), vec![dir.clone()]).unwrap();
    let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
    let mut expected = Vec::new();
    for step in 1..=3u64 {
        let st = staging.as_mut_slice();
        layout.write_headers(st);
        synthetic::fill(&mut st[layout.tensor_range(0)], 42);
        synthetic::fill(&mut st[layout.tensor_range(1)], step);
        let crcs = layout.tensor_crcs(st);
        let digests: Vec<u128> =
            (0..2).map(|i| ckpt_store::digest::tensor_digest(&st[layout.tensor_range(i)])).collect();
        expected.push((st[layout.tensor_range(0)].to_vec(), st[layout.tensor_range(1)].to_vec()));
        store.commit_with_digests(step, &layout, &staging, &crcs, &digests, &[]).unwrap();
        if step > 1 {
            assert_eq!(
                store.take_incremental().unwrap().linked_files,
                1,
                "step {step}: the frozen shard is linked locally"
            );
        }
        assert_eq!(drain.drain_once(), Round::Moved, "step {step}");
    }
    let frozen_len = frozen_shard.file_len;
    let st = drain.lock();
    assert_eq!(st.replicated.iter().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
    assert_eq!(st.copied_bytes, 2 * frozen_len, "steps 2 and 3 copy the frozen shard on the target");
    let total: u64 = layout.shards.iter().map(|s| s.file_len).sum();
    assert_eq!(st.uploaded_bytes, 3 * total - 2 * frozen_len, "the frozen shard is uploaded once");
    drop(st);
    if let Some(root) = url.strip_prefix("file://") {
        use std::os::unix::fs::MetadataExt;
        // The copies are hard links within the target: one inode.
        let inos: Vec<u64> = (1..=3)
            .map(|s| {
                std::fs::metadata(catalog::step_path(Path::new(root), s).join(&frozen_shard.file_name)).unwrap().ino()
            })
            .collect();
        assert!(inos[0] == inos[1] && inos[1] == inos[2], "{inos:?}");
    }
    let check = |d: &Drain, step: u64| {
        let r = d.remote_copy(step).unwrap_or_else(|e| panic!("step {step}: {e:?}"));
        let loaded = match &r.from {
            RemoteFrom::Dir(dir) => restore::load(dir, Which::Step(step), &ReadOptions::default(), None).unwrap(),
            RemoteFrom::Stream(rs) => ckpt_store::fetch::load_remote(&rs.index_bytes, step, rs).unwrap(),
        };
        let (frozen, moving) = &expected[step as usize - 1];
        assert!(
            loaded.tensor("frozen").unwrap() == &frozen[..] && loaded.tensor("moving").unwrap() == &moving[..],
            "step {step} differs"
        );
    };
    for step in 1..=3 {
        check(&drain, step);
    }
    let keep1 = Drain::open(DrainOptions { keep: Some(1), ..opts }, vec![dir.clone()]).unwrap();
    keep1.retain_remote();
    assert_eq!(keep1.target.steps().unwrap(), vec![3]);
    check(&keep1, 3);
}

#[test]
fn incremental_drain_to_file_target_uploads_unchanged_shard_once() {
    let remote = tempfile::tempdir().unwrap();
    incremental_drain_uploads_unchanged_shard_once(&format!("file://{}", remote.path().display()));
}

#[test]
fn incremental_drain_to_s3_uploads_unchanged_shard_once() {
    let server = ckpt_test_support::s3::S3Server::shared();
    incremental_drain_uploads_unchanged_shard_once(&server.url("incremental-drain"));
}

/// A step committed from a staging lease and resident there, as the
/// committer leaves it; `flip` flips a byte of the first shard's image
/// in staging after the commit (the disk holds the committed bytes).
fn resident_step(dir: &Path, staging: &Arc<crate::memory::staging::Staging>, step: u64, flip: bool) -> Layout {
    let mut store = Store::open(StoreOptions::new(vec![dir.to_path_buf()])).unwrap();
    store.register_staging(staging.buf());
    let layout = Layout::plan(
        synthetic::transformer_specs(12 << 20),
        LayoutOptions { shard_bytes_max: 4 << 20, ..Default::default() },
    )
    .unwrap();
    let (mut lease, _) = staging.acquire(layout.staging_len, "test", || Some("must not wait")).unwrap();
    let crcs = synthetic::stage(&layout, lease.as_mut_slice(), step);
    let mut placed = layout.clone();
    placed.rebase(lease.offset_bytes());
    store.commit(step, &placed, lease.staging_buf(), &crcs, &[Blob { name: "rng", bytes: b"seed" }]).unwrap();
    if flip {
        let at = layout.shards[0].staging_offset as usize + 100;
        lease.as_mut_slice()[at] ^= 0x08;
    }
    let blobs = vec![ckpt_wire::Blob { name: "rng".into(), bytes: b"seed".to_vec() }];
    staging.offer_resident(crate::memory::staging::Resident {
        step,
        layout: layout.clone(),
        crcs,
        digests: None,
        blobs,
        lease,
        origin: std::sync::Weak::<()>::new(),
    });
    layout
}

fn assert_remote_equals_local(remote: &Path, local: &Path, step: u64) {
    let (r, l) = (catalog::step_path(remote, step), catalog::step_path(local, step));
    let index = Index::from_json_bytes(&std::fs::read(l.join(INDEX_FILE_NAME)).unwrap()).unwrap();
    for f in &index.ckpt.files {
        assert!(
            std::fs::read(r.join(&f.name)).unwrap() == std::fs::read(l.join(&f.name)).unwrap(),
            "{} differs",
            f.name
        );
    }
    restore::verify(remote, step, &ReadOptions::default(), |_, _| {}).unwrap();
}

/// A step committed into `TMP/local` and left resident in a staging
/// (its first shard's image flipped if `flip`), and a drain to
/// `file://TMP/remote` lent that staging.
fn drain_of_resident_step(
    step: u64,
    flip: bool,
) -> (tempfile::TempDir, Arc<crate::memory::staging::Staging>, Layout, Arc<Drain>) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("local");
    let staging = crate::memory::staging::Staging::new(32 << 20).unwrap();
    let layout = resident_step(&dir, &staging, step, flip);
    let dir = dir.canonicalize().unwrap();
    let remote = tmp.path().join("remote");
    std::fs::create_dir(&remote).unwrap();
    let drain = Drain::open(
        DrainOptions { url: format!("file://{}", remote.display()), every: 1, keep: None, bandwidth_bytes_per_s: None },
        vec![dir],
    )
    .unwrap();
    drain.use_staging(staging.clone());
    (tmp, staging, layout, drain)
}

/// A step still resident in staging right
/// after its commit is uploaded from there, not read back from disk;
/// the remote files equal the committed ones.
#[test]
fn a_resident_step_drains_from_staging_memory() {
    let (tmp, staging, layout, drain) = drain_of_resident_step(4, false);
    let (dir, remote) = (tmp.path().join("local").canonicalize().unwrap(), tmp.path().join("remote"));
    assert_eq!(drain.drain_once(), Round::Moved);
    let shards: u64 = layout.shards.iter().map(|s| s.file_len).sum();
    let st = drain.lock();
    assert_eq!(st.replicated.iter().copied().collect::<Vec<_>>(), vec![4]);
    assert_eq!(st.from_memory_bytes, shards, "every shard from staging (the blob from disk)");
    drop(st);
    assert_remote_equals_local(&remote, &dir, 4);
    assert_eq!(staging.resident_step(), Some(4), "the loan ended; the image stays resident");
}

/// The crc32c is checked on the bytes taken from staging too: an image
/// that differs from the committed file (a flipped byte) is not
/// uploaded; that file is read from disk instead, and the remote step
/// is the committed one.
#[test]
fn a_resident_image_that_differs_from_its_files_drains_from_disk() {
    let (tmp, _staging, layout, drain) = drain_of_resident_step(6, true);
    let (dir, remote) = (tmp.path().join("local").canonicalize().unwrap(), tmp.path().join("remote"));
    assert_eq!(drain.drain_once(), Round::Moved);
    let shards: u64 = layout.shards.iter().map(|s| s.file_len).sum();
    assert_eq!(drain.lock().from_memory_bytes, shards - layout.shards[0].file_len, "the differing shard from disk");
    assert_remote_equals_local(&remote, &dir, 6);
}

/// A committed step whose file on disk no longer matches its index (a
/// flipped byte, found by the upload's read-back) is damage of the step,
/// not a failure of the target: it is told to the damage sink once and
/// passed over (retrying cannot mend it), the target stays up, and the
/// next step committed drains.
#[test]
fn a_step_damaged_on_disk_is_passed_over_once_and_the_next_step_drains() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("local");
    let mut store = Store::open(StoreOptions::new(vec![dir.clone()])).unwrap();
    let dir = dir.canonicalize().unwrap();
    let layout = Layout::plan(synthetic::transformer_specs(2 << 20), LayoutOptions::default()).unwrap();
    let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
    let mut commit = |store: &mut Store, step: u64| {
        let crcs = synthetic::stage(&layout, staging.as_mut_slice(), step);
        store.commit(step, &layout, &staging, &crcs, &[]).unwrap();
    };
    commit(&mut store, 1);
    let index =
        Index::from_json_bytes(&std::fs::read(catalog::step_path(&dir, 1).join(INDEX_FILE_NAME)).unwrap()).unwrap();
    let shard = catalog::step_path(&dir, 1).join(&index.ckpt.files[0].name);
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x10;
    std::fs::write(&shard, &bytes).unwrap();
    let remote = tmp.path().join("remote");
    std::fs::create_dir(&remote).unwrap();
    let drain = Drain::open(
        DrainOptions { url: format!("file://{}", remote.display()), every: 1, keep: None, bandwidth_bytes_per_s: None },
        vec![dir.clone()],
    )
    .unwrap();
    let told = Arc::new(AtomicUsize::new(0));
    let t = told.clone();
    drain.on_damage(Box::new(move |step, file, _| {
        assert_eq!(step, 1, "{file}");
        t.fetch_add(1, Ordering::SeqCst);
    }));
    assert_eq!(drain.drain_once(), Round::Moved, "a damaged step is passed over, not the target's failure");
    assert_eq!(drain.drain_once(), Round::Idle, "and not tried again");
    assert_eq!(told.load(Ordering::SeqCst), 1);
    {
        let st = drain.lock();
        assert!(st.up && st.upload_failures == 0, "the target is not at fault: {}", st.error);
        assert!(st.replicated.is_empty() && st.damaged.contains_key(&1), "{:?}", st.damaged);
    }
    assert!(!catalog::is_committed(&remote, 1), "no remote step of the damaged one");
    commit(&mut store, 2);
    assert_eq!(drain.drain_once(), Round::Moved);
    assert_eq!(drain.lock().replicated.iter().copied().collect::<Vec<_>>(), vec![2]);
    assert_remote_equals_local(&remote, &dir, 2);
}
