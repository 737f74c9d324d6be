//! The SIMD levels' block steps, written once over [`F32Vec`] and
//! instantiated per width: AVX2 (8 lanes) and AVX-512F (16 lanes). The
//! widths differ only in lane count and tile shapes (the const parameters
//! of [`Simd`]); every per-element sum has the same order at both.

use super::{drive_decode, drive_tiled, BlockSteps, Ctx, Cvt, Item, BK, QK_CHUNK};
use crate::kernels::kv::{KvView, SeqSpan};
use crate::kernels::simd::F32Vec;
use crate::pool::SyncPtr;
use std::arch::x86_64::*;
use std::marker::PhantomData;

/// Widening with AVX2 and F16C, 8 values at a time.
pub(super) struct F16cCvt;

impl Cvt for F16cCvt {
    #[inline(always)]
    fn cvt(src: KvView<'_>, at: usize, dst: &mut [f32]) {
        // SAFETY: only used by the x86 levels, whose entry points
        // enable AVX2, FMA and F16C (detected).
        unsafe { crate::kernels::attention::widen::widen_avx2(src, at, dst) }
    }
}

/// The block steps of vector `V`: score tiles of `QK_KEYS` keys × up to
/// `QK_NC` vectors of rows, `P·V` tiles of `PV_NC` vectors of columns, and
/// `ROW_V` (= `BK / V::LANES`) vectors per row of one tile's keys.
pub(super) struct Simd<
    V,
    const QK_KEYS: usize,
    const QK_NC: usize,
    const PV_NC: usize,
    const ROW_V: usize,
>(PhantomData<V>);

/// AVX2 + FMA.
pub(super) type Avx2 = Simd<__m256, 6, 2, 2, { BK / 8 }>;
/// AVX-512F.
pub(super) type Avx512 = Simd<__m512, 8, 3, 4, { BK / 16 }>;

/// Scores of `NK` keys × `NC` vectors of rows: `st[j·rp + r] = Σ_e
/// kt[e·BK + j] · qt[e·rp + r]` (pointers already offset to the tile).
///
/// # Safety
/// `V`'s features are enabled; the caller guarantees d×rp floats at qt
/// (tile columns `LANES·NC` in bounds), d rows of BK keys at k (NK used)
/// and NK×rp floats at st.
#[inline(always)]
unsafe fn qk_tile<V: F32Vec, const NK: usize, const NC: usize>(
    qt: *const f32,
    rp: usize,
    k: *const f32,
    d: usize,
    st: *mut f32,
) {
    let l = V::LANES;
    // SAFETY: the caller's contract.
    unsafe {
        let mut e0 = 0;
        while e0 < d {
            let e1 = (e0 + QK_CHUNK).min(d);
            let mut a = [[V::zero(); NC]; NK];
            for e in e0..e1 {
                let mut qv = [V::zero(); NC];
                for (c, v) in qv.iter_mut().enumerate() {
                    *v = V::load(qt.add(e * rp + l * c));
                }
                for (j, aj) in a.iter_mut().enumerate() {
                    let kb = V::splat(*k.add(e * BK + j));
                    for (c, ajc) in aj.iter_mut().enumerate() {
                        *ajc = kb.mul_add(qv[c], *ajc);
                    }
                }
            }
            for (j, aj) in a.iter().enumerate() {
                for (c, ajc) in aj.iter().enumerate() {
                    let p = st.add(j * rp + l * c);
                    let v = if e0 == 0 { *ajc } else { V::load(p).add(*ajc) };
                    v.store(p);
                }
            }
            e0 = e1;
        }
    }
}

/// Keys `*j..` in tiles of `NK` while whole ones fit, `nc` vectors of rows.
///
/// # Safety
/// As [`qk_tile`] for every tile; `nc` is 1, 2 or 3.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn qk_keys<V: F32Vec, const NK: usize>(
    q0: *const f32,
    rp: usize,
    kt: *const f32,
    nk: usize,
    d: usize,
    s0: *mut f32,
    nc: usize,
    j: &mut usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        while *j + NK <= nk {
            let (kj, sj) = (kt.add(*j), s0.add(*j * rp));
            match nc {
                3 => qk_tile::<V, NK, 3>(q0, rp, kj, d, sj),
                2 => qk_tile::<V, NK, 2>(q0, rp, kj, d, sj),
                _ => qk_tile::<V, NK, 1>(q0, rp, kj, d, sj),
            }
            *j += NK;
        }
    }
}

