//! Fused causal GQA attention over the paged KV pool, for any mix of
//! sequences in a step, with results that do not depend on the batch.
//!
//! Each query row `(token, head)` attends its own sequence's positions
//! `0..=pos`, or with a sliding window of `w` positions only `pos+1-w..=pos`
//! ([`window_start`]). Its result is computed by one fixed sequence of operations,
//! whatever else is in the step, however the sequence's prompt was chunked
//! and however many threads run:
//!
//! * keys are walked in **tiles of [`BK`] positions aligned to absolute
//!   positions** (`0..64`, `64..128`, ...), the last one cut at the row's
//!   own position (keys after it are masked to `-inf`, which adds exact
//!   zeros); with a sliding window the walk starts at the tile holding the
//!   window's first position, keys below it masked to `-inf` the same way
//!   (a tile with no visible key leaves a row's running sums as they are,
//!   so a row's result depends only on its own position and window, never
//!   on where the walk of its item started);
//! * tiles are grouped in **spans of [`SPAN`] positions**, each span's
//!   online softmax starts fresh, and the spans' partial results are merged
//!   **in span order** with one formula ([`merge_span`]);
//! * within a tile, per row: scores as sums of 16-dim chunks, each a chain
//!   of fused multiply-adds; the online-softmax update; `P·V` as one
//!   multiply-add chain per output element over the tile's keys.
//!
//! Two kinds of work items compute exactly that:
//!
//! * **tiled items** (a sequence with at least [`TILED_MIN_S`] query tokens
//!   in the step: prefill chunks): a kv head and a block of queries, their
//!   rows in SIMD lanes (`Q·Kᵀ` and `P·V` as register-tiled small GEMMs,
//!   flash-attention style), all spans walked in order and merged in the
//!   item;
//! * **decode items** (fewer query tokens: decode steps): a group of kv
//!   heads (all of them at long depth) and a run of spans, the keys in SIMD
//!   lanes, the heads interleaved tile by tile; the spans of one sequence
//!   run in parallel (flash-decoding) and their partials are merged
//!   afterwards, in span order.
//!
//! Every instruction-set level ([`Isa`]) implements both kinds with the
//! same per-row arithmetic, and a test checks that rows computed either
//! way are bitwise equal. Tiled items read keys and values from the pool
//! (any cache type, [`KvView`]) one tile at a time into f32 scratch
//! (widened or dequantized by `super::widen`, the same values at every
//! level): keys dims-major `[D][BK]`, values key-major `[BK][D]`. Decode
//! items, which read each key once per GQA group and are bound by memory
//! bandwidth, read an f16, bf16 or f32 pool in place ([`Runs`]), widening
//! in registers, all rows of the group per key load: a tile's scores
//! block by block in address order (every head's keys of a block, then
//! the next block), then its `P·V` likewise, prefetching half a tile
//! ahead (the tile's values while its scores are computed, the next
//! tile's keys during its `P·V`); other types go through the scratch as in
//! tiled items. Widening is exact, so both ways give the same bits.

use crate::kernels::kv::{KvGeom, KvView, SeqSpan, StepSeqs};
use crate::kernels::matmul::tiles::F32;
use crate::kernels::{Isa, KernelError};
use crate::pool::{SyncPtr, ThreadPool};
use decode::{drive_decode, elem, Ahead, DecodeItem, Parts, Runs};

/// Keys per tile (aligned to absolute positions).
pub const BK: usize = 64;
/// Keys per span (aligned to absolute positions; a multiple of [`BK`]).
pub const SPAN: usize = 4 * BK;
/// Head dims per partial sum of a score (the partial sums are added).
const QK_CHUNK: usize = 16;
/// Target query rows (query tokens × heads of a group) per tiled item.
const ROWS: usize = 48;
/// Sequences with at least this many query tokens in a step run as tiled
/// items; fewer, as decode items.
pub const TILED_MIN_S: usize = 4;
/// Decode items per thread a step aims at: a decode item walks a run of
/// consecutive spans of its kv heads (prefetching across their
/// boundaries), as long as the step still has this many items per thread
/// to balance. Each item starts its first tile unprefetched, so fewer,
/// longer items stream better: 4 rather than 8 took a SmolLM2 step's
/// attention at depth 4096 on 2 threads from 2.9-3.15 to 2.7-2.75 ms
/// (docs/design/paged-kv.md).
const DECODE_ITEMS_PER_THREAD: usize = 4;

