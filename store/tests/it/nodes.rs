//! Several nodes in one shared directory, as the coordinator and the parts
//! see it: each marker read once, the commit's retention left to its
//! caller, the outcome seen without a listing, and an incremental part
//! that compares with its own rank's marker instead of the whole index.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use ckpt_store::catalog;
use ckpt_store::commit::{IncrementalReport, Store, StoreOptions};
use ckpt_store::format::{self, Dtype, INDEX_FILE_NAME};
use ckpt_store::image::{Blob, Layout, LayoutOptions, TensorSpec};
use ckpt_store::nodes::{self, MarkersRead, RanksState};
use ckpt_store::restore::{self, ReadOptions, Which};
use ckpt_store::retention::Retention;
use ckpt_store::synthetic;

/// Rank `rank` of two: a frozen tensor alone in a stable shard and a
/// changing one, named after the rank.
fn part_layout(rank: u32) -> Layout {
    let (frozen, moving) = (format!("r{rank}.frozen"), format!("r{rank}.moving"));
    let specs = vec![TensorSpec::new(&frozen, Dtype::F32, &[1 << 14]), TensorSpec::new(&moving, Dtype::F32, &[256])];
    let changed: HashSet<String> = [moving].into();
    let opts = LayoutOptions { incremental: true, rank, world_size: 2, ..Default::default() };
    let l = Layout::plan_with(specs, opts, Some(&changed)).unwrap();
    assert!(l.shards[l.places[0].shard_idx].stable, "the test needs the frozen tensor in a stable shard");
    l
}

/// Writes rank `l.opts.rank`'s part of `step` (frozen tensor of seed 7, the
/// changing one of seed `step`); returns what it found.
fn write_part(store: &mut Store, l: &Layout, step: u64) -> Option<IncrementalReport> {
    write_part_report(store, l, step).incremental
}

fn write_part_report(store: &mut Store, l: &Layout, step: u64) -> nodes::PartReport {
    let (staging, crcs, digests) = crate::staged(l, &[7, step]);
    store.write_rank_part_with_digests(step, l, &staging, &crcs, &digests, &[], &[]).unwrap()
}

fn open(root: &Path, retention: Option<Retention>) -> (Store, PathBuf) {
    let shared = root.join("shared");
    fs::create_dir_all(&shared).unwrap();
    let opts = StoreOptions { retention, shared: Some(shared.clone()), ..StoreOptions::new(vec![root.join("own")]) };
    (Store::open(opts).unwrap(), shared.canonicalize().unwrap())
}

/// Damages a file in place (same length), so that it no longer parses.
fn damage(p: &Path) {
    use std::os::unix::fs::FileExt;
    let f = fs::File::options().write(true).open(p).unwrap();
    f.write_all_at(b"garbage!", 1).unwrap();
}

fn assert_loads(shared: &Path, step: u64) {
    let loaded = restore::load(shared, Which::Step(step), &ReadOptions::default(), None).unwrap();
    for rank in 0..2 {
        let l = part_layout(rank);
        for (i, seed) in [(0, 7), (1, step)] {
            let mut want = vec![0u8; l.tensor_range(i).len()];
            synthetic::fill(&mut want, seed);
            let name = &l.specs[i].name;
            assert!(loaded.tensor(name).unwrap() == &want[..], "step {step}: {name} is not the tensor saved");
        }
    }
}

/// The coordinator reads a marker once, when it first sees it: a marker
/// damaged after that look does not undo the commit, which reads no marker
/// again; the step loads.
#[test]
fn the_coordinator_reads_each_marker_once() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, shared) = open(tmp.path(), None);
    let (l0, l1) = (part_layout(0), part_layout(1));
    let mut read = MarkersRead::default();
    assert_eq!(store.read_new_markers(1, 2, &mut read).unwrap().unwrap(), vec![0, 1], "no marker yet");
    write_part(&mut store, &l0, 1);
    assert_eq!(store.read_new_markers(1, 2, &mut read).unwrap().unwrap(), vec![1]);
    let tmp_dir = nodes::ranks_tmp_path(&shared, 1).unwrap();
    damage(&tmp_dir.join(format::rank_marker_name(0)));
    write_part(&mut store, &l1, 1);
    assert_eq!(store.read_new_markers(1, 2, &mut read).unwrap().unwrap(), Vec::<u32>::new());
    assert_eq!(read.ranks().into_iter().collect::<Vec<_>>(), [0, 1]);
    store.commit_read_ranks(1, 2, read).unwrap();
    assert_loads(&shared, 1);
}

