//! Linear layers: `y[s, n] = sum_k x[s, k] * W[n, k]` with `W` stored
//! `[N, K]` (PyTorch order) in F32, F16 or BF16, plus fused epilogues.
//!
//! At the SIMD levels every product runs the register tiles of `tiles`
//! (`avx2`: 8 lanes, `avx512`: 16 lanes): one token ([`gemv`], memory-bound)
//! streams weight rows four at a time; several tokens split the output
//! columns into contiguous chunks sized for L2 and run row × token tiles
//! over the full K. Each (row, token) sum is computed in one fixed order
//! whatever the number of tokens, so results are **batch-invariant**: a
//! token's outputs are bit-identical whether it is multiplied alone or with
//! others, at any position (see `tiles`). At [`Isa::Scalar`] a portable path
//! does the same with its own fixed order (K blocks of 256, 8 partial sums
//! each). Epilogues are applied as sums are stored. [`matmul_with`] picks a
//! level explicitly (tests and benches run every level the CPU has);
//! [`matmul_bf16_dot`] is the opt-in bf16-activation product (`bf16dot`,
//! AVX-512 BF16; not batch-invariant, not used by the runtime).

pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod bf16dot;
pub mod bf16z;
pub mod gemv;
pub(crate) mod tiles;

use self::tiles::{RowLayout, Tiles};
use super::isa::Isa;
use super::{check_len, mul_dims, KernelError, LinearArgs, WeightRef};
use crate::ir::DType;
use crate::pool::{SyncPtr, ThreadPool};

/// What to do with the raw products before storing them in `y`.
#[derive(Clone, Copy, Debug)]
pub enum Epilogue<'a> {
    /// `y = x·Wᵀ`; `y` is `[S, N]`.
    None,
    /// `y += x·Wᵀ` (in-place residual add); `y` is `[S, N]`.
    Accumulate,
    /// `y = x·Wᵀ + r`; `r` and `y` are `[S, N]`.
    AddResidual(&'a [f32]),
    /// `W` is a packed `[2F, K]` gate/up weight (gate rows first, then up
    /// rows); `y` is `[S, F]` with `y[s, f] = silu(g[s, f]) * u[s, f]`.
    SwiGlu,
}

/// Tokens per block in the S>1 path (a multiple of the 3- and 6-token
/// SIMD tiles).
pub const TOKEN_BLOCK: usize = 24;
const _: () = assert!(TOKEN_BLOCK <= bf16dot::MAX_NS);
/// Largest number of output columns per chunk (half of it with SwiGLU,
/// whose chunks compute gate and up columns). Large chunks amortise packing
/// the x block; weights are read once per token block either way, which at
/// 24 tokens is far below memory bandwidth.
const MAX_CHUNK_ROWS: usize = 256;
/// Largest chunk for a single token (GEMV is memory-bound; smaller chunks
/// balance better).
const MAX_GEMV_CHUNK_ROWS: usize = 64;

/// What a call asks for: the kernels of a level, or the bf16 dot product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Level(Isa),
    /// Activations rounded to bf16 and `VDPBF16PS` (about 2× the
    /// arithmetic rate; results differ by the activation rounding, as in
    /// llama.cpp's BF16 path), for BF16 weights on CPUs with AVX-512 BF16;
    /// otherwise as `Level` of the same level.
    Bf16Dot(Isa),
}

/// The tile implementation chosen for one call.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Portable,
    Avx2,
    Avx512,
    Bf16Dot,
}

/// Computes `x·Wᵀ` with `epilogue` into `y` with the kernels of `isa` (a
/// level above what this CPU supports runs the best one it has); the
/// runtime calls it through [`Kernels::matmul`](crate::kernels::Kernels).
///
/// * `x`: `[s, k]` f32; `w`: `[n, k]` in its stored dtype;
/// * `y`: `[s, n]`, or `[s, n/2]` for [`Epilogue::SwiGlu`] (then `n` must be even).
///
/// No scratch is needed; nothing is allocated.
pub fn matmul_with(
    pool: &ThreadPool,
    isa: Isa,
    a: LinearArgs<'_>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    matmul_mode(pool, Mode::Level(isa), a, y)
}

