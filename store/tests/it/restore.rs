//! Reading back checkpoints whose shapes are at the edges of the format.

use ckpt_store::commit::{Store, StoreOptions};
use ckpt_store::format::Dtype;
use ckpt_store::image::{Layout, LayoutOptions, TensorSpec};
use ckpt_store::mem::AlignedBuf;
use ckpt_store::restore::{self, ReadOptions, Which};

/// Commits `specs` (bytes filled with a pattern) as `step`.
fn commit(dir: &std::path::Path, step: u64, specs: Vec<TensorSpec>) {
    commit_with_blobs(dir, step, specs, &[]);
}

fn commit_with_blobs(dir: &std::path::Path, step: u64, specs: Vec<TensorSpec>, blobs: &[ckpt_store::image::Blob<'_>]) {
    let layout = Layout::plan(specs, LayoutOptions::default()).unwrap();
    let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
    layout.write_headers(staging.as_mut_slice());
    for i in 0..layout.specs.len() {
        for (j, b) in staging.as_mut_slice()[layout.tensor_range(i)].iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(j as u8);
        }
    }
    let crcs = layout.tensor_crcs(staging.as_slice());
    let mut store = Store::open(StoreOptions::new(vec![dir.to_path_buf()])).unwrap();
    store.commit(step, &layout, &staging, &crcs, blobs).unwrap();
}

/// A shard holding only zero-byte tensors ends with its header: verify and
/// load must still close every tensor (they called it "only N of N bytes
/// checked" and refused a checkpoint they had committed).
#[test]
fn a_checkpoint_of_only_empty_tensors_verifies_and_loads() {
    let tmp = tempfile::tempdir().unwrap();
    commit(tmp.path(), 1, vec![TensorSpec::new("e", Dtype::F32, &[0]), TensorSpec::new("f", Dtype::BF16, &[0, 5])]);
    let opts = ReadOptions::default();
    let report = restore::verify(tmp.path(), 1, &opts, |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.tensors, 2);
    let loaded = restore::load(tmp.path(), Which::Step(1), &opts, None).unwrap();
    assert_eq!(loaded.tensor("e"), Some(&[][..]));
    assert_eq!(loaded.tensor("f"), Some(&[][..]));
}

/// Empty tensors beside one with bytes, first and last in file order.
#[test]
fn empty_tensors_around_a_full_one_verify_and_load() {
    let tmp = tempfile::tempdir().unwrap();
    commit(
        tmp.path(),
        2,
        vec![
            TensorSpec::new("a", Dtype::F32, &[0]),
            TensorSpec::new("b", Dtype::U8, &[3]),
            TensorSpec::new("c", Dtype::I64, &[2, 0]),
        ],
    );
    let opts = ReadOptions::default();
    let report = restore::verify(tmp.path(), 2, &opts, |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    let loaded = restore::load(tmp.path(), Which::Step(2), &opts, None).unwrap();
    assert_eq!(loaded.tensor("b"), Some(&[31u8, 32, 33][..]));
    assert_eq!(loaded.tensor("c"), Some(&[][..]));
}

/// A committed step whose Python skeleton names a tensor it lacks (written
/// before ranks' parts were checked at commit) does not load: `latest`
/// falls back past it saying why, `verify` names it, a load of it fails.
/// Before: it verified and loaded, and the Python load then raised
/// NotFound with no fallback.
#[test]
fn a_step_whose_skeleton_names_a_missing_tensor_is_passed_over_by_latest_saying_why() {
    use ckpt_store::image::Blob;
    use ckpt_store::skeleton::{minimal_skeleton, STRUCTURE_BLOB};
    let tmp = tempfile::tempdir().unwrap();
    let good = minimal_skeleton(&["a"]);
    let bad = minimal_skeleton(&["a", "only0"]);
    commit_with_blobs(
        tmp.path(),
        4,
        vec![TensorSpec::new("a", Dtype::F32, &[10])],
        &[Blob { name: STRUCTURE_BLOB, bytes: &good }],
    );
    commit_with_blobs(
        tmp.path(),
        5,
        vec![TensorSpec::new("a", Dtype::F32, &[10]), TensorSpec::new("only1", Dtype::F32, &[10])],
        &[Blob { name: STRUCTURE_BLOB, bytes: &bad }],
    );
    let opts = ReadOptions::default();
    let l = restore::load(tmp.path(), Which::Latest, &opts, None).unwrap();
    assert_eq!(l.step, 4);
    assert_eq!(l.fell_back.len(), 1, "{:?}", l.fell_back);
    assert_eq!(l.fell_back[0].0, 5);
    assert!(
        l.fell_back[0].1.contains("blobs/structure.pkl") && l.fell_back[0].1.contains("\"only0\""),
        "{}",
        l.fell_back[0].1
    );
    let report = restore::verify(tmp.path(), 5, &opts, |_, _| {}).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(restore::load(tmp.path(), Which::Step(5), &opts, None).is_err());
    assert!(restore::verify(tmp.path(), 4, &opts, |_, _| {}).unwrap().problems.is_empty());
}

/// A load into too little memory keeps the index it parsed (the
/// daemon's first load of a process answers "too small" and is retried
/// with more); the retry takes it and loads the step, and an index file
/// replaced since is not handed out.
#[test]
fn a_too_small_loads_index_is_kept_for_its_retry_only_while_its_file_is_unchanged() {
    use ckpt_store::restore::{KeptIndex, LoadError};
    let tmp = tempfile::tempdir().unwrap();
    commit(tmp.path(), 1, vec![TensorSpec::new("w", Dtype::F32, &[8192])]);
    let kept = std::sync::Arc::new(KeptIndex::default());
    let opts = ReadOptions { kept_index: Some(kept.clone()), ..Default::default() };
    let mut small = AlignedBuf::new(4096).unwrap();
    let need = match restore::load_into(tmp.path(), Which::Step(1), &opts, small.as_mut_slice()) {
        Err(LoadError::BufferTooSmall { need_bytes, .. }) => need_bytes,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("loaded into 4 KiB"),
    };
    assert_eq!(kept.with(tmp.path(), 1, |i| i.ckpt.step), Some(1));
    assert_eq!(kept.with(tmp.path(), 2, |i| i.ckpt.step), None, "another step");
    let mut big = AlignedBuf::new(need as usize).unwrap();
    let p = restore::load_into(tmp.path(), Which::Step(1), &opts, big.as_mut_slice()).unwrap();
    assert_eq!(p.step, 1);
    assert_eq!(kept.with(tmp.path(), 1, |_| ()), None, "taken by the retry");
    // Kept again, then the index replaced (same bytes, a new file).
    assert!(restore::load_into(tmp.path(), Which::Step(1), &opts, small.as_mut_slice()).is_err());
    let index = ckpt_store::catalog::step_path(tmp.path(), 1).join(ckpt_store::format::INDEX_FILE_NAME);
    let bytes = std::fs::read(&index).unwrap();
    let other = index.with_extension("new");
    std::fs::write(&other, bytes).unwrap();
    std::fs::rename(&other, &index).unwrap();
    assert_eq!(kept.with(tmp.path(), 1, |_| ()), None, "the file changed");
    let p = restore::load_into(tmp.path(), Which::Step(1), &opts, big.as_mut_slice()).unwrap();
    assert_eq!(p.step, 1);
}
