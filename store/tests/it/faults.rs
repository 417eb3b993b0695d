//! Failure semantics of a commit (DESIGN.md, "Failure semantics": disk full,
//! EIO): the checkpoint fails with a clear error, its temp folder is gone,
//! every earlier checkpoint is intact and `latest` still names it, and the
//! same `Store` keeps serving. Short writes are completed, byte-exactly.
//!
//! Disk full runs on a real small file system: a 64 MiB ext4 image mounted
//! over a loop device (root), else a 64 MiB tmpfs; without either the test
//! prints `skipped: <reason>`. EIO and short writes are injected with
//! `StoreOptions::faults` into the real engines. Every case runs with both
//! engines (io_uring, thread pool) and with O_DIRECT on and off.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use ckpt_store::catalog;
use ckpt_store::commit::{CommitError, Store, StoreOptions};
use ckpt_store::format::{self, TMP_PREFIX};
use ckpt_store::image::{Blob, Layout, LayoutOptions};
use ckpt_store::io::{FaultPlan, IoPolicy, ProbeError, Want};
use ckpt_store::mem::{AlignedBuf, RawBuf};
use ckpt_store::progress::Progress;
use ckpt_store::restore::{self, ReadOptions, Which};
use ckpt_store::synthetic;

const MIB: u64 = 1 << 20;

// ------------------------------------------------------------------ helpers

/// A staged synthetic checkpoint: layout, image and tensor checksums.
struct Staged {
    layout: Layout,
    staging: AlignedBuf,
    crcs: Vec<u32>,
}

fn stage(size_bytes: u64, n_dirs: usize, shard_bytes_max: u64, seed: u64) -> Staged {
    let layout = Layout::plan(
        synthetic::transformer_specs(size_bytes),
        LayoutOptions { n_dirs, shard_bytes_max, ..Default::default() },
    )
    .expect("plan the synthetic layout");
    let mut staging = AlignedBuf::new(layout.staging_len as usize).expect("staging memory");
    let crcs = synthetic::stage(&layout, staging.as_mut_slice(), seed);
    Staged { layout, staging, crcs }
}

fn policy(uring: Want, direct: Want) -> IoPolicy {
    IoPolicy { uring, direct, queue_depth: 0 }
}

/// Every (engine, O_DIRECT) combination, with a label.
fn combos() -> Vec<(&'static str, IoPolicy)> {
    vec![
        ("io_uring+O_DIRECT", policy(Want::On, Want::On)),
        ("io_uring+buffered", policy(Want::On, Want::Off)),
        ("thread-pool+O_DIRECT", policy(Want::Off, Want::On)),
        ("thread-pool+buffered", policy(Want::Off, Want::Off)),
    ]
}

/// Opens a store, or None (printing `skipped: …`) when the machine refuses
/// the forced engine (io_uring under a seccomp profile, O_DIRECT on a file
/// system without it); any other error fails the test.
fn open_store(opts: StoreOptions, label: &str) -> Option<Store> {
    match Store::open(opts) {
        Ok(s) => {
            assert_eq!(s.engine_names(), label, "the forced engine is the one in use");
            Some(s)
        }
        Err(ckpt_store::commit::StoreError::Probe(e @ ProbeError::Io { .. }))
            if e.to_string().contains("required but refused") =>
        {
            println!("skipped {label}: {e}");
            None
        }
        Err(e) => panic!("{label}: opening the store: {e}"),
    }
}

fn commit(store: &mut Store, step: u64, s: &Staged, blobs: &[Blob<'_>]) -> Result<(), CommitError> {
    store.commit(step, &s.layout, &s.staging, &s.crcs, blobs).map(|r| assert_eq!(r.step, step))
}

/// Names in `dir` that start with the temp-folder prefix.
fn temp_leftovers(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(TMP_PREFIX))
        .collect()
}

fn latest_name(dir: &Path) -> Option<String> {
    catalog::read_latest(dir).unwrap()
}

