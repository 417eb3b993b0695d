//! The store's integration tests, one test binary (rust-analyzer's
//! `tests/it` layout): the format pinned by golden files, injected faults
//! during a commit, reading back edge-shaped checkpoints, sliced tensors,
//! incremental commits comparing with the right step, several nodes' parts
//! and their coordinator's commit.
//!
//! Run one module with `cargo test --release -p ckpt-store --test it faults::`.

mod faults;
mod golden;
mod incremental;
mod nodes;
mod restore;
mod slices;

/// A staged image of `l` with tensor `i` filled from seed `seeds[i]`
/// (`synthetic::fill`), with its tensors' checksums and digests: what an
/// incremental commit of it is given.
fn staged(l: &ckpt_store::image::Layout, seeds: &[u64]) -> (ckpt_store::mem::AlignedBuf, Vec<u32>, Vec<u128>) {
    assert_eq!(seeds.len(), l.specs.len(), "a seed per tensor");
    let mut staging = ckpt_store::mem::AlignedBuf::new(l.staging_len as usize).unwrap();
    let st = staging.as_mut_slice();
    l.write_headers(st);
    for (i, &seed) in seeds.iter().enumerate() {
        ckpt_store::synthetic::fill(&mut st[l.tensor_range(i)], seed);
    }
    let crcs = l.tensor_crcs(st);
    let digests = (0..seeds.len()).map(|i| ckpt_store::digest::tensor_digest(&st[l.tensor_range(i)])).collect();
    (staging, crcs, digests)
}