/// Query tokens per tiled item for a GQA group of `n_rep` heads.
fn block_queries(n_rep: usize) -> usize {
    (ROWS / n_rep.max(1)).max(1)
}

/// Query rows of a decode item at most.
fn decode_rows(n_rep: usize) -> usize {
    n_rep * (TILED_MIN_S - 1)
}

/// The parts of a tiled item's scratch with `rp` padded rows: qt, st,
/// acc, (m, l, corr), kt, vt, and the span totals A, L, M.
fn tiled_parts(rp: usize, d: usize) -> [usize; 9] {
    [
        d * rp,
        BK * rp,
        rp * d,
        3 * rp,
        BK * d,
        BK * d,
        rp * d,
        rp,
        rp,
    ]
}

/// The parts of a decode item's scratch with `rp` rows of each of `nh`
/// kv heads: qs, the rows' scores (`BK` each, every head's), acc, (m, l,
/// corr), kt, vt, and `rp` ones (the corrections after a tile's first
/// block).
fn decode_parts(rp: usize, d: usize, nh: usize) -> [usize; 7] {
    [
        nh * rp * d,
        nh * rp * BK,
        nh * rp * d,
        nh * 3 * rp,
        BK * d,
        BK * d,
        rp,
    ]
}

/// Floats of one decode item's partial result: accumulators, maxima, sums.
fn partial_len(n_rep: usize, d: usize) -> usize {
    decode_rows(n_rep) * (d + 2)
}

/// One unit of parallel work.
#[derive(Debug, Clone, Copy)]
enum WorkItem {
    /// Queries `q0..q1` (within the sequence) of sequence `seq`, kv head `g`.
    Tiled { seq: u32, g: u32, q0: u32, q1: u32 },
    /// Spans `span0..span1` of decode sequence `seq`, kv heads `g0..g1`;
    /// the partial result of head `g0` and span `span0` goes to slot
    /// `slot`, the other heads' `n_spans` slots apart (one per span).
    Decode {
        seq: u32,
        g0: u32,
        g1: u32,
        span0: u32,
        span1: u32,
        slot: u32,
        n_spans: u32,
    },
}

/// Scratch of [`attention_paged`], sized once for the largest step so a
/// step allocates nothing.
#[derive(Debug, Clone)]
pub struct AttnWork {
    per_thread: usize,
    scratch: Vec<f32>,
    partials: Vec<f32>,
    items: Vec<WorkItem>,
}

impl AttnWork {
    /// Scratch for steps of at most `max_tokens` tokens of `max_seqs`
    /// sequences over the pool `geom`, on `n_threads` threads.
    pub fn new(
        geom: &KvGeom,
        n_rep: usize,
        max_tokens: usize,
        max_seqs: usize,
        n_threads: usize,
    ) -> AttnWork {
        let d = geom.head_dim;
        let rp = (block_queries(n_rep).min(max_tokens.max(1)) * n_rep).next_multiple_of(16);
        let per_thread = (tiled_parts(rp, d).iter().sum::<usize>()).max(
            decode_parts(decode_rows(n_rep), d, geom.n_kv_heads)
                .iter()
                .sum(),
        );
        let max_seqs = max_seqs.max(1);
        // Decode items: per kv head, the spans of every sequence. Sequences
        // with blocks of their own have spans adding up to at most the
        // pool's plus one per sequence; sequences that share prompt blocks
        // can go past that, and `partials` and `items` then grow once, at
        // the first such step, and keep that size.
        let decode_items = geom.n_kv_heads * (geom.capacity().div_ceil(SPAN) + max_seqs);
        let tiled_items = geom.n_kv_heads * (max_tokens.div_ceil(block_queries(n_rep)) + max_seqs);
        AttnWork {
            per_thread,
            scratch: vec![0.0; per_thread * n_threads.max(1)],
            partials: vec![0.0; decode_items * partial_len(n_rep, d)],
            items: Vec::with_capacity(decode_items + tiled_items),
        }
    }
}

/// The first position a query at `pos` sees: 0, or with a sliding window
/// of `w` positions `pos + 1 - w` (its own position included).
#[inline]
pub fn window_start(window: Option<usize>, pos: usize) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

