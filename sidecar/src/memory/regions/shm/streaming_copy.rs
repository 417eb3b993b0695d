//! The copy out of a host region into staging: streaming (non-temporal)
//! stores, so the image bypasses the caches the trainer computes with, and
//! with a crc32c computed from the very registers each load went through,
//! so the checksum is that of the bytes staged even while the client
//! writes its memory (`docs/format.md`'s checksums must verify what was
//! committed). Other threads see the copies only after the copying
//! thread's [`store_fence`].

use crate::config;
use config::COPY_CRC_LANE_BYTES as CRC_LANE_BYTES;

/// Whether streaming stores to `dst` would stall the loads from `src`:
/// when the destination lies a little ahead of the source modulo 4 KiB
/// (`ALIAS_WINDOW_BYTES`), each load's address matches, in its low 12
/// bits (all the core compares before it knows the physical address), a
/// line just stored and still held in a write-combining buffer, which
/// the core then flushes half-filled before the load goes on. Measured
/// here (AMD EPYC, 4 MiB from /dev/shm, three lanes): 12–19 ms instead of
/// 0.45 ms at 16–112 bytes ahead, 0.9 ms at 128, normal from 144 on; a
/// copy with plain stores runs 0.6–0.7 ms at any offset. Where this
/// says so, the checksummed copies use plain stores: the image then passes through
/// the caches, but at a fifth of the speed lost otherwise. Where tensors
/// land is set by the shard's layout and the client's, so a whole save
/// can sit in the window (a 4 KiB-aligned source under a header whose
/// length is a few lines past a page).
#[inline]
pub(super) fn stores_alias_loads(dst: *mut u8, src: *const u8) -> bool {
    let ahead = (dst as usize).wrapping_sub(src as usize) % 4096;
    ahead != 0 && ahead < ALIAS_WINDOW_BYTES
}

/// How far ahead of its source (modulo 4 KiB) a streaming copy's
/// destination stalls it ([`stores_alias_loads`]), with a margin.
const ALIAS_WINDOW_BYTES: usize = 256;

/// Copies `len` bytes with non-temporal (streaming) stores: the staged
/// image bypasses the caches instead of evicting, line by line, what the
/// trainer computes with from the L3 both cores share, and its lines need
/// no read-for-ownership (a third less memory traffic than a plain copy,
/// which also reads every destination line before writing it). Nobody reads
/// the image soon enough for caching it to pay: the checksum pass starts
/// after the whole copy, and images are far larger than the L3. Ends
/// without a store fence: streaming stores are weakly ordered, so the
/// copying thread calls [`store_fence`] once its copies are done, before
/// any other thread may read them (a fence per copy waits for each 4 KiB
/// tensor's stores to drain: a third of a copy of a thousand of them).
///
/// SAFETY: as [`std::ptr::copy_nonoverlapping`]: `src..src+len` readable,
/// `dst..dst+len` writable, the two disjoint.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // One stream of whole lines (four loads, then four stores) does not
    // stall where the three lanes of copy_streaming_crc do
    // ([`stores_alias_loads`]): 0.19-0.24 ms for 4 MiB at every offset
    // measured, so it always streams.
    // Plain copy up to the first 16-byte aligned destination address.
    let head = dst.align_offset(16).min(len);
    std::ptr::copy_nonoverlapping(src, dst, head);
    let (mut d, mut s, mut n) = (dst.add(head), src.add(head), len - head);
    // SSE2 is part of x86-64: always there. 64 bytes (one line) per round.
    while n >= 64 {
        let a = _mm_loadu_si128(s.cast::<__m128i>());
        let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
        let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
        let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
        _mm_stream_si128(d.cast::<__m128i>(), a);
        _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
        _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
        _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
        d = d.add(64);
        s = s.add(64);
        n -= 64;
    }
    std::ptr::copy_nonoverlapping(s, d, n);
}

