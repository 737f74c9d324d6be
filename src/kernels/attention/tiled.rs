//! Tiled (flash-attention style) causal GQA attention for prefill (S > 1).
//!
//! A work item is (kv head `g`, block of `bq` queries). Its rows are the
//! `n_rep × bq` query rows sharing kv head `g`, ordered query-major
//! (`r = qi·n_rep + rep`) and padded to a multiple of 16 SIMD lanes. The item
//! walks its keys `0..P+s1` in blocks of [`BK`]:
//!
//! * `Q·Kᵀ` as a small GEMM with register tiles (AVX2: 6 keys × 16 rows,
//!   AVX-512: 8 keys × 48 rows). Q is packed once per item, transposed
//!   (`qt[d][r]`) and pre-scaled by `1/sqrt(D)`, so a key element is
//!   broadcast against 16-48 rows at once and the scores come out key-major
//!   (`st[k][r]`), one SIMD lane per row;
//! * the causal mask only in blocks that reach past `P+s0` (keys every row
//!   of the item sees need none; no block is entirely masked because the
//!   walk stops at the item's last query);
//! * the online softmax vectorised across rows (row max / sum are lane-wise
//!   max / add over keys, `exp` by polynomial);
//! * `P·V` as a small GEMM (6 rows × 16 columns of accumulators with AVX2,
//!   6 × 64 with AVX-512), the old accumulators rescaled by the softmax
//!   correction as they are loaded.
//!
//! Each K and V row of a block is loaded from memory once for the whole item
//! (all `n_rep` heads of the group), then reused from L1. Items are handed to
//! the pool largest first (causal work grows with the query block), so the
//! dynamic chunk counter balances the threads.
//!
//! Levels ([`Isa`]): scalar (the reference, same blocking), AVX2+FMA
//! and AVX-512F, chosen at run time.

use super::AttnShape;
use crate::kernels::{Isa, KernelError};
use crate::pool::{SyncPtr, ThreadPool};

/// Keys per block of the tiled kernel.
pub const BK: usize = 64;
/// Head dims per partial sum of a score (the partial sums are added).
const QK_CHUNK: usize = 16;
/// Target query rows (query tokens × heads of a group) per work item.
const ROWS: usize = 48;

/// Query tokens per work item for a GQA group of `n_rep` heads.
fn block_queries(n_rep: usize) -> usize {
    (ROWS / n_rep.max(1)).max(1)
}

/// Scratch floats one thread needs for `shape` (rows padded to 16 lanes).
fn per_thread(shape: &AttnShape) -> usize {
    let n_rep = shape.n_heads / shape.n_kv_heads.max(1);
    let rp = (block_queries(n_rep).min(shape.s.max(1)) * n_rep).next_multiple_of(16);
    rp * (2 * shape.head_dim + BK + 3)
}

/// Scratch elements [`attention_tiled`] needs for a pool of `n_threads`.
pub fn attention_tiled_scratch_len(shape: &AttnShape, n_threads: usize) -> usize {
    per_thread(shape) * n_threads.max(1)
}

