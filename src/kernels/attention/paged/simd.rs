//! The SIMD levels' block steps, written once over [`F32Vec`] and
//! instantiated per width: AVX2 (8 lanes) and AVX-512F (16 lanes). The
//! widths differ only in lane count and tile shapes (the const parameters
//! of [`Simd`]); every per-element sum has the same order at both.

use super::{
    drive_decode, drive_tiled, elem, Ahead, BlockSteps, Ctx, Cvt, DecodeItem, Item, Probs, Runs,
    BK, QK_CHUNK,
};
use crate::kernels::kv::KvView;
use crate::kernels::matmul::tiles::elem_size;
use crate::kernels::matmul::tiles::simd::TileVec;
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
/// `QK_NC` vectors of rows, `P·V` tiles of `PV_NC` vectors of columns for
/// 4 or 6 rows; blocks of 1 to 3 rows (decode items) take `FEW` vectors
/// of keys or columns per row (up to 3·FEW accumulators, all in
/// registers with the row broadcasts and one loaded vector).
pub(super) struct Simd<
    V,
    const QK_KEYS: usize,
    const QK_NC: usize,
    const PV_NC: usize,
    const FEW: usize,
>(PhantomData<V>);

/// AVX2 + FMA (16 registers: 9 accumulators for 3 rows; with 12, LLVM
/// spills one in the score and `P·V` loops).
pub(super) type Avx2 = Simd<__m256, 6, 2, 2, 3>;
/// AVX-512F (32 registers).
pub(super) type Avx512 = Simd<__m512, 8, 3, 4, 4>;

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

/// Where `P[k, i]` is: key-major (`KM`, tiled items) at `k·ks + i`,
/// row-major (decode items) at `k + i·BK`.
#[inline(always)]
fn prob<const KM: bool>(k: usize, i: usize, ks: usize) -> usize {
    if KM {
        k * ks + i
    } else {
        k + i * BK
    }
}

/// `acc[i·d + c0 + L·c..] = acc·corr[i] + Σ_k P[k, i] · V[k, c0 + L·c..]`
/// for `R` rows and `L·NC` columns from `c0` (acc and st offset to the
/// first row; `P[k, i]` at [`prob`]), the values of dtype `DT` in
/// `v`, one run at a time.
///
/// # Safety
/// `V`'s features are enabled; the caller guarantees R rows of acc (stride
/// d) with columns `c0..c0 + L·NC`, nk keys of `v` with those columns,
/// the probabilities of nk keys for R rows and R corrections.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_tile<V: TileVec, const DT: u8, const R: usize, const NC: usize, const KM: bool>(
    st: *const f32,
    ks: usize,
    nk: usize,
    v: &Runs,
    c0: usize,
    acc: *mut f32,
    d: usize,
    corr: *const f32,
    ahead: &mut Ahead<'_>,
) {
    let l = V::LANES;
    let es = elem_size(DT);
    // SAFETY: the caller's contract.
    unsafe {
        let mut a = [[V::zero(); NC]; R];
        for (i, ai) in a.iter_mut().enumerate() {
            let cr = V::splat(*corr.add(i));
            for (c, aic) in ai.iter_mut().enumerate() {
                *aic = V::load(acc.add(i * d + c0 + l * c)).mul(cr);
            }
        }
        for (run, &at) in v.at[..nk.div_ceil(v.len)].iter().enumerate() {
            let k0 = run * v.len;
            let base = at.add(c0 * es);
            let mut vk = base;
            for k in 0..v.len.min(nk - k0) {
                if k % 4 == 0 {
                    // A few lines of the next tile's keys per 4 keys.
                    ahead.step();
                }
                if NC < R {
                    // NC value vectors, then one row broadcast at a time:
                    // R·NC + NC + 1 registers (15 for the tiled 6×2 at AVX2).
                    let vv: [V; NC] = std::array::from_fn(|c| V::load_w::<DT>(vk.add(l * c * es)));
                    for (i, ai) in a.iter_mut().enumerate() {
                        let pi = V::splat(*st.add(prob::<KM>(k0 + k, i, ks)));
                        for (aic, &vc) in ai.iter_mut().zip(&vv) {
                            *aic = pi.mul_add(vc, *aic);
                        }
                    }
                } else {
                    // R broadcasts, then one value vector at a time: R·NC +
                    // R + 1 registers (16 for a decode 3×4 at AVX2).
                    let p: [V; R] =
                        std::array::from_fn(|i| V::splat(*st.add(prob::<KM>(k0 + k, i, ks))));
                    for c in 0..NC {
                        let vv = V::load_w::<DT>(vk.add(l * c * es));
                        for (ai, &pi) in a.iter_mut().zip(&p) {
                            ai[c] = pi.mul_add(vv, ai[c]);
                        }
                    }
                }
                vk = vk.add(v.step * es);
            }
        }
        for (i, ai) in a.iter().enumerate() {
            for (c, aic) in ai.iter().enumerate() {
                aic.store(acc.add(i * d + c0 + l * c));
            }
        }
    }
}

