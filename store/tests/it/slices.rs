//! Tensors stored in slices (docs/format.md, "Slices"): two ranks' parts,
//! each holding an element range of one logical tensor, merged and
//! committed as one checkpoint whose index (format version 2, pinned by a
//! golden file) describes the logical tensor; it loads whole, and a flipped
//! byte of a slice is reported naming the logical tensor and the file.

use std::path::{Path, PathBuf};

use ckpt_store::commit::{Store, StoreOptions};
use ckpt_store::format::{Dtype, Index, INDEX_FILE_NAME};
use ckpt_store::image::{Layout, LayoutOptions, SliceDecl, TensorSpec};
use ckpt_store::mem::AlignedBuf;
use ckpt_store::restore::{self, ReadOptions, Which};

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/golden")
}

/// "w" is F32 [4, 3] = 12 elements: rank 0 holds [0, 5), rank 1 [5, 12);
/// "b" (F32 [2]) is whole on rank 1.
fn parts() -> Layout {
    let r0 = vec![TensorSpec::new("w#elems[0:5]", Dtype::F32, &[5])];
    let r1 = vec![TensorSpec::new("w#elems[5:12]", Dtype::F32, &[7]), TensorSpec::new("b", Dtype::F32, &[2])];
    let mut a = Layout::plan(r0, LayoutOptions { rank: 0, world_size: 2, ..Default::default() }).unwrap();
    let mut b = Layout::plan(r1, LayoutOptions { rank: 1, world_size: 2, ..Default::default() }).unwrap();
    a.rebase(0);
    b.rebase(a.staging_len);
    ckpt_store::ranks::merge(vec![a, b]).unwrap()
}

fn decl(piece: &str, a: u64, b: u64) -> SliceDecl {
    SliceDecl { piece: piece.into(), of: "w".into(), shape: vec![4, 3], elems: [a, b] }
}

/// The logical tensor w's bytes: element i is the f32 i + 0.5.
fn w_bytes() -> Vec<u8> {
    (0..12).flat_map(|i| (i as f32 + 0.5).to_le_bytes()).collect()
}

fn commit(dir: &Path) -> Layout {
    let mut layout = parts();
    layout.set_slices(vec![decl("w#elems[5:12]", 5, 12), decl("w#elems[0:5]", 0, 5)]).unwrap();
    let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
    layout.write_headers(staging.as_mut_slice());
    let w = w_bytes();
    for (i, s) in layout.specs.iter().enumerate() {
        let r = layout.tensor_range(i);
        let bytes: Vec<u8> = match s.name.as_str() {
            "w#elems[0:5]" => w[..20].to_vec(),
            "w#elems[5:12]" => w[20..].to_vec(),
            _ => vec![7u8; 8],
        };
        staging.as_mut_slice()[r].copy_from_slice(&bytes);
    }
    let crcs = layout.tensor_crcs(staging.as_slice());
    let mut store = Store::open(StoreOptions::new(vec![dir.to_path_buf()])).unwrap();
    store.commit(9, &layout, &staging, &crcs, &[]).unwrap();
    layout
}

#[test]
fn a_sliced_tensor_is_described_in_the_index_and_loads_whole() {
    let tmp = tempfile::tempdir().unwrap();
    commit(tmp.path());
    let bytes = std::fs::read(tmp.path().join("step-000000000009").join(INDEX_FILE_NAME)).unwrap();
    let path = golden_dir().join("sliced.index.json");
    if std::env::var_os("CKPT_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &bytes).unwrap();
    } else {
        let want = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (regenerate with CKPT_UPDATE_GOLDEN=1)", path.display()));
        assert!(
            want == bytes,
            "the sliced index differs from {}:\n{}",
            path.display(),
            String::from_utf8_lossy(&bytes)
        );
    }
    let index = Index::from_json_bytes(&bytes).unwrap();
    assert_eq!(index.ckpt.format_version, 2);
    let logical = index.logical();
    let names: Vec<&str> = logical.iter().map(|t| t.name).collect();
    assert_eq!(names, ["b", "w"]);
    let w = &logical[1];
    assert!(w.is_sliced() && !logical[0].is_sliced());
    assert_eq!((w.dtype, w.shape, w.len_bytes()), (Dtype::F32, &[4u64, 3][..], 48));
    let ranks: Vec<(&str, [u64; 2])> = w.slices.iter().map(|s| (&s.file[..19], s.elems)).collect();
    assert_eq!(ranks, [("rank-00000-of-00002", [0, 5]), ("rank-00001-of-00002", [5, 12])]);

    let loaded = restore::load(tmp.path(), Which::Latest, &ReadOptions::default(), None).unwrap();
    assert_eq!(loaded.logical_bytes("w").unwrap(), w_bytes());
    assert_eq!(loaded.logical_bytes("b").unwrap(), vec![7u8; 8]);
    assert!(loaded.logical_bytes("nope").is_none());
}

