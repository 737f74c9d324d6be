//! The row-interleaved ("x8") weight layout of the fast path and its
//! small-S kernels.
//!
//! GGUF stores a weight matrix row by row. A single-token product then
//! multiplies each row's unit with the activation block across the vector
//! and has to sum the vector's lanes once per unit and row (the row-major
//! kernels in `avx2.rs`/`avx512.rs` spend about a third of their work on
//! those reductions and on gathering every row's scales). In the x8 layout
//! the rows are interleaved in groups of 8, so that one 256-bit load holds
//! the same four bytes of 8 rows: lane `r` of the vector is row `r`, every
//! product lands in its row's lane, a unit's total needs no reduction, the
//! rows' scales are vectors, and the f32 step covers 8 rows at once.
//!
//! Layout: a matrix of `n` rows (`n` a multiple of 8) is `n / 8` groups;
//! a group is its rows' storage blocks column by column, each block column
//! `8 × block_bytes` bytes, the same size as before. Inside a block column
//! every part of the GGUF block ([`parts`]) is stored in one of three ways:
//! * [`Part::Rows`] (the f16 scales): each row's bytes one after another;
//! * [`Part::Cols`] (Q6_K's byte scales): byte `i` of the 8 rows together;
//! * [`Part::Words`] (the quants): 4-byte word `w` of the 8 rows together,
//!   so the vector at `32 w` holds word `w` of every row.
//!
//! The kernels compute every output with the shared arithmetic of
//! `units.rs` (bit for bit what the row-major kernels and the scalar
//! reference give); [`unpack_rows`] turns a group back into GGUF rows for
//! the scalar level and the AVX-512 VNNI prefill decoder. The AVX2 prefill
//! kernels decode whole groups straight into their 16-bit units
//! (`simd::decode_units`: the `quad`s of a unit, transposed to rows).

use crate::ir::DType;

/// How one part of a GGUF block is stored in an x8 block column (see the
/// module docs); `(offset in the GGUF block, bytes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Rows(usize, usize),
    Cols(usize, usize),
    Words(usize, usize),
}

impl Part {
    const fn len(self) -> usize {
        match self {
            Part::Rows(_, l) | Part::Cols(_, l) | Part::Words(_, l) => l,
        }
    }
}

/// Rows per group.
pub const G: usize = 8;

/// The parts of a block of `dtype` in x8 order, or `None` for a dtype
/// without an x8 layout.
pub const fn parts(dtype: DType) -> Option<&'static [Part]> {
    use Part::*;
    Some(match dtype {
        DType::Q8_0 => &[Rows(0, 2), Words(2, 32)],
        DType::Q4_0 | DType::IQ4_NL => &[Rows(0, 2), Words(2, 16)],
        DType::Q4_1 => &[Rows(0, 2), Rows(2, 2), Words(4, 16)],
        DType::Q5_0 => &[Rows(0, 2), Words(2, 4), Words(6, 16)],
        DType::Q5_1 => &[Rows(0, 2), Rows(2, 2), Words(4, 4), Words(8, 16)],
        DType::Q3_K => &[Rows(108, 2), Words(96, 12), Words(0, 32), Words(32, 64)],
        DType::Q4_K => &[Rows(0, 2), Rows(2, 2), Words(4, 12), Words(16, 128)],
        DType::Q5_K => &[
            Rows(0, 2),
            Rows(2, 2),
            Words(4, 12),
            Words(16, 32),
            Words(48, 128),
        ],
        DType::Q6_K => &[Rows(208, 2), Cols(192, 16), Words(0, 128), Words(128, 64)],
        DType::IQ4_XS => &[Rows(0, 2), Rows(2, 2), Words(4, 4), Words(8, 128)],
        _ => return None,
    })
}

/// Offset in an x8 block column of part `i` of `parts`.
pub const fn part_offset(parts: &[Part], i: usize) -> usize {
    let mut o = 0;
    let mut p = 0;
    while p < i {
        o += G * parts[p].len();
        p += 1;
    }
    o
}