/// The checkpoint verifies (every byte against its checksum) and loads back
/// with exactly the staged tensor bytes.
fn assert_intact(primary: &Path, step: u64, s: &Staged, io: IoPolicy, ctx: &str) {
    let opts = ReadOptions { io, ..Default::default() };
    let r =
        restore::verify(primary, step, &opts, |_, _| {}).unwrap_or_else(|e| panic!("{ctx}: verify step {step}: {e}"));
    assert!(r.problems.is_empty(), "{ctx}: step {step} damaged: {:?}", r.problems);
    assert_eq!(r.tensors, s.layout.specs.len(), "{ctx}");
    assert_eq!(r.bytes, s.layout.file_bytes(), "{ctx}");
    let loaded = restore::load(primary, Which::Step(step), &opts, None)
        .unwrap_or_else(|e| panic!("{ctx}: load step {step}: {e}"));
    for (i, spec) in s.layout.specs.iter().enumerate() {
        let got = loaded.tensor(&spec.name).unwrap_or_else(|| panic!("{ctx}: tensor {} missing", spec.name));
        assert!(
            got == &s.staging.as_slice()[s.layout.tensor_range(i)],
            "{ctx}: tensor {} differs from what was staged",
            spec.name
        );
    }
}

/// After a failed commit of `failed_step`: no temp folder anywhere, no folder
/// of the failed step, `latest` still names `good_step`, which is intact.
fn assert_nothing_left(dirs: &[PathBuf], failed_step: u64, good_step: u64, good: &Staged, io: IoPolicy, ctx: &str) {
    for d in dirs {
        assert_eq!(temp_leftovers(d), Vec::<String>::new(), "{ctx}: temp folder left in {}", d.display());
        assert!(
            !catalog::step_path(d, failed_step).exists(),
            "{ctx}: folder of the failed step {failed_step} in {}",
            d.display()
        );
    }
    assert!(!catalog::is_committed(&dirs[0], failed_step), "{ctx}");
    assert_eq!(
        latest_name(&dirs[0]).as_deref(),
        Some(format::step_dir_name(good_step).unwrap().as_str()),
        "{ctx}: latest moved"
    );
    assert_eq!(catalog::latest_step(&dirs[0]).unwrap(), Some(good_step), "{ctx}");
    assert_intact(&dirs[0], good_step, good, io, ctx);
}

// ------------------------------------------------------- small file systems

/// A small file system mounted on a temp dir, unmounted on drop (also when a
/// test panics).
struct SmallFs {
    mnt: PathBuf,
    kind: &'static str,
    // Dropped after `drop` has unmounted: holds the image and the mount point.
    _holder: tempfile::TempDir,
}

impl SmallFs {
    const SIZE_MIB: u64 = 64;

    /// ext4 on a loop device, else tmpfs; Err says why neither could be had.
    fn mount() -> Result<SmallFs, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: cannot mount a small file system".into());
        }
        let holder = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
        let mnt = holder.path().join("mnt");
        fs::create_dir(&mnt).map_err(|e| format!("mkdir: {e}"))?;
        let img = holder.path().join("fs.img");
        let run = |cmd: &mut Command| -> Result<(), String> {
            match cmd.output() {
                Ok(o) if o.status.success() => Ok(()),
                Ok(o) => Err(format!("{cmd:?}: {} {}", o.status, String::from_utf8_lossy(&o.stderr).trim())),
                Err(e) => Err(format!("{cmd:?}: {e}")),
            }
        };
        let ext4 = run(Command::new("truncate").arg("-s").arg(format!("{}M", Self::SIZE_MIB)).arg(&img))
            .and_then(|()| run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img)))
            .and_then(|()| run(Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&mnt)));
        match ext4 {
            Ok(()) => {
                let _ = fs::remove_file(&img).ok(); // the loop device keeps it open
                return Ok(SmallFs { mnt, kind: "ext4 on a loop device", _holder: holder });
            }
            Err(e) => println!("ext4 image not mountable ({e}); trying tmpfs"),
        }
        let _ = fs::remove_file(&img);
        run(Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={}m", Self::SIZE_MIB), "tmpfs"]).arg(&mnt))
            .map(|()| SmallFs { mnt, kind: "tmpfs", _holder: holder })
            .map_err(|e| format!("neither an ext4 loop mount nor a tmpfs could be mounted: {e}"))
    }

    fn free_bytes(&self) -> u64 {
        let c = std::ffi::CString::new(self.mnt.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: statvfs is plain data; all zeroes is a valid value of it.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: statvfs fills the struct we pass; the path is NUL-terminated.
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
        // Root may use the reserved blocks too: f_bfree, not f_bavail.
        st.f_bfree as u64 * st.f_frsize as u64
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let ok = Command::new("umount").arg(&self.mnt).status().is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
    }
}

