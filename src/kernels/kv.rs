//! The KV pool: one layer's keys or values for every sequence, in blocks of
//! `BS` positions, stored as f32 or f16, and the step's view of which
//! sequence owns which blocks.
//!
//! Layout of one layer's cache (`NB` blocks, `Hkv` kv heads, head dim `D`):
//! keys `[NB, Hkv, D, BS]` (a head's keys at one dim are `BS` contiguous
//! values, so a vector holds one dim of several keys), values
//! `[NB, Hkv, BS, D]` (a key's value row is contiguous). A sequence's
//! position `p` lives in block `blocks[p / BS]` of its block list, at offset
//! `p % BS`.

use super::{check_len, KernelError};
use crate::ir::SEQ_TABLE_COLS as COLS;
use half::f16;

/// The geometry of a KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeom {
    pub n_blocks: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Positions per block.
    pub block: usize,
}

impl KvGeom {
    /// Elements of one layer's keys (or values).
    pub fn elems(&self) -> usize {
        self.n_blocks * self.block_elems()
    }
    /// Elements of one block of one layer's keys (or values): a block is
    /// the outermost axis of both layouts, so its elements are contiguous.
    pub fn block_elems(&self) -> usize {
        self.n_kv_heads * self.head_dim * self.block
    }
    /// Positions the pool holds.
    pub fn capacity(&self) -> usize {
        self.n_blocks * self.block
    }
    /// Index of key `(block b, offset i, head g, dim e)`: `[NB, Hkv, D, BS]`.
    #[inline(always)]
    pub fn k_index(&self, b: usize, i: usize, g: usize, e: usize) -> usize {
        ((b * self.n_kv_heads + g) * self.head_dim + e) * self.block + i
    }
    /// Index of value `(block b, offset i, head g, dim e)`: `[NB, Hkv, BS, D]`.
    #[inline(always)]
    pub fn v_index(&self, b: usize, i: usize, g: usize, e: usize) -> usize {
        ((b * self.n_kv_heads + g) * self.block + i) * self.head_dim + e
    }
}

/// One layer's keys or values, owned.
#[derive(Debug, Clone)]
pub enum KvStore {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl KvStore {
    /// A zeroed store of `n` elements (f32 or f16).
    pub fn zeroed(f16_storage: bool, n: usize) -> Self {
        if f16_storage {
            KvStore::F16(vec![f16::ZERO; n])
        } else {
            KvStore::F32(vec![0.0; n])
        }
    }
    pub fn view(&self) -> KvView<'_> {
        match self {
            KvStore::F32(v) => KvView::F32(v),
            KvStore::F16(v) => KvView::F16(v),
        }
    }
    pub fn len(&self) -> usize {
        match self {
            KvStore::F32(v) => v.len(),
            KvStore::F16(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies block `src` onto block `dst` (blocks of `geom`, keys or
    /// values alike).
    ///
    /// # Panics
    /// If either block lies outside the store.
    pub fn copy_block(&mut self, geom: &KvGeom, src: usize, dst: usize) {
        let per = geom.block_elems();
        let (s, d) = (src * per, dst * per);
        match self {
            KvStore::F32(v) => v.copy_within(s..s + per, d),
            KvStore::F16(v) => v.copy_within(s..s + per, d),
        }
    }
}

/// One layer's keys or values, borrowed.
#[derive(Debug, Clone, Copy)]
pub enum KvView<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl KvView<'_> {
    pub fn len(&self) -> usize {
        match self {
            KvView::F32(v) => v.len(),
            KvView::F16(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element `i` widened to f32 (the f16 → f32 conversion is exact).
    #[inline(always)]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            KvView::F32(v) => v[i],
            KvView::F16(v) => v[i].to_f32(),
        }
    }
}

/// One sequence of a step, as the sequence table gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan<'a> {
    /// Its first token's row in the step.
    pub first: usize,
    /// Its tokens in the step.
    pub count: usize,
    /// The position of its first token in the step.
    pub start: usize,
    /// Its blocks, in position order (at least enough for `start + count`).
    pub blocks: &'a [i32],
    /// Its last tokens that want logits (1 to `count`).
    pub rows: usize,
}

impl SeqSpan<'_> {
    /// Positions its last query attends over (`start + count`).
    pub fn keys(&self) -> usize {
        self.start + self.count
    }
    /// The pool block holding position `p`.
    #[inline(always)]
    pub fn block_of(&self, p: usize, block: usize) -> usize {
        self.blocks[p / block] as usize
    }
}

/// The step's sequences: the sequence table `i32[N, 5]` (first token,
/// count, start position, offset of the block list, logit rows) over the
/// block table, checked once against the pool so kernels can index without
/// further checks.
#[derive(Debug, Clone, Copy)]
pub struct StepSeqs<'a> {
    seqs: &'a [i32],
    blocks: &'a [i32],
    block: usize,
}

impl<'a> StepSeqs<'a> {
    /// Checks that the table describes `tokens` tokens in order (each
    /// sequence's tokens contiguous, at least one each), that every block
    /// list is long enough for its sequence's positions and that every
    /// block the sequences use lies in a pool of `geom.n_blocks`.
    pub fn new(
        seqs: &'a [i32],
        blocks: &'a [i32],
        tokens: usize,
        geom: &KvGeom,
    ) -> Result<Self, KernelError> {
        const OP: &str = "kv sequences";
        let bad = |what| Err(KernelError::Invalid { op: OP, what });
        if seqs.is_empty() || !seqs.len().is_multiple_of(COLS) {
            return bad("the sequence table needs 5 columns and at least one row");
        }
        if geom.block == 0 {
            return bad("the block size is 0");
        }
        let mut next = 0usize;
        for row in seqs.chunks_exact(COLS) {
            let [first, count, start, off, rows] = [row[0], row[1], row[2], row[3], row[4]];
            if first < 0 || count < 1 || start < 0 || off < 0 {
                return bad("a sequence row has a negative entry or no tokens");
            }
            if rows < 1 || rows > count {
                return bad("a sequence asks logits for none of its tokens or more than it has");
            }
            let (first, count, start, off) =
                (first as usize, count as usize, start as usize, off as usize);
            if first != next {
                return bad("sequences' tokens must be contiguous and in order");
            }
            next += count;
            let need = (start + count).div_ceil(geom.block);
            let Some(list) = blocks.get(off..off + need) else {
                return bad("a block list runs past the block table");
            };
            if list.iter().any(|&b| b < 0 || b as usize >= geom.n_blocks) {
                return bad("a block id is outside the pool");
            }
        }
        check_len(OP, "tokens covered by the sequence table", tokens, next)?;
        Ok(StepSeqs {
            seqs,
            blocks,
            block: geom.block,
        })
    }