/// [`copy_streaming`] that also returns the crc32c of the bytes, computed
/// from the registers each 8 bytes were loaded into and stored from: the
/// checksum of exactly what was staged, whatever the source does meanwhile,
/// in the same single pass over memory. The bytes go in blocks of three
/// lanes side by side (three independent crc32 chains, the instruction's
/// latency hidden: one chain alone runs at a third of the speed), the
/// lanes `CRC_LANE_BYTES` long while the rest is long enough, then halved
/// down to [`CRC_LANE_BYTES_MIN`], so a 4 KiB tensor runs three chains
/// too; each block's lanes are joined with two carry-less multiplies
/// ([`join_lanes`]). Without SSE4.2 and PCLMULQDQ: copied through a small
/// bounce buffer, checksummed there.
///
/// SAFETY: as [`copy_streaming`].
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn copy_streaming_crc(dst: *mut u8, src: *const u8, len: usize) -> u32 {
    if std::arch::is_x86_feature_detected!("sse4.2")
        && std::arch::is_x86_feature_detected!("sse4.1")
        && std::arch::is_x86_feature_detected!("pclmulqdq")
    {
        // SAFETY: the CPU has SSE4.1, SSE4.2 and PCLMULQDQ (checked); the caller's contract.
        unsafe {
            if stores_alias_loads(dst, src) {
                copy_crc_sse42::<false>(dst, src, len)
            } else {
                copy_crc_sse42::<true>(dst, src, len)
            }
        }
    } else {
        // SAFETY: the caller's contract.
        unsafe { copy_bounced_crc(dst, src, len) }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn copy_streaming_crc(dst: *mut u8, src: *const u8, len: usize) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { copy_bounced_crc(dst, src, len) }
}

/// The shortest lane of [`copy_streaming_crc`]: below three of them the
/// rest (under 192 bytes) runs one chain, 8 bytes a step.
const CRC_LANE_BYTES_MIN: usize = 64;
/// Lane lengths from `CRC_LANE_BYTES` halving down to the minimum.
const CRC_LANES: usize = (CRC_LANE_BYTES / CRC_LANE_BYTES_MIN).trailing_zeros() as usize + 1;
const _: () = assert!(CRC_LANE_BYTES.is_power_of_two() && CRC_LANE_BYTES >= CRC_LANE_BYTES_MIN);

/// For lanes of `CRC_LANE_BYTES >> i`: the multipliers that shift a raw
/// crc over one lane and over two, x^(8·L − 33) and x^(16·L − 33) (the 33:
/// the carry-less product's one-bit offset and the crc32 instruction's
/// x^32, see [`join_lanes`]). Built at compile time.
const LANE_SHIFTS: [(u64, u64); CRC_LANES] = {
    let mut t = [(0u64, 0u64); CRC_LANES];
    let mut i = 0;
    while i < CRC_LANES {
        let bits = 8 * (CRC_LANE_BYTES >> i) as u64;
        t[i] = (ckpt_store::crc::x_pow_bits(bits - 33) as u64, ckpt_store::crc::x_pow_bits(2 * bits - 33) as u64);
        i += 1;
    }
    t
};

/// The raw crc state of lanes A ‖ B ‖ C from their raw states: `a` run on
/// from the state before the block, `b` and `c` from 0. The state shifts
/// over n bytes as s·x^(8n); a carry-less product s·k read back as 64 bits
/// is s·k·x (bit-reflected, one place off), and crc32 of a 64-bit word w
/// from state 0 is w·x^32: so crc32(0, clmul(s, x^(8n − 33))) = s·x^(8n),
/// and the two shifts share one crc32 (it is linear).
///
/// SAFETY: the CPU has SSE4.2 and PCLMULQDQ.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2,pclmulqdq")]
#[inline]
unsafe fn join_lanes(a: u64, b: u64, c: u64, (one, two): (u64, u64)) -> u64 {
    use std::arch::x86_64::{_mm_clmulepi64_si128, _mm_crc32_u64, _mm_cvtsi128_si64, _mm_cvtsi64_si128, _mm_xor_si128};
    let pa = _mm_clmulepi64_si128::<0>(_mm_cvtsi64_si128(a as i64), _mm_cvtsi64_si128(two as i64));
    let pb = _mm_clmulepi64_si128::<0>(_mm_cvtsi64_si128(b as i64), _mm_cvtsi64_si128(one as i64));
    _mm_crc32_u64(0, _mm_cvtsi128_si64(_mm_xor_si128(pa, pb)) as u64) ^ c
}

/// The copy of [`copy_streaming_crc`], with streaming stores (`STREAM`)
/// or plain ones ([`stores_alias_loads`]).
///
/// SAFETY: as [`copy_streaming`], and the CPU has SSE4.1, SSE4.2 and PCLMULQDQ.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2,sse4.1,pclmulqdq")]
unsafe fn copy_crc_sse42<const STREAM: bool>(dst: *mut u8, src: *const u8, len: usize) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8, _mm_stream_si64};
    // Raw (uninverted) crc state, as the instruction keeps it.
    let mut state: u32 = !0;
    // Byte stores up to a 16-byte aligned destination.
    let head = dst.align_offset(16).min(len);
    for i in 0..head {
        let b = src.add(i).read_volatile();
        dst.add(i).write(b);
        state = _mm_crc32_u8(state, b);
    }
    let (d, s, mut n) = (dst.add(head), src.add(head), len - head);
    let mut at = 0usize;
    for (lane_i, &shifts) in LANE_SHIFTS.iter().enumerate() {
        let lane = CRC_LANE_BYTES >> lane_i;
        while n >= 3 * lane {
            let [a, b, c] = three_lanes::<STREAM>(
                [d.add(at), d.add(at + lane), d.add(at + 2 * lane)],
                [s.add(at), s.add(at + lane), s.add(at + 2 * lane)],
                lane,
                [state as u64, 0, 0],
            );
            state = join_lanes(a, b, c, shifts) as u32;
            at += 3 * lane;
            n -= 3 * lane;
        }
    }
    while n >= 8 {
        let x = loaded_once_u64(s.add(at).cast::<u64>().read_unaligned());
        state = _mm_crc32_u64(state as u64, x) as u32;
        if STREAM {
            _mm_stream_si64(d.add(at).cast::<i64>(), x as i64);
        } else {
            d.add(at).cast::<u64>().write_unaligned(x);
        }
        at += 8;
        n -= 8;
    }
    while n > 0 {
        let x = s.add(at).read_volatile();
        d.add(at).write(x);
        state = _mm_crc32_u8(state, x);
        at += 1;
        n -= 1;
    }
    !state
}