// ------------------------------------------------------------------ disk full

/// For one engine combination on a fresh small file system: a small
/// checkpoint commits; one larger than the free space fails at the space
/// reservation with DiskFull; one whose shards fit but whose blob does not
/// fails after the shard writes (fallocate succeeded), also with DiskFull;
/// after each, nothing is left behind and the store commits again.
fn disk_full_case(label: &str, io: IoPolicy) {
    let fs_ = match SmallFs::mount() {
        Ok(f) => f,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    let ctx = format!("{label} on {}", fs_.kind);
    println!("{ctx}: {} bytes free", fs_.free_bytes());
    let dir = fs_.mnt.join("ckpt");
    let Some(mut store) = open_store(StoreOptions { io, ..StoreOptions::new(vec![dir.clone()]) }, label) else {
        return;
    };
    let dirs = store.dirs().to_vec();

    let small = stage(4 * MIB, 1, 1 << 30, 1);
    commit(&mut store, 1, &small, &[]).unwrap_or_else(|e| panic!("{ctx}: first small commit: {e}"));

    // 1. Far too big: the reservation (fallocate) of the shard runs out.
    let big = stage(80 * MIB, 1, 1 << 30, 2);
    assert!(big.layout.file_bytes() > fs_.free_bytes(), "{ctx}: the big checkpoint must not fit");
    let err = commit(&mut store, 2, &big, &[]).expect_err("a checkpoint bigger than the disk must fail");
    let text = err.to_string();
    println!("{ctx}: {text}");
    match &err {
        CommitError::DiskFull { needed_bytes, source, .. } => {
            assert!(
                needed_bytes.is_some_and(|n| n > 0),
                "{ctx}: DiskFull at the reservation says what it needed: {text}"
            );
            assert!(matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)), "{ctx}: {source:?}");
        }
        other => panic!("{ctx}: expected DiskFull, got {other:?}"),
    }
    assert!(text.contains("disk full"), "{ctx}: {text}");
    assert_nothing_left(&dirs, 2, 1, &small, io, &ctx);

    // The sidecar keeps serving: the next small checkpoint commits.
    let small3 = stage(4 * MIB, 1, 1 << 30, 3);
    commit(&mut store, 3, &small3, &[]).unwrap_or_else(|e| panic!("{ctx}: small commit after disk full: {e}"));
    assert_eq!(catalog::latest_step(&dirs[0]).unwrap(), Some(3), "{ctx}");
    assert_intact(&dirs[0], 3, &small3, io, &ctx);

    // 2. The shards fit (fallocate succeeds, data written and synced) but the
    //    blob written after them does not: space runs out mid-commit.
    let free = fs_.free_bytes();
    let blob = vec![0x5au8; (free + 8 * MIB) as usize];
    let small4 = stage(4 * MIB, 1, 1 << 30, 4);
    assert!(small4.layout.file_bytes() + 4 * MIB < free, "{ctx}: the shards alone must fit");
    let err = commit(&mut store, 4, &small4, &[Blob { name: "optimizer", bytes: &blob }])
        .expect_err("a blob bigger than the free space must fail");
    let text = err.to_string();
    println!("{ctx}: {text}");
    assert!(matches!(err, CommitError::DiskFull { .. }), "{ctx}: expected DiskFull, got {err:?}");
    assert!(text.contains("disk full") && text.contains("optimizer"), "{ctx}: {text}");
    assert_nothing_left(&dirs, 4, 3, &small3, io, &ctx);
    // Everything the failed commit took is given back.
    assert!(fs_.free_bytes() + MIB >= free, "{ctx}: space not returned ({} free, {free} before)", fs_.free_bytes());

    // And it still serves, with a blob that fits.
    let small5 = stage(4 * MIB, 1, 1 << 30, 5);
    commit(&mut store, 5, &small5, &[Blob { name: "optimizer", bytes: b"fits" }])
        .unwrap_or_else(|e| panic!("{ctx}: commit after the blob failure: {e}"));
    assert_intact(&dirs[0], 5, &small5, io, &ctx);
    // The earlier good checkpoints were never touched.
    assert_intact(&dirs[0], 1, &small, io, &ctx);
    assert_eq!(catalog::committed_steps(&dirs[0]).unwrap(), vec![1, 3, 5], "{ctx}");
    assert_eq!(catalog::latest_step(&dirs[0]).unwrap(), Some(5), "{ctx}");
}

