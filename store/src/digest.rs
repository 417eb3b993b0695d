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

use xxhash_rust::xxh3::{xxh3_128, Xxh3};

/// Block size of the digest definition. Changing it changes every digest
/// (each tensor is then found changed once, and written: safe).
pub const DIGEST_BLOCK_BYTES: usize = 1 << 20;

/// XXH3-128 of one block.
pub fn block_digest(bytes: &[u8]) -> u128 {
    debug_assert!(bytes.len() <= DIGEST_BLOCK_BYTES);
    xxh3_128(bytes)
}

/// A block's digest computed piecewise: update with consecutive parts of
/// the block (each while it is in cache), then [`BlockHasher::finish`].
pub struct BlockHasher(Xxh3);

impl Default for BlockHasher {
    fn default() -> Self {
        BlockHasher(Xxh3::new())
    }
}

impl BlockHasher {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    pub fn finish(&self) -> u128 {
        self.0.digest128()
    }
}

/// The tensor digest from its blocks' digests, in order.
pub fn combine(blocks: impl IntoIterator<Item = u128>) -> u128 {
    let mut h = Xxh3::new();
    for b in blocks {
        h.update(&b.to_le_bytes());
    }
    h.digest128()
}

/// The digest of a whole tensor's bytes (tests, readers).
pub fn tensor_digest(bytes: &[u8]) -> u128 {
    combine(bytes.chunks(DIGEST_BLOCK_BYTES).map(block_digest))
}

/// As the index writes it: 32 lowercase hex digits.
pub fn to_hex(d: u128) -> String {
    format!("{d:032x}")
}

/// The value of an index's `xxh128` (32 lowercase hex digits), or None.
pub fn parse_hex(s: &str) -> Option<u128> {
    (s.len() == 32 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))).then(|| u128::from_str_radix(s, 16).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

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
