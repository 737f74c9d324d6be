//! Fused causal GQA attention with an online (streaming) softmax.
//!
//! Work items are (kv head, block of [`Q_BLOCK`] queries), run on the pool.
//! An item holds `n_rep × Q_BLOCK` query rows (all query heads sharing the
//! kv head) and walks the keys `0..P+s1` in tiles of [`K_TILE`]: each key
//! and value row is loaded once per tile for all those rows; scores of the
//! tile go to scratch, the running max / sum / output accumulators are
//! rescaled as in the online softmax; the `S×T` matrix never exists.
//!
//! Decode (`S < TILED_MIN_S`) has only one item per kv head (3 for
//! SmolLM2), too few to keep every thread busy once the context is long,
//! so the streaming kernel then also splits the keys
//! ([`decode_key_splits`]): each item covers one key range and leaves its
//! unnormalised accumulators, running max and sum in scratch, and a merge
//! rescales them to the common max and sums them (as flash-decoding does).

#[cfg(target_arch = "x86_64")]
use super::ops::Avx2;
use super::ops::{AttnOps, Portable};
use super::tiled::{attention_tiled_scratch_len, attention_tiled_with};
use super::AttnShape;
use crate::kernels::matmul::dot8;
use crate::kernels::{Isa, KernelError};
use crate::pool::{SyncPtr, ThreadPool};

/// Query tokens per work item of the fused kernel.
pub const Q_BLOCK: usize = 16;
/// Keys per tile of the fused kernel.
pub const K_TILE: usize = 64;

fn fused_per_thread(shape: &AttnShape) -> usize {
    let rows = (shape.n_heads / shape.n_kv_heads.max(1)) * Q_BLOCK.min(shape.s.max(1));
    rows * (shape.head_dim + K_TILE + 2)
}

/// Most key ranges one decode item is split into.
pub const MAX_KEY_SPLITS: usize = 8;
/// Fewest keys per range of a split decode item.
const MIN_KEYS_PER_SPLIT: usize = 2 * K_TILE;

/// Key ranges per kv head for a decode step (`s < TILED_MIN_S`) on
/// `n_threads`: enough items for about four per thread, each range at
/// least [`MIN_KEYS_PER_SPLIT`] keys, at most [`MAX_KEY_SPLITS`]; 1 (no
/// split) for prefill shapes and for one thread.
pub fn decode_key_splits(shape: &AttnShape, n_threads: usize) -> usize {
    if shape.s == 0 || shape.s >= TILED_MIN_S || n_threads <= 1 || shape.n_kv_heads == 0 {
        return 1;
    }
    let keys = shape.pos + shape.s;
    let want = (4 * n_threads).div_ceil(shape.n_kv_heads);
    want.min(keys / MIN_KEYS_PER_SPLIT).clamp(1, MAX_KEY_SPLITS)
}

/// Scratch for the split items' partial results: per (kv head, split,
/// row) `head_dim` accumulators, the running max and the sum. Sized for the
/// largest decode shape (`s = TILED_MIN_S - 1`) so one buffer planned for a
/// prefill chunk also serves decode.
fn partials_len(shape: &AttnShape) -> usize {
    let n_rep = shape.n_heads / shape.n_kv_heads.max(1);
    let rows = n_rep * shape.s.clamp(1, TILED_MIN_S - 1);
    shape.n_kv_heads * MAX_KEY_SPLITS * rows * (shape.head_dim + 2)
}

/// Scratch elements [`attention_stream_with`] needs for a pool of `n_threads`.
pub fn attention_stream_scratch_len(shape: &AttnShape, n_threads: usize) -> usize {
    fused_per_thread(shape) * n_threads.max(1) + partials_len(shape)
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
    attention_fused_with(
        pool,
        Isa::current(),
        q,
        k_cache,
        v_cache,
        shape,
        out,
        scratch,
    )
}

