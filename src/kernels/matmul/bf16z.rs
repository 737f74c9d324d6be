//! `bf16z`: bf16 weights stored losslessly in 12.25 bits each, and the
//! single-token product that reads them.
//!
//! Decode streams every weight byte once per token and runs at the
//! machine's memory bandwidth, so fewer bytes per weight is the only way
//! left to make it faster. Trained and random weights alike have
//! exponents that cluster within a few binades of the largest one in a
//! block, so the high byte of a bf16 (sign and top seven exponent bits)
//! carries little information. The format keeps the low byte as it is and
//! codes the high byte in four bits against the block's largest value.
//!
//! **Layout.** A matrix `[n, k]` (`k` a multiple of 32) is `n · k/32`
//! blocks of [`BLOCK_BYTES`] = 49 bytes, row-major, then an exception table.
//! A block of 32 weights `w[0..32]`, with `hi(w)` = bits 14..8 of the bf16
//! (the exponent without its lowest bit) and `f` = the largest `hi` in the
//! block minus 7 (at least 0), the bottom of an 8-value window:
//!
//! - byte 0: `f`;
//! - bytes 1..17: one nibble per weight, `sign << 3 | (hi(w) - f)`, with
//!   `w[i]` in the low nibble of byte `1 + i` and `w[i + 16]` in its high
//!   nibble (so one shift splits them into two 16-weight halves);
//! - bytes 17..49: the low byte of each weight (the lowest exponent bit and
//!   the seven mantissa bits).
//!
//! So a weight decodes as `sign << 15 | (f + e) << 8 | low`, where `e` is
//! the nibble's low three bits, and in SIMD as a fixed 16-entry table
//! lookup (`sign << 7 | e`) plus `f` in each high byte (`f + e` < 128, so
//! the sign bit is never carried into). Weights below the window (values
//! under about 2^-14 of the block's largest, exact zeros) are stored with
//! `e = 0` and listed as exceptions: after the blocks, `n + 1`
//! little-endian u32 row starts into the entries, then the entries, each
//! `(column: u32, exact: u16, coded: u16)`. The product adds
//! `(exact - coded) · x[column]` per exception of the row, and decoding to
//! bf16 writes `exact` back, so nothing is lost.
//!
//! The size is 49/64 of bf16 plus the table. Measured with
//! `benches/probes/bf16z_stats.rs`: 0.007% of the random 1B checkpoint's weights
//! are exceptions (0.767 of bf16 in all), 0.03% of SmolLM2's trained layer
//! weights and 1% of its embedding table (0.778 in all).

use super::Epilogue;
use crate::kernels::{check_len, Isa, KernelError};
use crate::pool::ThreadPool;

/// Weights per block.
pub const BLOCK: usize = 32;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 49;
/// Bytes per exception entry.
const ENTRY_BYTES: usize = 8;

fn hi7(w: u16) -> u8 {
    ((w >> 8) & 0x7f) as u8
}

/// Encodes one block of 32 bf16 values into `out` (49 bytes) and returns
/// the exceptions as `(index in block, exact, coded)`.
fn encode_block(w: &[u16], out: &mut [u8], exc: &mut Vec<(usize, u16, u16)>) {
    let h = w.iter().map(|&v| hi7(v)).max().unwrap_or(0);
    let f = h.saturating_sub(7);
    out[0] = f;
    for (i, &v) in w.iter().enumerate() {
        let sign = (v >> 15) as u8;
        let e = hi7(v).saturating_sub(f);
        let nib = sign << 3 | e;
        let byte = &mut out[1 + i % 16];
        if i < 16 {
            *byte = (*byte & 0xf0) | nib;
        } else {
            *byte = (*byte & 0x0f) | nib << 4;
        }
        out[17 + i] = v as u8;
        let coded = (sign as u16) << 15 | ((f + e) as u16) << 8 | (v & 0xff);
        if coded != v {
            exc.push((i, v, coded));
        }
    }
}

/// Encoded size of an `[n, k]` matrix with `n_exceptions` exceptions.
pub fn encoded_len(n: usize, k: usize, n_exceptions: usize) -> Option<usize> {
    let blocks = n.checked_mul(k / BLOCK)?.checked_mul(BLOCK_BYTES)?;
    let starts = n.checked_add(1)?.checked_mul(4)?;
    blocks
        .checked_add(starts)?
        .checked_add(n_exceptions.checked_mul(ENTRY_BYTES)?)
}