#[test]
fn disk_full_with_io_uring() {
    for (label, io) in combos().into_iter().filter(|(_, p)| p.uring == Want::On) {
        disk_full_case(label, io);
    }
}

#[test]
fn disk_full_with_thread_pool() {
    for (label, io) in combos().into_iter().filter(|(_, p)| p.uring == Want::Off) {
        disk_full_case(label, io);
    }
}

// ------------------------------------------------------------------ EIO

/// The shard and offset of the `n`-th write the driver issues for the
/// primary directory (no short writes: chunks go out in file order).
fn nth_write(layout: &Layout, dir_idx: u32, direct: bool, chunk_bytes: u64, n: u64) -> (String, u64) {
    let mut k = 0;
    for sh in layout.shards.iter().filter(|s| s.dir_idx == dir_idx) {
        let len = if direct { sh.io_len } else { sh.file_len };
        let mut off = 0;
        while off < len {
            if k == n {
                return (sh.file_name.clone(), off);
            }
            k += 1;
            off += chunk_bytes.min(len - off);
        }
    }
    panic!("fewer than {} writes", n + 1);
}

fn eio_case(label: &str, io: IoPolicy, n_dirs: usize) {
    let ctx = format!("{label}, {n_dirs} dir(s)");
    let root = tempfile::tempdir().unwrap();
    let dirs_in: Vec<PathBuf> = (0..n_dirs).map(|i| root.path().join(format!("d{i}"))).collect();
    let chunk = 256 << 10;
    // Step 1 through a clean store; the fault plan counts writes per engine
    // for its whole life, so the faulty store starts from zero at step 2.
    let good = stage(8 * MIB, n_dirs, 2 * MIB, 1);
    {
        let Some(mut clean) =
            open_store(StoreOptions { io, chunk_bytes: chunk, ..StoreOptions::new(dirs_in.clone()) }, label)
        else {
            return;
        };
        commit(&mut clean, 1, &good, &[Blob { name: "meta", bytes: b"one" }])
            .unwrap_or_else(|e| panic!("{ctx}: clean commit: {e}"));
    }
    let s2 = stage(8 * MIB, n_dirs, 2 * MIB, 2);
    assert!(s2.layout.shards.len() >= 2 * n_dirs, "{ctx}: several shards per directory");
    let n = 9; // past the first shard of the primary (2 MiB shards, 256 KiB chunks)
    let faults = FaultPlan { fail_write_n: Some((n, libc::EIO)), ..Default::default() };
    let mut store =
        open_store(StoreOptions { io, chunk_bytes: chunk, faults: Some(faults), ..StoreOptions::new(dirs_in) }, label)
            .unwrap();
    let dirs = store.dirs().to_vec();
    let direct = store.targets()[0].choice.direct;
    let (shard, offset) = nth_write(&s2.layout, 0, direct, chunk as u64, n);
    let err = commit(&mut store, 2, &s2, &[Blob { name: "meta", bytes: b"two" }])
        .expect_err("an injected EIO must fail the commit");
    let text = err.to_string();
    println!("{ctx}: {text}");
    assert!(matches!(err, CommitError::Io { .. }), "{ctx}: EIO is not disk full: {err:?}");
    assert!(text.contains("Input/output error"), "{ctx}: {text}");
    if n_dirs == 1 {
        // Only one engine: the failing write is known exactly.
        assert_ne!(shard, s2.layout.shards[0].file_name, "{ctx}: the fault is meant for a later shard");
        assert!(text.contains(&shard), "{ctx}: names the shard {shard}: {text}");
        assert!(text.contains(&format!("offset {offset}")), "{ctx}: names the offset {offset}: {text}");
    } else {
        // Both engines fail their n-th write; whichever is reported, it names a shard file.
        assert!(s2.layout.shards.iter().any(|sh| text.contains(&sh.file_name)), "{ctx}: names a shard: {text}");
    }
    assert_nothing_left(&dirs, 2, 1, &good, io, &ctx);
    assert_eq!(
        restore::load(&dirs[0], Which::Latest, &ReadOptions { io, ..Default::default() }, None).unwrap().step,
        1,
        "{ctx}"
    );

    // The same store keeps serving (its n-th write is behind it).
    let s3 = stage(8 * MIB, n_dirs, 2 * MIB, 3);
    commit(&mut store, 3, &s3, &[]).unwrap_or_else(|e| panic!("{ctx}: commit after EIO: {e}"));
    assert_eq!(catalog::latest_step(&dirs[0]).unwrap(), Some(3), "{ctx}");
    assert_intact(&dirs[0], 3, &s3, io, &ctx);
    assert_intact(&dirs[0], 1, &good, io, &ctx);
}

