//! Register tiles shared by the SIMD levels, and the summation order that
//! makes every product **batch-invariant**.
//!
//! A tile computes up to [`RT`] weight rows × up to `TT` tokens of dot
//! products, one vector accumulator of `L` lanes per (row, token) pair
//! (`L` = 8 at [`Isa::Avx2`](crate::kernels::Isa::Avx2), 16 at the AVX-512
//! levels). For every pair the arithmetic is the same whatever the tile
//! shape, so it does not depend on how many tokens a call has or where a
//! token sits among them (nor on the thread count or chunking):
//!
//! * lane `l` accumulates the products of elements `e ≡ l (mod L)`, `e`
//!   increasing, with fused multiply-adds, starting from +0;
//! * a last partial group of elements is zero-padded to `L` lanes and
//!   multiply-added like the others;
//! * the `L` lanes are summed by one fixed tree (the level's `hsum4`).
//!
//! A single-token product (GEMV, memory-bound) runs the same tiles with one
//! token: four rows at once give four independent FMA chains. Several tokens
//! (GEMM, compute-bound) run `RT × TT` tiles over contiguous ranges of output
//! columns sized for L2, tokens in groups; F16/BF16 row tiles are widened to
//! f32 once per token group (exact, so the sums are unchanged). Epilogues are
//! applied per tile by the caller's `emit`.
//!
//! The server batches several sequences' tokens into one step; with this
//! order a sequence's logits are bit-identical to running it alone.

// Register tiles are indexed explicitly on purpose.
#![allow(clippy::needless_range_loop)]

use crate::ir::DType;

pub(crate) mod simd;

/// Weight-row tile (accumulator rows).
pub(crate) const RT: usize = 4;
/// Largest token tile of any level.
pub(crate) const MAX_TT: usize = 9;

/// A tile's sums: `[token][row]`.
pub(crate) type Sums = [[f32; RT]; MAX_TT];

/// Receives the sums of a weight-row tile for a group of tokens: `(first
/// token, first column, columns, sums)`.
pub(crate) type Emit<'a> = dyn FnMut(usize, usize, usize, &[[f32; RT]]) + 'a;

/// Weight dtype codes of the tile kernels.
pub(crate) const F32: u8 = 0;
pub(crate) const F16: u8 = 1;
pub(crate) const BF16: u8 = 2;

/// The tile dtype code of a plain weight dtype.
pub(crate) fn code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => F32,
        DType::F16 => F16,
        DType::BF16 => BF16,
        _ => unreachable!("plain dtypes only (checked by the callers)"),
    }
}

/// Bytes per element of a dtype code.
pub(crate) const fn elem_size(dt: u8) -> usize {
    if dt == F32 {
        4
    } else {
        2
    }
}

/// The operands of one tile: `t` tokens of `x` (`1 <= t <= TT`; rows of `k`
/// f32, row stride `k`) against `r` weight rows (`1 <= r <= RT`; `w[i]` for
/// `i < r` points to `k` elements of dtype `dt`).
#[derive(Clone, Copy)]
pub(crate) struct Tile<'a> {
    pub(crate) dt: u8,
    pub(crate) r: usize,
    pub(crate) t: usize,
    pub(crate) x: *const f32,
    pub(crate) k: usize,
    pub(crate) w: &'a [*const u8; RT],
    /// Software prefetch distance in bytes (0: none): while multiplying
    /// element `e` of each row the tile touches the byte `pf` past it
    /// (prefetches never fault, so it may point past the weights).
    pub(crate) pf: usize,
}

/// The tile kernels of one SIMD level.
pub(crate) trait Tiles {
    /// Tokens per full tile (at most [`MAX_TT`]).
    const TT: usize;

    /// Most tokens of a two-row tile in a step of [`PAIR_MIN`] to
    /// [`PAIR_MAX`] tokens (0: such steps run the tiles of `TT` too). See
    /// [`pair_tiles`].
    const PAIR_TT: usize = 0;