/// True when the codec (encoding, row decoding) may use its AVX2 code. The
/// codec is exact: both paths give the same bytes (tested below), so it
/// takes the CPU's best rather than the kernels' level; the products take
/// their level as an argument.
fn simd_codec() -> bool {
    Isa::detect().avx2()
}

/// Exceptions in one block of 32 bf16 values (64 little-endian bytes).
fn block_exceptions(b: &[u8]) -> u32 {
    let b = &b[..2 * BLOCK];
    #[cfg(target_arch = "x86_64")]
    if simd_codec() {
        // SAFETY: avx2 checked; 64 readable bytes; the block is only read
        // (no output pointer).
        return unsafe { avx2::encode_block(b.as_ptr(), None) }.count_ones();
    }
    let hi = |i: usize| b[2 * i + 1] & 0x7f;
    let h = (0..BLOCK).map(hi).max().unwrap_or(0);
    let f = h.saturating_sub(7);
    (0..BLOCK).filter(|&i| hi(i) < f).count() as u32
}

/// Runs `f(r0, r1)` on `0..n` split into contiguous ranges over the CPU's
/// threads (encoding happens once per session, before the pool exists).
fn par_ranges(n: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    let t = std::thread::available_parallelism()
        .map_or(1, |v| v.get())
        .clamp(1, 8)
        .min(n.max(1));
    let per = n.div_ceil(t);
    std::thread::scope(|sc| {
        for i in 1..t {
            sc.spawn(move || f((i * per).min(n), ((i + 1) * per).min(n)));
        }
        f(0, per.min(n));
    });
}

/// Rows between two calls of an encoder's `done` callback.
const DONE_ROWS: usize = 64;

/// Per-row exception counts of the bf16 rows `row(0..n)`, `k` values each
/// (`k` a multiple of 32): what [`encode_into`] and [`encoded_len`] need.
/// `done(r0, r1)` is called as rows `r0..r1` have been read (so that a
/// caller can release their source pages).
pub fn exception_counts<'a>(
    row: &(dyn Fn(usize) -> &'a [u8] + Sync),
    n: usize,
    k: usize,
    done: &(dyn Fn(usize, usize) + Sync),
) -> Vec<u32> {
    let mut counts = vec![0u32; n];
    let cp = crate::pool::SyncPtr::new(&mut counts);
    par_ranges(n, &|r0, r1| {
        // SAFETY: each range writes only its own rows' counts.
        let c = unsafe { cp.slice(r0, r1 - r0) };
        for (r, o) in (r0..r1).zip(c) {
            *o = row(r)[..2 * k]
                .chunks_exact(2 * BLOCK)
                .map(block_exceptions)
                .sum();
            if (r + 1 - r0) % DONE_ROWS == 0 || r + 1 == r1 {
                done(r + 1 - ((r - r0) % DONE_ROWS + 1), r + 1);
            }
        }
    });
    counts
}

