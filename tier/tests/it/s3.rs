//! The tier against an S3 server: tests/s3/serve.sh (moto, loopback),
//! started by the test itself. A server that cannot be started fails the
//! test (it is never skipped).

use crate::common::*;
use ckpt_test_support::s3::S3Server;
use ckpt_tier::Target;

/// A fresh prefix per test: the tests share one server and bucket.
fn target(prefix: &str) -> Target {
    let server = S3Server::shared();
    Target::open(&server.url(prefix), small_parts())
        .unwrap_or_else(|e| panic!("{e}; server log {}", server.log.display()))
}

#[test]
fn s3_round_trip() {
    let local = tempdir();
    round_trip(&target("round-trip"), local.path());
}

#[test]
fn s3_half_upload_is_not_a_step_and_is_cleaned() {
    let local = tempdir();
    half_upload_is_cleaned(&target("half-upload"), local.path());
}

#[test]
fn s3_flipped_byte_is_refused() {
    let local = tempdir();
    flipped_byte_is_refused(&target("flipped"), local.path());
}

#[test]
fn s3_aborted_upload_leaves_no_object_and_no_marker() {
    let local = tempdir();
    let t = target("aborted");
    let s = local_step(local.path(), 1, 3 * ckpt_tier::MIN_PART_SIZE_BYTES);
    // A file shorter than its index says: refused before any part goes up.
    let mut short = s.files[0].clone();
    short.len += 1;
    let e = t.upload_files(1, &[short]).unwrap_err().to_string();
    assert!(e.contains("does not match its index"), "{e}");
    // Parts uploaded, then a crc mismatch: aborted, its marker deleted.
    let mut wrong = s.files[0].clone();
    wrong.crc32c ^= 1;
    let e = t.upload_files(1, &[wrong]).unwrap_err().to_string();
    assert!(e.contains("does not match its index"), "{e}");
    assert_eq!(t.clean_incomplete().unwrap(), 0, "the aborts left no object, marker or pending upload");
    t.upload_step(1, &s.files, &s.index_json).unwrap();
    assert_eq!(t.steps().unwrap(), vec![1]);
    assert_eq!(t.clean_incomplete().unwrap(), 0, "nothing pending after a complete upload");
}

#[test]
fn s3_pending_multipart_upload_of_a_dead_sidecar_is_aborted() {
    use object_store::multipart::MultipartStore;
    use object_store::path::Path;
    use object_store::{ObjectStoreExt, PutPayload};
    // What a sidecar SIGKILLed mid-upload leaves: a multipart upload with
    // a part, and its marker (`.ckpt-upload-<nonce>`: key, upload id) in
    // the step folder; made here with object_store directly.
    let t = target("dead-sidecar");
    let s3 = object_store::aws::AmazonS3Builder::from_env().with_url("s3://ckpt-test").build().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let key = Path::parse("dead-sidecar/step-000000000002/rank-00000-of-00001-shard-0000.safetensors").unwrap();
    let marker = Path::parse("dead-sidecar/step-000000000002/.ckpt-upload-00000000deadbeef").unwrap();
    let id = rt.block_on(async {
        let id = s3.create_multipart(&key).await.unwrap();
        s3.put_part(&key, &id, 0, PutPayload::from(vec![7u8; ckpt_tier::MIN_PART_SIZE_BYTES])).await.unwrap();
        s3.put(&marker, PutPayload::from(format!("{key}\n{id}\n"))).await.unwrap();
        id
    });
    assert_eq!(t.steps().unwrap(), Vec::<u64>::new());
    // The step folder and the pending upload.
    assert_eq!(t.clean_incomplete().unwrap(), 2);
    rt.block_on(async {
        // A part for it is refused: there is no such upload any more (S3
        // says NoSuchUpload; moto fails with a 500 from its KeyError on
        // the unknown upload id, which its log shows).
        let e = s3.put_part(&key, &id, 1, PutPayload::from(vec![7u8; 10])).await.unwrap_err().to_string();
        assert!(
            e.contains("NoSuchUpload") || e.contains("500 Internal Server Error"),
            "the upload is still there: {e}"
        );
        assert!(matches!(s3.head(&marker).await, Err(object_store::Error::NotFound { .. })));
    });
}

#[test]
fn s3_open_of_a_missing_bucket_names_the_url() {
    let server = S3Server::shared();
    let url = "s3://no-such-bucket/x";
    let e = Target::open(url, small_parts()).unwrap_err().to_string();
    assert!(e.contains(url) && e.contains("cannot open"), "{e}");
    let secret = &server.env.iter().find(|(k, _)| k == "AWS_SECRET_ACCESS_KEY").unwrap().1;
    assert!(!e.contains(secret.as_str()), "{e}");
}

#[test]
fn s3_copied_file_survives_deleting_its_source() {
    let local = tempdir();
    copied_file_survives_deleting_its_source(&target("copied"), local.path());
}

#[test]
fn s3_held_upload_takes_bytes_from_memory() {
    let local = tempdir();
    held_upload_takes_bytes_from_memory(&target("held"), local.path());
}

#[test]
fn s3_held_bytes_that_differ_are_replaced_from_disk() {
    let local = tempdir();
    held_bytes_that_differ_are_replaced_from_disk(&target("held-differ"), local.path());
}

#[test]
fn s3_held_bytes_taken_back_mid_upload_are_read_from_disk() {
    let local = tempdir();
    held_bytes_taken_back_mid_upload_are_read_from_disk(&target("held-taken-back"), local.path());
}
