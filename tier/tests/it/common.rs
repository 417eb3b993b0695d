//! What the tier's tests share: a committed-looking local step (shard files
//! of seeded bytes, a blob, a valid index naming them), and the checks
//! every backend must pass.
use std::collections::BTreeMap;
use std::path::Path;

use ckpt_store::format::{self, CkptSection, Index, IndexBlob, IndexFile, IndexMetadata};
use ckpt_test_support::Rng;
use ckpt_tier::{LocalFile, Target, TargetOptions};

/// Small parts, so that a few MiB make a multipart upload of several parts.
pub fn small_parts() -> TargetOptions {
    TargetOptions { bandwidth_bytes_per_s: None, parallel: 4, part_size_bytes: ckpt_tier::MIN_PART_SIZE_BYTES }
}

pub struct LocalStep {
    pub files: Vec<LocalFile>,
    pub index_json: Vec<u8>,
    /// The bytes of each file, by name.
    pub bytes: BTreeMap<String, Vec<u8>>,
}

pub fn seeded_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Writes a step's files under `dir/step-N/` (two shards: one larger than
/// a part, one small; a blob) and returns them with a valid index.
pub fn local_step(dir: &Path, step: u64, big_len: usize) -> LocalStep {
    let step_dir = dir.join(format::step_dir_name(step).unwrap());
    std::fs::create_dir_all(step_dir.join(format::BLOBS_DIR_NAME)).unwrap();
    let shards = [(format::shard_file_name(0, 2, 0), big_len), (format::shard_file_name(1, 2, 0), 1000)];
    let mut files = Vec::new();
    let mut index_files = Vec::new();
    let mut bytes = BTreeMap::new();
    for (i, (name, len)) in shards.iter().enumerate() {
        let data = seeded_bytes(step * 100 + i as u64 + 1, *len);
        let path = step_dir.join(name);
        std::fs::write(&path, &data).unwrap();
        let crc = crc32c::crc32c(&data);
        files.push(LocalFile { local_path: path, name: name.clone(), len: *len as u64, crc32c: crc });
        index_files.push(IndexFile { name: name.clone(), dir_idx: 0, len_bytes: *len as u64, crc32c: crc });
        bytes.insert(name.clone(), data);
    }
    let blob = seeded_bytes(step * 100 + 99, 300);
    let blob_path = step_dir.join(format::BLOBS_DIR_NAME).join("extra.bin");
    std::fs::write(&blob_path, &blob).unwrap();
    let blob_crc = crc32c::crc32c(&blob);
    let blob_name = format!("{}/extra.bin", format::BLOBS_DIR_NAME);
    files.push(LocalFile { local_path: blob_path, name: blob_name.clone(), len: blob.len() as u64, crc32c: blob_crc });
    bytes.insert(blob_name, blob.clone());
    let mut index = Index {
        metadata: IndexMetadata { total_size: 0 },
        weight_map: BTreeMap::new(),
        ckpt: CkptSection {
            format_version: ckpt_store::config::FORMAT_VERSION,
            step,
            world_size: 2,
            secondary_dirs: vec![],
            files: index_files,
            tensors: BTreeMap::new(),
            blobs: vec![IndexBlob { name: "extra.bin".into(), len_bytes: blob.len() as u64, crc32c: blob_crc }],
            slices: BTreeMap::new(),
            nodes: BTreeMap::new(),
            index_crc32c: 0,
        },
    };
    let index_json = index.sealed_json_bytes();
    LocalStep { files, index_json, bytes }
}

pub fn read_all(t: &Target, step: u64, name: &str, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    t.read_range(step, name, 0, &mut v).unwrap();
    v
}

