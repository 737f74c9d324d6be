//! The fast path for linear layers over block-quantized weights: each
//! activation row is quantized once per matmul into 8-bit blocks
//! ([`Q8Act`], 32 elements, one f32 scale), then every weight block is
//! multiplied with an activation block in integers and scaled once, as
//! llama.cpp does; unlike llama.cpp, each activation carries a second 8-bit
//! quant for its rounding remainder.
//!
//! Supported weight types ([`supports`]): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
//! IQ4_NL, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, all seen as 32-element units of
//! small integer quants with one scale per unit or per 16-element half and
//! an additive term ([`units`]). Q2_K (a minimum per 16 elements) and the
//! float types go through the exact path (`super::exact`).
//!
//! Accuracy: the only approximation is the activation quantization. With
//! `c = max|x| / 127` per block, an activation `x` is `c · v` with
//! `|v| ≤ 127`; `q = round(v)` and the remainder `r = round(256 (v - q))`
//! (clamped to ±127) are both stored as `i8`, and `x ≈ d (256 q + r)` with
//! `d = c / 256`: in effect a 16-bit activation, every element within `d`
//! (one step of the remainder) of its value. One output therefore differs
//! from the exact product `Σ w_i x_i` (with the same dequantized weights) by
//! at most about `Σ_b d_b Σ_{i∈b} |w_i|` plus f32 rounding; see
//! [`act_error_bound`].
//! The kernels do twice the integer work of plain 8-bit activations (each
//! decoded weight block meets both quants) and read the same weight bytes.
//! With 8-bit activations alone the largest top-10 logit error on the
//! committed SmolLM2 prompts was 0.68, enough to flip near ties such as the
//! France prompt's first token; with the remainder it is ~0.003 (see
//! docs/design/fast-path-accuracy.md).
//!
//! Draft models ([`ActQuant::Plain`]): a speculative draft session's
//! guesses are all verified by the target, so its accuracy does not
//! affect the output; its activations are quantized to 8 bits alone (every
//! remainder 0), and the x8 decode kernels skip the remainder's products:
//! one `maddubs` (or `vpdpbusd`) per quad instead of two. Every kernel
//! still computes the shared arithmetic of [`units`] (with `qr = 0`), so
//! the levels agree bit for bit in this mode too.
//! The integer block products are exact. Q4_1's minimum term `m · Σ x_i`
//! uses the sum of the quantized activations, as llama.cpp does: the error
//! is then `Σ w_i e_i` with the dequantized `w` (centred on 0); with the f32
//! sum of the unquantized ones it would be `Σ (w_i - m) e_i`, measured
//! clearly worse. (Before the remainder, each block had one scale per
//! 16-element half, which halved the 8-bit error; with the remainder it
//! changes nothing measurable, so one scale per block it is.)
//!
//! Kernels, picked from the instruction-set level (an argument; the runtime's
//! comes from [`crate::kernels::Kernels`]) and the
//! number of activation rows `S`:
//! * S < [`packed_min_s`] (decode): 4 weight rows at a time, every unit's
//!   integer products summed across the vector and reduced into one lane
//!   per row (AVX2 `maddubs`/`madd`; AVX-512 VNNI 256-bit `vpdpbusd`).
//! * Larger S (prefill): work chunks of up to [`COLS_PER_CHUNK`] weight
//!   rows (24 at AVX2, 4 calls of 6 rows), decoded once per chunk into
//!   16-bit quants, times packed groups
//!   of tokens' 16-bit activations (`256 qs + qr`): AVX2 `vpmaddwd` with 8
//!   tokens per register, AVX-512 VNNI `vpdpwssd` with 16.
//! * [`Isa::Scalar`]: the reference ([`dot_q8_scalar`]).
//!
//! Every kernel computes each output with the same sequence of f32
//! operations (see [`units`]): the SIMD kernels agree with the scalar
//! reference bit for bit, and one activation row's outputs are the same
//! bits whatever the number of rows in the call and the row's place among
//! them (batch invariance: a server runs several sequences' tokens in one
//! step). The SwiGLU epilogue is the scalar `silu_f32` at the scalar level;
//! at the SIMD levels all kernels use one vector formula
//! ([`crate::kernels::elementwise::silu`](fn@crate::kernels::elementwise::silu), the same bits at AVX2 and
//! AVX-512). Checked for every type and level by `quantized::invariance`
//! and the tests below.

// Block kernels index several arrays with one loop counter, as in ggml's reference code.
#![allow(clippy::needless_range_loop)]

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod small;
pub mod units;
pub mod x8;

use crate::ir::DType;
use crate::kernels::matmul::Epilogue;
use crate::kernels::{check_linear, Isa, KernelError, LinearArgs, WeightRef};
use crate::pool::{SyncPtr, ThreadPool};

