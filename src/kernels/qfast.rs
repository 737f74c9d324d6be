//! The fast path for linear layers over block-quantized weights, as llama.cpp
//! does it: each activation row is quantized once per matmul into 8-bit
//! blocks ([`Q8Act`], 32 elements, one f32 scale), then every weight block is
//! multiplied with an activation block in integers (AVX2 `maddubs`/`madd`)
//! and scaled once per block.
//!
//! Supported weight types: Q8_0, Q4_0, Q4_1 ([`supports`]). Other dtypes go
//! through the exact path ([`super::qmatmul`]).
//!
//! Accuracy: the only approximation is the activation quantization. With
//! `d = max|x_b| / 127` per 32-element block `b`, each activation moves by at
//! most `d/2`, so one output differs from the exact product
//! `Σ w_i x_i` (with the same dequantized weights) by at most
//! `Σ_b (d_b / 2) Σ_{i∈b} |w_i|` plus f32 rounding; see
//! [`act_error_bound`]. The integer block products are exact.
//!
//! S>1 (prefill): the work is cut into tiles of [`COLS_PER_CHUNK`] weight rows
//! × [`TOKENS_PER_CHUNK`] tokens; inside a tile every weight block is decoded
//! once and multiplied with up to four tokens' activation blocks, so the
//! weights are streamed from memory once per tile rather than once per token.
//!
//! The AVX2 kernels are picked at run time ([`super::quant::simd_available`]);
//! the scalar kernels are the reference and agree with them exactly on the
//! quantized activations and up to f32 summation order on the outputs.

// Block kernels index several arrays with one loop counter, as in ggml's reference code.
#![allow(clippy::needless_range_loop)]

use super::matmul::Epilogue;
use super::{check_linear, KernelError, WeightRef};
use crate::ir::DType;
use crate::pool::{SyncPtr, ThreadPool};
use half::f16;

/// One quantized block of 32 activations: `x[i] ≈ d * qs[i]`, `s = d * Σ qs`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct Q8Act {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
}

/// Elements per activation block.
pub const QK: usize = 32;
/// Weight rows per work chunk.
pub const COLS_PER_CHUNK: usize = 16;
/// Tokens per work chunk (S>1).
pub const TOKENS_PER_CHUNK: usize = 64;

/// True for the weight dtypes this path handles.
pub fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
}

/// Activation blocks needed for an `[s, k]` input (`None` if `k` is not a
/// multiple of 32 or the size overflows).
pub fn scratch_len(s: usize, k: usize) -> Option<usize> {
    if !k.is_multiple_of(QK) {
        return None;
    }
    s.checked_mul(k / QK)
}

/// Scalar reference: quantizes `x` (a multiple of 32 elements) into `out`.
/// Rounds half to even, as `cvtps2dq` does, so it matches the AVX2 version bit for bit.
pub fn quantize_act_scalar(x: &[f32], out: &mut [Q8Act]) {
    assert_eq!(x.len(), out.len() * QK, "quantize_act: length mismatch");
    for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for i in 0..QK {
            let q = (xb[i] * id).round_ties_even() as i32;
            o.qs[i] = q as i8;
            sum += q;
        }
        o.d = d;
        o.s = d * sum as f32;
    }
}

/// Quantizes `x` into `out` (AVX2 when available, else the scalar reference).
///
/// # Panics
/// If `x.len() != 32 * out.len()`.
pub fn quantize_act(x: &[f32], out: &mut [Q8Act]) {
    assert_eq!(x.len(), out.len() * QK, "quantize_act: length mismatch");
    #[cfg(target_arch = "x86_64")]
    {
        if super::quant::simd_available() {
            // SAFETY: the CPU has avx2/fma/f16c; lengths checked above.
            unsafe { avx2::quantize(x, out) };
            return;
        }
    }
    quantize_act_scalar(x, out)
}

