//! The KV pool: one layer's keys or values for every sequence, in blocks of
//! `BS` positions, stored as one of the [`CacheType`]s, and the step's view
//! of which sequence owns which blocks.
//!
//! Layout of one layer's cache (`NB` blocks, `Hkv` kv heads, head dim `D`):
//! keys `[NB, Hkv, D, BS]` (a head's keys at one dim are `BS` contiguous
//! values, so a vector holds one dim of several keys), values
//! `[NB, Hkv, BS, D]` (a key's value row is contiguous). A sequence's
//! position `p` lives in block `blocks[p / BS]` of its block list, at offset
//! `p % BS`.
//!
//! The block-quantized types (`q8_0`, `q4_0`) quantize each key's and each
//! value's `D` values in groups of 32 along `D`, as llama.cpp does (so `D`
//! must be a multiple of 32), with ggml's reference quantizers: one f16
//! scale per group. The quants keep the element layout above (element `i`
//! of the flat layout is quant `i`; `q4_0` packs element `i` into the low
//! nibble of byte `i / 2` if `i` is even, the high one if odd), and the
//! scales sit beside them: element `i`'s scale is number
//! `(i / (32·run))·run + i % run`, where `run` is the stride between two
//! dims of one key (`BS` for keys, 1 for values). So a run of one dim of
//! `BS` keys reads `BS` contiguous quants and `BS` contiguous scales, and a
//! value row reads its quants with one scale per 32.

use super::{check_len, KernelError};
use crate::ir::DType;
use crate::ir::SEQ_TABLE_COLS as COLS;
use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

/// Elements sharing one scale in the block-quantized cache types.
pub const QUANT_GROUP: usize = 32;

/// How the KV cache stores keys or values (`-ctk`/`--cache-type-k`,
/// `-ctv`/`--cache-type-v`), by llama.cpp's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
}

impl CacheType {
    /// Every type, in the order `--help` lists them.
    pub const ALL: [CacheType; 5] = [
        CacheType::F32,
        CacheType::F16,
        CacheType::Bf16,
        CacheType::Q8_0,
        CacheType::Q4_0,
    ];

    /// llama.cpp's name (`f32`, `f16`, `bf16`, `q8_0`, `q4_0`).
    pub fn name(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
            CacheType::Bf16 => "bf16",
            CacheType::Q8_0 => "q8_0",
            CacheType::Q4_0 => "q4_0",
        }
    }

    /// The IR dtype of a cache of this type.
    pub fn dtype(self) -> DType {
        match self {
            CacheType::F32 => DType::F32,
            CacheType::F16 => DType::F16,
            CacheType::Bf16 => DType::BF16,
            CacheType::Q8_0 => DType::Q8_0,
            CacheType::Q4_0 => DType::Q4_0,
        }
    }

    /// The cache type of an IR dtype, if a cache can be stored as it.
    pub fn of_dtype(d: DType) -> Option<CacheType> {
        CacheType::ALL.into_iter().find(|t| t.dtype() == d)
    }

    /// Whether groups of [`QUANT_GROUP`] elements share a scale (then the
    /// head dim must be a multiple of 32).
    pub fn is_quantized(self) -> bool {
        matches!(self, CacheType::Q8_0 | CacheType::Q4_0)
    }

    /// Bytes of `n` elements (`n` a multiple of 32 for the quantized types):
    /// 4, 2, 2, 34/32 and 18/32 per element.
    pub fn bytes_for(self, n: usize) -> usize {
        match self {
            CacheType::F32 => 4 * n,
            CacheType::F16 | CacheType::Bf16 => 2 * n,
            CacheType::Q8_0 => n / QUANT_GROUP * 34,
            CacheType::Q4_0 => n / QUANT_GROUP * 18,
        }
    }
}

impl fmt::Display for CacheType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CacheType {
    type Err = String;
    /// llama.cpp's names, any case.
    fn from_str(s: &str) -> Result<Self, String> {
        let l = s.to_ascii_lowercase();
        CacheType::ALL
            .into_iter()
            .find(|t| t.name() == l)
            .ok_or_else(|| {
                format!("unknown KV cache type `{s}`: use one of f32, f16, bf16, q8_0, q4_0")
            })
    }
}

/// The index of element `i`'s scale in a block-quantized store whose two
/// dims of one key are `run` elements apart (module docs).
#[inline(always)]
pub fn scale_index(run: usize, i: usize) -> usize {
    (i / (QUANT_GROUP * run)) * run + i % run
}

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

/// The quants and scales of a block-quantized store (module docs).
#[derive(Debug, Clone)]
pub struct QuantStore<Q> {
    /// Elements between two dims of one key: `BS` for keys, 1 for values.
    pub run: usize,
    /// One scale per 32 elements.
    pub d: Vec<f16>,
    /// `q8_0`: one i8 per element; `q4_0`: one byte per two elements.
    pub q: Vec<Q>,
}