/// Fused attention of a step: `q` `[S, H, D]` (the step's tokens, each
/// sequence's contiguous), `out` the same shape; `k`, `v` one layer's pool;
/// with a sliding `window` a query at `p` reads only positions `t > p -
/// window` (the tiles below the window are not read).
#[allow(clippy::too_many_arguments)]
pub fn attention_paged(
    pool: &ThreadPool,
    isa: Isa,
    q: &[f32],
    k: KvView<'_>,
    v: KvView<'_>,
    geom: &KvGeom,
    n_rep: usize,
    window: Option<usize>,
    seqs: &StepSeqs<'_>,
    out: &mut [f32],
    work: &mut AttnWork,
) -> Result<(), KernelError> {
    const OP: &str = "attention";
    let (d, hkv) = (geom.head_dim, geom.n_kv_heads);
    let h = hkv * n_rep;
    if window == Some(0) {
        return Err(KernelError::Invalid {
            op: OP,
            what: "a sliding window must hold at least one position",
        });
    }
    if n_rep == 0 || d == 0 || hkv == 0 || geom.block == 0 || !BK.is_multiple_of(geom.block) {
        return Err(KernelError::Invalid {
            op: OP,
            what: "need n_rep, head_dim, kv heads > 0 and a block size dividing 64",
        });
    }
    let s_total: usize = seqs.iter().map(|s| s.count).sum();
    super::super::check_len(OP, "q elements (S*H*D)", s_total * h * d, q.len())?;
    super::super::check_len(OP, "out elements (S*H*D)", q.len(), out.len())?;
    for (what, c) in [("k cache elements", k.len()), ("v cache elements", v.len())] {
        super::super::check_len(OP, what, geom.elems(), c)?;
    }
    let need = work.per_thread * pool.n_threads().max(1);
    if work.scratch.len() < need {
        work.scratch.resize(need, 0.0);
    }
    // Work items: tiled ones first, largest (most keys) first, then the
    // decode spans. The order only balances the threads; no result depends
    // on it.
    let bq = block_queries(n_rep);
    let plen = partial_len(n_rep, d);
    work.items.clear();
    for (j, s) in seqs.iter().enumerate() {
        if s.count < TILED_MIN_S {
            continue;
        }
        let n_qb = s.count.div_ceil(bq);
        for qb in (0..n_qb).rev() {
            for g in 0..hkv {
                work.items.push(WorkItem::Tiled {
                    seq: j as u32,
                    g: g as u32,
                    q0: (qb * bq) as u32,
                    q1: ((qb + 1) * bq).min(s.count) as u32,
                });
            }
        }
    }
    // Decode items: per sequence, its kv heads cut into groups and its
    // spans into runs of consecutive spans. An item walks its spans tile by
    // tile, every head of its group in turn (so it reads each block's bytes
    // in address order); the groups are all heads when the spans alone give
    // enough items for the threads, fewer heads only when they do not
    // (short sequences). Partial slots: per sequence, kv head-major, then
    // span.
    let decode_spans = |s: &SeqSpan<'_>| {
        // Spans wholly below the first query's window are not visited.
        let first = window_start(window, s.start) / SPAN;
        (first, s.keys().div_ceil(SPAN) - first)
    };
    let spans_total: usize = seqs
        .iter()
        .filter(|s| s.count < TILED_MIN_S)
        .map(|s| decode_spans(&s).1)
        .sum();
    let target = DECODE_ITEMS_PER_THREAD * pool.n_threads().max(1);
    let heads_per = if pool.n_threads() <= 1 {
        hkv
    } else {
        (hkv * spans_total / target).clamp(1, hkv)
    };
    let n_groups = hkv.div_ceil(heads_per);
    let per_item = (spans_total * n_groups / target).max(1);
    let mut slots = 0usize;
    for (j, s) in seqs.iter().enumerate() {
        if s.count >= TILED_MIN_S {
            continue;
        }
        let (first, n_spans) = decode_spans(&s);
        let n_items = n_spans.div_ceil(per_item);
        for gi in 0..n_groups {
            let (g0, g1) = (gi * heads_per, ((gi + 1) * heads_per).min(hkv));
            for i in 0..n_items {
                let (a, b) = (i * n_spans / n_items, (i + 1) * n_spans / n_items);
                work.items.push(WorkItem::Decode {
                    seq: j as u32,
                    g0: g0 as u32,
                    g1: g1 as u32,
                    span0: (first + a) as u32,
                    span1: (first + b) as u32,
                    slot: (slots + g0 * n_spans + a) as u32,
                    n_spans: n_spans as u32,
                });
            }
        }
        slots += n_spans * hkv;
    }
    if work.partials.len() < slots * plen {
        work.partials.resize(slots * plen, 0.0);
    }
    let level = Level::of(isa);
    let per = work.per_thread;
    let sp = SyncPtr::new(&mut work.scratch);
    let pp = SyncPtr::new(&mut work.partials);
    let op = SyncPtr::new(out);
    let items = &work.items;
    let ctx = Ctx {
        q,
        k,
        v,
        geom,
        n_rep,
        h,
        window,
    };
    pool.run_indexed(items.len(), &|c, tid| {
        // SAFETY: thread `tid` is the only user of its scratch slice during
        // this job (pool contract); `per * n_threads` fits in scratch.
        let scr = unsafe { sp.slice(tid * per, per) };
        match items[c] {
            WorkItem::Tiled { seq, g, q0, q1 } => {
                let it = Item::new(
                    &ctx,
                    seqs.get(seq as usize),
                    g as usize,
                    q0 as usize,
                    q1 as usize,
                );
                level.tiled(&ctx, &it, op, scr);
            }
            WorkItem::Decode {
                seq,
                g0,
                g1,
                span0,
                span1,
                slot,
                n_spans,
            } => {
                let spans = span0 as usize..span1 as usize;
                let parts = Parts {
                    ptr: pp,
                    slot0: slot as usize,
                    per_head: n_spans as usize,
                };
                let s = seqs.get(seq as usize);
                // SAFETY: item c alone writes the partial slots of its heads
                // and spans (within the `slots · plen` floats of
                // `partials`).
                unsafe { level.decode((&ctx, &s, g0 as usize..g1 as usize, spans, parts, scr)) };
            }
        }
    });
    // Decode sequences: merge each row's span partials in span order.
    let mut slot = 0usize;
    for s in seqs.iter() {
        if s.count >= TILED_MIN_S {
            continue;
        }
        let n_spans = decode_spans(&s).1;
        let rows = s.count * n_rep;
        let rmax = decode_rows(n_rep);
        for g in 0..hkv {
            for r in 0..rows {
                let (qi, rep) = (r / n_rep, r % n_rep);
                let o = &mut out[((s.first + qi) * h + g * n_rep + rep) * d..][..d];
                let (mut mm, mut ll) = (f32::NEG_INFINITY, 0f32);
                for span in 0..n_spans {
                    let p = &work.partials[(slot + g * n_spans + span) * plen..][..plen];
                    let (a, m, l) = (
                        &p[r * d..(r + 1) * d],
                        p[rmax * d + r],
                        p[rmax * d + rmax + r],
                    );
                    merge_span(&mut mm, &mut ll, o, m, l, a);
                }
                let inv = 1.0 / ll;
                o.iter_mut().for_each(|x| *x *= inv);
            }
        }
        slot += n_spans * hkv;
    }
    Ok(())
}

