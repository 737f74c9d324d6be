//! Inner vector operations of the fused attention kernel: a portable
//! implementation and an AVX2+FMA one (dot products of four keys at once,
//! register-blocked P·V accumulation, vectorised exp).

use super::axpy;

/// The inner vector operations of the fused kernel, so the same loop nest
/// runs with portable code or with AVX2+FMA intrinsics.
pub(super) trait AttnOps {
    /// Dot products of `q` with four key rows.
    fn dot_x4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4];
    /// `acc += sum_t p[t] * v[t * stride .. + acc.len()]` for `t < p.len()`.
    fn pv(acc: &mut [f32], p: &[f32], v: &[f32], stride: usize);
    /// `row[i] = exp(row[i] - m)` (exactly 0 for `-inf`); returns the sum.
    fn exp_sub_sum(row: &mut [f32], m: f32) -> f32;
}

pub(super) struct Portable;

impl AttnOps for Portable {
    #[inline(always)]
    fn exp_sub_sum(row: &mut [f32], m: f32) -> f32 {
        let mut sum = 0f32;
        for p in row.iter_mut() {
            *p = (*p - m).exp();
            sum += *p;
        }
        sum
    }
    #[inline(always)]
    fn dot_x4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
        dot_x4(q, k)
    }
    #[inline(always)]
    fn pv(acc: &mut [f32], p: &[f32], v: &[f32], stride: usize) {
        let d = acc.len();
        for (t, &pt) in p.iter().enumerate() {
            if pt != 0.0 {
                axpy(acc, pt, &v[t * stride..t * stride + d]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl AttnOps for Avx2 {
    #[inline(always)]
    fn exp_sub_sum(row: &mut [f32], m: f32) -> f32 {
        // SAFETY: only reached from `fused_item_avx2` (AVX2+FMA detected).
        unsafe { x86::exp_sub_sum(row.as_mut_ptr(), row.len(), m) }
    }
    #[inline(always)]
    fn dot_x4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
        let n = q.len();
        assert!(k.iter().all(|r| r.len() >= n));
        // SAFETY: only reached from `fused_item_avx2` (AVX2+FMA detected);
        // every row has at least n elements.
        unsafe { x86::dot_x4(q.as_ptr(), k.map(|r| r.as_ptr()), n) }
    }
    #[inline(always)]
    fn pv(acc: &mut [f32], p: &[f32], v: &[f32], stride: usize) {
        let d = acc.len();
        if p.is_empty() {
            return;
        }
        assert!(stride >= d && v.len() >= (p.len() - 1) * stride + d);
        // SAFETY: as above; reads v rows t*stride..+d for t < p.len().
        unsafe { x86::pv(acc.as_mut_ptr(), d, p.as_ptr(), p.len(), v.as_ptr(), stride) }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// exp(x) for x <= ~0 (Cephes-style range reduction and degree-6
    /// polynomial, ~1 ulp); lanes below -87 (incl. -inf) give exactly 0.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(in crate::kernels) unsafe fn exp_ps(x: __m256) -> __m256 {
        let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
            _mm256_set1_ps(88.0),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_2e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.166_666_65));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
        let r2 = _mm256_mul_ps(r, r);
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2)))
    }

    /// row[i] = exp(row[i] - m) for i < n; returns the sum.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sub_sum(row: *mut f32, n: usize, m: f32) -> f32 {
        // SAFETY: caller guarantees n writable floats at row.
        unsafe {
            let mv = _mm256_set1_ps(m);
            let mut acc = _mm256_setzero_ps();
            let mut i = 0;
            while i + 8 <= n {
                let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(row.add(i)), mv));
                _mm256_storeu_ps(row.add(i), e);
                acc = _mm256_add_ps(acc, e);
                i += 8;
            }
            let mut sum = hsum(acc);
            while i < n {
                let e = (*row.add(i) - m).exp();
                *row.add(i) = e;
                sum += e;
                i += 1;
            }
            sum
        }
    }

    /// Four dot products of length n sharing the loads of `q`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_x4(q: *const f32, k: [*const f32; 4], n: usize) -> [f32; 4] {
        // SAFETY: caller guarantees n readable floats at q and each k[i].
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            let n8 = n & !7;
            let mut e = 0;
            while e < n8 {
                let qv = _mm256_loadu_ps(q.add(e));
                for i in 0..4 {
                    acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i].add(e)), acc[i]);
                }
                e += 8;
            }
            let mut out = [0f32; 4];
            for i in 0..4 {
                let mut s = hsum(acc[i]);
                for j in n8..n {
                    s += *q.add(j) * *k[i].add(j);
                }
                out[i] = s;
            }
            out
        }
    }

    /// acc[..d] += sum_t p[t] * v[t*stride..][..d], accumulating 64 columns
    /// at a time in registers.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn pv(
        acc: *mut f32,
        d: usize,
        p: *const f32,
        nt: usize,
        v: *const f32,
        stride: usize,
    ) {
        // SAFETY: caller guarantees acc[..d], p[..nt] and nt rows of v.
        unsafe {
            let mut c0 = 0;
            while c0 + 64 <= d {
                let mut a = [_mm256_setzero_ps(); 8];
                for (i, ai) in a.iter_mut().enumerate() {
                    *ai = _mm256_loadu_ps(acc.add(c0 + 8 * i));
                }
                for t in 0..nt {
                    let pt = _mm256_set1_ps(*p.add(t));
                    let row = v.add(t * stride + c0);
                    for (i, ai) in a.iter_mut().enumerate() {
                        *ai = _mm256_fmadd_ps(pt, _mm256_loadu_ps(row.add(8 * i)), *ai);
                    }
                }
                for (i, ai) in a.iter().enumerate() {
                    _mm256_storeu_ps(acc.add(c0 + 8 * i), *ai);
                }
                c0 += 64;
            }
            while c0 + 8 <= d {
                let mut a = _mm256_loadu_ps(acc.add(c0));
                for t in 0..nt {
                    a = _mm256_fmadd_ps(
                        _mm256_set1_ps(*p.add(t)),
                        _mm256_loadu_ps(v.add(t * stride + c0)),
                        a,
                    );
                }
                _mm256_storeu_ps(acc.add(c0), a);
                c0 += 8;
            }
            for c in c0..d {
                let mut a = *acc.add(c);
                for t in 0..nt {
                    a += *p.add(t) * *v.add(t * stride + c);
                }
                *acc.add(c) = a;
            }
        }
    }
}

