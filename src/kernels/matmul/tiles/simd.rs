//! The tile kernels of the SIMD levels, written once over [`TileVec`] (an
//! [`F32Vec`] that can also load weights of every tile dtype and sum four
//! vectors by its level's tree) and instantiated for AVX2 (`__m256`, in
//! `matmul/avx2.rs`) and AVX-512 (`__m512`, in `matmul/avx512.rs`) by
//! `tiles_level!`.
//!
//! The generic functions are `#[inline(always)]` and carry no
//! `#[target_feature]`; the macro wraps each instantiation in a function
//! that enables the level's features, as the module docs of
//! [`crate::kernels::simd`] describe, so every level compiles to the loops
//! its hand-written kernel had (same operations, same bits).

// Register tiles are indexed explicitly on purpose.
#![allow(clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
use super::{elem_size, Sums, Tile, F16, F32};
#[cfg(target_arch = "x86_64")]
use crate::kernels::simd::F32Vec;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{__m128, _mm_prefetch, _mm_storeu_ps, _MM_HINT_T0};

/// What the tile kernels need of one SIMD width beyond [`F32Vec`].
///
/// # Safety
/// As [`F32Vec`]: every method may only run where the width's features are
/// enabled; pointers must be valid for what each method reads.
#[cfg(target_arch = "x86_64")]
pub(crate) trait TileVec: F32Vec {
    /// Vector registers of the width.
    const REGS: usize;

    /// `LANES` weights of dtype `DT` at `p` as f32.
    unsafe fn load_w<const DT: u8>(p: *const u8) -> Self;

    /// The `n < LANES` weights of dtype `DT` at `p` as f32, zeros in the
    /// other lanes (nothing past them is read).
    unsafe fn load_w_part<const DT: u8>(p: *const u8, n: usize) -> Self;

    /// `[sum(a), sum(b), sum(c), sum(d)]`, each by the level's fixed tree.
    unsafe fn hsum4(a: Self, b: Self, c: Self, d: Self) -> __m128;

    /// Full steps (elements `0..kf`, `kf` a multiple of `LANES`) of `op`
    /// (`R` rows, `T` tokens) that the width writes out itself for some
    /// tile shapes, with the same fused multiply-adds in the same order as
    /// [`tile`]'s loop; returns how many elements it did (0 or `kf`).
    ///
    /// # Safety
    /// As [`tile`].
    #[inline]
    unsafe fn own_steps<const DT: u8, const R: usize, const T: usize>(
        op: &Tile<'_>,
        kf: usize,
        acc: &mut [[Self; T]; R],
    ) -> usize {
        let _ = (op, kf, acc);
        0
    }
}

/// One weight of dtype `DT` at `p` as f32.
///
/// # Safety
/// One readable element at `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn one<const DT: u8>(p: *const u8) -> f32 {
    // SAFETY: caller guarantees one readable element at p.
    unsafe {
        match DT {
            F32 => f32::from_le_bytes(p.cast::<[u8; 4]>().read_unaligned()),
            F16 => {
                crate::kernels::f16_to_f32(u16::from_le_bytes(p.cast::<[u8; 2]>().read_unaligned()))
            }
            _ => crate::kernels::bf16_to_f32(u16::from_le_bytes(
                p.cast::<[u8; 2]>().read_unaligned(),
            )),
        }
    }
}

/// `out[j][i] = dot(x[j], w[i])` for `j < T`, `i < R` (other lanes 0) of
/// `op` (its `dt`, `r`, `t` are `DT`, `R`, `T`), in the order of the
/// [`super`] module docs.
///
/// # Safety
/// As [`super::Tiles::tile`], the width's features enabled.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn tile<V: TileVec, const DT: u8, const R: usize, const T: usize>(
    op: &Tile<'_>,
    out: &mut Sums,
) {
    let Tile { x, k, w, .. } = *op;
    let es = elem_size(DT);
    // SAFETY (whole body): x has T rows of k floats (stride k), each
    // w[i] for i < R has k elements; loads stop at k.
    unsafe {
        let mut acc = [[V::zero(); T]; R];
        let kf = k & !(V::LANES - 1);
        let e0 = V::own_steps::<DT, R, T>(op, kf, &mut acc);
        // Two copies of the loop, so that the one without prefetch has no
        // test for it.
        let e = if op.pf > 0 {
            steps::<V, DT, R, T, true>(op, e0, kf, &mut acc)
        } else {
            steps::<V, DT, R, T, false>(op, e0, kf, &mut acc)
        };
        if e < k {
            let n = k - e;
            let mut xv = [V::zero(); T];
            for j in 0..T {
                xv[j] = V::load_w_part::<F32>(x.add(j * k + e).cast(), n);
            }
            for i in 0..R {
                let wv = V::load_w_part::<DT>(w[i].add(e * es), n);
                for j in 0..T {
                    acc[i][j] = wv.mul_add(xv[j], acc[i][j]);
                }
            }
        }
        let z = V::zero();
        for j in 0..T {
            let row = |i: usize| acc.get(i).map_or(z, |a| a[j]);
            let v = V::hsum4(row(0), row(1), row(2), row(3));
            _mm_storeu_ps(out[j].as_mut_ptr(), v);
        }
    }
}

