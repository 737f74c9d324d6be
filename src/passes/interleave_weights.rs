//! The `interleave_weights` pass: every packed quantized weight -> rows interleaved in groups of 8 (x8), so decode kernels need no per-row lane sums (same arithmetic, bit for bit).

use super::PassStats;
use crate::ir::{Graph, GraphError, Op, WeightLayout};

/// `interleave_weights`: every packed block-quantized weight the fast path
/// reads in the x8 layout is stored that way (rows interleaved in groups of
/// 8; see [`crate::kernels::quantized::fast::x8`]).
///
/// A decode step multiplies every weight row with one token. Stored row by
/// row, each row's block products end in a sum across the vector's lanes and
/// each row's scales are gathered one by one; in the x8 layout a vector
/// holds the same word of 8 rows, so lane `r` accumulates row `r` and the
/// scales of 8 rows are one vector. The arithmetic is the same integer sums
/// and the same f32 steps, so every output is bit for bit what the row-major
/// kernels give. Binding repacks the weights once, as it copies them into the
/// arena. Weights whose row count (or, for a SwiGLU matmul's `w13`, half of
/// it) is not a multiple of 8 stay as they are, as do dtypes without an x8
/// layout. Sessions in exact mode skip this pass (their kernels read rows).
pub fn interleave_weights(g: &mut Graph) -> Result<PassStats, GraphError> {
    use crate::kernels::quantized::fast::x8;
    let names: Vec<String> = g.packed().map(|p| p.name.clone()).collect();
    let mut n = 0;
    for name in names {
        let Some(id) = g.find(&name) else { continue };
        let meta = &g.node(id).meta;
        let Some((rows, cols)) = (match meta.shape.dims() {
            [r, c] => r.as_const().zip(c.as_const()),
            _ => None,
        }) else {
            continue;
        };
        let Some(p) = g.packed_weight(&name) else {
            continue;
        };
        if p.stored_as.is_some()
            || p.layout != WeightLayout::Rows
            || !x8::supports(meta.dtype, rows, cols)
        {
            continue;
        }
        // The SwiGLU epilogue reads the gate and up halves as two matrices.
        let halves = g
            .users(id)
            .into_iter()
            .any(|u| matches!(g.node(u).op, Op::MatMulSwiGlu));
        if halves && !(rows / 2).is_multiple_of(x8::G) {
            continue;
        }
        if let Some(p) = g.packed_weight_mut(&name) {
            p.layout = WeightLayout::X8;
        }
        n += 1;
    }
    Ok(PassStats { rewrites: n })
}
