//! Decode items of [`super::attention_paged`]: a kv head and one span of
//! a sequence with few query tokens, each key and value read once for the
//! whole GQA group, and the tile sources ([`Runs`]) the steps read: f16,
//! bf16 and f32 pools in place, block by block, widened in registers, or
//! f32 scratch.

use super::{
    carve, decode_parts, decode_rows, gather_k, gather_v, partial_len, window_start, BlockSteps,
    Ctx, Probs, BK, SPAN,
};
use crate::kernels::kv::{KvGeom, KvView, SeqSpan};
use crate::kernels::matmul::tiles::{elem_size, BF16, F16, F32};
use crate::pool::SyncPtr;
use std::ops::Range;

/// Where a tile's keys or values are read: runs of `len` keys (the last
/// one cut at the tile's end), run `i` from byte address `at[i]`; key `j`,
/// dim `e` of the tile is the element of dtype `DT` (`F32`, `F16` or
/// `BF16` of the tile kernels) at `at[j / len]` plus `(j % len)·step +
/// e·stride` elements. From the pool, the runs are the blocks (keys: step
/// 1, stride `BS`; values: step `D`, stride 1); from f32 scratch, one run
/// of [`BK`] keys (keys: stride `BK`; values: step `D`). At most
/// [`MAX_RUNS`] runs: pools of smaller blocks go through the scratch (the
/// struct is built and moved for every tile and head, so it stays small).
#[derive(Clone, Copy)]
pub(super) struct Runs {
    pub(super) at: [*const u8; MAX_RUNS],
    pub(super) len: usize,
    pub(super) step: usize,
    pub(super) stride: usize,
}

impl Runs {
    /// One run of [`BK`] f32 keys in scratch.
    pub(super) fn scratch(p: &[f32], step: usize, stride: usize) -> Runs {
        let mut at = [std::ptr::null(); MAX_RUNS];
        at[0] = p.as_ptr().cast();
        Runs {
            at,
            len: BK,
            step,
            stride,
        }
    }

    /// Keys `t0..t0+nk` of kv head `g` of a sequence, straight from the
    /// pool's bytes `pool` (dtype `DT`), in their blocks; with `index` the
    /// pool's index of an element `(block, offset, g, dim)` (keys: step
    /// 1, stride `BS`; values: step `D`, stride 1).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn pool<const DT: u8>(
        pool: &[u8],
        geom: &KvGeom,
        seq: &SeqSpan<'_>,
        t0: usize,
        nk: usize,
        base: impl Fn(usize) -> usize,
        step: usize,
        stride: usize,
    ) -> Runs {
        let (bs, es) = (geom.block, elem_size(DT));
        let span = geom.head_dim * bs * es;
        let mut at = [std::ptr::null(); MAX_RUNS];
        assert!(nk.div_ceil(bs) <= MAX_RUNS);
        for (i, a) in at.iter_mut().enumerate().take(nk.div_ceil(bs)) {
            // Tiles start at a multiple of BK, so every run at a block's
            // first key; the whole block is read (keys past `nk` too).
            let at0 = base(seq.block_of(t0 + i * bs, bs)) * es;
            *a = pool[at0..at0 + span].as_ptr();
        }
        Runs {
            at,
            len: bs,
            step,
            stride,
        }
    }

    /// The first bytes of the runs that hold `nk` keys.
    #[inline(always)]
    fn blocks(&self, nk: usize) -> &[*const u8] {
        &self.at[..nk.div_ceil(self.len)]
    }

    /// The address of key `j`, dim `e` (elements of dtype `DT`).
    #[inline(always)]
    pub(super) fn ptr<const DT: u8>(&self, j: usize, e: usize) -> *const u8 {
        let off = (j % self.len) * self.step + e * self.stride;
        self.at[j / self.len].wrapping_add(off * elem_size(DT))
    }
}

/// Block runs of a tile read in place at most: blocks of at least `BK /
/// MAX_RUNS` positions.
pub(super) const MAX_RUNS: usize = 8;

/// Bytes of a cache line, the prefetch step.
const LINE: usize = 64;
/// Steps over which the first tile of an item spreads each phase's
/// prefetches; later tiles spread them over as many steps as the phase
/// took in the tile before (the count differs by level and GQA group).
const AHEAD_STEPS: usize = 16;