/// The full steps of [`tile`] from element `e` to `kf` (a multiple of
/// `LANES`), prefetching `op.pf` bytes ahead once per cache line of each
/// row if `PF`; returns `kf`.
///
/// # Safety
/// As [`tile`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn steps<V: TileVec, const DT: u8, const R: usize, const T: usize, const PF: bool>(
    op: &Tile<'_>,
    mut e: usize,
    kf: usize,
    acc: &mut [[V; T]; R],
) -> usize {
    let Tile { x, k, w, pf, .. } = *op;
    let es = elem_size(DT);
    // SAFETY: as in `tile`: loads stop at kf <= k; prefetches never fault.
    unsafe {
        while e < kf {
            if PF && (e * es).is_multiple_of(64) {
                for i in 0..R {
                    // A prefetch past the weights never faults.
                    _mm_prefetch::<_MM_HINT_T0>(w[i].wrapping_add(e * es + pf) as *const i8);
                }
            }
            if (R <= 2 && T >= 3) || R * T + T + 1 > V::REGS {
                // The R rows' weights first, each into its own register,
                // then each token's x once, multiplied into every row:
                // the form of the two-row tiles (`tiles::pair_tiles`), and
                // of any tile with too many tokens to hold their x in
                // registers. On the Zen 1 VM a loop of it over L1 operands
                // (F16, 2 rows x 6 tokens) took 1.08 TSC ticks per FMA
                // where the x-first order below took 1.5 (2 x 5, and the
                // 4 x 3 `asm!` loop 1.44; 12 independent FMAs 0.81-0.94).
                let mut wv = [V::zero(); R];
                for i in 0..R {
                    wv[i] = V::load_w::<DT>(w[i].add(e * es));
                }
                for j in 0..T {
                    let xj = V::load(x.add(j * k + e));
                    for i in 0..R {
                        acc[i][j] = wv[i].mul_add(xj, acc[i][j]);
                    }
                }
            } else {
                let mut xv = [V::zero(); T];
                for j in 0..T {
                    xv[j] = V::load(x.add(j * k + e));
                }
                for i in 0..R {
                    let wv = V::load_w::<DT>(w[i].add(e * es));
                    for j in 0..T {
                        acc[i][j] = wv.mul_add(xv[j], acc[i][j]);
                    }
                }
            }
            e += V::LANES;
        }
    }
    e
}

/// Converts `k` weights of dtype `DT` at `src` to f32 at `dst`.
///
/// # Safety
/// `k` elements at `src`, `k` floats at `dst`; the width's features enabled.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn widen<V: TileVec, const DT: u8>(src: *const u8, k: usize, dst: *mut f32) {
    let es = elem_size(DT);
    // SAFETY: caller guarantees k elements at src and k floats at dst.
    unsafe {
        let mut e = 0;
        while e + V::LANES <= k {
            V::load_w::<DT>(src.add(e * es)).store(dst.add(e));
            e += V::LANES;
        }
        while e < k {
            *dst.add(e) = one::<DT>(src.add(e * es));
            e += 1;
        }
    }
}

