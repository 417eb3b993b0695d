//! Damage on disk (DESIGN.md "Failure semantics": "flipped byte on disk —
//! caught by checksum on load and `verify`; `load latest` falls back to the
//! newest good one and says so").
//!
//! Each test writes two checkpoints through the library (steps OLD and NEW),
//! damages NEW (a flipped byte in a tensor, in the safetensors header, a
//! truncated or missing shard, a missing or altered blob, a broken index),
//! then checks that `ckpt-sidecar verify` names the damage and exits 3, that
//! `load latest` falls back to OLD naming NEW, and that loading NEW by step
//! is refused with an error that names the file and tensor.

use std::fs::{self, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use ckpt_store::catalog;
use ckpt_store::commit::{Store, StoreOptions};
use ckpt_store::format::{Index, BLOBS_DIR_NAME, INDEX_FILE_NAME};
use ckpt_store::image::{Blob, Layout, LayoutOptions};
use ckpt_store::mem::AlignedBuf;
use ckpt_store::restore::{self, LoadError, Problem, ReadOptions, Which};
use ckpt_store::synthetic;
use ckpt_test_support::{cli, CliRun};

const EXIT_DAMAGED: i32 = 3;
const OLD: u64 = 10;
const NEW: u64 = 20;
const SIZE_BYTES: u64 = 2 << 20;
const BLOB_NAME: &str = "meta";
/// A large BF16 tensor, placed well inside its shard.
const TENSOR: &str = "model.layers.3.mlp.up_proj.weight";

// ------------------------------------------------------------------ helpers

/// Temp dir (kept alive by the caller) with steps OLD and NEW committed in
/// `n_dirs` target directories.
struct Fixture {
    _tmp: tempfile::TempDir,
    dirs: Vec<PathBuf>,
}

impl Fixture {
    fn new(n_dirs: usize) -> Fixture {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dirs: Vec<PathBuf> = (0..n_dirs).map(|i| tmp.path().join(format!("disk{i}"))).collect();
        let mut store = Store::open(StoreOptions::new(dirs.clone())).expect("open store");
        let layout = Layout::plan(
            synthetic::transformer_specs(SIZE_BYTES),
            LayoutOptions { n_dirs, shard_bytes_max: 1 << 20, ..Default::default() },
        )
        .expect("plan");
        assert!(layout.shards.len() >= 2, "want several shards");
        let mut staging = AlignedBuf::new(layout.staging_len as usize).expect("staging");
        for step in [OLD, NEW] {
            let crcs = synthetic::stage(&layout, staging.as_mut_slice(), step);
            let blob = format!("blob of step {step}").into_bytes();
            store.commit(step, &layout, &staging, &crcs, &[Blob { name: BLOB_NAME, bytes: &blob }]).expect("commit");
        }
        assert_eq!(catalog::committed_steps(&dirs[0]).unwrap(), vec![OLD, NEW]);
        assert_eq!(catalog::latest_step(&dirs[0]).unwrap(), Some(NEW));
        let f = Fixture { _tmp: tmp, dirs };
        // Sanity: undamaged, everything loads (the tests that damage it also
        // verify the intact step, and `fixture_is_intact` the whole of it).
        for step in [OLD, NEW] {
            let l = f.load(Which::Step(step)).unwrap_or_else(|e| panic!("step {step} damaged before any damage: {e}"));
            assert_tensor_is(&l, TENSOR, step);
        }
        f
    }

    fn primary(&self) -> &Path {
        &self.dirs[0]
    }

    fn index(&self, step: u64) -> Index {
        restore::read_index(self.primary(), step).expect("read index")
    }

    /// Path of shard `file` of `step`, in whichever directory holds it.
    fn shard_path(&self, step: u64, file: &str) -> PathBuf {
        let idx = self.index(step);
        let f = idx.ckpt.files.iter().find(|f| f.name == file).unwrap_or_else(|| panic!("no file {file}"));
        catalog::step_path(&self.dirs[f.dir_idx as usize], step).join(file)
    }

    /// (shard path, file name, absolute offset of the tensor's first byte,
    /// tensor length) of `tensor` in `step`, found through the index and the
    /// shard's own safetensors header.
    fn locate(&self, step: u64, tensor: &str) -> (PathBuf, String, u64, u64) {
        let idx = self.index(step);
        let t = idx.ckpt.tensors.get(tensor).unwrap_or_else(|| panic!("no tensor {tensor}"));
        let path = self.shard_path(step, &t.file);
        (path.clone(), t.file.clone(), data_start(&path) + t.data_offsets[0], t.data_offsets[1] - t.data_offsets[0])
    }

    fn verify(&self, step: u64) -> Vec<Problem> {
        restore::verify(self.primary(), step, &ReadOptions::default(), |_, _| {}).expect("verify runs").problems
    }

    fn load(&self, which: Which) -> Result<restore::Loaded, LoadError> {
        restore::load(self.primary(), which, &ReadOptions::default(), None)
    }

    /// `load latest` gives OLD, intact, and says it skipped NEW; returns why.
    fn assert_falls_back(&self) -> String {
        let l = self.load(Which::Latest).expect("load latest falls back to a good checkpoint");
        assert_eq!(l.step, OLD, "load latest should fall back to the older step");
        assert_eq!(l.fell_back.len(), 1, "fell_back: {:?}", l.fell_back);
        assert_eq!(l.fell_back[0].0, NEW, "fell_back names the damaged step");
        assert_eq!(l.blobs.get(BLOB_NAME).map(Vec::as_slice), Some(format!("blob of step {OLD}").as_bytes()));
        assert_tensor_is(&l, TENSOR, OLD);
        l.fell_back[0].1.clone()
    }

    /// Loading NEW by step is refused as damaged; returns the problems.
    fn assert_new_refused(&self) -> (Vec<Problem>, String) {
        match self.load(Which::Step(NEW)) {
            Ok(l) => panic!("a damaged step {} was loaded", l.step),
            Err(e @ LoadError::Damaged { .. }) => {
                let msg = e.to_string();
                let LoadError::Damaged { step, problems, .. } = e else { unreachable!() };
                assert_eq!(step, NEW);
                assert!(!problems.is_empty());
                (problems, msg)
            }
            Err(e) => panic!("expected LoadError::Damaged, got {e:?}"),
        }
    }

    /// The CLI: `verify` over every step exits 3 and prints the damage;
    /// `--json` says ok:false with NEW not ok and OLD ok; `--step OLD` exits
    /// 0, `--step NEW` 3. Returns the plain stdout and NEW's JSON problems.
    fn assert_cli_verify_damaged(&self) -> (String, Vec<serde_json::Value>) {
        let dir = self.primary().as_os_str();
        let CliRun { code, stdout: out, stderr: err } = cli(&["verify".as_ref(), dir]);
        assert_eq!(code, EXIT_DAMAGED, "verify should exit {EXIT_DAMAGED}: stdout {out} stderr {err}");
        assert!(out.contains(&format!("step {NEW}: DAMAGED")), "{out}");
        assert!(out.contains(&format!("step {OLD}: ok")), "{out}");

        let CliRun { code, stdout: out_json, stderr: err } = cli(&["verify".as_ref(), dir, "--json".as_ref()]);
        assert_eq!(code, EXIT_DAMAGED, "verify --json exit code: {out_json} {err}");
        let v: serde_json::Value =
            serde_json::from_str(out_json.trim()).unwrap_or_else(|e| panic!("verify --json output {out_json:?}: {e}"));
        assert_eq!(v["ok"], serde_json::Value::Bool(false), "{v}");
        let cps = v["checkpoints"].as_array().expect("checkpoints array");
        let by_step = |s: u64| {
            cps.iter().find(|c| c["step"].as_u64() == Some(s)).unwrap_or_else(|| panic!("step {s} missing in {v}"))
        };
        assert_eq!(by_step(OLD)["ok"], serde_json::Value::Bool(true), "{v}");
        assert_eq!(by_step(NEW)["ok"], serde_json::Value::Bool(false), "{v}");
        let problems = by_step(NEW)["problems"].as_array().expect("problems").clone();
        assert!(!problems.is_empty(), "{v}");

        let old = OLD.to_string();
        let new = NEW.to_string();
        let CliRun { code, stdout: o, stderr: e } = cli(&["verify".as_ref(), dir, "--step".as_ref(), old.as_ref()]);
        assert_eq!(code, 0, "verify --step {OLD} of the intact step: {o} {e}");
        let CliRun { code, stdout: o, stderr: e } = cli(&["verify".as_ref(), dir, "--step".as_ref(), new.as_ref()]);
        assert_eq!(code, EXIT_DAMAGED, "verify --step {NEW}: {o} {e}");
        (out, problems)
    }
}

/// Start of a safetensors file's data section: 8 + the little-endian u64
/// header length.
fn data_start(path: &Path) -> u64 {
    let mut f = fs::File::open(path).expect("open shard");
    let mut n = [0u8; 8];
    f.read_exact(&mut n).expect("read header length");
    8 + u64::from_le_bytes(n)
}

/// The safetensors header (JSON bytes) of a shard.
fn header_json(path: &Path) -> Vec<u8> {
    let bytes = fs::read(path).expect("read shard");
    bytes[8..data_start(path) as usize].to_vec()
}

fn xor_byte(path: &Path, offset: u64, mask: u8) {
    assert_ne!(mask, 0);
    let mut f = OpenOptions::new().read(true).write(true).open(path).expect("open for damage");
    assert!(offset < f.metadata().unwrap().len(), "offset {offset} past the end of {}", path.display());
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.read_exact(&mut b).unwrap();
    b[0] ^= mask;
    f.seek(SeekFrom::Start(offset)).unwrap();
    // No fsync: the page cache is coherent with the O_DIRECT reads of
    // verify and load (the kernel writes dirty pages back before them).
    f.write_all(&b).unwrap();
}

fn flip_byte(path: &Path, offset: u64) {
    xor_byte(path, offset, 0x01);
}

fn assert_tensor_is(l: &restore::Loaded, name: &str, step: u64) {
    let specs = synthetic::transformer_specs(SIZE_BYTES);
    let i = specs.iter().position(|s| s.name == name).expect("tensor in specs");
    let got = l.tensor(name).expect("tensor loaded");
    let mut want = vec![0u8; got.len()];
    synthetic::fill(&mut want, step + i as u64);
    assert!(got == want.as_slice(), "tensor {name} does not hold step {step}'s data");
}

fn names_file(problems: &[Problem], file: &str) -> bool {
    problems.iter().any(|p| p.file.as_deref() == Some(file))
}

fn json_names_file(problems: &[serde_json::Value], file: &str) -> bool {
    problems.iter().any(|p| p["file"].as_str() == Some(file))
}

/// Every check for a damaged shard `file` of NEW: verify (library and CLI)
/// names the file, load latest falls back, load NEW is refused naming it.
fn assert_shard_damage_caught(f: &Fixture, file: &str) {
    let problems = f.verify(NEW);
    assert!(names_file(&problems, file), "verify does not name {file}: {problems:?}");
    assert!(f.verify(OLD).is_empty(), "OLD is intact");
    let (out, json_problems) = f.assert_cli_verify_damaged();
    assert!(out.contains(file), "verify output does not name {file}: {out}");
    assert!(json_names_file(&json_problems, file), "verify --json does not name {file}: {json_problems:?}");
    let why = f.assert_falls_back();
    assert!(why.contains(file), "fall back reason does not name {file}: {why}");
    let (problems, msg) = f.assert_new_refused();
    assert!(names_file(&problems, file), "{problems:?}");
    assert!(msg.contains(file), "{msg}");
}

// -------------------------------------------------------------------- tests

#[test]
fn fixture_is_intact() {
    let f = Fixture::new(2);
    for step in [OLD, NEW] {
        assert_eq!(f.verify(step), Vec::<Problem>::new(), "step {step} damaged before any damage");
    }
    let CliRun { code, stdout: out, stderr: err } =
        cli(&["verify".as_ref(), f.primary().as_os_str(), "--json".as_ref()]);
    assert_eq!(code, 0, "verify of an intact dir: {out}{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("verify --json");
    assert_eq!(v["ok"], serde_json::Value::Bool(true), "{v}");
    let l = f.load(Which::Latest).expect("load latest");
    assert_eq!(l.step, NEW);
    assert!(l.fell_back.is_empty());
}

#[test]
fn flipped_byte_in_tensor_data_is_caught_and_named() {
    let f = Fixture::new(1);
    let (path, file, start, len) = f.locate(NEW, TENSOR);
    flip_byte(&path, start + len / 2);

    // Library verify: the tensor, in its file.
    let problems = f.verify(NEW);
    assert!(
        problems.iter().any(|p| p.tensor.as_deref() == Some(TENSOR) && p.file.as_deref() == Some(file.as_str())),
        "verify does not name tensor {TENSOR} in {file}: {problems:?}"
    );
    assert!(problems.iter().all(|p| p.file.as_deref() == Some(file.as_str())), "only {file} is damaged: {problems:?}");
    assert!(
        problems.iter().filter(|p| p.tensor.is_some()).all(|p| p.tensor.as_deref() == Some(TENSOR)),
        "only {TENSOR} is damaged: {problems:?}"
    );
    assert!(f.verify(OLD).is_empty());

    // (a) the CLI.
    let (out, json_problems) = f.assert_cli_verify_damaged();
    assert!(out.contains(TENSOR) && out.contains(&file), "verify output names neither tensor nor file: {out}");
    assert!(
        json_problems.iter().any(|p| p["tensor"].as_str() == Some(TENSOR) && p["file"].as_str() == Some(file.as_str())),
        "verify --json: {json_problems:?}"
    );

    // (b) load latest falls back to OLD and says why.
    let why = f.assert_falls_back();
    assert!(why.contains(TENSOR), "fall back reason does not name the tensor: {why}");

    // (c) load NEW is refused, naming the tensor.
    let (problems, msg) = f.assert_new_refused();
    assert!(problems.iter().any(|p| p.tensor.as_deref() == Some(TENSOR)), "{problems:?}");
    assert!(msg.contains(TENSOR) && msg.contains(&file), "error message: {msg}");

    // Flipped back, NEW is whole again: the check is on content, not on
    // some mark left by the first read.
    flip_byte(&path, start + len / 2);
    assert!(f.verify(NEW).is_empty());
    assert_eq!(f.load(Which::Latest).expect("load").step, NEW);
}

#[test]
fn flipped_byte_in_a_secondary_directory_is_caught() {
    let f = Fixture::new(2);
    let idx = f.index(NEW);
    // A tensor whose shard lives in the secondary directory.
    let (name, t) = idx
        .ckpt
        .tensors
        .iter()
        .filter(|(_, t)| idx.ckpt.files.iter().any(|x| x.name == t.file && x.dir_idx == 1))
        .max_by_key(|(_, t)| t.data_offsets[1] - t.data_offsets[0])
        .expect("a tensor in the secondary");
    let path = f.shard_path(NEW, &t.file);
    assert!(path.starts_with(&f.dirs[1]));
    let len = t.data_offsets[1] - t.data_offsets[0];
    flip_byte(&path, data_start(&path) + t.data_offsets[0] + len - 1);

    let problems = f.verify(NEW);
    assert!(
        problems
            .iter()
            .any(|p| p.tensor.as_deref() == Some(name.as_str()) && p.file.as_deref() == Some(t.file.as_str())),
        "{problems:?}"
    );
    let (out, _) = f.assert_cli_verify_damaged();
    assert!(out.contains(name.as_str()) && out.contains(&t.file), "{out}");
    let why = f.assert_falls_back();
    assert!(why.contains(name.as_str()), "{why}");
    let (problems, _) = f.assert_new_refused();
    assert!(problems.iter().any(|p| p.tensor.as_deref() == Some(name.as_str())), "{problems:?}");
}

#[test]
fn truncated_extended_or_missing_shard_is_caught_and_named() {
    // (cut to, or grown by) a few sizes, and a deleted file.
    enum Damage {
        CutBy(u64),
        CutTo(u64),
        Grow(u64),
        Delete,
    }
    for damage in
        [Damage::CutBy(1), Damage::CutBy(100_000), Damage::CutTo(4), Damage::CutTo(0), Damage::Grow(1), Damage::Delete]
    {
        let f = Fixture::new(1);
        let (path, file, _, _) = f.locate(NEW, TENSOR);
        let len = fs::metadata(&path).unwrap().len();
        match damage {
            Damage::CutBy(n) => OpenOptions::new().write(true).open(&path).unwrap().set_len(len - n).unwrap(),
            Damage::CutTo(n) => OpenOptions::new().write(true).open(&path).unwrap().set_len(n).unwrap(),
            Damage::Grow(n) => OpenOptions::new().write(true).open(&path).unwrap().set_len(len + n).unwrap(),
            Damage::Delete => fs::remove_file(&path).unwrap(),
        }
        assert_shard_damage_caught(&f, &file);
    }
}

#[test]
fn missing_or_altered_blob_is_caught() {
    let blob_file = format!("{BLOBS_DIR_NAME}/{BLOB_NAME}");
    for variant in 0..3 {
        let f = Fixture::new(1);
        let p = catalog::step_path(f.primary(), NEW).join(BLOBS_DIR_NAME).join(BLOB_NAME);
        match variant {
            0 => fs::remove_file(&p).unwrap(),
            1 => flip_byte(&p, 3),
            _ => fs::write(&p, b"blob of step 20 and more").unwrap(),
        }
        let problems = f.verify(NEW);
        assert!(names_file(&problems, &blob_file), "variant {variant}: {problems:?}");
        let (out, json_problems) = f.assert_cli_verify_damaged();
        assert!(out.contains(&blob_file), "variant {variant}: {out}");
        assert!(json_names_file(&json_problems, &blob_file), "variant {variant}: {json_problems:?}");
        let why = f.assert_falls_back();
        assert!(why.contains(&blob_file), "variant {variant}: {why}");
        let (problems, _) = f.assert_new_refused();
        assert!(names_file(&problems, &blob_file), "variant {variant}: {problems:?}");
    }
}

#[test]
fn corrupted_index_makes_load_latest_fall_back() {
    type Damage = Box<dyn Fn(&[u8]) -> Vec<u8>>;
    let variants: Vec<(&str, Damage)> = vec![
        (
            "not JSON",
            Box::new(|b: &[u8]| {
                let mut v = b.to_vec();
                v[0] = b'x';
                v
            }),
        ),
        ("cut in half", Box::new(|b: &[u8]| b[..b.len() / 2].to_vec())),
        ("empty", Box::new(|_: &[u8]| Vec::new())),
        (
            "says another step",
            Box::new(|b: &[u8]| {
                let s = String::from_utf8(b.to_vec()).unwrap();
                let from = format!("\"step\": {NEW},");
                assert!(s.contains(&from), "index layout changed: {s}");
                s.replacen(&from, &format!("\"step\": {OLD},"), 1).into_bytes()
            }),
        ),
        (
            "a tensor checksum altered",
            Box::new(|b: &[u8]| {
                let mut idx = Index::from_json_bytes(b).unwrap();
                idx.ckpt.tensors.get_mut(TENSOR).unwrap().crc32c ^= 1;
                idx.to_json_bytes()
            }),
        ),
        (
            "a file length altered",
            Box::new(|b: &[u8]| {
                let mut idx = Index::from_json_bytes(b).unwrap();
                idx.ckpt.files[0].len_bytes += 1;
                idx.to_json_bytes()
            }),
        ),
    ];
    for (what, damage) in &variants {
        let f = Fixture::new(1);
        let p = catalog::step_path(f.primary(), NEW).join(INDEX_FILE_NAME);
        let bytes = fs::read(&p).unwrap();
        fs::write(&p, damage(&bytes)).unwrap();

        let problems = f.verify(NEW);
        assert!(!problems.is_empty(), "{what}: verify found nothing");
        let (_, json_problems) = f.assert_cli_verify_damaged();
        assert!(!json_problems.is_empty(), "{what}");
        let why = f.assert_falls_back();
        assert!(!why.is_empty(), "{what}");
        let (_, msg) = f.assert_new_refused();
        assert!(msg.contains(&NEW.to_string()), "{what}: {msg}");
        // `ls` still lists both, so that the damage can be seen.
        let CliRun { code, stdout: out, stderr: err } =
            cli(&["ls".as_ref(), f.primary().as_os_str(), "--json".as_ref()]);
        assert_eq!(code, 0, "{what}: ls: {err}");
        assert!(out.contains(&format!("\"step\":{NEW}")), "{what}: {out}");
    }
    // A broken index: the problem is the index itself.
    let f = Fixture::new(1);
    let p = catalog::step_path(f.primary(), NEW).join(INDEX_FILE_NAME);
    fs::write(&p, b"{\"metadata\":").unwrap();
    let problems = f.verify(NEW);
    assert!(names_file(&problems, INDEX_FILE_NAME), "{problems:?}");
    let (out, _) = f.assert_cli_verify_damaged();
    assert!(out.contains(INDEX_FILE_NAME), "{out}");
    let why = f.assert_falls_back();
    assert!(why.contains(INDEX_FILE_NAME), "{why}");
}

#[test]
fn flipped_byte_in_the_safetensors_header_is_caught() {
    let probe = Fixture::new(1);
    let (path0, file, _, _) = probe.locate(NEW, TENSOR);
    let json = header_json(&path0);
    let find = |needle: &str| -> u64 {
        let at = json
            .windows(needle.len())
            .position(|w| w == needle.as_bytes())
            .unwrap_or_else(|| panic!("{needle} not in the header"));
        8 + at as u64
    };
    let trailing_spaces = json.iter().rev().take_while(|&&b| b == b' ').count() as u64;
    let mut spots: Vec<(&str, u64, u8)> = vec![
        ("lowest byte of the header length", 0, 0x01),
        ("highest byte of the header length", 7, 0x01),
        ("opening brace", 8, 0x01),
        ("inside the tensor's name", find(TENSOR) + 6, 0x01),
        ("a digit of a data offset", find("\"data_offsets\":[") + 16, 0x01),
        ("dtype BF16 -> BF36", find("\"BF16\"") + 3, 0x02),
        ("__metadata__ value pt -> pu", find("\"pt\"") + 2, 0x01),
    ];
    if trailing_spaces > 0 {
        spots.push(("padding space -> '!'", data_start(&path0) - 1, 0x01));
        // Space to tab keeps the JSON valid and identical: only the file
        // checksum can see it.
        spots.push(("padding space -> tab", data_start(&path0) - 1, b' ' ^ b'\t'));
    }
    drop(probe);
    for (what, offset, mask) in spots {
        let f = Fixture::new(1);
        let path = f.shard_path(NEW, &file);
        xor_byte(&path, offset, mask);
        let problems = f.verify(NEW);
        assert!(names_file(&problems, &file), "{what}: verify does not name {file}: {problems:?}");
        let (out, _) = f.assert_cli_verify_damaged();
        assert!(out.contains(&file), "{what}: {out}");
        let why = f.assert_falls_back();
        assert!(why.contains(&file), "{what}: {why}");
        let (problems, _) = f.assert_new_refused();
        assert!(names_file(&problems, &file), "{what}: {problems:?}");
    }
}

/// Sampled sweep: a single flipped byte anywhere in a shard (header, every
/// tensor boundary, the last byte) is always caught, and flipping it back
/// makes the checkpoint whole again.
#[test]
fn any_single_flipped_byte_in_a_shard_is_caught() {
    let f = Fixture::new(1);
    let idx = f.index(NEW);
    let mut rng = 0x00DD_BA11_u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut checked = 0;
    for file in &idx.ckpt.files {
        let path = f.shard_path(NEW, &file.name);
        let ds = data_start(&path);
        let mut spots: Vec<u64> = (0..8).collect();
        spots.extend((0..24).map(|_| 8 + next() % (ds - 8)));
        for (_, t) in idx.tensors_of(&file.name) {
            spots.push(ds + t.data_offsets[0]);
            spots.push(ds + t.data_offsets[1] - 1);
        }
        spots.extend((0..8).map(|_| ds + next() % (file.len_bytes - ds)));
        spots.push(file.len_bytes - 1);
        for at in spots {
            let mask = 1u8 << (next() % 8);
            xor_byte(&path, at, mask);
            // load checks every byte as verify does (same reader), and is
            // cheaper for a small checkpoint; verify too on every 8th spot.
            match f.load(Which::Step(NEW)) {
                Ok(_) => panic!("{} byte {at} ^ {mask:#04x}: loaded anyway", file.name),
                Err(LoadError::Damaged { problems, .. }) => {
                    assert!(names_file(&problems, &file.name), "{} byte {at} ^ {mask:#04x}: {problems:?}", file.name)
                }
                Err(e) => panic!("{} byte {at} ^ {mask:#04x}: expected Damaged, got {e}", file.name),
            }
            if checked % 8 == 0 {
                let problems = f.verify(NEW);
                assert!(
                    names_file(&problems, &file.name),
                    "{} byte {at} ^ {mask:#04x}: verify: {problems:?}",
                    file.name
                );
            }
            xor_byte(&path, at, mask);
            checked += 1;
        }
    }
    assert!(f.verify(NEW).is_empty());
    assert_eq!(f.load(Which::Latest).expect("load").step, NEW);
    eprintln!("{checked} single-byte flips, all caught");
}

#[test]
fn every_checkpoint_damaged_means_an_error_not_garbage() {
    let f = Fixture::new(1);
    for step in [OLD, NEW] {
        let (path, _, start, _) = f.locate(step, TENSOR);
        flip_byte(&path, start);
    }
    match f.load(Which::Latest) {
        Ok(l) => panic!("loaded step {} although every checkpoint is damaged", l.step),
        Err(e @ LoadError::NoneLoads { .. }) => {
            // Each step tried, newest first, and why it failed.
            let LoadError::NoneLoads { tried, shared, .. } = &e else { unreachable!() };
            assert_eq!(tried.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![NEW, OLD], "{e}");
            assert!(tried.iter().all(|(_, why)| why.contains(TENSOR)), "{e}");
            assert!(shared.is_none(), "no file is shared: {e}");
            let said = e.to_string();
            assert!(said.contains("no committed step loads") && said.contains(&format!("step {NEW}: ")), "{said}");
        }
        Err(e) => panic!("expected NoneLoads, got {e:?}"),
    }
    let CliRun { code, stdout: out, .. } = cli(&["verify".as_ref(), f.primary().as_os_str()]);
    assert_eq!(code, EXIT_DAMAGED);
    assert!(out.contains(&format!("step {OLD}: DAMAGED")) && out.contains(&format!("step {NEW}: DAMAGED")), "{out}");
}

/// The index has no checksum of its own: every field is cross-checked
/// against the shards except a few, so a single flipped byte in one of those
/// goes unseen. `world_size` "1" -> "3" is one flipped bit (0x31 ^ 0x02);
/// `verify` says ok and `load` hands out an index that claims three ranks
/// wrote the checkpoint, although the shard names say one.
#[test]
fn flipped_byte_in_index_world_size_is_caught() {
    let f = Fixture::new(1);
    let p = catalog::step_path(f.primary(), NEW).join(INDEX_FILE_NAME);
    let bytes = fs::read(&p).unwrap();
    let at = bytes.windows(15).position(|w| w == b"\"world_size\": 1").expect("world_size in the index") + 14;
    xor_byte(&p, at as u64, 0x02);
    assert!(!f.verify(NEW).is_empty(), "verify finds nothing wrong with a flipped index byte");
    assert!(f.load(Which::Step(NEW)).is_err(), "load accepts a flipped index byte");
}

/// `ls` runs the cheap checks (files present, sizes) and marks a step that
/// fails them, in its text and in `--json`; a flipped byte it does not
/// read, and it says so.
#[test]
fn ls_marks_a_step_with_a_missing_or_resized_file_and_says_what_it_checked() {
    let f = Fixture::new(2);
    let new_shard = f.index(NEW).ckpt.files.iter().find(|x| x.dir_idx == 1).expect("a shard on disk1").name.clone();
    fs::remove_file(f.shard_path(NEW, &new_shard)).unwrap();
    let old_shard = f.index(OLD).ckpt.files[0].name.clone();
    OpenOptions::new().append(true).open(f.shard_path(OLD, &old_shard)).unwrap().write_all(b"x").unwrap();
    let CliRun { code, stdout, stderr } = cli(&["ls".as_ref(), f.primary().as_os_str(), "--json".as_ref()]);
    assert_eq!(code, 0, "{stderr}");
    let j: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let row = |step: u64| j["checkpoints"].as_array().unwrap().iter().find(|r| r["step"] == step).unwrap().clone();
    assert_eq!(row(NEW)["damaged"], true, "{j}");
    let damage = row(NEW)["damage"].to_string();
    assert!(damage.contains(&new_shard) && damage.contains("missing"), "{damage}");
    assert_eq!(row(OLD)["damaged"], true, "{j}");
    assert!(row(OLD)["damage"].to_string().contains("where the index says"), "{j}");
    assert!(j["checked"].as_str().unwrap().contains("present"), "{j}");
    assert!(j["not_checked"].as_str().unwrap().contains("checksums"), "{j}");
    let CliRun { code, stdout, .. } = cli(&["ls".as_ref(), f.primary().as_os_str()]);
    assert_eq!(code, 0);
    let line =
        |step: u64| stdout.lines().find(|l| l.trim_start().starts_with(&format!("{step} "))).unwrap().to_string();
    assert!(line(NEW).contains("DAMAGED") && line(NEW).contains(&new_shard), "{stdout}");
    assert!(line(OLD).contains("DAMAGED"), "{stdout}");
    assert!(stdout.contains("not checked: contents"), "{stdout}");
    // A flipped byte: not found by ls (it reads no byte), found by verify.
    let f = Fixture::new(1);
    let (path, _, at, _) = f.locate(NEW, TENSOR);
    flip_byte(&path, at);
    let CliRun { stdout, .. } = cli(&["ls".as_ref(), f.primary().as_os_str(), "--json".as_ref()]);
    let j: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(j["checkpoints"].as_array().unwrap().iter().all(|r| r["damaged"] == false), "{j}");
}