/// [`matmul_with`] with activations rounded to bf16 and the AVX-512 BF16 dot
/// product for BF16 weights, where `isa` and the CPU have it (an opt-in trade of
/// accuracy for speed); otherwise exactly [`matmul_with`].
pub fn matmul_bf16_dot(
    pool: &ThreadPool,
    isa: Isa,
    a: LinearArgs<'_>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    matmul_mode(pool, Mode::Bf16Dot(isa), a, y)
}

fn matmul_mode(
    pool: &ThreadPool,
    mode: Mode,
    a: LinearArgs<'_>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "matmul";
    let (x, s, k, w, n, epilogue) = (a.x, a.s, a.k, a.w, a.n, a.epilogue);
    w.elem_size(OP)?;
    check_len(
        OP,
        "x elements (s*k)",
        mul_dims(OP, "s*k overflows", s, k)?,
        x.len(),
    )?;
    w.check_elems(OP, mul_dims(OP, "n*k overflows", n, k)?)?;
    let n_out = match epilogue {
        Epilogue::SwiGlu => {
            if !n.is_multiple_of(2) {
                return Err(KernelError::Invalid {
                    op: OP,
                    what: "SwiGlu needs an even number of weight rows (gate and up)",
                });
            }
            n / 2
        }
        _ => n,
    };
    let y_len = mul_dims(OP, "s*n overflows", s, n_out)?;
    check_len(OP, "y elements", y_len, y.len())?;
    if let Epilogue::AddResidual(r) = epilogue {
        check_len(OP, "residual elements", y_len, r.len())?;
    }
    if s == 0 || n_out == 0 {
        return Ok(());
    }
    if k == 0 {
        // Empty sums: apply the epilogue to zeros.
        for (i, v) in y.iter_mut().enumerate() {
            *v = match epilogue {
                Epilogue::None | Epilogue::SwiGlu => 0.0,
                Epilogue::Accumulate => *v,
                Epilogue::AddResidual(r) => r[i],
            };
        }
        return Ok(());
    }
    let isa = match mode {
        Mode::Level(l) | Mode::Bf16Dot(l) => l.min(Isa::detect()),
    };
    let path = match mode {
        Mode::Bf16Dot(_) if w.dtype == DType::BF16 && isa.avx512_bf16() => Path::Bf16Dot,
        _ if s == 1 => return gemv::gemv_at(isa, pool, a, y),
        _ if isa.avx512() => Path::Avx512,
        _ if isa.avx2() => Path::Avx2,
        _ => Path::Portable,
    };
    match path {
        Path::Avx512 => run_columns::<avx512::Avx512>(pool, a, n_out, y),
        Path::Avx2 => run_columns::<avx2::Avx2>(pool, a, n_out, y),
        Path::Portable | Path::Bf16Dot => {
            let max_rows = match (s, epilogue) {
                (1, _) => MAX_GEMV_CHUNK_ROWS,
                (_, Epilogue::SwiGlu) => MAX_CHUNK_ROWS / 2,
                _ => MAX_CHUNK_ROWS,
            };
            let rows = chunk_rows(n_out, max_rows, pool.n_threads());
            let n_chunks = n_out.div_ceil(rows);
            let yp = SyncPtr::new(y);
            pool.run(n_chunks, &|c| {
                let r0 = c * rows;
                let r1 = (r0 + rows).min(n_out);
                run_chunk(path, a, n_out, r0, r1, yp);
            });
        }
    }
    Ok(())
}

/// Weight bytes one chunk of the tiled path reads: they stay in L2 while
/// every token passes over them.
const CHUNK_BYTES: usize = 256 << 10;