/// True when a `[n, k]` matrix of `dtype` can be stored as x8.
pub fn supports(dtype: DType, n: usize, k: usize) -> bool {
    parts(dtype).is_some() && n > 0 && n.is_multiple_of(G) && k > 0 && dtype.bytes_for(k).is_some()
}

/// Interleaves `src` (`n` GGUF rows of `row_bytes`) into `dst` (same size).
///
/// # Panics
/// If the dtype has no x8 layout, `n` is not a multiple of 8 or the sizes disagree.
pub fn repack(dtype: DType, src: &[u8], row_bytes: usize, dst: &mut [u8]) {
    let ps = parts(dtype).expect("x8: dtype without a layout");
    let bb = dtype.block_bytes();
    assert!(row_bytes.is_multiple_of(bb) && src.len() == dst.len());
    let n = src.len() / row_bytes;
    assert!(n * row_bytes == src.len() && n.is_multiple_of(G));
    let cb = G * bb;
    for g in 0..n / G {
        let rows = &src[g * G * row_bytes..(g + 1) * G * row_bytes];
        let group = &mut dst[g * G * row_bytes..(g + 1) * G * row_bytes];
        for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
            for (blk, col) in row.chunks_exact(bb).zip(group.chunks_exact_mut(cb)) {
                let mut o = 0;
                for &p in ps {
                    match p {
                        Part::Rows(at, l) => {
                            col[o + r * l..o + (r + 1) * l].copy_from_slice(&blk[at..at + l])
                        }
                        Part::Cols(at, l) => {
                            for (i, &v) in blk[at..at + l].iter().enumerate() {
                                col[o + G * i + r] = v;
                            }
                        }
                        Part::Words(at, l) => {
                            let dst = col[o + 4 * r..o + G * l].chunks_mut(4 * G);
                            for (d, w) in dst.zip(blk[at..at + l].chunks_exact(4)) {
                                d[..4].copy_from_slice(w);
                            }
                        }
                    }
                    o += G * p.len();
                }
            }
        }
    }
}

/// Writes GGUF rows `r0..r1` of an x8 matrix (`x8`, rows of `row_bytes`)
/// into `dst` (`(r1 - r0) * row_bytes` bytes).
///
/// # Panics
/// As [`repack`], or if the rows are out of range.
pub fn unpack_rows(
    dtype: DType,
    x8: &[u8],
    row_bytes: usize,
    r0: usize,
    r1: usize,
    dst: &mut [u8],
) {
    let ps = parts(dtype).expect("x8: dtype without a layout");
    let bb = dtype.block_bytes();
    let nblk = row_bytes / bb;
    assert!(
        nblk * bb == row_bytes && dst.len() == (r1 - r0) * row_bytes && r1 * row_bytes <= x8.len()
    );
    let cb = G * bb;
    // Whole groups column by column (the common case), then any partial group row by row.
    let (g0, g1) = (r0.div_ceil(G), r1 / G);
    if g0 < g1 {
        #[cfg(target_arch = "x86_64")]
        let avx2 = std::is_x86_feature_detected!("avx2");
        #[cfg(not(target_arch = "x86_64"))]
        let avx2 = false;
        let gb = G * row_bytes;
        let groups = x8[g0 * gb..g1 * gb].chunks_exact(gb);
        let out = dst[(g0 * G - r0) * row_bytes..(g1 * G - r0) * row_bytes].chunks_exact_mut(gb);
        for (group, out) in groups.zip(out) {
            for (b, col) in group.chunks_exact(cb).enumerate() {
                unpack_column(ps, col, out, row_bytes, b * bb, avx2);
            }
        }
    }
    for row in (r0..r1).filter(|&row| row < g0 * G || row >= g1.max(g0) * G) {
        let (g, r) = (row / G, row % G);
        for b in 0..nblk {
            let col = &x8[(g * nblk + b) * cb..(g * nblk + b + 1) * cb];
            let blk = &mut dst[(row - r0) * row_bytes + b * bb..][..bb];
            for (i, &p) in ps.iter().enumerate() {
                let o = part_offset(ps, i);
                match p {
                    Part::Rows(at, l) => {
                        blk[at..at + l].copy_from_slice(&col[o + r * l..o + (r + 1) * l])
                    }
                    Part::Cols(at, l) => {
                        for i in 0..l {
                            blk[at + i] = col[o + G * i + r];
                        }
                    }
                    Part::Words(at, l) => {
                        for w in 0..l / 4 {
                            blk[at + 4 * w..at + 4 * w + 4]
                                .copy_from_slice(&col[o + 4 * G * w + 4 * r..][..4]);
                        }
                    }
                }
            }
        }
    }
}

