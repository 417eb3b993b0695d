//! Golden files pin the on-disk format: a small checkpoint written through
//! the real engine must produce, byte for byte, the index and shard checked
//! in under `tests/golden/`. A format change fails here; if it is intended,
//! bump `FORMAT_VERSION`, update docs/format.md, and regenerate with
//! `CKPT_UPDATE_GOLDEN=1 cargo test -p ckpt-store --test it golden::`.

use std::path::PathBuf;

use ckpt_store::commit::{Store, StoreOptions};
use ckpt_store::format::{Dtype, Index, INDEX_FILE_NAME};
use ckpt_store::image::{Blob, Layout, LayoutOptions, TensorSpec};
use ckpt_store::mem::AlignedBuf;

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/golden")
}

/// A tiny state with a tensor of each element size, a scalar, an empty
/// tensor and an odd length, so the file ends unaligned.
fn write_small_checkpoint(dir: &std::path::Path) -> PathBuf {
    let specs = vec![
        TensorSpec::new("model.embed.weight", Dtype::BF16, &[4, 3]),
        TensorSpec::new("model.norm.weight", Dtype::F32, &[3]),
        TensorSpec::new("optim.step", Dtype::I64, &[]),
        TensorSpec::new("optim.mask", Dtype::BOOL, &[5]),
        TensorSpec::new("optim.empty", Dtype::F16, &[0, 2]),
    ];
    let layout = Layout::plan(specs, LayoutOptions::default()).unwrap();
    let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
    layout.write_headers(staging.as_mut_slice());
    for i in 0..layout.specs.len() {
        let r = layout.tensor_range(i);
        for (j, b) in staging.as_mut_slice()[r].iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(40).wrapping_add(j as u8);
        }
    }
    let crcs = layout.tensor_crcs(staging.as_slice());
    let mut store = Store::open(StoreOptions::new(vec![dir.to_path_buf()])).unwrap();
    let blobs = [Blob { name: "rng.state", bytes: b"seed=1234\n" }];
    store.commit(42, &layout, &staging, &crcs, &blobs).unwrap().path
}

fn check(name: &str, actual: &[u8]) {
    let path = golden_dir().join(name);
    if std::env::var_os("CKPT_UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(golden_dir()).unwrap();
        std::fs::write(&path, actual).unwrap();
        println!("updated {}", path.display());
        return;
    }
    let expected = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (regenerate with CKPT_UPDATE_GOLDEN=1)", path.display()));
    assert!(
        expected == actual,
        "{name} differs from its golden file {}: the on-disk format changed.\n--- expected ---\n{}\n--- actual ---\n{}",
        path.display(),
        String::from_utf8_lossy(&expected),
        String::from_utf8_lossy(actual)
    );
}

#[test]
fn index_and_shard_match_golden_files() {
    let tmp = tempfile::tempdir().unwrap();
    let step_dir = write_small_checkpoint(tmp.path());
    let index_bytes = std::fs::read(step_dir.join(INDEX_FILE_NAME)).unwrap();
    check("small.index.json", &index_bytes);
    let index = Index::from_json_bytes(&index_bytes).unwrap();
    assert_eq!(index.ckpt.files.len(), 1);
    let shard = std::fs::read(step_dir.join(&index.ckpt.files[0].name)).unwrap();
    check("small.safetensors", &shard);
    check("small.blob", &std::fs::read(step_dir.join("blobs/rng.state")).unwrap());
}

#[test]
fn golden_index_parses_and_describes_the_golden_shard() {
    let index = Index::from_json_bytes(&std::fs::read(golden_dir().join("small.index.json")).unwrap()).unwrap();
    let shard = std::fs::read(golden_dir().join("small.safetensors")).unwrap();
    let f = &index.ckpt.files[0];
    assert_eq!(f.len_bytes, shard.len() as u64);
    assert_eq!(f.crc32c, crc32c::crc32c(&shard));
    let header = ckpt_store::format::decode_header(&shard, shard.len() as u64).unwrap();
    assert_eq!(header.data_start % 4096, 0, "data section is aligned");
    for t in &header.tensors {
        let it = &index.ckpt.tensors[&t.name];
        assert_eq!((it.dtype, &it.shape), (t.dtype, &t.shape));
        let bytes =
            &shard[(header.data_start + t.data_offsets.0) as usize..(header.data_start + t.data_offsets.1) as usize];
        assert_eq!(it.crc32c, crc32c::crc32c(bytes), "{}", t.name);
    }
}
