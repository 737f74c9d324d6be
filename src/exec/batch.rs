//! What one step runs on: the [`Batch`] of tokens of one or more
//! sequences, and the [`KvPool`] that hands out the KV blocks those
//! sequences' positions live in.
//!
//! The executor is given a batch per step; it derives each token's
//! position and KV slot from the batch's sequence table, checks it against
//! the pool, and binds the graph's step inputs (`tokens`, `positions`,
//! `kv.slots`, `kv.seqs`, `kv.blocks`) to it.
//!
//! A batch may also list **block copies**: before any of the step's tokens
//! is computed, the executor copies each listed KV block, every layer's
//! keys and values, onto another block. The scheduler uses this to give a
//! new sequence the positions it shares with an older one inside a block
//! that is not whole: the older sequence's block is copied into the new
//! one's own, and the new sequence is fed from its first position past the
//! shared tokens. Positions past those in the copy are stale; the new
//! sequence writes them before anything reads them. Every pipeline stage
//! applies the same copies to its own layers.

use crate::ir::SEQ_TABLE_COLS;

/// The tokens of one step, grouped by sequence.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    tokens: Vec<i32>,
    /// `[N, 5]`: first token, token count, start position, block-list
    /// offset, logit rows.
    seqs: Vec<i32>,
    blocks: Vec<i32>,
    /// `[C, 2]`: source block, destination block.
    copies: Vec<i32>,
    /// The window layers' block table, laid out as `blocks` (empty unless
    /// the model's window layers keep a ring: [`Batch::push_ring`]).
    window_blocks: Vec<i32>,
}

impl Batch {
    /// An empty batch whose buffers hold `max_tokens` tokens of `max_seqs`
    /// sequences over at most `max_blocks` blocks without growing.
    pub fn with_capacity(max_tokens: usize, max_seqs: usize, max_blocks: usize) -> Self {
        Batch {
            tokens: Vec::with_capacity(max_tokens),
            seqs: Vec::with_capacity(max_seqs * SEQ_TABLE_COLS),
            blocks: Vec::with_capacity(max_blocks),
            copies: Vec::with_capacity(2 * max_seqs),
            window_blocks: Vec::new(),
        }
    }

    /// A batch from its four tables, as [`Batch::tokens`],
    /// [`Batch::seq_table`], [`Batch::block_table`] and
    /// [`Batch::copy_table`] give them (a pipeline stage receives them from
    /// the previous one). The executor checks a batch before running it.
    pub fn from_parts(
        tokens: Vec<i32>,
        seqs: Vec<i32>,
        blocks: Vec<i32>,
        copies: Vec<i32>,
    ) -> Self {
        Batch {
            tokens,
            seqs,
            blocks,
            copies,
            window_blocks: Vec::new(),
        }
    }

    /// The batch with the window layers' block table `window` (as
    /// [`Batch::window_block_table`] gives it; a pipeline stage receives it
    /// from the previous one).
    pub fn with_window_table(mut self, window: Vec<i32>) -> Self {
        self.window_blocks = window;
        self
    }

