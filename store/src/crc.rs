//! crc32c combining without per-call setup: crc(A ‖ B) from crc(A), crc(B)
//! and |B|, as zlib's `crc32_combine` does since 1.2.12 (multiplication
//! modulo the polynomial by x^(8·|B|), the power taken from a table of
//! x^(2^k)). The `crc32c` crate's `crc32c_combine` builds 32×32 bit
//! matrices on every call (tens of µs); folding a thousand tensor
//! checksums into file checksums with it cost more than writing them.

/// The crc32c (Castagnoli) polynomial, bit-reflected.
const POLY: u32 = 0x82f6_3b78;

/// a·b modulo the polynomial (reflected: bit 31 is x^0).
const fn mult_mod_p(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                return p;
            }
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
}

/// X2N[k] = x^(2^k) modulo the polynomial.
const X2N: [u32; 64] = {
    let mut t = [0u32; 64];
    let mut p = 1u32 << 30; // x^1
    let mut k = 0;
    while k < 64 {
        t[k] = p;
        p = mult_mod_p(p, p);
        k += 1;
    }
    t
};

/// x^(8·len) modulo the polynomial: the operator that shifts a crc over
/// `len` bytes. Build it once for a length that repeats ([`combine_op`]).
pub fn shift_op(len: u64) -> u32 {
    x_pow(len, 3) // 8·len = len · 2^3
}

/// x^n modulo the polynomial (reflected, as [`shift_op`]'s): with it, a
/// carry-less multiply shifts a crc (a `const` table of them, built at
/// compile time, serves a copy's lanes: `streaming_copy` in the sidecar).
pub const fn x_pow_bits(n: u64) -> u32 {
    x_pow(n, 0)
}

/// x^(n · 2^k) modulo the polynomial.
const fn x_pow(mut n: u64, mut k: usize) -> u32 {
    let mut p = 1u32 << 31; // x^0
    while n != 0 {
        if n & 1 != 0 {
            p = mult_mod_p(X2N[k & 63], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

/// crc(A ‖ B) from `crc_a`, `crc_b` and the operator of |B| ([`shift_op`]).
#[inline]
pub fn combine_op(crc_a: u32, crc_b: u32, op: u32) -> u32 {
    mult_mod_p(op, crc_a) ^ crc_b
}

/// Multiplication by one shift operator ([`shift_op`]), tabulated by
/// byte (the product is linear in the checksum): folding many checksums
/// over one length, as a shard of ten thousand tensors of one size does,
/// costs four lookups each instead of [`combine_op`]'s loop over the bits
/// (about 45 ns: 0.9 ms of a 20k-tensor commit). Building it costs about
/// a thousand of those.
pub struct ShiftTable(Box<[[u32; 256]; 4]>);

impl ShiftTable {
    pub fn new(op: u32) -> ShiftTable {
        let mut t = Box::new([[0u32; 256]; 4]);
        for (j, row) in t.iter_mut().enumerate() {
            for (v, e) in row.iter_mut().enumerate() {
                *e = mult_mod_p(op, (v as u32) << (8 * j));
            }
        }
        ShiftTable(t)
    }

    /// [`combine_op`] with this table's operator.
    #[inline]
    pub fn combine(&self, crc_a: u32, crc_b: u32) -> u32 {
        let t = &self.0;
        t[0][(crc_a & 0xff) as usize]
            ^ t[1][((crc_a >> 8) & 0xff) as usize]
            ^ t[2][((crc_a >> 16) & 0xff) as usize]
            ^ t[3][(crc_a >> 24) as usize]
            ^ crc_b
    }
}

/// crc(A ‖ B) from `crc_a`, `crc_b` and `len_b` = |B| in bytes.
#[inline]
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    if len_b == 0 {
        return crc_a;
    }
    combine_op(crc_a, crc_b, shift_op(len_b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shift_table_combines_as_its_operator_does() {
        for len in [1u64, 1024, 4096 + 7, 1 << 30] {
            let op = shift_op(len);
            let t = ShiftTable::new(op);
            let mut x = 0x1234_5678u32;
            for _ in 0..1000 {
                x = x.wrapping_mul(2_654_435_761).rotate_left(7) ^ 0x9e37_79b9;
                let y = x.rotate_left(13).wrapping_add(len as u32);
                assert_eq!(t.combine(x, y), combine_op(x, y, op), "len {len}");
            }
        }
    }

    #[test]
    fn combining_equals_the_crc_of_the_concatenation() {
        let data: Vec<u8> = (0..70_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for split in [0usize, 1, 3, 4096, 4097, 65_536, 69_999, 70_000] {
            let (a, b) = data.split_at(split);
            let want = crc32c::crc32c(&data);
            assert_eq!(combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len() as u64), want, "split {split}");
            assert_eq!(
                combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len() as u64),
                crc32c::crc32c_combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len())
            );
        }
        // Large lengths (no bytes needed): agrees with the crate's combine.
        for len in [1u64 << 30, (5u64 << 30) + 12_345, u32::MAX as u64 + 7] {
            assert_eq!(
                combine(0x1234_5678, 0x9abc_def0, len),
                crc32c::crc32c_combine(0x1234_5678, 0x9abc_def0, len as usize)
            );
        }
    }
}
