use super::super::avx2::x86::{hsum, hsum4};
use super::{BLOCK, BLOCK_BYTES};
use std::arch::x86_64::*;

/// `sign << 7 | e` for each nibble `sign << 3 | e`, in both lanes.
static TABLE: [u8; 32] = {
    let mut t = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        let n = (i % 16) as u8;
        t[i] = (n & 8) << 4 | (n & 7);
        i += 1;
    }
    t
};

/// The bf16 words of the block at `q`: weights 0-7 and 16-23, then 8-15
/// and 24-31 (see [`dot`]).
///
/// # Safety
/// `q` points to [`BLOCK_BYTES`] readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn words(q: *const u8, table: __m256i, halves: __m256i, lo4: __m256i) -> (__m256i, __m256i) {
    // SAFETY: the block's bytes (caller); unaligned loads. Byte 0 is the
    // broadcast high bits, 1..17 the nibbles (in both lanes), 17.. the
    // low bytes.
    let (f, nib, low) = unsafe {
        (
            _mm256_set1_epi8(*q as i8),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(q.add(1) as *const __m128i)),
            _mm256_loadu_si256(q.add(17) as *const __m256i),
        )
    };
    let nibs = _mm256_and_si256(_mm256_srlv_epi32(nib, halves), lo4);
    let hi = _mm256_add_epi8(_mm256_shuffle_epi8(table, nibs), f);
    (_mm256_unpacklo_epi8(low, hi), _mm256_unpackhi_epi8(low, hi))
}

/// The constants of [`words`]: the table, the lane shifts, the nibble mask.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn consts() -> (__m256i, __m256i, __m256i) {
    // SAFETY: TABLE is 32 bytes; unaligned load.
    let table = unsafe { _mm256_loadu_si256(TABLE.as_ptr() as *const __m256i) };
    (
        table,
        _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4),
        _mm256_set1_epi8(0x0f),
    )
}

/// [`dot`] for four rows of the same length, sharing each load of
/// `xp`; one accumulator per row, as in [`dot`].
///
/// # Safety
/// As [`dot`], for each row.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot4(rows: [&[u8]; 4], xp: &[f32]) -> [f32; 4] {
    let nb = rows[0].len() / BLOCK_BYTES;
    let xp = &xp[..nb * BLOCK];
    // One bounds check per row here instead of one per block below.
    let p = rows.map(|r| r[..nb * BLOCK_BYTES].as_ptr());
    let (table, halves, lo4) = consts();
    let odd = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let mut acc = [_mm256_setzero_ps(); 4];
    for (b, x) in xp.chunks_exact(BLOCK).enumerate() {
        // SAFETY: 32 f32; unaligned loads.
        let xv = unsafe {
            [
                _mm256_loadu_ps(x.as_ptr()),
                _mm256_loadu_ps(x.as_ptr().add(8)),
                _mm256_loadu_ps(x.as_ptr().add(16)),
                _mm256_loadu_ps(x.as_ptr().add(24)),
            ]
        };
        for r in 0..4 {
            // SAFETY: block b < nb of a row checked to hold nb blocks.
            let (wa, wb) = unsafe {
                let q = p[r].add(b * BLOCK_BYTES);
                words(q, table, halves, lo4)
            };
            let e0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wa));
            let o0 = _mm256_castsi256_ps(_mm256_and_si256(wa, odd));
            let e1 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wb));
            let o1 = _mm256_castsi256_ps(_mm256_and_si256(wb, odd));
            let a = _mm256_fmadd_ps(e0, xv[0], acc[r]);
            let a = _mm256_fmadd_ps(o0, xv[1], a);
            let a = _mm256_fmadd_ps(e1, xv[2], a);
            acc[r] = _mm256_fmadd_ps(o1, xv[3], a);
        }
    }
    let v = hsum4(acc[0], acc[1], acc[2], acc[3]);
    let mut out = [0f32; 4];
    // SAFETY: 4 floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), v) };
    out
}

/// The blocks of one row as coded bf16 values (exceptions not applied):
/// in natural order, or with `PERMUTED` each block of 32 in
/// [`super::ORDER`] (the order in which [`dot`] multiplies them).
///
/// # Safety
/// The CPU must support avx2/fma; `out` holds 32 values per block.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode<const PERMUTED: bool>(blocks: &[u8], out: &mut [u16]) {
    let (table, halves, lo4) = consts();
    // Per 128-bit lane: the even words, then the odd ones.
    let split = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7,
        10, 11, 14, 15,
    );
    let p = blocks.as_ptr();
    let nb = blocks.len() / BLOCK_BYTES;
    for (b, o) in out.chunks_exact_mut(BLOCK).take(nb).enumerate() {
        // SAFETY: block b lies within `blocks`; `o` holds 32 u16 (64
        // bytes). Unaligned loads and stores.
        unsafe {
            let q = p.add(b * BLOCK_BYTES);
            let (wa, wb) = words(q, table, halves, lo4);
            let (lo, hi) = if PERMUTED {
                // wa: weights 0-7 | 16-23; as 64-bit quarters after the
                // split: (0,2,4,6) (1,3,5,7) (16,..,22) (17,..,23); 0xD8
                // orders them evens 0-6, evens 16-22, odds 1-7, odds 17-23.
                (
                    _mm256_permute4x64_epi64::<0xD8>(_mm256_shuffle_epi8(wa, split)),
                    _mm256_permute4x64_epi64::<0xD8>(_mm256_shuffle_epi8(wb, split)),
                )
            } else {
                (
                    _mm256_permute2x128_si256::<0x20>(wa, wb),
                    _mm256_permute2x128_si256::<0x31>(wa, wb),
                )
            };
            let d = o.as_mut_ptr() as *mut __m256i;
            _mm256_storeu_si256(d, lo);
            _mm256_storeu_si256(d.add(1), hi);
        }
    }
}