    /// Empties the batch (keeps its buffers).
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.seqs.clear();
        self.blocks.clear();
        self.copies.clear();
        self.window_blocks.clear();
    }

    /// Copies KV block `src` onto block `dst` (every layer's keys and
    /// values) before the step's tokens are computed; copies apply in the
    /// order they were added.
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let clamp = |b: u32| i32::try_from(b).unwrap_or(i32::MAX);
        self.copies.extend([clamp(src), clamp(dst)]);
    }

    /// Adds the tokens of one sequence at positions `start..start +
    /// tokens.len()`; `blocks` are the sequence's KV blocks in position
    /// order (its block `i` holds positions `i·BS..(i+1)·BS`). An empty
    /// `tokens` adds nothing. The step gives logits for its last token
    /// (where the graph reads only the last rows).
    pub fn push(&mut self, tokens: &[u32], start: usize, blocks: &[u32]) {
        self.push_rows(tokens, start, blocks, 1);
    }

    /// [`Batch::push`] asking logits for the sequence's last `rows` tokens
    /// (clamped to 1..=`tokens.len()`): a sequence verifying `k` drafted
    /// tokens feeds `k + 1` tokens and asks for `k + 1` rows.
    pub fn push_rows(&mut self, tokens: &[u32], start: usize, blocks: &[u32], rows: usize) {
        self.push_ring(tokens, start, blocks, &[], rows);
    }

    /// [`Batch::push_rows`] for a model whose window layers keep only their
    /// window: `ring` is the sequence's ring of blocks in the window layers'
    /// pool, and position `p` of those layers lives in ring block
    /// `(p / BS) mod ring.len()` (an empty ring adds no window entries).
    pub fn push_ring(
        &mut self,
        tokens: &[u32],
        start: usize,
        blocks: &[u32],
        ring: &[u32],
        rows: usize,
    ) {
        if tokens.is_empty() {
            return;
        }
        if !ring.is_empty() {
            // The window table keeps the block table's offsets: pad a
            // sequence pushed without a ring before this one.
            let pad = self.blocks.len().saturating_sub(self.window_blocks.len());
            self.window_blocks.extend(std::iter::repeat_n(-1, pad));
            self.window_blocks.extend(
                (0..blocks.len()).map(|i| i32::try_from(ring[i % ring.len()]).unwrap_or(i32::MAX)),
            );
        }
        let clamp = |x: usize| i32::try_from(x).unwrap_or(i32::MAX);
        self.seqs.extend([
            clamp(self.tokens.len()),
            clamp(tokens.len()),
            clamp(start),
            clamp(self.blocks.len()),
            clamp(rows.clamp(1, tokens.len())),
        ]);
        self.tokens
            .extend(tokens.iter().map(|&t| i32::try_from(t).unwrap_or(i32::MAX)));
        self.blocks
            .extend(blocks.iter().map(|&b| i32::try_from(b).unwrap_or(i32::MAX)));
    }

    /// Tokens in the step (`S`).
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }
    /// Sequences in the step (`N`).
    pub fn n_seqs(&self) -> usize {
        self.seqs.len() / SEQ_TABLE_COLS
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    pub fn tokens(&self) -> &[i32] {
        &self.tokens
    }
    /// The sequence table, `N` rows of (first token, count, start, block
    /// offset, logit rows).
    pub fn seq_table(&self) -> &[i32] {
        &self.seqs
    }
    /// Where sequence `j`'s logits are among the rows of a step that reads
    /// only the last rows (`LogitRows::Last`/`Tail`): rows `range`, its
    /// last tokens in position order.
    pub fn logit_rows_of(&self, j: usize) -> std::ops::Range<usize> {
        let rows = |i: usize| self.seqs[SEQ_TABLE_COLS * i + 4].max(0) as usize;
        let start: usize = (0..j).map(rows).sum();
        start..start + rows(j)
    }
    /// Logit rows of the step (`R`), over every sequence.
    pub fn n_logit_rows(&self) -> usize {
        self.seqs
            .chunks_exact(SEQ_TABLE_COLS)
            .map(|r| r[4].max(0) as usize)
            .sum()
    }
    pub fn block_table(&self) -> &[i32] {
        &self.blocks
    }
    /// The window layers' block table: entry `i` of a sequence's list (at
    /// its block-table offset) is the ring block holding its positions
    /// `i·BS..(i+1)·BS` in those layers; empty without rings.
    pub fn window_block_table(&self) -> &[i32] {
        &self.window_blocks
    }
    /// The block copies, `C` rows of (source, destination).
    pub fn copy_table(&self) -> &[i32] {
        &self.copies
    }
}

/// The KV pool's block allocator: every layer's cache has the same `NB`
/// blocks of `BS` positions, and a sequence owns a list of block ids.
///
/// A block may be in several lists at once ([`KvPool::share`]): sequences
/// with a common prompt prefix read the same blocks for it. Every list
/// holding a block counts as one reference; the block is free again when
/// the last one lets it go. Only blocks whose positions are all written
/// are shared, so no sequence ever writes into a block another one reads.
#[derive(Debug, Clone)]
pub struct KvPool {
    block: usize,
    total: usize,
    /// Free block ids, taken from the end (the lowest ids first).
    free: Vec<u32>,
    /// Block lists holding each block (0 for a free block).
    refs: Vec<u32>,
}