/// Encodes the bf16 rows `row(0..n)` (`k` values each, `k` a multiple of
/// 32) into `out`, which holds exactly `encoded_len(n, k, Σ counts)` bytes,
/// `counts` being [`exception_counts`] of the same rows. `done` as there.
pub fn encode_into<'a>(
    row: &(dyn Fn(usize) -> &'a [u8] + Sync),
    n: usize,
    k: usize,
    counts: &[u32],
    out: &mut [u8],
    done: &(dyn Fn(usize, usize) + Sync),
) -> Result<(), KernelError> {
    const OP: &str = "bf16z::encode";
    if k == 0 || !k.is_multiple_of(BLOCK) {
        return Err(KernelError::Invalid {
            op: OP,
            what: "k is not a positive multiple of 32",
        });
    }
    check_len(OP, "exception counts", n, counts.len())?;
    let total: usize = counts.iter().map(|&c| c as usize).sum();
    let want = encoded_len(n, k, total).ok_or(KernelError::Invalid {
        op: OP,
        what: "size overflows",
    })?;
    check_len(OP, "output bytes", want, out.len())?;
    let nb = k / BLOCK;
    let rb = nb * BLOCK_BYTES;
    let (blocks, rest) = out.split_at_mut(n * rb);
    let (starts, entries) = rest.split_at_mut((n + 1) * 4);
    let mut first = Vec::with_capacity(n + 1);
    let mut acc = 0usize;
    for (r, &c) in counts.iter().enumerate() {
        first.push(acc);
        starts[r * 4..r * 4 + 4].copy_from_slice(&(acc as u32).to_le_bytes());
        acc += c as usize;
    }
    first.push(acc);
    starts[n * 4..].copy_from_slice(&(acc as u32).to_le_bytes());
    let (bp, ep) = (
        crate::pool::SyncPtr::new(blocks),
        crate::pool::SyncPtr::new(entries),
    );
    let bad = std::sync::atomic::AtomicBool::new(false);
    par_ranges(n, &|r0, r1| {
        // SAFETY: rows r0..r1 own their blocks and their entries
        // (first[r0]..first[r1], from the same counts).
        let (bl, en) = unsafe {
            (
                bp.slice(r0 * rb, (r1 - r0) * rb),
                ep.slice(
                    first[r0] * ENTRY_BYTES,
                    (first[r1] - first[r0]) * ENTRY_BYTES,
                ),
            )
        };
        let mut at = 0;
        let mut exc = Vec::new();
        let mut w = [0u16; BLOCK];
        let simd = simd_codec();
        for r in r0..r1 {
            let src = &row(r)[..2 * k];
            for b in 0..nb {
                let o = ((r - r0) * nb + b) * BLOCK_BYTES;
                let blk = &src[b * 2 * BLOCK..(b + 1) * 2 * BLOCK];
                let out = &mut bl[o..o + BLOCK_BYTES];
                exc.clear();
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: avx2 checked; 64 readable bytes in, 49
                    // writable bytes out.
                    let mask = unsafe { avx2::encode_block(blk.as_ptr(), Some(out.as_mut_ptr())) };
                    if mask == 0 {
                        continue;
                    }
                }
                let _ = simd;
                // A block with exceptions (or no SIMD): the portable encoder,
                // which also lists them.
                for (v, c) in w.iter_mut().zip(blk.chunks_exact(2)) {
                    *v = u16::from_le_bytes([c[0], c[1]]);
                }
                encode_block(&w, out, &mut exc);
                for &(i, exact, coded) in &exc {
                    let Some(e) = en.get_mut(at..at + ENTRY_BYTES) else {
                        bad.store(true, std::sync::atomic::Ordering::Relaxed);
                        return;
                    };
                    e[..4].copy_from_slice(&((b * BLOCK + i) as u32).to_le_bytes());
                    e[4..6].copy_from_slice(&exact.to_le_bytes());
                    e[6..].copy_from_slice(&coded.to_le_bytes());
                    at += ENTRY_BYTES;
                }
            }
            if (r + 1 - r0) % DONE_ROWS == 0 || r + 1 == r1 {
                done(r + 1 - ((r - r0) % DONE_ROWS + 1), r + 1);
            }
        }
        if at != en.len() {
            bad.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    if bad.into_inner() {
        return Err(KernelError::Invalid {
            op: OP,
            what: "the exception counts do not match the rows",
        });
    }
    Ok(())
}

/// Encodes a row-major bf16 matrix `[n, k]` (`k` a multiple of 32).
pub fn encode(bf16: &[u8], n: usize, k: usize) -> Result<Vec<u8>, KernelError> {
    const OP: &str = "bf16z::encode";
    if k == 0 || !k.is_multiple_of(BLOCK) {
        return Err(KernelError::Invalid {
            op: OP,
            what: "k is not a positive multiple of 32",
        });
    }
    let want = n
        .checked_mul(k)
        .and_then(|e| e.checked_mul(2))
        .ok_or(KernelError::Invalid {
            op: OP,
            what: "n*k overflows",
        })?;
    check_len(OP, "bf16 bytes (2*n*k)", want, bf16.len())?;
    let row = |r: usize| &bf16[r * 2 * k..(r + 1) * 2 * k];
    let counts = exception_counts(&row, n, k, &|_, _| {});
    let total = counts.iter().map(|&c| c as usize).sum();
    let mut out = vec![0u8; encoded_len(n, k, total).unwrap_or(0)];
    encode_into(&row, n, k, &counts, &mut out, &|_, _| {})?;
    Ok(out)
}

/// A checked view of an encoded matrix.
#[derive(Clone, Copy)]
pub struct Bf16z<'a> {
    n: usize,
    k: usize,
    blocks: &'a [u8],
    starts: &'a [u8],
    entries: &'a [u8],
}

impl<'a> Bf16z<'a> {
    /// Checks `bytes` as an encoded `[n, k]` matrix: sizes, row starts in
    /// order and within the table, columns below `k`.
    pub fn parse(bytes: &'a [u8], n: usize, k: usize) -> Result<Self, KernelError> {
        const OP: &str = "bf16z";
        let bad = |what| KernelError::Invalid { op: OP, what };
        if k == 0 || !k.is_multiple_of(BLOCK) {
            return Err(bad("k is not a positive multiple of 32"));
        }
        let head = encoded_len(n, k, 0).ok_or(bad("size overflows"))?;
        if bytes.len() < head || !(bytes.len() - head).is_multiple_of(ENTRY_BYTES) {
            return Err(bad(
                "byte length does not fit n, k and whole exception entries",
            ));
        }
        let nblk = n * (k / BLOCK) * BLOCK_BYTES;
        let (blocks, rest) = bytes.split_at(nblk);
        let (starts, entries) = rest.split_at((n + 1) * 4);
        let z = Bf16z {
            n,
            k,
            blocks,
            starts,
            entries,
        };
        let n_entries = entries.len() / ENTRY_BYTES;
        let mut prev = 0;
        for r in 0..=n {
            let s = z.start(r);
            if s < prev || s > n_entries || (r == 0 && s != 0) || (r == n && s != n_entries) {
                return Err(bad("exception row starts are out of order or out of range"));
            }
            prev = s;
        }
        if (0..n_entries).any(|e| z.entry(e).0 >= k) {
            return Err(bad("an exception column is not below k"));
        }
        Ok(z)
    }

    fn start(&self, r: usize) -> usize {
        let b = &self.starts[r * 4..r * 4 + 4];
        u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
    }

    /// Entry `e`: (column, exact bf16, coded bf16).
    fn entry(&self, e: usize) -> (usize, u16, u16) {
        let b = &self.entries[e * ENTRY_BYTES..(e + 1) * ENTRY_BYTES];
        (
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize,
            u16::from_le_bytes([b[4], b[5]]),
            u16::from_le_bytes([b[6], b[7]]),
        )
    }

    /// Number of exceptions.
    pub fn n_exceptions(&self) -> usize {
        self.entries.len() / ENTRY_BYTES
    }

    fn row_blocks(&self, r: usize) -> &'a [u8] {
        let rb = self.k / BLOCK * BLOCK_BYTES;
        &self.blocks[r * rb..(r + 1) * rb]
    }

    /// Row `r` as bf16 values (exact).
    pub fn decode_row(&self, r: usize, out: &mut [u16]) {
        #[cfg(target_arch = "x86_64")]
        if simd_codec() {
            let out = &mut out[..self.k];
            // SAFETY: avx2 checked; the row holds k/32 blocks and `out` k values.
            unsafe { avx2::decode::<false>(self.row_blocks(r), out) };
            self.apply_exceptions(r, out);
            return;
        }
        self.decode_row_scalar(r, out);
    }

    /// Writes row `r`'s exact values over their coded ones.
    fn apply_exceptions(&self, r: usize, out: &mut [u16]) {
        for e in self.start(r)..self.start(r + 1) {
            let (c, exact, _) = self.entry(e);
            out[c] = exact;
        }
    }

    /// [`Self::decode_row`] in portable code.
    fn decode_row_scalar(&self, r: usize, out: &mut [u16]) {
        let out = &mut out[..self.k];
        for (blk, o) in self
            .row_blocks(r)
            .chunks_exact(BLOCK_BYTES)
            .zip(out.chunks_exact_mut(BLOCK))
        {
            decode_block(blk, o);
        }
        self.apply_exceptions(r, out);
    }

    /// Row `r` as f32 values (exact), without allocating: the embedding
    /// gather of a table stored as bf16z.
    pub fn decode_row_f32(&self, r: usize, out: &mut [f32]) {
        let out = &mut out[..self.k];
        let mut w = [0u16; BLOCK];
        for (blk, o) in self
            .row_blocks(r)
            .chunks_exact(BLOCK_BYTES)
            .zip(out.chunks_exact_mut(BLOCK))
        {
            decode_block(blk, &mut w);
            for (d, &v) in o.iter_mut().zip(&w) {
                *d = crate::kernels::bf16_to_f32(v);
            }
        }
        for e in self.start(r)..self.start(r + 1) {
            let (c, exact, _) = self.entry(e);
            out[c] = crate::kernels::bf16_to_f32(exact);
        }
    }

    /// Rows `r0..r0 + out.len() / k` as bf16 values, decoded over the pool.
    pub fn decode_rows(&self, pool: &ThreadPool, r0: usize, out: &mut [u16]) {
        self.for_rows(pool, out, &|r, o| self.decode_row(r0 + r, o));
    }

    /// `f(r, row r of out)` for every row of `out` (`k` values each), eight
    /// rows per chunk of the pool.
    fn for_rows(&self, pool: &ThreadPool, out: &mut [u16], f: &(dyn Fn(usize, &mut [u16]) + Sync)) {
        let k = self.k;
        let rows = out.len() / k;
        let op = crate::pool::SyncPtr::new(out);
        pool.run(rows.div_ceil(8), &|c| {
            for r in c * 8..((c + 1) * 8).min(rows) {
                // SAFETY: chunk c alone writes rows c*8..c*8+8 of `out`.
                let o = unsafe { op.slice(r * k, k) };
                f(r, o);
            }
        });
    }

    /// `row r · x` with the coded blocks, in the portable level's order
    /// ([`super::portable_dot_with`]), plus the row's exceptions; without
    /// allocating.
    fn dot_scalar(&self, r: usize, x: &[f32]) -> f32 {
        let blocks = self.row_blocks(r);
        let mut w = [0u16; BLOCK];
        let mut fill = |k0: usize, buf: &mut [f32]| {
            for (b, o) in buf.chunks_exact_mut(BLOCK).enumerate() {
                let blk = &blocks[(k0 / BLOCK + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                decode_block(blk, &mut w);
                for (d, &v) in o.iter_mut().zip(&w) {
                    *d = crate::kernels::bf16_to_f32(v);
                }
            }
        };
        super::portable_dot_with(x, &mut fill) + self.corrections(r, x)
    }

    /// Rows `r0..r0 + out.len() / k` as coded bf16 values (exceptions not
    /// applied), decoded over the pool: in natural order, or with
    /// `permuted` each block of 32 in [`ORDER`], the order in which the
    /// AVX2 single-token kernel multiplies them.
    fn decode_coded_rows(&self, pool: &ThreadPool, r0: usize, out: &mut [u16], permuted: bool) {
        self.for_rows(pool, out, &|r, o| {
            let blocks = self.row_blocks(r0 + r);
            #[cfg(target_arch = "x86_64")]
            if permuted {
                // SAFETY: permuted is only asked for at the AVX2 levels
                // (checked by the caller); the row holds k/32 blocks and
                // `o` k values.
                unsafe { avx2::decode::<true>(blocks, o) };
                return;
            }
            assert!(!permuted, "permuted decode needs AVX2");
            for (blk, ob) in blocks
                .chunks_exact(BLOCK_BYTES)
                .zip(o.chunks_exact_mut(BLOCK))
            {
                decode_block(blk, ob);
            }
        });
    }

    /// The exception corrections of row `r`.
    fn corrections(&self, r: usize, x: &[f32]) -> f32 {
        let mut s = 0f32;
        for e in self.start(r)..self.start(r + 1) {
            let (c, exact, coded) = self.entry(e);
            s += (crate::kernels::bf16_to_f32(exact) - crate::kernels::bf16_to_f32(coded)) * x[c];
        }
        s
    }
}

/// One block's 32 coded values (exceptions not applied), in portable code.
fn decode_block(blk: &[u8], out: &mut [u16]) {
    let f = blk[0];
    for (i, v) in out[..BLOCK].iter_mut().enumerate() {
        let nib = (blk[1 + i % 16] >> (4 * (i / 16))) & 0xf;
        let hi = f.wrapping_add(nib & 7) & 0x7f;
        *v = ((nib >> 3) as u16) << 15 | (hi as u16) << 8 | blk[17 + i] as u16;
    }
}

/// The element order of a block of 32 in which the AVX2 single-token
/// kernel ([`avx2::dot`]) produces weights (see there).
const ORDER: [usize; 32] = [
    0, 2, 4, 6, 16, 18, 20, 22, 1, 3, 5, 7, 17, 19, 21, 23, 8, 10, 12, 14, 24, 26, 28, 30, 9, 11,
    13, 15, 25, 27, 29, 31,
];

/// `x` rearranged for the AVX2 kernels: each block of 32 in [`ORDER`].
fn permute_x(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    for b in x.chunks_exact(BLOCK) {
        out.extend(ORDER.iter().map(|&i| b[i]));
    }
}

std::thread_local! {
    static X_PERM: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `y = x·Wᵀ` with `epilogue` for one activation row and an encoded `W`
/// (`[n, k]`), the same contract as [`super::gemv::gemv_at`], with the
/// kernels of `isa` (lowered to what the CPU supports):
/// the portable kernel at [`Isa::Scalar`], the AVX2 kernel at every SIMD
/// level (there is no AVX-512 one).
///
/// Every row is the sum of its coded weights times x, in the order of the
/// multi-token product at that level ([`matmul_at`] multiplies the same
/// coded values in the same order), plus its exception corrections: the
/// result does not depend on how many tokens a step has.
pub fn gemv_at(
    isa: Isa,
    pool: &ThreadPool,
    x: &[f32],
    w: Bf16z<'_>,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "bf16z::gemv";
    check_len(OP, "x elements (k)", w.k, x.len())?;
    let n_out = match epilogue {
        Epilogue::SwiGlu if w.n.is_multiple_of(2) => w.n / 2,
        Epilogue::SwiGlu => {
            return Err(KernelError::Invalid {
                op: OP,
                what: "SwiGLU needs an even number of rows",
            })
        }
        _ => w.n,
    };
    check_len(OP, "output elements", n_out, y.len())?;
    if let Epilogue::AddResidual(r) = epilogue {
        check_len(OP, "residual elements", n_out, r.len())?;
    }
    if !isa.min(Isa::detect()).avx2() {
        super::gemv::run_rows(
            pool,
            n_out,
            super::gemv::BLOCK,
            epilogue,
            y,
            &|r| w.dot_scalar(r, x),
            None,
            super::gemv::swiglu_scalar,
        );
        return Ok(());
    }
    X_PERM.with(|cell| {
        let mut xp = cell.borrow_mut();
        permute_x(x, &mut xp);
        let xp = &xp[..];
        // Four rows at a time: one accumulator per row, so four independent
        // FMA chains, and x loaded once for four rows.
        let dot4 = |r: usize, q: usize| {
            let rows = [r, r + q, r + 2 * q, r + 3 * q];
            // SAFETY: avx2 checked above; each row holds k/32 blocks and xp
            // is x permuted (k elements).
            let d = unsafe { avx2::dot4(rows.map(|r| w.row_blocks(r)), xp) };
            std::array::from_fn(|i| d[i] + w.corrections(rows[i], x))
        };
        super::gemv::run_rows(
            pool,
            n_out,
            super::gemv::BLOCK,
            epilogue,
            y,
            // SAFETY: as for dot4, one row.
            &|r| unsafe { avx2::dot(w.row_blocks(r), xp) } + w.corrections(r, x),
            Some(&dot4 as &(dyn Fn(usize, usize) -> [f32; 4] + Sync)),
            // As its several-token products: the scalar SwiGLU.
            super::gemv::swiglu_scalar,
        );
    });
    Ok(())
}

/// Output rows per group of the multi-token product.
const GROUP: usize = 256;

std::thread_local! {
    /// Decoded bf16 rows, permuted x and product scratch of [`matmul`], reused.
    static GROUP_SCRATCH: std::cell::RefCell<(Vec<u16>, Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// `y = x·Wᵀ` with `epilogue` for `s` activation rows and an encoded `W`
/// (`bytes`, `[n, k]`); the contract of [`super::matmul_with`], with the
/// kernels of `isa`. One row goes to [`gemv_at`]. More
/// rows are multiplied `GROUP` (256) output rows at a time: the group's
/// weight rows (gate and up rows for SwiGLU) are decoded to their coded
/// bf16 values, in the order the single-token kernel multiplies them (x
/// permuted to match), multiplied by the plain bf16 tiles of the same lane
/// width (AVX2 at every SIMD level, the portable path at
/// [`Isa::Scalar`]), and the exception corrections and the epilogue are
/// applied while scattering into `y`: each token's result is bit-identical
/// to [`gemv_at`]'s for it. Decoding costs one pass over the weights per
/// call, which a prefill chunk shares among its tokens.
#[allow(clippy::too_many_arguments)]
pub fn matmul_at(
    isa: Isa,
    pool: &ThreadPool,
    x: &[f32],
    s: usize,
    k: usize,
    bytes: &[u8],
    n: usize,
    epilogue: Epilogue<'_>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "bf16z::matmul";
    let w = Bf16z::parse(bytes, n, k)?;
    if s == 1 {
        return gemv_at(isa, pool, x, w, epilogue, y);
    }
    let swiglu = matches!(epilogue, Epilogue::SwiGlu);
    if swiglu && !n.is_multiple_of(2) {
        return Err(KernelError::Invalid {
            op: OP,
            what: "SwiGLU needs an even number of rows",
        });
    }
    let n_out = if swiglu { n / 2 } else { n };
    let len = |a: usize, b: usize| crate::kernels::mul_dims(OP, "size overflows", a, b);
    check_len(OP, "x elements (s*k)", len(s, k)?, x.len())?;
    check_len(OP, "output elements", len(s, n_out)?, y.len())?;
    if let Epilogue::AddResidual(r) = epilogue {
        check_len(OP, "residual elements", len(s, n_out)?, r.len())?;
    }
    let simd = isa.min(Isa::detect()).avx2();
    let level = if simd { Isa::Avx2 } else { Isa::Scalar };
    GROUP_SCRATCH.with(|cell| {
        let (wbuf, xbuf, tmp) = &mut *cell.borrow_mut();
        let per = if swiglu { 2 } else { 1 };
        wbuf.resize(per * GROUP * k, 0);
        tmp.resize(s * per * GROUP, 0.0);
        let xp: &[f32] = if simd {
            xbuf.clear();
            for row in x.chunks_exact(k) {
                xbuf.extend(row.chunks_exact(BLOCK).flat_map(|b| ORDER.map(|i| b[i])));
            }
            xbuf
        } else {
            x
        };
        for j0 in (0..n_out).step_by(GROUP) {
            let g = GROUP.min(n_out - j0);
            w.decode_coded_rows(pool, j0, &mut wbuf[..g * k], simd);
            if swiglu {
                w.decode_coded_rows(pool, n_out + j0, &mut wbuf[g * k..2 * g * k], simd);
            }
            if cfg!(target_endian = "big") {
                wbuf.iter_mut().for_each(|v| *v = v.to_le());
            }
            let rows = &wbuf[..per * g * k];
            // SAFETY: any u16 slice is a valid byte slice of twice the
            // length (alignment 1); the values are little-endian (above).
            let bytes = unsafe {
                std::slice::from_raw_parts(rows.as_ptr().cast::<u8>(), std::mem::size_of_val(rows))
            };
            let wr = crate::kernels::WeightRef::new(crate::ir::DType::BF16, bytes);
            let gw = per * g;
            let t = &mut tmp[..s * gw];
            super::matmul_with(
                pool,
                level,
                crate::kernels::LinearArgs::new(xp, s, k, wr, gw, Epilogue::None),
                t,
            )?;
            for (tok, tr) in t.chunks_exact(gw).enumerate() {
                let xt = &x[tok * k..(tok + 1) * k];
                let o = tok * n_out + j0;
                let yr = &mut y[o..o + g];
                for (i, out) in yr.iter_mut().enumerate() {
                    let v = tr[i] + w.corrections(j0 + i, xt);
                    *out = match epilogue {
                        Epilogue::None => v,
                        Epilogue::Accumulate => *out + v,
                        Epilogue::AddResidual(r) => v + r[o + i],
                        Epilogue::SwiGlu => {
                            let u = tr[g + i] + w.corrections(n_out + j0 + i, xt);
                            crate::kernels::elementwise::silu_f32(v) * u
                        }
                    };
                }
            }
        }
        Ok(())
    })
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(test)]
mod tests;