    /// Most tokens of a one-row tile, which F16 steps of more than
    /// [`Tiles::PAIR_TT`] tokens and at most this many run (0: none). See
    /// [`pair_tiles`].
    const ROW_TT: usize = 0;

    /// Rows ahead of the row being multiplied whose weights a single-token
    /// product prefetches (0: none; [`Tiles::GEMV_PREFETCH`] overrides it).
    /// Above 0, several-token products prefetch too ([`columns`]).
    const PREFETCH_ROWS: usize = 0;

    /// Bytes ahead of each row's position that a single-token product
    /// prefetches, whatever the row length (0: [`Tiles::PREFETCH_ROWS`]
    /// rows ahead instead).
    const GEMV_PREFETCH: usize = 0;

    /// `out[j][i] = dot(x[j], w[i])` for `j < t`, `i < r` of the operands
    /// `op`, in the order described in the module docs.
    ///
    /// # Safety
    /// The CPU supports the level; `op` is as [`Tile`] describes.
    unsafe fn tile(op: Tile<'_>, out: &mut Sums);

    /// `g[i] = silu(g[i]) * u[i]` elementwise, with this level's vector
    /// formula: an element's bits depend on its own inputs alone, so
    /// single-token and several-token products agree however they batch
    /// their outputs.
    ///
    /// Every level is an x86 SIMD level, and all apply the AVX2 SwiGLU of
    /// `elementwise::silu` (it gives the bits of the AVX-512 one).
    ///
    /// # Panics
    /// If the lengths differ.
    fn swiglu(g: &mut [f32], u: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a level's kernels run only on CPUs that have it, and
        // every SIMD level includes AVX2 and FMA (`Isa::detect`).
        unsafe {
            crate::kernels::elementwise::silu::swiglu_slice_avx2(g, u)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (g, u);
            unreachable!("no x86 SIMD on this architecture");
        }
    }

    /// Whether several-token products widen F16 row tiles to f32 once per
    /// token group ([`columns`]) rather than convert them in registers
    /// once per token tile.
    const WIDEN_F16: bool = true;

    /// Converts `k` elements of dtype `dt` at `src` to f32 at `dst`.
    ///
    /// # Safety
    /// The CPU supports the level; `k` elements at `src`, `k` floats at `dst`.
    unsafe fn widen(dt: u8, src: *const u8, k: usize, dst: *mut f32);
}

/// One row's dot product with `x` (`k` elements): the tile order with one
/// row and one token.
///
/// # Safety
/// As [`Tiles::tile`] with `r = t = 1`.
#[inline]
pub(crate) unsafe fn dot1<K: Tiles>(dt: u8, row: *const u8, x: *const f32, k: usize) -> f32 {
    let mut out = [[0f32; RT]; MAX_TT];
    let w = [row, row, row, row];
    // SAFETY: forwarded.
    unsafe {
        K::tile(
            Tile {
                dt,
                r: 1,
                t: 1,
                x,
                k,
                w: &w,
                pf: gemv_prefetch::<K>(dt, k),
            },
            &mut out,
        )
    };
    out[0][0]
}

/// The prefetch distance of a single-token product's tiles over rows of
/// `k` elements of dtype `dt`.
#[inline]
fn gemv_prefetch<K: Tiles>(dt: u8, k: usize) -> usize {
    if K::GEMV_PREFETCH > 0 {
        K::GEMV_PREFETCH
    } else {
        K::PREFETCH_ROWS * k * elem_size(dt)
    }
}

/// Four rows' dot products with `x`.
///
/// # Safety
/// As [`Tiles::tile`] with `r = 4`, `t = 1`.
#[inline]
pub(crate) unsafe fn dot4<K: Tiles>(
    dt: u8,
    rows: [*const u8; RT],
    x: *const f32,
    k: usize,
) -> [f32; RT] {
    let mut out = [[0f32; RT]; MAX_TT];
    // SAFETY: forwarded.
    unsafe {
        K::tile(
            Tile {
                dt,
                r: RT,
                t: 1,
                x,
                k,
                w: &rows,
                pf: gemv_prefetch::<K>(dt, k),
            },
            &mut out,
        )
    };
    out[0]
}

/// Steps of this many tokens or fewer, down to [`PAIR_MIN`], run the
/// two-row tiles of [`Tiles::PAIR_TT`] at the levels that have them (F16
/// steps of more than `PAIR_TT` tokens the one-row tiles of
/// [`Tiles::ROW_TT`]).
pub(crate) const PAIR_MAX: usize = 9;
/// [`PAIR_MAX`] for F32 weights.
pub(crate) const PAIR_MAX_F32: usize = 7;
/// Fewest tokens of a step that runs the two-row tiles (2 and 3 tokens
/// stream the weights at the single-token rate with the four-row tiles).
pub(crate) const PAIR_MIN: usize = 4;

/// Which weight rows one output tile reads, relative to the weight tensor.
#[derive(Clone, Copy)]
pub(crate) enum RowLayout {
    /// Output column `c` is weight row `c`.
    Plain,
    /// Output column `c` needs gate row `c` and up row `up + c`.
    GateUp { up: usize },
}

/// Bytes of x one token group may span (it is re-read from L2 for every
/// weight-row tile of the chunk).
const TOKEN_GROUP_BYTES: usize = 384 << 10;

/// Tokens per group: one weight-row tile (widened once, for F16/BF16) is
/// reused from L1 by this many tokens before the next tile is loaded. As
/// many as fit [`TOKEN_GROUP_BYTES`], 48..=144, a multiple of the tile.
fn token_group(k: usize, tt: usize) -> usize {
    (TOKEN_GROUP_BYTES / (k * 4) / tt * tt).clamp(48, MAX_TOKEN_GROUP)
}

/// Most tokens in a group.
pub(crate) const MAX_TOKEN_GROUP: usize = 144;

/// The sums of one weight-row tile for a whole token group, emitted at
/// once (at small K, 576 in SmolLM2, a call per token tile cost as much as
/// a tenth of the tiles), with room for a last full tile past the group.
type GroupSums = [[f32; RT]; MAX_TOKEN_GROUP + MAX_TT];

/// How many row tiles ahead the first token tile of a row tile prefetches
/// (see [`columns`]).
const PREFETCH_TILES: usize = 2;

/// Largest K whose F16/BF16 row tiles are widened into a stack buffer
/// (beyond it they are converted in registers, once per token tile).
const WIDEN_MAX_K: usize = 4096;

/// Computes output columns `c0..c1` for all `s` tokens of `x` (`[s, k]`)
/// against the weights at `w` (`[*, k]` of dtype `dt`, rows chosen by
/// `layout`), calling `emit(t, c, nc, sums)` for each weight-row tile and
/// group of tokens: `sums[j]` holds,
/// for token `t + j`, the dot products with the tile's weight rows — `nc`
/// plain rows (`c..c+nc`), or for [`RowLayout::GateUp`] the `nc` gate rows
/// followed by the `nc` up rows.
///
/// # Safety
/// The CPU supports `K`'s level; `x` holds `s * k` floats; every weight row
/// the layout names for columns `c0..c1` lies within the allocation at `w`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn columns<K: Tiles>(
    x: *const f32,
    s: usize,
    k: usize,
    w: *const u8,
    dt: u8,
    layout: RowLayout,
    c0: usize,
    c1: usize,
    emit: &mut Emit<'_>,
) {
    let rb = k * elem_size(dt);
    let null = std::ptr::null::<u8>();
    let token_group = token_group(k, K::TT);
    // Written by `widen` before every read; left uninitialised so calls that
    // never widen pay nothing for it.
    let mut wbuf_mem = std::mem::MaybeUninit::<[f32; RT * WIDEN_MAX_K]>::uninit();
    let wbuf = wbuf_mem.as_mut_ptr().cast::<f32>();
    let mut sums: GroupSums = [[0f32; RT]; MAX_TOKEN_GROUP + MAX_TT];
    // SAFETY: the caller guarantees rows of the layout and tokens below s
    // are in bounds; only those are addressed.
    unsafe {
        let row = |r: usize| w.add(r * rb);
        let mut t0 = 0;
        while t0 < s {
            let t1 = (t0 + token_group).min(s);
            // Widening pays off when a tile is reused by several tokens.
            let widen = dt != F32 && (dt != F16 || K::WIDEN_F16) && k <= WIDEN_MAX_K && t1 - t0 > 1;
            let mut c = c0;
            while c < c1 {
                let (p, r, nc) = match layout {
                    RowLayout::Plain => {
                        let nc = (c1 - c).min(RT);
                        let mut p = [null; RT];
                        for (i, q) in p.iter_mut().enumerate().take(nc) {
                            *q = row(c + i);
                        }
                        (p, nc, nc)
                    }
                    RowLayout::GateUp { up } => {
                        if c + 2 <= c1 {
                            ([row(c), row(c + 1), row(up + c), row(up + c + 1)], 4, 2)
                        } else {
                            ([row(c), row(up + c), null, null], 2, 1)
                        }
                    }
                };
                if widen {
                    let mut q = [null; RT];
                    for i in 0..r {
                        let dst = wbuf.add(i * k);
                        K::widen(dt, p[i], k, dst);
                        q[i] = dst.cast::<u8>().cast_const();
                    }
                    token_tiles::<K>(&mut sums, F32, r, x, k, t0, t1, &q, 0, c, nc, emit);
                } else {
                    // The first token group reads the weights from memory:
                    // at the levels whose single-token product prefetches,
                    // its first token tile prefetches the row tile
                    // PREFETCH_TILES on (`nc` columns per tile, the same
                    // offset in each of its rows), as a single-token product
                    // streams rows; the other token tiles read this one from
                    // L1.
                    let pf = if t0 == 0 && K::PREFETCH_ROWS > 0 {
                        PREFETCH_TILES * nc * rb
                    } else {
                        0
                    };
                    if let Some((rows, tt)) = few_plan::<K>(dt, s) {
                        pair_tiles::<K>(&mut sums, dt, r, x, k, s, &p, pf, rows, tt);
                        emit(0, c, nc, &sums[..s]);
                    } else {
                        token_tiles::<K>(&mut sums, dt, r, x, k, t0, t1, &p, pf, c, nc, emit);
                    }
                }
                c += nc;
            }
            t0 = t1;
        }
    }
}

