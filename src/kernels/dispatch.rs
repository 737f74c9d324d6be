//! The forms the executor calls: dispatch on the weight dtype (plain or
//! block-quantized) through a [`Kernels`] table, per-token RoPE angles and in-place elementwise ops.

use super::elementwise::rope::{rope_freq, RopeScaling};
use super::matmul::gemv;
use super::quantized::dequantize_row;
use super::quantized::fast::{self as qfast, ActQuant, Q8Act};
use super::Kernels;
use super::{check_len, embedding_rows, mul_dims, KernelError, LinearArgs, WeightRef};
use crate::ir::WeightLayout;
use crate::pool::ThreadPool;
use std::cell::RefCell;

impl From<crate::ir::RopeScaling> for RopeScaling {
    fn from(s: crate::ir::RopeScaling) -> Self {
        match s {
            crate::ir::RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => RopeScaling::Llama3 {
                factor: factor as f32,
                low_freq_factor: low_freq_factor as f32,
                high_freq_factor: high_freq_factor as f32,
                original_max_position: original_context as f32,
            },
            crate::ir::RopeScaling::Linear { factor } => RopeScaling::Linear {
                factor: factor as f32,
            },
        }
    }
}

/// How quantized matmuls treat the activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatmulMode {
    /// f32 activations, weights dequantized in registers
    /// ([`qmatmul_with`](super::quantized::exact::qmatmul_with)).
    #[default]
    Exact,
    /// Activations quantized once per row into blocks of 8-bit quants and
    /// 8-bit remainders ([`qfast::Q8Act`]), and integer
    /// block dot products ([`qfast::qmatmul_fast_with`]) for the weight dtypes
    /// [`qfast::supports`] (every block type but Q2_K); single-row products over F32/F16/BF16 weights use
    /// [`gemv::gemv_at`] (exact arithmetic, another summation order); other
    /// cases use the exact kernels.
    Fast,
    /// As `Fast`, with 8-bit activations alone ([`ActQuant::Plain`]: no
    /// remainder, half the integer work of the decode kernels): for a
    /// speculative draft model, whose guesses do not affect the output.
    Draft,
}

impl MatmulMode {
    /// How the fast path quantizes activations in this mode (`None`: it
    /// does not run).
    pub fn act_quant(self) -> Option<ActQuant> {
        match self {
            MatmulMode::Exact => None,
            MatmulMode::Fast => Some(ActQuant::Remainder),
            MatmulMode::Draft => Some(ActQuant::Plain),
        }
    }
}