/// Folds one span's partial result `(m, l, a)` of a row into its running
/// total `(mm, ll, aa)`, in f32, the same in every kernel: the first span
/// with any key is taken as it is; a span without visible keys (`m = -inf`,
/// or `l = 0` when its keys were all masked) changes nothing; otherwise
/// both are rescaled to the common maximum and added.
#[inline]
pub fn merge_span(mm: &mut f32, ll: &mut f32, aa: &mut [f32], m: f32, l: f32, a: &[f32]) {
    if m == f32::NEG_INFINITY || l == 0.0 {
        return;
    }
    if *mm == f32::NEG_INFINITY {
        *mm = m;
        *ll = l;
        aa.copy_from_slice(a);
        return;
    }
    let mx = mm.max(m);
    let (wa, wb) = ((*mm - mx).exp(), (m - mx).exp());
    *ll = *ll * wa + l * wb;
    for (x, &y) in aa.iter_mut().zip(a) {
        *x = *x * wa + y * wb;
    }
    *mm = mx;
}

/// What every item reads.
struct Ctx<'a> {
    q: &'a [f32],
    k: KvView<'a>,
    v: KvView<'a>,
    geom: &'a KvGeom,
    n_rep: usize,
    /// Query heads.
    h: usize,
    /// The sliding window, if any.
    window: Option<usize>,
}

impl Ctx<'_> {
    /// `1/sqrt(D)`, which query rows are multiplied by once.
    fn scale(&self) -> f32 {
        super::scale(self.geom.head_dim)
    }
    /// Query row `(token row, head)`.
    fn q_row(&self, row: usize, head: usize) -> &[f32] {
        let d = self.geom.head_dim;
        &self.q[(row * self.h + head) * d..][..d]
    }
}