/// Tiled causal GQA attention; `out` is `[S, H, D]`. `scratch` needs at
/// least [`attention_tiled_scratch_len`]`(shape, pool.n_threads())` elements.
pub fn attention_tiled(
    pool: &ThreadPool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    shape: AttnShape,
    out: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), KernelError> {
    attention_tiled_with(
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

/// The kernel set of the tiled kernel at a given [`Isa`] level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TiledLevel {
    /// Portable Rust: the reference.
    Scalar,
    /// AVX2 + FMA, 8 rows per vector.
    Avx2,
    /// AVX-512F, 16 rows per vector (falls back to AVX2 where 16-row
    /// vectors do not fit).
    Avx512,
}

impl TiledLevel {
    /// The kernels of `isa`, lowered to what this CPU supports.
    fn of(isa: Isa) -> Self {
        match isa.min(Isa::detect()) {
            Isa::Scalar => Self::Scalar,
            Isa::Avx2 => Self::Avx2,
            Isa::Avx512 | Isa::Avx512Vnni => Self::Avx512,
        }
    }
}

/// [`attention_tiled`] with the kernels of `isa` (for tests and
/// benchmarks), lowered to what this CPU supports.
#[allow(clippy::too_many_arguments)]
pub fn attention_tiled_with(
    pool: &ThreadPool,
    isa: Isa,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    shape: AttnShape,
    out: &mut [f32],
    scratch: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "attention_tiled";
    let level = TiledLevel::of(isa);
    shape.check(OP, q, k_cache, v_cache, out.len())?;
    let per = per_thread(&shape);
    let need = attention_tiled_scratch_len(&shape, pool.n_threads());
    if scratch.len() < need {
        return Err(KernelError::Shape {
            op: OP,
            what: "scratch elements (attention_tiled_scratch_len)",
            expected: need,
            actual: scratch.len(),
        });
    }
    if shape.s == 0 {
        return Ok(());
    }
    let n_rep = shape.n_heads / shape.n_kv_heads;
    let bq = block_queries(n_rep);
    let n_qb = shape.s.div_ceil(bq);
    let sp = SyncPtr::new(scratch);
    let op = SyncPtr::new(out);
    pool.run_indexed(shape.n_kv_heads * n_qb, &|c, tid| {
        // Largest items (last query blocks: most keys) first.
        let qb = n_qb - 1 - c / shape.n_kv_heads;
        let g = c % shape.n_kv_heads;
        let s0 = qb * bq;
        let s1 = (s0 + bq).min(shape.s);
        // SAFETY: thread `tid` is the only user of its scratch slice during
        // this job (pool contract); `per * n_threads` fits in scratch.
        let scr = unsafe { sp.slice(tid * per, per) };
        let it = Item::new(&shape, g, s0, s1);
        match level {
            TiledLevel::Scalar => item_portable(q, k_cache, v_cache, &shape, &it, op, scr),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 and FMA were detected (`TiledLevel::of` lowers to the CPU's level).
            TiledLevel::Avx2 => unsafe { x86::item(q, k_cache, v_cache, &shape, &it, op, scr) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F, AVX2 and FMA were detected.
            TiledLevel::Avx512 => unsafe {
                x86_512::item(q, k_cache, v_cache, &shape, &it, op, scr)
            },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("TiledLevel::of gives Scalar off x86-64"),
        }
    });
    Ok(())
}

/// Geometry of one work item.
struct Item {
    g: usize,
    s0: usize,
    n_rep: usize,
    /// Real rows (`(s1 - s0) · n_rep`).
    rows: usize,
    /// Rows padded to a multiple of 16 (one AVX-512 vector).
    rp: usize,
    /// Keys `<= t_diag` are visible to every row of the item.
    t_diag: usize,
    /// One past the last key of the item.
    t_end: usize,
}

impl Item {
    fn new(sh: &AttnShape, g: usize, s0: usize, s1: usize) -> Self {
        let n_rep = sh.n_heads / sh.n_kv_heads;
        let rows = (s1 - s0) * n_rep;
        Item {
            g,
            s0,
            n_rep,
            rows,
            rp: rows.next_multiple_of(16),
            t_diag: sh.pos + s0,
            t_end: sh.pos + s1,
        }
    }
}

/// Splits a thread's scratch into (qt, st, acc, m, l, corr).
#[allow(clippy::type_complexity)]
fn split_scratch(
    scr: &mut [f32],
    rp: usize,
    d: usize,
) -> (
    &mut [f32],
    &mut [f32],
    &mut [f32],
    &mut [f32],
    &mut [f32],
    &mut [f32],
) {
    let (qt, rest) = scr.split_at_mut(d * rp);
    let (st, rest) = rest.split_at_mut(BK * rp);
    let (acc, rest) = rest.split_at_mut(rp * d);
    let (m, rest) = rest.split_at_mut(rp);
    let (l, rest) = rest.split_at_mut(rp);
    (qt, st, acc, m, l, &mut rest[..rp])
}

/// Packs the item's query rows transposed and scaled by `1/sqrt(D)`
/// (`qt[e·rp + r]`; padding rows are zero).
fn pack_q(q: &[f32], sh: &AttnShape, it: &Item, qt: &mut [f32]) {
    let d = sh.head_dim;
    let c = sh.scale();
    for r in 0..it.rp {
        if r < it.rows {
            let (qi, rep) = (r / it.n_rep, r % it.n_rep);
            let h = it.g * it.n_rep + rep;
            let src = &q[((it.s0 + qi) * sh.n_heads + h) * d..][..d];
            for (e, &x) in src.iter().enumerate() {
                qt[e * it.rp + r] = x * c;
            }
        } else {
            for e in 0..d {
                qt[e * it.rp + r] = 0.0;
            }
        }
    }
}

/// Sets masked scores of block `t0..t0+nk` to `-inf`: row `r` (query
/// `r / n_rep`) sees keys `<= t_diag + r / n_rep`. Padding rows stay.
fn mask_block(st: &mut [f32], it: &Item, t0: usize, nk: usize) {
    for k in 0..nk {
        let t = t0 + k;
        if t <= it.t_diag {
            continue;
        }
        // Rows with t_diag + qi < t, i.e. qi < t - t_diag.
        let first_visible = ((t - it.t_diag) * it.n_rep).min(it.rows);
        st[k * it.rp..k * it.rp + first_visible].fill(f32::NEG_INFINITY);
    }
}

/// Writes `acc[r] / l[r]` to the output rows of the item.
fn write_out(sh: &AttnShape, it: &Item, acc: &[f32], l: &[f32], out: SyncPtr<f32>) {
    let d = sh.head_dim;
    for r in 0..it.rows {
        let (qi, rep) = (r / it.n_rep, r % it.n_rep);
        let h = it.g * it.n_rep + rep;
        let start = ((it.s0 + qi) * sh.n_heads + h) * d;
        // SAFETY: (s0+qi, h) belongs to this work item only; in bounds
        // because s0+qi < S and h < H (shape checked against out).
        let o = unsafe { out.slice(start, d) };
        let inv = 1.0 / l[r];
        for (oi, &a) in o.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
            *oi = a * inv;
        }
    }
}

/// The scalar reference implementation of one item (same blocking).
fn item_portable(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    sh: &AttnShape,
    it: &Item,
    out: SyncPtr<f32>,
    scr: &mut [f32],
) {
    let d = sh.head_dim;
    let rp = it.rp;
    let (qt, st, acc, m, l, corr) = split_scratch(scr, rp, d);
    pack_q(q, sh, it, qt);
    acc.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    let kv_row = sh.n_kv_heads * d;
    let col = it.g * d;
    let mut t0 = 0;
    while t0 < it.t_end {
        let nk = BK.min(it.t_end - t0);
        // Scores.
        for k in 0..nk {
            let krow = &kc[(t0 + k) * kv_row + col..][..d];
            let srow = &mut st[k * rp..(k + 1) * rp];
            for (r, sv) in srow.iter_mut().enumerate() {
                let mut tot = 0f32;
                for e0 in (0..d).step_by(QK_CHUNK) {
                    let mut part = 0f32;
                    for (e, &kv) in krow.iter().enumerate().take(d.min(e0 + QK_CHUNK)).skip(e0) {
                        part += kv * qt[e * rp + r];
                    }
                    tot += part;
                }
                *sv = tot;
            }
        }
        if t0 + nk - 1 > it.t_diag {
            mask_block(st, it, t0, nk);
        }
        // Online softmax, per row.
        for r in 0..rp {
            let mx = (0..nk).fold(f32::NEG_INFINITY, |a, k| a.max(st[k * rp + r]));
            let m_new = m[r].max(mx);
            let cr = (m[r] - m_new).exp();
            let mut sum = 0f32;
            for k in 0..nk {
                let p = (st[k * rp + r] - m_new).exp();
                st[k * rp + r] = p;
                sum += p;
            }
            l[r] = l[r] * cr + sum;
            m[r] = m_new;
            corr[r] = cr;
        }
        // Values.
        for r in 0..rp {
            let a = &mut acc[r * d..(r + 1) * d];
            a.iter_mut().for_each(|x| *x *= corr[r]);
            for k in 0..nk {
                let p = st[k * rp + r];
                let vrow = &vc[(t0 + k) * kv_row + col..][..d];
                for (x, &v) in a.iter_mut().zip(vrow) {
                    *x += p * v;
                }
            }
        }
        t0 += nk;
    }
    write_out(sh, it, acc, l, out);
}

/// The three per-block steps of a SIMD level; [`drive`] runs them.
#[cfg(target_arch = "x86_64")]
trait BlockSteps {
    /// Scores of `nk` keys (`k`: rows of `kv_row` floats, `d` used) for all
    /// `rp` rows of `qt` into `st`.
    ///
    /// # Safety
    /// The level's CPU features are available; `nk` key rows of `d` floats
    /// are readable at `k` with stride `kv_row`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn qk(
        qt: &[f32],
        rp: usize,
        k: *const f32,
        kv_row: usize,
        nk: usize,
        d: usize,
        st: &mut [f32],
    );
    /// Online softmax update of one block.
    ///
    /// # Safety
    /// The level's CPU features are available.
    unsafe fn softmax(
        st: &mut [f32],
        rp: usize,
        nk: usize,
        m: &mut [f32],
        l: &mut [f32],
        corr: &mut [f32],
    );
    /// `acc = acc·corr + P·V` for one block.
    ///
    /// # Safety
    /// As [`BlockSteps::qk`], for the value rows at `v`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv(
        st: &[f32],
        rp: usize,
        nk: usize,
        v: *const f32,
        kv_row: usize,
        d: usize,
        acc: &mut [f32],
        corr: &[f32],
    );
}