thread_local! {
    /// Quantized-activation scratch of the fast path; grows to the largest
    /// [`qfast::scratch_len_for`] seen on this thread and is then reused (no
    /// allocation per call).
    static ACT_SCRATCH: RefCell<Vec<Q8Act>> = const { RefCell::new(Vec::new()) };
    /// GGUF rows unpacked from an x8 weight for a kernel that reads rows.
    static ROWS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on `w` with its rows one after another: `w` itself, or for an
/// x8 weight of `rows` rows the rows unpacked into a per-thread buffer
/// (only when a kernel other than the fast path reads an x8 weight, e.g.
/// exact mode switched on after the weights were interleaved).
fn with_gguf_rows<R>(
    op: &'static str,
    w: WeightRef<'_>,
    rows: usize,
    f: impl FnOnce(WeightRef<'_>) -> Result<R, KernelError>,
) -> Result<R, KernelError> {
    if w.layout == WeightLayout::Rows {
        return f(w);
    }
    if rows == 0 || !w.bytes.len().is_multiple_of(rows) || !rows.is_multiple_of(qfast::x8::G) {
        return Err(KernelError::Invalid {
            op,
            what: "x8 weights need rows in whole groups of 8",
        });
    }
    let row_bytes = w.bytes.len() / rows;
    ROWS.with(|cell| {
        let mut buf = cell.borrow_mut();
        buf.resize(w.bytes.len(), 0);
        qfast::x8::unpack_rows(w.dtype, w.bytes, row_bytes, 0, rows, &mut buf);
        f(WeightRef::new(w.dtype, &buf))
    })
}

impl Kernels {
    /// `y = x·Wᵀ` for any weight dtype in the given mode, with this
    /// table's kernels.
    pub fn matmul_any(
        &self,
        pool: &ThreadPool,
        a: LinearArgs<'_>,
        y: &mut [f32],
        mode: MatmulMode,
    ) -> Result<(), KernelError> {
        let (s, k, w, n) = (a.s, a.k, a.w, a.n);
        if w.dtype == crate::ir::DType::BF16Z {
            // Exact in both modes, as for plain bf16.
            return (self.bf16z_matmul)(pool, a, y);
        }
        let quant = mode.act_quant().filter(|_| qfast::supports(w.dtype));
        let fast = quant.is_some();
        if w.layout == WeightLayout::X8 && !fast {
            return with_gguf_rows("matmul", w, n, |w| {
                self.matmul_any(pool, a.with_w(w), y, mode)
            });
        }
        if let Some(quant) = quant {
            if let Some(need) = (self.qfast_scratch_len)(w.dtype, s, k) {
                return ACT_SCRATCH.with(|cell| {
                    let mut scratch = cell.borrow_mut();
                    if scratch.len() < need {
                        scratch.resize(need, Q8Act::default());
                    }
                    (self.qmatmul_fast)(pool, a, y, &mut scratch, quant)
                });
            }
            if w.layout == WeightLayout::X8 {
                return with_gguf_rows("matmul", w, n, |w| {
                    self.matmul_any(pool, a.with_w(w), y, mode)
                });
            }
        }
        if mode != MatmulMode::Exact && s == 1 && gemv::supports(w.dtype) {
            return (self.gemv)(pool, a, y);
        }
        if w.dtype.is_quantized() {
            (self.qmatmul)(pool, a, y)
        } else {
            (self.matmul)(pool, a, y)
        }
    }
}

/// Embedding rows for any table dtype (quantized rows are dequantized).
pub fn embedding_any(
    table: WeightRef<'_>,
    vocab: usize,
    dim: usize,
    ids: &[i32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "embedding";
    // BF16Z has blocks (of bf16 values) but is read by `embedding_rows`.
    if !table.dtype.is_quantized() || table.dtype == crate::ir::DType::BF16Z {
        return embedding_rows(table, vocab, dim, ids, out);
    }
    let row_bytes = table.dtype.bytes_for(dim).ok_or(KernelError::Invalid {
        op: OP,
        what: "dim is not a whole number of quantization blocks",
    })?;
    check_len(
        OP,
        "table bytes",
        mul_dims(OP, "table size overflows", vocab, row_bytes)?,
        table.bytes.len(),
    )?;
    check_len(
        OP,
        "out elements",
        mul_dims(OP, "ids*dim overflows", ids.len(), dim)?,
        out.len(),
    )?;
    for (index, (&id, o)) in ids.iter().zip(out.chunks_exact_mut(dim.max(1))).enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(KernelError::IdOutOfRange {
                op: OP,
                id: id.into(),
                index,
                rows: vocab,
            });
        }
        let r = id as usize * row_bytes;
        let dequant = |row: &[u8], o: &mut [f32]| dequantize_row(table.dtype, row, o);
        let done = if table.layout == WeightLayout::X8 {
            // One row of an x8 table (a tied embedding stored for the output
            // head), unpacked into the per-thread buffer (no allocation per step).
            ROWS.with(|cell| {
                let mut buf = cell.borrow_mut();
                buf.resize(row_bytes, 0);
                let id = id as usize;
                qfast::x8::unpack_rows(table.dtype, table.bytes, row_bytes, id, id + 1, &mut buf);
                dequant(&buf, o)
            })
        } else {
            dequant(&table.bytes[r..r + row_bytes], o)
        };
        done.map_err(|_| KernelError::Invalid {
            op: OP,
            what: "bad quantized row",
        })?;
    }
    Ok(())
}

/// Fills `out` (`[s, head_dim/2, 2]`) with `(cos, sin)` of `p * freq_i`
/// for each token's position `p`, with the same f32 arithmetic as Meta's
/// `precompute_freqs_cis`.
pub fn rope_fill_freqs(
    out: &mut [f32],
    positions: &[i32],
    head_dim: usize,
    theta: f32,
    scaling: Option<crate::ir::RopeScaling>,
) -> Result<(), KernelError> {
    let half = head_dim / 2;
    check_len(
        "rope_freqs",
        "out elements",
        positions.len() * half * 2,
        out.len(),
    )?;
    let scaling = scaling.map(RopeScaling::from);
    for i in 0..half {
        let f = rope_freq(i, head_dim, theta, scaling);
        for (t, &p) in positions.iter().enumerate() {
            let c = num_complex::Complex32::from_polar(1.0, p as f32 * f);
            out[(t * half + i) * 2] = c.re;
            out[(t * half + i) * 2 + 1] = c.im;
        }
    }
    Ok(())
}

/// Rotates `x` (`[s, heads, head_dim]`) in place by `freqs` (`[s, head_dim/2, 2]`).
pub fn rope_apply_freqs(
    x: &mut [f32],
    s: usize,
    heads: usize,
    head_dim: usize,
    freqs: &[f32],
) -> Result<(), KernelError> {
    let half = head_dim / 2;
    check_len("rope", "x elements", s * heads * head_dim, x.len())?;
    check_len("rope", "freqs elements", s * half * 2, freqs.len())?;
    for (t, tok) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        let f = &freqs[t * half * 2..(t + 1) * half * 2];
        for head in tok.chunks_exact_mut(head_dim) {
            for (pair, cs) in head.chunks_exact_mut(2).zip(f.chunks_exact(2)) {
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * cs[0] - b * cs[1];
                pair[1] = a * cs[1] + b * cs[0];
            }
        }
    }
    Ok(())
}