/// The longest piece [`copy_streaming_crc3`] copies: from three lanes of
/// `CRC_LANE_BYTES` on, a piece alone runs three lanes as long as three
/// pieces side by side would.
pub const TRIO_BYTES_MAX: usize = 3 * CRC_LANE_BYTES - 16;

/// Copies three ranges of one length `len` at once, each the lane of its
/// own crc32c chain, and returns their crc32c; None (nothing copied) when
/// they do not suit it: `len` not a multiple of 16 or above
/// [`TRIO_BYTES_MAX`], a destination not 16-byte aligned or one whose
/// streaming stores would stall its loads ([`stores_alias_loads`]), or a
/// CPU without SSE4.2. For many small tensors: a tensor under three lanes
/// of `CRC_LANE_BYTES` runs its lanes short, one after another inside its
/// pages, which the prefetchers follow badly; three tensors side by side
/// are three whole streams. Measured here (4 MiB as 4 KiB tensors, the
/// source out of cache): 0.40-0.45 ms against 0.60-0.89 ms one tensor
/// at a time, and 0.34-0.44 ms for 1 MiB pieces.
///
/// SAFETY: as [`copy_streaming`], for each of the three ranges; the six
/// ranges are pairwise disjoint but for sources, which may overlap.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn copy_streaming_crc3(dst: [*mut u8; 3], src: [*const u8; 3], len: usize) -> Option<[u32; 3]> {
    let suits = len % 16 == 0
        && len <= TRIO_BYTES_MAX
        && (0..3).all(|k| dst[k] as usize % 16 == 0 && !stores_alias_loads(dst[k], src[k]));
    if !(suits && std::arch::is_x86_feature_detected!("sse4.2") && std::arch::is_x86_feature_detected!("sse4.1")) {
        return None;
    }
    // SAFETY: the CPU has SSE4.1 and SSE4.2 (checked); the destinations are
    // aligned and `len` whole 16 bytes (checked); the caller's contract.
    let raw = unsafe { three_lanes::<true>(dst, src, len, [u64::from(!0u32); 3]) };
    Some(raw.map(|c| !(c as u32)))
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn copy_streaming_crc3(_dst: [*mut u8; 3], _src: [*const u8; 3], _len: usize) -> Option<[u32; 3]> {
    None
}