/// Geometry of one tiled item.
struct Item<'a> {
    seq: SeqSpan<'a>,
    g: usize,
    /// First query (within the sequence) of the item.
    q0: usize,
    n_rep: usize,
    /// Real rows (`(q1 - q0) · n_rep`), query-major (`r = qi·n_rep + rep`).
    rows: usize,
    /// Rows padded to a multiple of 16 (one AVX-512 vector).
    rp: usize,
    /// Keys `<= t_diag` are visible to every row of the item.
    t_diag: usize,
    /// One past the last key of the item.
    t_end: usize,
    /// The first query's first visible key (the earliest of the item).
    lo: usize,
    /// The sliding window, if any.
    window: Option<usize>,
}

impl<'a> Item<'a> {
    fn new(ctx: &Ctx<'_>, seq: SeqSpan<'a>, g: usize, q0: usize, q1: usize) -> Self {
        let rows = (q1 - q0) * ctx.n_rep;
        Item {
            seq,
            g,
            q0,
            n_rep: ctx.n_rep,
            rows,
            rp: rows.next_multiple_of(16),
            t_diag: seq.start + q0,
            t_end: seq.start + q1,
            lo: window_start(ctx.window, seq.start + q0),
            window: ctx.window,
        }
    }
}

/// The runs `(j, b, i0, n)` of keys `t0..t0+nk` of a sequence, in order:
/// keys `t0+j..t0+j+n` lie in pool block `b` from offset `i0`. (An
/// iterator, so the callers' loop bodies stay in the callers, compiled
/// with their CPU features.)
#[inline(always)]
fn block_runs<'a>(
    seq: &'a SeqSpan<'_>,
    bs: usize,
    t0: usize,
    nk: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> + 'a {
    let mut j = 0;
    std::iter::from_fn(move || {
        (j < nk).then(|| {
            let p = t0 + j;
            let (b, i0) = (seq.block_of(p, bs), p % bs);
            let n = (bs - i0).min(nk - j);
            j += n;
            (j - n, b, i0, n)
        })
    })
}

/// Copies keys `t0..t0+nk` of kv head `g` of a sequence into `kt` as f32,
/// dims-major (`kt[e·BK + j]`), one block run at a time.
#[inline(always)]
fn gather_k<C: Cvt>(
    ctx: &Ctx<'_>,
    seq: &SeqSpan<'_>,
    g: usize,
    t0: usize,
    nk: usize,
    kt: &mut [f32],
) {
    let geom = ctx.geom;
    for (j, b, i0, n) in block_runs(seq, geom.block, t0, nk) {
        for e in 0..geom.head_dim {
            let src = geom.k_index(b, i0, g, e);
            C::cvt(ctx.k, src, &mut kt[e * BK + j..e * BK + j + n]);
        }
    }
}

/// Copies values `t0..t0+nk` of kv head `g` into `vt` as f32, key-major
/// (`vt[j·D + e]`).
#[inline(always)]
fn gather_v<C: Cvt>(
    ctx: &Ctx<'_>,
    seq: &SeqSpan<'_>,
    g: usize,
    t0: usize,
    nk: usize,
    vt: &mut [f32],
) {
    let (geom, d) = (ctx.geom, ctx.geom.head_dim);
    for (j, b, i0, n) in block_runs(seq, geom.block, t0, nk) {
        let src = geom.v_index(b, i0, g, 0);
        C::cvt(ctx.v, src, &mut vt[j * d..(j + n) * d]);
    }
}