/// Markers sent by message (the report's bytes) are taken as their files
/// would be read: with both in, the commit needs no look at the folder,
/// and it commits even with both files damaged after they were sent.
#[test]
fn sent_markers_commit_without_reading_the_files() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, shared) = open(tmp.path(), None);
    let sent: Vec<_> = (0..2).map(|r| write_part_report(&mut store, &part_layout(r), 1).sent).collect();
    let tmp_dir = nodes::ranks_tmp_path(&shared, 1).unwrap();
    for r in 0..2 {
        damage(&tmp_dir.join(format::rank_marker_name(r)));
    }
    let mut read = MarkersRead::default();
    for m in &sent {
        assert!(store.take_sent_marker(1, 2, m.clone(), &mut read).unwrap(), "rank {} taken", m.rank);
    }
    assert!(!store.take_sent_marker(1, 2, sent[0].clone(), &mut read).unwrap(), "a rank is taken once");
    assert_eq!(read.n_sent(), 2);
    store.commit_read_ranks(1, 2, read).unwrap();
    assert_loads(&shared, 1);
}

/// A marker sent for an earlier attempt of the step (its temp folder since
/// removed and made again) is not taken, nor one beyond the world size,
/// nor one of a step whose folder is gone; a damaged one is refused.
#[test]
fn a_sent_marker_of_another_folder_or_rank_is_not_taken() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, _) = open(tmp.path(), None);
    let old = write_part_report(&mut store, &part_layout(1), 1).sent;
    assert!(store.abort_ranks(1, "test: the first attempt is given up").unwrap());
    let mut read = MarkersRead::default();
    assert!(!store.take_sent_marker(1, 2, old.clone(), &mut read).unwrap(), "no folder: not taken");
    // A second attempt: a new folder, likely of the same inode, born later
    // (file systems stamp times coarsely: let the clock move on).
    let born = |p: &Path| fs::metadata(p).unwrap().created().unwrap();
    let probe = tmp.path().join("probe");
    fs::create_dir(&probe).unwrap();
    while born(&probe) <= std::time::UNIX_EPOCH + std::time::Duration::from_nanos(old.folder.born_ns) {
        fs::remove_dir(&probe).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        fs::create_dir(&probe).unwrap();
    }
    let new = write_part_report(&mut store, &part_layout(0), 1).sent;
    let mut read = MarkersRead::default();
    assert_ne!(old.folder, new.folder);
    assert!(new.folder.born_ns > 0, "this test's file system gives birth times");
    assert!(!store.take_sent_marker(1, 2, old.clone(), &mut read).unwrap(), "an earlier attempt's marker is not taken");
    assert!(!read.has(1));
    let mut beyond = new.clone();
    beyond.rank = 5;
    assert!(!store.take_sent_marker(1, 2, beyond, &mut read).unwrap(), "a rank beyond the world size");
    let mut bad = new.clone();
    bad.marker[1] = b'!';
    assert!(store.take_sent_marker(1, 2, bad, &mut read).is_err(), "a damaged marker is refused");
    assert!(store.take_sent_marker(1, 2, new, &mut read).unwrap());
    assert_eq!(read.ranks().into_iter().collect::<Vec<_>>(), [0]);
}

/// A marker that does not read is the inner error (the coordinator aborts),
/// not a listing failure (it would try again).
#[test]
fn a_damaged_marker_is_refused_when_first_read() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, shared) = open(tmp.path(), None);
    write_part(&mut store, &part_layout(0), 1);
    damage(&nodes::ranks_tmp_path(&shared, 1).unwrap().join(format::rank_marker_name(0)));
    let mut read = MarkersRead::default();
    let r = store.read_new_markers(1, 2, &mut read).expect("the listing reads");
    assert!(r.is_err(), "a damaged marker is refused: {r:?}");
}

/// The commit itself applies no retention: the caller does once its ranks
/// are answered (`retain_shared`), and then the old steps go.
#[test]
fn retention_is_left_to_after_the_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, shared) = open(tmp.path(), Some(Retention { keep_last: 1, keep_every: None }));
    for step in 1..=2 {
        for rank in 0..2 {
            write_part(&mut store, &part_layout(rank), step);
        }
        let mut read = MarkersRead::default();
        assert!(store.read_new_markers(step, 2, &mut read).unwrap().unwrap().is_empty());
        let rep = store.commit_read_ranks(step, 2, read).unwrap();
        assert!(rep.deleted_by_retention.is_empty());
    }
    assert_eq!(catalog::readable_steps(&shared).unwrap(), [1, 2], "the commit deleted nothing");
    assert_eq!(store.retain_shared(2), [1]);
    assert_eq!(catalog::readable_steps(&shared).unwrap(), [2]);
    assert_loads(&shared, 2);
}