/// Three lanes of `len` bytes side by side (a multiple of 16; with
/// `STREAM`, 16-byte aligned destinations), each its own crc32 chain run on
/// from `crc` (raw, uninverted states): each 16 bytes loaded once into a
/// register, stored from it (streaming with `STREAM`, else plain) and
/// checksummed from it, so what is checksummed is what is staged.
/// `loaded_once`: else LLVM folds the crc's loads into `crc32 reg, [src]`,
/// a second read of memory the client may be writing. The three lanes of a
/// block of [`copy_crc_sse42`], or three whole pieces
/// ([`copy_streaming_crc3`]).
///
/// SAFETY: as [`copy_streaming`] for each lane; the CPU has SSE4.1 and SSE4.2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2,sse4.1")]
#[inline]
unsafe fn three_lanes<const STREAM: bool>(
    dst: [*mut u8; 3],
    src: [*const u8; 3],
    len: usize,
    crc: [u64; 3],
) -> [u64; 3] {
    use std::arch::x86_64::{
        __m128i, _mm_crc32_u64, _mm_cvtsi128_si64, _mm_extract_epi64, _mm_loadu_si128, _mm_storeu_si128,
        _mm_stream_si128,
    };
    let store = |p: *mut u8, x: __m128i| {
        if STREAM {
            _mm_stream_si128(p.cast::<__m128i>(), x)
        } else {
            _mm_storeu_si128(p.cast::<__m128i>(), x)
        }
    };
    let [mut a, mut b, mut c] = crc;
    let mut i = 0;
    while i < len {
        let x = loaded_once(_mm_loadu_si128(src[0].add(i).cast::<__m128i>()));
        let y = loaded_once(_mm_loadu_si128(src[1].add(i).cast::<__m128i>()));
        let z = loaded_once(_mm_loadu_si128(src[2].add(i).cast::<__m128i>()));
        store(dst[0].add(i), x);
        store(dst[1].add(i), y);
        store(dst[2].add(i), z);
        a = _mm_crc32_u64(a, _mm_cvtsi128_si64(x) as u64);
        b = _mm_crc32_u64(b, _mm_cvtsi128_si64(y) as u64);
        c = _mm_crc32_u64(c, _mm_cvtsi128_si64(z) as u64);
        a = _mm_crc32_u64(a, _mm_extract_epi64::<1>(x) as u64);
        b = _mm_crc32_u64(b, _mm_extract_epi64::<1>(y) as u64);
        c = _mm_crc32_u64(c, _mm_extract_epi64::<1>(z) as u64);
        i += 16;
    }
    [a, b, c]
}