/// Dot products of `q` with four rows at once (four independent
/// accumulator chains, one load of `q` per step).
#[inline(always)]
fn dot_x4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let n = q.len();
    let (k0, k1, k2, k3) = (&k[0][..n], &k[1][..n], &k[2][..n], &k[3][..n]);
    let mut acc = [[0f32; 8]; 4];
    let mut e = 0;
    while e + 8 <= n {
        for l in 0..8 {
            let qv = q[e + l];
            acc[0][l] += qv * k0[e + l];
            acc[1][l] += qv * k1[e + l];
            acc[2][l] += qv * k2[e + l];
            acc[3][l] += qv * k3[e + l];
        }
        e += 8;
    }
    let mut out = [0f32; 4];
    for (o, (a, kr)) in out.iter_mut().zip(acc.iter().zip([k0, k1, k2, k3])) {
        let mut s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
        for i in e..n {
            s += q[i] * kr[i];
        }
        *o = s;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_exp_accuracy() {
        if !crate::kernels::Isa::detect().avx2() {
            return;
        }
        // Special values first (vector lanes), then a range, then a scalar tail.
        let mut row = vec![
            f32::NEG_INFINITY,
            -100.0,
            -87.5,
            0.0,
            -1e-8,
            -0.5,
            -86.9,
            -3.3,
        ];
        row.extend((0..2000).map(|i| -(i as f32) * 0.05));
        row.extend([f32::NEG_INFINITY, -0.25, -2.0]);
        let orig = row.clone();
        let sum = <Avx2 as AttnOps>::exp_sub_sum(&mut row, 0.0);
        let mut want_sum = 0f64;
        for (&x, &e) in orig.iter().zip(&row) {
            let want = (x as f64).exp();
            want_sum += e as f64;
            if x == f32::NEG_INFINITY {
                assert_eq!(e, 0.0, "exp({x})");
            } else if x < -87.0 {
                assert!(e < 1e-37, "exp({x}) = {e}");
            } else {
                assert!(
                    ((e as f64) - want).abs() <= 4e-7 * want,
                    "exp({x}) = {e}, want {want}"
                );
            }
        }
        assert!((sum as f64 - want_sum).abs() < 1e-5 * want_sum);
    }
}