/// Upper bound of `|fast - exact|` for one output: `Σ_b d_b/2 · Σ_{i∈b} |w_i|`
/// (`w` dequantized, `acts` the quantized activation row).
pub fn act_error_bound(w: &[f32], acts: &[Q8Act]) -> f32 {
    w.chunks_exact(QK)
        .zip(acts)
        .map(|(wb, a)| a.d * 0.5 * wb.iter().map(|v| v.abs()).sum::<f32>())
        .sum()
}

#[inline(always)]
fn rd_f16(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Scalar reference: a stored weight row (`dtype`) dotted with a quantized
/// activation row: per block an exact integer sum, scaled in f32.
///
/// # Panics
/// If `dtype` is not [`supported`](supports) or the lengths disagree.
pub fn dot_q8_scalar(dtype: DType, row: &[u8], acts: &[Q8Act]) -> f32 {
    let bb = dtype.block_bytes();
    assert!(supports(dtype), "dot_q8: unsupported {dtype}");
    assert_eq!(row.len(), acts.len() * bb, "dot_q8: length mismatch");
    let mut sum = 0f32;
    for (b, a) in row.chunks_exact(bb).zip(acts) {
        let d = rd_f16(b, 0);
        let mut isum = 0i32;
        match dtype {
            DType::Q8_0 => {
                for i in 0..32 {
                    isum += (b[2 + i] as i8) as i32 * a.qs[i] as i32;
                }
                sum += d * a.d * isum as f32;
            }
            DType::Q4_0 => {
                for i in 0..16 {
                    let q = b[2 + i];
                    isum += ((q & 15) as i32 - 8) * a.qs[i] as i32;
                    isum += ((q >> 4) as i32 - 8) * a.qs[i + 16] as i32;
                }
                sum += d * a.d * isum as f32;
            }
            DType::Q4_1 => {
                let m = rd_f16(b, 2);
                for i in 0..16 {
                    let q = b[4 + i];
                    isum += (q & 15) as i32 * a.qs[i] as i32;
                    isum += (q >> 4) as i32 * a.qs[i + 16] as i32;
                }
                sum += d * a.d * isum as f32 + m * a.s;
            }
            _ => unreachable!(),
        }
    }
    sum
}

/// `out[r * nt + t] = row_r · acts[t]` for the consecutive weight rows in
/// `w` (`row_bytes` each) and up to 4 activation rows (`nt = acts.len()`).
#[inline]
fn dot_rows(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
    simd: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd {
            // SAFETY: `simd` is only true when the CPU has avx2/fma/f16c; the
            // lengths are checked inside.
            unsafe { avx2::dot_rows(dtype, w, row_bytes, acts, out) };
            return;
        }
    }
    let _ = simd;
    let nt = acts.len();
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        for (t, a) in acts.iter().enumerate() {
            out[r * nt + t] = dot_q8_scalar(dtype, row, a);
        }
    }
}

/// `y = x·Wᵀ` with `epilogue` for a Q8_0/Q4_0/Q4_1 `W` `[n, k]`, quantizing
/// each row of `x` once into `scratch` (at least [`scratch_len`]`(s, k)`
/// blocks). Same contract as [`super::qmatmul`] otherwise.
#[allow(clippy::too_many_arguments)]
pub fn qmatmul_fast(
    pool: &ThreadPool,
    x: &[f32],
    s: usize,
    k: usize,
    w: WeightRef<'_>,
    n: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
    scratch: &mut [Q8Act],
) -> Result<(), KernelError> {
    qmatmul_fast_impl(
        pool,
        x,
        s,
        k,
        w,
        n,
        epilogue,
        y,
        scratch,
        super::quant::simd_available(),
    )
}

