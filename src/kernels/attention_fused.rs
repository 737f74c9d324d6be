//! Fused causal GQA attention with an online (streaming) softmax.
//!
//! Work items are (kv head, block of [`Q_BLOCK`] queries), run on the pool.
//! An item holds `n_rep × Q_BLOCK` query rows (all query heads sharing the
//! kv head) and walks the keys `0..P+s1` in tiles of [`K_TILE`]: each key
//! and value row is loaded once per tile for all those rows; scores of the
//! tile go to scratch, the running max / sum / output accumulators are
//! rescaled as in the online softmax; the `S×T` matrix never exists.

use super::attention::AttnShape;
#[cfg(target_arch = "x86_64")]
use super::attention_ops::Avx2;
use super::attention_ops::{AttnOps, Portable};
use super::attention_tiled::{attention_tiled_scratch_len, attention_tiled_with};
use super::matmul::{dot8, Isa};
use super::KernelError;
use crate::pool::{SyncPtr, ThreadPool};

/// Query tokens per work item of the fused kernel.
pub const Q_BLOCK: usize = 16;
/// Keys per tile of the fused kernel.
pub const K_TILE: usize = 64;

fn fused_per_thread(shape: &AttnShape) -> usize {
    let rows = (shape.n_heads / shape.n_kv_heads.max(1)) * Q_BLOCK.min(shape.s.max(1));
    rows * (shape.head_dim + K_TILE + 2)
}

/// Scratch elements [`attention_stream_with`] needs for a pool of `n_threads`.
pub fn attention_stream_scratch_len(shape: &AttnShape, n_threads: usize) -> usize {
    fused_per_thread(shape) * n_threads.max(1)
}

/// From this many query tokens on, [`attention_fused`] runs the tiled
/// kernel ([`attention_tiled_with`]); below (decode, tiny chunks) the
/// streaming kernel, which does not pad rows to 8 SIMD lanes.
pub const TILED_MIN_S: usize = 4;

/// Scratch elements [`attention_fused`] needs for a pool of `n_threads`
/// (enough for either kernel it may choose, for any `s` up to `shape.s`).
pub fn attention_fused_scratch_len(shape: &AttnShape, n_threads: usize) -> usize {
    attention_stream_scratch_len(shape, n_threads)
        .max(attention_tiled_scratch_len(shape, n_threads))
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

/// [`attention_fused`] with an explicit choice of implementation: the
/// tiled kernel for `s >= TILED_MIN_S`, else the streaming one.
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
    let need = attention_fused_scratch_len(&shape, pool.n_threads());
    if scratch.len() < need {
        return Err(KernelError::Shape {
            op: "attention_fused",
            what: "scratch elements (attention_fused_scratch_len)",
            expected: need,
            actual: scratch.len(),
        });
    }
    if shape.s >= TILED_MIN_S {
        attention_tiled_with(pool, isa, q, k_cache, v_cache, shape, out, scratch)
    } else {
        attention_stream_with(pool, isa, q, k_cache, v_cache, shape, out, scratch)
    }
}

/// The streaming kernel: work items of (kv head, 16 queries), each key and
/// value row loaded once per item, scores of a 64-key tile in scratch,
/// online softmax per row. `scratch` needs
/// [`attention_stream_scratch_len`] elements.
#[allow(clippy::too_many_arguments)]
pub fn attention_stream_with(
    pool: &ThreadPool,
    isa: Isa,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    shape: AttnShape,
    out: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "attention_stream";
    shape.check(OP, q, k_cache, v_cache, out.len())?;
    let per = fused_per_thread(&shape);
    let need = attention_stream_scratch_len(&shape, pool.n_threads());
    if scratch.len() < need {
        return Err(KernelError::Shape {
            op: OP,
            what: "scratch elements (attention_stream_scratch_len)",
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
