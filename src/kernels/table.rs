//! The one kernel dispatch: a table of kernel entry points per
//! instruction-set level, resolved once per process.
//!
//! [`Kernels::current`] is the only place that asks which level the kernels
//! run at ([`Isa::current`]: the CPU's best, capped by `LLAMA_GRAPH_ISA`);
//! it returns the table of that level, a `&'static` filled at compile time.
//! The executor holds it and calls through it; nothing below asks the CPU
//! again: every kernel family's entry point takes its level as an argument
//! (the `*_with` / `*_at` functions), and the table binds each level to
//! them. Tests and benchmarks that compare levels take
//! [`Kernels::for_level`] for each of [`Isa::supported_levels`].
//!
//! See docs/design/kernel-dispatch.md for the convention a new kernel
//! follows.

use super::attention::{attention_paged, AttnWork};
use super::isa::Isa;
use super::kv::{KvGeom, KvView, StepSeqs};
use super::matmul::{self, bf16z, gemv};
use super::quantized::exact::qmatmul_with;
use super::quantized::fast::{self as qfast, ActQuant, Q8Act};
use super::{KernelError, LinearArgs};
use crate::ir::DType;
use crate::pool::ThreadPool;

/// `y = x·Wᵀ` with an epilogue: `(pool, operands, y)`.
pub type LinearFn = fn(&ThreadPool, LinearArgs<'_>, &mut [f32]) -> Result<(), KernelError>;

/// One activation row: a [`LinearFn`] whose operands have `s = 1`.
pub type GemvFn = LinearFn;

/// The quantized fast path: a [`LinearFn`] plus activation scratch and
/// how the activations are quantized.
pub type QFastFn =
    fn(&ThreadPool, LinearArgs<'_>, &mut [f32], &mut [Q8Act], ActQuant) -> Result<(), KernelError>;

/// The bf16z product: a [`LinearFn`] whose weights are bf16z bytes.
pub type Bf16zFn = LinearFn;

/// Fused paged attention of a step (see [`attention_paged`]).
pub type AttentionFn = fn(
    &ThreadPool,
    &[f32],
    KvView<'_>,
    KvView<'_>,
    &KvGeom,
    usize,
    Option<usize>,
    &StepSeqs<'_>,
    &mut [f32],
    &mut AttnWork,
) -> Result<(), KernelError>;

/// The kernel entry points of one instruction-set level.
pub struct Kernels {
    isa: Isa,
    /// Tiled GEMM over F32/F16/BF16 weights (one row goes to `gemv`).
    pub matmul: LinearFn,
    /// As `matmul`, with bf16-rounded activations and `VDPBF16PS` for BF16
    /// weights where the CPU has AVX-512 BF16 (opt-in; otherwise `matmul`).
    pub matmul_bf16_dot: LinearFn,
    /// One activation row over F32/F16/BF16 weights.
    pub gemv: GemvFn,
    /// Block-quantized weights, f32 activations (exact).
    pub qmatmul: LinearFn,
    /// Block-quantized weights, quantized activations.
    pub qmatmul_fast: QFastFn,
    /// Activation scratch `qmatmul_fast` needs, in blocks (`None`: the
    /// fast path does not take this dtype at this level).
    pub qfast_scratch_len: fn(DType, usize, usize) -> Option<usize>,
    /// The lossless bf16z weight format.
    pub bf16z_matmul: Bf16zFn,
    /// Fused attention over the paged KV pool.
    pub attention: AttentionFn,
}

/// The table of `$isa`: each entry point bound to that level.
macro_rules! level_table {
    ($isa:expr) => {
        Kernels {
            isa: $isa,
            matmul: |p, a, y| matmul::matmul_with(p, $isa, a, y),
            matmul_bf16_dot: |p, a, y| matmul::matmul_bf16_dot(p, $isa, a, y),
            gemv: |p, a, y| gemv::gemv_at($isa, p, a, y),
            qmatmul: |p, a, y| qmatmul_with($isa, p, a, y),
            qmatmul_fast: |p, a, y, scr, q| qfast::qmatmul_fast_with($isa, q, p, a, y, scr),
            qfast_scratch_len: |dtype, s, k| qfast::scratch_len_for($isa, dtype, s, k),
            bf16z_matmul: |p, a, y| {
                bf16z::matmul_at($isa, p, a.x, a.s, a.k, a.w.bytes, a.n, a.epilogue, y)
            },
            attention: |p, q, kc, vc, g, r, w, seqs, out, work| {
                attention_paged(p, $isa, q, kc, vc, g, r, w, seqs, out, work)
            },
        }
    };
}

/// One table per level, in the order of [`Isa::ALL`].
static LEVELS: [Kernels; 4] = [
    level_table!(Isa::Scalar),
    level_table!(Isa::Avx2),
    level_table!(Isa::Avx512),
    level_table!(Isa::Avx512Vnni),
];

impl Kernels {
    /// The table the kernels run with: the level resolved once per process
    /// (the CPU's best, capped by `LLAMA_GRAPH_ISA`). The only caller of
    /// [`Isa::current`].
    pub fn current() -> &'static Kernels {
        Kernels::for_level(Isa::current())
    }

    /// The table of `isa`, lowered to what this CPU supports (tests and
    /// benchmarks that compare levels).
    pub fn for_level(isa: Isa) -> &'static Kernels {
        let isa = isa.min(Isa::detect());
        let t = &LEVELS[Isa::ALL.iter().position(|&l| l == isa).unwrap_or(0)];
        debug_assert_eq!(t.isa, isa);
        t
    }

    /// The level these entry points run at.
    pub fn isa(&self) -> Isa {
        self.isa
    }
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels").field("isa", &self.isa).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_table_per_level_in_order() {
        for (t, l) in LEVELS.iter().zip(Isa::ALL) {
            assert_eq!(t.isa(), l);
        }
        for l in Isa::supported_levels() {
            assert_eq!(Kernels::for_level(l).isa(), l);
        }
        assert_eq!(Kernels::for_level(Isa::Avx512Vnni).isa(), Isa::detect());
        assert!(Kernels::current().isa() <= Isa::detect());
    }
}