#[allow(clippy::too_many_arguments)]
fn qmatmul_fast_impl(
    pool: &ThreadPool,
    x: &[f32],
    s: usize,
    k: usize,
    w: WeightRef<'_>,
    n: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
    scratch: &mut [Q8Act],
    simd: bool,
) -> Result<(), KernelError> {
    const OP: &str = "qmatmul_fast";
    if !supports(w.dtype) {
        return Err(KernelError::DType {
            op: OP,
            dtype: w.dtype,
        });
    }
    let (row_bytes, n_out) = check_linear(OP, x, s, k, &w, n, &epilogue, y)?;
    let nb = k / QK;
    let need = s * nb;
    if scratch.len() < need {
        return Err(KernelError::Shape {
            op: OP,
            what: "scratch blocks (at least s*k/32)",
            expected: need,
            actual: scratch.len(),
        });
    }
    let acts = &mut scratch[..need];
    if s * k >= 1 << 14 {
        // Large inputs (prefill): quantize the rows in parallel.
        let ap = SyncPtr::new(acts);
        pool.run(s, &|t| {
            // SAFETY: chunk t owns blocks t*nb..(t+1)*nb.
            let a = unsafe { ap.slice(t * nb, nb) };
            quantize_act(&x[t * k..(t + 1) * k], a);
        });
    } else {
        quantize_act(x, acts);
    }
    let acts: &[Q8Act] = acts;
    let yp = SyncPtr::new(y);
    // Decode-sized inputs: a few long contiguous row ranges per thread, so
    // each thread streams its weights in long runs the hardware prefetcher
    // follows (16-row chunks taken alternately by two threads measured 0.75x
    // of one thread's speed); the atomic counter still balances 4 per thread.
    let rows_per_chunk = if s <= 4 {
        COLS_PER_CHUNK.max(n_out.div_ceil(4 * pool.n_threads()))
    } else {
        COLS_PER_CHUNK
    };
    let col_chunks = n_out.div_ceil(rows_per_chunk);
    let tok_chunks = s.div_ceil(TOKENS_PER_CHUNK);
    pool.run(col_chunks * tok_chunks, &|c| {
        let (cc, tc) = (c % col_chunks, c / col_chunks);
        let (jc0, jc1) = (cc * rows_per_chunk, ((cc + 1) * rows_per_chunk).min(n_out));
        let (t0, t1) = (tc * TOKENS_PER_CHUNK, ((tc + 1) * TOKENS_PER_CHUNK).min(s));
        let mut v = [0f32; COLS_PER_CHUNK * 4];
        let mut up = [0f32; COLS_PER_CHUNK * 4];
        for j0 in (jc0..jc1).step_by(COLS_PER_CHUNK) {
            let j1 = (j0 + COLS_PER_CHUNK).min(jc1);
            let nr = j1 - j0;
            let mut ta = t0;
            while ta < t1 {
                let nt = (t1 - ta).min(4);
                let mut tile: [&[Q8Act]; 4] = [&[]; 4];
                for i in 0..nt {
                    tile[i] = &acts[(ta + i) * nb..(ta + i + 1) * nb];
                }
                let tile = &tile[..nt];
                dot_rows(
                    w.dtype,
                    &w.bytes[j0 * row_bytes..j1 * row_bytes],
                    row_bytes,
                    tile,
                    &mut v[..nr * nt],
                    simd,
                );
                if let Epilogue::SwiGlu = epilogue {
                    let (u0, u1) = (j0 + n_out, j1 + n_out);
                    dot_rows(
                        w.dtype,
                        &w.bytes[u0 * row_bytes..u1 * row_bytes],
                        row_bytes,
                        tile,
                        &mut up[..nr * nt],
                        simd,
                    );
                }
                for i in 0..nt {
                    let t = ta + i;
                    // SAFETY: chunk c alone owns columns j0..j1 of rows t0..t1 of y.
                    let yr = unsafe { yp.slice(t * n_out + j0, nr) };
                    for (r, o) in yr.iter_mut().enumerate() {
                        let (val, j) = (v[r * nt + i], j0 + r);
                        *o = match epilogue {
                            Epilogue::None => val,
                            Epilogue::Accumulate => *o + val,
                            Epilogue::AddResidual(res) => val + res[t * n_out + j],
                            Epilogue::SwiGlu => super::elementwise::silu_f32(val) * up[r * nt + i],
                        };
                    }
                }
                ta += nt;
            }
        }
    });
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Q8Act, QK};
    use crate::ir::DType;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support avx2/fma/f16c.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize(x: &[f32], out: &mut [Q8Act]) {
        let sign = _mm256_set1_ps(-0.0);
        let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
            // SAFETY: xb has 32 f32; unaligned loads.
            let v = unsafe {
                [
                    _mm256_loadu_ps(xb.as_ptr()),
                    _mm256_loadu_ps(xb.as_ptr().add(8)),
                    _mm256_loadu_ps(xb.as_ptr().add(16)),
                    _mm256_loadu_ps(xb.as_ptr().add(24)),
                ]
            };
            let mut m = _mm256_andnot_ps(sign, v[0]);
            for vi in &v[1..] {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vi));
            }
            let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            // cvtps2dq rounds to nearest even under the default MXCSR.
            let i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id));
            let i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id));
            let i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id));
            let i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id));
            let sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            let s4 = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256::<1>(sum),
            );
            let s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<1>(s4));
            let isum = _mm_cvtsi128_si32(s4);
            let p01 = _mm256_packs_epi32(i0, i1);
            let p23 = _mm256_packs_epi32(i2, i3);
            let p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm);
            // SAFETY: qs has 32 bytes; unaligned store.
            unsafe { _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, p) };
            o.d = d;
            o.s = d * isum as f32;
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn f16_at(b: &[u8], at: usize) -> f32 {
        let bits = u16::from_le_bytes([b[at], b[at + 1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// A weight block decoded to 32 bytes in element order: signed (Q8_0,
    /// Q4_0) or unsigned 0..15 (Q4_1).
    trait Block {
        const BYTES: usize;
        const SIGNED: bool;
        const HAS_MIN: bool;
        /// (quants, d, m)
        unsafe fn load(b: &[u8]) -> (__m256i, f32, f32);
    }

    struct BQ8_0;
    struct BQ4_0;
    struct BQ4_1;

    impl Block for BQ8_0 {
        const BYTES: usize = 34;
        const SIGNED: bool = true;
        const HAS_MIN: bool = false;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load(b: &[u8]) -> (__m256i, f32, f32) {
            let q = &b[2..34];
            // SAFETY: q has 32 bytes; unaligned load.
            let v = unsafe { _mm256_loadu_si256(q.as_ptr() as *const __m256i) };
            (v, f16_at(b, 0), 0.0)
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles32(q: &[u8]) -> __m256i {
        let q = &q[..16];
        // SAFETY: q has 16 bytes; unaligned load. AVX2 is enabled in every caller.
        unsafe {
            let v = _mm_loadu_si128(q.as_ptr() as *const __m128i);
            let both = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
            _mm256_and_si256(both, _mm256_set1_epi8(15))
        }
    }

    impl Block for BQ4_0 {
        const BYTES: usize = 18;
        const SIGNED: bool = true;
        const HAS_MIN: bool = false;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load(b: &[u8]) -> (__m256i, f32, f32) {
            // SAFETY: as nibbles32.
            let v = unsafe { _mm256_sub_epi8(nibbles32(&b[2..18]), _mm256_set1_epi8(8)) };
            (v, f16_at(b, 0), 0.0)
        }
    }

    impl Block for BQ4_1 {
        const BYTES: usize = 20;
        const SIGNED: bool = false;
        const HAS_MIN: bool = true;
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load(b: &[u8]) -> (__m256i, f32, f32) {
            // SAFETY: as nibbles32.
            let v = unsafe { nibbles32(&b[4..20]) };
            (v, f16_at(b, 0), f16_at(b, 2))
        }
    }

    /// # Safety
    /// The CPU must support avx2/fma/f16c; `dtype` must be Q8_0/Q4_0/Q4_1.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows(
        dtype: DType,
        w: &[u8],
        row_bytes: usize,
        acts: &[&[Q8Act]],
        out: &mut [f32],
    ) {
        match dtype {
            DType::Q8_0 => rows::<BQ8_0>(w, row_bytes, acts, out),
            DType::Q4_0 => rows::<BQ4_0>(w, row_bytes, acts, out),
            DType::Q4_1 => rows::<BQ4_1>(w, row_bytes, acts, out),
            _ => unreachable!("checked by supports()"),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn rows<B: Block>(w: &[u8], row_bytes: usize, acts: &[&[Q8Act]], out: &mut [f32]) {
        // R rows x NT tokens of independent accumulators per kernel call:
        // enough chains to hide the fmadd latency, few enough for 16 registers.
        match acts.len() {
            // Two interleaved rows help short rows (k=576 Q4: 360 bytes) but
            // stall on loads for long ones (Q8_0 rows, k=1536): measured on
            // the benchmark machine (AMD EPYC), 1.4 vs 1.9 ms and 3.2 vs 1.4 ms.
            1 if row_bytes <= 512 => rows_nt::<B, 1, 2>(w, row_bytes, acts, out),
            1 => rows_nt::<B, 1, 1>(w, row_bytes, acts, out),
            2 => rows_nt::<B, 2, 2>(w, row_bytes, acts, out),
            3 => rows_nt::<B, 3, 2>(w, row_bytes, acts, out),
            4 => rows_nt::<B, 4, 2>(w, row_bytes, acts, out),
            _ => unreachable!("tiles have 1..=4 tokens"),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn rows_nt<B: Block, const NT: usize, const R: usize>(
        w: &[u8],
        row_bytes: usize,
        acts: &[&[Q8Act]],
        out: &mut [f32],
    ) {
        let nr = w.len() / row_bytes;
        assert!(w.len() == nr * row_bytes && out.len() == nr * NT && acts.len() == NT);
        let nb = row_bytes / B::BYTES;
        assert!(nb * B::BYTES == row_bytes);
        let mut a: [&[Q8Act]; NT] = [&[]; NT];
        for t in 0..NT {
            a[t] = &acts[t][..nb];
        }
        let mut r = 0;
        while r + R <= nr {
            kern::<B, R, NT>(
                &w[r * row_bytes..(r + R) * row_bytes],
                nb,
                &a,
                &mut out[r * NT..(r + R) * NT],
            );
            r += R;
        }
        while r < nr {
            kern::<B, 1, NT>(
                &w[r * row_bytes..(r + 1) * row_bytes],
                nb,
                &a,
                &mut out[r * NT..(r + 1) * NT],
            );
            r += 1;
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn kern<B: Block, const R: usize, const NT: usize>(
        w: &[u8],
        nb: usize,
        a: &[&[Q8Act]; NT],
        out: &mut [f32],
    ) {
        let rb = nb * B::BYTES;
        assert!(w.len() == R * rb && out.len() == R * NT);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); NT]; R];
        let mut msum = [[0f32; NT]; R];
        for b in 0..nb {
            // Plain loops, not `array::from_fn`: its closure is not inlined
            // into this target-feature function (it showed up as its own
            // symbol in the profile, called per block and row).
            let mut q = [_mm256_setzero_si256(); R];
            let mut qu = [_mm256_setzero_si256(); R];
            let mut dw = [_mm256_setzero_ps(); R];
            let mut mw = [0f32; R];
            for r in 0..R {
                let at = r * rb + b * B::BYTES;
                // SAFETY: the slice has B::BYTES bytes.
                let (qq, d, m) = unsafe { B::load(&w[at..at + B::BYTES]) };
                q[r] = qq;
                qu[r] = if B::SIGNED {
                    _mm256_sign_epi8(qq, qq)
                } else {
                    qq
                };
                dw[r] = _mm256_set1_ps(d);
                mw[r] = m;
            }
            for t in 0..NT {
                let ab = &a[t][b];
                // SAFETY: qs has 32 bytes; unaligned load.
                let av = unsafe { _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i) };
                let da = _mm256_set1_ps(ab.d);
                for r in 0..R {
                    let sa = if B::SIGNED {
                        _mm256_sign_epi8(av, q[r])
                    } else {
                        av
                    };
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(qu[r], sa), ones);
                    acc[r][t] =
                        _mm256_fmadd_ps(_mm256_mul_ps(dw[r], da), _mm256_cvtepi32_ps(p), acc[r][t]);
                    if B::HAS_MIN {
                        msum[r][t] += mw[r] * ab.s;
                    }
                }
            }
        }
        for r in 0..R {
            for t in 0..NT {
                out[r * NT + t] = hsum(acc[r][t]) + msum[r][t];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::{dequantize_row, quantize_row};
    use crate::kernels::testutil::Rng;

    fn quantized_weights(dtype: DType, wf: &[f32], n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
        let rb = dtype.bytes_for(k).unwrap();
        let mut wq = vec![0u8; n * rb];
        let mut wd = vec![0f32; n * k];
        for j in 0..n {
            quantize_row(
                dtype,
                &wf[j * k..(j + 1) * k],
                &mut wq[j * rb..(j + 1) * rb],
            )
            .unwrap();
            dequantize_row(
                dtype,
                &wq[j * rb..(j + 1) * rb],
                &mut wd[j * k..(j + 1) * k],
            )
            .unwrap();
        }
        (wq, wd)
    }

    fn deq_act(a: &[Q8Act]) -> Vec<f32> {
        a.iter()
            .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
            .collect()
    }

    #[test]
    fn quantize_act_simd_matches_scalar_and_bound() {
        let mut rng = Rng::new(3);
        let mut x = rng.vec(32 * 9);
        // Ties, zeros and a zero block.
        x[5] = 0.0;
        x[32..64].iter_mut().for_each(|v| *v = 0.0);
        x[64] = 1.0;
        x[65] = 0.5 / 127.0 * 1.0; // exactly half a step below the first level
        let mut a = vec![Q8Act::default(); 9];
        let mut b = vec![Q8Act::default(); 9];
        quantize_act_scalar(&x, &mut a);
        quantize_act(&x, &mut b);
        assert_eq!(a, b);
        assert_eq!(a[1].d, 0.0);
        assert!(a[1].qs.iter().all(|&q| q == 0));
        let xd = deq_act(&a);
        for (i, (&u, &v)) in x.iter().zip(&xd).enumerate() {
            let d = a[i / 32].d;
            assert!((u - v).abs() <= d * 0.5 * (1.0 + 1e-5), "{i}: {u} vs {v}");
        }
        for blk in &a {
            let s: i32 = blk.qs.iter().map(|&q| q as i32).sum();
            assert_eq!(blk.s, blk.d * s as f32);
            assert!(blk.qs.iter().any(|&q| q.unsigned_abs() == 127) || blk.d == 0.0);
        }
    }

    /// Fast matmul vs dequantize-then-multiply: exact (up to f32 summation)
    /// against the dequantized activations, and within [`act_error_bound`]
    /// of the f32 activations.
    #[test]
    fn matches_dequantize_then_multiply() {
        let pool = ThreadPool::new(2);
        let mut rng = Rng::new(11);
        // s = 70 covers a partial token chunk and partial 4-token tiles;
        // n = 38 a partial column chunk.
        for (s, k, n) in [(1, 96, 38), (5, 64, 20), (70, 128, 38)] {
            let x = rng.vec(s * k);
            let wf = rng.vec(n * k);
            let r = rng.vec(s * n);
            for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
                let (wq, wd) = quantized_weights(dtype, &wf, n, k);
                let mut acts = vec![Q8Act::default(); s * k / 32];
                quantize_act_scalar(&x, &mut acts);
                let xq = deq_act(&acts);
                let wr = WeightRef::new(dtype, &wq);
                for simd in [false, true] {
                    if simd && !crate::kernels::quant::simd_available() {
                        continue;
                    }
                    let mut scratch = vec![Q8Act::default(); scratch_len(s, k).unwrap()];
                    let mut y = vec![0f32; s * n];
                    qmatmul_fast_impl(
                        &pool,
                        &x,
                        s,
                        k,
                        wr,
                        n,
                        Epilogue::AddResidual(&r),
                        &mut y,
                        &mut scratch,
                        simd,
                    )
                    .unwrap();
                    for t in 0..s {
                        let ar = &acts[t * k / 32..(t + 1) * k / 32];
                        for j in 0..n {
                            let wj = &wd[j * k..(j + 1) * k];
                            let on_q: f32 = (0..k).map(|i| xq[t * k + i] * wj[i]).sum();
                            let on_f: f32 = (0..k).map(|i| x[t * k + i] * wj[i]).sum();
                            let got = y[t * n + j] - r[t * n + j];
                            let scale: f32 = (0..k).map(|i| (xq[t * k + i] * wj[i]).abs()).sum();
                            assert!(
                                (got - on_q).abs() <= 1e-5 * scale + 1e-6,
                                "{dtype} simd={simd} s={s} t={t} j={j}: {got} vs {on_q}"
                            );
                            let bound = act_error_bound(wj, ar);
                            assert!(
                                (got - on_f).abs() <= bound * 1.001 + 1e-5 * scale + 1e-6,
                                "{dtype}: {got} vs f32 {on_f}, bound {bound}"
                            );
                        }
                    }
                    // SwiGlu and Accumulate epilogues.
                    let mut g = vec![0f32; s * n / 2];
                    qmatmul_fast_impl(
                        &pool,
                        &x,
                        s,
                        k,
                        wr,
                        n,
                        Epilogue::SwiGlu,
                        &mut g,
                        &mut scratch,
                        simd,
                    )
                    .unwrap();
                    let mut acc = r.clone();
                    qmatmul_fast_impl(
                        &pool,
                        &x,
                        s,
                        k,
                        wr,
                        n,
                        Epilogue::Accumulate,
                        &mut acc,
                        &mut scratch,
                        simd,
                    )
                    .unwrap();
                    for t in 0..s {
                        let dotq = |j: usize| -> f32 {
                            (0..k).map(|i| xq[t * k + i] * wd[j * k + i]).sum()
                        };
                        for j in 0..n / 2 {
                            let want =
                                crate::kernels::elementwise::silu_f32(dotq(j)) * dotq(j + n / 2);
                            let got = g[t * n / 2 + j];
                            assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "{dtype}");
                        }
                        for j in 0..n {
                            assert!(
                                (acc[t * n + j] - y[t * n + j]).abs() <= 1e-5,
                                "{dtype} accumulate"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn scalar_dot_by_hand() {
        // Q4_1 block: d = 0.5, m = -1, nibbles lo = 1, hi = 2 everywhere.
        let mut b = vec![0u8; 20];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b[4..].iter_mut().for_each(|q| *q = 0x21);
        let a = Q8Act {
            d: 0.25,
            s: 0.25 * 32.0,
            qs: [1; 32],
        };
        // w = 0.5*1-1 = -0.5 (16 of them) and 0.5*2-1 = 0 (16); x = 0.25.
        assert_eq!(dot_q8_scalar(DType::Q4_1, &b, &[a]), -0.5 * 0.25 * 16.0);
    }

    #[test]
    fn rejects_bad_arguments() {
        let pool = ThreadPool::new(1);
        let w = vec![0u8; 34];
        let wr = WeightRef::new(DType::Q8_0, &w);
        let mut y = vec![0f32; 1];
        let mut small: Vec<Q8Act> = vec![];
        assert!(matches!(
            qmatmul_fast(
                &pool,
                &[0.0; 32],
                1,
                32,
                wr,
                1,
                Epilogue::None,
                &mut y,
                &mut small
            ),
            Err(KernelError::Shape { .. })
        ));
        let wk = WeightRef::new(DType::Q4_K, &w);
        let mut sc = vec![Q8Act::default(); 1];
        assert!(matches!(
            qmatmul_fast(
                &pool,
                &[0.0; 32],
                1,
                32,
                wk,
                1,
                Epilogue::None,
                &mut y,
                &mut sc
            ),
            Err(KernelError::DType { .. })
        ));
    }
}