/// The tiled path for several tokens: contiguous ranges of output columns,
/// sized so their weight rows fit in L2 and there are about eight per
/// thread, each computed by [`tiles::columns`] with the level's kernels
/// (`n_out` output columns).
fn run_columns<K: Tiles>(pool: &ThreadPool, a: LinearArgs<'_>, n_out: usize, y: &mut [f32]) {
    let (x, s, k, w, epilogue) = (a.x, a.s, a.k, a.w, a.epilogue);
    let dt = tiles::code(w.dtype);
    let es = tiles::elem_size(dt);
    let (layout, rows_per_col) = match epilogue {
        Epilogue::SwiGlu => (RowLayout::GateUp { up: n_out }, 2),
        _ => (RowLayout::Plain, 1),
    };
    let last_row = n_out * rows_per_col;
    assert!(x.len() >= s * k && last_row * k * es <= w.bytes.len() && k > 0);
    let by_cache = (CHUNK_BYTES / (k * es * rows_per_col)).max(4) / 4 * 4;
    // About eight chunks per thread: with nothing packed per chunk, small
    // chunks cost little and absorb a thread being descheduled.
    let by_balance = n_out.div_ceil(pool.n_threads() * 8).div_ceil(4) * 4;
    let cols = by_balance.min(by_cache).max(4);
    let n_chunks = n_out.div_ceil(cols);
    let yp = SyncPtr::new(y);
    pool.run(n_chunks, &|ci| {
        let c0 = ci * cols;
        let c1 = (c0 + cols).min(n_out);
        // A token group's gates and ups for the SwiGLU (nc <= RT / 2 each).
        const MAX: usize = tiles::MAX_TOKEN_GROUP * tiles::RT / 2;
        let (mut g, mut u) = ([0f32; MAX], [0f32; MAX]);
        let mut emit = |t: usize, c: usize, nc: usize, sums: &[[f32; tiles::RT]]| {
            if let Epilogue::SwiGlu = epilogue {
                // The group's gates (nc per token; its ups follow them in
                // each row of sums) through the level's SwiGLU at once.
                let m = sums.len() * nc;
                // Element by element: copies of nc <= 2 floats would be
                // calls to memcpy (5% of a SmolLM2 F16 pp512 went there).
                for (j, v) in sums.iter().enumerate() {
                    for i in 0..nc {
                        g[j * nc + i] = v[i];
                        u[j * nc + i] = v[nc + i];
                    }
                }
                K::swiglu(&mut g[..m], &u[..m]);
                for j in 0..sums.len() {
                    // SAFETY: as below.
                    let yrow = unsafe { yp.slice((t + j) * n_out + c, nc) };
                    for i in 0..nc {
                        yrow[i] = g[j * nc + i];
                    }
                }
                return;
            }
            for (j, v) in sums.iter().enumerate() {
                let at = (t + j) * n_out + c;
                // SAFETY: this chunk alone owns columns c0..c1 (c + nc <= c1)
                // of every row of y (s * n_out elements); y outlives `run`.
                let yrow = unsafe { yp.slice(at, nc) };
                match epilogue {
                    // A whole tile as one 16-byte move, not a memcpy call.
                    Epilogue::None => match <&mut [f32; tiles::RT]>::try_from(&mut *yrow) {
                        Ok(full) => *full = *v,
                        Err(_) => (0..nc).for_each(|i| yrow[i] = v[i]),
                    },
                    Epilogue::Accumulate => {
                        yrow.iter_mut().zip(v).for_each(|(o, a)| *o += a);
                    }
                    Epilogue::AddResidual(r) => {
                        for ((o, a), b) in yrow.iter_mut().zip(v).zip(&r[at..at + nc]) {
                            *o = a + b;
                        }
                    }
                    Epilogue::SwiGlu => unreachable!("applied above"),
                }
            }
        };
        // SAFETY: the level was checked supported (`isa` is capped by
        // `Isa::detect`); x holds s*k floats and every weight row below
        // `last_row` lies in `w.bytes` (asserted above).
        unsafe {
            tiles::columns::<K>(
                x.as_ptr(),
                s,
                k,
                w.bytes.as_ptr(),
                dt,
                layout,
                c0,
                c1,
                &mut emit,
            )
        };
    });
}

/// Output columns per chunk: at most `max_rows`, and about four chunks per
/// thread for load balance. Multiple of 8.
fn chunk_rows(n_out: usize, max_rows: usize, threads: usize) -> usize {
    let by_balance = n_out.div_ceil(threads * 4).div_ceil(8) * 8;
    by_balance.clamp(8, max_rows)
}