/// Upload, list, latest, get_index, read_range (whole and a window across
/// a part boundary), delete_step: what every backend must do.
pub fn round_trip(t: &Target, local: &Path) {
    assert_eq!(t.steps().unwrap(), Vec::<u64>::new());
    assert_eq!(t.latest().unwrap(), None);
    let part = ckpt_tier::MIN_PART_SIZE_BYTES;
    let s1 = local_step(local, 1, 2 * part + 12345);
    let s2 = local_step(local, 2, part / 2);
    let stats = t.upload_step(1, &s1.files, &s1.index_json).unwrap();
    assert_eq!(stats.files, 3);
    assert_eq!(stats.bytes, s1.bytes.values().map(|b| b.len() as u64).sum::<u64>());
    t.upload_step(2, &s2.files, &s2.index_json).unwrap();
    assert_eq!(t.steps().unwrap(), vec![1, 2]);
    assert_eq!(t.latest().unwrap(), Some(2));
    // An older step committed again leaves `latest` alone.
    t.upload_step(1, &s1.files, &s1.index_json).unwrap();
    assert_eq!(t.latest().unwrap(), Some(2));

    let remote_index = t.get_index(1).unwrap();
    assert_eq!(remote_index, s1.index_json, "an index with no secondary dirs is stored as given");
    Index::from_json_bytes(&remote_index).unwrap();

    for (name, data) in &s1.bytes {
        assert!(read_all(t, 1, name, data.len()) == *data, "{name} read back differs");
    }
    // A window across the first part boundary.
    let big = format::shard_file_name(0, 2, 0);
    let mut w = vec![0u8; 1000];
    t.read_range(1, &big, (part - 500) as u64, &mut w).unwrap();
    assert!(w[..] == s1.bytes[&big][part - 500..part + 500]);

    // A read past the end is an error naming the object.
    let mut past = vec![0u8; 10];
    let e = t.read_range(2, &format::shard_file_name(1, 2, 0), 995, &mut past).unwrap_err().to_string();
    assert!(e.contains(t.url()) && e.contains("rank-00001-of-00002-shard-0000.safetensors"), "{e}");

    t.delete_step(2).unwrap();
    assert_eq!(t.steps().unwrap(), vec![1]);
    assert_eq!(t.latest().unwrap(), Some(1), "latest names a deleted step: the newest committed one instead");
    let e = t.get_index(2).unwrap_err().to_string();
    assert!(e.contains("not found") && e.contains("step-000000000002"), "{e}");
}

/// A dead sidecar's half upload (files, no index) is not a step, and
/// clean_incomplete removes it.
pub fn half_upload_is_cleaned(t: &Target, local: &Path) {
    let s3 = local_step(local, 3, ckpt_tier::MIN_PART_SIZE_BYTES + 7);
    t.upload_files(3, &s3.files[..2]).unwrap();
    assert!(!t.steps().unwrap().contains(&3), "a step without its index is listed");
    let removed = t.clean_incomplete().unwrap();
    assert!(removed >= 1, "removed {removed}");
    // Its files are gone: committing it now fails, naming a missing file.
    let e = t.commit_step(3, &s3.index_json).unwrap_err().to_string();
    assert!(e.contains("not committed") && e.contains("missing"), "{e}");
    assert!(!t.steps().unwrap().contains(&3));
}