/// One quantized block of 32 activations:
/// `x[i] ≈ d * (256 * qs[i] + qr[i])` ([`RES`] = 256);
/// `isum` holds `Σ (256 qs[i] + qr[i])` over each 16-element half (for
/// kernels that multiply offset weights `q + OFF` and take `OFF · isum` back
/// off in integers) and `s = d * (isum[0] + isum[1])` is the sum of the
/// block's values (for weight offsets such as Q4_1's minimum).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct Q8Act {
    pub d: f32,
    pub s: f32,
    pub isum: [i32; 2],
    /// The 8-bit quants (`|qs| ≤ 127`).
    pub qs: [i8; 32],
    /// The remainders, in units of 1/256 of a quant step (`|qr| ≤ 127`).
    pub qr: [i8; 32],
}

/// How the fast path quantizes activations (picked by the session's
/// [`MatmulMode`](crate::kernels::MatmulMode)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActQuant {
    /// 8-bit quants plus an 8-bit remainder: the accuracy bound of the
    /// module docs.
    #[default]
    Remainder,
    /// 8-bit quants alone (every [`Q8Act::qr`] 0): each element within half
    /// an 8-bit step of its value, half the integer work in the x8 decode
    /// kernels. For speculative draft models, whose guesses the target
    /// verifies.
    Plain,
}

/// Weight of [`Q8Act::qs`] against [`Q8Act::qr`] (a power of two, so the
/// scale `d = c / RES` is exact).
pub const RES: i32 = 256;
/// `log2(RES)`.
pub const RES_SHIFT: i32 = 8;

/// Elements per activation block.
pub const QK: usize = 32;
/// Weight rows per work chunk.
pub const COLS_PER_CHUNK: usize = 16;
/// Tokens per work chunk of the small-S kernels.
pub const TOKENS_PER_CHUNK: usize = 64;
/// Tokens per work chunk of the packed kernels (a multiple of 16).
pub const PACKED_TOKENS_PER_CHUNK: usize = 256;

/// The kernel set the fast path runs at a given [`Isa`] level (there is
/// no plain AVX-512 kernel: that level runs the AVX2 ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    /// Scalar reference.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 plus AVX-512 F/BW/VL and VNNI.
    Avx512Vnni,
}

impl Level {
    /// The kernels of `isa`, lowered to what this CPU supports.
    fn of(isa: Isa) -> Level {
        match isa.min(Isa::detect()) {
            Isa::Scalar => Level::Scalar,
            Isa::Avx2 | Isa::Avx512 => Level::Avx2,
            Isa::Avx512Vnni => Level::Avx512Vnni,
        }
    }
}

/// True for the weight dtypes this path handles.
pub fn supports(dtype: DType) -> bool {
    units::is_unit_format(dtype)
}

/// Smallest S that runs the packed (prefill) kernels at `isa` for weights
/// of `dtype`, if any. Any threshold gives the same results (every kernel
/// computes the same arithmetic); it only decides speed. Below it the
/// small-S kernels read the x8-interleaved weights directly, 4 tokens per
/// pass; the packed kernels decode every weight once per call into wider
/// units, which pays off only over enough tokens, and later for Q4_1, whose
/// small-S kernels are cheapest. Measured (`bench -p S -n 0 -t 2`, tokens/s,
/// small-S vs packed):
/// * SmolLM2 Q4_1: AVX2 S=4 346 vs 153, S=16 628 vs 412, S=128 720 vs 613,
///   S=512 646 vs 576; VNNI S=16 822 vs 592, S=32 895 vs 841, S=64 902 vs 1007.
/// * 1B-shaped Q4_1: AVX2 S=16 85 vs 54, S=64 94 vs 75; VNNI S=32 114 vs
///   100, S=64 124 vs 131.
/// * 1B-shaped Q8_0: AVX2 S=32 55 vs 63; VNNI S=32 107 vs 98, S=128 108 vs 161.
/// * 1B-shaped Q4_K_M: AVX2 S=4 56 vs 23, S=16 65 vs 63, S=64 74 vs 83;
///   VNNI S=16 86 vs 93.
pub fn packed_min_s(isa: Isa, dtype: DType) -> Option<usize> {
    match (Level::of(isa), dtype) {
        (Level::Scalar, _) => None,
        (Level::Avx2, DType::Q4_1) => None,
        (Level::Avx512Vnni, DType::Q4_1) => Some(64),
        (Level::Avx2 | Level::Avx512Vnni, _) => Some(16),
    }
}

/// True where [`qmatmul_fast_with`] runs the packed kernels.
fn packed_for(isa: Isa, dtype: DType, s: usize, k: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && supports(dtype)
        && packed_min_s(isa, dtype).is_some_and(|m| s >= m)
        && k >= dtype.block_elems()
        && k.is_multiple_of(dtype.block_elems())
}

