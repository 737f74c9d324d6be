//! Compute kernels, separate from scheduling.
//!
//! One directory per family, each with its scalar reference and its SIMD
//! variants side by side; every family's entry points take one
//! instruction-set level, [`Isa`], and [`Kernels`] binds them per level into
//! one table, resolved once per process (the CPU's best, cappable with
//! `LLAMA_GRAPH_ISA`) and held by the executor:
//!
//! | family | what |
//! | --- | --- |
//! | [`matmul`](mod@matmul) | linear layers over f32/f16/bf16 weights: tiled GEMM (`avx2`, `avx512`, `bf16dot`), single-token GEMV (`gemv`), and the lossless `bf16z` weight format |
//! | [`quantized`] | block-quantized weights (GGUF formats): block layouts and dequantization (`blocks`), the exact f32-activation path (`exact`), the integer fast path (`fast`) |
//! | [`attention`] | over the paged KV pool: reference scores/softmax/values and the fused, batch-invariant kernel (`paged`: tiled items for prefill, key-split items for decode) |
//! | [`elementwise`] | add, mul, SiLU/SwiGLU, RMSNorm (`norm`), RoPE (`rope`) |
//! | [`embedding`], [`kv`] | token-row gather; the KV pool's layout, the step's sequence table, KV writes |
//! | [`table`], [`dispatch`] | the table of entry points per level; the forms the executor calls: dispatch on weight dtype and mode |
//!
//! Conventions: row-major; activations are `f32`; weights are raw
//! little-endian bytes in their stored dtype (see [`WeightRef`]), read with
//! unaligned loads. Kernels never allocate: scratch space is passed in by the
//! caller, sized by the `*_scratch_len` functions. Parallel kernels take a
//! [`ThreadPool`](crate::pool::ThreadPool).

pub mod attention;
pub mod dispatch;
pub mod elementwise;
pub mod embedding;
pub mod isa;
pub mod kv;
pub mod matmul;
pub mod quantized;
pub(crate) mod simd;
pub mod table;
#[cfg(test)]
pub(crate) mod testutil;

pub use attention::{
    attention_paged, attn_scores, attn_scores_windowed, attn_values, softmax_rows, AttnWork,
    TILED_MIN_S,
};
pub use dispatch::{embedding_any, MatmulMode};
pub use elementwise::norm::rmsnorm;
pub use elementwise::rope::{rope_reference, RopeScaling, RopeTable};
pub use elementwise::{
    add, add_inplace, argmax, gelu_tanh_inplace, mul, mul_broadcast_rows, scale_inplace, silu,
    swiglu,
};
pub use embedding::embedding_rows;
pub use isa::Isa;
pub use kv::{kv_write_rows, CacheType, KvGeom, KvHalf, KvStore, KvView, SeqSpan, StepSeqs};
pub use matmul::{gemv, matmul_with, Epilogue};
pub use quantized::dequantize_row;
pub use table::Kernels;

use crate::ir::{DType, WeightLayout};
use thiserror::Error;

/// Work chunks per thread of a product of a few tokens (decode steps):
/// one contiguous range of weight rows each. Each chunk restarts the
/// hardware prefetchers' streams and waits out a memory latency before
/// they run ahead, so on a small model every extra chunk costs: SmolLM2
/// decode at 2 threads on Zen 5 (`op_profile`, interleaved) was 7-38%
/// faster with 1 chunk per thread than with 4, on Q4_1, Q8_0 and Q4_K_M
/// files and at the AVX2 level too; 8 per thread was slower still. Used
/// by the quantized products (`quantized::fast`) and the float
/// single-token product (`matmul::gemv`).
pub const DECODE_CHUNKS_PER_THREAD: usize = 1;

/// Errors from kernel argument checks. Every message names the operation
/// and what was wrong.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    #[error("{op}: {what}: expected {expected}, got {actual}")]
    Shape {
        op: &'static str,
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("{op}: unsupported dtype {dtype}")]
    DType { op: &'static str, dtype: DType },
    #[error("{op}: token id {id} at index {index} is out of range for {rows} rows")]
    IdOutOfRange {
        op: &'static str,
        id: i64,
        index: usize,
        rows: usize,
    },
    #[error("kv_write: positions {pos}..{pos}+{len} exceed cache capacity {capacity}")]
    CacheOverflow {
        pos: usize,
        len: usize,
        capacity: usize,
    },
    #[error("{op}: invalid argument: {what}")]
    Invalid {
        op: &'static str,
        what: &'static str,
    },
}

impl From<KernelError> for crate::Error {
    fn from(e: KernelError) -> Self {
        crate::Error::msg(e.to_string())
    }
}

pub(crate) fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    actual: usize,
) -> Result<(), KernelError> {
    if expected == actual {
        Ok(())
    } else {
        Err(KernelError::Shape {
            op,
            what,
            expected,
            actual,
        })
    }
}

/// `a * b` or a shape error naming `what` when it overflows.
pub(crate) fn mul_dims(
    op: &'static str,
    what: &'static str,
    a: usize,
    b: usize,
) -> Result<usize, KernelError> {
    a.checked_mul(b).ok_or(KernelError::Invalid { op, what })
}

/// The operands of a linear layer `y = x·Wᵀ`, what every linear entry point
/// takes (the [`table`]'s `LinearFn`s, [`matmul_with`], the quantized
/// paths): `x` `[s, k]` f32, `W` `[n, k]` in its stored dtype, and the
/// epilogue applied to the products. The output `y` (`[s, n]`, or `[s, n/2]`
/// for [`Epilogue::SwiGlu`]) is passed beside it.
#[derive(Clone, Copy, Debug)]
pub struct LinearArgs<'a> {
    pub x: &'a [f32],
    pub s: usize,
    pub k: usize,
    pub w: WeightRef<'a>,
    pub n: usize,
    pub epilogue: Epilogue<'a>,
}

