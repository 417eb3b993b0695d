//! A synthetic transformer-like training state for benchmarks and tests:
//! about fifty tensors of mixed sizes and dtypes, filled with non-constant
//! pseudo-random bytes that are a pure function of (seed, tensor, offset).

use crate::format::Dtype;
use crate::image::{Layout, TensorSpec};

/// Tensors of a model whose total is close to `target_bytes`: an embedding,
/// six layers of attention and MLP weights (bf16) with their norms (f32), a
/// final norm and a step counter.
pub fn transformer_specs(target_bytes: u64) -> Vec<TensorSpec> {
    const N_LAYERS: u64 = 6;
    // bf16 bytes ~= 2 * (2 * vocab * d + layers * 12 d^2) with vocab = 8d
    // -> 176 d^2; d a multiple of 16.
    let d = (((target_bytes as f64) / 176.0).sqrt().round() as u64 / 16 * 16).max(16);
    let vocab = 8 * d;
    let mut v = vec![TensorSpec::new("model.embed_tokens.weight", Dtype::BF16, &[vocab, d])];
    for l in 0..N_LAYERS {
        let p = format!("model.layers.{l}");
        v.push(TensorSpec::new(format!("{p}.input_layernorm.weight"), Dtype::F32, &[d]));
        v.push(TensorSpec::new(format!("{p}.self_attn.qkv_proj.weight"), Dtype::BF16, &[3 * d, d]));
        v.push(TensorSpec::new(format!("{p}.self_attn.qkv_proj.bias"), Dtype::BF16, &[3 * d]));
        v.push(TensorSpec::new(format!("{p}.self_attn.o_proj.weight"), Dtype::BF16, &[d, d]));
        v.push(TensorSpec::new(format!("{p}.post_attention_layernorm.weight"), Dtype::F32, &[d]));
        v.push(TensorSpec::new(format!("{p}.mlp.up_proj.weight"), Dtype::BF16, &[4 * d, d]));
        v.push(TensorSpec::new(format!("{p}.mlp.down_proj.weight"), Dtype::BF16, &[d, 4 * d]));
        v.push(TensorSpec::new(format!("{p}.mlp.down_proj.bias"), Dtype::BF16, &[d]));
    }
    v.push(TensorSpec::new("model.norm.weight", Dtype::F32, &[d]));
    v.push(TensorSpec::new("lm_head.weight", Dtype::BF16, &[vocab, d]));
    v.push(TensorSpec::new("train.step", Dtype::I64, &[]));
    v
}

/// Fills `out` with bytes determined by `(seed, offset)` (xorshift-style,
/// several GB/s per core).
pub fn fill(out: &mut [u8], seed: u64) {
    let mut words = out.chunks_exact_mut(8);
    let mut x = seed ^ 0x9E37_79B9_7F4A_7C15;
    for w in &mut words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    for (i, b) in words.into_remainder().iter_mut().enumerate() {
        *b = (seed as u8).wrapping_add(i as u8).wrapping_mul(31);
    }
}

/// Writes headers and fills every tensor of `layout` in `staging` with
/// `fill(…, seed + tensor index)`, using both cores; returns the tensor
/// checksums.
pub fn stage(layout: &Layout, staging: &mut [u8], seed: u64) -> Vec<u32> {
    layout.write_headers(staging);
    // Split the tensors' disjoint ranges over two threads.
    let mut ranges: Vec<(usize, &mut [u8])> = Vec::new();
    let mut rest = staging;
    let mut consumed = 0usize;
    let mut order: Vec<usize> = (0..layout.specs.len()).collect();
    order.sort_by_key(|&i| layout.places[i].staging_offset);
    for i in order {
        let r = layout.tensor_range(i);
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - consumed);
        let (mine, tail) = tail.split_at_mut(r.len());
        ranges.push((i, mine));
        rest = tail;
        consumed = r.end;
    }
    let total: usize = ranges.iter().map(|(_, r)| r.len()).sum();
    let mut crcs = vec![0u32; layout.specs.len()];
    let mut first = Vec::new();
    let mut acc = 0;
    while acc < total / 2 && !ranges.is_empty() {
        let r = ranges.remove(0);
        acc += r.1.len();
        first.push(r);
    }
    let work = |part: Vec<(usize, &mut [u8])>| -> Vec<(usize, u32)> {
        part.into_iter()
            .map(|(i, r)| {
                fill(r, seed.wrapping_add(i as u64));
                (i, crc32c::crc32c(r))
            })
            .collect()
    };
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| work(ranges));
        (work(first), h.join().expect("fill thread"))
    });
    for (i, c) in a.into_iter().chain(b) {
        crcs[i] = c;
    }
    crcs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::LayoutOptions;

    #[test]
    fn specs_hit_the_target_within_a_few_percent() {
        for target in [64u64 << 20, 2 << 30] {
            let specs = transformer_specs(target);
            assert!((45..=60).contains(&specs.len()));
            let l = Layout::plan(specs, LayoutOptions::default()).unwrap();
            let ratio = l.tensor_bytes() as f64 / target as f64;
            assert!((0.9..=1.05).contains(&ratio), "{ratio}");
        }
    }

    #[test]
    fn staged_data_is_not_constant_and_crcs_match() {
        let l = Layout::plan(transformer_specs(4 << 20), LayoutOptions::default()).unwrap();
        let mut buf = vec![0u8; l.staging_len as usize];
        let crcs = stage(&l, &mut buf, 7);
        assert_eq!(crcs, l.tensor_crcs(&buf));
        let t = &buf[l.tensor_range(0)];
        assert!(t.iter().any(|&b| b != t[0]));
    }
}