/// `x`, which the compiler must from now on take as an opaque register
/// value: every later use reads that register, never the memory `x` was
/// loaded from. The source of a copy is a client's memory, which another
/// process may write at any moment; without this, LLVM (which assumes the
/// memory unchanged) reads it a second time for the checksum (`crc32 reg,
/// [src]`), and a byte the client changes in between is checksummed other
/// than it is staged: a committed checkpoint that does not verify.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn loaded_once(mut x: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m128i {
    // SAFETY: an empty asm that passes the register through unchanged; it
    // touches no memory, stack or flags. Not `pure`: the compiler may then
    // neither drop it nor run it again on a second load of the source.
    unsafe { std::arch::asm!("/* {0} */", inout(xmm_reg) x, options(nomem, nostack, preserves_flags)) };
    x
}

/// [`loaded_once`] for 8 bytes in a general register.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn loaded_once_u64(mut x: u64) -> u64 {
    // SAFETY: as in loaded_once.
    unsafe { std::arch::asm!("/* {0} */", inout(reg) x, options(nomem, nostack, preserves_flags)) };
    x
}

/// The fallback of [`copy_streaming_crc`]: each block copied into a bounce
/// buffer on this thread's stack, checksummed there, streamed on from there.
///
/// SAFETY: as [`copy_streaming`].
#[allow(dead_code)]
unsafe fn copy_bounced_crc(dst: *mut u8, src: *const u8, len: usize) -> u32 {
    const BOUNCE_BYTES: usize = config::COPY_BOUNCE_BYTES;
    let mut bounce = [0u8; BOUNCE_BYTES];
    let mut c = 0u32;
    let mut at = 0;
    while at < len {
        let n = (len - at).min(BOUNCE_BYTES);
        // SAFETY: the caller's contract; the bounce buffer is this frame's,
        // n ≤ its size, disjoint from both.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), bounce.as_mut_ptr(), n) };
        c = crc32c::crc32c_append(c, &bounce[..n]);
        // SAFETY: as above.
        unsafe { copy_streaming(dst.add(at), bounce.as_ptr(), n) };
        at += n;
    }
    c
}

/// Makes this thread's streaming stores ([`ShmMemory::copy_out`](super::ShmMemory::copy_out)) globally
/// visible: called by a copying thread once a run of copies is done, before
/// it says so to another thread (the disk writer, or the thread that joins
/// it and replies Released).
#[cfg(target_arch = "x86_64")]
pub fn store_fence() {
    // SAFETY: sfence has no preconditions (SSE, part of x86-64).
    unsafe { std::arch::x86_64::_mm_sfence() }
}