/// `P·V` for rows `0..R` (pointers offset to the first row): tiles of
/// `PV_NC` vectors of columns, then of two, of one, then scalar columns.
/// Returns `R`.
///
/// # Safety
/// `V`'s features are enabled; the caller guarantees R rows of a (stride
/// d), the probabilities of nk keys for R rows at s (strides `ps`), R
/// corrections and nk keys of d values in `v`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_rows<V: TileVec, const DT: u8, const R: usize, const PV_NC: usize, const KM: bool>(
    s: *const f32,
    ks: usize,
    nk: usize,
    v: &Runs,
    a: *mut f32,
    d: usize,
    c: *const f32,
    ahead: &mut Ahead<'_>,
) -> usize {
    let l = V::LANES;
    // SAFETY: the caller's contract.
    unsafe {
        let mut c0 = 0;
        while c0 + l * PV_NC <= d {
            pv_tile::<V, DT, R, PV_NC, KM>(s, ks, nk, v, c0, a, d, c, ahead);
            c0 += l * PV_NC;
        }
        if PV_NC > 2 && c0 + 2 * l <= d {
            pv_tile::<V, DT, R, 2, KM>(s, ks, nk, v, c0, a, d, c, ahead);
            c0 += 2 * l;
        }
        while c0 + l <= d {
            pv_tile::<V, DT, R, 1, KM>(s, ks, nk, v, c0, a, d, c, ahead);
            c0 += l;
        }
        for i in 0..R {
            let cr = *c.add(i);
            for col in c0..d {
                let mut x = *a.add(i * d + col) * cr;
                for k in 0..nk {
                    x += *s.add(prob::<KM>(k, i, ks)) * elem::<DT>(v.ptr::<DT>(k, col));
                }
                *a.add(i * d + col) = x;
            }
        }
    }
    R
}

/// `P·V` of rows `0..rp` in blocks of 6 rows (tiled items), then 4, then
/// 3, 2, 1 with `FEW` vectors of columns (decode items: a GQA group).
///
/// # Safety
/// As [`pv_rows`] for every block.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_all<V: TileVec, const DT: u8, const PV_NC: usize, const FEW: usize, const KM: bool>(
    sp: *const f32,
    ks: usize,
    rp: usize,
    nk: usize,
    v: &Runs,
    ap: *mut f32,
    d: usize,
    cp: *const f32,
    ahead: &mut Ahead<'_>,
) {
    let rs = if KM { 1 } else { BK };
    // SAFETY: the caller's contract.
    unsafe {
        let mut r0 = 0;
        while r0 < rp {
            let (s, a, c) = (sp.add(r0 * rs), ap.add(r0 * d), cp.add(r0));
            r0 += match rp - r0 {
                6.. => pv_rows::<V, DT, 6, PV_NC, KM>(s, ks, nk, v, a, d, c, ahead),
                4 | 5 => pv_rows::<V, DT, 4, PV_NC, KM>(s, ks, nk, v, a, d, c, ahead),
                3 => pv_rows::<V, DT, 3, FEW, KM>(s, ks, nk, v, a, d, c, ahead),
                2 => pv_rows::<V, DT, 2, FEW, KM>(s, ks, nk, v, a, d, c, ahead),
                _ => pv_rows::<V, DT, 1, FEW, KM>(s, ks, nk, v, a, d, c, ahead),
            };
        }
    }
}