/// `acc[i·d + L·c..] = acc·corr[i] + Σ_k st[k·rp + i] · v[k·d + L·c..]` for
/// `R` rows and `L·NC` columns (pointers offset to the tile).
///
/// # Safety
/// `V`'s features are enabled; the caller guarantees R rows of acc (stride
/// d) with `L·NC` columns, nk value rows (stride d) with `L·NC` columns,
/// nk×rp probabilities (R columns used) and R corrections.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_tile<V: F32Vec, const R: usize, const NC: usize>(
    st: *const f32,
    rp: usize,
    nk: usize,
    v: *const f32,
    acc: *mut f32,
    d: usize,
    corr: *const f32,
) {
    let l = V::LANES;
    // SAFETY: the caller's contract.
    unsafe {
        let mut a = [[V::zero(); NC]; R];
        for (i, ai) in a.iter_mut().enumerate() {
            let cr = V::splat(*corr.add(i));
            for (c, aic) in ai.iter_mut().enumerate() {
                *aic = V::load(acc.add(i * d + l * c)).mul(cr);
            }
        }
        for k in 0..nk {
            let mut vv = [V::zero(); NC];
            for (c, x) in vv.iter_mut().enumerate() {
                *x = V::load(v.add(k * d + l * c));
            }
            for (i, ai) in a.iter_mut().enumerate() {
                let p = V::splat(*st.add(k * rp + i));
                for (c, aic) in ai.iter_mut().enumerate() {
                    *aic = p.mul_add(vv[c], *aic);
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            for (c, aic) in ai.iter().enumerate() {
                aic.store(acc.add(i * d + l * c));
            }
        }
    }
}

/// `P·V` for rows `0..R` (pointers offset to the first row): tiles of
/// `PV_NC` vectors of columns, then of one, then scalar columns. Returns `R`.
///
/// # Safety
/// `V`'s features are enabled; the caller guarantees R rows of a (stride
/// d), R columns of nk×rp probabilities at s, R corrections and nk value
/// rows of d floats at v; columns stay below d.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_rows<V: F32Vec, const R: usize, const PV_NC: usize>(
    s: *const f32,
    rp: usize,
    nk: usize,
    v: *const f32,
    a: *mut f32,
    d: usize,
    c: *const f32,
) -> usize {
    let l = V::LANES;
    // SAFETY: the caller's contract.
    unsafe {
        let mut c0 = 0;
        while c0 + l * PV_NC <= d {
            pv_tile::<V, R, PV_NC>(s, rp, nk, v.add(c0), a.add(c0), d, c);
            c0 += l * PV_NC;
        }
        while c0 + l <= d {
            pv_tile::<V, R, 1>(s, rp, nk, v.add(c0), a.add(c0), d, c);
            c0 += l;
        }
        for i in 0..R {
            let cr = *c.add(i);
            for col in c0..d {
                let mut x = *a.add(i * d + col) * cr;
                for k in 0..nk {
                    x += *s.add(k * rp + i) * *v.add(k * d + col);
                }
                *a.add(i * d + col) = x;
            }
        }
    }
    R
}

/// One row's online softmax update, 8 lanes of AVX2 at every SIMD level:
/// the row maximum, `p = exp(s - m)` stored in place, the sum of `p` as two
/// alternating scalar chains (as the tiled kernels' two vector chains give
/// each row), and `l = l·corr + sum` (one fused multiply-add).
///
/// # Safety
/// AVX2 and FMA are available.
#[inline(always)]
pub(super) unsafe fn row_softmax_avx2(st: &mut [f32], nk: usize, m: &mut f32, l: &mut f32) -> f32 {
    // SAFETY: AVX2 and FMA are available (contract); st has room for BK
    // (a multiple of 8) lanes.
    unsafe {
        // The maximum (exact in any order): 8 lanes, then the tail.
        let n8 = nk / 8 * 8;
        let mut mv = <__m256 as F32Vec>::splat(f32::NEG_INFINITY);
        for k0 in (0..n8).step_by(8) {
            mv = mv.max(<__m256 as F32Vec>::load(st.as_ptr().add(k0)));
        }
        let mut lanes = [0f32; 8];
        mv.store(lanes.as_mut_ptr());
        let mx = lanes
            .iter()
            .chain(&st[n8..nk])
            .fold(f32::NEG_INFINITY, |a, &x| a.max(x));
        let m_new = m.max(mx);
        let cr = _mm256_cvtss_f32(<__m256 as F32Vec>::splat(*m - m_new).exp());
        let mv = <__m256 as F32Vec>::splat(m_new);
        let sp = st.as_mut_ptr();
        for k0 in (0..nk).step_by(8) {
            let p = <__m256 as F32Vec>::load(sp.add(k0)).sub(mv).exp();
            p.store(sp.add(k0));
        }
        let (mut s0, mut s1) = (0f32, 0f32);
        let mut k = 0;
        while k + 2 <= nk {
            s0 += st[k];
            s1 += st[k + 1];
            k += 2;
        }
        if k < nk {
            s0 += st[k];
        }
        *l = l.mul_add(cr, s0 + s1);
        *m = m_new;
        cr
    }
}

impl<
        V: F32Vec,
        const QK_KEYS: usize,
        const QK_NC: usize,
        const PV_NC: usize,
        const ROW_V: usize,
    > BlockSteps for Simd<V, QK_KEYS, QK_NC, PV_NC, ROW_V>
{
    type Cvt = F16cCvt;

    #[inline(always)]
    unsafe fn qk(qt: &[f32], rp: usize, kt: &[f32], nk: usize, st: &mut [f32]) {
        let l = V::LANES;
        let d = qt.len() / rp;
        assert!(qt.len() >= d * rp && st.len() >= nk * rp && kt.len() >= d * BK);
        assert!(rp.is_multiple_of(l) && nk <= BK && QK_NC <= 3);
        let mut r0 = 0;
        while r0 < rp {
            let nc = ((rp - r0) / l).min(QK_NC);
            // SAFETY: r0 + L·nc <= rp; keys j..j+NK <= nk <= BK; st has
            // nk×rp floats (asserted); V's features enabled (contract).
            unsafe {
                let (q0, s0) = (qt.as_ptr().add(r0), st.as_mut_ptr().add(r0));
                let mut j = 0;
                qk_keys::<V, QK_KEYS>(q0, rp, kt.as_ptr(), nk, d, s0, nc, &mut j);
                qk_keys::<V, 1>(q0, rp, kt.as_ptr(), nk, d, s0, nc, &mut j);
            }
            r0 += l * nc;
        }
    }

    #[inline(always)]
    unsafe fn softmax(st: &mut [f32], rp: usize, nk: usize, mlc: &mut [f32]) {
        let lanes = V::LANES;
        let (m, rest) = mlc.split_at_mut(rp);
        let (l, corr) = rest.split_at_mut(rp);
        assert!(st.len() >= nk * rp && m.len() >= rp && l.len() >= rp && corr.len() >= rp);
        assert!(rp.is_multiple_of(lanes));
        // SAFETY: all accesses are at r0..r0+LANES <= rp of rows k < nk;
        // V's features enabled (contract).
        unsafe {
            let sp = st.as_mut_ptr();
            for r0 in (0..rp).step_by(lanes) {
                let mut mx = V::splat(f32::NEG_INFINITY);
                for k in 0..nk {
                    mx = mx.max(V::load(sp.add(k * rp + r0)));
                }
                let m_old = V::load(m.as_ptr().add(r0));
                // A row with no visible key yet (all `-inf`, below its
                // sliding window) keeps a finite maximum: zeros, not NaN.
                let m_new = m_old.max(mx).max(V::splat(f32::MIN));
                let cr = m_old.sub(m_new).exp();
                let mut s0 = V::zero();
                let mut s1 = V::zero();
                let mut k = 0;
                while k + 2 <= nk {
                    let a = sp.add(k * rp + r0);
                    let b = sp.add((k + 1) * rp + r0);
                    let pa = V::load(a).sub(m_new).exp();
                    let pb = V::load(b).sub(m_new).exp();
                    pa.store(a);
                    pb.store(b);
                    s0 = s0.add(pa);
                    s1 = s1.add(pb);
                    k += 2;
                }
                if k < nk {
                    let a = sp.add(k * rp + r0);
                    let pa = V::load(a).sub(m_new).exp();
                    pa.store(a);
                    s0 = s0.add(pa);
                }
                let l_old = V::load(l.as_ptr().add(r0));
                let l_new = l_old.mul_add(cr, s0.add(s1));
                l_new.store(l.as_mut_ptr().add(r0));
                m_new.store(m.as_mut_ptr().add(r0));
                cr.store(corr.as_mut_ptr().add(r0));
            }
        }
    }

    #[inline(always)]
    unsafe fn pv(st: &[f32], rp: usize, nk: usize, vt: &[f32], acc: &mut [f32], corr: &[f32]) {
        let d = acc.len() / rp;
        assert!(st.len() >= nk * rp && acc.len() >= rp * d && corr.len() >= rp);
        assert!(vt.len() >= nk * d && rp.is_multiple_of(2));
        let (sp, ap, cp, vp) = (st.as_ptr(), acc.as_mut_ptr(), corr.as_ptr(), vt.as_ptr());
        // SAFETY: rows r0..r0+R <= rp (rp is even); nk value rows of d
        // floats at vt (asserted); V's features enabled (contract).
        unsafe {
            let mut r0 = 0;
            while r0 < rp {
                let (s, a, c) = (sp.add(r0), ap.add(r0 * d), cp.add(r0));
                // Blocks of 6 rows (tiled items), 4 (decode items of 3 or
                // 4 heads a group: 8 accumulators in flight), then 2.
                r0 += match rp - r0 {
                    6.. => pv_rows::<V, 6, PV_NC>(s, rp, nk, vp, a, d, c),
                    4 => pv_rows::<V, 4, PV_NC>(s, rp, nk, vp, a, d, c),
                    _ => pv_rows::<V, 2, PV_NC>(s, rp, nk, vp, a, d, c),
                };
            }
        }
    }

    #[inline(always)]
    unsafe fn row_qk(qs: &[f32], kt: &[f32], nk: usize, st: &mut [f32]) {
        let l = V::LANES;
        let d = qs.len();
        assert!(qs.len() >= d && kt.len() >= d * BK && st.len() >= BK && nk <= BK);
        assert!(ROW_V * l == BK);
        // All BK lanes are computed (a fixed-length loop): the lanes past
        // `nk` hold scores of stale keys, which nothing reads.
        // SAFETY: ROW_V·LANES = BK lanes of kt rows and st (asserted); V's
        // features enabled (contract).
        unsafe {
            let (kp, sp) = (kt.as_ptr(), st.as_mut_ptr());
            let mut e0 = 0;
            while e0 < d {
                let e1 = (e0 + QK_CHUNK).min(d);
                let mut a = [V::zero(); ROW_V];
                for (e, &qe) in qs.iter().enumerate().take(e1).skip(e0) {
                    let qb = V::splat(qe);
                    for (v, av) in a.iter_mut().enumerate() {
                        *av = V::load(kp.add(e * BK + l * v)).mul_add(qb, *av);
                    }
                }
                for (v, av) in a.iter().enumerate() {
                    let p = sp.add(l * v);
                    let x = if e0 == 0 { *av } else { V::load(p).add(*av) };
                    x.store(p);
                }
                e0 = e1;
            }
        }
    }

    #[inline(always)]
    unsafe fn row_softmax(st: &mut [f32], nk: usize, m: &mut f32, l: &mut f32) -> f32 {
        // SAFETY: AVX2/FMA available (every SIMD level implies them).
        unsafe { row_softmax_avx2(st, nk, m, l) }
    }
}

/// The entry points of one level: `$tiled` and `$decode` run
/// [`drive_tiled`] and [`drive_decode`] with the steps `$steps`, compiled
/// with the features `$feat`.
macro_rules! level_entry_points {
    ($tiled:ident, $decode:ident, $steps:ty, $feat:literal, $name:literal) => {
        #[doc = concat!("One tiled item with ", $name, ".")]
        ///
        /// # Safety
        #[doc = concat!("The features ", $feat, " are available.")]
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $tiled(
            ctx: &Ctx<'_>,
            it: &Item<'_>,
            out: SyncPtr<f32>,
            scr: &mut [f32],
        ) {
            // SAFETY: this level's features are available (this function's contract).
            unsafe { drive_tiled::<$steps>(ctx, it, out, scr) }
        }

        #[doc = concat!("One decode item with ", $name, ".")]
        ///
        /// # Safety
        #[doc = concat!("The features ", $feat, " are available.")]
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $decode(
            ctx: &Ctx<'_>,
            seq: &SeqSpan<'_>,
            g: usize,
            span: usize,
            part: &mut [f32],
            scr: &mut [f32],
        ) {
            // SAFETY: as above.
            unsafe { drive_decode::<$steps>(ctx, seq, g, span, part, scr) }
        }
    };
}

level_entry_points!(tiled_avx2, decode_avx2, Avx2, "avx2,fma,f16c", "AVX2+FMA");
level_entry_points!(
    tiled_avx512,
    decode_avx512,
    Avx512,
    "avx512f,avx2,fma,f16c",
    "AVX-512F"
);