#[test]
fn injected_eio_fails_the_commit_and_leaves_nothing() {
    for (label, io) in combos() {
        eio_case(label, io, 1);
    }
}

#[test]
fn injected_eio_with_two_directories() {
    for (label, io) in combos().into_iter().filter(|(_, p)| p.direct == Want::On) {
        eio_case(label, io, 2);
    }
}

/// An EIO on the first write of all (before anything reached the disk).
#[test]
fn injected_eio_on_the_first_write() {
    for (label, io) in combos() {
        let root = tempfile::tempdir().unwrap();
        let faults = FaultPlan { fail_write_n: Some((0, libc::EIO)), ..Default::default() };
        let Some(mut store) = open_store(
            StoreOptions { io, faults: Some(faults), ..StoreOptions::new(vec![root.path().join("d")]) },
            label,
        ) else {
            continue;
        };
        let dirs = store.dirs().to_vec();
        let s = stage(2 * MIB, 1, 1 << 30, 1);
        let err = commit(&mut store, 1, &s, &[]).expect_err("EIO must fail the commit");
        assert!(
            err.to_string().contains("Input/output error") && err.to_string().contains(&s.layout.shards[0].file_name),
            "{label}: {err}"
        );
        assert_eq!(temp_leftovers(&dirs[0]), Vec::<String>::new(), "{label}");
        assert_eq!(catalog::committed_steps(&dirs[0]).unwrap(), Vec::<u64>::new(), "{label}");
        assert_eq!(latest_name(&dirs[0]), None, "{label}: no latest without a checkpoint");
        commit(&mut store, 1, &s, &[]).unwrap_or_else(|e| panic!("{label}: retry of the same step: {e}"));
        assert_intact(&dirs[0], 1, &s, io, label);
    }
}

// ------------------------------------------------------------------ short writes

