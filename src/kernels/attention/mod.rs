//! Causal grouped-query attention over the paged KV pool.
//!
//! Shapes: `q` `[S, H, D]`, the step's tokens of `N` sequences (each
//! sequence's tokens contiguous, [`StepSeqs`]); one layer's keys and values
//! in the pool ([`KvView`], layout in [`crate::kernels::kv`]). A query of a
//! sequence at position `p` attends that sequence's positions `0..=p`;
//! head `h` reads kv head `h / (H / Hkv)`; scores are scaled by `1/sqrt(D)`.
//!
//! Two forms: the unfused pieces here, [`attn_scores`] → [`softmax_rows`] →
//! [`attn_values`] (materialising `[H, S, T]`, `T` the longest key span of
//! the step), the reference path; and [`attention_paged`](paged), a fused
//! kernel that never materialises the scores and whose results do not
//! depend on the batch (see [`paged`]).

pub mod paged;
mod widen;

use crate::kernels::kv::{KvGeom, KvView, StepSeqs};
use crate::kernels::{check_len, KernelError};
use crate::pool::{SyncPtr, ThreadPool};

pub use paged::{attention_paged, merge_span, AttnWork, BK, SPAN, TILED_MIN_S};

/// The score scale `1/sqrt(D)` in f32.
pub fn scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}

/// Checks the operands of an unfused piece: `rows_len` elements of q (or
/// out), the cache, and `hst_len` elements of scores (or probs, named
/// `hst`) of `T = t_n` keys; returns `(S, H)`.
#[allow(clippy::too_many_arguments)]
fn check_unfused(
    op: &'static str,
    geom: &KvGeom,
    n_rep: usize,
    seqs: &StepSeqs<'_>,
    rows_len: usize,
    cache: KvView<'_>,
    t_n: usize,
    (hst, hst_len): (&'static str, usize),
) -> Result<(usize, usize), KernelError> {
    if n_rep == 0 || geom.n_kv_heads == 0 || geom.head_dim == 0 {
        return Err(KernelError::Invalid {
            op,
            what: "need n_rep, kv heads and head_dim > 0",
        });
    }
    let h = geom.n_kv_heads * n_rep;
    let s: usize = seqs.iter().map(|s| s.count).sum();
    check_len(
        op,
        "q or out elements (S*H*D)",
        s * h * geom.head_dim,
        rows_len,
    )?;
    check_len(op, "cache elements", geom.elems(), cache.len())?;
    if seqs.max_keys() > t_n {
        return Err(KernelError::Invalid {
            op,
            what: "T is shorter than a sequence's key span",
        });
    }
    check_len(op, hst, h * s * t_n, hst_len)?;
    Ok((s, h))
}

/// `scores[h, i, t] = q[i, h]·K[t, h/n_rep] / sqrt(D)` for the positions
/// `t <= p` of token `i`'s own sequence (`p` its position), `-inf` for
/// `p < t < T`. `scores` has `H·S·T` elements, `T >= ` every sequence's
/// `start + count`.
#[allow(clippy::too_many_arguments)]
pub fn attn_scores(
    pool: &ThreadPool,
    q: &[f32],
    k: KvView<'_>,
    geom: &KvGeom,
    n_rep: usize,
    seqs: &StepSeqs<'_>,
    t_n: usize,
    scores: &mut [f32],
) -> Result<(), KernelError> {
    attn_scores_windowed(pool, q, k, geom, n_rep, seqs, t_n, None, scores)
}

/// [`attn_scores`] with a sliding window: a query at position `p` also
/// masks (`-inf`) the positions `t <= p - window`, so it sees `window`
/// positions, its own included (Mistral, Phi-3, Gemma 3's local layers;
/// transformers' sliding-window mask and llama.cpp's standard SWA). The
/// masked keys are not read.
#[allow(clippy::too_many_arguments)]
pub fn attn_scores_windowed(
    pool: &ThreadPool,
    q: &[f32],
    k: KvView<'_>,
    geom: &KvGeom,
    n_rep: usize,
    seqs: &StepSeqs<'_>,
    t_n: usize,
    window: Option<usize>,
    scores: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "attn_scores";
    if window == Some(0) {
        return Err(KernelError::Invalid {
            op: OP,
            what: "a sliding window must hold at least one position",
        });
    }
    let hst = ("scores elements (H*S*T)", scores.len());
    let (s_n, h_n) = check_unfused(OP, geom, n_rep, seqs, q.len(), k, t_n, hst)?;
    let (d, bs) = (geom.head_dim, geom.block);
    let c = scale(d);
    let sp = SyncPtr::new(scores);
    pool.run(h_n, &|h| {
        // SAFETY: chunk h writes only its own [S, T] block of scores.
        let out = unsafe { sp.slice(h * s_n * t_n, s_n * t_n) };
        let g = h / n_rep;
        for s in seqs.iter() {
            for i in 0..s.count {
                let row = s.first + i;
                let qv = &q[(row * h_n + h) * d..][..d];
                let limit = s.start + i;
                let first = window.map_or(0, |w| (limit + 1).saturating_sub(w));
                for (t, o) in out[row * t_n..(row + 1) * t_n].iter_mut().enumerate() {
                    *o = if t <= limit && t >= first {
                        let b = s.block_of(t, bs);
                        let mut acc = 0f32;
                        for (e, &x) in qv.iter().enumerate() {
                            acc += x * k.get(geom.k_index(b, t % bs, g, e));
                        }
                        acc * c
                    } else {
                        f32::NEG_INFINITY
                    };
                }
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
    if !x.len().is_multiple_of(row_len) {
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

/// `out[i, h, :] = sum_t probs[h, i, t] * V[t, h/n_rep, :]` over the
/// positions `t <= p` of token `i`'s own sequence.
#[allow(clippy::too_many_arguments)]
pub fn attn_values(
    pool: &ThreadPool,
    probs: &[f32],
    v: KvView<'_>,
    geom: &KvGeom,
    n_rep: usize,
    seqs: &StepSeqs<'_>,
    t_n: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "attn_values";
    let hst = ("probs elements (H*S*T)", probs.len());
    let (s_n, h_n) = check_unfused(OP, geom, n_rep, seqs, out.len(), v, t_n, hst)?;
    let (d, bs) = (geom.head_dim, geom.block);
    let op = SyncPtr::new(out);
    pool.run(h_n, &|h| {
        let g = h / n_rep;
        for s in seqs.iter() {
            for i in 0..s.count {
                let row = s.first + i;
                // SAFETY: chunk h writes only out[row, h, :].
                let o = unsafe { op.slice((row * h_n + h) * d, d) };
                o.fill(0.0);
                let p = &probs[(h * s_n + row) * t_n..][..t_n];
                for (t, &pt) in p.iter().enumerate().take(s.start + i + 1) {
                    let b = s.block_of(t, bs);
                    let base = geom.v_index(b, t % bs, g, 0);
                    for (e, x) in o.iter_mut().enumerate() {
                        *x += pt * v.get(base + e);
                    }
                }
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests;
