//! GELU with the tanh approximation over a whole activation, on the pool.
//!
//! `0.5·v·(1 + tanh(u))` with `u = sqrt(2/π)·(v + 0.044715·v³)` equals
//! `v / (1 + e^(-2u))` (as `1 + tanh(u) = 2 / (1 + e^(-2u))`), which the
//! SIMD levels compute with the SwiGLU's vector `e^x` ([`super::silu`](mod@super::silu)): a
//! few ulp from the scalar [`super::gelu_tanh_f32`]. Every element is
//! computed by the same operations whatever its place in the slice (a tail
//! shorter than a vector is padded, not computed by the scalar formula), and
//! the split into chunks for the threads changes no result, so the op stays
//! batch-invariant.

use crate::kernels::Isa;
use crate::pool::{SyncPtr, ThreadPool};

/// Elements per parallel chunk (a multiple of 8); activations up to this
/// size run on the calling thread.
const CHUNK: usize = 16 * 1024;

/// `x = gelu_tanh(x)` at level `isa`, in chunks over `pool`.
pub fn gelu_tanh_inplace_at(isa: Isa, pool: &ThreadPool, x: &mut [f32]) {
    let n = x.len();
    if n <= CHUNK || pool.n_threads() <= 1 {
        gelu_chunk(isa, x);
        return;
    }
    let xp = SyncPtr::new(x);
    pool.run(n.div_ceil(CHUNK), &|c| {
        let start = c * CHUNK;
        // SAFETY: chunk c alone touches elements start..start+len (< n).
        let part = unsafe { xp.slice(start, CHUNK.min(n - start)) };
        gelu_chunk(isa, part);
    });
}

fn gelu_chunk(isa: Isa, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.min(Isa::detect()) >= Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected.
        unsafe { x86::gelu_tanh_slice_avx2(x) };
        return;
    }
    let _ = isa;
    for v in x {
        *v = super::gelu_tanh_f32(*v);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `gelu_tanh(v)` lane-wise, as `v / (1 + e^(-2u))`.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn gelu8(v: __m256) -> __m256 {
        // -2·sqrt(2/π), and the cubic's coefficient.
        let k = _mm256_set1_ps(-2.0 * 0.797_884_6);
        let v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
        let inner = _mm256_fmadd_ps(_mm256_set1_ps(0.044715), v3, v);
        // SAFETY: as the caller's.
        let e = unsafe { super::super::silu::exp8(_mm256_mul_ps(k, inner)) };
        _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0), e))
    }

    /// `x[i] = gelu_tanh(x[i])` for a slice of any length.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gelu_tanh_slice_avx2(x: &mut [f32]) {
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: 8 f32; unaligned loads and stores.
            unsafe { _mm256_storeu_ps(c.as_mut_ptr(), gelu8(_mm256_loadu_ps(c.as_ptr()))) };
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut b = [0f32; 8];
            b[..tail.len()].copy_from_slice(tail);
            // SAFETY: 8 f32.
            unsafe { _mm256_storeu_ps(b.as_mut_ptr(), gelu8(_mm256_loadu_ps(b.as_ptr()))) };
            let n = tail.len();
            tail.copy_from_slice(&b[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{assert_close, Rng};

    /// Every level against the formula in f64, over a wide range (both
    /// saturations included), on a length with a tail, alone and on the
    /// pool (the same bits either way).
    #[test]
    fn gelu_tanh_levels_match_f64() {
        let mut rng = Rng::new(3);
        let n = 3 * CHUNK + 13;
        let mut x: Vec<f32> = rng.vec(n).iter().map(|v| v * 12.0).collect();
        x[..6].copy_from_slice(&[0.0, -0.0, 1e-20, -30.0, 30.0, -9.5]);
        let want: Vec<f64> = x
            .iter()
            .map(|&v| {
                let v = v as f64;
                let u = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v);
                0.5 * v * (1.0 + u.tanh())
            })
            .collect();
        for isa in Isa::supported_levels() {
            let mut alone = x.clone();
            gelu_chunk(isa, &mut alone);
            assert_close(&alone, &want, 1e-6, 2e-6, &format!("gelu_tanh {isa:?}"));
            let mut pooled = x.clone();
            gelu_tanh_inplace_at(isa, &ThreadPool::new(3), &mut pooled);
            assert!(
                pooled
                    .iter()
                    .zip(&alone)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa:?}: the pool changes results"
            );
            // A row's results do not depend on where it sits in the slice.
            let mut shifted = x[5..].to_vec();
            gelu_chunk(isa, &mut shifted);
            assert!(
                shifted
                    .iter()
                    .zip(&alone[5..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa:?}: results depend on the offset"
            );
        }
    }
}