/// The tiles of a step of a few tokens (`s` in [`PAIR_MIN`]..=[`PAIR_MAX`],
/// one token group) for one weight-row tile: its rows `rows` at a time
/// (two, or one for F16 steps of 8 and 9 tokens: [`few_plan`]), each group
/// of rows against all `s` tokens in as few tiles of at most `tt` tokens
/// as can be (two rows: 8 tokens as 4 + 4, 9 as 5 + 4), the first tile of
/// each group prefetching with distance `pf` ([`Tile::pf`]).
///
/// A step of 4 to 9 tokens is a speculative verification step. Four-row
/// tiles of at most `TT` = 3 tokens converted each F16 weight vector once
/// per 3 tokens, in a loop whose converted vector the FMAs wait for; a
/// pair of rows against up to 7 tokens converts it once per step and
/// multiplies each x vector it loads into both rows (see
/// `tiles::simd::steps`). At 8 and 9 tokens two tiles per pair convert
/// every F16 weight vector twice (one conversion per 4 FMAs, where
/// `VCVTPH2PS` competes with the FMAs for the pipes); one row against all
/// 8 or 9 tokens (9 accumulators) converts it once: on the 2-vCPU Zen 1
/// VM `HEAD=1 DTYPES=f16 fgemm_steps 1 9` (the SmolLM2-135M products of a
/// verification step with logits at every position) went from 98/110 ms
/// at S = 8/9 to 81-89/91-98 ms, about S = 7's cost plus one token's
/// FMAs. The sums do not change: the tile shape never changes a sum.
///
/// # Safety
/// As [`columns`]: tokens `0..s` of `x` and `r` rows at `w` exist.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn pair_tiles<K: Tiles>(
    sums: &mut GroupSums,
    dt: u8,
    r: usize,
    x: *const f32,
    k: usize,
    s: usize,
    w: &[*const u8; RT],
    pf: usize,
    rows: usize,
    tt: usize,
) {
    let null = std::ptr::null::<u8>();
    let tiles = s.div_ceil(tt);
    let mut out: Sums = [[0f32; RT]; MAX_TT];
    let mut i0 = 0;
    while i0 < r {
        let ri = (r - i0).min(rows);
        let mut q = [null; RT];
        q[..ri].copy_from_slice(&w[i0..i0 + ri]);
        let mut t = 0;
        for n in 0..tiles {
            // The tokens left shared evenly among the tiles left.
            let nt = (s - t) / (tiles - n);
            // SAFETY: forwarded; tokens t..t+nt < s exist, ri rows at q.
            unsafe {
                K::tile(
                    Tile {
                        dt,
                        r: ri,
                        t: nt,
                        x: x.add(t * k),
                        k,
                        w: &q,
                        pf: if n == 0 { pf } else { 0 },
                    },
                    &mut out,
                );
            }
            for j in 0..nt {
                sums[t + j][i0..i0 + ri].copy_from_slice(&out[j][..ri]);
            }
            t += nt;
        }
        i0 += ri;
    }
}

