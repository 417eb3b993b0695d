//! Incremental commits compare with the newest committed step: kept in
//! memory from the commit that wrote it, or read back from disk whenever
//! the directory may hold another newest step than the one remembered (a
//! rollback, retention, another process's commit). Each case loads what
//! was saved.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use ckpt_store::catalog;
use ckpt_store::commit::{IncrementalReport, Store, StoreOptions};
use ckpt_store::format::{Dtype, INDEX_FILE_NAME};
use ckpt_store::image::{Blob, Layout, LayoutOptions, TensorSpec};
use ckpt_store::restore::{self, ReadOptions, Which};
use ckpt_store::retention::Retention;
use ckpt_store::synthetic;

/// A layout of a frozen tensor alone in a stable shard and a changing one.
fn layout() -> Layout {
    let specs =
        vec![TensorSpec::new("frozen", Dtype::F32, &[1 << 16]), TensorSpec::new("moving", Dtype::F32, &[1 << 10])];
    let changed: HashSet<String> = ["moving".to_string()].into();
    let l =
        Layout::plan_with(specs, LayoutOptions { incremental: true, ..Default::default() }, Some(&changed)).unwrap();
    let sh = &l.shards[l.places[0].shard_idx];
    assert!(sh.stable && sh.tensors == vec![0], "the test needs the frozen tensor alone in a stable shard");
    l
}

/// Commits `step` with the frozen tensor filled from seed `frozen` and the
/// changing one from `moving`; returns what the commit found.
fn save(store: &mut Store, l: &Layout, step: u64, frozen: u64, moving: u64) -> IncrementalReport {
    commit(store, l, step, &[frozen, moving], &[])
}

/// Commits `step` of layout `l`, tensor `i` filled from seed `seeds[i]`,
/// with `blobs`; returns what the commit found.
fn commit(store: &mut Store, l: &Layout, step: u64, seeds: &[u64], blobs: &[Blob<'_>]) -> IncrementalReport {
    let (staging, crcs, digests) = crate::staged(l, seeds);
    store.commit_with_digests(step, l, &staging, &crcs, &digests, blobs).unwrap();
    store.take_incremental().expect("an incremental commit reports")
}

/// Step `step` of `dir` loads with the tensors of seeds `frozen` and `moving`.
fn assert_loads(dir: &Path, l: &Layout, step: u64, frozen: u64, moving: u64) {
    assert_tensors(dir, l, step, &[frozen, moving]);
}

/// Step `step` of `dir` loads with `l`'s tensor `i` of seed `seeds[i]`.
fn assert_tensors(dir: &Path, l: &Layout, step: u64, seeds: &[u64]) {
    let loaded = restore::load(dir, Which::Step(step), &ReadOptions::default(), None).unwrap();
    for (i, &seed) in seeds.iter().enumerate() {
        let name = &l.specs[i].name;
        let mut want = vec![0u8; l.tensor_range(i).len()];
        synthetic::fill(&mut want, seed);
        assert!(loaded.tensor(name).unwrap() == &want[..], "step {step}: {name} is not the tensor saved");
    }
}

fn open(dir: &Path, retention: Option<Retention>) -> (Store, PathBuf) {
    let store = Store::open(StoreOptions { retention, ..StoreOptions::new(vec![dir.to_path_buf()]) }).unwrap();
    let dir = dir.canonicalize().unwrap();
    (store, dir)
}

/// The step a store just committed is compared with from memory: its index
/// on disk, made unreadable in place (same file, length, last bytes and
/// modification time), is not read, and the frozen shard is still linked.
#[test]
fn the_next_commit_compares_with_the_step_kept_in_memory_without_reading_its_index() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, dir) = open(&tmp.path().join("d"), None);
    let l = layout();
    let first = save(&mut store, &l, 1, 7, 1);
    assert_eq!((first.prev_step, first.prev_kept), (None, false));
    let index = catalog::step_path(&dir, 1).join(INDEX_FILE_NAME);
    let mtime = std::fs::metadata(&index).unwrap().modified().unwrap();
    let f = std::fs::File::options().write(true).open(&index).unwrap();
    f.write_all_at(b"garbage!", 1).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    assert!(restore::read_index(&dir, 1).is_err(), "the test needs an index that does not read");
    let r = save(&mut store, &l, 2, 7, 2);
    assert_eq!((r.prev_step, r.prev_kept, r.linked_files), (Some(1), true, 1));
    assert_eq!(r.changed, Some(["moving".to_string()].into()));
    assert_loads(&dir, &l, 2, 7, 2);
    let r = save(&mut store, &l, 3, 7, 3);
    assert_eq!((r.prev_step, r.prev_kept, r.linked_files), (Some(2), true, 1));
    assert_loads(&dir, &l, 3, 7, 3);
}

/// After a rollback the step compared with is the one rolled back to,
/// read from disk; the commit after that is kept again.
#[test]
fn a_commit_after_a_rollback_compares_with_the_step_rolled_back_to() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, dir) = open(&tmp.path().join("d"), None);
    let l = layout();
    save(&mut store, &l, 1, 7, 1);
    save(&mut store, &l, 2, 8, 2);
    store.rollback(1).unwrap();
    let r = save(&mut store, &l, 3, 8, 3);
    assert_eq!((r.prev_step, r.prev_kept, r.linked_files), (Some(1), false, 0));
    assert_loads(&dir, &l, 3, 8, 3);
    let r = save(&mut store, &l, 4, 8, 4);
    assert_eq!((r.prev_step, r.prev_kept, r.linked_files), (Some(3), true, 1));
    assert_loads(&dir, &l, 4, 8, 4);
}