/// Scores of rows `0..R` (`q`, stride d) against key vectors `x0..x0+NV`
/// of a tile (keys `L·x0..`), to `s[r·BK + L·x]`: per 16-dim chunk one
/// multiply-add chain per lane, the chunks added in order (as
/// [`qk_tile`] gives each row).
///
/// # Safety
/// `V`'s features are enabled; `k`'s runs hold whole vectors (their
/// length a multiple of `L`) and the keys of vectors `x0..x0+NV`; R rows
/// of d floats at q, R rows of BK floats at s.
#[inline(always)]
unsafe fn qk_rows<V: TileVec, const DT: u8, const R: usize, const NV: usize>(
    q: *const f32,
    d: usize,
    k: &Runs,
    x0: usize,
    s: *mut f32,
    ahead: &mut Ahead<'_>,
) {
    let l = V::LANES;
    let es = elem_size(DT);
    // SAFETY: the caller's contract.
    unsafe {
        let kp: [*const u8; NV] = std::array::from_fn(|x| k.ptr::<DT>(l * (x0 + x), 0));
        let ks = k.stride * es;
        let mut e0 = 0;
        while e0 < d {
            ahead.step();
            let e1 = (e0 + QK_CHUNK).min(d);
            let mut a = [[V::zero(); NV]; R];
            let mut off = e0 * ks;
            for e in e0..e1 {
                // R broadcasts, then one key vector at a time: R·NV + R + 1
                // registers.
                let qb: [V; R] = std::array::from_fn(|r| V::splat(*q.add(r * d + e)));
                for (x, &p) in kp.iter().enumerate() {
                    let kv = V::load_w::<DT>(p.add(off));
                    for (ar, &qr) in a.iter_mut().zip(&qb) {
                        ar[x] = kv.mul_add(qr, ar[x]);
                    }
                }
                off += ks;
            }
            for (r, ar) in a.iter().enumerate() {
                for (x, arx) in ar.iter().enumerate() {
                    let p = s.add(r * BK + l * (x0 + x));
                    let v = if e0 == 0 { *arx } else { V::load(p).add(*arx) };
                    v.store(p);
                }
            }
            e0 = e1;
        }
    }
}

/// [`qk_rows`] for every key vector of `nk` keys, `NV` at a time, then
/// two, then one at a time. Returns `R`.
///
/// # Safety
/// As [`qk_rows`] for vectors `0..nk.div_ceil(L)`.
#[inline(always)]
unsafe fn qk_rows_all<V: TileVec, const DT: u8, const R: usize, const NV: usize>(
    q: *const f32,
    d: usize,
    k: &Runs,
    nk: usize,
    s: *mut f32,
    ahead: &mut Ahead<'_>,
) -> usize {
    let nv = nk.div_ceil(V::LANES);
    // SAFETY: the caller's contract.
    unsafe {
        let mut x = 0;
        while x + NV <= nv {
            qk_rows::<V, DT, R, NV>(q, d, k, x, s, ahead);
            x += NV;
        }
        if NV > 2 && x + 2 <= nv {
            qk_rows::<V, DT, R, 2>(q, d, k, x, s, ahead);
            x += 2;
        }
        while x < nv {
            qk_rows::<V, DT, R, 1>(q, d, k, x, s, ahead);
            x += 1;
        }
    }
    R
}

/// One row's online softmax update, 8 lanes of AVX2 at every SIMD level:
/// the row maximum, `p = exp(s - m)` stored in place, the sum of `p` with
/// key `k` in lane `k % 8` (as the tiled kernels' eight chains give each
/// row; the lanes past `nk` are set to `-inf` first, so they add exact
/// zeros), the lanes added as in [`sum8`], and `l = l·corr + sum` (one
/// fused multiply-add).
///
/// # Safety
/// AVX2 and FMA are available; `st` has room for `nk` rounded up to 8.
#[inline(always)]
pub(super) unsafe fn row_softmax_avx2(st: &mut [f32], nk: usize, m: &mut f32, l: &mut f32) -> f32 {
    let n8 = nk.next_multiple_of(8);
    st[nk..n8].fill(f32::NEG_INFINITY);
    // SAFETY: AVX2 and FMA are available (contract); st has n8 lanes
    // (the slice above is checked).
    unsafe {
        let sp = st.as_mut_ptr();
        // The maximum (exact in any order).
        let mut mv = <__m256 as F32Vec>::splat(f32::NEG_INFINITY);
        for k0 in (0..n8).step_by(8) {
            mv = mv.max(<__m256 as F32Vec>::load(sp.add(k0)));
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps::<1>(mv));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps::<1>(h, h)));
        let m_new = m.max(mx);
        let cr = _mm256_cvtss_f32(<__m256 as F32Vec>::splat(*m - m_new).exp());
        let mv = <__m256 as F32Vec>::splat(m_new);
        let mut sv = <__m256 as F32Vec>::zero();
        for k0 in (0..n8).step_by(8) {
            let p = <__m256 as F32Vec>::load(sp.add(k0)).sub(mv).exp();
            p.store(sp.add(k0));
            sv = sv.add(p);
        }
        *l = l.mul_add(cr, sum8(sv));
        *m = m_new;
        cr
    }
}

/// The sum of the 8 lanes `c0..c7` of `v` in the order every kernel adds a
/// row's softmax chains: `((c0 + c4) + (c2 + c6)) + ((c1 + c5) + (c3 +
/// c7))`.
///
/// # Safety
/// AVX is available.
#[inline(always)]
unsafe fn sum8(v: __m256) -> f32 {
    // SAFETY: AVX is available (contract).
    unsafe {
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<1>(h, h)))
    }
}