/// One work item over key blocks with the steps of level `B`; inlined into
/// each level's `#[target_feature]` entry point.
///
/// # Safety
/// The CPU features of `B` are available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn drive<B: BlockSteps>(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    sh: &AttnShape,
    it: &Item,
    out: SyncPtr<f32>,
    scr: &mut [f32],
) {
    let d = sh.head_dim;
    let rp = it.rp;
    let kv_row = sh.n_kv_heads * d;
    let col = it.g * d;
    // Every key/value row read below lies in the checked caches.
    assert!(it.t_end * kv_row <= kc.len().min(vc.len()) && col + d <= kv_row);
    let (qt, st, acc, m, l, corr) = split_scratch(scr, rp, d);
    pack_q(q, sh, it, qt);
    acc.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    let mut t0 = 0;
    while t0 < it.t_end {
        let nk = BK.min(it.t_end - t0);
        // SAFETY: the features of B are available (this function's
        // contract); key and value rows t0..t0+nk < t_end are in bounds
        // (asserted above).
        unsafe {
            B::qk(
                qt,
                rp,
                kc.as_ptr().add(t0 * kv_row + col),
                kv_row,
                nk,
                d,
                st,
            )
        };
        if t0 + nk - 1 > it.t_diag {
            mask_block(st, it, t0, nk);
        }
        // SAFETY: as above.
        unsafe {
            B::softmax(st, rp, nk, m, l, corr);
            B::pv(
                st,
                rp,
                nk,
                vc.as_ptr().add(t0 * kv_row + col),
                kv_row,
                d,
                acc,
                corr,
            );
        }
        t0 += nk;
    }
    write_out(sh, it, acc, l, out);
}