/// A step committed below the newest and deleted by retention right away
/// is not compared with: the newest readable step is, read from disk.
#[test]
fn a_commit_after_retention_deleted_the_remembered_step_compares_with_the_newest_on_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, dir) = open(&tmp.path().join("d"), Some(Retention { keep_last: 1, keep_every: None }));
    let l = layout();
    save(&mut store, &l, 10, 7, 1);
    save(&mut store, &l, 5, 8, 2);
    assert_eq!(catalog::readable_steps(&dir).unwrap(), vec![10], "the test needs step 5 deleted by retention");
    let r = save(&mut store, &l, 11, 8, 3);
    assert_eq!((r.prev_step, r.prev_kept, r.linked_files), (Some(10), false, 0));
    assert_loads(&dir, &l, 11, 8, 3);
}

/// Another process rolled the directory back and committed the remembered
/// step's number again with other bytes: the next commit compares with
/// that step as it is on disk, so the frozen tensor (other bytes there) is
/// written, not linked from the other process's file.
#[test]
fn a_step_of_the_remembered_number_committed_by_another_process_is_read_again() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, dir) = open(&tmp.path().join("d"), None);
    let l = layout();
    save(&mut store, &l, 1, 7, 1);
    save(&mut store, &l, 2, 8, 2);
    // The other process: this one's locks let go, as after a restart.
    drop(store.take_locks());
    let (mut other, _) = open(&dir, None);
    other.rollback(1).unwrap();
    save(&mut other, &l, 2, 9, 3);
    drop(other);
    let r = save(&mut store, &l, 3, 8, 4);
    assert_eq!((r.prev_step, r.prev_kept, r.linked_files), (Some(2), false, 0));
    assert_loads(&dir, &l, 3, 8, 4);
}

/// The kept step is looked up by position while the tensors come in the
/// same order, and by name otherwise: the same tensors planned in another
/// order (a state whose keys were reordered) still link the frozen shard
/// and compare every tensor, and a tensor renamed counts as new.
#[test]
fn a_kept_step_finds_its_tensors_by_name_when_the_next_layout_orders_them_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, dir) = open(&tmp.path().join("d"), None);
    let l = layout();
    save(&mut store, &l, 1, 7, 1);
    let plan = |names: [&str; 2], sizes: [u64; 2]| {
        let specs = names.into_iter().zip(sizes).map(|(n, s)| TensorSpec::new(n, Dtype::F32, &[s])).collect();
        let changed: HashSet<String> = ["moving".to_string()].into();
        Layout::plan_with(specs, LayoutOptions { incremental: true, ..Default::default() }, Some(&changed)).unwrap()
    };
    // "moving" first, "frozen" second: positions differ from the kept step's.
    let swapped = plan(["moving", "frozen"], [1 << 10, 1 << 16]);
    let r = commit(&mut store, &swapped, 2, &[2, 7], &[]);
    assert_eq!((r.prev_step, r.prev_kept, r.linked_files), (Some(1), true, 1));
    assert_eq!(r.changed, Some(["moving".to_string()].into()), "only the moving tensor changed");
    assert_tensors(&dir, &swapped, 2, &[2, 7]);
    // The frozen bytes under a new name: new, so changed and written; the
    // moving tensor holds step 2's bytes again: unchanged.
    let renamed = plan(["frozen2", "moving"], [1 << 16, 1 << 10]);
    let r = commit(&mut store, &renamed, 3, &[7, 2], &[]);
    assert_eq!((r.prev_step, r.prev_kept, r.linked_files), (Some(2), true, 0));
    assert_eq!(r.changed, Some(["frozen2".to_string()].into()));
}

/// A blob holding the very bytes of its namesake in the step compared
/// with is linked (the same file), a changed one written anew; every step
/// reads back its own blobs.
#[test]
fn an_unchanged_blob_is_linked_from_the_step_before_and_a_changed_one_written() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, dir) = open(&tmp.path().join("d"), None);
    let l = layout();
    let skeleton = vec![7u8; 100_000];
    let commit = |store: &mut Store, step: u64, rng: &[u8]| {
        let blobs = [Blob { name: "structure.pkl", bytes: &skeleton }, Blob { name: "rng", bytes: rng }];
        commit(store, &l, step, &[7, step], &blobs);
    };
    let inode = |step: u64, name: &str| {
        let p = catalog::step_path(&dir, step).join(ckpt_store::format::BLOBS_DIR_NAME).join(name);
        std::fs::metadata(p).unwrap().ino()
    };
    commit(&mut store, 1, b"rng-1");
    commit(&mut store, 2, b"rng-2");
    assert_eq!(inode(1, "structure.pkl"), inode(2, "structure.pkl"), "the unchanged blob is the same file");
    assert_ne!(inode(1, "rng"), inode(2, "rng"), "a changed blob of the same length is written anew");
    for (step, rng) in [(1, &b"rng-1"[..]), (2, b"rng-2")] {
        let loaded = restore::load(&dir, Which::Step(step), &ReadOptions::default(), None).unwrap();
        assert_eq!(loaded.blobs["structure.pkl"], skeleton, "step {step}");
        assert_eq!(loaded.blobs["rng"], rng, "step {step}");
    }
    // Without incremental comparison (link_unchanged off) nothing is linked.
    store.set_link_unchanged(false);
    commit(&mut store, 3, b"rng-3");
    assert_ne!(inode(2, "structure.pkl"), inode(3, "structure.pkl"));
}