fn short_writes_case(label: &str, io: IoPolicy, s: &Staged, chunk_bytes: usize) {
    let root = tempfile::tempdir().unwrap();
    let faults = FaultPlan { short_writes: true, ..Default::default() };
    let Some(mut store) = open_store(
        StoreOptions { io, chunk_bytes, faults: Some(faults), ..StoreOptions::new(vec![root.path().join("d")]) },
        label,
    ) else {
        return;
    };
    let dirs = store.dirs().to_vec();
    commit(&mut store, 7, s, &[Blob { name: "meta", bytes: b"short" }])
        .unwrap_or_else(|e| panic!("{label}: commit with short writes: {e}"));
    for sh in &s.layout.shards {
        let len = fs::metadata(catalog::step_path(&dirs[0], 7).join(&sh.file_name)).unwrap().len();
        assert_eq!(len, sh.file_len, "{label}: {} has its exact length", sh.file_name);
    }
    assert_intact(&dirs[0], 7, s, io, label);
}

/// Short writes under O_DIRECT (every request a whole number of blocks).
#[test]
fn short_writes_are_completed_with_direct() {
    let s = stage(8 * MIB, 1, 3 * MIB, 11);
    for (label, io) in combos().into_iter().filter(|(_, p)| p.direct == Want::On) {
        short_writes_case(label, io, &s, 1 << 20);
    }
}

/// Short writes of buffered files whose lengths are whole blocks (so no
/// request has a partial-block tail).
#[test]
fn short_writes_are_completed_buffered_aligned_files() {
    // Tensor bytes in whole blocks and the header padded to a block, so every
    // shard file is a whole number of blocks long.
    use ckpt_store::format::Dtype;
    use ckpt_store::image::TensorSpec;
    let specs: Vec<TensorSpec> =
        (0..12).map(|i| TensorSpec::new(format!("w.{i}"), Dtype::BF16, &[256 + 64 * i, 1024])).collect();
    let layout = Layout::plan(specs, LayoutOptions { shard_bytes_max: 3 * MIB, ..Default::default() }).unwrap();
    assert!(layout.shards.iter().all(|sh| sh.file_len == sh.io_len), "whole-block files");
    let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
    let crcs = synthetic::stage(&layout, staging.as_mut_slice(), 12);
    let s = Staged { layout, staging, crcs };
    for (label, io) in combos().into_iter().filter(|(_, p)| p.direct == Want::Off) {
        short_writes_case(label, io, &s, 1 << 20);
    }
}

/// Short writes of buffered files of any length: the synthetic state's
/// shards end in a partial block. Regression: the fault hook once cut
/// 4097..=8191-byte writes to 0 bytes, so buffered commits failed with
/// "made no progress".
#[test]
fn short_writes_are_completed_buffered_any_length() {
    let s = stage(8 * MIB, 1, 3 * MIB, 13);
    assert!(s.layout.shards.iter().any(|sh| sh.file_len % 4096 != 0), "some shard ends in a partial block");
    for (label, io) in combos().into_iter().filter(|(_, p)| p.direct == Want::Off) {
        short_writes_case(label, io, &s, 1 << 20);
    }
}

// ------------------------------------------------------------ fed commits

/// A filler copies `src`'s image into `dst` run by run, in the order given,
/// marking each run done; then finishes with the checksums, or after
/// `fail_after` runs fails instead.
fn fill(
    progress: &Progress,
    src: &Staged,
    dst: usize,
    runs: &[(usize, usize)],
    order: &[usize],
    fail_after: Option<usize>,
) {
    for (n, &r) in order.iter().enumerate() {
        if fail_after == Some(n) {
            progress.fail("the test's filler gave up".into());
            return;
        }
        // Paced like a real copy, so the writer is already waiting on the
        // prefix (a gate that let it run ahead would be caught); correctness
        // never depends on it.
        std::thread::sleep(std::time::Duration::from_millis(3));
        let (a, b) = runs[r];
        // SAFETY: dst is the address of a live buffer of at least staging_len
        // bytes, this run's range is written by this thread only, and the
        // writer reads it only after done(r).
        unsafe { std::ptr::copy_nonoverlapping(src.staging.as_ptr().add(a), (dst as *mut u8).add(a), b - a) };
        progress.done(r);
    }
    progress.finish(src.crcs.clone());
}