/// Rows and most tokens per tile of a step of `s` tokens that runs
/// [`pair_tiles`] (None: the token tiles of [`Tiles::TT`]).
fn few_plan<K: Tiles>(dt: u8, s: usize) -> Option<(usize, usize)> {
    if dt == F16 && s > K::PAIR_TT && s <= K::ROW_TT {
        return Some((1, K::ROW_TT));
    }
    // F32 steps of 8 and 9 tokens (two tiles per pair) measured no faster
    // than the four-row tiles, nor did one-row tiles of 8 and 9 tokens.
    let pair_max = if dt == F32 { PAIR_MAX_F32 } else { PAIR_MAX };
    (K::PAIR_TT > 0 && (PAIR_MIN..=pair_max).contains(&s)).then_some((2, K::PAIR_TT))
}

/// Token tiles of `K::TT` (then the remainder; never a last tile of one
/// token after a full one) for one weight-row tile, the first with prefetch
/// distance `pf` ([`Tile::pf`]).
///
/// # Safety
/// As [`columns`]: tokens `t0..t1` of `x` and `r` rows at `w` exist.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn token_tiles<K: Tiles>(
    sums: &mut GroupSums,
    dt: u8,
    r: usize,
    x: *const f32,
    k: usize,
    t0: usize,
    t1: usize,
    w: &[*const u8; RT],
    pf: usize,
    c: usize,
    nc: usize,
    emit: &mut Emit<'_>,
) {
    let mut t = t0;
    while t < t1 {
        // TT + 1 tokens left run as TT - 1 and 2: a one-token tile has a
        // quarter of the independent FMA chains the pipes need (a 4x1 tile
        // is bound by FMA latency), and the tile shape does not change any
        // sum.
        let nt = match t1 - t {
            n if n == K::TT + 1 && K::TT > 2 => K::TT - 1,
            n => n.min(K::TT),
        };
        // SAFETY: forwarded; tokens t..t+nt exist; rows t - t0 onwards of
        // `sums` (at most MAX_TOKEN_GROUP - 1 + MAX_TT of them) are a `Sums`.
        unsafe {
            let out = &mut *sums.as_mut_ptr().add(t - t0).cast::<Sums>();
            K::tile(
                Tile {
                    dt,
                    r,
                    t: nt,
                    x: x.add(t * k),
                    k,
                    w,
                    pf: if t == t0 { pf } else { 0 },
                },
                out,
            );
        }
        t += nt;
    }
    emit(t0, c, nc, &sums[..t1 - t0]);
}