/// Activation blocks of scratch enough for an `[s, k]` input at every
/// level (`None` if `k` is not a multiple of 32 or the size overflows).
pub fn scratch_len(s: usize, k: usize) -> Option<usize> {
    if !k.is_multiple_of(QK) {
        return None;
    }
    s.checked_mul(k / QK)
}

/// Activation blocks of scratch [`qmatmul_fast_with`] needs at `isa` for
/// weights of `dtype`: [`scratch_len`], except none where the packed
/// kernels run (they quantize a group of tokens at a time into per-worker
/// buffers of their own).
pub fn scratch_len_for(isa: Isa, dtype: DType, s: usize, k: usize) -> Option<usize> {
    if packed_for(isa, dtype, s, k) {
        return Some(0);
    }
    scratch_len(s, k)
}

/// Scalar reference: quantizes `x` (a multiple of 32 elements) into `out`
/// (with `quant`'s remainders, or none). Rounds half to even, as
/// `cvtps2dq` does, so it matches the AVX2 version bit for bit.
pub fn quantize_act_scalar(quant: ActQuant, x: &[f32], out: &mut [Q8Act]) {
    assert_eq!(x.len(), out.len() * QK, "quantize_act: length mismatch");
    for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let c = amax / 127.0;
        let id = if c != 0.0 { 1.0 / c } else { 0.0 };
        let mut isum = [0i32; 2];
        for i in 0..QK {
            let v = xb[i] * id;
            let q = v.round_ties_even();
            let r = match quant {
                ActQuant::Remainder => ((v - q) * RES as f32)
                    .round_ties_even()
                    .clamp(-127.0, 127.0),
                ActQuant::Plain => 0.0,
            };
            o.qs[i] = q as i32 as i8;
            o.qr[i] = r as i32 as i8;
            isum[i / 16] += RES * q as i32 + r as i32;
        }
        o.d = c / RES as f32;
        o.isum = isum;
        o.s = o.d * (isum[0] + isum[1]) as f32;
    }
}

/// Quantizes `x` into `out` as `quant` says (AVX2 at the SIMD levels of
/// `isa`, else the scalar reference).
///
/// # Panics
/// If `x.len() != 32 * out.len()`.
pub fn quantize_act(isa: Isa, quant: ActQuant, x: &[f32], out: &mut [Q8Act]) {
    quantize_act_with(Level::of(isa), quant, x, out)
}

fn quantize_act_with(level: Level, quant: ActQuant, x: &[f32], out: &mut [Q8Act]) {
    assert_eq!(x.len(), out.len() * QK, "quantize_act: length mismatch");
    #[cfg(target_arch = "x86_64")]
    {
        if level != Level::Scalar {
            // SAFETY: both SIMD levels imply avx2/fma/f16c (callers check
            // `Level::supported`); lengths checked above.
            unsafe { avx2::quantize(x, out, quant == ActQuant::Plain) };
            return;
        }
    }
    let _ = level;
    quantize_act_scalar(quant, x, out)
}

/// Upper bound of `|fast - exact|` for one output:
/// `(1 + 1/64) Σ_b e_b · Σ_{i∈b} |w_i|` over the blocks `b` of the
/// activation row `acts` quantized as `quant` says (`w` dequantized), with
/// `e_b` how far an activation may be from its value: one remainder step
/// `d_b` with the remainder (half a step from rounding it, the other half
/// only where the clamp to ±127 bites), half an 8-bit step (`RES / 2 · d_b`)
/// without. The 1/64 covers the f32 rounding of `x / c`.
pub fn act_error_bound(quant: ActQuant, w: &[f32], acts: &[Q8Act]) -> f32 {
    let steps = match quant {
        ActQuant::Remainder => 1.0,
        ActQuant::Plain => (RES / 2) as f32,
    };
    let sum: f32 = w
        .chunks_exact(QK)
        .zip(acts)
        .map(|(wb, a)| steps * a.d * wb.iter().map(|v| v.abs()).sum::<f32>())
        .sum();
    sum * (1.0 + 1.0 / 64.0)
}