/// The other sidecars' look: two stats, whatever the rank count.
#[test]
fn the_outcome_is_seen_without_a_listing() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, shared) = open(tmp.path(), None);
    assert_eq!(nodes::ranks_outcome(&shared, 1).unwrap().0, RanksState::Gone);
    write_part(&mut store, &part_layout(0), 1);
    let (state, modified) = nodes::ranks_outcome(&shared, 1).unwrap();
    assert!(matches!(state, RanksState::InFlight(_)) && modified.is_some(), "{state:?} {modified:?}");
    write_part(&mut store, &part_layout(1), 1);
    store.commit_ranks(1, 2).unwrap();
    assert_eq!(nodes::ranks_outcome(&shared, 1).unwrap().0, RanksState::Committed);
    write_part(&mut store, &part_layout(0), 2);
    assert!(store.abort_ranks(2, "test").unwrap());
    assert_eq!(nodes::ranks_outcome(&shared, 2).unwrap().0, RanksState::Gone);
    assert_eq!(nodes::abort_reason(&shared, 2).as_deref(), Some("test"));
}

/// A rank's part written before the previous one is committed (its kept
/// part is then not of the newest committed step) compares with its own
/// rank's marker in the newest step's folder, not with the whole index
/// (damaged here: read, it would make the part write everything), and
/// links its unchanged shard from it.
#[test]
fn a_part_ahead_of_the_commit_compares_with_its_own_marker_not_the_index() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, shared) = open(tmp.path(), None);
    let (l0, l1) = (part_layout(0), part_layout(1));
    write_part(&mut store, &l0, 1);
    write_part(&mut store, &l1, 1);
    store.commit_ranks(1, 2).unwrap();
    damage(&catalog::step_path(&shared, 1).join(INDEX_FILE_NAME));
    assert!(restore::read_index(&shared, 1).is_err(), "the test needs an index that does not read");
    // Step 2's parts, not committed; step 3's rank 0 comes first.
    let r = write_part(&mut store, &l0, 2).unwrap();
    assert_eq!((r.prev_step, r.prev_kept, r.linked_files), (Some(1), true, 1));
    write_part(&mut store, &l1, 2);
    let r = write_part(&mut store, &l0, 3).unwrap();
    assert_eq!((r.prev_step, r.prev_kept, r.linked_files), (Some(1), false, 1), "rank 0's marker of step 1");
    let changed: Vec<String> = r.changed.unwrap().into_iter().collect();
    assert_eq!(changed, ["r0.moving"]);
    store.commit_ranks(2, 2).unwrap();
    assert_loads(&shared, 2);
}

/// Steps of the same parts, one after another (the coordinator reads the
/// markers by the shapes it kept and renders the index from its kept
/// merge): each loads, its index reads as any index does, and a blob with
/// the bytes of its namesake in the step the part compares with (a
/// skeleton) is linked from there, one that changed is written.
#[test]
fn steps_of_the_same_parts_commit_and_load_and_link_an_unchanged_blob() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    let (mut store, shared) = open(tmp.path(), None);
    let (l0, l1) = (part_layout(0), part_layout(1));
    let skeleton = vec![5u8; 10_000];
    for step in 1..=3u64 {
        let rng = format!("rng-{step}");
        let blobs = [Blob { name: "skeleton", bytes: &skeleton }, Blob { name: "rng", bytes: rng.as_bytes() }];
        let (staging, crcs, digests) = crate::staged(&l0, &[7, step]);
        store.write_rank_part_with_digests(step, &l0, &staging, &crcs, &digests, &blobs, &[]).unwrap();
        write_part(&mut store, &l1, step);
        store.commit_ranks(step, 2).unwrap();
        assert_loads(&shared, step);
        let index = restore::read_index(&shared, step).unwrap();
        assert_eq!((index.ckpt.step, index.ckpt.blobs.len()), (step, 2));
    }
    let ino = |step: u64, name: &str| {
        fs::metadata(catalog::step_path(&shared, step).join(format::BLOBS_DIR_NAME).join(name)).unwrap().ino()
    };
    assert_eq!(ino(2, "skeleton"), ino(1, "skeleton"), "linked");
    assert_eq!(ino(3, "skeleton"), ino(1, "skeleton"), "linked");
    assert_ne!(ino(2, "rng"), ino(1, "rng"), "written");
    let rng = fs::read(catalog::step_path(&shared, 3).join(format::BLOBS_DIR_NAME).join("rng")).unwrap();
    assert_eq!(rng, b"rng-3");
}