impl<
        V: TileVec,
        const QK_KEYS: usize,
        const QK_NC: usize,
        const PV_NC: usize,
        const FEW: usize,
    > BlockSteps for Simd<V, QK_KEYS, QK_NC, PV_NC, FEW>
{
    type Cvt = F16cCvt;
    const LANES: usize = V::LANES;

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
                // The sum of a row's probabilities: eight chains, key `k`
                // in chain `k % 8`, added as in [`sum8`].
                let mut s = [V::zero(); 8];
                let mut k = 0;
                while k < nk {
                    for (j, sj) in s.iter_mut().enumerate() {
                        if k + j < nk {
                            let a = sp.add((k + j) * rp + r0);
                            let pa = V::load(a).sub(m_new).exp();
                            pa.store(a);
                            *sj = sj.add(pa);
                        }
                    }
                    k += 8;
                }
                let sum = s[0]
                    .add(s[4])
                    .add(s[2].add(s[6]))
                    .add(s[1].add(s[5]).add(s[3].add(s[7])));
                let l_old = V::load(l.as_ptr().add(r0));
                let l_new = l_old.mul_add(cr, sum);
                l_new.store(l.as_mut_ptr().add(r0));
                m_new.store(m.as_mut_ptr().add(r0));
                cr.store(corr.as_mut_ptr().add(r0));
            }
        }
    }

    #[inline(always)]
    unsafe fn pv<const DT: u8>(
        p: Probs<'_>,
        nk: usize,
        v: &Runs,
        acc: &mut [f32],
        corr: &[f32],
        ahead: &mut Ahead<'_>,
    ) {
        let (st, ks, rs, rp) = (p.p, p.ks, p.rs, p.rows);
        let d = acc.len() / rp;
        let last = (nk.max(1) - 1) * ks + (rp - 1) * rs;
        assert!(st.len() > last && acc.len() >= rp * d && corr.len() >= rp);
        assert!(nk <= BK && v.stride == 1);
        let (sp, ap, cp) = (st.as_ptr(), acc.as_mut_ptr(), corr.as_ptr());
        // SAFETY: rows r0..r0+R <= rp, keys < nk of st (asserted); nk
        // keys of d values in v (the trait's contract); V's features
        // enabled (contract).
        unsafe {
            if rs == 1 {
                pv_all::<V, DT, PV_NC, FEW, true>(sp, ks, rp, nk, v, ap, d, cp, ahead);
            } else {
                assert!(ks == 1 && rs == BK);
                pv_all::<V, DT, PV_NC, FEW, false>(sp, ks, rp, nk, v, ap, d, cp, ahead);
            }
        }
    }

    #[inline(always)]
    unsafe fn rows_qk<const DT: u8>(
        qs: &[f32],
        rows: usize,
        k: &Runs,
        nk: usize,
        sr: &mut [f32],
        ahead: &mut Ahead<'_>,
    ) {
        let d = qs.len() / rows;
        assert!(rows >= 1 && nk <= BK && k.len.is_multiple_of(V::LANES));
        assert!(sr.len() >= (rows - 1) * BK + nk.next_multiple_of(V::LANES));
        let (qp, sp) = (qs.as_ptr(), sr.as_mut_ptr());
        // SAFETY: rows r0..r0+R <= rows of d floats at qs and, from row
        // r0, BK at sr (the last row's `nk` rounded up to a vector:
        // asserted); the runs hold whole vectors (asserted) and the keys
        // of every vector below nk (the trait's contract); V's features
        // enabled (contract).
        unsafe {
            let mut r0 = 0;
            while r0 < rows {
                let (q, s) = (qp.add(r0 * d), sp.add(r0 * BK));
                // Up to 4 rows per key load (8 accumulators), 3 with FEW
                // vectors.
                r0 += match rows - r0 {
                    4.. => qk_rows_all::<V, DT, 4, 2>(q, d, k, nk, s, ahead),
                    3 => qk_rows_all::<V, DT, 3, FEW>(q, d, k, nk, s, ahead),
                    2 => qk_rows_all::<V, DT, 2, FEW>(q, d, k, nk, s, ahead),
                    _ => qk_rows_all::<V, DT, 1, FEW>(q, d, k, nk, s, ahead),
                };
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
        #[doc = concat!("The features ", $feat, " are available; no other thread touches the item's partial slots.")]
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $decode(it: DecodeItem<'_, '_>) {
            // SAFETY: as above (this function's contract).
            unsafe { drive_decode::<$steps>(it) }
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