/// A block-quantized store, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct QuantView<'a, Q> {
    pub run: usize,
    pub d: &'a [f16],
    pub q: &'a [Q],
}

impl<Q: Copy + Default> QuantStore<Q> {
    fn zeroed(n: usize, run: usize, per_byte: usize) -> Self {
        QuantStore {
            run: run.max(1),
            d: vec![f16::ZERO; n / QUANT_GROUP],
            q: vec![Q::default(); n / per_byte],
        }
    }
    fn view(&self) -> QuantView<'_, Q> {
        QuantView {
            run: self.run,
            d: &self.d,
            q: &self.q,
        }
    }
    /// Copies `per` elements (a multiple of 64) from element `s` to `t`.
    fn copy_elems(&mut self, s: usize, t: usize, per: usize, per_byte: usize) {
        self.q
            .copy_within(s / per_byte..(s + per) / per_byte, t / per_byte);
        let g = QUANT_GROUP;
        self.d.copy_within(s / g..(s + per) / g, t / g);
    }
}

/// One layer's keys or values, owned.
#[derive(Debug, Clone)]
pub enum KvStore {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    Q8_0(QuantStore<i8>),
    Q4_0(QuantStore<u8>),
}

impl KvStore {
    /// A zeroed store of `n` elements of type `ty`; `run` is the stride
    /// between two dims of one key (`BS` for keys, 1 for values), which
    /// only the quantized types use.
    ///
    /// # Errors
    /// A quantized type and `n` not a multiple of 64.
    pub fn new(ty: CacheType, n: usize, run: usize) -> Result<Self, KernelError> {
        if ty.is_quantized() && !n.is_multiple_of(2 * QUANT_GROUP) {
            return Err(KernelError::Invalid {
                op: "kv cache",
                what: "a q8_0 or q4_0 cache needs whole groups of 32 values per head",
            });
        }
        Ok(match ty {
            CacheType::F32 => KvStore::F32(vec![0.0; n]),
            CacheType::F16 => KvStore::F16(vec![f16::ZERO; n]),
            CacheType::Bf16 => KvStore::Bf16(vec![bf16::ZERO; n]),
            CacheType::Q8_0 => KvStore::Q8_0(QuantStore::zeroed(n, run, 1)),
            CacheType::Q4_0 => KvStore::Q4_0(QuantStore::zeroed(n, run, 2)),
        })
    }
    /// A zeroed store of `n` elements (f32 or f16).
    pub fn zeroed(f16_storage: bool, n: usize) -> Self {
        if f16_storage {
            KvStore::F16(vec![f16::ZERO; n])
        } else {
            KvStore::F32(vec![0.0; n])
        }
    }
    pub fn cache_type(&self) -> CacheType {
        match self {
            KvStore::F32(_) => CacheType::F32,
            KvStore::F16(_) => CacheType::F16,
            KvStore::Bf16(_) => CacheType::Bf16,
            KvStore::Q8_0(_) => CacheType::Q8_0,
            KvStore::Q4_0(_) => CacheType::Q4_0,
        }
    }
    pub fn view(&self) -> KvView<'_> {
        match self {
            KvStore::F32(v) => KvView::F32(v),
            KvStore::F16(v) => KvView::F16(v),
            KvStore::Bf16(v) => KvView::Bf16(v),
            KvStore::Q8_0(s) => KvView::Q8_0(s.view()),
            KvStore::Q4_0(s) => KvView::Q4_0(s.view()),
        }
    }
    /// Elements stored.
    pub fn len(&self) -> usize {
        self.view().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes the store takes.
    pub fn bytes(&self) -> usize {
        self.cache_type().bytes_for(self.len())
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
            KvStore::Bf16(v) => v.copy_within(s..s + per, d),
            KvStore::Q8_0(q) => q.copy_elems(s, d, per, 1),
            KvStore::Q4_0(q) => q.copy_elems(s, d, per, 2),
        }
    }
}

