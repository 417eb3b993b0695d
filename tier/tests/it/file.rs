//! The tier against a file:// target (a temporary directory).

use crate::common::*;
use ckpt_tier::{Target, TargetOptions};

#[test]
fn file_round_trip() {
    let (local, remote) = (tempdir(), tempdir());
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    round_trip(&t, local.path());
    // The target is an ordinary checkpoint directory.
    assert_eq!(ckpt_store::catalog::committed_steps(remote.path()).unwrap(), vec![1]);
}

#[test]
fn file_target_is_a_checkpoint_directory() {
    let (local, remote) = (tempdir(), tempdir());
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    let s = local_step(local.path(), 7, 100_000);
    t.upload_step(7, &s.files, &s.index_json).unwrap();
    assert_eq!(ckpt_store::catalog::latest_step(remote.path()).unwrap(), Some(7));
    for (name, data) in &s.bytes {
        let p = remote.path().join("step-000000000007").join(name);
        assert!(std::fs::read(&p).unwrap() == *data, "{}", p.display());
    }
}

#[test]
fn file_half_upload_is_not_a_step_and_is_cleaned() {
    let (local, remote) = (tempdir(), tempdir());
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    half_upload_is_cleaned(&t, local.path());
    assert!(!remote.path().join("step-000000000003").exists());
}

#[test]
fn file_staging_leftovers_are_cleaned() {
    // object_store's staged file of an upload cut short inside a committed step.
    let (local, remote) = (tempdir(), tempdir());
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    let s = local_step(local.path(), 5, 1000);
    t.upload_step(5, &s.files, &s.index_json).unwrap();
    let leftover = remote.path().join("step-000000000005").join(format!("{}#1", s.files[0].name));
    std::fs::write(&leftover, b"half").unwrap();
    assert_eq!(t.clean_incomplete().unwrap(), 1);
    assert!(!leftover.exists());
    assert_eq!(t.steps().unwrap(), vec![5]);
}

#[test]
fn file_flipped_byte_is_refused() {
    let (local, remote) = (tempdir(), tempdir());
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    flipped_byte_is_refused(&t, local.path());
}

#[test]
fn file_bandwidth_limit_still_uploads_everything() {
    // The limit is exercised (parts wait on the bucket); no timing asserted.
    let (local, remote) = (tempdir(), tempdir());
    let opts = TargetOptions { bandwidth_bytes_per_s: Some(200 << 20), ..small_parts() };
    let t = Target::open(&file_url(remote.path()), opts).unwrap();
    let s = local_step(local.path(), 1, 3 * ckpt_tier::MIN_PART_SIZE_BYTES);
    t.upload_step(1, &s.files, &s.index_json).unwrap();
    for (name, data) in &s.bytes {
        assert!(read_all(&t, 1, name, data.len()) == *data);
    }
}

#[test]
fn file_index_naming_a_missing_file_is_not_committed() {
    let (local, remote) = (tempdir(), tempdir());
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    let s = local_step(local.path(), 6, 1000);
    t.upload_files(6, &s.files[1..]).unwrap();
    let e = t.commit_step(6, &s.index_json).unwrap_err().to_string();
    assert!(e.contains("rank-00000-of-00002-shard-0000.safetensors is missing"), "{e}");
    assert_eq!(t.steps().unwrap(), Vec::<u64>::new());
    // The index of another step is refused too.
    t.upload_files(6, &s.files[..1]).unwrap();
    let e = t.commit_step(8, &s.index_json).unwrap_err().to_string();
    assert!(e.contains("index of step 6"), "{e}");
    t.commit_step(6, &s.index_json).unwrap();
    assert_eq!(t.steps().unwrap(), vec![6]);
}

#[test]
fn file_bad_urls_are_named() {
    for (url, want) in [
        ("ftp://x/y", "not supported"),
        ("file://host/x", "absolute path"),
        ("gs://bucket/x", "not built in"),
        ("s3://AKIA:secret@bucket/x", "credentials"),
    ] {
        let e = Target::open(url, TargetOptions::default()).unwrap_err().to_string();
        assert!(e.contains(want), "{url}: {e}");
        assert!(!e.contains("secret"), "{url}: a secret in {e}");
    }
}

#[test]
fn file_remote_index_has_every_file_in_the_step_folder() {
    // A local index with a secondary directory: the remote one has none.
    let local = tempdir();
    let s = local_step(local.path(), 9, 1000);
    let mut index = ckpt_store::format::Index::from_json_bytes(&s.index_json).unwrap();
    index.ckpt.secondary_dirs = vec!["/nvme1/ckpt".into()];
    index.ckpt.files[0].dir_idx = 1;
    let local_json = index.sealed_json_bytes();
    let remote = ckpt_tier::remote_index_json(&local_json).unwrap();
    let r = ckpt_store::format::Index::from_json_bytes(&remote).unwrap();
    assert!(r.ckpt.secondary_dirs.is_empty() && r.ckpt.files.iter().all(|f| f.dir_idx == 0));
}

#[test]
fn file_target_without_o_direct_is_written_buffered() {
    // tmpfs refuses O_DIRECT: source and target there take the buffered path.
    let local = tempfile::tempdir_in("/dev/shm").unwrap();
    let remote = tempfile::tempdir_in("/dev/shm").unwrap();
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    let s = local_step(local.path(), 1, 2 * ckpt_tier::MIN_PART_SIZE_BYTES + 4097);
    t.upload_step(1, &s.files, &s.index_json).unwrap();
    for (name, data) in &s.bytes {
        let p = remote.path().join("step-000000000001").join(name);
        assert!(std::fs::read(&p).unwrap() == *data, "{}", p.display());
    }
}

#[test]
fn file_copied_file_is_a_hard_link_and_survives_deleting_its_source() {
    use std::os::unix::fs::MetadataExt;
    let (local, remote) = (tempdir(), tempdir());
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    let big = ckpt_store::format::shard_file_name(0, 2, 0);
    let at = |step: u64| remote.path().join(ckpt_store::format::step_dir_name(step).unwrap()).join(&big);
    // Checked before the delete inside: the copy is the same inode.
    let probe = tempdir();
    let tp = Target::open(&file_url(probe.path()), small_parts()).unwrap();
    let s = local_step(local.path(), 1, 1000);
    tp.upload_step(1, &s.files, &s.index_json).unwrap();
    tp.copy_file(1, 2, &big).unwrap();
    let p = |step: u64| probe.path().join(ckpt_store::format::step_dir_name(step).unwrap()).join(&big);
    assert_eq!(
        std::fs::metadata(p(1)).unwrap().ino(),
        std::fs::metadata(p(2)).unwrap().ino(),
        "a file:// copy is a hard link"
    );
    copied_file_survives_deleting_its_source(&t, local.path());
    assert!(!at(1).exists() && at(2).exists());
}

#[test]
fn file_held_upload_takes_bytes_from_memory() {
    let (local, remote) = (tempdir(), tempdir());
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    held_upload_takes_bytes_from_memory(&t, local.path());
}

#[test]
fn file_held_bytes_that_differ_are_replaced_from_disk() {
    let (local, remote) = (tempdir(), tempdir());
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    held_bytes_that_differ_are_replaced_from_disk(&t, local.path());
}

#[test]
fn file_held_bytes_taken_back_mid_upload_are_read_from_disk() {
    let (local, remote) = (tempdir(), tempdir());
    let t = Target::open(&file_url(remote.path()), small_parts()).unwrap();
    held_bytes_taken_back_mid_upload_are_read_from_disk(&t, local.path());
}
