//! The per-tensor digest of incremental checkpoints (docs/format.md,
//! "Incremental checkpoints"): XXH3-128 over blocks, strong enough to decide
//! that a tensor did not change since the last committed step (crc32c is
//! not: one collision in 2^32 saves of a changed tensor would lose data).
//!
//! Definition (what `ckpt.tensors[*].xxh128` holds, as 32 lowercase hex
//! digits of the 128-bit value): split the tensor's bytes into blocks of
//! [`DIGEST_BLOCK_BYTES`] (the last one shorter; none for an empty tensor),
//! take XXH3-128 (seed 0) of each block, and XXH3-128 of the blocks'
//! digests, each as 16 little-endian bytes, one after the other. Blocks let
//! several copy threads hash one large tensor in parallel, each piece while
//! its bytes are still in cache; the sidecar's copy pieces are exactly these
//! blocks (`COPY_PIECE_BYTES` equals [`DIGEST_BLOCK_BYTES`], asserted there).
//!
//! Speed: detection is on by default, so a save where everything changed
//! pays the digest for nothing. Two things keep it near free: the kernel
//! is chosen at run time ([`Kernel::best`]: AVX2 where the CPU has it,
//! whatever target the binary was compiled for), and the checksum pass
//! hashes each chunk right after its crc32c read it, while it is in the
//! first-level cache ([`crc_and_digest`]), so the digest adds compute but
//! no second read from memory. Every kernel computes the same function:
//! existing indexes' digests stay valid.

use std::sync::OnceLock;

use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use crate::config::SUM_CHUNK_BYTES;

/// Block size of the digest definition. Changing it changes every digest
/// (each tensor is then found changed once, and written: safe).
pub const DIGEST_BLOCK_BYTES: usize = 1 << 20;

/// The code that computes XXH3-128: the same function, the same values
/// (tested against each other and known answers), different speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// `twox-hash`, which picks its SIMD when called: AVX2 where the CPU
    /// has it (about twice SSE2's speed). Used where AVX2 is present.
    Dispatched,
    /// `xxhash-rust`, whose SIMD is fixed when compiled (SSE2 on the
    /// default x86-64 target, NEON on aarch64): everywhere else.
    Portable,
}

impl Kernel {
    /// This process's kernel, chosen once: [`Kernel::Dispatched`] where
    /// the CPU has AVX2, else [`Kernel::Portable`].
    pub fn best() -> Kernel {
        static BEST: OnceLock<Kernel> = OnceLock::new();
        *BEST.get_or_init(|| if Kernel::has_avx2() { Kernel::Dispatched } else { Kernel::Portable })
    }

    /// Whether this CPU has AVX2 (then [`Kernel::Dispatched`] runs it).
    pub fn has_avx2() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// XXH3-128 (seed 0) of `bytes`.
    pub fn hash(self, bytes: &[u8]) -> u128 {
        match self {
            Kernel::Dispatched => twox_hash::XxHash3_128::oneshot(bytes),
            Kernel::Portable => xxh3_128(bytes),
        }
    }
}

/// XXH3-128 of one block.
pub fn block_digest(bytes: &[u8]) -> u128 {
    debug_assert!(bytes.len() <= DIGEST_BLOCK_BYTES);
    Kernel::best().hash(bytes)
}

/// A block's digest computed piecewise: update with consecutive parts of
/// the block (each while it is in cache), then [`BlockHasher::finish`].
pub struct BlockHasher(Inner);

// The dispatched hasher stays inline: a BlockHasher lives on one copy
// thread's stack for one block, and boxing it would allocate on the data path.
#[allow(clippy::large_enum_variant)]
enum Inner {
    Dispatched(twox_hash::XxHash3_128),
    Portable(Box<Xxh3>),
}

impl Default for BlockHasher {
    fn default() -> Self {
        BlockHasher::with_kernel(Kernel::best())
    }
}

impl BlockHasher {
    pub fn with_kernel(k: Kernel) -> Self {
        BlockHasher(match k {
            Kernel::Dispatched => Inner::Dispatched(twox_hash::XxHash3_128::new()),
            Kernel::Portable => Inner::Portable(Box::default()),
        })
    }
    pub fn update(&mut self, bytes: &[u8]) {
        match &mut self.0 {
            Inner::Dispatched(h) => h.write(bytes),
            Inner::Portable(h) => h.update(bytes),
        }
    }
    pub fn finish(&self) -> u128 {
        match &self.0 {
            Inner::Dispatched(h) => h.finish_128(),
            Inner::Portable(h) => h.digest128(),
        }
    }
}

/// The crc32c (with `crc`; else 0) and the block digest of `bytes` (at
/// most one block), in one pass over memory: chunk by chunk of
/// [`SUM_CHUNK_BYTES`], each checksummed (read from memory) and then hashed
/// while it is still in the core's first-level cache. Without `crc`, the
/// block is hashed at once.
pub fn crc_and_digest(bytes: &[u8], crc: bool) -> (u32, u128) {
    crc_and_digest_with(Kernel::best(), bytes, crc, SUM_CHUNK_BYTES)
}