impl KvPool {
    /// A pool of `n_blocks` blocks of `block` positions, all free.
    pub fn new(n_blocks: usize, block: usize) -> Self {
        KvPool {
            block: block.max(1),
            total: n_blocks,
            free: (0..n_blocks as u32).rev().collect(),
            refs: vec![0; n_blocks],
        }
    }
    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block
    }
    pub fn total_blocks(&self) -> usize {
        self.total
    }
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }
    /// Positions the whole pool holds.
    pub fn capacity(&self) -> usize {
        self.total * self.block
    }
    /// Blocks needed for `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block)
    }
    /// Grows `seq`'s block list to hold `positions` positions. Takes
    /// nothing and returns false when the pool has too few free blocks.
    pub fn reserve(&mut self, seq: &mut Vec<u32>, positions: usize) -> bool {
        let need = self.blocks_for(positions).saturating_sub(seq.len());
        if need > self.free.len() {
            return false;
        }
        for _ in 0..need {
            let b = self.free.pop().expect("counted above");
            self.refs[b as usize] = 1;
            seq.push(b);
        }
        true
    }
    /// Lets go of every block of `seq` (each returns to the pool unless
    /// another list still holds it).
    pub fn release(&mut self, seq: &mut Vec<u32>) {
        self.truncate(seq, 0);
    }
    /// Lets go of the blocks of `seq` past the first `positions` positions.
    pub fn truncate(&mut self, seq: &mut Vec<u32>, positions: usize) {
        let keep = self.blocks_for(positions);
        while seq.len() > keep {
            let b = seq.pop().expect("longer than keep");
            self.unref(b);
        }
    }
    /// Makes `dst[i]` the block `src[i]` for every `i < src.len()` (both in
    /// position order, `dst` at least as long), letting go of the blocks
    /// `dst` held there: a sequence whose first positions hold the same
    /// tokens as another's reads that sequence's blocks for them.
    ///
    /// # Panics
    /// If `dst` is shorter than `src` or a block of `src` is free.
    pub fn share(&mut self, src: &[u32], dst: &mut [u32]) {
        for (d, &b) in dst[..src.len()].iter_mut().zip(src) {
            assert!(self.refs[b as usize] > 0, "sharing a free block");
            self.refs[b as usize] += 1;
            let old = std::mem::replace(d, b);
            self.unref(old);
        }
    }
    /// Block lists holding block `b`.
    pub fn refs(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }
    fn unref(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        if *r == 0 {
            // Already free: letting go twice must not list it twice.
            debug_assert!(false, "block {b} let go of twice");
            return;
        }
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
        }
    }
}

/// The window layers' own pool, when they keep only their window: each
/// sequence holds a ring of `ring` blocks there, and position `p` lives in
/// ring block `(p / BS) mod ring` (see [`Batch::push_ring`]).
///
/// A query at `p` reads positions `p - window + 1..=p`. A step feeds a
/// sequence at most `max_chunk` positions, so between the oldest position a
/// query of the step still reads and the newest one the step writes lie at
/// most `window + max_chunk - 2` positions: with `ring` blocks of `BS`
/// spanning more than that plus one block, no position is overwritten
/// while a query can still read it (nor by a step whose guesses are then
/// rolled back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowRing {
    /// The widest window of the model's layers.
    pub window: usize,
    /// Blocks per sequence.
    pub ring: usize,
    /// Positions per block.
    pub block: usize,
}