/// One layer's keys or values, borrowed.
#[derive(Debug, Clone, Copy)]
pub enum KvView<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
    Q8_0(QuantView<'a, i8>),
    Q4_0(QuantView<'a, u8>),
}

impl KvView<'_> {
    /// Elements viewed.
    pub fn len(&self) -> usize {
        match self {
            KvView::F32(v) => v.len(),
            KvView::F16(v) => v.len(),
            KvView::Bf16(v) => v.len(),
            KvView::Q8_0(s) => s.d.len() * QUANT_GROUP,
            KvView::Q4_0(s) => s.d.len() * QUANT_GROUP,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element `i` widened (dequantized) to f32, exactly as ggml's
    /// `dequantize_row_*` gives it: the f16/bf16 → f32 conversions are
    /// exact, a quant is `q · d` (`(q − 8) · d` for q4_0) in f32.
    #[inline(always)]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            KvView::F32(v) => v[i],
            KvView::F16(v) => v[i].to_f32(),
            KvView::Bf16(v) => v[i].to_f32(),
            KvView::Q8_0(s) => s.q[i] as f32 * s.d[scale_index(s.run, i)].to_f32(),
            KvView::Q4_0(s) => {
                let nib = (s.q[i / 2] >> (4 * (i & 1))) & 15;
                (nib as i32 - 8) as f32 * s.d[scale_index(s.run, i)].to_f32()
            }
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
/// `slot` (`block · BS + offset`), converting to the store's type (round to
/// nearest even for f16 and bf16; ggml's reference quantizers for q8_0 and
/// q4_0, one group of 32 dims at a time).
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
    // Flat index of dim e of head g of this token.
    let at = |g: usize, e: usize| match half {
        KvHalf::K => geom.k_index(b, i, g, e),
        KvHalf::V => geom.v_index(b, i, g, e),
    };
    match cache {
        KvStore::F32(c) => {
            for (g, src) in row.chunks_exact(d).enumerate() {
                for (e, &x) in src.iter().enumerate() {
                    c[at(g, e)] = x;
                }
            }
        }
        KvStore::F16(c) => {
            for (g, src) in row.chunks_exact(d).enumerate() {
                for (e, &x) in src.iter().enumerate() {
                    c[at(g, e)] = f16::from_f32(x);
                }
            }
        }
        KvStore::Bf16(c) => {
            for (g, src) in row.chunks_exact(d).enumerate() {
                for (e, &x) in src.iter().enumerate() {
                    c[at(g, e)] = bf16::from_f32(x);
                }
            }
        }
        KvStore::Q8_0(c) => {
            check_groups(d)?;
            let mut blk = [0u8; 34];
            for (g, src) in row.chunks_exact(d).enumerate() {
                for (k, xs) in src.chunks_exact(QUANT_GROUP).enumerate() {
                    quantize_group(DType::Q8_0, xs, &mut blk)?;
                    let e0 = k * QUANT_GROUP;
                    c.d[scale_index(c.run, at(g, e0))] = scale_of(&blk);
                    for (e, &q) in blk[2..].iter().enumerate() {
                        c.q[at(g, e0 + e)] = q as i8;
                    }
                }
            }
        }
        KvStore::Q4_0(c) => {
            check_groups(d)?;
            let mut blk = [0u8; 18];
            for (g, src) in row.chunks_exact(d).enumerate() {
                for (k, xs) in src.chunks_exact(QUANT_GROUP).enumerate() {
                    quantize_group(DType::Q4_0, xs, &mut blk)?;
                    let e0 = k * QUANT_GROUP;
                    c.d[scale_index(c.run, at(g, e0))] = scale_of(&blk);
                    // ggml's block: byte j holds dims j (low nibble) and
                    // j + 16 (high nibble).
                    for e in 0..QUANT_GROUP {
                        let nib = (blk[2 + e % 16] >> (4 * (e / 16))) & 15;
                        let idx = at(g, e0 + e);
                        let sh = 4 * (idx & 1);
                        let byte = &mut c.q[idx / 2];
                        *byte = (*byte & !(15 << sh)) | (nib << sh);
                    }
                }
            }
        }
    }
    Ok(())
}

fn check_groups(d: usize) -> Result<(), KernelError> {
    if d.is_multiple_of(QUANT_GROUP) {
        Ok(())
    } else {
        Err(KernelError::Invalid {
            op: "kv_write",
            what: "a q8_0 or q4_0 cache needs a head dim that is a multiple of 32",
        })
    }
}

/// One group of 32 through ggml's reference quantizer.
fn quantize_group(dt: DType, xs: &[f32], blk: &mut [u8]) -> Result<(), KernelError> {
    super::quantized::quantize_row(dt, xs, blk).map_err(|_| KernelError::Invalid {
        op: "kv_write",
        what: "quantizing a group of 32 values",
    })
}

/// The f16 scale at the start of a ggml block.
fn scale_of(blk: &[u8]) -> f16 {
    f16::from_le_bytes([blk[0], blk[1]])
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

    /// What ggml stores for `xs` (a whole number of groups of 32 for the
    /// quantized types), dequantized: the reference a cache must read back.
    fn ggml_round_trip(ty: CacheType, xs: &[f32]) -> Vec<f32> {
        use crate::kernels::quantized::{dequantize_row, quantize_row};
        let dt = ty.dtype();
        let mut bytes = vec![0u8; dt.bytes_for(xs.len()).unwrap()];
        quantize_row(dt, xs, &mut bytes).unwrap();
        let mut out = vec![0f32; xs.len()];
        dequantize_row(dt, &bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn writes_land_in_each_layout() {
        // Head dim 3 for the plain types, 64 (two groups) for all.
        let wide = KvGeom {
            head_dim: 64,
            ..GEOM
        };
        let mut rng = crate::kernels::testutil::Rng::new(3);
        for ty in CacheType::ALL {
            for geom in [GEOM, wide] {
                if ty.is_quantized() && geom.head_dim % 32 != 0 {
                    continue;
                }
                let mut k = KvStore::new(ty, geom.elems(), geom.block).unwrap();
                let mut v = KvStore::new(ty, geom.elems(), 1).unwrap();
                let row = geom.n_kv_heads * geom.head_dim;
                let x: Vec<f32> = rng.vec(2 * row).iter().map(|v| v * 3.0).collect();
                // Slots 5 (block 1, offset 1) and 8 (block 2, offset 0).
                kv_write_rows(&mut k, KvHalf::K, &geom, &[5, 8], &x).unwrap();
                kv_write_rows(&mut v, KvHalf::V, &geom, &[5, 8], &x).unwrap();
                let (kv, vv) = (k.view(), v.view());
                let (mut kset, mut vset) = (Vec::new(), Vec::new());
                for (t, (b, i)) in [(1, 1), (2, 0)].into_iter().enumerate() {
                    for g in 0..geom.n_kv_heads {
                        let d = geom.head_dim;
                        let src = &x[t * row + g * d..t * row + (g + 1) * d];
                        let want = ggml_round_trip(ty, src);
                        for (e, &w) in want.iter().enumerate() {
                            let what = format!("{ty} D {d} token {t} head {g} dim {e}");
                            assert_eq!(kv.get(geom.k_index(b, i, g, e)), w, "k {what}");
                            assert_eq!(vv.get(geom.v_index(b, i, g, e)), w, "v {what}");
                            kset.push(geom.k_index(b, i, g, e));
                            vset.push(geom.v_index(b, i, g, e));
                        }
                    }
                }
                for i in 0..geom.elems() {
                    if !kset.contains(&i) {
                        assert_eq!(kv.get(i), 0.0, "{ty}: key element {i} written");
                    }
                    if !vset.contains(&i) {
                        assert_eq!(vv.get(i), 0.0, "{ty}: value element {i} written");
                    }
                }
                assert_eq!(k.bytes(), ty.bytes_for(geom.elems()));
                assert!(matches!(
                    kv_write_rows(&mut k, KvHalf::K, &geom, &[12], &x[..row]),
                    Err(KernelError::CacheOverflow { .. })
                ));
                assert!(kv_write_rows(&mut k, KvHalf::K, &geom, &[-1], &x[..row]).is_err());
                assert!(kv_write_rows(&mut k, KvHalf::K, &geom, &[0], &x[..row - 1]).is_err());
                // A block copy carries quants and scales alike.
                k.copy_block(&geom, 1, 0);
                v.copy_block(&geom, 1, 0);
                let (kv, vv) = (k.view(), v.view());
                for g in 0..geom.n_kv_heads {
                    for e in 0..geom.head_dim {
                        for i in 0..geom.block {
                            let (a, c) = (geom.k_index(0, i, g, e), geom.k_index(1, i, g, e));
                            assert_eq!(kv.get(a), kv.get(c), "{ty} copied key");
                            let (a, c) = (geom.v_index(0, i, g, e), geom.v_index(1, i, g, e));
                            assert_eq!(vv.get(a), vv.get(c), "{ty} copied value");
                        }
                    }
                }
            }
        }
        // A quantized cache refuses a head dim that is not whole groups.
        let big = KvGeom {
            n_blocks: 8,
            ..GEOM
        };
        let mut q = KvStore::new(CacheType::Q8_0, big.elems(), 1).unwrap();
        let e = kv_write_rows(&mut q, KvHalf::V, &big, &[0], &[0.5; 6]).unwrap_err();
        assert!(e.to_string().contains("multiple of 32"), "{e}");
        assert!(KvStore::new(CacheType::Q4_0, 96, 1).is_err());
    }

    #[test]
    fn cache_types_by_llama_cpp_names() {
        for ty in CacheType::ALL {
            assert_eq!(ty.name().parse::<CacheType>().unwrap(), ty);
            assert_eq!(ty.name().to_uppercase().parse::<CacheType>().unwrap(), ty);
            assert_eq!(CacheType::of_dtype(ty.dtype()), Some(ty));
        }
        let e = "q5_1".parse::<CacheType>().unwrap_err();
        assert!(e.contains("q5_1") && e.contains("q8_0"), "{e}");
        // q8_0 takes 34/64 of f16's bytes, q4_0 18/64.
        assert_eq!(CacheType::Q8_0.bytes_for(64), 68);
        assert_eq!(CacheType::F16.bytes_for(64), 128);
        assert_eq!(CacheType::Q4_0.bytes_for(64), 36);
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