/// Widening of a run of cached values to f32 (exact).
trait Cvt {
    fn cvt(src: KvView<'_>, at: usize, dst: &mut [f32]);
}

struct PortableCvt;

impl Cvt for PortableCvt {
    #[inline(always)]
    fn cvt(src: KvView<'_>, at: usize, dst: &mut [f32]) {
        super::widen::widen_portable(src, at, dst)
    }
}

/// Packs the item's query rows transposed and scaled by `1/sqrt(D)`
/// (`qt[e·rp + r]`; padding rows are zero).
fn pack_q(ctx: &Ctx<'_>, it: &Item<'_>, qt: &mut [f32]) {
    let d = ctx.geom.head_dim;
    let c = ctx.scale();
    for r in 0..it.rp {
        if r < it.rows {
            let (qi, rep) = (r / it.n_rep, r % it.n_rep);
            let src = ctx.q_row(it.seq.first + it.q0 + qi, it.g * it.n_rep + rep);
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

/// Sets masked scores of tile `t0..t0+nk` to `-inf`: row `r` (query
/// `r / n_rep`) sees keys `<= t_diag + r / n_rep`. Padding rows stay.
fn mask_block(st: &mut [f32], it: &Item<'_>, t0: usize, nk: usize) {
    for k in 0..nk {
        let t = t0 + k;
        if t <= it.t_diag {
            continue;
        }
        let first_visible = ((t - it.t_diag) * it.n_rep).min(it.rows);
        st[k * it.rp..k * it.rp + first_visible].fill(f32::NEG_INFINITY);
    }
}

/// Sets the scores of tile `t0..t0+nk` below each row's sliding window to
/// `-inf`: row `r` (query at `t_diag + r / n_rep`) sees keys `>= t_diag + r
/// / n_rep + 1 - window`. Padding rows stay.
fn mask_below_window(st: &mut [f32], it: &Item<'_>, w: usize, t0: usize, nk: usize) {
    for k in 0..nk {
        // Key t is below the window of queries at positions >= t + w.
        let first_masked = ((t0 + k + w).saturating_sub(it.t_diag) * it.n_rep).min(it.rows);
        st[k * it.rp + first_masked..k * it.rp + it.rows].fill(f32::NEG_INFINITY);
    }
}

/// The per-tile steps of a level. Scores come out key-major (`st[k·rp +
/// r]`, one lane per row); every per-row result must not depend on the
/// other rows, `rp` or `nk` beyond the row's own keys. `qt` holds `D·rp`
/// floats and `acc` `rp·D`, which gives `D`.
///
/// # Safety
/// Every step may use the level's CPU features: the caller makes sure they
/// are available. [`Runs`] arguments address readable elements for every
/// key `< nk` of every dim (a key run's whole block may be read).
trait BlockSteps {
    type Cvt: Cvt;
    /// Keys per vector: a tile read straight from the pool needs blocks
    /// of a multiple of it.
    const LANES: usize;
    /// Scores of `nk` keys (`kt[e·BK + j]`) for all `rp` rows of `qt`.
    unsafe fn qk(qt: &[f32], rp: usize, kt: &[f32], nk: usize, st: &mut [f32]);
    /// Online softmax update of one tile; `mlc` is the rows' maxima, sums
    /// and (out) corrections, `rp` each.
    unsafe fn softmax(st: &mut [f32], rp: usize, nk: usize, mlc: &mut [f32]);
    /// `acc = acc·corr + P·V` for one tile, values of dtype `DT` in `v`;
    /// steps `ahead` now and then.
    unsafe fn pv<const DT: u8>(
        p: Probs<'_>,
        nk: usize,
        v: &Runs,
        acc: &mut [f32],
        corr: &[f32],
        ahead: &mut Ahead<'_>,
    );
    /// Scores of `nk` keys of dtype `DT` in `k` for each of the `rows`
    /// rows of `qs` (row-major), the same arithmetic as [`Self::qk`]
    /// gives a row, to `sr[r·BK + j]` (lanes from `nk` up to a whole
    /// vector hold scores of other keys, which nothing reads; `sr` may
    /// start at a block within the tile's rows, so it holds `(rows - 1)·BK`
    /// plus `nk` rounded up to a vector); steps `ahead` now and then.
    unsafe fn rows_qk<const DT: u8>(
        qs: &[f32],
        rows: usize,
        k: &Runs,
        nk: usize,
        sr: &mut [f32],
        ahead: &mut Ahead<'_>,
    );
    /// One row's online softmax update, as [`Self::softmax`] gives it;
    /// returns the correction of the old accumulators.
    unsafe fn row_softmax(st: &mut [f32], nk: usize, m: &mut f32, l: &mut f32) -> f32;
}

/// A tile's probabilities for `rows` rows: key `k`, row `r` at `p[k·ks +
/// r·rs]` (tiled items: key-major, decode items: row-major).
#[derive(Clone, Copy)]
struct Probs<'a> {
    p: &'a [f32],
    ks: usize,
    rs: usize,
    rows: usize,
}

/// Splits scratch into consecutive slices of the given lengths.
fn carve<const N: usize>(mut scr: &mut [f32], lens: [usize; N]) -> [&mut [f32]; N] {
    lens.map(|n| {
        let (part, rest) = std::mem::take(&mut scr).split_at_mut(n);
        scr = rest;
        part
    })
}

/// One tiled item with the steps of level `B`; inlined into each level's
/// entry point.
///
/// # Safety
/// The CPU features of `B` are available.
#[inline(always)]
unsafe fn drive_tiled<B: BlockSteps>(
    ctx: &Ctx<'_>,
    it: &Item<'_>,
    out: SyncPtr<f32>,
    scr: &mut [f32],
) {
    let d = ctx.geom.head_dim;
    let rp = it.rp;
    let [qt, st, acc, mlc, kt, vt, aa, ll, mm] = carve(scr, tiled_parts(rp, d));
    pack_q(ctx, it, qt);
    let multi_span = it.t_end > SPAN;
    mm.fill(f32::NEG_INFINITY);
    // Spans and tiles wholly below every row's window are skipped; the
    // rest stay aligned to absolute positions.
    let mut s0 = it.lo / SPAN * SPAN;
    // The last row's window start: tiles from here on need no lower mask.
    let lo_last = it.window.map_or(0, |w| it.t_end.saturating_sub(w));
    while s0 < it.t_end {
        let s1 = (s0 + SPAN).min(it.t_end);
        acc.fill(0.0);
        mlc[..rp].fill(f32::NEG_INFINITY);
        mlc[rp..2 * rp].fill(0.0);
        let mut t0 = s0.max(it.lo / BK * BK);
        while t0 < s1 {
            let nk = BK.min(s1 - t0);
            gather_k::<B::Cvt>(ctx, &it.seq, it.g, t0, nk, kt);
            gather_v::<B::Cvt>(ctx, &it.seq, it.g, t0, nk, vt);
            // SAFETY: the features of B are available (this function's contract).
            unsafe { B::qk(qt, rp, kt, nk, st) };
            if t0 + nk - 1 > it.t_diag {
                mask_block(st, it, t0, nk);
            }
            if let Some(w) = it.window.filter(|_| t0 < lo_last) {
                mask_below_window(st, it, w, t0, nk);
            }
            // SAFETY: as above.
            unsafe {
                B::softmax(st, rp, nk, mlc);
                let v = Runs::scratch(vt, d, 1);
                let p = Probs {
                    p: st,
                    ks: rp,
                    rs: 1,
                    rows: rp,
                };
                B::pv::<F32>(p, nk, &v, acc, &mlc[2 * rp..], &mut Ahead::none());
            }
            t0 += nk;
        }
        if multi_span {
            for r in 0..it.rows {
                let a = &acc[r * d..(r + 1) * d];
                let aa = &mut aa[r * d..(r + 1) * d];
                merge_span(&mut mm[r], &mut ll[r], aa, mlc[r], mlc[rp + r], a);
            }
        }
        s0 = s1;
    }
    let (acc, l) = if multi_span {
        (&*aa, &*ll)
    } else {
        (&*acc, &mlc[rp..])
    };
    for r in 0..it.rows {
        let (qi, rep) = (r / it.n_rep, r % it.n_rep);
        let h = it.g * it.n_rep + rep;
        let start = ((it.seq.first + it.q0 + qi) * ctx.h + h) * d;
        // SAFETY: (token, h) belongs to this work item only; in bounds
        // (q and out have S·H·D elements, checked by the caller).
        let o = unsafe { out.slice(start, d) };
        let inv = 1.0 / l[r];
        for (oi, &a) in o.iter_mut().zip(&acc[r * d..(r + 1) * d]) {
            *oi = a * inv;
        }
    }
}

/// The kernel set in use, lowered to what the CPU supports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    Scalar,
    Avx2,
    Avx512,
}

impl Level {
    fn of(isa: Isa) -> Self {
        match isa.min(Isa::detect()) {
            Isa::Scalar => Self::Scalar,
            Isa::Avx2 => Self::Avx2,
            Isa::Avx512 | Isa::Avx512Vnni => Self::Avx512,
        }
    }

    fn tiled(self, ctx: &Ctx<'_>, it: &Item<'_>, out: SyncPtr<f32>, scr: &mut [f32]) {
        match self {
            // SAFETY: the portable steps need no CPU feature.
            Level::Scalar => unsafe { drive_tiled::<Portable>(ctx, it, out, scr) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2, FMA and F16C were detected (`Level::of`).
            Level::Avx2 => unsafe { simd::tiled_avx2(ctx, it, out, scr) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F, AVX2, FMA and F16C were detected.
            Level::Avx512 => unsafe { simd::tiled_avx512(ctx, it, out, scr) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("Level::of gives Scalar off x86-64"),
        }
    }

    /// # Safety
    /// No other thread touches the item's partial slots.
    unsafe fn decode(self, it: DecodeItem<'_, '_>) {
        match self {
            // SAFETY: the portable steps need no CPU feature; the slots
            // are the item's (this function's contract).
            Level::Scalar => unsafe { drive_decode::<Portable>(it) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `tiled`, and the slots as above.
            Level::Avx2 => unsafe { simd::decode_avx2(it) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `tiled`, and the slots as above.
            Level::Avx512 => unsafe { simd::decode_avx512(it) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("Level::of gives Scalar off x86-64"),
        }
    }
}

/// The scalar reference level: per row, the arithmetic of its tile steps.
struct Portable;

impl BlockSteps for Portable {
    type Cvt = PortableCvt;
    const LANES: usize = 1;

    unsafe fn qk(qt: &[f32], rp: usize, kt: &[f32], nk: usize, st: &mut [f32]) {
        let d = qt.len() / rp;
        for k in 0..nk {
            for r in 0..rp {
                let mut tot = 0f32;
                for e0 in (0..d).step_by(QK_CHUNK) {
                    let mut part = 0f32;
                    for e in e0..d.min(e0 + QK_CHUNK) {
                        part += kt[e * BK + k] * qt[e * rp + r];
                    }
                    tot += part;
                }
                st[k * rp + r] = tot;
            }
        }
    }

    unsafe fn softmax(st: &mut [f32], rp: usize, nk: usize, mlc: &mut [f32]) {
        let (m, rest) = mlc.split_at_mut(rp);
        let (l, corr) = rest.split_at_mut(rp);
        for r in 0..rp {
            let mx = (0..nk).fold(f32::NEG_INFINITY, |a, k| a.max(st[k * rp + r]));
            // A row with no visible key yet (all `-inf`, below its sliding
            // window) keeps a finite maximum: zeros, not NaN.
            let m_new = m[r].max(mx).max(f32::MIN);
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
    }

    unsafe fn pv<const DT: u8>(
        p: Probs<'_>,
        nk: usize,
        v: &Runs,
        acc: &mut [f32],
        corr: &[f32],
        _: &mut Ahead<'_>,
    ) {
        let d = acc.len() / p.rows;
        for (r, a) in acc.chunks_exact_mut(d).enumerate() {
            a.iter_mut().for_each(|x| *x *= corr[r]);
            for k in 0..nk {
                let p = p.p[k * p.ks + r * p.rs];
                for (e, x) in a.iter_mut().enumerate() {
                    // SAFETY: key k < nk, dim e < D of the runs (contract).
                    *x += p * unsafe { elem::<DT>(v.ptr::<DT>(k, e)) };
                }
            }
        }
    }

    unsafe fn rows_qk<const DT: u8>(
        qs: &[f32],
        rows: usize,
        k: &Runs,
        nk: usize,
        sr: &mut [f32],
        _: &mut Ahead<'_>,
    ) {
        let d = qs.len() / rows;
        for r in 0..rows {
            for j in 0..nk {
                let mut tot = 0f32;
                for e0 in (0..d).step_by(QK_CHUNK) {
                    let mut part = 0f32;
                    for e in e0..d.min(e0 + QK_CHUNK) {
                        // SAFETY: key j < nk, dim e < D of the runs (contract).
                        part += unsafe { elem::<DT>(k.ptr::<DT>(j, e)) } * qs[r * d + e];
                    }
                    tot += part;
                }
                sr[r * BK + j] = tot;
            }
        }
    }

    unsafe fn row_softmax(st: &mut [f32], nk: usize, m: &mut f32, l: &mut f32) -> f32 {
        let mut mlc = [*m, *l, 0.0];
        // SAFETY: no CPU feature needed.
        unsafe { Self::softmax(st, 1, nk, &mut mlc) };
        (*m, *l) = (mlc[0], mlc[1]);
        mlc[2]
    }
}

/// Decode items, and the reading of a tile in place.
mod decode;
/// The SIMD levels' block steps, written once over `F32Vec`.
#[cfg(target_arch = "x86_64")]
mod simd;