/// No shared file system (`nodes::over_peers`): nodes a and b each with a
/// shared directory of its own. Rank 1's part, written on b, reaches a's
/// coordinator as a `SentPart` (its blob written into a's temp folder and
/// synced with the others before the commit, its marker taken); a commits both, and b installs the step from a's step folder's
/// files: the same index and blobs under `step-…`, and `latest`. A step
/// sent with a wrong index, a missing or damaged blob, or a name outside
/// its folder is refused and leaves nothing committed.
#[test]
fn a_step_committed_over_peers_is_installed_in_each_nodes_own_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let node = |id: &str| {
        let (root, shared) = (tmp.path().join(id), tmp.path().join(id).join("shared"));
        fs::create_dir_all(&shared).unwrap();
        let node_local = Some(id.to_string());
        let opts =
            StoreOptions { shared: Some(shared.clone()), node_local, ..StoreOptions::new(vec![root.join("own")]) };
        (Store::open(opts).unwrap(), shared.canonicalize().unwrap())
    };
    let ((mut a, a_shared), (mut b, b_shared)) = (node("a"), node("b"));
    let (l0, l1) = (part_layout(0), part_layout(1));
    let step = 4;
    let (s0, c0, d0) = crate::staged(&l0, &[7, step]);
    let own = a.write_rank_part_with_digests(step, &l0, &s0, &c0, &d0, &[Blob { name: "rng-0", bytes: b"zero" }], &[]);
    let (s1, c1, d1) = crate::staged(&l1, &[7, step]);
    let blob1 = Blob { name: "rng-1", bytes: b"one" };
    let sent = b.write_rank_part_with_digests(step, &l1, &s1, &c1, &d1, &[blob1], &[]).unwrap().sent;
    let part = nodes::SentPart {
        rank: 1,
        marker: sent.marker,
        slices: sent.slices,
        blobs: vec![("rng-1".into(), b"one".to_vec())],
    };
    let mut read = MarkersRead::default();
    assert!(a.take_sent_marker(step, 2, own.unwrap().sent, &mut read).unwrap());
    let mut bad = part.clone();
    bad.blobs[0].0 = "../escape".into();
    assert!(a.take_sent_part(step, 2, bad, &mut read).is_err(), "a name that is not a blob's");
    assert!(!tmp.path().join("a/escape").exists());
    let (taken, written) = a.take_sent_part(step, 2, part, &mut read).unwrap();
    assert!(taken && written.iter().any(|p| p.ends_with("blobs/rng-1")), "{written:?}");
    nodes::sync_written(&written).unwrap();
    a.commit_read_ranks(step, 2, read).unwrap();
    let files = nodes::committed_files(&a_shared, step).unwrap();
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&INDEX_FILE_NAME) && names.contains(&"blobs/rng-0") && names.contains(&"blobs/rng-1"));

    let with = |name: &str, f: &dyn Fn(&mut Vec<u8>)| -> nodes::StepFiles {
        let mut v = files.clone();
        v.iter_mut().filter(|(n, _)| n == name).for_each(|(_, b)| f(b));
        v
    };
    let refused: [(&str, nodes::StepFiles); 4] = [
        ("a damaged blob", with("blobs/rng-1", &|b| b[0] ^= 1)),
        ("a missing blob", files.iter().filter(|(n, _)| n != "blobs/rng-0").cloned().collect()),
        ("a name outside its folder", [files.clone(), vec![("blobs/../../x".into(), vec![1])]].concat()),
        ("a damaged index", with(INDEX_FILE_NAME, &|b| b[10] ^= 1)),
    ];
    for (why, sent) in refused {
        assert!(b.install_committed(step, &sent).is_err(), "{why}");
        assert!(!catalog::is_committed(&b_shared, step), "{why}");
    }
    assert!(b.install_committed(step + 1, &files).is_err(), "an index of another step");
    assert!(b.install_committed(step, &files).unwrap());
    assert!(!b.install_committed(step, &files).unwrap(), "committed here already");
    assert_eq!(catalog::latest_step(&b_shared).unwrap(), Some(step));
    let mut installed = nodes::committed_files(&b_shared, step).unwrap();
    let mut want = files.clone();
    installed.sort();
    want.sort();
    assert_eq!(installed, want);
    // b's own marker of rank 1 stays beside them, as in a's folder.
    assert!(catalog::step_path(&b_shared, step).join(format::rank_marker_name(1)).exists());
    assert_eq!(nodes::ranks_outcome(&b_shared, step).unwrap().0, RanksState::Committed);
}