#[test]
fn a_fed_commit_writes_only_filled_bytes_and_a_failed_filler_leaves_nothing() {
    for (label, io) in combos() {
        let dir = tempfile::tempdir().unwrap();
        let dirs = vec![dir.path().join("a"), dir.path().join("b")];
        let Some(mut store) =
            open_store(StoreOptions { io, chunk_bytes: 256 << 10, ..StoreOptions::new(dirs.clone()) }, label)
        else {
            continue;
        };
        let src = stage(24 * MIB, 2, 8 * MIB, 5);
        // The image's bytes in runs of 1 MiB after the first shard's header
        // (headers come with the image: copied first, ready at once).
        let first = src.layout.shard_range(0).start + 4096;
        let end = src.layout.staging_len as usize;
        let runs: Vec<(usize, usize)> =
            (first..end).step_by(MIB as usize).map(|a| (a, (a + MIB as usize).min(end))).collect();
        // Filled out of order (1, 0, 3, 2, ...): a chunk written before its
        // bytes were copied would carry 0xAA and fail the verification.
        let n = runs.len();
        let order: Vec<usize> = (0..n)
            .map(|i| {
                if i % 2 == 1 {
                    i - 1
                } else if i + 1 < n {
                    i + 1
                } else {
                    i
                }
            })
            .collect();
        let ctx = format!("{label}, fed");
        for (step, fail_after) in [(1u64, None), (2, Some(runs.len() / 2))] {
            let mut dst = AlignedBuf::new(end).unwrap();
            dst.as_mut_slice().fill(0xAA);
            dst.as_mut_slice()[..first].copy_from_slice(&src.staging.as_slice()[..first]);
            // Shared from here on: the filler writes it while the store reads it.
            let dst = RawBuf::from(dst);
            let progress = Progress::new(runs.iter().map(|r| r.0 as u64).collect(), end as u64);
            let dst_addr = dst.as_ptr() as usize;
            let r = std::thread::scope(|s| {
                s.spawn(|| fill(&progress, &src, dst_addr, &runs, &order, fail_after));
                store.commit_fed(step, &src.layout, &dst, &progress, &[Blob { name: "b", bytes: b"blob" }])
            });
            match fail_after {
                None => {
                    r.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    assert_intact(&dirs[0], 1, &src, io, &ctx);
                }
                Some(_) => {
                    let e = r.unwrap_err();
                    assert!(
                        matches!(e, CommitError::Unfilled { step: 2, .. }) && e.to_string().contains("gave up"),
                        "{ctx}: {e}"
                    );
                    assert_nothing_left(&dirs, 2, 1, &src, io, &ctx);
                }
            }
        }
    }
}