/// `Blocks`: the [`BlockSteps`] of the SIMD level module it is invoked in,
/// forwarding to that module's `qk_block`, `softmax_block` and `pv_block`
/// (names resolve where the macro is invoked).
#[cfg(target_arch = "x86_64")]
macro_rules! block_steps {
    () => {
        /// The block steps of this level, for [`super::drive`].
        pub(super) struct Blocks;

        impl super::BlockSteps for Blocks {
            #[inline(always)]
            unsafe fn qk(
                qt: &[f32],
                rp: usize,
                k: *const f32,
                kv_row: usize,
                nk: usize,
                d: usize,
                st: &mut [f32],
            ) {
                // SAFETY: forwarded contract (see `BlockSteps`).
                unsafe { qk_block(qt, rp, k, kv_row, nk, d, st) }
            }
            #[inline(always)]
            unsafe fn softmax(
                st: &mut [f32],
                rp: usize,
                nk: usize,
                m: &mut [f32],
                l: &mut [f32],
                corr: &mut [f32],
            ) {
                // SAFETY: forwarded contract (see `BlockSteps`).
                unsafe { softmax_block(st, rp, nk, m, l, corr) }
            }
            #[inline(always)]
            unsafe fn pv(
                st: &[f32],
                rp: usize,
                nk: usize,
                v: *const f32,
                kv_row: usize,
                d: usize,
                acc: &mut [f32],
                corr: &[f32],
            ) {
                // SAFETY: forwarded contract (see `BlockSteps`).
                unsafe { pv_block(st, rp, nk, v, kv_row, d, acc, corr) }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::ops::x86::exp_ps;
    use super::*;
    use std::arch::x86_64::*;

    /// Scores of `NK` keys × `8·NC` rows: `st[j·rp + r] = Σ_e k[j·kv_row +
    /// e] · qt[e·rp + r]` (pointers already offset to the tile).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn qk_tile<const NK: usize, const NC: usize>(
        qt: *const f32,
        rp: usize,
        k: *const f32,
        kv_row: usize,
        d: usize,
        st: *mut f32,
    ) {
        // SAFETY: the caller guarantees d×rp floats at qt (tile columns
        // 8·NC in bounds), NK key rows of d floats and NK×rp floats at st.
        unsafe {
            // Chunks of QK_CHUNK dims summed separately (pairwise-ish
            // rounding, as the 8-lane dot products of the streaming kernel).
            let mut e0 = 0;
            while e0 < d {
                let e1 = (e0 + QK_CHUNK).min(d);
                let mut a = [[_mm256_setzero_ps(); NC]; NK];
                for e in e0..e1 {
                    let mut qv = [_mm256_setzero_ps(); NC];
                    for (c, v) in qv.iter_mut().enumerate() {
                        *v = _mm256_loadu_ps(qt.add(e * rp + 8 * c));
                    }
                    for (j, aj) in a.iter_mut().enumerate() {
                        let kb = _mm256_broadcast_ss(&*k.add(j * kv_row + e));
                        for (c, ajc) in aj.iter_mut().enumerate() {
                            *ajc = _mm256_fmadd_ps(kb, qv[c], *ajc);
                        }
                    }
                }
                for (j, aj) in a.iter().enumerate() {
                    for (c, ajc) in aj.iter().enumerate() {
                        let p = st.add(j * rp + 8 * c);
                        let v = if e0 == 0 {
                            *ajc
                        } else {
                            _mm256_add_ps(_mm256_loadu_ps(p), *ajc)
                        };
                        _mm256_storeu_ps(p, v);
                    }
                }
                e0 = e1;
            }
        }
    }

    /// `acc[i·d + 8c..] = acc·corr[i] + Σ_k st[k·rp + i] · v[k·kv_row + 8c..]`
    /// for `R` rows and `8·NC` columns (pointers offset to the tile).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_tile<const R: usize, const NC: usize>(
        st: *const f32,
        rp: usize,
        nk: usize,
        v: *const f32,
        kv_row: usize,
        acc: *mut f32,
        d: usize,
        corr: *const f32,
    ) {
        // SAFETY: the caller guarantees R rows of acc (stride d) with 8·NC
        // columns, nk value rows with 8·NC columns, nk×rp probabilities
        // (R columns used) and R corrections.
        unsafe {
            let mut a = [[_mm256_setzero_ps(); NC]; R];
            for (i, ai) in a.iter_mut().enumerate() {
                let cr = _mm256_broadcast_ss(&*corr.add(i));
                for (c, aic) in ai.iter_mut().enumerate() {
                    *aic = _mm256_mul_ps(_mm256_loadu_ps(acc.add(i * d + 8 * c)), cr);
                }
            }
            for k in 0..nk {
                let mut vv = [_mm256_setzero_ps(); NC];
                for (c, x) in vv.iter_mut().enumerate() {
                    *x = _mm256_loadu_ps(v.add(k * kv_row + 8 * c));
                }
                for (i, ai) in a.iter_mut().enumerate() {
                    let p = _mm256_broadcast_ss(&*st.add(k * rp + i));
                    for (c, aic) in ai.iter_mut().enumerate() {
                        *aic = _mm256_fmadd_ps(p, vv[c], *aic);
                    }
                }
            }
            for (i, ai) in a.iter().enumerate() {
                for (c, aic) in ai.iter().enumerate() {
                    _mm256_storeu_ps(acc.add(i * d + 8 * c), *aic);
                }
            }
        }
    }

    /// Scores of one key block for all rows.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn qk_block(
        qt: &[f32],
        rp: usize,
        k: *const f32,
        kv_row: usize,
        nk: usize,
        d: usize,
        st: &mut [f32],
    ) {
        debug_assert!(qt.len() >= d * rp && st.len() >= nk * rp && rp.is_multiple_of(8));
        let mut r0 = 0;
        while r0 < rp {
            let wide = r0 + 16 <= rp;
            let mut j = 0;
            // SAFETY: r0 + 8·NC <= rp, keys j..j+NK < nk (caller: nk rows
            // of d floats at k), st has nk×rp floats.
            unsafe {
                let (q0, s0) = (qt.as_ptr().add(r0), st.as_mut_ptr().add(r0));
                while j + 6 <= nk {
                    let (kj, sj) = (k.add(j * kv_row), s0.add(j * rp));
                    if wide {
                        qk_tile::<6, 2>(q0, rp, kj, kv_row, d, sj);
                    } else {
                        qk_tile::<6, 1>(q0, rp, kj, kv_row, d, sj);
                    }
                    j += 6;
                }
                while j < nk {
                    let (kj, sj) = (k.add(j * kv_row), s0.add(j * rp));
                    if wide {
                        qk_tile::<1, 2>(q0, rp, kj, kv_row, d, sj);
                    } else {
                        qk_tile::<1, 1>(q0, rp, kj, kv_row, d, sj);
                    }
                    j += 1;
                }
            }
            r0 += if wide { 16 } else { 8 };
        }
    }

    /// Online softmax update for one block, 8 rows per vector.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn softmax_block(
        st: &mut [f32],
        rp: usize,
        nk: usize,
        m: &mut [f32],
        l: &mut [f32],
        corr: &mut [f32],
    ) {
        assert!(st.len() >= nk * rp && m.len() >= rp && l.len() >= rp && corr.len() >= rp);
        // SAFETY: all accesses are at r0..r0+8 <= rp of rows k < nk.
        unsafe {
            let sp = st.as_mut_ptr();
            for r0 in (0..rp).step_by(8) {
                let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
                for k in 0..nk {
                    mx = _mm256_max_ps(mx, _mm256_loadu_ps(sp.add(k * rp + r0)));
                }
                let m_old = _mm256_loadu_ps(m.as_ptr().add(r0));
                let m_new = _mm256_max_ps(m_old, mx);
                let cr = exp_ps(_mm256_sub_ps(m_old, m_new));
                let mut s0 = _mm256_setzero_ps();
                let mut s1 = _mm256_setzero_ps();
                let mut k = 0;
                while k + 2 <= nk {
                    let a = sp.add(k * rp + r0);
                    let b = sp.add((k + 1) * rp + r0);
                    let pa = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(a), m_new));
                    let pb = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(b), m_new));
                    _mm256_storeu_ps(a, pa);
                    _mm256_storeu_ps(b, pb);
                    s0 = _mm256_add_ps(s0, pa);
                    s1 = _mm256_add_ps(s1, pb);
                    k += 2;
                }
                if k < nk {
                    let a = sp.add(k * rp + r0);
                    let pa = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(a), m_new));
                    _mm256_storeu_ps(a, pa);
                    s0 = _mm256_add_ps(s0, pa);
                }
                let l_old = _mm256_loadu_ps(l.as_ptr().add(r0));
                let l_new = _mm256_fmadd_ps(l_old, cr, _mm256_add_ps(s0, s1));
                _mm256_storeu_ps(l.as_mut_ptr().add(r0), l_new);
                _mm256_storeu_ps(m.as_mut_ptr().add(r0), m_new);
                _mm256_storeu_ps(corr.as_mut_ptr().add(r0), cr);
            }
        }
    }

    /// `acc = acc·corr + P·V` for one key block, all rows.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_block(
        st: &[f32],
        rp: usize,
        nk: usize,
        v: *const f32,
        kv_row: usize,
        d: usize,
        acc: &mut [f32],
        corr: &[f32],
    ) {
        assert!(st.len() >= nk * rp && acc.len() >= rp * d && corr.len() >= rp);
        let (sp, ap, cp) = (st.as_ptr(), acc.as_mut_ptr(), corr.as_ptr());
        // SAFETY: rows r0..r0+R <= rp (rp is even); the caller guarantees
        // nk value rows of d floats at v.
        unsafe {
            let mut r0 = 0;
            while r0 < rp {
                // 6 rows × 16 columns: 12 accumulators + 2 value vectors +
                // 1 broadcast fit the 16 registers (4 × 24 spilled).
                if r0 + 6 <= rp {
                    pv_rows::<6>(sp.add(r0), rp, nk, v, kv_row, ap.add(r0 * d), d, cp.add(r0));
                    r0 += 6;
                } else {
                    pv_rows::<2>(sp.add(r0), rp, nk, v, kv_row, ap.add(r0 * d), d, cp.add(r0));
                    r0 += 2;
                }
            }
        }
    }

    /// [`pv_block`] for rows `0..R` (pointers offset to the first row).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_rows<const R: usize>(
        s: *const f32,
        rp: usize,
        nk: usize,
        v: *const f32,
        kv_row: usize,
        a: *mut f32,
        d: usize,
        c: *const f32,
    ) {
        // SAFETY: the caller guarantees R rows of a (stride d), R columns
        // of nk×rp probabilities at s, R corrections and nk value rows of
        // d floats (stride kv_row) at v; columns stay below d.
        unsafe {
            let mut c0 = 0;
            while c0 + 16 <= d {
                pv_tile::<R, 2>(s, rp, nk, v.add(c0), kv_row, a.add(c0), d, c);
                c0 += 16;
            }
            if c0 + 8 <= d {
                pv_tile::<R, 1>(s, rp, nk, v.add(c0), kv_row, a.add(c0), d, c);
                c0 += 8;
            }
            for i in 0..R {
                let cr = *c.add(i);
                for col in c0..d {
                    let mut x = *a.add(i * d + col) * cr;
                    for k in 0..nk {
                        x += *s.add(k * rp + i) * *v.add(k * kv_row + col);
                    }
                    *a.add(i * d + col) = x;
                }
            }
        }
    }

    block_steps!();

    /// One work item with AVX2+FMA.
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn item(
        q: &[f32],
        kc: &[f32],
        vc: &[f32],
        sh: &AttnShape,
        it: &Item,
        out: SyncPtr<f32>,
        scr: &mut [f32],
    ) {
        // SAFETY: this level's features are available (this function's contract).
        unsafe { super::drive::<Blocks>(q, kc, vc, sh, it, out, scr) }
    }
}