/// Scalar reference: a stored weight row (`dtype`) dotted with a quantized
/// activation row, with the arithmetic every kernel shares
/// ([`units::unit_acc`]).
///
/// # Panics
/// If `dtype` is not [`supported`](supports) or the lengths disagree.
pub fn dot_q8_scalar(dtype: DType, row: &[u8], acts: &[Q8Act]) -> f32 {
    assert!(supports(dtype), "dot_q8: unsupported {dtype}");
    let bb = dtype.block_bytes();
    let upb = units::units_per_block(dtype);
    assert_eq!(row.len() * upb, acts.len() * bb, "dot_q8: length mismatch");
    let (mut d, mut m) = ([[0f32; 2]; 8], [0f32; 8]);
    let mut f = 0f32;
    for (b, ab) in row.chunks_exact(bb).zip(acts.chunks_exact(upb)) {
        units::block_scales(dtype, b, &mut d, &mut m);
        for (u, a) in ab.iter().enumerate() {
            f = units::unit_acc(dtype, f, &units::unit_quants(dtype, b, u), d[u], m[u], a);
        }
    }
    f
}

/// How a weight matrix's bytes are laid out ([`Layout::X8`]: see [`x8`]).
pub use crate::ir::WeightLayout as Layout;

thread_local! {
    /// GGUF rows unpacked from an x8 matrix (scalar level, VNNI prefill
    /// decode, partial groups).
    static UNPACKED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on rows `r0..r1` of `w` as GGUF rows (the bytes themselves, or
/// unpacked from x8 into a per-thread buffer).
fn with_rows<R>(
    layout: Layout,
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    f: impl FnOnce(&[u8]) -> R,
) -> R {
    match layout {
        Layout::Rows => f(w),
        Layout::X8 => UNPACKED.with(|cell| {
            let mut buf = cell.borrow_mut();
            buf.resize(w.len(), 0);
            x8::unpack_rows(dtype, w, row_bytes, 0, w.len() / row_bytes, &mut buf);
            f(&buf)
        }),
    }
}

/// `out[r * nt + t] = row_r · acts[t]` for the consecutive weight rows in
/// `w` (`row_bytes` each; whole groups of 8 for [`Layout::X8`]) and up to
/// 4 activation rows (`nt = acts.len()`, quantized as `quant` says: the x8
/// kernels skip the remainders' products under [`ActQuant::Plain`], where
/// they are 0; the others multiply them).
#[inline]
#[allow(clippy::too_many_arguments)]
fn dot_rows(
    quant: ActQuant,
    dtype: DType,
    layout: Layout,
    w: &[u8],
    row_bytes: usize,
    acts: &[&[Q8Act]],
    out: &mut [f32],
    level: Level,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if level != Level::Scalar && layout == Layout::X8 {
            // SAFETY: the caller checked the level; the lengths are checked inside.
            unsafe {
                x8::simd::dot_rows(
                    level == Level::Avx512Vnni,
                    quant == ActQuant::Plain,
                    dtype,
                    w,
                    row_bytes,
                    acts,
                    out,
                )
            };
            return;
        }
        if level == Level::Avx512Vnni {
            // SAFETY: the caller checked `level.supported()`; the lengths are
            // checked inside.
            unsafe { small::dot_rows::<avx512::Vnni>(dtype, w, row_bytes, acts, out) };
            return;
        }
        if level != Level::Scalar {
            // SAFETY: as above (avx2/fma/f16c).
            unsafe { small::dot_rows::<avx2::Maddubs>(dtype, w, row_bytes, acts, out) };
            return;
        }
    }
    let _ = level;
    with_rows(layout, dtype, w, row_bytes, |w| {
        let nt = acts.len();
        for (r, row) in w.chunks_exact(row_bytes).enumerate() {
            for (t, a) in acts.iter().enumerate() {
                out[r * nt + t] = dot_q8_scalar(dtype, row, a);
            }
        }
    })
}

/// `y = x·Wᵀ` with `epilogue` for a `W` `[n, k]` of a [supported](supports)
/// dtype with the kernels of `isa` (lowered to what this CPU supports),
/// quantizing each row of `x` once as `quant` says into `scratch` (at least
/// [`scratch_len_for`]`(isa, w.dtype, s, k)` blocks). Same contract as
/// [`super::exact::qmatmul_with`] otherwise.
pub fn qmatmul_fast_with(
    isa: Isa,
    quant: ActQuant,
    pool: &ThreadPool,
    a: LinearArgs<'_>,
    y: &mut [f32],
    scratch: &mut [Q8Act],
) -> Result<(), KernelError> {
    let (x, s, k, w, n, epilogue) = (a.x, a.s, a.k, a.w, a.n, a.epilogue);
    // For Layout::X8, `w.bytes` holds the matrix as [`x8::repack`] wrote it.
    let layout = w.layout;
    let level = Level::of(isa);
    const OP: &str = "qmatmul_fast";
    if !supports(w.dtype) {
        return Err(KernelError::DType {
            op: OP,
            dtype: w.dtype,
        });
    }
    let (row_bytes, n_out) = check_linear(OP, &a, y)?;
    if layout == Layout::X8 && !(x8::supports(w.dtype, n, k) && n_out.is_multiple_of(x8::G)) {
        return Err(KernelError::Invalid {
            op: OP,
            what: "x8 weights need rows (and SwiGLU halves) in whole groups of 8",
        });
    }
    let nb = k / QK;
    let need = scratch_len_for(isa, w.dtype, s, k).unwrap_or(usize::MAX);
    if scratch.len() < need {
        return Err(KernelError::Shape {
            op: OP,
            what: "scratch blocks (scratch_len_for)",
            expected: need,
            actual: scratch.len(),
        });
    }
    #[cfg(target_arch = "x86_64")]
    {
        if packed_for(isa, w.dtype, s, k) {
            packed::run(
                level, quant, layout, pool, x, s, k, w, n_out, row_bytes, epilogue, y,
            );
            return Ok(());
        }
    }
    let acts = &mut scratch[..need];
    if s * k >= 1 << 14 {
        // Large inputs: quantize the rows in parallel.
        let ap = SyncPtr::new(acts);
        pool.run(s, &|t| {
            // SAFETY: chunk t owns blocks t*nb..(t+1)*nb.
            let a = unsafe { ap.slice(t * nb, nb) };
            quantize_act_with(level, quant, &x[t * k..(t + 1) * k], a);
        });
    } else {
        quantize_act_with(level, quant, x, acts);
    }
    let acts: &[Q8Act] = acts;
    let yp = SyncPtr::new(y);
    // Decode-sized inputs: one long contiguous row range per thread, so each
    // thread streams its weights in a run the hardware prefetcher follows
    // (16-row chunks taken alternately by two threads measured 0.75x of one
    // thread's speed; see kernels::DECODE_CHUNKS_PER_THREAD).
    let rows_per_chunk = if s <= 4 {
        COLS_PER_CHUNK.max(
            n_out
                .div_ceil(crate::kernels::DECODE_CHUNKS_PER_THREAD * pool.n_threads())
                .next_multiple_of(x8::G),
        )
    } else {
        COLS_PER_CHUNK
    };
    let col_chunks = n_out.div_ceil(rows_per_chunk);
    let tok_chunks = s.div_ceil(TOKENS_PER_CHUNK);
    // The SwiGLU of the SIMD levels' packed kernels, so that a token's
    // outputs are the same whichever kernel ran it.
    let vector_swiglu = matches!(epilogue, Epilogue::SwiGlu)
        && cfg!(target_arch = "x86_64")
        && level != Level::Scalar;
    pool.run(col_chunks * tok_chunks, &|c| {
        let (cc, tc) = (c % col_chunks, c / col_chunks);
        let (jc0, jc1) = (cc * rows_per_chunk, ((cc + 1) * rows_per_chunk).min(n_out));
        let (t0, t1) = (tc * TOKENS_PER_CHUNK, ((tc + 1) * TOKENS_PER_CHUNK).min(s));
        let mut v = [0f32; COLS_PER_CHUNK * 4];
        let mut up = [0f32; COLS_PER_CHUNK * 4];
        for j0 in (jc0..jc1).step_by(COLS_PER_CHUNK) {
            let j1 = (j0 + COLS_PER_CHUNK).min(jc1);
            let nr = j1 - j0;
            let mut ta = t0;
            while ta < t1 {
                let nt = (t1 - ta).min(4);
                let mut tile: [&[Q8Act]; 4] = [&[]; 4];
                for i in 0..nt {
                    tile[i] = &acts[(ta + i) * nb..(ta + i + 1) * nb];
                }
                let tile = &tile[..nt];
                dot_rows(
                    quant,
                    w.dtype,
                    layout,
                    &w.bytes[j0 * row_bytes..j1 * row_bytes],
                    row_bytes,
                    tile,
                    &mut v[..nr * nt],
                    level,
                );
                if let Epilogue::SwiGlu = epilogue {
                    let (u0, u1) = (j0 + n_out, j1 + n_out);
                    dot_rows(
                        quant,
                        w.dtype,
                        layout,
                        &w.bytes[u0 * row_bytes..u1 * row_bytes],
                        row_bytes,
                        tile,
                        &mut up[..nr * nt],
                        level,
                    );
                }
                #[cfg(target_arch = "x86_64")]
                if vector_swiglu {
                    // SAFETY: the level was checked by the caller.
                    unsafe {
                        if level == Level::Avx512Vnni {
                            avx512::swiglu_slice(&mut v[..nr * nt], &up[..nr * nt])
                        } else {
                            crate::kernels::elementwise::silu::swiglu_slice_avx2(
                                &mut v[..nr * nt],
                                &up[..nr * nt],
                            )
                        }
                    };
                }
                for i in 0..nt {
                    let t = ta + i;
                    // SAFETY: chunk c alone owns columns j0..j1 of rows t0..t1 of y.
                    let yr = unsafe { yp.slice(t * n_out + j0, nr) };
                    for (r, o) in yr.iter_mut().enumerate() {
                        *o = if vector_swiglu {
                            v[r * nt + i]
                        } else {
                            apply_epilogue(
                                epilogue,
                                *o,
                                v[r * nt + i],
                                up[r * nt + i],
                                t,
                                j0 + r,
                                n_out,
                            )
                        };
                    }
                }
                ta += nt;
            }
        }
    });
    Ok(())
}

#[inline(always)]
fn apply_epilogue(
    e: Epilogue<'_>,
    old: f32,
    val: f32,
    up: f32,
    t: usize,
    j: usize,
    n_out: usize,
) -> f32 {
    match e {
        Epilogue::None => val,
        Epilogue::Accumulate => old + val,
        Epilogue::AddResidual(res) => val + res[t * n_out + j],
        Epilogue::SwiGlu => crate::kernels::elementwise::silu_f32(val) * up,
    }
}

/// The packed (prefill) driver for both SIMD levels.
#[cfg(target_arch = "x86_64")]
mod packed {
    use super::avx2::{self, ActI16, DecodedUnit, PackedAct, WUnit};
    use super::avx512::{self, Act16, WUnit8};
    use super::*;
    use std::cell::RefCell;
    use std::thread::LocalKey;

    /// Largest tokens per group and rows per kernel call of any level.
    const TG_MAX: usize = 16;
    const R_MAX: usize = 8;

    /// One level's packed kernels: decoded weight units `W`, packed
    /// activation blocks `A` of `TG` tokens, `R` rows per kernel call.
    trait Kernels {
        type W: DecodedUnit + Send + Sync + 'static;
        type A: PackedAct + Send + Sync + 'static;
        const TG: usize;
        const R: usize;
        /// Weight rows per work chunk (a multiple of `R` and of 8).
        const COLS: usize = COLS_PER_CHUNK;
        fn acts() -> &'static LocalKey<RefCell<Vec<Self::A>>>;
        fn wdec() -> &'static LocalKey<RefCell<Vec<Self::W>>>;
        /// Decodes whole x8 groups (`w`) straight into units, the same
        /// units [`avx2::decode`] makes of the unpacked rows, where
        /// the level has such a decoder; false where the caller must unpack
        /// the rows first.
        ///
        /// # Safety
        /// The CPU must support the level; `dtype` has an x8 layout.
        unsafe fn decode_x8(
            _dtype: DType,
            _w: &[u8],
            _row_bytes: usize,
            _out: &mut [Self::W],
        ) -> bool {
            false
        }
        /// `out[r][t]` for the first `nt` tokens of the group `a` (lanes
        /// past them may hold anything).
        ///
        /// # Safety
        /// The CPU must support the level.
        unsafe fn kern(
            dtype: DType,
            w: &[Self::W],
            nu: usize,
            a: &[Self::A],
            nt: usize,
            out: &mut [[f32; TG_MAX]; R_MAX],
        );
        /// `g = silu(g) * u` with this level's formula.
        fn swiglu(g: &mut [[f32; TG_MAX]; R_MAX], u: &[[f32; TG_MAX]; R_MAX]);
    }

    thread_local! {
        static ACTS_I16: RefCell<Vec<ActI16>> = const { RefCell::new(Vec::new()) };
        static WDEC_I16: RefCell<Vec<WUnit>> = const { RefCell::new(Vec::new()) };
        static ACTS16: RefCell<Vec<Act16>> = const { RefCell::new(Vec::new()) };
        static WDEC16: RefCell<Vec<WUnit8>> = const { RefCell::new(Vec::new()) };
        /// One group of tokens' quantized rows before packing (per worker).
        static GROUP: RefCell<Vec<Q8Act>> = const { RefCell::new(Vec::new()) };
    }

    /// AVX2: 16-bit weights and activations, `vpmaddwd`.
    struct Avx2K;
    /// AVX-512 VNNI: 8-bit weights, `vpdpbusd`.
    struct VnniK;

    /// `$m::$k::<SPLIT, MIN $(, $g)?>($arg...)` for the format `$dtype`.
    macro_rules! by_format {
        ($m:ident :: $k:ident $(<$g:tt>)?, $dtype:expr, ($($arg:expr),*)) => {{
            match (units::split_scales($dtype), units::has_min($dtype)) {
                (false, false) => $m::$k::<false, false $(, $g)?>($($arg),*),
                (false, true) => $m::$k::<false, true $(, $g)?>($($arg),*),
                (true, false) => $m::$k::<true, false $(, $g)?>($($arg),*),
                (true, true) => $m::$k::<true, true $(, $g)?>($($arg),*),
            }
        }};
    }

    impl Kernels for Avx2K {
        type W = WUnit;
        type A = ActI16;
        const TG: usize = avx2::TG_I16;
        const R: usize = avx2::R_I16;
        const COLS: usize = 4 * avx2::R_I16;
        fn acts() -> &'static LocalKey<RefCell<Vec<ActI16>>> {
            &ACTS_I16
        }
        fn wdec() -> &'static LocalKey<RefCell<Vec<WUnit>>> {
            &WDEC_I16
        }
        unsafe fn decode_x8(dtype: DType, w: &[u8], row_bytes: usize, out: &mut [WUnit]) -> bool {
            // SAFETY: as the caller's.
            unsafe { x8::simd::decode_units(dtype, w, row_bytes, out) };
            true
        }
        unsafe fn kern(
            dtype: DType,
            w: &[WUnit],
            nu: usize,
            a: &[ActI16],
            nt: usize,
            out: &mut [[f32; TG_MAX]; R_MAX],
        ) {
            let mut o = [[0f32; avx2::TG_I16]; avx2::R_I16];
            // SAFETY: as the caller's.
            unsafe {
                if nt <= 8 {
                    by_format!(avx2::kern16<1>, dtype, (w, nu, a, &mut o))
                } else {
                    by_format!(avx2::kern16<2>, dtype, (w, nu, a, &mut o))
                }
            };
            for r in 0..avx2::R_I16 {
                out[r][..avx2::TG_I16].copy_from_slice(&o[r]);
            }
        }
        fn swiglu(g: &mut [[f32; TG_MAX]; R_MAX], u: &[[f32; TG_MAX]; R_MAX]) {
            for (gr, ur) in g.iter_mut().zip(u) {
                // SAFETY: this level runs only where the CPU supports avx2/fma.
                unsafe {
                    crate::kernels::elementwise::silu::swiglu_slice_avx2(
                        &mut gr[..avx2::TG_I16],
                        &ur[..avx2::TG_I16],
                    )
                };
            }
        }
    }

    impl Kernels for VnniK {
        type W = WUnit8;
        type A = Act16;
        const TG: usize = avx512::TG;
        const R: usize = avx512::R;
        fn acts() -> &'static LocalKey<RefCell<Vec<Act16>>> {
            &ACTS16
        }
        fn wdec() -> &'static LocalKey<RefCell<Vec<WUnit8>>> {
            &WDEC16
        }
        unsafe fn kern(
            dtype: DType,
            w: &[WUnit8],
            nu: usize,
            a: &[Act16],
            _nt: usize,
            out: &mut [[f32; TG_MAX]; R_MAX],
        ) {
            // SAFETY: as the caller's.
            unsafe { by_format!(avx512::kern, dtype, (w, nu, a, out)) }
        }
        fn swiglu(g: &mut [[f32; TG_MAX]; R_MAX], u: &[[f32; TG_MAX]; R_MAX]) {
            // SAFETY: this level runs only where the CPU supports it.
            unsafe { avx512::swiglu(g, u) }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        level: Level,
        quant: ActQuant,
        layout: Layout,
        pool: &ThreadPool,
        x: &[f32],
        s: usize,
        k: usize,
        w: WeightRef<'_>,
        n_out: usize,
        row_bytes: usize,
        epilogue: Epilogue<'_>,
        y: &mut [f32],
    ) {
        match level {
            Level::Avx512Vnni => run_with::<VnniK>(
                level, quant, layout, pool, x, s, k, w, n_out, row_bytes, epilogue, y,
            ),
            _ => run_with::<Avx2K>(
                level, quant, layout, pool, x, s, k, w, n_out, row_bytes, epilogue, y,
            ),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_with<K: Kernels>(
        level: Level,
        quant: ActQuant,
        layout: Layout,
        pool: &ThreadPool,
        x: &[f32],
        s: usize,
        k: usize,
        w: WeightRef<'_>,
        n_out: usize,
        row_bytes: usize,
        epilogue: Epilogue<'_>,
        y: &mut [f32],
    ) {
        let dtype = w.dtype;
        let nu = k / QK;
        let (tg, rk) = (K::TG, K::R);
        let groups = s.div_ceil(tg);
        K::acts().with(|cell| {
            let mut packed = cell.borrow_mut();
            if packed.len() < groups * nu {
                packed.resize(groups * nu, K::A::default());
            }
            let packed = &mut packed[..groups * nu];
            {
                let pp = SyncPtr::new(packed);
                pool.run(groups, &|g| {
                    let (t0, t1) = (g * tg, ((g + 1) * tg).min(s));
                    // SAFETY: chunk g alone owns packed blocks g*nu..(g+1)*nu.
                    let p = unsafe { pp.slice(g * nu, nu) };
                    GROUP.with(|gcell| {
                        let mut a = gcell.borrow_mut();
                        let need = (t1 - t0) * nu;
                        if a.len() < need {
                            a.resize(need, Q8Act::default());
                        }
                        let a = &mut a[..need];
                        quantize_act_with(level, quant, &x[t0 * k..t1 * k], a);
                        let mut rows: [&[Q8Act]; TG_MAX] = [&[]; TG_MAX];
                        for (t, r) in a.chunks_exact(nu).enumerate() {
                            rows[t] = r;
                        }
                        avx2::pack(&rows[..t1 - t0], nu, p);
                    });
                });
            }
            let packed: &[K::A] = packed;
            let yp = SyncPtr::new(y);
            let col_chunks = n_out.div_ceil(K::COLS);
            let tok_chunks = s.div_ceil(PACKED_TOKENS_PER_CHUNK);
            let swiglu = matches!(epilogue, Epilogue::SwiGlu);
            // Rows per chunk rounded up to whole kernel calls.
            let rp = K::COLS.div_ceil(rk) * rk;
            pool.run(col_chunks * tok_chunks, &|c| {
                let (cc, tc) = (c % col_chunks, c / col_chunks);
                let (j0, j1) = (cc * K::COLS, ((cc + 1) * K::COLS).min(n_out));
                let (t0, t1) = (
                    tc * PACKED_TOKENS_PER_CHUNK,
                    ((tc + 1) * PACKED_TOKENS_PER_CHUNK).min(s),
                );
                K::wdec().with(|wcell| {
                    let mut wdec = wcell.borrow_mut();
                    let need = 2 * rp * nu;
                    if wdec.len() < need {
                        wdec.resize(need, K::W::default());
                    }
                    let (gate, up) = wdec[..need].split_at_mut(rp * nu);
                    // Rows r0..r1 decoded into `out`: x8 groups straight
                    // where the level can, else through the GGUF rows. With
                    // x8 weights r0 and r1 are whole groups (the entry
                    // checks that `n_out` is; chunks start at multiples of
                    // K::COLS).
                    let decode = |r0: usize, r1: usize, out: &mut [K::W]| {
                        let b = &w.bytes[r0 * row_bytes..r1 * row_bytes];
                        // SAFETY (both calls): the caller checked the level.
                        if layout == Layout::X8 && unsafe { K::decode_x8(dtype, b, row_bytes, out) }
                        {
                            return;
                        }
                        with_rows(layout, dtype, b, row_bytes, |b| unsafe {
                            avx2::decode(dtype, b, row_bytes, out)
                        });
                    };
                    decode(j0, j1, gate);
                    if swiglu {
                        decode(j0 + n_out, j1 + n_out, up);
                    }
                    let (gate, up): (&[K::W], &[K::W]) = (gate, up);
                    let mut vg = [[0f32; TG_MAX]; R_MAX];
                    let mut vu = [[0f32; TG_MAX]; R_MAX];
                    for g in t0 / tg..t1.div_ceil(tg) {
                        let pg = &packed[g * nu..(g + 1) * nu];
                        let nt = (s - g * tg).min(tg);
                        for r0 in (0..j1 - j0).step_by(rk) {
                            let nr = (j1 - j0 - r0).min(rk);
                            // SAFETY: as above.
                            unsafe {
                                K::kern(dtype, &gate[r0 * nu..(r0 + rk) * nu], nu, pg, nt, &mut vg);
                                if swiglu {
                                    K::kern(
                                        dtype,
                                        &up[r0 * nu..(r0 + rk) * nu],
                                        nu,
                                        pg,
                                        nt,
                                        &mut vu,
                                    );
                                }
                            }
                            if swiglu {
                                K::swiglu(&mut vg, &vu);
                            }
                            let j = j0 + r0;
                            for i in 0..nt {
                                let t = g * tg + i;
                                // SAFETY: chunk c alone owns columns j0..j1 of rows t0..t1 of y.
                                let yr = unsafe { yp.slice(t * n_out + j, nr) };
                                match epilogue {
                                    Epilogue::None | Epilogue::SwiGlu => {
                                        for (r, o) in yr.iter_mut().enumerate() {
                                            *o = vg[r][i];
                                        }
                                    }
                                    Epilogue::Accumulate => {
                                        for (r, o) in yr.iter_mut().enumerate() {
                                            *o += vg[r][i];
                                        }
                                    }
                                    Epilogue::AddResidual(res) => {
                                        let rr = &res[t * n_out + j..t * n_out + j + nr];
                                        for (r, o) in yr.iter_mut().enumerate() {
                                            *o = vg[r][i] + rr[r];
                                        }
                                    }
                                }
                            }
                        }
                    }
                });
            });
        });
    }
}

#[cfg(test)]
mod tests;