/// A rank's part of several nodes written while it is filled
/// (`Store::write_rank_part_fed`): only copied bytes reach the disk (the
/// image is filled out of order, paced, into a buffer of 0xAA: a chunk
/// written before its bytes were copied fails the load of the committed
/// step), the marker comes after the filler's checksums; a filler that
/// fails leaves no file of the rank and no marker.
#[test]
fn a_fed_rank_part_writes_only_filled_bytes_and_a_failed_filler_leaves_no_marker() {
    let part = |rank: u32, prefix: &str, seed: u64| {
        let specs = synthetic::transformer_specs(12 * MIB)
            .into_iter()
            .map(|mut s| {
                s.name = format!("{prefix}{}", s.name);
                s
            })
            .collect();
        let layout =
            Layout::plan(specs, LayoutOptions { rank, world_size: 2, shard_bytes_max: 4 * MIB, ..Default::default() })
                .unwrap();
        let mut staging = AlignedBuf::new(layout.staging_len as usize).unwrap();
        let crcs = synthetic::stage(&layout, staging.as_mut_slice(), seed);
        Staged { layout, staging, crcs }
    };
    let (r0, r1) = (part(0, "", 21), part(1, "r1.", 22));
    let first = r0.layout.shard_range(0).start + 4096;
    let end = r0.layout.staging_len as usize;
    let runs: Vec<(usize, usize)> =
        (first..end).step_by(MIB as usize).map(|a| (a, (a + MIB as usize).min(end))).collect();
    let n = runs.len();
    let order: Vec<usize> = (0..n)
        .map(|i| {
            if i % 2 == 1 {
                i - 1
            } else if i + 1 < n {
                i + 1
            } else {
                i
            }
        })
        .collect();
    for (label, io) in combos() {
        let dir = tempfile::tempdir().unwrap();
        let shared = dir.path().join("shared");
        fs::create_dir(&shared).unwrap();
        let opts = StoreOptions {
            io,
            chunk_bytes: 256 << 10,
            shared: Some(shared.clone()),
            ..StoreOptions::new(vec![dir.path().join("own")])
        };
        let Some(mut store) = open_store(opts, label) else { continue };
        let ctx = format!("{label}, fed rank part");
        for (step, fail_after) in [(1u64, None), (2, Some(n / 2))] {
            let mut dst = AlignedBuf::new(end).unwrap();
            dst.as_mut_slice().fill(0xAA);
            dst.as_mut_slice()[..first].copy_from_slice(&r0.staging.as_slice()[..first]);
            // Shared from here on: the filler writes it while the store reads it.
            let dst = RawBuf::from(dst);
            let progress = Progress::new(runs.iter().map(|r| r.0 as u64).collect(), end as u64);
            let dst_addr = dst.as_ptr() as usize;
            let r = std::thread::scope(|s| {
                s.spawn(|| fill(&progress, &r0, dst_addr, &runs, &order, fail_after));
                store.write_rank_part_fed(step, &r0.layout, &dst, &progress, &[], &[])
            });
            let tmp = ckpt_store::nodes::ranks_tmp_path(&shared, step).unwrap();
            match fail_after {
                None => {
                    r.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    store
                        .write_rank_part(step, &r1.layout, &r1.staging, &r1.crcs, &[], &[])
                        .unwrap_or_else(|e| panic!("{ctx}: rank 1: {e}"));
                    assert_eq!(store.ranks_missing(step, 2).unwrap(), Vec::<u32>::new(), "{ctx}: both markers in");
                    store.commit_ranks(step, 2).unwrap_or_else(|e| panic!("{ctx}: commit: {e}"));
                    let ropts = ReadOptions { io, ..Default::default() };
                    let v = restore::verify(&shared, step, &ropts, |_, _| {})
                        .unwrap_or_else(|e| panic!("{ctx}: verify: {e}"));
                    assert!(v.problems.is_empty(), "{ctx}: damaged: {:?}", v.problems);
                    let loaded = restore::load(&shared, Which::Step(step), &ropts, None)
                        .unwrap_or_else(|e| panic!("{ctx}: load: {e}"));
                    for s in [&r0, &r1] {
                        for (i, spec) in s.layout.specs.iter().enumerate() {
                            let got = loaded
                                .tensor(&spec.name)
                                .unwrap_or_else(|| panic!("{ctx}: tensor {} missing", spec.name));
                            assert!(
                                got == &s.staging.as_slice()[s.layout.tensor_range(i)],
                                "{ctx}: tensor {} differs from what was staged",
                                spec.name
                            );
                        }
                    }
                }
                Some(_) => {
                    let e = r.unwrap_err();
                    assert!(
                        matches!(e, CommitError::Unfilled { step: 2, .. }) && e.to_string().contains("gave up"),
                        "{ctx}: {e}"
                    );
                    assert_eq!(store.ranks_missing(step, 2).unwrap(), vec![0, 1], "{ctx}: no marker");
                    let left: Vec<String> = fs::read_dir(&tmp)
                        .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
                        .unwrap_or_default();
                    assert_eq!(left, Vec::<String>::new(), "{ctx}: the failed rank's files are gone");
                }
            }
        }
    }
}