impl<'a> LinearArgs<'a> {
    /// The operands in their usual order.
    pub fn new(
        x: &'a [f32],
        s: usize,
        k: usize,
        w: WeightRef<'a>,
        n: usize,
        epilogue: Epilogue<'a>,
    ) -> Self {
        LinearArgs {
            x,
            s,
            k,
            w,
            n,
            epilogue,
        }
    }

    /// The same operands over other weights (e.g. a repacked copy).
    pub fn with_w(self, w: WeightRef<'a>) -> Self {
        LinearArgs { w, ..self }
    }
}

/// Checks the operands `a` of a linear layer and its output `y` (`[s, n]`,
/// or `[s, n/2]` for SwiGLU) and returns (bytes per weight row, output
/// columns).
pub(crate) fn check_linear(
    op: &'static str,
    a: &LinearArgs<'_>,
    y: &[f32],
) -> Result<(usize, usize), KernelError> {
    let (x, s, k, w, n) = (a.x, a.s, a.k, a.w, a.n);
    let row_bytes = w.dtype.bytes_for(k).ok_or(KernelError::Invalid {
        op,
        what: "k is not a whole number of blocks of the weight dtype",
    })?;
    check_len(
        op,
        "x elements (s*k)",
        mul_dims(op, "s*k overflows", s, k)?,
        x.len(),
    )?;
    check_len(
        op,
        "weight bytes",
        mul_dims(op, "n*row bytes overflows", n, row_bytes)?,
        w.bytes.len(),
    )?;
    let n_out = match a.epilogue {
        Epilogue::SwiGlu if n.is_multiple_of(2) => n / 2,
        Epilogue::SwiGlu => {
            return Err(KernelError::Invalid {
                op,
                what: "SwiGlu needs an even number of weight rows",
            })
        }
        _ => n,
    };
    check_len(
        op,
        "y elements",
        mul_dims(op, "s*n overflows", s, n_out)?,
        y.len(),
    )?;
    if let Epilogue::AddResidual(r) = a.epilogue {
        check_len(op, "residual elements", y.len(), r.len())?;
    }
    Ok((row_bytes, n_out))
}

/// `v` stored as a plain weight dtype (F32, F16, BF16: little-endian,
/// rounded to nearest), or `None` for other dtypes. For tests, benches and
/// weights built at run time.
pub fn plain_bytes(v: &[f32], dtype: DType) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(v.len() * 4);
    for &x in v {
        match dtype {
            DType::F32 => out.extend_from_slice(&x.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
            _ => return None,
        }
    }
    Some(out)
}

/// A borrowed tensor of weights in its stored dtype (F32, F16 or BF16,
/// little-endian, no alignment requirement).
/// Rows are stored one after another unless `layout` says otherwise
/// (only the fast quantized path reads [`WeightLayout::X8`] directly;
/// [`dispatch`] hands every other kernel GGUF rows).
#[derive(Clone, Copy, Debug)]
pub struct WeightRef<'a> {
    pub dtype: DType,
    pub bytes: &'a [u8],
    pub layout: WeightLayout,
}

impl<'a> WeightRef<'a> {
    pub fn new(dtype: DType, bytes: &'a [u8]) -> Self {
        WeightRef {
            dtype,
            bytes,
            layout: WeightLayout::Rows,
        }
    }
    /// The same bytes, read as stored in `layout`.
    pub fn with_layout(self, layout: WeightLayout) -> Self {
        WeightRef { layout, ..self }
    }
    /// Wraps f32 values (tests, small tensors built at run time).
    pub fn from_f32(v: &'a [f32]) -> Self {
        // SAFETY: any f32 slice is a valid byte slice of 4x the length.
        let bytes = unsafe {
            std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v))
        };
        WeightRef {
            dtype: DType::F32,
            bytes,
            layout: WeightLayout::Rows,
        }
    }
    /// Element size in bytes, or an error for dtypes plain kernels do not read.
    pub(crate) fn elem_size(&self, op: &'static str) -> Result<usize, KernelError> {
        match self.dtype {
            DType::F32 => Ok(4),
            DType::F16 | DType::BF16 => Ok(2),
            dtype => Err(KernelError::DType { op, dtype }),
        }
    }
    /// Number of elements (bytes / element size).
    pub(crate) fn check_elems(&self, op: &'static str, expected: usize) -> Result<(), KernelError> {
        let es = self.elem_size(op)?;
        let want = mul_dims(op, "weight byte size overflows", expected, es)?;
        check_len(op, "weight bytes", want, self.bytes.len())
    }
    /// Converts elements `start..start+out.len()` to f32. Bounds are the
    /// caller's responsibility (checked slices; panics only on a bug).
    #[inline]
    pub(crate) fn read_into(&self, start: usize, out: &mut [f32]) {
        match self.dtype {
            DType::F32 => {
                let b = &self.bytes[start * 4..(start + out.len()) * 4];
                for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            DType::F16 => {
                let b = &self.bytes[start * 2..(start + out.len()) * 2];
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            DType::BF16 => {
                let b = &self.bytes[start * 2..(start + out.len()) * 2];
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            _ => unreachable!("dtype checked by elem_size"),
        }
    }
}

#[inline]
pub(crate) fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

#[inline]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}