/// [`crc_and_digest`] with a given kernel and chunk (tests: every path).
pub fn crc_and_digest_with(k: Kernel, bytes: &[u8], crc: bool, chunk_bytes: usize) -> (u32, u128) {
    debug_assert!(bytes.len() <= DIGEST_BLOCK_BYTES);
    if !crc {
        return (0, k.hash(bytes));
    }
    let mut c = 0u32;
    let mut h = BlockHasher::with_kernel(k);
    for chunk in bytes.chunks(chunk_bytes.max(1)) {
        c = crc32c::crc32c_append(c, chunk);
        h.update(chunk);
    }
    (c, h.finish())
}

/// The tensor digest from its blocks' digests, in order.
pub fn combine(blocks: impl IntoIterator<Item = u128>) -> u128 {
    // Most tensors have a few blocks: their digests hashed in one call from
    // the stack. A streaming hasher costs more to set up than to hash 16
    // bytes, and a save of 10k small tensors sets up 10k of them.
    const INLINE: usize = 8;
    let mut buf = [0u8; 16 * INLINE];
    let mut n = 0;
    let mut blocks = blocks.into_iter();
    for b in blocks.by_ref() {
        buf[16 * n..16 * (n + 1)].copy_from_slice(&b.to_le_bytes());
        n += 1;
        if n == INLINE {
            break;
        }
    }
    if n < INLINE {
        return Kernel::best().hash(&buf[..16 * n]);
    }
    // The same function streamed (XXH3's streaming and one-shot forms agree).
    let mut h = BlockHasher::default();
    h.update(&buf);
    for b in blocks {
        h.update(&b.to_le_bytes());
    }
    h.finish()
}

/// The digest of a whole tensor's bytes (tests, readers).
pub fn tensor_digest(bytes: &[u8]) -> u128 {
    combine(bytes.chunks(DIGEST_BLOCK_BYTES).map(block_digest))
}

/// As the index writes it: 32 lowercase hex digits.
pub fn to_hex(d: u128) -> String {
    let mut out = Vec::with_capacity(32);
    push_hex(&mut out, d);
    String::from_utf8(out).expect("hex digits are ASCII")
}

/// Appends [`to_hex`]'s 32 digits to `out` (the index's rendering: one
/// per tensor, with no formatter or allocation each).
pub fn push_hex(out: &mut Vec<u8>, d: u128) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.extend((0..32).rev().map(|k| DIGITS[((d >> (4 * k)) & 0xf) as usize]));
}

