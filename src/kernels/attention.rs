//! Causal grouped-query attention over a KV cache.
//!
//! Shapes: `q` `[S, H, D]`; caches `[C, Hkv, D]` with valid rows
//! `0..P+S`; query `s` (absolute position `P+s`) attends keys `0..=P+s`;
//! head `h` reads kv head `h / (H / Hkv)`; scores are scaled by `1/sqrt(D)`.
//!
//! Two forms: the unfused pieces [`attn_scores`] → [`softmax_rows`] →
//! [`attn_values`] (materialising `[H, S, T]`), and [`attention_fused`], a
//! streaming-softmax kernel that never materialises the score matrix and
//! reads each kv head once per query block for all of its query heads.

use super::matmul::{dot8, Isa};
use super::{check_len, mul_dims, KernelError};
use crate::pool::{SyncPtr, ThreadPool};

/// Geometry of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// New query tokens S.
    pub s: usize,
    /// Position P of the first new token (tokens already in the cache).
    pub pos: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// Keys attended by the last query: T = P + S.
    pub fn n_keys(&self) -> usize {
        self.pos + self.s
    }
    fn check(
        &self,
        op: &'static str,
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        out_len: usize,
    ) -> Result<(), KernelError> {
        if self.n_kv_heads == 0 || self.head_dim == 0 || self.n_heads % self.n_kv_heads != 0 {
            return Err(KernelError::Invalid {
                op,
                what: "need n_kv_heads > 0, head_dim > 0 and n_heads a multiple of n_kv_heads",
            });
        }
        let hd = mul_dims(
            op,
            "n_heads*head_dim overflows",
            self.n_heads,
            self.head_dim,
        )?;
        check_len(
            op,
            "q elements (s*n_heads*head_dim)",
            mul_dims(op, "q size overflows", self.s, hd)?,
            q.len(),
        )?;
        check_len(
            op,
            "out elements (s*n_heads*head_dim)",
            self.s * hd,
            out_len,
        )?;
        let t = self.pos.checked_add(self.s).ok_or(KernelError::Invalid {
            op,
            what: "pos + s overflows",
        })?;
        let need = mul_dims(
            op,
            "cache size overflows",
            t,
            self.n_kv_heads * self.head_dim,
        )?;
        for (what, c) in [("k cache elements", k_cache), ("v cache elements", v_cache)] {
            if c.len() < need || c.len() % (self.n_kv_heads * self.head_dim) != 0 {
                return Err(KernelError::Shape {
                    op,
                    what,
                    expected: need,
                    actual: c.len(),
                });
            }
        }
        Ok(())
    }
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// Elements of the `[H, S, T]` score matrix of the unfused form.
pub fn attn_scores_len(shape: &AttnShape) -> usize {
    shape.n_heads * shape.s * shape.n_keys()
}

