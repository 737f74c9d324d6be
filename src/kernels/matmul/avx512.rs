//! AVX-512 tile kernels for [`matmul`](super::matmul()) with several tokens (S > 1).
//!
//! Dot-product form, nothing packed: a tile is up to 4 weight rows × up to
//! 6 tokens, 24 zmm accumulators over 16-element K steps (10 loads per 24
//! FMAs), read straight from `x` and from the weights in their stored dtype
//! (F16 widened with `VCVTPH2PS`, BF16 by a 16-bit shift, in registers). The
//! K tail uses masked loads. Each tile's sums are reduced once, at the end
//! of K, and handed to the caller's epilogue.
//!
//! The earlier AVX2 path copied (widened) every 4-row weight tile into a
//! stack buffer once per 24-token block and packed x per chunk; for F32
//! weights those copies were a fifth of prefill time (see
//! benches/compare/NOTES.md, "Float prefill"). Here the only reuse is
//! through the caches: a chunk's weight rows stay in L2 while all token
//! groups pass over them, and a 4-row tile stays in L1 across the token
//! tiles of one group.

// Register tiles are indexed explicitly on purpose.
#![allow(clippy::needless_range_loop)]

use crate::ir::DType;
use crate::kernels::WeightRef;

/// Bytes of x one token group may span (it is re-read from L2 for every
/// weight-row tile of the chunk).
const TOKEN_GROUP_BYTES: usize = 384 << 10;

/// Tokens per group: one weight-row tile (widened once, for F16/BF16) is
/// reused from L1 by this many tokens before the next tile is loaded. As
/// many as fit [`TOKEN_GROUP_BYTES`], 48..=144, a multiple of the tile.
fn token_group(k: usize) -> usize {
    (TOKEN_GROUP_BYTES / (k * 4) / TT * TT).clamp(48, 144)
}
/// Token tile (accumulator columns).
pub(crate) const TT: usize = 6;
/// Weight-row tile (accumulator rows).
pub(crate) const RT: usize = 4;

/// Receives each tile's sums: `(first token, first column, columns, sums)`.
pub(crate) type Emit<'a> = dyn FnMut(usize, usize, usize, &[[f32; RT]]) + 'a;

/// Whether this CPU has AVX-512F/BW/VL with FMA and F16C.
pub(crate) fn available() -> bool {
    crate::kernels::Isa::detect().avx512()
}

/// Which weight rows one output tile reads, relative to the weight tensor.
#[derive(Clone, Copy)]
pub(crate) enum RowLayout {
    /// Output column `c` is weight row `c`.
    Plain,
    /// Output column `c` needs gate row `c` and up row `up + c`.
    GateUp { up: usize },
}