/// Encodes the 32 bf16 values at `src` (64 bytes) into the 49-byte
/// block at `out` when given, and returns the mask of the weights below
/// the window (exceptions; the caller re-encodes such a block with the
/// portable encoder, which lists them, and writes the same bytes).
///
/// # Safety
/// The CPU must support avx2; `src` points to 64 readable bytes and
/// `out`, if given, to 49 writable ones.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn encode_block(src: *const u8, out: Option<*mut u8>) -> u32 {
    // SAFETY: as documented; unaligned loads.
    let (a, b) = unsafe {
        (
            _mm256_loadu_si256(src as *const __m256i),
            _mm256_loadu_si256(src.add(32) as *const __m256i),
        )
    };
    // packus works per 128-bit lane; 0xD8 puts the quarters back in order.
    let pack = |x: __m256i, y: __m256i| _mm256_permute4x64_epi64::<0xD8>(_mm256_packus_epi16(x, y));
    let hib = pack(_mm256_srli_epi16::<8>(a), _mm256_srli_epi16::<8>(b));
    let hi7 = _mm256_and_si256(hib, _mm256_set1_epi8(0x7f));
    let m = _mm_max_epu8(
        _mm256_castsi256_si128(hi7),
        _mm256_extracti128_si256::<1>(hi7),
    );
    let m = _mm_max_epu8(m, _mm_srli_si128::<8>(m));
    let m = _mm_max_epu8(m, _mm_srli_si128::<4>(m));
    let m = _mm_max_epu8(m, _mm_srli_si128::<2>(m));
    let m = _mm_max_epu8(m, _mm_srli_si128::<1>(m));
    let f = (_mm_cvtsi128_si32(m) as u8).saturating_sub(7);
    let fv = _mm256_set1_epi8(f as i8);
    let below = _mm256_movemask_epi8(_mm256_cmpgt_epi8(fv, hi7)) as u32;
    if let Some(out) = out {
        let low = _mm256_set1_epi16(0xff);
        let lows = pack(_mm256_and_si256(a, low), _mm256_and_si256(b, low));
        let sign = _mm256_srli_epi16::<4>(_mm256_and_si256(hib, _mm256_set1_epi8(-128)));
        let nib = _mm256_or_si256(_mm256_subs_epu8(hi7, fv), sign);
        let nibs = _mm_or_si128(
            _mm256_castsi256_si128(nib),
            _mm_slli_epi16::<4>(_mm256_extracti128_si256::<1>(nib)),
        );
        // SAFETY: `out` has 49 writable bytes; unaligned stores.
        unsafe {
            *out = f;
            _mm_storeu_si128(out.add(1) as *mut __m128i, nibs);
            _mm256_storeu_si256(out.add(17) as *mut __m256i, lows);
        }
    }
    below
}

/// One row's blocks · `xp` (x permuted by `permute_x`).
///
/// Per block: the 16 nibble bytes, loaded into both 128-bit lanes and
/// shifted right by 0 in the low lane and 4 in the high one, give the
/// nibbles of weights 0-15 and 16-31; a fixed table (`vpshufb`) turns
/// each into `sign << 7 | e`, and adding `f` makes the high bytes.
/// Interleaving with the low bytes gives bf16 words: weights 0-7 and
/// 16-23 in one register, 8-15 and 24-31 in the other (the unpacks work
/// per 128-bit lane). Each 32-bit lane then holds a pair, widened by
/// shift (even) and mask (odd), hence `permute_x`'s order. The four
/// vectors are multiply-added into one 8-lane accumulator in that order
/// and summed by the tiles' tree: exactly the 8-lane tile order of
/// [`crate::kernels::matmul::tiles`] over the permuted values.
///
/// # Safety
/// The CPU must support avx2/fma; `blocks` is whole blocks and `xp`
/// holds 32 elements per block.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot(blocks: &[u8], xp: &[f32]) -> f32 {
    let nb = blocks.len() / BLOCK_BYTES;
    let xp = &xp[..nb * BLOCK];
    let (table, halves, lo4) = consts();
    let odd = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let mut acc = _mm256_setzero_ps();
    let p = blocks.as_ptr();
    for (b, x) in xp.chunks_exact(BLOCK).enumerate() {
        // SAFETY: block b < nb lies within `blocks` (49 bytes from q);
        // x holds 32 f32. Unaligned loads.
        let ((wa, wb), xv) = unsafe {
            (
                words(p.add(b * BLOCK_BYTES), table, halves, lo4),
                [
                    _mm256_loadu_ps(x.as_ptr()),
                    _mm256_loadu_ps(x.as_ptr().add(8)),
                    _mm256_loadu_ps(x.as_ptr().add(16)),
                    _mm256_loadu_ps(x.as_ptr().add(24)),
                ],
            )
        };
        let ws = [
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wa)),
            _mm256_castsi256_ps(_mm256_and_si256(wa, odd)),
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wb)),
            _mm256_castsi256_ps(_mm256_and_si256(wb, odd)),
        ];
        for u in 0..4 {
            acc = _mm256_fmadd_ps(ws[u], xv[u], acc);
        }
    }
    hsum(acc)
}