/// Pool blocks prefetched a few cache lines at a time by the steps of a
/// tile phase (a call of [`Ahead::step`] per 16-dim chunk of scores and
/// per 4 keys of `P·V`), so the loads to memory overlap the arithmetic
/// instead of queueing in bursts: a decode tile's score phase prefetches
/// its value blocks, its `P·V` phase the next tile's key blocks.
pub(super) struct Ahead<'a> {
    /// The blocks' first bytes.
    blocks: &'a [*const u8],
    /// Bytes of each block.
    bytes: usize,
    /// Bytes per [`Ahead::step`] (a step stays within one block).
    chunk: usize,
    /// The next line: block `run`, byte `off`.
    run: usize,
    off: usize,
    /// Calls of [`Ahead::step`] so far.
    taken: usize,
}

impl<'a> Ahead<'a> {
    /// Nothing to prefetch.
    pub(super) fn none() -> Ahead<'a> {
        Ahead::blocks(&[], 0, 1)
    }

    /// The blocks at `blocks`, `bytes` each, spread over about `steps`
    /// steps.
    #[inline(always)]
    fn blocks(blocks: &'a [*const u8], bytes: usize, steps: usize) -> Ahead<'a> {
        let lines = (blocks.len() * bytes.div_ceil(LINE)).div_ceil(steps.max(1));
        Ahead {
            blocks,
            bytes,
            chunk: (lines * LINE).min(bytes.next_multiple_of(LINE)),
            run: 0,
            off: 0,
            taken: 0,
        }
    }

    /// Prefetches the next few lines (of one block).
    #[inline(always)]
    pub(super) fn step(&mut self) {
        self.taken += 1;
        let Some(&at) = self.blocks.get(self.run) else {
            return;
        };
        let end = self.off + self.chunk;
        #[cfg(target_arch = "x86_64")]
        for off in (self.off..end.min(self.bytes)).step_by(LINE) {
            // SAFETY: a prefetch never faults (SSE, baseline on x86-64).
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(off).cast());
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = at;
        if end >= self.bytes {
            self.run += 1;
            self.off = 0;
        } else {
            self.off = end;
        }
    }

    /// Prefetches the lines not yet prefetched; returns the calls of
    /// [`Ahead::step`] before this one.
    #[inline(always)]
    fn finish(&mut self) -> usize {
        let taken = self.taken;
        while self.run < self.blocks.len() {
            self.step();
        }
        taken
    }
}

/// One element of dtype `DT` (`F32`, `F16` or `BF16`) at `p`, as f32.
///
/// # Safety
/// `p` is readable for one element.
#[inline(always)]
pub(super) unsafe fn elem<const DT: u8>(p: *const u8) -> f32 {
    // SAFETY: the caller's contract.
    unsafe {
        match DT {
            F32 => p.cast::<f32>().read_unaligned(),
            F16 => crate::kernels::f16_to_f32(p.cast::<u16>().read_unaligned()),
            _ => crate::kernels::bf16_to_f32(p.cast::<u16>().read_unaligned()),
        }
    }
}

/// One decode item (a range of kv heads and a run of consecutive spans of
/// a sequence with few queries): each head's and span's partial result of
/// each row `(acc, m, l)` goes to its slot of `parts`. Per tile: every
/// head's scores of all its rows with the keys in lanes
/// ([`BlockSteps::rows_qk`]), each row's mask and online softmax
/// ([`BlockSteps::row_softmax`]); then every head's `P·V` of all its rows
/// at once ([`BlockSteps::pv`]; a row that sees no key of a tile gets
/// correction 1 and probabilities 0, which leave its sums as they are).
/// An f16, bf16 or f32 pool is read in place, block by block in address
/// order, half a tile ahead prefetched meanwhile ([`Ahead`]); the
/// quantized types through f32 scratch.
///
/// # Safety
/// The CPU features of `B` are available; no other thread touches the
/// item's partial slots.
#[inline(always)]
pub(super) unsafe fn drive_decode<B: BlockSteps>(it: DecodeItem<'_, '_>) {
    /// The bytes of a pool.
    fn bytes<T: Copy>(s: &[T]) -> &[u8] {
        // SAFETY: f32, f16 and bf16 are plain data without padding; the
        // bytes live as long as `s`.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
    }
    let ctx = it.0;
    let direct = ctx.geom.block.is_multiple_of(B::LANES.max(BK / MAX_RUNS));
    // SAFETY: the features of B are available (this function's contract).
    unsafe {
        match (ctx.k, ctx.v) {
            (KvView::F16(k), KvView::F16(v)) if direct => {
                decode_tiles::<B, F16>(it, Some((bytes(k), bytes(v))))
            }
            (KvView::Bf16(k), KvView::Bf16(v)) if direct => {
                decode_tiles::<B, BF16>(it, Some((bytes(k), bytes(v))))
            }
            (KvView::F32(k), KvView::F32(v)) if direct => {
                decode_tiles::<B, F32>(it, Some((bytes(k), bytes(v))))
            }
            _ => decode_tiles::<B, F32>(it, None),
        }
    }
}