/// Output columns `r0..r1` of `n_out` for all tokens.
fn run_chunk(path: Path, a: LinearArgs<'_>, n_out: usize, r0: usize, r1: usize, y: SyncPtr<f32>) {
    let (x, s, k, w, epilogue) = (a.x, a.s, a.k, a.w, a.epilogue);
    let nr = r1 - r0;
    // Gate (or plain) sums in the first half, SwiGLU up sums in the second.
    let mut buf = [0f32; TOKEN_BLOCK * MAX_CHUNK_ROWS];
    let (acc, acc_up): (&mut [f32], &mut [f32]) = if matches!(epilogue, Epilogue::SwiGlu) {
        buf.split_at_mut(TOKEN_BLOCK * MAX_CHUNK_ROWS / 2)
    } else {
        (&mut buf[..], &mut [])
    };
    let mut s0 = 0;
    while s0 < s {
        let ns = (s - s0).min(TOKEN_BLOCK);
        let xb = &x[s0 * k..(s0 + ns) * k];
        let out = &mut acc[..ns * nr];
        block(path, xb, ns, k, w, r0, nr, out);
        if let Epilogue::SwiGlu = epilogue {
            block(path, xb, ns, k, w, n_out + r0, nr, &mut acc_up[..ns * nr]);
        }
        for t in 0..ns {
            // SAFETY: this chunk alone owns columns r0..r1 of each row of y
            // (`y` has s * n_out elements and r1 <= n_out); y outlives `run`.
            let yrow = unsafe { y.slice((s0 + t) * n_out + r0, nr) };
            let arow = &acc[t * nr..(t + 1) * nr];
            match epilogue {
                Epilogue::None => yrow.copy_from_slice(arow),
                Epilogue::Accumulate => yrow.iter_mut().zip(arow).for_each(|(o, a)| *o += a),
                Epilogue::AddResidual(r) => {
                    let rrow = &r[(s0 + t) * n_out + r0..(s0 + t) * n_out + r1];
                    for ((o, a), b) in yrow.iter_mut().zip(arow).zip(rrow) {
                        *o = a + b;
                    }
                }
                Epilogue::SwiGlu => {
                    let urow = &acc_up[t * nr..(t + 1) * nr];
                    for ((o, g), u) in yrow.iter_mut().zip(arow).zip(urow) {
                        *o = crate::kernels::elementwise::silu_f32(*g) * u;
                    }
                }
            }
        }
        s0 += ns;
    }
}

/// K block of the portable path.
const PORTABLE_KB: usize = 256;

/// `out[t * nr + r] = dot(x[t], W[row0 + r])` for `t < ns`, `r < nr`.
#[allow(clippy::too_many_arguments)]
fn block(
    path: Path,
    x: &[f32],
    ns: usize,
    k: usize,
    w: WeightRef<'_>,
    row0: usize,
    nr: usize,
    out: &mut [f32],
) {
    if path == Path::Bf16Dot {
        return bf16dot::block(x, ns, k, w.bytes, row0, nr, out);
    }
    // The portable path.
    let mut wbuf = [0f32; PORTABLE_KB];
    out[..ns * nr].fill(0.0);
    for r in 0..nr {
        let base = (row0 + r) * k;
        let mut k0 = 0;
        while k0 < k {
            let kl = (k - k0).min(PORTABLE_KB);
            w.read_into(base + k0, &mut wbuf[..kl]);
            for t in 0..ns {
                let xr = &x[t * k + k0..t * k + k0 + kl];
                out[t * nr + r] += dot8(&wbuf[..kl], xr);
            }
            k0 += kl;
        }
    }
}