/// The AVX-512F level: the same blocking with 16 rows per vector.
#[cfg(target_arch = "x86_64")]
mod x86_512 {
    use super::*;
    use std::arch::x86_64::*;

    /// exp(x) lane-wise for x <= ~0 (Cephes-style, as the AVX2 `exp_ps`);
    /// lanes below -87 (incl. -inf) give exactly 0.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp_ps(x: __m512) -> __m512 {
        let lo = _mm512_set1_ps(-87.0);
        let ok = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, lo);
        let x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.398_2e-3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.333_452e-3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166_579_6e-2));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166_666_65));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5));
        let r2 = _mm512_mul_ps(r, r);
        let y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
        let pow2 = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        _mm512_maskz_mul_ps(ok, y, _mm512_castsi512_ps(pow2))
    }

    /// Scores of `NK` keys × `16·NC` rows (as the AVX2 `qk_tile`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn qk_tile<const NK: usize, const NC: usize>(
        qt: *const f32,
        rp: usize,
        k: *const f32,
        kv_row: usize,
        d: usize,
        st: *mut f32,
    ) {
        // SAFETY: the caller guarantees d×rp floats at qt (tile columns
        // 16·NC in bounds), NK key rows of d floats and NK×rp floats at st.
        unsafe {
            // Chunks of QK_CHUNK dims summed separately (pairwise-ish
            // rounding, as the 8-lane dot products of the streaming kernel).
            let mut e0 = 0;
            while e0 < d {
                let e1 = (e0 + QK_CHUNK).min(d);
                let mut a = [[_mm512_setzero_ps(); NC]; NK];
                for e in e0..e1 {
                    let mut qv = [_mm512_setzero_ps(); NC];
                    for (c, v) in qv.iter_mut().enumerate() {
                        *v = _mm512_loadu_ps(qt.add(e * rp + 16 * c));
                    }
                    for (j, aj) in a.iter_mut().enumerate() {
                        let kb = _mm512_set1_ps(*k.add(j * kv_row + e));
                        for (c, ajc) in aj.iter_mut().enumerate() {
                            *ajc = _mm512_fmadd_ps(kb, qv[c], *ajc);
                        }
                    }
                }
                for (j, aj) in a.iter().enumerate() {
                    for (c, ajc) in aj.iter().enumerate() {
                        let p = st.add(j * rp + 16 * c);
                        let v = if e0 == 0 {
                            *ajc
                        } else {
                            _mm512_add_ps(_mm512_loadu_ps(p), *ajc)
                        };
                        _mm512_storeu_ps(p, v);
                    }
                }
                e0 = e1;
            }
        }
    }

    /// Scores of one key block for all rows (rp % 16 == 0).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn qk_block(
        qt: &[f32],
        rp: usize,
        k: *const f32,
        kv_row: usize,
        nk: usize,
        d: usize,
        st: &mut [f32],
    ) {
        assert!(qt.len() >= d * rp && st.len() >= nk * rp && rp.is_multiple_of(16));
        let mut r0 = 0;
        while r0 < rp {
            let nc = ((rp - r0) / 16).min(3);
            // SAFETY: r0 + 16·nc <= rp; keys j..j+NK <= nk (caller: nk rows
            // of d floats at k, stride kv_row); st has nk×rp floats.
            unsafe {
                let (q0, s0) = (qt.as_ptr().add(r0), st.as_mut_ptr().add(r0));
                let mut j = 0;
                while j + 8 <= nk {
                    let (kj, sj) = (k.add(j * kv_row), s0.add(j * rp));
                    match nc {
                        3 => qk_tile::<8, 3>(q0, rp, kj, kv_row, d, sj),
                        2 => qk_tile::<8, 2>(q0, rp, kj, kv_row, d, sj),
                        _ => qk_tile::<8, 1>(q0, rp, kj, kv_row, d, sj),
                    }
                    j += 8;
                }
                while j < nk {
                    let (kj, sj) = (k.add(j * kv_row), s0.add(j * rp));
                    match nc {
                        3 => qk_tile::<1, 3>(q0, rp, kj, kv_row, d, sj),
                        2 => qk_tile::<1, 2>(q0, rp, kj, kv_row, d, sj),
                        _ => qk_tile::<1, 1>(q0, rp, kj, kv_row, d, sj),
                    }
                    j += 1;
                }
            }
            r0 += 16 * nc;
        }
    }

    /// Online softmax update for one block, 16 rows per vector.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn softmax_block(
        st: &mut [f32],
        rp: usize,
        nk: usize,
        m: &mut [f32],
        l: &mut [f32],
        corr: &mut [f32],
    ) {
        assert!(st.len() >= nk * rp && m.len() >= rp && l.len() >= rp && corr.len() >= rp);
        assert!(rp.is_multiple_of(16));
        // SAFETY: all accesses are at r0..r0+16 <= rp of rows k < nk.
        unsafe {
            let sp = st.as_mut_ptr();
            for r0 in (0..rp).step_by(16) {
                let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
                for k in 0..nk {
                    mx = _mm512_max_ps(mx, _mm512_loadu_ps(sp.add(k * rp + r0)));
                }
                let m_old = _mm512_loadu_ps(m.as_ptr().add(r0));
                let m_new = _mm512_max_ps(m_old, mx);
                let cr = exp_ps(_mm512_sub_ps(m_old, m_new));
                let mut s0 = _mm512_setzero_ps();
                let mut s1 = _mm512_setzero_ps();
                let mut k = 0;
                while k + 2 <= nk {
                    let a = sp.add(k * rp + r0);
                    let b = sp.add((k + 1) * rp + r0);
                    let pa = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(a), m_new));
                    let pb = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(b), m_new));
                    _mm512_storeu_ps(a, pa);
                    _mm512_storeu_ps(b, pb);
                    s0 = _mm512_add_ps(s0, pa);
                    s1 = _mm512_add_ps(s1, pb);
                    k += 2;
                }
                if k < nk {
                    let a = sp.add(k * rp + r0);
                    let pa = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(a), m_new));
                    _mm512_storeu_ps(a, pa);
                    s0 = _mm512_add_ps(s0, pa);
                }
                let l_old = _mm512_loadu_ps(l.as_ptr().add(r0));
                let l_new = _mm512_fmadd_ps(l_old, cr, _mm512_add_ps(s0, s1));
                _mm512_storeu_ps(l.as_mut_ptr().add(r0), l_new);
                _mm512_storeu_ps(m.as_mut_ptr().add(r0), m_new);
                _mm512_storeu_ps(corr.as_mut_ptr().add(r0), cr);
            }
        }
    }

    /// `acc = acc·corr + P·V` for `R` rows × `16·NC` columns (pointers
    /// offset to the tile).
    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_tile<const R: usize, const NC: usize>(
        st: *const f32,
        rp: usize,
        nk: usize,
        v: *const f32,
        kv_row: usize,
        acc: *mut f32,
        d: usize,
        corr: *const f32,
    ) {
        // SAFETY: the caller guarantees R rows of acc (stride d) with 16·NC
        // columns, nk value rows with 16·NC columns, nk×rp probabilities
        // (R columns used) and R corrections.
        unsafe {
            let mut a = [[_mm512_setzero_ps(); NC]; R];
            for (i, ai) in a.iter_mut().enumerate() {
                let cr = _mm512_set1_ps(*corr.add(i));
                for (c, aic) in ai.iter_mut().enumerate() {
                    *aic = _mm512_mul_ps(_mm512_loadu_ps(acc.add(i * d + 16 * c)), cr);
                }
            }
            for k in 0..nk {
                let mut vv = [_mm512_setzero_ps(); NC];
                for (c, x) in vv.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(v.add(k * kv_row + 16 * c));
                }
                for (i, ai) in a.iter_mut().enumerate() {
                    let p = _mm512_set1_ps(*st.add(k * rp + i));
                    for (c, aic) in ai.iter_mut().enumerate() {
                        *aic = _mm512_fmadd_ps(p, vv[c], *aic);
                    }
                }
            }
            for (i, ai) in a.iter().enumerate() {
                for (c, aic) in ai.iter().enumerate() {
                    _mm512_storeu_ps(acc.add(i * d + 16 * c), *aic);
                }
            }
        }
    }

    /// [`pv_block`] for rows `0..R` (pointers offset to the first row).
    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_rows<const R: usize>(
        s: *const f32,
        rp: usize,
        nk: usize,
        v: *const f32,
        kv_row: usize,
        a: *mut f32,
        d: usize,
        c: *const f32,
    ) {
        // SAFETY: the caller guarantees R rows of a (stride d), R columns
        // of nk×rp probabilities at s, R corrections and nk value rows of
        // d floats (stride kv_row) at v; columns stay below d.
        unsafe {
            let mut c0 = 0;
            while c0 + 64 <= d {
                pv_tile::<R, 4>(s, rp, nk, v.add(c0), kv_row, a.add(c0), d, c);
                c0 += 64;
            }
            while c0 + 16 <= d {
                pv_tile::<R, 1>(s, rp, nk, v.add(c0), kv_row, a.add(c0), d, c);
                c0 += 16;
            }
            for i in 0..R {
                let cr = *c.add(i);
                for col in c0..d {
                    let mut x = *a.add(i * d + col) * cr;
                    for k in 0..nk {
                        x += *s.add(k * rp + i) * *v.add(k * kv_row + col);
                    }
                    *a.add(i * d + col) = x;
                }
            }
        }
    }

    /// `acc = acc·corr + P·V` for one key block, all rows.
    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_block(
        st: &[f32],
        rp: usize,
        nk: usize,
        v: *const f32,
        kv_row: usize,
        d: usize,
        acc: &mut [f32],
        corr: &[f32],
    ) {
        assert!(st.len() >= nk * rp && acc.len() >= rp * d && corr.len() >= rp);
        let (sp, ap, cp) = (st.as_ptr(), acc.as_mut_ptr(), corr.as_ptr());
        // SAFETY: rows r0..r0+R <= rp (rp is even); the caller guarantees
        // nk value rows of d floats at v.
        unsafe {
            let mut r0 = 0;
            while r0 < rp {
                // 6 rows × 64 columns: 24 accumulators + 4 value vectors.
                if r0 + 6 <= rp {
                    pv_rows::<6>(sp.add(r0), rp, nk, v, kv_row, ap.add(r0 * d), d, cp.add(r0));
                    r0 += 6;
                } else {
                    pv_rows::<2>(sp.add(r0), rp, nk, v, kv_row, ap.add(r0 * d), d, cp.add(r0));
                    r0 += 2;
                }
            }
        }
    }

    block_steps!();

    /// One work item with AVX-512F.
    ///
    /// # Safety
    /// AVX-512F must be available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn item(
        q: &[f32],
        kc: &[f32],
        vc: &[f32],
        sh: &AttnShape,
        it: &Item,
        out: SyncPtr<f32>,
        scr: &mut [f32],
    ) {
        // SAFETY: this level's features are available (this function's contract).
        unsafe { super::drive::<Blocks>(q, kc, vc, sh, it, out, scr) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::fused::{attention_stream_scratch_len, attention_stream_with};
    use crate::kernels::testutil::{assert_close, Rng};

    const LEVELS: [Isa; 4] = Isa::ALL;

    /// Straightforward causal GQA attention in f64.
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
                        let dot: f64 = qv.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum();
                        dot / (d as f64).sqrt()
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

    /// Random q (scaled so softmax is peaked), caches with `cap` rows whose
    /// rows past P+S are NaN (must never be read).
    fn check(threads: usize, sh: AttnShape, seed: u64) {
        let pool = ThreadPool::new(threads);
        let mut rng = Rng::new(seed);
        let q: Vec<f32> = rng
            .vec(sh.s * sh.n_heads * sh.head_dim)
            .iter()
            .map(|v| v * 4.0)
            .collect();
        let kv_row = sh.n_kv_heads * sh.head_dim;
        let cap = sh.n_keys() + 5;
        let mut kc = rng.vec(cap * kv_row);
        let mut vc = rng.vec(cap * kv_row);
        kc[sh.n_keys() * kv_row..].fill(f32::NAN);
        vc[sh.n_keys() * kv_row..].fill(f32::NAN);
        let want = naive(&q, &kc, &vc, &sh);
        let mut scratch = vec![f32::NAN; attention_tiled_scratch_len(&sh, threads)];
        for level in LEVELS {
            if !level.supported() {
                eprintln!("skipping {level:?}: not available on this CPU");
                continue;
            }
            let mut out = vec![f32::NAN; q.len()];
            attention_tiled_with(&pool, level, &q, &kc, &vc, sh, &mut out, &mut scratch).unwrap();
            assert_close(&out, &want, 2e-5, 2e-4, &format!("tiled {level:?} {sh:?}"));
        }
        // The streaming kernel on the same inputs (both ISAs).
        let mut scratch = vec![f32::NAN; attention_stream_scratch_len(&sh, threads)];
        for isa in Isa::supported_levels() {
            let mut out = vec![f32::NAN; q.len()];
            attention_stream_with(&pool, isa, &q, &kc, &vc, sh, &mut out, &mut scratch).unwrap();
            assert_close(&out, &want, 2e-5, 2e-4, &format!("stream {isa:?} {sh:?}"));
        }
    }

    fn sh(s: usize, pos: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize) -> AttnShape {
        AttnShape {
            s,
            pos,
            n_heads,
            n_kv_heads,
            head_dim,
        }
    }

    #[test]
    fn prefill_smollm2_shape() {
        // SmolLM2-135M: 9 heads, 3 kv heads (group 3), head_dim 64; several
        // query blocks and key blocks, block edges off the 64-key grid.
        check(2, sh(130, 0, 9, 3, 64), 1);
        check(1, sh(17, 0, 9, 3, 64), 2);
    }

    #[test]
    fn chunk_after_history() {
        // Prefill chunks at positions inside an existing cache.
        check(2, sh(40, 100, 9, 3, 64), 3);
        check(2, sh(16, 64, 9, 3, 64), 4);
        check(1, sh(5, 63, 9, 3, 64), 5);
        check(2, sh(70, 9, 4, 4, 64), 6); // group 1
    }

    #[test]
    fn odd_head_dims_and_groups() {
        // head_dim not a multiple of 8 (scalar columns) nor of 16/64.
        check(2, sh(33, 7, 6, 2, 20), 7);
        check(1, sh(9, 2, 4, 1, 7), 8);
        check(2, sh(50, 0, 8, 2, 40), 9);
        check(2, sh(3, 200, 3, 3, 64), 10); // rows not a multiple of 8
        check(1, sh(1, 70, 9, 3, 64), 11); // single query
    }

    #[test]
    fn causal_mask_exact() {
        // Keys 0..=P+s hold value row e_t (one-hot on t), all scores equal:
        // query s must average exactly the first P+s+1 one-hot rows, so any
        // attention to a future key shows up as a nonzero column > P+s.
        let (s_n, pos, d) = (20, 3, 32);
        let shape = sh(s_n, pos, 3, 1, d);
        let t_n = pos + s_n;
        let q = vec![0.5f32; s_n * 3 * d];
        let kc = vec![1.0f32; t_n * d];
        let mut vc = vec![0.0f32; t_n * d];
        for t in 0..t_n {
            vc[t * d + t] = 1.0;
        }
        for level in LEVELS.into_iter().filter(|l| l.supported()) {
            let pool = ThreadPool::new(2);
            let mut scr = vec![0.0; attention_tiled_scratch_len(&shape, 2)];
            let mut out = vec![f32::NAN; q.len()];
            attention_tiled_with(&pool, level, &q, &kc, &vc, shape, &mut out, &mut scr).unwrap();
            for s in 0..s_n {
                for h in 0..3 {
                    let o = &out[(s * 3 + h) * d..][..d];
                    let n = (pos + s + 1) as f32;
                    for (t, &x) in o.iter().enumerate() {
                        let want = if t <= pos + s { 1.0 / n } else { 0.0 };
                        assert!(
                            (x - want).abs() < 1e-6,
                            "{level:?} s {s} h {h} t {t}: {x} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn scratch_and_shape_errors() {
        let pool = ThreadPool::new(2);
        let shape = sh(8, 2, 4, 2, 16);
        let q = vec![0.0; 8 * 4 * 16];
        let ok = vec![0.0; 10 * 2 * 16];
        let mut out = vec![0.0; q.len()];
        let mut scr = vec![0.0; attention_tiled_scratch_len(&shape, 2)];
        assert!(attention_tiled(&pool, &q, &ok, &ok, shape, &mut out, &mut scr[1..]).is_err());
        assert!(attention_tiled(&pool, &q, &ok[32..], &ok, shape, &mut out, &mut scr).is_err());
        assert!(attention_tiled(&pool, &q, &ok, &ok, shape, &mut out, &mut scr).is_ok());
    }
}