/// Where a decode item's partial results go: the slot of (head `h`,
/// span `s`) of the item is `slot0 + (h - heads.start)·per_head + (s -
/// spans.start)` of `ptr`, [`partial_len`] floats each.
#[derive(Clone, Copy)]
pub(super) struct Parts {
    pub(super) ptr: SyncPtr<f32>,
    pub(super) slot0: usize,
    pub(super) per_head: usize,
}

/// The item of [`drive_decode`]: `(ctx, seq, kv heads, spans, partials,
/// scratch)`.
pub(super) type DecodeItem<'a, 'b> = (
    &'a Ctx<'b>,
    &'a SeqSpan<'b>,
    Range<usize>,
    Range<usize>,
    Parts,
    &'a mut [f32],
);

/// [`drive_decode`] with keys and values of dtype `DT` read from the
/// pool's bytes `pool` (keys, values), or, without it, widened into f32
/// scratch (`DT` is then `F32`). The item's kv heads are interleaved per
/// tile, each head with its own running sums, so each row's arithmetic is
/// as if its head ran alone. In place, a tile's scores are computed block
/// by block, every head's keys of a block before the next block (a block
/// holds every head's keys, so the reads go up through memory, which the
/// hardware prefetchers follow), then its `P·V` likewise over the value
/// blocks, split at the blocks: an element's multiply-adds stay one chain
/// in key order, its correction applied before the first block's. The
/// value blocks are prefetched during the score phase, the next tile's
/// key blocks during `P·V`, a few lines per step: read from memory in
/// head order, or with each tile's lines prefetched at once, the KV of a
/// deep cache streamed at half the rate (docs/design/paged-kv.md).
///
/// # Safety
/// The CPU features of `B` are available; `pool` holds the cache of `ctx`;
/// no other thread touches the item's partial slots.
#[inline(always)]
unsafe fn decode_tiles<B: BlockSteps, const DT: u8>(
    (ctx, seq, heads, spans, parts, scr): DecodeItem<'_, '_>,
    pool: Option<(&[u8], &[u8])>,
) {
    assert!(pool.is_some() || DT == F32);
    let geom = ctx.geom;
    let d = geom.head_dim;
    let n_rep = ctx.n_rep;
    let rows = seq.count * n_rep;
    let rmax = decode_rows(n_rep);
    let plen = partial_len(n_rep, d);
    let nh = heads.len();
    assert!(nh >= 1 && heads.end <= geom.n_kv_heads);
    let [qs_all, sr_all, acc_all, mlc_all, kt, vt, ones] = carve(scr, decode_parts(rows, d, nh));
    ones.fill(1.0);
    let c = ctx.scale();
    for (hi, g) in heads.clone().enumerate() {
        for r in 0..rows {
            let (qi, rep) = (r / n_rep, r % n_rep);
            let src = ctx.q_row(seq.first + qi, g * n_rep + rep);
            let qs = &mut qs_all[(hi * rows + r) * d..(hi * rows + r + 1) * d];
            for (o, &x) in qs.iter_mut().zip(src) {
                *o = x * c;
            }
        }
    }
    // A tile's keys, or values, of head `g` in the pool: runs of one block
    // each.
    let k_runs = |kp: &[u8], g: usize, t0: usize, nk: usize| {
        let at = |b| geom.k_index(b, 0, g, 0);
        Runs::pool::<DT>(kp, geom, seq, t0, nk, at, 1, geom.block)
    };
    let v_runs = |vp: &[u8], g: usize, t0: usize, nk: usize| {
        Runs::pool::<DT>(vp, geom, seq, t0, nk, |b| geom.v_index(b, 0, g, 0), d, 1)
    };
    // The bytes of one head's keys (or values) in a block; a block's
    // heads are consecutive, so the item's heads are `nh` times as many
    // from the first one's.
    let block_bytes = d * geom.block * elem_size(DT);
    // The last key of the item.
    let end = (spans.end * SPAN).min(seq.keys());
    // Tiles wholly below the first query's window are not read.
    let lo = window_start(ctx.window, seq.start) / BK * BK;
    // Positions per pool block; a tile read in place is walked one block
    // at a time (every head's keys of a block, then the next block), so
    // the reads go up through memory as the pool lays it out.
    let bs = geom.block;
    // Steps of each phase of the tile before (of all the item's heads):
    // scores, `P·V`.
    let (mut steps_qk, mut steps_pv) = (AHEAD_STEPS * nh, AHEAD_STEPS * nh);
    for (i, span) in spans.clone().enumerate() {
        acc_all[..nh * rows * d].fill(0.0);
        for hi in 0..nh {
            let mlc = &mut mlc_all[hi * 3 * rows..(hi + 1) * 3 * rows];
            mlc[..rows].fill(f32::NEG_INFINITY);
            mlc[rows..2 * rows].fill(0.0);
        }
        let s0 = span * SPAN;
        let s1 = (s0 + SPAN).min(seq.keys());
        let mut t0 = s0.max(lo);
        while t0 < s1 {
            let nk = BK.min(s1 - t0);
            // The tile's value blocks, prefetched while its scores are
            // computed, and the next tile's key blocks, while its `P·V`
            // runs: each phase's reads half a tile ahead of it, in the
            // order it reads them.
            let t1 = t0 + nk;
            let n1 = BK.min(end.saturating_sub(t1));
            // (The runs of the first head address whole blocks: the item's
            // heads follow it in each.)
            let (this_v, next_k) = match pool {
                Some((kp, vp)) => (
                    Some(v_runs(vp, heads.start, t0, nk)),
                    Some(k_runs(kp, heads.start, t1, n1)),
                ),
                None => (None, None),
            };
            let v_blocks = this_v.as_ref().map_or(&[][..], |r| r.blocks(nk));
            let k_blocks = next_k.as_ref().map_or(&[][..], |r| r.blocks(n1));
            let mut ahead_v = Ahead::blocks(v_blocks, nh * block_bytes, steps_qk);
            let mut ahead_k = Ahead::blocks(k_blocks, nh * block_bytes, steps_pv);
            // Scores of every head.
            match pool {
                Some((kp, _)) => {
                    for b0 in (0..nk).step_by(bs) {
                        let nb = bs.min(nk - b0);
                        for (hi, g) in heads.clone().enumerate() {
                            let kr = k_runs(kp, g, t0 + b0, nb);
                            let qs = &qs_all[hi * rows * d..(hi + 1) * rows * d];
                            let sr = &mut sr_all[hi * rows * BK + b0..(hi + 1) * rows * BK];
                            // SAFETY: the features of B are available (this
                            // function's contract); the run addresses a whole
                            // block of the pool (a checked slice).
                            unsafe { B::rows_qk::<DT>(qs, rows, &kr, nb, sr, &mut ahead_v) };
                        }
                    }
                }
                None => {
                    for (hi, g) in heads.clone().enumerate() {
                        gather_k::<B::Cvt>(ctx, seq, g, t0, nk, kt);
                        let qs = &qs_all[hi * rows * d..(hi + 1) * rows * d];
                        let sr = &mut sr_all[hi * rows * BK..(hi + 1) * rows * BK];
                        let kr = Runs::scratch(kt, 1, BK);
                        // SAFETY: as above; the scratch holds the tile.
                        unsafe { B::rows_qk::<DT>(qs, rows, &kr, nk, sr, &mut ahead_v) };
                    }
                }
            }
            // The value lines the score phase left (before they are read).
            let taken_qk = ahead_v.finish();
            // Each row's mask and online softmax.
            for hi in 0..nh {
                let sr = &mut sr_all[hi * rows * BK..(hi + 1) * rows * BK];
                let mlc = &mut mlc_all[hi * 3 * rows..(hi + 1) * 3 * rows];
                let (ml, corr) = mlc.split_at_mut(2 * rows);
                let (m, l) = ml.split_at_mut(rows);
                for r in 0..rows {
                    let limit = seq.start + r / n_rep;
                    let first = window_start(ctx.window, limit);
                    let sr = &mut sr[r * BK..(r + 1) * BK];
                    if limit < t0 || first >= t0 + nk {
                        // No key of this tile is visible: a masked tile
                        // changes nothing.
                        corr[r] = 1.0;
                        sr[..nk].fill(0.0);
                        continue;
                    }
                    // Keys after the row's position, and below its window.
                    sr[(limit + 1 - t0).min(nk)..nk].fill(f32::NEG_INFINITY);
                    sr[..first.saturating_sub(t0)].fill(f32::NEG_INFINITY);
                    // SAFETY: as above.
                    corr[r] = unsafe { B::row_softmax(sr, nk, &mut m[r], &mut l[r]) };
                }
            }
            // `P·V` of every head: in place, block by block, the
            // accumulators corrected at the first block (a correction of
            // 1 after it changes no bit).
            match pool {
                Some((_, vp)) => {
                    for b0 in (0..nk).step_by(bs) {
                        let nb = bs.min(nk - b0);
                        for (hi, g) in heads.clone().enumerate() {
                            let vr = v_runs(vp, g, t0 + b0, nb);
                            let acc = &mut acc_all[hi * rows * d..(hi + 1) * rows * d];
                            let corr = if b0 == 0 {
                                &mlc_all[hi * 3 * rows + 2 * rows..(hi + 1) * 3 * rows]
                            } else {
                                &ones[..rows]
                            };
                            let p = Probs {
                                p: &sr_all[hi * rows * BK + b0..(hi + 1) * rows * BK],
                                ks: 1,
                                rs: BK,
                                rows,
                            };
                            // SAFETY: as above.
                            unsafe { B::pv::<DT>(p, nb, &vr, acc, corr, &mut ahead_k) };
                        }
                    }
                }
                None => {
                    for (hi, g) in heads.clone().enumerate() {
                        gather_v::<B::Cvt>(ctx, seq, g, t0, nk, vt);
                        let acc = &mut acc_all[hi * rows * d..(hi + 1) * rows * d];
                        let corr = &mlc_all[hi * 3 * rows + 2 * rows..(hi + 1) * 3 * rows];
                        let p = Probs {
                            p: &sr_all[hi * rows * BK..(hi + 1) * rows * BK],
                            ks: 1,
                            rs: BK,
                            rows,
                        };
                        let vr = Runs::scratch(vt, d, 1);
                        // SAFETY: as above; the scratch holds the tile.
                        unsafe { B::pv::<DT>(p, nk, &vr, acc, corr, &mut ahead_k) };
                    }
                }
            }
            let taken_pv = ahead_k.finish();
            if n1 == BK && nk == BK {
                (steps_qk, steps_pv) = (taken_qk.max(1), taken_pv.max(1));
            }
            t0 += nk;
        }
        for hi in 0..nh {
            // SAFETY: the item alone writes its slots (this function's
            // contract); the caller sized `parts.ptr` for every slot.
            let part = unsafe {
                let slot = parts.slot0 + hi * parts.per_head + i;
                parts.ptr.slice(slot * plen, plen)
            };
            let acc = &acc_all[hi * rows * d..(hi + 1) * rows * d];
            let mlc = &mlc_all[hi * 3 * rows..(hi + 1) * 3 * rows];
            part[..rows * d].copy_from_slice(acc);
            part[rmax * d..rmax * d + rows].copy_from_slice(&mlc[..rows]);
            part[rmax * d + rmax..rmax * d + rmax + rows].copy_from_slice(&mlc[rows..2 * rows]);
        }
    }
}