/// The portable level's dot product of a weight row with `x`, in the
/// order [`block`] gives every (row, token) pair: K blocks of 256,
/// each summed by [`dot8`], added in order to a sum starting at 0.
/// `fill(k0, buf)` writes weights `k0..k0 + buf.len()` of the row as f32.
pub(crate) fn portable_dot_with(x: &[f32], fill: &mut dyn FnMut(usize, &mut [f32])) -> f32 {
    let k = x.len();
    let mut wbuf = [0f32; PORTABLE_KB];
    let mut sum = 0f32;
    let mut k0 = 0;
    while k0 < k {
        let kl = (k - k0).min(PORTABLE_KB);
        fill(k0, &mut wbuf[..kl]);
        sum += dot8(&wbuf[..kl], &x[k0..k0 + kl]);
        k0 += kl;
    }
    sum
}

/// Dot product with 8 independent partial sums (vectorisable).
#[inline(always)]
pub(crate) fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    let s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    s + tail
}

/// Floating-point operations of one matmul call (2·S·N·K), for benches.
pub fn flops(s: usize, n: usize, k: usize) -> f64 {
    2.0 * s as f64 * n as f64 * k as f64
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::kernels::testutil::{assert_close, decoded, encode, Rng};

    /// [`matmul_with`] at the level the tests run at (`LLAMA_GRAPH_ISA`).
    pub(crate) fn matmul(
        pool: &ThreadPool,
        a: LinearArgs<'_>,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        matmul_with(pool, crate::kernels::Kernels::current().isa(), a, y)
    }

    fn naive(x: &[f32], s: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
        let mut y = vec![0f64; s * n];
        for i in 0..s {
            for j in 0..n {
                y[i * n + j] = (0..k)
                    .map(|e| x[i * k + e] as f64 * w[j * k + e] as f64)
                    .sum();
            }
        }
        y
    }

    fn tol(k: usize) -> f64 {
        // Inputs in [-1, 1): f32 sum error grows ~ sqrt(k) * eps * |terms|.
        2e-6 * (k as f64).sqrt() * 4.0
    }

    fn check(pool: &ThreadPool, s: usize, k: usize, n: usize, seed: u64) {
        let mut rng = Rng::new(seed);
        let x = rng.vec(s * k);
        let wf = rng.vec(n * k);
        let r = rng.vec(s * n);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let wb = encode(&wf, dtype);
            let w = WeightRef::new(dtype, &wb);
            let want = naive(&x, s, k, &decoded(&wf, dtype), n);
            for isa in Isa::supported_levels() {
                let what = format!("{dtype} s={s} k={k} n={n} {isa:?}");
                let mut y = vec![f32::NAN; s * n];
                matmul_with(
                    pool,
                    isa,
                    LinearArgs::new(&x, s, k, w, n, Epilogue::None),
                    &mut y,
                )
                .unwrap();
                assert_close(&y, &want, tol(k), 1e-5, &what);
                // Residual epilogues.
                let want_r: Vec<f64> = want.iter().zip(&r).map(|(a, &b)| a + b as f64).collect();
                matmul_with(
                    pool,
                    isa,
                    LinearArgs::new(&x, s, k, w, n, Epilogue::AddResidual(&r)),
                    &mut y,
                )
                .unwrap();
                assert_close(&y, &want_r, tol(k), 1e-5, &what);
                let mut y2 = r.clone();
                matmul_with(
                    pool,
                    isa,
                    LinearArgs::new(&x, s, k, w, n, Epilogue::Accumulate),
                    &mut y2,
                )
                .unwrap();
                assert_close(&y2, &want_r, tol(k), 1e-5, &what);
                // SwiGLU over the same weights seen as [gate; up].
                if n.is_multiple_of(2) {
                    let f = n / 2;
                    let mut ys = vec![f32::NAN; s * f];
                    matmul_with(
                        pool,
                        isa,
                        LinearArgs::new(&x, s, k, w, n, Epilogue::SwiGlu),
                        &mut ys,
                    )
                    .unwrap();
                    let mut want_s = vec![0f64; s * f];
                    for i in 0..s {
                        for j in 0..f {
                            let g = want[i * n + j];
                            let u = want[i * n + f + j];
                            want_s[i * f + j] = g / (1.0 + (-g).exp()) * u;
                        }
                    }
                    assert_close(&ys, &want_s, tol(k) * 4.0, 1e-5, &format!("swiglu {what}"));
                }
            }
        }
    }

    /// A product under test: `(pool, x, s, epilogue, y)`.
    pub(crate) type MatmulFn<'a> =
        dyn Fn(&ThreadPool, &[f32], usize, Epilogue<'_>, &mut [f32]) + 'a;

    /// The outputs of `tokens` (rows of `x`, `[*, k]`) multiplied together,
    /// token by token as bit patterns; `init` is `y`'s rows before the call
    /// (read by `Accumulate`) and `r` the residual rows.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn batch_bits(
        mm: &MatmulFn<'_>,
        pool: &ThreadPool,
        x: &[f32],
        k: usize,
        tokens: std::ops::Range<usize>,
        n_out: usize,
        ep_kind: usize,
        r: &[f32],
    ) -> Vec<Vec<u32>> {
        let s = tokens.len();
        let rows = &r[tokens.start * n_out..tokens.end * n_out];
        let mut y = rows.to_vec();
        let ep = match ep_kind {
            0 => Epilogue::None,
            1 => Epilogue::Accumulate,
            2 => Epilogue::AddResidual(rows),
            _ => Epilogue::SwiGlu,
        };
        mm(pool, &x[tokens.start * k..tokens.end * k], s, ep, &mut y);
        y.chunks_exact(n_out)
            .map(|row| row.iter().map(|v| v.to_bits()).collect())
            .collect()
    }

    /// Asserts that every token's outputs in batches of `S` tokens (at the
    /// start and at the end of 64 tokens, on 2 and 1 threads) are
    /// bit-identical to that token multiplied alone, for every epilogue.
    pub(crate) fn check_batch_invariance(
        mm: &MatmulFn<'_>,
        x: &[f32],
        k: usize,
        n: usize,
        r: &[f32],
        what: &str,
    ) {
        let pools = [ThreadPool::new(2), ThreadPool::new(1)];
        const TOKENS: usize = 64;
        for ep in 0..4 {
            let n_out = if ep == 3 { n / 2 } else { n };
            let alone: Vec<Vec<u32>> = (0..TOKENS)
                .flat_map(|t| batch_bits(mm, &pools[0], x, k, t..t + 1, n_out, ep, r))
                .collect();
            for s in [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 37, 64] {
                for (i, start) in [0, TOKENS - s].into_iter().enumerate() {
                    let got = batch_bits(mm, &pools[i], x, k, start..start + s, n_out, ep, r);
                    for (j, row) in got.iter().enumerate() {
                        let t = start + j;
                        if let Some(c) = (0..n_out).find(|&c| row[c] != alone[t][c]) {
                            panic!(
                                "{what} epilogue {ep}: token {t} at {j} of S={s}, column {c}: {} vs {} alone",
                                f32::from_bits(row[c]),
                                f32::from_bits(alone[t][c])
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn batch_invariant_at_every_level() {
        // K with and without 8/16-element tails, and above the widening
        // buffer; N with row-tile remainders.
        for (i, &(k, n)) in [(576, 40), (100, 22), (37, 10), (4100, 6)]
            .iter()
            .enumerate()
        {
            let mut rng = Rng::new(400 + i as u64);
            let x = rng.vec(64 * k);
            let wf = rng.vec(n * k);
            let r = rng.vec(64 * n);
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let wb = encode(&wf, dtype);
                let w = WeightRef::new(dtype, &wb);
                for isa in Isa::supported_levels() {
                    let mm = |pool: &ThreadPool, x: &[f32], s, ep: Epilogue<'_>, y: &mut [f32]| {
                        matmul_with(pool, isa, LinearArgs::new(x, s, k, w, n, ep), y).unwrap()
                    };
                    check_batch_invariance(
                        &mm,
                        &x,
                        k,
                        n,
                        &r,
                        &format!("{dtype} {isa} k={k} n={n}"),
                    );
                }
            }
        }
    }

    #[test]
    fn gemv_odd_and_model_sizes() {
        let pool = ThreadPool::new(2);
        check(&pool, 1, 576, 1536, 1);
        check(&pool, 1, 1536, 576, 2);
        check(&pool, 1, 13, 37, 3);
        check(&pool, 1, 8, 9, 4);
        check(&pool, 1, 32, 45, 14); // permuted BF16 GEMV with a row remainder

        // Ranges of several 256-row GEMV blocks of the SIMD levels, a short
        // last block with rows left over from its four runs, epilogue
        // batches of four blocks and a remainder.
        check(&ThreadPool::new(1), 1, 40, 4102, 15);
        check(&pool, 1, 24, 2309, 16);
    }

    #[test]
    fn gemm_blocked_sizes() {
        let pool = ThreadPool::new(2);
        check(&pool, 2, 576, 64, 5);
        check(&pool, 13, 67, 30, 6); // token tiles 3,3,3,3,1; row tails
        check(&pool, 29, 576, 100, 7); // > one token block
        check(&pool, 4, 300, 20, 12); // K block + scalar tail
        check(&pool, 5, 576, 1536, 13); // model-sized, S > 1
        let pool1 = ThreadPool::new(1);
        check(&pool1, 5, 96, 44, 8);
    }

    #[test]
    fn simd_levels_odd_shapes() {
        // Token counts around the 6-token tile and the token groups, column
        // counts that are not multiples of the 4-row tile, K with and
        // without a 16-element tail; every epilogue and SIMD level (the
        // level is taken explicitly, so AVX2 is tested on AVX-512 CPUs).
        let pool = ThreadPool::new(2);
        let mut seed = 200;
        for &s in &[1, 2, 3, 7, 64, 65, 130] {
            for &(k, n) in &[(576, 30), (1536, 14), (37, 22), (100, 9)] {
                seed += 1;
                check(&pool, s, k, n, seed);
            }
        }
        let pool1 = ThreadPool::new(1);
        check(&pool1, 49, 40, 26, 300);
        // K above the widening buffer (F16/BF16 converted in registers;
        // AVX2 F16 always is), with a 19-element tail.
        check(&pool, 7, 4100, 10, 301);
        check(&pool, 5, 2 * 4096 + 19, 6, 304);
        // More tokens than one group (144 at k = 576, 60 at k = 1536).
        check(&pool, 150, 576, 10, 302);
        check(&pool, 61, 1536, 6, 303);
    }

    #[test]
    fn bf16_dot_path() {
        // Expected: exact sums of bf16(x) * bf16(w); on CPUs without
        // AVX-512 BF16 the call falls back to the exact path, which must
        // then match the unrounded-x reference instead.
        let pool = ThreadPool::new(2);
        let isa = crate::kernels::Kernels::current().isa();
        let has = isa.avx512_bf16();
        for (i, &(s, k, n)) in [
            (1, 576, 72),
            (5, 67, 20),
            (13, 300, 64),
            (24, 1100, 36),
            (29, 2048, 9),
        ]
        .iter()
        .enumerate()
        {
            let mut rng = Rng::new(100 + i as u64);
            let x = rng.vec(s * k);
            let wf = rng.vec(n * k);
            let wb = encode(&wf, DType::BF16);
            let xr = if has {
                decoded(&x, DType::BF16)
            } else {
                x.clone()
            };
            let want = naive(&xr, s, k, &decoded(&wf, DType::BF16), n);
            let mut y = vec![f32::NAN; s * n];
            let w = WeightRef::new(DType::BF16, &wb);
            matmul_bf16_dot(
                &pool,
                isa,
                LinearArgs::new(&x, s, k, w, n, Epilogue::None),
                &mut y,
            )
            .unwrap();
            assert_close(
                &y,
                &want,
                tol(k),
                1e-5,
                &format!("bf16dot s={s} k={k} n={n}"),
            );
            // SwiGLU epilogue through the same path.
            let mut ys = vec![f32::NAN; s * n / 2];
            if n % 2 == 0 {
                matmul_bf16_dot(
                    &pool,
                    isa,
                    LinearArgs::new(&x, s, k, w, n, Epilogue::SwiGlu),
                    &mut ys,
                )
                .unwrap();
                let f = n / 2;
                for t in 0..s {
                    for j in 0..f {
                        let (g, u) = (want[t * n + j], want[t * n + f + j]);
                        let e = g / (1.0 + (-g).exp()) * u;
                        assert!(
                            (ys[t * f + j] as f64 - e).abs() < 4.0 * tol(k),
                            "swiglu bf16dot"
                        );
                    }
                }
            }
        }
        // F32 weights with Bf16Dot requested use the exact path.
        let x = vec![0.3f32; 2 * 9];
        let w = vec![1.0f32 / 3.0; 4 * 9];
        let mut y = vec![0.0; 8];
        matmul_bf16_dot(
            &pool,
            isa,
            LinearArgs::new(&x, 2, 9, WeightRef::from_f32(&w), 4, Epilogue::None),
            &mut y,
        )
        .unwrap();
        assert!(y.iter().all(|&v| (v - 0.9).abs() < 1e-6));
    }

    #[test]
    fn large_vocab_projection() {
        // LM-head sized: 49152 rows, S = 1 and S = 2, BF16 only (time).
        let pool = ThreadPool::new(2);
        let (k, n) = (64, 49152);
        let mut rng = Rng::new(9);
        let wf = rng.vec(n * k);
        let wb = encode(&wf, DType::BF16);
        let wd = decoded(&wf, DType::BF16);
        for s in [1, 2] {
            let x = rng.vec(s * k);
            let mut y = vec![0f32; s * n];
            matmul(
                &pool,
                LinearArgs::new(
                    &x,
                    s,
                    k,
                    WeightRef::new(DType::BF16, &wb),
                    n,
                    Epilogue::None,
                ),
                &mut y,
            )
            .unwrap();
            assert_close(&y, &naive(&x, s, k, &wd, n), tol(k), 1e-5, "lm head");
        }
    }

    #[test]
    fn unaligned_weight_bytes() {
        let pool = ThreadPool::new(2);
        let mut rng = Rng::new(11);
        let (s, k, n) = (4, 40, 12);
        let x = rng.vec(s * k);
        let wf = rng.vec(n * k);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let mut buf = vec![0u8; 1];
            buf.extend(encode(&wf, dtype));
            let w = WeightRef::new(dtype, &buf[1..]);
            let mut y = vec![0f32; s * n];
            matmul(
                &pool,
                LinearArgs::new(&x, s, k, w, n, Epilogue::None),
                &mut y,
            )
            .unwrap();
            assert_close(
                &y,
                &naive(&x, s, k, &decoded(&wf, dtype), n),
                tol(k),
                1e-5,
                "unaligned",
            );
        }
    }

    #[test]
    fn shape_errors() {
        let pool = ThreadPool::new(1);
        let x = vec![0f32; 6];
        let w = vec![0f32; 9];
        let mut y = vec![0f32; 6];
        let wr = WeightRef::from_f32(&w);
        assert!(matmul(
            &pool,
            LinearArgs::new(&x, 2, 3, wr, 3, Epilogue::None),
            &mut y
        )
        .is_ok());
        assert!(matmul(
            &pool,
            LinearArgs::new(&x, 2, 3, wr, 3, Epilogue::None),
            &mut y[1..]
        )
        .is_err());
        assert!(matmul(
            &pool,
            LinearArgs::new(&x[1..], 2, 3, wr, 3, Epilogue::None),
            &mut y
        )
        .is_err());
        assert!(matmul(
            &pool,
            LinearArgs::new(&x, 2, 3, WeightRef::from_f32(&w[1..]), 3, Epilogue::None),
            &mut y
        )
        .is_err());
        assert!(matmul(
            &pool,
            LinearArgs::new(&x, 2, 3, wr, 3, Epilogue::SwiGlu),
            &mut y
        )
        .is_err());
        assert!(matmul(
            &pool,
            LinearArgs::new(&x, 2, 3, wr, 3, Epilogue::AddResidual(&x[1..])),
            &mut y
        )
        .is_err());
        let q = WeightRef::new(DType::Q8_0, &[]);
        assert!(matches!(
            matmul(
                &pool,
                LinearArgs::new(&x, 2, 3, q, 3, Epilogue::None),
                &mut y
            ),
            Err(KernelError::DType { .. })
        ));
    }
}