    /// Sequences in the step.
    pub fn len(&self) -> usize {
        self.seqs.len() / COLS
    }
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
    /// Sequence `j`.
    pub fn get(&self, j: usize) -> SeqSpan<'a> {
        let r = &self.seqs[COLS * j..COLS * (j + 1)];
        let (start, count) = (r[2] as usize, r[1] as usize);
        let off = r[3] as usize;
        let need = (start + count).div_ceil(self.block);
        SeqSpan {
            first: r[0] as usize,
            count,
            start,
            blocks: &self.blocks[off..off + need],
            rows: r[4] as usize,
        }
    }
    pub fn iter(&self) -> impl Iterator<Item = SeqSpan<'a>> + '_ {
        (0..self.len()).map(|j| self.get(j))
    }
    /// Logit rows of the step (`R`): every sequence's `rows`, summed.
    pub fn logit_rows(&self) -> usize {
        self.iter().map(|s| s.rows).sum()
    }
    /// The longest key span (`T`).
    pub fn max_keys(&self) -> usize {
        self.iter().map(|s| s.keys()).max().unwrap_or(0)
    }
    /// Fills each token's position and KV slot (`block · BS + p % BS`).
    pub fn fill_positions_and_slots(&self, positions: &mut [i32], slots: &mut [i32]) {
        for s in self.iter() {
            for i in 0..s.count {
                let p = s.start + i;
                positions[s.first + i] = p as i32;
                slots[s.first + i] =
                    (s.block_of(p, self.block) * self.block + p % self.block) as i32;
            }
        }
    }
}

/// Which half of the cache a write goes to (the layouts differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvHalf {
    K,
    V,
}

/// Writes one token's keys or values (`row`: `[Hkv, D]`) at pool slot
/// `slot` (`block · BS + offset`), converting to the store's type.
pub fn kv_write_row(
    cache: &mut KvStore,
    half: KvHalf,
    geom: &KvGeom,
    slot: usize,
    row: &[f32],
) -> Result<(), KernelError> {
    const OP: &str = "kv_write";
    check_len(
        OP,
        "row elements (n_kv_heads*head_dim)",
        geom.n_kv_heads * geom.head_dim,
        row.len(),
    )?;
    check_len(OP, "cache elements", geom.elems(), cache.len())?;
    if slot >= geom.capacity() {
        return Err(KernelError::CacheOverflow {
            pos: slot,
            len: 1,
            capacity: geom.capacity(),
        });
    }
    let (b, i) = (slot / geom.block, slot % geom.block);
    let d = geom.head_dim;
    match (cache, half) {
        (KvStore::F32(c), KvHalf::V) => {
            for (g, src) in row.chunks_exact(d).enumerate() {
                let at = geom.v_index(b, i, g, 0);
                c[at..at + d].copy_from_slice(src);
            }
        }
        (KvStore::F16(c), KvHalf::V) => {
            for (g, src) in row.chunks_exact(d).enumerate() {
                let at = geom.v_index(b, i, g, 0);
                for (o, &x) in c[at..at + d].iter_mut().zip(src) {
                    *o = f16::from_f32(x);
                }
            }
        }
        (KvStore::F32(c), KvHalf::K) => {
            for (g, src) in row.chunks_exact(d).enumerate() {
                for (e, &x) in src.iter().enumerate() {
                    c[geom.k_index(b, i, g, e)] = x;
                }
            }
        }
        (KvStore::F16(c), KvHalf::K) => {
            for (g, src) in row.chunks_exact(d).enumerate() {
                for (e, &x) in src.iter().enumerate() {
                    c[geom.k_index(b, i, g, e)] = f16::from_f32(x);
                }
            }
        }
    }
    Ok(())
}