/// [`attention_fused`] with the kernels of `isa`: the tiled kernel for
/// `s >= TILED_MIN_S`, else the streaming one.
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
    let splits = decode_key_splits(&shape, pool.n_threads());
    let (work, partials) = scratch.split_at_mut(per * pool.n_threads().max(1));
    let sp = SyncPtr::new(work);
    let pp = SyncPtr::new(partials);
    let op = SyncPtr::new(out);
    let out_len = out_len(&shape);
    let keys = shape.pos + shape.s;
    let n_rep = shape.n_heads / shape.n_kv_heads;
    // With splits, every item's rows: n_rep * s (decode: one query block).
    let rows = n_rep * shape.s;
    let part = rows * (shape.head_dim + 2);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    #[cfg(target_arch = "x86_64")]
    let avx2 = isa.min(Isa::detect()).avx2();
    pool.run_indexed(shape.n_kv_heads * n_qb * splits, &|c, tid| {
        let (gq, split) = (c / splits, c % splits);
        let g = gq / n_qb;
        let s0 = (gq % n_qb) * Q_BLOCK;
        let s1 = (s0 + Q_BLOCK).min(shape.s);
        let range = (split * keys / splits)..((split + 1) * keys / splits);
        let sink = if splits == 1 {
            Sink::Out(op, out_len)
        } else {
            // SAFETY: item c alone writes partial slot c (splits > 1 only
            // for decode shapes, which partials_len covers).
            Sink::Partial(unsafe { pp.slice(c * part, part) })
        };
        // SAFETY: thread `tid` is the only user of its scratch slice during
        // this job; work item c writes only out[s0..s1, heads of group g, :]
        // or its own partial slot.
        let scr = unsafe { sp.slice(tid * per, per) };
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 and FMA were detected at run time.
            unsafe { fused_item_avx2(q, k_cache, v_cache, &shape, g, s0, s1, range, sink, scr) };
            return;
        }
        fused_item::<Portable>(q, k_cache, v_cache, &shape, g, s0, s1, range, sink, scr);
    });
    if splits > 1 {
        merge_partials(
            &shape,
            splits,
            &partials[..shape.n_kv_heads * splits * part],
            out,
        );
    }
    Ok(())
}

/// Where a work item's result goes.
enum Sink<'a> {
    /// Normalised, into the output (`[S, H, D]`, its length).
    Out(SyncPtr<f32>, usize),
    /// Unnormalised: `rows × D` accumulators, then `rows` maxima, then
    /// `rows` sums.
    Partial(&'a mut [f32]),
}

/// Combines the split items' partial results of a decode step into `out`:
/// each split's accumulators and sum rescaled by `e^(m_i - M)` to the rows'
/// common maximum `M`, summed, divided by the summed sums.
fn merge_partials(shape: &AttnShape, splits: usize, partials: &[f32], out: &mut [f32]) {
    let d = shape.head_dim;
    let n_rep = shape.n_heads / shape.n_kv_heads;
    let rows = n_rep * shape.s;
    let part = rows * (d + 2);
    for g in 0..shape.n_kv_heads {
        let slot = |i: usize| &partials[(g * splits + i) * part..][..part];
        for r in 0..rows {
            let (rep, qi) = (r / shape.s, r % shape.s);
            let m_of = |i: usize| slot(i)[rows * d + r];
            let l_of = |i: usize| slot(i)[rows * d + rows + r];
            let mx = (0..splits).map(m_of).fold(f32::NEG_INFINITY, f32::max);
            let o = &mut out[(qi * shape.n_heads + g * n_rep + rep) * d..][..d];
            o.fill(0.0);
            let mut l = 0.0;
            for i in 0..splits {
                if m_of(i) == f32::NEG_INFINITY {
                    continue;
                }
                let w = (m_of(i) - mx).exp();
                l += l_of(i) * w;
                for (ov, &a) in o.iter_mut().zip(&slot(i)[r * d..(r + 1) * d]) {
                    *ov += a * w;
                }
            }
            let inv = 1.0 / l;
            o.iter_mut().for_each(|v| *v *= inv);
        }
    }
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
    keys: std::ops::Range<usize>,
    sink: Sink<'_>,
    scr: &mut [f32],
) {
    fused_item::<Avx2>(q, kc, vc, sh, g, s0, s1, keys, sink, scr)
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
    keys: std::ops::Range<usize>,
    sink: Sink<'_>,
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
    // Keys `keys` (all of them unless the item is one split of a decode
    // step), up to the last one any of the item's rows sees.
    let t_end = (sh.pos + s1).min(keys.end);
    let mut t0 = keys.start;
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
    match sink {
        Sink::Out(out, out_len) => {
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
        Sink::Partial(p) => {
            p[..rows * d].copy_from_slice(acc);
            p[rows * d..rows * d + rows].copy_from_slice(m);
            p[rows * d + rows..rows * (d + 2)].copy_from_slice(l);
        }
    }
}