impl WindowRing {
    /// The ring for `window` when steps feed a sequence at most
    /// `max_chunk` tokens, in blocks of `block` positions.
    pub fn new(window: usize, max_chunk: usize, block: usize) -> Self {
        let block = block.max(1);
        WindowRing {
            window: window.max(1),
            ring: (window + max_chunk).div_ceil(block) + 1,
            block,
        }
    }
    /// Positions one ring holds.
    pub fn positions(&self) -> usize {
        self.ring * self.block
    }
    /// The first position still held once positions below `high` have
    /// been written (every block within `ring` blocks of the newest).
    pub fn held_from(&self, high: usize) -> usize {
        if high == 0 {
            return 0;
        }
        let newest = (high - 1) / self.block;
        (newest + 1).saturating_sub(self.ring) * self.block
    }
    /// Whether a sequence whose positions from `held_from` on are held can
    /// go on from position `pos` (its queries there read back `window`).
    pub fn can_resume(&self, pos: usize, held_from: usize) -> bool {
        pos == 0 || (pos + 1).saturating_sub(self.window) >= held_from
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_out_and_returned() {
        let mut pool = KvPool::new(5, 16);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert!(pool.reserve(&mut a, 17));
        assert_eq!(a, [0, 1]);
        assert!(pool.reserve(&mut a, 32), "still two blocks");
        assert_eq!(pool.free_blocks(), 3);
        assert!(pool.reserve(&mut b, 48));
        assert!(!pool.reserve(&mut a, 33), "no block left");
        assert_eq!(a.len(), 2, "a failed reserve takes nothing");
        pool.release(&mut b);
        assert!(b.is_empty());
        assert_eq!(pool.free_blocks(), 3);
        assert!(pool.reserve(&mut a, 80));
        pool.truncate(&mut a, 20);
        assert_eq!(a.len(), 2);
        assert_eq!(pool.free_blocks(), 3);
    }

    #[test]
    fn shared_blocks_are_freed_by_their_last_holder() {
        let mut pool = KvPool::new(4, 4);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert!(pool.reserve(&mut a, 8));
        assert!(pool.reserve(&mut b, 8));
        assert_eq!((a.as_slice(), b.as_slice()), (&[0, 1][..], &[2, 3][..]));
        assert_eq!(pool.free_blocks(), 0);
        // b reads a's first block for its first 4 positions; its own
        // block 2 goes back to the pool.
        pool.share(&a[..1], &mut b);
        assert_eq!(b, [0, 3]);
        assert_eq!((pool.refs(0), pool.refs(2), pool.free_blocks()), (2, 0, 1));
        pool.release(&mut a);
        assert_eq!(pool.free_blocks(), 2, "block 0 is still b's");
        assert_eq!(pool.refs(0), 1);
        pool.truncate(&mut b, 4);
        assert_eq!(b, [0]);
        pool.release(&mut b);
        assert_eq!(pool.free_blocks(), 4);
        assert!((0..4).all(|i| pool.refs(i) == 0));
    }

    #[test]
    fn batch_rows() {
        let mut b = Batch::with_capacity(8, 2, 4);
        b.push(&[5, 6, 7], 0, &[3]);
        b.push(&[], 9, &[1]);
        b.push(&[9], 20, &[0, 2]);
        assert_eq!(b.n_tokens(), 4);
        assert_eq!(b.n_seqs(), 2);
        assert_eq!(b.seq_table(), &[0, 3, 0, 0, 1, 3, 1, 20, 1, 1]);
        assert_eq!(b.block_table(), &[3, 0, 2]);
        b.push_rows(&[4, 4], 21, &[0, 2], 2);
        b.push_rows(&[4], 9, &[1], 5);
        assert_eq!(&b.seq_table()[10..], &[4, 2, 21, 3, 2, 6, 1, 9, 5, 1]);
        assert_eq!(b.n_logit_rows(), 5);
        assert_eq!(b.logit_rows_of(2), 2..4);
        assert_eq!(b.logit_rows_of(3), 4..5);
        b.copy_block(3, 1);
        assert_eq!(b.copy_table(), &[3, 1]);
        b.clear();
        assert!(b.is_empty());
        assert!(b.copy_table().is_empty());
    }

    #[test]
    fn a_window_ring_holds_every_position_a_query_still_reads() {
        let r = WindowRing::new(8, 5, 16);
        assert_eq!((r.ring, r.positions()), (2, 32));
        // Written up to 100: blocks 5 and 6 (80..112) are held.
        assert_eq!(r.held_from(100), 80);
        assert_eq!(r.held_from(0), 0);
        assert_eq!(r.held_from(20), 0);
        assert!(r.can_resume(97, 80) && r.can_resume(87, 80) && r.can_resume(0, 80));
        assert!(!r.can_resume(86, 80) && !r.can_resume(10, 80));
        // Simulated, for several windows, chunk sizes and block sizes, the
        // ring keeps every position a query reads; one too small does not.
        for (w, s, bs) in [(8, 5, 16), (8, 9, 4), (64, 24, 16), (3, 1, 1), (40, 7, 16)] {
            let r = WindowRing::new(w, s, bs);
            assert_eq!(simulate(r, s), Ok(()), "{r:?}");
            let small = WindowRing {
                ring: (w + s - 1).div_ceil(bs) - 1,
                ..r
            };
            if small.ring > 0 {
                assert!(simulate(small, s).is_err(), "{small:?} is too small");
            }
        }
    }

    /// Feeds one sequence in steps of 1 to `max` tokens (every third
    /// step's last two rejected, as rolled-back guesses) through ring `r`
    /// and checks that each query's window still holds its own positions.
    fn simulate(r: WindowRing, max: usize) -> Result<(), String> {
        let mut slot_pos = vec![usize::MAX; r.positions()];
        let slot = |p: usize| (p / r.block) % r.ring * r.block + p % r.block;
        let mut start = 0;
        for i in 0..3 * (r.positions() + r.window) {
            let n = 1 + (i * 7 + 3) % max;
            for p in start..start + n {
                slot_pos[slot(p)] = p;
            }
            for q in start..start + n {
                for t in (q + 1).saturating_sub(r.window)..=q {
                    if slot_pos[slot(t)] != t {
                        return Err(format!("step {i}: query {q} reads {t}, gone"));
                    }
                }
            }
            start += if i % 3 == 0 && n > 2 { n - 2 } else { n };
        }
        Ok(())
    }

    #[test]
    fn a_ring_fills_the_window_table_at_the_block_table_offsets() {
        let mut b = Batch::with_capacity(8, 3, 8);
        b.push_ring(&[1, 2], 0, &[4], &[0, 1], 1);
        b.push_ring(&[3], 40, &[5, 6, 7], &[2, 3], 1);
        assert_eq!(b.block_table(), &[4, 5, 6, 7]);
        // Position p of the second sequence is in ring block (p / 16) mod 2.
        assert_eq!(b.window_block_table(), &[0, 2, 3, 2]);
        b.clear();
        assert!(b.window_block_table().is_empty());
    }
}