/// The value of an index's `xxh128` (32 lowercase hex digits), or None.
pub fn parse_hex(s: &str) -> Option<u128> {
    (s.len() == 32 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .then(|| u128::from_str_radix(s, 16).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_the_formatters_32_lowercase_digits() {
        for d in [0u128, 1, 0xabc, u64::MAX as u128, u128::MAX, 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210] {
            assert_eq!(to_hex(d), format!("{d:032x}"));
            assert_eq!(parse_hex(&to_hex(d)), Some(d));
        }
    }

    const KERNELS: [Kernel; 2] = [Kernel::Dispatched, Kernel::Portable];

    /// Bytes that differ everywhere (no two chunks alike).
    fn data(len: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Sizes around the chunk and block boundaries, and XXH3's own (16,
    /// 128, 240 bytes; 64-byte stripes, 1 KiB blocks).
    fn sizes() -> Vec<usize> {
        let c = SUM_CHUNK_BYTES;
        let mut v = vec![
            0,
            1,
            3,
            16,
            17,
            128,
            129,
            240,
            241,
            1023,
            1024,
            1025,
            c - 1,
            c,
            c + 1,
            3 * c + 17,
            DIGEST_BLOCK_BYTES - 1,
            DIGEST_BLOCK_BYTES,
        ];
        v.extend([64 * 1024 + 64, 256 << 10]);
        v
    }

    #[test]
    fn every_kernel_fused_or_not_gives_the_reference_xxh128_and_crc32c_at_chunk_boundaries_and_unaligned_starts() {
        // The reference: xxhash-rust's one-shot XXH3-128 (the function the
        // format's digests were first taken with) and the crc32c crate.
        assert_eq!(xxh3_128(b""), 0x99aa06d3014798d86001c324468d497f, "XXH3-128 of nothing (xxhsum -H2)");
        assert_eq!(Kernel::best() == Kernel::Dispatched, Kernel::has_avx2(), "AVX2 picks the dispatched kernel");
        eprintln!(
            "this CPU: AVX2 {} (the dispatched kernel runs {})",
            Kernel::has_avx2(),
            if Kernel::has_avx2() { "AVX2" } else { "its own fallback" }
        );
        let buf = data(DIGEST_BLOCK_BYTES + 64);
        for start in [0usize, 1, 7, 63] {
            for n in sizes() {
                let bytes = &buf[start..start + n];
                let (want_crc, want) = (crc32c::crc32c(bytes), xxh3_128(bytes));
                for k in KERNELS {
                    assert_eq!(k.hash(bytes), want, "{k:?} one-shot, {n} bytes at +{start}");
                    for chunk in [SUM_CHUNK_BYTES, 1000, 64, 1] {
                        if chunk == 1 && n > 4096 {
                            continue;
                        }
                        assert_eq!(
                            crc_and_digest_with(k, bytes, true, chunk),
                            (want_crc, want),
                            "{k:?} fused, chunk {chunk}, {n} bytes at +{start}"
                        );
                    }
                    assert_eq!(
                        crc_and_digest_with(k, bytes, false, SUM_CHUNK_BYTES),
                        (0, want),
                        "{k:?} not fused, {n} bytes at +{start}"
                    );
                    // Piecewise, cut at odd places.
                    let mut h = BlockHasher::with_kernel(k);
                    bytes.chunks(4096 + 3).for_each(|p| h.update(p));
                    assert_eq!(h.finish(), want, "{k:?} piecewise, {n} bytes at +{start}");
                }
            }
        }
        assert_eq!(
            crc_and_digest(&buf[..3 * SUM_CHUNK_BYTES + 5], true),
            (crc32c::crc32c(&buf[..3 * SUM_CHUNK_BYTES + 5]), xxh3_128(&buf[..3 * SUM_CHUNK_BYTES + 5]))
        );
    }

    #[test]
    fn a_tensor_changed_by_one_element_is_found_changed_by_every_kernel_and_path() {
        // A BF16 tensor of 2.5 blocks; one element (2 bytes) changed at the
        // edges of chunks, blocks and the tensor.
        let len = 2 * DIGEST_BLOCK_BYTES + DIGEST_BLOCK_BYTES / 2;
        let base = data(len);
        let whole = tensor_digest(&base);
        let per_block = |k: Kernel, fused: bool, t: &[u8]| {
            combine(t.chunks(DIGEST_BLOCK_BYTES).map(|b| crc_and_digest_with(k, b, fused, SUM_CHUNK_BYTES).1))
        };
        for k in KERNELS {
            assert_eq!(per_block(k, true, &base), whole);
            assert_eq!(per_block(k, false, &base), whole);
        }
        let c = SUM_CHUNK_BYTES;
        for at in [0, c - 2, c, DIGEST_BLOCK_BYTES - 2, DIGEST_BLOCK_BYTES, DIGEST_BLOCK_BYTES + 3 * c, len - 2] {
            let mut t = base.clone();
            // The element's low bit, as a training step's smallest update.
            t[at] ^= 1;
            assert_ne!(tensor_digest(&t), whole, "element at byte {at}");
            for k in KERNELS {
                for fused in [true, false] {
                    assert_ne!(per_block(k, fused, &t), whole, "{k:?} fused {fused}: element at byte {at}");
                }
            }
        }
    }

    #[test]
    fn combining_block_digests_is_xxh3_of_them_end_to_end_at_any_count() {
        // combine hashes a few blocks in one call and streams more: both
        // are the definition's XXH3-128 of the digests laid end to end.
        for n in 0..20u128 {
            let blocks: Vec<u128> = (0..n).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)).collect();
            let bytes: Vec<u8> = blocks.iter().flat_map(|b| b.to_le_bytes()).collect();
            for k in KERNELS {
                assert_eq!(combine(blocks.iter().copied()), k.hash(&bytes), "{n} blocks, {k:?}");
            }
        }
    }

    #[test]
    fn piecewise_blocks_equal_whole_blocks_and_hex_round_trips() {
        let data: Vec<u8> = (0..(2 * DIGEST_BLOCK_BYTES + 77)).map(|i| (i * 31 % 251) as u8).collect();
        let blocks: Vec<u128> = data
            .chunks(DIGEST_BLOCK_BYTES)
            .map(|b| {
                let mut h = BlockHasher::default();
                b.chunks(4096 + 3).for_each(|p| h.update(p));
                h.finish()
            })
            .collect();
        assert_eq!(combine(blocks), tensor_digest(&data));
        let mut other = data.clone();
        other[DIGEST_BLOCK_BYTES + 5] ^= 1;
        assert_ne!(tensor_digest(&other), tensor_digest(&data));
        let d = tensor_digest(&data);
        assert_eq!(parse_hex(&to_hex(d)), Some(d));
        assert_eq!(parse_hex("ABCDEF00000000000000000000000000"), None, "uppercase is not the index's spelling");
        assert_eq!(tensor_digest(&[]), combine([]));
    }
}