/// Implements [`Tiles`](super::Tiles) for the level `$level` with the
/// kernels above at vector type `$v`, compiled with the features `$feat`:
/// token tiles of `$tt` (the largest) down to 1 (and, if given, the
/// two-row tiles' `pair_tokens` and the one-row tiles' `row_tokens`, the
/// first of each list the largest; and the single-token product's
/// `gemv_prefetch`), the dtype, row and token
/// counts dispatched to monomorphic functions as the hand-written levels
/// did. On other architectures the level's kernels are unreachable.
macro_rules! tiles_level {
    ($level:ty, $v:ty, $feat:literal, widen_f16: $wf:expr, prefetch_rows: $pr:expr, tokens: [$tt:literal $(, $t:literal)*] $(, pair_tokens: [$pt:literal $(, $st:literal)*])? $(, row_tokens: [$rt:literal $(, $rs:literal)*])? $(, gemv_prefetch: $gp:expr)?) => {
        impl $crate::kernels::matmul::tiles::Tiles for $level {
            const TT: usize = $tt;
            $(const PAIR_TT: usize = $pt;)?
            $(const ROW_TT: usize = $rt;)?
            const WIDEN_F16: bool = $wf;
            const PREFETCH_ROWS: usize = $pr;
            $(const GEMV_PREFETCH: usize = $gp;)?

            unsafe fn tile(op: $crate::kernels::matmul::tiles::Tile<'_>, out: &mut $crate::kernels::matmul::tiles::Sums) {
                #[cfg(not(target_arch = "x86_64"))]
                {
                    let _ = (op, out);
                    unreachable!("no x86 SIMD on this architecture");
                }
                #[cfg(target_arch = "x86_64")]
                {
                    use $crate::kernels::matmul::tiles::{simd, Sums, Tile, BF16, F16, F32};

                    #[inline]
                    #[target_feature(enable = $feat)]
                    unsafe fn tile_r<const DT: u8>(op: Tile<'_>, out: &mut Sums) {
                        // SAFETY: forwarded.
                        unsafe {
                            match op.r {
                                4 => tile_t::<DT, 4>(op, out),
                                3 => tile_t::<DT, 3>(op, out),
                                2 => tile_t::<DT, 2>(op, out),
                                _ => tile_t::<DT, 1>(op, out),
                            }
                        }
                    }

                    #[inline]
                    #[target_feature(enable = $feat)]
                    unsafe fn tile_t<const DT: u8, const R: usize>(op: Tile<'_>, out: &mut Sums) {
                        // SAFETY: forwarded.
                        unsafe {
                            match op.t {
                                $tt => tile_n::<DT, R, $tt>(op, out),
                                $($t => tile_n::<DT, R, $t>(op, out),)*
                                $($pt => tile_n::<DT, R, $pt>(op, out), $($st => tile_n::<DT, R, $st>(op, out),)*)?
                                $($rt => tile_n::<DT, R, $rt>(op, out), $($rs => tile_n::<DT, R, $rs>(op, out),)*)?
                                _ => tile_n::<DT, R, 1>(op, out),
                            }
                        }
                    }

                    #[inline]
                    #[target_feature(enable = $feat)]
                    unsafe fn tile_n<const DT: u8, const R: usize, const T: usize>(
                        op: Tile<'_>,
                        out: &mut Sums,
                    ) {
                        // SAFETY: forwarded; the level's features are enabled.
                        unsafe { simd::tile::<$v, DT, R, T>(&op, out) }
                    }

                    // SAFETY: forwarded to the monomorphic kernel.
                    unsafe {
                        match op.dt {
                            F32 => tile_r::<F32>(op, out),
                            F16 => tile_r::<F16>(op, out),
                            _ => tile_r::<BF16>(op, out),
                        }
                    }
                }
            }

            unsafe fn widen(dt: u8, src: *const u8, k: usize, dst: *mut f32) {
                #[cfg(not(target_arch = "x86_64"))]
                {
                    let _ = (dt, src, k, dst);
                    unreachable!("no x86 SIMD on this architecture");
                }
                #[cfg(target_arch = "x86_64")]
                {
                    use $crate::kernels::matmul::tiles::{simd, BF16, F16, F32};

                    #[inline]
                    #[target_feature(enable = $feat)]
                    unsafe fn widen_dt<const DT: u8>(src: *const u8, k: usize, dst: *mut f32) {
                        // SAFETY: forwarded; the level's features are enabled.
                        unsafe { simd::widen::<$v, DT>(src, k, dst) }
                    }

                    // SAFETY: forwarded.
                    unsafe {
                        match dt {
                            F32 => widen_dt::<F32>(src, k, dst),
                            F16 => widen_dt::<F16>(src, k, dst),
                            _ => widen_dt::<BF16>(src, k, dst),
                        }
                    }
                }
            }
        }
    };
}
pub(crate) use tiles_level;