/// Writes `x` (`[S, Hkv, D]`) at each token's slot.
pub fn kv_write_rows(
    cache: &mut KvStore,
    half: KvHalf,
    geom: &KvGeom,
    slots: &[i32],
    x: &[f32],
) -> Result<(), KernelError> {
    let row = geom.n_kv_heads * geom.head_dim;
    check_len("kv_write", "x elements (s*row)", slots.len() * row, x.len())?;
    for (&slot, r) in slots.iter().zip(x.chunks_exact(row.max(1))) {
        let slot = usize::try_from(slot).map_err(|_| KernelError::Invalid {
            op: "kv_write",
            what: "negative slot",
        })?;
        kv_write_row(cache, half, geom, slot, r)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GEOM: KvGeom = KvGeom {
        n_blocks: 3,
        n_kv_heads: 2,
        head_dim: 3,
        block: 4,
    };

    #[test]
    fn writes_land_in_each_layout() {
        for f16_storage in [false, true] {
            let mut k = KvStore::zeroed(f16_storage, GEOM.elems());
            let mut v = KvStore::zeroed(f16_storage, GEOM.elems());
            let x: Vec<f32> = (0..2 * 6).map(|i| i as f32 + 1.0).collect();
            // Slots 5 (block 1, offset 1) and 8 (block 2, offset 0).
            kv_write_rows(&mut k, KvHalf::K, &GEOM, &[5, 8], &x).unwrap();
            kv_write_rows(&mut v, KvHalf::V, &GEOM, &[5, 8], &x).unwrap();
            for (t, (b, i)) in [(1, 1), (2, 0)].into_iter().enumerate() {
                for g in 0..2 {
                    for e in 0..3 {
                        let want = x[t * 6 + g * 3 + e];
                        assert_eq!(k.view().get(GEOM.k_index(b, i, g, e)), want);
                        assert_eq!(v.view().get(GEOM.v_index(b, i, g, e)), want);
                    }
                }
            }
            let written: f32 = (0..GEOM.elems()).map(|i| k.view().get(i)).sum();
            assert_eq!(written, x.iter().sum::<f32>(), "nothing else written");
            assert!(matches!(
                kv_write_rows(&mut k, KvHalf::K, &GEOM, &[12], &x[..6]),
                Err(KernelError::CacheOverflow { .. })
            ));
            assert!(kv_write_rows(&mut k, KvHalf::K, &GEOM, &[-1], &x[..6]).is_err());
            assert!(kv_write_rows(&mut k, KvHalf::K, &GEOM, &[0], &x[..5]).is_err());
        }
    }

    #[test]
    fn sequence_table_is_checked() {
        // Two sequences: 3 tokens at 0..3 (block 2), 1 token at position 5
        // (blocks 0, 1).
        let seqs = [0, 3, 0, 0, 2, 3, 1, 5, 1, 1];
        let blocks = [2, 0, 1];
        let s = StepSeqs::new(&seqs, &blocks, 4, &GEOM).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!((s.get(0).rows, s.logit_rows()), (2, 3));
        assert_eq!(s.max_keys(), 6);
        assert_eq!(s.get(1).blocks, &[0, 1]);
        let (mut pos, mut slots) = ([0; 4], [0; 4]);
        s.fill_positions_and_slots(&mut pos, &mut slots);
        assert_eq!(pos, [0, 1, 2, 5]);
        assert_eq!(slots, [8, 9, 10, 5]);
        // Wrong token count, a gap, a short block list, a block outside.
        assert!(StepSeqs::new(&seqs, &blocks, 5, &GEOM).is_err());
        assert!(StepSeqs::new(&[0, 3, 0, 0, 1, 4, 1, 5, 1, 1], &blocks, 5, &GEOM).is_err());
        assert!(StepSeqs::new(&[0, 3, 0, 0, 1, 3, 1, 8, 1, 1], &blocks, 4, &GEOM).is_err());
        assert!(StepSeqs::new(&seqs, &[2, 0, 3], 4, &GEOM).is_err());
        assert!(StepSeqs::new(&[0, 0, 0, 0, 0], &blocks, 0, &GEOM).is_err());
        // Logit rows: none, or more than the sequence's tokens.
        assert!(StepSeqs::new(&[0, 3, 0, 0, 0, 3, 1, 5, 1, 1], &blocks, 4, &GEOM).is_err());
        assert!(StepSeqs::new(&[0, 3, 0, 0, 4, 3, 1, 5, 1, 1], &blocks, 4, &GEOM).is_err());
        // Four columns are not a sequence table any more.
        assert!(StepSeqs::new(&[0, 3, 0, 0, 3, 1, 5, 1], &blocks, 4, &GEOM).is_err());
        assert!(StepSeqs::new(&[], &blocks, 0, &GEOM).is_err());
    }
}