/// Computes output columns `c0..c1` for all `s` tokens of `x` (`[s, k]`)
/// against `w` (`[*, k]`, rows chosen by `layout`), calling
/// `emit(t, c, nc, sums)` for each tile: `sums[j]` holds, for token `t + j`,
/// the dot products with the tile's weight rows — `nc` plain rows
/// (`c..c+nc`), or for [`RowLayout::GateUp`] the `nc` gate rows followed by
/// the `nc` up rows. Requires [`available`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn columns(
    x: &[f32],
    s: usize,
    k: usize,
    w: WeightRef<'_>,
    layout: RowLayout,
    c0: usize,
    c1: usize,
    emit: &mut Emit<'_>,
) {
    let es = match w.dtype {
        DType::F32 => 4,
        DType::F16 | DType::BF16 => 2,
        _ => unreachable!("dtype checked by matmul"),
    };
    let last_row = match layout {
        RowLayout::Plain => c1,
        RowLayout::GateUp { up } => up + c1,
    };
    assert!(
        c0 <= c1 && x.len() >= s * k && last_row * k * es <= w.bytes.len() && k > 0 && available()
    );
    let tg = token_group(k);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: CPU features checked above; every row the tiles read is below
    // `last_row` (checked against the weight bytes), every token below `s`
    // (checked against `x`), and K loads stop at `k` (masked tail).
    unsafe {
        let wp = w.bytes.as_ptr();
        match w.dtype {
            DType::F32 => {
                x86::columns::<{ x86::F32 }>(x.as_ptr(), s, k, wp, layout, c0, c1, tg, emit)
            }
            DType::F16 => {
                x86::columns::<{ x86::F16 }>(x.as_ptr(), s, k, wp, layout, c0, c1, tg, emit)
            }
            _ => x86::columns::<{ x86::BF16 }>(x.as_ptr(), s, k, wp, layout, c0, c1, tg, emit),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, s, k, w, layout, c0, c1, emit, es, tg);
        unreachable!("available() is false on this architecture");
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Emit, RowLayout, RT, TT};
    use std::arch::x86_64::*;

    pub(super) const F32: u8 = 0;
    pub(super) const F16: u8 = 1;
    pub(super) const BF16: u8 = 2;

    const fn elem_size(dt: u8) -> usize {
        if dt == F32 {
            4
        } else {
            2
        }
    }

    /// 16 weights at `p` as f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn load<const DT: u8>(p: *const u8) -> __m512 {
        // SAFETY: caller guarantees 16 readable elements at p.
        unsafe {
            match DT {
                F32 => _mm512_loadu_ps(p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(p.cast()),
                ))),
            }
        }
    }

    /// The elements of `m` at `p` as f32, zeros elsewhere (masked-off lanes
    /// are not read).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn load_mask<const DT: u8>(p: *const u8, m: __mmask16) -> __m512 {
        // SAFETY: caller guarantees the lanes set in m are readable.
        unsafe {
            match DT {
                F32 => _mm512_maskz_loadu_ps(m, p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_maskz_loadu_epi16(m, p.cast()),
                ))),
            }
        }
    }

    /// `[sum(a), sum(b), sum(c), sum(d)]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    fn hsum4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
        let fold = |v: __m512| {
            let hi = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v));
            _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(hi))
        };
        let t0 = _mm256_hadd_ps(fold(a), fold(b));
        let t1 = _mm256_hadd_ps(fold(c), fold(d));
        let t2 = _mm256_hadd_ps(t0, t1);
        _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps::<1>(t2))
    }

    /// `out[j][i] = dot(x[j], w[i])` for `j < T`, `i < R` (other lanes 0).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn tile<const DT: u8, const R: usize, const T: usize>(
        x: *const f32,
        k: usize,
        w: &[*const u8; RT],
        out: &mut [[f32; RT]; TT],
    ) {
        let es = elem_size(DT);
        // SAFETY (whole body): x has T rows of k floats (stride k), each
        // w[i] for i < R has k elements; loads stop at k.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let k16 = k & !15;
            let mut e = 0;
            while e < k16 {
                let mut xv = [_mm512_setzero_ps(); T];
                for j in 0..T {
                    xv[j] = _mm512_loadu_ps(x.add(j * k + e));
                }
                for i in 0..R {
                    let wv = load::<DT>(w[i].add(e * es));
                    for j in 0..T {
                        acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
                    }
                }
                e += 16;
            }
            if e < k {
                let m: __mmask16 = ((1u32 << (k - e)) - 1) as u16;
                let mut xv = [_mm512_setzero_ps(); T];
                for j in 0..T {
                    xv[j] = _mm512_maskz_loadu_ps(m, x.add(j * k + e));
                }
                for i in 0..R {
                    let wv = load_mask::<DT>(w[i].add(e * es), m);
                    for j in 0..T {
                        acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
                    }
                }
            }
            let z = _mm512_setzero_ps();
            for j in 0..T {
                let row = |i: usize| acc.get(i).map_or(z, |a| a[j]);
                let v = hsum4(row(0), row(1), row(2), row(3));
                _mm_storeu_ps(out[j].as_mut_ptr(), v);
            }
        }
    }

    /// Token tiles of 6 (then the remainder) for one weight-row tile.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn token_tiles<const DT: u8, const R: usize>(
        x: *const f32,
        k: usize,
        t0: usize,
        t1: usize,
        w: &[*const u8; RT],
        c: usize,
        nc: usize,
        emit: &mut Emit<'_>,
    ) {
        let mut out = [[0f32; RT]; TT];
        let mut t = t0;
        // SAFETY: forwards the caller's bounds: tokens t0..t1 of x exist.
        unsafe {
            while t + TT <= t1 {
                tile::<DT, R, TT>(x.add(t * k), k, w, &mut out);
                emit(t, c, nc, &out);
                t += TT;
            }
            let xt = x.add(t * k);
            match t1 - t {
                0 => return,
                1 => tile::<DT, R, 1>(xt, k, w, &mut out),
                2 => tile::<DT, R, 2>(xt, k, w, &mut out),
                3 => tile::<DT, R, 3>(xt, k, w, &mut out),
                4 => tile::<DT, R, 4>(xt, k, w, &mut out),
                _ => tile::<DT, R, 5>(xt, k, w, &mut out),
            }
            emit(t, c, nc, &out[..t1 - t]);
        }
    }

    /// Converts `k` weights at `src` to f32 at `dst`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    unsafe fn widen<const DT: u8>(src: *const u8, k: usize, dst: *mut f32) {
        let es = elem_size(DT);
        // SAFETY: caller guarantees k elements at src and k floats at dst.
        unsafe {
            let mut e = 0;
            while e + 16 <= k {
                _mm512_storeu_ps(dst.add(e), load::<DT>(src.add(e * es)));
                e += 16;
            }
            if e < k {
                let m: __mmask16 = ((1u32 << (k - e)) - 1) as u16;
                _mm512_mask_storeu_ps(dst.add(e), m, load_mask::<DT>(src.add(e * es), m));
            }
        }
    }

    /// One weight-row tile (`R` rows at `p`) over tokens `t0..t1`, rows
    /// widened to f32 first (into `wbuf`) unless they are F32 already.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn row_tile<const DT: u8, const R: usize>(
        x: *const f32,
        k: usize,
        t0: usize,
        t1: usize,
        p: &[*const u8; RT],
        c: usize,
        nc: usize,
        wbuf: *mut f32,
        emit: &mut Emit<'_>,
    ) {
        // SAFETY: forwards the caller's bounds; wbuf has room for RT rows
        // of WIDEN_MAX_K floats, and each row is written before it is read.
        unsafe {
            if DT == F32 || k > WIDEN_MAX_K {
                return token_tiles::<DT, R>(x, k, t0, t1, p, c, nc, emit);
            }
            let mut q = [std::ptr::null::<u8>(); RT];
            for i in 0..R {
                let dst = wbuf.add(i * k);
                widen::<DT>(p[i], k, dst);
                q[i] = dst.cast::<u8>().cast_const();
            }
            token_tiles::<F32, R>(x, k, t0, t1, &q, c, nc, emit)
        }
    }

    /// Largest K whose F16/BF16 row tiles are widened into a stack buffer
    /// (beyond it they are converted in registers, once per token tile).
    const WIDEN_MAX_K: usize = 4096;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn columns<const DT: u8>(
        x: *const f32,
        s: usize,
        k: usize,
        w: *const u8,
        layout: RowLayout,
        c0: usize,
        c1: usize,
        token_group: usize,
        emit: &mut Emit<'_>,
    ) {
        let rb = k * elem_size(DT);
        let null = std::ptr::null::<u8>();
        // Written by `widen` before every read; left uninitialised so F32
        // calls (which never use it) pay nothing for it.
        let mut wbuf_mem = std::mem::MaybeUninit::<[f32; RT * WIDEN_MAX_K]>::uninit();
        let wbuf = wbuf_mem.as_mut_ptr().cast::<f32>();
        // SAFETY: the caller checked that rows below the layout's last row
        // and tokens below s are in bounds; only those are addressed.
        unsafe {
            let row = |r: usize| w.add(r * rb);
            let mut t0 = 0;
            while t0 < s {
                let t1 = (t0 + token_group).min(s);
                let mut c = c0;
                while c < c1 {
                    match layout {
                        RowLayout::Plain => {
                            let nc = (c1 - c).min(RT);
                            let mut p = [null; RT];
                            for (i, q) in p.iter_mut().enumerate().take(nc) {
                                *q = row(c + i);
                            }
                            match nc {
                                4 => row_tile::<DT, 4>(x, k, t0, t1, &p, c, nc, wbuf, emit),
                                3 => row_tile::<DT, 3>(x, k, t0, t1, &p, c, nc, wbuf, emit),
                                2 => row_tile::<DT, 2>(x, k, t0, t1, &p, c, nc, wbuf, emit),
                                _ => row_tile::<DT, 1>(x, k, t0, t1, &p, c, nc, wbuf, emit),
                            }
                            c += nc;
                        }
                        RowLayout::GateUp { up } => {
                            if c + 2 <= c1 {
                                let p = [row(c), row(c + 1), row(up + c), row(up + c + 1)];
                                row_tile::<DT, 4>(x, k, t0, t1, &p, c, 2, wbuf, emit);
                                c += 2;
                            } else {
                                let p = [row(c), row(up + c), null, null];
                                row_tile::<DT, 2>(x, k, t0, t1, &p, c, 1, wbuf, emit);
                                c += 1;
                            }
                        }
                    }
                }
                t0 = t1;
            }
        }
    }
}