/// `scores[h, s, t] = q[s, h]·K[t, h/n_rep] / sqrt(D)` for `t <= P+s`, and
/// `-inf` for masked (future) keys. `scores` has [`attn_scores_len`] elements.
pub fn attn_scores(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[f32],
    shape: AttnShape,
    scores: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "attn_scores";
    shape.check(OP, q, k_cache, k_cache, q.len())?;
    let (s_n, t_n, d) = (shape.s, shape.n_keys(), shape.head_dim);
    check_len(
        OP,
        "scores elements (H*S*T)",
        attn_scores_len(&shape),
        scores.len(),
    )?;
    let n_rep = shape.n_heads / shape.n_kv_heads;
    let kv_row = shape.n_kv_heads * d;
    let scale = shape.scale();
    let sp = SyncPtr::new(scores);
    pool.run(shape.n_heads, &|h| {
        // SAFETY: chunk h writes only its own [S, T] block of scores.
        let out = unsafe { sp.slice(h * s_n * t_n, s_n * t_n) };
        let g = h / n_rep;
        for s in 0..s_n {
            let qv = &q[(s * shape.n_heads + h) * d..][..d];
            let limit = shape.pos + s;
            for (t, o) in out[s * t_n..(s + 1) * t_n].iter_mut().enumerate() {
                *o = if t <= limit {
                    dot8(qv, &k_cache[t * kv_row + g * d..][..d]) * scale
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
    });
    Ok(())
}

/// In-place softmax of each row (length `row_len`) in f32. A row that is
/// entirely `-inf` becomes zeros.
pub fn softmax_rows(pool: &ThreadPool, x: &mut [f32], row_len: usize) -> Result<(), KernelError> {
    const OP: &str = "softmax_rows";
    if row_len == 0 {
        return check_len(OP, "elements (row_len is 0)", 0, x.len());
    }
    if x.len() % row_len != 0 {
        return Err(KernelError::Shape {
            op: OP,
            what: "elements (multiple of row_len)",
            expected: x.len() / row_len * row_len,
            actual: x.len(),
        });
    }
    let rows = x.len() / row_len;
    let per = (4096 / row_len).max(1);
    let xp = SyncPtr::new(x);
    pool.run(rows.div_ceil(per), &|c| {
        let r0 = c * per;
        let r1 = (r0 + per).min(rows);
        // SAFETY: chunk c owns rows r0..r1.
        let block = unsafe { xp.slice(r0 * row_len, (r1 - r0) * row_len) };
        block.chunks_exact_mut(row_len).for_each(softmax_row);
    });
    Ok(())
}

fn softmax_row(row: &mut [f32]) {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    let mut sum = 0f32;
    for v in row.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

/// `out[s, h, :] = sum_t probs[h, s, t] * V[t, h/n_rep, :]`.
pub fn attn_values(
    pool: &ThreadPool,
    probs: &[f32],
    v_cache: &[f32],
    shape: AttnShape,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "attn_values";
    let q_len = shape.s * shape.n_heads * shape.head_dim;
    // `check` wants a q-shaped slice; out has that shape.
    shape.check(
        OP,
        &out[..out.len().min(q_len)],
        v_cache,
        v_cache,
        out.len(),
    )?;
    check_len(
        OP,
        "probs elements (H*S*T)",
        attn_scores_len(&shape),
        probs.len(),
    )?;
    let (s_n, t_n, d, h_n) = (shape.s, shape.n_keys(), shape.head_dim, shape.n_heads);
    let n_rep = h_n / shape.n_kv_heads;
    let kv_row = shape.n_kv_heads * d;
    let op = SyncPtr::new(out);
    pool.run(h_n, &|h| {
        let g = h / n_rep;
        for s in 0..s_n {
            // SAFETY: chunk h writes only out[s, h, :] for each s.
            let o = unsafe { op.slice((s * h_n + h) * d, d) };
            o.fill(0.0);
            let p = &probs[(h * s_n + s) * t_n..][..t_n];
            for (t, &pt) in p.iter().enumerate().take(shape.pos + s + 1) {
                axpy(o, pt, &v_cache[t * kv_row + g * d..][..d]);
            }
        }
    });
    Ok(())
}

/// The inner vector operations of the fused kernel, so the same loop nest
/// runs with portable code or with AVX2+FMA intrinsics.
trait AttnOps {
    /// Dot products of `q` with four key rows.
    fn dot_x4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4];
    /// `acc += sum_t p[t] * v[t * stride .. + acc.len()]` for `t < p.len()`.
    fn pv(acc: &mut [f32], p: &[f32], v: &[f32], stride: usize);
    /// `row[i] = exp(row[i] - m)` (exactly 0 for `-inf`); returns the sum.
    fn exp_sub_sum(row: &mut [f32], m: f32) -> f32;
}

struct Portable;

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
struct Avx2;

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
mod x86 {
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
    unsafe fn exp_ps(x: __m256) -> __m256 {
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

#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Query tokens per work item of the fused kernel.
const Q_BLOCK: usize = 16;
/// Keys per tile of the fused kernel.
const K_TILE: usize = 64;

fn fused_per_thread(shape: &AttnShape) -> usize {
    let rows = (shape.n_heads / shape.n_kv_heads.max(1)) * Q_BLOCK.min(shape.s.max(1));
    rows * (shape.head_dim + K_TILE + 2)
}

/// Scratch elements [`attention_fused`] needs for a pool of `n_threads`.
pub fn attention_fused_scratch_len(shape: &AttnShape, n_threads: usize) -> usize {
    fused_per_thread(shape) * n_threads.max(1)
}

/// Fused causal GQA attention with an online softmax; `out` is `[S, H, D]`.
/// `scratch` needs at least [`attention_fused_scratch_len`]`(shape,
/// pool.n_threads())` elements. Work items are (kv head, block of 16
/// queries); each loads every key/value row once for all `n_rep` heads.
pub fn attention_fused(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    shape: AttnShape,
    out: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), KernelError> {
    attention_fused_with(pool, Isa::Auto, q, k_cache, v_cache, shape, out, scratch)
}

/// [`attention_fused`] with an explicit choice of implementation.
#[allow(clippy::too_many_arguments)]
pub fn attention_fused_with(
    pool: &ThreadPool,
    isa: Isa,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    shape: AttnShape,
    out: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "attention_fused";
    shape.check(OP, q, k_cache, v_cache, out.len())?;
    let per = fused_per_thread(&shape);
    let need = attention_fused_scratch_len(&shape, pool.n_threads());
    if scratch.len() < need {
        return Err(KernelError::Shape {
            op: OP,
            what: "scratch elements (attention_fused_scratch_len)",
            expected: need,
            actual: scratch.len(),
        });
    }
    if shape.s == 0 {
        return Ok(());
    }
    let n_qb = shape.s.div_ceil(Q_BLOCK);
    let sp = SyncPtr::new(scratch);
    let op = SyncPtr::new(out);
    let out_len = out_len(&shape);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    #[cfg(target_arch = "x86_64")]
    let avx2 = isa == Isa::Auto
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma");
    pool.run_indexed(shape.n_kv_heads * n_qb, &|c, tid| {
        let g = c / n_qb;
        let s0 = (c % n_qb) * Q_BLOCK;
        let s1 = (s0 + Q_BLOCK).min(shape.s);
        // SAFETY: thread `tid` is the only user of its scratch slice during
        // this job; work item c writes only out[s0..s1, heads of group g, :].
        let scr = unsafe { sp.slice(tid * per, per) };
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 and FMA were detected at run time.
            unsafe { fused_item_avx2(q, k_cache, v_cache, &shape, g, s0, s1, op, out_len, scr) };
            return;
        }
        fused_item::<Portable>(q, k_cache, v_cache, &shape, g, s0, s1, op, out_len, scr);
    });
    Ok(())
}

fn out_len(shape: &AttnShape) -> usize {
    shape.s * shape.n_heads * shape.head_dim
}

/// [`fused_item`] compiled with AVX2+FMA enabled, so its dot products and
/// axpys vectorise 8 lanes wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn fused_item_avx2(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    sh: &AttnShape,
    g: usize,
    s0: usize,
    s1: usize,
    out: SyncPtr<f32>,
    out_len: usize,
    scr: &mut [f32],
) {
    fused_item::<Avx2>(q, kc, vc, sh, g, s0, s1, out, out_len, scr)
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn fused_item<O: AttnOps>(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    sh: &AttnShape,
    g: usize,
    s0: usize,
    s1: usize,
    out: SyncPtr<f32>,
    out_len: usize,
    scr: &mut [f32],
) {
    let d = sh.head_dim;
    let n_rep = sh.n_heads / sh.n_kv_heads;
    let nq = s1 - s0;
    let rows = n_rep * nq;
    let (acc, rest) = scr.split_at_mut(rows * d);
    let (m, rest) = rest.split_at_mut(rows);
    let (l, rest) = rest.split_at_mut(rows);
    let sc = &mut rest[..rows * K_TILE];
    acc.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    let kv_row = sh.n_kv_heads * d;
    let scale = sh.scale();
    let qrow = |r: usize| {
        let (rep, qi) = (r / nq, r % nq);
        &q[((s0 + qi) * sh.n_heads + g * n_rep + rep) * d..][..d]
    };
    let t_end = sh.pos + s1;
    let mut t0 = 0;
    while t0 < t_end {
        let t1 = (t0 + K_TILE).min(t_end);
        let nt = t1 - t0;
        // Scores for the tile: each key row is loaded once for all rows.
        let mut t = t0;
        while t + 4 <= t1 {
            let k4 = [0, 1, 2, 3].map(|i| &kc[(t + i) * kv_row + g * d..][..d]);
            for r in 0..rows {
                let limit = sh.pos + s0 + r % nq;
                let dots = O::dot_x4(qrow(r), k4);
                for (i, &v) in dots.iter().enumerate() {
                    sc[r * K_TILE + (t + i - t0)] = if t + i <= limit {
                        v * scale
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
            t += 4;
        }
        for t in t..t1 {
            let krow = &kc[t * kv_row + g * d..][..d];
            for r in 0..rows {
                let limit = sh.pos + s0 + r % nq;
                sc[r * K_TILE + (t - t0)] = if t <= limit {
                    dot8(qrow(r), krow) * scale
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
        // Online softmax update.
        for r in 0..rows {
            let row = &mut sc[r * K_TILE..r * K_TILE + nt];
            let mt = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if mt == f32::NEG_INFINITY {
                row.fill(0.0);
                continue;
            }
            let m_new = m[r].max(mt);
            let corr = (m[r] - m_new).exp();
            if corr != 1.0 {
                l[r] *= corr;
                acc[r * d..(r + 1) * d].iter_mut().for_each(|a| *a *= corr);
            }
            l[r] += O::exp_sub_sum(row, m_new);
            m[r] = m_new;
        }
        // Values: per row, the accumulator stays in registers across the
        // tile; the tile's value rows (≤ 64 × D) stay in L1 for all rows.
        let vbase = &vc[t0 * kv_row + g * d..(t1 - 1) * kv_row + g * d + d];
        for r in 0..rows {
            O::pv(
                &mut acc[r * d..(r + 1) * d],
                &sc[r * K_TILE..r * K_TILE + nt],
                vbase,
                kv_row,
            );
        }
        t0 = t1;
    }
    for r in 0..rows {
        let (rep, qi) = (r / nq, r % nq);
        let h = g * n_rep + rep;
        let start = ((s0 + qi) * sh.n_heads + h) * d;
        debug_assert!(start + d <= out_len);
        // SAFETY: (s0+qi, h) belongs to this work item only; in bounds.
        let o = unsafe { out.slice(start, d) };
        let inv = 1.0 / l[r];
        for (oi, &a) in o.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
            *oi = a * inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{assert_close, Rng};

    fn naive(q: &[f32], kc: &[f32], vc: &[f32], sh: &AttnShape) -> Vec<f64> {
        let (d, h_n) = (sh.head_dim, sh.n_heads);
        let n_rep = h_n / sh.n_kv_heads;
        let kv_row = sh.n_kv_heads * d;
        let mut out = vec![0f64; sh.s * h_n * d];
        for s in 0..sh.s {
            for h in 0..h_n {
                let g = h / n_rep;
                let qv = &q[(s * h_n + h) * d..][..d];
                let n_t = sh.pos + s + 1;
                let sc: Vec<f64> = (0..n_t)
                    .map(|t| {
                        let k = &kc[t * kv_row + g * d..][..d];
                        qv.iter()
                            .zip(k)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|v| (v - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for t in 0..n_t {
                    let v = &vc[t * kv_row + g * d..][..d];
                    for i in 0..d {
                        out[(s * h_n + h) * d + i] += e[t] / z * v[i] as f64;
                    }
                }
            }
        }
        out
    }

    fn case(threads: usize, sh: AttnShape, cap: usize, seed: u64) {
        let pool = ThreadPool::new(threads);
        let mut rng = Rng::new(seed);
        let q: Vec<f32> = rng
            .vec(sh.s * sh.n_heads * sh.head_dim)
            .iter()
            .map(|v| v * 3.0)
            .collect();
        let kc = rng.vec(cap * sh.n_kv_heads * sh.head_dim);
        let vc = rng.vec(cap * sh.n_kv_heads * sh.head_dim);
        let want = naive(&q, &kc, &vc, &sh);
        // Unfused.
        let mut scores = vec![0f32; attn_scores_len(&sh)];
        attn_scores(&pool, &q, &kc, sh, &mut scores).unwrap();
        softmax_rows(&pool, &mut scores, sh.n_keys()).unwrap();
        let mut out_a = vec![0f32; q.len()];
        attn_values(&pool, &scores, &vc, sh, &mut out_a).unwrap();
        assert_close(&out_a, &want, 1e-5, 1e-4, "unfused vs naive");
        // Fused.
        let mut scratch = vec![f32::NAN; attention_fused_scratch_len(&sh, pool.n_threads())];
        for isa in [Isa::Auto, Isa::Portable] {
            let mut out_b = vec![f32::NAN; q.len()];
            attention_fused_with(&pool, isa, &q, &kc, &vc, sh, &mut out_b, &mut scratch).unwrap();
            assert_close(&out_b, &want, 1e-5, 1e-4, "fused vs naive");
            let a64: Vec<f64> = out_a.iter().map(|&v| v as f64).collect();
            assert_close(&out_b, &a64, 1e-5, 1e-4, "fused vs unfused");
        }
    }

    #[test]
    fn prefill_gqa() {
        let sh = AttnShape {
            s: 37,
            pos: 0,
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 16,
        };
        case(2, sh, 40, 1);
        case(1, sh, 37, 2);
    }

    #[test]
    fn decode_and_chunked_with_history() {
        // One new token after 150 cached ones (several key tiles).
        case(
            2,
            AttnShape {
                s: 1,
                pos: 150,
                n_heads: 9,
                n_kv_heads: 3,
                head_dim: 64,
            },
            200,
            3,
        );
        // A chunk of 20 tokens at position 70, no GQA.
        case(
            2,
            AttnShape {
                s: 20,
                pos: 70,
                n_heads: 4,
                n_kv_heads: 4,
                head_dim: 8,
            },
            90,
            4,
        );
        // MQA, odd head_dim.
        case(
            1,
            AttnShape {
                s: 5,
                pos: 3,
                n_heads: 4,
                n_kv_heads: 1,
                head_dim: 7,
            },
            8,
            5,
        );
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_exp_accuracy() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
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

    #[test]
    fn causal_mask_in_scores() {
        let pool = ThreadPool::new(1);
        let sh = AttnShape {
            s: 3,
            pos: 2,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 4,
        };
        let q = vec![1.0; 12];
        let kc = vec![1.0; 5 * 4];
        let mut sc = vec![0.0; attn_scores_len(&sh)];
        attn_scores(&pool, &q, &kc, sh, &mut sc).unwrap();
        for s in 0..3 {
            for t in 0..5 {
                let v = sc[s * 5 + t];
                if t <= 2 + s {
                    assert_eq!(v, 2.0); // 4 / sqrt(4)
                } else {
                    assert_eq!(v, f32::NEG_INFINITY);
                }
            }
        }
    }

    #[test]
    fn shape_errors() {
        let pool = ThreadPool::new(1);
        let sh = AttnShape {
            s: 2,
            pos: 3,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 4,
        };
        let q = vec![0.0; 2 * 4 * 4];
        let short = vec![0.0; 4 * 2 * 4]; // 4 rows < P+S = 5
        let ok = vec![0.0; 5 * 2 * 4];
        let mut out = vec![0.0; q.len()];
        let mut scr = vec![0.0; attention_fused_scratch_len(&sh, 1)];
        assert!(attention_fused(&pool, &q, &short, &ok, sh, &mut out, &mut scr).is_err());
        assert!(attention_fused(&pool, &q, &ok, &ok, sh, &mut out, &mut scr[1..]).is_err());
        assert!(attention_fused(&pool, &q, &ok, &ok, sh, &mut out, &mut scr).is_ok());
        let bad = AttnShape {
            n_kv_heads: 3,
            ..sh
        };
        assert!(attention_fused(&pool, &q, &ok, &ok, bad, &mut out, &mut scr).is_err());
    }
}