/// Writes block column `col` of a group into its 8 GGUF rows in `out`
/// (rows of `row_bytes`, the block at byte `at0` of each row).
fn unpack_column(
    ps: &[Part],
    col: &[u8],
    out: &mut [u8],
    row_bytes: usize,
    at0: usize,
    avx2: bool,
) {
    let mut o = 0;
    for &p in ps {
        match p {
            Part::Rows(at, l) => {
                for r in 0..G {
                    let d = r * row_bytes + at0 + at;
                    out[d..d + l].copy_from_slice(&col[o + r * l..o + (r + 1) * l]);
                }
            }
            Part::Cols(at, l) => {
                for r in 0..G {
                    let d = r * row_bytes + at0 + at;
                    for (i, v) in out[d..d + l].iter_mut().enumerate() {
                        *v = col[o + G * i + r];
                    }
                }
            }
            Part::Words(at, l) => {
                let nw = l / 4;
                let mut w = 0;
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    while w + 4 <= nw {
                        // SAFETY: AVX2 was detected; the function checks its bounds.
                        unsafe {
                            transpose4(
                                &col[o + 4 * G * w..o + 4 * G * (w + 4)],
                                out,
                                row_bytes,
                                at0 + at + 4 * w,
                            )
                        };
                        w += 4;
                    }
                }
                let _ = avx2;
                for w in w..nw {
                    for r in 0..G {
                        let d = r * row_bytes + at0 + at + 4 * w;
                        let s = o + 4 * G * w + 4 * r;
                        out[d..d + 4].copy_from_slice(&col[s..s + 4]);
                    }
                }
            }
        }
        o += G * p.len();
    }
}

/// Four words of 8 rows (`src`: 4 vectors, lane = row) transposed into
/// 16 bytes of each row (`out[r * row_bytes + at..][..16]`).
///
/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose4(src: &[u8], out: &mut [u8], row_bytes: usize, at: usize) {
    use std::arch::x86_64::*;
    assert!(src.len() == 128 && (G - 1) * row_bytes + at + 16 <= out.len());
    // SAFETY: bounds checked above; unaligned loads and stores.
    unsafe {
        let p = src.as_ptr() as *const __m256i;
        let (a, b, c, d) = (
            _mm256_loadu_si256(p),
            _mm256_loadu_si256(p.add(1)),
            _mm256_loadu_si256(p.add(2)),
            _mm256_loadu_si256(p.add(3)),
        );
        let (t0, t1) = (_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
        let (t2, t3) = (_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
        // Rows (0, 4), (1, 5), (2, 6), (3, 7) in the low and high halves.
        let u = [
            _mm256_unpacklo_epi64(t0, t2),
            _mm256_unpackhi_epi64(t0, t2),
            _mm256_unpacklo_epi64(t1, t3),
            _mm256_unpackhi_epi64(t1, t3),
        ];
        let o = out.as_mut_ptr().add(at);
        for (r, v) in u.into_iter().enumerate() {
            _mm_storeu_si128(
                o.add(r * row_bytes) as *mut __m128i,
                _mm256_castsi256_si128(v),
            );
            _mm_storeu_si128(
                o.add((r + 4) * row_bytes) as *mut __m128i,
                _mm256_extracti128_si256::<1>(v),
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod simd;

#[cfg(test)]
mod tests;