#[test]
fn a_flipped_byte_in_a_slice_names_the_logical_tensor_and_its_file() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = commit(tmp.path());
    let i = layout.specs.iter().position(|s| s.name == "w#elems[5:12]").unwrap();
    let sh = &layout.shards[layout.places[i].shard_idx];
    let file = tmp.path().join("step-000000000009").join(&sh.file_name);
    let mut bytes = std::fs::read(&file).unwrap();
    let at = sh.header.len() + layout.places[i].data_offsets.0 as usize + 3;
    bytes[at] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();

    let r = restore::verify(tmp.path(), 9, &ReadOptions::default(), |_, _| {}).unwrap();
    let lines: Vec<String> = r.problems.iter().map(|p| p.to_string()).collect();
    let want = format!(
        "{}: tensor \"w\": slice elems [5, 12) of rank 1 (stored as \"w#elems[5:12]\"): checksum mismatch",
        sh.file_name
    );
    assert!(lines.iter().any(|l| l.starts_with(&want)), "{lines:?}");
    assert_eq!(r.tensors, 2, "verify counts logical tensors");
    let e = restore::load(tmp.path(), Which::Step(9), &ReadOptions::default(), None)
        .err()
        .expect("a damaged step does not load");
    assert!(e.to_string().contains(&want), "{e}");
}

#[test]
fn slices_that_leave_a_gap_overlap_or_mismatch_are_refused() {
    let bad = [
        vec![decl("w#elems[0:5]", 0, 5)],                               // [5, 12) missing
        vec![decl("w#elems[0:5]", 0, 5), decl("w#elems[5:12]", 4, 11)], // overlap
        vec![decl("w#elems[0:5]", 0, 5), decl("w#elems[5:12]", 5, 12), decl("b", 12, 14)], // past the end
        vec![decl("w#elems[0:5]", 0, 5), decl("nope", 5, 12)],          // no such tensor
        vec![SliceDecl { of: "b".into(), ..decl("w#elems[0:5]", 0, 5) }], // logical name is a stored one
        vec![decl("w#elems[0:5]", 0, 5), SliceDecl { shape: vec![12], ..decl("w#elems[5:12]", 5, 12) }], // two shapes
    ];
    for decls in bad {
        let mut l = parts();
        let e = l.set_slices(decls.clone()).expect_err(&format!("{decls:?} accepted"));
        assert!(e.to_string().starts_with("index: "), "{e}");
        assert!(l.slices().is_empty());
    }
}

#[test]
fn an_index_without_slices_stays_version_1_and_version_1_with_slices_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    commit(tmp.path());
    let bytes = std::fs::read(tmp.path().join("step-000000000009").join(INDEX_FILE_NAME)).unwrap();
    let mut index = Index::from_json_bytes(&bytes).unwrap();
    index.ckpt.format_version = 1;
    index.seal();
    let e = Index::from_json_bytes(&index.to_json_bytes()).unwrap_err();
    assert!(e.to_string().contains("format version 1 has no slices"), "{e}");
    index.ckpt.format_version = 4;
    index.seal();
    let e = Index::from_json_bytes(&index.to_json_bytes()).unwrap_err();
    assert!(e.to_string().contains("format version 4 is not supported (this build reads 1 to 3)"), "{e}");
    let plain = parts();
    assert_eq!(plain.index(1, &[0, 0, 0], &[], vec![]).ckpt.format_version, 1);
}