/// `x = silu(x)`.
pub fn silu_inplace(x: &mut [f32]) {
    for v in x {
        *v = super::elementwise::silu_f32(*v);
    }
}

/// `a *= b` (same shapes).
pub fn mul_inplace(a: &mut [f32], b: &[f32]) -> Result<(), KernelError> {
    check_len("mul", "b elements", a.len(), b.len())?;
    for (x, &y) in a.iter_mut().zip(b) {
        *x *= y;
    }
    Ok(())
}

/// `x[r, d] *= v[d]`.
pub fn mul_broadcast_inplace(x: &mut [f32], v: &[f32]) -> Result<(), KernelError> {
    if v.is_empty() || !x.len().is_multiple_of(v.len()) {
        return Err(KernelError::Shape {
            op: "mul_broadcast",
            what: "x elements (multiple of vector length)",
            expected: v.len(),
            actual: x.len(),
        });
    }
    for row in x.chunks_exact_mut(v.len()) {
        for (a, &b) in row.iter_mut().zip(v) {
            *a *= b;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::elementwise::rope::rope_reference;

    #[test]
    fn per_step_rope_matches_reference() {
        let (s, h, d, pos) = (3, 2, 8, 5);
        let x: Vec<f32> = (0..s * h * d).map(|i| (i as f32 * 0.37).sin()).collect();
        for scaling in [None, Some(crate::ir::RopeScaling::LLAMA3_1)] {
            let mut want = x.clone();
            rope_reference(&mut want, s, h, d, pos, 500000.0, scaling.map(Into::into)).unwrap();
            let mut f = vec![0f32; s * d];
            let positions: Vec<i32> = (pos as i32..(pos + s) as i32).collect();
            rope_fill_freqs(&mut f, &positions, d, 500000.0, scaling).unwrap();
            let mut got = x.clone();
            rope_apply_freqs(&mut got, s, h, d, &f).unwrap();
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-6, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn table_rows_are_the_per_token_angles() {
        use crate::kernels::RopeTable;
        let positions = [0, 17, 3, 3, 2047, 1000];
        for (scaling, d) in [(None, 64), (Some(crate::ir::RopeScaling::LLAMA3_1), 128)] {
            let mut a = vec![0f32; positions.len() * d];
            rope_fill_freqs(&mut a, &positions, d, 500000.0, scaling).unwrap();
            let t = RopeTable::new(d, 500000.0, scaling.map(Into::into), 2048).unwrap();
            let mut b = vec![0f32; a.len()];
            t.gather(&positions, &mut b).unwrap();
            assert_eq!(a, b);
            assert!(t.gather(&[2048], &mut b[..d]).is_err());
            assert!(t.gather(&[-1], &mut b[..d]).is_err());
        }
    }
}