/// Copies `src` into `dst` (the same length) with streaming stores, then
/// fences them: a copy of large files nobody reads soon (the peers'
/// copy of a part for sending) that leaves the caches to the trainer and
/// costs a third less memory traffic than a plain copy ([`copy_streaming`]).
pub fn copy_streaming_fenced(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "a streaming copy between ranges of different lengths");
    // SAFETY: both slices are valid for their length, equal here; `&mut`
    // makes `dst` disjoint from `src`.
    unsafe { copy_streaming(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
    store_fence();
}

/// Elsewhere copies are plain stores, ordered by the atomics and joins
/// that hand them over.
#[cfg(not(target_arch = "x86_64"))]
pub fn store_fence() {}

/// Elsewhere: a plain copy.
///
/// SAFETY: as [`std::ptr::copy_nonoverlapping`].
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    std::ptr::copy_nonoverlapping(src, dst, len)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[test]
    fn streaming_copy_matches_a_plain_copy_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for src_off in [0usize, 1, 15, 16, 33] {
            for dst_off in [0usize, 1, 8, 17, 64] {
                for len in [0usize, 1, 15, 16, 63, 64, 65, 127, 1000, 4096 + 7] {
                    let mut dst = vec![0xAAu8; 4096 + 200];
                    // SAFETY: both ranges lie inside their vectors, which are distinct.
                    unsafe { copy_streaming(dst.as_mut_ptr().add(dst_off), src.as_ptr().add(src_off), len) };
                    assert_eq!(
                        &dst[dst_off..dst_off + len],
                        &src[src_off..src_off + len],
                        "src+{src_off} dst+{dst_off} len {len}"
                    );
                    assert!(
                        dst[..dst_off].iter().chain(&dst[dst_off + len..]).all(|&x| x == 0xAA),
                        "wrote outside: src+{src_off} dst+{dst_off} len {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_checksummed_copy_stages_the_bytes_and_their_crc_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..200_000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        for src_off in [0usize, 1, 7, 8, 13] {
            for dst_off in [0usize, 1, 5, 8, 64] {
                for len in [
                    0usize,
                    1,
                    7,
                    8,
                    9,
                    63,
                    191,
                    192,
                    4096,
                    4096 + 200,
                    3 * CRC_LANE_BYTES - 1,
                    3 * CRC_LANE_BYTES,
                    3 * CRC_LANE_BYTES + 9,
                    150_001,
                ] {
                    let mut dst = vec![0xAAu8; 160_000];
                    // SAFETY: both ranges lie inside their vectors, which are distinct.
                    let c =
                        unsafe { copy_streaming_crc(dst.as_mut_ptr().add(dst_off), src.as_ptr().add(src_off), len) };
                    store_fence();
                    let want = &src[src_off..src_off + len];
                    assert_eq!(&dst[dst_off..dst_off + len], want, "src+{src_off} dst+{dst_off} len {len}");
                    assert_eq!(c, crc32c::crc32c(want), "src+{src_off} dst+{dst_off} len {len}");
                    assert!(dst[..dst_off].iter().chain(&dst[dst_off + len..]).all(|&x| x == 0xAA));
                    // SAFETY: as above.
                    let b = unsafe { copy_bounced_crc(dst.as_mut_ptr().add(dst_off), src.as_ptr().add(src_off), len) };
                    assert_eq!(b, c);
                }
            }
        }
    }

    #[test]
    fn a_destination_just_ahead_of_its_source_modulo_a_page_is_copied_with_plain_stores_and_right() {
        // One buffer, so the distance between source and destination is chosen.
        let len = 3 * CRC_LANE_BYTES + 4096 + 77;
        for ahead in [0usize, 8, 16, 100, ALIAS_WINDOW_BYTES - 1, ALIAS_WINDOW_BYTES, 2048, 4095] {
            let mut buf: Vec<u8> = (0..2 * len + 16_384).map(|i| (i as u32).wrapping_mul(2654435761) as u8).collect();
            let base = buf.as_mut_ptr();
            let src_at = base.align_offset(4096);
            let dst_at = src_at + len.next_multiple_of(4096) + ahead;
            let want = buf[src_at..src_at + len].to_vec();
            // SAFETY: both ranges lie inside `buf` and are disjoint (dst_at ≥ src_at + len).
            let (src, dst) = unsafe { (base.add(src_at) as *const u8, base.add(dst_at)) };
            assert_eq!(stores_alias_loads(dst, src), ahead != 0 && ahead < ALIAS_WINDOW_BYTES, "ahead {ahead}");
            // SAFETY: as above.
            let c = unsafe { copy_streaming_crc(dst, src, len) };
            store_fence();
            assert_eq!(&buf[dst_at..dst_at + len], &want[..], "ahead {ahead}");
            assert_eq!(c, crc32c::crc32c(&want), "ahead {ahead}");
            buf[dst_at..dst_at + len].fill(0);
            // SAFETY: as above.
            unsafe { copy_streaming(base.add(dst_at), base.add(src_at), len) };
            store_fence();
            assert_eq!(&buf[dst_at..dst_at + len], &want[..], "ahead {ahead}");
        }
    }

    #[test]
    fn the_checksummed_copy_checksums_the_bytes_it_staged_while_its_source_changes() {
        // Regression: the crc was taken with a second read of the source
        // (LLVM folded the loads into `crc32 reg, [src]`), so a source
        // written meanwhile (a client's memory) was staged one way and
        // checksummed another: a Durable step that did not load. Another
        // thread writes the source all along here (atomically; the copy
        // reads it as it reads a client's memory, which another process
        // writes): whatever mix a copy stages, its crc is that mix's.
        use std::sync::atomic::AtomicU64;
        let len = 3 * CRC_LANE_BYTES + 40;
        let src: Vec<AtomicU64> = (0..len / 8 + 1).map(|i| AtomicU64::new(i as u64)).collect();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for w in &src {
                        w.store(k, Ordering::Relaxed);
                        k = k.wrapping_add(1);
                    }
                }
            });
            let mut dst = vec![0u8; len];
            let mut bad = 0;
            for _ in 0..20_000 {
                // SAFETY: src holds at least len bytes, dst exactly len; distinct.
                let c = unsafe { copy_streaming_crc(dst.as_mut_ptr(), src.as_ptr().cast::<u8>(), len) };
                store_fence();
                if c != crc32c::crc32c(&dst) {
                    bad += 1;
                }
            }
            stop.store(true, Ordering::Relaxed);
            assert_eq!(bad, 0, "copies of 20000 whose crc is not that of the bytes they staged");
        });
    }

    #[test]
    fn three_ranges_side_by_side_are_copied_and_checksummed_as_each_alone() {
        // Both sides page-aligned, as a shared region and staging are.
        let mut src_buf: Vec<u8> =
            (0..3 * 24_576u32 + 4096).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let at = src_buf.as_ptr().align_offset(4096);
        let src = &mut src_buf[at..];
        let mut dst = vec![0u8; 3 * 24_576 + 4096 + 64];
        let base = dst.as_mut_ptr().wrapping_add(dst.as_ptr().align_offset(4096));
        for len in [16usize, 64, 1024, 4096, 4112, TRIO_BYTES_MAX] {
            // SAFETY: the three destinations are disjoint ranges inside `dst`, the sources inside `src`.
            let (d, s) = unsafe {
                (
                    [base, base.add(len), base.add(2 * len)],
                    [src.as_ptr(), src.as_ptr().add(len), src.as_ptr().add(2 * len)],
                )
            };
            // SAFETY: as above.
            let got = unsafe { copy_streaming_crc3(d, s, len) };
            store_fence();
            let Some(got) = got else {
                // Only a CPU without SSE4.2 (or a misaligned case) refuses a suitable trio.
                assert!(!std::arch::is_x86_feature_detected!("sse4.2"), "len {len} refused");
                continue;
            };
            for k in 0..3 {
                let want = &src[k * len..(k + 1) * len];
                // SAFETY: written above, inside `dst`.
                let staged = unsafe { std::slice::from_raw_parts(d[k], len) };
                assert_eq!(staged, want, "len {len} lane {k}");
                assert_eq!(got[k], crc32c::crc32c(want), "len {len} lane {k}");
            }
        }
        // What does not suit is refused, nothing copied.
        let odd = [base.wrapping_add(1), base.wrapping_add(8192), base.wrapping_add(16384)];
        let s3 = [src.as_ptr(), src.as_ptr(), src.as_ptr()];
        // SAFETY: refused before any access.
        unsafe {
            assert_eq!(copy_streaming_crc3(odd, s3, 64), None, "misaligned destination");
            assert_eq!(copy_streaming_crc3([base, base.add(64), base.add(128)], s3, 24), None, "not whole 16 bytes");
            assert_eq!(
                copy_streaming_crc3(
                    [base, base.add(TRIO_BYTES_MAX + 16), base.add(2 * TRIO_BYTES_MAX + 32)],
                    s3,
                    TRIO_BYTES_MAX + 16
                ),
                None,
                "too long"
            );
        }
    }
}