/// A local file whose bytes no longer match its index is never uploaded,
/// and its step never committed.
pub fn flipped_byte_is_refused(t: &Target, local: &Path) {
    let s = local_step(local, 4, 2 * ckpt_tier::MIN_PART_SIZE_BYTES + 1);
    let victim = &s.files[0];
    let mut data = std::fs::read(&victim.local_path).unwrap();
    let at = data.len() - 3; // in the last part
    data[at] ^= 0x10;
    std::fs::write(&victim.local_path, &data).unwrap();
    let e = t.upload_step(4, &s.files, &s.index_json).unwrap_err().to_string();
    assert!(e.contains("does not match its index") && e.contains(&victim.name) && e.contains(t.url()), "{e}");
    assert!(!t.steps().unwrap().contains(&4));
    // Nor was the file itself left as an object.
    let mut one = [0u8; 1];
    let e = t.read_range(4, &victim.name, 0, &mut one).unwrap_err().to_string();
    assert!(e.contains("not found"), "{e}");

    // A small file (one put) is checked as well (the first try put it up: removed).
    t.delete_step(4).unwrap();
    let small = &s.files[1];
    let mut data = std::fs::read(&small.local_path).unwrap();
    data[0] ^= 1;
    std::fs::write(&small.local_path, &data).unwrap();
    let e = t.upload_files(4, std::slice::from_ref(small)).unwrap_err().to_string();
    assert!(e.contains("does not match its index"), "{e}");
    let e = t.read_range(4, &small.name, 0, &mut one).unwrap_err().to_string();
    assert!(e.contains("not found"), "{e}");
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

pub fn file_url(p: &Path) -> String {
    format!("file://{}", p.display())
}

/// Step 2's big shard is a target-side copy of step 1's (`copy_file`, the
/// drain's unchanged file), the rest uploaded; step 2 commits, and reads
/// back bit-equal after step 1 is deleted (each remote step self-contained).
pub fn copied_file_survives_deleting_its_source(t: &Target, local: &Path) {
    let s1 = local_step(local, 1, ckpt_tier::MIN_PART_SIZE_BYTES + 4321);
    t.upload_step(1, &s1.files, &s1.index_json).unwrap();
    let big = format::shard_file_name(0, 2, 0);
    // Step 2: the same big shard (its bytes, name and index entry), new others.
    let mut s2 = local_step(local, 2, 1);
    let big_file = s1.files.iter().find(|f| f.name == big).unwrap().clone();
    let mut index = Index::from_json_bytes(&s2.index_json).unwrap();
    for f in &mut index.ckpt.files {
        if f.name == big {
            (f.len_bytes, f.crc32c) = (big_file.len, big_file.crc32c);
        }
    }
    s2.index_json = index.sealed_json_bytes();
    s2.bytes.insert(big.clone(), s1.bytes[&big].clone());
    let rest: Vec<LocalFile> = s2.files.iter().filter(|f| f.name != big).cloned().collect();
    t.copy_file(1, 2, &big).unwrap();
    t.upload_files(2, &rest).unwrap();
    t.commit_step(2, &s2.index_json).unwrap();
    // A copy of a file the source step lacks is NotFound, naming it.
    let e = t.copy_file(1, 3, "no-such.safetensors").unwrap_err();
    assert!(matches!(e, ckpt_tier::TierError::NotFound { .. }), "{e}");
    t.delete_step(1).unwrap();
    assert_eq!(t.steps().unwrap(), vec![2]);
    for (name, data) in &s2.bytes {
        assert!(read_all(t, 2, name, data.len()) == *data, "{name} of step 2 differs after step 1 was deleted");
    }
}

/// A holder of an upload's files in memory (page-aligned buffers, as the
/// sidecar's staging), for `upload_files_held`: it may hold a file's bytes
/// with a flipped byte, and may stop lending after some parts (a save took
/// the memory back).
pub struct TestHeld {
    bufs: Vec<ckpt_store::mem::AlignedBuf>,
    lens: Vec<u64>,
    /// Parts it still lends (negative: unlimited).
    lends_left: std::sync::atomic::AtomicI64,
    pub lent_parts: std::sync::atomic::AtomicU64,
}

impl TestHeld {
    pub fn new(files: &[LocalFile], lends: i64) -> TestHeld {
        let block = ckpt_tier::DIRECT_BLOCK_BYTES;
        let bufs = files
            .iter()
            .map(|f| {
                let mut b = ckpt_store::mem::AlignedBuf::new((f.len as usize).div_ceil(block).max(1) * block).unwrap();
                b.as_mut_slice()[..f.len as usize].copy_from_slice(&std::fs::read(&f.local_path).unwrap());
                b
            })
            .collect();
        TestHeld { bufs, lens: files.iter().map(|f| f.len).collect(), lends_left: lends.into(), lent_parts: 0.into() }
    }

    pub fn flip(&mut self, file_idx: usize, at: usize) {
        self.bufs[file_idx].as_mut_slice()[at] ^= 0x40;
    }
}

impl ckpt_tier::HeldBytes for TestHeld {
    fn with_part(&self, file_idx: usize, offset: u64, len: usize, f: &mut dyn FnMut(&[u8])) -> bool {
        use std::sync::atomic::Ordering;
        assert!(offset + len as u64 <= self.lens[file_idx], "a part inside its file");
        if self.lends_left.fetch_sub(1, Ordering::SeqCst) == 0 {
            self.lends_left.store(0, Ordering::SeqCst);
            return false;
        }
        f(&self.bufs[file_idx].as_slice()[offset as usize..]);
        self.lent_parts.fetch_add(1, Ordering::SeqCst);
        true
    }
}

/// Upload from memory (`upload_files_held`): every part taken from the
/// holder, none read from the local files (they are changed on disk after
/// the holder read them, so a read would fail the crc), the remote files
/// equal to the committed bytes, then committed as usual.
pub fn held_upload_takes_bytes_from_memory(t: &Target, local: &Path) {
    let s = local_step(local, 8, 2 * ckpt_tier::MIN_PART_SIZE_BYTES + 777);
    let held = std::sync::Arc::new(TestHeld::new(&s.files, -1));
    // The local files changed under it: a part read from disk would not match.
    for f in &s.files {
        let mut d = std::fs::read(&f.local_path).unwrap();
        d[0] ^= 1;
        std::fs::write(&f.local_path, &d).unwrap();
    }
    let (stats, from_memory) = t.upload_files_held(8, &s.files, held.clone()).unwrap();
    assert_eq!(from_memory, stats.bytes, "every byte from memory");
    t.commit_step(8, &s.index_json).unwrap();
    for (name, data) in &s.bytes {
        assert!(read_all(t, 8, name, data.len()) == *data, "{name} differs");
    }
}

/// Lent bytes that differ from the committed file (the crc is checked on
/// memory too): that file is uploaded again from disk; the remote file is
/// the committed one, and the bytes counted from memory exclude it.
pub fn held_bytes_that_differ_are_replaced_from_disk(t: &Target, local: &Path) {
    let s = local_step(local, 9, 2 * ckpt_tier::MIN_PART_SIZE_BYTES + 777);
    let mut held = TestHeld::new(&s.files, -1);
    held.flip(0, ckpt_tier::MIN_PART_SIZE_BYTES + 5);
    let (stats, from_memory) = t.upload_files_held(9, &s.files, std::sync::Arc::new(held)).unwrap();
    assert_eq!(from_memory, stats.bytes - s.files[0].len, "the differing file counted from disk");
    t.commit_step(9, &s.index_json).unwrap();
    for (name, data) in &s.bytes {
        assert!(read_all(t, 9, name, data.len()) == *data, "{name} differs");
    }
}

/// The holder takes its memory back after one part (a save needed it):
/// the other parts are read from disk, the upload completes, equal bytes.
pub fn held_bytes_taken_back_mid_upload_are_read_from_disk(t: &Target, local: &Path) {
    let s = local_step(local, 10, 3 * ckpt_tier::MIN_PART_SIZE_BYTES + 777);
    let held = std::sync::Arc::new(TestHeld::new(&s.files, 1));
    let (stats, from_memory) = t.upload_files_held(10, &s.files, held.clone()).unwrap();
    assert_eq!(held.lent_parts.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(from_memory > 0 && from_memory < stats.bytes, "{from_memory} of {}", stats.bytes);
    t.commit_step(10, &s.index_json).unwrap();
    for (name, data) in &s.bytes {
        assert!(read_all(t, 10, name, data.len()) == *data, "{name} differs");
    }
}
